//! `bench restart`: how long a guest's traffic stops when its driver domain fails and
//! the toolstack's watchdog restarts it (paper 000 §5.1, issue 15).
//!
//! A `pv` machine carries a paced UDP stream to the guest's application, which checks
//! every byte of every message. The driver domain's kernel is made to fail, by a panic
//! (its thread ends) or a hang (it stops polling with its interrupts off, so only the
//! frames piling up in the NIC show it). The watchdog runs every millisecond, as a
//! toolstack's periodic check would (pvio's `up` runs it every 10 ms); it restarts a
//! driver domain whose kernel ended, or that left work waiting for [`STALL`] without
//! looking. The restart destroys the domain (the hypervisor takes back every mapping
//! of guest pages), resets the NIC, retires the back ends in the store, boots a new
//! driver domain and offers the vifs again; the guest's netfront sees its back end
//! close, keeps its unanswered packets, and reconnects.
//!
//! Measured per fault: detection (fault to the watchdog's decision), the restart
//! itself (decision to the new driver domain running with its vifs connected), and
//! fault to traffic flowing again (the first message the application receives after
//! the restart). The goal the issue sets is under 100 ms from fault to traffic.
//!
//! Disks too (issue 39): a second machine's guest reads its virtual disk at random, 4 KiB
//! at queue depth 8, every byte checked, while its driver domain fails the same ways. The
//! restart serves the disk again from a new driver domain; the guest's blkfront sees its
//! back end go, reconnects and issues again what was in flight. Measured: fault to I/O
//! flowing again (the first request completed after the restart), and that every
//! request completes once and well.

use std::time::{Duration, Instant};

use net::netfront::FrontConfig;

use crate::{Error, Experiment, Mode, Report};
use rig::udp::{Config, Fault, Options, Running};

/// The registry entry.
pub const EXPERIMENT: Experiment = Experiment {
    id: "restart",
    title: "Driver-domain restart under traffic: fault to traffic flowing again",
    paper: "000 §5.1 (issue 15; the paper asks for it and reports no figure)",
    run,
};

/// How long work may wait for the driver domain before the watchdog calls it stalled.
pub const STALL: Duration = Duration::from_millis(50);
/// How often the watchdog looks.
const PERIOD: Duration = Duration::from_millis(1);
/// Offered load: frames per second of 1000-byte messages (a fifth of a gigabit).
const RATE: f64 = 25_000.0;
/// The goal, fault to traffic flowing.
const GOAL_MS: f64 = 100.0;

/// One fault's timings, ms.
#[derive(Debug, Clone, Copy)]
struct Timing {
    detect: f64,
    restart: f64,
    flowing: f64,
}

fn messages(r: &Running) -> u64 {
    r.snapshot().messages
}

