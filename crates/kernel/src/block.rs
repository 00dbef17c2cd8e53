//! The guest's block applications above blkfront: its `hdparm -t` (sequential reads) and
//! its `fio` (random reads or writes at a queue depth), and the kernel of a guest whose
//! only device is a virtual disk.
//!
//! A job keeps `depth` requests of `bytes` each in flight over a span of the disk. Each
//! in-flight slot has pages of its own, allocated when the job starts. Every read is
//! checked byte for byte against what the disk must hold ([`BlockJobSpec::expect`]);
//! a write fills its pages from [`BlockJobSpec::fill`] at the offset it goes to, so that
//! the file can be checked afterwards. Each completion's latency, from its submission
//! to the guest seeing its response, goes to [`BlockJobSpec::latencies`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::blkfront::{Bio, BioOp, BioSeg, Blkfront, Completion};
use blk::blkif::SECTOR_SIZE;
use dev::wire::Samples;
use hv::profile::{enter, Class};
use std::sync::mpsc::Receiver;

use hv::store::{WatchEvent, XenStore, XenbusState};
use hv::{Domain, Gfn, Hypervisor, Port, Vcpu, PAGE_SIZE};

use crate::vcpu::{Kernel, Work};
use crate::{other, BuildError, Counters};

/// What a job submits its bios to: blkfront, or the guest's NBD client.
pub trait BlockQueue {
    /// Takes `bio` under `tag`, or says why not (`Busy`: try after a completion).
    fn submit(&mut self, tag: u64, bio: &Bio<'_>) -> Result<(), blk::blkfront::SubmitError>;
}

impl BlockQueue for Blkfront {
    fn submit(&mut self, tag: u64, bio: &Bio<'_>) -> Result<(), blk::blkfront::SubmitError> {
        Blkfront::submit(self, tag, bio)
    }
}

/// Where a job's requests go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// One after another from the span's start, wrapping at its end.
    Sequential,
    /// Aligned to the request's size, uniformly over the span (xorshift, seeded).
    Random(u64),
}

/// What a job's requests do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobOp {
    /// Reads, each checked.
    Read,
    /// Writes of [`BlockJobSpec::fill`].
    Write,
}
hv::named_enum!(JobOp {
    Read => "read",
    Write => "write",
});

/// What a job counted.
#[derive(Debug, Default)]
pub struct JobCounters {
    /// Requests submitted.
    pub submitted: AtomicU64,
    /// Requests completed (with or without an error).
    pub completed: AtomicU64,
    /// Completions with an error status.
    pub errors: AtomicU64,
    /// Reads with a byte other than the disk's.
    pub corrupt: AtomicU64,
    /// Bytes moved by successful requests.
    pub bytes: AtomicU64,
    /// Completions for a slot with nothing in flight (a request answered twice, or an
    /// answer to none): not taken, and counted, so a doubled request shows.
    pub unexpected: AtomicU64,
}

/// A job's set-up.
#[derive(Debug, Clone)]
pub struct BlockJobSpec {
    /// Reads or writes.
    pub op: JobOp,
    /// Where.
    pub pattern: Pattern,
    /// Bytes per request: a multiple of 512, at most 128 KiB.
    pub bytes: u32,
    /// Requests kept in flight, 1 to 32.
    pub depth: usize,
    /// The sectors it covers, `[start, end)`.
    pub span: (u64, u64),
    /// Requests to submit in all (none: until the machine stops).
    pub limit: Option<u64>,
    /// Fills a buffer with what the disk holds from byte `offset` on (reads are checked
    /// against it when `verify`).
    pub expect: fn(u64, &mut [u8]),
    /// Check every byte read against `expect` (off for a disk whose contents are not a
    /// known pattern: a user's file under `pvio up`).
    pub verify: bool,
    /// Fills a buffer with what a write puts from byte `offset` on.
    pub fill: fn(u64, &mut [u8]),
    /// Each completion's latency, ns.
    pub latencies: Arc<Samples>,
    /// Its counters.
    pub counters: Arc<JobCounters>,
}

/// One in-flight slot: its pages, and what it is doing.
#[derive(Debug)]
struct Slot {
    segs: Vec<BioSeg>,
    sector: u64,
    at: Instant,
    busy: bool,
}

