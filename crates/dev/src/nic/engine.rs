//! The NIC's engine: the device side of the register file, run as a thread or as a
//! unit on a pCPU. Each step takes frames from the wire, places them by filter into
//! the receive queues' descriptors through the IOMMU (non-temporal stores), raises the
//! queues' interrupts as moderation allows, and sends what the driver posted on the
//! transmit ring, cutting large segments when it offloads them.

use crate::irq::IrqLine;
use crate::wire::{WireSink, WireSource};
use hv::iommu::DmaContext;
use hv::{DeviceId, Iova};
use net::offload::{Csum, Offload, MAX_HEADERS};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::fifo::RxFifo;
pub use super::fifo::GUEST_QUEUE_HOLD;
use super::*;

#[derive(Debug, Clone, Copy)]
pub(super) struct NoRoom {
    pub(super) q: usize,
    pub(super) tail: u32,
}

pub(super) struct Device {
    pub(super) regs: Arc<NicRegs>,
    pub(super) dma: DmaContext,
    pub(super) coalesce: Coalesce,
    pub(super) rxq: Vec<RxQueue>,
    pub(super) tx_head: u32,
    pub(super) frame: Vec<u8>,
    /// The offload of the packet being sent (from its context descriptor).
    pub(super) tx_off: Offload,
    /// A received frame being finished for a guest queue, and one frame cut from it
    /// (or from a packet being sent).
    pub(super) scratch: Vec<u8>,
    pub(super) seg: Vec<u8>,
    /// The descriptors one received frame takes and the bytes each gets (reused, not
    /// zeroed per frame).
    pub(super) rx_descs: [(Iova, Desc); MAX_RX_DESCS_PER_FRAME],
    pub(super) rx_lens: [u16; MAX_RX_DESCS_PER_FRAME],
    /// Frames wait with a holding source for want of a descriptor: its readiness is
    /// not work until the driver refills (which wakes the device).
    pub(super) holding: bool,
    /// The receive packet buffer: frames from the cable or looped back by the driver
    /// wait there while their queue has no free descriptor.
    pub(super) fifo: RxFifo,
    /// A frame of several of the buffer's chunks, gathered to be placed.
    pub(super) fifo_frame: Vec<u8>,
    /// Since when the cable's far end has been paused (802.3x XOFF), if it has.
    pub(super) xoff: Option<Instant>,
}

/// The device's own state of one receive queue.
#[derive(Debug, Default)]
pub(super) struct RxQueue {
    /// Its interrupt line (MSI-X vector); a queue without one cannot be enabled.
    pub(super) irq: Option<IrqLine>,
    pub(super) head: u32,
    pub(super) pending: u32,
    pub(super) first_pending: Option<Instant>,
    pub(super) last_pending: Option<Instant>,
    /// A guest queue: since when a frame for it has waited with the source for want of
    /// a buffer (flow control, bounded by [`GUEST_QUEUE_HOLD`]).
    pub(super) starved_since: Option<Instant>,
    /// The queue's tail when a frame of it was dropped from the packet buffer, its wait
    /// run out: until the driver moves the tail, the queue is stuck, and what comes for
    /// it is dropped at once rather than kept (so that a guest that posts nothing
    /// neither fills the buffer again nor pauses the cable again).
    pub(super) stuck_at: Option<u32>,
}

impl RxQueue {
    pub(super) fn reset(&mut self) {
        self.head = 0;
        self.pending = 0;
        self.first_pending = None;
        self.last_pending = None;
        self.starved_since = None;
        self.stuck_at = None;
    }
}

/// The bytes a receive descriptor's buffer holds: its length field, 0 meaning a full
/// frame.
#[inline]
fn desc_room(d: &Desc) -> usize {
    if d.len == 0 {
        MAX_FRAME
    } else {
        usize::from(d.len)
    }
}

pub(super) fn desc_iova(base: u64, i: u32) -> Iova {
    Iova(base + (i % RING_DESCS) as u64 * DESC_SIZE as u64)
}

impl Device {
    /// Fresh registers (interrupt moderation as `coalesce` says) and the device on them.
    pub(super) fn with_regs(
        hv: &Arc<hv::Hypervisor>,
        dev: DeviceId,
        coalesce: Coalesce,
        irqs: Vec<IrqLine>,
    ) -> (Arc<NicRegs>, Self) {
        let regs = Arc::new(NicRegs::new());
        for q in &regs.rxq {
            q.itr_pkts
                .store(coalesce.pkts_per_irq.max(1), Ordering::Relaxed);
        }
        let d = Device::new(Arc::clone(&regs), hv.iommu().device(dev), coalesce, irqs);
        (regs, d)
    }

