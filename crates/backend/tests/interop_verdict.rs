//! The Xen interop run's verdict (`scripts/xen-interop/verdict`) over recorded runs: the
//! committed records pass, and a run that left a check out, reported it twice, failed
//! one or carried TCP at a trickle fails. A missing result is a failure, never a pass.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The verdict's exit status and output for `backend` over `checks`.
fn verdict(backend: &str, checks: &str) -> (bool, String) {
    let f = std::env::temp_dir().join(format!(
        "pvio-verdict-{backend}-{}-{}",
        std::process::id(),
        checks.len()
    ));
    std::fs::write(&f, checks).expect("checks file");
    let o = Command::new("bash")
        .arg(repo().join("scripts/xen-interop/verdict"))
        .arg(backend)
        .arg(&f)
        .output()
        .expect("bash");
    let _ = std::fs::remove_file(&f);
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

/// The driver-domain run that the verdict holds: every round, round 5 too.
const DRVDOM_RECORD: &str = "pvio-drvdom/run-o";

fn recorded(dir: &str) -> String {
    let p = repo().join(format!("docs/results/xen-interop/{dir}/checks.txt"));
    std::fs::read_to_string(p).expect("the committed record")
}

#[test]
fn the_recorded_runs_pass_with_every_check_reported() {
    // pvio in dom0, Linux's back ends, and pvio in a driver domain (destroyed and created
    // again in its round 5).
    for (backend, dir) in [
        ("pvio", "pvio"),
        ("linux", "linux"),
        // The rates' records now (the emulated CPU without ERMS).
        ("pvio", "pvio-noerms3"),
        ("linux", "linux-noerms3"),
        ("pvio-drvdom", DRVDOM_RECORD),
    ] {
        let (ok, out) = verdict(backend, &recorded(dir));
        assert!(ok, "{dir}: {out}");
        assert!(!out.contains("FAIL"), "{dir}: {out}");
    }
}

#[test]
fn a_run_that_misses_repeats_fails_or_trickles_is_a_failed_run() {
    let pvio = recorded("pvio");
    let without = |name: &str| {
        pvio.lines()
            .filter(|l| !l.starts_with(&format!("pvio-check {name} ")))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    };
    // A round that reported nothing of one check (its domU hung, its console lost).
    for name in [
        "restart-vif",
        "restart-disk",
        "restart-takeover",
        "restart-connected",
        "served-by-pvio",
        "features",
        "fio-seqwrite",
        "disk",
        "payload-up",
        "iperf3-down",
        "flood-quiet",
        "flood-fio",
        "flood-overlap",
    ] {
        let (ok, out) = verdict("pvio", &without(name));
        assert!(!ok, "{name} missing must fail: {out}");
    }
    // pvio's round 3 is pvio's own: the Linux reference does not pass as a pvio run.
    assert!(!verdict("pvio", &recorded("linux")).0);
    // A check reported twice (a round run again) is not one round's result.
    let twice = format!(
        "{pvio}{}\n",
        pvio.lines().find(|l| l.contains(" disk ok")).expect("disk")
    );
    assert!(!verdict("pvio", &twice).0);
    // A failed check.
    let failed = pvio.replacen("pvio-check disk ok", "pvio-check disk FAIL", 1);
    assert!(!verdict("pvio", &failed).0);
    // TCP at a trickle: the up stream's receiver rate, whatever it was, made 0.4.
    let up = pvio
        .lines()
        .find(|l| l.starts_with("pvio-check iperf3-up ok"))
        .expect("iperf3-up");
    let (head, tail) = up
        .rsplit_once(" Mbits/sec receiver")
        .expect("a receiver rate");
    let (head, _rate) = head.rsplit_once(' ').expect("a rate");
    let slow = pvio.replacen(up, &format!("{head} 0.4 Mbits/sec receiver{tail}"), 1);
    let (ok, out) = verdict("pvio", &slow);
    assert!(!ok && out.contains("iperf3-up: 0.4 Mbit/s"), "{out}");
    // Nothing at all.
    assert!(!verdict("pvio", "").0);
    assert!(!verdict("linux", "").0);
}

#[test]
fn a_driver_domain_run_must_show_its_driver_domain_serving() {
    // The driver-domain record less the driver domain's own line proves nothing about a
    // driver domain; less round 5's, nothing about its destruction and creation.
    let all = recorded(DRVDOM_RECORD);
    let without = |prefix: &str| -> String {
        all.lines()
            .filter(|l| !l.starts_with(prefix))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    let pvio = without("pvio-check driver-domain ");
    let (ok, out) = verdict("pvio-drvdom", &pvio);
    assert!(!ok && out.contains("driver-domain: 0 ok"), "{out}");
    let with = format!("{pvio}pvio-check driver-domain ok domain 1 runs pvio backend\n");
    let (ok, out) = verdict("pvio-drvdom", &with);
    assert!(ok, "{out}");
    // The line says so only when it is ok.
    let failed = format!("{pvio}pvio-check driver-domain FAIL domain 1: no back end serving\n");
    assert!(!verdict("pvio-drvdom", &failed).0);
    for name in [
        "drvdom-restart",
        "drvdom-restart-disk",
        "drvdom-restart-vif",
        "drvdom-restart-ping",
        "payload-drvdom-restart",
    ] {
        let (ok, out) = verdict("pvio-drvdom", &without(&format!("pvio-check {name} ")));
        assert!(
            !ok && out.contains(&format!("{name}: 0 ok")),
            "{name}: {out}"
        );
    }
}
