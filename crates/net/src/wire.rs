//! Frames on the wire: building the remote sender's UDP messages (IP-fragmented into
//! full-size frames when larger than the MTU, as paper 000's 48000-byte messages are)
//! and parsing received frames into validated IPv4 fragments and UDP datagrams.
//!
//! Header formats and checksums are `smoltcp::wire`'s; this module only arranges them.
//! Parsing trusts nothing: lengths are checked before any field is read, checksums are
//! verified, and each failure has its own error.

use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    checksum, EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr, IpAddress,
    IpProtocol, Ipv4Address, Ipv4Packet, Ipv4Repr, UdpPacket, UdpRepr,
};

/// Ethernet header.
pub const ETH_HEADER: usize = 14;
/// IPv4 header without options.
pub const IPV4_HEADER: usize = 20;
/// UDP header.
pub const UDP_HEADER: usize = 8;
/// The Ethernet MTU the papers' links had.
pub const DEFAULT_MTU: u16 = 1500;
/// Largest frame pvio builds: MTU plus the Ethernet header.
pub const MAX_FRAME: usize = DEFAULT_MTU as usize + ETH_HEADER;
/// An 802.1Q tag's bytes.
pub const VLAN_HEADER: usize = 4;
/// The longest frame a 1500-byte MTU allows with a VLAN tag: what a NIC without jumbo
/// frames accepts, and what a vif sends a front end without scatter-gather (Linux's
/// `xenvif_change_mtu` keeps such a vif at MTU 1500). Every such bound in pvio is this
/// one constant.
pub const MAX_TAGGED_FRAME: usize = MAX_FRAME + VLAN_HEADER;
/// Largest UDP payload an IPv4 datagram can carry.
pub const MAX_UDP_PAYLOAD: usize = 65535 - IPV4_HEADER - UDP_HEADER;

/// Why a frame was not accepted (or a message not built).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum WireError {
    /// Shorter than its headers or its length fields say.
    #[error("truncated")]
    Truncated,
    /// Not an IPv4 frame.
    #[error("not IPv4")]
    NotIpv4,
    /// IPv4 header malformed (version, header length).
    #[error("malformed IPv4 header")]
    BadIpHeader,
    /// IPv4 header checksum wrong.
    #[error("bad IPv4 checksum")]
    BadIpChecksum,
    /// UDP header malformed (length field).
    #[error("malformed UDP header")]
    BadUdpHeader,
    /// UDP checksum wrong.
    #[error("bad UDP checksum")]
    BadUdpChecksum,
    /// A message too large for one IPv4 datagram, or an MTU too small to fragment into.
    #[error("message too large")]
    TooLarge,
}

/// The payload the lab's senders put in message `seq`: byte `i` is `31·i + seq`
/// (mod 256). Every byte depends on its position and the message, so a byte copied to
/// the wrong place, a stale buffer or a message delivered twice in one is caught by
/// [`PayloadCheck`], which needs nothing from the sender but the message itself.
pub const fn payload_byte(seq: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(PAYLOAD_STEP).wrapping_add(seq)
}

const PAYLOAD_STEP: u8 = 31;
/// The inverse of 31 modulo 256 (31 · 223 = 6913 = 27 · 256 + 1).
const PAYLOAD_STEP_INV: u8 = 223;

/// Checks a whole received payload against [`payload_byte`]'s pattern with one
/// comparison of memory: the pattern for message `seq` is the periodic sequence `31·j`
/// read from `j = 223·seq`, so a table of 256 + the longest message covers every `seq`.
#[derive(Debug, Clone)]
pub struct PayloadCheck {
    table: Vec<u8>,
}

impl PayloadCheck {
    /// A checker for payloads up to `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            table: (0..max + 256).map(|j| payload_byte(0, j)).collect(),
        }
    }
    /// Whether `data` is one whole message of the pattern (its first byte names it).
    pub fn verify(&self, data: &[u8]) -> bool {
        let Some(&seq) = data.first() else {
            return true;
        };
        let from = usize::from(seq.wrapping_mul(PAYLOAD_STEP_INV));
        self.table
            .get(from..from + data.len())
            .is_some_and(|want| want == data)
    }
}

