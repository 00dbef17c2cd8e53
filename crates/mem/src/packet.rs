//! AF_PACKET sockets with mapped rings (`TPACKET_V2`): the NIC model's cable on a real
//! Linux interface, a physical NIC or one end of a veth pair, the way DPDK's
//! `af_packet` driver attaches to one.
//!
//! Receive ([`PacketRx`]): the kernel copies each frame that reaches the interface into
//! the next free slot of a ring mapped into this process and marks the slot the user's.
//! pvio takes frames from the slots in order, with no system call per frame, and hands
//! each slot back once the frame is handed on. A frame that finds the next slot still
//! the user's is dropped by the kernel and counted (`tp_drops`), as a NIC's FIFO
//! overflows.
//!
//! Transmit ([`PacketTx`]): pvio writes frames into the slots of a second ring and marks
//! them for sending; one `send` without data has the kernel send every marked slot, a
//! batch per system call (`PACKET_TX_RING`).
//!
//! What it trusts: a slot's header is the kernel's, but it is read once, checked against
//! the slot's bounds, and a frame it does not bear out is counted and skipped. A frame's
//! bytes are the wire's, hostile, and are only handed on as bytes. The unsafe parts are
//! the socket options, the mapping, and the slots' memory, which the kernel and this
//! process take turns to own by the status word at each slot's start.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// Bytes of one slot: a 1518-byte frame (a VLAN tag included) behind the kernel's
/// header and alignment fits; larger ones are truncated and counted.
pub const SLOT_SIZE: usize = 2048;
/// Bytes of one block of slots (the kernel allocates the ring block by block).
const BLOCK_SIZE: usize = 64 * 1024;
const SLOTS_PER_BLOCK: usize = BLOCK_SIZE / SLOT_SIZE;
/// Where the kernel's `struct sockaddr_ll` sits in a received slot: after the
/// `tpacket2_hdr`, aligned.
const SLL_OFFSET: usize = align(std::mem::size_of::<libc::tpacket2_hdr>());
/// Where a frame to send starts in a transmit slot (`TPACKET2_HDRLEN` less the
/// address, the kernel's offset when `PACKET_TX_HAS_OFF` is off).
const TX_DATA_OFFSET: usize = libc::TPACKET2_HDRLEN - std::mem::size_of::<libc::sockaddr_ll>();
/// The longest frame a transmit slot holds.
pub const TX_MAX_FRAME: usize = SLOT_SIZE - TX_DATA_OFFSET;

const fn align(x: usize) -> usize {
    (x + libc::TPACKET_ALIGNMENT - 1) & !(libc::TPACKET_ALIGNMENT - 1)
}

/// `TP_STATUS_USER`: the slot holds a received frame for the process.
const TP_STATUS_USER: u32 = 1;
/// `TP_STATUS_KERNEL`: the slot is the kernel's to fill.
const TP_STATUS_KERNEL: u32 = 0;
/// `TP_STATUS_CSUMNOTREADY`: the frame's transport checksum is partial (a frame from a
/// local stack, on a veth, say).
const TP_STATUS_CSUMNOTREADY: u32 = 1 << 3;

/// What rode beside a received frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxMeta {
    /// The transport checksum is partial: the sender's stack left it to a NIC that
    /// never saw it (on a veth the frame comes straight from the peer's stack).
    pub csum_partial: bool,
}

/// What one [`PacketRx::take`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxPoll {
    /// A frame was handed on and its slot given back.
    Taken,
    /// The consumer refused the frame: it stays in its slot, first in line.
    Refused,
    /// A slot held something that was not a frame to hand on (counted in
    /// [`RxStats`]); the slot was given back.
    Skipped,
    /// No frame waits.
    Empty,
}

/// A receive ring's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RxStats {
    /// Frames handed on.
    pub frames: u64,
    /// Frames longer than a slot: the kernel kept only their start; dropped.
    pub truncated: u64,
    /// Slots whose header placed the frame outside the slot; dropped.
    pub malformed: u64,
    /// Frames this host sent on the interface (the socket asks not to see them; a
    /// kernel that shows them anyway has them skipped here).
    pub outgoing: u64,
    /// Frames the kernel dropped for want of a free slot (`tp_drops`), collected when
    /// a slot says some were lost.
    pub ring_full: u64,
}

