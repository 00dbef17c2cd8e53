//! The remote host at the far end of the NIC's cable, speaking TCP: smoltcp's TCP
//! ([`net::tcp::TcpHost`]) on a thread of its own, and the cable between it and the NIC,
//! which carries frames at a settable wire rate.
//!
//! The peer is the papers' sending machine: in a stream it is netperf's TCP_STREAM
//! client writing 1 KiB messages, in a ping-pong netperf's TCP_RR client. It connects
//! to the machine under test, so its SYN, its data and the ACKs that come back cross the
//! whole path: wire, NIC, driver domain, netback, netfront, the guest's TCP. Its
//! congestion control (smoltcp's Reno) and the receiver's window set the pace, as they
//! do between two real hosts.
//!
//! The cable is two lanes, one per direction. A frame put on a lane occupies it for its
//! serialization time at the wire rate (with Ethernet's preamble, inter-frame gap and
//! FCS: 24 bytes a frame) and is delivered when its last bit is: at 1 Gbit/s a 1514-byte
//! frame takes 12.3 µs, so a lane carries at most 81 274 such frames per second, the
//! paper's link. The unlimited wire delivers at once. A lane holds a bounded number of
//! frames (a switch port's buffer); the NIC's transmit side drops beyond it, counted,
//! and the peer's TCP is held back instead (its frames wait in its own ring, as a
//! qdisc holds a sender).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use net::offload::Offload;
use net::tcp::{fill_stream, Open, StreamCheck, TcpHost, TcpStats};
use net::wire::MAX_TAGGED_FRAME;
use smoltcp::wire::Ipv4Address;

use crate::wire::Doze;
use crate::wire::{Samples, WireSink, WireSource};

/// Frames a lane holds, each up to the wire's largest (a frame on a cable is at most
/// an MTU: the NIC cuts large packets before they leave it).
pub const LANE_FRAMES: usize = 256;
/// Frames each direction of a NIC-to-NIC cable ([`crossover`]) holds: with no switch
/// between them, what waits here is what waits at the sending host, in its transmit
/// queue (Linux's `txqueuelen` of 1000) and its NIC's ring; a host's devices hand
/// frames over faster than the wire's rate in bursts, and a host drops only past that.
pub const CROSSOVER_FRAMES: usize = 1024;
/// Bytes each frame occupies on an Ethernet wire beyond its own: preamble and start
/// delimiter (8), FCS (4), inter-frame gap (12).
pub const WIRE_OVERHEAD: usize = 24;

/// A wire's rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireRate {
    /// Bits per second (the papers' links: 1 Gbit/s).
    Bits(u64),
    /// No limit: a frame is delivered as soon as it is put on.
    Unlimited,
}

impl WireRate {
    /// The paper's link.
    pub const GIGABIT: WireRate = WireRate::Bits(1_000_000_000);

    /// How long a `len`-byte frame occupies the wire.
    pub fn serialization(self, len: usize) -> Duration {
        match self {
            WireRate::Bits(b) => {
                Duration::from_nanos(((len + WIRE_OVERHEAD) as u64 * 8 * 1_000_000_000) / b.max(1))
            }
            WireRate::Unlimited => Duration::ZERO,
        }
    }
}

/// One direction of the cable.
#[derive(Debug)]
struct Lane {
    ring: net::tcp::FrameRing,
    due: VecDeque<Instant>,
    /// When the wire is free again (the last frame's last bit).
    free_at: Option<Instant>,
    rate: WireRate,
    /// Since when the receiving device has paused the sender (an 802.3x XOFF): frames
    /// on the lane stay where they are, and nothing is due until it lets it go.
    paused: Option<Instant>,
}

impl Lane {
    fn new(rate: WireRate) -> Self {
        Self::with_frames(rate, LANE_FRAMES)
    }