/// A running job.
#[derive(Debug)]
pub struct BlockJob {
    spec: BlockJobSpec,
    dom: Arc<Domain>,
    slots: Vec<Slot>,
    next: u64,
    rng: u64,
    submitted: u64,
    /// Two pages of scratch: what a page holds, what it should.
    scratch: Box<[u8]>,
    want: Box<[u8]>,
}

impl BlockJob {
    /// Allocates each slot's pages in `dom`; refuses a size or depth the block layer
    /// cannot take.
    pub fn new(dom: &Arc<Domain>, spec: BlockJobSpec) -> Result<Self, BuildError> {
        let b = u64::from(spec.bytes);
        if b == 0 || b % SECTOR_SIZE != 0 || b > 128 * 1024 {
            return Err(other(format!(
                "block size {b}: a multiple of 512 up to 128 KiB"
            )));
        }
        if spec.depth == 0 || spec.depth > blk::blkfront::RING_IDS {
            return Err(other(format!("queue depth {}: 1 to 32", spec.depth)));
        }
        let per = b / SECTOR_SIZE;
        if spec.span.1 < spec.span.0 + per {
            return Err(other("the job's span holds no request"));
        }
        let pages = (spec.bytes as usize).div_ceil(PAGE_SIZE);
        let mut slots = Vec::with_capacity(spec.depth);
        for _ in 0..spec.depth {
            let mut segs = Vec::with_capacity(pages);
            let mut left = spec.bytes as usize;
            for _ in 0..pages {
                let gfn: Gfn = dom.alloc_page().map_err(other)?;
                let len = left.min(PAGE_SIZE);
                segs.push(BioSeg {
                    gfn,
                    offset: 0,
                    len: len as u16,
                });
                left -= len;
            }
            slots.push(Slot {
                segs,
                sector: 0,
                at: Instant::now(),
                busy: false,
            });
        }
        let rng = match spec.pattern {
            Pattern::Random(seed) => seed | 1,
            Pattern::Sequential => 1,
        };
        Ok(Self {
            next: spec.span.0,
            spec,
            dom: Arc::clone(dom),
            slots,
            rng,
            submitted: 0,
            scratch: vec![0u8; PAGE_SIZE].into_boxed_slice(),
            want: vec![0u8; PAGE_SIZE].into_boxed_slice(),
        })
    }

    /// The sector of the next request.
    fn next_sector(&mut self) -> u64 {
        let per = u64::from(self.spec.bytes) / SECTOR_SIZE;
        let (start, end) = self.spec.span;
        match self.spec.pattern {
            Pattern::Sequential => {
                if self.next + per > end {
                    self.next = start;
                }
                let s = self.next;
                self.next += per;
                s
            }
            Pattern::Random(_) => {
                self.rng ^= self.rng << 13;
                self.rng ^= self.rng >> 7;
                self.rng ^= self.rng << 17;
                let places = (end - start) / per;
                start + self.rng % places * per
            }
        }
    }

    /// Fills free slots with requests while the job has some left and the queue has
    /// room; returns how many it submitted (the caller kicks).
    pub fn submit(&mut self, front: &mut impl BlockQueue) -> usize {
        let _u = enter(Class::User);
        let mut n = 0;
        for i in 0..self.slots.len() {
            if self.slots[i].busy || self.spec.limit.is_some_and(|l| self.submitted >= l) {
                continue;
            }
            let sector = self.next_sector();
            let write = self.spec.op == JobOp::Write;
            if write {
                let mut at = sector * SECTOR_SIZE;
                for s in &self.slots[i].segs {
                    let len = usize::from(s.len);
                    (self.spec.fill)(at, &mut self.scratch[..len]);
                    let _ = self.dom.write(s.gfn, 0, &self.scratch[..len]);
                    at += len as u64;
                }
            }
            let slot = &mut self.slots[i];
            let bio = Bio {
                op: if write { BioOp::Write } else { BioOp::Read },
                sector,
                segs: &slot.segs,
            };
            slot.at = Instant::now();
            if front.submit(i as u64, &bio).is_err() {
                break;
            }
            slot.sector = sector;
            slot.busy = true;
            self.submitted += 1;
            self.spec.counters.submitted.fetch_add(1, Ordering::Relaxed);
            n += 1;
        }
        n
    }