/// A transmit ring's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TxStats {
    /// Frames put in the ring for sending.
    pub frames: u64,
    /// Frames refused: the ring had no free slot even after a send.
    pub ring_full: u64,
    /// Frames refused: empty, or longer than a slot holds.
    pub bad_length: u64,
    /// Sends the kernel refused or cut short (its buffers full): the marked slots
    /// stay marked and go with the next send.
    pub send_errors: u64,
    /// Sends made (one per batch).
    pub sends: u64,
}

/// Why [`PacketTx::push`] refused a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TxRefused {
    /// No free slot, even after a send.
    #[error("the transmit ring is full")]
    RingFull,
    /// Empty, or longer than [`TX_MAX_FRAME`].
    #[error("a frame of this length does not fit a slot")]
    BadLength,
}

/// A ring of slots mapped from a packet socket.
struct Ring {
    base: NonNull<u8>,
    len: usize,
    slots: usize,
}

// SAFETY: the mapping is owned by the ring alone and lives until it is dropped; every
// access goes through `&self`/`&mut self` of the owner, and the kernel's side of each
// slot is coordinated by the slot's status word, an atomic.
unsafe impl Send for Ring {}

impl Ring {
    /// Asks the kernel for a ring of `slots` slots (`opt`: `PACKET_RX_RING` or
    /// `PACKET_TX_RING`) and maps it.
    fn map(fd: &OwnedFd, opt: libc::c_int, slots: usize) -> io::Result<Self> {
        let blocks = slots.div_ceil(SLOTS_PER_BLOCK).max(1);
        let slots = blocks * SLOTS_PER_BLOCK;
        let bad = |_| io::Error::new(io::ErrorKind::InvalidInput, "ring too large");
        let req = libc::tpacket_req {
            tp_block_size: BLOCK_SIZE as libc::c_uint,
            tp_block_nr: blocks.try_into().map_err(bad)?,
            tp_frame_size: SLOT_SIZE as libc::c_uint,
            tp_frame_nr: slots.try_into().map_err(bad)?,
        };
        set_opt(fd, opt, &req)?;
        // Exactly the ring just configured on `fd`.
        let len = blocks * BLOCK_SIZE;
        let p = crate::map_shared(fd, len)?;
        let base = NonNull::new(p.cast()).ok_or_else(io::Error::last_os_error)?;
        Ok(Self { base, len, slots })
    }

    /// The start of slot `i` (`i < slots`).
    fn slot(&self, i: usize) -> *mut u8 {
        debug_assert!(i < self.slots);
        // SAFETY: slot `i` starts `i * SLOT_SIZE` bytes in, inside the mapping
        // (`slots * SLOT_SIZE <= len`, blocks holding whole slots).
        unsafe { self.base.as_ptr().add(i * SLOT_SIZE) }
    }

    /// The status word of slot `i`, which the kernel reads and writes atomically.
    fn status(&self, i: usize) -> &AtomicU32 {
        // SAFETY: the word is the first field of the slot's `tpacket2_hdr`, inside the
        // mapping, 4-byte aligned (the mapping is page-aligned and slots are
        // `SLOT_SIZE` apart); an `AtomicU32` has `u32`'s layout, the kernel only ever
        // accesses the word as a whole, and the reference lives no longer than `self`,
        // hence than the mapping.
        unsafe { &*self.slot(i).cast::<AtomicU32>() }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range `map` mapped; no reference into it outlives
        // `self`.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("slots", &self.slots).finish()
    }
}

fn set_opt<T>(fd: &OwnedFd, opt: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: passes a pointer to a live `T` and its exact size; the kernel reads at
    // most that many bytes.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            opt,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A packet socket of the raw kind, not yet receiving anything (protocol 0 until it is
/// bound), using `TPACKET_V2` slots.
fn socket() -> io::Result<OwnedFd> {
    // SAFETY: socket takes three integers and returns a new descriptor or -1.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_opt(
        &fd,
        libc::PACKET_VERSION,
        &(libc::tpacket_versions::TPACKET_V2 as libc::c_int),
    )?;
    Ok(fd)
}

