//! A vif served as a unit of pvio's scheduler, beside the vbd queues (`blk::unit`): its
//! queues' rings and its interface, moved in steps on a pCPU of the back end's, as
//! Linux's netback moves each queue's packets in a NAPI poll and a kernel thread of its
//! own.
//!
//! One step reads at most a budget of frames from the interface (each to its flow's
//! queue), copies what each queue holds to the guest's posted buffers, and takes at
//! most a budget of each queue's packets from the guest to the interface. So a guest
//! that floods its TX ring, or a host that floods the interface, holds its pCPU one
//! step at a time. Input on the interface wakes the unit (the pCPU watches the
//! descriptor, [`dev::tap::TapPort::bind_unit`]); the guest's notifications come from
//! the upcall that reads the event-channel device ([`NetUnit::routes`]); a rate's next period
//! is the unit's deadline.
//!
//! The vifs on one pCPU share that pCPU's packet buffers (one step at a time runs
//! there). A back end in user space copies every packet (`Vif::set_tx_copy`), so no
//! buffer holds a guest's page and no release token comes back to be answered. The
//! unit whose step finds one hands it to its own queues; one that names another vif
//! would be lost to that vif, and is counted (`stray_tokens`), so that a mode that made
//! them would show.
//!
//! As for a vbd queue, the thread that placed the unit never waits on its lock while it
//! runs: counters when the lock is free, a flag for a vif that broke, and taking it
//! back (to hand it over or disconnect it) first tells it to leave.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use dev::tap::TapPort;
use hv::sched::{Cx, SchedError, Scheduler, Step, Unit, UnitJoin, UnitSpec, UnitStats, Waker};
use hv::Xen;
use net::netback::{self, Vif, VifStats};
use net::skb::{SkbId, SkbPool, NET_SKB_PAD};

use crate::upcall::Route;

/// Packets one queue's TX takes per step.
const TX_BUDGET: usize = 64;
/// Longest frame between a TAP and a vif: a 64 KiB segment and its Ethernet header.
const FRAME_MAX: usize = 65536 + 14;

/// A pCPU's packet buffers, shared by the vifs placed there.
pub(crate) type Pool = Arc<Mutex<SkbPool>>;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a vif's unit counted.
#[derive(Debug, Default)]
pub(crate) struct Counted {
    /// Frames written to the interface.
    pub frames_out: AtomicU64,
    /// Frames read from the interface and queued for the guest.
    pub frames_in: AtomicU64,
    /// Frames dropped for want of a buffer, or too long.
    pub frames_dropped: AtomicU64,
    /// Release tokens that named no queue of this vif (none is expected).
    pub stray_tokens: AtomicU64,
}

/// What the unit moves packets between.
struct Served<X: Xen> {
    queues: Vec<Vif<X>>,
    tap: TapPort,
    /// A packet gathered for the interface (allocated once).
    frame: Box<[u8]>,
    tokens: Vec<u32>,
}

struct Inner<X: Xen> {
    served: Mutex<Option<Served<X>>>,
    pool: Pool,
    /// To be taken back: the unit ends at its next step.
    leave: AtomicBool,
    /// The guest notified (a queue's TX may hold packets); set by the upcall.
    signalled: Arc<AtomicBool>,
    /// A queue broke the protocol: the vif waits to be disconnected.
    broken: AtomicBool,
    counted: Counted,
}

struct VifUnit<X: Xen> {
    inner: Arc<Inner<X>>,
    /// What wakes it: the interface is bound to it at its first step, outside the
    /// scheduler's lock that `attach` runs under.
    waker: Option<Waker>,
}

