//! Real interfaces on either end of the platform: a Linux TAP device whose frames a
//! reader thread takes in, and which frames are written out to.
//!
//! `pvio up` puts the NIC model's cable on one TAP (its far end in the "outside"
//! network namespace) and hands a guest's received frames to another (in the guest's
//! namespace, whose Linux stack plays the guest's network stack). The reader thread is
//! the outside world: it blocks in `read`, queues the frame in a buffer from a fixed
//! set, and wakes whoever consumes it (the device thread, or the guest's vCPU).

use std::fs::File;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::capture::{CaptureFile, CaptureTap};
use crate::nic::NicRegs;
use crate::wire::{WireSink, WireSource};

/// Frames queued between the reader and the consumer; beyond that the reader waits.
pub const TAP_QUEUE: usize = 256;
/// Bytes per frame buffer: a 1500-byte MTU frame and its Ethernet header fit.
const FRAME_BUF: usize = 2048;

/// A TAP port's counters.
#[derive(Debug, Default)]
pub struct TapCounters {
    /// Frames read from the interface and handed on.
    pub frames_in: AtomicU64,
    /// Bytes of those frames.
    pub bytes_in: AtomicU64,
    /// Frames written to the interface.
    pub frames_out: AtomicU64,
    /// Bytes of those frames.
    pub bytes_out: AtomicU64,
    /// Frames read but dropped: larger than a buffer (an MTU above 1500).
    pub oversize_in: AtomicU64,
    /// Writes the interface refused (it was down, say).
    pub write_errors: AtomicU64,
}

type Wake = Box<dyn Fn() + Send + Sync>;

/// One frame, one `write`: a TAP takes a frame whole or not at all, so a short write is
/// an error like a refused one.
fn write_frame(out: &mut File, frame: &[u8], c: &TapCounters) {
    match out.write(frame) {
        Ok(n) if n == frame.len() => {
            c.frames_out.fetch_add(1, Ordering::Relaxed);
            c.bytes_out.fetch_add(n as u64, Ordering::Relaxed)
        }
        _ => c.write_errors.fetch_add(1, Ordering::Relaxed),
    };
}

/// The counters as they stand.
impl net::counters::CounterSet for TapCounters {
    fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        f("frames_in", l(&self.frames_in));
        f("bytes_in", l(&self.bytes_in));
        f("frames_out", l(&self.frames_out));
        f("bytes_out", l(&self.bytes_out));
        f("oversize_in", l(&self.oversize_in));
        f("write_errors", l(&self.write_errors));
    }
}

impl TapCounters {
    /// The counters that count frames lost, by reason.
    pub const DROPS: &'static [&'static str] = &["oversize_in", "write_errors"];
}

/// One TAP interface: frames in through a reader thread, frames out by `write`.
pub struct TapPort {
    out: File,
    rx: Receiver<Vec<u8>>,
    free: SyncSender<Vec<u8>>,
    queued: Arc<AtomicUsize>,
    wake: Arc<OnceLock<Wake>>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
    counters: Arc<TapCounters>,
    /// A frame the consumer refused, first in line.
    held: Option<Vec<u8>>,
    /// Packet capture: of the frames read from the interface as they are handed on,
    /// of those written to it, and one for the sink (`sink`) to take.
    capture: Option<Captures>,
}

/// A port's capture taps.
#[derive(Debug)]
struct Captures {
    taken: CaptureTap,
    sent: CaptureTap,
    for_sink: Option<CaptureTap>,
}

impl std::fmt::Debug for TapPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TapPort")
            .field("queued", &self.queued.load(Ordering::Relaxed))
            .field("counters", &self.counters)
            .finish()
    }
}

