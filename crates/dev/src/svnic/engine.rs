//! The SV-NIC's micro-engines (paper 002 §IV-B): an egress engine whose contexts each
//! serve a disjoint set of VIFs' send queues, and ingress engines whose contexts share
//! the wire's frames, find each one's VIF by a hash of its destination MAC and place it
//! in that VIF's receive queue in arrival order.
//!
//! A context is a step function over its own state: it does one packet's worth of work
//! and returns, which is the voluntary yield of the board's hardware contexts (they are
//! not preempted either). An engine runs its contexts in turn on one device core; the
//! device cores are threads pinned by the caller, their time charged to no domain.
//!
//! Each stage is timed with the TSC for Figure 8: on egress `msg_rcv` (finding and
//! copying a frame the guest queued) and `pkt_tx` (handing it to the wire); on ingress
//! `pkt_rx` (taking a frame from the wire), `chnl_demux` (finding its VIF and a
//! sequence number) and `msg_send` (placing it, publishing it in order and raising the
//! guest's signal).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mem::PageAccess;

use super::vif::{VifError, VifRx, VifTx, SLOT_BYTES};

/// Figure 8's stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Egress: a frame found in a send queue and copied into the device.
    MsgRcv,
    /// Egress: the frame handed to the wire.
    PktTx,
    /// Ingress: a frame taken from the wire.
    PktRx,
    /// Ingress: its VIF found and a sequence number taken.
    ChnlDemux,
    /// Ingress: the frame placed, published in order, the guest signalled.
    MsgSend,
}

impl Stage {
    /// Every stage, in counter order.
    pub const ALL: [Stage; 5] = [
        Stage::MsgRcv,
        Stage::PktTx,
        Stage::PktRx,
        Stage::ChnlDemux,
        Stage::MsgSend,
    ];
    /// The paper's name.
    pub fn name(self) -> &'static str {
        match self {
            Stage::MsgRcv => "msg_rcv",
            Stage::PktTx => "pkt_tx",
            Stage::PktRx => "pkt_rx",
            Stage::ChnlDemux => "chnl_demux",
            Stage::MsgSend => "msg_send",
        }
    }
}

/// TSC ticks and counts per stage, shared by the engines and read by the lab.
#[derive(Debug, Default)]
pub struct StageTimes {
    ticks: [AtomicU64; 5],
    count: [AtomicU64; 5],
}

impl StageTimes {
    fn add(&self, s: Stage, ticks: u64) {
        self.ticks[s as usize].fetch_add(ticks, Ordering::Relaxed);
        self.count[s as usize].fetch_add(1, Ordering::Relaxed);
    }
    /// Ticks and count of stage `s` so far.
    pub fn get(&self, s: Stage) -> (u64, u64) {
        (
            self.ticks[s as usize].load(Ordering::Relaxed),
            self.count[s as usize].load(Ordering::Relaxed),
        )
    }
}

/// Finds a VIF by destination MAC: an open-addressed table of twice the VIFs it may
/// hold, hashed on the MAC's bytes (the paper's hashing, so the cost stays flat as
/// VIFs are added).
#[derive(Debug, Clone)]
pub struct Demux {
    slots: Vec<Option<([u8; 6], u16)>>,
    len: usize,
}

