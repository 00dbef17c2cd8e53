#!/usr/bin/env bash
# The Xen interop run: boots Debian's Xen 4.17 under QEMU's TCG with a Debian dom0,
# which starts one unmodified Linux domU (netfront and blkfront) against a back end
# and checks what crosses: ping, iperf3 both ways, a filesystem written and read back.
#
#   BACKEND=linux   Linux's own xen-netback and xen-blkback serve the domU (the
#                   reference: what Linux's front ends negotiate with Linux's back ends)
#   BACKEND=pvio    `pvio backend` in dom0's user space serves them, as its systemd unit
#                   (dist/pvio-backend.service) runs it; round 3 restarts it twice
#   BACKEND=pvio-drvdom
#                   `pvio backend` in a driver domain (a second domU, drvdom-plan) serves
#                   them: the guest's vif and disk name it (backend=drvdom); its own uplink
#                   and disk are served by dom0's Linux back ends; round 3 restarts it
#                   twice there
#   DOMU_VCPUS=N    the domU's vCPUs (1; blkfront takes one queue a vCPU)
#   PVIO_ARGS=...   more options for `pvio backend` in dom0 (--sync-disk, say)
#   PERSISTENT_GRANTS=N
#                   grants each vbd queue keeps mapped, told to the back end in dom0,
#                   either alike (pvio's --persistent-grants, Linux blkback's
#                   max_persistent_grants; both 1056 unless told); refused with pvio-drvdom
#   QEMU_CPU=...    the emulated CPU (default below)
#
# usage: scripts/xen-interop/run.sh [OUT_DIR]     (OUT_DIR defaults to results/xen-interop)
# Needs root (debootstrap, for the cached images). Minutes per boot: TCG is slow.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
backend="${BACKEND:-linux}"
out="${1:-$repo/results/xen-interop}/$backend"
timeout_s="${TIMEOUT_S:-1800}"
images="$("$here/images.sh" | tail -n1)"

mkdir -p "$out"
ex="$(mktemp -d)"
trap 'rm -rf "$ex"' EXIT
mkdir -p "$ex/x"

# What dom0 runs, what the domU runs, and (BACKEND=pvio) pvio itself.
cp "$here/dom0-run" "$ex/x/run-dom0"
cp "$here/payload-server.py" "$ex/x/payload-server.py"
echo "$backend" >"$ex/x/backend"
pvio_args="${PVIO_ARGS:-}"
if [[ -n "${PERSISTENT_GRANTS:-}" ]]; then
    [[ "$PERSISTENT_GRANTS" =~ ^[0-9]+$ ]] || { echo "PERSISTENT_GRANTS: a number" >&2; exit 2; }
    # Told to dom0's back end only: a driver domain's pvio would not hear of it.
    [[ "$backend" != pvio-drvdom ]] || { echo "PERSISTENT_GRANTS: for BACKEND=pvio or linux" >&2; exit 2; }
    pvio_args="$pvio_args --persistent-grants $PERSISTENT_GRANTS"
    echo "$PERSISTENT_GRANTS" >"$ex/x/persistent-grants"
fi
echo "$pvio_args" >"$ex/x/pvio-args"
# The domU's vCPUs (dom0-run says why one by default).
echo "${DOMU_VCPUS:-1}" >"$ex/x/domu-vcpus"
stage="$ex/plan"
mkdir -p "$stage"
install -m 0755 "$here/domu-plan" "$stage/plan"
# Module parameters the domU's /init applies: Linux's blkfront asks for a ring of
# 2^4 pages only when told to (its default is one page), and each front end is asked for
# two queues (by default, one a vCPU; netfront takes two, blkfront no more than its vCPUs
# online, here one).
mkdir -p "$stage/etc"
printf 'xen-blkfront.ko max_ring_page_order=4 max_queues=2\nxen-netfront.ko max_queues=2\n' >"$stage/etc/modparams"
(cd "$stage" && find . -print0 | cpio --null -o -H newc --quiet | gzip -9) >"$ex/x/plan.cpio.gz"
if [[ "$backend" == pvio* ]]; then
    # dom0 is Debian 12, like the machine this builds on: the ordinary build runs there.
    if [[ -z "${PVIO_BIN:-}" ]]; then
        (cd "$repo" && cargo build --release -p pvio >&2)
    fi
fi
case "$backend" in
pvio)
    install -m 0755 "${PVIO_BIN:-$repo/target/release/pvio}" "$ex/x/pvio"
    install -m 0644 "$repo/dist/pvio-backend.service" "$ex/x/pvio-backend.service"
    ;;
pvio-drvdom)
    # The driver domain's root is the guests' initramfs with this archive after it: its
    # plan, and pvio (without its symbols: the root lives in the domain's memory).
    drv="$ex/drvdom"
    mkdir -p "$drv/bin"
    install -m 0755 "$here/drvdom-plan" "$drv/plan"
    strip -o "$drv/bin/pvio" "${PVIO_BIN:-$repo/target/release/pvio}"
    (cd "$drv" && find . -print0 | cpio --null -o -H newc --quiet | gzip -9) >"$ex/x/drvdom-plan.cpio.gz"
    # Round 5's toolstack step: a domain created under a chosen id (libxl can, xl 4.17
    # cannot), built here against Debian 12's libxl, the same as dom0's.
    if ! command -v gcc >/dev/null || [ ! -e /usr/include/libxl.h ]; then
        apt-get install -y gcc libxen-dev >&2
    fi
    gcc -O2 -Wall -o "$ex/x/create-domid" "$here/create-domid.c" -lxenlight -lxentoollog
    ;;
