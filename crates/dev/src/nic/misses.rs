//! The NIC's frames dropped for want of a descriptor, in bursts with their times, so
//! that a run's losses can be laid beside the host's holds of the pCPUs' threads
//! (`hv::sched::Scheduler::host_holds`) and each missed frame said to be the host's or
//! not: a ring runs dry when the unit that posts its buffers does not run, and a unit
//! in a step the host holds cannot run anywhere.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hv::sched::HostHold;

/// Misses this close together are one burst: a ring that ran dry drops a frame every
/// few µs at the papers' rates.
pub const MISS_BURST_GAP: Duration = Duration::from_micros(200);

/// How long after a hold ends a missed frame is still its: the released thread runs
/// the step it was held in to its end and the consumer posts buffers in its next poll,
/// tens of µs on a core of its own.
pub const MISS_AFTER_HOLD: Duration = Duration::from_micros(250);

/// Bursts kept, the newest over the oldest.
const MISS_LOG: usize = 256;

/// The device's missed frames in bursts: first and last miss (ns since `epoch`) and the
/// frames. Written by the device's engine only (one turn at a time, wherever it runs).
#[derive(Debug)]
pub struct MissLog {
    epoch: Instant,
    bursts: AtomicU64,
    log: Box<[[AtomicU64; 3]]>,
}

/// A burst of missed frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissBurst {
    /// Its first miss.
    pub from: Instant,
    /// Its last.
    pub to: Instant,
    /// Frames missed in it.
    pub frames: u64,
}

impl Default for MissLog {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            bursts: AtomicU64::new(0),
            log: (0..MISS_LOG).map(|_| Default::default()).collect(),
        }
    }
}

impl MissLog {
    /// A frame missed at `at`.
    pub fn note(&self, at: Instant) {
        let t = at.saturating_duration_since(self.epoch).as_nanos() as u64;
        let n = self.bursts.load(Ordering::Relaxed);
        if n > 0 {
            let b = &self.log[(n - 1) as usize % MISS_LOG];
            let last = b[1].load(Ordering::Relaxed);
            if t.saturating_sub(last) <= MISS_BURST_GAP.as_nanos() as u64 {
                b[1].store(t.max(last), Ordering::Relaxed);
                b[2].store(b[2].load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                return;
            }
        }
        let b = &self.log[n as usize % MISS_LOG];
        b[0].store(t, Ordering::Relaxed);
        b[1].store(t, Ordering::Relaxed);
        b[2].store(1, Ordering::Relaxed);
        self.bursts.store(n + 1, Ordering::Relaxed);
    }

    /// The bursts kept, oldest first.
    pub fn bursts(&self) -> Vec<MissBurst> {
        let n = self.bursts.load(Ordering::Relaxed);
        (n.saturating_sub(MISS_LOG as u64)..n)
            .map(|k| {
                let b = &self.log[k as usize % MISS_LOG];
                let at = |i: usize| self.epoch + Duration::from_nanos(b[i].load(Ordering::Relaxed));
                MissBurst {
                    from: at(0),
                    to: at(1),
                    frames: b[2].load(Ordering::Relaxed),
                }
            })
            .collect()
    }
}

/// The frames of `bursts` that fell while the host held a pCPU's thread (`holds`,
/// each taken to last [`MISS_AFTER_HOLD`] past its end): a burst inside the holds
/// counts whole, one partly inside for that part of its frames (spread evenly over
/// it), one outside not at all. A frame missed in a burst the log no longer has is not
/// counted: what is not shown to be the host's is not said to be.
pub fn in_holds(bursts: &[MissBurst], holds: &[HostHold]) -> u64 {
    let mut spans: Vec<(Instant, Instant)> = holds
        .iter()
        .map(|h| (h.from, h.to + MISS_AFTER_HOLD))
        .collect();
    spans.sort();
    let mut merged: Vec<(Instant, Instant)> = Vec::with_capacity(spans.len());
    for (a, b) in spans {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    bursts
        .iter()
        .map(|m| {
            let len = m.to.saturating_duration_since(m.from);
            let inside: Duration = merged
                .iter()
                .map(|&(a, b)| b.min(m.to).saturating_duration_since(a.max(m.from)))
                .sum();
            let point_inside = merged.iter().any(|&(a, b)| a <= m.from && m.to <= b);
            if point_inside {
                m.frames
            } else if len.is_zero() {
                0
            } else {
                (m.frames as u128 * inside.as_nanos() / len.as_nanos()) as u64
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(from: Instant, to: Instant) -> HostHold {
        HostHold {
            pcpu: 1,
            from,
            to,
            held: to - from,
            in_step: true,
            in_turn: false,
        }
    }

    /// Misses close together make one burst, a pause past the gap a new one.
    #[test]
    fn misses_close_together_are_one_burst() {
        let log = MissLog::default();
        let t = Instant::now();
        for k in 0..10 {
            log.note(t + Duration::from_micros(12 * k));
        }
        log.note(t + Duration::from_millis(5));
        let b = log.bursts();
        assert_eq!(b.len(), 2);
        assert_eq!(b[0].frames, 10);
        assert_eq!(b[0].to - b[0].from, Duration::from_micros(108));
        assert_eq!(b[1].frames, 1);
    }

    /// A burst inside a hold (or just after it) is the host's; one away from every hold
    /// is not; one half in a hold counts half its frames.
    #[test]
    fn a_missed_frame_is_the_hosts_only_inside_a_hold_or_just_after() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let burst = |a: Instant, b: Instant, frames| MissBurst {
            from: a,
            to: b,
            frames,
        };
        let holds = [hold(ms(10), ms(14)), hold(ms(100), ms(101))];
        // Inside the first hold, and a single miss just after it ends.
        assert_eq!(in_holds(&[burst(ms(13), ms(14), 80)], &holds), 80);
        let just_after = ms(14) + MISS_AFTER_HOLD / 2;
        assert_eq!(in_holds(&[burst(just_after, just_after, 1)], &holds), 1);
        // Away from both.
        assert_eq!(in_holds(&[burst(ms(50), ms(51), 80)], &holds), 0);
        // Half of it inside the second hold's span (which ends MISS_AFTER_HOLD late).
        let end = ms(101) + MISS_AFTER_HOLD;
        let b = burst(
            end - Duration::from_millis(1),
            end + Duration::from_millis(1),
            100,
        );
        assert_eq!(in_holds(&[b], &holds), 50);
        // Overlapping holds of two pCPUs count once.
        let twice = [hold(ms(10), ms(14)), hold(ms(12), ms(16))];
        assert_eq!(in_holds(&[burst(ms(11), ms(15), 40)], &twice), 40);
        assert_eq!(in_holds(&[], &holds), 0);
        assert_eq!(in_holds(&[burst(ms(13), ms(14), 80)], &[]), 0);
    }
}
