//! The far end of the NIC's cable: sources of received frames and sinks for sent ones.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use net::wire::{UdpFlow, UdpFramer};

/// What the NIC receives: frames due by a time.
pub trait WireSource: Send {
    /// Calls `emit` with every frame due by `now`. Returns how many.
    fn poll(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8])) -> usize;
    /// When the next frame is due (`None`: nothing scheduled).
    fn next_due(&self) -> Option<Instant>;
    /// Whether frames already wait (a source fed from outside, which wakes the device
    /// through [`crate::nic::NicRegs::wire_wake`]).
    fn ready(&self) -> bool {
        false
    }
    /// Called once by the device thread as it starts, with its registers.
    fn attach(&mut self, _regs: &Arc<crate::nic::NicRegs>) {}
}

/// What the NIC transmits goes here.
pub trait WireSink: Send {
    /// One frame left the NIC.
    fn transmit(&mut self, frame: &[u8]);
}

/// No traffic.
#[derive(Debug, Default)]
pub struct Silence;

impl WireSource for Silence {
    fn poll(&mut self, _: Instant, _: &mut dyn FnMut(&[u8])) -> usize {
        0
    }
    fn next_due(&self) -> Option<Instant> {
        None
    }
}

/// Counts what it is given (the sink of experiments that only receive).
#[derive(Debug, Default, Clone)]
pub struct CountingSink {
    /// Frames and bytes seen.
    pub counters: Arc<SinkCounters>,
}

/// A sink's counters, readable while it runs.
#[derive(Debug, Default)]
pub struct SinkCounters {
    /// Frames.
    pub frames: AtomicU64,
    /// Bytes.
    pub bytes: AtomicU64,
}

impl WireSink for CountingSink {
    fn transmit(&mut self, frame: &[u8]) {
        self.counters.frames.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes
            .fetch_add(frame.len() as u64, Ordering::Relaxed);
    }
}

/// A sender's counters, readable while it runs.
#[derive(Debug, Default)]
pub struct SenderCounters {
    /// Frames put on the wire.
    pub frames: AtomicU64,
    /// Whole messages put on the wire.
    pub messages: AtomicU64,
    /// The latest any frame went out after its due time, in µs (the device thread
    /// was not running): a measure of how faithful the pacing was.
    pub max_late_us: AtomicU64,
    /// Frames not sent because the host held the device thread past the stall horizon
    /// (whole messages; see [`PacedSender::skip_after_stall`]).
    pub skipped_frames: AtomicU64,
}

/// The remote sender: UDP messages of one size at a fixed frame rate (paper 000 kept
/// the same packet rate for every message size). Messages are built once, each with its
/// own IP identification, and replayed in turn, so sending costs the device thread a
/// copy and nothing else.
#[derive(Debug)]
pub struct PacedSender {
    frames: Vec<u8>,
    spans: Vec<(usize, usize)>,
    frames_per_message: usize,
    period: Duration,
    start: Option<Instant>,
    sent: u64,
    limit: Option<u64>,
    stall_horizon: Option<Duration>,
    counters: Arc<SenderCounters>,
}

/// Messages built ahead (distinct IP identifications in flight at once).
const PREBUILT: usize = 64;

impl PacedSender {
    /// `message` bytes of UDP payload per message on `flow`, at `rate` frames per
    /// second, stopping after `limit` frames if given.
    pub fn new(
        flow: UdpFlow,
        message: usize,
        rate: f64,
        limit: Option<u64>,
    ) -> Result<Self, net::wire::WireError> {
        let mut framer = UdpFramer::new(flow);
        let mut frames = Vec::new();
        let mut spans = Vec::new();
        let mut fpm = 0;
        for m in 0..PREBUILT {
            let payload: Vec<u8> = (0..message)
                .map(|i| net::wire::payload_byte(m as u8, i))
                .collect();
            fpm = framer.frames(m as u16, &payload, |f| {
                spans.push((frames.len(), f.len()));
                frames.extend_from_slice(f);
            })?;
        }
        Ok(Self {
            frames,
            spans,
            frames_per_message: fpm,
            period: Duration::from_secs_f64(1.0 / rate.max(1.0)),
            start: None,
            sent: 0,
            limit,
            stall_horizon: None,
            counters: Arc::default(),
        })
    }

    /// Messages whose first frame is due more than `horizon` in the past are not sent
    /// (counted in `skipped_frames`). A wire delivers frames at their times; when the
    /// host deschedules the device thread, sending its backlog at once would be a burst
    /// no link produces, which overflows the NIC's ring: host stalls would show up as
    /// the platform's loss. Skipped frames are not offered load. A message already
    /// begun is finished, so no partial message is made.
    pub fn skip_after_stall(mut self, horizon: Duration) -> Self {
        self.stall_horizon = Some(horizon);
        self
    }

