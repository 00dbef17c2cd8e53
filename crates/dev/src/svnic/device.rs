//! The running SV-NIC: its micro-engines on device cores, its cable, its signalling,
//! and the device-side management driver that adds and removes VIFs while it runs.
//!
//! Threads: an egress engine, and an ingress engine that also plays the board's network
//! I/O engine (it takes the cable's frames into device buffers, from which its contexts
//! place them). With the sidecore design, a third thread is the sidecore: a host core of
//! the hypervisor's, given to taking the device's messages and sending each guest its
//! event. Each thread is pinned to the core it is given; their time is charged to no
//! domain (the device's cores are the board's, the sidecore is the hypervisor's).
//!
//! Engines poll, as the board's micro-engines do: a step that finds nothing yields the
//! core to whatever else the host scheduled there (on this 2-core machine device cores
//! share cores with the guests), and steps again.
//!
//! Signals reach the guest as physical interrupts bound to an event-channel port of its
//! own (one vector per VIF, [`VifSignal::vector`]), whichever design carries them:
//! * [`SignalMode::PerVif`]: the device raises the VIF's vector (MSI-X);
//! * [`SignalMode::IdRegister`]: the device sets the VIF's bit and raises the one master
//!   vector; the hypervisor's handler, on the controller domain's vCPU, reads and clears
//!   the register and forwards an event to every VIF sharing a set bit
//!   ([`hv::Hypervisor::send_pirq`]);
//! * [`SignalMode::Sidecore`]: the device writes the VIF's id into the side channel;
//!   the sidecore forwards exactly that VIF's event.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hv::{Hypervisor, Vector};
use mem::PageAccess;
use net::offload::Offload;

use super::engine::{Demux, Egress, EngineStats, Ingress, IngressVifs, StageTimes};
use super::signal::{BitMap, Dir, IdRegister, SideChannel};
use super::vif::{VifRx, VifTx, SLOT_BYTES};
use crate::wire::{WireSink, WireSource};

/// How the device signals guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalMode {
    /// The shared 8-bit identifier register and a master interrupt demultiplexed by the
    /// hypervisor on a host core (the paper's SV-NIC).
    IdRegister,
    /// A message channel to a sidecore (the paper's §V).
    Sidecore,
    /// A vector per VIF (MSI-X; the paper's suggested fix).
    PerVif,
}
hv::named_enum!(SignalMode {
    IdRegister => "register",
    Sidecore => "sidecore",
    PerVif => "per-vif",
});

/// Where the device's threads run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCores {
    /// The egress engine's core.
    pub egress: Option<usize>,
    /// The ingress engine's core.
    pub ingress: Option<usize>,
    /// The sidecore (with [`SignalMode::Sidecore`]).
    pub sidecore: Option<usize>,
    /// The block service's engine ([`super::block`]), if the device runs it.
    pub block: Option<usize>,
}

/// What the device's threads do when they find nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Idle {
    /// Poll on (the paper's micro-engines and sidecore): each step that finds nothing
    /// yields its core and steps again.
    #[default]
    Poll,
    /// Poll while there is work, then sleep once `spin` has passed with none (the
    /// paper's future work, dynamic core partitioning; vhost's busy-poll): the core
    /// goes to whoever else runs there until a doorbell (a guest's send), a frame on
    /// the cable, or a message for the sidecore wakes the thread. `spin` zero: sleep at
    /// once, an interrupt-driven device.
    Block {
        /// How long a thread polls on without work before it sleeps.
        spin: std::time::Duration,
    },
}

/// How long a sleeping thread sleeps at most before it looks again (only a safety
/// net: every source of work wakes it).
const NAP: std::time::Duration = std::time::Duration::from_millis(100);

/// How to build the device.
#[derive(Debug, Clone, Copy)]
pub struct SvnicConfig {
    /// Egress contexts (the board's 8 per micro-engine).
    pub egress_contexts: usize,
    /// Ingress contexts.
    pub ingress_contexts: usize,
    /// The signalling design.
    pub signal: SignalMode,
    /// The master interrupt's vector ([`SignalMode::IdRegister`]).
    pub master: Vector,
    /// Where the threads run.
    pub cores: DeviceCores,
    /// The link's rate: the MAC puts one frame on it at a time.
    pub link: crate::peer::WireRate,
    /// How egress shares a saturated link.
    pub schedule: super::engine::Schedule,
    /// Whether the threads poll on or sleep when idle.
    pub idle: Idle,
    /// Each VIF in a memory domain of its own, reached through an IOMMU context of its
    /// own (beyond the paper, c: its "device domain per VIF"); otherwise the VIFs are
    /// the device's own memory, written directly.
    pub iommu: bool,
    /// How long an ingress context keeps a frame whose VIF's queue is full before
    /// dropping it ([`super::engine::VIF_HOLD`]).
    pub vif_hold: Duration,
}

impl Default for SvnicConfig {
    fn default() -> Self {
        Self {
            egress_contexts: 8,
            ingress_contexts: 8,
            signal: SignalMode::IdRegister,
            master: Vector(60),
            cores: DeviceCores::default(),
            link: crate::peer::WireRate::Unlimited,
            schedule: super::engine::Schedule::RoundRobin,
            idle: Idle::Poll,
            iommu: false,
            vif_hold: super::engine::VIF_HOLD,
        }
    }
}

/// How a VIF's guest is told: its vector (bound to the guest's port) and, with the
/// identifier register, its bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VifSignal {
    /// The VIF's own vector.
    pub vector: Vector,
    /// Its identifier bit.
    pub bit: u8,
}

