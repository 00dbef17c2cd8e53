//! The far end of the NIC's cable: sources of received frames and sinks for sent ones.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use net::offload::Offload;
use net::wire::{UdpFlow, UdpFramer};

/// A device thread that sleeps when it has nothing to do, and the wake-up whoever
/// gives it work sends (a doorbell write, a frame on its cable): the thread announces
/// its sleep ([`Doze::announce`]), looks for work once more, and only then parks; a
/// waker publishes its work first and then wakes ([`Doze::wake`]). Both sides store,
/// fence and load, so one of them always sees the other: no wake-up is slept through.
#[derive(Debug, Default)]
pub struct Doze {
    parked: std::sync::atomic::AtomicBool,
    thread: std::sync::OnceLock<std::thread::Thread>,
    /// The engine's unit, when it runs on one of pvio's pCPUs: a wake-up is its IPI.
    unit: std::sync::OnceLock<hv::sched::Waker>,
}

impl Doze {
    /// The thread to wake is `t` (set once).
    pub fn bind(&self, t: std::thread::Thread) {
        let _ = self.thread.set(t);
    }

    /// Work was published: wakes the thread if it sleeps (a load when it does not).
    pub fn wake(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            self.kick();
        }
    }

    /// The engine to wake is a unit on a pCPU (set once).
    pub fn bind_unit(&self, w: &hv::sched::Waker) {
        let _ = self.unit.set(w.clone());
    }

    /// The engine's unit, once it runs as one.
    pub fn unit(&self) -> Option<hv::sched::Waker> {
        self.unit.get().cloned()
    }

    /// Wakes the engine whatever it is doing (to stop it, or to have it look at
    /// requests).
    pub fn kick(&self) {
        if let Some(w) = self.unit.get() {
            w.wake();
        } else if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// The thread is about to sleep: after this it must look for work once more.
    pub fn announce(&self) {
        self.parked.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// The thread sleeps at most `d` (or until woken), then is awake again.
    pub fn sleep(&self, d: Duration) {
        std::thread::park_timeout(d);
        self.awake();
    }

    /// The thread found work after announcing: it is awake.
    pub fn awake(&self) {
        self.parked.store(false, Ordering::Release);
    }
}

/// What the NIC receives: frames due by a time.
pub trait WireSource: Send {
    /// Calls `emit` with every frame due by `now`, and what rides beside it (a cable
    /// to a local stack, a TAP with offloads, may carry partial checksums and large TCP
    /// segments, as virtio-net's does). Returns how many.
    fn poll(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8], Offload)) -> usize;
    /// When the next frame is due (`None`: nothing scheduled).
    fn next_due(&self) -> Option<Instant>;
    /// Whether frames already wait (a source fed from outside, which wakes the device
    /// through the [`Doze`] it was attached to).
    fn ready(&self) -> bool {
        false
    }
    /// Called once by the device thread as it starts, with what wakes it.
    fn attach(&mut self, _wake: &Arc<Doze>) {}
    /// Whether a frame the device has no room for can stay with the source, first in
    /// its line, rather than be lost: a TAP keeps it in the interface's queue, as a
    /// link with flow control pauses its sender. A cable's frames cannot wait this way: a
    /// far end that takes PAUSE frames is paused instead ([`Self::pauses`]).
    fn holds(&self) -> bool {
        false
    }
    /// Whether the far end takes PAUSE frames (IEEE 802.3x flow control): the device
    /// then stops it while its packet buffer is nearly full ([`Self::pause`]) rather
    /// than drop what comes, and takes its frames through [`Self::poll_held`], refusing
    /// those that come after it decided to pause (a refused frame stays first in the
    /// far end's line). A far end without flow control keeps sending, and what the
    /// device has no room for is lost.
    fn pauses(&self) -> bool {
        false
    }
    /// The device paused the far end (`on`, an XOFF) or let it go again (an XON), at
    /// `now`. A paused far end sends nothing and has nothing due until let go.
    fn pause(&mut self, _on: bool, _now: Instant) {}
    /// The device is done with the source for now (it stops, or hands the source on):
    /// a source with work in the kernel ends it here, on the device's own thread.
    fn close(&mut self) {}
    /// Whether the source must be used from one thread (an io_uring whose completions
    /// run as work of the thread that submitted): the device's engine then stays on
    /// its own pCPU rather than have idle pCPUs run its steps.
    fn thread_bound(&self) -> bool {
        false
    }
    /// As [`Self::poll`], for a source that [`Self::holds`]: `emit` returns false for
    /// a frame the device refuses, which stays first in line, and the poll stops there.
    fn poll_held(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8], Offload) -> bool) -> usize {
        self.poll(now, &mut |f, off| {
            emit(f, off);
        })
    }
}