esac
# The exchange disk: dom0 mounts it, runs run-dom0 and leaves its results on it.
mke2fs -q -t ext4 -L pvio-x -d "$ex/x" "$ex/x.img" 1G >&2

# dom0's root is copied per run so that a run never changes the cached image.
cp --sparse=always "$images/dom0.img" "$ex/dom0.img"

echo "booting Xen under TCG (BACKEND=$backend); console: $out/console.log" >&2
set +e
# The emulation: a thread an emulated CPU (TCG=single: both on one thread, in turn), no
# AVX, and no XSAVE: Xen and the guests keep their FPU and vector state with FXSAVE. With
# XSAVE emulated, once a driver domain ran beside the domU (three vCPUs on two emulated
# CPUs, so Xen switching vCPUs on one CPU), processes in dom0 and the domU died of
# segmentation and protection faults in libc (fio, sh, xenstore-exists), with pvio's
# back end and with Linux's, with one thread and with two; the first run without XSAVE
# passed every check (docs/results/xen-interop.md).
tcg="${TCG:-multi}"
# The serial port (Xen's console, dom0's through it) is logged to console.log and takes
# input from a socket, and QEMU's monitor listens on another: stall-watch asks dom0 and
# Xen what every task and vCPU waits on when the console goes quiet (a stalled run), by
# a path that needs neither dom0's disks nor the store, and ends the emulation after.
rm -f "$out/console.log"
"$here/stall-watch" "$out/console.log" "$ex/serial.sock" "$ex/monitor.sock" "${STALL_S:-240}" &
watch_pid=$!
# The emulated CPU offers no ERMS or FSRM: TCG runs a string move one element a step, so
# with them every copy Linux and glibc make (and pvio's) moved a byte a step, a cost no
# processor that offers ERMS has; without them all three move 8-byte words.
timeout "$timeout_s" qemu-system-x86_64 \
    -accel tcg,thread=$tcg -cpu "${QEMU_CPU:-max,-smap,-pku,-la57,-avx,-avx2,-fma,-f16c,-xsave,-erms,-fsrm}" -smp 2 -m 3G \
    -display none -no-reboot \
    -chardev "socket,id=con,path=$ex/serial.sock,server=on,wait=off,logfile=$out/console.log,logappend=on" \
    -serial chardev:con -monitor "unix:$ex/monitor.sock,server=on,wait=off" \
    -kernel "$images/xen" \
    -append "dom0_mem=1024M,max:1024M dom0_max_vcpus=1 dom0_vcpus_pin console=com1 com1=115200,8n1 loglvl=all guest_loglvl=all" \
    -initrd "$images/vmlinuz root=/dev/vda ro console=hvc0 earlyprintk=xen,$images/initrd.img" \
    -drive "file=$ex/dom0.img,if=virtio,format=raw" \
    -drive "file=$ex/x.img,if=virtio,format=raw" \
    -net none
rc=$?
kill "$watch_pid" 2>/dev/null
set -e
echo "qemu exited $rc" >&2
grep -q "stall-watch" "$out/console.log" && echo "the console went quiet: see stall-watch in $out/console.log" >&2
# Bring back what dom0 left on the exchange disk.
rm -rf "$out/x"
mkdir -p "$out/x"
debugfs -R "rdump /out $out/x" "$ex/x.img" >/dev/null 2>&1 || true
# And Xen's logs from dom0's disk (the domU's console among them), whether or not dom0
# got as far as copying them: what to read when a run stalls.
rm -rf "$out/xen-logs"
mkdir -p "$out/xen-logs"
debugfs -R "rdump /var/log/xen $out/xen-logs" "$ex/dom0.img" >/dev/null 2>&1 || true
ls "$out/x" >&2 || true

# The verdicts: the domU's checks, and each payload's hash where it started against
# where it landed.
log="$out/x/out/dom0.log"
sha() { sed -n "s/.*sha $1 \([0-9a-f]*\).*/\1/p" "$log" | head -n1; }
{
    grep -a "pvio-check" "$log" | sed 's/^.*pvio-check /pvio-check /'
    for dir in up down restart drvdom-restart; do
        case "$dir" in
        up) a=$(sha up-sent); b=$(sha up-received) ;;
        down) a=$(sha down-sent); b=$(sha down-received) ;;
        # Only BACKEND=pvio runs the restart round, and its paced stream.
        restart) [[ "$backend" == pvio* ]] || continue; a=$(sha slow-sent); b=$(sha slow-received) ;;
        # Round 5 (a driver domain's run): the same stream across the driver domain's
        # destruction and creation.
        drvdom-restart) [[ "$backend" == pvio-drvdom ]] || continue; a=$(sha slow-sent); b=$(sha slow5-received) ;;
        esac
        if [[ -n "$a" && "$a" == "$b" ]]; then
            echo "pvio-check payload-$dir ok sha256 $a at both ends"
        else
            echo "pvio-check payload-$dir FAIL sent ${a:-?} received ${b:-?}"
        fi
    done
} >"$out/checks.txt"
cat "$out/checks.txt"
# Every check every round must report, each ok, each rate above its floor: a check that
# is missing fails the run (scripts/xen-interop/verdict).
if ! "$here/verdict" "$backend" "$out/checks.txt" | tee "$out/verdict.txt"; then
    echo "xen interop ($backend): FAILED" >&2
    exit 1
fi
echo "xen interop ($backend): every check passed" >&2
