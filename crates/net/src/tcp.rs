//! TCP for the lab's hosts: smoltcp's TCP sockets over pvio's frames.
//!
//! A [`TcpHost`] is one host's TCP/IP: a smoltcp [`Interface`] (ARP, IPv4, TCP with its
//! flow and congestion control, window scaling and timestamps) and its sockets, with a
//! device made of two fixed rings of frame buffers. The kernel below it (netfront, the
//! NIC driver, or the remote peer's cable) copies each received frame into the receive
//! ring ([`TcpHost::input`]), lets the host run ([`TcpHost::poll`]), and sends what it
//! put in the transmit ring ([`TcpHost::output`]). Nothing here allocates after
//! [`TcpHost::new`]: the rings and the socket buffers are allocated once.
//!
//! Two things differ from Linux, and both are smoltcp's shape rather than a mechanism
//! pvio measures: smoltcp parses a frame from one contiguous slice, so a received packet
//! buffer (a head and page fragments in domain memory) is copied into the ring first;
//! and a socket keeps its received bytes in a ring of its own rather than a queue of
//! packet buffers, so the payload is copied once more before the application's read.
//! Both copies are counted ([`TcpStats::rx_staged_bytes`]) so a report can say what
//! they weigh.
//!
//! Received frames whose transport checksum the device did not validate are verified
//! here, before smoltcp sees them (smoltcp is configured to trust the receive side,
//! as Linux trusts `CHECKSUM_UNNECESSARY`): a large aggregate a NIC's LRO built carries
//! its segments' validation, not a checksum over the whole.

use std::sync::OnceLock;
use std::time::{Duration, Instant as StdInstant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, Checksum, ChecksumCapabilities, DeviceCapabilities, Medium};
use smoltcp::socket::tcp;
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr, Ipv4Address};

use crate::offload::MAX_OFFLOAD_LEN;
use crate::wire::{ETH_HEADER, MAX_FRAME};

/// Frames the receive ring holds: one NAPI poll's worth and as many again.
pub const RX_FRAMES: usize = 128;
/// Frames the transmit ring holds.
pub const TX_FRAMES: usize = 128;
/// Bytes of a receive slot: the largest packet a GSO or LRO path delivers, and its
/// Ethernet header.
pub const RX_SLOT: usize = MAX_OFFLOAD_LEN + ETH_HEADER;
/// A socket's receive and send buffers (Linux's `tcp_rmem` default is 128 KiB and
/// grows; a fixed 256 KiB window keeps a 1 Gbit/s path with a millisecond of delay
/// busy).
pub const SOCKET_BUFFER: usize = 256 * 1024;

/// A ring of fixed-size frame buffers, allocated once.
#[derive(Debug)]
pub struct FrameRing {
    bytes: Box<[u8]>,
    slot: usize,
    lens: Box<[usize]>,
    head: usize,
    len: usize,
}

impl FrameRing {
    /// `slots` buffers of `slot` bytes each.
    pub fn new(slots: usize, slot: usize) -> Self {
        Self {
            bytes: vec![0; slots * slot].into_boxed_slice(),
            slot,
            lens: vec![0; slots].into_boxed_slice(),
            head: 0,
            len: 0,
        }
    }

    /// Frames queued.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether none is queued.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether every slot is taken.
    pub fn is_full(&self) -> bool {
        self.len == self.lens.len()
    }

    /// Bytes one slot holds.
    pub fn slot_bytes(&self) -> usize {
        self.slot
    }

    /// Queues an `n`-byte frame that `fill` writes; `fill` may refuse it (false). Fails
    /// (false) if the ring is full, `n` is larger than a slot, or `fill` refused.
    pub fn push_with(&mut self, n: usize, fill: impl FnOnce(&mut [u8]) -> bool) -> bool {
        if self.is_full() || n > self.slot {
            return false;
        }
        let i = (self.head + self.len) % self.lens.len();
        if !fill(&mut self.bytes[i * self.slot..i * self.slot + n]) {
            return false;
        }
        self.lens[i] = n;
        self.len += 1;
        true
    }