/// The index of interface `name` in the calling thread's network namespace.
pub fn ifindex(name: &str) -> io::Result<libc::c_int> {
    let c = CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "interface name"))?;
    // SAFETY: passes a NUL-terminated string that lives across the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(io::Error::last_os_error());
    }
    libc::c_int::try_from(i).map_err(|_| io::Error::other("interface index"))
}

/// Binds `fd` to interface `ifindex` for `protocol` (host order; 0: send only).
fn bind(fd: &OwnedFd, ifindex: libc::c_int, protocol: u16) -> io::Result<()> {
    // SAFETY: `sockaddr_ll` is plain data; all zeroes is a valid value of it.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = protocol.to_be();
    sll.sll_ifindex = ifindex;
    // SAFETY: passes a live `sockaddr_ll` and its exact size.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The receiving side of a cable on a real interface: every frame that reaches the
/// interface (promiscuous), none this host sends on it.
#[derive(Debug)]
pub struct PacketRx {
    ring: Ring,
    head: usize,
    stats: RxStats,
    fd: OwnedFd,
}

impl PacketRx {
    /// Attaches to interface `name` with a ring of at least `slots` slots.
    pub fn open(name: &str, slots: usize) -> io::Result<Self> {
        let index = ifindex(name)?;
        let fd = socket()?;
        set_opt(&fd, libc::PACKET_IGNORE_OUTGOING, &(1 as libc::c_int))?;
        let ring = Ring::map(&fd, libc::PACKET_RX_RING, slots)?;
        // Bound only now: nothing arrives before the ring exists.
        bind(&fd, index, libc::ETH_P_ALL as u16)?;
        let mreq = libc::packet_mreq {
            mr_ifindex: index,
            mr_type: libc::PACKET_MR_PROMISC as libc::c_ushort,
            mr_alen: 0,
            mr_address: [0; 8],
        };
        set_opt(&fd, libc::PACKET_ADD_MEMBERSHIP, &mreq)?;
        Ok(Self {
            ring,
            head: 0,
            stats: RxStats::default(),
            fd,
        })
    }

    /// Whether a frame waits in the next slot (a load, no system call).
    pub fn ready(&self) -> bool {
        self.ring.status(self.head).load(Ordering::Acquire) & TP_STATUS_USER != 0
    }

    /// Slots in the ring.
    pub fn slots(&self) -> usize {
        self.ring.slots
    }

    /// Hands the next received frame to `f` and gives its slot back, unless `f`
    /// refuses it (returns false: the frame stays first in line). A slot whose header
    /// does not bear out a whole frame is counted and given back.
    pub fn take(&mut self, f: impl FnOnce(&[u8], RxMeta) -> bool) -> RxPoll {
        let i = self.head;
        let status = self.ring.status(i).load(Ordering::Acquire);
        if status & TP_STATUS_USER == 0 {
            return RxPoll::Empty;
        }
        if status & libc::TP_STATUS_LOSING != 0 {
            self.collect_drops();
        }
        let slot = self.ring.slot(i);
        // SAFETY: the slot is this process's while its status says USER (the kernel
        // fills only slots marked KERNEL), so the header is read, once, as a copy;
        // `tpacket2_hdr` is plain data at the slot's start, aligned.
        let hdr: libc::tpacket2_hdr = unsafe { std::ptr::read(slot.cast()) };
        // SAFETY: as above; the packet type is a byte of the address after the header,
        // inside the slot.
        let pkttype: u8 = unsafe {
            std::ptr::read(
                slot.add(SLL_OFFSET + std::mem::offset_of!(libc::sockaddr_ll, sll_pkttype)),
            )
        };
        let (at, snap) = (usize::from(hdr.tp_mac), hdr.tp_snaplen as usize);
        let verdict = if at < SLL_OFFSET || at.saturating_add(snap) > SLOT_SIZE || snap == 0 {
            Some(&mut self.stats.malformed)
        } else if (hdr.tp_len as usize) > snap {
            Some(&mut self.stats.truncated)
        } else if pkttype == libc::PACKET_OUTGOING {
            Some(&mut self.stats.outgoing)
        } else {
            None
        };
        if let Some(count) = verdict {
            *count += 1;
            self.give_back();
            return RxPoll::Skipped;
        }
        // SAFETY: `at + snap <= SLOT_SIZE` (checked above), so the bytes lie in the
        // slot, which stays this process's until `give_back`: the kernel writes no
        // byte of it while `f` reads them, and the borrow ends with the call.
        let frame = unsafe { std::slice::from_raw_parts(slot.add(at), snap) };
        let meta = RxMeta {
            csum_partial: status & TP_STATUS_CSUMNOTREADY != 0,
        };
        if !f(frame, meta) {
            return RxPoll::Refused;
        }
        self.stats.frames += 1;
        self.give_back();
        RxPoll::Taken
    }

    /// Returns the head slot to the kernel and moves on.
    fn give_back(&mut self) {
        self.ring
            .status(self.head)
            .store(TP_STATUS_KERNEL, Ordering::Release);
        self.head = (self.head + 1) % self.ring.slots;
    }

    /// Adds the kernel's count of frames dropped for want of a slot (read and reset
    /// by `PACKET_STATISTICS`) to the stats.
    fn collect_drops(&mut self) {
        let mut st = libc::tpacket_stats {
            tp_packets: 0,
            tp_drops: 0,
        };
        let mut len = std::mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
        // SAFETY: passes a live `tpacket_stats` and its size; the kernel writes at
        // most that many bytes and the length.
        let r = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                (&mut st as *mut libc::tpacket_stats).cast(),
                &mut len,
            )
        };
        if r == 0 {
            self.stats.ring_full += u64::from(st.tp_drops);
        }
    }

    /// The counts so far.
    pub fn stats(&self) -> RxStats {
        self.stats
    }
}

