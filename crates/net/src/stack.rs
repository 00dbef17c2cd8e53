//! The guest's network stack for received UDP: IPv4 input with reassembly, UDP input
//! with checksum verification, per-socket receive queues, and `recv` copying a
//! datagram into the application's buffer (the `usercopy` of paper 000, Table 3).
//!
//! Frames arrive as packet buffers whose data starts at the Ethernet header (from a NIC
//! driver or netfront). Headers are copied out (a few dozen bytes), parsed with
//! `smoltcp::wire` and validated before anything is acted on; every refusal has a
//! counter. Fragments are not copied: reassembly links their buffers into the first
//! one's fragment list, as Linux does. Memory is bounded: reassembly contexts are fixed
//! and each socket queue has a byte budget (`SO_RCVBUF`), past which datagrams are
//! dropped and counted.

use hv::counters::{CopyAlign, PerReason};
use std::time::Duration;

use hv::profile::{enter, Class};
use hv::{Domain, Gfn, PAGE_SIZE};
use smoltcp::wire::{checksum, IpProtocol, Ipv4Address};

use crate::reasm::{FragInfo, Reassembler, DEFAULT_CONTEXTS, DEFAULT_TIMEOUT, MAX_PIECES};
use crate::skb::{SegPage, SkbError, SkbId, SkbPool, SkbQueue};
use crate::wire::{parse_ipv4_header, parse_udp_header, WireError, ETH_HEADER, UDP_HEADER};

/// Why the stack dropped a frame or datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RxDrop {
    /// Shorter than its headers or length fields.
    Truncated,
    /// Not IPv4 (no other protocol is served).
    NotIpv4,
    /// Malformed IPv4 header.
    BadIpHeader,
    /// IPv4 header checksum wrong.
    BadIpChecksum,
    /// Addressed to another host.
    NotForUs,
    /// Not UDP.
    NotUdp,
    /// Headers not in the linear area.
    NotLinear,
    /// Reassembly dropped it (see the reassembler's own counters).
    Reassembly,
    /// Malformed UDP header.
    BadUdpHeader,
    /// UDP checksum wrong.
    BadUdpChecksum,
    /// No socket on the port.
    NoSocket,
    /// The socket's queue was full.
    SocketFull,
}

impl From<WireError> for RxDrop {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Truncated | WireError::TooLarge => RxDrop::Truncated,
            WireError::NotIpv4 => RxDrop::NotIpv4,
            WireError::BadIpHeader => RxDrop::BadIpHeader,
            WireError::BadIpChecksum => RxDrop::BadIpChecksum,
            WireError::BadUdpHeader => RxDrop::BadUdpHeader,
            WireError::BadUdpChecksum => RxDrop::BadUdpChecksum,
        }
    }
}

impl RxDrop {
    /// Every reason, in counter order.
    pub const ALL: [RxDrop; 12] = [
        RxDrop::Truncated,
        RxDrop::NotIpv4,
        RxDrop::BadIpHeader,
        RxDrop::BadIpChecksum,
        RxDrop::NotForUs,
        RxDrop::NotUdp,
        RxDrop::NotLinear,
        RxDrop::Reassembly,
        RxDrop::BadUdpHeader,
        RxDrop::BadUdpChecksum,
        RxDrop::NoSocket,
        RxDrop::SocketFull,
    ];
}

hv::reason!(RxDrop);

/// Counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StackStats {
    /// Frames offered.
    pub frames: u64,
    /// Datagrams queued to sockets.
    pub datagrams: u64,
    /// Drops per [`RxDrop`].
    pub drops: PerReason<RxDrop>,
    /// Checksums verified in software (not by the device or the back end).
    pub soft_csums: u64,
    /// Bytes copied to applications, by how source and destination line up.
    pub usercopy_bytes: PerReason<CopyAlign>,
}

hv::counter_set!(StackStats {
    frames,
    datagrams,
    drops,
    soft_csums,
    usercopy_bytes
});

impl StackStats {
    /// Drops for one reason.
    pub fn drop_count(&self, r: RxDrop) -> u64 {
        self.drops.get(r)
    }
    /// All drops.
    pub fn drops_total(&self) -> u64 {
        self.drops.total()
    }
}

/// A socket's handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketId(usize);

#[derive(Debug)]
struct Socket {
    port: u16,
    queue: SkbQueue,
}