    /// Frames each message takes.
    pub fn frames_per_message(&self) -> usize {
        self.frames_per_message
    }
    /// Counters, readable from other threads.
    pub fn counters(&self) -> &Arc<SenderCounters> {
        &self.counters
    }
}

impl WireSource for PacedSender {
    fn poll(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8])) -> usize {
        let start = *self.start.get_or_insert(now);
        let mut n = 0;
        while self.limit.is_none_or(|l| self.sent < l) {
            let due = start + self.period.mul_f64(self.sent as f64);
            if due > now {
                break;
            }
            let late = now.duration_since(due);
            let late_us = late.as_micros() as u64;
            if late_us > self.counters.max_late_us.load(Ordering::Relaxed) {
                self.counters.max_late_us.store(late_us, Ordering::Relaxed);
            }
            let fpm = self.frames_per_message as u64;
            if self.stall_horizon.is_some_and(|h| late > h) && self.sent.is_multiple_of(fpm) {
                let skip = self.limit.map_or(fpm, |l| fpm.min(l - self.sent));
                self.sent += skip;
                self.counters
                    .skipped_frames
                    .fetch_add(skip, Ordering::Relaxed);
                continue;
            }
            let (off, len) = self.spans[self.sent as usize % self.spans.len()];
            emit(&self.frames[off..off + len]);
            self.sent += 1;
            n += 1;
            self.counters.frames.fetch_add(1, Ordering::Relaxed);
            if self.sent.is_multiple_of(self.frames_per_message as u64) {
                self.counters.messages.fetch_add(1, Ordering::Relaxed);
            }
        }
        n
    }

    fn next_due(&self) -> Option<Instant> {
        if self.limit.is_some_and(|l| self.sent >= l) {
            return None;
        }
        match self.start {
            Some(s) => Some(s + self.period.mul_f64(self.sent as f64)),
            None => Some(Instant::now()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smoltcp::wire::Ipv4Address;

    fn flow() -> UdpFlow {
        UdpFlow {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            src_ip: Ipv4Address::new(10, 0, 0, 1),
            dst_ip: Ipv4Address::new(10, 0, 0, 2),
            src_port: 1,
            dst_port: 2,
            mtu: 1500,
        }
    }

    fn poll(s: &mut PacedSender, at: Instant) -> usize {
        s.poll(at, &mut |_| {})
    }

    #[test]
    fn a_late_sender_catches_up_unless_told_to_skip_after_a_stall() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        // Without a horizon every frame due is sent, late or not.
        let mut s = PacedSender::new(flow(), 52, 1000.0, None).expect("sender");
        assert_eq!(poll(&mut s, t0), 1);
        assert_eq!(poll(&mut s, t0 + 10 * ms), 10);
        assert_eq!(s.counters().max_late_us.load(Ordering::Relaxed), 9000);
        // With a 2 ms horizon, frames more than 2 ms late are skipped and counted.
        let mut s = PacedSender::new(flow(), 52, 1000.0, None)
            .expect("sender")
            .skip_after_stall(2 * ms);
        assert_eq!(poll(&mut s, t0), 1);
        assert_eq!(poll(&mut s, t0 + 10 * ms), 3, "frames 8, 9 and 10");
        let c = s.counters();
        assert_eq!(c.skipped_frames.load(Ordering::Relaxed), 7);
        assert_eq!(c.frames.load(Ordering::Relaxed), 4);
        assert_eq!(c.messages.load(Ordering::Relaxed), 4);
        // The schedule is kept: the next frame is due at 11 ms.
        assert_eq!(s.next_due(), Some(t0 + 11 * ms));
    }

    #[test]
    fn a_stall_skips_whole_messages_and_finishes_one_begun() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut s = PacedSender::new(flow(), 3000, 1000.0, None)
            .expect("sender")
            .skip_after_stall(2 * ms);
        assert_eq!(s.frames_per_message(), 3);
        assert_eq!(poll(&mut s, t0), 1);
        // Frames 1 and 2 finish message 0 however late; messages 1 and 2 (frames 3-8)
        // are skipped; message 3 begins at frame 9, 1 ms late.
        assert_eq!(poll(&mut s, t0 + 10 * ms), 4);
        let c = s.counters();
        assert_eq!(c.skipped_frames.load(Ordering::Relaxed), 6);
        assert_eq!(c.frames.load(Ordering::Relaxed), 5);
        assert_eq!(c.messages.load(Ordering::Relaxed), 1);
    }
}
