//! A vbd queue served as a unit of pvio's scheduler ([`hv::sched`]), as Linux's
//! `xen-blkback` serves each ring from a kernel thread of its own (`xen_blkif_schedule`)
//! woken by the ring's interrupt.
//!
//! Each step of the unit is one [`Blkback::serve`], bounded by the queue's budget, so a
//! front end that keeps its ring full holds its pCPU for one budget at a time: the other
//! units there (another guest's queues) take their turn between two of its steps. The
//! disk's system calls run on the pCPU's thread, so a slow disk holds that pCPU, never
//! the thread that moves the network's packets or watches the store.
//!
//! The event channel is not the unit's to read: whoever reads the ports that fired (one
//! descriptor for the whole domain, as Linux's upcall demultiplexes its ports) wakes
//! the unit for the queue's [`Queue::port`] ([`Queue::wake`], or [`Queue::waker`]), as
//! an interrupt handler wakes the ring's thread. The unit then serves until its ring
//! stays empty, re-arming the front end's notification as it goes idle
//! ([`Blkback::pending`]).
//!
//! The back end sits behind a lock each step holds while it serves. The thread that
//! placed it never waits on that lock while the unit runs, since it also moves the
//! network's packets: it looks at the back end's counters only when the lock is free
//! ([`Queue::try_with`]), and learns that the ring broke from a flag the unit sets
//! ([`Queue::broken`]). Taking the back end back ([`Queue::take`]), to hand it over or
//! disconnect it, first tells the unit to leave, so it waits for the step in progress
//! and no other (a lock alone can be taken again by a unit whose guest keeps it busy,
//! step after step, before the waiting thread wakes), then ends the unit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hv::sched::{
    Cx, IrqLine, SchedError, Scheduler, Step, Unit, UnitJoin, UnitSpec, UnitStats, Waker,
};
use hv::{Port, Xen};

use crate::blkback::{Blkback, VbdStats};

/// What the unit and the thread that placed it share.
#[derive(Debug)]
struct Inner<X: Xen> {
    back: Mutex<Option<Blkback<X>>>,
    /// The back end is to be taken back: the unit ends at its next step.
    leave: AtomicBool,
    /// The front end broke the protocol: the device waits to be disconnected.
    broken: AtomicBool,
}

type Shared<X> = Arc<Inner<X>>;

/// The lock, also after a step panicked holding it (the back end is then taken back and
/// disconnected: [`Queue::ended`]).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The unit itself: one queue's back end. [`Queue::place_as`] places it inside a unit
/// of the caller's (one that counts its steps, say).
#[derive(Debug)]
pub struct Served<X: Xen> {
    back: Shared<X>,
    /// What wakes it; the disk's completions are bound to it at the first step that
    /// finds the back end's disk asynchronous ([`Blkback::disk_async`]).
    waker: Option<Waker>,
    /// The disk's completions, as an interrupt line of this unit.
    disk: Option<IrqLine>,
}

impl<X: Xen> Served<X> {
    /// Looks at the back end between two steps (none once taken back).
    pub fn with<R>(&self, f: impl FnOnce(&Blkback<X>) -> R) -> Option<R> {
        lock(&self.back.back).as_ref().map(f)
    }
}

impl<X: Xen + Send + 'static> Unit for Served<X> {
    type Output = ();

    fn attach(&mut self, waker: &Waker, _stats: &Arc<UnitStats>) {
        self.waker = Some(waker.clone());
    }

    fn step(&mut self, _cx: &Cx) -> Step<()> {
        if self.back.leave.load(Ordering::Acquire) {
            // To be taken back: the unit ends, the lock left to the taker.
            return Step::Done(());
        }
        let mut g = lock(&self.back.back);
        let Some(b) = g.as_mut() else {
            return Step::Done(());
        };
        if b.broken().is_some() {
            // Disconnected for a protocol break: it waits to be taken back.
            self.back.broken.store(true, Ordering::Release);
            return Step::Idle(None);
        }
        if self.disk.is_none() {
            if let (Some(fd), Some(w)) = (b.disk_event_fd(), &self.waker) {
                // A transfer's end wakes the unit as the ring's event does. The line goes
                // with the unit, before the back end (and the descriptor) is taken back.
                self.disk = w.irq_line(fd).ok();
            }
        }
        b.serve();
        if b.broken().is_some() {
            self.back.broken.store(true, Ordering::Release);
            Step::Idle(None)
        } else if b.pending() {
            // Stopped at its budget: the pCPU's other units go first.
            Step::More
        } else {
            if let Some(l) = &self.disk {
                // Transfers in flight (or none): the next to end wakes the unit.
                l.arm();
            }
            Step::Idle(None)
        }
    }
}