/// Signals as the hypervisor side counts them.
#[derive(Debug, Default)]
pub struct SignalStats {
    /// Guest events the hypervisor sent (from any design).
    pub events: AtomicU64,
    /// Master interrupts handled ([`SignalMode::IdRegister`]).
    pub master_interrupts: AtomicU64,
    /// Messages the sidecore took ([`SignalMode::Sidecore`]).
    pub sidecore_messages: AtomicU64,
    /// TSC ticks the hypervisor spent forwarding (the handler's or the sidecore's), for
    /// Figure 8's interrupt virtualization cost.
    pub forward_ticks: AtomicU64,
    /// Frames the device signalled for (each may wake several guests with the register).
    pub device_signals: AtomicU64,
    /// Identifier bits the handler found set, over all its runs: each is forwarded to
    /// every VIF sharing it (the paper's ⌊n/8⌋ to ⌈n/8⌉ events a frame).
    pub bits_handled: AtomicU64,
    /// Events the hypervisor sent to a VIF with no request of its own outstanding: it
    /// shared the bit with one that asked, or an earlier run of the handler had already
    /// told it. The identifier register's redundant wake-ups.
    pub redundant: AtomicU64,
    /// Events the hypervisor could not send: the VIF or its guest went between the
    /// device's signal and the forwarding (a machine shutting down).
    pub undelivered: AtomicU64,
}

/// What the device refused outside its engines, and how it paused the cable instead.
#[derive(Debug, Clone, Default)]
pub struct DeviceDrops {
    /// Frames the cable brought that found no device buffer.
    pub rx_fifo_full: u64,
    /// Messages for the sidecore that found its channel full.
    pub channel_full: u64,
    /// Times the device paused the cable's far end (802.3x XOFF) as its buffer filled.
    pub rx_xoffs: u64,
    /// Microseconds the far end spent paused, in all.
    pub rx_xoff_us: u64,
    /// The longest pause, in microseconds.
    pub rx_xoff_longest_us: u64,
}
hv::counter_set!(DeviceDrops {
    rx_fifo_full,
    channel_full,
    rx_xoffs,
    rx_xoff_us,
    rx_xoff_longest_us
});

hv::atomic_counter_set!(SignalStats => SignalCounts {
    events,
    master_interrupts,
    sidecore_messages,
    forward_ticks,
    device_signals,
    bits_handled,
    redundant,
    undelivered,
});

/// The signalling state shared by the device threads and the hypervisor's forwarders.
#[derive(Debug)]
struct Signals<P> {
    mode: SignalMode,
    master: Vector,
    reg: IdRegister,
    /// By VIF id: its signal, if it exists ([`encode`]): read by the device on every
    /// signal, so a word each, not a lock.
    vifs: Box<[AtomicU32]>,
    bits: Mutex<BitMap>,
    channel: SideChannel,
    /// By VIF id: the device signalled it and the hypervisor has not yet forwarded.
    asked: Box<[AtomicBool]>,
    stats: SignalStats,
    /// The sidecore's sleep, when it sleeps ([`Idle::Block`]): a message wakes it.
    sidecore_wake: Option<Arc<crate::wire::Doze>>,
    _p: std::marker::PhantomData<P>,
}

/// A VIF's signal as one word: valid bit, identifier bit, vector.
fn encode(s: Option<VifSignal>) -> u32 {
    s.map_or(0, |s| {
        1 << 31 | u32::from(s.bit) << 8 | u32::from(s.vector.0)
    })
}

fn decode(w: u32) -> Option<VifSignal> {
    (w >> 31 != 0).then_some(VifSignal {
        vector: Vector(w as u8),
        bit: (w >> 8) as u8,
    })
}

impl<P> Signals<P> {
    fn signal(&self, vif: u16) -> Option<VifSignal> {
        decode(self.vifs.get(vif as usize)?.load(Ordering::Acquire))
    }

    fn vector(&self, vif: u16) -> Option<Vector> {
        self.signal(vif).map(|s| s.vector)
    }

    /// The device side: signal `vif` by the configured design.
    fn raise(&self, hv: &Hypervisor, vif: u16) {
        self.stats.device_signals.fetch_add(1, Ordering::Relaxed);
        match self.mode {
            SignalMode::PerVif => {
                if let Some(v) = self.vector(vif) {
                    let _ = hv.raise_irq(v);
                }
            }
            SignalMode::IdRegister => {
                if let Some(b) = self.signal(vif).map(|s| s.bit) {
                    if let Some(a) = self.asked.get(vif as usize) {
                        a.store(true, Ordering::Release);
                    }
                    if self.reg.raise(Dir::Rx, b) {
                        let _ = hv.raise_irq(self.master);
                    }
                }
            }
            SignalMode::Sidecore => {
                // A full channel drops the message: the VIF's queue keeps the frame, and
                // its next frame's message wakes the guest (counted in `full`).
                let _ = self.channel.send(vif, Dir::Rx);
                if let Some(w) = &self.sidecore_wake {
                    w.wake();
                }
            }
        }
    }

    /// The hypervisor's master-interrupt handler: reads and clears the register and
    /// sends an event to every VIF sharing a set bit.
    fn handle_master(&self, hv: &Hypervisor) {
        let t0 = mem::cpu::rdtsc();
        self.stats.master_interrupts.fetch_add(1, Ordering::Relaxed);
        let bits = self.reg.take(Dir::Rx);
        self.stats
            .bits_handled
            .fetch_add(u64::from(bits.count_ones()), Ordering::Relaxed);
        if let Ok(map) = self.bits.lock() {
            map.demux(bits, &mut |v| {
                let asked = self
                    .asked
                    .get(v as usize)
                    .is_some_and(|a| a.swap(false, Ordering::AcqRel));
                if !asked {
                    self.stats.redundant.fetch_add(1, Ordering::Relaxed);
                }
                match self.vector(v).map(|vector| hv.send_pirq(vector)) {
                    Some(Ok(_)) => self.stats.events.fetch_add(1, Ordering::Relaxed),
                    _ => self.stats.undelivered.fetch_add(1, Ordering::Relaxed),
                };
            });
        }
        self.stats
            .forward_ticks
            .fetch_add(mem::cpu::rdtsc().wrapping_sub(t0), Ordering::Relaxed);
    }

