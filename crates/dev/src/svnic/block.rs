//! The SV-NIC's block virtualization service (paper 002 §VI-B): the remote virtual
//! block device's local back end running on the device's own cores, the paper's
//! device-centric design.
//!
//! A block engine (one more device thread) serves each guest's blkif ring and turns
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
use std::thread::JoinHandle;
use std::time::Instant;

use blk::aoe::HEAD;
use blk::blkback::FrameAt;
use blk::initiator::Initiator;
use blk::remote::RemoteVbd;
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

impl net::counters::CounterSet for BlockEngineStats {
    fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        f("frames_in", l(&self.frames_in));
        f("frames_out", l(&self.frames_out));
        f("unclaimed", l(&self.unclaimed));
        f("send_full", l(&self.send_full));
        f("busy_steps", l(&self.busy_steps));
        f("busy_ns", l(&self.busy_ns));
    }
}

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
    /// The engine's core.
    pub core: Option<usize>,
    /// Whether it polls on or sleeps when idle.
    pub idle: Idle,
}

/// The running block engine.
#[derive(Debug)]
pub struct BlockEngine {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<RemoteVbd>>>,
    stats: Arc<BlockEngineStats>,
}

impl BlockEngine {
    /// Starts the engine's thread.
    pub fn start(svc: BlockService) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(BlockEngineStats::default());
        let (st, sp) = (Arc::clone(&stats), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("svnic-block".into())
            .spawn(move || run(svc, &sp, &st))?;
        Ok(Self {
            stop,
            thread: Some(thread),
            stats,
        })
    }

    /// Its counters.
    pub fn stats(&self) -> &Arc<BlockEngineStats> {
        &self.stats
    }

    /// Stops the thread and gives back its devices (for their counters and teardown).
    pub fn stop(mut self) -> Vec<RemoteVbd> {
        self.stop.store(true, Ordering::Release);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for BlockEngine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The engine's loop: frames from the wire to their devices, each device's ring
/// served and its frames sent; when a step finds nothing, yield (polling) or nap until
/// the next deadline (sleeping).
fn run(mut svc: BlockService, stop: &AtomicBool, stats: &BlockEngineStats) -> Vec<RemoteVbd> {
    if let Some(c) = svc.core {
        let _ = mem::cpu::pin_current_thread(c);
    }
    // No signals: the engine polls its queue pair.
    let _ = svc.front.set_rx_signal(false);
    let mut head = vec![0u8; HEAD].into_boxed_slice();
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let mut work = 0usize;
        // Answers from the wire, each judged and placed while its slot is still the
        // engine's (it goes back to the ingress contexts when `recv_at` returns).
        loop {
            let BlockService {
                vbds,
                front,
                rx_gfns,
                ..
            } = &mut svc;
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
                Ok(None) => break,
                Err(_) => {
                    stats.unclaimed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
        for v in svc.vbds.iter_mut() {
            work += v.serve();
            let front = &mut svc.front;
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
        if work > 0 {
            stats.busy_steps.fetch_add(1, Ordering::Relaxed);
            stats
                .busy_ns
                .fetch_add(now.elapsed().as_nanos() as u64, Ordering::Relaxed);
            continue;
        }
        match svc.idle {
            Idle::Poll => std::thread::yield_now(),
            Idle::Block { .. } => {
                // No doorbell reaches this engine yet: it naps to the next deadline,
                // a millisecond at most.
                let nap = svc.vbds.iter().filter_map(|v| v.next_due()).min().map_or(
                    std::time::Duration::from_millis(1),
                    |d| {
                        d.saturating_duration_since(Instant::now())
                            .min(std::time::Duration::from_millis(1))
                    },
                );
                std::thread::park_timeout(nap);
            }
        }
    }
    std::mem::take(&mut svc.vbds)
}
