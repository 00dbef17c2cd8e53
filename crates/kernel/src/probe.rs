//! Raw-frame probes above a guest's network driver, paper 002's `psapp`: a client sends
//! a 64-byte frame to its server, which echoes it back, and the client times the round
//! trip; then it waits a random time (the paper's 0 to 100 ms) and sends the next. The
//! frames are handed straight to the driver, with no stack in the way.
//!
//! A probe carries its sequence number and a pattern derived from it in every byte; the
//! client checks every byte of each echo.
//!
//! A flood ([`FloodSpec`]) sends frames of the same pattern one way, as fast as the
//! driver takes them or at an offered rate that may change while it runs (paper 002's
//! Figure 10 senders); whoever receives them checks every byte ([`verify`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::wire::Samples;

/// The probes' EtherType (IEEE's local experimental one).
pub const ETHERTYPE: u16 = 0x88b5;
/// A probe's length: the paper's 64-byte frames (without the FCS).
pub const PROBE_LEN: usize = 60;
/// A probe not echoed within this is counted lost and the next one sent.
pub const LOST_AFTER: Duration = Duration::from_secs(1);

/// What a client counted.
#[derive(Debug, Default)]
pub struct ProbeCounters {
    /// Probes sent.
    pub sent: AtomicU64,
    /// Echoes received and checked.
    pub echoed: AtomicU64,
    /// Echoes with a wrong byte.
    pub corrupt: AtomicU64,
    /// Probes not echoed within [`LOST_AFTER`].
    pub lost: AtomicU64,
    /// Frames that were not an echo of the probe in flight.
    pub stray: AtomicU64,
}

/// A client's set-up.
#[derive(Debug, Clone)]
pub struct ProbeSpec {
    /// Its own MAC.
    pub me: [u8; 6],
    /// Its server's MAC.
    pub peer: [u8; 6],
    /// The longest random wait between an echo and the next probe.
    pub max_gap: Duration,
    /// The random waits' seed.
    pub seed: u64,
    /// Where each round trip goes, in ns.
    pub rtts: Arc<Samples>,
    /// Its counters.
    pub counters: Arc<ProbeCounters>,
}

/// Byte `i` of probe `seq`.
fn pattern(seq: u32, i: usize) -> u8 {
    (seq as u8)
        .wrapping_mul(31)
        .wrapping_add(i as u8)
        .rotate_left(3)
}