    /// The sidecore's step: forwards every message waiting; how many.
    fn sidecore_step(&self, hv: &Hypervisor) -> usize {
        let mut n = 0;
        while let Some((vif, _dir)) = self.channel.recv() {
            let t0 = mem::cpu::rdtsc();
            self.stats.sidecore_messages.fetch_add(1, Ordering::Relaxed);
            match self.vector(vif).map(|v| hv.send_pirq(v)) {
                Some(Ok(_)) => self.stats.events.fetch_add(1, Ordering::Relaxed),
                // The VIF or its guest went since the device wrote the message.
                _ => self.stats.undelivered.fetch_add(1, Ordering::Relaxed),
            };
            self.stats
                .forward_ticks
                .fetch_add(mem::cpu::rdtsc().wrapping_sub(t0), Ordering::Relaxed);
            n += 1;
        }
        n
    }
}

/// VIF ids a device serves (0 to this, exclusive).
pub const MAX_VIFS: usize = 256;

/// Frames the network I/O engine holds between the cable and the ingress contexts.
const RX_FIFO: usize = 256;
/// With fewer free buffers than this, the device pauses a far end that takes PAUSE
/// frames (an 802.3x XOFF at the high-water mark, as the NIC's packet buffer does);
/// what that far end would still send stays on its side of the cable.
const RX_FIFO_XOFF: usize = RX_FIFO / 8;
/// With this many free buffers again, it lets the far end go (the XON).
const RX_FIFO_XON: usize = RX_FIFO / 2;

/// A management request to the egress engine (the device-side driver writes it, the
/// engine takes it between steps).
enum EgressReq<P> {
    Add { id: u16, mac: [u8; 6], tx: VifTx<P> },
    Remove { id: u16 },
    Priority { id: u16, priority: u8 },
    Schedule(super::engine::Schedule),
}

/// A management request to the ingress engine.
enum IngressReq<P> {
    Add {
        id: u16,
        mac: [u8; 6],
        rx: Arc<VifRx<P>>,
    },
    Remove {
        id: u16,
    },
    Dma {
        id: u16,
        dma: Box<super::engine::VifDma>,
    },
    Misplace(u32),
}

/// What the device threads share.
struct Shared<P> {
    stop: AtomicBool,
    /// The cable is plugged in: until then the device takes nothing from it.
    link_up: AtomicBool,
    egress_requests: Mutex<Vec<EgressReq<P>>>,
    ingress_requests: Mutex<Vec<IngressReq<P>>>,
    signals: Arc<Signals<P>>,
    times: Arc<StageTimes>,
    egress_stats: Mutex<Option<Arc<EngineStats>>>,
    ingress_stats: Mutex<Option<Arc<EngineStats>>>,
    /// Frames the cable brought that the device had no buffer for.
    rx_fifo_full: AtomicU64,
    /// Pauses of the cable's far end: how many, their microseconds, the longest.
    rx_xoffs: AtomicU64,
    rx_xoff_us: AtomicU64,
    rx_xoff_longest_us: AtomicU64,
    /// Management requests each engine has carried out (egress, ingress): a request
    /// is done once both passed its number.
    done: [AtomicU64; 2],
    /// Requests issued.
    issued: AtomicU64,
    /// The device-side management driver's counters.
    mgmt: Arc<super::mgmt::MgmtStats>,
    /// Engine threads still running: the sidecore stops after them, with every
    /// message they wrote forwarded.
    engines_running: std::sync::atomic::AtomicUsize,
    /// The idle policy.
    idle: Idle,
    /// VIFs through the IOMMU ([`SvnicConfig::iommu`]).
    iommu: bool,
    /// Each thread's sleep: egress (the guests' doorbell), ingress (the cable's), the
    /// sidecore (the engines').
    dozes: [Arc<crate::wire::Doze>; 3],
}

/// The running device.
pub struct Svnic<P: PageAccess + Send + Sync + 'static> {
    ctl: Control<P>,
    threads: Vec<JoinHandle<()>>,
    /// The engines and sidecore, when they run as units on pCPUs.
    units: Vec<hv::sched::UnitJoin<()>>,
}

/// The device's management interface and counters: what its device-side management
/// driver ([`super::mgmt`]) calls, and a test standing in for it. Cheap to clone; the
/// running [`Svnic`] dereferences to it.
pub struct Control<P> {
    shared: Arc<Shared<P>>,
}

impl<P> std::fmt::Debug for Control<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control").finish_non_exhaustive()
    }
}

impl<P> Clone for Control<P> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<P: PageAccess + Send + Sync + 'static> std::ops::Deref for Svnic<P> {
    type Target = Control<P>;
    fn deref(&self) -> &Control<P> {
        &self.ctl
    }
}

impl<P: PageAccess + Send + Sync + 'static> std::fmt::Debug for Svnic<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Svnic")
            .field("threads", &self.threads.len())
            .finish_non_exhaustive()
    }
}

/// When a thread last had work, and how far apart its work has been coming (a moving
/// average): work that comes closer together than the spin is polled for.
#[derive(Debug, Clone, Copy)]
struct Activity {
    at: Instant,
    gap: std::time::Duration,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            at: Instant::now(),
            gap: std::time::Duration::MAX,
        }
    }
}

impl Activity {
    fn worked(&mut self, now: Instant) {
        let g = now.saturating_duration_since(self.at);
        // A quarter of the newest gap, three of the average (saturating at first).
        self.gap = if self.gap == std::time::Duration::MAX {
            g
        } else {
            (self.gap * 3 + g) / 4
        };
        self.at = now;
    }
}

