//! Work stealing for devices' engines: a pCPU with nothing of its own to run takes a
//! turn of a stealable unit ([`UnitSpec::stealable`]) whose own pCPU is in another
//! unit's step, so that a device does not wait behind a vCPU while a core idles.
//!
//! The unit stays its own pCPU's: its slot, its IPI bit, its deadline and its
//! accounting are there. The thief, under that pCPU's table lock, takes only the
//! stealable units' IPI bits (a vCPU's wake-up stays for its own pCPU), expires only
//! their deadlines, marks the unit it takes *away* (its own pCPU does not pick it, and
//! a wake-up meanwhile leaves it runnable), runs one turn on its own thread, and puts
//! it back as the turn ended: runnable again (its own pCPU's IPI bit set, so that it or
//! a thief runs it), idle with its deadline unless woken meanwhile, or ended.
//!
//! An idle pCPU learns of such work from hints its peers publish under their locks (the
//! stealable units left runnable as a step starts, the earliest deadline of an idle
//! one) and from their IPI words, looked at as it spins; a pCPU asleep in the host does
//! not steal.
//!
//! A pCPU whose thread the host holds off its core is covered the same way, for every
//! unit that may move ([`UnitSpec::movable`]: vCPUs too, as Xen's soft affinity lets a
//! vCPU run on another pCPU rather than not at all). A pCPU with its core takes a
//! wake-up from its IPI word within a few hundred ns as it spins; one that is neither
//! in a step nor asleep, leaves a wake-up there and takes none for [`HELD_AFTER`] is not
//! running, and an idle peer that saw it so takes its movable units' wake-ups.

use super::*;

/// How long a pCPU that is neither in a step nor asleep may leave a wake-up of a
/// movable unit in its IPI word (or a device's deadline past), taking no other wake-up
/// meanwhile, before an idle peer takes it as held off its core by the host and runs
/// the unit.
pub const HELD_AFTER: Duration = Duration::from_micros(20);

/// A pCPU's peers (itself among them), and what it has seen of each as it looked: since
/// when the peer, out of its steps and awake, has left work untaken, and the count of
/// wake-ups it had taken then; and the span over which it last found the peer's table
/// locked in one of the peer's own turns ([`found_locked`]).
#[derive(Debug)]
pub(super) struct Peers<'a> {
    all: &'a [Arc<PcpuShared>],
    untaken: Vec<Option<(Instant, u64)>>,
    locked: Vec<Option<(u64, u64)>>,
    /// When its spin last looked whether a peer is held.
    held_look: Instant,
}

/// How often a spinning pCPU looks whether a peer is held ([`held`]): a look reads the
/// peer's IPI word, whose line every wake-up of the peer then has to take back, so it is
/// made a few times per [`HELD_AFTER`], not at every [`STEAL_LOOK`].
pub const HELD_LOOK: Duration = Duration::from_micros(10);

impl<'a> Peers<'a> {
    /// `all`, nothing seen of them yet.
    pub(super) fn new(all: &'a [Arc<PcpuShared>]) -> Self {
        Self {
            all,
            untaken: vec![None; all.len()],
            locked: vec![None; all.len()],
            held_look: Instant::now(),
        }
    }
}

/// Whether pCPU `q` looks held by the host: out of its steps and awake, with a wake-up
/// of a movable unit in its IPI word (or a device's deadline past), and no wake-up
/// taken by its own thread (its count of takes unchanged) for [`HELD_AFTER`] since the
/// watcher first saw it so (`seen`). The watcher may look with gaps (its own steps
/// between): a pCPU with its core takes a wake-up within a few hundred ns, and one it
/// took shows in the count. (Thieves' takes of its devices' wake-ups, every few µs at
/// the wire's pace, must not count: they would hide a held owner from its watcher.)
fn held(q: &PcpuShared, now: Instant, seen: &mut Option<(Instant, u64)>) -> bool {
    let untaken = !q.steal.busy.load(Ordering::Acquire)
        && !q.sleeping.load(Ordering::Acquire)
        && !q.stop.load(Ordering::Relaxed)
        && ((0..WORDS).any(|w| {
            q.ipi[w].load(Ordering::Relaxed) & q.steal.movable[w].load(Ordering::Relaxed) != 0
        }) || due(q, now));
    if !untaken {
        *seen = None;
        return false;
    }
    let taken = q.stats.took.load(Ordering::Relaxed);
    match *seen {
        Some((since, n)) if n == taken => now.saturating_duration_since(since) >= HELD_AFTER,
        _ => {
            *seen = Some((now, taken));
            false
        }
    }
}

