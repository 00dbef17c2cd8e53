//! Checksum and segmentation offload: what travels beside a packet's bytes.
//!
//! A packet may leave its TCP or UDP checksum for someone else to fill in (Linux's
//! `CHECKSUM_PARTIAL`: the field holds the pseudo-header's sum, and whoever finally
//! needs the full checksum adds the data to it), may arrive with its checksum already
//! verified (`CHECKSUM_UNNECESSARY`), and may be one large TCP segment that stands for
//! many MTU-sized ones (GSO: its segment size rides along, and a segmenter cuts it up
//! only where something downstream cannot take it whole).
//!
//! The three places that carry this metadata each have their own encoding, converted
//! here: netif's `NETTXF_CSUM_BLANK`/`NETRXF_DATA_VALIDATED` bits and its GSO extra-info
//! slot (the ring carries only the bits: where the checksum lies is re-derived from the
//! headers by [`checksum_setup`], as netback's and netfront's `checksum_setup` do), the
//! virtio-net header that an `IFF_VNET_HDR` TAP reads and writes ([`VnetHdr`]), and the
//! NIC model's descriptors ([`Offload::to_bits`]).
//!
//! Every header read here is untrusted: lengths are checked before fields are read, and
//! each refusal has its reason ([`OffloadError`]).

use smoltcp::wire::{checksum, IpProtocol, Ipv4Address};

use crate::netif::{Gso, XEN_NETIF_GSO_TYPE_TCPV4, XEN_NETIF_GSO_TYPE_TCPV6};
use crate::wire::{ETH_HEADER, MAX_FRAME};

/// A packet's checksum state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Csum {
    /// Nothing known: a receiver verifies the checksum in the packet.
    #[default]
    None,
    /// The L4 checksum is to be filled in: its field, `offset` bytes past `start` (both
    /// from the start of the frame), holds the pseudo-header's sum.
    Partial {
        /// Where the checksummed bytes start (the L4 header).
        start: u16,
        /// The checksum field's offset from `start`.
        offset: u16,
    },
    /// Already verified (by a NIC, or by whoever built the packet).
    Valid,
}

/// What rides beside a packet's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Offload {
    /// The checksum state.
    pub csum: Csum,
    /// A large TCP segment's segment size and type.
    pub gso: Option<Gso>,
}

impl Offload {
    /// Nothing offloaded.
    pub const NONE: Offload = Offload {
        csum: Csum::None,
        gso: None,
    };

    /// Packs the metadata into 64 bits (the NIC model's descriptor field): gso size (16),
    /// gso type (8), checksum state (2 bits), checksum start (16), offset (16).
    pub fn to_bits(self) -> u64 {
        let (state, start, offset) = match self.csum {
            Csum::None => (0u64, 0u64, 0u64),
            Csum::Partial { start, offset } => (1, u64::from(start), u64::from(offset)),
            Csum::Valid => (2, 0, 0),
        };
        let (size, ty) = self
            .gso
            .map_or((0u64, 0u64), |g| (u64::from(g.size), u64::from(g.ty)));
        size | ty << 16 | state << 24 | start << 32 | offset << 48
    }

    /// Unpacks [`Offload::to_bits`]; `None` for a state no encoder writes.
    pub fn from_bits(b: u64) -> Option<Offload> {
        let f = |shift: u32| (b >> shift) as u16;
        let csum = match (b >> 24) & 0xff {
            0 => Csum::None,
            1 => Csum::Partial {
                start: f(32),
                offset: f(48),
            },
            2 => Csum::Valid,
            _ => return None,
        };
        let gso = (f(0) != 0).then(|| Gso {
            size: f(0),
            ty: (b >> 16) as u8,
        });
        Some(Offload { csum, gso })
    }
}

/// Why offload metadata or the headers it describes were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum OffloadError {
    /// Neither an IPv4 nor an IPv6 frame.
    #[error("not IPv4 or IPv6")]
    NotIp,
    /// Shorter than its headers, or than its IPv4 length says.
    #[error("headers truncated")]
    Truncated,
    /// A fragment (IPv4, or an IPv6 fragment header), a header length out of range, an
    /// IPv6 jumbogram or extension headers past what is looked at.
    #[error("bad IP header")]
    BadIpHeader,
    /// Neither TCP nor UDP: no checksum to offload.
    #[error("not TCP or UDP")]
    NotTcpUdp,
    /// A checksum start or offset that does not point at the L4 checksum field.
    #[error("checksum offsets do not match the headers")]
    BadCsumOffsets,
    /// A GSO segment size of zero.
    #[error("GSO size zero")]
    GsoSizeZero,
    /// A GSO type other than TCP over IPv4 or IPv6, or one that is not the packet's
    /// family.
    #[error("unsupported GSO type")]
    BadGsoType,
    /// GSO of something that is not TCP.
    #[error("GSO of a packet that is not TCP")]
    GsoNotTcp,
    /// Segments (headers plus segment size) longer than an MTU-sized frame.
    #[error("GSO segments longer than a frame")]
    GsoSegmentTooLong,
    /// Longer than the 64 KiB an offloaded packet may have.
    #[error("packet longer than 64 KiB")]
    TooLong,
}