/// An engine, counted while it runs (also if it panics: the guard goes with it); the
/// sidecore, which stops after the engines, is told when one goes.
struct Running<P>(Arc<Shared<P>>);

impl<P> Drop for Running<P> {
    fn drop(&mut self) {
        self.0.engines_running.fetch_sub(1, Ordering::AcqRel);
        self.0.dozes[2].kick();
    }
}

/// Where the engines go: a scheduler, and the pCPU for each configured core.
type Placement<'a> = (&'a hv::sched::Scheduler, &'a dyn Fn(Option<usize>) -> usize);

/// What one step of an engine came to.
enum EngineStep {
    /// It did work (or found some after announcing its sleep): step again.
    Busy,
    /// Nothing to do, but it polls: give the core to whatever else runs there.
    Yield,
    /// Nothing to do: asleep until woken or this instant.
    Sleep(Instant),
    /// Stopped.
    Done,
}

/// One of the device's engines (egress, ingress, the sidecore): a step is one pass.
trait DeviceEngine: Send {
    fn name(&self) -> &'static str;
    /// What wakes it.
    fn doze(&self) -> &Arc<crate::wire::Doze>;
    fn step(&mut self) -> EngineStep;
}

/// An engine on a thread of its own, pinned to `core` if given.
fn run_engine_thread(mut e: Box<dyn DeviceEngine>, core: Option<usize>) {
    pin(core);
    e.doze().bind(std::thread::current());
    loop {
        match e.step() {
            EngineStep::Busy => {}
            EngineStep::Yield => std::thread::yield_now(),
            EngineStep::Sleep(until) => {
                let d = Arc::clone(e.doze());
                d.sleep(until.saturating_duration_since(Instant::now()));
            }
            EngineStep::Done => return,
        }
    }
}

/// An engine as a unit on a pCPU.
struct EngineUnit(Box<dyn DeviceEngine>);

impl hv::sched::Unit for EngineUnit {
    type Output = ();
    fn attach(&mut self, waker: &hv::sched::Waker, _stats: &Arc<hv::sched::UnitStats>) {
        self.0.doze().bind_unit(waker);
    }
    fn step(&mut self, _cx: &hv::sched::Cx) -> hv::sched::Step<()> {
        self.0.doze().awake();
        match self.0.step() {
            EngineStep::Busy => hv::sched::Step::More,
            EngineStep::Yield => hv::sched::Step::Yield,
            EngineStep::Sleep(until) => hv::sched::Step::Idle(Some(until)),
            EngineStep::Done => hv::sched::Step::Done(()),
        }
    }
}

/// The egress engine: management requests, then what the link lets the contexts send.
struct EgressEngine<P: PageAccess + Send + Sync + 'static> {
    sh: Arc<Shared<P>>,
    hv: Arc<Hypervisor>,
    e: Egress<P>,
    link: crate::peer::WireRate,
    /// When the link is free again (the last frame's last bit).
    free_at: Instant,
    last: Activity,
    sink: Box<dyn WireSink>,
    _running: Running<P>,
}

impl<P: PageAccess + Send + Sync + 'static> EgressEngine<P> {
    fn new(
        sh: Arc<Shared<P>>,
        hv: &Arc<Hypervisor>,
        cfg: &SvnicConfig,
        sink: Box<dyn WireSink>,
    ) -> Self {
        let mut e: Egress<P> = Egress::new(cfg.egress_contexts, Arc::clone(&sh.times));
        e.set_schedule(cfg.schedule);
        if let Ok(mut s) = sh.egress_stats.lock() {
            *s = Some(Arc::clone(e.stats()));
        }
        Self {
            _running: Running(Arc::clone(&sh)),
            sh,
            hv: Arc::clone(hv),
            e,
            link: cfg.link,
            free_at: Instant::now(),
            last: Activity::default(),
            sink,
        }
    }
}

impl<P: PageAccess + Send + Sync + 'static> DeviceEngine for EgressEngine<P> {
    fn name(&self) -> &'static str {
        "svnic-egress"
    }
    fn doze(&self) -> &Arc<crate::wire::Doze> {
        &self.sh.dozes[0]
    }
    fn step(&mut self) -> EngineStep {
        let sh = &self.sh;
        if sh.stop.load(Ordering::Acquire) {
            return EngineStep::Done;
        }
        let e = &mut self.e;
        if let Ok(mut r) = sh.egress_requests.lock() {
            for req in r.drain(..) {
                match req {
                    EgressReq::Add { id, mac, tx } => e.add(id, mac, tx),
                    EgressReq::Remove { id } => {
                        e.remove(id);
                    }
                    EgressReq::Priority { id, priority } => {
                        e.set_priority(id, priority);
                    }
                    EgressReq::Schedule(s) => e.set_schedule(s),
                }
            }
            // Everything issued before this lock is carried out.
            sh.done[0].store(sh.issued.load(Ordering::Acquire), Ordering::Release);
        }
        // The MAC takes one frame at a time at the link's rate; with no limit, every
        // context may send.
        let now = Instant::now();
        let link = self.link;
        // A far end that paused the link, or a cable with no room, takes nothing: the
        // frames stay in the guests' send queues.
        let budget = match link {
            _ if !self.sink.room() => 0,
            crate::peer::WireRate::Unlimited => usize::MAX,
            crate::peer::WireRate::Bits(_) => usize::from(self.free_at <= now),
        };
        let (free_at, sink) = (&mut self.free_at, &mut self.sink);
        let n = if budget == 0 {
            0
        } else {
            e.step(budget, &mut |_, f| {
                *free_at = (*free_at).max(now) + link.serialization(f.len());
                sink.transmit(f, Offload::NONE);
            })
        };
        if n > 0 {
            self.sink.flush();
        }
        let hv = &self.hv;
        e.take_tx_wakes(&mut |vif| sh.signals.raise(hv, vif));
        if n > 0 || budget == 0 {
            // Sent, or frames wait for the link: busy.
            self.last.worked(now);
            return if n == 0 {
                EngineStep::Yield
            } else {
                EngineStep::Busy
            };
        }
        let e = &self.e;
        sh.idle(
            0,
            &mut self.last,
            || e.has_pending() || sh.requests_waiting(0),
            None,
        )
    }
}

