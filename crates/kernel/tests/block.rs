//! Guests with virtual disks on running machines: blkfront on each guest's vCPU,
//! blkback on the driver domain's, the backing file on tmpfs. Every byte read is the
//! file's; every byte written lands in the file.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::blkback::VbdStats;
use blk::disk::{pattern_fill, write_patterned};
use dev::wire::{CountingSink, Samples, WireSource};
use kernel::block::{BlockJobSpec, JobCounters, JobOp, Pattern};
use kernel::driver_domain::DriverConfig;
use kernel::machine::{Above, BlockSpec, Disk, GuestSpec, Layout, Machine, MachineSpec, NicSpec};
use net::netfront::FrontConfig;

/// Nothing on the wire.
struct Quiet;

impl WireSource for Quiet {
    fn poll(
        &mut self,
        _now: Instant,
        _emit: &mut dyn FnMut(&[u8], net::offload::Offload),
    ) -> usize {
        0
    }
    fn next_due(&self) -> Option<Instant> {
        None
    }
}

/// 8 MiB.
const SECTORS: u64 = 16384;

fn backing(name: &str) -> PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let p = dir.join(format!("pvio-block-{}-{name}", std::process::id()));
    write_patterned(&p, SECTORS).expect("backing file");
    p
}

/// What a write job puts at byte `offset`: the pattern, inverted.
fn inverted(offset: u64, buf: &mut [u8]) {
    pattern_fill(offset, buf);
    buf.iter_mut().for_each(|b| *b = !*b);
}

fn job(
    op: JobOp,
    pattern: Pattern,
    bytes: u32,
    depth: usize,
    span: (u64, u64),
    limit: u64,
) -> (BlockJobSpec, Arc<JobCounters>) {
    let counters = Arc::new(JobCounters::default());
    let spec = BlockJobSpec {
        op,
        pattern,
        bytes,
        depth,
        span,
        limit: Some(limit),
        expect: pattern_fill,
        verify: true,
        fill: inverted,
        latencies: Arc::new(Samples::new(limit as usize)),
        counters: Arc::clone(&counters),
    };
    (spec, counters)
}

fn guest(name: &str, disk: &std::path::Path, persistent: bool, job: BlockJobSpec) -> GuestSpec {
    GuestSpec {
        weight: 1,
        name: name.into(),
        mac: [2, 0, 0, 0, 0, 9],
        above: Above::Block(Box::new(BlockSpec {
            disk: Disk::File(disk.to_path_buf()),
            read_only: false,
            persistent,
            job,
        })),
        core: None,
        front: FrontConfig::default(),
    }
}

fn machine(guests: Vec<GuestSpec>) -> Machine {
    Machine::start(MachineSpec::new(
        NicSpec::new(Box::new(Quiet), Box::new(CountingSink::default())),
        Layout::DriverDomain {
            driver: DriverConfig::default(),
            guests,
        },
    ))
    .expect("machine")
}

