//! What a pCPU's thread knows of the host's holds of it: the time the host kept the
//! thread off its core, which is neither a unit's nor the scheduler's.
//!
//! Two measures, each never more than the truth: the gaps between the idle loop's looks
//! past [`HOST_GAP`] (the loop looks every few hundred ns while it has its core), and
//! the wall time since the thread's last read of its CPU clock that the clock did not
//! count and the thread did not sleep (a hold anywhere else: in a step, on a lock; each
//! read keeps what of it since the read before no gap kept).
//! Waits to run are taken net of both ([`Holds::within`]); holds of
//! [`HOLD_LOGGED`] or longer are also kept with their times ([`HostHold`]), so that a
//! device's losses can be laid beside them afterwards: a frame the NIC had no buffer
//! for while the host held the thread of the unit that posts them is the host's.

use super::*;

/// A gap between two looks of a spinning idle loop longer than this is the host's: the
/// loop looks every few hundred ns while it has its core, and a look at its lines (a
/// `ppoll`) or its clock takes a few µs at most.
pub const HOST_GAP: Duration = Duration::from_micros(10);

/// The host's part of a gap between two points of a thread's own way that take a few
/// hundred ns with its core (two looks of the idle loop, a step's end and the next
/// pick): all of it past [`HOST_GAP`], none of a shorter one.
pub(super) fn hosts(gap: Duration) -> u64 {
    if gap > HOST_GAP {
        gap.as_nanos() as u64
    } else {
        0
    }
}

/// A wait to run longer than this has the host's share in it looked for: the thread's
/// clock is read (a system call, on the waits a host's hold makes, not on the others).
pub const HOLD_LOOK: Duration = Duration::from_micros(50);

/// How often a pCPU's thread reads its clock, spinning idle or between steps, so that
/// a hold is measured from a read at most this old (a hold's part before the wait it
/// falls in cannot be told from its part inside, so an older read makes a net wait
/// longer than it was by up to its age). A read is a system call of a few hundred ns:
/// a few tenths of a percent of a busy pCPU, the scheduler's, not a unit's.
pub(super) const CLOCK_READ: Duration = Duration::from_micros(100);

/// A hold of a pCPU's thread this long or longer is kept with its time
/// ([`Scheduler::host_holds`]): a twelfth of the time a ring of 256 buffers lasts at
/// the papers' 81 274 frames/s, so that every hold a ring could run dry in is there. A
/// step this long has its thread's clock read as it ends (a system call, on steps this
/// long only).
pub const HOLD_LOGGED: Duration = Duration::from_micros(250);

/// Gaps kept in [`Holds`] for the waits: a wait spans a few at most.
pub(super) const GAPS: usize = 16;

/// Holds kept with their times, the newest over the oldest: a lab run sees a few dozen.
const HOLD_LOG: usize = 256;

/// The bits of a logged hold's length that say it was seen in a step, on the
/// scheduler's way from a step to its next pick ([`Holds::push_turn`]: kept in the gaps
/// too), or between two of the thread's clock reads where no gap or step showed it
/// ([`Holds::clock_read`]).
const IN_STEP: u64 = 1 << 63;
const IN_TURN: u64 = 1 << 62;
const IN_READ: u64 = 1 << 61;
const KINDS: u64 = IN_STEP | IN_TURN | IN_READ;

pub(super) fn add(a: &AtomicU64, v: u64) {
    a.store(a.load(Ordering::Relaxed) + v, Ordering::Relaxed);
}

/// A hold of a pCPU's thread by the host, as the thread saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostHold {
    /// The pCPU whose thread was held.
    pub pcpu: usize,
    /// The span the hold lies in: an idle loop's gap exactly; for a step, the step; for
    /// one only a clock read saw, the time since the read before it.
    pub from: Instant,
    /// Its end.
    pub to: Instant,
    /// How much of the span the host held the thread at least.
    pub held: Duration,
    /// It came in a step (the step's unit could not run anywhere meanwhile), not
    /// between two looks of the idle loop.
    pub in_step: bool,
    /// It came in the scheduler's turn between steps, with the pCPU's table locked
    /// or the unit whose step ended in the thread's hand: no idle peer could take any
    /// of its units (or that one) meanwhile.
    pub in_turn: bool,
}