    /// Queues an `n`-byte frame and returns its buffer to write, or `None` if the ring
    /// is full or `n` is larger than a slot.
    pub fn push_slot(&mut self, n: usize) -> Option<&mut [u8]> {
        if self.is_full() || n > self.slot {
            return None;
        }
        let i = (self.head + self.len) % self.lens.len();
        self.lens[i] = n;
        self.len += 1;
        Some(&mut self.bytes[i * self.slot..i * self.slot + n])
    }

    /// The oldest frame, if any.
    pub fn front(&self) -> Option<&[u8]> {
        (self.len > 0).then(|| {
            let at = self.head * self.slot;
            &self.bytes[at..at + self.lens[self.head]]
        })
    }

    /// Drops the oldest frame.
    pub fn pop(&mut self) {
        if self.len > 0 {
            self.head = (self.head + 1) % self.lens.len();
            self.len -= 1;
        }
    }
}

/// A host's counters.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TcpStats {
    /// Frames taken in.
    pub rx_frames: u64,
    /// Of them, packets larger than one MTU (a GSO packet or an LRO aggregate).
    pub rx_large: u64,
    /// Frames dropped: their TCP checksum was wrong.
    pub rx_bad_checksum: u64,
    /// Frames dropped: the receive ring was full (the host had not run).
    pub rx_ring_full: u64,
    /// Frames dropped: larger than a receive slot.
    pub rx_oversize: u64,
    /// Bytes copied into the receive ring (smoltcp's contiguous frame).
    pub rx_staged_bytes: u64,
    /// Frames the host sent.
    pub tx_frames: u64,
    /// Bytes of them.
    pub tx_bytes: u64,
}

hv::counter_set!(TcpStats {
    rx_frames,
    rx_large,
    rx_bad_checksum,
    rx_ring_full,
    rx_oversize,
    rx_staged_bytes,
    tx_frames,
    tx_bytes
});

/// The device smoltcp drives: the two rings.
#[derive(Debug)]
struct Phy {
    rx: FrameRing,
    tx: FrameRing,
}

/// A received frame, consumed from the ring's front.
struct RxTok<'a>(&'a mut FrameRing);
/// Room for one frame to send.
struct TxTok<'a>(&'a mut FrameRing);

impl phy::RxToken for RxTok<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        let r = f(self.0.front().unwrap_or(&[]));
        self.0.pop();
        r
    }
}

impl phy::TxToken for TxTok<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        match self.0.push_slot(len) {
            Some(b) => f(b),
            // `transmit` hands out a token only while there is room, and smoltcp asks
            // for no more than the MTU: not reached, but smoltcp needs its result.
            None => f(&mut vec![0; len]),
        }
    }
}

impl phy::Device for Phy {
    type RxToken<'a> = RxTok<'a>;
    type TxToken<'a> = TxTok<'a>;

    fn receive(&mut self, _: Instant) -> Option<(RxTok<'_>, TxTok<'_>)> {
        // Take a frame only while an answer to it has room.
        (!self.rx.is_empty() && !self.tx.is_full())
            .then_some((RxTok(&mut self.rx), TxTok(&mut self.tx)))
    }

    fn transmit(&mut self, _: Instant) -> Option<TxTok<'_>> {
        (!self.tx.is_full()).then_some(TxTok(&mut self.tx))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MAX_FRAME;
        let mut csum = ChecksumCapabilities::default();
        // Transport checksums are verified by the host's input (or were by the
        // device); IPv4 header checksums by smoltcp. Both are computed on transmit.
        csum.tcp = Checksum::Tx;
        csum.udp = Checksum::Tx;
        caps.checksum = csum;
        caps
    }
}

fn smol_now(now: Duration) -> Instant {
    Instant::from_micros(now.as_micros() as i64)
}

/// TCP timestamps' clock (RFC 7323's `TSval`): milliseconds since the first call in
/// this process, as Linux's is a jiffies-based millisecond clock.
fn tsval() -> u32 {
    static EPOCH: OnceLock<StdInstant> = OnceLock::new();
    let ms = EPOCH.get_or_init(StdInstant::now).elapsed().as_millis() as u32;
    ms.wrapping_add(1)
}