/// What the NIC transmits goes here.
pub trait WireSink: Send {
    /// One frame left the NIC, with its offload ([`Offload::NONE`] unless
    /// [`WireSink::takes_offload`]).
    fn transmit(&mut self, frame: &[u8], off: Offload);
    /// Whether the far end takes partial checksums and large TCP segments whole; if
    /// not, the NIC's segmentation and checksum engines finish them first.
    fn takes_offload(&self) -> bool {
        false
    }
    /// The NIC has put every frame it had on the cable for now: a sink that sends in
    /// batches sends what it holds.
    fn flush(&mut self) {}
    /// Whether the cable takes a frame now without losing it: false while the far end
    /// has paused this one (802.3x) or its queue is full. A device that can wait keeps
    /// its frames in the guests' rings until it is true; one that sends regardless
    /// loses what finds no room.
    fn room(&self) -> bool {
        true
    }
    /// Whether the sink must be used from one thread ([`WireSource::thread_bound`]).
    fn thread_bound(&self) -> bool {
        false
    }
}

/// No traffic.
#[derive(Debug, Default)]
pub struct Silence;

impl WireSource for Silence {
    fn poll(&mut self, _: Instant, _: &mut dyn FnMut(&[u8], Offload)) -> usize {
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
    fn transmit(&mut self, frame: &[u8], _: Offload) {
        self.counters.frames.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes
            .fetch_add(frame.len() as u64, Ordering::Relaxed);
    }
}

/// One-way latency from the wire to the application: the sender stamps the instant each
/// message's last frame reaches the NIC, the receiving application looks the stamp up
/// when it has read and checked the whole message, and keeps the difference.
///
/// Messages are named by their pattern's sequence number ([`net::wire::payload_byte`]'s
/// `seq`, the payload's first byte), which the sender reuses every [`PREBUILT`]
/// messages, so a stamp is the right one while fewer than that many messages are in
/// flight: the probe is for low rates, where one message has arrived long before the
/// next is sent. Samples go into a fixed array (no allocation on the receive path); past
/// its capacity they are counted and dropped.
#[derive(Debug)]
pub struct LatencyProbe {
    epoch: Instant,
    sent_ns: [AtomicU64; PREBUILT],
    samples: Samples,
    overflow: AtomicU64,
    unmatched: AtomicU64,
}

/// Latencies in ns, kept in a fixed array (no allocation as they come) by one writer
/// and readable by others while it runs.
#[derive(Debug)]
pub struct Samples {
    ns: Box<[AtomicU64]>,
    len: AtomicU64,
}

impl Samples {
    /// Room for `capacity` samples.
    pub fn new(capacity: usize) -> Self {
        Self {
            ns: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            len: AtomicU64::new(0),
        }
    }

    /// Keeps one (the only writer); false if the array is full.
    pub fn push(&self, ns: u64) -> bool {
        let i = self.len.load(Ordering::Relaxed);
        match self.ns.get(i as usize) {
            Some(slot) => {
                slot.store(ns, Ordering::Relaxed);
                self.len.store(i + 1, Ordering::Release);
                true
            }
            None => false,
        }
    }

    /// Samples kept so far (a mark for [`Samples::since`]).
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire) as usize
    }

    /// Whether none has been kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The samples kept after mark `from`, in ns, in order.
    pub fn since(&self, from: usize) -> Vec<u64> {
        let n = self.len();
        self.ns[from.min(n)..n]
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .collect()
    }
}