    fn with_frames(rate: WireRate, frames: usize) -> Self {
        Self {
            ring: net::tcp::FrameRing::new(frames, MAX_TAGGED_FRAME),
            due: VecDeque::with_capacity(frames),
            free_at: None,
            rate,
            paused: None,
        }
    }

    /// Puts `frame` on the wire at `now`; false if the lane is full.
    fn push(&mut self, frame: &[u8], now: Instant) -> bool {
        if !self.ring.push_with(frame.len(), |b| {
            b.copy_from_slice(frame);
            true
        }) {
            return false;
        }
        let start = self.free_at.map_or(now, |f| f.max(now));
        let done = start + self.rate.serialization(frame.len());
        self.free_at = Some(done);
        self.due.push_back(done);
        true
    }

    /// When the oldest frame arrives (none while paused).
    fn next_due(&self) -> Option<Instant> {
        if self.paused.is_some() {
            return None;
        }
        self.due.front().copied()
    }

    /// Whether a sender may put a frame on now without it being lost: the lane has
    /// room and the receiver has not paused it.
    fn takes(&self) -> bool {
        self.paused.is_none() && !self.ring.is_full()
    }

    /// The receiver pauses the sender (`on`) or lets it go, at `now`. The sender stops
    /// between frames and, let go, carries on as late as the pause lasted: what was on
    /// the lane arrives that much later, and what had arrived and was refused arrives
    /// at once.
    fn pause(&mut self, on: bool, now: Instant) {
        match (on, self.paused) {
            (true, None) => self.paused = Some(now),
            (false, Some(since)) => {
                self.paused = None;
                let d = now.saturating_duration_since(since);
                self.due.iter_mut().for_each(|t| *t += d);
                if let Some(f) = self.free_at.as_mut() {
                    *f += d;
                }
            }
            _ => {}
        }
    }

    /// As [`Self::deliver`], while the receiver takes them: a frame `f` refuses stays
    /// first on the lane and delivery stops there. Nothing is delivered while paused.
    fn deliver_held(&mut self, now: Instant, mut f: impl FnMut(&[u8]) -> bool) -> usize {
        let mut n = 0;
        while self.paused.is_none() && self.due.front().is_some_and(|&d| d <= now) {
            if let Some(fr) = self.ring.front() {
                if !f(fr) {
                    break;
                }
            }
            self.ring.pop();
            self.due.pop_front();
            n += 1;
        }
        n
    }

    /// Hands every frame that has arrived by `now` to `f`; returns how many.
    fn deliver(&mut self, now: Instant, mut f: impl FnMut(&[u8])) -> usize {
        let mut n = 0;
        while self.due.front().is_some_and(|&d| d <= now) {
            if let Some(fr) = self.ring.front() {
                f(fr);
            }
            self.ring.pop();
            self.due.pop_front();
            n += 1;
        }
        n
    }
}

/// The cable's counters.
#[derive(Debug, Default)]
pub struct CableCounters {
    /// Frames the NIC sent that the peer's lane had no room for.
    pub to_peer_dropped: AtomicU64,
    /// Frames carried to the NIC.
    pub to_nic: AtomicU64,
    /// Frames carried to the peer.
    pub to_peer: AtomicU64,
}

/// What both ends of the cable share.
#[derive(Debug)]
struct CableInner {
    to_nic: Mutex<Lane>,
    to_peer: Mutex<Lane>,
    nic: OnceLock<Arc<Doze>>,
    /// What wakes the peer's engine (its thread, or its unit on a pCPU).
    peer: Arc<Doze>,
    counters: CableCounters,
}

impl CableInner {
    fn wake_peer(&self) {
        self.peer.wake();
    }
}

/// The NIC's end of the cable: its source (what the peer sent) and its sink.
#[derive(Debug)]
pub struct CableEnd(Arc<CableInner>);

