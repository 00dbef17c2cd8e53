//! How a device's interrupt reaches its driver.
//!
//! Under the hypervisor (driver domain, or a guest with an assigned device) the device
//! raises a vector at the hypervisor, which turns it into an event on the owner's
//! channel: two hops, as in Xen. A native machine has no hypervisor in the way: the
//! interrupt wakes the kernel's CPU directly.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use hv::{Hypervisor, Vector};

/// A native interrupt line: a pending bit and the CPU it wakes. The CPU's clock and
/// its local timer (a deadline the idle loop's halt honours) live here too.
#[derive(Debug, Default)]
pub struct NativeIrq {
    pending: AtomicBool,
    cpu: OnceLock<Thread>,
    /// The CPU's unit, when the kernel runs on one of pvio's pCPUs.
    unit: OnceLock<hv::sched::Waker>,
    epoch: OnceLock<Instant>,
}

impl NativeIrq {
    /// The thread of the CPU the line is routed to (set once, by that thread); its
    /// clock starts now.
    pub fn route_here(&self) {
        let _ = self.cpu.set(std::thread::current());
        let _ = self.epoch.set(Instant::now());
    }
    /// The line is routed to a kernel running as a unit on a pCPU: raising it wakes
    /// `waker`; the CPU's clock starts now.
    pub fn route_to(&self, waker: &hv::sched::Waker) {
        let _ = self.unit.set(waker.clone());
        let _ = self.epoch.set(Instant::now());
    }
    /// The instant a deadline on [`NativeIrq::now`]'s clock falls at.
    pub fn instant_at(&self, deadline: Duration) -> Option<Instant> {
        self.epoch.get().map(|e| *e + deadline)
    }
    /// The CPU's clock: time since the line was routed.
    pub fn now(&self) -> Duration {
        self.epoch.get().map_or(Duration::ZERO, Instant::elapsed)
    }
    /// Whether an interrupt is pending.
    pub fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }
    /// Acknowledges (clears) the interrupt; true if one was pending. The pending bit is
    /// read first and cleared only when set: a CPU learns of an interrupt from its own
    /// controller, so the common case (none pending) must not pull the line's cache
    /// line over from the device's core with a locked write.
    pub fn ack(&self) -> bool {
        self.pending() && self.pending.swap(false, Ordering::AcqRel)
    }
    /// Raises the interrupt and wakes the CPU.
    pub fn raise(&self) {
        self.pending.store(true, Ordering::Release);
        if let Some(w) = self.unit.get() {
            w.wake();
        } else if let Some(t) = self.cpu.get() {
            t.unpark();
        }
    }
    /// Halts the CPU until an interrupt is pending or `stop` is set (the idle loop's
    /// `hlt`).
    pub fn halt(&self, stop: &AtomicBool) {
        self.halt_until(stop, None);
    }
    /// Halts as [`NativeIrq::halt`] does, with the local timer armed for `deadline` (on
    /// [`NativeIrq::now`]'s clock); true if the timer expired.
    pub fn halt_until(&self, stop: &AtomicBool, deadline: Option<Duration>) -> bool {
        while !self.pending() && !stop.load(Ordering::Acquire) {
            match deadline {
                None => std::thread::park(),
                Some(d) => {
                    let now = self.now();
                    if now >= d {
                        return true;
                    }
                    std::thread::park_timeout(d - now);
                }
            }
        }
        false
    }
}

/// Where a device's interrupt goes.
#[derive(Debug, Clone)]
pub enum IrqLine {
    /// Through the hypervisor, as a virtual IRQ on the owner's event channel.
    Hypervisor {
        /// The hypervisor.
        hv: Arc<Hypervisor>,
        /// The device's vector.
        vector: Vector,
    },
    /// Straight to a native kernel.
    Native(Arc<NativeIrq>),
}

impl IrqLine {
    /// Raises the interrupt.
    pub fn raise(&self) {
        match self {
            IrqLine::Hypervisor { hv, vector } => {
                let _ = hv.raise_irq(*vector);
            }
            IrqLine::Native(n) => n.raise(),
        }
    }
}