/// A frame in the network I/O engine's buffer: its bytes, its length, and its VIF
/// when the engine chose it (a copy of a broadcast).
type Held = (Box<[u8]>, usize, Option<u16>);

/// The ingress engine: management requests, frames from the cable into the network
/// I/O engine's FIFO, then the contexts place them in the VIFs' buffers.
struct IngressEngine<P: PageAccess + Send + Sync + 'static> {
    sh: Arc<Shared<P>>,
    hv: Arc<Hypervisor>,
    ing: Ingress<P>,
    vifs: IngressVifs<P>,
    /// The network I/O engine's buffers: frames from the cable wait here for an
    /// ingress context.
    fifo: VecDeque<Held>,
    free: Vec<Box<[u8]>>,
    /// Since when the device has paused the cable's far end, if it has.
    xoff: Option<Instant>,
    last: Activity,
    source: Box<dyn WireSource>,
    _running: Running<P>,
}

impl<P: PageAccess + Send + Sync + 'static> IngressEngine<P> {
    fn new(
        sh: Arc<Shared<P>>,
        hv: &Arc<Hypervisor>,
        cfg: &SvnicConfig,
        mut source: Box<dyn WireSource>,
    ) -> Self {
        source.attach(&sh.dozes[1]);
        let mut ing: Ingress<P> = Ingress::new(cfg.ingress_contexts, Arc::clone(&sh.times));
        ing.set_hold(cfg.vif_hold);
        if let Ok(mut s) = sh.ingress_stats.lock() {
            *s = Some(Arc::clone(ing.stats()));
        }
        Self {
            _running: Running(Arc::clone(&sh)),
            sh,
            hv: Arc::clone(hv),
            ing,
            vifs: IngressVifs {
                rx: Vec::new(),
                demux: Demux::new(256),
            },
            fifo: VecDeque::with_capacity(RX_FIFO),
            free: (0..RX_FIFO)
                .map(|_| vec![0u8; SLOT_BYTES].into_boxed_slice())
                .collect(),
            xoff: None,
            last: Activity::default(),
            source,
        }
    }
}

impl<P: PageAccess + Send + Sync + 'static> DeviceEngine for IngressEngine<P> {
    fn name(&self) -> &'static str {
        "svnic-ingress"
    }
    fn doze(&self) -> &Arc<crate::wire::Doze> {
        &self.sh.dozes[1]
    }
    fn step(&mut self) -> EngineStep {
        let Self {
            sh,
            hv,
            ing,
            vifs,
            fifo,
            free,
            xoff,
            last,
            source,
            ..
        } = self;
        if sh.stop.load(Ordering::Acquire) {
            // A far end left paused would wait for this device for ever.
            xon(sh, source.as_mut(), xoff, Instant::now());
            return EngineStep::Done;
        }
        if let Ok(mut r) = sh.ingress_requests.lock() {
            for req in r.drain(..) {
                match req {
                    IngressReq::Add { id, mac, rx } => {
                        let i = id as usize;
                        if vifs.rx.len() <= i {
                            vifs.rx.resize_with(i + 1, || None);
                        }
                        vifs.rx[i] = Some(rx);
                        vifs.demux.insert(mac, id);
                    }
                    IngressReq::Remove { id } => {
                        if let Some(r) = vifs.rx.get_mut(id as usize) {
                            *r = None;
                        }
                        ing.forget(id);
                    }
                    IngressReq::Dma { id, dma } => ing.set_dma(id, Some(*dma)),
                    IngressReq::Misplace(every) => ing.inject_misplacement(every),
                }
            }
            sh.done[1].store(sh.issued.load(Ordering::Acquire), Ordering::Release);
        }
        if sh.link_up.load(Ordering::Acquire) {
            let st = ing.stats();
            let now = Instant::now();
            if !source.pauses() {
                source.poll(now, &mut |f, _off| intake(f, fifo, free, vifs, sh, st));
            } else {
                if free.len() >= RX_FIFO_XON {
                    xon(sh, source.as_mut(), xoff, now);
                }
                if xoff.is_none() {
                    // Frames as the cable brings them, until the buffer's free part
                    // falls under the high-water mark: then the far end is paused, and
                    // what it would still send stays with it, first in its line.
                    source.poll_held(now, &mut |f, _off| {
                        if xoff.is_some() {
                            return false;
                        }
                        intake(f, fifo, free, vifs, sh, st);
                        if free.len() < RX_FIFO_XOFF {
                            *xoff = Some(Instant::now());
                            sh.rx_xoffs.fetch_add(1, Ordering::Relaxed);
                        }
                        true
                    });
                    if let Some(at) = *xoff {
                        source.pause(true, at);
                    }
                }
            }
        }
        let sig = &sh.signals;
        let now = Instant::now();
        let n = ing.step(
            vifs,
            now,
            &mut |buf: &mut [u8]| {
                let (b, len, to) = fifo.pop_front()?;
                buf[..len].copy_from_slice(&b[..len]);
                free.push(b);
                Some((len, to))
            },
            &mut |vif| sig.raise(hv, vif),
        );
        if n > 0 || !fifo.is_empty() || ing.in_flight() > 0 {
            last.worked(Instant::now());
            return if n == 0 {
                EngineStep::Yield
            } else {
                EngineStep::Busy
            };
        }
        let up = sh.link_up.load(Ordering::Acquire);
        let next = if up { source.next_due() } else { None };
        sh.idle(
            1,
            last,
            || (up && source.ready()) || sh.requests_waiting(1),
            next,
        )
    }
}