/// The span a thief that found a peer's table locked at `at` (ns since the peer's
/// epoch) knows the peer's thread held it: from the start of the peer's turn then
/// (`turn`, its [`PcpuShared::turn_ns`]; 0 when the lock was not its own thread's
/// turn's) to `at`. The thread has its table a few hundred ns a turn with its core, so
/// a span past [`HOST_GAP`] is the host's hold of it, all of it (as [`between`] counts
/// a gap); a shorter one is none.
pub(super) fn found_locked(turn: u64, at: u64) -> Option<(u64, u64)> {
    (turn != 0 && holds::hosts(Duration::from_nanos(at.saturating_sub(turn))) > 0)
        .then_some((turn, at))
}

/// Whether the earliest deadline of `q`'s idle stealable units (its hint) has passed
/// by `now`. A pCPU spinning idle leaves its spin at its earliest deadline; one whose
/// hint stays past is held, or its hint is stale (a thief's look refreshes it).
fn due(q: &PcpuShared, now: Instant) -> bool {
    let due = q.steal.due.load(Ordering::Acquire);
    due != u64::MAX && now.saturating_duration_since(q.epoch).as_nanos() as u64 >= due
}

/// Whether pCPU `q` is running units with a stealable one waiting (runnable, woken, or
/// its deadline passed by `now`). Its busy flag, not its step's start, says it runs: the
/// flag is written only as it goes idle and comes back, the step's start at every step.
fn wanted(q: &PcpuShared, now: Instant) -> bool {
    if !q.steal.busy.load(Ordering::Acquire) || q.stop.load(Ordering::Relaxed) {
        return false;
    }
    if due(q, now) {
        return true;
    }
    (0..WORDS).any(|w| {
        let mine = q.steal.stealable[w].load(Ordering::Relaxed);
        mine != 0
            && (q.ipi[w].load(Ordering::Relaxed) | q.steal.waiting[w].load(Ordering::Relaxed))
                & mine
                != 0
    })
}

/// Whether a pCPU other than `me` has a device's engine waiting while it is in a step,
/// or looks held by the host with a movable unit woken.
pub(super) fn wanted_by(me: &PcpuShared, peers: &mut Peers<'_>, now: Instant) -> bool {
    let look_held = now.saturating_duration_since(peers.held_look) >= HELD_LOOK;
    if look_held {
        peers.held_look = now;
    }
    let mut any = false;
    for (q, seen) in peers.all.iter().zip(&mut peers.untaken) {
        if !std::ptr::eq(&**q, me) {
            // Every peer is looked at, so that each one's watch is kept.
            any |= (look_held && held(q, now, seen)) || wanted(q, now);
        }
    }
    any
}

