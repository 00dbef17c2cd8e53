//! vbd queues as units of pvio's scheduler (`blk::unit`), as `pvio backend` runs them:
//! a guest that floods its ring shares a pCPU with a quiet guest, which waits for one
//! step of the flooder's, one budget of requests, not for its whole ring; every request
//! of both is answered once; a queue taken back ends its unit and is handed on whole.

mod common;

use common::{host, rw, seg, Hostile};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blk::blkback::{self, Blkback, VBD_WINDOW_SLOTS};
use blk::blkif::{RawRequest, BLKIF_OP_READ, BLKIF_RSP_EOPNOTSUPP, BLKIF_RSP_OKAY, SECTOR_SIZE};
use blk::disk::FileDisk;
use blk::unit::{Queue, Served};
use blk::xenbus;
use hv::sched::{CpuPlan, Cx, IdlePolicy, Scheduler, Step, Unit, UnitSpec};

/// Sectors of the test disks.
const SECTORS: u64 = 1024;

fn backing(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("pvio-units-{}-{name}", std::process::id()));
    blk::disk::write_patterned(&p, SECTORS).expect("backing file");
    p
}

/// The order units stepped in, each with the requests its queue had taken after the
/// step, and the marks the test made between their steps.
type Log = Arc<Mutex<Vec<(&'static str, u64)>>>;

/// A queue's unit that writes its name to the log after each step.
struct Logged {
    inner: Served<hv::Pvio>,
    name: &'static str,
    log: Log,
}

impl Unit for Logged {
    type Output = ();
    fn step(&mut self, cx: &Cx) -> Step<()> {
        let s = self.inner.step(cx);
        let taken = self.inner.with(|b| b.stats().taken).unwrap_or(0);
        self.log.lock().expect("log").push((self.name, taken));
        s
    }
}

/// A scheduler of one pCPU that sleeps when idle: what runs there, runs in turn.
fn one_pcpu() -> Arc<Scheduler> {
    Scheduler::new(&CpuPlan::floating(1, IdlePolicy::Block), None).expect("scheduler")
}

/// Waits (at most ten seconds) until `front` has `n` responses, gathering them.
fn responses(front: &mut Hostile, n: usize, got: &mut Vec<blk::blkif::Response>) {
    let t0 = Instant::now();
    while got.len() < n {
        got.extend(front.responses());
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{} of {n} responses",
            got.len()
        );
        std::thread::yield_now();
    }
}

/// A unit that holds its pCPU while told to: the test's way of waking two units at the
/// same moment, whatever the host's scheduling of the test's own thread.
struct Gate {
    hold: Arc<AtomicBool>,
    holding: Arc<AtomicBool>,
}

impl Unit for Gate {
    type Output = ();
    fn step(&mut self, _cx: &Cx) -> Step<()> {
        if self.hold.load(Ordering::Acquire) {
            self.holding.store(true, Ordering::Release);
            while self.hold.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            self.holding.store(false, Ordering::Release);
        }
        Step::Idle(None)
    }
}

