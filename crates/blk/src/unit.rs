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
//! descriptor for the whole domain, as Linux's upcall demultiplexes its ports) calls
//! [`Queue::wake`] for the queue's [`Queue::port`], as an interrupt handler wakes the
//! ring's thread. The unit then serves until its ring stays empty, re-arming the
//! front end's notification as it goes idle ([`Blkback::pending`]).
//!
//! The back end stays reachable from the thread that placed it ([`Queue::with`]: its
//! counters, whether it broke) behind a lock a step holds while it serves; taking it
//! back ([`Queue::take`]), to hand it over or disconnect it, ends the unit.

use std::sync::{Arc, Mutex, MutexGuard};

use hv::sched::{Cx, SchedError, Scheduler, Step, Unit, UnitJoin, UnitSpec};
use hv::{Port, Xen};

use crate::blkback::Blkback;

type Shared<X> = Arc<Mutex<Option<Blkback<X>>>>;

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
}

impl<X: Xen> Served<X> {
    /// Looks at the back end between two steps (none once taken back).
    pub fn with<R>(&self, f: impl FnOnce(&Blkback<X>) -> R) -> Option<R> {
        lock(&self.back).as_ref().map(f)
    }
}

impl<X: Xen + Send + 'static> Unit for Served<X> {
    type Output = ();

    fn step(&mut self, _cx: &Cx) -> Step<()> {
        let mut g = lock(&self.back);
        let Some(b) = g.as_mut() else {
            // Taken back: the unit ends.
            return Step::Done(());
        };
        if b.broken().is_some() {
            // Disconnected for a protocol break: it waits to be taken back.
            return Step::Idle(None);
        }
        b.serve();
        if b.pending() {
            // Stopped at its budget: the pCPU's other units go first.
            Step::More
        } else {
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
        let shared = Arc::new(Mutex::new(Some(back)));
        let join = sched.place(
            pcpu,
            spec,
            wrap(Served {
                back: Arc::clone(&shared),
            }),
        )?;
        Ok(Self {
            back: shared,
            join,
            port,
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

    /// Looks at the back end between two of its steps (none once taken back).
    pub fn with<R>(&self, f: impl FnOnce(&Blkback<X>) -> R) -> Option<R> {
        lock(&self.back).as_ref().map(f)
    }

    /// Whether the unit has ended without being taken back: a step panicked, or the
    /// scheduler stopped. Its back end serves no more and is to be disconnected.
    pub fn ended(&self) -> bool {
        self.join.is_finished()
    }

    /// Takes the back end back (waiting for a step in progress to finish) and ends the
    /// unit; `None` if it was taken before.
    pub fn take(self) -> Option<Blkback<X>> {
        let back = lock(&self.back).take();
        self.join.wake();
        if !self.join.is_finished() {
            let _ = self.join.join();
        }
        back
    }
}