/// Waits until the application has received more than `past` messages.
fn until_more(r: &Running, past: u64, limit: Duration) -> Result<Instant, Error> {
    let t = Instant::now();
    loop {
        if messages(r) > past {
            return Ok(Instant::now());
        }
        if t.elapsed() > limit {
            return Err(Error::Other(format!(
                "no message arrived within {limit:?} (stuck at {past})"
            )));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Injects `f`, lets the watchdog find it and restart, and times the way back.
fn one_fault(r: &mut Running, f: Fault) -> Result<Timing, Error> {
    let t_fault = Instant::now();
    r.inject_fault(f);
    let restarted = loop {
        let asked = Instant::now();
        if let Some(x) = r.watchdog(STALL)? {
            break (x, asked);
        }
        if t_fault.elapsed() > Duration::from_secs(5) {
            return Err(Error::Other(format!("{f:?}: the watchdog saw nothing")));
        }
        std::thread::sleep(PERIOD);
    };
    let (x, decided) = restarted;
    let at = messages(r);
    let back = until_more(r, at, Duration::from_secs(5))
        .map_err(|e| Error::Other(format!("after {f:?} and {x:?}: {e}")))?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok(Timing {
        detect: ms(decided.duration_since(t_fault)),
        restart: ms(x.took),
        flowing: ms(back.duration_since(t_fault)),
    })
}

/// The configuration a record names: the stream, the faults of each kind, and the
/// watchdog's stall limit and period.
#[derive(Debug, serde::Serialize)]
struct Recorded {
    rate_fps: f64,
    message: usize,
    faults_each: usize,
    stall_limit_ms: f64,
    watchdog_period_ms: f64,
}

fn run(cx: &crate::Context) -> Result<Report, Error> {
    let mode = cx.mode;
    let faults = match mode {
        Mode::Full => 9,
        Mode::Quick => 5,
        Mode::Smoke => 1,
    };
    let opts = Options {
        rate: RATE,
        sample: None,
        idle: cx.idle,
        ..Options::paper(Config::Pv, 1000)
    };
    let (result, disk) = quietly(opts, faults);
    let (timings, finish, held) = result?;
    let mut r = Report::new(EXPERIMENT.id, EXPERIMENT.title, EXPERIMENT.paper);
    r.setup = format!(
        "pv machine (v1 grants, original grant path, netfilter on), {RATE} frames/s of \
         1000-byte UDP messages to the guest's application, which checks every byte. \
         {faults} faults of each kind; the watchdog looks every {PERIOD:?} with a stall \
         limit of {STALL:?}."
    );
    r.set_config(&Recorded {
        rate_fps: RATE,
        message: 1000,
        faults_each: faults,
        stall_limit_ms: STALL.as_secs_f64() * 1e3,
        watchdog_period_ms: PERIOD.as_secs_f64() * 1e3,
    });
    network_rows(&mut r, &timings, &finish, held, faults);
    let (disk_timings, disk) = disk?;
    disk_rows(&mut r, &disk_timings, &disk);
    r.notes.push(
        "A hang's detection is bounded below by the stall limit: the watchdog cannot \
         tell a hung driver domain from a slow one sooner. A panic is seen at the next \
         look after the kernel's thread ends (unwinding first)."
            .into(),
    );
    Ok(r)
}

/// Both measurements with the injected panics' backtraces kept out of the output.
fn quietly(
    opts: Options,
    faults: usize,
) -> (Result<Measured, Error>, Result<(Timings, DiskTally), Error>) {
    // The injected panics would each print a backtrace; keep the report readable.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let injected = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|m| m.contains("injected fault"));
        if !injected {
            hook(info);
        }
    }));
    let result = measure(opts, faults);
    let disk = measure_disk(opts.idle, faults);
    let _ = std::panic::take_hook();
    (result, disk)
}

/// The network's outages, its faults caught, its messages checked.
fn network_rows(
    r: &mut Report,
    timings: &Timings,
    finish: &rig::udp::Finish,
    held: usize,
    faults: usize,
) {
    timing_rows(r, timings, "", "vifs connected", "traffic flowing again");
    let caught = timings.iter().map(|(_, t)| t.len()).sum::<usize>();
    r.check(
        "faults caught and restarted",
        caught as f64,
        "faults",
        &format!("= {}", 2 * faults),
        caught == 2 * faults,
    );
    r.check_none("messages delivered not as sent", finish.corrupt, "messages");
    let run = "the network's run across the faults".to_string();
    crate::harness::device_waits(r, &[(run, &finish.counters)]);
    r.check_none(
        "frames of destroyed domains still held after the run",
        held as u64,
        "frames",
    );
    r.notes.push(format!(
        "{} of {} messages sent arrived, every byte checked; those lost were on the wire \
         or in the failed driver domain during the outages (UDP: nothing resends them; \
         `pvio up`'s test shows TCP resending them).",
        finish.messages_received, finish.messages_sent
    ));
}

/// The disk's outages, and every request answered once and read right.
fn disk_rows(r: &mut Report, disk_timings: &Timings, disk: &DiskTally) {
    timing_rows(
        r,
        disk_timings,
        ", a guest's disk",
        "disk connected",
        "I/O flowing again",
    );
    r.check_none(
        "disk requests lost, doubled, failed or read wrong across the faults",
        disk.lost + disk.doubled + disk.failed + disk.corrupt,
        "requests",
    );
    r.notes.push(format!(
        "The disk: {} requests completed, {} issued again to a new back end after a \
         fault, every byte read checked against the file.",
        disk.completed, disk.requeued
    ));
}

