//! The loop every kernel runs on its vCPU, and the interface a kernel offers it.
//!
//! A kernel's vCPU (a unit on one of pvio's pCPUs, [`KernelUnit`]) takes what woke it (a native interrupt line, or the events the
//! hypervisor set pending), runs its timer if it expired, polls, and when a poll found
//! nothing it goes idle: a native kernel halts with its local timer armed; a Xen kernel
//! programs its one-shot timer (`VCPUOP_set_singleshot_timer`, as 2.6.18-xen's
//! `stop_hz_timer` does at every idle entry) and blocks in the hypervisor.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dev::irq::NativeIrq;
use hv::profile::{enter, Class};
use hv::{Port, Vcpu, Virq};

use crate::Counters;

/// What one poll step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Work {
    /// Packets taken in: from a device, a ring or a TAP.
    pub rx: usize,
    /// Packets handed on or completed: to a ring, a device, a TAP.
    pub tx: usize,
    /// Messages the application took.
    pub app: usize,
    /// Work is left that needs no event to be found again (a NAPI poll that used its
    /// whole budget stays scheduled): the kernel must not go idle.
    pub more: bool,
}

impl Work {
    /// Whether the kernel may go idle.
    pub fn idle(&self) -> bool {
        self.rx + self.tx + self.app == 0 && !self.more
    }
}

impl std::ops::AddAssign for Work {
    fn add_assign(&mut self, o: Work) {
        self.rx += o.rx;
        self.tx += o.tx;
        self.app += o.app;
        self.more |= o.more;
    }
}

/// A domain's kernel, as its vCPU loop drives it.
pub trait Kernel: Send + 'static {
    /// Whether the kernel keeps time (a stack with timers). One without a clock binds
    /// no timer, reads no clock, and is given `Duration::ZERO` as the time.
    const CLOCK: bool;
    /// An event on one of its ports (a Xen kernel; the timer's is handled by the loop).
    fn event(&mut self, v: &Vcpu, port: Port);
    /// Its native interrupt line fired (a native kernel).
    fn interrupt(&mut self) {}
    /// Its timer expired; `now` is its clock.
    fn tick(&mut self, _now: Duration) {}
    /// Its vCPU is placed on a pCPU, woken by `waker` (a kernel with a host interface
    /// above it makes the interface its interrupt line).
    fn attach(&mut self, _waker: &hv::sched::Waker) {}
    /// One pass of work at `now`.
    fn poll(&mut self, now: Duration) -> Work;
    /// Whether this instance keeps time although its kind does not ([`Kernel::CLOCK`]):
    /// a driver domain with LRO holds aggregates for at most a limit. Asked once, at
    /// start.
    fn wants_clock(&self) -> bool {
        Self::CLOCK
    }
    /// Whether its state is tied to the thread that runs it (a host interface whose
    /// io_uring completions run as the submitting thread's work): its vCPU then stays on
    /// its pCPU, even while the host holds it (`hv::sched::UnitSpec::movable`). Asked
    /// once, at placement.
    fn thread_bound(&self) -> bool {
        false
    }
    /// When it next needs its timer.
    fn next_timer(&self) -> Option<Duration> {
        None
    }
    /// Its components' counters as they stand, for a live view (none by default).
    fn counters(&self) -> Counters {
        Counters::default()
    }
    /// Stops: gives back every buffer, grant and mapping it holds, and reports its
    /// counters.
    fn shutdown(self) -> Counters;
}

/// Where a running kernel's counters are asked for and answered, as a statistics
/// request to a running kernel: the asker raises the request and kicks the vCPU, and
/// the kernel's loop answers between two polls with [`Kernel::counters`]. Nothing on
/// the kernel's side runs until it is asked but one relaxed load per loop.
#[derive(Debug, Default)]
pub struct CounterDoor {
    asked: AtomicBool,
    answer: Mutex<Option<Counters>>,
}

impl CounterDoor {
    /// Asks for the counters (the previous answer, if not taken, is dropped).
    pub fn ask(&self) {
        if let Ok(mut a) = self.answer.lock() {
            *a = None;
        }
        self.asked.store(true, Ordering::Release);
    }