    pub(super) fn new(
        regs: Arc<NicRegs>,
        dma: DmaContext,
        coalesce: Coalesce,
        irqs: Vec<IrqLine>,
    ) -> Self {
        let mut rxq: Vec<RxQueue> = (0..RX_QUEUES).map(|_| RxQueue::default()).collect();
        for (q, irq) in rxq.iter_mut().zip(irqs) {
            q.irq = Some(irq);
        }
        Self {
            regs,
            dma,
            coalesce,
            rxq,
            tx_head: 0,
            frame: vec![0; 65536],
            tx_off: Offload::NONE,
            scratch: vec![0; 65536],
            seg: vec![0; 2048],
            rx_descs: [(Iova(0), Desc::default()); MAX_RX_DESCS_PER_FRAME],
            rx_lens: [0; MAX_RX_DESCS_PER_FRAME],
            holding: false,
            fifo: RxFifo::new(),
            fifo_frame: vec![0; super::RX_FIFO_RESERVE],
            xoff: None,
        }
    }

    /// One pass of the device: a reset taken, frames due from the wire received,
    /// descriptors the driver posted sent, interrupts raised; then what it waits for:
    /// `None` to run again at once, or `Some(until)`: the instant the next frame or
    /// interrupt is due, or (`Some(None)`) nothing at all but a wake-up (a doorbell, a
    /// refill, a frame on the wire, a register change), so that an idle device takes no
    /// timer.
    pub(super) fn pass(
        &mut self,
        source: &mut dyn WireSource,
        sink: &mut dyn WireSink,
        resets: &mut u64,
    ) -> Option<Option<Instant>> {
        let regs = Arc::clone(&self.regs);
        let r = regs.resets.load(Ordering::Acquire);
        if r != *resets {
            *resets = r;
            self.rxq.iter_mut().for_each(RxQueue::reset);
            self.fifo.clear();
            self.tx_head = 0;
        }
        regs.iterations.fetch_add(1, Ordering::AcqRel);
        regs.iotlb_hits.store(self.dma.hits, Ordering::Relaxed);
        regs.iotlb_misses.store(self.dma.misses, Ordering::Relaxed);
        let now = Instant::now();
        let mut again = false;
        if regs.enabled.load(Ordering::Acquire) {
            // Frames kept in the device go ahead of the cable's.
            if !self.fifo.is_empty() {
                again = self.drain_fifo(now);
            }
            self.maybe_xon(source, now);
            if regs.link_up.load(Ordering::Acquire) {
                if source.holds() {
                    self.receive_held(source, now);
                } else if source.pauses() {
                    self.receive_paced(source, now);
                } else {
                    source.poll(now, &mut |f, off| self.receive(f, off));
                }
            }
            self.transmit(sink);
        }
        let now = Instant::now();
        // Until the next frame is due or the oldest completion's interrupt, or (idle)
        // until a doorbell. A paused far end has nothing due: the refill that makes
        // room wakes the device.
        let mut wake = if regs.link_up.load(Ordering::Acquire) && self.xoff.is_none() {
            source.next_due()
        } else {
            None
        };
        if let Some(d) = self.fifo.due() {
            wake = Some(wake.map_or(d, |w| w.min(d)));
        }
        for q in 0..RX_QUEUES {
            if let Some(t) = self.rxq[q].starved_since.filter(|_| self.holding) {
                // A guest queue's hold runs out even if it never posts.
                let d = t + GUEST_QUEUE_HOLD;
                wake = Some(wake.map_or(d, |w| w.min(d)));
            }
            self.maybe_interrupt(q, now);
            if self.rxq[q].pending > 0 {
                // With interrupts off the driver is polling and will see the
                // completions anyway; look again after a coalescing period.
                let from = if regs.rxq[q].irq_enabled.load(Ordering::Acquire) {
                    self.delay_start(q).unwrap_or(now)
                } else {
                    now
                };
                let d = from + self.coalesce.max_delay;
                wake = Some(wake.map_or(d, |w| w.min(d)));
            }
        }
        let now = Instant::now();
        if again || std::mem::take(&mut self.fifo.again) || wake.is_some_and(|w| w <= now) {
            return None;
        }
        // Announce the sleep, then look once more: a doorbell or a frame that came
        // before the flag was seen must not be slept through. The fences pair with the
        // doorbell's and the wire's (store, fence, load on each side), so that one of
        // the two always sees the other.
        regs.doze.announce();
        let work = regs.tx_tail.load(Ordering::SeqCst) % RING_DESCS != self.tx_head
            || regs.stop.load(Ordering::Acquire)
            || (source.ready() && !self.holding && regs.link_up.load(Ordering::Acquire));
        if work {
            regs.doze.awake();
            return None;
        }
        // The wire is asked again: a frame put on it since the first look (its wake-up
        // found the device not yet asleep) is due in its serialization time, not at the
        // idle timeout.
        let due = if regs.link_up.load(Ordering::Acquire) && self.xoff.is_none() {
            source.next_due()
        } else {
            None
        };
        Some(match (wake, due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    /// The device on a thread of its own: passes, parked between them.
    pub(super) fn run(
        mut self,
        mut source: Box<dyn WireSource>,
        mut sink: Box<dyn WireSink>,
    ) -> Box<dyn WireSource> {
        let _ = mem::cpu::set_timer_slack(1_000);
        let regs = Arc::clone(&self.regs);
        source.attach(&regs.doze);
        let mut resets = regs.resets.load(Ordering::Acquire);
        while !regs.stop.load(Ordering::Acquire) {
            match self.pass(source.as_mut(), sink.as_mut(), &mut resets) {
                None => {}
                Some(Some(until)) => {
                    std::thread::park_timeout(until.saturating_duration_since(Instant::now()));
                    regs.doze.awake();
                }
                Some(None) => {
                    std::thread::park();
                    regs.doze.awake();
                }
            }
        }
        source.close();
        source
    }

    /// Where the coalescing delay of queue `q`'s pending completions counts from.
    pub(super) fn delay_start(&self, q: usize) -> Option<Instant> {
        match self.coalesce.delay_from {
            DelayFrom::FirstPacket => self.rxq[q].first_pending,
            DelayFrom::LastPacket => self.rxq[q].last_pending,
        }
    }

    /// Queue `q`'s completions per interrupt, as the driver last set them.
    pub(super) fn itr(&self, q: usize) -> u32 {
        self.regs.rxq[q].itr_pkts.load(Ordering::Relaxed).max(1)
    }

    pub(super) fn complete(&mut self, q: usize, now: Instant) {
        let st = &mut self.rxq[q];
        if st.pending == 0 {
            st.first_pending = Some(now);
        }
        st.last_pending = Some(now);
        st.pending += 1;
        // The count, and the delay too: the moderation timer runs on its own in a
        // NIC, so a long burst of work (a ring of large packets cut into frames) must
        // not hold back an interrupt that is due.
        self.maybe_interrupt(q, now);
    }

    pub(super) fn maybe_interrupt(&mut self, q: usize, now: Instant) {
        if self.rxq[q].pending == 0 || !self.regs.rxq[q].irq_enabled.load(Ordering::Acquire) {
            return;
        }
        let count = self.rxq[q].pending >= self.itr(q);
        let deadline = self.delay_start(q).map(|t| t + self.coalesce.max_delay);
        let timer = !count && deadline.is_some_and(|d| now >= d);
        if timer {
            let late = deadline.map_or(0, |d| now.duration_since(d).as_nanos() as u64);
            self.regs.timer_irqs.fetch_add(1, Ordering::Relaxed);
            self.regs.timer_late_ns.fetch_add(late, Ordering::Relaxed);
        }
        if count || timer {
            let st = &mut self.rxq[q];
            st.pending = 0;
            st.first_pending = None;
            st.last_pending = None;
            self.regs.irqs.fetch_add(1, Ordering::Relaxed);
            self.regs.rxq[q].irqs.fetch_add(1, Ordering::Relaxed);
            if let Some(irq) = &st.irq {
                irq.raise();
            }
        }
    }

    /// Frames from a source that holds them (a TAP), as long as the default queue has
    /// room: the first refused stays with the source, and the device pauses it until
    /// the driver's next RX tail write (link-level flow control: what cannot be
    /// received is not read, rather than read and dropped).
    pub(super) fn receive_held(&mut self, source: &mut dyn WireSource, now: Instant) {
        let mut refused = None;
        source.poll_held(now, &mut |f, off| match self.take(f, off) {
            Ok(()) => true,
            // A guest's own queue without room holds its frame with the source for a
            // while (flow control), then drops what comes for it until it posts again,
            // as a VMDq NIC's queue with drop enabled does: one guest that posts no
            // buffers pauses the cable for the others only that long.
            Err(e) if e.q != 0 => {
                let since = *self.rxq[e.q].starved_since.get_or_insert(now);
                if now.saturating_duration_since(since) < GUEST_QUEUE_HOLD {
                    refused = Some(e);
                    false
                } else {
                    self.missed(e);
                    true
                }
            }
            Err(e) => {
                refused = Some(e);
                false
            }
        });
        self.holding = false;
        let Some(e) = refused else {
            return;
        };
        // Pause, then look at the tail again: a refill that came before the flag was
        // up did not see it (SeqCst on both sides; see `NicRegs::set_rx_tail`).
        self.regs.rx_paused.store(true, Ordering::SeqCst);
        if self.regs.rxq[e.q].tail.load(Ordering::SeqCst) == e.tail {
            self.holding = true;
            self.regs.rx_pauses.fetch_add(1, Ordering::Relaxed);
        } else {
            self.regs.rx_paused.store(false, Ordering::Relaxed);
        }
    }

    /// Frames from a far end that takes PAUSE frames, while it is not paused: each is
    /// received as a cable's is, and once the packet buffer's room for its fullest
    /// queue falls under [`super::RX_FIFO_XOFF`] the device pauses the far end (an
    /// 802.3x XOFF, as the 82599 sends one at its high-water mark) and refuses what it
    /// would still have sent, which stays first in its line. [`Self::maybe_xon`] lets
    /// it go. A queue that is stuck (its frames' wait ran out) drops its frames at once
    /// and fills nothing, so it cannot keep the cable paused.
    pub(super) fn receive_paced(&mut self, source: &mut dyn WireSource, now: Instant) {
        if self.xoff.is_some() {
            return;
        }
        source.poll_held(now, &mut |f, off| {
            if self.xoff.is_some() {
                return false;
            }
            self.receive(f, off);
            if !self.fifo.is_empty() && self.fifo.room() < super::RX_FIFO_XOFF {
                self.xoff = Some(Instant::now());
                self.regs.rx_xoffs.fetch_add(1, Ordering::Relaxed);
            }
            true
        });
        if let Some(at) = self.xoff {
            source.pause(true, at);
        }
    }

    /// Lets a paused far end go (an XON) once the packet buffer has
    /// [`super::RX_FIFO_XON`] of room again for its fullest queue, and accounts the
    /// pause.
    fn maybe_xon(&mut self, source: &mut dyn WireSource, now: Instant) {
        let Some(since) = self.xoff else {
            return;
        };
        if self.fifo.room() < super::RX_FIFO_XON {
            return;
        }
        self.xoff = None;
        source.pause(false, now);
        let us = now.saturating_duration_since(since).as_micros() as u64;
        self.regs.rx_xoff_us.fetch_add(us, Ordering::Relaxed);
        self.regs
            .rx_xoff_longest_us
            .fetch_max(us, Ordering::Relaxed);
    }

    /// A frame from the wire, with what rides beside it: into the free descriptors'
    /// buffers of the queue its destination is steered to. Metadata from the cable is
    /// checked against the frame first, like anything from outside. A frame whose
    /// queue has no room (or has frames waiting already, which it goes behind) waits
    /// in the device's packet buffer; one the buffer has no room for is dropped on the
    /// queue.
    pub(super) fn receive(&mut self, frame: &[u8], off: Offload) {
        if let Err(e) = self.take(frame, off) {
            self.hold(e, frame, off, false);
        }
    }

    /// Queue `q`'s lack of room, as its tail stands now.
    fn no_room(&self, q: usize) -> NoRoom {
        NoRoom {
            q,
            tail: self.regs.rxq[q].tail.load(Ordering::SeqCst),
        }
    }

    /// A frame from the wire: taken (received, or dropped for a reason no refill
    /// cures), or refused for want of a free descriptor on its queue (or because frames
    /// of its queue wait in the device already), to stay first in a holding source's
    /// line or to wait in the device.
    pub(super) fn take(&mut self, frame: &[u8], off: Offload) -> Result<(), NoRoom> {
        if !self.admit(frame, off) {
            return Ok(());
        }
        let q = self.regs.classify(frame);
        self.receive_in_turn(q, frame, off)
    }

    /// As [`Self::receive_or_refuse`], behind the frames of queue `q` already waiting
    /// in the device: refused while there are any (order kept).
    fn receive_in_turn(&mut self, q: usize, frame: &[u8], off: Offload) -> Result<(), NoRoom> {
        if self.fifo.holds_for(q) {
            return Err(self.no_room(q));
        }
        self.receive_or_refuse(q, frame, off)
    }

    /// Whether a frame and what rides beside it may be received: offload metadata the
    /// frame's headers do not bear out, or a frame too long without GSO, is counted and
    /// dropped.
    fn admit(&self, frame: &[u8], off: Offload) -> bool {
        let regs = &self.regs;
        let partial = matches!(off.csum, Csum::Partial { .. });
        if (partial || off.gso.is_some())
            && net::offload::validate(&off, &frame[..frame.len().min(MAX_HEADERS)], frame.len())
                .is_err()
        {
            regs.rx_bad_offload.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        if frame.len() > MAX_FRAME && off.gso.is_none() {
            regs.rx_oversize.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// A checked frame into queue `q`, or the queue's lack of room.
    pub(super) fn receive_or_refuse(
        &mut self,
        q: usize,
        frame: &[u8],
        off: Offload,
    ) -> Result<(), NoRoom> {
        let partial = matches!(off.csum, Csum::Partial { .. });
        if let Some(g) = off.gso.filter(|_| q != 0) {
            let whole = self.regs.rxq[q].whole.load(Ordering::Acquire);
            if whole & 1u32.checked_shl(u32::from(g.ty)).unwrap_or(0) != 0 {
                return self.receive_whole(q, frame, off);
            }
        }
        if q != 0 && (partial || off.gso.is_some()) {
            // A guest queue that takes no large frames gets what a cable of MTU-sized
            // frames would have brought, checksums complete. A large segment is cut
            // only once the queue has a buffer for every frame of it, so that none is
            // lost for want of one (flow control holds it meanwhile).
            let head = &frame[..frame.len().min(MAX_HEADERS)];
            let frames = match (off.gso, net::offload::checksum_setup(head, frame.len())) {
                (Some(g), Ok(l4)) => (frame.len() - l4.headers())
                    .div_ceil(usize::from(g.size).max(1))
                    .max(1),
                _ => 1,
            };
            self.room_for(q, frames)?;
            self.receive_cut(q, frame, off);
            return Ok(());
        }
        self.receive_one(q, frame, off)
    }

    /// Whether queue `q` has at least `n` free descriptors (a frame cut up takes one
    /// each, as each fits a buffer); its lack of room if not.
    fn room_for(&self, q: usize, n: usize) -> Result<(), NoRoom> {
        let tail = self.regs.rxq[q].tail.load(Ordering::Acquire);
        let free = (tail + RING_DESCS - self.rxq[q].head) % RING_DESCS;
        if (free as usize) < n {
            return Err(NoRoom { q, tail });
        }
        Ok(())
    }

    /// Counts a frame dropped for want of a descriptor on its queue.
    pub(super) fn missed(&self, e: NoRoom) {
        self.regs.rxq[e.q].missed.fetch_add(1, Ordering::Relaxed);
        self.regs.rx_missed.fetch_add(1, Ordering::Relaxed);
        self.regs.rx_missed_log.note(Instant::now());
    }

    /// Cuts a large or partially checksummed frame into complete frames for queue `q`.
    pub(super) fn receive_cut(&mut self, q: usize, frame: &[u8], off: Offload) {
        let (mut scratch, mut seg) = (
            std::mem::take(&mut self.scratch),
            std::mem::take(&mut self.seg),
        );
        let f = &mut scratch[..frame.len()];
        f.copy_from_slice(frame);
        if let Ok(l4) = net::offload::checksum_setup(&f[..f.len().min(MAX_HEADERS)], f.len()) {
            let done = match off.gso {
                Some(g) => net::offload::segment_tcp(f, &l4, g.size.into(), &mut seg, |s| {
                    self.regs.rx_cut.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = self.receive_one(q, s, Offload::NONE) {
                        self.missed(e);
                    }
                })
                .is_ok(),
                None => {
                    let ok = net::offload::fill_partial(f, l4.l4, l4.csum_offset).is_ok();
                    if ok {
                        self.regs.rx_cut.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = self.receive_one(q, f, Offload::NONE) {
                            self.missed(e);
                        }
                    }
                    ok
                }
            };
            if !done {
                self.regs.rx_bad_offload.fetch_add(1, Ordering::Relaxed);
            }
        }
        (self.scratch, self.seg) = (scratch, seg);
    }

    /// One frame into queue `q`: as many descriptors as its length needs (each
    /// descriptor's buffer as long as its length field says; 0 means a full frame),
    /// data first (non-temporal, fenced), then the write-backs from the last to the
    /// first, so that the driver never sees the first done before the rest. The last
    /// carries end-of-packet and the offload. A frame without enough free descriptors
    /// is dropped whole, nothing written.
    pub(super) fn receive_one(
        &mut self,
        q: usize,
        frame: &[u8],
        off: Offload,
    ) -> Result<(), NoRoom> {
        self.place(q, frame, off, false)
    }

    /// A large frame into a guest queue that takes it whole: its first buffer, then a
    /// descriptor left for its context (the offload, in the write-back's address field,
    /// the buffer unwritten), then the rest of its bytes ([`DESC_CTX_NEXT`]). Its
    /// checksum stays partial, as it came. Without descriptors for all of it, nothing
    /// is written and the frame waits (or is dropped) as a whole.
    fn receive_whole(&mut self, q: usize, frame: &[u8], off: Offload) -> Result<(), NoRoom> {
        self.place(q, frame, off, true)
    }

    /// One frame into queue `q`'s descriptors, with a context descriptor second if
    /// `whole`.
    fn place(&mut self, q: usize, frame: &[u8], off: Offload, whole: bool) -> Result<(), NoRoom> {
        let regs = Arc::clone(&self.regs);
        let qr = &regs.rxq[q];
        // Queue 0 is on whenever the device is; another only once enabled, with a line.
        let on = q == 0 || (qr.enabled.load(Ordering::Acquire) && self.rxq[q].irq.is_some());
        if !on {
            qr.missed.fetch_add(1, Ordering::Relaxed);
            regs.rx_missed.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let Some((k, h)) = self.gather_descs(q, frame.len(), whole)? else {
            return Ok(());
        };
        // Data first. A write that faults (part of it may have landed) completes every
        // descriptor of the frame with the error bit and no length, so the driver
        // drops it and recycles the buffers instead of handing up what they held.
        let failed = !self.write_data(k, frame, whole);
        if failed {
            regs.dma_faults.fetch_add(1, Ordering::Relaxed);
            regs.rx_dma_errors.fetch_add(1, Ordering::Relaxed);
        }
        let written = if whole {
            self.write_backs_whole(k, off, failed)
        } else {
            self.write_backs(k, frame, off, failed)
        };
        if !written {
            regs.dma_faults.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.rxq[q].head = h;
        self.rxq[q].starved_since = None;
        qr.frames.fetch_add(1, Ordering::Relaxed);
        regs.rx_frames.fetch_add(1, Ordering::Relaxed);
        if !failed {
            regs.rx_bytes
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            if off.gso.is_some() {
                regs.rx_gso.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.complete(q, Instant::now());
        Ok(())
    }

    /// Reads queue `q`'s free descriptors from its head until their buffers hold
    /// `len` bytes (with `ctx`, the second holds none: it is the frame's context).
    /// Returns how many and the head after them; `None` if the frame is dropped
    /// (descriptors too short for it, counted; a descriptor read that faulted,
    /// counted); `NoRoom` if the driver has not posted enough yet.
    #[inline]
    fn gather_descs(
        &mut self,
        q: usize,
        len: usize,
        ctx: bool,
    ) -> Result<Option<(usize, u32)>, NoRoom> {
        let regs = &self.regs;
        let qr = &regs.rxq[q];
        let tail = qr.tail.load(Ordering::Acquire);
        let head = self.rxq[q].head;
        if head == tail {
            return Err(NoRoom { q, tail });
        }
        let base = qr.base.load(Ordering::Relaxed);
        let (mut k, mut room, mut h) = (0, 0usize, head);
        while room < len.max(1) || (ctx && k < 2) {
            if h == tail {
                return Err(NoRoom { q, tail });
            }
            if k == MAX_RX_DESCS_PER_FRAME {
                // Descriptors too short for the frame: no refill makes room for it.
                qr.missed.fetch_add(1, Ordering::Relaxed);
                regs.rx_missed.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            let at = desc_iova(base, h);
            let mut raw = [0u8; DESC_SIZE];
            if self.dma.dma_read(at, &mut raw).is_err() {
                regs.dma_faults.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            let d: Desc = bytemuck::pod_read_unaligned(&raw);
            if !(ctx && k == 1) {
                room += desc_room(&d);
            }
            self.rx_descs[k] = (at, d);
            k += 1;
            h = (h + 1) % RING_DESCS;
        }
        Ok(Some((k, h)))
    }

    /// Writes `frame` into the buffers of the first `k` gathered descriptors (each up
    /// to its room; with `ctx`, none into the second), recording each one's length.
    /// Returns false if a write faulted; the rest are then not written.
    #[inline]
    fn write_data(&mut self, k: usize, frame: &[u8], ctx: bool) -> bool {
        let mut done = 0;
        let mut ok = true;
        for (j, (_, d)) in self.rx_descs[..k].iter().enumerate() {
            let n = if ctx && j == 1 {
                0
            } else {
                (frame.len() - done).min(desc_room(d))
            };
            if ok
                && self
                    .dma
                    .dma_write(Iova(d.addr), &frame[done..done + n])
                    .is_err()
            {
                ok = false;
            }
            self.rx_lens[j] = n as u16;
            done += n;
        }
        ok
    }

    /// Writes the gathered descriptors back, from the last to the first, so that the
    /// driver never sees the first done before the rest: the last carries end of packet
    /// and the offload (or the checksum's verdict), and after a failed data write each
    /// carries the error bit and no length. Returns false if a write-back faulted.
    #[inline]
    fn write_backs(&mut self, k: usize, frame: &[u8], off: Offload, failed: bool) -> bool {
        let offloaded = off != Offload::NONE;
        let last_status = if failed {
            DESC_DD | DESC_EOP | DESC_ERR
        } else if offloaded {
            DESC_DD | DESC_EOP | DESC_OFFLOAD
        } else if net::wire::l4_checksum(frame) == Some(true) {
            DESC_DD | DESC_EOP | DESC_L4_OK
        } else {
            DESC_DD | DESC_EOP
        };
        for j in (0..k).rev() {
            let (at, d) = self.rx_descs[j];
            let last = j + 1 == k;
            let wb = Desc {
                addr: if last && offloaded && !failed {
                    off.to_bits()
                } else {
                    d.addr
                },
                len: if failed { 0 } else { self.rx_lens[j] },
                status: if last {
                    last_status
                } else if failed {
                    DESC_DD | DESC_ERR
                } else {
                    DESC_DD
                },
                flags: 0,
                pad: 0,
            };
            if self.dma.dma_write_back(at, &wb.to_bytes()).is_err() {
                return false;
            }
        }
        true
    }

    /// The write-backs of a frame taken whole, from the last descriptor to the first:
    /// the first marked [`DESC_CTX_NEXT`], the second the context (the offload in its
    /// address field, no length), end of packet on the last, whichever it is; after a
    /// failed data write each carries the error bit and no length, and the first no
    /// context mark. Returns false if a write-back faulted.
    fn write_backs_whole(&mut self, k: usize, off: Offload, failed: bool) -> bool {
        for j in (0..k).rev() {
            let (at, d) = self.rx_descs[j];
            let eop = if j + 1 == k { DESC_EOP } else { 0 };
            let wb = if failed {
                Desc {
                    status: DESC_DD | DESC_ERR | eop,
                    ..d
                }
            } else if j == 1 {
                Desc {
                    addr: off.to_bits(),
                    len: 0,
                    status: DESC_DD | DESC_OFFLOAD | eop,
                    ..d
                }
            } else {
                Desc {
                    len: self.rx_lens[j],
                    status: DESC_DD | eop | if j == 0 { DESC_CTX_NEXT } else { 0 },
                    ..d
                }
            };
            let wb = Desc {
                len: if failed { 0 } else { wb.len },
                flags: 0,
                pad: 0,
                ..wb
            };
            if self.dma.dma_write_back(at, &wb.to_bytes()).is_err() {
                return false;
            }
        }
        true
    }

    /// Puts one packet on the cable. A large one is cut into MTU-sized frames by the
    /// segmentation engine (TSO), checksums complete, as a NIC puts it on a wire. A
    /// partial checksum goes as it is to a far end that takes it (a virtio-net
    /// cable), else the checksum engine fills it in. A context the packet's headers do
    /// not bear out is counted, and nothing sent.
    ///
    /// Large frames are not handed to the cable whole, though a TAP would take them: so
    /// written into the outside namespace, TCP through `pvio up` stalled for hundreds
    /// of milliseconds at a time (the sender's retransmission timer fired while the
    /// receiver's acknowledgements sat unread; see `docs/results/up.md`), where the
    /// same packets cut into frames flow steadily.
    pub(super) fn send(&mut self, sink: &mut dyn WireSink, len: usize, off: Offload) {
        let regs = Arc::clone(&self.regs);
        let frame = &mut self.frame[..len];
        let partial = matches!(off.csum, Csum::Partial { .. });
        let count = |n: usize| {
            regs.tx_frames.fetch_add(1, Ordering::Relaxed);
            regs.tx_bytes.fetch_add(n as u64, Ordering::Relaxed);
        };
        if !partial && off.gso.is_none() {
            sink.transmit(frame, Offload::NONE);
            count(len);
            return;
        }
        let Ok(Some(l4)) = net::offload::validate(&off, &frame[..len.min(MAX_HEADERS)], len) else {
            regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // A cable whose far end takes offloads (a TAP with a virtio-net header: the
        // host's stack, which cuts or re-aggregates as it needs) gets the packet
        // whole, as a NIC's TSO output is re-aggregated by the receiver's GRO; any
        // other gets frames the segmentation and checksum engines finish.
        if sink.takes_offload() {
            regs.tx_gso
                .fetch_add(u64::from(off.gso.is_some()), Ordering::Relaxed);
            sink.transmit(frame, off);
            count(len);
            return;
        }
        match off.gso {
            Some(g) => {
                regs.tx_gso.fetch_add(1, Ordering::Relaxed);
                let r = net::offload::segment_tcp(frame, &l4, g.size.into(), &mut self.seg, |f| {
                    regs.tx_tso_segments.fetch_add(1, Ordering::Relaxed);
                    sink.transmit(f, Offload::NONE);
                    count(f.len());
                });
                if r.is_err() {
                    regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                if net::offload::fill_partial(frame, l4.l4, l4.csum_offset).is_ok() {
                    sink.transmit(frame, Offload::NONE);
                    count(len);
                } else {
                    regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// A packet the driver sent to guest queue `q` ([`DESC_LOOP`]): received into
    /// that queue as a frame from the cable would be, checked as one, and kept in the
    /// device's packet buffer while the queue has no room (the transmit ring does not
    /// wait for a receive queue). Queue 0, or none, is no guest queue: counted as a bad
    /// packet.
    pub(super) fn loop_back(&mut self, q: usize, len: usize, off: Offload) {
        let regs = Arc::clone(&self.regs);
        if q == 0 || q >= RX_QUEUES {
            regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
            return;
        }
        regs.tx_looped.fetch_add(1, Ordering::Relaxed);
        let frame = std::mem::take(&mut self.frame);
        if self.admit(&frame[..len], off) {
            if let Err(e) = self.receive_in_turn(q, &frame[..len], off) {
                self.hold(e, &frame[..len], off, true);
            }
        }
        self.frame = frame;
    }

    /// Keeps `frame` in the device's packet buffer, its queue paused as the cable's is,
    /// until the queue is refilled; drops and counts it if the queue is stuck, or the
    /// buffer, or the queue's share of it, is full.
    fn hold(&mut self, e: NoRoom, frame: &[u8], off: Offload, looped: bool) {
        if self.stuck(e.q) || !self.fifo.put(e.q, frame, off, Instant::now()) {
            self.missed(e);
            return;
        }
        let held = if looped {
            &self.regs.rx_loop_held
        } else {
            &self.regs.rx_fifo_held
        };
        held.fetch_add(1, Ordering::Relaxed);
        // The refill wakes the device; one that came before the flag was up did not
        // see it, and the tail, looked at again, says so (see `receive_held`).
        self.regs.rx_paused.store(true, Ordering::SeqCst);
        self.fifo.again |= self.regs.rxq[e.q].tail.load(Ordering::SeqCst) != e.tail;
    }

    /// Whether queue `q` is stuck: a frame of it waited out its hold, and the driver
    /// has not moved its tail since. Its mark goes once the tail moves.
    fn stuck(&mut self, q: usize) -> bool {
        let Some(at) = self.rxq[q].stuck_at else {
            return false;
        };
        if self.regs.rxq[q].tail.load(Ordering::Acquire) == at {
            return true;
        }
        self.rxq[q].stuck_at = None;
        false
    }

    /// Places the frames waiting in the packet buffer whose queues now have room,
    /// oldest first; a frame's queue without room keeps it and every later one of its
    /// own. A frame still without room once held [`GUEST_QUEUE_HOLD`] is dropped and
    /// counted, and its queue marked stuck: the queue's other waiting frames are
    /// dropped with it. Returns whether a queue was refilled while it looked (the pass then
    /// runs again rather than sleep).
    fn drain_fifo(&mut self, now: Instant) -> bool {
        let mut fifo = std::mem::take(&mut self.fifo);
        let mut buf = std::mem::take(&mut self.fifo_frame);
        let mut blocked = 0u32;
        let mut again = false;
        for _ in 0..fifo.len() {
            let Some(h) = fifo.pop() else {
                break;
            };
            if blocked & (1 << h.q) != 0 {
                fifo.keep(h);
                continue;
            }
            if self.stuck(h.q) {
                fifo.release(h);
                self.missed(self.no_room(h.q));
                continue;
            }
            match self.receive_or_refuse(h.q, fifo.bytes(&h, &mut buf), h.off) {
                Ok(()) => fifo.release(h),
                // Its queue found no room for it in all that time: dropped there, and
                // the queue stuck until its driver posts again. (A refill that came
                // meanwhile is taken first, whatever woke the device.)
                Err(e) if now.saturating_duration_since(h.since) >= GUEST_QUEUE_HOLD => {
                    fifo.release(h);
                    self.missed(e);
                    self.rxq[h.q].stuck_at = Some(e.tail);
                }
                Err(e) => {
                    blocked |= 1 << h.q;
                    fifo.keep(h);
                    // Paused again, then the tail looked at once more: a refill that
                    // came before the flag was up did not see it.
                    self.regs.rx_paused.store(true, Ordering::SeqCst);
                    again |= self.regs.rxq[h.q].tail.load(Ordering::SeqCst) != e.tail;
                }
            }
        }
        self.fifo = fifo;
        self.fifo_frame = buf;
        again
    }

    /// Sends every packet the driver queued.
    pub(super) fn transmit(&mut self, sink: &mut dyn WireSink) {
        self.transmit_ring(sink);
        sink.flush();
    }

    /// Hands every packet on the transmit ring to the cable.
    pub(super) fn transmit_ring(&mut self, sink: &mut dyn WireSink) {
        let regs = Arc::clone(&self.regs);
        let tail = regs.tx_tail.load(Ordering::Acquire) % RING_DESCS;
        let base = regs.tx_base.load(Ordering::Relaxed);
        let mut len = 0usize;
        let mut bad = false;
        while self.tx_head != tail {
            let at = desc_iova(base, self.tx_head);
            let mut raw = [0u8; DESC_SIZE];
            if self.dma.dma_read(at, &mut raw).is_err() {
                regs.dma_faults.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let mut d: Desc = bytemuck::pod_read_unaligned(&raw);
            if d.flags & DESC_CTX != 0 {
                // The next packet's offload; a context no encoder writes spoils it.
                match Offload::from_bits(d.addr) {
                    Some(o) => self.tx_off = o,
                    None => {
                        self.tx_off = Offload::NONE;
                        bad = true;
                        regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
                    }
                }
                d.status = DESC_DD;
                let _ = self.dma.dma_write_back(at, &d.to_bytes());
                self.tx_head = (self.tx_head + 1) % RING_DESCS;
                regs.tx_head.store(self.tx_head, Ordering::Release);
                continue;
            }
            let n = d.len as usize;
            if len + n > self.frame.len() {
                bad = true;
            } else if self
                .dma
                .dma_read(Iova(d.addr), &mut self.frame[len..len + n])
                .is_err()
            {
                regs.dma_faults.fetch_add(1, Ordering::Relaxed);
                bad = true;
            } else {
                len += n;
            }
            let eop = d.flags & DESC_EOP != 0;
            let looped = (d.flags & DESC_LOOP != 0).then_some(usize::from(d.pad));
            d.status = DESC_DD;
            let _ = self.dma.dma_write_back(at, &d.to_bytes());
            self.tx_head = (self.tx_head + 1) % RING_DESCS;
            regs.tx_head.store(self.tx_head, Ordering::Release);
            if eop {
                let off = std::mem::take(&mut self.tx_off);
                match (bad, looped) {
                    (true, _) => {}
                    (false, Some(q)) => self.loop_back(q, len, off),
                    (false, None) => self.send(sink, len, off),
                }
                len = 0;
                bad = false;
                self.complete(0, Instant::now());
            }
        }
    }
}