impl<X: Xen + Send + 'static> Unit for VifUnit<X> {
    type Output = ();

    fn attach(&mut self, waker: &Waker, _stats: &Arc<UnitStats>) {
        self.waker = Some(waker.clone());
    }

    fn step(&mut self, _cx: &Cx) -> Step<()> {
        let inner = &*self.inner;
        if inner.leave.load(Ordering::Acquire) {
            return Step::Done(());
        }
        let mut g = lock(&inner.served);
        let Some(s) = g.as_mut() else {
            return Step::Done(());
        };
        if let Some(w) = &self.waker {
            // Input on the interface wakes the unit (once bound, this does nothing).
            s.tap.bind_unit(w);
        }
        if s.queues.iter().any(|v| v.disabled().is_some()) {
            inner.broken.store(true, Ordering::Release);
            return Step::Idle(None);
        }
        let mut pool = lock(&inner.pool);
        let busy = move_packets(
            s,
            &mut pool,
            inner.signalled.swap(false, Ordering::AcqRel),
            &inner.counted,
        );
        if s.queues.iter().any(|v| v.disabled().is_some()) {
            inner.broken.store(true, Ordering::Release);
            return Step::Idle(None);
        }
        if busy {
            return Step::More;
        }
        // Nothing moved: the interface's line is armed, the guest notifies; a packet
        // that waits for its rate's credit wakes the unit when the period begins.
        Step::Idle(s.queues.iter().filter_map(Vif::tx_credit_wait).min())
    }
}