impl AsRawFd for PacketRx {
    /// Readable while a frame waits: the interrupt line of the cable.
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The sending side of a cable on a real interface.
#[derive(Debug)]
pub struct PacketTx {
    ring: Ring,
    head: usize,
    /// Slots marked since the last successful send.
    marked: usize,
    stats: TxStats,
    fd: OwnedFd,
}

impl PacketTx {
    /// Attaches to interface `name` for sending, with a ring of at least `slots`
    /// slots. The socket receives nothing.
    pub fn open(name: &str, slots: usize) -> io::Result<Self> {
        let index = ifindex(name)?;
        let fd = socket()?;
        // A frame the device refuses is dropped and the rest of the batch goes on,
        // rather than the ring stopping at it.
        set_opt(&fd, libc::PACKET_LOSS, &(1 as libc::c_int))?;
        let ring = Ring::map(&fd, libc::PACKET_TX_RING, slots)?;
        bind(&fd, index, 0)?;
        Ok(Self {
            ring,
            head: 0,
            marked: 0,
            stats: TxStats::default(),
            fd,
        })
    }

    /// Copies `frame` into the next free slot and marks it for sending; it leaves at
    /// the next [`PacketTx::flush`] (or when the ring is full, at once).
    pub fn push(&mut self, frame: &[u8]) -> Result<(), TxRefused> {
        if frame.is_empty() || frame.len() > TX_MAX_FRAME {
            self.stats.bad_length += 1;
            return Err(TxRefused::BadLength);
        }
        let i = self.head;
        if self.ring.status(i).load(Ordering::Acquire) != libc::TP_STATUS_AVAILABLE {
            // Still marked or being sent: send what is marked and look again.
            self.flush();
            if self.ring.status(i).load(Ordering::Acquire) != libc::TP_STATUS_AVAILABLE {
                self.stats.ring_full += 1;
                return Err(TxRefused::RingFull);
            }
        }
        let slot = self.ring.slot(i);
        // SAFETY: an AVAILABLE slot is this process's (the kernel reads it only once
        // marked SEND_REQUEST); the frame is at most `TX_MAX_FRAME` bytes, so it ends
        // inside the slot, and it cannot overlap the mapping (it is a Rust slice).
        unsafe {
            std::ptr::copy_nonoverlapping(frame.as_ptr(), slot.add(TX_DATA_OFFSET), frame.len());
            let hdr = slot.cast::<libc::tpacket2_hdr>();
            std::ptr::addr_of_mut!((*hdr).tp_len).write(frame.len() as u32);
        }
        self.ring
            .status(i)
            .store(libc::TP_STATUS_SEND_REQUEST, Ordering::Release);
        self.head = (i + 1) % self.ring.slots;
        self.marked += 1;
        self.stats.frames += 1;
        Ok(())
    }