/// One host's TCP/IP.
pub struct TcpHost {
    iface: Interface,
    sockets: SocketSet<'static>,
    phy: Phy,
    stats: TcpStats,
}

impl std::fmt::Debug for TcpHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpHost")
            .field("mac", &self.iface.hardware_addr())
            .field("ip", &self.iface.ipv4_addr())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// How a connection is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Open {
    /// Wait for a peer on this port.
    Listen(u16),
    /// Connect from this local port to that address and port.
    Connect {
        /// The local port.
        from: u16,
        /// The peer's address.
        to: Ipv4Address,
        /// The peer's port.
        port: u16,
    },
}

impl TcpHost {
    /// A host at `ip`/24 with `mac`, its clock at `now`. `seed` seeds smoltcp's initial
    /// sequence numbers and ports.
    pub fn new(ip: Ipv4Address, mac: [u8; 6], now: Duration, seed: u64) -> Self {
        let mut phy = Phy {
            rx: FrameRing::new(RX_FRAMES, RX_SLOT),
            tx: FrameRing::new(TX_FRAMES, MAX_FRAME),
        };
        let mut config = Config::new(HardwareAddress::Ethernet(EthernetAddress(mac)));
        config.random_seed = seed;
        let mut iface = Interface::new(config, &mut phy, smol_now(now));
        iface.update_ip_addrs(|a| {
            // One address; the vector has room for it by construction.
            let _ = a.push(IpCidr::new(IpAddress::Ipv4(ip), 24));
        });
        Self {
            iface,
            sockets: SocketSet::new(Vec::with_capacity(4)),
            phy,
            stats: TcpStats::default(),
        }
    }

    /// A TCP socket with [`SOCKET_BUFFER`]-byte buffers, Reno congestion control and
    /// timestamps, listening or connecting as `open` says.
    pub fn open(&mut self, open: Open) -> Result<SocketHandle, TcpError> {
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; SOCKET_BUFFER]),
            tcp::SocketBuffer::new(vec![0; SOCKET_BUFFER]),
        );
        s.set_congestion_control(tcp::CongestionControl::Reno);
        s.set_tsval_generator(Some(tsval));
        match open {
            Open::Listen(port) => s.listen(port).map_err(|_| TcpError::Open)?,
            Open::Connect { from, to, port } => s
                .connect(self.iface.context(), (IpAddress::Ipv4(to), port), from)
                .map_err(|_| TcpError::Open)?,
        }
        Ok(self.sockets.add(s))
    }

    /// A socket, to read, write or ask its state.
    pub fn socket(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket<'static>>(h)
    }

    /// A received frame of `len` bytes, which `fill` copies in (false: it could not);
    /// `csum_valid`: the device (or LRO) validated its transport checksum. Returns
    /// whether it was queued.
    pub fn input(
        &mut self,
        len: usize,
        csum_valid: bool,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> bool {
        if len > self.phy.rx.slot_bytes() {
            self.stats.rx_oversize += 1;
            return false;
        }
        if self.phy.rx.is_full() {
            self.stats.rx_ring_full += 1;
            return false;
        }
        let mut bad = false;
        let queued = self.phy.rx.push_with(len, |b| {
            if !fill(b) {
                return false;
            }
            bad = !csum_valid && crate::wire::l4_checksum(b) == Some(false);
            !bad
        });
        if bad {
            self.stats.rx_bad_checksum += 1;
        }
        if queued {
            self.stats.rx_frames += 1;
            self.stats.rx_large += u64::from(len > MAX_FRAME);
            self.stats.rx_staged_bytes += len as u64;
        }
        queued
    }

    /// Runs the stack at `now`: takes in what was received, lets the sockets send.
    /// Returns whether anything changed.
    pub fn poll(&mut self, now: Duration) -> bool {
        let r = self
            .iface
            .poll(smol_now(now), &mut self.phy, &mut self.sockets);
        r == smoltcp::iface::PollResult::SocketStateChanged
    }

    /// Hands each frame the host sent to `send`, oldest first, until `send` refuses one
    /// (false: its ring is full; the frame stays queued). Returns how many were taken.
    pub fn output(&mut self, mut send: impl FnMut(&[u8]) -> bool) -> usize {
        let mut n = 0;
        while let Some(f) = self.phy.tx.front() {
            let len = f.len();
            if !send(f) {
                break;
            }
            self.phy.tx.pop();
            self.stats.tx_frames += 1;
            self.stats.tx_bytes += len as u64;
            n += 1;
        }
        n
    }

    /// Frames sent and not yet taken by [`TcpHost::output`].
    pub fn output_queued(&self) -> usize {
        self.phy.tx.len()
    }

    /// When the stack next needs to run with nothing received (a retransmission, a
    /// delayed ACK), as a time on the clock `poll` is given.
    pub fn poll_at(&mut self, now: Duration) -> Option<Duration> {
        self.iface
            .poll_at(smol_now(now), &self.sockets)
            .map(|t| Duration::from_micros(t.total_micros().max(0) as u64))
    }

    /// The host's counters.
    pub fn stats(&self) -> &TcpStats {
        &self.stats
    }
}