/// One pCPU, two guests' queues on it. The flooder's ring holds 32 requests a round,
/// reads and requests of an operation no disk has (refused, `EOPNOTSUPP`); its budget
/// is one request a step. Each round, while a third unit holds the pCPU, the flood is
/// posted and its queue woken, then the quiet guest's read is posted and its queue
/// woken; then the pCPU is let go. The flooder's queue steps first (it comes first in
/// the pCPU's round) and takes one request; the quiet queue steps next, though 31 of
/// the flood's requests still wait. A queue that served its ring until empty would take
/// all 32 first. Every request of both is answered once, the flooder's in order.
#[test]
fn a_flooding_guest_holds_a_shared_pcpu_for_one_budget_at_a_time() {
    let h = host();
    let (gf, gq) = (h.guest("flooder"), h.guest("quiet"));
    let (pf, pq) = (backing("flooder"), backing("quiet"));
    let open = |g: &hv::Domain, devid: u32, p: &PathBuf| {
        let disk = FileDisk::open(p, false).expect("disk");
        xenbus::create_vbd(h.hv.store(), h.drv.id(), g.id(), devid, false).expect("vbd");
        blkback::probe(h.hv.store(), h.drv.id(), g.id(), devid, &disk, false).expect("probe");
        disk
    };
    let (df, dq) = (open(&gf, 51712, &pf), open(&gq, 51712, &pq));
    let mut flooder = Hostile::connect(&h, &gf, 51712);
    let mut quiet = Hostile::connect(&h, &gq, 51712);
    let connect = |g: &hv::Domain, slot: u32, disk| {
        Blkback::connect(
            hv::Pvio::new(&h.hv, &h.drv),
            g.id(),
            51712,
            slot * VBD_WINDOW_SLOTS,
            disk,
        )
        .expect("back")
    };
    let mut bf = connect(&gf, 0, df);
    bf.set_budget(1);
    let bq = connect(&gq, 1, dq);

    let sched = one_pcpu();
    let log: Log = Arc::default();
    let place = |name: &'static str, back| {
        let log = Arc::clone(&log);
        Queue::place_as(&sched, 0, UnitSpec::named(name), back, move |inner| {
            Logged { inner, name, log }
        })
        .expect("placed")
    };
    let qf = place("flooder", bf);
    let qq = place("quiet", bq);
    let (hold, holding) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let gate = sched
        .place(
            0,
            UnitSpec::named("gate"),
            Gate {
                hold: Arc::clone(&hold),
                holding: Arc::clone(&holding),
            },
        )
        .expect("gate");

    let (_, rf) = flooder.granted(&h, false);
    let (gfn_q, rq) = quiet.granted(&h, false);
    let mut got_f = Vec::new();
    let mut got_q = Vec::new();
    for round in 0..50u64 {
        let base = round * 32;
        let flood: Vec<_> = (base..base + 32)
            .map(|i| match i % 4 {
                3 => RawRequest {
                    operation: 9,
                    id: i + 1,
                    ..RawRequest::default()
                },
                _ => rw(BLKIF_OP_READ, i + 1, i % (SECTORS - 8), &[seg(rf, 0, 7)]),
            })
            .collect();
        log.lock().expect("log").clear();
        hold.store(true, Ordering::Release);
        gate.wake();
        let t0 = Instant::now();
        while !holding.load(Ordering::Acquire) {
            assert!(t0.elapsed() < Duration::from_secs(10), "the gate never ran");
            std::thread::yield_now();
        }
        // The pCPU is held: nothing of the flooder's has run.
        let before = qf.try_with(|b| b.stats().taken).expect("flooder") - base;
        assert_eq!(before, 0);
        flooder.send(&flood);
        qf.wake();
        quiet.send(&[rw(BLKIF_OP_READ, round, 3, &[seg(rq, 0, 7)])]);
        log.lock().expect("log").push(("mark", before));
        qq.wake();
        hold.store(false, Ordering::Release);
        responses(&mut quiet, round as usize + 1, &mut got_q);
        responses(&mut flooder, (base + 32) as usize, &mut got_f);
        let log = log.lock().expect("log").clone();
        let mark = log.iter().position(|&(n, _)| n == "mark").expect("mark");
        let quiet_step = mark
            + log[mark..]
                .iter()
                .position(|&(n, _)| n == "quiet")
                .expect("quiet");
        let at_quiet = log[..quiet_step]
            .iter()
            .rev()
            .find(|&&(n, _)| n == "flooder")
            .map_or(base, |&(_, t)| t)
            - base;
        assert_eq!(
            at_quiet - before,
            1,
            "the flooder's queue took {} requests between the quiet read's wake and its step: {log:?}",
            at_quiet - before
        );
    }

    for r in &got_q {
        assert_eq!(r.status, BLKIF_RSP_OKAY, "quiet read {}", r.id);
    }
    let mut want = vec![0u8; 4096];
    blk::disk::pattern_fill(3 * SECTOR_SIZE, &mut want);
    let mut page = vec![0u8; 4096];
    gq.read(gfn_q, 0, &mut page).expect("read");
    assert_eq!(page, want, "the quiet guest's sectors");

    let ids: Vec<u64> = got_f.iter().map(|r| r.id).collect();
    assert_eq!(
        ids,
        (1..=50 * 32).collect::<Vec<_>>(),
        "each once, in order"
    );
    for r in &got_f {
        let want = if r.id % 4 == 0 {
            BLKIF_RSP_EOPNOTSUPP
        } else {
            BLKIF_RSP_OKAY
        };
        assert_eq!(r.status, want, "request {}", r.id);
    }
    // Taken back in the middle of a flood and placed again: every request still
    // answered once, in order.
    let more: Vec<_> = (50 * 32..51 * 32u64)
        .map(|i| rw(BLKIF_OP_READ, i + 1, i % (SECTORS - 8), &[seg(rf, 0, 7)]))
        .collect();
    flooder.send(&more);
    qf.wake();
    let t0 = Instant::now();
    while qf.try_with(|b| b.stats().taken).unwrap_or(0) < 50 * 32 + 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the flood never began"
        );
        std::hint::spin_loop();
    }
    let sf = qf.take().expect("flooder's back end");
    let qf = Queue::place(&sched, 0, "flooder again", sf).expect("placed again");
    let mut rest = Vec::new();
    responses(&mut flooder, 32, &mut rest);
    let ids: Vec<u64> = rest.iter().map(|r| r.id).collect();
    assert_eq!(ids, (50 * 32 + 1..=51 * 32).collect::<Vec<_>>());
    assert!(rest.iter().all(|r| r.status == BLKIF_RSP_OKAY));
    let sf = qf.take().expect("flooder's back end");
    assert_eq!(sf.stats().taken, 51 * 32);
    assert_eq!(sf.stats().refused.total(), 50 * 8);
    assert!(qq.take().is_some());
    sched.stop(Duration::from_secs(1));
    for p in [pf, pq] {
        let _ = std::fs::remove_file(p);
    }
}