impl OffloadError {
    /// Every reason, for counters.
    pub const ALL: [OffloadError; 10] = [
        OffloadError::NotIp,
        OffloadError::Truncated,
        OffloadError::BadIpHeader,
        OffloadError::NotTcpUdp,
        OffloadError::BadCsumOffsets,
        OffloadError::GsoSizeZero,
        OffloadError::BadGsoType,
        OffloadError::GsoNotTcp,
        OffloadError::GsoSegmentTooLong,
        OffloadError::TooLong,
    ];
}
hv::reason!(OffloadError);

/// The longest packet offload carries: 64 KiB, Linux's `GSO_MAX_SIZE` (the frame, its
/// Ethernet header included).
pub const MAX_OFFLOAD_LEN: usize = 65536;

/// Bytes of headers [`checksum_setup`] may need: Ethernet, IPv4 with options and TCP
/// with options, or IPv6 with the extension headers it walks and TCP.
pub const MAX_HEADERS: usize = ETH_HEADER + 60 + 60;

/// Bytes of IPv6 extension headers [`checksum_setup`] walks past: what fits in
/// [`MAX_HEADERS`] beside the fixed header and TCP's longest (`xenvif`'s own bound is
/// the same idea: headers beyond what it copied are not looked at).
const MAX_V6_EXTENSIONS: usize = MAX_HEADERS - ETH_HEADER - 40 - 60;

/// Where an IP frame's transport header and checksum lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L4 {
    /// Offset of the IP header (after Ethernet).
    pub l3: usize,
    /// IPv6 (its fixed header at `l3`), not IPv4.
    pub v6: bool,
    /// Offset of the TCP or UDP header.
    pub l4: usize,
    /// TCP or UDP.
    pub tcp: bool,
    /// The transport header's length (TCP with options, or UDP's 8).
    pub l4_len: usize,
    /// The checksum field's offset from `l4`.
    pub csum_offset: usize,
    /// The frame's length as the IP header gives it (Ethernet header included).
    pub frame_len: usize,
}

impl L4 {
    /// The offload state of a checksum left to be filled in.
    pub fn partial(&self) -> Csum {
        Csum::Partial {
            start: self.l4 as u16,
            offset: self.csum_offset as u16,
        }
    }
    /// Headers' length: Ethernet, IP (with IPv6's extension headers), transport.
    pub fn headers(&self) -> usize {
        self.l4 + self.l4_len
    }
    /// The GSO type of TCP in this family.
    pub fn gso_type(&self) -> u8 {
        if self.v6 {
            XEN_NETIF_GSO_TYPE_TCPV6
        } else {
            XEN_NETIF_GSO_TYPE_TCPV4
        }
    }
}