impl Demux {
    /// A table for up to `max` VIFs.
    pub fn new(max: usize) -> Self {
        Self {
            slots: vec![None; (2 * max.max(1)).next_power_of_two()],
            len: 0,
        }
    }
    fn hash(mac: &[u8; 6]) -> usize {
        // FNV-1a over the six bytes.
        let mut h: u32 = 0x811c_9dc5;
        for &b in mac {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
        h as usize
    }
    /// Adds (or moves) `mac` to VIF `vif`; false if the table is full.
    pub fn insert(&mut self, mac: [u8; 6], vif: u16) -> bool {
        let mask = self.slots.len() - 1;
        let mut i = Self::hash(&mac) & mask;
        for _ in 0..self.slots.len() {
            match self.slots[i] {
                Some((m, _)) if m == mac => {
                    self.slots[i] = Some((mac, vif));
                    return true;
                }
                None if self.len * 2 < self.slots.len() => {
                    self.slots[i] = Some((mac, vif));
                    self.len += 1;
                    return true;
                }
                None => return false,
                Some(_) => i = (i + 1) & mask,
            }
        }
        false
    }
    /// The VIF for `mac`, if any.
    pub fn lookup(&self, mac: &[u8; 6]) -> Option<u16> {
        let mask = self.slots.len() - 1;
        let mut i = Self::hash(mac) & mask;
        for _ in 0..self.slots.len() {
            match self.slots[i] {
                Some((m, v)) if m == *mac => return Some(v),
                None => return None,
                Some(_) => i = (i + 1) & mask,
            }
        }
        None
    }
}

/// Counters of an engine.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Frames handed to the wire (egress) or placed in a VIF (ingress).
    pub frames: AtomicU64,
    /// Ingress: frames for no VIF's MAC (dropped).
    pub no_vif: AtomicU64,
    /// Ingress: frames a VIF had no room for, dropped once they had waited the hold
    /// ([`VIF_HOLD`]) or at once while the VIF was stuck (its `rx_full` counts them too).
    pub vif_full: AtomicU64,
    /// Ingress: frames that found their VIF's queue full and waited in their context
    /// for the guest to drain it (flow control), the other contexts held back.
    pub vif_held: AtomicU64,
    /// Frames a VIF's queue refused (a bad length, or the VIF disconnected).
    pub vif_errors: AtomicU64,
    /// Context steps that found nothing to do.
    pub idle_steps: AtomicU64,
    /// Ingress: copies of broadcast and multicast frames, one for each VIF.
    pub broadcast: AtomicU64,
    /// Ingress: frames whose placement the IOMMU refused (an address outside the VIF's
    /// context): not written, the slot left empty.
    pub dma_faults: AtomicU64,
    /// Egress: frames whose source MAC was not their VIF's (or too short to have one),
    /// dropped before the wire: a guest sends only from the address the toolstack gave
    /// it, as the driver domain's bridge holds its vifs to theirs.
    pub spoofed: AtomicU64,
}

hv::atomic_counter_set!(EngineStats => EngineCounts {
    frames,
    no_vif,
    vif_full,
    vif_held,
    vif_errors,
    idle_steps,
    broadcast,
    dma_faults,
    spoofed,
});

/// How the egress engine shares the link among VIFs when it is saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// Quality-unaware: each context serves its VIFs in turn, one packet a step.
    #[default]
    RoundRobin,
    /// Quality-aware (paper 002 §VI-A): the backlogged VIF that has had the least of the
    /// link for its priority goes next (stride scheduling on bytes), so each gets a share
    /// in proportion to its priority, and what an idle VIF leaves goes to the others.
    Priority,
}
hv::named_enum!(Schedule {
    RoundRobin => "round-robin",
    Priority => "quality-aware",
});

/// How long an ingress context keeps a frame whose VIF's queue is full, waiting for
/// the guest to drain it, before dropping it (the same bound the NIC keeps for a
/// guest's own queue, [`crate::nic::GUEST_QUEUE_HOLD`]): long enough for a guest held
/// off its core by the host's scheduler, short enough that one that stopped draining
/// holds the other VIFs back once, briefly.
pub const VIF_HOLD: Duration = crate::nic::GUEST_QUEUE_HOLD;

/// A VIF's priority when none was set (the scale is 1 to 100).
pub const DEFAULT_PRIORITY: u8 = 50;

/// Bytes-times-priority units per byte sent: a VIF's pass advances by
/// `len × STRIDE / priority`.
const STRIDE: u64 = 1 << 20;