/// What a pCPU's thread knows of the host's holds of it, for the waits to run they
/// take up: the holds its idle loop saw as gaps between its looks past [`HOST_GAP`]
/// (each as its start and end in ns since the pCPU's epoch, the newest over the
/// oldest), and its CPU clock as it last read it, with the wall time and its sleeps
/// then (a hold anywhere else, in a step or on a lock, shows as wall time the clock did
/// not count); and the long holds with their times. Written by the pCPU's own thread
/// only; the log is also read by a thief accounting a wait for one of the pCPU's units
/// (its turn holds, [`Holds::in_turns`]) and by reports once the run is over (relaxed
/// loads: an entry being written may read torn, which costs a wait's net figure at
/// most, never memory safety).
#[derive(Debug)]
pub(super) struct Holds {
    next: AtomicU64,
    spans: [[AtomicU64; 2]; GAPS],
    /// Its last clock read: when (ns since the epoch), the CPU time, and the time it had
    /// slept in all by then.
    read_at_ns: AtomicU64,
    read_cpu_ns: AtomicU64,
    read_slept_ns: AtomicU64,
    /// Its sleeps in the host in all (never reset).
    pub(super) slept_ns: AtomicU64,
    /// Its idle loop's last look (ns since the epoch) while it spins; 0 while it does
    /// not: a peer that finds it old sees a hold still going on ([`Holds::held_idle`]).
    look_ns: AtomicU64,
    /// Holds of [`HOLD_LOGGED`] or longer: from, to (ns since the epoch), and the time
    /// held, with [`IN_STEP`] set for one seen in a step; `logged` counts them all.
    logged: AtomicU64,
    log: Box<[[AtomicU64; 3]]>,
}

impl Default for Holds {
    fn default() -> Self {
        Self {
            next: AtomicU64::new(0),
            spans: Default::default(),
            read_at_ns: AtomicU64::new(0),
            read_cpu_ns: AtomicU64::new(0),
            read_slept_ns: AtomicU64::new(0),
            slept_ns: AtomicU64::new(0),
            look_ns: AtomicU64::new(0),
            logged: AtomicU64::new(0),
            log: (0..HOLD_LOG).map(|_| Default::default()).collect(),
        }
    }
}

impl Holds {
    /// The idle loop saw a gap from `from` to `to` (ns since the epoch).
    pub(super) fn push(&self, from: u64, to: u64) {
        self.push_kind(from, to, 0);
    }

    /// The scheduler's way from a step's end to its next pick took from `from` to `to`
    /// (ns since the epoch), past [`HOST_GAP`]: a gap, as the idle loop's, in which the
    /// unit whose step ended was in the thread's hand or the table locked, so that no
    /// peer could take any of its units ([`Holds::in_turns`]).
    pub(super) fn push_turn(&self, from: u64, to: u64) {
        self.push_kind(from, to, IN_TURN);
    }

    fn push_kind(&self, from: u64, to: u64, kind: u64) {
        let n = self.next.load(Ordering::Relaxed);
        let s = &self.spans[n as usize % GAPS];
        s[0].store(from, Ordering::Relaxed);
        s[1].store(to, Ordering::Relaxed);
        self.next.store(n + 1, Ordering::Relaxed);
        if to - from >= HOLD_LOGGED.as_nanos() as u64 {
            self.log(from, to, to - from, kind);
        }
    }

    /// The thread woke at `to` (ns since the epoch) from a sleep of `slept` ns, in which
    /// its wait on the host's run queue grew by `queued` ns: woken, it waited that long
    /// for its core behind another thread. That wait is the host's hold, not its sleep:
    /// kept as the idle loop's gaps are, ending as the thread ran. Returns the sleep net
    /// of it.
    ///
    /// If a waker rang it at `rung` (ns since the epoch), the time from the ring to its
    /// running again is the host's wake-up of it, kept as one hold with the queueing
    /// (which lies inside it) if it is past [`HOST_GAP`]: the wake-up's own system calls
    /// and the host scheduler's way to an idle core take a few µs, which stay in the
    /// waits. The wake-up stays in the sleep (the pCPU chose to sleep; only its queueing
    /// behind another thread is taken from it).
    pub(super) fn woke(&self, to: u64, slept: u64, queued: u64, rung: Option<u64>) -> u64 {
        let gap = HOST_GAP.as_nanos() as u64;
        let queued = queued.min(slept);
        let queued = if queued > gap { queued } else { 0 };
        let from = match rung.filter(|r| to.saturating_sub(*r) > gap) {
            Some(r) => r.min(to - queued),
            None if queued > 0 => to - queued,
            None => return slept,
        };
        self.push(from, to);
        slept - queued
    }