/// One direction of a UDP flow between two hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpFlow {
    /// Sender MAC.
    pub src_mac: [u8; 6],
    /// Receiver MAC.
    pub dst_mac: [u8; 6],
    /// Sender address.
    pub src_ip: Ipv4Address,
    /// Receiver address.
    pub dst_ip: Ipv4Address,
    /// Sender port.
    pub src_port: u16,
    /// Receiver port.
    pub dst_port: u16,
    /// Link MTU (IP packet size).
    pub mtu: u16,
}

/// Builds the frames of UDP messages for one flow. Its buffers are allocated once; each
/// message reuses them (no allocation per packet).
#[derive(Debug)]
pub struct UdpFramer {
    flow: UdpFlow,
    datagram: Vec<u8>,
    frame: Vec<u8>,
}

impl UdpFramer {
    /// A framer for `flow`.
    pub fn new(flow: UdpFlow) -> Self {
        Self {
            flow,
            datagram: vec![0; 65535],
            frame: vec![0; flow.mtu as usize + ETH_HEADER],
        }
    }

    /// The flow.
    pub fn flow(&self) -> &UdpFlow {
        &self.flow
    }

    /// Bytes of IP payload per fragment: the MTU less the IP header, rounded down to the
    /// 8-byte unit fragment offsets count in.
    pub fn fragment_payload(&self) -> usize {
        (self.flow.mtu as usize).saturating_sub(IPV4_HEADER) / 8 * 8
    }

    /// Number of frames a message of `len` payload bytes takes.
    pub fn frames_for(&self, len: usize) -> usize {
        (UDP_HEADER + len).div_ceil(self.fragment_payload().max(8))
    }

    /// Builds the frames carrying one UDP message with IP identification `ident`, calling
    /// `emit` with each frame in order. The UDP checksum covers the whole datagram, which
    /// is then cut into fragments. Returns the number of frames.
    pub fn frames(
        &mut self,
        ident: u16,
        payload: &[u8],
        mut emit: impl FnMut(&[u8]),
    ) -> Result<usize, WireError> {
        if payload.len() > MAX_UDP_PAYLOAD {
            return Err(WireError::TooLarge);
        }
        let per = self.fragment_payload();
        if per < 8 {
            return Err(WireError::TooLarge);
        }
        let f = self.flow;
        let (src, dst) = (IpAddress::Ipv4(f.src_ip), IpAddress::Ipv4(f.dst_ip));
        // The whole UDP datagram, checksummed.
        let dlen = UDP_HEADER + payload.len();
        let mut udp = UdpPacket::new_unchecked(&mut self.datagram[..dlen]);
        UdpRepr {
            src_port: f.src_port,
            dst_port: f.dst_port,
        }
        .emit(
            &mut udp,
            &src,
            &dst,
            payload.len(),
            |p| p.copy_from_slice(payload),
            &ChecksumCapabilities::default(),
        );
        // Cut into fragments of `per` bytes.
        let mut off = 0;
        let mut n = 0;
        while off < dlen {
            let chunk = per.min(dlen - off);
            let more = off + chunk < dlen;
            let total = ETH_HEADER + IPV4_HEADER + chunk;
            let frame = &mut self.frame[..total];
            let mut eth = EthernetFrame::new_unchecked(&mut *frame);
            EthernetRepr {
                src_addr: EthernetAddress(f.src_mac),
                dst_addr: EthernetAddress(f.dst_mac),
                ethertype: EthernetProtocol::Ipv4,
            }
            .emit(&mut eth);
            let mut ip = Ipv4Packet::new_unchecked(eth.payload_mut());
            Ipv4Repr {
                src_addr: f.src_ip,
                dst_addr: f.dst_ip,
                next_header: IpProtocol::Udp,
                payload_len: chunk,
                hop_limit: 64,
            }
            .emit(&mut ip, &ChecksumCapabilities::default());
            ip.set_ident(ident);
            ip.set_dont_frag(false);
            ip.set_more_frags(more);
            // Cannot truncate: off < 65535 and is a multiple of 8.
            ip.set_frag_offset(off as u16);
            ip.fill_checksum();
            ip.payload_mut()[..chunk].copy_from_slice(&self.datagram[off..off + chunk]);
            emit(&self.frame[..total]);
            off += chunk;
            n += 1;
        }
        Ok(n)
    }
}

