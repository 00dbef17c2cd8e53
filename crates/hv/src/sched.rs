//! pvio's scheduler: the physical CPUs pvio owns, and the units it runs on them.
//!
//! A machine is given cores. On each, pvio runs one pinned thread, a *pCPU*, which owns
//! the core as Xen owns its physical CPUs. Every activity of the machine is a *unit* on
//! a pCPU: a vCPU's kernel, a device model's engine. A unit is a state machine with one
//! entry point, [`Unit::step`]: it does one bounded pass of work (a poll with a
//! NAPI-style budget) and says whether it has more, is idle until an event (or a
//! deadline), or is done. The pCPU runs its runnable units round-robin, each for its
//! weight in steps a turn; preemption happens only between steps, so a step's length is
//! the scheduling latency a unit can impose on its neighbours, and it is counted. A
//! device's engine woken since its last step goes ahead of the round (never twice in a
//! row), and a step that leaves one woken ends its unit's weighted turn there: an engine
//! waits for a step, not for a turn or the round.
//!
//! A wake-up is Xen's `vcpu_wake` followed by an IPI: whoever gives a unit work (an
//! event channel's sender, a doorbell, a frame on a cable) sets the unit's bit in its
//! pCPU's *IPI word*. An idle pCPU is waiting on that word in its idle loop, in one of
//! three [`IdlePolicy`]s: it spins on it (`poll`), spins up to a bound and then sleeps
//! (`halt-poll`, KVM's `halt_poll_ns`), or sleeps at once (`block`, which is what a
//! vCPU thread parking on a futex costs). Only a sleeping pCPU needs the host to wake
//! it, and only then is a wake-up a system call.
//!
//! What it accounts, as a hypervisor would: each unit's time running, waiting to run
//! (woken, while another unit holds the pCPU) and idle, from the clock at every switch;
//! each pCPU's idle time; and the time the host took the pCPU away (the thread's CPU
//! clock against the wall clock over a window, less the time it slept on purpose), so
//! that no domain is charged for the host's other work.
//!
//! A device's engine is hardware beside the CPUs: it must not wait for a CPU while one
//! idles. A unit placed [`UnitSpec::stealable`] may have its steps run by another pCPU
//! of the scheduler that is idle while its own pCPU is in another unit's step (work
//! stealing, [`steal`]); it goes back to its own pCPU's table after each turn. Each
//! unit's waits to run are kept in a histogram (their 99th percentile and longest in
//! [`UnitReport`]), and steps longer than [`LONG_STEP`] are counted.
//!
//! A step that never returns (a hung kernel) holds its pCPU's thread but not its other
//! units: [`Scheduler::rescue`] retires the thread and starts a fresh one on the same
//! core, which takes the pCPU's other units over; the hung unit goes back to the pCPU
//! when its step returns.

use std::os::fd::{AsRawFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use mem::cpu::{pin_current_thread, RunDelay, SampleSlot, SlotBinding, ThreadClock};

mod holds;
mod steal;

use holds::{add, Holds, CLOCK_READ};
pub use holds::{HostHold, HOLD_LOGGED, HOLD_LOOK, HOST_GAP};

/// Units a pCPU can hold.
pub const MAX_UNITS: usize = 256;
const WORDS: usize = MAX_UNITS / 64;

/// How an idle pCPU waits for its IPI word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdlePolicy {
    /// Spin on the IPI word: a wake-up costs a cache line's transfer. For a lab whose
    /// load is all pvio's own, on cores nobody else needs.
    Poll,
    /// Spin up to the bound, then sleep until an IPI or a deadline (KVM's
    /// `halt_poll_ns`): a wake-up soon after going idle costs what polling costs, one
    /// after a long idle a host wake-up, and an idle pCPU gives its core back to the
    /// host's other processes (iperf3, a test runner) after the bound.
    HaltPoll(Duration),
    /// Sleep at once: every wake-up of an idle pCPU is a host wake-up (a futex), as a
    /// vCPU thread's was before pvio had a scheduler. Kept as the comparison row.
    Block,
    /// Halt-poll with a window of each pCPU's own that adapts, as KVM's `halt_poll_ns`
    /// does (`grow_halt_poll_ns`, `shrink_halt_poll_ns`): it starts at zero, grows
    /// (to [`ADAPTIVE_GROW_START`], then doubling, up to the bound) when a wake-up came
    /// after the window but within the bound, where a longer spin would have caught
    /// it, and drops back to zero when the pCPU slept longer than the bound, where no
    /// spin would have. A pCPU that wakes often spins; one that idles long gives its
    /// core back at once. For machines that share their cores with other processes
    /// (`pvio up` with iperf3).
    AdaptiveHaltPoll(Duration),
}

/// The window an adaptive halt-poll starts growing from (KVM's
/// `halt_poll_ns_grow_start`).
pub const ADAPTIVE_GROW_START: Duration = Duration::from_micros(10);

/// An adaptive halt-poll window after an idle period of `halted` with window `window`
/// and bound `max` (KVM's rule: `kvm_vcpu_halt`'s grow and shrink, shrink factor 0).
pub fn next_poll_window(window: Duration, halted: Duration, max: Duration) -> Duration {
    if halted <= window {
        // Woken while spinning: the window did its work.
        window
    } else if halted > max {
        // No window within the bound would have caught it.
        Duration::ZERO
    } else if window.is_zero() {
        ADAPTIVE_GROW_START.min(max)
    } else {
        (window * 2).min(max)
    }
}

/// KVM's default halt-polling bound (`halt_poll_ns`, 200 µs).
pub const HALT_POLL_DEFAULT: Duration = Duration::from_micros(200);

impl IdlePolicy {
    /// The default halt-poll policy.
    pub const HALT_POLL: IdlePolicy = IdlePolicy::HaltPoll(HALT_POLL_DEFAULT);

    /// The policy's name as records and machine files spell it: `poll`,
    /// `halt-poll` (the default bound) or `halt-poll:<µs>us`, `block`.
    pub fn name(&self) -> String {
        match self {
            IdlePolicy::Poll => "poll".into(),
            IdlePolicy::HaltPoll(b) if *b == HALT_POLL_DEFAULT => "halt-poll".into(),
            IdlePolicy::HaltPoll(b) => format!("halt-poll:{}us", b.as_micros()),
            IdlePolicy::Block => "block".into(),
            IdlePolicy::AdaptiveHaltPoll(b) if *b == HALT_POLL_DEFAULT => "adaptive".into(),
            IdlePolicy::AdaptiveHaltPoll(b) => format!("adaptive:{}us", b.as_micros()),
        }
    }

    /// The policy for a machine that shares its cores with another machine of the same
    /// run (paper 002's two hosts on one cable): `poll` becomes `halt-poll`, so that the
    /// two machines' pCPUs on one core take turns instead of spinning against each other.
    pub fn shared(self) -> IdlePolicy {
        match self {
            IdlePolicy::Poll => IdlePolicy::HALT_POLL,
            p => p,
        }
    }

    /// Parses [`IdlePolicy::name`]'s spellings.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "poll" => Ok(IdlePolicy::Poll),
            "block" => Ok(IdlePolicy::Block),
            "halt-poll" => Ok(IdlePolicy::HALT_POLL),
            "adaptive" => Ok(IdlePolicy::AdaptiveHaltPoll(HALT_POLL_DEFAULT)),
            _ if s.starts_with("adaptive:") => s
                .strip_prefix("adaptive:")
                .and_then(|r| r.strip_suffix("us"))
                .and_then(|n| n.parse::<u64>().ok())
                .map(|us| IdlePolicy::AdaptiveHaltPoll(Duration::from_micros(us)))
                .ok_or_else(|| format!("idle policy {s:?}: adaptive or adaptive:<n>us")),
            _ => {
                let us = s
                    .strip_prefix("halt-poll:")
                    .and_then(|r| r.strip_suffix("us"))
                    .and_then(|n| n.parse::<u64>().ok())
                    .ok_or_else(|| {
                        format!(
                            "idle policy {s:?}: poll, halt-poll, halt-poll:<n>us, adaptive \
                             or block"
                        )
                    })?;
                Ok(IdlePolicy::HaltPoll(Duration::from_micros(us)))
            }
        }
    }
}

impl std::fmt::Display for IdlePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// What one step of a unit did.
#[derive(Debug)]
pub enum Step<O> {
    /// It has more work that needs no wake-up to be found: run it again next turn.
    More,
    /// It found nothing to do but keeps polling (a device's micro-engine that owns its
    /// core): run it again next turn. When a whole round of a pCPU's units only yields,
    /// a pCPU that shares its core with other threads (`halt-poll`, `block`) gives the
    /// host a turn, as a polling thread's `sched_yield` does; a `poll` pCPU spins on.
    Yield,
    /// It has nothing to do until woken, or until the deadline, if any.
    Idle(Option<Instant>),
    /// It has ended, with its result.
    Done(O),
}

/// What a step is told.
#[derive(Debug, Clone, Copy)]
pub struct Cx {
    /// When the step began.
    pub now: Instant,
    /// When the unit was last woken (its IPI seen, or its deadline passed) after it
    /// went idle; `None` when its previous step had more work.
    pub woken: Option<Instant>,
}

/// A schedulable unit: a vCPU's kernel, a device's engine.
pub trait Unit: Send + 'static {
    /// What it gives back when done.
    type Output: Send + 'static;
    /// Called once as it is placed, before its first step, with what wakes it and
    /// where its time is accounted.
    fn attach(&mut self, _waker: &Waker, _stats: &Arc<UnitStats>) {}
    /// Where the profiler's samples are charged while it runs (none: the pCPU's own).
    fn samples(&self) -> Option<Arc<SampleSlot>> {
        None
    }
    /// One bounded pass of work.
    fn step(&mut self, cx: &Cx) -> Step<Self::Output>;
}

/// How a unit is scheduled.
#[derive(Debug, Clone)]
pub struct UnitSpec {
    /// Its name, for stats and threads.
    pub name: String,
    /// Steps it may take a turn while it has more work (Xen's credit weight, scaled:
    /// 1 is the least). Units of weights 1 and 3 that both always have work get one and
    /// three steps of each round.
    pub weight: u32,
    /// The share of its pCPU's time it may take, in percent per accounting period (Xen's
    /// cap); 0 or 100 is no cap. A unit past its cap is not run until the next period.
    pub cap_percent: u32,
    /// Another pCPU of the scheduler, idle, may run its steps while its own pCPU is in
    /// another unit's step (a device's engine, which must not wait for a CPU while one
    /// idles). Its state must not be tied to a thread. Implies `movable`.
    pub stealable: bool,
    /// Another pCPU of the scheduler, idle, may run its steps while the host holds its
    /// own pCPU's thread off the core (Xen's soft affinity: a vCPU pinned to a pCPU
    /// runs elsewhere rather than not at all). Its state must not be tied to a thread.
    pub movable: bool,
}

impl UnitSpec {
    /// A unit of weight 1 without a cap.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            weight: 1,
            cap_percent: 0,
            stealable: false,
            movable: false,
        }
    }

    /// A vCPU of weight 1 without a cap, which an idle pCPU may run while the host
    /// holds its own ([`UnitSpec::movable`]).
    pub fn vcpu(name: impl Into<String>) -> Self {
        Self {
            movable: true,
            ..Self::named(name)
        }
    }

    /// A device's engine of weight 1 without a cap, which idle pCPUs may run
    /// ([`UnitSpec::stealable`]).
    pub fn device(name: impl Into<String>) -> Self {
        Self {
            stealable: true,
            movable: true,
            ..Self::named(name)
        }
    }
}

/// A step longer than this is counted as long (`long_steps`): the time a unit's
/// neighbours on its pCPU may wait behind it, a bound a device's engine (whose frames
/// arrive at the wire's pace) cannot afford to wait past.
pub const LONG_STEP: Duration = Duration::from_millis(1);

/// Buckets of the wait-to-run histogram: bucket 0 below 1024 ns, then each power of two
/// of ns from 2^10 on in four equal parts (a bucket's bound at most a quarter above any
/// wait in it), up to 2^34 ns (17 s), the last everything longer.
pub const WAIT_BUCKETS: usize = 1 + 4 * 24;

/// The histogram bucket of a wait of `ns`.
fn wait_bucket(ns: u64) -> usize {
    if ns < 1 << 10 {
        return 0;
    }
    let e = 63 - ns.leading_zeros() as usize;
    let quarter = (ns >> (e - 2)) as usize & 3;
    (1 + 4 * (e - 10) + quarter).min(WAIT_BUCKETS - 1)
}

/// The upper bound of histogram bucket `k`, in whole µs up.
fn bucket_bound(k: usize) -> Duration {
    let ns = match k {
        0 => 1 << 10,
        _ => {
            let (e, quarter) = (10 + (k - 1) / 4, (k - 1) % 4);
            (5 + quarter as u64) << (e - 2)
        }
    };
    Duration::from_micros(ns.div_ceil(1000))
}

/// A histogram of waits to run, by [`wait_bucket`].
#[derive(Debug)]
struct WaitHist([AtomicU64; WAIT_BUCKETS]);