/// Each fault kind's rows (detection, restart, fault to `flowing`) and its check of the
/// median against the goal; `what` follows the group's name, `connected` says what the
/// restart waits for.
fn timing_rows(
    r: &mut Report,
    timings: &[(&'static str, Vec<Timing>)],
    what: &str,
    connected: &str,
    flowing: &str,
) {
    for (kind, ts) in timings {
        let g = format!("{kind} in the driver domain{what}");
        let col = |f: fn(&Timing) -> f64| ts.iter().map(f).collect::<Vec<_>>();
        r.row(
            &g,
            "detection (fault → watchdog decides)",
            "ms",
            &col(|t| t.detect),
        );
        r.row(
            &g,
            &format!("restart (decision → new driver domain, {connected})"),
            "ms",
            &col(|t| t.restart),
        );
        let times = col(|t| t.flowing);
        let med = crate::Stats::of(&times).median;
        r.row(&g, &format!("fault → {flowing}"), "ms", &times);
        r.check(
            &format!("{g}: fault to {flowing}, median"),
            med,
            "ms",
            &format!("< {GOAL_MS}"),
            med < GOAL_MS,
        );
    }
}

type Measured = (Vec<(&'static str, Vec<Timing>)>, rig::udp::Finish, usize);

fn measure(opts: Options, faults: usize) -> Result<Measured, Error> {
    let mut running = Running::start(opts)?;
    let hv = std::sync::Arc::clone(&running.hv);
    until_more(&running, 200, Duration::from_secs(10))?;
    // Traffic flows: the devices' waits to run count from here, across the faults.
    running.begin_window();
    let mut out = Vec::new();
    crate::progress::plan(2 * faults as u64);
    for (f, kind) in [(Fault::Panic, "panic"), (Fault::Hang, "hang")] {
        let mut ts = Vec::new();
        for i in 0..faults {
            crate::progress::step(format_args!("{kind} {}/{faults}", i + 1));
            let t = one_fault(&mut running, f)?;
            ts.push(t);
            // Traffic settles before the next fault.
            let at = messages(&running);
            until_more(&running, at + 500, Duration::from_secs(10))
                .map_err(|e| Error::Other(format!("settling after {f:?}: {e}")))?;
        }
        out.push((kind, ts));
    }
    let finish = running.finish(Duration::from_secs(1))?;
    Ok((out, finish, hv.reap()))
}

/// Each fault kind's timings.
type Timings = Vec<(&'static str, Vec<Timing>)>;

/// What the disk's guest counted over all its faults.
#[derive(Debug, Default)]
struct DiskTally {
    completed: u64,
    lost: u64,
    doubled: u64,
    failed: u64,
    corrupt: u64,
    requeued: u64,
}

/// 64 MiB.
const DISK_SECTORS: u64 = 131_072;

/// The restart's disk machine: a driver domain serving one guest's disk, the file at
/// `path`, which the guest reads 4 KiB at random, 8 in flight, each read checked.
fn disk_machine(
    idle: hv::sched::IdlePolicy,
    path: &std::path::Path,
    counters: &std::sync::Arc<kernel::block::JobCounters>,
) -> Result<kernel::machine::Machine, Error> {
    use kernel::block::{BlockJobSpec, JobOp, Pattern};
    use kernel::machine::{
        Above, BlockSpec, Disk, GuestSpec, Layout, Machine, MachineSpec, NicSpec,
    };
    use std::sync::Arc;
    let job = BlockJobSpec {
        op: JobOp::Read,
        pattern: Pattern::Random(11),
        bytes: 4096,
        depth: 8,
        span: (0, DISK_SECTORS),
        limit: None,
        expect: blk::disk::pattern_fill,
        verify: true,
        fill: blk::disk::pattern_fill,
        latencies: Arc::new(dev::wire::Samples::new(1)),
        counters: Arc::clone(counters),
    };
    Machine::start(MachineSpec {
        idle,
        ..MachineSpec::new(
            NicSpec::new(
                Box::new(dev::wire::Silence),
                Box::new(dev::wire::CountingSink::default()),
            ),
            Layout::DriverDomain {
                driver: kernel::driver_domain::DriverConfig::default(),
                guests: vec![GuestSpec {
                    weight: 1,
                    name: "disk".into(),
                    mac: [2, 0, 0, 0, 0, 0x0d],
                    above: Above::Block(Box::new(BlockSpec {
                        disk: Disk::File(path.to_path_buf()),
                        read_only: true,
                        persistent: false,
                        job,
                    })),
                    core: None,
                    front: FrontConfig::default(),
                }],
            },
        )
    })
    .map_err(|e| Error::Other(e.to_string()))
}

/// The disk rows: a block guest's random reads across `faults` faults of each kind.
fn measure_disk(idle: hv::sched::IdlePolicy, faults: usize) -> Result<(Timings, DiskTally), Error> {
    use kernel::driver_domain::Fault as DriverFault;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!("pvio-restart-disk-{}", std::process::id()));
    blk::disk::write_patterned(&path, DISK_SECTORS)
        .map_err(|e| Error::Other(format!("{}: {e}", path.display())))?;
    let counters = Arc::new(kernel::block::JobCounters::default());
    let mut m = disk_machine(idle, &path, &counters)?;
    let done = || counters.completed.load(Ordering::Relaxed);
    let more = |past: u64| -> Result<Instant, Error> {
        let t = Instant::now();
        while done() <= past {
            if t.elapsed() > Duration::from_secs(10) {
                return Err(Error::Other(format!("the disk's I/O stopped at {past}")));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(Instant::now())
    };
    more(500)?;
    let mut out = Vec::new();
    for (f, kind) in [(DriverFault::Panic, "panic"), (DriverFault::Hang, "hang")] {
        let mut ts = Vec::new();
        for _ in 0..faults {
            let t_fault = Instant::now();
            m.inject_fault(f);
            let (x, decided) = loop {
                let asked = Instant::now();
                if let Some(x) = m.watchdog(STALL).map_err(|e| Error::Other(e.to_string()))? {
                    break (x, asked);
                }
                if t_fault.elapsed() > Duration::from_secs(5) {
                    return Err(Error::Other(format!(
                        "disk, {f:?}: the watchdog saw nothing"
                    )));
                }
                std::thread::sleep(PERIOD);
            };
            let back = more(done())?;
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            ts.push(Timing {
                detect: ms(decided.duration_since(t_fault)),
                restart: ms(x.took),
                flowing: ms(back.duration_since(t_fault)),
            });
            more(done() + 500)?;
        }
        out.push((kind, ts));
    }
    let c = m.stop().map_err(|e| Error::Other(e.to_string()))?;
    let _ = std::fs::remove_file(&path);
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    // The job stopped with the machine: what it had in flight then is the only
    // difference between asked and answered that is not a loss.
    let in_flight = l(&counters.submitted).saturating_sub(l(&counters.completed));
    Ok((
        out,
        DiskTally {
            completed: l(&counters.completed),
            lost: in_flight.saturating_sub(8),
            doubled: l(&counters.unexpected)
                + c.sum(|f: &blk::blkfront::FrontStats| f.bad_responses),
            failed: l(&counters.errors),
            corrupt: l(&counters.corrupt),
            requeued: c.sum(|r: &kernel::block::RecoveryStats| r.requeued),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_smoke_run_restarts_after_each_fault_and_loses_no_byte() {
        let rep = run(&crate::Context::smoke()).expect("runs");
        let caught = rep
            .checks
            .iter()
            .find(|c| c.what.starts_with("faults caught"))
            .expect("check");
        assert!(caught.met, "{caught:?}");
        // What the run must do (every fault caught, nothing lost or left held), not how
        // fast: the recovery's medians and the devices' waits are the record's to judge.
        let timed = |c: &crate::report::Check| {
            c.what.contains("median") || crate::harness::is_device_wait_check(c)
        };
        assert!(
            rep.checks.iter().any(crate::harness::is_device_wait_check),
            "the devices' waits are judged: {:?}",
            rep.checks
        );
        for c in rep.checks.iter().filter(|c| !timed(c)) {
            assert!(c.met, "{c:?}");
        }
    }
}