    fn log(&self, from: u64, to: u64, held: u64, kind: u64) {
        let n = self.logged.load(Ordering::Relaxed);
        let s = &self.log[n as usize % HOLD_LOG];
        s[0].store(from, Ordering::Relaxed);
        s[1].store(to, Ordering::Relaxed);
        s[2].store(held | kind, Ordering::Relaxed);
        self.logged.store(n + 1, Ordering::Relaxed);
    }

    /// The thread's clock read `cpu` at `at` (ns since the epoch). The wall time since
    /// its last read that the clock did not count and the thread did not sleep was the
    /// host's: what of it no gap or step kept (a hold on the way from a step to the next
    /// read, say, where no look measures) is kept now, over the two reads' span, if it
    /// is [`HOLD_LOGGED`] or longer. Without it the read would be the next measure's
    /// start, and a hold before it that a peer's wait took in would be lost.
    pub(super) fn clock_read(&self, at: u64, cpu: u64) {
        let prev = self.read_at_ns.load(Ordering::Relaxed);
        if prev > 0 && at > prev {
            let off = self.off_since_read(prev, at, cpu);
            let long = HOLD_LOGGED.as_nanos() as u64;
            if off >= long {
                let unkept = off.saturating_sub(self.seen(prev, at));
                if unkept >= long {
                    self.log(prev, at, unkept, IN_READ);
                }
            }
        }
        self.rebase(at, cpu);
    }

    /// The wall time from the last clock read (at `at`) to `to`, when the clock read
    /// `cpu`, that the clock did not count and the thread did not sleep.
    fn off_since_read(&self, at: u64, to: u64, cpu: u64) -> u64 {
        let slept = self
            .slept_ns
            .load(Ordering::Relaxed)
            .saturating_sub(self.read_slept_ns.load(Ordering::Relaxed));
        (to - at)
            .saturating_sub(cpu.saturating_sub(self.read_cpu_ns.load(Ordering::Relaxed)))
            .saturating_sub(slept)
    }