/// Runs one turn of a stealable unit of another pCPU that is in a step, or of a movable
/// unit of one the host holds, if one waits and that pCPU's table is free this instant.
/// Returns when the turn's last step ended, if it ran one: the way on from there is
/// the scheduler's, and a hold in it the host's ([`between`]).
pub(super) fn try_steal(
    me: &PcpuShared,
    peers: &mut Peers<'_>,
    binding: &mut Option<SlotBinding>,
) -> Option<Instant> {
    let now = Instant::now();
    let peers_at = peers
        .all
        .iter()
        .zip(&mut peers.untaken)
        .zip(&mut peers.locked);
    for ((q, seen), locked) in peers_at {
        if std::ptr::eq(&**q, me) {
            continue;
        }
        let held = held(q, now, seen);
        if !held && !wanted(q, now) {
            continue;
        }
        // Its own thread holds the lock only between steps: if it is taken, the pCPU is
        // choosing what to run next, which may be the engine. (A thread the host holds
        // with the lock taken keeps its units; a long turn found so is the host's.)
        let Ok(mut t) = q.table.try_lock() else {
            let at = now.saturating_duration_since(q.epoch).as_nanos() as u64;
            // Read after the failed try: on a machine whose locked instructions are
            // fences (x86), a turn's end (its clear before the unlock) shows here.
            *locked = found_locked(q.turn_ns.load(Ordering::Acquire), at).or(*locked);
            continue;
        };
        let locked = locked.take();
        // Only the wake-ups of stealable units in the table (of movable ones, if the
        // host holds the pCPU): a vCPU's, or those of a unit its own pCPU is running,
        // stay for that pCPU.
        let units = if held {
            &q.steal.movable
        } else {
            &q.steal.stealable
        };
        let mut mask = [0u64; WORDS];
        for (w, m) in mask.iter_mut().enumerate() {
            *m = t.present(w, units[w].load(Ordering::Relaxed));
            if *m != 0 {
                let bits = q.ipi[w].fetch_and(!*m, Ordering::SeqCst) & *m;
                t.wake_units(q, w, bits, now, None);
            }
        }
        t.expire_deadlines_of(now, mask);
        let pick = (0..WORDS).find_map(|w| {
            let bits = t.runnable[w] & mask[w] & !t.over_cap[w];
            (bits != 0).then(|| w * 64 + bits.trailing_zeros() as usize)
        });
        let Some(i) = pick else {
            t.publish_steal_hints(q);
            continue;
        };
        let (w, bit) = (i / 64, 1u64 << (i % 64));
        t.runnable[w] &= !bit;
        t.away[w] |= bit;
        let woken = t.woken[i].take();
        let generation = t.generation;
        let Some(mut e) = t.units[i].take() else {
            t.away[w] &= !bit;
            continue;
        };
        if let Some((from, to)) = locked {
            // Its wait to run may lie in it.
            e.stats().held_locked(from, to);
        }
        // Units it woke and does not run go back into the IPI word: their pCPU, idle
        // in its spin (the host let it go, or it went idle as the thief looked), watches
        // the word, not its table.
        for (ww, m) in mask.iter().enumerate() {
            let rest = t.runnable[ww] & m & !t.away[ww];
            if rest != 0 {
                q.ipi[ww].fetch_or(rest, Ordering::SeqCst);
            }
        }
        t.publish_steal_hints(q);
        // A pCPU running another's unit is busy: its own wake-ups wait for it as they
        // would behind its own step, and no peer takes it for held meanwhile. Marked
        // before the peer's table is free, as an owner marks itself before its step.
        if !me.steal.busy.load(Ordering::Relaxed) {
            me.steal.busy.store(true, Ordering::Release);
        }
        drop(t);
        if held {
            q.stats.covered.fetch_add(1, Ordering::Relaxed);
        }
        let turn = Instant::now();
        let (out, ran, end) = run_sampled(me, q, peers.all, binding, &mut *e, woken);
        e.stats().stolen.fetch_add(1, Ordering::Relaxed);
        put_back(
            me,
            q,
            i,
            e,
            Turn {
                out,
                ran,
                from: turn,
                end,
            },
            generation,
        );
        return Some(end);
    }
    None
}

/// A unit's turn on a thief's thread: what its last step said, the time it ran, when
/// the turn began and when its last step ended.
struct Turn {
    out: StepOut,
    ran: u64,
    from: Instant,
    end: Instant,
}