/// One step's packets for one vif; whether any moved.
fn move_packets<X: Xen>(
    s: &mut Served<X>,
    pool: &mut SkbPool,
    signalled: bool,
    counted: &Counted,
) -> bool {
    let Served {
        queues,
        tap,
        frame,
        tokens,
    } = s;
    let n = queues.len();
    // The interface's frames, each into the queue of its flow.
    let got = tap.recv(|bytes, off| {
        let Ok(skb) = pool.alloc(NET_SKB_PAD) else {
            counted.frames_dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        if pool.append(skb, bytes).is_err() {
            pool.free(skb);
            counted.frames_dropped.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        pool.set_offload(skb, off);
        queues[netback::select_queue(bytes, n)].start_xmit(pool, skb);
        counted.frames_in.fetch_add(1, Ordering::Relaxed);
        true
    });
    let mut busy = got > 0;
    for vif in queues.iter_mut() {
        let rx = if vif.rx_pending() {
            vif.rx_action(pool)
        } else {
            0
        };
        let tx = if signalled || vif.tx_pending() {
            vif.tx_action(pool, TX_BUDGET, |pool, skb| {
                to_tap(tap, pool, skb, frame, counted);
            })
        } else {
            0
        };
        busy |= rx + tx > 0;
    }
    pool.take_released(|r| tokens.push(r.token));
    if !tokens.is_empty() {
        busy = true;
        let mine = tokens
            .iter()
            .filter(|&&t| queues.iter().any(|v| u32::from(v.index()) == t >> 16))
            .count();
        counted
            .stray_tokens
            .fetch_add((tokens.len() - mine) as u64, Ordering::Relaxed);
        for v in queues.iter_mut() {
            v.tx_release(tokens.iter().copied());
        }
        tokens.clear();
    }
    busy
}

/// Writes one packet from a vif to its interface, whole (its pieces gathered into one
/// buffer allocated once), with its offload; frees it.
fn to_tap(tap: &mut TapPort, pool: &mut SkbPool, skb: SkbId, frame: &mut [u8], c: &Counted) {
    let len = pool.len(skb);
    if len <= frame.len() && pool.read(skb, 0, &mut frame[..len]).is_ok() {
        tap.send(&frame[..len], pool.offload(skb));
        c.frames_out.fetch_add(1, Ordering::Relaxed);
    } else {
        c.frames_dropped.fetch_add(1, Ordering::Relaxed);
    }
    pool.free(skb);
}

/// A vif that could not be placed, and what it held.
pub(crate) struct Unplaced<X: Xen> {
    pub why: SchedError,
    pub queues: Vec<Vif<X>>,
    pub tap: TapPort,
}

/// A connected vif placed on a scheduler: what wakes it, and its queues and interface.
pub(crate) struct NetUnit<X: Xen> {
    inner: Arc<Inner<X>>,
    join: UnitJoin<()>,
    /// Every queue's channels (the TX ring's, the RX ring's if split).
    ports: Vec<u32>,
    /// Each queue's counters as last seen.
    seen: Vec<VifStats>,
}

impl<X: Xen + Send + 'static> NetUnit<X> {
    /// Places a connected vif's `queues` and its interface on pCPU `pcpu`, moving
    /// packets with `pool` (that pCPU's); gives them back if it cannot be placed.
    pub(crate) fn place(
        sched: &Scheduler,
        pcpu: usize,
        name: String,
        queues: Vec<Vif<X>>,
        tap: TapPort,
        pool: Pool,
    ) -> Result<Self, Box<Unplaced<X>>> {
        let ports = queues
            .iter()
            .flat_map(|v| [Some(v.port().0), v.rx_port().map(|p| p.0)])
            .flatten()
            .collect();
        let seen = queues.iter().map(|v| v.stats().clone()).collect();
        let inner = Arc::new(Inner {
            served: Mutex::new(Some(Served {
                queues,
                tap,
                frame: vec![0; FRAME_MAX].into_boxed_slice(),
                tokens: Vec::with_capacity(netback::MAX_PENDING),
            })),
            pool,
            leave: AtomicBool::new(false),
            // Its first step looks at every ring.
            signalled: Arc::new(AtomicBool::new(true)),
            broken: AtomicBool::new(false),
            counted: Counted::default(),
        });
        match sched.place(
            pcpu,
            UnitSpec::named(name),
            VifUnit {
                inner: Arc::clone(&inner),
                waker: None,
            },
        ) {
            Ok(join) => Ok(Self {
                inner,
                join,
                ports,
                seen,
            }),
            Err(why) => {
                let s = lock(&inner.served).take().expect("never placed");
                Err(Box::new(Unplaced {
                    why,
                    queues: s.queues,
                    tap: s.tap,
                }))
            }
        }
    }

    /// What each of its queues' channels wakes: the unit, told the guest notified.
    pub(crate) fn routes(&self) -> impl Iterator<Item = Route> + '_ {
        self.ports.iter().map(|&port| {
            let flag = Some(Arc::clone(&self.inner.signalled));
            Route::new(port, flag, self.join.waker(), self.join.stats())
        })
    }

    /// The pCPU it runs on.
    pub(crate) fn pcpu(&self) -> usize {
        self.join.waker().pcpu()
    }

    /// Whether a queue broke the protocol (or the unit ended under it: a step that
    /// panicked): the vif is to be taken back and disconnected.
    pub(crate) fn broken(&self) -> bool {
        self.inner.broken.load(Ordering::Acquire) || self.join.is_finished()
    }

    /// What it counted.
    pub(crate) fn counted(&self) -> &Counted {
        &self.inner.counted
    }

    /// Each queue's counters: now if no step holds the vif, else as last seen.
    pub(crate) fn stats(&mut self) -> &[VifStats] {
        if let Ok(g) = self.inner.served.try_lock() {
            if let Some(s) = g.as_ref() {
                self.seen = s.queues.iter().map(|v| v.stats().clone()).collect();
            }
        }
        &self.seen
    }

    /// Takes the queues and the interface back and ends the unit, waiting for the step
    /// in progress (if any) and no other; with the pCPU's pool, to give back what they
    /// hold.
    pub(crate) fn take(self) -> Option<(Vec<Vif<X>>, TapPort, Pool)> {
        self.inner.leave.store(true, Ordering::Release);
        self.join.wake();
        if !self.join.is_finished() {
            let _ = self.join.join();
        }
        let mut s = lock(&self.inner.served).take()?;
        // Its interface is no longer this unit's line.
        s.tap.unbind_unit();
        Some((s.queues, s.tap, Arc::clone(&self.inner.pool)))
    }
}
