//! Each fuzz target for a bounded number of seeded cases (`PVIO_FUZZ_CASES` for more,
//! `PVIO_FUZZ_SEED` to start elsewhere). A failure names its seed; rerun with it. Each
//! case runs under a watchdog: one that does not return in 20 s is a hang a hostile
//! peer caused, and fails.

use pvio_fuzz::Input;

fn cases(default: u64) -> u64 {
    std::env::var("PVIO_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A fuzz target's case function.
type Case = fn(&mut Input<'_>);

fn run(name: &str, default: u64, f: Case) {
    let base = std::env::var("PVIO_FUZZ_SEED")
        .ok()
        .and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0x243f_6a88_85a3_08d3);
    for case in 0..cases(default) {
        let seed = base.wrapping_add(case.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(|| f(&mut Input::from_seed(seed)));
            let _ = tx.send(r.is_ok());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(20)) {
            Ok(ok) => assert!(ok, "{name}: case with PVIO_FUZZ_SEED={seed:#x} failed"),
            Err(_) => panic!("{name}: case with PVIO_FUZZ_SEED={seed:#x} hung"),
        }
    }
}

#[test]
fn reassembly_gives_every_fragment_back_exactly_once() {
    run("reasm", 3000, pvio_fuzz::reasm::case);
}

#[test]
fn hostile_store_operations_leave_quotas_and_other_domains_whole() {
    run("store", 300, pvio_fuzz::store::case);
}

#[test]
fn a_hostile_peer_on_the_stores_wire_protocol_gets_an_answer_per_message_and_changes_nothing_it_may_not(
) {
    run("store_wire", 300, pvio_fuzz::store_wire::case);
}

#[test]
fn hostile_hypercall_arguments_leave_no_mapping_frame_or_channel_behind() {
    run("hypercalls", 200, pvio_fuzz::hypercalls::case);
}

#[test]
fn hostile_front_ends_leave_the_driver_domain_whole() {
    run("netback", 150, pvio_fuzz::netback::case);
}

#[test]
fn hostile_block_front_ends_leave_the_driver_domain_and_the_other_disk_whole() {
    run("blkback", 150, pvio_fuzz::blkback::case);
}

#[test]
fn hostile_back_ends_leave_the_guest_whole() {
    run("netfront", 300, pvio_fuzz::netfront::case);
}

#[test]
fn odd_store_values_in_either_direction_leave_both_ends_whole() {
    run("connect", 150, pvio_fuzz::connect::case);
}

/// Every fuzz target, by the name of its folder in `regressions/` and of its cargo-fuzz
/// binary.
const TARGETS: [(&str, Case); 9] = [
    ("reasm", pvio_fuzz::reasm::case),
    ("store", pvio_fuzz::store::case),
    ("store_wire", pvio_fuzz::store_wire::case),
    ("hypercalls", pvio_fuzz::hypercalls::case),
    ("netback", pvio_fuzz::netback::case),
    ("blkback", pvio_fuzz::blkback::case),
    ("netfront", pvio_fuzz::netfront::case),
    ("connect", pvio_fuzz::connect::case),
    ("lro", pvio_fuzz::lro::case),
];

/// Every input libFuzzer found failing, kept in `regressions/<target>/` under a name
/// that says what it found, replays clean; so does the empty input, for every target
/// (libFuzzer tries it first, and an input that ends early must read as zeros).
#[test]
fn every_saved_finding_replays_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
    // Every cargo-fuzz target is replayed here.
    let bins = dir.join("../../../fuzz/fuzz_targets");
    let mut names: Vec<String> = std::fs::read_dir(&bins)
        .expect("fuzz/fuzz_targets")
        .flatten()
        .filter_map(|e| Some(e.path().file_stem()?.to_str()?.to_string()))
        .collect();
    names.sort();
    let mut ours: Vec<&str> = TARGETS.iter().map(|t| t.0).collect();
    ours.sort_unstable();
    assert_eq!(names, ours, "a fuzz target the replay leaves out");
    for (name, f) in TARGETS {
        let r = std::panic::catch_unwind(|| f(&mut Input::from_bytes(&[])));
        assert!(r.is_ok(), "{name}: the empty input fails");
    }
    let mut replayed = 0;
    for (name, f) in TARGETS {
        let Ok(entries) = std::fs::read_dir(dir.join(name)) else {
            continue;
        };
        for e in entries.flatten() {
            let bytes = std::fs::read(e.path()).expect("read");
            let r = std::panic::catch_unwind(|| f(&mut Input::from_bytes(&bytes)));
            assert!(r.is_ok(), "{name}: {} fails again", e.path().display());
            replayed += 1;
        }
    }
    assert!(replayed > 0, "the saved findings are where this test looks");
}

#[test]
fn a_hostile_wire_through_lro_gives_each_flow_its_segments_as_they_came() {
    run("lro", 1000, pvio_fuzz::lro::case);
}