/// Finds the transport header of an untagged IPv4 or IPv6 TCP or UDP frame from its
/// first bytes (`head`, at least the headers; more is ignored) and its length: netback's
/// and netfront's `checksum_setup` (`skb_checksum_setup_ipv4` and `_ipv6`). Fragments
/// are refused, as they are there; IPv6's hop-by-hop, routing and destination options
/// headers are walked past.
pub fn checksum_setup(head: &[u8], len: usize) -> Result<L4, OffloadError> {
    if head.len() < ETH_HEADER + 20 || len < ETH_HEADER + 20 {
        return Err(OffloadError::Truncated);
    }
    match head[12..14] {
        [0x08, 0x00] => {}
        [0x86, 0xdd] => return setup_v6(head, len),
        _ => return Err(OffloadError::NotIp),
    }
    let ip = &head[ETH_HEADER..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ip[0] >> 4 != 4 || ihl < 20 {
        return Err(OffloadError::BadIpHeader);
    }
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if total < ihl || ETH_HEADER + total > len {
        return Err(OffloadError::Truncated);
    }
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    if frag & 0x3fff != 0 {
        return Err(OffloadError::BadIpHeader);
    }
    let l4 = ETH_HEADER + ihl;
    transport(head, ip[9], ETH_HEADER, false, l4, ETH_HEADER + total)
}

/// The transport header of protocol `proto` at `l4`, behind the IP header at `l3`, in a
/// frame the IP header says is `frame_len` long: TCP (its data offset read and checked)
/// or UDP; its header must lie inside both the frame and `head`.
fn transport(
    head: &[u8],
    proto: u8,
    l3: usize,
    v6: bool,
    l4: usize,
    frame_len: usize,
) -> Result<L4, OffloadError> {
    let (tcp, csum_offset) = match IpProtocol::from(proto) {
        IpProtocol::Tcp => (true, 16),
        IpProtocol::Udp => (false, 6),
        _ => return Err(OffloadError::NotTcpUdp),
    };
    let l4_len = if tcp {
        let doff = head
            .get(l4 + 12)
            .map(|b| usize::from(b >> 4) * 4)
            .ok_or(OffloadError::Truncated)?;
        if doff < 20 {
            return Err(OffloadError::BadIpHeader);
        }
        doff
    } else {
        8
    };
    if l4 + l4_len > frame_len || l4 + l4_len > head.len() {
        return Err(OffloadError::Truncated);
    }
    Ok(L4 {
        l3,
        v6,
        l4,
        tcp,
        l4_len,
        csum_offset,
        frame_len,
    })
}

/// [`checksum_setup`] for IPv6: the fixed header, then extension headers while they are
/// hop-by-hop options (0), routing (43) or destination options (60), up to
/// [`MAX_V6_EXTENSIONS`] bytes of them; a fragment header (44) is refused, a jumbogram
/// (payload length 0) too.
fn setup_v6(head: &[u8], len: usize) -> Result<L4, OffloadError> {
    let l3 = ETH_HEADER;
    if head.len() < l3 + 40 || len < l3 + 40 {
        return Err(OffloadError::Truncated);
    }
    let ip = &head[l3..];
    if ip[0] >> 4 != 6 {
        return Err(OffloadError::BadIpHeader);
    }
    let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    if payload == 0 {
        return Err(OffloadError::BadIpHeader);
    }
    let frame_len = l3 + 40 + payload;
    if frame_len > len {
        return Err(OffloadError::Truncated);
    }
    let (mut next, mut at) = (ip[6], l3 + 40);
    loop {
        match next {
            0 | 43 | 60 => {
                let h = head.get(at..at + 2).ok_or(OffloadError::Truncated)?;
                next = h[0];
                at += (usize::from(h[1]) + 1) * 8;
                if at - (l3 + 40) > MAX_V6_EXTENSIONS {
                    return Err(OffloadError::BadIpHeader);
                }
            }
            44 => return Err(OffloadError::BadIpHeader),
            _ => break,
        }
    }
    transport(head, next, l3, true, at, frame_len)
}

/// Checks a packet's offload metadata against its headers (`head`: its first bytes,
/// `len`: its length): a partial checksum must point at the transport checksum, and a
/// GSO packet must be TCP, its GSO type its IP family's, with a segment size that keeps
/// its segments within an MTU-sized frame. Returns where the transport header lies, if there is metadata.
pub fn validate(off: &Offload, head: &[u8], len: usize) -> Result<Option<L4>, OffloadError> {
    if len > MAX_OFFLOAD_LEN {
        return Err(OffloadError::TooLong);
    }
    if !matches!(off.csum, Csum::Partial { .. }) && off.gso.is_none() {
        return Ok(None);
    }
    let l4 = checksum_setup(head, len)?;
    if let Csum::Partial { start, offset } = off.csum {
        if usize::from(start) != l4.l4 || usize::from(offset) != l4.csum_offset {
            return Err(OffloadError::BadCsumOffsets);
        }
    }
    if let Some(g) = off.gso {
        check_gso(g, &l4)?;
    }
    Ok(Some(l4))
}

/// Checks GSO parameters against the headers they apply to.
pub fn check_gso(g: Gso, l4: &L4) -> Result<(), OffloadError> {
    if g.size == 0 {
        return Err(OffloadError::GsoSizeZero);
    }
    if !matches!(g.ty, XEN_NETIF_GSO_TYPE_TCPV4 | XEN_NETIF_GSO_TYPE_TCPV6) || g.ty != l4.gso_type()
    {
        return Err(OffloadError::BadGsoType);
    }
    if !l4.tcp {
        return Err(OffloadError::GsoNotTcp);
    }
    if l4.headers() + usize::from(g.size) > MAX_FRAME {
        return Err(OffloadError::GsoSegmentTooLong);
    }
    Ok(())
}

/// Reads a packet buffer's headers into `head` and finds its transport header there
/// ([`checksum_setup`]), checking `gso` against it and the packet's length against
/// [`MAX_OFFLOAD_LEN`]: what netback and netfront do for a packet that arrived with a
/// blank checksum or GSO, whose checksum's place the ring does not carry.
pub fn locate(
    pool: &crate::skb::SkbPool,
    skb: crate::skb::SkbId,
    gso: Option<Gso>,
    head: &mut [u8; MAX_HEADERS],
) -> Result<L4, OffloadError> {
    let len = pool.len(skb);
    if len > MAX_OFFLOAD_LEN {
        return Err(OffloadError::TooLong);
    }
    let h = len.min(MAX_HEADERS);
    pool.read(skb, 0, &mut head[..h])
        .map_err(|_| OffloadError::Truncated)?;
    let l4 = checksum_setup(&head[..h], len)?;
    if let Some(g) = gso {
        check_gso(g, &l4)?;
    }
    Ok(l4)
}

/// The pseudo-header sum a partial checksum's field holds (not complemented), for the
/// IP header at `frame[l3..]` and the transport bytes to the frame's end: IPv4's
/// (addresses, protocol, length) or IPv6's (RFC 8200 §8.1: addresses, a 32-bit length,
/// the next header).
pub fn pseudo_sum(frame: &[u8], l4: &L4) -> u16 {
    let ip = &frame[l4.l3..];
    let proto = if l4.tcp {
        IpProtocol::Tcp
    } else {
        IpProtocol::Udp
    };
    if l4.v6 {
        let mut p = [0u8; 40];
        p[..32].copy_from_slice(&ip[8..40]);
        p[32..36].copy_from_slice(&((l4.frame_len - l4.l4) as u32).to_be_bytes());
        p[39] = u8::from(proto);
        return checksum::data(&p);
    }
    let src = Ipv4Address::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Address::new(ip[16], ip[17], ip[18], ip[19]);
    checksum::pseudo_header_v4(&src, &dst, proto, (l4.frame_len - l4.l4) as u32)
}

/// Writes the pseudo-header sum into the checksum field (netback's fix-up of a GSO
/// packet sent without `NETTXF_csum_blank`): the packet becomes a proper partial one.
pub fn set_pseudo(frame: &mut [u8], l4: &L4) {
    let s = pseudo_sum(frame, l4);
    let at = l4.l4 + l4.csum_offset;
    frame[at..at + 2].copy_from_slice(&s.to_be_bytes());
}

/// Fills in a partial checksum in place (what a NIC's checksum offload, or Linux's
/// `skb_checksum_help`, does): the sum of everything from `start`, the field's
/// pseudo-header sum included, complemented into the field.
pub fn fill_partial(frame: &mut [u8], start: usize, offset: usize) -> Result<(), OffloadError> {
    let at = start + offset;
    if at + 2 > frame.len() {
        return Err(OffloadError::BadCsumOffsets);
    }
    let sum = !checksum::data(&frame[start..]);
    // UDP sends a computed zero as all ones (zero means "no checksum").
    let sum = if sum == 0 && offset == 6 { 0xffff } else { sum };
    frame[at..at + 2].copy_from_slice(&sum.to_be_bytes());
    Ok(())
}

/// Whether a complete frame's transport checksum is right.
pub fn verify(frame: &[u8], l4: &L4) -> bool {
    let end = l4.frame_len.min(frame.len());
    let at = l4.l4 + l4.csum_offset;
    if !l4.tcp && frame.get(at..at + 2) == Some(&[0, 0]) {
        return true;
    }
    checksum::combine(&[pseudo_sum(frame, l4), checksum::data(&frame[l4.l4..end])]) == 0xffff
}

/// Cuts a TCP GSO frame (over IPv4 or IPv6) into frames of at most `mss` payload bytes
/// each, with complete checksums (Linux's `tcp_gso_segment` with software checksums, or
/// a NIC's TSO engine): each segment gets the headers, its IP length (IPv4's total
/// length, identification one more per segment and header checksum; IPv6's payload
/// length), its sequence number, and the flags only the last (FIN, PSH) or only the
/// first (CWR) segment keeps. Each frame is built in `out` (at least `headers + mss`
/// bytes) and handed to `emit`. Returns the segments.
pub fn segment_tcp(
    frame: &[u8],
    l4: &L4,
    mss: usize,
    out: &mut [u8],
    mut emit: impl FnMut(&[u8]),
) -> Result<usize, OffloadError> {
    if mss == 0 {
        return Err(OffloadError::GsoSizeZero);
    }
    if !l4.tcp {
        return Err(OffloadError::GsoNotTcp);
    }
    let hl = l4.headers();
    let end = l4.frame_len;
    if end > frame.len() || hl > end {
        return Err(OffloadError::Truncated);
    }
    if hl + mss > out.len() {
        return Err(OffloadError::GsoSegmentTooLong);
    }
    let payload = &frame[hl..end];
    let ip_id = u16::from_be_bytes([frame[l4.l3 + 4], frame[l4.l3 + 5]]);
    let seq = u32::from_be_bytes([
        frame[l4.l4 + 4],
        frame[l4.l4 + 5],
        frame[l4.l4 + 6],
        frame[l4.l4 + 7],
    ]);
    let flags = frame[l4.l4 + 13];
    let segs = payload.len().div_ceil(mss).max(1);
    for (i, chunk) in payload
        .chunks(mss)
        .chain(payload.is_empty().then_some(&[][..]))
        .enumerate()
    {
        let n = hl + chunk.len();
        let f = &mut out[..n];
        f[..hl].copy_from_slice(&frame[..hl]);
        f[hl..].copy_from_slice(chunk);
        let ip = l4.l3;
        if l4.v6 {
            f[ip + 4..ip + 6].copy_from_slice(&((n - ip - 40) as u16).to_be_bytes());
        } else {
            f[ip + 2..ip + 4].copy_from_slice(&((n - ip) as u16).to_be_bytes());
            f[ip + 4..ip + 6].copy_from_slice(&ip_id.wrapping_add(i as u16).to_be_bytes());
            f[ip + 10..ip + 12].copy_from_slice(&[0, 0]);
            let ip_sum = !checksum::data(&f[ip..l4.l4]);
            f[ip + 10..ip + 12].copy_from_slice(&ip_sum.to_be_bytes());
        }
        let t = l4.l4;
        let s = seq.wrapping_add((i * mss) as u32);
        f[t + 4..t + 8].copy_from_slice(&s.to_be_bytes());
        let last = i + 1 == segs;
        let mut fl = flags;
        if !last {
            fl &= !(0x01 | 0x08); // FIN, PSH
        }
        if i > 0 {
            fl &= !0x80; // CWR
        }
        f[t + 13] = fl;
        let seg = L4 {
            frame_len: n,
            ..*l4
        };
        set_pseudo(f, &seg);
        fill_partial(f, t, seg.csum_offset)?;
        emit(f);
    }
    Ok(segs)
}

/// Bytes of the virtio-net header an `IFF_VNET_HDR` TAP puts before each frame
/// (`struct virtio_net_hdr`, without the mergeable-buffers count).
pub const VNET_HDR_LEN: usize = 10;
/// `VIRTIO_NET_HDR_F_NEEDS_CSUM`.
pub const VNET_F_NEEDS_CSUM: u8 = 1;
/// `VIRTIO_NET_HDR_F_DATA_VALID`.
pub const VNET_F_DATA_VALID: u8 = 2;
/// `VIRTIO_NET_HDR_GSO_NONE`.
pub const VNET_GSO_NONE: u8 = 0;
/// `VIRTIO_NET_HDR_GSO_TCPV4`.
pub const VNET_GSO_TCPV4: u8 = 1;
/// `VIRTIO_NET_HDR_GSO_TCPV6`.
pub const VNET_GSO_TCPV6: u8 = 4;
/// `VIRTIO_NET_HDR_GSO_ECN`, or-ed into the type.
pub const VNET_GSO_ECN: u8 = 0x80;

/// The virtio-net header, in the byte order a TAP uses by default (the host's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VnetHdr {
    /// `VNET_F_*`.
    pub flags: u8,
    /// `VNET_GSO_*`.
    pub gso_type: u8,
    /// Headers' length of a GSO frame.
    pub hdr_len: u16,
    /// Segment size.
    pub gso_size: u16,
    /// Where the checksummed bytes start.
    pub csum_start: u16,
    /// The checksum field's offset from `csum_start`.
    pub csum_offset: u16,
}