    /// A completion: its latency kept, a read's every byte checked.
    pub fn done(&mut self, c: Completion) {
        let Some(slot) = self.slots.get_mut(c.tag as usize).filter(|s| s.busy) else {
            self.spec
                .counters
                .unexpected
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        slot.busy = false;
        let ns = slot.at.elapsed().as_nanos() as u64;
        self.spec.latencies.push(ns);
        let k = &self.spec.counters;
        k.completed.fetch_add(1, Ordering::Relaxed);
        if !c.ok() {
            k.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        k.bytes
            .fetch_add(u64::from(self.spec.bytes), Ordering::Relaxed);
        if self.spec.op == JobOp::Read && self.spec.verify {
            let _u = enter(Class::User);
            let mut at = slot.sector * SECTOR_SIZE;
            let mut good = true;
            for s in &slot.segs {
                let len = usize::from(s.len);
                if self.dom.read(s.gfn, 0, &mut self.scratch[..len]).is_err() {
                    good = false;
                    break;
                }
                (self.spec.expect)(at, &mut self.want[..len]);
                good &= self.scratch[..len] == self.want[..len];
                at += len as u64;
            }
            if !good {
                k.corrupt.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Whether the job has submitted all it was to.
    pub fn finished(&self) -> bool {
        self.spec.limit.is_some_and(|l| self.submitted >= l)
    }

    /// Whether requests are in flight.
    pub fn busy(&self) -> bool {
        self.slots.iter().any(|s| s.busy)
    }

    /// Issues again every request in flight, each under its tag with its sector and
    /// pages as first issued (a write's pages still hold what it writes), to a front end
    /// that has just reconnected to a new back end: what Linux's blkfront does in
    /// `blkif_recover`. Its latency still counts from the first issue. Returns how many
    /// went; one the queue refused waits for [`BlockJob::resubmit`] again.
    pub fn resubmit(&mut self, front: &mut impl BlockQueue) -> usize {
        let mut n = 0;
        for (i, slot) in self.slots.iter().enumerate().filter(|(_, s)| s.busy) {
            let bio = Bio {
                op: match self.spec.op {
                    JobOp::Write => BioOp::Write,
                    JobOp::Read => BioOp::Read,
                },
                sector: slot.sector,
                segs: &slot.segs,
            };
            if front.submit(i as u64, &bio).is_err() {
                break;
            }
            n += 1;
        }
        n
    }

    /// Fails every request in flight (its back end is gone past the bound): each
    /// completes once, with an error.
    pub fn fail_in_flight(&mut self) -> usize {
        let mut n = 0;
        for tag in 0..self.slots.len() {
            if self.slots[tag].busy {
                self.done(Completion {
                    tag: tag as u64,
                    status: blk::blkif::BLKIF_RSP_ERROR,
                });
                n += 1;
            }
        }
        n
    }
}

/// How long a guest waits for a back end that went away (its driver domain died)
/// before it fails what was in flight with an error; requests keep waiting for a new
/// back end after that. Linux's blkfront waits for ever; a bound is what a user of a
/// disk would rather have, and the AoE initiator's own bound is the same.
pub const RECONNECT_BOUND: Duration = Duration::from_secs(5);

/// What the guest's block layer counted of its back ends coming and going.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryStats {
    /// Back ends lost (closed, or their directory gone) while connected.
    pub backend_lost: u64,
    /// Connections to a back end after one was lost.
    pub reconnects: u64,
    /// Requests issued again to a new back end.
    pub requeued: u64,
    /// Requests failed because no back end came back within [`RECONNECT_BOUND`].
    pub failed_unreconnected: u64,
}

hv::counter_set!(RecoveryStats {
    backend_lost,
    reconnects,
    requeued,
    failed_unreconnected
});

/// A guest whose one device is a virtual disk: blkfront and a job above it.
///
/// It watches its back end as Linux's blkfront does (`backend_changed`): when the back
/// end closes or vanishes (its driver domain died), blkfront lets go of the ring and
/// its grants, the requests in flight stay the job's, and when the toolstack points the
/// device at a new back end that waits for it (`InitWait`), blkfront connects and every
/// request in flight is issued again. A back end that does not come back within
/// [`RECONNECT_BOUND`] fails them with an error.
#[derive(Debug)]
pub struct BlockGuest {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    devid: u32,
    persistent: bool,
    front: Option<Blkfront>,
    /// The front end's own directory's watch: the toolstack re-points `backend` there
    /// when a new driver domain takes the disk. It wakes the vCPU.
    fwatch: Receiver<WatchEvent>,
    /// The back end's directory, as the front end's `backend` key last said, and its
    /// state's watch (it wakes the vCPU).
    otherend: Option<(String, Receiver<WatchEvent>)>,
    /// The back end's directory blkfront is connected to.
    serving: Option<String>,
    /// When the back end was lost (the kernel's clock), while no new one has taken
    /// over; and whether what was in flight has been failed since.
    lost: Option<(Duration, bool)>,
    recovery: RecoveryStats,
    job: BlockJob,
    /// Why connecting failed, if it did.
    connect_error: Option<String>,
}

/// The watches' token.
const OTHEREND: &str = "blkfront-otherend";

impl BlockGuest {
    /// The guest's kernel over a connected front end.
    pub fn new(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        front: Blkfront,
        job: BlockJobSpec,
    ) -> Result<Self, BuildError> {
        let (devid, persistent) = (front.devid(), front.persistent());
        let mut g = Self::waiting(hv, dom, devid, persistent, job)?;
        g.front = Some(front);
        g.serving = g.otherend.as_ref().map(|(d, _)| d.clone());
        Ok(g)
    }

    /// The guest's kernel before its back end is ready (a remote disk still being
    /// found): blkfront connects from the guest's own loop once the back end waits.
    pub fn waiting(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        devid: u32,
        persistent: bool,
        job: BlockJobSpec,
    ) -> Result<Self, BuildError> {
        let fdir = blk::xenbus::frontend_dir(dom.id(), devid);
        let fwatch = hv
            .store()
            .watch_waking(
                dom.id(),
                &format!("{fdir}/backend"),
                OTHEREND,
                Some(waker(hv, dom)),
            )
            .map_err(other)?;
        let mut g = Self {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
            devid,
            persistent,
            front: None,
            fwatch,
            otherend: None,
            serving: None,
            lost: None,
            recovery: RecoveryStats::default(),
            job: BlockJob::new(dom, job)?,
            connect_error: None,
        };
        g.follow_backend();
        Ok(g)
    }

    /// Reads where the front end's `backend` key points and watches that directory's
    /// state (again, if it moved). Returns the back end's state as it is now.
    fn follow_backend(&mut self) -> XenbusState {
        let (store, me) = (self.hv.store(), self.dom.id());
        let fdir = blk::xenbus::frontend_dir(me, self.devid);
        let Ok(bdir) = store.read(me, &format!("{fdir}/backend")) else {
            return XenbusState::Unknown;
        };
        if self.otherend.as_ref().is_none_or(|(d, _)| *d != bdir) {
            if let Some((old, _)) = self.otherend.take() {
                store.unwatch(me, &format!("{old}/state"), OTHEREND);
            }
            let w = store.watch_waking(
                me,
                &format!("{bdir}/state"),
                OTHEREND,
                Some(waker(&self.hv, &self.dom)),
            );
            match w {
                Ok(w) => self.otherend = Some((bdir.clone(), w)),
                Err(e) => {
                    self.connect_error = Some(e.to_string());
                    return XenbusState::Unknown;
                }
            }
        }
        // The events only woke the vCPU; the state is read as it is now.
        if let Some((_, w)) = &self.otherend {
            let _ = w.try_iter().count();
        }
        store.xenbus_state(me, &bdir)
    }

    /// Whether either watch has fired since it was last looked at.
    fn store_moved(&self) -> bool {
        let f = self.fwatch.try_iter().count() > 0;
        let b = self
            .otherend
            .as_ref()
            .is_some_and(|(_, w)| w.try_iter().count() > 0);
        f || b
    }

    /// The back end is gone: blkfront lets go of the ring and its grants (the
    /// hypervisor took back the dead domain's mappings), the requests in flight stay
    /// the job's, to be issued again.
    fn lose_backend(&mut self, now: Duration) {
        if let Some(f) = self.front.take() {
            f.close();
        }
        self.serving = None;
        self.recovery.backend_lost += 1;
        self.lost = Some((now, false));
    }

    /// Connects a waiting front end if its back end now waits for it; after a loss,
    /// issues again what was in flight.
    fn try_connect(&mut self) -> bool {
        if self.follow_backend() != XenbusState::InitWait {
            return false;
        }
        match Blkfront::connect(&self.hv, &self.dom, self.devid, self.persistent) {
            Ok(mut f) => {
                if self.lost.take().is_some() {
                    self.recovery.reconnects += 1;
                    let n = self.job.resubmit(&mut f);
                    self.recovery.requeued += n as u64;
                    if n > 0 {
                        f.kick();
                    }
                }
                self.front = Some(f);
                self.serving = self.otherend.as_ref().map(|(d, _)| d.clone());
                self.connect_error = None;
                true
            }
            Err(e) => {
                self.connect_error = Some(e.to_string());
                false
            }
        }
    }

    /// Past the bound without a back end: what was in flight fails, once.
    fn expire(&mut self, now: Duration) {
        if let Some((at, failed)) = &mut self.lost {
            if !*failed && now >= *at + RECONNECT_BOUND {
                *failed = true;
                let n = self.job.fail_in_flight();
                self.recovery.failed_unreconnected += n as u64;
            }
        }
    }

    /// The guest's block layer's counters of back ends lost and found.
    pub fn recovery(&self) -> RecoveryStats {
        self.recovery
    }
}

/// Kicks `dom`'s vCPU 0 (the store's event channel to a blocked guest).
fn waker(hv: &Arc<Hypervisor>, dom: &Arc<Domain>) -> hv::store::Wake {
    let (h, d) = (Arc::downgrade(hv), Arc::downgrade(dom));
    hv::store::Wake(Arc::new(move || {
        if let (Some(h), Some(d)) = (h.upgrade(), d.upgrade()) {
            h.kick_vcpu(&d, 0);
        }
    }))
}

impl Kernel for BlockGuest {
    const CLOCK: bool = false;

    // The event only wakes the vCPU; the poll takes the responses (blk-mq's
    // completion from the interrupt, folded into the poll step).
    fn event(&mut self, _v: &Vcpu, _port: Port) {}

    // A clock for the reconnect bound only: no timer is armed while a back end serves.
    fn wants_clock(&self) -> bool {
        true
    }

    fn next_timer(&self) -> Option<Duration> {
        match self.lost {
            Some((at, false)) => Some(at + RECONNECT_BOUND),
            _ => None,
        }
    }

    fn tick(&mut self, now: Duration) {
        self.expire(now);
    }

    fn poll(&mut self, now: Duration) -> Work {
        // One relaxed look at each watch's queue a pass; the store is read only when a
        // watch fired.
        if self.front.is_some() && self.store_moved() {
            let st = self.follow_backend();
            let moved = self.otherend.as_ref().map(|(d, _)| d) != self.serving.as_ref();
            if moved
                || !matches!(
                    st,
                    XenbusState::Connected | XenbusState::InitWait | XenbusState::Initialised
                )
            {
                self.lose_backend(now);
            }
        }
        if self.front.is_none() && !self.try_connect() {
            self.expire(now);
            return Work::default();
        }
        let Some(front) = self.front.as_mut() else {
            return Work::default();
        };
        let job = &mut self.job;
        let done = front.complete(|c| job.done(c));
        let sent = job.submit(front);
        if sent > 0 {
            front.kick();
        }
        Work {
            rx: done,
            tx: sent,
            ..Work::default()
        }
    }

    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        if let Some(f) = &self.front {
            c.add_set("blkfront", f.stats());
        }
        c.add(
            "blkfront",
            "connect_failed",
            u64::from(self.connect_error.is_some()),
        );
        let k = &self.job.spec.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        c.add("block job", "completed", l(&k.completed));
        c.add("block job", "errors", l(&k.errors));
        c.add("block job", "corrupt", l(&k.corrupt));
        c.add("block job", "bytes", l(&k.bytes));
        c.add("block job", "unexpected", l(&k.unexpected));
        c.add_set("blkfront recovery", &self.recovery);
        c
    }

    fn shutdown(mut self) -> Counters {
        let c = self.counters();
        if let Some(f) = self.front.take() {
            f.close();
        }
        c
    }
}