    /// The answer, once the kernel has given it.
    pub fn take(&self) -> Option<Counters> {
        self.answer.lock().ok().and_then(|mut a| a.take())
    }

    /// The kernel's side: answers if asked.
    fn answer<K: Kernel>(&self, kernel: &K) {
        if self.asked.load(Ordering::Relaxed) && self.asked.swap(false, Ordering::Acquire) {
            let c = kernel.counters();
            if let Ok(mut a) = self.answer.lock() {
                *a = Some(c);
            }
        }
    }
}

/// What the kernel runs on.
#[derive(Debug, Clone)]
pub enum Platform {
    /// Under the hypervisor: events, a virtual timer, blocking in the hypervisor.
    Xen,
    /// On the bare machine: one interrupt line wakes the CPU; it halts when idle.
    Native(Arc<NativeIrq>),
}

/// A kernel on its vCPU, as a unit on one of pvio's pCPUs: each step takes what woke it
/// (a native interrupt line, or the events the hypervisor set pending), runs its timer
/// if it expired, and polls once; a poll that found nothing makes it idle (a native
/// kernel halts with its local timer armed; a Xen kernel programs its one-shot timer
/// and blocks in the hypervisor), and the pCPU runs it again when an interrupt or event
/// wakes it or its timer is due. It ends once `stop` is set (and the vCPU kicked, or
/// the native line raised), shutting the kernel down; `ready` is counted up at its
/// first step; `door`'s requests for counters are answered between polls.
pub struct KernelUnit<K: Kernel> {
    v: Vcpu,
    platform: Platform,
    kernel: Option<K>,
    stop: Arc<AtomicBool>,
    ready: Arc<AtomicUsize>,
    door: Arc<CounterDoor>,
    clocked: bool,
    tport: Option<Port>,
    timer: KernelTimer,
    started: bool,
    blocked: bool,
}

impl<K: Kernel> std::fmt::Debug for KernelUnit<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelUnit")
            .field("domain", &self.v.domain().id())
            .field("vcpu", &self.v.id())
            .finish_non_exhaustive()
    }
}

impl<K: Kernel> KernelUnit<K> {
    /// `kernel` on `v`.
    pub fn new(
        v: Vcpu,
        platform: Platform,
        kernel: K,
        stop: Arc<AtomicBool>,
        ready: Arc<AtomicUsize>,
        door: Arc<CounterDoor>,
    ) -> Self {
        let clocked = K::CLOCK || kernel.wants_clock();
        Self {
            v,
            platform,
            kernel: Some(kernel),
            stop,
            ready,
            door,
            clocked,
            tport: None,
            timer: KernelTimer::default(),
            started: false,
            blocked: false,
        }
    }

    fn clock(&self) -> Duration {
        let _t = enter(Class::Time);
        match &self.platform {
            Platform::Native(n) => n.now(),
            Platform::Xen => self.v.system_time(),
        }
    }

    fn finish(&mut self) -> Counters {
        self.v.stop_unit();
        self.kernel.take().map(K::shutdown).unwrap_or_default()
    }
}

impl<K: Kernel> hv::sched::Unit for KernelUnit<K> {
    type Output = Counters;

    fn attach(&mut self, waker: &hv::sched::Waker, stats: &Arc<hv::sched::UnitStats>) {
        self.v.bind_unit(waker, stats);
        if let Some(k) = self.kernel.as_mut() {
            k.attach(waker);
        }
        if let Platform::Native(n) = &self.platform {
            n.route_to(waker);
        }
    }

    fn samples(&self) -> Option<Arc<mem::cpu::SampleSlot>> {
        Some(Arc::clone(self.v.samples()))
    }

