//! Real interfaces on either end of the platform: a Linux TAP device whose frames are
//! read in, and which frames are written out to.
//!
//! `pvio up` puts the NIC model's cable on one TAP (its far end in the "outside"
//! network namespace) and hands a guest's received frames to another (in the guest's
//! namespace, whose Linux stack plays the guest's network stack). The frames' consumer
//! (the NIC's engine, or the guest's vCPU) reads them itself, without waiting, in its
//! step on its pCPU, and the interface is its interrupt line ([`IrqLine`]): the pCPU
//! looks at it while it spins and sleeps on it, and wakes the consumer when input
//! waits, one host wake-up at most where a reader thread cost one for itself and one for
//! the consumer. A consumer that takes no more leaves the frames in the interface's own
//! queue, and the sender's stack (its qdisc, TCP) slows down, as with a real NIC's full
//! ring.

use std::fs::File;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hv::sched::IrqLine;

use mem::tap::TapOffload;
use net::offload::{Offload, VnetHdr, MAX_HEADERS, MAX_OFFLOAD_LEN, VNET_HDR_LEN};

use crate::capture::{CaptureFile, CaptureTap};
use crate::wire::{WireSink, WireSource};

/// Bytes per frame buffer: a 1500-byte MTU frame and its Ethernet header fit.
const FRAME_BUF: usize = 2048;
/// Bytes per frame buffer with offloads: the virtio-net header and a 64 KiB packet.
const OFFLOAD_BUF: usize = VNET_HDR_LEN + MAX_OFFLOAD_LEN;

/// A port's counters: a TAP's, or a packet socket's on a real interface
/// ([`crate::packet`]).
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
    /// Reads that failed other than for want of input (the interface went away): the
    /// port then stops listening on its line.
    pub read_errors: AtomicU64,
    /// Frames read whose virtio-net header the frame does not bear out (a GSO type
    /// other than TCPv4, a checksum offset past the headers), dropped.
    pub bad_offload_in: AtomicU64,
    /// Large (GSO) frames read.
    pub gso_in: AtomicU64,
    /// Large (GSO) frames written.
    pub gso_out: AtomicU64,
    /// Frames the interface had for the port that found its packet ring full (the
    /// kernel's count): the cable's FIFO overflowed.
    pub ring_full_in: AtomicU64,
    /// Packet-ring slots whose header did not place a whole frame in the slot.
    pub bad_slot_in: AtomicU64,
    /// Frames taken from a packet ring with the transport checksum left partial by
    /// the sender's stack (a veth peer's), handed on with that offload.
    pub csum_partial_in: AtomicU64,
    /// System calls the port made to move frames: each `read`, `write` and
    /// `io_uring_enter` (a look that found nothing included), each `send` and ring
    /// `poll` of a packet socket.
    pub syscalls: AtomicU64,
    /// 1 while frames cross in batches through an io_uring, 0 one a call.
    pub batched: AtomicU64,
}

/// One frame, one `write` (with offloads, one `writev` of the virtio-net header and
/// the frame): a TAP takes a frame whole or not at all, so a short write is an error
/// like a refused one. A frame with offload metadata to a TAP without offloads is
/// refused, counted as a write error: its sender was to finish it.
///
/// A large segment whose checksum was verified (an LRO aggregate: its TCP checksum
/// field is its first segment's) is written as a partial one instead, its field made the
/// pseudo-header sum in a copy of the headers: Linux's TAP takes no `DATA_VALID` on
/// the way in and would verify the field against the whole, as its own segmentation of
/// such a packet (`tcp4_gso_segment`) does the same conversion.
fn write_frame(out: &mut File, vnet: bool, frame: &[u8], mut off: Offload, c: &TapCounters) {
    c.syscalls.fetch_add(1, Ordering::Relaxed);
    let r = if vnet {
        let l4 = off.gso.and_then(|_| {
            net::offload::checksum_setup(&frame[..frame.len().min(MAX_HEADERS)], frame.len()).ok()
        });
        let mut head = [0u8; MAX_HEADERS];
        let mut split = 0;
        if let (Some(l4), net::offload::Csum::Valid) = (&l4, off.csum) {
            split = l4.headers();
            head[..split].copy_from_slice(&frame[..split]);
            net::offload::set_pseudo(&mut head[..split], l4);
            off.csum = l4.partial();
        }
        let mut hdr = [0u8; VNET_HDR_LEN];
        VnetHdr::from_offload(&off, l4.as_ref()).write(&mut hdr);
        if off.gso.is_some() && l4.is_some() {
            c.gso_out.fetch_add(1, Ordering::Relaxed);
        }
        out.write_vectored(&[
            IoSlice::new(&hdr),
            IoSlice::new(&head[..split]),
            IoSlice::new(&frame[split..]),
        ])
        .map(|n| n.saturating_sub(VNET_HDR_LEN))
    } else if off != Offload::NONE && off.csum != net::offload::Csum::Valid {
        Err(std::io::ErrorKind::InvalidInput.into())
    } else {
        out.write(frame)
    };
    match r {
        Ok(n) if n == frame.len() => {
            c.frames_out.fetch_add(1, Ordering::Relaxed);
            c.bytes_out.fetch_add(n as u64, Ordering::Relaxed)
        }
        _ => c.write_errors.fetch_add(1, Ordering::Relaxed),
    };
}