/// Why a socket could not be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TcpError {
    /// smoltcp refused the listen or connect (a port of 0, a socket already open).
    #[error("cannot open the socket")]
    Open,
}

/// Byte `k` of the lab's TCP streams: [`crate::wire::payload_byte`]'s pattern for
/// message `k / 1024`, so a byte delivered at the wrong offset, twice, or from a stale
/// buffer is caught.
pub fn stream_byte(k: u64) -> u8 {
    crate::wire::payload_byte((k >> 10) as u8, (k & 1023) as usize)
}

/// Bytes of one message of the stream's pattern.
const STREAM_MESSAGE: u64 = 1024;

/// The stream's pattern as one table: byte `k` is `31·(k mod 256) + k / 1024` (mod
/// 256), which is `31·(k mod 256 + 223·(k / 1024))` since 31·223 = 1 (mod 256). So the
/// bytes from `k` to the end of its 1024-byte message are this table's from
/// `(k + 223·(k / 1024)) mod 256` on, and a whole run is checked with one comparison of
/// memory and written with one copy, where a byte at a time cost a 64 KiB read 40 µs.
static STREAM_TABLE: [u8; 256 + STREAM_MESSAGE as usize] = {
    let mut t = [0u8; 256 + STREAM_MESSAGE as usize];
    let mut j = 0;
    while j < t.len() {
        t[j] = crate::wire::payload_byte(0, j);
        j += 1;
    }
    t
};

/// The stream's bytes from offset `at` to the end of its message (at most 1024).
fn stream_run(at: u64) -> &'static [u8] {
    let message = at / STREAM_MESSAGE;
    let within = at % STREAM_MESSAGE;
    let from = ((at % 256) + 223 * (message % 256)) % 256;
    let len = STREAM_MESSAGE - within;
    &STREAM_TABLE[from as usize..(from + len) as usize]
}

/// Checks a byte stream against [`stream_byte`] as it arrives, in pieces of any size.
#[derive(Debug, Default, Clone)]
pub struct StreamCheck {
    /// Bytes checked.
    pub bytes: u64,
    /// Bytes that were not the pattern's.
    pub corrupt: u64,
}

impl StreamCheck {
    /// Checks the next piece of the stream: a run of the pattern at a time, the bytes
    /// of a run that differs counted one by one.
    pub fn check(&mut self, mut piece: &[u8]) {
        while !piece.is_empty() {
            let want = stream_run(self.bytes);
            let n = want.len().min(piece.len());
            let (got, rest) = piece.split_at(n);
            if got != &want[..n] {
                let bad = got.iter().zip(want).filter(|(g, w)| g != w).count();
                self.corrupt += bad as u64;
            }
            self.bytes += n as u64;
            piece = rest;
        }
    }
}

/// Fills `out` with the stream's bytes from offset `at`.
pub fn fill_stream(mut at: u64, mut out: &mut [u8]) {
    while !out.is_empty() {
        let want = stream_run(at);
        let n = want.len().min(out.len());
        let (run, rest) = out.split_at_mut(n);
        run.copy_from_slice(&want[..n]);
        at += n as u64;
        out = rest;
    }
}