impl LatencyProbe {
    /// A probe that keeps up to `capacity` samples.
    pub fn new(capacity: usize) -> Self {
        Self {
            epoch: Instant::now(),
            sent_ns: std::array::from_fn(|_| AtomicU64::new(0)),
            samples: Samples::new(capacity),
            overflow: AtomicU64::new(0),
            unmatched: AtomicU64::new(0),
        }
    }

    fn now_ns(&self) -> u64 {
        // Offset by one so that a stamp is never 0, which means "not sent".
        self.epoch.elapsed().as_nanos() as u64 + 1
    }

    /// The sender: message `seq`'s last frame reaches the NIC now.
    pub fn sent(&self, seq: usize) {
        if let Some(s) = self.sent_ns.get(seq) {
            s.store(self.now_ns(), Ordering::Release);
        }
    }

    /// The application: message `seq` has been read whole, now. Only one thread
    /// receives (the application's).
    pub fn received(&self, seq: u8) {
        let Some(at) = self
            .sent_ns
            .get(usize::from(seq))
            .map(|s| s.load(Ordering::Acquire))
            .filter(|&at| at != 0)
        else {
            self.unmatched.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if !self.samples.push(self.now_ns().saturating_sub(at)) {
            self.overflow.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Samples kept so far (a mark for [`LatencyProbe::since`]).
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether none has been kept.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The latencies kept after mark `from`, in ns, in arrival order.
    pub fn since(&self, from: usize) -> Vec<u64> {
        self.samples.since(from)
    }

    /// Messages received past the capacity, and messages whose sequence number was
    /// never stamped (not the sender's).
    pub fn dropped(&self) -> (u64, u64) {
        (
            self.overflow.load(Ordering::Relaxed),
            self.unmatched.load(Ordering::Relaxed),
        )
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

hv::atomic_counter_set!(SenderCounters => SenderCounts {
    frames,
    messages,
    max_late_us,
    skipped_frames,
});

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
    /// Since when the device has paused it (an XOFF), if it has.
    paused: Option<Instant>,
    counters: Arc<SenderCounters>,
    probe: Option<Arc<LatencyProbe>>,
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
            paused: None,
            counters: Arc::default(),
            probe: None,
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

    /// Stamps each message's arrival at the NIC in `probe` (see [`LatencyProbe`]).
    pub fn with_probe(mut self, probe: Arc<LatencyProbe>) -> Self {
        self.probe = Some(probe);
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

    /// Sends every frame due by `now` while `emit` takes them; a frame it refuses stays
    /// first in line (the device paused the link as it came). Returns how many went.
    fn send_due(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8], Offload) -> bool) -> usize {
        if self.paused.is_some() {
            return 0;
        }
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
            let last = (self.sent + 1).is_multiple_of(fpm);
            if let Some(p) = self.probe.as_ref().filter(|_| last) {
                // Stamped before the NIC has the frame, so the receiver never finds the
                // previous round's stamp for it (a refused frame is stamped again when
                // it goes).
                p.sent((self.sent / fpm) as usize % PREBUILT);
            }
            if !emit(&self.frames[off..off + len], Offload::NONE) {
                break;
            }
            self.sent += 1;
            n += 1;
            self.counters.frames.fetch_add(1, Ordering::Relaxed);
            if self.sent.is_multiple_of(self.frames_per_message as u64) {
                self.counters.messages.fetch_add(1, Ordering::Relaxed);
            }
        }
        n
    }
}

/// The sender's NIC takes PAUSE frames, as a link partner with flow control on does
/// (Linux's ixgbe and igb turn it on by default): while paused it sends nothing, and
/// its pacing resumes where it stopped, each later frame due as much later as the
/// pause lasted (as a packet generator whose transmit ring is full waits and then
/// keeps its interval from there), rather than sending the backlog at once or
/// skipping it.
impl WireSource for PacedSender {
    fn poll(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
        self.send_due(now, &mut |f, off| {
            emit(f, off);
            true
        })
    }

    fn poll_held(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8], Offload) -> bool) -> usize {
        self.send_due(now, emit)
    }

