//! The loop every kernel runs on its vCPU, and the interface a kernel offers it.
//!
//! A kernel's vCPU takes what woke it (a native interrupt line, or the events the
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
    /// One pass of work at `now`.
    fn poll(&mut self, now: Duration) -> Work;
    /// Whether this instance keeps time although its kind does not ([`Kernel::CLOCK`]):
    /// a driver domain with LRO holds aggregates for at most a limit. Asked once, at
    /// start.
    fn wants_clock(&self) -> bool {
        Self::CLOCK
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

/// Runs `kernel` on `v` until `stop` is set (and the vCPU kicked, or the native line
/// raised), then shuts it down. `ready` is counted up once the loop runs; `door`'s
/// requests for counters are answered between polls.
pub fn run<K: Kernel>(
    v: Vcpu,
    platform: Platform,
    mut kernel: K,
    stop: &AtomicBool,
    ready: &AtomicUsize,
    door: &CounterDoor,
) -> Counters {
    let clocked = K::CLOCK || kernel.wants_clock();
    let tport = match platform {
        Platform::Xen if clocked => v.hv().bind_virq(v.domain(), Virq::Timer, v.id()).ok(),
        _ => None,
    };
    if let Platform::Native(n) = &platform {
        n.route_here();
    }
    let clock = |v: &Vcpu| {
        let _t = enter(Class::Time);
        match &platform {
            Platform::Native(n) => n.now(),
            Platform::Xen => v.system_time(),
        }
    };
    let mut timer = KernelTimer::default();
    ready.fetch_add(1, Ordering::Release);
    while !stop.load(Ordering::Acquire) && !v.domain().is_dying() {
        let mut expired = false;
        match &platform {
            Platform::Native(n) => {
                if n.ack() {
                    kernel.interrupt();
                }
                expired = timer.native_expired(|| clock(&v));
            }
            Platform::Xen => {
                v.handle_events(|q| {
                    if Some(q) == tport {
                        expired = true;
                    } else {
                        kernel.event(&v, q);
                    }
                });
            }
        }
        let now = if clocked { clock(&v) } else { Duration::ZERO };
        if expired {
            timer.armed = None;
            kernel.tick(now);
        }
        let idle = kernel.poll(now).idle();
        door.answer(&kernel);
        if idle {
            match &platform {
                Platform::Native(n) => {
                    timer.arm(kernel.next_timer(), |_| {});
                    let _s = enter(Class::Schedule);
                    n.halt_until(stop, timer.armed);
                }
                Platform::Xen => {
                    if clocked {
                        timer.xen_idle(kernel.next_timer(), &v);
                    }
                    // Grants a back end held when they were revoked go back once it
                    // lets go (Linux retries them from a timer).
                    v.domain().grant_table().retry_deferred();
                    v.wait();
                }
            }
        }
    }
    kernel.shutdown()
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