/// A frame from the cable into the network I/O engine's buffer: a broadcast or
/// multicast frame goes to every VIF, the engine making a copy for each, addressed.
/// What finds no free buffer is dropped and counted.
fn intake<P>(
    f: &[u8],
    fifo: &mut VecDeque<Held>,
    free: &mut Vec<Box<[u8]>>,
    vifs: &IngressVifs<P>,
    sh: &Shared<P>,
    st: &EngineStats,
) {
    let mut each = |to: Option<u16>| match free.pop() {
        Some(mut b) if f.len() <= b.len() => {
            b[..f.len()].copy_from_slice(f);
            fifo.push_back((b, f.len(), to));
        }
        Some(b) => {
            free.push(b);
            sh.rx_fifo_full.fetch_add(1, Ordering::Relaxed);
        }
        None => {
            sh.rx_fifo_full.fetch_add(1, Ordering::Relaxed);
        }
    };
    if f.first().is_none_or(|&b| b & 1 == 0) {
        return each(None);
    }
    for (id, rx) in vifs.rx.iter().enumerate() {
        if rx.is_some() {
            st.broadcast.fetch_add(1, Ordering::Relaxed);
            each(Some(id as u16));
        }
    }
}

/// Lets a far end the device paused go again (the XON), and accounts the pause.
fn xon<P>(sh: &Shared<P>, source: &mut dyn WireSource, xoff: &mut Option<Instant>, now: Instant) {
    let Some(since) = xoff.take() else {
        return;
    };
    source.pause(false, now);
    let us = now.saturating_duration_since(since).as_micros() as u64;
    sh.rx_xoff_us.fetch_add(us, Ordering::Relaxed);
    sh.rx_xoff_longest_us.fetch_max(us, Ordering::Relaxed);
}

/// The sidecore: forwards the engines' signals (paper 002's interrupt virtualization);
/// it stops after the engines, forwarding whatever they wrote last.
struct Sidecore<P> {
    sh: Arc<Shared<P>>,
    hv: Arc<Hypervisor>,
    last: Activity,
}

impl<P: PageAccess + Send + Sync + 'static> DeviceEngine for Sidecore<P> {
    fn name(&self) -> &'static str {
        "sidecore"
    }
    fn doze(&self) -> &Arc<crate::wire::Doze> {
        &self.sh.dozes[2]
    }
    fn step(&mut self) -> EngineStep {
        let sh = &self.sh;
        if sh.signals.sidecore_step(&self.hv) > 0 {
            self.last.worked(Instant::now());
            return EngineStep::Busy;
        }
        if sh.stop.load(Ordering::Acquire) && sh.engines_running.load(Ordering::Acquire) == 0 {
            sh.signals.sidecore_step(&self.hv);
            return EngineStep::Done;
        }
        sh.idle(
            2,
            &mut self.last,
            || !sh.signals.channel.is_empty() || sh.engines_running.load(Ordering::Acquire) == 0,
            None,
        )
    }
}

impl<P> Shared<P> {
    /// Engine `k` (0 egress, 1 ingress, 2 sidecore) found nothing to do. Polling, it
    /// yields its core (on a pCPU: lets the pCPU's other units run). Sleeping when idle,
    /// it polls on while work has been coming closer together than its spin (and for no
    /// longer than the spin); otherwise, or once the spin has passed, it announces its
    /// sleep, looks once more (`work`: anything to do after all?), and sleeps until
    /// `until`, a wake-up, or [`NAP`].
    fn idle(
        &self,
        k: usize,
        last: &mut Activity,
        work: impl FnOnce() -> bool,
        until: Option<Instant>,
    ) -> EngineStep {
        let Idle::Block { spin } = self.idle else {
            return EngineStep::Yield;
        };
        if last.gap < spin && last.at.elapsed() < spin {
            return EngineStep::Yield;
        }
        let d = &self.dozes[k];
        d.announce();
        if work() || self.stop.load(Ordering::Acquire) {
            d.awake();
            return EngineStep::Busy;
        }
        let now = Instant::now();
        let nap = until.map_or(NAP, |u| u.saturating_duration_since(now).min(NAP));
        EngineStep::Sleep(now + nap)
    }

    /// Management requests wait for engine `k` (0 egress, 1 ingress).
    fn requests_waiting(&self, k: usize) -> bool {
        if k == 0 {
            self.egress_requests.lock().is_ok_and(|r| !r.is_empty())
        } else {
            self.ingress_requests.lock().is_ok_and(|r| !r.is_empty())
        }
    }

    /// Requests were queued: both engines look at them.
    fn wake_engines(&self) {
        self.dozes[0].wake();
        self.dozes[1].wake();
    }
}

fn pin(core: Option<usize>) {
    if let Some(c) = core {
        let _ = mem::cpu::pin_current_thread(c);
    }
}

