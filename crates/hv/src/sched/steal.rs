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

use super::*;

/// Whether pCPU `q` is running units with a stealable one waiting (runnable, woken, or
/// its deadline passed by `now`). Its busy flag, not its step's start, says it runs: the
/// flag is written only as it goes idle and comes back, the step's start at every step.
fn wanted(q: &PcpuShared, now: Instant) -> bool {
    if !q.steal.busy.load(Ordering::Acquire) || q.stop.load(Ordering::Relaxed) {
        return false;
    }
    let due = q.steal.due.load(Ordering::Acquire);
    if due != u64::MAX && now.saturating_duration_since(q.epoch).as_nanos() as u64 >= due {
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

/// Whether a pCPU other than `me` has a device's engine waiting while it is in a step.
pub(super) fn wanted_by(me: &PcpuShared, peers: &[Arc<PcpuShared>], now: Instant) -> bool {
    peers
        .iter()
        .any(|q| !std::ptr::eq(&**q, me) && wanted(q, now))
}

/// Runs one turn of a stealable unit of another pCPU that is in a step, if one waits
/// and that pCPU's table is free this instant. Returns whether it ran one.
pub(super) fn try_steal(
    me: &PcpuShared,
    peers: &[Arc<PcpuShared>],
    binding: &mut Option<SlotBinding>,
) -> bool {
    let now = Instant::now();
    for q in peers.iter().filter(|q| !std::ptr::eq(&***q, me)) {
        if !wanted(q, now) {
            continue;
        }
        // Its own thread holds the lock only between steps: if it is taken, the pCPU is
        // choosing what to run next, which may be the engine.
        let Ok(mut t) = q.table.try_lock() else {
            continue;
        };
        // Only the wake-ups of stealable units in the table: a vCPU's, or those of a
        // unit its own pCPU is running, stay for that pCPU.
        let mut mask = [0u64; WORDS];
        for (w, m) in mask.iter_mut().enumerate() {
            *m = t.present(w, q.steal.stealable[w].load(Ordering::Relaxed));
            if *m != 0 {
                let bits = q.ipi[w].fetch_and(!*m, Ordering::SeqCst) & *m;
                t.wake_units(q, w, bits, now);
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
        t.publish_steal_hints(q);
        drop(t);
        let (out, ran, _) = run_sampled(me, binding, &mut *e, woken);
        e.stats().stolen.fetch_add(1, Ordering::Relaxed);
        put_back(q, i, e, out, ran, generation);
        return true;
    }
    false
}

/// Unit `i` of pCPU `q` back from a turn on a thief's thread, as the turn ended.
fn put_back(
    q: &PcpuShared,
    i: usize,
    mut e: Box<dyn Erased>,
    out: StepOut,
    ran: u64,
    generation: u64,
) {
    let (w, bit) = (i / 64, 1u64 << (i % 64));
    let mut t = lock(&q.table);
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
        StepOut::More | StepOut::Yield => t.runnable[w] |= bit,
        // A wake-up while it was away left it runnable: it runs again.
        StepOut::Idle(d) if t.runnable[w] & bit == 0 => {
            t.idle[w] |= bit;
            t.set_deadline(i, d);
        }
        StepOut::Idle(_) => {}
        StepOut::Ended => {
            t.end(q, i);
            t.publish_steal_hints(q);
            drop(t);
            e.finish();
            return;
        }
    }
    t.units[i] = Some(e);
    let runnable = t.runnable[w] & bit != 0;
    let timed = t.timed[w] & bit != 0;
    t.publish_steal_hints(q);
    drop(t);
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
    // One asleep is woken.
    if q.sleeping.load(Ordering::SeqCst) {
        q.stats.host_wakes.fetch_add(1, Ordering::Relaxed);
        wake_thread(q);
    }
}