impl Default for WaitHist {
    fn default() -> Self {
        Self(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl std::ops::Deref for WaitHist {
    type Target = [AtomicU64; WAIT_BUCKETS];
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// The 99th percentile of a wait histogram, as the upper bound of the bucket it falls in
/// (zero: no wait yet).
fn p99(waits: &[AtomicU64; WAIT_BUCKETS]) -> Duration {
    let waits: Vec<u64> = waits.iter().map(|b| b.load(Ordering::Relaxed)).collect();
    let total: u64 = waits.iter().sum();
    if total == 0 {
        return Duration::ZERO;
    }
    // The bucket holding the wait that 99% of the waits do not exceed.
    let want = total - total / 100;
    let mut seen = 0;
    let k = waits
        .iter()
        .position(|&n| {
            seen += n;
            seen >= want
        })
        .unwrap_or(WAIT_BUCKETS - 1);
    bucket_bound(k)
}

/// The accounting period for caps (Xen's credit scheduler accounts every 30 ms; a
/// shorter period keeps a capped unit's bursts short on a lab's time scale).
pub const CAP_PERIOD: Duration = Duration::from_millis(10);

/// A unit's accounting, readable while it runs.
#[derive(Debug, Default)]
pub struct UnitStats {
    name: String,
    running_ns: AtomicU64,
    runnable_ns: AtomicU64,
    steps: AtomicU64,
    wakeups: AtomicU64,
    longest_step_ns: AtomicU64,
    capped: AtomicU64,
    /// Its waits to run, woken until it ran, by [`wait_bucket`].
    waits: WaitHist,
    longest_wait_ns: AtomicU64,
    /// The same waits less the time the host held the thread that ran the unit off its
    /// core meanwhile, as far as that thread can tell ([`Holds`]), or a thief's thread
    /// that had it ([`UnitStats::held_away`]).
    net_waits: WaitHist,
    longest_net_wait_ns: AtomicU64,
    long_steps: AtomicU64,
    /// Turns another pCPU ran it.
    stolen: AtomicU64,
    /// Its scheduler's count of wait windows ([`Scheduler::mark_waits`]), and the one
    /// its wait histograms and longest waits belong to: a new window restarts them at
    /// the unit's next wait (by the thread that writes them, so nothing races).
    window: Arc<AtomicU64>,
    counted: AtomicU64,
    /// Its last turn on a thief's thread that lasted [`HOLD_LOOK`] or more: from, to
    /// (ns since the pCPU's epoch), and the time at least that the host held the
    /// thief's thread in it ([`UnitStats::held_away`]).
    away_hold: [AtomicU64; 3],
    /// The last span (ns since its pCPU's epoch) over which its pCPU's table was locked
    /// by a thread the host held: its pCPU's own in one turn, as a thief found it before
    /// it took the unit, or a thief's putting it back ([`UnitStats::held_locked`]).
    locked_hold: [AtomicU64; 2],
}

/// A snapshot of [`UnitStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnitReport {
    /// The unit's name.
    pub name: String,
    /// Time it ran (its steps' wall time).
    pub running: Duration,
    /// Time it waited to run, woken, while other units held the pCPU.
    pub runnable: Duration,
    /// Steps taken.
    pub steps: u64,
    /// Times it was woken from idle.
    pub wakeups: u64,
    /// Its longest step: how long it held its pCPU at once.
    pub longest_step: Duration,
    /// Turns it was passed over for being past its cap.
    pub capped: u64,
    /// The 99th percentile of its waits to run (woken until it ran), as the upper bound
    /// of the histogram bucket it falls in (zero: no wait yet).
    pub wait_p99: Duration,
    /// Its longest wait to run.
    pub longest_wait: Duration,
    /// As `wait_p99`, each wait less the time the host held the pCPU that ran it off
    /// its core meanwhile, as far as its thread can tell ([`Holds`]: the gaps its idle
    /// loop saw, and the wall time its CPU clock did not count since its last read).
    pub wait_p99_net: Duration,
    /// Its longest wait to run, net likewise.
    pub longest_wait_net: Duration,
    /// Steps longer than [`LONG_STEP`].
    pub long_steps: u64,
    /// Turns an idle pCPU other than its own ran it ([`UnitSpec::stealable`]).
    pub stolen: u64,
}

impl UnitStats {
    /// Time the unit has run.
    pub fn running(&self) -> Duration {
        Duration::from_nanos(self.running_ns.load(Ordering::Relaxed))
    }
    /// A snapshot.
    pub fn report(&self) -> UnitReport {
        let d = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        let (wait_p99, wait_p99_net) = (p99(&self.waits), p99(&self.net_waits));
        // No wait since a new window began: its waits are none yet.
        let fresh = self.window.load(Ordering::Relaxed) == self.counted.load(Ordering::Relaxed);
        let w = |v: Duration| if fresh { v } else { Duration::ZERO };
        UnitReport {
            name: self.name.clone(),
            running: d(&self.running_ns),
            runnable: d(&self.runnable_ns),
            steps: self.steps.load(Ordering::Relaxed),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            longest_step: d(&self.longest_step_ns),
            capped: self.capped.load(Ordering::Relaxed),
            wait_p99: w(wait_p99),
            longest_wait: w(d(&self.longest_wait_ns)),
            wait_p99_net: w(wait_p99_net),
            longest_wait_net: w(d(&self.longest_net_wait_ns)),
            long_steps: self.long_steps.load(Ordering::Relaxed),
            stolen: self.stolen.load(Ordering::Relaxed),
        }
    }

    /// It had a turn on a thief's thread from `from` to `to` (ns since its pCPU's
    /// epoch) in which the host held that thread for `held` at least. Written by the
    /// thief before the unit is back in its table (under the table's lock), read by
    /// whoever runs it next.
    pub(super) fn held_away(&self, from: u64, to: u64, held: u64) {
        for (a, v) in self.away_hold.iter().zip([from, to, held]) {
            a.store(v, Ordering::Relaxed);
        }
    }

    /// Its pCPU's table was held from `from` to `to` (ns since its pCPU's epoch) by a
    /// thread the host held: its pCPU's own in one turn, as a thief that then took the
    /// unit found it, or a thief's putting the unit back before it signalled it. The
    /// host's, every bit of it (either has the table a few hundred ns with its core).
    /// Written under the table's lock, read as whoever runs the unit next accounts its
    /// wait.
    pub(super) fn held_locked(&self, from: u64, to: u64) {
        self.locked_hold[0].store(from, Ordering::Relaxed);
        self.locked_hold[1].store(to, Ordering::Relaxed);
    }

    /// The time in `from..to` (ns since its pCPU's epoch) its pCPU's table was locked by
    /// a thread the host held, as last kept ([`UnitStats::held_locked`]).
    fn locked_within(&self, from: u64, to: u64) -> u64 {
        let [a, b] = self
            .locked_hold
            .each_ref()
            .map(|v| v.load(Ordering::Relaxed));
        b.min(to).saturating_sub(a.max(from))
    }

    /// At least the time in `from..to` (ns since its pCPU's epoch) the host held a
    /// thief's thread with the unit on it: the hold lies somewhere in its turn, so the
    /// part inside is at least the hold less the turn's part outside.
    fn away_within(&self, from: u64, to: u64) -> u64 {
        let [a, b, held] = self.away_hold.each_ref().map(|v| v.load(Ordering::Relaxed));
        if held == 0 || b < from || a > to {
            return 0;
        }
        let inside = b.min(to).saturating_sub(a.max(from));
        held.saturating_sub((b - a).saturating_sub(inside))
    }

    /// A wait to run of `ns`, `net` of it not the host's, into the histograms. Only the
    /// thread running the unit writes its stats (one at a time, handed over under its
    /// pCPU's table lock), so plain loads and stores do, without a locked instruction
    /// per wake-up.
    fn waited(&self, ns: u64, net: u64) {
        let window = self.window.load(Ordering::Relaxed);
        if window != self.counted.load(Ordering::Relaxed) {
            for a in self.waits.iter().chain(self.net_waits.iter()) {
                a.store(0, Ordering::Relaxed);
            }
            self.longest_wait_ns.store(0, Ordering::Relaxed);
            self.longest_net_wait_ns.store(0, Ordering::Relaxed);
            self.counted.store(window, Ordering::Relaxed);
        }
        for (h, longest, v) in [
            (&self.waits, &self.longest_wait_ns, ns),
            (&self.net_waits, &self.longest_net_wait_ns, net),
        ] {
            let b = &h[wait_bucket(v)];
            b.store(b.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            if v > longest.load(Ordering::Relaxed) {
                longest.store(v, Ordering::Relaxed);
            }
        }
    }
}

/// A pCPU's accounting, readable while it runs.
#[derive(Debug, Default)]
struct PcpuStats {
    busy_ns: AtomicU64,
    idle_ns: AtomicU64,
    slept_ns: AtomicU64,
    sleeps: AtomicU64,
    /// Wake-ups that found it asleep (the host had to wake it).
    host_wakes: AtomicU64,
    /// Sleeps a waker rang it out of, and the time from the first ring to its thread's
    /// running again, in all and the longest (the host's wake-ups).
    rung_wakes: AtomicU64,
    rung_wake_ns: AtomicU64,
    longest_rung_wake_ns: AtomicU64,
    /// Timed sleeps the host woke it from after their time, and how late, in all and
    /// the longest (the host's wake-ups at a timer).
    timer_wakes: AtomicU64,
    timer_late_ns: AtomicU64,
    longest_timer_late_ns: AtomicU64,
    /// Units it found woken in its IPI word (wake-ups of one unit before the pCPU looked
    /// count once).
    ipis: AtomicU64,
    /// The thread's CPU time, as it last read its clock (on its way into the idle loop).
    cpu_ns: AtomicU64,
    longest_step_ns: AtomicU64,
    rescues: AtomicU64,
    /// Interrupt lines it saw input on and fired.
    line_fires: AtomicU64,
    /// The longest gap between two looks of its spinning idle loop (a few ns apart when
    /// the thread has its core), or on its way from a step to the next pick: the longest
    /// time the host took the core from it outside steps.
    longest_away_ns: AtomicU64,
    /// Turns of its units that idle peers ran while the host held its thread off the
    /// core ([`steal::HELD_AFTER`]).
    covered: AtomicU64,
    /// Times its own thread took wake-ups from its IPI word (written by it alone; read
    /// by peers watching whether it runs).
    took: AtomicU64,
}

/// A snapshot of one pCPU's accounting.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PcpuReport {
    /// Its index in the scheduler.
    pub index: usize,
    /// The core it is pinned to (none: it floats, on a host without that core).
    pub core: Option<usize>,
    /// Time running units.
    pub busy: Duration,
    /// Time in the idle loop (spinning or asleep).
    pub idle: Duration,
    /// Of the idle time, asleep in the host.
    pub slept: Duration,
    /// Times it went to sleep.
    pub sleeps: u64,
    /// Wake-ups that had to wake it in the host.
    pub host_wakes: u64,
    /// Sleeps a waker rang it out of (several rings of one sleep count once).
    pub rung_wakes: u64,
    /// The time from each such sleep's first ring to its thread's running again, in
    /// all: the host's wake-ups of it, a hold its devices' waits are net of.
    pub rung_wake: Duration,
    /// The longest of those.
    pub longest_rung_wake: Duration,
    /// Timed sleeps that ended at their timer (before any ring).
    pub timer_wakes: u64,
    /// How long after the timer's due time each such sleep's thread ran again, in all:
    /// the host's wake-up of it at its timer (a halted core's timer interrupt wakes it
    /// in about a µs), a hold its devices' waits are net of, as a ring's.
    pub timer_late: Duration,
    /// The longest of those.
    pub longest_timer_late: Duration,
    /// Units it found woken in its IPI word (several wake-ups of a unit before it looked
    /// count once).
    pub ipis: u64,
    /// Time the host kept its thread off the core while it meant to run: the wall time
    /// since the stats were reset, less its thread's CPU time and its sleeps.
    pub stolen: Duration,
    /// The wall time the report covers.
    pub window: Duration,
    /// The longest step any unit took on it.
    pub longest_step: Duration,
    /// Times a hung step's thread was replaced.
    pub rescues: u64,
    /// Its thread's CPU time over the window (as the thread last read its clock, at
    /// most a millisecond ago while it runs).
    pub cpu: Duration,
    /// Profiler samples taken while no unit with samples of its own ran (the idle loop,
    /// the scheduler, device engines).
    pub samples: u64,
    /// Interrupt lines from the host ([`IrqLine`]) it saw input on and fired.
    pub line_fires: u64,
    /// The longest the host kept its thread off the core at one time outside steps
    /// (in the idle loop or the scheduler's way to its next pick; a step's such gaps
    /// show in `longest_step`).
    pub longest_away: Duration,
    /// Of `stolen`, the time its thread waited on the host's run queue while other host
    /// threads had the core; the rest is time the VM itself was off the host's CPU (its
    /// hypervisor's), which the host kernel cannot see.
    pub host_queued: Duration,
    /// Turns of its units that idle peers ran while the host held its thread off the
    /// core (movable units: vCPUs and devices' engines).
    pub covered: u64,
}

type Slot = Option<Box<dyn Erased>>;

/// The units of one pCPU, with the state its thread keeps between steps.
struct Table {
    /// Bumped when a rescue retires the thread that runs the pCPU.
    generation: u64,
    units: Vec<Slot>,
    /// Slots of units placed and not yet ended (whether in the table or out in a step).
    held: [u64; WORDS],
    /// Units placed and not yet ended.
    live: usize,
    /// Runnable units the thread has taken from the IPI word.
    runnable: [u64; WORDS],
    /// Units idle until woken (or their deadline).
    idle: [u64; WORDS],
    /// Units with a deadline.
    timed: [u64; WORDS],
    /// Deadlines of idle units (index: slot).
    deadline: Vec<Option<Instant>>,
    /// When each runnable unit was woken (index: slot).
    woken: Vec<Option<Instant>>,
    /// When each idle unit's last step ended (index: slot): a wake-up stamped before
    /// then came while the unit ran, so it waited to run from there on, not before.
    stepped: Vec<Option<Instant>>,
    /// Time each capped unit ran in the current period, and when the period began.
    period_ns: Vec<u64>,
    period_start: Instant,
    /// Units passed over until the next period.
    over_cap: [u64; WORDS],
    /// Stealable units out on another pCPU's thread for a turn.
    away: [u64; WORDS],
}

/// A pCPU: its IPI word and the state its thread and wakers share.
pub(crate) struct PcpuShared {
    index: usize,
    core: Option<usize>,
    policy: IdlePolicy,
    /// The adaptive halt-poll's window now, ns (only its own thread writes it).
    poll_window_ns: AtomicU64,
    sample: Option<Duration>,
    name: String,
    /// The IPI word: one bit per unit woken since the thread last looked.
    ipi: [AtomicU64; WORDS],
    sleeping: AtomicBool,
    /// When a waker first rang it while it slept (ns since `epoch`; 0: not since it
    /// went to sleep): from then until its thread runs, the host holds it.
    rung_ns: AtomicU64,
    thread: Mutex<Option<Thread>>,
    stop: AtomicBool,
    /// When the step now running began, in ns since `epoch`; 0 when none runs.
    step_since: AtomicU64,
    /// When its thread took its table for a turn of its scheduler (ns since `epoch`),
    /// 0 once it let it go: the table is its own a few hundred ns a turn with its core,
    /// so a thief that finds it locked in the same turn over a span knows the host held
    /// the thread, with the table, all that span ([`steal`]).
    turn_ns: AtomicU64,
    epoch: Instant,
    table: Mutex<Table>,
    stats: PcpuStats,
    /// Where samples go while no unit with a slot of its own runs.
    own: Arc<SampleSlot>,
    /// When the report window began, the thread's CPU clock and its host run-queue wait
    /// then.
    window_start: Mutex<(Instant, Duration, Duration)>,
    /// Its thread's host id (0 before it runs), for its `schedstat`.
    tid: AtomicI32,
    /// The host descriptors its units wait on ([`Waker::irq_line`]); bumped `lines_at`
    /// tells the thread to take a fresh copy.
    lines: Mutex<Vec<Arc<LineInner>>>,
    lines_at: AtomicU64,
    /// What a waker signals while the thread sleeps in `ppoll` on its lines.
    doorbell: OnceLock<mem::poll::EventFd>,
    /// What work stealing shares, on lines of its own.
    steal: StealShared,
    /// When each stealable unit was last woken from idle, ns since `epoch` (0: not
    /// since its pCPU last looked), stamped by its waker.
    woke_ns: Box<[AtomicU64]>,
    /// The host's recent holds of its thread ([`Holds`]).
    holds: Holds,
}

/// A pCPU's state for work stealing, away from its IPI word's line: the owner writes
/// the hints as its steps start, and the IPI word is written by every waker.
#[derive(Debug, Default)]
#[repr(C, align(128))]
struct StealShared {
    /// Its stealable units (set as they are placed, cleared as they end).
    stealable: [AtomicU64; WORDS],
    /// Its movable units, stealable ones included (likewise).
    movable: [AtomicU64; WORDS],
    /// Hints for idle pCPUs, published under the table's lock: stealable units left
    /// runnable, and the earliest deadline of an idle stealable one (ns since `epoch`,
    /// `u64::MAX` for none).
    waiting: [AtomicU64; WORDS],
    due: AtomicU64,
    /// The pCPU is running units (its own, or another's as a thief), not idle: written
    /// only as it goes idle and comes back, not at every step, since idle pCPUs read it.
    busy: AtomicBool,
    /// A thief put a unit back idle with a deadline: the pCPU's idle loop, which waits
    /// for the deadlines it knew, looks at its table again.
    retime: AtomicBool,
}

/// A host descriptor a unit waits on: when it has input and the unit armed it, the
/// pCPU wakes the unit as an IPI would.
#[derive(Debug)]
struct LineInner {
    fd: RawFd,
    slot: u16,
    armed: AtomicBool,
}

/// A unit's interrupt line from the host (a TAP's queue): the pCPU looks at it while
/// it spins (at most every [`LINE_LOOK_IDLE`]; [`LINE_LOOK_BUSY`] while its units run)
/// and sleeps on it, and wakes the unit once input waits, if the unit armed it. A line
/// fires once per arming (as `EPOLLONESHOT`): a unit that stops reading (its consumer
/// is full) leaves it unarmed and is not woken over and over by input it will not take.
/// Dropping the line takes it off the pCPU; drop it before closing the descriptor.
#[derive(Debug)]
pub struct IrqLine {
    inner: Arc<LineInner>,
    pcpu: Arc<PcpuShared>,
}

impl IrqLine {
    /// The unit found the descriptor empty: wake it when input comes.
    pub fn arm(&self) {
        self.inner.armed.store(true, Ordering::SeqCst);
    }
}

impl Drop for IrqLine {
    fn drop(&mut self) {
        if let Ok(mut l) = self.pcpu.lines.lock() {
            l.retain(|x| !Arc::ptr_eq(x, &self.inner));
        }
        self.pcpu.lines_at.fetch_add(1, Ordering::SeqCst);
        self.pcpu.ring_doorbell();
    }
}

/// How often a spinning pCPU looks whether another pCPU's device engine waits for it
/// ([`steal`]).
pub const STEAL_LOOK: Duration = Duration::from_micros(2);

/// How often a pCPU spinning within a bound gives its core to any other thread of the
/// host that waits for it (`sched_yield`: one system call, nothing when none waits).
pub const SPIN_YIELD: Duration = Duration::from_micros(20);
/// How often a spinning pCPU looks at its armed lines (a `ppoll` with no timeout):
/// the most an input waits to be seen while the pCPU is idle.
pub const LINE_LOOK_IDLE: Duration = Duration::from_micros(5);
/// How often it looks between its units' steps while they have work.
pub const LINE_LOOK_BUSY: Duration = Duration::from_micros(20);

impl PcpuShared {
    /// Wakes the thread if it sleeps in `ppoll` on its lines.
    fn ring_doorbell(&self) {
        if let Some(d) = self.doorbell.get() {
            d.signal();
        }
    }
}

/// The pCPU thread's copy of its lines, and when it last looked at them.
struct Lines {
    at: u64,
    lines: Vec<Arc<LineInner>>,
    fds: Vec<mem::poll::PollFd>,
    /// Index into `lines` of each line in `fds`, in order (after the doorbell, when
    /// the poll set has it first).
    polled: Vec<usize>,
    last_look: Instant,
}

impl Lines {
    fn new() -> Self {
        Self {
            at: u64::MAX,
            lines: Vec::new(),
            fds: Vec::new(),
            polled: Vec::new(),
            last_look: Instant::now(),
        }
    }

    /// Takes a fresh copy of the pCPU's lines if they changed.
    fn refresh(&mut self, p: &PcpuShared) {
        let at = p.lines_at.load(Ordering::Acquire);
        if at != self.at {
            self.at = at;
            self.lines = p.lines.lock().map(|l| l.clone()).unwrap_or_default();
        }
    }

    /// Whether the pCPU has lines at all (then it sleeps in `ppoll`).
    fn any(&self) -> bool {
        !self.lines.is_empty()
    }

    /// Builds the poll set: the doorbell (if `doorbell`) and every armed line.
    fn build(&mut self, doorbell: Option<RawFd>) {
        self.fds.clear();
        self.polled.clear();
        if let Some(d) = doorbell {
            self.fds.push(mem::poll::PollFd::readable(d));
        }
        for (i, l) in self.lines.iter().enumerate() {
            if l.armed.load(Ordering::Acquire) {
                self.polled.push(i);
                self.fds.push(mem::poll::PollFd::readable(l.fd));
            }
        }
    }

    /// Fires every polled line that is ready: disarmed, its unit's IPI bit set.
    /// Returns how many fired.
    fn fire(&mut self, p: &PcpuShared, first: usize) -> usize {
        let mut n = 0;
        for (k, &i) in self.polled.iter().enumerate() {
            if self.fds[first + k].ready() {
                let l = &self.lines[i];
                if l.armed.swap(false, Ordering::AcqRel) {
                    let s = l.slot as usize;
                    p.ipi[s / 64].fetch_or(1 << (s % 64), Ordering::SeqCst);
                    p.stats.line_fires.fetch_add(1, Ordering::Relaxed);
                    n += 1;
                }
            }
        }
        n
    }

    /// Looks at the armed lines without waiting, at most every `every`.
    fn look(&mut self, p: &PcpuShared, now: Instant, every: Duration) -> usize {
        if self.lines.is_empty() || now.duration_since(self.last_look) < every {
            return 0;
        }
        self.last_look = now;
        self.build(None);
        if self.fds.is_empty() {
            return 0;
        }
        match mem::poll::wait(&mut self.fds, Some(Duration::ZERO)) {
            Ok(n) if n > 0 => self.fire(p, 0),
            _ => 0,
        }
    }
}

impl std::fmt::Debug for PcpuShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pcpu")
            .field("index", &self.index)
            .field("core", &self.core)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// What wakes one unit: its bit in its pCPU's IPI word.
#[derive(Debug, Clone)]
pub struct Waker {
    pcpu: Arc<PcpuShared>,
    slot: u16,
}

impl Waker {
    /// `vcpu_wake` and the IPI: marks the unit runnable and, if its pCPU sleeps in the
    /// host, wakes it. Call after publishing the work (the store that the unit will read
    /// must come first): the pCPU takes the word before it runs the unit.
    #[inline]
    pub fn wake(&self) {
        let p = &*self.pcpu;
        let (w, b) = (self.slot as usize / 64, self.slot % 64);
        if p.steal.stealable[w].load(Ordering::Relaxed) & (1 << b) != 0 {
            // A device's engine: when it was woken, for its wait to run (a clock read
            // in user space; a vCPU's wake-up does not pay it).
            let at = p.epoch.elapsed().as_nanos() as u64 | 1;
            let _ = p.woke_ns[self.slot as usize].compare_exchange(
                0,
                at,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        p.ipi[w].fetch_or(1 << b, Ordering::SeqCst);
        // Pairs with the idle loop's store of `sleeping` and its look at the word.
        if p.sleeping.load(Ordering::SeqCst) {
            p.stats.host_wakes.fetch_add(1, Ordering::Relaxed);
            wake_thread(p);
        }
    }

    /// The pCPU the unit runs on.
    pub fn pcpu(&self) -> usize {
        self.pcpu.index
    }

    /// Makes host descriptor `fd` an interrupt line of this unit ([`IrqLine`]), not
    /// yet armed.
    pub fn irq_line(&self, fd: RawFd) -> std::io::Result<IrqLine> {
        let p = &self.pcpu;
        if p.doorbell.get().is_none() {
            let _ = p.doorbell.set(mem::poll::EventFd::new()?);
        }
        let inner = Arc::new(LineInner {
            fd,
            slot: self.slot,
            armed: AtomicBool::new(false),
        });
        lock(&p.lines).push(Arc::clone(&inner));
        p.lines_at.fetch_add(1, Ordering::SeqCst);
        p.ring_doorbell();
        Ok(IrqLine {
            inner,
            pcpu: Arc::clone(p),
        })
    }
}

/// What one step of a placed unit came to.
enum StepOut {
    More,
    /// More, its weighted turn cut short after a step because a device's engine of the
    /// pCPU running it was woken ([`run_unit`]).
    Cut,
    Yield,
    Idle(Option<Instant>),
    Ended,
}

/// The object-safe side of a placed unit and its result slot.
trait Erased: Send {
    fn samples(&self) -> Option<Arc<SampleSlot>>;
    fn step(&mut self, cx: &Cx) -> StepOut;
    fn fail(&mut self, why: String);
    /// Answers the join with the result the last step gave (after the pCPU has let the
    /// unit go, so that a joiner finds its slot free).
    fn finish(&mut self);
    fn stats(&self) -> &Arc<UnitStats>;
    fn spec(&self) -> &UnitSpec;
}

struct Placed<U: Unit> {
    unit: U,
    spec: UnitSpec,
    stats: Arc<UnitStats>,
    done: Arc<Done<U::Output>>,
    output: Option<U::Output>,
}

impl<U: Unit> Erased for Placed<U> {
    fn samples(&self) -> Option<Arc<SampleSlot>> {
        self.unit.samples()
    }
    fn step(&mut self, cx: &Cx) -> StepOut {
        match self.unit.step(cx) {
            Step::More => StepOut::More,
            Step::Yield => StepOut::Yield,
            Step::Idle(d) => StepOut::Idle(d),
            Step::Done(o) => {
                self.output = Some(o);
                StepOut::Ended
            }
        }
    }
    fn fail(&mut self, why: String) {
        self.done.put(Err(why));
    }
    fn finish(&mut self) {
        if let Some(o) = self.output.take() {
            self.done.put(Ok(o));
        }
    }
    fn stats(&self) -> &Arc<UnitStats> {
        &self.stats
    }
    fn spec(&self) -> &UnitSpec {
        &self.spec
    }
}

/// A unit's result, once it ends.
struct Done<O> {
    result: Mutex<Option<Result<O, String>>>,
    finished: AtomicBool,
    cv: Condvar,
}

impl<O> Done<O> {
    fn put(&self, r: Result<O, String>) {
        if let Ok(mut g) = self.result.lock() {
            if g.is_none() && !self.finished.load(Ordering::Acquire) {
                *g = Some(r);
            }
        }
        self.finished.store(true, Ordering::Release);
        self.cv.notify_all();
    }
}

/// A placed unit: its wake-up, its accounting, and its result once it ends.
pub struct UnitJoin<O> {
    done: Arc<Done<O>>,
    stats: Arc<UnitStats>,
    waker: Waker,
}

impl<O> std::fmt::Debug for UnitJoin<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitJoin")
            .field("unit", &self.stats.name)
            .field("pcpu", &self.waker.pcpu.index)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl<O> UnitJoin<O> {
    /// Whether the unit has ended (done, panicked or abandoned).
    pub fn is_finished(&self) -> bool {
        self.done.finished.load(Ordering::Acquire)
    }
    /// Waits for the unit to end: its result, or why it has none (it panicked, or its
    /// scheduler stopped first).
    pub fn join(self) -> Result<O, String> {
        let mut g = self
            .done
            .result
            .lock()
            .map_err(|_| "result lock poisoned".to_string())?;
        while g.is_none() {
            g = self
                .done
                .cv
                .wait(g)
                .map_err(|_| "result lock poisoned".to_string())?;
        }
        g.take().unwrap_or_else(|| Err("no result".into()))
    }
    /// Wakes the unit (to have it notice a stop flag, say).
    pub fn wake(&self) {
        self.waker.wake();
    }
    /// What wakes it.
    pub fn waker(&self) -> &Waker {
        &self.waker
    }
    /// Its accounting.
    pub fn stats(&self) -> &Arc<UnitStats> {
        &self.stats
    }
}

/// Why a unit cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// No such pCPU.
    #[error("no pCPU {0}")]
    NoPcpu(usize),
    /// The pCPU holds [`MAX_UNITS`] units already.
    #[error("pCPU {0} is full")]
    Full(usize),
    /// The scheduler is stopping.
    #[error("the scheduler has stopped")]
    Stopped,
}

/// Where a machine's pCPUs are and how they idle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuPlan {
    /// The host core of each pCPU (none: the pCPU floats).
    pub cores: Vec<Option<usize>>,
    /// How idle pCPUs wait.
    pub policy: IdlePolicy,
    /// pCPUs that wait their own way, by index, in place of `policy`: a device's cores
    /// that poll while the guests' cores halt-poll, or sleep at once where the rest poll
    /// (dynamic core partitioning).
    pub own_policy: Vec<(usize, IdlePolicy)>,
}

impl CpuPlan {
    /// `n` pCPUs on cores 0..n, each pinned if the host has the core.
    pub fn first(n: usize, policy: IdlePolicy) -> Self {
        let online = mem::cpu::online_cores();
        Self {
            cores: (0..n).map(|c| (c < online).then_some(c)).collect(),
            policy,
            own_policy: Vec::new(),
        }
    }

    /// `n` pCPUs pinned to no core (the host places their threads), as a test or a tool
    /// that shares the machine wants them.
    pub fn floating(n: usize, policy: IdlePolicy) -> Self {
        Self {
            cores: vec![None; n],
            policy,
            own_policy: Vec::new(),
        }
    }

    /// How pCPU `i` waits.
    pub fn policy_of(&self, i: usize) -> IdlePolicy {
        self.own_policy
            .iter()
            .rev()
            .find(|(p, _)| *p == i)
            .map_or(self.policy, |(_, policy)| *policy)
    }
}

/// A set of pCPUs and the units on them.
#[derive(Debug)]
pub struct Scheduler {
    pcpus: Vec<Arc<PcpuShared>>,
    /// The same, for each pCPU's thread to steal from.
    peers: Arc<Vec<Arc<PcpuShared>>>,
    threads: Mutex<Vec<(usize, JoinHandle<()>)>>,
    policy: IdlePolicy,
    /// Wait windows begun ([`Scheduler::mark_waits`]), shared with every unit's stats.
    waits_window: Arc<AtomicU64>,
}

/// A pCPU's samples when no unit runs (its idle loop and the scheduler itself).
fn idle_slot() -> Arc<SampleSlot> {
    Arc::new(SampleSlot::default())
}

impl Scheduler {
    /// Starts one pinned pCPU thread per core of `plan`; with `sample`, each samples
    /// its CPU time at that interval for the profiler (charged to the unit running).
    pub fn new(plan: &CpuPlan, sample: Option<Duration>) -> std::io::Result<Arc<Self>> {
        let now = Instant::now();
        let pcpus: Vec<Arc<PcpuShared>> = plan
            .cores
            .iter()
            .enumerate()
            .map(|(index, &core)| {
                Arc::new(PcpuShared {
                    index,
                    core,
                    policy: plan.policy_of(index),
                    poll_window_ns: AtomicU64::new(0),
                    sample,
                    name: format!("pcpu{index}"),
                    ipi: std::array::from_fn(|_| AtomicU64::new(0)),
                    sleeping: AtomicBool::new(false),
                    rung_ns: AtomicU64::new(0),
                    thread: Mutex::new(None),
                    stop: AtomicBool::new(false),
                    step_since: AtomicU64::new(0),
                    turn_ns: AtomicU64::new(0),
                    epoch: now,
                    table: Mutex::new(Table {
                        generation: 0,
                        units: (0..MAX_UNITS).map(|_| None).collect(),
                        held: [0; WORDS],
                        live: 0,
                        runnable: [0; WORDS],
                        idle: [0; WORDS],
                        timed: [0; WORDS],
                        deadline: vec![None; MAX_UNITS],
                        woken: vec![None; MAX_UNITS],
                        stepped: vec![None; MAX_UNITS],
                        period_ns: vec![0; MAX_UNITS],
                        period_start: now,
                        over_cap: [0; WORDS],
                        away: [0; WORDS],
                    }),
                    stats: PcpuStats::default(),
                    own: idle_slot(),
                    window_start: Mutex::new((now, Duration::ZERO, Duration::ZERO)),
                    tid: AtomicI32::new(0),
                    lines: Mutex::new(Vec::new()),
                    lines_at: AtomicU64::new(0),
                    doorbell: OnceLock::new(),
                    steal: StealShared {
                        due: AtomicU64::new(u64::MAX),
                        ..StealShared::default()
                    },
                    woke_ns: (0..MAX_UNITS).map(|_| AtomicU64::new(0)).collect(),
                    holds: Holds::default(),
                })
            })
            .collect();
        let s = Arc::new(Self {
            peers: Arc::new(pcpus.clone()),
            pcpus,
            threads: Mutex::new(Vec::new()),
            policy: plan.policy,
            waits_window: Arc::default(),
        });
        for p in &s.pcpus {
            s.spawn(p, 0)?;
        }
        Ok(s)
    }

    fn spawn(&self, p: &Arc<PcpuShared>, generation: u64) -> std::io::Result<()> {
        let q = Arc::clone(p);
        let peers = Arc::clone(&self.peers);
        let h = std::thread::Builder::new()
            .name(p.name.clone())
            .spawn(move || pcpu_main(&q, &peers, generation))?;
        if let Ok(mut t) = self.threads.lock() {
            t.push((p.index, h));
        }
        Ok(())
    }

    /// Number of pCPUs.
    pub fn pcpus(&self) -> usize {
        self.pcpus.len()
    }

    /// How its pCPUs idle (those with a policy of their own aside: [`Self::policy_of`]).
    pub fn policy(&self) -> IdlePolicy {
        self.policy
    }

    /// How pCPU `i` idles.
    pub fn policy_of(&self, i: usize) -> IdlePolicy {
        self.pcpus.get(i).map_or(self.policy, |p| p.policy)
    }

    /// The core pCPU `i` is pinned to.
    pub fn core(&self, i: usize) -> Option<usize> {
        self.pcpus.get(i).and_then(|p| p.core)
    }

    /// Places `unit` on pCPU `pcpu` (an index past the last wraps around, so that a
    /// layout written for more pCPUs still runs, sharing them). It is attached at once
    /// and runs its first step on its pCPU.
    pub fn place<U: Unit>(
        &self,
        pcpu: usize,
        spec: UnitSpec,
        mut unit: U,
    ) -> Result<UnitJoin<U::Output>, SchedError> {
        if self.pcpus.is_empty() {
            return Err(SchedError::NoPcpu(pcpu));
        }
        let p = &self.pcpus[pcpu % self.pcpus.len()];
        if p.stop.load(Ordering::Acquire) {
            return Err(SchedError::Stopped);
        }
        let mut t = lock(&p.table);
        let slot = (0..MAX_UNITS)
            .find(|&i| t.held[i / 64] & (1 << (i % 64)) == 0)
            .ok_or(SchedError::Full(p.index))?;
        let waker = Waker {
            pcpu: Arc::clone(p),
            slot: slot as u16,
        };
        let window = Arc::clone(&self.waits_window);
        let stats = Arc::new(UnitStats {
            name: spec.name.clone(),
            counted: AtomicU64::new(window.load(Ordering::Relaxed)),
            window,
            ..UnitStats::default()
        });
        unit.attach(&waker, &stats);
        let (stealable, movable) = (spec.stealable, spec.stealable || spec.movable);
        let done = Arc::new(Done {
            result: Mutex::new(None),
            finished: AtomicBool::new(false),
            cv: Condvar::new(),
        });
        t.units[slot] = Some(Box::new(Placed {
            unit,
            spec,
            stats: Arc::clone(&stats),
            done: Arc::clone(&done),
            output: None,
        }));
        t.held[slot / 64] |= 1 << (slot % 64);
        t.live += 1;
        if stealable {
            p.steal.stealable[slot / 64].fetch_or(1 << (slot % 64), Ordering::SeqCst);
        }
        if movable {
            p.steal.movable[slot / 64].fetch_or(1 << (slot % 64), Ordering::SeqCst);
        }
        drop(t);
        waker.wake();
        Ok(UnitJoin { done, stats, waker })
    }
}

impl Scheduler {
    /// Replaces the thread of every pCPU whose current step has run longer than `limit`
    /// (a hung kernel): the retired thread finishes its step whenever it returns and
    /// hands the unit back; a fresh thread on the same core runs the pCPU's other units
    /// from now on. Returns how many pCPUs were rescued.
    pub fn rescue(&self, limit: Duration) -> usize {
        let mut n = 0;
        for p in &self.pcpus {
            let since = p.step_since.load(Ordering::Acquire);
            if since == 0 || p.stop.load(Ordering::Acquire) {
                continue;
            }
            let now = p.epoch.elapsed().as_nanos() as u64;
            if now.saturating_sub(since) < limit.as_nanos() as u64 {
                continue;
            }
            let generation = {
                let mut t = lock(&p.table);
                t.generation += 1;
                t.generation
            };
            p.step_since.store(0, Ordering::Release);
            p.stats.rescues.fetch_add(1, Ordering::Relaxed);
            if self.spawn(p, generation).is_ok() {
                n += 1;
            }
        }
        n
    }

    /// Every unit's waits to run count from now (a measured window, after a machine's
    /// start and warm-up): each unit's wait histograms and longest waits restart, as
    /// the unit next waits; a report before then shows none. Its other accounting
    /// (CPU, steps) goes on.
    pub fn mark_waits(&self) {
        self.waits_window.fetch_add(1, Ordering::Relaxed);
    }

    /// Zeroes every pCPU's and starts a new accounting window (units keep theirs).
    pub fn reset_stats(&self) {
        for p in &self.pcpus {
            let s = &p.stats;
            for a in [
                &s.busy_ns,
                &s.idle_ns,
                &s.slept_ns,
                &s.sleeps,
                &s.host_wakes,
                &s.rung_wakes,
                &s.rung_wake_ns,
                &s.longest_rung_wake_ns,
                &s.timer_wakes,
                &s.timer_late_ns,
                &s.longest_timer_late_ns,
                &s.ipis,
                &s.longest_step_ns,
                &s.line_fires,
                &s.longest_away_ns,
                &s.covered,
            ] {
                a.store(0, Ordering::Relaxed);
            }
            let cpu = Duration::from_nanos(s.cpu_ns.load(Ordering::Relaxed));
            let queued = run_delay(p);
            if let Ok(mut w) = p.window_start.lock() {
                *w = (Instant::now(), cpu, queued);
            }
        }
    }

    /// The host's holds of the pCPUs' threads of [`HOLD_LOGGED`] or longer, as the
    /// threads saw them, since the scheduler started (the newest few hundred of each
    /// pCPU's), oldest first by pCPU: what a device's losses are laid beside.
    pub fn host_holds(&self) -> Vec<HostHold> {
        self.pcpus
            .iter()
            .flat_map(|p| p.holds.logged(p.index, p.epoch))
            .collect()
    }

    /// Each pCPU's accounting since the last reset.
    pub fn reports(&self) -> Vec<PcpuReport> {
        self.pcpus
            .iter()
            .map(|p| {
                let s = &p.stats;
                let d = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
                let (t0, cpu0, queued0) = p.window_start.lock().map(|w| *w).unwrap_or((
                    Instant::now(),
                    Duration::ZERO,
                    Duration::ZERO,
                ));
                let window = t0.elapsed();
                // The thread's CPU clock as the thread last published it (it reads its
                // own clock when it goes idle: a clock read is a system call, kept off
                // the step path).
                let cpu = d(&s.cpu_ns).saturating_sub(cpu0);
                let slept = d(&s.slept_ns);
                PcpuReport {
                    index: p.index,
                    core: p.core,
                    busy: d(&s.busy_ns),
                    idle: d(&s.idle_ns),
                    slept,
                    sleeps: s.sleeps.load(Ordering::Relaxed),
                    host_wakes: s.host_wakes.load(Ordering::Relaxed),
                    rung_wakes: s.rung_wakes.load(Ordering::Relaxed),
                    rung_wake: d(&s.rung_wake_ns),
                    longest_rung_wake: d(&s.longest_rung_wake_ns),
                    timer_wakes: s.timer_wakes.load(Ordering::Relaxed),
                    timer_late: d(&s.timer_late_ns),
                    longest_timer_late: d(&s.longest_timer_late_ns),
                    ipis: s.ipis.load(Ordering::Relaxed),
                    stolen: window.saturating_sub(cpu + slept),
                    window,
                    longest_step: d(&s.longest_step_ns),
                    rescues: s.rescues.load(Ordering::Relaxed),
                    line_fires: s.line_fires.load(Ordering::Relaxed),
                    longest_away: d(&s.longest_away_ns),
                    host_queued: run_delay(p).saturating_sub(queued0),
                    covered: s.covered.load(Ordering::Relaxed),
                    cpu,
                    samples: p.own.counts().iter().sum(),
                }
            })
            .collect()
    }

    /// Every unit placed and not yet ended, with its pCPU's index: its accounting as it
    /// stands (a unit out in a step at the moment is left out).
    pub fn unit_reports(&self) -> Vec<(usize, UnitReport)> {
        let mut stats = Vec::new();
        for p in &self.pcpus {
            // Only the stats are taken under the table's lock, which the pCPU and its
            // thieves take between steps: a report is built (and allocates) without it.
            let t = lock(&p.table);
            stats.extend(
                t.units
                    .iter()
                    .flatten()
                    .map(|u| (p.index, Arc::clone(u.stats()))),
            );
        }
        stats.into_iter().map(|(i, s)| (i, s.report())).collect()
    }

    /// Stops every pCPU: each runs its units until they end (their owners stop them
    /// first), for at most `grace`; units left then are dropped, their joins answered
    /// with an error. A thread held by a hung step is left to end on its own.
    pub fn stop(&self, grace: Duration) {
        for p in &self.pcpus {
            p.stop.store(true, Ordering::Release);
            wake_thread(p);
        }
        let t0 = Instant::now();
        while t0.elapsed() < grace && self.pcpus.iter().any(|p| lock(&p.table).live > 0) {
            std::thread::sleep(Duration::from_millis(1));
        }
        for p in &self.pcpus {
            let mut t = lock(&p.table);
            for u in t.units.iter_mut().filter_map(Option::take) {
                let mut u = u;
                u.fail("the scheduler stopped before the unit ended".into());
            }
            t.live = 0;
            t.generation += 1;
            drop(t);
            wake_thread(p);
        }
        let threads = self
            .threads
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        for (i, h) in threads {
            let p = &self.pcpus[i];
            // A thread out in a hung step cannot be joined; it exits when the step ends.
            if h.is_finished() || p.step_since.load(Ordering::Acquire) == 0 {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(2));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A pCPU thread's host run-queue wait so far (zero before it runs, or where the host
/// does not say).
fn run_delay(p: &PcpuShared) -> Duration {
    match p.tid.load(Ordering::Acquire) {
        0 => Duration::ZERO,
        tid => mem::cpu::thread_run_delay(tid).unwrap_or_default(),
    }
}

/// Wakes a pCPU asleep in the host: when it was first rung is kept (a clock read, on
/// a path that makes a system call anyway), so that the time the host takes to run
/// its thread again counts as the host's hold of it ([`idle_sleep`]). A pCPU with
/// lines sleeps in `ppoll` on its doorbell, one without in `park`; which one is
/// decided as it goes to sleep, so both are rung.
fn wake_thread(p: &PcpuShared) {
    let at = p.epoch.elapsed().as_nanos() as u64 | 1;
    let _ = p
        .rung_ns
        .compare_exchange(0, at, Ordering::AcqRel, Ordering::Relaxed);
    p.ring_doorbell();
    if let Ok(t) = p.thread.lock() {
        if let Some(t) = t.as_ref() {
            t.unpark();
        }
    }
}

fn any_ipi(p: &PcpuShared, order: Ordering) -> bool {
    p.ipi.iter().any(|w| w.load(order) != 0)
}

impl Table {
    /// The first runnable unit at or after `from` (wrapping), not past its cap: a few
    /// word operations, whatever the number of slots.
    /// A device's engine of `p` woken since its last step and runnable here: picked
    /// ahead of the round (hardware does not wait for a CPU's turn to come round).
    fn woken_device(&self, p: &PcpuShared) -> Option<usize> {
        (0..WORDS).find_map(|w| {
            let mut bits = self.runnable[w]
                & !self.over_cap[w]
                & !self.away[w]
                & p.steal.stealable[w].load(Ordering::Relaxed);
            while bits != 0 {
                let i = w * 64 + bits.trailing_zeros() as usize;
                if self.woken[i].is_some() && self.units[i].is_some() {
                    return Some(i);
                }
                bits &= bits - 1;
            }
            None
        })
    }

    fn next_runnable(&self, from: usize) -> Option<usize> {
        let from = from % MAX_UNITS;
        let (w0, b0) = (from / 64, from % 64);
        for k in 0..=WORDS {
            let w = (w0 + k) % WORDS;
            let mut bits = self.runnable[w] & !self.over_cap[w] & !self.away[w];
            if k == 0 {
                bits &= !0u64 << b0;
            } else if k == WORDS {
                bits &= (1u64 << b0) - 1;
            }
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
        }
        None
    }

    /// Unit `i`, whose step ended at `ended`, idles until `d`. A deadline already past
    /// as the step ended (a device behind its schedule: its timer was due while it ran
    /// or before) makes it runnable at once, and its wait to run counts from the step's
    /// end, not from the deadline: it could not have waited while it was running.
    fn idle_after_step(&mut self, i: usize, d: Option<Instant>, ended: Instant) {
        self.idle[i / 64] |= 1 << (i % 64);
        self.stepped[i] = Some(ended);
        self.set_deadline(i, d.map(|d| d.max(ended)));
    }

    /// Sets (or clears) unit `i`'s deadline.
    fn set_deadline(&mut self, i: usize, d: Option<Instant>) {
        self.deadline[i] = d;
        match d {
            Some(_) => self.timed[i / 64] |= 1 << (i % 64),
            None => self.timed[i / 64] &= !(1 << (i % 64)),
        }
    }

    /// The units with a deadline.
    fn timed_units(&self) -> impl Iterator<Item = usize> + '_ {
        (0..WORDS).flat_map(move |w| {
            let mut bits = self.timed[w];
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let b = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    w * 64 + b
                })
            })
        })
    }

    fn earliest_deadline(&self) -> Option<Instant> {
        self.timed_units().filter_map(|i| self.deadline[i]).min()
    }

    /// Takes the IPI word: units woken since the last look become runnable (an idle one
    /// loses its deadline and is stamped woken at `now`). The IPIs are counted here, by
    /// the pCPU, not by each waker on a line they share.
    /// `clear`: when the pCPU's idle loop last found the IPI word empty, if it comes
    /// from there ([`woken_at`]).
    #[inline]
    fn take_ipis(&mut self, p: &PcpuShared, now: Instant, clear: Option<Instant>) {
        for w in 0..WORDS {
            if p.ipi[w].load(Ordering::Relaxed) == 0 {
                continue;
            }
            let bits = p.ipi[w].swap(0, Ordering::SeqCst);
            // Its own takes, counted for peers watching whether it runs at all (a
            // thief's take of a unit's wake-up does not count).
            add(&p.stats.took, 1);
            self.wake_units(p, w, bits, now, clear);
        }
    }

    /// Units `bits` of word `w`, taken from the IPI word, become runnable.
    #[inline]
    fn wake_units(
        &mut self,
        p: &PcpuShared,
        w: usize,
        mut bits: u64,
        now: Instant,
        clear: Option<Instant>,
    ) {
        self.runnable[w] |= bits;
        p.stats
            .ipis
            .fetch_add(u64::from(bits.count_ones()), Ordering::Relaxed);
        while bits != 0 {
            let i = w * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            // A stealable unit's waker stamped the wake-up (its wait counts from
            // there, not from when a pCPU got to look).
            let stamped = match p.woke_ns[i].load(Ordering::Acquire) {
                0 => 0,
                _ => p.woke_ns[i].swap(0, Ordering::AcqRel),
            };
            let stamped = (stamped != 0).then(|| p.epoch + Duration::from_nanos(stamped));
            let at = woken_at(stamped, now, clear);
            if self.idle[w] & (1 << (i % 64)) != 0 {
                self.idle[w] &= !(1 << (i % 64));
                self.set_deadline(i, None);
                self.woken[i] = Some(after_step(at, self.stepped[i].take()));
            } else if self.away[w] & (1 << (i % 64)) != 0 && self.woken[i].is_none() {
                // Woken while a thief runs it: it runs again as it comes back, and its
                // wait counts from this wake-up, as it would on its own pCPU.
                self.woken[i] = Some(at);
            }
        }
    }

    /// Makes runnable every idle unit whose deadline has passed, stamped woken at its
    /// deadline.
    #[inline]
    fn expire_deadlines(&mut self, now: Instant) {
        if self.earliest_deadline().is_none_or(|d| d > now) {
            return;
        }
        self.expire_deadlines_of(now, [u64::MAX; WORDS]);
    }

    /// As [`Self::expire_deadlines`], for the units in `mask` only.
    fn expire_deadlines_of(&mut self, now: Instant, mask: [u64; WORDS]) {
        let timed = self.timed;
        for (w, bits) in timed.into_iter().enumerate() {
            let mut bits = bits & mask[w];
            while bits != 0 {
                let i = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let Some(d) = self.deadline[i].filter(|&d| d <= now) {
                    self.set_deadline(i, None);
                    self.idle[i / 64] &= !(1 << (i % 64));
                    self.runnable[i / 64] |= 1 << (i % 64);
                    self.woken[i] = Some(d);
                }
            }
        }
    }

    /// A new cap period lets every unit run again.
    #[inline]
    fn new_cap_period(&mut self, now: Instant) {
        if now.duration_since(self.period_start) >= CAP_PERIOD {
            self.period_start = now;
            self.period_ns.iter_mut().for_each(|n| *n = 0);
            self.over_cap = [0; WORDS];
        }
    }

    /// How long an idle pCPU may wait: to the earliest deadline, or to the end of the
    /// cap period if a unit waits for it.
    #[inline]
    fn idle_until(&self) -> Option<Instant> {
        if self.over_cap.iter().any(|&w| w != 0) {
            let end = self.period_start + CAP_PERIOD;
            Some(self.earliest_deadline().map_or(end, |d| d.min(end)))
        } else {
            self.earliest_deadline()
        }
    }

    /// Charges unit `i`'s `ran` ns to its cap (Xen credit's cap: a percentage of each
    /// period), passing it over until the next period once it reaches it.
    #[inline]
    fn charge_cap(&mut self, i: usize, e: &dyn Erased, ran: u64) {
        let cap = e.spec().cap_percent;
        if cap > 0 && cap < 100 {
            self.period_ns[i] += ran;
            let allowed = CAP_PERIOD.as_nanos() as u64 * cap as u64 / 100;
            if self.period_ns[i] >= allowed {
                self.over_cap[i / 64] |= 1 << (i % 64);
                e.stats().capped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Publishes the hints idle pCPUs steal by: the stealable units left runnable, and
    /// the earliest deadline of an idle one.
    fn publish_steal_hints(&self, p: &PcpuShared) {
        let s = &p.steal;
        let mut due = u64::MAX;
        let mut any = false;
        for w in 0..WORDS {
            let mine = s.stealable[w].load(Ordering::Relaxed);
            if mine == 0 {
                continue;
            }
            any = true;
            let waiting = self.runnable[w] & self.present(w, mine);
            // Stored only when it changes: the owner's steps must not keep the line
            // moving for nothing.
            if s.waiting[w].load(Ordering::Relaxed) != waiting {
                s.waiting[w].store(waiting, Ordering::Release);
            }
            let mut timed = self.timed[w] & mine & !self.away[w];
            while timed != 0 {
                let i = w * 64 + timed.trailing_zeros() as usize;
                timed &= timed - 1;
                if let Some(d) = self.deadline[i] {
                    due = due.min(d.saturating_duration_since(p.epoch).as_nanos() as u64);
                }
            }
        }
        if (any || due != u64::MAX) && s.due.load(Ordering::Relaxed) != due {
            s.due.store(due, Ordering::Release);
        }
    }

    /// Of units `mask` of word `w`, those in the table now (not out in a step on its own
    /// pCPU's thread or a thief's).
    fn present(&self, w: usize, mask: u64) -> u64 {
        let mut bits = mask & !self.away[w];
        let mut out = 0;
        while bits != 0 {
            let b = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if self.units[w * 64 + b].is_some() {
                out |= 1 << b;
            }
        }
        out
    }

    /// Unit `i` ended: its slot is free and it is neither idle nor timed.
    #[inline]
    fn end(&mut self, p: &PcpuShared, i: usize) {
        p.steal.stealable[i / 64].fetch_and(!(1 << (i % 64)), Ordering::SeqCst);
        p.steal.movable[i / 64].fetch_and(!(1 << (i % 64)), Ordering::SeqCst);
        self.held[i / 64] &= !(1 << (i % 64));
        self.live -= 1;
        self.set_deadline(i, None);
        self.idle[i / 64] &= !(1 << (i % 64));
        self.woken[i] = None;
        self.stepped[i] = None;
    }

    /// Unit `i`'s step ended at `ended` saying it is idle, but a wake-up came while it
    /// ran and left it runnable: it waits to run from the step's end (a wait from
    /// before then would count its own step).
    fn woken_in_step(&mut self, i: usize, ended: Instant) {
        self.woken[i] = Some(after_step(self.woken[i].unwrap_or(ended), Some(ended)));
    }
}

/// When a unit woken at `at` began to wait to run, if its last step ended at
/// `stepped`: not before that end. A wake-up stamped earlier came while the unit was
/// being picked or ran (its waker saw it dozing before its step began), and that step
/// may well have served it; either way the unit ran meanwhile, and did not wait.
#[inline]
fn after_step(at: Instant, stepped: Option<Instant>) -> Instant {
    stepped.map_or(at, |e| at.max(e))
}

/// The pCPU thread's own CPU clock, published into its `cpu_ns` stat for reports taken
/// while it runs, and the start of the host's holds measured by it. A read is a
/// system call, which the way into the idle loop (and so a wake-up's latency) must not
/// pay each time: between steps it is read at most every [`CLOCK_READ`].
struct CpuClock {
    clock: Option<ThreadClock>,
    /// The thread's wait on the host's run queue, read around its sleeps: a wake-up
    /// the host did not run at once (another thread had the core) is the host's hold.
    delay: Option<RunDelay>,
    /// What the pCPU's threads before this one (retired by rescues) used.
    base: Duration,
    published: Instant,
}

impl CpuClock {
    fn new(p: &PcpuShared) -> Self {
        Self {
            clock: ThreadClock::current().ok(),
            delay: RunDelay::current().ok(),
            base: Duration::from_nanos(p.stats.cpu_ns.load(Ordering::Relaxed)),
            published: Instant::now(),
        }
    }

    /// Publishes the clock now.
    fn publish(&self, p: &PcpuShared) {
        if let Some(c) = self.clock.and_then(|c| c.read()) {
            p.stats
                .cpu_ns
                .store((self.base + c).as_nanos() as u64, Ordering::Relaxed);
            p.holds
                .clock_read(p.epoch.elapsed().as_nanos() as u64, c.as_nanos() as u64);
        }
    }

    /// Publishes the clock if [`CLOCK_READ`] has passed since it last did.
    #[inline]
    fn publish_now_and_then(&mut self, p: &PcpuShared, now: Instant) {
        if now.saturating_duration_since(self.published) >= CLOCK_READ {
            self.published = now;
            self.publish(p);
        }
    }
}

/// The pCPU thread's start: pinned to its core (best effort: a core the host lacks
/// leaves it floating, as the machine's record says), a fine timer slack, and its ids
/// published for wakers and reports.
fn pcpu_enter(p: &PcpuShared) {
    if let Some(c) = p.core {
        let _ = pin_current_thread(c);
    }
    let _ = mem::cpu::set_timer_slack(1_000);
    p.tid.store(mem::cpu::current_tid(), Ordering::Release);
    if let Ok(mut t) = p.thread.lock() {
        *t = Some(std::thread::current());
    }
}

/// The profiler's sampler on this pCPU's thread, bound to the pCPU's own slot until a
/// unit runs. The perf task clock's precise timer (where the kernel offers it) samples
/// each period as it ends; the POSIX CPU timer is checked on scheduler ticks and charges
/// several periods at once to whichever unit runs at the tick, which on a pCPU shared by
/// units is a strong bias. Its cost per host context switch falls only on sleeps.
fn bind_sampler(p: &PcpuShared) -> Option<SlotBinding> {
    let sampler = mem::cpu::Sampler::PerfTaskClock;
    SlotBinding::bind_with(Arc::clone(&p.own), p.sample, sampler).ok()
}

/// The pCPU's thread: pin, then run units until stopped (or retired by a rescue). Each
/// turn takes the host's input and the IPI word, wakes units whose deadline passed,
/// picks the next runnable unit (or idles), runs it for its weight in steps, and puts
/// it back as its last step said.
fn pcpu_main(p: &Arc<PcpuShared>, all: &[Arc<PcpuShared>], generation: u64) {
    pcpu_enter(p);
    let mut cpu = CpuClock::new(p);
    // The first read, from which the host's first holds are measured.
    cpu.publish(p);
    let mut binding = bind_sampler(p);
    let mut cursor = 0usize;
    // The last pick was a device's engine ahead of the round.
    let mut ahead = false;
    // Steps in a row that only yielded.
    let mut yields = 0usize;
    let mut lines = Lines::new();
    let mut peers = steal::Peers::new(all);
    let mut t = lock(&p.table);
    // When the thread last had its core outside a unit's step: the way from there to
    // the next pick (or to the idle loop) is a few hundred ns of its own, so a longer
    // gap is the host's.
    let mut mark = Instant::now();
    // When the idle loop it just left last found the IPI word empty.
    let mut clear = None;
    loop {
        if t.generation != generation {
            return;
        }
        let now = Instant::now();
        p.turn_ns.store(
            now.saturating_duration_since(p.epoch).as_nanos() as u64 | 1,
            Ordering::Release,
        );
        // Input on the host's lines, looked at now and then between steps.
        lines.refresh(p);
        lines.look(p, now, LINE_LOOK_BUSY);
        t.take_ipis(p, now, clear.take());
        t.expire_deadlines(now);
        t.new_cap_period(now);
        // A device's engine woken since its last step goes first, but never twice in a
        // row out of the round: an engine woken again and again cannot keep a vCPU off
        // its pCPU, which runs one step of the round between two such picks.
        let first = (!ahead).then(|| t.woken_device(p)).flatten();
        ahead = first.is_some();
        let pick = first
            .or_else(|| t.next_runnable(cursor))
            .filter(|&i| t.units[i].is_some());
        let Some(i) = pick else {
            // A runnable bit whose unit is away (in a retired thread's step) waits.
            if let Some(i) = t.next_runnable(cursor) {
                if t.units[i].is_none() {
                    t.runnable[i / 64] &= !(1 << (i % 64));
                }
                continue;
            }
            if p.stop.load(Ordering::Acquire) && t.live == 0 {
                p.turn_ns.store(0, Ordering::Release);
                cpu.publish(p);
                return;
            }
            let until = t.idle_until();
            // The hints as it goes idle: a device's deadline it set after its step's
            // start is what peers watch for while it idles (a past one says it is held).
            t.publish_steal_hints(p);
            let left = Instant::now();
            between(p, mark, left);
            p.turn_ns.store(0, Ordering::Release);
            drop(t);
            // Nothing of its own to run: a device's engine another pCPU's step keeps
            // waiting, if there is one.
            let stole = (!p.stop.load(Ordering::Relaxed))
                .then(|| steal::try_steal(p, &mut peers, &mut binding))
                .flatten();
            if let Some(end) = stole {
                mark = end;
                cpu.publish_now_and_then(p, Instant::now());
                t = lock(&p.table);
                continue;
            }
            #[cfg(test)]
            tests::pause_before_idle(p);
            cpu.publish_now_and_then(p, now);
            // The way from its turn to the idle loop's first look (a look at its peers
            // that found nothing to take, a clock read now and then) is a few µs with
            // its core, and no look of the idle loop measures it: a longer gap is the
            // host's, in which this pCPU could have taken a peer's device and did not
            // (a VM's hypervisor pauses every vCPU at once, and a thread's clock counts
            // the pause: this gap is then what shows it, the peer's step does not).
            away(p, left, Instant::now());
            p.steal.busy.store(false, Ordering::Release);
            clear = idle(p, until, &cpu, &mut lines, &mut peers);
            mark = Instant::now();
            t = lock(&p.table);
            continue;
        };
        t.runnable[i / 64] &= !(1 << (i % 64));
        let woken = t.woken[i].take();
        let Some(mut e) = t.units[i].take() else {
            continue;
        };
        t.publish_steal_hints(p);
        // Kept before the table is free, so that a thief that waited for it sees the
        // hold as it accounts the wait. (A hold after it, with the table still locked,
        // the thief measures itself: `turn_ns`.)
        between(p, mark, Instant::now());
        // Busy before the table is free: a thread the host holds from here to the step
        // must look busy to its peers, or a device's engine left waiting in its table
        // looks like an idle pCPU's own to take, and nobody takes it.
        if !p.steal.busy.load(Ordering::Relaxed) {
            p.steal.busy.store(true, Ordering::Release);
        }
        p.turn_ns.store(0, Ordering::Release);
        drop(t);
        let (out, ran, end) = run_sampled(p, p, all, &mut binding, &mut *e, woken);
        mark = end;
        cpu.publish_now_and_then(p, end);
        t = lock(&p.table);
        if t.generation != generation {
            hand_back(p, t, i, e, &out);
            return;
        }
        t.charge_cap(i, &*e, ran);
        // A turn a device's wake-up cut short (`run_unit`) resumes after the engine's step,
        // and an engine run ahead of the round leaves the round where it was.
        let resume = ahead || matches!(out, StepOut::Cut);
        match out {
            StepOut::More | StepOut::Cut => {
                t.runnable[i / 64] |= 1 << (i % 64);
                t.units[i] = Some(e);
                yields = 0;
            }
            StepOut::Yield => {
                t.runnable[i / 64] |= 1 << (i % 64);
                t.units[i] = Some(e);
                yields += 1;
                if yields >= t.live && p.policy != IdlePolicy::Poll {
                    // A round of nothing but polling: the host's other threads get the
                    // core for a moment (the host's time, as in the idle loop; the table
                    // is free meanwhile).
                    yields = 0;
                    drop(t);
                    let gave = Instant::now();
                    std::thread::yield_now();
                    mark = Instant::now();
                    away(p, gave, mark);
                    t = lock(&p.table);
                }
            }
            StepOut::Idle(d) => {
                yields = 0;
                // Unless a thief took its wake-up meanwhile (it is runnable already).
                if t.runnable[i / 64] & (1 << (i % 64)) == 0 {
                    t.idle_after_step(i, d, end);
                } else {
                    t.woken_in_step(i, end);
                }
                t.units[i] = Some(e);
            }
            StepOut::Ended => {
                t.end(p, i);
                drop(t);
                e.finish();
                drop(e);
                mark = Instant::now();
                t = lock(&p.table);
            }
        }
        if !resume {
            cursor = i + 1;
        }
    }
}

/// Whether a device's engine of `p` has been woken and not yet taken from its IPI word.
#[inline]
fn device_signalled(p: &PcpuShared) -> bool {
    (0..WORDS).any(|w| {
        p.ipi[w].load(Ordering::Relaxed) & p.steal.stealable[w].load(Ordering::Relaxed) != 0
    })
}

/// [`run_unit`] with the profiler's samples charged to the unit while it runs.
fn run_sampled(
    p: &PcpuShared,
    owner: &PcpuShared,
    all: &[Arc<PcpuShared>],
    binding: &mut Option<SlotBinding>,
    e: &mut dyn Erased,
    woken: Option<Instant>,
) -> (StepOut, u64, Instant) {
    let prev = match (binding.as_mut(), e.samples()) {
        (Some(b), Some(s)) => Some(b.switch(s)),
        _ => None,
    };
    let r = run_unit(p, owner, all, e, woken);
    if let (Some(b), Some(prev)) = (binding.as_mut(), prev) {
        b.switch(prev);
    }
    r
}

/// Runs unit `e` for its weight in steps, or until a step returns anything but *more*;
/// accounts each step to the unit and the pCPU. Returns what the last step said, the
/// time the unit ran, and when its last step ended. A step that panics fails the unit's
/// join and ends it.
#[inline]
fn run_unit(
    p: &PcpuShared,
    owner: &PcpuShared,
    all: &[Arc<PcpuShared>],
    e: &mut dyn Erased,
    mut woken: Option<Instant>,
) -> (StepOut, u64, Instant) {
    let weight = e.spec().weight.max(1);
    // The unit's time starts here: picking it was the scheduler's (the pCPU's own).
    let mut start = Instant::now();
    let mut out = StepOut::More;
    let mut ran = 0u64;
    for k in 0..weight {
        if let Some(w) = woken {
            start = account_wait(p, owner, all, e.stats(), e.spec().stealable, w, start);
        }
        p.step_since.store(
            start.duration_since(p.epoch).as_nanos() as u64 | 1,
            Ordering::Release,
        );
        let cx = Cx { now: start, woken };
        let r = catch_unwind(AssertUnwindSafe(|| e.step(&cx)));
        let end = Instant::now();
        let ns = end.duration_since(start).as_nanos() as u64;
        ran += ns;
        let st = e.stats();
        st.running_ns.fetch_add(ns, Ordering::Relaxed);
        st.steps.fetch_add(1, Ordering::Relaxed);
        st.longest_step_ns.fetch_max(ns, Ordering::Relaxed);
        if ns > LONG_STEP.as_nanos() as u64 {
            let n = st.long_steps.load(Ordering::Relaxed);
            st.long_steps.store(n + 1, Ordering::Relaxed);
        }
        p.stats.longest_step_ns.fetch_max(ns, Ordering::Relaxed);
        woken = None;
        start = end;
        if ns >= HOLD_LOGGED.as_nanos() as u64 {
            // Was the host's hold in it? (A clock read: the scheduler's time.)
            let at = |t: Instant| t.saturating_duration_since(p.epoch).as_nanos() as u64;
            start = Instant::now();
            p.holds.long_step(at(end) - ns, at(start));
        }
        match r {
            // A device's engine woken on this pCPU waits for this step's end, not for the
            // rest of a weighted turn: the turn ends here and resumes after the engine.
            Ok(StepOut::More) if k + 1 < weight && !e.spec().stealable && device_signalled(p) => {
                out = StepOut::Cut;
            }
            Ok(StepOut::More) => continue,
            Ok(o) => out = o,
            Err(panic) => {
                e.fail(panic_text(&panic));
                out = StepOut::Ended;
            }
        }
        break;
    }
    p.step_since.store(0, Ordering::Release);
    p.stats.busy_ns.fetch_add(ran, Ordering::Relaxed);
    (out, ran, start)
}

/// When a unit taken from the IPI word at `now` was woken: at its waker's stamp, if it
/// has one, but not before the pCPU's idle loop last found the word empty (`clear`). A
/// waker stamps, then signals; a spinning idle loop sees the signal within a look, so
/// a stamp older than the last empty look is a waker held between the two (a host's
/// hold of its thread, in its step): the wake-up could not be seen, nor the unit run,
/// before the signal.
fn woken_at(stamped: Option<Instant>, now: Instant, clear: Option<Instant>) -> Instant {
    let at = stamped.map_or(now, |s| s.min(now));
    clear.map_or(at, |c| at.max(c.min(now)))
}

/// Accounts unit `st`'s wait to run from its wake-up `w` to `start`, with and without
/// the host's share of it: the largest of what is known to be the host's (never more
/// than the truth). That is its holds of this thread meanwhile; for a unit of another
/// pCPU (`owner`), of that pCPU's thread (idle, with a hold still going on, or in its
/// scheduler's turns, where its table was locked against thieves, as it kept them or
/// as the thief found the table, [`UnitStats::held_locked`]); of a thief's thread that
/// had the unit ([`UnitStats::held_away`]); and for a device's engine
/// (`stealable`), the time every pCPU of `all` but the owner was held at once (an idle
/// one's hold still going on included, [`Holds::held_idle`]), in which none of them
/// could take it while its own was busy, as an idle one would. Returns when its step
/// may start: a long wait reads the thread's clock ([`HOLD_LOOK`]), and that system
/// call is the scheduler's time, not the unit's, so the step's time starts after it.
#[inline]
fn account_wait(
    p: &PcpuShared,
    owner: &PcpuShared,
    all: &[Arc<PcpuShared>],
    st: &UnitStats,
    stealable: bool,
    w: Instant,
    start: Instant,
) -> Instant {
    let wait = start.saturating_duration_since(w).as_nanos() as u64;
    st.wakeups.fetch_add(1, Ordering::Relaxed);
    st.runnable_ns.fetch_add(wait, Ordering::Relaxed);
    if wait <= HOLD_LOOK.as_nanos() as u64 {
        st.waited(wait, wait);
        return start;
    }
    let ns = |q: &PcpuShared, t: Instant| t.saturating_duration_since(q.epoch).as_nanos() as u64;
    let mut host = p.holds.within(ns(p, w), ns(p, start));
    let (from, to) = (ns(owner, w), ns(owner, start));
    if !std::ptr::eq(p, owner) {
        // The unit's own pCPU held meanwhile (idle, its hold perhaps still going on, or
        // in its turn with its table locked): the larger, never more than the truth.
        host = host
            .max(owner.holds.in_turns(from, to))
            .max(owner.holds.held_idle(from, to));
    }
    // The wait may have begun while the unit was on a thief's thread the host held, or
    // while its pCPU's table was locked by a held thread (its pCPU's own as a thief tried
    // it, or a thief's putting it back; likewise the larger).
    host = host
        .max(st.away_within(from, to))
        .max(st.locked_within(from, to));
    if stealable {
        // Every other pCPU held at once, as far as they kept their holds by now, and an
        // idle one's hold still going on.
        let others = all.iter().filter(|q| !std::ptr::eq(&***q, owner));
        let held = others.map(|q| q.holds.held_idle(ns(q, w), ns(q, start)));
        host = host.max(held_at_once(held, wait));
    }
    let host = host.min(wait);
    st.waited(wait, wait - host);
    Instant::now()
}

/// At least the time in a wait of `wait` ns that every one of some threads was held at
/// once, from at least how long each was held in it (`held`): their sum less all but
/// one wait's length. None without any thread.
fn held_at_once(held: impl Iterator<Item = u64>, wait: u64) -> u64 {
    let (mut n, mut sum) = (0u64, 0u64);
    for h in held {
        n += 1;
        sum += h.min(wait);
    }
    match n {
        0 => 0,
        n => sum.saturating_sub((n - 1) * wait),
    }
}

/// A unit whose step a rescue retired the thread in: handed back to the pCPU's new
/// thread, or, when the scheduler is stopping or the unit ended, its join answered.
fn hand_back(
    p: &PcpuShared,
    mut t: MutexGuard<'_, Table>,
    i: usize,
    mut e: Box<dyn Erased>,
    out: &StepOut,
) {
    let ended = matches!(out, StepOut::Ended);
    if p.stop.load(Ordering::Acquire) && !ended {
        e.fail("the scheduler stopped before the unit ended".into());
    } else if !ended {
        t.units[i] = Some(e);
        drop(t);
        p.ipi[i / 64].fetch_or(1 << (i % 64), Ordering::SeqCst);
        wake_thread(p);
    } else {
        p.steal.stealable[i / 64].fetch_and(!(1 << (i % 64)), Ordering::SeqCst);
        p.steal.movable[i / 64].fetch_and(!(1 << (i % 64)), Ordering::SeqCst);
        t.held[i / 64] &= !(1 << (i % 64));
        t.live -= 1;
        drop(t);
        e.finish();
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked".into())
}

/// The idle loop: waits for the IPI word, a deadline or a stop, as the policy says.
fn idle(
    p: &PcpuShared,
    until: Option<Instant>,
    cpu: &CpuClock,
    lines: &mut Lines,
    peers: &mut steal::Peers<'_>,
) -> Option<Instant> {
    let start = Instant::now();
    let window = Duration::from_nanos(p.poll_window_ns.load(Ordering::Relaxed));
    let spin_end = match p.policy {
        IdlePolicy::Poll => None,
        IdlePolicy::HaltPoll(b) => Some(start + b),
        IdlePolicy::Block => Some(start),
        IdlePolicy::AdaptiveHaltPoll(_) => Some(start + window),
    };
    let (sleep, counted, mut clear) = idle_spin(p, start, until, spin_end, cpu, lines, peers);
    p.holds.left_idle();
    if sleep {
        clear = idle_sleep(p, until, cpu, lines).or(clear);
    }
    if let IdlePolicy::AdaptiveHaltPoll(max) = p.policy {
        let next = next_poll_window(window, start.elapsed(), max);
        p.poll_window_ns
            .store(next.as_nanos() as u64, Ordering::Relaxed);
    }
    p.stats
        .idle_ns
        .fetch_add(counted.elapsed().as_nanos() as u64, Ordering::Relaxed);
    clear
}

/// The idle loop's spin: until a unit is woken, the scheduler stops, `until` passes,
/// a host line has input, or the spin's end (`spin_end`, none: for ever) passes. Returns
/// whether the pCPU should now sleep (the spin ran out), up to when its idle time has
/// been counted, and when it last found the IPI word empty.
fn idle_spin(
    p: &PcpuShared,
    start: Instant,
    until: Option<Instant>,
    spin_end: Option<Instant>,
    cpu: &CpuClock,
    lines: &mut Lines,
    peers: &mut steal::Peers<'_>,
) -> (bool, Instant, Option<Instant>) {
    let mut counted = start;
    let mut spins = 0u32;
    let mut last = start;
    let mut last_peek = start;
    let mut last_read = start;
    let mut last_yield = start;
    // When it last found the IPI word empty (it was looked at just before).
    let mut clear = None;
    loop {
        if any_ipi(p, Ordering::Acquire)
            || p.stop.load(Ordering::Relaxed)
            || (p.steal.retime.load(Ordering::Relaxed)
                && p.steal.retime.swap(false, Ordering::AcqRel))
        {
            // The host may have held it until just now: the wait it ends is net of that.
            away(p, last, Instant::now());
            return (false, counted, clear);
        }
        if spins.is_multiple_of(32) {
            let now = Instant::now();
            clear = Some(now);
            // The look is published before the gap it ends is kept (a peer reading both
            // takes the gaps up to the look it read).
            p.holds
                .looked(now.saturating_duration_since(p.epoch).as_nanos() as u64);
            away(p, last, now);
            last = now;
            if until.is_some_and(|u| now >= u) {
                return (false, counted, Some(now));
            }
            if lines.look(p, now, LINE_LOOK_IDLE) > 0 {
                return (false, counted, Some(now));
            }
            // Another pCPU's device engine waits while that pCPU is in a step (looked
            // at every few µs: each look reads lines the other pCPU writes as it works).
            if now.duration_since(last_peek) >= STEAL_LOOK {
                last_peek = now;
                if steal::wanted_by(p, peers, now) {
                    return (false, counted, Some(now));
                }
            }
            // The clock read now and then, for the holds that may come once it is busy.
            if now.duration_since(last_read) >= CLOCK_READ {
                last_read = now;
                cpu.publish(p);
            }
            // A long spin shows in the accounting as it goes, not only once it ends.
            if now.duration_since(counted) >= Duration::from_millis(1) {
                p.stats.idle_ns.fetch_add(
                    now.duration_since(counted).as_nanos() as u64,
                    Ordering::Relaxed,
                );
                counted = now;
                cpu.publish(p);
            }
            if spin_end.is_some_and(|e| now >= e) {
                return (true, counted, Some(now));
            }
            // A bounded spin shares the core with the host's other threads: it gives
            // way now and then, and a turn given away means another thread wanted the
            // core, so it stops spinning and sleeps (KVM's poll ends likewise once its
            // core has another task to run).
            if spin_end.is_some() && now.duration_since(last_yield) >= SPIN_YIELD {
                std::thread::yield_now();
                let back = Instant::now();
                last_yield = back;
                if back.saturating_duration_since(now) > HOST_GAP {
                    away(p, now, back);
                    return (true, counted, Some(now));
                }
            }
        }
        spins = spins.wrapping_add(1);
        std::hint::spin_loop();
    }
}

/// The idle loop's look at `now` after one at `last`: 32 turns of the loop take well
/// under a µs on a core of its own, so a gap past [`HOST_GAP`] is the host's.
#[inline]
fn away(p: &PcpuShared, last: Instant, now: Instant) {
    gap(p, last, now, Holds::push);
}

/// The scheduler's way from `last` (a step's end, the idle loop's or a thief's turn's)
/// to its next pick at `now`, as [`away`]: a few hundred ns with its core (a clock read,
/// a lock a peer holds for as long). A gap past [`HOST_GAP`] is the host's, and the
/// unit whose step ended was in the thread's hand or the table locked meanwhile.
#[inline]
fn between(p: &PcpuShared, last: Instant, now: Instant) {
    gap(p, last, now, Holds::push_turn);
}

#[inline]
fn gap(p: &PcpuShared, last: Instant, now: Instant, push: fn(&Holds, u64, u64)) {
    let gap = now.saturating_duration_since(last);
    // Only the pCPU's own thread writes it.
    let longest = &p.stats.longest_away_ns;
    if gap.as_nanos() as u64 > longest.load(Ordering::Relaxed) {
        longest.store(gap.as_nanos() as u64, Ordering::Relaxed);
    }
    if holds::hosts(gap) > 0 {
        let ns = |t: Instant| t.saturating_duration_since(p.epoch).as_nanos() as u64;
        push(&p.holds, ns(last), ns(now));
    }
}

/// The idle loop's sleep in the host, until a wake-up, `until`, or input on a host
/// line; returns a time it found the IPI word empty at, if it slept. The sleep is
/// announced, then the IPI word looked at once more: a waker that set a bit before it
/// could see the flag must not be slept through (both sides store, then load).
fn idle_sleep(
    p: &PcpuShared,
    until: Option<Instant>,
    cpu: &CpuClock,
    lines: &mut Lines,
) -> Option<Instant> {
    // Before the look at the IPI word below: a time it was found empty at, if it was.
    let checked = Instant::now();
    p.rung_ns.store(0, Ordering::Relaxed);
    p.sleeping.store(true, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    let asleep = (!any_ipi(p, Ordering::SeqCst)
        && !p.stop.load(Ordering::SeqCst)
        && !p.steal.retime.swap(false, Ordering::SeqCst))
    .then(|| {
        // The thread's CPU clock as it goes to sleep (one more system call beside the
        // sleep's own): the time it then sleeps is not the host's, and a report taken
        // meanwhile sees the CPU it used up to here.
        cpu.publish(p);
        let waited0 = cpu.delay.as_ref().and_then(RunDelay::read);
        let t0 = Instant::now();
        let timeout = until.map(|u| u.saturating_duration_since(t0));
        lines.refresh(p);
        match p.doorbell.get().filter(|_| lines.any()) {
            // With lines, the host wakes it for their input too.
            Some(bell) => {
                lines.build(Some(bell.as_raw_fd()));
                if let Ok(n) = mem::poll::wait(&mut lines.fds, timeout) {
                    if n > 0 {
                        if lines.fds[0].ready() {
                            bell.drain();
                        }
                        lines.fire(p, 1);
                    }
                }
            }
            None => match timeout {
                None => std::thread::park(),
                Some(d) => std::thread::park_timeout(d),
            },
        }
        let now = Instant::now();
        let mut slept = now.saturating_duration_since(t0).as_nanos() as u64;
        let ns = |t: Instant| t.saturating_duration_since(p.epoch).as_nanos() as u64;
        let to = ns(now);
        // Rung, it was no longer asleep by its own choice: the time from the ring to its
        // thread's running again is the host's wake-up of it (on this VM its hypervisor
        // waking an idle vCPU, 29 µs median, where a halted core wakes in about a µs).
        // Woken, it may also have waited on the host's run queue behind another thread
        // (a kernel without preemption lets one run on to its tick): that wait is not
        // its sleep either. Both are the host's holds, laid where they ended as the idle
        // loop's gaps are, so that a device's wait across them is net of them, and the
        // wake-ups are counted.
        let rung = Some(p.rung_ns.swap(0, Ordering::Relaxed)).filter(|r| *r >= ns(t0) && *r < to);
        // Its timer due before any ring, it was no longer asleep by its own choice
        // either: from the due time to its running is the host's wake-up of it at the
        // timer, a hold as a ring's is (the timer slack is a µs, [`pcpu_enter`]).
        let due = until.map(ns).filter(|u| *u >= ns(t0) && *u < to);
        let (woken, stats) = match due {
            Some(u) if rung.is_none_or(|r| u < r) => (Some(u), timer_stats(p)),
            _ => (rung, rung_stats(p)),
        };
        let queued = match (waited0, cpu.delay.as_ref().and_then(RunDelay::read)) {
            (Some(a), Some(b)) => b.saturating_sub(a).as_nanos() as u64,
            _ => 0,
        };
        slept = p.holds.woke(to, slept, queued, woken);
        if let Some(w) = woken {
            let [count, total, longest] = stats;
            let late = to - w;
            total.fetch_add(late, Ordering::Relaxed);
            longest.fetch_max(late, Ordering::Relaxed);
            count.fetch_add(1, Ordering::Relaxed);
        }
        p.stats.slept_ns.fetch_add(slept, Ordering::Relaxed);
        add(&p.holds.slept_ns, slept);
        p.stats.sleeps.fetch_add(1, Ordering::Relaxed);
        checked
    });
    p.sleeping.store(false, Ordering::Relaxed);
    asleep
}

/// A pCPU's counters of the host's wake-ups of it by a ring: how many, their time in
/// all, the longest.
fn rung_stats(p: &PcpuShared) -> [&AtomicU64; 3] {
    let s = &p.stats;
    [&s.rung_wakes, &s.rung_wake_ns, &s.longest_rung_wake_ns]
}

/// As [`rung_stats`], for its wake-ups at a timer.
fn timer_stats(p: &PcpuShared) -> [&AtomicU64; 3] {
    let s = &p.stats;
    [&s.timer_wakes, &s.timer_late_ns, &s.longest_timer_late_ns]
}

/// Live units on a pCPU (for tests and reports).
pub fn live_units(s: &Scheduler, pcpu: usize) -> usize {
    s.pcpus.get(pcpu).map_or(0, |p| lock(&p.table).live)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threads held at once for at least the overlap their holds force into one wait:
    /// none if they could have taken turns, the one hold alone, none without threads.
    #[test]
    fn threads_are_held_at_once_for_no_more_than_their_holds_force() {
        assert_eq!(held_at_once([700, 600].into_iter(), 1_000), 300);
        assert_eq!(held_at_once([500, 500].into_iter(), 1_000), 0);
        assert_eq!(held_at_once([900, 2_000, 950].into_iter(), 1_000), 850);
        assert_eq!(held_at_once([400].into_iter(), 1_000), 400);
        assert_eq!(held_at_once(std::iter::empty(), 1_000), 0);
    }

    /// A unit's wake-up counts from its waker's stamp, never after it was taken, and
    /// never before the idle loop last found the IPI word empty: a waker held between
    /// its stamp and its signal is not the unit's wait.
    #[test]
    fn a_wake_up_counts_from_its_stamp_but_not_before_it_could_be_seen() {
        let t0 = Instant::now();
        let us = |n: u64| t0 + Duration::from_micros(n);
        assert_eq!(woken_at(Some(us(10)), us(50), None), us(10));
        assert_eq!(woken_at(None, us(50), None), us(50));
        assert_eq!(woken_at(Some(us(60)), us(50), None), us(50), "not after");
        // Stamped at 10, the word still empty at 4 000: seen from then.
        assert_eq!(
            woken_at(Some(us(10)), us(4_001), Some(us(4_000))),
            us(4_000)
        );
        // Empty at 5, stamped at 10: from the stamp.
        assert_eq!(woken_at(Some(us(10)), us(50), Some(us(5))), us(10));
        assert_eq!(woken_at(None, us(50), Some(us(5))), us(50));
    }

    /// A pCPU's table found locked in one turn of its scheduler, over a span longer than
    /// the thread's own few hundred ns, is the host's hold of the thread from the turn's
    /// start to the look, all of it; a short one, another thread's lock (no turn), or a
    /// turn begun after the look is none.
    #[test]
    fn a_table_found_locked_in_one_turn_is_held_from_the_turns_start_to_the_look() {
        use super::steal::found_locked;
        assert_eq!(found_locked(40_000, 3_040_000), Some((40_000, 3_040_000)));
        assert_eq!(found_locked(40_000, 45_000), None, "its own turn's time");
        assert_eq!(found_locked(0, 3_040_000), None, "not its thread's turn");
        assert_eq!(found_locked(50_000, 40_000), None, "a turn after the look");
    }

    /// A unit's wait is net of the part inside it of the span its pCPU's thread was
    /// found holding its table (by the thief that then took it), and of none outside.
    #[test]
    fn a_wait_is_net_of_its_pcpus_table_found_held_inside_it() {
        let st = UnitStats::default();
        assert_eq!(st.locked_within(0, 10_000_000), 0);
        st.held_locked(1_000_000, 4_000_000);
        assert_eq!(st.locked_within(0, 10_000_000), 3_000_000);
        assert_eq!(st.locked_within(2_000_000, 10_000_000), 2_000_000);
        assert_eq!(st.locked_within(5_000_000, 6_000_000), 0);
        assert_eq!(st.locked_within(0, 500_000), 0);
    }

    /// A wait falls in a bucket whose bound is at or above it and at most a quarter
    /// (and a µs's rounding) above it, so a 99th percentile between two powers of two
    /// is told as such: 35 µs waits are reported as 41, not 64.
    #[test]
    fn a_waits_bucket_bounds_it_from_above_within_a_quarter() {
        for ns in (0..40u64)
            .map(|k| 1u64 << k)
            .chain([
                999, 1_000, 1_024, 1_500, 35_000, 49_999, 50_000, 1_000_000, 7_127_000,
            ])
            .chain((1..200).map(|k| k * 7_919))
        {
            let (k, bound) = (wait_bucket(ns), bucket_bound(wait_bucket(ns)));
            let bound = bound.as_nanos() as u64;
            match k {
                // Below a µs (and a few ns): told as 2 µs at most.
                0 => assert!(ns < 1_024 && bound <= 2_000, "{ns} ns: bound {bound}"),
                // Past 17 s: the last bucket, everything longer.
                _ if k == WAIT_BUCKETS - 1 => assert!(ns >= 1 << 34, "{ns} ns"),
                _ => {
                    assert!(bound >= ns, "{ns} ns: bound {bound}");
                    assert!(bound <= ns + ns / 4 + 1_000, "{ns} ns: bound {bound}");
                }
            }
        }
        let h = WaitHist::default();
        h[wait_bucket(35_000)].store(100, Ordering::Relaxed);
        assert_eq!(p99(&h), Duration::from_micros(41), "not 64");
        assert_eq!(p99(&WaitHist::default()), Duration::ZERO);
    }

    /// A new wait window restarts a unit's waits: a report before its next wait shows
    /// none, and after it only the window's; its other accounting goes on.
    #[test]
    fn a_units_waits_count_from_the_window_its_scheduler_marked() {
        let window = Arc::new(AtomicU64::new(0));
        let st = UnitStats {
            window: Arc::clone(&window),
            ..UnitStats::default()
        };
        st.steps.store(7, Ordering::Relaxed);
        st.waited(9_000_000, 8_000_000);
        let r = st.report();
        assert_eq!(r.longest_wait, Duration::from_millis(9));
        assert_eq!(r.longest_wait_net, Duration::from_millis(8));
        window.fetch_add(1, Ordering::Relaxed);
        let r = st.report();
        assert_eq!(
            (r.longest_wait, r.wait_p99),
            (Duration::ZERO, Duration::ZERO)
        );
        assert_eq!(
            (r.longest_wait_net, r.wait_p99_net),
            (Duration::ZERO, Duration::ZERO)
        );
        assert_eq!(r.steps, 7, "the rest of its accounting goes on");
        st.waited(20_000, 10_000);
        let r = st.report();
        assert_eq!(r.longest_wait, Duration::from_micros(20));
        assert_eq!(r.longest_wait_net, Duration::from_micros(10));
        assert!(r.wait_p99 > Duration::ZERO && r.wait_p99 < Duration::from_millis(1));
    }

    /// Pauses that tests ask of a pCPU on its way to the idle loop: the pCPU (by
    /// address), how long, and a flag raised as the pause begins.
    type Pause = (usize, Duration, Arc<AtomicBool>);
    static PAUSES: Mutex<Vec<Pause>> = Mutex::new(Vec::new());

    /// The pause asked of `p`, if any: its thread spins through it, so that its CPU
    /// clock counts it, as a thread's clock counts a VM's hypervisor's pause of its vCPU.
    pub(super) fn pause_before_idle(p: &PcpuShared) {
        let me = p as *const PcpuShared as usize;
        let pause = {
            let mut all = lock(&PAUSES);
            let k = all.iter().position(|(at, ..)| *at == me);
            k.map(|k| all.remove(k))
        };
        if let Some((_, d, paused)) = pause {
            paused.store(true, Ordering::Release);
            let t = Instant::now();
            while t.elapsed() < d {
                std::hint::spin_loop();
            }
        }
    }

    /// A device's engine waits while its own pCPU is in a vCPU's long step and the host
    /// holds the only other pCPU on its way from a turn to the idle loop, where no look
    /// of the idle loop measures (a hypervisor's pause, which the thread's clock counts):
    /// that pCPU would have taken the engine, so the wait is the host's, and the engine's
    /// net wait leaves it out.
    #[test]
    fn a_hold_on_the_way_to_the_idle_loop_is_the_hosts_in_a_device_engines_wait() {
        struct Hog {
            inside: Arc<AtomicBool>,
            release: Arc<AtomicBool>,
        }
        impl Unit for Hog {
            type Output = ();
            fn step(&mut self, _cx: &Cx) -> Step<()> {
                self.inside.store(true, Ordering::Release);
                while !self.release.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                Step::Done(())
            }
        }
        struct Once(Arc<AtomicU64>);
        impl Unit for Once {
            type Output = ();
            fn step(&mut self, _cx: &Cx) -> Step<()> {
                if self.0.fetch_add(1, Ordering::AcqRel) == 1 {
                    return Step::Done(());
                }
                Step::Idle(None)
            }
        }
        const PAUSE: Duration = Duration::from_millis(20);
        // One round: pCPU 1 held 20 ms on its way to the idle loop while pCPU 0 is in a
        // vCPU's step and the engine is woken. Returns how long after its wake-up the
        // engine ran, and its report.
        let round = || {
            let s = Scheduler::new(&CpuPlan::floating(2, IdlePolicy::Poll), None).expect("sched");
            let (inside, release) = (
                Arc::new(AtomicBool::new(false)),
                Arc::new(AtomicBool::new(false)),
            );
            let hog = Hog {
                inside: Arc::clone(&inside),
                release: Arc::clone(&release),
            };
            let hog = s.place(0, UnitSpec::named("vcpu"), hog).expect("hog");
            let ran = Arc::new(AtomicU64::new(0));
            let nic = s
                .place(0, UnitSpec::device("nic"), Once(Arc::clone(&ran)))
                .expect("nic");
            let poke = s
                .place(
                    1,
                    UnitSpec::named("poke"),
                    Once(Arc::new(AtomicU64::new(0))),
                )
                .expect("poke");
            let t = Instant::now();
            let waited = |what: &str, f: &dyn Fn() -> bool| {
                while !f() {
                    assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
                    std::thread::yield_now();
                }
            };
            waited("the engine's first step", &|| {
                ran.load(Ordering::Acquire) == 1
            });
            waited("the vCPU's long step", &|| inside.load(Ordering::Acquire));
            // pCPU 1 runs a unit, and is held on its way back to the idle loop.
            let paused = Arc::new(AtomicBool::new(false));
            let at = &*s.pcpus[1] as *const PcpuShared as usize;
            lock(&PAUSES).push((at, PAUSE, Arc::clone(&paused)));
            poke.wake();
            waited("pCPU 1 held", &|| paused.load(Ordering::Acquire));
            let woken = Instant::now();
            nic.wake();
            waited("the engine's second step", &|| {
                ran.load(Ordering::Acquire) == 2
            });
            let ran_after = woken.elapsed();
            release.store(true, Ordering::Release);
            poke.wake();
            let r = nic.stats().report();
            assert_eq!(nic.join(), Ok(()));
            assert_eq!(hog.join(), Ok(()));
            assert_eq!(poke.join(), Ok(()));
            // The engine ran once pCPU 1 was back (its own was in the vCPU's step all along).
            assert!(r.stolen >= 1, "{r:?}");
            (ran_after, r)
        };
        // A round counts only if this test's thread woke the engine early in the pause
        // (a thread the host held past most of it judges nothing); one of a few does.
        let (ran_after, r) = (0..5)
            .map(|_| round())
            .find(|(ran_after, _)| *ran_after >= PAUSE / 2)
            .expect("the engine woken early in pCPU 1's pause in one of five rounds");
        assert!(r.longest_wait >= PAUSE / 2, "{ran_after:?} {r:?}");
        assert!(
            r.longest_wait_net < Duration::from_millis(2),
            "the hold is the host's: {r:?}"
        );
    }
}