fn wait(c: &JobCounters, n: u64) {
    let t = Instant::now();
    while c.completed.load(Ordering::Relaxed) < n && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn two_guests_read_and_write_their_disks_through_the_driver_domain_intact() {
    let (a, b) = (backing("a"), backing("b"));
    // One guest reads its disk sequentially in 128 KiB requests, persistent grants;
    // the other writes random 4 KiB blocks at queue depth 8 without, then a third pass
    // reads them back through a new machine.
    let (seq, seq_c) = job(
        JobOp::Read,
        Pattern::Sequential,
        128 * 1024,
        1,
        (0, SECTORS),
        200,
    );
    let (wr, wr_c) = job(JobOp::Write, Pattern::Sequential, 4096, 8, (0, 4096), 512);
    let m = machine(vec![
        guest("reader", &a, true, seq),
        guest("writer", &b, false, wr),
    ]);
    wait(&seq_c, 200);
    wait(&wr_c, 512);
    let counters = m.stop().expect("stop");
    for (c, n) in [(&seq_c, 200), (&wr_c, 512)] {
        assert_eq!(c.completed.load(Ordering::Relaxed), n);
        assert_eq!(c.errors.load(Ordering::Relaxed), 0);
        assert_eq!(
            c.corrupt.load(Ordering::Relaxed),
            0,
            "every byte read is the file's"
        );
    }
    assert_eq!(counters.sum(|v: &VbdStats| v.reads), 200);
    assert_eq!(counters.sum(|v: &VbdStats| v.writes), 512);
    // The writer's 2 MiB went to the file, inverted; the rest is as it was.
    let f = std::fs::read(&b).expect("file");
    let mut want = vec![0u8; f.len()];
    pattern_fill(0, &mut want);
    inverted(0, &mut want[..4096 * 512]);
    assert!(f == want, "the file holds exactly what was written");

    // Read the written half back, at random, through a fresh machine.
    let (rd, rd_c) = job(JobOp::Read, Pattern::Random(7), 4096, 32, (0, 4096), 1000);
    let mut g = guest("again", &b, true, rd);
    if let Above::Block(bs) = &mut g.above {
        bs.job.expect = inverted;
    }
    let m = machine(vec![g]);
    wait(&rd_c, 1000);
    m.stop().expect("stop");
    assert_eq!(rd_c.completed.load(Ordering::Relaxed), 1000);
    assert_eq!(rd_c.corrupt.load(Ordering::Relaxed), 0);
    for p in [a, b] {
        let _ = std::fs::remove_file(p);
    }
}

/// A queue that takes every request.
struct Takes(Vec<u64>);

impl kernel::block::BlockQueue for Takes {
    fn submit(
        &mut self,
        tag: u64,
        _bio: &blk::blkfront::Bio<'_>,
    ) -> Result<(), blk::blkfront::SubmitError> {
        self.0.push(tag);
        Ok(())
    }
}

/// Issue 39: a request answered twice, or an answer for a slot with nothing in
/// flight, is not taken as a completion but counted, so a check of "none doubled" can
/// fail.
#[test]
fn a_completion_for_nothing_in_flight_is_counted_not_taken() {
    use blk::blkfront::Completion;
    use kernel::block::BlockJob;
    let hv = hv::Hypervisor::new(hv::HvConfig::default()).expect("hv");
    let dom = hv
        .create_domain(&hv::DomainConfig {
            name: "g".into(),
            pages: 64,
            ..hv::DomainConfig::default()
        })
        .expect("domain");
    let (spec, counters) = job(JobOp::Write, Pattern::Sequential, 4096, 2, (0, 64), 2);
    let mut j = BlockJob::new(&dom, spec).expect("job");
    let mut q = Takes(Vec::new());
    assert_eq!(j.submit(&mut q), 2);
    let ok = |tag| Completion {
        tag,
        status: blk::blkif::BLKIF_RSP_OKAY,
    };
    j.done(ok(0));
    j.done(ok(0));
    j.done(ok(7));
    j.done(ok(1));
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    assert_eq!(l(&counters.completed), 2);
    assert_eq!(l(&counters.unexpected), 2);
    assert!(!j.busy());
}

/// Issue 39: the driver domain dies (its kernel panics, or hangs) under a reading and a
/// writing guest. The watchdog starts a new one, which serves both disks again; each
/// guest's blkfront sees its back end go, then the new one wait for it, reconnects and
/// issues again what was in flight. Every request completes once and well, every byte
/// read is the file's, and the written file holds exactly what the writes put there.
#[test]
fn disks_survive_a_driver_domain_that_panics_or_hangs() {
    use kernel::driver_domain::Fault;
    for (k, fault) in [Fault::Panic, Fault::Hang].into_iter().enumerate() {
        let (a, b) = (backing(&format!("ra{k}")), backing(&format!("rb{k}")));
        let (rd, rd_c) = job(
            JobOp::Read,
            Pattern::Random(3),
            16384,
            8,
            (0, SECTORS),
            3000,
        );
        let (wr, wr_c) = job(JobOp::Write, Pattern::Sequential, 4096, 8, (0, 4096), 3000);
        let mut m = machine(vec![
            guest("reader", &a, true, rd),
            guest("writer", &b, false, wr),
        ]);
        wait(&rd_c, 300);
        wait(&wr_c, 300);
        m.inject_fault(fault);
        let t = Instant::now();
        let r = loop {
            if let Some(r) = m.watchdog(Duration::from_millis(50)).expect("restart") {
                break r;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{fault:?}: no restart"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        wait(&rd_c, 3000);
        wait(&wr_c, 3000);
        let c = m.stop().expect("stop");
        for (what, j) in [("reader", &rd_c), ("writer", &wr_c)] {
            let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            assert_eq!(l(&j.completed), 3000, "{fault:?} {what}: {c:?}");
            assert_eq!(l(&j.submitted), 3000, "{fault:?} {what}");
            assert_eq!(l(&j.errors), 0, "{fault:?} {what}");
            assert_eq!(l(&j.unexpected), 0, "{fault:?} {what}: none answered twice");
            assert_eq!(l(&j.corrupt), 0, "{fault:?} {what}: every byte read right");
        }
        assert_eq!(
            c.get("blkfront recovery", "backend_lost"),
            2,
            "{fault:?}: {r:?}"
        );
        assert_eq!(c.get("blkfront recovery", "reconnects"), 2, "{fault:?}");
        assert_eq!(c.get("blkfront recovery", "failed_unreconnected"), 0);
        assert!(
            c.get("blkfront recovery", "requeued") > 0,
            "{fault:?}: what was in flight at the fault went again"
        );
        let f = std::fs::read(&b).expect("file");
        let mut want = vec![0u8; f.len()];
        pattern_fill(0, &mut want);
        inverted(0, &mut want[..4096 * 512]);
        assert!(
            f == want,
            "{fault:?}: the file holds exactly what was written"
        );
        for p in [a, b] {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Issue 39: a disk the new driver domain cannot serve (its backing file is gone) does
/// not stop the restart, and its guest fails what it had in flight, each request once
/// with an error, within the bound, instead of waiting for ever.
#[test]
fn a_disk_whose_back_end_cannot_come_back_fails_its_requests_within_the_bound() {
    use kernel::block::RECONNECT_BOUND;
    use kernel::driver_domain::Fault;
    let a = backing("gone");
    let (rd, rd_c) = job(
        JobOp::Read,
        Pattern::Random(5),
        4096,
        8,
        (0, SECTORS),
        1_000_000,
    );
    let mut m = machine(vec![guest("reader", &a, false, rd)]);
    wait(&rd_c, 100);
    std::fs::remove_file(&a).expect("remove");
    m.inject_fault(Fault::Panic);
    let t = Instant::now();
    let r = loop {
        if let Some(r) = m.watchdog(Duration::from_millis(50)).expect("restart") {
            break r;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no restart");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(r.disks_unserved, 1);
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let lost = Instant::now();
    while l(&rd_c.completed) < l(&rd_c.submitted) {
        assert!(
            lost.elapsed() < RECONNECT_BOUND + Duration::from_secs(5),
            "requests still waiting past the bound"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = m.stop().expect("stop");
    assert!(l(&rd_c.errors) > 0 && l(&rd_c.errors) <= 8, "{c:?}");
    assert_eq!(l(&rd_c.completed), l(&rd_c.submitted), "each request once");
    assert_eq!(l(&rd_c.unexpected), 0);
    assert_eq!(l(&rd_c.corrupt), 0);
    assert_eq!(
        c.get("blkfront recovery", "failed_unreconnected"),
        l(&rd_c.errors)
    );
}