    /// The clock read `cpu` at `at`: the next measure's start, with nothing kept.
    fn rebase(&self, at: u64, cpu: u64) {
        self.read_at_ns.store(at, Ordering::Relaxed);
        self.read_cpu_ns.store(cpu, Ordering::Relaxed);
        self.read_slept_ns
            .store(self.slept_ns.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// At least the time in `from..to` (ns since the epoch, `to` now) that the host
    /// held the calling thread, which is this pCPU's: the gaps its idle loop and its
    /// way between steps saw there with the holds kept from its long steps there, or
    /// the wall time since its last clock read that its clock did not count, less the
    /// part of it before `from`,
    /// whichever says more (a long step reads the clock as it ends, so a hold in it is
    /// before the next read and only its kept record still shows it). Never more than
    /// the truth but for the clock's own granularity: a reader of the net waits may
    /// trust that they are not shorter than they were.
    pub(super) fn within(&self, from: u64, to: u64) -> u64 {
        self.within_read(from, to).0
    }

    /// At least the time in `from..to` the host held the thread as its gaps and long
    /// steps kept show, without a clock read: a system call returning is where the host
    /// takes a thread off its core, so a thread holding something a peer waits for
    /// measures this way.
    pub(super) fn seen(&self, from: u64, to: u64) -> u64 {
        self.spans
            .iter()
            .map(|s| {
                let (a, b) = (s[0].load(Ordering::Relaxed), s[1].load(Ordering::Relaxed));
                b.min(to).saturating_sub(a.max(from))
            })
            .sum::<u64>()
            + self.running(from, to, IN_STEP | IN_READ)
    }

    /// The idle loop looked at `at` (ns since the epoch), spinning.
    #[inline]
    pub(super) fn looked(&self, at: u64) {
        self.look_ns.store(at, Ordering::Relaxed);
    }

    /// The idle loop stopped spinning (to run a unit, to steal, to sleep).
    #[inline]
    pub(super) fn left_idle(&self) {
        self.look_ns.store(0, Ordering::Relaxed);
    }

    /// As [`Holds::seen`], read by a peer at `to` (now, ns since this thread's epoch),
    /// with a hold still going on: an idle loop that spins looks every few hundred ns
    /// while it has its core, so one whose last look is more than [`HOST_GAP`] old is
    /// held since that look, and the hold is not in its gaps until it looks again.
    /// What it kept is taken up to that look only, so that a gap it pushes meanwhile
    /// (which ends at its next look) is not counted twice.
    pub(super) fn held_idle(&self, from: u64, to: u64) -> u64 {
        let look = self.look_ns.load(Ordering::Relaxed);
        if look == 0 || to <= look || hosts(Duration::from_nanos(to - look)) == 0 {
            return self.seen(from, to);
        }
        let since = look.max(from);
        self.seen(from, since) + (to - since)
    }

    /// As [`Holds::within`], with the clock's reading it took.
    fn within_read(&self, from: u64, to: u64) -> (u64, Option<u64>) {
        let gaps = self.seen(from, to);
        let at = self.read_at_ns.load(Ordering::Relaxed);
        let cpu = ThreadClock::current()
            .ok()
            .and_then(|c| c.read())
            .map(|c| c.as_nanos() as u64);
        let clocked = match cpu {
            Some(cpu) if at > 0 && at <= to => self
                .off_since_read(at, to, cpu)
                .saturating_sub(from.saturating_sub(at)),
            _ => 0,
        };
        (gaps.max(clocked), cpu)
    }

    /// At least the time in `from..to` the host held the thread on its way from a step
    /// to its next pick, as kept: what a thief that found the pCPU's table locked (or
    /// the unit in the thread's hand) meanwhile waited for.
    pub(super) fn in_turns(&self, from: u64, to: u64) -> u64 {
        self.running(from, to, IN_TURN)
    }

    /// At least the time in `from..to` the host held the thread in the holds kept
    /// (of `kinds`; a hold lies somewhere in its span, so the part of it
    /// inside is at least its length less the span's part outside), newest first until
    /// one ended before `from`.
    fn running(&self, from: u64, to: u64, kinds: u64) -> u64 {
        let n = self.logged.load(Ordering::Relaxed);
        let mut sum = 0;
        for k in (n.saturating_sub(HOLD_LOG as u64)..n).rev() {
            let s = &self.log[k as usize % HOLD_LOG];
            let (a, b) = (s[0].load(Ordering::Relaxed), s[1].load(Ordering::Relaxed));
            if b < from {
                break;
            }
            let held = s[2].load(Ordering::Relaxed);
            if held & kinds == 0 {
                continue;
            }
            let inside = b.min(to).saturating_sub(a.max(from));
            let outside = (b - a).saturating_sub(inside);
            sum += (held & !KINDS).saturating_sub(outside);
        }
        sum
    }

    /// A step ran from `from` to `to` (ns since the epoch, `to` now) for at least
    /// [`HOLD_LOGGED`]: the thread's clock is read, and the host's share of the step
    /// (as [`Holds::within`] bounds it) kept if it is as long. The read is the next
    /// measure's start.
    pub(super) fn long_step(&self, from: u64, to: u64) {
        let (held, cpu) = self.within_read(from, to);
        if let Some(cpu) = cpu {
            // What the step's hold is, is kept below, as the step's.
            self.rebase(to, cpu);
        }
        if held >= HOLD_LOGGED.as_nanos() as u64 {
            self.log(from, to, held, IN_STEP);
        }
    }

    /// The holds kept, oldest first, as pCPU `pcpu`'s with epoch `epoch`.
    pub(super) fn logged(&self, pcpu: usize, epoch: Instant) -> Vec<HostHold> {
        let n = self.logged.load(Ordering::Relaxed);
        let first = n.saturating_sub(HOLD_LOG as u64);
        (first..n)
            .map(|k| {
                let s = &self.log[k as usize % HOLD_LOG];
                let at = |i: usize| epoch + Duration::from_nanos(s[i].load(Ordering::Relaxed));
                let held = s[2].load(Ordering::Relaxed);
                HostHold {
                    pcpu,
                    from: at(0),
                    to: at(1),
                    held: Duration::from_nanos(held & !KINDS),
                    in_step: held & IN_STEP != 0,
                    in_turn: held & IN_TURN != 0,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hold the idle loop saw counts only for its part inside a wait.
    #[test]
    fn a_wait_is_net_of_the_gaps_inside_it_and_only_of_those() {
        let h = Holds::default();
        h.push(1_000, 5_000);
        h.push(9_000, 10_000);
        assert_eq!(h.within(0, 20_000), 5_000);
        assert_eq!(h.within(3_000, 9_500), 2_500);
        assert_eq!(h.within(5_000, 9_000), 0);
        // Older gaps give way to newer ones, never more than it keeps.
        for k in 0..GAPS as u64 {
            h.push(100_000 + k * 10, 100_000 + k * 10 + 5);
        }
        assert_eq!(h.within(0, 20_000), 0);
    }

    /// Wall time the thread's clock did not count since its last read, and not slept in
    /// the idle loop, is the host's: the part of it inside a wait counts, the part
    /// before the wait began does not, and a sleep of its own is not a hold.
    #[test]
    fn wall_time_the_threads_clock_did_not_count_is_the_hosts_from_the_waits_start() {
        let epoch = Instant::now();
        let ns = |t: Instant| t.duration_since(epoch).as_nanos() as u64;
        let h = Holds::default();
        let clock = ThreadClock::current().expect("clock");
        let read = |h: &Holds| {
            let c = clock.read().expect("read").as_nanos() as u64;
            h.clock_read(ns(Instant::now()), c);
        };
        read(&h);
        let from = Instant::now();
        // Off the CPU for 4 ms, as a host's hold would keep it.
        std::thread::sleep(Duration::from_millis(4));
        let to = Instant::now();
        let held = h.within(ns(from), ns(to));
        assert!((3_500_000..=ns(to) - ns(from)).contains(&held), "{held}");
        // A wait that began 2 ms into it has 2 ms of it, give or take the clock.
        let later = h.within(ns(from) + 2_000_000, ns(to));
        assert!(
            (later + 2_000_000).abs_diff(held) <= 100_000,
            "{later} {held}"
        );
        // The same off-CPU time spent asleep in the idle loop is its own, not the host's.
        read(&h);
        let from = Instant::now();
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_millis(4));
        add(&h.slept_ns, t0.elapsed().as_nanos() as u64);
        let held = h.within(ns(from), ns(Instant::now()));
        assert!(held < 500_000, "{held}");
    }
    /// A thread woken from its sleep that waited for its core behind another thread was
    /// held by the host for that wait, not asleep: a wait to run across it is net of
    /// it, and a short queue (a few µs, any wake-up's) is no hold.
    #[test]
    fn a_wake_up_that_waited_for_its_core_is_the_hosts_hold_not_the_threads_sleep() {
        let h = Holds::default();
        // Woke at 10 ms from a 5 ms sleep whose last 3 ms were a wait for the core.
        assert_eq!(h.woke(10_000_000, 5_000_000, 3_000_000, None), 2_000_000);
        assert_eq!(h.within(6_000_000, 10_000_000), 3_000_000);
        assert_eq!(h.within(0, 7_000_000), 0);
        assert_eq!(h.logged(0, Instant::now()).len(), 1, "a long one is kept");
        // Never more than the sleep; a few µs of queueing is a wake-up's own.
        assert_eq!(h.woke(20_000_000, 1_000_000, 4_000_000, None), 0);
        assert_eq!(h.woke(30_000_000, 1_000_000, 5_000, None), 1_000_000);
        assert_eq!(h.within(29_000_000, 30_000_000), 0);
    }

    /// A sleeping thread rung by a waker is the host's from the ring until it runs: a
    /// wait across that is net of it, once, with any queueing inside it, while a
    /// wake-up of a few µs is no hold; the sleep before the ring is the thread's own.
    #[test]
    fn the_hosts_wake_up_of_a_rung_thread_is_a_hold_counted_once() {
        let h = Holds::default();
        // Asleep 1–10 ms, rung at 9.95 ms, ran at 10 ms: 50 µs the host's.
        assert_eq!(h.woke(10_000_000, 9_000_000, 0, Some(9_950_000)), 9_000_000);
        assert_eq!(h.within(9_900_000, 10_100_000), 50_000);
        assert_eq!(h.within(1_000_000, 9_950_000), 0, "the sleep is its own");
        // Rung at 19.9 ms, 60 µs of it queued behind another thread: 100 µs held, once,
        // and only the queueing taken from the sleep.
        assert_eq!(
            h.woke(20_000_000, 5_000_000, 60_000, Some(19_900_000)),
            4_940_000
        );
        assert_eq!(h.within(19_000_000, 21_000_000), 100_000);
        // Queued longer than the ring says (a ring after the wake-up began): the
        // queueing's span is kept whole.
        assert_eq!(
            h.woke(30_000_000, 5_000_000, 60_000, Some(29_980_000)),
            4_940_000
        );
        assert_eq!(h.within(29_000_000, 31_000_000), 60_000);
        // A wake-up within the host's gap is the wake-up's own.
        assert_eq!(
            h.woke(40_000_000, 5_000_000, 0, Some(39_995_000)),
            5_000_000
        );
        assert_eq!(h.within(39_000_000, 41_000_000), 0);
    }

    /// A hold kept from a long step counts in a wait for the part of it that must lie
    /// inside the wait, on top of the idle loop's gaps: its step read the clock as it
    /// ended, so the clock's measure no longer sees it.
    #[test]
    fn a_wait_is_net_of_the_holds_kept_from_long_steps_inside_it() {
        let h = Holds::default();
        h.log(10_000, 20_000, 6_000, IN_STEP);
        h.push(30_000, 31_000);
        // An idle loop's gap kept is counted from the gaps, not again from what is kept
        // (here kept only, as though the ring of gaps had let it go).
        h.log(40_000, 41_000, 1_000, 0);
        assert_eq!(h.within(0, 50_000), 7_000);
        // 8 of the step's 10 µs inside: at least 4 of its 6 µs held.
        assert_eq!(h.within(12_000, 29_000), 4_000);
        assert_eq!(h.within(21_000, 29_000), 0);
        assert_eq!(h.within(16_000, 18_000), 0);
    }

    /// A hold on the scheduler's way between steps counts in the pCPU's own waits
    /// once, as a gap, and is what a thief's wait for one of its units is net of; a
    /// step's is not (a thief may take a unit from a pCPU in a step), nor an idle
    /// loop's gap.
    #[test]
    fn a_hold_between_steps_counts_once_for_its_own_waits_and_for_a_thiefs() {
        let h = Holds::default();
        h.push_turn(1_000_000, 1_600_000);
        h.log(3_000_000, 4_000_000, 1_000_000, IN_STEP);
        h.push(5_000_000, 5_300_000);
        assert_eq!(h.within(0, 6_000_000), 1_900_000);
        assert_eq!(h.in_turns(0, 6_000_000), 600_000);
        assert_eq!(h.in_turns(1_300_000, 6_000_000), 300_000);
        assert_eq!(h.in_turns(2_000_000, 6_000_000), 0);
        let kept = h.logged(0, Instant::now());
        assert!(kept[0].in_turn && !kept[0].in_step, "{kept:?}");
        assert!(kept[1].in_step && !kept[1].in_turn, "{kept:?}");
        assert!(!kept[2].in_step && !kept[2].in_turn, "{kept:?}");
    }

    /// An idle peer held as a wait is accounted counts from its last look, with the
    /// gaps it kept taken once.
    #[test]
    fn an_idle_peer_held_now_counts_from_its_last_look_and_its_kept_gaps_once() {
        let h = Holds::default();
        h.push(2_000, 3_000);
        // Not spinning (running a unit, asleep): only what it kept.
        assert_eq!(h.held_idle(0, 100_000), 1_000);
        // Spinning, its last look 5 µs ago: it has its core.
        h.looked(95_000);
        assert_eq!(h.held_idle(0, 100_000), 1_000);
        // Its last look 60 µs ago: held since then, and still.
        h.looked(40_000);
        assert_eq!(h.held_idle(0, 100_000), 1_000 + 60_000);
        assert_eq!(
            h.held_idle(50_000, 100_000),
            50_000,
            "from the wait's start"
        );
        // Back, it keeps the gap as it looks again; a peer that read the old look
        // meanwhile takes the gaps up to it only, so the hold counts once.
        h.push(40_000, 100_000);
        assert_eq!(h.held_idle(0, 100_000), 1_000 + 60_000);
        h.looked(100_000);
        assert_eq!(h.held_idle(0, 100_000), 1_000 + 60_000);
        h.left_idle();
        assert_eq!(h.held_idle(0, 100_000), 1_000 + 60_000);
    }

    /// A hold between two clock reads that no gap or step kept (on the way from a step
    /// to the next read) is kept by the read after it, so that a peer's wait that began
    /// before that read still sees it; a gap the idle loop kept in it counts once.
    #[test]
    fn a_hold_only_the_next_clock_read_saw_is_kept_by_it_and_counted_once() {
        let h = Holds::default();
        h.rebase(1_000_000, 1_000_000);
        // 2 ms later the clock has counted 0.5 ms: 1.5 ms off the CPU, none kept.
        h.clock_read(3_000_000, 1_500_000);
        assert_eq!(h.seen(1_500_000, 3_200_000), 1_500_000 - 500_000);
        assert_eq!(h.logged(0, Instant::now()).len(), 1);
        // 3 ms with 0.5 ms counted, 1 ms of it a gap the idle loop kept: the other
        // 1.5 ms kept by the read, the gap not twice.
        h.push(4_000_000, 5_000_000);
        h.clock_read(6_000_000, 2_000_000);
        assert_eq!(h.seen(3_000_000, 6_000_000), 1_000_000 + 1_500_000);
        // Off the CPU less than a long hold: nothing more kept.
        h.clock_read(6_200_000, 2_000_000);
        assert_eq!(h.logged(0, Instant::now()).len(), 3);
    }

    /// Holds long enough to empty a device's ring are kept with their times, from the
    /// idle loop's gaps and from steps the host held, the newest over the oldest; a
    /// short gap or a step the thread ran through is not.
    #[test]
    fn long_holds_are_kept_with_their_times_and_short_ones_are_not() {
        let epoch = Instant::now();
        let ns = |t: Instant| t.duration_since(epoch).as_nanos() as u64;
        let h = Holds::default();
        h.push(1_000, 1_000 + HOST_GAP.as_nanos() as u64 * 2);
        h.push(10_000, 10_000 + HOLD_LOGGED.as_nanos() as u64);
        let kept = h.logged(3, epoch);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].pcpu, 3);
        assert_eq!(kept[0].from, epoch + Duration::from_nanos(10_000));
        assert_eq!(kept[0].held, HOLD_LOGGED);
        assert!(!kept[0].in_step);
        // A step off the CPU for 4 ms (as a host's hold keeps it) is kept; one that
        // spins through 1 ms on its core is not.
        let clock = ThreadClock::current().expect("clock");
        h.clock_read(
            ns(Instant::now()),
            clock.read().expect("read").as_nanos() as u64,
        );
        let from = Instant::now();
        std::thread::sleep(Duration::from_millis(4));
        h.long_step(ns(from), ns(Instant::now()));
        let from = Instant::now();
        while from.elapsed() < Duration::from_millis(1) {
            std::hint::spin_loop();
        }
        let before_spin = h.logged(0, epoch).len();
        h.long_step(ns(from), ns(Instant::now()));
        // (A busy host may hold the spin too; then it is rightly kept as well.)
        let kept = h.logged(0, epoch);
        assert_eq!(before_spin, 2);
        let step = kept[1];
        assert!(step.in_step);
        assert!(step.held >= Duration::from_micros(3_500), "{step:?}");
        assert!(step.held <= step.to - step.from, "{step:?}");
        for k in 0..HOLD_LOG as u64 {
            h.push(
                1_000_000_000 + k * 1_000_000,
                1_000_000_000 + k * 1_000_000 + 500_000,
            );
        }
        let kept = h.logged(0, epoch);
        assert_eq!(kept.len(), HOLD_LOG);
        assert!(kept
            .iter()
            .all(|k| !k.in_step && k.held == Duration::from_micros(500)));
    }
}
