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

use hv::store::{WatchEvent, XenbusState};
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
}

/// A front end not yet connected: it connects once its back end waits for it
/// (`InitWait`), as blkfront's `backend_changed` watch does.
#[derive(Debug)]
struct Waiting {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    devid: u32,
    persistent: bool,
    /// The back end's state node's watch (it wakes the vCPU).
    watch: Receiver<WatchEvent>,
    bdir: String,
}

/// A guest whose one device is a virtual disk: blkfront and a job above it.
#[derive(Debug)]
pub struct BlockGuest {
    front: Option<Blkfront>,
    waiting: Option<Waiting>,
    job: BlockJob,
    /// Why connecting failed, if it did.
    connect_error: Option<String>,
}

impl BlockGuest {
    /// The guest's kernel over a connected front end.
    pub fn new(dom: &Arc<Domain>, front: Blkfront, job: BlockJobSpec) -> Result<Self, BuildError> {
        Ok(Self {
            job: BlockJob::new(dom, job)?,
            front: Some(front),
            waiting: None,
            connect_error: None,
        })
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
        let store = hv.store();
        let fdir = blk::xenbus::frontend_dir(dom.id(), devid);
        let bdir = store
            .read(dom.id(), &format!("{fdir}/backend"))
            .map_err(other)?;
        let (h, d) = (Arc::downgrade(hv), Arc::downgrade(dom));
        let wake = hv::store::Wake(Arc::new(move || {
            if let (Some(h), Some(d)) = (h.upgrade(), d.upgrade()) {
                h.kick_vcpu(&d, 0);
            }
        }));
        let watch = store
            .watch_waking(
                dom.id(),
                &format!("{bdir}/state"),
                "blkfront-otherend",
                Some(wake),
            )
            .map_err(other)?;
        Ok(Self {
            job: BlockJob::new(dom, job)?,
            front: None,
            waiting: Some(Waiting {
                hv: Arc::clone(hv),
                dom: Arc::clone(dom),
                devid,
                persistent,
                watch,
                bdir,
            }),
            connect_error: None,
        })
    }

    /// Connects a waiting front end if its back end now waits for it.
    fn try_connect(&mut self) -> bool {
        let Some(w) = &self.waiting else {
            return false;
        };
        // The events only woke the vCPU; the state is read as it is now.
        let _ = w.watch.try_iter().count();
        let st = w.hv.store().xenbus_state(w.dom.id(), &w.bdir);
        if st != XenbusState::InitWait {
            return false;
        }
        match Blkfront::connect(&w.hv, &w.dom, w.devid, w.persistent) {
            Ok(f) => {
                self.front = Some(f);
                let me = w.dom.id();
                w.hv.store()
                    .unwatch(me, &format!("{}/state", w.bdir), "blkfront-otherend");
                self.waiting = None;
                true
            }
            Err(e) => {
                self.connect_error = Some(e.to_string());
                self.waiting = None;
                false
            }
        }
    }
}

impl Kernel for BlockGuest {
    const CLOCK: bool = false;

    // The event only wakes the vCPU; the poll takes the responses (blk-mq's
    // completion from the interrupt, folded into the poll step).
    fn event(&mut self, _v: &Vcpu, _port: Port) {}

    fn poll(&mut self, _now: Duration) -> Work {
        if self.front.is_none() && !self.try_connect() {
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