/// Puts one frame in `slot` as the interface takes it (behind its virtio-net header if
/// `vnet`), `fill` writing the frame's `len` bytes; the same judgement and header as
/// [`write_frame`], the aggregate's checksum field made partial in place (the slot is
/// the port's own copy). Returns the bytes to write, or None (counted) if the frame
/// cannot go.
fn fill_slot(
    slot: &mut [u8],
    vnet: bool,
    len: usize,
    mut off: Offload,
    fill: impl FnOnce(&mut [u8]) -> bool,
    c: &TapCounters,
) -> Option<usize> {
    let hdr = if vnet { VNET_HDR_LEN } else { 0 };
    if !vnet && off != Offload::NONE && off.csum != net::offload::Csum::Valid {
        c.write_errors.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    if hdr + len > slot.len() || !fill(&mut slot[hdr..hdr + len]) {
        c.write_errors.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    if vnet {
        let (h, frame) = slot.split_at_mut(hdr);
        let frame = &mut frame[..len];
        let l4 = off.gso.and_then(|_| {
            net::offload::checksum_setup(&frame[..frame.len().min(MAX_HEADERS)], frame.len()).ok()
        });
        if let (Some(l4), net::offload::Csum::Valid) = (&l4, off.csum) {
            net::offload::set_pseudo(&mut frame[..l4.headers()], l4);
            off.csum = l4.partial();
        }
        let h: &mut [u8; VNET_HDR_LEN] = h.try_into().expect("the header's length");
        VnetHdr::from_offload(&off, l4.as_ref()).write(h);
        if off.gso.is_some() && l4.is_some() {
            c.gso_out.fetch_add(1, Ordering::Relaxed);
        }
    }
    c.bytes_out.fetch_add(len as u64, Ordering::Relaxed);
    Some(hdr + len)
}

/// Queues one frame of `len` bytes on `ring` as the interface takes it ([`fill_slot`]),
/// `capture` shown the frame; a frame that found no slot is counted as a write error.
fn queue_on(
    ring: &mut mem::tapring::TapRing,
    vnet: bool,
    len: usize,
    off: Offload,
    fill: impl FnOnce(&mut [u8]) -> bool,
    c: &TapCounters,
    capture: Option<&CaptureTap>,
) {
    let hdr = if vnet { VNET_HDR_LEN } else { 0 };
    let queued = ring.send(hdr + len, |slot| {
        let Some(n) = fill_slot(slot, vnet, len, off, fill, c) else {
            return 0;
        };
        if let Some(cap) = capture {
            cap.frame(&slot[hdr..n]);
        }
        n
    });
    if !queued {
        c.write_errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// Adds what `ring` did since `seen` to the port's counters `c`, and remembers it.
fn sync_counts(
    ring: &mem::tapring::TapRing,
    seen: &mut (mem::tapring::TapRingStats, u64),
    c: &TapCounters,
) {
    let (st, errs) = (ring.stats(), ring.tx_errors());
    let (was, was_errs) = *seen;
    c.syscalls
        .fetch_add(st.enters - was.enters, Ordering::Relaxed);
    c.frames_out
        .fetch_add(st.writes - was.writes, Ordering::Relaxed);
    c.write_errors.fetch_add(errs - was_errs, Ordering::Relaxed);
    *seen = (st, errs);
}

/// Frames at most this long go through the ring's slots; a longer one (a large TCP
/// segment) is written on its own from where it lies, as copying 64 KiB into a slot
/// costs more than the call it saves.
pub const BATCH_MAX_FRAME: usize = 4096;

/// How a port moves frames across its interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EdgeIo {
    /// In batches through an io_uring (`mem::tapring`), many frames a system call each
    /// way, by reads that never wait (`RxMode::Nowait`): done inside the call of
    /// whichever thread looks, so the port's consumer may move between threads (a
    /// vCPU or an engine that idle pCPUs run). Where the kernel cannot, as `Plain`.
    Batched,
    /// As `Batched`, by one multishot read armed in the kernel (`RxMode::Armed`): a
    /// look that finds nothing costs no call, but the reads run as work of the thread
    /// that armed them, so the port's consumer stays on that thread.
    Armed,
    /// One `read` or `write` a frame.
    Plain,
}

/// The port's io_uring, made on the thread that first moves frames (the kernel runs a
/// ring's reads in the thread that armed them), or why there is none.
#[derive(Debug)]
enum Ring {
    /// Wanted, reading as this says, not made yet.
    Wanted(mem::tapring::RxMode),
    Up(Box<mem::tapring::TapRing>),
    /// Plain I/O: not wanted, or the kernel could not.
    None,
}

impl Ring {
    /// The ring `io` asks for.
    fn wanted(io: EdgeIo) -> Self {
        match io {
            EdgeIo::Batched => Ring::Wanted(mem::tapring::RxMode::Nowait),
            EdgeIo::Armed => Ring::Wanted(mem::tapring::RxMode::Armed),
            EdgeIo::Plain => Ring::None,
        }
    }

    /// The same kind of ring, not made yet (for a second handle of the interface).
    fn again(&self) -> Self {
        match self {
            Ring::Wanted(m) => Ring::Wanted(*m),
            Ring::Up(r) => Ring::Wanted(r.mode()),
            Ring::None => Ring::None,
        }
    }

    /// Whether the ring's work must be done from one thread (its reads run as work of
    /// the thread that armed them).
    fn thread_bound(&self) -> bool {
        match self {
            Ring::Wanted(m) => *m == mem::tapring::RxMode::Armed,
            Ring::Up(r) => r.mode() == mem::tapring::RxMode::Armed,
            Ring::None => false,
        }
    }
}

/// Receive buffers and transmit slots of a port's ring: for MTU-sized frames, and for
/// frames behind a virtio-net header (a 64 KiB segment is read into one buffer).
fn ring_shape(vnet: bool) -> (u16, u16, usize) {
    if vnet {
        (64, 64, OFFLOAD_BUF)
    } else {
        (256, 128, FRAME_BUF)
    }
}

hv::atomic_counter_set!(TapCounters => TapCounts {
    frames_in,
    bytes_in,
    frames_out,
    bytes_out,
    oversize_in,
    write_errors,
    read_errors,
    bad_offload_in,
    gso_in,
    gso_out,
    ring_full_in,
    bad_slot_in,
    csum_partial_in,
    syscalls,
    batched,
});

impl TapCounters {
    /// The counters that count frames lost, by reason.
    pub const DROPS: &'static [&'static str] = &[
        "oversize_in",
        "write_errors",
        "bad_offload_in",
        "ring_full_in",
        "bad_slot_in",
    ];
}

/// One TAP interface: frames in by non-blocking `read`s in its consumer's step, frames
/// out by `write`.
pub struct TapPort {
    /// The interface as the consumer's interrupt line: dropped before the file, so
    /// that it is off its pCPU before the descriptor closes.
    line: Option<IrqLine>,
    out: File,
    /// Frames carry a virtio-net header.
    vnet: bool,
    /// The one frame buffer: a frame is read into it and handed on from it.
    buf: Box<[u8]>,
    /// A frame the consumer refused, still in `buf`: its length and offload.
    held: Option<(usize, Offload)>,
    /// The last `recv` stopped at its budget with input perhaps still waiting.
    more: bool,
    /// What wakes the device whose wire source this is, once it runs as a unit.
    doze: Option<Arc<crate::wire::Doze>>,
    /// The consumer's unit, once bound.
    waker: Option<hv::sched::Waker>,
    counters: Arc<TapCounters>,
    /// Packet capture: of the frames read from the interface as they are handed on,
    /// of those written to it, and one for the sink (`sink`) to take.
    capture: Option<Captures>,
    /// Batched I/O, if any.
    ring: Ring,
    /// A frame on its way out that does not go through the ring, assembled by
    /// [`TapPort::send_with`] (allocated once).
    tx_buf: Box<[u8]>,
    /// The ring's descriptor as a second line: its completions wake the consumer.
    ring_line: Option<IrqLine>,
    /// The ring's counts as last added to the port's counters.
    ring_seen: (mem::tapring::TapRingStats, u64),
}

/// Frames one `recv` reads at most before it lets its consumer's step end (NAPI's
/// budget): a flood on the interface cannot hold the pCPU.
pub const RECV_BUDGET: usize = 64;

/// What one `read` of the interface gave.
enum Got {
    /// A frame of this length (header included) with this offload, in the buffer.
    Frame(usize, Offload),
    /// Something read and dropped (counted), or an interrupted read: read on.
    Skip,
    /// Nothing waits.
    Empty,
    /// The interface failed (it went away): nothing more will come.
    Failed,
}

/// Judges `read`, the `n` bytes one read of an interface gave into a buffer of `size`:
/// the header is the kernel's, but the frame behind it came from outside, so what it
/// claims is checked against the frame. Its offload, or None (counted) to drop it. A
/// frame judged good is counted in once taken ([`count_in`]).
fn judge(read: &[u8], size: usize, vnet: bool, c: &TapCounters) -> Option<Offload> {
    let n = read.len();
    let hdr = if vnet { VNET_HDR_LEN } else { 0 };
    if n <= hdr || n >= size {
        if n >= size {
            c.oversize_in.fetch_add(1, Ordering::Relaxed);
        }
        return None;
    }
    let off = if vnet {
        let mut h = [0u8; VNET_HDR_LEN];
        h.copy_from_slice(&read[..VNET_HDR_LEN]);
        let frame = &read[hdr..];
        match VnetHdr::parse(&h).to_offload(&frame[..frame.len().min(MAX_HEADERS)], frame.len()) {
            Ok(o) => o,
            Err(_) => {
                c.bad_offload_in.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        }
    } else {
        Offload::NONE
    };
    Some(off)
}

/// Counts a frame of `len` bytes (header excluded) with `off` as taken from the
/// interface.
fn count_in(c: &TapCounters, len: usize, off: Offload) {
    if off.gso.is_some() {
        c.gso_in.fetch_add(1, Ordering::Relaxed);
    }
    c.bytes_in.fetch_add(len as u64, Ordering::Relaxed);
    c.frames_in.fetch_add(1, Ordering::Relaxed);
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
            .field("held", &self.held.is_some())
            .field("counters", &self.counters)
            .finish()
    }
}

impl TapPort {
    /// Takes `file` (an open TAP without offloads) as a port. Its buffer is allocated
    /// here, once.
    pub fn start(file: File) -> std::io::Result<Self> {
        Self::start_with(file, TapOffload::None)
    }

    /// Takes `file`, a TAP opened with offloads `off` ([`mem::tap::open_tap_offload`]),
    /// as a port: unless `None`, frames are read and written behind a virtio-net
    /// header, whose metadata is checked against each frame read. Reads no longer wait
    /// (for every handle of the file): its consumer reads in its own step, and the
    /// interface is its interrupt line ([`TapPort::bind_unit`]).
    pub fn start_with(file: File, off: TapOffload) -> std::io::Result<Self> {
        Self::start_io(file, off, EdgeIo::Batched)
    }

    /// As [`TapPort::start_with`], moving frames as `io` says.
    pub fn start_io(file: File, off: TapOffload, io: EdgeIo) -> std::io::Result<Self> {
        let vnet = off != TapOffload::None;
        let size = if vnet { OFFLOAD_BUF } else { FRAME_BUF };
        mem::poll::set_nonblocking(&file)?;
        Ok(Self {
            line: None,
            out: file,
            vnet,
            buf: vec![0u8; size].into_boxed_slice(),
            held: None,
            more: false,
            doze: None,
            waker: None,
            counters: Arc::new(TapCounters::default()),
            capture: None,
            ring: Ring::wanted(io),
            ring_line: None,
            ring_seen: Default::default(),
            tx_buf: vec![0u8; size].into_boxed_slice(),
        })
    }

    /// The port's ring, made now if wanted and not yet made (on the calling thread,
    /// which from then on runs its reads, unless they never wait); None for plain I/O.
    fn ring(&mut self) -> Option<&mut mem::tapring::TapRing> {
        if let Ring::Wanted(mode) = self.ring {
            let (rx, tx, size) = ring_shape(self.vnet);
            self.ring = match mem::tapring::TapRing::with_mode(self.out.as_fd(), rx, tx, size, mode)
            {
                Ok(r) => {
                    self.counters.batched.store(1, Ordering::Relaxed);
                    Ring::Up(Box::new(r))
                }
                Err(_) => Ring::None,
            };
            // A ring whose reads wait in the kernel has completions between looks,
            // and wakes the consumer for them.
            if let (true, Ring::Up(r), Some(w)) = (
                self.ring.thread_bound(),
                &self.ring,
                self.doze
                    .as_ref()
                    .and_then(|d| d.unit())
                    .or(self.waker.clone()),
            ) {
                self.ring_line = w.irq_line(r.ring_fd()).ok();
            }
        }
        match &mut self.ring {
            Ring::Up(r) => Some(r),
            _ => None,
        }
    }

    /// Adds what the ring did since last time to the port's counters.
    fn sync_ring_counts(&mut self) {
        if let Ring::Up(r) = &self.ring {
            sync_counts(r, &mut self.ring_seen, &self.counters);
        }
    }

    /// The unit that consumes the port's frames: input on the interface wakes it.
    pub fn bind_unit(&mut self, waker: &hv::sched::Waker) {
        self.waker = Some(waker.clone());
        if self.line.is_none() {
            self.line = waker.irq_line(self.out.as_raw_fd()).ok();
            if let Some(l) = &self.line {
                l.arm();
            }
        }
        if let (true, Ring::Up(r), None) = (self.ring.thread_bound(), &self.ring, &self.ring_line) {
            self.ring_line = waker.irq_line(r.ring_fd()).ok();
        }
        if let Some(l) = &self.ring_line {
            l.arm();
        }
    }

    /// The interface is no longer its consumer's line (the consumer is gone; a new one
    /// binds again).
    pub fn unbind_unit(&mut self) {
        self.line = None;
        self.ring_line = None;
        self.waker = None;
    }

    /// Arms the port's lines: the consumer found nothing waiting.
    fn arm(&self) {
        if let Some(l) = &self.line {
            l.arm();
        }
        if let Some(l) = &self.ring_line {
            l.arm();
        }
    }

    /// Reads one frame into the buffer and judges it: the header is the kernel's, but
    /// the frame behind it came from outside, so what it claims is checked against the
    /// frame.
    fn read_one(&mut self) -> Got {
        let c = &self.counters;
        c.syscalls.fetch_add(1, Ordering::Relaxed);
        let n = match (&self.out).read(&mut self.buf) {
            // End of input (a TAP never gives it; a socket whose peer left does): as
            // a failure, or every look would read nothing again.
            Ok(0) => {
                c.read_errors.fetch_add(1, Ordering::Relaxed);
                return Got::Failed;
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Got::Skip,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Got::Empty,
            Err(_) => {
                c.read_errors.fetch_add(1, Ordering::Relaxed);
                return Got::Failed;
            }
        };
        match judge(&self.buf[..n], self.buf.len(), self.vnet, c) {
            Some(off) => Got::Frame(n, off),
            None => Got::Skip,
        }
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

    /// Whether a frame waits that the last `recv` did not hand on (a port not yet
    /// bound to a unit looks at the interface itself).
    pub fn ready(&self) -> bool {
        self.held.is_some()
            || self.more
            || matches!(&self.ring, Ring::Up(r) if r.pending())
            || (self.line.is_none()
                && mem::tap::wait_readable(&self.out, Duration::ZERO).unwrap_or(false))
    }

    /// Hands frames read from the interface, with their offload, to `f` in order,
    /// until `f` refuses one (returns false: that frame stays first in line for the
    /// next call), nothing waits (the line is armed), or [`RECV_BUDGET`] frames went.
    /// Returns how many were taken.
    pub fn recv(&mut self, mut f: impl FnMut(&[u8], Offload) -> bool) -> usize {
        if self.line.is_none() {
            if let Some(w) = self.doze.as_ref().and_then(|d| d.unit()) {
                self.bind_unit(&w);
            }
        }
        if self.ring().is_some() {
            return self.recv_ring(f);
        }
        let hdr = if self.vnet { VNET_HDR_LEN } else { 0 };
        let mut n = 0;
        self.more = false;
        while n < RECV_BUDGET {
            let (len, off) = match self.held.take() {
                Some(h) => h,
                None => match self.read_one() {
                    Got::Frame(len, off) => (len, off),
                    Got::Skip => continue,
                    Got::Empty => {
                        if let Some(l) = &self.line {
                            l.arm();
                        }
                        return n;
                    }
                    // Not armed: a descriptor in error is always "ready", and would
                    // wake its consumer at every look.
                    Got::Failed => return n,
                },
            };
            if !f(&self.buf[hdr..len], off) {
                self.held = Some((len, off));
                return n;
            }
            count_in(&self.counters, len - hdr, off);
            if let Some(c) = &self.capture {
                c.taken.frame(&self.buf[hdr..len]);
            }
            n += 1;
        }
        self.more = true;
        n
    }

    /// [`TapPort::recv`] through the ring: the frames its reads have placed, many for
    /// one system call.
    fn recv_ring(&mut self, mut f: impl FnMut(&[u8], Offload) -> bool) -> usize {
        let Self {
            ring: Ring::Up(ring),
            vnet,
            counters: c,
            capture,
            ..
        } = self
        else {
            return 0;
        };
        let (vnet, hdr) = (*vnet, if *vnet { VNET_HDR_LEN } else { 0 });
        let size = ring_shape(vnet).2;
        let mut handed = 0;
        let mut failed = false;
        ring.recv(RECV_BUDGET, |ev, bytes| match ev {
            mem::tapring::RxEvent::Error(_) => {
                c.read_errors.fetch_add(1, Ordering::Relaxed);
                failed = true;
                true
            }
            mem::tapring::RxEvent::Frame { .. } => {
                let Some(off) = judge(bytes, size, vnet, c) else {
                    return true;
                };
                if !f(&bytes[hdr..], off) {
                    // Judged again when it is handed on again.
                    return false;
                }
                count_in(c, bytes.len() - hdr, off);
                if let Some(cap) = capture {
                    cap.taken.frame(&bytes[hdr..]);
                }
                handed += 1;
                true
            }
        });
        if failed {
            // The ring's read ended for good, after every frame it had read: the port
            // goes on one frame a call, in order, rather than leave the interface
            // unread (its readiness would wake the consumer at every look).
            self.close_io();
            self.more = true;
            return handed;
        }
        self.more = handed == RECV_BUDGET || matches!(&self.ring, Ring::Up(r) if r.pending());
        if !self.more {
            self.arm();
        }
        self.sync_ring_counts();
        handed
    }

    /// Writes one frame to the interface now, with its offload (for a TAP without
    /// offloads, only [`Offload::NONE`] or a verified checksum), after any frames
    /// queued by [`TapPort::send_with`].
    pub fn send(&mut self, frame: &[u8], off: Offload) {
        self.flush();
        if let Some(c) = &self.capture {
            c.sent.frame(frame);
        }
        write_frame(&mut self.out, self.vnet, frame, off, &self.counters);
    }

    /// Queues one frame for the interface, `fill` writing its `len` bytes where they
    /// go (a slot of the ring, or the port's own transmit buffer): the copy a caller
    /// would make to hand over one slice is the only one. With batched I/O it leaves
    /// with the next [`TapPort::flush`], which the caller owes once it has queued what
    /// it has; otherwise (or if it is long) it is written now. A `fill` that fails
    /// (returns false) sends nothing, counted as a write error.
    pub fn send_with(&mut self, len: usize, off: Offload, fill: impl FnOnce(&mut [u8]) -> bool) {
        let mut fill = Some(fill);
        let mut once = |buf: &mut [u8]| fill.take().is_some_and(|f| f(buf));
        if self.queue(len, off, &mut once) {
            return;
        }
        self.flush();
        let mut frame = std::mem::take(&mut self.tx_buf);
        if len <= frame.len() && once(&mut frame[..len]) {
            if let Some(c) = &self.capture {
                c.sent.frame(&frame[..len]);
            }
            write_frame(&mut self.out, self.vnet, &frame[..len], off, &self.counters);
        } else {
            self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
        }
        self.tx_buf = frame;
    }

    /// Queues a frame of `len` bytes on the ring, if it goes that way (batched I/O,
    /// and short enough): true if it was taken (queued, or refused and counted).
    fn queue(&mut self, len: usize, off: Offload, fill: impl FnOnce(&mut [u8]) -> bool) -> bool {
        if len > BATCH_MAX_FRAME || self.ring().is_none() {
            return false;
        }
        let Self {
            ring: Ring::Up(ring),
            vnet,
            counters,
            capture,
            ..
        } = self
        else {
            return false;
        };
        let cap = capture.as_ref().map(|c| &c.sent);
        queue_on(ring, *vnet, len, off, fill, counters, cap);
        true
    }

    /// Ends the port's batched I/O on the calling thread (the one that armed its reads:
    /// the consumer's, as it stops): queued frames go, the kernel lets go of the
    /// interface, and the port moves frames one a call from then on.
    pub fn close_io(&mut self) {
        if let Ring::Up(r) = &mut self.ring {
            r.close();
        }
        self.sync_ring_counts();
        self.ring_line = None;
        self.ring = Ring::None;
    }

    /// Hands every frame queued for the interface over in one system call.
    pub fn flush(&mut self) {
        if let Ring::Up(r) = &mut self.ring {
            if r.queued() > 0 {
                r.flush();
            }
        }
        self.sync_ring_counts();
    }

    /// Whether frames go with a virtio-net header (partial checksums and large TCP
    /// segments are taken).
    pub fn takes_offload(&self) -> bool {
        self.vnet
    }

    /// A second handle for writing (the NIC's sink, while this is its source); the
    /// first one made after [`TapPort::capture`] captures what it writes.
    pub fn sink(&mut self) -> std::io::Result<TapSink> {
        Ok(TapSink {
            out: self.out.try_clone()?,
            vnet: self.vnet,
            counters: Arc::clone(&self.counters),
            capture: self.capture.as_mut().and_then(|c| c.for_sink.take()),
            ring: self.ring.again(),
            ring_seen: Default::default(),
        })
    }

    /// The counters.
    pub fn counters(&self) -> &Arc<TapCounters> {
        &self.counters
    }
}

impl AsRawFd for TapPort {
    /// The interface's descriptor, for an owner that waits on it itself.
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.out.as_raw_fd()
    }
}

/// Writes the NIC's transmitted frames to a TAP: in batches through a ring of its own
/// (one system call a transmit pass) where its port has one, each frame by a `write`
/// otherwise.
#[derive(Debug)]
pub struct TapSink {
    out: File,
    vnet: bool,
    counters: Arc<TapCounters>,
    capture: Option<CaptureTap>,
    ring: Ring,
    ring_seen: (mem::tapring::TapRingStats, u64),
}

impl TapSink {
    /// The sink's ring (transmit only), made on the device's thread at first use.
    fn ring(&mut self) -> Option<&mut mem::tapring::TapRing> {
        if let Ring::Wanted(mode) = self.ring {
            let size = ring_shape(self.vnet).2;
            self.ring = match mem::tapring::TapRing::with_mode(self.out.as_fd(), 0, 128, size, mode)
            {
                Ok(r) => Ring::Up(Box::new(r)),
                Err(_) => Ring::None,
            };
        }
        match &mut self.ring {
            Ring::Up(r) => Some(r),
            _ => None,
        }
    }
}

impl WireSink for TapSink {
    fn transmit(&mut self, frame: &[u8], off: Offload) {
        if frame.len() <= BATCH_MAX_FRAME && self.ring().is_some() {
            let Self {
                ring: Ring::Up(ring),
                vnet,
                counters,
                capture,
                ..
            } = self
            else {
                return;
            };
            let fill = |b: &mut [u8]| {
                b.copy_from_slice(frame);
                true
            };
            queue_on(
                ring,
                *vnet,
                frame.len(),
                off,
                fill,
                counters,
                capture.as_ref(),
            );
            return;
        }
        self.flush();
        if let Some(c) = &self.capture {
            c.frame(frame);
        }
        write_frame(&mut self.out, self.vnet, frame, off, &self.counters);
    }
    fn takes_offload(&self) -> bool {
        self.vnet
    }
    fn thread_bound(&self) -> bool {
        self.ring.thread_bound()
    }
    fn flush(&mut self) {
        let Ring::Up(r) = &mut self.ring else {
            return;
        };
        if r.queued() > 0 {
            r.flush();
        }
        sync_counts(r, &mut self.ring_seen, &self.counters);
    }
}

impl WireSource for TapPort {
    fn poll(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
        self.recv(|f, off| {
            emit(f, off);
            true
        })
    }
    fn next_due(&self) -> Option<Instant> {
        None
    }
    fn ready(&self) -> bool {
        TapPort::ready(self)
    }
    fn attach(&mut self, wake: &Arc<crate::wire::Doze>) {
        self.doze = Some(Arc::clone(wake));
    }
    fn holds(&self) -> bool {
        true
    }
    fn poll_held(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], Offload) -> bool) -> usize {
        self.recv(|f, off| emit(f, off))
    }
    fn close(&mut self) {
        self.close_io();
    }
    fn thread_bound(&self) -> bool {
        self.ring.thread_bound()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use net::netif::{Gso, XEN_NETIF_GSO_TYPE_TCPV4};
    use net::offload::{Csum, VNET_F_DATA_VALID, VNET_F_NEEDS_CSUM, VNET_GSO_TCPV4};

    /// What `write_frame` wrote to a file: the virtio-net header and the frame.
    fn written(frame: &[u8], off: Offload) -> (VnetHdr, Vec<u8>) {
        let path = std::env::temp_dir().join(format!(
            "pvio-tap-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let mut f = File::create(&path).expect("temp file");
        let c = TapCounters::default();
        write_frame(&mut f, true, frame, off, &c);
        drop(f);
        let bytes = std::fs::read(&path).expect("read back");
        let _ = std::fs::remove_file(&path);
        assert_eq!(c.frames_out.load(Ordering::Relaxed), 1);
        assert_eq!(c.write_errors.load(Ordering::Relaxed), 0);
        let hdr: &[u8; VNET_HDR_LEN] = bytes[..VNET_HDR_LEN].try_into().expect("header");
        (VnetHdr::parse(hdr), bytes[VNET_HDR_LEN..].to_vec())
    }

    /// An aggregate as LRO hands it up: headers for the whole, the TCP checksum field
    /// its first segment's, verified.
    fn aggregate() -> Vec<u8> {
        aggregate_of(3)
    }

    fn aggregate_of(segments: usize) -> Vec<u8> {
        let seg = net::wire::TcpSegment {
            sport: 40000,
            dport: 5201,
            seq: 7,
            ack: 1,
            flags: 0x10,
            window: 512,
            ts: Some((5, 6)),
        };
        let payload: Vec<u8> = (0..segments * 1448).map(|i| (i * 7) as u8).collect();
        let mut f = seg.frame(&payload);
        // The first segment's checksum, not the whole's.
        let at = 14 + 20 + 16;
        f[at..at + 2].copy_from_slice(&[0x12, 0x34]);
        f
    }

    /// A port over one end of a datagram socket pair, which reads as a TAP does (a
    /// frame a read), and the other end to write hostile frames into it.
    fn port_io(off: TapOffload, io: EdgeIo) -> (TapPort, std::os::unix::net::UnixDatagram) {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().expect("pair");
        let f = File::from(std::os::fd::OwnedFd::from(a));
        (TapPort::start_io(f, off, io).expect("port"), b)
    }

    /// Receives until `want` frames came or a few hundred looks found nothing more (a
    /// ring's reads run at the next look after they are due).
    fn recv_all(p: &mut TapPort, want: usize, mut f: impl FnMut(&[u8], Offload)) -> usize {
        let mut n = 0;
        for _ in 0..500 {
            n += p.recv(|b, off| {
                f(b, off);
                true
            });
            if n >= want {
                break;
            }
        }
        n
    }

    /// Whether this kernel can run a port's ring (io_uring with multishot reads, 6.7):
    /// where it cannot, a batched port moves frames one a call, and is tested so.
    fn rings_here() -> bool {
        let (a, _b) = std::os::unix::net::UnixDatagram::pair().expect("pair");
        let here = mem::tapring::TapRing::new(a.as_fd(), 16, 8, 2048).is_ok();
        assert!(
            here || !mem::tapring::kernel_runs_rings(),
            "this kernel should run a ring"
        );
        here
    }

    #[test]
    fn both_ways_of_moving_frames_carry_the_same_frames_in_order_and_batches_make_fewer_calls() {
        let rings = rings_here();
        let mut calls = Vec::new();
        for io in [EdgeIo::Plain, EdgeIo::Batched, EdgeIo::Armed] {
            let (mut p, peer) = port_io(TapOffload::None, io);
            let frames: Vec<Vec<u8>> = (0..100u8).map(|i| vec![i; 60 + usize::from(i)]).collect();
            for f in &frames {
                peer.send(f).expect("send");
            }
            let mut got = Vec::new();
            recv_all(&mut p, frames.len(), |b, _| got.push(b.to_vec()));
            assert_eq!(got, frames, "{io:?}");
            for f in &frames {
                p.send_with(f.len(), Offload::NONE, |buf| {
                    buf.copy_from_slice(f);
                    true
                });
            }
            p.flush();
            let mut buf = [0u8; 256];
            for f in &frames {
                let n = peer.recv(&mut buf).expect("frame");
                assert_eq!(&buf[..n], &f[..], "{io:?}");
            }
            let c = p.counters();
            assert_eq!(c.frames_out.load(Ordering::Relaxed), 100, "{io:?}");
            assert_eq!(c.frames_in.load(Ordering::Relaxed), 100, "{io:?}");
            assert_eq!(c.write_errors.load(Ordering::Relaxed), 0, "{io:?}");
            assert_eq!(
                c.batched.load(Ordering::Relaxed),
                u64::from(io != EdgeIo::Plain && rings),
                "a port batches wherever the kernel can"
            );
            calls.push(c.syscalls.load(Ordering::Relaxed));
        }
        // One a frame each way and more (the look that found nothing), against a few
        // for all.
        assert!(calls[0] >= 200, "{calls:?}");
        if rings {
            assert!(calls[1] * 10 < calls[0], "{calls:?}");
            assert!(calls[2] * 10 < calls[0], "{calls:?}");
        } else {
            eprintln!("no io_uring here: every port moved a frame a call");
        }
    }

    #[test]
    fn only_a_multishot_read_ties_a_port_and_its_sink_to_one_thread() {
        for io in [EdgeIo::Plain, EdgeIo::Batched, EdgeIo::Armed] {
            let (mut p, _peer) = port_io(TapOffload::None, io);
            let sink = p.sink().expect("sink");
            // Before and after the ring is made (at the first look).
            for _ in 0..2 {
                let bound =
                    io == EdgeIo::Armed && (matches!(p.ring, Ring::Wanted(_)) || rings_here());
                assert_eq!(WireSource::thread_bound(&p), bound, "{io:?}");
                assert_eq!(WireSink::thread_bound(&sink), io == EdgeIo::Armed, "{io:?}");
                p.recv(|_, _| true);
            }
        }
    }

    #[test]
    fn a_port_whose_ring_was_made_on_a_thread_that_ended_still_reads_its_interface() {
        for io in [EdgeIo::Batched, EdgeIo::Armed] {
            ring_outlives_its_thread(io);
        }
    }

    fn ring_outlives_its_thread(io: EdgeIo) {
        // A unit moves to a fresh thread when its pCPU's old one is retired (a hung
        // step's rescue); the kernel cancels the reads that thread armed when it ends.
        let (p, peer) = port_io(TapOffload::None, io);
        let mut p = std::thread::spawn(move || {
            let mut p = p;
            assert_eq!(p.recv(|_, _| true), 0, "nothing yet; the ring is made here");
            p
        })
        .join()
        .expect("first thread");
        let frames: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 60 + usize::from(i)]).collect();
        for f in &frames {
            peer.send(f).expect("send");
        }
        // The kernel cancels them as the thread goes, a moment after it ended.
        let mut got = Vec::new();
        for _ in 0..100 {
            p.recv(|b, _| {
                got.push(b.to_vec());
                true
            });
            if got.len() == frames.len() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(got, frames, "{io:?}");
        assert_eq!(p.counters().read_errors.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_frame_before_the_interface_ends_arrives_and_a_look_after_it_returns() {
        for io in [EdgeIo::Plain, EdgeIo::Batched, EdgeIo::Armed] {
            // A stream's end reads as nothing (a TAP never ends; a socket whose peer
            // left does): one frame, then the end.
            let (a, peer) = std::os::unix::net::UnixStream::pair().expect("pair");
            let f = File::from(std::os::fd::OwnedFd::from(a));
            let mut p = TapPort::start_io(f, TapOffload::None, io).expect("port");
            (&peer).write_all(&[9u8; 64]).expect("send");
            drop(peer);
            let mut got = Vec::new();
            for _ in 0..50 {
                p.recv(|b, _| {
                    got.push(b.to_vec());
                    true
                });
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(got, [vec![9u8; 64]], "{io:?}");
            assert!(
                p.counters().read_errors.load(Ordering::Relaxed) >= 1,
                "{io:?}"
            );
        }
    }

    #[test]
    fn frames_whose_header_lies_or_that_overrun_the_buffer_are_dropped_and_counted_and_the_next_one_arrives(
    ) {
        for io in [EdgeIo::Plain, EdgeIo::Batched, EdgeIo::Armed] {
            hostile_frames_are_dropped(io);
        }
    }

    fn hostile_frames_are_dropped(io: EdgeIo) {
        let (mut p, peer) = port_io(TapOffload::CsumTso, io);
        let frame = aggregate();
        // A GSO type Linux never sends, then a checksum offset past the frame.
        let mut bad_type = [0u8; VNET_HDR_LEN];
        bad_type[1] = 0x7f;
        let mut past = [0u8; VNET_HDR_LEN];
        past[0] = net::offload::VNET_F_NEEDS_CSUM;
        past[6..8].copy_from_slice(&(frame.len() as u16).to_ne_bytes());
        past[8..10].copy_from_slice(&16u16.to_ne_bytes());
        for h in [bad_type, past] {
            peer.send(&[&h[..], &frame[..]].concat()).expect("send");
        }
        // Only a header, and a frame larger than any buffer.
        peer.send(&[0u8; VNET_HDR_LEN]).expect("send");
        peer.send(&vec![0u8; OFFLOAD_BUF + 100]).expect("send");
        // Then a frame as Linux sends it: no offload.
        let good = [0u8; VNET_HDR_LEN];
        peer.send(&[&good[..], &frame[..]].concat()).expect("send");
        let mut got = Vec::new();
        assert_eq!(
            recv_all(&mut p, 1, |f, off| got.push((f.to_vec(), off))),
            1,
            "{io:?}"
        );
        assert_eq!(got, vec![(frame.clone(), Offload::NONE)]);
        let c = p.counters();
        assert_eq!(c.bad_offload_in.load(Ordering::Relaxed), 2);
        assert_eq!(c.oversize_in.load(Ordering::Relaxed), 1);
        assert_eq!(c.frames_in.load(Ordering::Relaxed), 1);
        // Nothing waits now: the read did not block.
        assert!(!p.ready());
    }

    #[test]
    fn a_refused_frame_is_first_in_line_next_time_and_a_recv_stops_at_its_budget() {
        for io in [EdgeIo::Plain, EdgeIo::Batched, EdgeIo::Armed] {
            refused_frame_waits(io);
        }
    }

    fn refused_frame_waits(io: EdgeIo) {
        let (mut p, peer) = port_io(TapOffload::None, io);
        for i in 0..(RECV_BUDGET + 3) {
            peer.send(&[i as u8; 60]).expect("send");
        }
        // Refused: held, and handed on first by the next call.
        let mut offered = 0;
        for _ in 0..100 {
            p.recv(|_, _| {
                offered += 1;
                false
            });
            if offered > 0 {
                break;
            }
        }
        assert_eq!(offered, 1, "{io:?}");
        assert!(p.ready());
        let mut firsts = Vec::new();
        assert_eq!(
            p.recv(|f, _| {
                firsts.push(f[0]);
                true
            }),
            RECV_BUDGET
        );
        assert_eq!(firsts[..2], [0, 1]);
        // The budget ran out with frames still waiting: the consumer is told to look
        // again rather than wait for the line.
        assert!(p.ready());
        assert_eq!(p.recv(|_, _| true), 3);
        assert!(!p.ready());
    }

    #[test]
    fn a_verified_large_segment_goes_to_the_tap_as_a_partial_one_with_its_pseudo_header_sum() {
        let frame = aggregate();
        let off = Offload {
            csum: Csum::Valid,
            gso: Some(Gso {
                size: 1448,
                ty: XEN_NETIF_GSO_TYPE_TCPV4,
            }),
        };
        let (h, mut got) = written(&frame, off);
        assert_eq!(h.flags, VNET_F_NEEDS_CSUM);
        assert_eq!((h.csum_start, h.csum_offset), (34, 16));
        assert_eq!(
            (h.gso_type, h.gso_size, h.hdr_len),
            (VNET_GSO_TCPV4, 1448, 66)
        );
        // Every byte as it was but the checksum field, which Linux completes over the
        // whole: the result verifies.
        assert_eq!(got.len(), frame.len());
        let at = 34 + 16;
        assert_eq!(got[..at], frame[..at]);
        assert_eq!(got[at + 2..], frame[at + 2..]);
        let l4 = net::offload::checksum_setup(&got[..MAX_HEADERS], got.len()).expect("tcp");
        net::offload::fill_partial(&mut got, 34, 16).expect("fill");
        assert!(net::offload::verify(&got, &l4));
    }

    #[test]
    #[ignore = "needs root: a TAP (.ci/run runs it as root)"]
    fn a_batched_tap_is_gone_once_its_port_closes_so_the_next_of_its_name_can_be_made() {
        let name = format!("pvtr{}", std::process::id() % 100_000);
        let gone = || !std::path::Path::new("/sys/class/net").join(&name).exists();
        for io in [
            EdgeIo::Batched,
            EdgeIo::Armed,
            EdgeIo::Batched,
            EdgeIo::Armed,
        ] {
            let (f, got) = mem::tap::open_tap(&name).expect("tap");
            assert_eq!(got, name, "made afresh under its name");
            let mut p = TapPort::start_io(f, TapOffload::None, io).expect("port");
            // Makes the ring (and arms the multishot read: a request in flight holds
            // the interface's file).
            p.recv(|_, _| true);
            assert_eq!(
                p.counters().batched.load(Ordering::Relaxed),
                u64::from(mem::tapring::kernel_runs_rings()),
                "batched where the kernel can run a ring"
            );
            p.send_with(60, Offload::NONE, |b| {
                b.fill(0xff);
                true
            });
            p.flush();
            p.close_io();
            drop(p);
            assert!(gone(), "the kernel let go of the interface");
        }
    }

    #[test]
    fn a_verified_large_segment_in_a_batch_gets_the_same_header_and_pseudo_header_sum() {
        let frame = aggregate_of(2);
        assert!(frame.len() <= BATCH_MAX_FRAME, "through a slot");
        let off = Offload {
            csum: Csum::Valid,
            gso: Some(Gso {
                size: 1448,
                ty: XEN_NETIF_GSO_TYPE_TCPV4,
            }),
        };
        let (want_h, want) = written(&frame, off);
        let (mut p, peer) = port_io(TapOffload::CsumTso, EdgeIo::Batched);
        p.send_with(frame.len(), off, |b| {
            b.copy_from_slice(&frame);
            true
        });
        p.flush();
        let mut buf = vec![0u8; 8192];
        let n = peer.recv(&mut buf).expect("frame");
        let hdr: &[u8; VNET_HDR_LEN] = buf[..VNET_HDR_LEN].try_into().expect("header");
        assert_eq!(VnetHdr::parse(hdr), want_h);
        assert_eq!(&buf[VNET_HDR_LEN..n], &want[..]);
        assert_eq!(p.counters().gso_out.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_verified_frame_of_one_segment_goes_as_it_is_marked_valid() {
        let frame = aggregate();
        let off = Offload {
            csum: Csum::Valid,
            gso: None,
        };
        let (h, got) = written(&frame, off);
        assert_eq!((h.flags, h.gso_type), (VNET_F_DATA_VALID, 0));
        assert_eq!(got, frame);
    }
}