/// A queue whose disk moves bytes asynchronously, as a unit: it places the requests and
/// goes idle, and each transfer's end wakes it (the disk's completions are its
/// interrupt line), with nothing else waking it, until every request is answered, in
/// the order taken. Taken back with transfers in flight, it hands the device over
/// whole.
#[test]
fn a_queue_whose_disk_is_asynchronous_is_woken_by_the_disk_and_answers_every_request() {
    let h = host();
    let g = h.guest("guest");
    let path = backing("aio");
    let disk = FileDisk::open(&path, false).expect("disk");
    xenbus::create_vbd(h.hv.store(), h.drv.id(), g.id(), 51712, false).expect("vbd");
    blkback::probe(h.hv.store(), h.drv.id(), g.id(), 51712, &disk, true).expect("probe");
    let mut front = Hostile::connect(&h, &g, 51712);
    let fdir = xenbus::frontend_dir(g.id(), 51712);
    h.hv.store()
        .write(g.id(), &format!("{fdir}/feature-persistent"), "1")
        .expect("key");
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    assert!(back.copy_transient(blkback::Bounce::new(&h.drv).expect("pages")));
    assert!(back.disk_async(), "io_uring taken");
    let sched = one_pcpu();
    let q = Queue::place(&sched, 0, "aio", back).expect("placed");
    let pages: Vec<_> = (0..8).map(|_| front.granted(&h, false)).collect();
    let mut got = Vec::new();
    for round in 0..4u64 {
        let reqs: Vec<RawRequest> = (0..8u64)
            .map(|k| {
                let id = round * 8 + k + 1;
                rw(BLKIF_OP_READ, id, 8 * id, &[seg(pages[k as usize].1, 0, 7)])
            })
            .collect();
        front.send(&reqs);
        // One wake, as the ring's event; the rest is the disk's.
        q.wake();
        responses(&mut front, 8 * (round as usize + 1), &mut got);
        for (k, (gfn, _)) in pages.iter().enumerate() {
            let id = round * 8 + k as u64 + 1;
            let mut want = vec![0u8; 4096];
            blk::disk::pattern_fill(8 * id * SECTOR_SIZE, &mut want);
            let mut page = vec![0u8; 4096];
            g.read(*gfn, 0, &mut page).expect("read");
            assert_eq!(page, want, "request {id}'s sectors");
        }
    }
    let ids: Vec<u64> = got.iter().map(|r| r.id).collect();
    assert_eq!(ids, (1..=32).collect::<Vec<_>>(), "each once, in order");
    assert!(got.iter().all(|r| r.status == BLKIF_RSP_OKAY));
    // Taken back right after a wake, transfers perhaps in flight: handed over whole.
    let more: Vec<RawRequest> = (33..41u64)
        .map(|id| {
            rw(
                BLKIF_OP_READ,
                id,
                8 * id,
                &[seg(pages[(id - 33) as usize].1, 0, 7)],
            )
        })
        .collect();
    front.send(&more);
    q.wake();
    let back = q.take().expect("back end");
    let taken = back.stats().taken;
    assert!(back.stats().async_transfers >= 32, "{:?}", back.stats());
    back.hand_over();
    let rest = front.responses();
    assert_eq!(
        rest.iter().map(|r| r.id).collect::<Vec<_>>(),
        (33..33 + taken - 32).collect::<Vec<_>>(),
        "what was taken is answered by the hand-over"
    );
    let _ = std::fs::remove_file(&path);
}