/// The Ethernet and IPv4 headers of a received frame, validated. This is the one IPv4
/// input parse of pvio: the guest's stack runs it on the header bytes it copied out of
/// a packet buffer, and [`parse_ipv4`] on a frame held whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Header {
    /// Source MAC of the frame.
    pub src_mac: [u8; 6],
    /// Source address.
    pub src: Ipv4Address,
    /// Destination address.
    pub dst: Ipv4Address,
    /// Protocol.
    pub proto: IpProtocol,
    /// Identification.
    pub ident: u16,
    /// Offset of this fragment's payload in the datagram, in bytes.
    pub offset: u16,
    /// More fragments follow.
    pub more: bool,
    /// IPv4 header length in bytes (options included).
    pub header_len: usize,
    /// IPv4 total length: header and payload, link padding excluded.
    pub total_len: usize,
}

impl Ipv4Header {
    /// Bytes of IP payload in this packet.
    pub fn payload_len(&self) -> usize {
        self.total_len - self.header_len
    }
    /// Whether this is a whole datagram.
    pub fn is_whole(&self) -> bool {
        self.offset == 0 && !self.more
    }
}

/// Parses and validates the Ethernet and IPv4 headers at the start of `head` (the first
/// bytes of a frame, a copy; options included if present) for a frame of `frame_len`
/// bytes in all: the ethertype, the version, the header length within `head`, the total
/// length within the frame, the header checksum. Options are allowed and skipped.
pub fn parse_ipv4_header(head: &[u8], frame_len: usize) -> Result<Ipv4Header, WireError> {
    if head.len() < ETH_HEADER + IPV4_HEADER || frame_len < head.len() {
        return Err(WireError::Truncated);
    }
    let eth = EthernetFrame::new_unchecked(head);
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return Err(WireError::NotIpv4);
    }
    let ipb = &head[ETH_HEADER..];
    let ip = Ipv4Packet::new_unchecked(ipb);
    let hl = ip.header_len() as usize;
    if ip.version() != 4 || hl < IPV4_HEADER || hl > ipb.len() {
        return Err(WireError::BadIpHeader);
    }
    let tl = ip.total_len() as usize;
    if tl < hl || tl > frame_len - ETH_HEADER {
        return Err(WireError::Truncated);
    }
    if !Ipv4Packet::new_unchecked(&ipb[..hl]).verify_checksum() {
        return Err(WireError::BadIpChecksum);
    }
    Ok(Ipv4Header {
        src_mac: eth.src_addr().0,
        src: ip.src_addr(),
        dst: ip.dst_addr(),
        proto: ip.next_header(),
        ident: ip.ident(),
        offset: ip.frag_offset(),
        more: ip.more_frags(),
        header_len: hl,
        total_len: tl,
    })
}

/// Parses and validates a whole Ethernet frame carrying IPv4 ([`parse_ipv4_header`]):
/// its headers, and its IP payload (trailing link padding excluded).
pub fn parse_ipv4(frame: &[u8]) -> Result<(Ipv4Header, &[u8]), WireError> {
    let head = &frame[..frame.len().min(ETH_HEADER + 60)];
    let h = parse_ipv4_header(head, frame.len())?;
    let body = &frame[ETH_HEADER..];
    Ok((h, &body[h.header_len..h.total_len]))
}

