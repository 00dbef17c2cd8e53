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
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(m as u8))
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
            counters: Arc::default(),
        })
    }

    /// Frames each message takes.
    pub fn frames_per_message(&self) -> usize {
        self.frames_per_message
    }
    /// Counters, readable from other threads.
    pub fn counters(&self) -> &Arc<SenderCounters> {
        &self.counters
    }
    /// The payload of prebuilt message `m` (what a receiver should get).
    pub fn payload_of(message: usize, m: usize) -> Vec<u8> {
        (0..message)
            .map(|i| {
                (i as u8)
                    .wrapping_mul(31)
                    .wrapping_add((m % PREBUILT) as u8)
            })
            .collect()
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
            let late = now.duration_since(due).as_micros() as u64;
            if late > self.counters.max_late_us.load(Ordering::Relaxed) {
                self.counters.max_late_us.store(late, Ordering::Relaxed);
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