    /// Has the kernel send every marked slot (one system call), if any is marked.
    pub fn flush(&mut self) {
        if self.marked == 0 {
            return;
        }
        self.stats.sends += 1;
        // SAFETY: a send of no data (null buffer, length 0) on an open packet socket
        // bound to its interface: the kernel sends the ring's marked slots.
        let r = unsafe { libc::send(self.fd.as_raw_fd(), std::ptr::null(), 0, libc::MSG_DONTWAIT) };
        if r < 0 {
            self.stats.send_errors += 1;
        } else {
            self.marked = 0;
        }
    }

    /// Frames marked and not yet handed to a send.
    pub fn marked(&self) -> usize {
        self.marked
    }

    /// The counts so far.
    pub fn stats(&self) -> TxStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame to no one on the loopback interface, of an experimental EtherType, with
    /// `tag` and `n` in its first payload bytes and a seeded pattern after.
    fn frame(tag: u32, n: u32, len: usize) -> Vec<u8> {
        let mut f = vec![0u8; len];
        f[0..6].copy_from_slice(&[0x02, 0x70, 0x76, 0x69, 0x6f, 0x01]);
        f[6..12].copy_from_slice(&[0x02, 0x70, 0x76, 0x69, 0x6f, 0x02]);
        f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
        f[14..18].copy_from_slice(&tag.to_be_bytes());
        f[18..22].copy_from_slice(&n.to_be_bytes());
        for (i, b) in f.iter_mut().enumerate().skip(22) {
            *b = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(n) as u8;
        }
        f
    }

    /// The test's own frames among whatever else crosses the loopback interface.
    fn ours(f: &[u8], tag: u32) -> Option<u32> {
        (f.len() >= 22 && f[12..14] == [0x88, 0xb5] && f[14..18] == tag.to_be_bytes())
            .then(|| u32::from_be_bytes([f[18], f[19], f[20], f[21]]))
    }

    /// A packet socket pair on the loopback interface. These tests need CAP_NET_RAW:
    /// they are ignored by default (shown as skipped) and `.ci/run` runs them as root,
    /// where a socket that cannot be opened fails them.
    fn open_pair() -> (PacketRx, PacketTx) {
        match (PacketRx::open("lo", 256), PacketTx::open("lo", 64)) {
            (Ok(rx), Ok(tx)) => (rx, tx),
            (Err(e), _) | (_, Err(e)) => {
                panic!("packet socket on lo (needs CAP_NET_RAW: run as root): {e}")
            }
        }
    }

    /// Takes frames until `want` of the test's own were seen or a second passed.
    fn collect(rx: &mut PacketRx, tag: u32, want: usize) -> Vec<(u32, Vec<u8>)> {
        let mut got = Vec::new();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while got.len() < want && std::time::Instant::now() < until {
            if rx.take(|f, _| {
                if let Some(n) = ours(f, tag) {
                    got.push((n, f.to_vec()));
                }
                true
            }) == RxPoll::Empty
            {
                std::thread::yield_now();
            }
        }
        got
    }

