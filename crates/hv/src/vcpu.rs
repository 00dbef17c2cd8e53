//! vCPUs: a domain's kernel loop, run as a unit on one of pvio's pCPUs
//! ([`crate::sched`]) or, for the hypervisor's own tests and micro-benchmarks, on an OS
//! thread of its own.
//!
//! On a pCPU, a vCPU with nothing to do is *blocked* (`SCHEDOP_block`): [`Vcpu::idle`]
//! announces it, re-checks its events after a full fence, and the pCPU runs its other
//! units or idles; an event for it sets its bit in its pCPU's IPI word
//! ([`crate::sched::Waker`]), and [`Vcpu::resume`] accounts the wake-up as Xen's
//! context switch does.
//!
//! On a thread of its own, a vCPU waits for events in one of three modes. *Blocking* is Xen's `SCHEDOP_block`: the
//! thread announces it is blocked, re-checks `upcall_pending` after a full fence, and
//! parks (a futex) until a sender's kick unparks it — a real cross-core wake-up, several
//! microseconds. *Polling* spins on `upcall_pending` without a syscall — tens of
//! nanoseconds per hand-off, at the price of a core. Both are real; the experiments say
//! which they use.

use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use mem::cpu::{pin_current_thread, SampleSlot, SlotBinding, ThreadClock};

use crate::domain::Domain;
use crate::profile::{enter, Class};
use crate::sched::{UnitStats, Waker};
use crate::time::{read_system_time, update_vcpu_system_time, Runstate, RunstateKind};
use crate::types::{Port, Vector};
use crate::Hypervisor;

/// How a vCPU waits for events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitMode {
    /// Park the thread until kicked (a halted vCPU).
    Blocking,
    /// Spin on the upcall flag (a polling vCPU).
    Polling,
    /// Spin on the upcall flag for up to this long, then park until kicked (KVM's
    /// `halt_poll_ns`): an event that comes soon after the vCPU went idle costs what
    /// polling costs, a long idle what blocking costs, and an idle vCPU gives its core
    /// back after the bound. The spin is the vCPU's own CPU time.
    HaltPoll(Duration),
}

pub use crate::sched::HALT_POLL_DEFAULT;

/// Per-vCPU state kept in the domain.
#[derive(Debug)]
pub struct VcpuState {
    id: u32,
    thread: OnceLock<Thread>,
    /// What wakes it, when it runs as a unit on a pCPU.
    waker: OnceLock<Waker>,
    /// Its pCPU's accounting of it, when it runs as a unit.
    unit: OnceLock<Arc<UnitStats>>,
    /// Set while the vCPU is (about to be) parked.
    blocked: AtomicBool,
    /// A wake-up that is not an event (a stop request, say).
    kicked: AtomicBool,
    /// 0: blocking, 1: polling, 2: halt-polling for `halt_poll_ns`.
    mode: AtomicU8,
    halt_poll_ns: AtomicU64,
    pub(crate) slot: Arc<SampleSlot>,
    clock: Mutex<Option<ThreadClock>>,
    /// CPU time at exit, in ns, once the thread has ended.
    final_cpu_ns: AtomicU64,
    /// Counters (owner-written, read when reporting).
    blocks: AtomicU64,
    wakes: AtomicU64,
    /// Times the vCPU looked at its events: what a watchdog sees move while the
    /// vCPU's kernel makes progress.
    looks: AtomicU64,
    /// Physical vectors raised at this CPU and not yet taken by the hypervisor (the
    /// local APIC's request register).
    irr: [AtomicU64; 4],
    /// The single-shot timer's deadline on the hypervisor clock, in ns; 0 when unset.
    timer_deadline: AtomicU64,
    /// The port bound to `VIRQ_TIMER`, plus one; 0 when none.
    timer_port: AtomicU32,
    timer_fires: AtomicU64,
    /// Run-state accounting (owner-written): the state, when it began, and ns per
    /// state, as [`crate::time::Runstate`].
    run_state: AtomicU8,
    run_entry_ns: AtomicU64,
    run_time_ns: [AtomicU64; 4],
}