impl VnetHdr {
    /// Reads a header.
    pub fn parse(b: &[u8; VNET_HDR_LEN]) -> Self {
        let u = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
        Self {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u(2),
            gso_size: u(4),
            csum_start: u(6),
            csum_offset: u(8),
        }
    }

    /// Writes the header.
    pub fn write(&self, b: &mut [u8; VNET_HDR_LEN]) {
        b[0] = self.flags;
        b[1] = self.gso_type;
        for (i, v) in [
            (2, self.hdr_len),
            (4, self.gso_size),
            (6, self.csum_start),
            (8, self.csum_offset),
        ] {
            b[i..i + 2].copy_from_slice(&v.to_ne_bytes());
        }
    }

    /// The header for a frame with this metadata (`l4`: its headers, needed for GSO).
    pub fn from_offload(off: &Offload, l4: Option<&L4>) -> Self {
        let mut h = VnetHdr::default();
        match off.csum {
            Csum::Partial { start, offset } => {
                h.flags = VNET_F_NEEDS_CSUM;
                h.csum_start = start;
                h.csum_offset = offset;
            }
            Csum::Valid => h.flags = VNET_F_DATA_VALID,
            Csum::None => {}
        }
        if let (Some(g), Some(l4)) = (off.gso, l4) {
            h.gso_type = if l4.v6 {
                VNET_GSO_TCPV6
            } else {
                VNET_GSO_TCPV4
            };
            h.gso_size = g.size;
            h.hdr_len = l4.headers() as u16;
        }
        h
    }

