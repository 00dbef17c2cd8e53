//! A vif's transmit rate: the toolstack's `rate` key (`xl`'s `rate=` in a vif spec),
//! served as Linux's netback serves it, by credit.
//!
//! The key, in the back end's directory, is `<bytes>,<microseconds>`: so many bytes of
//! the guest's packets a period. A period's credit is added when the period has passed
//! (a fresh period starts then), up to a burst of `max(128 KiB, bytes)`; a packet goes
//! when its size fits the credit left and spends it. One that does not waits, on the
//! ring, for the next period ([`Credit::due`]): the guest's TX is held back, nothing is
//! dropped. The key is the toolstack's: a guest cannot write it.

use std::time::{Duration, Instant};

/// Credit a period's addition may build up to at least (Linux's 131072-byte burst):
/// enough for the largest packet, so that every packet can go in time.
const MIN_BURST: u64 = 128 * 1024;

/// The credit of one vif's transmit side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    /// Bytes a period adds.
    bytes: u64,
    period: Duration,
    /// Bytes that may still go in this period.
    remaining: u64,
    /// When this period began.
    start: Instant,
    /// The last packet looked at did not fit.
    waiting: bool,
}

impl Credit {
    /// The rate a `rate` key gives (`"<bytes>,<microseconds>"`, both positive), its
    /// first period starting at `now` with a period's credit; `None` for anything else
    /// (the vif then goes unlimited, as Linux's does).
    pub fn parse(v: &str, now: Instant) -> Option<Self> {
        let (b, us) = v.trim().split_once(',')?;
        let bytes: u64 = b.trim().parse().ok().filter(|&b| b > 0)?;
        let us: u64 = us.trim().parse().ok().filter(|&u| u > 0)?;
        Some(Self {
            bytes,
            period: Duration::from_micros(us),
            remaining: bytes,
            start: now,
            waiting: false,
        })
    }

    /// Bytes a period adds, and the period.
    pub fn rate(&self) -> (u64, Duration) {
        (self.bytes, self.period)
    }

    /// Whether a packet of `size` bytes may go at `now`, spending its size if so. A
    /// period that has passed adds its credit first.
    pub fn admit(&mut self, size: u64, now: Instant) -> bool {
        if now >= self.due() {
            self.start = now;
            let burst = self.bytes.max(MIN_BURST);
            self.remaining = self.remaining.saturating_add(self.bytes).min(burst);
        }
        self.waiting = size > self.remaining;
        if self.waiting {
            return false;
        }
        self.remaining -= size;
        true
    }

    /// When a packet that did not fit may be looked at again (the next period), if one
    /// is waiting.
    pub fn waiting_until(&self) -> Option<Instant> {
        self.waiting.then(|| self.due())
    }

    /// When the next period's credit comes.
    pub fn due(&self) -> Instant {
        self.start + self.period
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_two_positive_numbers_make_a_rate() {
        let now = Instant::now();
        let c = Credit::parse("125000,50000", now).expect("10 Mbit/s in 50 ms periods");
        assert_eq!(c.rate(), (125_000, Duration::from_millis(50)));
        for bad in [
            "",
            "1",
            "0,5",
            "5,0",
            "-1,5",
            "1,2,3",
            "x,1",
            "18446744073709551616,1",
        ] {
            assert_eq!(Credit::parse(bad, now), None, "{bad:?}");
        }
    }

    #[test]
    fn a_period_lets_its_bytes_go_and_the_next_adds_up_to_the_burst() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut c = Credit::parse("3000,10000", t0).expect("3000 bytes a 10 ms period");
        assert!(c.admit(1500, t0) && c.admit(1500, ms(1)));
        assert!(!c.admit(1, ms(9)), "spent until the period ends");
        assert_eq!(c.waiting_until(), Some(ms(10)));
        assert!(c.admit(3000, ms(10)), "the next period's credit");
        assert_eq!(c.waiting_until(), None);
        assert!(!c.admit(1, ms(19)));
        // A long idle adds one period's credit, not one for each period missed.
        assert!(!c.admit(3001, ms(1000)));
        assert!(c.admit(3000, ms(1000)));
        // Credit builds up to the burst (128 KiB), no further.
        let mut idle = Credit::parse("100000,1000", t0).expect("rate");
        for n in 1..=10 {
            idle.admit(0, t0 + Duration::from_millis(n));
        }
        assert!(idle.admit(MIN_BURST, ms(20)));
        assert!(!idle.admit(1, ms(20)), "no more than the burst");
        // A rate above the burst lets a period's bytes go at once.
        let mut big = Credit::parse("1000000,1000", t0).expect("rate");
        assert!(big.admit(1_000_000, t0));
    }
}