/// A VIF as egress serves it.
#[derive(Debug)]
struct EgressVif<P> {
    id: u16,
    /// The MAC the toolstack gave it: the only source address its frames may carry.
    mac: [u8; 6],
    tx: VifTx<P>,
    priority: u8,
    /// Stride scheduling's pass: how much of the link it has had, over its priority.
    pass: u64,
}

/// One egress context: the VIFs it serves and where it left off.
#[derive(Debug)]
struct EgressCtx<P> {
    vifs: Vec<EgressVif<P>>,
    next: usize,
}

/// The egress engine: each VIF's send queue served by one context, VIFs given to the
/// contexts round robin (so their sets are disjoint and need no lock), each context
/// yielding after every packet; with [`Schedule::Priority`], the VIF to serve is chosen
/// over all of them by priority.
#[derive(Debug)]
pub struct Egress<P> {
    contexts: Vec<EgressCtx<P>>,
    added: usize,
    /// The context whose turn it is next.
    next_ctx: usize,
    schedule: Schedule,
    /// The pass of the VIF served last (a VIF that comes back from idle starts here).
    vtime: u64,
    buf: Box<[u8]>,
    /// VIFs whose guest asked to be told when its full send queue has room again,
    /// and whose frame a context has just taken (drained by [`Egress::take_tx_wakes`]
    /// after each step; at most one a context a step, so never grown on the data path).
    tx_wake: Vec<u16>,
    times: Arc<StageTimes>,
    stats: Arc<EngineStats>,
}

impl<P: PageAccess> Egress<P> {
    /// An engine of `contexts` contexts (the board's 8 per micro-engine).
    pub fn new(contexts: usize, times: Arc<StageTimes>) -> Self {
        Self {
            contexts: (0..contexts.max(1))
                .map(|_| EgressCtx {
                    vifs: Vec::new(),
                    next: 0,
                })
                .collect(),
            added: 0,
            next_ctx: 0,
            schedule: Schedule::RoundRobin,
            vtime: 0,
            buf: vec![0u8; SLOT_BYTES].into_boxed_slice(),
            tx_wake: Vec::with_capacity(contexts.max(1)),
            times,
            stats: Arc::default(),
        }
    }

    /// Whether any send queue holds a frame (the engine's last look before it sleeps).
    pub fn has_pending(&self) -> bool {
        self.contexts
            .iter()
            .flat_map(|c| &c.vifs)
            .any(|v| v.tx.pending().is_ok_and(|n| n > 0))
    }

    /// Hands each VIF whose guest is waiting for room in its send queue, and that has
    /// some now, to `f` (the device signals it).
    pub fn take_tx_wakes(&mut self, f: &mut dyn FnMut(u16)) {
        for id in self.tx_wake.drain(..) {
            f(id);
        }
    }

    /// Chooses the scheduling policy.
    pub fn set_schedule(&mut self, s: Schedule) {
        self.schedule = s;
    }

    /// Gives VIF `id`'s send queue, whose frames must come from `mac`, to the next
    /// context in turn.
    pub fn add(&mut self, id: u16, mac: [u8; 6], tx: VifTx<P>) {
        let n = self.contexts.len();
        self.contexts[self.added % n].vifs.push(EgressVif {
            id,
            mac,
            tx,
            priority: DEFAULT_PRIORITY,
            pass: self.vtime,
        });
        self.added += 1;
    }

    /// Sets VIF `id`'s priority (1 to 100; clamped): false if it has no such VIF.
    pub fn set_priority(&mut self, id: u16, priority: u8) -> bool {
        for c in &mut self.contexts {
            if let Some(v) = c.vifs.iter_mut().find(|v| v.id == id) {
                v.priority = priority.clamp(1, 100);
                return true;
            }
        }
        false
    }