    /// The metadata this header gives a frame, checked against the frame's first bytes
    /// (`head`) and length. ECN is accepted with TCP (the CWR rule of [`segment_tcp`]
    /// is what it asks of a segmenter); every GSO type but TCP's is refused.
    pub fn to_offload(&self, head: &[u8], len: usize) -> Result<Offload, OffloadError> {
        let csum = if self.flags & VNET_F_NEEDS_CSUM != 0 {
            Csum::Partial {
                start: self.csum_start,
                offset: self.csum_offset,
            }
        } else if self.flags & VNET_F_DATA_VALID != 0 {
            Csum::Valid
        } else {
            Csum::None
        };
        let gso = match self.gso_type & !VNET_GSO_ECN {
            VNET_GSO_NONE => None,
            VNET_GSO_TCPV4 => Some(Gso {
                size: self.gso_size,
                ty: XEN_NETIF_GSO_TYPE_TCPV4,
            }),
            VNET_GSO_TCPV6 => Some(Gso {
                size: self.gso_size,
                ty: XEN_NETIF_GSO_TYPE_TCPV6,
            }),
            _ => return Err(OffloadError::BadGsoType),
        };
        let off = Offload { csum, gso };
        validate(&off, head, len)?;
        Ok(off)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hv::counters::check_reason_order;

    /// A TCP/IPv4 frame of `payload` bytes (pattern `i % 251`), checksums complete.
    fn tcp_frame(payload: usize, flags: u8) -> Vec<u8> {
        let mut f = vec![0u8; ETH_HEADER + 20 + 20 + payload];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        let ip = ETH_HEADER;
        f[ip] = 0x45;
        let total = (20 + 20 + payload) as u16;
        f[ip + 2..ip + 4].copy_from_slice(&total.to_be_bytes());
        f[ip + 4..ip + 6].copy_from_slice(&0x1234u16.to_be_bytes());
        f[ip + 6] = 0x40; // DF
        f[ip + 8] = 64;
        f[ip + 9] = 6;
        f[ip + 12..ip + 16].copy_from_slice(&[10, 0, 0, 1]);
        f[ip + 16..ip + 20].copy_from_slice(&[10, 0, 0, 2]);
        let s = !checksum::data(&f[ip..ip + 20]);
        f[ip + 10..ip + 12].copy_from_slice(&s.to_be_bytes());
        let t = ip + 20;
        f[t..t + 2].copy_from_slice(&5001u16.to_be_bytes());
        f[t + 2..t + 4].copy_from_slice(&40000u16.to_be_bytes());
        f[t + 4..t + 8].copy_from_slice(&0xffff_ff00u32.to_be_bytes());
        f[t + 12] = 5 << 4;
        f[t + 13] = flags;
        for (i, b) in f[t + 20..].iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let l4 = checksum_setup(&f, f.len()).expect("setup");
        set_pseudo(&mut f, &l4);
        fill_partial(&mut f, l4.l4, 16).expect("fill");
        f
    }

    #[test]
    fn reasons_are_in_counter_order() {
        check_reason_order::<OffloadError>();
    }

    #[test]
    fn bits_round_trip() {
        for off in [
            Offload::NONE,
            Offload {
                csum: Csum::Partial {
                    start: 34,
                    offset: 16,
                },
                gso: Some(Gso {
                    size: 1448,
                    ty: XEN_NETIF_GSO_TYPE_TCPV4,
                }),
            },
            Offload {
                csum: Csum::Valid,
                gso: None,
            },
        ] {
            assert_eq!(Offload::from_bits(off.to_bits()), Some(off));
        }
        assert_eq!(Offload::from_bits(3 << 24), None);
    }

    #[test]
    fn a_partial_checksum_filled_in_verifies_and_matches_a_full_one() {
        let full = tcp_frame(3000, 0x18);
        let l4 = checksum_setup(&full, full.len()).expect("setup");
        assert!(verify(&full, &l4));
        let mut partial = full.clone();
        set_pseudo(&mut partial, &l4);
        assert!(!verify(&partial, &l4));
        fill_partial(&mut partial, l4.l4, l4.csum_offset).expect("fill");
        assert_eq!(partial, full);
    }

    #[test]
    fn segments_carry_every_byte_in_order_with_right_headers_and_checksums() {
        // ACK|PSH|FIN|CWR on the large segment.
        let big = tcp_frame(10_000, 0x10 | 0x08 | 0x01 | 0x80);
        let l4 = checksum_setup(&big, big.len()).expect("setup");
        let mut out = [0u8; 2048];
        let mut got = Vec::new();
        let mut segs = Vec::new();
        let n = segment_tcp(&big, &l4, 1448, &mut out, |f| {
            segs.push(f.to_vec());
        })
        .expect("segment");
        assert_eq!(n, 10_000usize.div_ceil(1448));
        assert_eq!(segs.len(), n);
        for (i, s) in segs.iter().enumerate() {
            let sl = checksum_setup(s, s.len()).expect("segment parses");
            assert_eq!(sl.frame_len, s.len());
            assert!(verify(s, &sl), "segment {i} checksum");
            assert!(s.len() <= MAX_FRAME);
            let ip = &s[ETH_HEADER..ETH_HEADER + 20];
            assert_eq!(!checksum::data(ip), 0, "IPv4 header checksum");
            assert_eq!(u16::from_be_bytes([ip[4], ip[5]]), 0x1234 + i as u16);
            let t = &s[sl.l4..];
            let seq = u32::from_be_bytes([t[4], t[5], t[6], t[7]]);
            assert_eq!(seq, 0xffff_ff00u32.wrapping_add((i * 1448) as u32));
            let last = i + 1 == n;
            assert_eq!(t[13] & 0x09 != 0, last, "FIN/PSH only on the last");
            assert_eq!(t[13] & 0x80 != 0, i == 0, "CWR only on the first");
            got.extend_from_slice(&s[sl.headers()..]);
        }
        assert_eq!(got, big[l4.headers()..]);
    }

    #[test]
    fn hostile_metadata_is_refused_with_its_reason() {
        let f = tcp_frame(4000, 0x10);
        let l4 = checksum_setup(&f, f.len()).expect("setup");
        let partial = |start, offset| Offload {
            csum: Csum::Partial { start, offset },
            gso: None,
        };
        let gso = |size, ty| Offload {
            csum: l4.partial(),
            gso: Some(Gso { size, ty }),
        };
        let v = |o: Offload| validate(&o, &f, f.len());
        assert_eq!(v(partial(34, 16)).map(|l| l.is_some()), Ok(true));
        assert_eq!(v(partial(34, 6)), Err(OffloadError::BadCsumOffsets));
        assert_eq!(v(partial(60000, 16)), Err(OffloadError::BadCsumOffsets));
        assert_eq!(v(gso(0, 1)), Err(OffloadError::GsoSizeZero));
        assert_eq!(v(gso(1448, 2)), Err(OffloadError::BadGsoType));
        assert_eq!(v(gso(1461, 1)), Err(OffloadError::GsoSegmentTooLong));
        assert_eq!(v(gso(1460, 1)).map(|l| l.is_some()), Ok(true));
        assert_eq!(
            validate(&gso(1448, 1), &f, MAX_OFFLOAD_LEN + 1),
            Err(OffloadError::TooLong)
        );
        // UDP cannot be segmented as TCP; ICMP has no offloaded checksum.
        let mut udp = f.clone();
        udp[ETH_HEADER + 9] = 17;
        assert_eq!(
            validate(&gso(1448, 1), &udp, udp.len()),
            Err(OffloadError::BadCsumOffsets)
        );
        let g = Offload {
            csum: Csum::Partial {
                start: 34,
                offset: 6,
            },
            gso: Some(Gso { size: 1448, ty: 1 }),
        };
        assert_eq!(validate(&g, &udp, udp.len()), Err(OffloadError::GsoNotTcp));
        let mut icmp = f.clone();
        icmp[ETH_HEADER + 9] = 1;
        assert_eq!(
            validate(&partial(34, 16), &icmp, icmp.len()),
            Err(OffloadError::NotTcpUdp)
        );
        // A fragment, a short frame, a length past the frame, IPv6.
        let mut frag = f.clone();
        frag[ETH_HEADER + 6] = 0x20;
        assert_eq!(
            validate(&partial(34, 16), &frag, frag.len()),
            Err(OffloadError::BadIpHeader)
        );
        assert_eq!(
            validate(&partial(34, 16), &f[..40], 40),
            Err(OffloadError::Truncated)
        );
        assert_eq!(
            validate(&partial(34, 16), &f, f.len() - 1),
            Err(OffloadError::Truncated)
        );
        // An IPv4 header behind IPv6's type; ARP.
        let mut v6 = f.clone();
        v6[12..14].copy_from_slice(&[0x86, 0xdd]);
        assert_eq!(
            validate(&partial(34, 16), &v6, v6.len()),
            Err(OffloadError::BadIpHeader)
        );
        let mut arp = f.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(
            validate(&partial(34, 16), &arp, arp.len()),
            Err(OffloadError::NotIp)
        );
        // Nothing to check without metadata.
        assert_eq!(validate(&Offload::NONE, &[], 0), Ok(None));
    }

    /// A TCP/IPv6 frame of `payload` bytes (pattern `i % 251`) behind `ext` bytes of
    /// hop-by-hop options (0 or a multiple of 8), checksum complete, computed here from
    /// RFC 8200's pseudo-header without this module's code.
    fn tcp6_frame(payload: usize, ext: usize, flags: u8) -> Vec<u8> {
        let mut f = vec![0u8; ETH_HEADER + 40 + ext + 20 + payload];
        f[12..14].copy_from_slice(&[0x86, 0xdd]);
        let ip = ETH_HEADER;
        f[ip] = 0x60;
        f[ip + 4..ip + 6].copy_from_slice(&((ext + 20 + payload) as u16).to_be_bytes());
        f[ip + 6] = if ext > 0 { 0 } else { 6 };
        f[ip + 7] = 64;
        f[ip + 8..ip + 24].copy_from_slice(&[0xfd, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        f[ip + 24..ip + 40]
            .copy_from_slice(&[0xfd, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        if ext > 0 {
            f[ip + 40] = 6;
            f[ip + 41] = (ext / 8 - 1) as u8;
        }
        let t = ip + 40 + ext;
        f[t..t + 2].copy_from_slice(&5001u16.to_be_bytes());
        f[t + 2..t + 4].copy_from_slice(&40000u16.to_be_bytes());
        f[t + 4..t + 8].copy_from_slice(&0x0102_0304u32.to_be_bytes());
        f[t + 12] = 5 << 4;
        f[t + 13] = flags;
        for (i, b) in f[t + 20..].iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let mut sum: u32 = 0;
        let mut add = |b: &[u8]| {
            for c in b.chunks(2) {
                sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
            }
        };
        add(&f[ip + 8..ip + 40]);
        add(&((20 + payload) as u32).to_be_bytes());
        add(&[0, 0, 0, 6]);
        add(&f[t..]);
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        f[t + 16..t + 18].copy_from_slice(&(!(sum as u16)).to_be_bytes());
        f
    }

    #[test]
    fn an_ipv6_frame_is_located_past_its_options_and_its_checksum_filled_as_its_senders() {
        for ext in [0, 8, 16] {
            let full = tcp6_frame(3000, ext, 0x18);
            let l4 = checksum_setup(&full, full.len()).expect("setup");
            assert!(l4.v6 && l4.tcp);
            assert_eq!((l4.l4, l4.csum_offset), (ETH_HEADER + 40 + ext, 16));
            assert_eq!(l4.frame_len, full.len());
            assert!(verify(&full, &l4), "the sender's checksum verifies");
            let mut partial = full.clone();
            set_pseudo(&mut partial, &l4);
            fill_partial(&mut partial, l4.l4, l4.csum_offset).expect("fill");
            assert_eq!(partial, full, "filled in as the sender computed it");
            let off = Offload {
                csum: l4.partial(),
                gso: Some(Gso {
                    size: 1400,
                    ty: XEN_NETIF_GSO_TYPE_TCPV6,
                }),
            };
            assert_eq!(validate(&off, &full, full.len()), Ok(Some(l4)));
            // The other family's GSO type is refused.
            let v4 = Offload {
                gso: Some(Gso {
                    size: 1400,
                    ty: XEN_NETIF_GSO_TYPE_TCPV4,
                }),
                ..off
            };
            assert_eq!(
                validate(&v4, &full, full.len()),
                Err(OffloadError::BadGsoType)
            );
        }
        // A fragment header, a jumbogram, a length past the frame, options past the bound.
        let mut frag = tcp6_frame(100, 8, 0x18);
        frag[ETH_HEADER + 6] = 44;
        let mut jumbo = tcp6_frame(100, 0, 0x18);
        jumbo[ETH_HEADER + 4..ETH_HEADER + 6].copy_from_slice(&[0, 0]);
        let mut long = tcp6_frame(100, 0, 0x18);
        long[ETH_HEADER + 4..ETH_HEADER + 6].copy_from_slice(&[0x10, 0]);
        let mut deep = tcp6_frame(100, 8, 0x18);
        deep[ETH_HEADER + 41] = 255;
        for (f, e) in [
            (frag, OffloadError::BadIpHeader),
            (jumbo, OffloadError::BadIpHeader),
            (long, OffloadError::Truncated),
            (deep, OffloadError::BadIpHeader),
        ] {
            let l = f.len();
            assert_eq!(checksum_setup(&f[..l.min(MAX_HEADERS)], l), Err(e));
        }
    }

    #[test]
    fn an_ipv6_segment_is_cut_into_frames_with_their_lengths_and_checksums() {
        let big = tcp6_frame(10_000, 8, 0x10 | 0x08 | 0x01);
        let l4 = checksum_setup(&big, big.len()).expect("setup");
        let mut out = [0u8; 2048];
        let mut segs = Vec::new();
        let n = segment_tcp(&big, &l4, 1428, &mut out, |f| segs.push(f.to_vec())).expect("cut");
        assert_eq!(n, 10_000usize.div_ceil(1428));
        let mut payload = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            let sl4 = checksum_setup(s, s.len()).expect("a frame");
            assert!(sl4.v6 && verify(s, &sl4), "segment {i} verifies");
            let plen = u16::from_be_bytes([s[ETH_HEADER + 4], s[ETH_HEADER + 5]]) as usize;
            assert_eq!(plen, s.len() - ETH_HEADER - 40);
            let last = i + 1 == segs.len();
            assert_eq!(
                s[sl4.l4 + 13] & 0x09 != 0,
                last,
                "FIN and PSH on the last only"
            );
            payload.extend_from_slice(&s[sl4.headers()..]);
        }
        assert_eq!(payload, &big[l4.headers()..], "every byte, in order");
        // The virtio-net header says TCPv6 and comes back as it went.
        let off = Offload {
            csum: l4.partial(),
            gso: Some(Gso {
                size: 1428,
                ty: XEN_NETIF_GSO_TYPE_TCPV6,
            }),
        };
        let h = VnetHdr::from_offload(&off, Some(&l4));
        assert_eq!(
            (h.gso_type, h.hdr_len),
            (VNET_GSO_TCPV6, l4.headers() as u16)
        );
        assert_eq!(h.to_offload(&big, big.len()), Ok(off));
    }

    #[test]
    fn a_vnet_header_round_trips_and_bad_types_are_refused() {
        let f = tcp_frame(4000, 0x10);
        let l4 = checksum_setup(&f, f.len()).expect("setup");
        let off = Offload {
            csum: l4.partial(),
            gso: Some(Gso { size: 1448, ty: 1 }),
        };
        let h = VnetHdr::from_offload(&off, Some(&l4));
        assert_eq!(h.hdr_len, 54);
        let mut b = [0u8; VNET_HDR_LEN];
        h.write(&mut b);
        let back = VnetHdr::parse(&b);
        assert_eq!(back, h);
        assert_eq!(back.to_offload(&f, f.len()), Ok(off));
        let udp = VnetHdr { gso_type: 3, ..h };
        assert_eq!(udp.to_offload(&f, f.len()), Err(OffloadError::BadGsoType));
        let ecn = VnetHdr {
            gso_type: VNET_GSO_TCPV4 | VNET_GSO_ECN,
            ..h
        };
        assert_eq!(ecn.to_offload(&f, f.len()), Ok(off));
    }
}