    #[test]
    #[ignore = "needs CAP_NET_RAW (.ci/run runs it as root)"]
    fn frames_sent_in_batches_arrive_whole_in_order_and_a_refused_one_waits() {
        let (mut rx, mut tx) = open_pair();
        let tag = std::process::id() ^ 0x5a5a_0000;
        let sent: Vec<Vec<u8>> = (0..150u32)
            .map(|n| {
                frame(
                    tag,
                    n,
                    60 + (n as usize * 97) % (TX_MAX_FRAME.min(1514) - 59),
                )
            })
            .collect();
        // More frames than the transmit ring has slots: a full ring is sent and
        // reused.
        for f in &sent {
            tx.push(f).expect("a slot");
            if tx.marked() == 16 {
                tx.flush();
            }
        }
        tx.flush();
        assert_eq!(tx.stats().frames, 150);
        assert!(tx.stats().sends < 150, "frames leave in batches");
        let got = collect(&mut rx, tag, 150);
        let numbers: Vec<u32> = got.iter().map(|(n, _)| *n).collect();
        assert_eq!(numbers, (0..150).collect::<Vec<_>>());
        for (n, f) in &got {
            assert_eq!(f, &sent[*n as usize], "frame {n} arrived byte for byte");
        }

        // A refused frame stays first in line.
        tx.push(&frame(tag, 1000, 100)).expect("a slot");
        tx.flush();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let mut refused = false;
        while !refused && std::time::Instant::now() < until {
            match rx.take(|f, _| ours(f, tag).is_none()) {
                RxPoll::Refused => refused = true,
                RxPoll::Empty => std::thread::yield_now(),
                _ => {}
            }
        }
        assert!(refused);
        assert_eq!(collect(&mut rx, tag, 1)[0].0, 1000);
    }

    #[test]
    #[ignore = "needs CAP_NET_RAW (.ci/run runs it as root)"]
    fn a_slot_whose_header_places_the_frame_outside_it_is_given_back_unread() {
        let (mut rx, mut tx) = open_pair();
        let tag = std::process::id() ^ 0x1e1e_0000;
        tx.push(&frame(tag, 1, 100)).expect("a slot");
        tx.flush();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while !rx.ready() {
            assert!(std::time::Instant::now() < until, "no frame arrived");
            std::thread::yield_now();
        }
        // Whatever frame is first in line, its header now claims bytes past the slot
        // (the slot is this process's while it is marked for the user).
        let slot = rx.ring.slot(rx.head).cast::<libc::tpacket2_hdr>();
        // SAFETY: the head slot is marked USER, so the kernel does not touch it; the
        // write stays inside its header.
        unsafe { std::ptr::addr_of_mut!((*slot).tp_mac).write(SLOT_SIZE as u16 - 8) };
        let mut handed = false;
        assert_eq!(
            rx.take(|_, _| {
                handed = true;
                true
            }),
            RxPoll::Skipped
        );
        assert!(!handed, "no byte of the slot was handed on");
        assert_eq!(rx.stats().malformed, 1);
        // The slot went back to the kernel and the ring goes on.
        let after = tag ^ 1;
        tx.push(&frame(after, 2, 100)).expect("a slot");
        tx.flush();
        let got = collect(&mut rx, after, 1);
        assert_eq!(got, vec![(2, frame(after, 2, 100))]);
    }

    #[test]
    #[ignore = "needs CAP_NET_RAW (.ci/run runs it as root)"]
    fn a_frame_longer_than_a_slot_is_counted_and_dropped_and_the_next_arrives() {
        let (mut rx, mut tx) = open_pair();
        let tag = std::process::id() ^ 0x3c3c_0000;
        // Fits a transmit slot, not a receive slot behind the kernel's header.
        let long = frame(tag, 1, TX_MAX_FRAME);
        tx.push(&long).expect("a slot");
        tx.push(&frame(tag, 2, 200)).expect("a slot");
        tx.flush();
        let got = collect(&mut rx, tag, 1);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1, frame(tag, 2, 200));
        assert!(rx.stats().truncated >= 1);
        assert_eq!(tx.push(&[]), Err(TxRefused::BadLength));
        assert_eq!(
            tx.push(&vec![0; TX_MAX_FRAME + 1]),
            Err(TxRefused::BadLength)
        );
        assert_eq!(tx.stats().bad_length, 2);
    }
}
