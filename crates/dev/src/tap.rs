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
use std::os::fd::AsRawFd;
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
    counters: Arc<TapCounters>,
    /// Packet capture: of the frames read from the interface as they are handed on,
    /// of those written to it, and one for the sink (`sink`) to take.
    capture: Option<Captures>,
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
            counters: Arc::new(TapCounters::default()),
            capture: None,
        })
    }

    /// The unit that consumes the port's frames: input on the interface wakes it.
    pub fn bind_unit(&mut self, waker: &hv::sched::Waker) {
        if self.line.is_none() {
            self.line = waker.irq_line(self.out.as_raw_fd()).ok();
            if let Some(l) = &self.line {
                l.arm();
            }
        }
    }

    /// The interface is no longer its consumer's line (the consumer is gone; a new one
    /// binds again).
    pub fn unbind_unit(&mut self) {
        self.line = None;
    }

    /// Reads one frame into the buffer and judges it: the header is the kernel's, but
    /// the frame behind it came from outside, so what it claims is checked against the
    /// frame.
    fn read_one(&mut self) -> Got {
        let c = &self.counters;
        let n = match (&self.out).read(&mut self.buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Got::Skip,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Got::Empty,
            Err(_) => {
                c.read_errors.fetch_add(1, Ordering::Relaxed);
                return Got::Failed;
            }
        };
        let size = self.buf.len();
        let hdr = if self.vnet { VNET_HDR_LEN } else { 0 };
        if n <= hdr || n >= size {
            if n >= size {
                c.oversize_in.fetch_add(1, Ordering::Relaxed);
            }
            return Got::Skip;
        }
        let off = if self.vnet {
            let mut h = [0u8; VNET_HDR_LEN];
            h.copy_from_slice(&self.buf[..VNET_HDR_LEN]);
            let frame = &self.buf[hdr..n];
            match VnetHdr::parse(&h).to_offload(&frame[..frame.len().min(MAX_HEADERS)], frame.len())
            {
                Ok(o) => o,
                Err(_) => {
                    c.bad_offload_in.fetch_add(1, Ordering::Relaxed);
                    return Got::Skip;
                }
            }
        } else {
            Offload::NONE
        };
        if off.gso.is_some() {
            c.gso_in.fetch_add(1, Ordering::Relaxed);
        }
        c.bytes_in.fetch_add((n - hdr) as u64, Ordering::Relaxed);
        c.frames_in.fetch_add(1, Ordering::Relaxed);
        Got::Frame(n, off)
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
            if let Some(c) = &self.capture {
                c.taken.frame(&self.buf[hdr..len]);
            }
            n += 1;
        }
        self.more = true;
        n
    }

    /// Writes one frame to the interface, with its offload (for a TAP without
    /// offloads, only [`Offload::NONE`] or a verified checksum).
    pub fn send(&mut self, frame: &[u8], off: Offload) {
        if let Some(c) = &self.capture {
            c.sent.frame(frame);
        }
        write_frame(&mut self.out, self.vnet, frame, off, &self.counters);
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

/// Writes the NIC's transmitted frames to a TAP.
#[derive(Debug)]
pub struct TapSink {
    out: File,
    vnet: bool,
    counters: Arc<TapCounters>,
    capture: Option<CaptureTap>,
}

impl WireSink for TapSink {
    fn transmit(&mut self, frame: &[u8], off: Offload) {
        if let Some(c) = &self.capture {
            c.frame(frame);
        }
        write_frame(&mut self.out, self.vnet, frame, off, &self.counters);
    }
    fn takes_offload(&self) -> bool {
        self.vnet
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
        let seg = net::wire::TcpSegment {
            sport: 40000,
            dport: 5201,
            seq: 7,
            ack: 1,
            flags: 0x10,
            window: 512,
            ts: Some((5, 6)),
        };
        let payload: Vec<u8> = (0..3 * 1448).map(|i| (i * 7) as u8).collect();
        let mut f = seg.frame(&payload);
        // The first segment's checksum, not the whole's.
        let at = 14 + 20 + 16;
        f[at..at + 2].copy_from_slice(&[0x12, 0x34]);
        f
    }

    /// A port over one end of a datagram socket pair, which reads as a TAP does (a
    /// frame a read), and the other end to write hostile frames into it.
    fn port(off: TapOffload) -> (TapPort, std::os::unix::net::UnixDatagram) {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().expect("pair");
        let f = File::from(std::os::fd::OwnedFd::from(a));
        (TapPort::start_with(f, off).expect("port"), b)
    }

    #[test]
    fn frames_whose_header_lies_or_that_overrun_the_buffer_are_dropped_and_counted_and_the_next_one_arrives(
    ) {
        let (mut p, peer) = port(TapOffload::CsumTso);
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
            p.recv(|f, off| {
                got.push((f.to_vec(), off));
                true
            }),
            1
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
        let (mut p, peer) = port(TapOffload::None);
        for i in 0..(RECV_BUDGET + 3) {
            peer.send(&[i as u8; 60]).expect("send");
        }
        // Refused: held, and handed on first by the next call.
        assert_eq!(p.recv(|_, _| false), 0);
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
