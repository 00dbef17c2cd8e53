//! The SV-NIC's block virtualization service (paper 002 §VI-B): the remote virtual
//! block device's local back end running on the device's own cores, the paper's
//! device-centric design.
//!
//! A block engine (one more device engine, a unit on the device's pCPU) serves each guest's blkif ring and turns
//! its requests into ATA-over-Ethernet frames ([`blk::remote::RemoteVbd`]), with the
//! device's memory domain as the one that maps the guests' grants (the hypervisor puts
//! each mapping in the device's IOMMU context, so the device reaches exactly the pages
//! granted to it). The engine talks to the wire the way the board's firmware talks to
//! its network engines: through a queue pair of its own in device memory, a VIF no
//! guest sees, whose frames the egress contexts put on the link beside the guests' and
//! whose MAC the ingress contexts demultiplex to it. A target's answer is placed by
//! the engine straight from the receive buffer in device memory into the guest's
//! granted page, one copy, with no guest network stack and no host CPU on the way; the
//! guest learns of the response by its event channel.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::aoe::HEAD;
use blk::blkback::FrameAt;
use blk::initiator::Initiator;
use blk::remote::RemoteVbd;
use hv::sched::{Cx, SchedError, Scheduler, Step, Unit, UnitJoin, UnitSpec};
use hv::{Domain, Gfn, OwnPage};
use mem::PageAccess;

use super::device::Idle;
use super::vif::VifFront;

/// The block engine's counters.
#[derive(Debug, Default)]
pub struct BlockEngineStats {
    /// Frames taken from the engine's receive queue.
    pub frames_in: AtomicU64,
    /// Frames put on its send queue.
    pub frames_out: AtomicU64,
    /// Frames for no device (a tag naming none), or that could not be read.
    pub unclaimed: AtomicU64,
    /// Sends the send queue had no room for (the initiator sends them again).
    pub send_full: AtomicU64,
    /// Steps that found work.
    pub busy_steps: AtomicU64,
    /// Time those steps took, ns: the engine's work, without its polling.
    pub busy_ns: AtomicU64,
}

hv::atomic_counter_set!(BlockEngineStats => BlockEngineCounts {
    frames_in,
    frames_out,
    unclaimed,
    send_full,
    busy_steps,
    busy_ns,
});

/// What the block engine is given to run.
#[derive(Debug)]
pub struct BlockService {
    /// The remote devices, device `i`'s initiator with tag prefix `i`.
    pub vbds: Vec<RemoteVbd>,
    /// The engine's queue pair, seen from its side.
    pub front: VifFront<OwnPage>,
    /// The frame of each of the queue pair's receive pages, by index.
    pub rx_gfns: Vec<Gfn>,
    /// The device's memory domain (the receive pages are its own).
    pub device: Arc<Domain>,
    /// Whether it polls on or sleeps when idle.
    pub idle: Idle,
}

/// The running block engine: a unit on one of the machine's pCPUs.
#[derive(Debug)]
pub struct BlockEngine {
    stop: Arc<AtomicBool>,
    unit: Option<UnitJoin<Vec<RemoteVbd>>>,
    stats: Arc<BlockEngineStats>,
}

impl BlockEngine {
    /// Places the engine on pCPU `pcpu` of `sched`.
    pub fn start_on(svc: BlockService, sched: &Scheduler, pcpu: usize) -> Result<Self, SchedError> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(BlockEngineStats::default());
        // No signals: the engine polls its queue pair.
        let _ = svc.front.set_rx_signal(false);
        let engine = Engine {
            svc,
            stop: Arc::clone(&stop),
            stats: Arc::clone(&stats),
            head: vec![0u8; HEAD].into_boxed_slice(),
        };
        let unit = sched.place(pcpu, UnitSpec::named("svnic-block"), engine)?;
        Ok(Self {
            stop,
            unit: Some(unit),
            stats,
        })
    }

    /// Its counters.
    pub fn stats(&self) -> &Arc<BlockEngineStats> {
        &self.stats
    }

    /// Stops the engine and gives back its devices (for their counters and teardown).
    pub fn stop(mut self) -> Vec<RemoteVbd> {
        self.finish().unwrap_or_default()
    }

    fn finish(&mut self) -> Option<Vec<RemoteVbd>> {
        self.stop.store(true, Ordering::Release);
        let u = self.unit.take()?;
        u.wake();
        u.join().ok()
    }
}