impl<P: PageAccess + Send + Sync + 'static> Svnic<P> {
    /// Starts the device on `hv`, its cable `source` and `sink`. With the identifier
    /// register, the master vector's handler is bound to `controller`'s vCPU.
    pub fn start(
        hv: &Arc<Hypervisor>,
        controller: Option<&hv::Domain>,
        cfg: SvnicConfig,
        source: Box<dyn WireSource>,
        sink: Box<dyn WireSink>,
    ) -> Result<Self, hv::EvtchnError> {
        Self::start_with(hv, controller, cfg, source, sink, None)
    }

    /// As [`Svnic::start`], its engines and sidecore units on pCPUs of `sched`
    /// (`pcpu_of` maps the core [`SvnicConfig::cores`] names to a pCPU) instead of
    /// threads of their own.
    pub fn start_on(
        hv: &Arc<Hypervisor>,
        controller: Option<&hv::Domain>,
        cfg: SvnicConfig,
        source: Box<dyn WireSource>,
        sink: Box<dyn WireSink>,
        sched: &hv::sched::Scheduler,
        pcpu_of: &dyn Fn(Option<usize>) -> usize,
    ) -> Result<Self, hv::EvtchnError> {
        Self::start_with(hv, controller, cfg, source, sink, Some((sched, pcpu_of)))
    }

    fn start_with(
        hv: &Arc<Hypervisor>,
        controller: Option<&hv::Domain>,
        cfg: SvnicConfig,
        source: Box<dyn WireSource>,
        sink: Box<dyn WireSink>,
        place: Option<Placement<'_>>,
    ) -> Result<Self, hv::EvtchnError> {
        let dozes: [Arc<crate::wire::Doze>; 3] = Default::default();
        let blocking = matches!(cfg.idle, Idle::Block { .. });
        let signals = Arc::new(Signals {
            mode: cfg.signal,
            master: cfg.master,
            reg: IdRegister::default(),
            vifs: (0..MAX_VIFS).map(|_| AtomicU32::new(0)).collect(),
            bits: Mutex::new(BitMap::default()),
            channel: SideChannel::new(1024),
            asked: (0..MAX_VIFS).map(|_| AtomicBool::new(false)).collect(),
            stats: SignalStats::default(),
            sidecore_wake: blocking.then(|| Arc::clone(&dozes[2])),
            _p: std::marker::PhantomData,
        });
        if cfg.signal == SignalMode::IdRegister {
            if let Some(c) = controller {
                let s = Arc::clone(&signals);
                hv.bind_irq_handler(c, cfg.master, Box::new(move |hv| s.handle_master(hv)))?;
            }
        }
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            link_up: AtomicBool::new(false),
            egress_requests: Mutex::new(Vec::new()),
            ingress_requests: Mutex::new(Vec::new()),
            signals,
            times: Arc::new(StageTimes::default()),
            egress_stats: Mutex::new(None),
            ingress_stats: Mutex::new(None),
            rx_fifo_full: AtomicU64::new(0),
            rx_xoffs: AtomicU64::new(0),
            rx_xoff_us: AtomicU64::new(0),
            rx_xoff_longest_us: AtomicU64::new(0),
            done: [AtomicU64::new(0), AtomicU64::new(0)],
            issued: AtomicU64::new(0),
            mgmt: Arc::default(),
            engines_running: std::sync::atomic::AtomicUsize::new(2),
            idle: cfg.idle,
            iommu: cfg.iommu,
            dozes,
        });
        let mut engines: Vec<(Box<dyn DeviceEngine>, Option<usize>)> = vec![
            (
                Box::new(EgressEngine::new(Arc::clone(&shared), hv, &cfg, sink)),
                cfg.cores.egress,
            ),
            (
                Box::new(IngressEngine::new(Arc::clone(&shared), hv, &cfg, source)),
                cfg.cores.ingress,
            ),
        ];
        if cfg.signal == SignalMode::Sidecore {
            engines.push((
                Box::new(Sidecore {
                    sh: Arc::clone(&shared),
                    hv: Arc::clone(hv),
                    last: Activity::default(),
                }),
                cfg.cores.sidecore,
            ));
        }
        let mut threads = Vec::new();
        let mut units = Vec::new();
        for (e, core) in engines {
            match place {
                Some((sched, pcpu_of)) => {
                    let name = e.name();
                    let j = sched
                        .place(
                            pcpu_of(core),
                            hv::sched::UnitSpec::named(name),
                            EngineUnit(e),
                        )
                        .map_err(|_| hv::EvtchnError::NoFreePort)?;
                    units.push(j);
                }
                None => threads.push(
                    std::thread::Builder::new()
                        .name(e.name().into())
                        .spawn(move || run_engine_thread(e, core))
                        .map_err(|_| hv::EvtchnError::NoFreePort)?,
                ),
            }
        }
        Ok(Self {
            ctl: Control { shared },
            threads,
            units,
        })
    }

    /// Stops the device's threads.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.ctl.shared.stop.store(true, Ordering::Release);
        for d in &self.ctl.shared.dozes {
            d.kick();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for u in self.units.drain(..) {
            let _ = u.join();
        }
    }
}

impl Svnic<hv::OwnPage> {
    /// Starts the device-side management driver: it takes VIF requests from the store
    /// under `device`'s directory ([`super::mgmt`]) until the device stops.
    pub fn manage(
        &mut self,
        hv: &Arc<Hypervisor>,
        device: Arc<hv::Domain>,
    ) -> Result<(), super::mgmt::MgmtError> {
        let t = super::mgmt::DeviceDriver::start(hv, device, self.ctl.clone())?;
        self.threads.push(t);
        Ok(())
    }
}