/// Unit `i` of pCPU `q` back from a `turn` on thief `me`'s thread.
///
/// The host may have held the thief's thread off its core with the unit on it, in a
/// step or after it: the unit could run nowhere else meanwhile, so a wait of it that
/// began then is the host's for as long as the hold lasted. A turn long enough to have
/// had one ([`HOLD_LOOK`]) has the hold measured by the thief, as its gaps and long
/// steps show, and kept with the unit ([`UnitStats::held_away`]) before the unit is
/// back in its table, where whoever runs it next reads it.
fn put_back(
    me: &PcpuShared,
    q: &PcpuShared,
    i: usize,
    mut e: Box<dyn Erased>,
    turn: Turn,
    generation: u64,
) {
    let Turn {
        out,
        ran,
        from,
        end: ended,
    } = turn;
    let (w, bit) = (i / 64, 1u64 << (i % 64));
    let mut t = lock(&q.table);
    let now = Instant::now();
    if now.saturating_duration_since(from) >= HOLD_LOOK {
        let ns = |t: Instant| t.saturating_duration_since(me.epoch).as_nanos() as u64;
        // From the step's end to here is a few hundred ns with the core (a lock its
        // owner holds for as long): a longer gap is the host's, the unit in hand (kept
        // in the thief's own gaps later, with the rest of its way to its next pick).
        // No clock read here, with the unit and the table held: a hold at its return
        // would not be in what it measured.
        let after = holds::hosts(now.saturating_duration_since(ended));
        let held = me.holds.seen(ns(from), ns(ended)) + after;
        e.stats().held_away(ns(from), ns(now), held);
    }
    t.away[w] &= !bit;
    if q.stop.load(Ordering::Acquire) && t.generation != generation {
        // The scheduler stopped and gave up the table's units while this one was away.
        drop(t);
        match out {
            StepOut::Ended => e.finish(),
            _ => e.fail("the scheduler stopped before the unit ended".into()),
        }
        return;
    }
    t.charge_cap(i, &*e, ran);
    match out {
        StepOut::More | StepOut::Cut | StepOut::Yield => {
            // It had more work, woken or not: no wait from idle (as on its own pCPU).
            t.runnable[w] |= bit;
            t.woken[i] = None;
        }
        StepOut::Idle(d) if t.runnable[w] & bit == 0 => t.idle_after_step(i, d, ended),
        // A wake-up while it was away left it runnable: it runs again, and waits from
        // the end of the step it was woken in.
        StepOut::Idle(_) => t.woken_in_step(i, ended),
        StepOut::Ended => {
            t.end(q, i);
            t.publish_steal_hints(q);
            drop(t);
            e.finish();
            return;
        }
    }
    let runnable = t.runnable[w] & bit != 0;
    let timed = t.timed[w] & bit != 0;
    t.publish_steal_hints(q);
    // Held here, with the table locked and the unit not yet signalled, its own pCPU
    // (spinning idle with its core) could not have run it: a wait that lies in the
    // hold is the host's, kept with the unit before it is free to run (the way from the
    // lock to here is a few hundred ns with the core).
    let signal = Instant::now();
    if holds::hosts(signal.saturating_duration_since(now)) > 0 {
        let ns = |t: Instant| t.saturating_duration_since(q.epoch).as_nanos() as u64;
        e.stats().held_locked(ns(now), ns(signal));
    }
    t.units[i] = Some(e);
    // Signalled before the table is free: a hold of this thread after it (the unlock
    // may be a system call, where the host takes a thread off its core) must not keep
    // the unit's own pCPU, spinning idle with its core, from seeing it.
    if runnable {
        // Its own pCPU, or a thief, runs it next.
        q.ipi[w].fetch_or(bit, Ordering::SeqCst);
    } else if timed {
        // Its own pCPU may have gone idle meanwhile, waiting for the deadlines it knew:
        // it looks again.
        q.steal.retime.store(true, Ordering::SeqCst);
    } else {
        return;
    }
    drop(t);
    // One asleep is woken.
    if q.sleeping.load(Ordering::SeqCst) {
        q.stats.host_wakes.fetch_add(1, Ordering::Relaxed);
        wake_thread(q);
    }
}