    /// Takes VIF `id`'s send queue back (the VIF is being destroyed); its context
    /// carries on with the rest.
    pub fn remove(&mut self, id: u16) -> Option<VifTx<P>> {
        for c in &mut self.contexts {
            if let Some(i) = c.vifs.iter().position(|v| v.id == id) {
                let v = c.vifs.remove(i);
                c.next = 0;
                return Some(v.tx);
            }
        }
        None
    }

    /// Sends at most `budget` frames (what the link has room for), each context at most
    /// one, through `wire` (with the VIF each came from). Returns the frames sent.
    pub fn step(&mut self, budget: usize, wire: &mut dyn FnMut(u16, &[u8])) -> usize {
        match self.schedule {
            Schedule::RoundRobin => self.step_round_robin(budget, wire),
            Schedule::Priority => self.step_priority(budget, wire),
        }
    }

    fn sent(
        &mut self,
        (id, len, wake): (u16, usize, bool),
        t0: u64,
        wire: &mut dyn FnMut(u16, &[u8]),
    ) {
        if wake && self.tx_wake.len() < self.tx_wake.capacity() {
            self.tx_wake.push(id);
        }
        let t1 = mem::cpu::rdtsc();
        wire(id, &self.buf[..len]);
        let t2 = mem::cpu::rdtsc();
        self.times.add(Stage::MsgRcv, t1.wrapping_sub(t0));
        self.times.add(Stage::PktTx, t2.wrapping_sub(t1));
        self.stats.frames.fetch_add(1, Ordering::Relaxed);
    }

