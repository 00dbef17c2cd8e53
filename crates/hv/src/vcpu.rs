//! vCPUs: OS threads pinned to cores that run a domain's kernel loop.
//!
//! A vCPU waits for events in one of two modes. *Blocking* is Xen's `SCHEDOP_block`: the
//! thread announces it is blocked, re-checks `upcall_pending` after a full fence, and
//! parks (a futex) until a sender's kick unparks it — a real cross-core wake-up, several
//! microseconds. *Polling* spins on `upcall_pending` without a syscall — tens of
//! nanoseconds per hand-off, at the price of a core. Both are real; the experiments say
//! which they use.

use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use mem::cpu::{pin_current_thread, SampleSlot, SlotBinding, ThreadClock};

use crate::domain::Domain;
use crate::profile::{enter, Class};
use crate::types::Port;
use crate::Hypervisor;

/// How a vCPU waits for events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitMode {
    /// Park the thread until kicked (a halted vCPU).
    Blocking,
    /// Spin on the upcall flag (a polling vCPU).
    Polling,
}

/// Per-vCPU state kept in the domain.
#[derive(Debug)]
pub struct VcpuState {
    id: u32,
    thread: OnceLock<Thread>,
    /// Set while the vCPU is (about to be) parked.
    blocked: AtomicBool,
    /// A wake-up that is not an event (a stop request, say).
    kicked: AtomicBool,
    mode: AtomicU8,
    pub(crate) slot: Arc<SampleSlot>,
    clock: Mutex<Option<ThreadClock>>,
    /// CPU time at exit, in ns, once the thread has ended.
    final_cpu_ns: AtomicU64,
    /// Counters (owner-written, read when reporting).
    blocks: AtomicU64,
    wakes: AtomicU64,
}

impl VcpuState {
    pub(crate) fn new(id: u32) -> Self {
        Self {
            id,
            thread: OnceLock::new(),
            blocked: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
            mode: AtomicU8::new(0),
            slot: Arc::new(SampleSlot::default()),
            clock: Mutex::new(None),
            final_cpu_ns: AtomicU64::new(0),
            blocks: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
        }
    }

    /// Wakes the vCPU if it is blocked (`vcpu_kick`).
    #[inline]
    pub(crate) fn kick(&self) {
        // Full fence: our upcall_pending (or `kicked`) store must be visible before we
        // read `blocked`, pairing with the fence in `block`; otherwise both could miss.
        fence(Ordering::SeqCst);
        if self.blocked.load(Ordering::Relaxed) {
            if let Some(t) = self.thread.get() {
                self.wakes.fetch_add(1, Ordering::Relaxed);
                t.unpark();
            }
        }
    }

    /// The vCPU's index in its domain.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// CPU time the vCPU's thread has used (running, or final once it ended).
    pub fn cpu_time(&self) -> Duration {
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
        if self.state().mode.load(Ordering::Relaxed) == 1 {
            WaitMode::Polling
        } else {
            WaitMode::Blocking
        }
    }

    /// Whether an event upcall is pending.
    #[inline]
    pub fn upcall_pending(&self) -> bool {
        self.dom.upcall_pending(self.id)
    }

    /// Handles pending events: calls `f` for each pending, unmasked port.
    #[inline]
    pub fn handle_events(&self, f: impl FnMut(Port)) -> usize {
        self.dom.take_pending(self.id, f)
    }

    /// Waits until an event upcall is pending or the vCPU is kicked, in this vCPU's mode.
    /// Returns at once if one is already pending.
    pub fn wait(&self) {
        match self.mode() {
            WaitMode::Blocking => self.block(),
            WaitMode::Polling => {
                let s = self.state();
                while !self.upcall_pending() && !s.kicked.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                s.kicked.store(false, Ordering::Relaxed);
            }
        }
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
        while !self.upcall_pending() && !s.kicked.load(Ordering::Acquire) {
            parked = true;
            std::thread::park();
        }
        s.blocked.store(false, Ordering::Relaxed);
        s.kicked.store(false, Ordering::Relaxed);
        if parked {
            s.blocks.fetch_add(1, Ordering::Relaxed);
        }
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
        st.mode
            .store(u8::from(start.mode == WaitMode::Polling), Ordering::Relaxed);
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
                let binding = SlotBinding::bind(Arc::clone(&s.slot), start.sample).ok();
                if let Ok(mut c) = s.clock.lock() {
                    *c = ThreadClock::current().ok();
                }
                let st_dom = Arc::clone(&v.dom);
                let id = v.id as usize;
                let r = kernel(v);
                let s = &st_dom.vcpus[id];
                let t = mem::cpu::thread_cpu_time();
                s.final_cpu_ns.store(t.as_nanos() as u64, Ordering::Release);
                if let Ok(mut c) = s.clock.lock() {
                    *c = None;
                }
                drop(binding);
                r
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