impl Drop for BlockEngine {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// The engine as a unit.
struct Engine {
    svc: BlockService,
    stop: Arc<AtomicBool>,
    stats: Arc<BlockEngineStats>,
    /// Room for a frame's headers, copied out of device memory before they are judged.
    head: Box<[u8]>,
}

impl Unit for Engine {
    type Output = Vec<RemoteVbd>;

    /// Frames from the wire to their devices, each device's ring served and its frames
    /// sent. A step that finds nothing yields (polling, as the device's other engines
    /// do) or, when the device sleeps, idles until the next deadline of its
    /// initiators, a millisecond at most: no doorbell reaches this engine yet.
    fn step(&mut self, cx: &Cx) -> Step<Vec<RemoteVbd>> {
        if self.stop.load(Ordering::Acquire) {
            return Step::Done(std::mem::take(&mut self.svc.vbds));
        }
        let now = cx.now;
        let work = self.receive(now) + self.serve(now);
        if work > 0 {
            self.stats.busy_steps.fetch_add(1, Ordering::Relaxed);
            self.stats
                .busy_ns
                .fetch_add(now.elapsed().as_nanos() as u64, Ordering::Relaxed);
            return Step::More;
        }
        match self.svc.idle {
            Idle::Poll => Step::Yield,
            Idle::Block { .. } => {
                let nap = now + Duration::from_millis(1);
                let due = self.svc.vbds.iter().filter_map(|v| v.next_due()).min();
                Step::Idle(Some(due.map_or(nap, |d| d.min(nap))))
            }
        }
    }
}

impl Engine {
    /// Answers from the wire, each judged and placed while its slot is still the
    /// engine's (it goes back to the ingress contexts when `recv_at` returns).
    fn receive(&mut self, now: Instant) -> usize {
        let mut work = 0;
        let (stats, head) = (&self.stats, &mut self.head);
        let BlockService {
            vbds,
            front,
            rx_gfns,
            ..
        } = &mut self.svc;
        loop {
            let got = front.recv_at(|p: &OwnPage, page, offset, len| {
                let n = len.min(head.len());
                p.read(offset, &mut head[..n])?;
                let i = Initiator::tag_prefix_of(&head[..n]).map_or(usize::MAX, usize::from);
                Ok(match (vbds.get_mut(i), rx_gfns.get(page)) {
                    (Some(v), Some(&gfn)) => {
                        let at = FrameAt::Page { gfn, offset };
                        let _ = v.input(&head[..n], len, at, now, |_| false);
                        true
                    }
                    _ => false,
                })
            });
            match got {
                Ok(Some(claimed)) => {
                    work += 1;
                    stats.frames_in.fetch_add(1, Ordering::Relaxed);
                    if !claimed {
                        stats.unclaimed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(None) => return work,
                Err(_) => {
                    stats.unclaimed.fetch_add(1, Ordering::Relaxed);
                    return work;
                }
            }
        }
    }

    /// Each device's ring served and its frames (requests, retransmissions) sent.
    fn serve(&mut self, now: Instant) -> usize {
        let mut work = 0;
        let stats = &self.stats;
        for v in self.svc.vbds.iter_mut() {
            work += v.serve();
            let front = &mut self.svc.front;
            work += v.poll(now, |f| {
                if front.send(f).is_ok() {
                    stats.frames_out.fetch_add(1, Ordering::Relaxed);
                    true
                } else {
                    stats.send_full.fetch_add(1, Ordering::Relaxed);
                    false
                }
            });
        }
        work
    }
}