    fn step_round_robin(&mut self, budget: usize, wire: &mut dyn FnMut(u16, &[u8])) -> usize {
        let mut sent = 0;
        let nc = self.contexts.len();
        let first = self.next_ctx;
        for k in 0..nc {
            if sent == budget {
                break;
            }
            // The contexts take the link in turn (a step with room for fewer frames
            // than contexts starts where the last one stopped).
            let ci = (first + k) % nc;
            self.next_ctx = (ci + 1) % nc;
            let t0 = mem::cpu::rdtsc();
            let c = &mut self.contexts[ci];
            let n = c.vifs.len();
            let mut found = None;
            let mut spoofed = false;
            for k in 0..n {
                let i = (c.next + k) % n;
                let v = &mut c.vifs[i];
                match v.tx.take(&mut self.buf) {
                    Ok(Some(len)) if !from(&self.buf[..len], &v.mac) => {
                        self.stats.spoofed.fetch_add(1, Ordering::Relaxed);
                        spoofed = true;
                        c.next = (i + 1) % n;
                        break;
                    }
                    Ok(Some(len)) => {
                        found = Some((v.id, len, v.tx.wants_signal()));
                        c.next = (i + 1) % n;
                        break;
                    }
                    Ok(None) => {}
                    Err(_) => {
                        self.stats.vif_errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            let Some(f) = found else {
                if !spoofed {
                    self.stats.idle_steps.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            };
            self.sent(f, t0, wire);
            sent += 1;
        }
        sent
    }

    fn step_priority(&mut self, budget: usize, wire: &mut dyn FnMut(u16, &[u8])) -> usize {
        let mut sent = 0;
        while sent < budget.min(self.contexts.len()) {
            let t0 = mem::cpu::rdtsc();
            // The backlogged VIF with the least pass; one that comes back from idle
            // starts at the current time, with no credit saved.
            let mut best: Option<(usize, usize, u64)> = None;
            for (ci, c) in self.contexts.iter_mut().enumerate() {
                for (vi, v) in c.vifs.iter_mut().enumerate() {
                    match v.tx.pending() {
                        Ok(0) => {}
                        Ok(_) => {
                            v.pass = v.pass.max(self.vtime);
                            if best.is_none_or(|b| v.pass < b.2) {
                                best = Some((ci, vi, v.pass));
                            }
                        }
                        Err(_) => {
                            self.stats.vif_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
            let Some((ci, vi, pass)) = best else {
                self.stats.idle_steps.fetch_add(1, Ordering::Relaxed);
                break;
            };
            let v = &mut self.contexts[ci].vifs[vi];
            match v.tx.take(&mut self.buf) {
                Ok(Some(len)) => {
                    let f = (v.id, len, v.tx.wants_signal());
                    // A spoofed frame costs its VIF its share of the link all the same.
                    v.pass = pass + len as u64 * STRIDE / u64::from(v.priority.max(1));
                    self.vtime = pass;
                    if from(&self.buf[..len], &v.mac) {
                        self.sent(f, t0, wire);
                        sent += 1;
                    } else {
                        self.stats.spoofed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    self.stats.vif_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        sent
    }

    /// The engine's counters.
    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }
}

/// Whether `frame` is an Ethernet frame whose source address is `mac`.
fn from(frame: &[u8], mac: &[u8; 6]) -> bool {
    frame.get(6..12).is_some_and(|src| src == mac)
}

/// A VIF's receive buffers as the device reaches them through the IOMMU (beyond the
/// paper, c): the device's DMA tagged with the VIF's own requester id, whose context
/// maps that VIF's receive buffers and nothing else, at [`rx_iova`].
#[derive(Debug)]
pub struct VifDma {
    /// The DMA handle of the VIF's requester id.
    pub ctx: hv::iommu::DmaContext,
    /// Where its receive buffers start in its I/O address space.
    pub base: hv::Iova,
}

/// Where VIF `id`'s receive buffers are mapped in its IOMMU context: 16 MiB apart, so
/// that no two VIFs' addresses meet (an address meant for another VIF is outside this
/// one's mappings).
pub fn rx_iova(id: u16) -> hv::Iova {
    hv::Iova((u64::from(id) + 1) << 24)
}

/// A frame the network I/O engine hands an ingress context: its length, and the VIF
/// it is for when the engine already chose one (a copy of a broadcast).
pub type Delivery = (usize, Option<u16>);

/// Copies `frame` into slot `seq` of VIF `vif`'s receive queue `rx`: by DMA through
/// the VIF's IOMMU context when it has one (`dma`), directly otherwise. With the
/// injected ingress bug (`bug`), the address computed is the next VIF's: through an
/// IOMMU context the write faults (counted in `faults`); without one the bytes land in
/// the next VIF's buffer and this VIF's slot is left empty.
#[allow(clippy::too_many_arguments)]
#[inline]
fn place<P: PageAccess>(
    dma: Option<&mut VifDma>,
    vifs: &IngressVifs<P>,
    vif: u16,
    rx: &VifRx<P>,
    seq: u32,
    frame: &[u8],
    bug: bool,
    faults: &AtomicU64,
) -> Result<(), VifError> {
    let len = frame.len();
    match dma {
        Some(d) => {
            let base = if bug {
                rx_iova(vif.wrapping_add(1))
            } else {
                d.base
            };
            let iova = hv::Iova(base.0 + VifRx::<P>::slot_offset(seq) as u64);
            rx.fill_with(seq, len, || {
                let ok = d.ctx.dma_write(iova, frame).is_ok();
                if !ok {
                    faults.fetch_add(1, Ordering::Relaxed);
                }
                ok
            })
            .map(|_| ())
        }
        None if bug => {
            if let Some(other) = vifs
                .rx
                .get(vif.wrapping_add(1) as usize)
                .and_then(|r| r.as_ref())
            {
                let _ = other.misplaced_write(seq, frame);
            }
            rx.fill_with(seq, len, || false).map(|_| ())
        }
        None => rx.fill(seq, frame),
    }
}

/// What an ingress context is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InState {
    /// Ready for a frame from the wire.
    Idle,
    /// Its frame is in its buffer; its VIF's queue is full, and it waits for the
    /// guest to drain it (since `since`), holding back the contexts behind it.
    Wait {
        vif: u16,
        len: usize,
        since: Instant,
    },
    /// Its frame is in the VIF's slot; waiting for its turn to publish.
    Publish {
        vif: u16,
        seq: u32,
        len: usize,
        t0: u64,
    },
}

/// What became of a frame an ingress context asked its VIF to take.
enum Admit {
    /// Placed in a slot: the context's state to publish it.
    Placed(InState),
    /// The VIF's queue is full: the frame is the caller's to keep or drop.
    Full,
    /// Dropped and counted: the queue still full for a stuck VIF or a frame that waited
    /// out its hold, or the VIF gone or broken.
    Dropped,
}

/// One ingress context and its frame buffer.
#[derive(Debug)]
struct IngressCtx {
    state: InState,
    buf: Box<[u8]>,
}

/// An ingress engine: a pool of contexts sharing the wire's frames and every VIF's
/// receive queue (several engines may share them too, each on its own core).
#[derive(Debug)]
pub struct Ingress<P> {
    contexts: Vec<IngressCtx>,
    /// By VIF id: its DMA handle, when the device reaches its buffers through the IOMMU.
    dma: Vec<Option<VifDma>>,
    /// Fault injection: every this many frames (0: never), an ingress bug computes the
    /// next VIF's address for the frame.
    misplace_every: u32,
    placed: u32,
    /// The context whose frame waits for room in its VIF's queue: while it waits the
    /// others take no frame from the wire, so that every VIF's frames keep their order.
    waiting: Option<usize>,
    /// How long a frame waits for room ([`VIF_HOLD`] unless set).
    hold: Duration,
    /// By VIF id: its frame waited out the hold, and its frames are dropped at once
    /// until its queue has room again.
    stuck: Vec<bool>,
    times: Arc<StageTimes>,
    stats: Arc<EngineStats>,
    _p: std::marker::PhantomData<P>,
}

/// The VIFs ingress places frames into: the receive queues by VIF id and the MAC
/// table, shared by the ingress engines.
#[derive(Debug)]
pub struct IngressVifs<P> {
    /// Receive queues, indexed by VIF id (none for a destroyed VIF).
    pub rx: Vec<Option<Arc<VifRx<P>>>>,
    /// Destination MAC → VIF id.
    pub demux: Demux,
}

impl<P: PageAccess> Ingress<P> {
    /// An engine of `contexts` contexts.
    pub fn new(contexts: usize, times: Arc<StageTimes>) -> Self {
        Self {
            contexts: (0..contexts.max(1))
                .map(|_| IngressCtx {
                    state: InState::Idle,
                    buf: vec![0u8; SLOT_BYTES].into_boxed_slice(),
                })
                .collect(),
            dma: Vec::new(),
            misplace_every: 0,
            placed: 0,
            waiting: None,
            hold: VIF_HOLD,
            stuck: Vec::new(),
            times,
            stats: Arc::default(),
            _p: std::marker::PhantomData,
        }
    }

    /// VIF `id` was destroyed: its DMA handle and its stuck mark go (a VIF made later
    /// with its number starts afresh).
    pub fn forget(&mut self, id: u16) {
        self.set_dma(id, None);
        if let Some(s) = self.stuck.get_mut(id as usize) {
            *s = false;
        }
    }

    /// A frame whose VIF's queue is full waits `hold` for room from now on.
    pub fn set_hold(&mut self, hold: Duration) {
        self.hold = hold;
    }

    /// VIF `id`'s receive buffers are reached through the IOMMU with `dma` from now on
    /// (none: written directly, as the board's own memory).
    pub fn set_dma(&mut self, id: u16, dma: Option<VifDma>) {
        let i = id as usize;
        if self.dma.len() <= i {
            self.dma.resize_with(i + 1, || None);
        }
        self.dma[i] = dma;
    }

    /// Fault injection: an ingress bug that, every `every` frames (0: never), places a
    /// frame at the next VIF's address instead of its own VIF's. Through a VIF's IOMMU
    /// context the write faults and is counted (`dma_faults`); with the buffers written
    /// directly it lands in the other VIF's buffer, as such a bug would on a device
    /// without one.
    pub fn inject_misplacement(&mut self, every: u32) {
        self.misplace_every = every;
    }

    /// Runs every context once. An idle context takes a frame with `wire` (which copies
    /// one into the buffer it is given and returns its length, and the VIF it is for
    /// when the network I/O engine already chose one: a copy of a broadcast), finds its
    /// VIF (by the destination MAC's hash otherwise), takes a
    /// sequence number, copies the frame into the VIF's slot and publishes it if its
    /// turn has come; a context waiting to publish tries again. `signal` is called for
    /// each published frame whose guest wants a receive signal. Returns frames
    /// published.
    ///
    /// A frame whose VIF's queue is full waits in its context for the guest to drain
    /// it, and the other contexts take nothing from the wire meanwhile: the frames
    /// behind it stay with the network I/O engine, whose buffer pauses the cable when
    /// it fills (flow control, not loss). The wait is bounded: a frame still without
    /// room after the hold ([`VIF_HOLD`] unless [`Self::set_hold`]) is dropped, and
    /// that VIF is *stuck*, its frames dropped at once until its queue has room, so a
    /// guest that stops draining holds the others back once, for the hold at most.
    pub fn step(
        &mut self,
        vifs: &IngressVifs<P>,
        now: Instant,
        wire: &mut dyn FnMut(&mut [u8]) -> Option<Delivery>,
        signal: &mut dyn FnMut(u16),
    ) -> usize {
        if let Some(i) = self.waiting {
            self.retry(i, vifs, now);
        }
        let mut published = 0;
        for i in 0..self.contexts.len() {
            if self.contexts[i].state == InState::Idle && self.waiting.is_none() {
                let Some(state) = self.take_frame(i, vifs, now, wire) else {
                    continue;
                };
                self.contexts[i].state = state;
            }
            if let InState::Publish { vif, seq, len, t0 } = self.contexts[i].state {
                let Some(rx) = vifs.rx.get(vif as usize).and_then(|r| r.as_ref()) else {
                    // Destroyed while this context held a slot: nothing to publish into.
                    self.contexts[i].state = InState::Idle;
                    continue;
                };
                match rx.publish(seq, len) {
                    Ok(true) => {
                        if rx.wants_signal() {
                            signal(vif);
                        }
                        self.times
                            .add(Stage::MsgSend, mem::cpu::rdtsc().wrapping_sub(t0));
                        self.stats.frames.fetch_add(1, Ordering::Relaxed);
                        published += 1;
                        self.contexts[i].state = InState::Idle;
                    }
                    // Not its turn: yield, and try again at its next step.
                    Ok(false) => {}
                    Err(_) => {
                        self.stats.vif_errors.fetch_add(1, Ordering::Relaxed);
                        self.contexts[i].state = InState::Idle;
                    }
                }
            }
        }
        published
    }

    /// Idle context `i` takes a frame from the wire and finds its VIF, then admits it
    /// ([`Self::admit`]). Returns the context's next state; `None` if there was no
    /// frame, or it is dropped (counted: no VIF, the VIF stuck or broken).
    #[inline]
    fn take_frame(
        &mut self,
        i: usize,
        vifs: &IngressVifs<P>,
        now: Instant,
        wire: &mut dyn FnMut(&mut [u8]) -> Option<Delivery>,
    ) -> Option<InState> {
        let c = &mut self.contexts[i];
        let t0 = mem::cpu::rdtsc();
        let Some((len, to)) = wire(&mut c.buf) else {
            self.stats.idle_steps.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let t1 = mem::cpu::rdtsc();
        self.times.add(Stage::PktRx, t1.wrapping_sub(t0));
        if len < super::vif::MIN_FRAME {
            self.stats.no_vif.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut dst = [0u8; 6];
        dst.copy_from_slice(&c.buf[..6]);
        let Some(vif) = to.or_else(|| vifs.demux.lookup(&dst)) else {
            self.stats.no_vif.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        match self.admit(i, vifs, vif, len, t1, false) {
            Admit::Placed(state) => Some(state),
            Admit::Full => {
                // The frame waits for the guest to drain its queue.
                self.stats.vif_held.fetch_add(1, Ordering::Relaxed);
                self.waiting = Some(i);
                Some(InState::Wait {
                    vif,
                    len,
                    since: now,
                })
            }
            Admit::Dropped => None,
        }
    }

    /// Context `i`'s waiting frame asks its VIF for room again: placed if there is,
    /// dropped once it has waited the hold (its VIF then stuck).
    fn retry(&mut self, i: usize, vifs: &IngressVifs<P>, now: Instant) {
        let InState::Wait { vif, len, since } = self.contexts[i].state else {
            self.waiting = None;
            return;
        };
        let waited_out = now.saturating_duration_since(since) >= self.hold;
        let state = match self.admit(i, vifs, vif, len, mem::cpu::rdtsc(), waited_out) {
            Admit::Placed(state) => state,
            Admit::Full => return,
            // Dropped (counted): waited out, or its VIF destroyed or broken meanwhile.
            Admit::Dropped => InState::Idle,
        };
        self.contexts[i].state = state;
        self.waiting = None;
    }

    /// Takes a sequence number in `vif`'s queue for context `i`'s `len`-byte frame and
    /// copies the frame into that slot. `t1` is when the frame was taken, for the
    /// demultiplexing stage's time. A full queue drops the frame (counted) if the VIF is
    /// stuck, or if the frame has `waited_out` its hold, which makes the VIF stuck.
    fn admit(
        &mut self,
        i: usize,
        vifs: &IngressVifs<P>,
        vif: u16,
        len: usize,
        t1: u64,
        waited_out: bool,
    ) -> Admit {
        let Some(rx) = vifs.rx.get(vif as usize).and_then(Option::as_ref) else {
            self.stats.no_vif.fetch_add(1, Ordering::Relaxed);
            return Admit::Dropped;
        };
        let v = vif as usize;
        if self.stuck.len() <= v {
            self.stuck.resize(v + 1, false);
        }
        let seq = match rx.try_reserve() {
            Ok(Some(seq)) => {
                self.stuck[v] = false;
                seq
            }
            Ok(None) if self.stuck[v] || waited_out => {
                self.stuck[v] = true;
                rx.refuse();
                self.stats.vif_full.fetch_add(1, Ordering::Relaxed);
                return Admit::Dropped;
            }
            Ok(None) => return Admit::Full,
            Err(_) => {
                self.stats.vif_errors.fetch_add(1, Ordering::Relaxed);
                return Admit::Dropped;
            }
        };
        let t2 = mem::cpu::rdtsc();
        self.times.add(Stage::ChnlDemux, t2.wrapping_sub(t1));
        self.placed = self.placed.wrapping_add(1);
        let bug = self.misplace_every != 0 && self.placed.is_multiple_of(self.misplace_every);
        let frame = &self.contexts[i].buf[..len];
        let dma = self.dma.get_mut(vif as usize).and_then(Option::as_mut);
        if place(dma, vifs, vif, rx, seq, frame, bug, &self.stats.dma_faults).is_err() {
            self.stats.vif_errors.fetch_add(1, Ordering::Relaxed);
        }
        Admit::Placed(InState::Publish {
            vif,
            seq,
            len,
            t0: t2,
        })
    }

    /// Contexts holding a frame not yet published.
    pub fn in_flight(&self) -> usize {
        self.contexts
            .iter()
            .filter(|c| c.state != InState::Idle)
            .count()
    }

    /// The engine's counters.
    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }
}