    fn step(&mut self, cx: &hv::sched::Cx) -> hv::sched::Step<Counters> {
        use hv::sched::Step;
        if !self.started {
            self.started = true;
            self.v.start_unit();
            if matches!(self.platform, Platform::Xen) && self.clocked {
                self.tport = self
                    .v
                    .hv()
                    .bind_virq(self.v.domain(), Virq::Timer, self.v.id())
                    .ok();
            }
            self.ready.fetch_add(1, Ordering::Release);
        }
        if self.blocked {
            self.blocked = false;
            if matches!(self.platform, Platform::Xen) {
                self.v.resume(cx.woken);
            }
        }
        if self.stop.load(Ordering::Acquire) || self.v.domain().is_dying() {
            return Step::Done(self.finish());
        }
        let Some(kernel) = self.kernel.as_mut() else {
            return Step::Done(Counters::default());
        };
        let mut expired = false;
        match &self.platform {
            Platform::Native(n) => {
                if n.ack() {
                    kernel.interrupt();
                }
                expired = self.timer.native_expired(|| n.now());
            }
            Platform::Xen => {
                let (v, tport) = (&self.v, self.tport);
                v.handle_events(|q| {
                    if Some(q) == tport {
                        expired = true;
                    } else {
                        kernel.event(v, q);
                    }
                });
            }
        }
        let now = if self.clocked {
            self.clock()
        } else {
            Duration::ZERO
        };
        let Some(kernel) = self.kernel.as_mut() else {
            return Step::Done(Counters::default());
        };
        if expired {
            self.timer.armed = None;
            kernel.tick(now);
        }
        let idle = kernel.poll(now).idle();
        self.door.answer(kernel);
        if !idle {
            return Step::More;
        }
        let next = kernel.next_timer();
        match &self.platform {
            Platform::Native(n) => {
                self.timer.arm(next, |_| {});
                let _s = enter(Class::Schedule);
                if n.pending() || self.stop.load(Ordering::Acquire) {
                    return Step::More;
                }
                if self.timer.armed.is_some_and(|d| n.now() >= d) {
                    return Step::More;
                }
                self.blocked = true;
                Step::Idle(self.timer.armed.and_then(|d| n.instant_at(d)))
            }
            Platform::Xen => {
                if self.clocked {
                    self.timer.xen_idle(next, &self.v);
                }
                // Grants a back end held when they were revoked go back once it lets
                // go (Linux retries them from a timer).
                self.v.domain().grant_table().retry_deferred();
                match self.v.idle() {
                    None => Step::More,
                    Some(due) => {
                        self.blocked = true;
                        Step::Idle(due)
                    }
                }
            }
        }
    }
}

/// A Xen kernel's handling of a physical interrupt's event, as 2.6.18-xen's `ack_pirq`
/// and `end_pirq` do it: the port is masked while `handler` runs, then unmasked, and the
/// hypervisor is told that the interrupt has ended (`PHYSDEVOP_eoi`), which unmasks the
/// line it masked when it delivered the interrupt. The port is the kernel's own pirq,
/// so none of the calls can fail.
pub fn xen_pirq(v: &Vcpu, port: Port, handler: impl FnOnce()) {
    {
        let _i = enter(Class::Interrupt);
        let _ = v.domain().evtchn_mask(port);
    }
    handler();
    let _h = enter(Class::Hypercall);
    let _ = v.hv().evtchn_unmask(v.domain(), port);
    let _ = v.hv().pirq_eoi(v.domain(), port);
}

/// A kernel's view of its one-shot timer: what it last asked for, so that it programs
/// the timer (a hypercall under Xen, the local APIC natively) only when the deadline it
/// needs changes.
#[derive(Debug, Default)]
struct KernelTimer {
    armed: Option<Duration>,
}

impl KernelTimer {
    /// Asks for `want`, calling `program` if it differs from what is armed.
    fn arm(&mut self, want: Option<Duration>, program: impl FnOnce(Option<Duration>)) {
        if want != self.armed {
            program(want);
            self.armed = want;
        }
    }
    /// A Xen kernel going idle, as 2.6.18-xen's `stop_hz_timer`: it programs the
    /// one-shot timer for its next timer event (or stops it when there is none) at every
    /// idle entry, whether or not the deadline changed.
    fn xen_idle(&mut self, want: Option<Duration>, v: &Vcpu) {
        v.set_timer(want);
        self.armed = want;
    }
    /// A native kernel's check of its local timer at interrupt time; the clock is read
    /// only when the timer is armed.
    fn native_expired(&self, now: impl FnOnce() -> Duration) -> bool {
        self.armed.is_some_and(|d| now() >= d)
    }
}