/// A UDP header, validated against the datagram it heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpHeader {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// The length field: header and payload.
    pub len: usize,
    /// The checksum field (zero: none, allowed in IPv4).
    pub checksum: u16,
}

/// Parses the UDP header `h` of a datagram that has `datagram_len` bytes of IP payload:
/// the length field must cover the header and fit in the datagram. The one UDP input
/// parse of pvio; the checksum is verified by the caller, over wherever the bytes lie.
pub fn parse_udp_header(h: &[u8; UDP_HEADER], datagram_len: usize) -> Result<UdpHeader, WireError> {
    let be = |i: usize| u16::from_be_bytes([h[i], h[i + 1]]);
    let len = be(4) as usize;
    if len < UDP_HEADER || len > datagram_len {
        return Err(WireError::BadUdpHeader);
    }
    Ok(UdpHeader {
        src_port: be(0),
        dst_port: be(2),
        len,
        checksum: be(6),
    })
}

/// Parses a whole UDP datagram held in one slice (after reassembly) and verifies its
/// checksum; returns the header and the payload.
pub fn parse_udp(
    src: Ipv4Address,
    dst: Ipv4Address,
    datagram: &[u8],
) -> Result<(UdpHeader, &[u8]), WireError> {
    let h: &[u8; UDP_HEADER] = datagram
        .get(..UDP_HEADER)
        .and_then(|h| h.try_into().ok())
        .ok_or(WireError::BadUdpHeader)?;
    let u = parse_udp_header(h, datagram.len())?;
    let d = &datagram[..u.len];
    let sum = checksum::combine(&[
        checksum::pseudo_header_v4(&src, &dst, IpProtocol::Udp, u.len as u32),
        checksum::data(d),
    ]);
    if u.checksum != 0 && sum != 0xffff {
        return Err(WireError::BadUdpChecksum);
    }
    Ok((u, &d[UDP_HEADER..]))
}