impl<P: PageAccess + Send + Sync + 'static> Control<P> {
    /// Whether each VIF has its own memory domain and IOMMU context
    /// ([`SvnicConfig::iommu`]).
    pub fn iommu(&self) -> bool {
        self.shared.iommu
    }

    /// The ingress engine reaches VIF `id`'s receive buffers through `dma` (asked before
    /// the VIF is added, so that no frame of it is written otherwise).
    pub fn set_vif_dma(&self, id: u16, dma: super::engine::VifDma) {
        if let Ok(mut r) = self.shared.ingress_requests.lock() {
            r.push(IngressReq::Dma {
                id,
                dma: Box::new(dma),
            });
        }
        self.shared.wake_engines();
    }

    /// Fault injection: an ingress bug placing every `every`th frame at the next VIF's
    /// address ([`super::engine::Ingress::inject_misplacement`]); 0 ends it.
    pub fn inject_misplacement(&self, every: u32) {
        if let Ok(mut r) = self.shared.ingress_requests.lock() {
            r.push(IngressReq::Misplace(every));
        }
        self.shared.wake_engines();
    }

    /// The device was stopped.
    pub fn stopped(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// Messages for the sidecore that found its channel full (each VIF's frame waits in
    /// its queue for the next signal).
    pub fn channel_full(&self) -> u64 {
        self.shared.signals.channel.full.load(Ordering::Relaxed)
    }

    /// The device-side management driver's counters.
    pub fn mgmt_stats(&self) -> &Arc<super::mgmt::MgmtStats> {
        &self.shared.mgmt
    }

    /// The device-side management driver adds VIF `id` (its queues, its MAC, its
    /// signal); the engines take it at their next step. False (nothing added) for an id
    /// of [`MAX_VIFS`] or more.
    pub fn add_vif(
        &self,
        id: u16,
        mac: [u8; 6],
        tx: VifTx<P>,
        rx: Arc<VifRx<P>>,
        signal: VifSignal,
    ) -> bool {
        let s = &self.shared.signals;
        let Some(w) = s.vifs.get(id as usize) else {
            return false;
        };
        w.store(encode(Some(signal)), Ordering::Release);
        if let Ok(mut b) = s.bits.lock() {
            b.add(signal.bit, id);
        }
        if let Ok(mut r) = self.shared.ingress_requests.lock() {
            r.push(IngressReq::Add { id, mac, rx });
        }
        if let Ok(mut r) = self.shared.egress_requests.lock() {
            r.push(EgressReq::Add { id, mac, tx });
        }
        self.shared.wake_engines();
        true
    }

    /// The management API: VIF `id`'s priority, 1 (lowest) to 100, for the
    /// quality-aware egress scheduler.
    pub fn set_priority(&self, id: u16, priority: u8) {
        if let Ok(mut r) = self.shared.egress_requests.lock() {
            r.push(EgressReq::Priority { id, priority });
        }
        self.shared.wake_engines();
    }

    /// The management API: quality-aware or quality-unaware egress.
    pub fn set_schedule(&self, s: super::engine::Schedule) {
        if let Ok(mut r) = self.shared.egress_requests.lock() {
            r.push(EgressReq::Schedule(s));
        }
        self.shared.wake_engines();
    }

    /// Plugs the cable in: the device starts taking frames from it.
    pub fn link_up(&self) {
        self.shared.link_up.store(true, Ordering::Release);
        self.shared.dozes[1].wake();
    }

    /// Frames the cable brought that found no device buffer.
    pub fn rx_fifo_full(&self) -> u64 {
        self.shared.rx_fifo_full.load(Ordering::Relaxed)
    }

    /// The device's own refusals, outside its engines ([`Svnic::rx_fifo_full`] and
    /// [`Svnic::channel_full`]), and its pauses of the cable's far end.
    pub fn drops(&self) -> DeviceDrops {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceDrops {
            rx_fifo_full: self.rx_fifo_full(),
            channel_full: self.channel_full(),
            rx_xoffs: l(&self.shared.rx_xoffs),
            rx_xoff_us: l(&self.shared.rx_xoff_us),
            rx_xoff_longest_us: l(&self.shared.rx_xoff_longest_us),
        }
    }

    /// A bit for a new VIF from the identifier register (`next++ mod 8`).
    pub fn assign_bit(&self) -> u8 {
        self.shared.signals.reg.assign()
    }

    /// Removes VIF `id` and returns once both engines have let go of its queues (a
    /// context that held one of its frames drops it; nothing is written into the VIF's
    /// memory after this), so that the region can be taken back. False if the engines
    /// did not answer within `wait` (stopped, or starved of their cores).
    pub fn remove_vif(&self, id: u16, wait: std::time::Duration) -> bool {
        // The issue number is taken under both request locks, so an engine that saw
        // this request also counts it, and one that counted it has seen it.
        let (Ok(mut ri), Ok(mut re)) = (
            self.shared.ingress_requests.lock(),
            self.shared.egress_requests.lock(),
        ) else {
            return false;
        };
        ri.push(IngressReq::Remove { id });
        re.push(EgressReq::Remove { id });
        let n = self.shared.issued.fetch_add(1, Ordering::AcqRel) + 1;
        drop((ri, re));
        self.shared.wake_engines();
        let s = &self.shared.signals;
        if let Ok(mut b) = s.bits.lock() {
            b.remove(id);
        }
        if let Some(w) = s.vifs.get(id as usize) {
            w.store(0, Ordering::Release);
        }
        let t = Instant::now();
        while self
            .shared
            .done
            .iter()
            .any(|d| d.load(Ordering::Acquire) < n)
        {
            if t.elapsed() >= wait {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    /// The egress engine's doorbell for the guests' VIF drivers
    /// ([`super::vif::VifFront::with_doorbell`]), when it sleeps when idle.
    pub fn doorbell(&self) -> Option<Arc<crate::wire::Doze>> {
        matches!(self.shared.idle, Idle::Block { .. }).then(|| Arc::clone(&self.shared.dozes[0]))
    }

    /// Figure 8's stage times so far.
    pub fn stage_times(&self) -> &Arc<StageTimes> {
        &self.shared.times
    }

    /// The signalling counters.
    pub fn signal_stats(&self) -> &SignalStats {
        &self.shared.signals.stats
    }

    /// The engines' counters (once their threads started).
    pub fn engine_stats(&self) -> (Option<Arc<EngineStats>>, Option<Arc<EngineStats>>) {
        let g = |m: &Mutex<Option<Arc<EngineStats>>>| m.lock().ok().and_then(|s| s.clone());
        (g(&self.shared.egress_stats), g(&self.shared.ingress_stats))
    }
}

impl<P: PageAccess + Send + Sync + 'static> Drop for Svnic<P> {
    fn drop(&mut self) {
        self.halt();
    }
}