impl WireSource for CableEnd {
    fn poll(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
        let Ok(mut lane) = self.0.to_nic.lock() else {
            return 0;
        };
        let was_full = lane.ring.is_full();
        let n = lane.deliver(now, |f| emit(f, Offload::NONE));
        drop(lane);
        self.0
            .counters
            .to_nic
            .fetch_add(n as u64, Ordering::Relaxed);
        if was_full && n > 0 {
            // The peer may be waiting for room.
            self.0.wake_peer();
        }
        n
    }

    fn next_due(&self) -> Option<Instant> {
        self.0.to_nic.lock().ok().and_then(|l| l.next_due())
    }

    fn ready(&self) -> bool {
        self.next_due().is_some_and(|d| d <= Instant::now())
    }

    fn attach(&mut self, wake: &Arc<Doze>) {
        let _ = self.0.nic.set(Arc::clone(wake));
    }
}

/// The NIC's transmit end.
#[derive(Debug)]
pub struct CableSink(Arc<CableInner>);

impl WireSink for CableSink {
    fn transmit(&mut self, frame: &[u8], _: Offload) {
        let ok = self
            .0
            .to_peer
            .lock()
            .is_ok_and(|mut l| l.push(frame, Instant::now()));
        if ok {
            self.0.wake_peer();
        } else {
            self.0
                .counters
                .to_peer_dropped
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What the peer does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PeerApp {
    /// netperf's TCP_STREAM: writes of `message` bytes of the stream pattern
    /// ([`net::tcp::stream_byte`]), at most `rate` bytes per second if given (the
    /// offered load; otherwise as fast as TCP lets it), until `total` bytes if given.
    Stream {
        /// Bytes per write.
        message: usize,
        /// Offered load, bytes per second.
        rate: Option<f64>,
        /// Bytes to send in all.
        total: Option<u64>,
    },
    /// netperf's TCP_RR: a `size`-byte request, then wait for the `size`-byte answer,
    /// `count` times if given; each round trip is timed.
    Rr {
        /// Bytes per request and per answer.
        size: usize,
        /// Transactions to run.
        count: Option<u64>,
    },
}

/// Where the peer is and whom it talks to.
#[derive(Debug, Clone, Copy)]
pub struct PeerSpec {
    /// The peer's address and MAC.
    pub ip: Ipv4Address,
    /// Its MAC.
    pub mac: [u8; 6],
    /// The host it connects to, and its port.
    pub to: Ipv4Address,
    /// The port it connects to.
    pub port: u16,
    /// The wire's rate, both directions.
    pub rate: WireRate,
    /// The core its thread is pinned to (none: it floats).
    pub core: Option<usize>,
    /// What it runs.
    pub app: PeerApp,
}

/// Round trips a peer keeps.
pub const MAX_SAMPLES: usize = 1 << 20;

/// The peer's counters, readable while it runs.
#[derive(Debug)]
pub struct PeerCounters {
    /// The connection is established.
    pub connected: AtomicBool,
    /// Stream bytes written into the socket.
    pub written: AtomicU64,
    /// Stream bytes the receiver acknowledged.
    pub acked: AtomicU64,
    /// Transactions completed.
    pub transactions: AtomicU64,
    /// Answer bytes that were not what was asked for.
    pub corrupt: AtomicU64,
    /// Round-trip times of the transactions.
    pub rtt: Samples,
    /// The peer has stopped writing ([`TcpPeer::quiesce`]): `written` is final.
    pub quiet: AtomicBool,
    /// A paced stream: bytes it is behind its schedule (TCP's window held it back), as
    /// of its last step; a measurement of a fixed load starts once this is small.
    pub lag: AtomicU64,
}

impl Default for PeerCounters {
    fn default() -> Self {
        Self {
            connected: AtomicBool::new(false),
            written: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            transactions: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            rtt: Samples::new(MAX_SAMPLES),
            quiet: AtomicBool::new(false),
            lag: AtomicU64::new(0),
        }
    }
}

/// A running peer and its cable. Dropping it stops the peer.
#[derive(Debug)]
pub struct TcpPeer {
    cable: Arc<CableInner>,
    stop: Arc<AtomicBool>,
    quiet: Arc<AtomicBool>,
    /// The engine until it is started.
    engine: Option<PeerEngine>,
    runner: Option<Runner>,
    counters: Arc<PeerCounters>,
}

/// Where the peer's engine runs.
#[derive(Debug)]
enum Runner {
    Thread(JoinHandle<TcpStats>),
    Unit(hv::sched::UnitJoin<TcpStats>),
}

/// The longest the peer sleeps with nothing to do.
const IDLE_NAP: Duration = Duration::from_millis(10);
/// Its sleep when it can do nothing until the other end acts.
const STUCK_NAP: Duration = Duration::from_micros(50);

/// The peer's local port.
const PEER_PORT: u16 = 49152;

impl TcpPeer {
    /// Starts the peer on a thread of its own (pinned to `spec.core`, if given);
    /// returns it and the NIC's two ends of the cable.
    pub fn start(spec: PeerSpec) -> std::io::Result<(Self, CableEnd, CableSink)> {
        let (mut p, a, b) = Self::new(spec);
        p.run_thread()?;
        Ok((p, a, b))
    }

    /// The peer and its cable, not yet running: the machine under test takes the
    /// cable's ends, then the peer runs on one of its pCPUs ([`TcpPeer::run_on`]) or on
    /// a thread ([`TcpPeer::run_thread`]).
    pub fn new(spec: PeerSpec) -> (Self, CableEnd, CableSink) {
        let cable = Arc::new(CableInner {
            to_nic: Mutex::new(Lane::new(spec.rate)),
            to_peer: Mutex::new(Lane::new(spec.rate)),
            nic: OnceLock::new(),
            peer: Arc::default(),
            counters: CableCounters::default(),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let quiet = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(PeerCounters::default());
        let engine = PeerEngine::new(
            spec,
            Arc::clone(&cable),
            Arc::clone(&stop),
            Arc::clone(&quiet),
            Arc::clone(&counters),
        );
        let (a, b) = (CableEnd(Arc::clone(&cable)), CableSink(Arc::clone(&cable)));
        (
            Self {
                cable,
                stop,
                quiet,
                engine: Some(engine),
                runner: None,
                counters,
            },
            a,
            b,
        )
    }

    /// Runs the peer's engine as a unit on pCPU `pcpu` of `sched`.
    pub fn run_on(
        &mut self,
        sched: &hv::sched::Scheduler,
        pcpu: usize,
    ) -> Result<(), hv::sched::SchedError> {
        if let Some(e) = self.engine.take() {
            let j = sched.place(pcpu, hv::sched::UnitSpec::device("tcp-peer"), e)?;
            self.runner = Some(Runner::Unit(j));
        }
        Ok(())
    }

    /// Runs the peer's engine on a thread of its own.
    pub fn run_thread(&mut self) -> std::io::Result<()> {
        let Some(mut e) = self.engine.take() else {
            return Ok(());
        };
        let core = e.spec.core;
        let doze = Arc::clone(&self.cable.peer);
        let thread = std::thread::Builder::new()
            .name("tcp-peer".into())
            .spawn(move || {
                if let Some(core) = core {
                    let _ = mem::cpu::pin_current_thread(core);
                }
                let _ = mem::cpu::set_timer_slack(1_000);
                loop {
                    match e.step() {
                        PeerStep::More => {}
                        PeerStep::Idle(until) => {
                            std::thread::park_timeout(
                                until.saturating_duration_since(Instant::now()),
                            );
                            doze.awake();
                        }
                        PeerStep::Done(stats) => return stats,
                    }
                }
            })?;
        self.cable.peer.bind(thread.thread().clone());
        self.runner = Some(Runner::Thread(thread));
        Ok(())
    }

    /// The peer's counters.
    pub fn counters(&self) -> &Arc<PeerCounters> {
        &self.counters
    }

    /// Stops writing: what was written still goes out (and is retransmitted as TCP
    /// needs), so a run can end with every byte delivered.
    pub fn quiesce(&self) {
        self.quiet.store(true, Ordering::Release);
        self.cable.peer.kick();
    }

    /// The cable's counters.
    pub fn cable(&self) -> &CableCounters {
        &self.cable.counters
    }

    /// Stops the peer; returns its TCP's counters.
    pub fn stop(mut self) -> Option<TcpStats> {
        self.halt()
    }

    fn halt(&mut self) -> Option<TcpStats> {
        self.stop.store(true, Ordering::Release);
        self.cable.peer.kick();
        match self.runner.take()? {
            Runner::Thread(t) => t.join().ok(),
            Runner::Unit(u) => u.join().ok(),
        }
    }
}

impl Drop for TcpPeer {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

/// The peer's application state.
struct App {
    app: PeerApp,
    /// Stream bytes written so far.
    written: u64,
    /// When the peer started sending (for the offered load).
    start: Option<Instant>,
    /// A transaction's request went out at this time; its answer is awaited.
    asked: Option<Instant>,
    /// Bytes of the awaited answer received.
    answered: usize,
    check: StreamCheck,
    scratch: Vec<u8>,
}

impl App {
    /// Writes what is due; returns when it next wants to run, if it is pacing.
    fn step(
        &mut self,
        host: &mut TcpHost,
        h: smoltcp::iface::SocketHandle,
        quiet: bool,
        c: &PeerCounters,
    ) -> Option<Instant> {
        let s = host.socket(h);
        if !s.may_send() {
            return None;
        }
        c.connected.store(true, Ordering::Release);
        let now = Instant::now();
        match self.app {
            PeerApp::Stream {
                message,
                rate,
                total,
            } => {
                let start = *self.start.get_or_insert(now);
                let mut next = None;
                while !quiet && s.send_capacity() - s.send_queue() >= message {
                    if total.is_some_and(|t| self.written >= t) {
                        break;
                    }
                    if let Some(r) = rate {
                        let due = start + Duration::from_secs_f64(self.written as f64 / r);
                        if due > now {
                            next = Some(due);
                            break;
                        }
                    }
                    let m = &mut self.scratch[..message];
                    fill_stream(self.written, m);
                    match s.send_slice(m) {
                        Ok(n) => self.written += n as u64,
                        Err(_) => break,
                    }
                }
                c.written.store(self.written, Ordering::Relaxed);
                if let Some(r) = rate {
                    let due = (now - start).as_secs_f64() * r;
                    c.lag.store(
                        (due - self.written as f64).max(0.0) as u64,
                        Ordering::Relaxed,
                    );
                }
                c.quiet.store(quiet, Ordering::Release);
                c.acked
                    .store(self.written - s.send_queue() as u64, Ordering::Relaxed);
                next
            }
            PeerApp::Rr { size, count } => {
                // The answer, as much of it as is here.
                while self.asked.is_some() && s.can_recv() {
                    let buf = &mut self.scratch[..size - self.answered];
                    let Ok(n) = s.recv_slice(buf) else { break };
                    self.check.check(&buf[..n]);
                    self.answered += n;
                    if self.answered == size {
                        if let Some(t) = self.asked.take() {
                            let _ = c.rtt.push(t.elapsed().as_nanos() as u64);
                        }
                        self.answered = 0;
                        c.transactions.fetch_add(1, Ordering::Relaxed);
                        c.corrupt.store(self.check.corrupt, Ordering::Relaxed);
                    }
                }
                let done = count.is_some_and(|n| c.transactions.load(Ordering::Relaxed) >= n);
                if !quiet
                    && self.asked.is_none()
                    && !done
                    && s.send_capacity() - s.send_queue() >= size
                {
                    let m = &mut self.scratch[..size];
                    fill_stream(self.written, m);
                    if s.send_slice(m) == Ok(size) {
                        self.written += size as u64;
                        self.asked = Some(Instant::now());
                    }
                }
                c.quiet.store(quiet, Ordering::Release);
                None
            }
        }
    }
}

/// What one step of the peer's engine came to.
enum PeerStep {
    More,
    Idle(Instant),
    Done(TcpStats),
}

/// The peer's host: its TCP stack, its application, and its end of the cable; a step
/// takes the frames due from the cable, runs the stack and the application, and puts
/// what it sends on the wire.
struct PeerEngine {
    spec: PeerSpec,
    cable: Arc<CableInner>,
    stop: Arc<AtomicBool>,
    quiet: Arc<AtomicBool>,
    counters: Arc<PeerCounters>,
    epoch: Instant,
    host: TcpHost,
    handle: Option<smoltcp::iface::SocketHandle>,
    app: App,
}

impl std::fmt::Debug for PeerEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerEngine")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl PeerEngine {
    fn new(
        spec: PeerSpec,
        cable: Arc<CableInner>,
        stop: Arc<AtomicBool>,
        quiet: Arc<AtomicBool>,
        counters: Arc<PeerCounters>,
    ) -> Self {
        let mut host = TcpHost::new(spec.ip, spec.mac, Duration::ZERO, 0x9e37_79b9_7f4a_7c15);
        let handle = host
            .open(Open::Connect {
                from: PEER_PORT,
                to: spec.to,
                port: spec.port,
            })
            .ok();
        if let (Some(h), PeerApp::Rr { .. }) = (handle, spec.app) {
            // One request at a time: Nagle would hold none back, and a delayed ACK on
            // an answer would only delay the ACK, not the next request.
            host.socket(h).set_nagle_enabled(false);
        }
        Self {
            app: App {
                app: spec.app,
                written: 0,
                start: None,
                asked: None,
                answered: 0,
                check: StreamCheck::default(),
                scratch: vec![0; 65536],
            },
            spec,
            cable,
            stop,
            quiet,
            counters,
            epoch: Instant::now(),
            host,
            handle,
        }
    }

    fn step(&mut self) -> PeerStep {
        let cable = Arc::clone(&self.cable);
        cable.peer.awake();
        let Some(h) = self.handle else {
            return PeerStep::Done(self.host.stats().clone());
        };
        if self.stop.load(Ordering::Acquire) {
            return PeerStep::Done(self.host.stats().clone());
        }
        let host = &mut self.host;
        let now = Instant::now();
        let mut got = 0;
        if let Ok(mut lane) = cable.to_peer.lock() {
            got = lane.deliver(now, |f| {
                host.input(f.len(), true, |b| {
                    b.copy_from_slice(f);
                    true
                });
            });
            cable
                .counters
                .to_peer
                .fetch_add(got as u64, Ordering::Relaxed);
        }
        let t = now.duration_since(self.epoch);
        host.poll(t);
        let app_due = self
            .app
            .step(host, h, self.quiet.load(Ordering::Acquire), &self.counters);
        host.poll(t);
        // Onto the wire, as far as the lane has room.
        let (mut sent, mut held) = (0, false);
        if let Ok(mut lane) = cable.to_nic.lock() {
            sent = host.output(|f| lane.push(f, now));
            held = host.output_queued() > 0;
        }
        if sent > 0 {
            if let Some(r) = cable.nic.get() {
                r.wake();
            }
        }
        // Idle until a frame arrives, the stack's timer, or the application's pace;
        // frames held for want of room wait for the NIC to take some (it wakes us).
        let epoch = self.epoch;
        let mut wake = host.poll_at(t).map(|d| epoch + d);
        let mut at = |d: Option<Instant>| {
            if let Some(d) = d {
                wake = Some(wake.map_or(d, |w| w.min(d)));
            }
        };
        at(cable.to_peer.lock().ok().and_then(|l| l.next_due()));
        at(app_due);
        let now = Instant::now();
        let progress = got + sent > 0;
        let nap = match wake {
            Some(w) if w <= now && progress && !held => return PeerStep::More,
            Some(w) if w > now => (w - now).min(IDLE_NAP),
            // Due already with nothing done (the stack waits on something only the
            // other end can change), or only the NIC can make room: a short nap, no
            // spinning on a core the machine under test may need.
            Some(_) => STUCK_NAP,
            None if held => STUCK_NAP,
            None => IDLE_NAP,
        };
        // Announce the sleep, then look once more: a frame put on the lane, a stop or a
        // quiesce since the first look must not be slept through.
        cable.peer.announce();
        let arrived = cable
            .to_peer
            .lock()
            .ok()
            .and_then(|l| l.next_due())
            .is_some_and(|d| d <= Instant::now());
        if arrived || self.stop.load(Ordering::Acquire) {
            cable.peer.awake();
            return PeerStep::More;
        }
        PeerStep::Idle(now + nap)
    }
}

impl hv::sched::Unit for PeerEngine {
    type Output = TcpStats;
    fn attach(&mut self, waker: &hv::sched::Waker, _stats: &Arc<hv::sched::UnitStats>) {
        self.cable.peer.bind_unit(waker);
    }
    fn step(&mut self, _cx: &hv::sched::Cx) -> hv::sched::Step<TcpStats> {
        match PeerEngine::step(self) {
            PeerStep::More => hv::sched::Step::More,
            PeerStep::Idle(t) => hv::sched::Step::Idle(Some(t)),
            PeerStep::Done(s) => hv::sched::Step::Done(s),
        }
    }
}

/// A cable between two devices (two hosts' NICs, paper 002's `n,n:1x1` set-up): a lane
/// each way at the wire's rate, each end the source of one lane and the sink of the
/// other.
#[derive(Debug)]
struct Crossover {
    lanes: [Mutex<Lane>; 2],
    /// Each end's NIC, to wake when a frame is put on its incoming lane.
    nics: [OnceLock<Arc<Doze>>; 2],
    /// Frames each end sent that its outgoing lane had no room for.
    dropped: [AtomicU64; 2],
}

/// One end of a [`crossover`] cable: where its device takes frames from and puts them.
#[derive(Debug)]
pub struct CrossEnd {
    cable: Arc<Crossover>,
    /// This end's index: it reads lane `me` and writes lane `1 - me`.
    me: usize,
}

/// A cable between two devices at `rate`: its two ends.
pub fn crossover(rate: WireRate) -> (CrossEnd, CrossEnd) {
    let cable = Arc::new(Crossover {
        lanes: [
            Mutex::new(Lane::with_frames(rate, CROSSOVER_FRAMES)),
            Mutex::new(Lane::with_frames(rate, CROSSOVER_FRAMES)),
        ],
        nics: [OnceLock::new(), OnceLock::new()],
        dropped: [AtomicU64::new(0), AtomicU64::new(0)],
    });
    (
        CrossEnd {
            cable: Arc::clone(&cable),
            me: 0,
        },
        CrossEnd { cable, me: 1 },
    )
}

impl CrossEnd {
    /// The other half of this end, for the device's transmit side.
    pub fn sink(&self) -> CrossEnd {
        CrossEnd {
            cable: Arc::clone(&self.cable),
            me: self.me,
        }
    }

    /// Frames this end sent that found the lane full.
    pub fn dropped(&self) -> u64 {
        self.cable.dropped[self.me].load(Ordering::Relaxed)
    }
}

impl WireSource for CrossEnd {
    fn poll(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
        let Ok(mut lane) = self.cable.lanes[self.me].lock() else {
            return 0;
        };
        lane.deliver(now, |f| emit(f, Offload::NONE))
    }

    fn next_due(&self) -> Option<Instant> {
        self.cable.lanes[self.me]
            .lock()
            .ok()
            .and_then(|l| l.next_due())
    }

    fn ready(&self) -> bool {
        self.next_due().is_some_and(|d| d <= Instant::now())
    }

    fn attach(&mut self, wake: &Arc<Doze>) {
        let _ = self.cable.nics[self.me].set(Arc::clone(wake));
    }

    /// The far end is a device like this one: its MAC takes PAUSE frames, and while
    /// paused its frames wait on the lane (its transmit queue) and its device sends
    /// nothing more ([`WireSink::room`]).
    fn pauses(&self) -> bool {
        true
    }

    fn pause(&mut self, on: bool, now: Instant) {
        if let Ok(mut lane) = self.cable.lanes[self.me].lock() {
            lane.pause(on, now);
        }
    }

    fn poll_held(&mut self, now: Instant, emit: &mut dyn FnMut(&[u8], Offload) -> bool) -> usize {
        let Ok(mut lane) = self.cable.lanes[self.me].lock() else {
            return 0;
        };
        lane.deliver_held(now, |f| emit(f, Offload::NONE))
    }
}

impl WireSink for CrossEnd {
    fn transmit(&mut self, frame: &[u8], _: Offload) {
        let to = 1 - self.me;
        let ok = self.cable.lanes[to]
            .lock()
            .is_ok_and(|mut l| l.push(frame, Instant::now()));
        if ok {
            if let Some(n) = self.cable.nics[to].get() {
                n.wake();
            }
        } else {
            self.cable.dropped[self.me].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn room(&self) -> bool {
        self.cable.lanes[1 - self.me]
            .lock()
            .is_ok_and(|l| l.takes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(k: u8) -> Vec<u8> {
        vec![k; 100]
    }

    #[test]
    fn a_paused_crossover_keeps_its_frames_and_takes_no_more_until_let_go() {
        let (a, mut b) = crossover(WireRate::GIGABIT);
        let mut to_b = a.sink();
        assert!(b.pauses());
        for k in 0..3 {
            assert!(to_b.room());
            to_b.transmit(&numbered(k), Offload::NONE);
        }
        let ms = Duration::from_millis(1);
        let t0 = Instant::now() + ms;
        // The receiver takes one, refuses the next and pauses the sender.
        let mut got = Vec::new();
        let took = b.poll_held(t0, &mut |f, _| {
            if got.is_empty() {
                got.push(f[0]);
                true
            } else {
                false
            }
        });
        assert_eq!((took, got.as_slice()), (1, &[0u8][..]));
        b.pause(true, t0);
        assert!(!to_b.room(), "a paused sender sends nothing more");
        assert_eq!(b.next_due(), None, "nothing is due while paused");
        assert_eq!(b.poll_held(t0 + 10 * ms, &mut |_, _| true), 0);
        // Let go: the refused frame first, then the rest, each once and in order.
        b.pause(false, t0 + 5 * ms);
        assert!(to_b.room());
        assert!(b.next_due().is_some_and(|d| d <= t0 + 5 * ms));
        b.poll_held(t0 + 10 * ms, &mut |f, _| {
            got.push(f[0]);
            true
        });
        assert_eq!(got, vec![0, 1, 2]);
        assert_eq!(a.sink().dropped(), 0);
    }

    #[test]
    fn a_full_crossover_lane_has_no_room_and_what_is_sent_anyway_is_counted_lost() {
        let (a, _b) = crossover(WireRate::GIGABIT);
        let mut to_b = a.sink();
        for _ in 0..CROSSOVER_FRAMES {
            assert!(to_b.room());
            to_b.transmit(&numbered(1), Offload::NONE);
        }
        assert!(!to_b.room());
        to_b.transmit(&numbered(2), Offload::NONE);
        assert_eq!(a.dropped(), 1);
    }
}
