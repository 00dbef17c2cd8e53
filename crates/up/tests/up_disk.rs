//! `pvio up` with a guest on the network and a guest with a virtual disk (a machine
//! file's `[[disk]]`): the disk guest's job runs until the machine goes down, and the
//! live counters show it and blkback at work.

use std::time::{Duration, Instant};

use blk::blkback::VbdStats;
use kernel::block::JobOp;
use kernel::machine::Disk;
use up::{up, UpConfig, UpDisk, UpGuest};

#[test]
fn a_disk_guest_runs_its_job_beside_a_network_guest_and_the_counters_show_it() {
    let pid = std::process::id() % 100_000;
    let file = std::path::PathBuf::from(format!("/dev/shm/pvio-up-disk-{pid}.img"));
    blk::disk::write_patterned(&file, 8192).expect("backing file");
    let cfg = UpConfig {
        outside_ns: format!("pvio-d{pid}-o"),
        outside_addr: "10.79.9.1/24".into(),
        guests: vec![UpGuest {
            ns: format!("pvio-d{pid}-g"),
            addr: "10.79.9.2/24".into(),
            ..UpGuest::nth(0)
        }],
        disks: vec![UpDisk {
            name: "disk1".into(),
            disk: Disk::File(file.clone()),
            read_only: false,
            persistent: true,
            op: JobOp::Read,
            random: true,
            bytes: 4096,
            depth: 4,
            core: None,
        }],
        ..UpConfig::default()
    };
    let m = up(&cfg).expect("pvio up");
    let t = Instant::now();
    let mut done = 0;
    let first = m.live_sample().expect("a sample");
    let mut port = None;
    while t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
        if let Some(s) = m.live_sample() {
            done = s.counters.get("block job", "completed");
            if done > 1000 {
                // The live table's row for the disk: reads, 8 sectors each.
                port = rig::live::rates(&first, &s)
                    .into_iter()
                    .find(|r| r.port.starts_with("vbd"));
                break;
            }
        }
    }
    let c = m.down_with_counters().expect("down");
    let _ = std::fs::remove_file(&file);
    assert!(done > 1000, "the job ran: {done} completions");
    let p = port.expect("the disk has a row in the live table");
    assert!(
        p.rx_pps > 0.0 && (p.rx_bps / p.rx_pps - 4096.0 * 8.0).abs() < 1.0,
        "{p:?}"
    );
    assert!(c.sum(|v: &VbdStats| v.reads) > 1000, "{c:?}");
    assert_eq!(c.get("block job", "errors"), 0);
}