/// Probe `seq` from `me` to `peer`.
pub fn probe(me: [u8; 6], peer: [u8; 6], seq: u32) -> [u8; PROBE_LEN] {
    let mut f = [0u8; PROBE_LEN];
    f[..6].copy_from_slice(&peer);
    f[6..12].copy_from_slice(&me);
    f[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
    f[14..18].copy_from_slice(&seq.to_be_bytes());
    for (i, b) in f.iter_mut().enumerate().skip(18) {
        *b = pattern(seq, i);
    }
    f
}

/// The sequence number of a probe or flood frame of any length whose every byte is
/// as sent; `None` for anything else.
pub fn verify(frame: &[u8]) -> Option<u32> {
    if frame.len() < 18 || frame[12..14] != ETHERTYPE.to_be_bytes() {
        return None;
    }
    let seq = u32::from_be_bytes([frame[14], frame[15], frame[16], frame[17]]);
    frame
        .iter()
        .enumerate()
        .skip(18)
        .all(|(i, &b)| b == pattern(seq, i))
        .then_some(seq)
}

/// A flood's set-up.
#[derive(Debug, Clone)]
pub struct FloodSpec {
    /// Its own MAC.
    pub me: [u8; 6],
    /// Where its frames go.
    pub peer: [u8; 6],
    /// Each frame's length (18 to 1514 bytes).
    pub len: usize,
    /// The offered load in bits a second, changeable while it runs; 0: as fast as the
    /// driver takes frames.
    pub rate: Arc<AtomicU64>,
    /// Frames sent.
    pub sent: Arc<AtomicU64>,
}

/// What a sink counted: frames addressed to it that arrived whole, and the rest.
#[derive(Debug, Default)]
pub struct SinkCounters {
    /// Frames received with every byte as sent, and in their sender's sequence.
    pub received: AtomicU64,
    /// Frames with a wrong byte.
    pub corrupt: AtomicU64,
    /// Frames whose sequence number was not the next one (one lost or reordered
    /// before it).
    pub out_of_sequence: AtomicU64,
}

/// A flood's state.
#[derive(Debug)]
pub struct Flood {
    spec: FloodSpec,
    seq: u32,
    /// When the next frame is due at the offered rate (the guest's clock).
    next_at: Duration,
    frame: Box<[u8]>,
}

/// Frames a flood sends at most in one poll (then it yields the vCPU's loop).
const FLOOD_BURST: usize = 64;
/// A paced flood sends, each time it runs, the frames due within this much of now (as
/// a pacing qdisc's quantum): a vCPU woken per frame at high rates would spend its
/// time waking.
pub const FLOOD_QUANTUM: Duration = Duration::from_micros(200);

impl Flood {
    fn run(&mut self, now: Duration, send: &mut dyn FnMut(&[u8]) -> bool) -> usize {
        let mut n = 0;
        while n < FLOOD_BURST {
            let rate = self.spec.rate.load(Ordering::Relaxed);
            if rate != 0 && now + FLOOD_QUANTUM < self.next_at {
                break;
            }
            let f = &mut self.frame;
            f[14..18].copy_from_slice(&self.seq.to_be_bytes());
            for (i, b) in f.iter_mut().enumerate().skip(18) {
                *b = pattern(self.seq, i);
            }
            if !send(f) {
                break;
            }
            self.seq = self.seq.wrapping_add(1);
            self.spec.sent.fetch_add(1, Ordering::Relaxed);
            n += 1;
            if let Some(ns) = (self.frame.len() as u64 * 8 * 1_000_000_000).checked_div(rate) {
                // No more than a millisecond's frames saved up after a stall.
                let from = self
                    .next_at
                    .max(now.saturating_sub(Duration::from_millis(1)));
                self.next_at = from + Duration::from_nanos(ns);
            }
        }
        n
    }
}

/// A raw application above the driver.
#[derive(Debug)]
pub enum Raw {
    /// The server: every probe addressed to it goes back to whoever sent it (one for
    /// another MAC, which a bridge flooded here, is not its to answer).
    Echo {
        /// Its MAC.
        me: [u8; 6],
        /// Probes echoed.
        echoed: u64,
    },
    /// The client.
    Ping(Box<Ping>),
    /// A one-way sender.
    Flood(Box<Flood>),
    /// A flood's receiver: checks every byte of every frame addressed to it.
    Sink {
        /// Its MAC.
        me: [u8; 6],
        /// The next sequence number expected.
        next: u32,
        /// Its counters.
        counters: Arc<SinkCounters>,
    },
}

/// The client's state.
#[derive(Debug)]
pub struct Ping {
    spec: ProbeSpec,
    seq: u32,
    /// The probe in flight, when it left, and when (the guest's clock) it is lost.
    in_flight: Option<(u32, Instant, Duration)>,
    /// When the next probe is due (the guest's clock).
    next_at: Duration,
    rng: u64,
}

impl Raw {
    /// A client.
    pub fn ping(spec: ProbeSpec) -> Self {
        let rng = spec.seed | 1;
        Raw::Ping(Box::new(Ping {
            spec,
            seq: 0,
            in_flight: None,
            next_at: Duration::ZERO,
            rng,
        }))
    }

    /// A flood.
    pub fn flood(spec: FloodSpec) -> Self {
        let mut frame = vec![0u8; spec.len.clamp(18, 1514)].into_boxed_slice();
        frame[..6].copy_from_slice(&spec.peer);
        frame[6..12].copy_from_slice(&spec.me);
        frame[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
        Raw::Flood(Box::new(Flood {
            spec,
            seq: 0,
            next_at: Duration::ZERO,
            frame,
        }))
    }

    /// A frame arrived; `send` puts a frame on the driver (false: no room).
    pub fn input(&mut self, frame: &[u8], now: Duration, send: &mut dyn FnMut(&[u8]) -> bool) {
        if frame.len() < 18 || frame[12..14] != ETHERTYPE.to_be_bytes() {
            if let Raw::Ping(p) = self {
                p.spec.counters.stray.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        match self {
            Raw::Echo { me, echoed } => {
                if frame[..6] != *me {
                    return;
                }
                let mut f = [0u8; PROBE_LEN];
                let n = frame.len().min(PROBE_LEN);
                f[..n].copy_from_slice(&frame[..n]);
                f.copy_within(6..12, 0);
                f[6..12].copy_from_slice(&frame[..6]);
                if send(&f[..n]) {
                    *echoed += 1;
                }
            }
            Raw::Flood(_) => {}
            Raw::Sink { me, next, counters } => {
                if frame[..6] != *me {
                    return;
                }
                match verify(frame) {
                    Some(seq) => {
                        if seq != *next {
                            counters.out_of_sequence.fetch_add(1, Ordering::Relaxed);
                        }
                        *next = seq.wrapping_add(1);
                        counters.received.fetch_add(1, Ordering::Relaxed);
                    }
                    None => {
                        counters.corrupt.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Raw::Ping(p) => {
                // An echo comes from the server to this client; anything else (another
                // client's probe that a bridge flooded here) is not one.
                if frame[..6] != p.spec.me || frame[6..12] != p.spec.peer {
                    p.spec.counters.stray.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let seq = u32::from_be_bytes([frame[14], frame[15], frame[16], frame[17]]);
                let Some((want, at, _)) = p.in_flight else {
                    p.spec.counters.stray.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                if seq != want {
                    p.spec.counters.stray.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let rtt = at.elapsed();
                let c = &p.spec.counters;
                let ok = frame.len() == PROBE_LEN
                    && frame[18..]
                        .iter()
                        .enumerate()
                        .all(|(i, &b)| b == pattern(seq, i + 18));
                if ok {
                    c.echoed.fetch_add(1, Ordering::Relaxed);
                    p.spec.rtts.push(rtt.as_nanos() as u64);
                } else {
                    c.corrupt.fetch_add(1, Ordering::Relaxed);
                }
                p.in_flight = None;
                p.next_at = now + p.gap();
            }
        }
    }

    /// Sends the next probe if it is due: how many frames went out.
    pub fn run(&mut self, now: Duration, send: &mut dyn FnMut(&[u8]) -> bool) -> usize {
        let p = match self {
            Raw::Ping(p) => p,
            Raw::Flood(f) => return f.run(now, send),
            Raw::Echo { .. } | Raw::Sink { .. } => return 0,
        };
        if let Some((_, _, lost_at)) = p.in_flight {
            if now < lost_at {
                return 0;
            }
            p.spec.counters.lost.fetch_add(1, Ordering::Relaxed);
            p.in_flight = None;
        }
        if now < p.next_at {
            return 0;
        }
        let f = probe(p.spec.me, p.spec.peer, p.seq);
        // The clock is read before the send: a client preempted between the two would
        // otherwise take the echo's time off the round trip.
        let at = Instant::now();
        if !send(&f) {
            return 0;
        }
        p.in_flight = Some((p.seq, at, now + LOST_AFTER));
        p.seq = p.seq.wrapping_add(1);
        p.spec.counters.sent.fetch_add(1, Ordering::Relaxed);
        1
    }

    /// When the client next needs its timer: the next probe, or the one in flight's
    /// loss.
    pub fn next_timer(&self) -> Option<Duration> {
        let p = match self {
            Raw::Ping(p) => p,
            // At a rate, its next frame; at full speed, the transmit signal wakes it.
            Raw::Flood(f) => {
                return (f.spec.rate.load(Ordering::Relaxed) != 0)
                    .then(|| f.next_at.saturating_sub(FLOOD_QUANTUM))
            }
            Raw::Echo { .. } | Raw::Sink { .. } => return None,
        };
        match p.in_flight {
            Some((_, _, lost_at)) => Some(lost_at),
            None => Some(p.next_at),
        }
    }
}

impl Ping {
    /// A random wait from 0 to the longest (xorshift64).
    fn gap(&mut self) -> Duration {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let max = self.spec.max_gap.as_nanos() as u64;
        if max == 0 {
            Duration::ZERO
        } else {
            Duration::from_nanos(self.rng % (max + 1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> (Raw, Arc<ProbeCounters>, Arc<Samples>) {
        let (c, r) = (
            Arc::new(ProbeCounters::default()),
            Arc::new(Samples::new(16)),
        );
        let raw = Raw::ping(ProbeSpec {
            me: [2, 0, 0, 0, 0, 1],
            peer: [2, 0, 0, 0, 0, 2],
            max_gap: Duration::ZERO,
            seed: 1,
            rtts: Arc::clone(&r),
            counters: Arc::clone(&c),
        });
        (raw, c, r)
    }

    /// What `raw` sends at `now`.
    fn sent(raw: &mut Raw, now: Duration) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        raw.run(now, &mut |f| {
            out.push(f.to_vec());
            true
        });
        out
    }

    #[test]
    fn a_probe_goes_through_the_echo_and_its_round_trip_is_kept() {
        let (mut ping, c, rtts) = client();
        let mut echo = Raw::Echo {
            me: [2, 0, 0, 0, 0, 2],
            echoed: 0,
        };
        let out = sent(&mut ping, Duration::ZERO);
        assert_eq!(out.len(), 1);
        assert!(
            sent(&mut ping, Duration::ZERO).is_empty(),
            "one in flight at a time"
        );
        let mut back = Vec::new();
        echo.input(&out[0], Duration::ZERO, &mut |f| {
            back.push(f.to_vec());
            true
        });
        assert_eq!(back[0][..6], out[0][6..12], "back to its sender");
        ping.input(&back[0], Duration::ZERO, &mut |_| true);
        assert_eq!(c.echoed.load(Ordering::Relaxed), 1);
        assert_eq!(rtts.len(), 1);
        assert_eq!(
            sent(&mut ping, Duration::ZERO).len(),
            1,
            "the next one goes"
        );
    }

    #[test]
    fn a_flood_keeps_its_rate_stops_when_the_driver_is_full_and_every_frame_verifies() {
        let rate = Arc::new(AtomicU64::new(8_000_000)); // 1000-byte frames: 1 a ms
        let sent_c = Arc::new(AtomicU64::new(0));
        let mut f = Raw::flood(FloodSpec {
            me: [2, 0, 0, 0, 0, 1],
            peer: [2, 0, 0, 0, 0, 2],
            len: 1000,
            rate: Arc::clone(&rate),
            sent: Arc::clone(&sent_c),
        });
        let ms = Duration::from_millis(1);
        assert_eq!(sent(&mut f, Duration::ZERO).len(), 1);
        assert!(sent(&mut f, ms / 2).is_empty(), "not due yet");
        assert_eq!(f.next_timer(), Some(ms - FLOOD_QUANTUM));
        // Due within the quantum: sent now.
        let out = sent(&mut f, ms - FLOOD_QUANTUM);
        assert_eq!(out.len(), 1);
        assert_eq!(verify(&out[0]), Some(1));
        let mut bad = out[0].clone();
        bad[999] ^= 0x40;
        assert_eq!(verify(&bad), None);
        // A long stall saves up at most a millisecond's frames.
        let stalled = sent(&mut f, 100 * ms).len();
        assert!((1..=2).contains(&stalled), "{stalled}");
        // At full speed it sends until the driver is full, then waits to be woken.
        rate.store(0, Ordering::Relaxed);
        let mut room = 5;
        let n = f.run(100 * ms, &mut |_| {
            room -= 1;
            room >= 0
        });
        assert_eq!(n, 5);
        assert_eq!(f.next_timer(), None);
        assert_eq!(sent_c.load(Ordering::Relaxed), 2 + stalled as u64 + 5);
    }

    #[test]
    fn a_wrong_byte_a_strangers_frame_and_a_lost_probe_are_each_counted() {
        let (mut ping, c, _) = client();
        let mut echo = Raw::Echo {
            me: [2, 0, 0, 0, 0, 2],
            echoed: 0,
        };
        let out = sent(&mut ping, Duration::ZERO);
        let mut back = Vec::new();
        echo.input(&out[0], Duration::ZERO, &mut |f| {
            back.push(f.to_vec());
            true
        });
        // Another client's probe, flooded here.
        let stranger = probe([2, 0, 0, 0, 0, 9], [2, 0, 0, 0, 0, 2], 0);
        ping.input(&stranger, Duration::ZERO, &mut |_| true);
        assert_eq!(c.stray.load(Ordering::Relaxed), 1);
        let mut bad = back[0].clone();
        bad[40] ^= 1;
        ping.input(&bad, Duration::ZERO, &mut |_| true);
        assert_eq!(c.corrupt.load(Ordering::Relaxed), 1);
        // The next probe is never echoed: lost once its time is up, then another goes.
        let out = sent(&mut ping, Duration::ZERO);
        assert_eq!(out.len(), 1);
        assert!(sent(&mut ping, LOST_AFTER / 2).is_empty());
        assert_eq!(ping.next_timer(), Some(LOST_AFTER));
        assert_eq!(sent(&mut ping, LOST_AFTER).len(), 1);
        assert_eq!(c.lost.load(Ordering::Relaxed), 1);
    }
}