/// Whether an untagged Ethernet frame's transport checksum is right: `Some` for an
/// unfragmented IPv4 TCP segment or UDP datagram that carries a checksum, `None` for
/// anything else (another protocol, a fragment, UDP without a checksum, a frame too
/// short to parse). A NIC's receive checksum offload and a host's check both ask this.
pub fn l4_checksum(frame: &[u8]) -> Option<bool> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return None;
    }
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    if ip.more_frags() || ip.frag_offset() != 0 {
        return None;
    }
    let (src, dst) = (
        IpAddress::Ipv4(ip.src_addr()),
        IpAddress::Ipv4(ip.dst_addr()),
    );
    match ip.next_header() {
        IpProtocol::Udp => {
            let u = UdpPacket::new_checked(ip.payload()).ok()?;
            (u.checksum() != 0).then(|| u.verify_checksum(&src, &dst))
        }
        IpProtocol::Tcp => {
            let t = smoltcp::wire::TcpPacket::new_checked(ip.payload()).ok()?;
            Some(t.verify_checksum(&src, &dst))
        }
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn flow() -> UdpFlow {
        UdpFlow {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            src_ip: Ipv4Address::new(10, 0, 0, 1),
            dst_ip: Ipv4Address::new(10, 0, 0, 2),
            src_port: 5001,
            dst_port: 5002,
            mtu: DEFAULT_MTU,
        }
    }

    pub(crate) fn message(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect()
    }

    pub(crate) fn frames_of(len: usize, ident: u16) -> Vec<Vec<u8>> {
        let mut f = UdpFramer::new(flow());
        let mut out = Vec::new();
        f.frames(ident, &message(len, ident as u8), |fr| {
            out.push(fr.to_vec())
        })
        .expect("frames");
        out
    }

    #[test]
    fn the_papers_message_sizes_become_the_right_frames() {
        let f = UdpFramer::new(flow());
        assert_eq!(f.fragment_payload(), 1480);
        // 52 and 1500 bytes: one frame each? 1500 B of payload + 8 of UDP needs two.
        assert_eq!(frames_of(52, 1).len(), 1);
        assert_eq!(
            frames_of(52, 1)[0].len(),
            ETH_HEADER + IPV4_HEADER + UDP_HEADER + 52
        );
        assert_eq!(
            frames_of(1472, 1).len(),
            1,
            "1472 B is the largest unfragmented payload"
        );
        assert_eq!(frames_of(1500, 1).len(), 2);
        // 48000 bytes: 33 frames, all full-size but the last.
        let fr = frames_of(48000, 7);
        assert_eq!(fr.len(), 33);
        assert!(fr[..32].iter().all(|x| x.len() == MAX_FRAME));
        assert_eq!(f.frames_for(48000), 33);
    }

    #[test]
    fn built_frames_parse_back_with_offsets_and_checksums() {
        let fr = frames_of(48000, 9);
        let mut whole = vec![0u8; UDP_HEADER + 48000];
        for (i, x) in fr.iter().enumerate() {
            let (p, payload) = parse_ipv4(x).expect("valid");
            assert_eq!(
                (p.ident, p.proto, p.more),
                (9, IpProtocol::Udp, i + 1 < fr.len())
            );
            assert_eq!(p.offset as usize, i * 1480);
            assert_eq!(p.payload_len(), payload.len());
            whole[p.offset as usize..p.offset as usize + payload.len()].copy_from_slice(payload);
        }
        let (d, payload) = parse_udp(flow().src_ip, flow().dst_ip, &whole).expect("udp");
        assert_eq!((d.src_port, d.dst_port), (5001, 5002));
        assert_eq!(payload, &message(48000, 9)[..]);
        let small = frames_of(52, 3);
        let (one, payload) = parse_ipv4(&small[0]).expect("valid");
        assert!(one.is_whole());
        assert_eq!(
            parse_udp(one.src, one.dst, payload).expect("udp").1,
            &message(52, 3)[..]
        );
    }

    #[test]
    fn malformed_frames_are_refused_with_their_reason() {
        let good = frames_of(100, 1).remove(0);
        assert_eq!(parse_ipv4(&good[..10]), Err(WireError::Truncated));
        assert_eq!(
            parse_ipv4(&good[..ETH_HEADER + 10]),
            Err(WireError::Truncated)
        );
        let mut arp = good.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(parse_ipv4(&arp), Err(WireError::NotIpv4));
        let mut v6 = good.clone();
        v6[ETH_HEADER] = 0x65;
        assert_eq!(parse_ipv4(&v6), Err(WireError::BadIpHeader));
        let mut csum = good.clone();
        csum[ETH_HEADER + 8] ^= 1; // TTL changes, checksum does not
        assert_eq!(parse_ipv4(&csum), Err(WireError::BadIpChecksum));
        let mut long = good.clone();
        long[ETH_HEADER + 2..ETH_HEADER + 4].copy_from_slice(&2000u16.to_be_bytes()); // total length > frame
        assert_eq!(parse_ipv4(&long), Err(WireError::Truncated));
        let mut hl = good.clone();
        hl[ETH_HEADER] = 0x44; // header length 16 < 20
        assert_eq!(parse_ipv4(&hl), Err(WireError::BadIpHeader));
        let (p, payload) = parse_ipv4(&good).expect("valid");
        let mut bad = payload.to_vec();
        bad[UDP_HEADER] ^= 0xff;
        assert_eq!(
            parse_udp(p.src, p.dst, &bad),
            Err(WireError::BadUdpChecksum)
        );
        let mut short = payload.to_vec();
        short[4..6].copy_from_slice(&4u16.to_be_bytes());
        assert!(matches!(
            parse_udp(p.src, p.dst, &short),
            Err(WireError::BadUdpHeader)
        ));
        assert_eq!(
            UdpFramer::new(flow()).frames(1, &vec![0; MAX_UDP_PAYLOAD + 1], |_| {}),
            Err(WireError::TooLarge)
        );
    }

    #[test]
    fn the_payload_check_takes_every_message_whole_and_catches_any_wrong_byte() {
        let check = PayloadCheck::new(65507);
        for seq in 0..=255u8 {
            for len in [0usize, 1, 2, 52, 1472, 48000, 65507] {
                let mut m: Vec<u8> = (0..len).map(|i| payload_byte(seq, i)).collect();
                assert!(check.verify(&m), "seq {seq} len {len}");
                if len > 1 {
                    // Any one byte wrong, first, middle or last.
                    for at in [0, len / 2, len - 1] {
                        m[at] ^= 0x40;
                        assert!(!check.verify(&m), "seq {seq} len {len} byte {at}");
                        m[at] ^= 0x40;
                    }
                    // Another message's bytes in place of this one's tail.
                    let other = seq.wrapping_add(1);
                    m[len - 1] = payload_byte(other, len - 1);
                    assert!(!check.verify(&m));
                }
            }
        }
        assert!(
            !PayloadCheck::new(100).verify(&[0; 101]),
            "longer than the table"
        );
    }
}