    fn pauses(&self) -> bool {
        true
    }

    fn pause(&mut self, on: bool, now: Instant) {
        match (on, self.paused) {
            (true, None) => self.paused = Some(now),
            (false, Some(since)) => {
                self.paused = None;
                if let Some(s) = self.start.as_mut() {
                    *s += now.saturating_duration_since(since);
                }
            }
            _ => {}
        }
    }

    fn next_due(&self) -> Option<Instant> {
        if self.paused.is_some() || self.limit.is_some_and(|l| self.sent >= l) {
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
        s.poll(at, &mut |_, _| {})
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

    /// A sender the device pauses (802.3x) keeps the frame it refused first in line,
    /// sends nothing and has nothing due while paused, and resumes its pace as much
    /// later as the pause lasted: no backlog sent at once, nothing skipped, even with a
    /// stall horizon shorter than the pause.
    #[test]
    fn a_paused_sender_keeps_its_refused_frame_and_resumes_its_pace_as_late_as_the_pause() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut s = PacedSender::new(flow(), 52, 1000.0, None)
            .expect("sender")
            .skip_after_stall(2 * ms);
        assert!(s.pauses());
        assert_eq!(poll(&mut s, t0), 1);
        // Frames 1 and 2 are due by 2 ms: the device takes one, refuses the next and
        // pauses the sender.
        let mut offered = Vec::new();
        let took = s.poll_held(t0 + 2 * ms, &mut |f, _| {
            offered.push(f.to_vec());
            offered.len() == 1
        });
        assert_eq!(took, 1);
        s.pause(true, t0 + 2 * ms);
        assert_eq!(s.next_due(), None, "a paused sender has nothing due");
        assert_eq!(poll(&mut s, t0 + 10 * ms), 0);
        // Let go at 12 ms: the refused frame is due then, the next a period later.
        s.pause(false, t0 + 12 * ms);
        assert_eq!(s.next_due(), Some(t0 + 12 * ms));
        let mut again = Vec::new();
        s.poll_held(t0 + 12 * ms, &mut |f, _| {
            again.push(f.to_vec());
            true
        });
        assert_eq!(again, vec![offered[1].clone()], "the refused frame, first");
        assert_eq!(s.next_due(), Some(t0 + 13 * ms));
        assert_eq!(poll(&mut s, t0 + 13 * ms), 1);
        let c = s.counters();
        assert_eq!(c.frames.load(Ordering::Relaxed), 4);
        assert_eq!(c.skipped_frames.load(Ordering::Relaxed), 0);
        // Frame 1, due at 1 ms and sent at 2, was the latest: the pause made none late.
        assert_eq!(c.max_late_us.load(Ordering::Relaxed), 1000);
    }

    #[test]
    fn the_probe_matches_each_message_to_its_own_stamp() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let probe = Arc::new(LatencyProbe::new(2));
        let mut s = PacedSender::new(flow(), 3000, 1000.0, None)
            .expect("sender")
            .with_probe(Arc::clone(&probe));
        // Two frames of message 0: not yet whole, not stamped.
        assert_eq!(poll(&mut s, t0), 1);
        assert_eq!(poll(&mut s, t0 + ms), 1);
        probe.received(0);
        assert_eq!((probe.len(), probe.dropped()), (0, (0, 1)));
        // Its last frame stamps it; message 1's first frame does not.
        assert_eq!(poll(&mut s, t0 + 3 * ms), 2);
        probe.received(0);
        assert_eq!(probe.len(), 1);
        assert!(
            probe.since(0)[0] < 3_600_000_000_000,
            "a latency, not a date"
        );
        probe.received(1);
        assert_eq!(probe.dropped(), (0, 2), "message 1 is not whole yet");
        // A sequence number the sender never uses is not matched; the capacity holds.
        probe.received(200);
        assert_eq!(probe.dropped(), (0, 3));
        probe.received(0);
        probe.received(0);
        assert_eq!((probe.len(), probe.dropped()), (2, (1, 3)));
        assert_eq!(probe.since(1).len(), 1);
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
