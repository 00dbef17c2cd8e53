/*
 * Creates a domain under a domain id of the caller's choosing, from the configuration
 * `xl create -n` prints (JSON), and unpauses it: what a toolstack needs to bring a
 * driver domain back under the id its guests' front ends are bound to (their grants name
 * it, and their event channels wait unbound for it). `xl` 4.17 has no way to choose the
 * id; libxl has (LIBXL_HAVE_CREATEINFO_DOMID).
 *
 *   create-domid DOMID CONFIG.json      prints the new domain's id
 *
 * The interop run's dom0 builds it against Debian's libxen-dev (run.sh) and runs it in
 * its fifth round (dom0-run). It retries while the id is still held by the domain
 * destroyed before (a dying domain keeps its id until every page is let go).
 *
 * libxl also refuses an id destroyed in the last minute ("domain id recently used"): it
 * keeps a history of them (XEN_RUN_DIR/domid-history, one "seconds domid" line each) so
 * that nothing that still names the old domain mistakes a new one for it. Here that is
 * the point: the guests name the old driver domain, and the new one is to take its place.
 * So the id asked for is taken out of the history, and no other.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <libxl.h>
#include <xentoollog.h>

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    char *buf = NULL;
    size_t len = 0, cap = 0;

    if (!f)
        return NULL;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = (cap ? cap * 2 : 65536);
            buf = realloc(buf, cap);
            if (!buf) {
                fclose(f);
                return NULL;
            }
        }
        size_t n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0)
            break;
    }
    fclose(f);
    buf[len] = '\0';
    return buf;
}

/* Takes `domid` out of libxl's history of recently destroyed ids (see above). */
static void forget_recent(uint32_t domid)
{
    static const char *paths[] = {"/run/xen/domid-history", "/var/run/xen/domid-history"};

    for (size_t p = 0; p < sizeof(paths) / sizeof(paths[0]); p++) {
        char *all = slurp(paths[p]);
        if (!all)
            continue;
        FILE *f = fopen(paths[p], "w");
        if (!f) {
            free(all);
            continue;
        }
        for (char *line = strtok(all, "\n"); line; line = strtok(NULL, "\n")) {
            unsigned long sec;
            unsigned int id;
            if (sscanf(line, "%lu %u", &sec, &id) == 2 && id == domid)
                continue;
            fprintf(f, "%s\n", line);
        }
        fclose(f);
        free(all);
        return;
    }
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s DOMID CONFIG.json\n", argv[0]);
        return 2;
    }
    char *end;
    unsigned long want = strtoul(argv[1], &end, 10);
    if (*end || want == 0 || want >= 0x7FF0 /* DOMID_FIRST_RESERVED */) {
        fprintf(stderr, "%s: not a domain id a guest can have\n", argv[1]);
        return 2;
    }
    char *json = slurp(argv[2]);
    if (!json) {
        fprintf(stderr, "%s: %s\n", argv[2], strerror(errno));
        return 1;
    }
    xentoollog_logger_stdiostream *lg =
        xtl_createlogger_stdiostream(stderr, XTL_ERROR, 0);
    libxl_ctx *ctx = NULL;
    if (!lg || libxl_ctx_alloc(&ctx, LIBXL_VERSION, 0, (xentoollog_logger *)lg)) {
        fprintf(stderr, "no libxl context\n");
        return 1;
    }
    int rc = 1;
    for (int tries = 0; tries < 60; tries++) {
        libxl_domain_config cfg;
        libxl_domain_config_init(&cfg);
        if (libxl_domain_config_from_json(ctx, &cfg, json)) {
            fprintf(stderr, "%s: not a domain configuration\n", argv[2]);
            libxl_domain_config_dispose(&cfg);
            break;
        }
        cfg.c_info.domid = (uint32_t)want;
        forget_recent((uint32_t)want);
        uint32_t domid = INVALID_DOMID;
        rc = libxl_domain_create_new(ctx, &cfg, &domid, NULL, NULL);
        libxl_domain_config_dispose(&cfg);
        if (rc == 0) {
            rc = libxl_domain_unpause(ctx, domid, NULL);
            if (rc == 0)
                printf("%u\n", domid);
            break;
        }
        /* The id still held by the domain before it: wait, and try again. */
        sleep(1);
    }
    libxl_ctx_free(ctx);
    xtl_logger_destroy((xentoollog_logger *)lg);
    free(json);
    return rc ? 1 : 0;
}