/// A TCP/IPv4 segment between 10.0.0.1 and 10.0.0.2, for building test and fuzz
/// frames (a wire's worth of segments to hand an LRO engine or a stack): Linux's
/// aligned timestamp option (NOP, NOP, TS) if `ts` is given, both checksums correct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSegment {
    /// Source port (the flow).
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Sequence number of the first payload byte.
    pub seq: u32,
    /// Acknowledgement number.
    pub ack: u32,
    /// TCP flags.
    pub flags: u8,
    /// Advertised window.
    pub window: u16,
    /// The timestamp option: (value, echo reply).
    pub ts: Option<(u32, u32)>,
}

impl TcpSegment {
    /// The frame carrying `payload`.
    pub fn frame(&self, payload: &[u8]) -> Vec<u8> {
        let tcp_len = if self.ts.is_some() { 32 } else { 20 };
        let total = IPV4_HEADER + tcp_len + payload.len();
        let mut f = vec![0u8; ETH_HEADER + total];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        let ip = &mut f[ETH_HEADER..ETH_HEADER + IPV4_HEADER];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        ip[8] = 64;
        ip[9] = 6;
        ip[12..16].copy_from_slice(&[10, 0, 0, 1]);
        ip[16..20].copy_from_slice(&[10, 0, 0, 2]);
        let sum = !smoltcp::wire::checksum::data(ip);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        let l4 = ETH_HEADER + IPV4_HEADER;
        let t = &mut f[l4..l4 + tcp_len];
        t[0..2].copy_from_slice(&self.sport.to_be_bytes());
        t[2..4].copy_from_slice(&self.dport.to_be_bytes());
        t[4..8].copy_from_slice(&self.seq.to_be_bytes());
        t[8..12].copy_from_slice(&self.ack.to_be_bytes());
        t[12] = ((tcp_len / 4) as u8) << 4;
        t[13] = self.flags;
        t[14..16].copy_from_slice(&self.window.to_be_bytes());
        if let Some((v, e)) = self.ts {
            t[20..24].copy_from_slice(&[1, 1, 8, 10]);
            t[24..28].copy_from_slice(&v.to_be_bytes());
            t[28..32].copy_from_slice(&e.to_be_bytes());
        }
        f[l4 + tcp_len..].copy_from_slice(payload);
        // The checksum over the pseudo-header, the header and the payload.
        let sum = !smoltcp::wire::checksum::combine(&[
            smoltcp::wire::checksum::pseudo_header_v4(
                &Ipv4Address::new(10, 0, 0, 1),
                &Ipv4Address::new(10, 0, 0, 2),
                smoltcp::wire::IpProtocol::Tcp,
                (tcp_len + payload.len()) as u32,
            ),
            smoltcp::wire::checksum::data(&f[l4..]),
        ]);
        f[l4 + 16..l4 + 18].copy_from_slice(&sum.to_be_bytes());
        f
    }
}