/// A vbd queue placed on a scheduler: what wakes it, and its back end.
#[derive(Debug)]
pub struct Queue<X: Xen> {
    back: Shared<X>,
    join: UnitJoin<()>,
    port: Port,
    /// Its counters as last seen ([`Queue::stats`]).
    seen: VbdStats,
}

impl<X: Xen + Send + 'static> Queue<X> {
    /// Places `back` on pCPU `pcpu` of `sched` as a unit named `name`; its first step
    /// serves whatever the ring already holds.
    pub fn place(
        sched: &Scheduler,
        pcpu: usize,
        name: impl Into<String>,
        back: Blkback<X>,
    ) -> Result<Self, SchedError> {
        Self::place_as(sched, pcpu, UnitSpec::named(name), back, |s| s)
    }

    /// [`Queue::place`], the unit wrapped by `wrap` and scheduled as `spec` says.
    pub fn place_as<U: Unit<Output = ()>>(
        sched: &Scheduler,
        pcpu: usize,
        spec: UnitSpec,
        back: Blkback<X>,
        wrap: impl FnOnce(Served<X>) -> U,
    ) -> Result<Self, SchedError> {
        let port = back.port();
        let shared = Arc::new(Inner {
            back: Mutex::new(Some(back)),
            leave: AtomicBool::new(false),
            broken: AtomicBool::new(false),
        });
        let join = sched.place(
            pcpu,
            spec,
            wrap(Served {
                back: Arc::clone(&shared),
                waker: None,
                disk: None,
            }),
        )?;
        Ok(Self {
            back: shared,
            join,
            port,
            seen: VbdStats::default(),
        })
    }

    /// The local end of the queue's event channel.
    pub fn port(&self) -> Port {
        self.port
    }

    /// The event channel fired (or anything else the ring may hold): the unit runs.
    pub fn wake(&self) {
        self.join.wake();
    }

    /// The pCPU the unit runs on.
    pub fn pcpu(&self) -> usize {
        self.join.waker().pcpu()
    }

    /// What wakes the unit, for whoever routes the queue's port to it.
    pub fn waker(&self) -> &Waker {
        self.join.waker()
    }

    /// The unit's accounting on its pCPU (one a placement: it names the placement).
    pub fn unit_stats(&self) -> &Arc<UnitStats> {
        self.join.stats()
    }

    /// Looks at the back end if no step holds it now (none then, or once taken back):
    /// never waits for the unit.
    pub fn try_with<R>(&self, f: impl FnOnce(&Blkback<X>) -> R) -> Option<R> {
        let g = match self.back.back.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        g.as_ref().map(f)
    }

    /// Its counters: now if no step holds the back end, else as last seen.
    pub fn stats(&mut self) -> &VbdStats {
        if let Some(s) = self.try_with(|b| b.stats().clone()) {
            self.seen = s;
        }
        &self.seen
    }

    /// Whether the front end broke the protocol: the device is to be taken back and
    /// disconnected ([`Blkback::broken`] says how, once taken).
    pub fn broken(&self) -> bool {
        self.back.broken.load(Ordering::Acquire)
    }

    /// Whether the unit has ended without being taken back: a step panicked, or the
    /// scheduler stopped. Its back end serves no more and is to be disconnected.
    pub fn ended(&self) -> bool {
        self.join.is_finished()
    }

    /// Takes the back end back and ends the unit, waiting for the step in progress (if
    /// any) and no other; `None` if it was taken before.
    pub fn take(self) -> Option<Blkback<X>> {
        self.back.leave.store(true, Ordering::Release);
        self.join.wake();
        if !self.join.is_finished() {
            let _ = self.join.join();
        }
        lock(&self.back.back).take()
    }
}