impl VcpuState {
    pub(crate) fn new(id: u32) -> Self {
        Self {
            id,
            thread: OnceLock::new(),
            waker: OnceLock::new(),
            unit: OnceLock::new(),
            blocked: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
            mode: AtomicU8::new(0),
            halt_poll_ns: AtomicU64::new(0),
            slot: Arc::new(SampleSlot::default()),
            clock: Mutex::new(None),
            final_cpu_ns: AtomicU64::new(0),
            blocks: AtomicU64::new(0),
            looks: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
            irr: std::array::from_fn(|_| AtomicU64::new(0)),
            timer_deadline: AtomicU64::new(0),
            timer_port: AtomicU32::new(0),
            timer_fires: AtomicU64::new(0),
            run_state: AtomicU8::new(RunstateKind::Offline as u8),
            run_entry_ns: AtomicU64::new(0),
            run_time_ns: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// Marks `vector` pending at this CPU and wakes it (the interrupt controller).
    pub(crate) fn raise_vector(&self, vector: Vector) {
        let (w, b) = (vector.0 as usize / 64, vector.0 % 64);
        self.irr[w].fetch_or(1 << b, Ordering::Release);
        self.kick();
    }

    /// Whether a physical vector waits for the hypervisor on this CPU.
    #[inline]
    pub(crate) fn irr_pending(&self) -> bool {
        self.irr.iter().any(|w| w.load(Ordering::Relaxed) != 0)
    }

    /// Takes the pending vectors, lowest first.
    pub(crate) fn take_vectors(&self, mut f: impl FnMut(Vector)) {
        for (i, w) in self.irr.iter().enumerate() {
            if w.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = w.swap(0, Ordering::Acquire);
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                f(Vector((i * 64) as u8 + b as u8));
            }
        }
    }

    pub(crate) fn bind_timer(&self, port: Port) {
        self.timer_port.store(port.0 + 1, Ordering::Release);
    }

    pub(crate) fn unbind_timer(&self, port: Port) {
        let _ =
            self.timer_port
                .compare_exchange(port.0 + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    pub(crate) fn timer_port(&self) -> Option<Port> {
        match self.timer_port.load(Ordering::Acquire) {
            0 => None,
            p => Some(Port(p - 1)),
        }
    }

    /// Whether a physical interrupt raised at this CPU waits for the hypervisor to
    /// turn it into an event (it does so when the vCPU next looks).
    pub fn irq_pending(&self) -> bool {
        self.irr_pending()
    }

    /// Times the vCPU has looked at its events (a kernel that stops looking while one
    /// is pending has stopped making progress).
    pub fn event_looks(&self) -> u64 {
        self.looks.load(Ordering::Relaxed)
    }

    /// Times the single-shot timer fired.
    pub fn timer_fires(&self) -> u64 {
        self.timer_fires.load(Ordering::Relaxed)
    }

    /// Wakes the vCPU if it is blocked (`vcpu_kick`).
    #[inline]
    pub(crate) fn kick(&self) {
        // Full fence: our upcall_pending (or `kicked`) store must be visible before we
        // read `blocked`, pairing with the fence in `block`; otherwise both could miss.
        fence(Ordering::SeqCst);
        if self.blocked.load(Ordering::Relaxed) {
            if let Some(w) = self.waker.get() {
                self.wakes.fetch_add(1, Ordering::Relaxed);
                w.wake();
            } else if let Some(t) = self.thread.get() {
                self.wakes.fetch_add(1, Ordering::Relaxed);
                t.unpark();
            }
        }
    }

    /// The vCPU's index in its domain.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// CPU time the vCPU has used: on a pCPU, its time running as the scheduler
    /// accounts it (from the clock at every switch, as Xen's runstate); on a thread of
    /// its own, the thread's CPU clock (or its final value once it ended).
    pub fn cpu_time(&self) -> Duration {
        if let Some(u) = self.unit.get() {
            return u.running();
        }
        if let Some(c) = self.clock.lock().ok().and_then(|c| *c) {
            if let Some(t) = c.read() {
                return t;
            }
        }
        Duration::from_nanos(self.final_cpu_ns.load(Ordering::Acquire))
    }

    /// The vCPU's sample counters.
    pub fn samples(&self) -> &Arc<SampleSlot> {
        &self.slot
    }

    /// `VCPUOP_get_runstate_info`: the vCPU's state and its time in each state.
    pub fn runstate(&self) -> Runstate {
        let kind = |k: u8| match k {
            0 => RunstateKind::Running,
            1 => RunstateKind::Runnable,
            2 => RunstateKind::Blocked,
            _ => RunstateKind::Offline,
        };
        Runstate {
            state: kind(self.run_state.load(Ordering::Acquire)),
            state_entry_time: Duration::from_nanos(self.run_entry_ns.load(Ordering::Acquire)),
            time: std::array::from_fn(|i| {
                Duration::from_nanos(self.run_time_ns[i].load(Ordering::Relaxed))
            }),
        }
    }

    /// `vcpu_runstate_change`: closes the current state's interval at `now` and enters
    /// `next`.
    fn runstate_change(&self, next: RunstateKind, now: Duration) {
        let now = now.as_nanos() as u64;
        let cur = self.run_state.load(Ordering::Relaxed) as usize;
        let since = self.run_entry_ns.load(Ordering::Relaxed);
        if let Some(t) = self.run_time_ns.get(cur) {
            t.fetch_add(now.saturating_sub(since), Ordering::Relaxed);
        }
        self.run_entry_ns.store(now, Ordering::Relaxed);
        self.run_state.store(next as u8, Ordering::Release);
    }

    /// Times the vCPU blocked and was woken by a kick.
    pub fn block_wake_counts(&self) -> (u64, u64) {
        (
            self.blocks.load(Ordering::Relaxed),
            self.wakes.load(Ordering::Relaxed),
        )
    }
}

/// What a vCPU's kernel loop is given: its domain, the hypervisor for hypercalls, and
/// the wait primitives.
#[derive(Debug, Clone)]
pub struct Vcpu {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    id: u32,
}

impl Vcpu {
    /// The hypervisor (hypercalls run on this thread, as in Xen).
    pub fn hv(&self) -> &Arc<Hypervisor> {
        &self.hv
    }
    /// This vCPU's domain.
    pub fn domain(&self) -> &Arc<Domain> {
        &self.dom
    }
    /// This vCPU's index.
    pub fn id(&self) -> u32 {
        self.id
    }
    fn state(&self) -> &VcpuState {
        &self.dom.vcpus[self.id as usize]
    }
    /// How this vCPU waits.
    pub fn mode(&self) -> WaitMode {
        let s = self.state();
        match s.mode.load(Ordering::Relaxed) {
            1 => WaitMode::Polling,
            2 => WaitMode::HaltPoll(Duration::from_nanos(s.halt_poll_ns.load(Ordering::Relaxed))),
            _ => WaitMode::Blocking,
        }
    }

    /// Whether an event upcall, or a physical interrupt for the hypervisor to turn into
    /// one, is pending.
    #[inline]
    pub fn upcall_pending(&self) -> bool {
        self.dom.upcall_pending(self.id) || self.state().irr_pending()
    }

    /// Handles pending events: first the hypervisor takes any physical interrupt raised
    /// at this CPU and any expired timer, then the guest's upcall handler calls `f` for
    /// each pending, unmasked port.
    #[inline]
    pub fn handle_events(&self, f: impl FnMut(Port)) -> usize {
        let s = self.state();
        s.looks.fetch_add(1, Ordering::Relaxed);
        if s.irr_pending() {
            self.hv.do_irq(&self.dom, self.id);
        }
        if s.timer_deadline.load(Ordering::Relaxed) != 0 {
            self.check_timer();
        }
        self.dom.take_pending(self.id, f)
    }

    /// `VCPUOP_set_singleshot_timer` (or, with `None`, `VCPUOP_stop_singleshot_timer`):
    /// at `deadline` on the hypervisor's clock, `VIRQ_TIMER` is sent to this vCPU, waking
    /// it if it blocked. A deadline already past fires at once.
    pub fn set_timer(&self, deadline: Option<Duration>) {
        let _c = enter(Class::XenTime);
        let ns = deadline.map_or(0, |d| (d.as_nanos() as u64).max(1));
        self.state().timer_deadline.store(ns, Ordering::Relaxed);
        if ns != 0 {
            self.check_timer();
        }
    }

    /// Fires the single-shot timer if its deadline has passed; returns the time left
    /// otherwise (none when no timer is set).
    fn check_timer(&self) -> Option<Duration> {
        let _c = enter(Class::XenTime);
        let s = self.state();
        let ns = s.timer_deadline.load(Ordering::Relaxed);
        if ns == 0 {
            return None;
        }
        let now = self.hv.now().as_nanos() as u64;
        if now < ns {
            return Some(Duration::from_nanos(ns - now));
        }
        s.timer_deadline.store(0, Ordering::Relaxed);
        s.timer_fires.fetch_add(1, Ordering::Relaxed);
        if let Some(p) = s.timer_port() {
            self.hv.set_pending(&self.dom, p);
        }
        None
    }

    /// Waits until an event upcall is pending or the vCPU is kicked, in this vCPU's mode.
    /// Returns at once if one is already pending.
    pub fn wait(&self) {
        match self.mode() {
            WaitMode::Blocking => self.block(),
            WaitMode::Polling => {
                self.poll_for(None);
            }
            WaitMode::HaltPoll(bound) => {
                if !self.poll_for(Some(bound)) {
                    self.block();
                }
            }
        }
    }

    /// Spins until an event upcall is pending or the vCPU is kicked (true), or, with a
    /// bound, until that long has passed without either (false). The clock is read
    /// once every 64 spins, not on every one.
    fn poll_for(&self, bound: Option<Duration>) -> bool {
        let s = self.state();
        let start = bound.map(|_| std::time::Instant::now());
        let mut spins = 0u32;
        while !self.upcall_pending() && !s.kicked.load(Ordering::Acquire) {
            if s.timer_deadline.load(Ordering::Relaxed) != 0 {
                self.check_timer();
            }
            spins = spins.wrapping_add(1);
            if let (Some(b), Some(t)) = (bound, start) {
                if spins.is_multiple_of(64) && t.elapsed() >= b {
                    return false;
                }
            }
            std::hint::spin_loop();
        }
        s.kicked.store(false, Ordering::Relaxed);
        true
    }

    /// `SCHEDOP_block`: parks until an event or a kick.
    pub fn block(&self) {
        let _c = enter(Class::XenSchedule);
        let s = self.state();
        s.blocked.store(true, Ordering::Relaxed);
        // Full fence: `blocked` must be visible before we re-check upcall_pending, so a
        // sender that set the flag after our check sees `blocked` and unparks us.
        fence(Ordering::SeqCst);
        let mut parked = false;
        // A dying domain's vCPU is not scheduled again: it returns to be torn down.
        while !self.upcall_pending() && !s.kicked.load(Ordering::Acquire) && !self.dom.is_dying() {
            if !parked {
                // Xen's `schedule` on the way out: the vCPU is blocked from now.
                s.runstate_change(RunstateKind::Blocked, self.hv.now());
            }
            parked = true;
            if s.timer_deadline.load(Ordering::Relaxed) == 0 {
                std::thread::park();
            } else if let Some(left) = self.check_timer() {
                std::thread::park_timeout(left);
            }
        }
        s.blocked.store(false, Ordering::Relaxed);
        s.kicked.store(false, Ordering::Relaxed);
        if parked {
            s.blocks.fetch_add(1, Ordering::Relaxed);
            self.schedule_in();
        }
    }

    /// Where the profiler's samples of this vCPU are counted.
    pub fn samples(&self) -> &Arc<SampleSlot> {
        &self.state().slot
    }

    /// Binds the vCPU to the unit that runs it on a pCPU: events and kicks wake it
    /// through `waker`, and its CPU time is the pCPU's accounting of it.
    pub fn bind_unit(&self, waker: &Waker, stats: &Arc<UnitStats>) {
        let s = self.state();
        let _ = s.waker.set(waker.clone());
        let _ = s.unit.set(Arc::clone(stats));
    }

    /// The vCPU starts running on its pCPU (its first step).
    pub fn start_unit(&self) {
        self.schedule_in();
    }

    /// The vCPU ended: it is offline from now.
    pub fn stop_unit(&self) {
        self.state()
            .runstate_change(RunstateKind::Offline, self.hv.now());
    }

    /// `SCHEDOP_block` on a pCPU: announces the vCPU blocked and looks once more at its
    /// events. `None`: an event (or a kick) is pending, so it runs on. Otherwise it is
    /// blocked from now, and the answer is when its single-shot timer is due (the pCPU
    /// runs it again then, or when an event's wake-up comes first).
    pub fn idle(&self) -> Option<Option<std::time::Instant>> {
        let _c = enter(Class::XenSchedule);
        let s = self.state();
        s.blocked.store(true, Ordering::Relaxed);
        // Full fence: `blocked` must be visible before we re-check upcall_pending, so a
        // sender that set the flag after our check sees `blocked` and wakes us.
        fence(Ordering::SeqCst);
        let mut left = None;
        let pending = self.upcall_pending()
            || s.kicked.load(Ordering::Acquire)
            || self.dom.is_dying()
            || (s.timer_deadline.load(Ordering::Relaxed) != 0 && {
                left = self.check_timer();
                left.is_none()
            });
        if pending {
            s.blocked.store(false, Ordering::Relaxed);
            s.kicked.store(false, Ordering::Relaxed);
            return None;
        }
        s.runstate_change(RunstateKind::Blocked, self.hv.now());
        Some(left.map(|l| std::time::Instant::now() + l))
    }

    /// The vCPU runs again after [`Vcpu::idle`] blocked it, woken at `woken` (its IPI
    /// seen, or its timer due): it was runnable from then, and runs from now.
    pub fn resume(&self, woken: Option<std::time::Instant>) {
        let s = self.state();
        s.blocked.store(false, Ordering::Relaxed);
        s.kicked.store(false, Ordering::Relaxed);
        s.blocks.fetch_add(1, Ordering::Relaxed);
        if let Some(w) = woken {
            let waited = w.elapsed();
            s.runstate_change(RunstateKind::Runnable, self.hv.now().saturating_sub(waited));
        }
        self.schedule_in();
    }

    /// What Xen's context switch does for a vCPU it runs again: the run-state change,
    /// and a fresh stamp in the vCPU's time-info block (`update_vcpu_system_time`).
    fn schedule_in(&self) {
        let _c = enter(Class::XenTime);
        let tsc = mem::cpu::rdtsc();
        let now = self.hv.now();
        self.state().runstate_change(RunstateKind::Running, now);
        update_vcpu_system_time(&self.dom, self.id, tsc, now);
    }

    /// The guest's clock: system time read from this vCPU's time-info block and the TSC,
    /// as a PV guest reads it ([`crate::time::read_system_time`]); the hypervisor's
    /// clock if the block cannot be read.
    #[inline]
    pub fn system_time(&self) -> Duration {
        read_system_time(&self.dom, self.id).unwrap_or_else(|| self.hv.now())
    }
}

/// How to start a vCPU.
#[derive(Debug, Clone, Copy)]
pub struct VcpuStart {
    /// Which vCPU of the domain.
    pub vcpu: u32,
    /// Core to pin to (none: float).
    pub core: Option<usize>,
    /// Waiting mode.
    pub mode: WaitMode,
    /// Sampling interval for the profiler (none: no sampling, class tags still kept).
    pub sample: Option<Duration>,
}

impl Hypervisor {
    /// Starts a vCPU of `dom` on its own thread running `kernel`, which returns when the
    /// domain's loop decides to stop.
    pub fn start_vcpu<R: Send + 'static>(
        self: &Arc<Self>,
        dom: &Arc<Domain>,
        start: VcpuStart,
        kernel: impl FnOnce(Vcpu) -> R + Send + 'static,
    ) -> std::io::Result<JoinHandle<R>> {
        let st = dom
            .vcpus
            .get(start.vcpu as usize)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc_einval()))?;
        let (mode, bound) = match start.mode {
            WaitMode::Blocking => (0, Duration::ZERO),
            WaitMode::Polling => (1, Duration::ZERO),
            WaitMode::HaltPoll(b) => (2, b),
        };
        st.halt_poll_ns.store(
            u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        st.mode.store(mode, Ordering::Relaxed);
        let v = Vcpu {
            hv: Arc::clone(self),
            dom: Arc::clone(dom),
            id: start.vcpu,
        };
        std::thread::Builder::new()
            .name(format!("{}-v{}", dom.name, start.vcpu))
            .spawn(move || {
                let s = v.state();
                if let Some(c) = start.core {
                    // Best effort: a missing core leaves the thread floating, visibly in the
                    // experiment's configuration record.
                    let _ = pin_current_thread(c);
                }
                let _ = s.thread.set(std::thread::current());
                v.schedule_in();
                let binding = SlotBinding::bind(Arc::clone(&s.slot), start.sample).ok();
                if let Ok(mut c) = s.clock.lock() {
                    *c = ThreadClock::current().ok();
                }
                let st_dom = Arc::clone(&v.dom);
                let st_hv = Arc::clone(&v.hv);
                let id = v.id as usize;
                let r = kernel(v);
                let s = &st_dom.vcpus[id];
                s.runstate_change(RunstateKind::Offline, st_hv.now());
                let t = mem::cpu::thread_cpu_time();
                s.final_cpu_ns.store(t.as_nanos() as u64, Ordering::Release);
                if let Ok(mut c) = s.clock.lock() {
                    *c = None;
                }
                drop(binding);
                r
            })
    }

    /// vCPU `id` of `dom`, to run as a unit on a pCPU ([`crate::sched`]); none if the
    /// domain has no such vCPU.
    pub fn vcpu(self: &Arc<Self>, dom: &Arc<Domain>, id: u32) -> Option<Vcpu> {
        dom.vcpus.get(id as usize)?;
        Some(Vcpu {
            hv: Arc::clone(self),
            dom: Arc::clone(dom),
            id,
        })
    }

    /// Wakes a vCPU without an event (so that its loop can notice a stop flag, say).
    pub fn kick_vcpu(&self, dom: &Domain, vcpu: u32) {
        if let Some(s) = dom.vcpus.get(vcpu as usize) {
            s.kicked.store(true, Ordering::Release);
            s.kick();
        }
    }
}

fn libc_einval() -> i32 {
    22
}