/// Sockets a stack serves.
pub const MAX_SOCKETS: usize = 16;
/// Default receive buffer per socket (Linux's `rmem_default`).
pub const DEFAULT_RCVBUF: usize = 212_992;

/// An application's receive buffer: whole pages of its domain's memory.
#[derive(Debug)]
pub struct UserBuf {
    pages: Vec<Gfn>,
}

impl UserBuf {
    /// `bytes` (rounded up to pages) taken from `dom`'s allocator.
    pub fn new(dom: &Domain, bytes: usize) -> Result<Self, hv::DomainError> {
        let pages = (0..bytes.div_ceil(PAGE_SIZE).max(1))
            .map(|_| dom.alloc_page())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { pages })
    }
    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.pages.len() * PAGE_SIZE
    }
    /// Copies `data` in at offset `at` (a read's `copy_to_user`).
    pub fn write(&self, dom: &Domain, at: usize, data: &[u8]) -> Result<(), hv::DomainError> {
        let mut done = 0;
        while done < data.len() {
            let pos = at + done;
            let (p, o) = (pos / PAGE_SIZE, pos % PAGE_SIZE);
            let n = (PAGE_SIZE - o).min(data.len() - done);
            let g = *self.pages.get(p).ok_or(hv::DomainError::BadGfn(u32::MAX))?;
            dom.write(g, o, &data[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes from offset `at` (to check what arrived).
    pub fn read(&self, dom: &Domain, at: usize, out: &mut [u8]) -> Result<(), hv::DomainError> {
        let mut done = 0;
        while done < out.len() {
            let pos = at + done;
            let (p, o) = (pos / PAGE_SIZE, pos % PAGE_SIZE);
            let n = (PAGE_SIZE - o).min(out.len() - done);
            let g = *self.pages.get(p).ok_or(hv::DomainError::BadGfn(u32::MAX))?;
            dom.read(g, o, &mut out[done..done + n])?;
            done += n;
        }
        Ok(())
    }
}

/// A received datagram's description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// Bytes copied into the buffer.
    pub len: usize,
    /// Bytes the datagram had (more than `len` if the buffer was short).
    pub datagram: usize,
}

/// The stack of one domain.
#[derive(Debug)]
pub struct Stack {
    ip: Ipv4Address,
    mac: [u8; 6],
    reasm: Reassembler<SkbId>,
    pieces: Vec<SkbId>,
    released: Vec<SkbId>,
    sockets: Vec<Socket>,
    stats: StackStats,
}

impl Stack {
    /// A stack answering to `ip` and `mac`.
    pub fn new(ip: Ipv4Address, mac: [u8; 6]) -> Self {
        Self {
            ip,
            mac,
            reasm: Reassembler::new(DEFAULT_CONTEXTS, DEFAULT_TIMEOUT),
            pieces: Vec::with_capacity(MAX_PIECES),
            released: Vec::with_capacity(DEFAULT_CONTEXTS * MAX_PIECES + 1),
            sockets: Vec::with_capacity(MAX_SOCKETS),
            stats: StackStats::default(),
        }
    }

    /// The address.
    pub fn ip(&self) -> Ipv4Address {
        self.ip
    }
    /// Counters.
    pub fn stats(&self) -> &StackStats {
        &self.stats
    }
    /// Reassembly counters.
    pub fn reasm_stats(&self) -> &crate::reasm::ReasmStats {
        self.reasm.stats()
    }

    /// Binds a UDP socket on `port` with a receive buffer of `rcvbuf` bytes.
    pub fn bind_udp(&mut self, port: u16, rcvbuf: usize) -> Option<SocketId> {
        if self.sockets.len() == MAX_SOCKETS || self.sockets.iter().any(|s| s.port == port) {
            return None;
        }
        self.sockets.push(Socket {
            port,
            queue: SkbQueue::new(rcvbuf),
        });
        Some(SocketId(self.sockets.len() - 1))
    }

    /// Datagrams waiting on a socket.
    pub fn queued(&self, s: SocketId) -> usize {
        self.sockets[s.0].queue.len()
    }

    fn drop(&mut self, pool: &mut SkbPool, skb: SkbId, why: RxDrop) {
        self.stats.drops.add(why);
        pool.free(skb);
    }

    /// Takes one received frame (data at the Ethernet header) at time `now`.
    pub fn input(&mut self, pool: &mut SkbPool, skb: SkbId, now: Duration) {
        let _c = enter(Class::Network);
        self.stats.frames += 1;
        let mut hdr = [0u8; ETH_HEADER + 60];
        let n = pool.len(skb).min(hdr.len());
        if pool.read(skb, 0, &mut hdr[..n]).is_err() {
            return self.drop(pool, skb, RxDrop::Truncated);
        }
        let ip = match parse_ipv4_header(&hdr[..n], pool.len(skb)) {
            Ok(ip) => ip,
            Err(e) => return self.drop(pool, skb, e.into()),
        };
        if ip.dst != self.ip {
            return self.drop(pool, skb, RxDrop::NotForUs);
        }
        if ip.proto != IpProtocol::Udp {
            return self.drop(pool, skb, RxDrop::NotUdp);
        }
        let info = FragInfo::from(&ip);
        let (hl, tl) = (ip.header_len, ip.total_len);
        if pool.pull(skb, ETH_HEADER + hl).is_err() {
            return self.drop(pool, skb, RxDrop::NotLinear);
        }
        // Link padding goes; the IP length is what counts.
        if pool.trim(skb, tl - hl).is_err() {
            return self.drop(pool, skb, RxDrop::Truncated);
        }

        let Self {
            reasm,
            pieces,
            released,
            ..
        } = self;
        pieces.clear();
        let r = reasm.push(
            now,
            &info,
            skb,
            |ps| pieces.extend(ps.iter().map(|p| p.item)),
            &mut |id| released.push(id),
        );
        for id in self.released.drain(..) {
            pool.free(id);
        }
        if r.is_err() {
            self.stats.drops.add(RxDrop::Reassembly);
            return;
        }
        let Some((&head, rest)) = self.pieces.split_first() else {
            return;
        };
        for &p in rest {
            pool.append_frag_list(head, p);
        }
        self.udp_input(pool, head, info.src, info.dst);
    }

    fn udp_input(&mut self, pool: &mut SkbPool, skb: SkbId, src: Ipv4Address, dst: Ipv4Address) {
        let mut h = [0u8; UDP_HEADER];
        if pool.read(skb, 0, &mut h).is_err() {
            return self.drop(pool, skb, RxDrop::BadUdpHeader);
        }
        let udp = match parse_udp_header(&h, pool.len(skb)) {
            Ok(u) => u,
            Err(e) => return self.drop(pool, skb, e.into()),
        };
        let (ulen, csum, dport) = (udp.len, udp.checksum, udp.dst_port);
        if ulen < pool.len(skb) && pool.trim(skb, ulen).is_err() {
            return self.drop(pool, skb, RxDrop::BadUdpHeader);
        }
        if csum != 0 && !pool_csum_valid(pool, skb) {
            self.stats.soft_csums += 1;
            let ok = udp_checksum(pool, skb, src, dst, ulen).is_ok_and(|s| s == 0xffff);
            if !ok {
                return self.drop(pool, skb, RxDrop::BadUdpChecksum);
            }
        }
        let Some(sock) = self.sockets.iter_mut().find(|s| s.port == dport) else {
            return self.drop(pool, skb, RxDrop::NoSocket);
        };
        if pool.pull(skb, UDP_HEADER).is_err() {
            return self.drop(pool, skb, RxDrop::NotLinear);
        }
        match sock.queue.push(pool, skb) {
            Ok(()) => self.stats.datagrams += 1,
            Err(skb) => self.drop(pool, skb, RxDrop::SocketFull),
        }
    }

    /// `recv` on a socket: copies the next datagram into `buf` (as much as fits) and
    /// frees it. `None` if nothing is queued.
    pub fn recv(
        &mut self,
        pool: &mut SkbPool,
        s: SocketId,
        buf: &UserBuf,
    ) -> Result<Option<Received>, SkbError> {
        let _c = enter(Class::Syscall);
        let Some(skb) = self.sockets[s.0].queue.pop(pool) else {
            return Ok(None);
        };
        let datagram = pool.len(skb);
        let len = datagram.min(buf.capacity());
        let r = {
            let _u = enter(Class::UserCopy);
            copy_to_user(pool, skb, len, buf, &mut self.stats.usercopy_bytes)
        };
        {
            let _m = enter(Class::Mem);
            pool.free(skb);
        }
        r.map(|()| Some(Received { len, datagram }))
    }

    /// When [`Stack::tick`] next has work: the kernel sets its timer to this before it
    /// idles.
    pub fn next_timer(&self) -> Option<Duration> {
        self.reasm.next_expiry()
    }

    /// Expires stale reassembly (at [`Stack::next_timer`], or now and then).
    pub fn tick(&mut self, pool: &mut SkbPool, now: Duration) {
        let _c = enter(Class::Time);
        let Self {
            reasm, released, ..
        } = self;
        reasm.expire(now, &mut |id| released.push(id));
        for id in self.released.drain(..) {
            pool.free(id);
        }
    }

    /// Frees everything the stack holds.
    pub fn shutdown(&mut self, pool: &mut SkbPool) {
        let Self {
            reasm, released, ..
        } = self;
        reasm.clear(&mut |id| released.push(id));
        for id in self.released.drain(..) {
            pool.free(id);
        }
        for s in &mut self.sockets {
            s.queue.purge(pool);
        }
    }

    /// The MAC address.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }
}

fn pool_csum_valid(pool: &SkbPool, skb: SkbId) -> bool {
    pool.csum_valid(skb)
}

/// The UDP checksum sum (pseudo header and every byte of the datagram) folded to 16
/// bits: `0xffff` when the datagram is intact.
fn udp_checksum(
    pool: &SkbPool,
    skb: SkbId,
    src: Ipv4Address,
    dst: Ipv4Address,
    ulen: usize,
) -> Result<u16, SkbError> {
    let dom = pool.domain();
    let mut sum = checksum::pseudo_header_v4(&src, &dst, IpProtocol::Udp, ulen as u32);
    pool.walk(skb, 0, ulen, |seg, at| {
        let SegPage::Own(g) = seg.page else {
            return Err(SkbError::OutOfBounds);
        };
        let mut part = dom.csum_partial(g, seg.offset, seg.len)?;
        // A run starting at an odd position of the datagram has its bytes in the other
        // halves of the 16-bit words.
        if at % 2 == 1 {
            part = part.swap_bytes();
        }
        sum = checksum::combine(&[sum, part]);
        Ok(())
    })?;
    Ok(sum)
}

/// Copies the first `len` bytes of a buffer into the application's pages.
fn copy_to_user(
    pool: &SkbPool,
    skb: SkbId,
    len: usize,
    buf: &UserBuf,
    census: &mut PerReason<CopyAlign>,
) -> Result<(), SkbError> {
    let dom = pool.domain();
    pool.walk(skb, 0, len, |seg, at| {
        let SegPage::Own(g) = seg.page else {
            return Err(SkbError::OutOfBounds);
        };
        let mut done = 0;
        while done < seg.len {
            let pos = at + done;
            let (p, o) = (pos / PAGE_SIZE, pos % PAGE_SIZE);
            let n = (PAGE_SIZE - o).min(seg.len - done);
            let up = *buf.pages.get(p).ok_or(SkbError::OutOfBounds)?;
            dom.copy(g, seg.offset + done, up, o, n)?;
            census.add_n(CopyAlign::of(seg.offset + done, o), n as u64);
            done += n;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::skb::NET_SKB_PAD;
    use crate::wire::tests::{flow, frames_of, message};
    use hv::{DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
    use std::sync::Arc;

    fn setup() -> (Arc<Hypervisor>, SkbPool, Stack, SocketId, UserBuf) {
        let hv = Hypervisor::new(HvConfig {
            frames: 4096,
            grant_path: GrantPath::Optimised,
            ..HvConfig::default()
        })
        .expect("hv");
        let d = hv
            .create_domain(&DomainConfig {
                name: "g".into(),
                pages: 2048,
                grant_frames: 1,
                grant_version: GrantVersion::V2,
                vcpus: 1,
                map_slots: 4,
                driver_domain: false,
            })
            .expect("dom");
        let pool = SkbPool::new(Arc::clone(&d), 256, 64).expect("pool");
        let mut st = Stack::new(flow().dst_ip, flow().dst_mac);
        let s = st.bind_udp(flow().dst_port, DEFAULT_RCVBUF).expect("bind");
        let ub = UserBuf::new(&d, 65536).expect("user buffer");
        (hv, pool, st, s, ub)
    }

    fn skb_of(pool: &mut SkbPool, frame: &[u8]) -> SkbId {
        let id = pool.alloc(NET_SKB_PAD).expect("skb");
        pool.put(id, frame).expect("fits");
        id
    }

    #[test]
    fn a_fragmented_message_is_reassembled_checked_and_copied_to_the_application() {
        let (_hv, mut pool, mut st, s, ub) = setup();
        let free = pool.free_buffers();
        for (i, fr) in frames_of(48000, 9).iter().enumerate().rev() {
            let id = skb_of(&mut pool, fr);
            st.input(&mut pool, id, Duration::from_millis(i as u64));
        }
        assert_eq!(st.stats().datagrams, 1);
        assert_eq!(
            st.stats().soft_csums,
            1,
            "fragments cannot be checked by a device"
        );
        let r = st
            .recv(&mut pool, s, &ub)
            .expect("copy")
            .expect("one datagram");
        assert_eq!(r.len, 48000);
        let mut got = vec![0u8; 48000];
        ub.read(pool.domain(), 0, &mut got).expect("read");
        assert_eq!(got, message(48000, 9));
        assert_eq!(pool.free_buffers(), free, "every buffer came back");
        assert_eq!(st.recv(&mut pool, s, &ub), Ok(None));
    }

    #[test]
    fn corrupted_and_misaddressed_frames_are_dropped_and_counted() {
        let (_hv, mut pool, mut st, s, ub) = setup();
        let free = pool.free_buffers();
        let good = frames_of(1000, 1).remove(0);
        // A flipped payload byte: the UDP checksum catches it.
        let mut bad_udp = good.clone();
        bad_udp[100] ^= 0xff;
        // A flipped IP header byte: the header checksum catches it.
        let mut bad_ip = good.clone();
        bad_ip[ETH_HEADER + 8] ^= 1;
        // Truncated below its IP length.
        let short = good[..200].to_vec();
        // Another host's address (checksum fixed up so only the address is wrong).
        let mut other = frames_of(10, 2).remove(0);
        other[ETH_HEADER + 19] = 99;
        let mut ipp = smoltcp::wire::Ipv4Packet::new_unchecked(&mut other[ETH_HEADER..]);
        ipp.fill_checksum();
        // Not IPv4 (an ARP ethertype).
        let mut arp = good.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        for f in [&bad_udp, &bad_ip, &short, &other, &arp] {
            let id = skb_of(&mut pool, f);
            st.input(&mut pool, id, Duration::ZERO);
        }
        let c = |r| st.stats().drop_count(r);
        assert_eq!(c(RxDrop::BadUdpChecksum), 1);
        assert_eq!(c(RxDrop::BadIpChecksum), 1);
        assert_eq!(c(RxDrop::Truncated), 1);
        assert_eq!(c(RxDrop::NotForUs), 1);
        assert_eq!(c(RxDrop::NotIpv4), 1);
        assert_eq!(st.stats().datagrams, 0);
        // The good one still gets through, and nothing leaked.
        let id = skb_of(&mut pool, &good);
        st.input(&mut pool, id, Duration::ZERO);
        let r = st.recv(&mut pool, s, &ub).expect("copy").expect("datagram");
        assert_eq!(r.len, 1000);
        assert_eq!(pool.free_buffers(), free);
    }

    #[test]
    fn a_full_socket_drops_and_counts_with_bounded_memory() {
        let (_hv, mut pool, mut st, _s, _ub) = setup();
        let s2 = st.bind_udp(7, 3000).expect("bind");
        let mut f = flow();
        f.dst_port = 7;
        let mut framer = crate::wire::UdpFramer::new(f);
        for i in 0..10u16 {
            let mut frames = Vec::new();
            framer
                .frames(i, &[1u8; 1000], |fr| frames.push(fr.to_vec()))
                .expect("frames");
            let id = skb_of(&mut pool, &frames[0]);
            st.input(&mut pool, id, Duration::ZERO);
        }
        assert_eq!(st.queued(s2), 3, "3000 bytes of 1000-byte datagrams");
        assert_eq!(st.stats().drop_count(RxDrop::SocketFull), 7);
        // Never-completed reassembly expires and gives its buffers back.
        let free = pool.free_buffers();
        let fr = frames_of(48000, 3);
        for f in &fr[..5] {
            let id = skb_of(&mut pool, f);
            st.input(&mut pool, id, Duration::ZERO);
        }
        assert_eq!(pool.free_buffers(), free - 5);
        st.tick(&mut pool, DEFAULT_TIMEOUT);
        assert_eq!(pool.free_buffers(), free);
    }
}