impl TapPort {
    /// Starts the reader on `file` (an open TAP). Buffers are allocated here, once.
    pub fn start(file: File) -> std::io::Result<Self> {
        let mut input = file.try_clone()?;
        let (tx, rx) = sync_channel::<Vec<u8>>(TAP_QUEUE);
        let (free, free_rx) = sync_channel::<Vec<u8>>(TAP_QUEUE);
        let free_again = free.clone();
        for _ in 0..TAP_QUEUE {
            let _ = free.try_send(vec![0u8; FRAME_BUF]);
        }
        let queued = Arc::new(AtomicUsize::new(0));
        let wake: Arc<OnceLock<Wake>> = Arc::new(OnceLock::new());
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(TapCounters::default());
        let (q, w, s, c) = (
            Arc::clone(&queued),
            Arc::clone(&wake),
            Arc::clone(&stop),
            Arc::clone(&counters),
        );
        let reader = std::thread::Builder::new()
            .name("tap-reader".into())
            .spawn(move || {
                // Back-pressure, not loss: with every buffer queued the reader stops
                // reading, the interface's own queue fills, and the sender's stack
                // (its qdisc, TCP) slows down, as with a real NIC's full TX ring.
                'frames: while !s.load(Ordering::Acquire) {
                    let mut buf = match free_rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(b) => b,
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => break,
                    };
                    match mem::tap::wait_readable(&input, Duration::from_millis(50)) {
                        Ok(true) => {}
                        Ok(false) => {
                            let _ = free_again.try_send(buf);
                            continue;
                        }
                        Err(_) => break,
                    }
                    buf.resize(FRAME_BUF, 0);
                    let n = match input.read(&mut buf) {
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
                        Err(_) => break,
                    };
                    if n == 0 || n >= FRAME_BUF {
                        if n >= FRAME_BUF {
                            c.oversize_in.fetch_add(1, Ordering::Relaxed);
                        }
                        let _ = free_again.try_send(buf);
                        continue;
                    }
                    buf.truncate(n);
                    c.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                    // Counted before it is visible: the consumer may see the frame
                    // before `try_send` returns.
                    q.fetch_add(1, Ordering::Release);
                    loop {
                        match tx.try_send(buf) {
                            Ok(()) => break,
                            Err(TrySendError::Full(b)) => {
                                if s.load(Ordering::Acquire) {
                                    break 'frames;
                                }
                                buf = b;
                                std::thread::sleep(Duration::from_micros(50));
                            }
                            Err(TrySendError::Disconnected(_)) => break 'frames,
                        }
                    }
                    c.frames_in.fetch_add(1, Ordering::Relaxed);
                    if let Some(w) = w.get() {
                        w();
                    }
                }
            })?;
        Ok(Self {
            out: file,
            rx,
            free,
            queued,
            wake,
            stop,
            reader: Some(reader),
            counters,
            held: None,
            capture: None,
        })
    }

    /// Captures every frame that crosses this interface from now on, both ways, into
    /// `file` (a sink made after this captures what it writes too).
    pub fn capture(&mut self, file: &CaptureFile) {
        self.capture = Some(Captures {
            taken: file.tap(),
            sent: file.tap(),
            for_sink: Some(file.tap()),
        });
    }

    /// Who the reader wakes when a frame is queued (set once).
    pub fn set_wake(&self, wake: impl Fn() + Send + Sync + 'static) {
        let _ = self.wake.set(Box::new(wake));
    }

    /// Whether frames wait.
    pub fn ready(&self) -> bool {
        self.queued.load(Ordering::Acquire) > 0
    }

    /// Hands queued frames to `f` in order, recycling each buffer, until `f` refuses
    /// one (returns false): that frame stays first in line for the next call. Returns
    /// how many were taken.
    pub fn recv(&mut self, mut f: impl FnMut(&[u8]) -> bool) -> usize {
        let mut n = 0;
        while let Some(buf) = self.held.take().or_else(|| self.rx.try_recv().ok()) {
            if !f(&buf) {
                self.held = Some(buf);
                break;
            }
            if let Some(c) = &self.capture {
                c.taken.frame(&buf);
            }
            self.queued.fetch_sub(1, Ordering::AcqRel);
            let _ = self.free.try_send(buf);
            n += 1;
        }
        n
    }

    /// Writes one frame to the interface.
    pub fn send(&mut self, frame: &[u8]) {
        if let Some(c) = &self.capture {
            c.sent.frame(frame);
        }
        write_frame(&mut self.out, frame, &self.counters);
    }

    /// A second handle for writing (the NIC's sink, while this is its source); the
    /// first one made after [`TapPort::capture`] captures what it writes.
    pub fn sink(&mut self) -> std::io::Result<TapSink> {
        Ok(TapSink {
            out: self.out.try_clone()?,
            counters: Arc::clone(&self.counters),
            capture: self.capture.as_mut().and_then(|c| c.for_sink.take()),
        })
    }

    /// The counters.
    pub fn counters(&self) -> &Arc<TapCounters> {
        &self.counters
    }
}

impl Drop for TapPort {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// Writes the NIC's transmitted frames to a TAP.
#[derive(Debug)]
pub struct TapSink {
    out: File,
    counters: Arc<TapCounters>,
    capture: Option<CaptureTap>,
}

impl WireSink for TapSink {
    fn transmit(&mut self, frame: &[u8]) {
        if let Some(c) = &self.capture {
            c.frame(frame);
        }
        write_frame(&mut self.out, frame, &self.counters);
    }
}

impl WireSource for TapPort {
    fn poll(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8])) -> usize {
        self.recv(|f| {
            emit(f);
            true
        })
    }
    fn next_due(&self) -> Option<Instant> {
        None
    }
    fn ready(&self) -> bool {
        TapPort::ready(self)
    }
    fn attach(&mut self, regs: &Arc<NicRegs>) {
        let r = Arc::clone(regs);
        self.set_wake(move || r.wire_wake());
    }
}
