//! The netif protocol (`io/netif.h`): entry layouts, flags, statuses, and validation.
//!
//! Names are netif.h's, TX and RX from the front end's point of view: TX carries packets
//! from the guest to the back end, RX from the back end into buffers the guest posted.

use hv::counters::PerReason;
use ring::RingProtocol;

// --- Layouts ----------------------------------------------------------------------

/// `struct netif_tx_request`: one slot of a packet the front end transmits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct TxRequest {
    /// Grant of the page holding this slot's bytes.
    pub gref: u32,
    /// Offset of the bytes in the page.
    pub offset: u16,
    /// `NETTXF_*`.
    pub flags: u16,
    /// Echoed in the response.
    pub id: u16,
    /// First slot: the whole packet's size; later slots: this slot's bytes.
    pub size: u16,
}

/// `struct netif_tx_response`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct TxResponse {
    /// The request's id.
    pub id: u16,
    /// `XEN_NETIF_RSP_*`.
    pub status: i16,
}

/// `struct netif_rx_request`: a buffer the front end posts for received packets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct RxRequest {
    /// Echoed in the response.
    pub id: u16,
    /// Padding (the C struct's implicit hole before `gref`).
    pub pad: u16,
    /// Grant of the buffer page (writable).
    pub gref: u32,
}

/// `struct netif_rx_response`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct RxResponse {
    /// The request's id.
    pub id: u16,
    /// Where the data starts in the buffer.
    pub offset: u16,
    /// `NETRXF_*`.
    pub flags: u16,
    /// Bytes received (≥ 0) or `XEN_NETIF_RSP_*` (< 0).
    pub status: i16,
}

/// `struct netif_extra_info`: an extra slot following a request with
/// `NETTXF_extra_info` (or a response with `NETRXF_extra_info`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct ExtraInfo {
    /// `XEN_NETIF_EXTRA_TYPE_*`.
    pub ty: u8,
    /// `XEN_NETIF_EXTRA_FLAG_*`.
    pub flags: u8,
    /// The union: for GSO, `size`, then `type` and `pad` (one byte each), then
    /// `features`; for multicast, a MAC address.
    pub data: [u16; 3],
}

const _: () = assert!(std::mem::size_of::<TxRequest>() == 12);
const _: () = assert!(std::mem::size_of::<TxResponse>() == 4);
const _: () = assert!(std::mem::size_of::<RxRequest>() == 8);
const _: () = assert!(std::mem::size_of::<RxResponse>() == 8);
const _: () = assert!(std::mem::size_of::<ExtraInfo>() == 8);

impl ExtraInfo {
    /// An extra slot arrives in a TX request slot: its first 8 bytes.
    pub fn from_tx_slot(r: &TxRequest) -> Self {
        let bytes = bytemuck::bytes_of(r);
        bytemuck::pod_read_unaligned(&bytes[..std::mem::size_of::<ExtraInfo>()])
    }
    /// The slot an extra is written into on the TX ring.
    pub fn to_tx_slot(&self) -> TxRequest {
        let mut r = TxRequest::default();
        bytemuck::bytes_of_mut(&mut r)[..8].copy_from_slice(bytemuck::bytes_of(self));
        r
    }
    /// An extra slot arrives in an RX response slot (the same 8 bytes).
    pub fn from_rx_slot(r: &RxResponse) -> Self {
        bytemuck::cast(*r)
    }
    /// The slot an extra is written into on the RX ring.
    pub fn to_rx_slot(&self) -> RxResponse {
        bytemuck::cast(*self)
    }
    /// `u.gso.size`.
    pub fn gso_size(&self) -> u16 {
        self.data[0]
    }
    /// `u.gso.type`.
    pub fn gso_type(&self) -> u8 {
        self.data[1].to_le_bytes()[0]
    }
    /// A GSO extra.
    pub fn gso(size: u16, ty: u8, more: bool) -> Self {
        Self {
            ty: XEN_NETIF_EXTRA_TYPE_GSO,
            flags: if more { XEN_NETIF_EXTRA_FLAG_MORE } else { 0 },
            data: [size, ty as u16, 0],
        }
    }
}

/// The TX ring: requests from the front end, responses from the back end.
#[derive(Debug)]
pub struct TxRing;
impl RingProtocol for TxRing {
    type Req = TxRequest;
    type Rsp = TxResponse;
}

/// The RX ring.
#[derive(Debug)]
pub struct RxRing;
impl RingProtocol for RxRing {
    type Req = RxRequest;
    type Rsp = RxResponse;
}

/// `struct xen_netif_ctrl_request`: a message on the control ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct CtrlRequest {
    /// Echoed in the response.
    pub id: u16,
    /// `XEN_NETIF_CTRL_TYPE_*`.
    pub ty: u16,
    /// Arguments, by type.
    pub data: [u32; 3],
}

/// `struct xen_netif_ctrl_response`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct CtrlResponse {
    /// The request's id.
    pub id: u16,
    /// The request's type.
    pub ty: u16,
    /// `XEN_NETIF_CTRL_STATUS_*`.
    pub status: u32,
    /// The answer, by type.
    pub data: u32,
}

/// `struct xen_netif_gref`: one entry of the list an `ADD`/`DEL_GREF_MAPPING` message
/// names, in a page the front end grants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct NetifGref {
    /// The grant reference.
    pub gref: u32,
    /// `XEN_NETIF_CTRLF_GREF_*`.
    pub flags: u16,
    /// `XEN_NETIF_CTRL_STATUS_*`, written by the back end (`DEL` only).
    pub status: u16,
}

const _: () = assert!(std::mem::size_of::<CtrlRequest>() == 16);
const _: () = assert!(std::mem::size_of::<CtrlResponse>() == 12);
const _: () = assert!(std::mem::size_of::<NetifGref>() == 8);

/// The control ring.
#[derive(Debug)]
pub struct CtrlRing;
impl RingProtocol for CtrlRing {
    type Req = CtrlRequest;
    type Rsp = CtrlResponse;
}

/// `XEN_NETIF_CTRL_TYPE_GET_GREF_MAPPING_SIZE`: how many grants the back end keeps
/// mapped.
pub const XEN_NETIF_CTRL_TYPE_GET_GREF_MAPPING_SIZE: u16 = 8;
/// `XEN_NETIF_CTRL_TYPE_ADD_GREF_MAPPING`: map a list of grants ahead of use.
pub const XEN_NETIF_CTRL_TYPE_ADD_GREF_MAPPING: u16 = 9;
/// `XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING`: unmap a list of grants.
pub const XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING: u16 = 10;
/// `XEN_NETIF_CTRL_STATUS_SUCCESS`.
pub const XEN_NETIF_CTRL_STATUS_SUCCESS: u32 = 0;
/// `XEN_NETIF_CTRL_STATUS_NOT_SUPPORTED`.
pub const XEN_NETIF_CTRL_STATUS_NOT_SUPPORTED: u32 = 1;
/// `XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER`.
pub const XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER: u32 = 2;
/// `XEN_NETIF_CTRL_STATUS_BUFFER_OVERFLOW`.
pub const XEN_NETIF_CTRL_STATUS_BUFFER_OVERFLOW: u32 = 3;
/// `XEN_NETIF_CTRLF_GREF_readonly`: the grant is read-only.
pub const XEN_NETIF_CTRLF_GREF_READONLY: u16 = 1 << 0;
/// Entries of a gref list: one page of them.
pub const GREF_LIST_MAX: usize = PAGE_SIZE / std::mem::size_of::<NetifGref>();

// --- Flags and statuses -------------------------------------------------------------

/// Checksum field blank (offload).
pub const NETTXF_CSUM_BLANK: u16 = 1 << 0;
/// Data validated against its checksum.
pub const NETTXF_DATA_VALIDATED: u16 = 1 << 1;
/// The packet continues in the next slot.
pub const NETTXF_MORE_DATA: u16 = 1 << 2;
/// Extra-info slots follow this one.
pub const NETTXF_EXTRA_INFO: u16 = 1 << 3;

/// Data validated.
pub const NETRXF_DATA_VALIDATED: u16 = 1 << 0;
/// Checksum blank.
pub const NETRXF_CSUM_BLANK: u16 = 1 << 1;
/// The packet continues in the next response.
pub const NETRXF_MORE_DATA: u16 = 1 << 2;
/// Extra-info responses follow.
pub const NETRXF_EXTRA_INFO: u16 = 1 << 3;
/// GSO prefix (legacy).
pub const NETRXF_GSO_PREFIX: u16 = 1 << 4;

/// Never used: invalid.
pub const XEN_NETIF_EXTRA_TYPE_NONE: u8 = 0;
/// `u.gso`.
pub const XEN_NETIF_EXTRA_TYPE_GSO: u8 = 1;
/// Multicast address to add.
pub const XEN_NETIF_EXTRA_TYPE_MCAST_ADD: u8 = 2;
/// Multicast address to remove.
pub const XEN_NETIF_EXTRA_TYPE_MCAST_DEL: u8 = 3;
/// Hash value.
pub const XEN_NETIF_EXTRA_TYPE_HASH: u8 = 4;
/// One past the last type pvio knows.
pub const XEN_NETIF_EXTRA_TYPE_MAX: u8 = 5;
/// Another extra follows.
pub const XEN_NETIF_EXTRA_FLAG_MORE: u8 = 1 << 0;

/// GSO of TCP over IPv4.
pub const XEN_NETIF_GSO_TYPE_TCPV4: u8 = 1;
/// GSO of TCP over IPv6.
pub const XEN_NETIF_GSO_TYPE_TCPV6: u8 = 2;

/// Dropped by the back end.
pub const XEN_NETIF_RSP_DROPPED: i16 = -2;
/// Error.
pub const XEN_NETIF_RSP_ERROR: i16 = -1;
/// Done.
pub const XEN_NETIF_RSP_OKAY: i16 = 0;
/// The response to an extra-info slot.
pub const XEN_NETIF_RSP_NULL: i16 = 1;

// --- Bounds (each with its origin) --------------------------------------------------

/// Ethernet header: the smallest packet a back end accepts (netback drops shorter ones).
pub const ETH_HLEN: u16 = 14;
/// Slots a packet may use before a back end drops it: netif.h's
/// `XEN_NETIF_NR_SLOTS_MIN`, Linux's `XEN_NETBK_LEGACY_SLOTS_MAX` (MAX_SKB_FRAGS + 1).
pub const LEGACY_SLOTS_MAX: usize = 18;
/// Slots beyond which a front end is treated as malicious and the interface disabled
/// (Linux netback's `fatal_skb_slots` default, `FATAL_SKB_SLOTS_DEFAULT`).
pub const FATAL_SKB_SLOTS: usize = 20;
/// Page size of the granted buffers.
pub const PAGE_SIZE: usize = 4096;

// --- TX: what netback checks --------------------------------------------------------

/// Why a TX packet is dropped: the front end gets `XEN_NETIF_RSP_ERROR` for each of its
/// slots and the interface carries on (netback's `xenvif_tx_err`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum TxDrop {
    /// More slots than `LEGACY_SLOTS_MAX`.
    #[error("too many slots")]
    TooManySlots,
    /// A slot holds more bytes than the packet size left for it: the first slot's size
    /// is smaller than its fragments.
    #[error("slot larger than the rest of the packet")]
    SlotLargerThanPacket,
    /// A slot carries no bytes.
    #[error("zero-length slot")]
    ZeroLengthSlot,
    /// The packet is shorter than an Ethernet header.
    #[error("packet shorter than an Ethernet header")]
    PacketTooShort,
}

/// Why a front end is judged broken: the interface is disabled and its ring never
/// touched again (netback's `xenvif_fatal_tx_err`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum TxFatal {
    /// The chain of slots (or extras) runs past what the front end published.
    #[error("slot chain runs past the published requests")]
    Unterminated,
    /// More than `FATAL_SKB_SLOTS` slots.
    #[error("slot chain longer than the fatal limit")]
    ChainTooLong,
    /// A slot's `offset + size` runs past its page.
    #[error("slot crosses its page")]
    CrossesPage,
    /// An extra-info slot of type 0 or an unknown type.
    #[error("invalid extra-info type")]
    BadExtraType,
    /// A GSO extra with size 0.
    #[error("GSO size zero")]
    GsoSizeZero,
    /// A GSO extra of an unknown type.
    #[error("unknown GSO type")]
    BadGsoType,
}

impl TxDrop {
    /// Every reason, for counters.
    pub const ALL: [TxDrop; 4] = [
        TxDrop::TooManySlots,
        TxDrop::SlotLargerThanPacket,
        TxDrop::ZeroLengthSlot,
        TxDrop::PacketTooShort,
    ];
}

impl TxFatal {
    /// Every reason, for counters.
    pub const ALL: [TxFatal; 6] = [
        TxFatal::Unterminated,
        TxFatal::ChainTooLong,
        TxFatal::CrossesPage,
        TxFatal::BadExtraType,
        TxFatal::GsoSizeZero,
        TxFatal::BadGsoType,
    ];
}

/// One data slot of a packet, as validated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TxSlot {
    /// Grant of the page.
    pub gref: u32,
    /// Offset of the data in the page.
    pub offset: u16,
    /// Bytes in this slot (for the first slot: its own share, not the packet's size).
    pub len: u16,
    /// The request id to answer.
    pub id: u16,
}

/// GSO parameters from an extra slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gso {
    /// Segment size (MSS).
    pub size: u16,
    /// `XEN_NETIF_GSO_TYPE_*`.
    pub ty: u8,
}

/// A packet's slots as consumed from the ring: what to act on if valid, and in any case
/// what to answer (one response per consumed request slot, in ring order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxChain {
    /// Data slots, first one first. At most `FATAL_SKB_SLOTS` (more is fatal).
    slots: [TxSlot; FATAL_SKB_SLOTS],
    nr_slots: usize,
    /// Extra-info slots consumed after the first slot (each answered `RSP_NULL`).
    pub extras: usize,
    /// Packet length (the first slot's `size`).
    pub len: u16,
    /// The first slot's `NETTXF_CSUM_BLANK | NETTXF_DATA_VALIDATED` bits.
    pub csum_flags: u16,
    /// GSO request, if any.
    pub gso: Option<Gso>,
}

impl TxChain {
    /// A chain of no slots, for [`read_tx_packet_into`] to fill.
    pub fn empty() -> Self {
        Self {
            slots: [TxSlot::default(); FATAL_SKB_SLOTS],
            nr_slots: 0,
            extras: 0,
            len: 0,
            csum_flags: 0,
            gso: None,
        }
    }
    /// The data slots, first one first.
    pub fn slots(&self) -> &[TxSlot] {
        &self.slots[..self.nr_slots]
    }
    /// Request slots consumed in all (data and extras): the responses owed.
    pub fn consumed(&self) -> usize {
        self.nr_slots + self.extras
    }
    /// The responses owed, in ring order, with `status` for data slots and `RSP_NULL`
    /// for extras (the first slot's extras follow it, as netback answers them).
    pub fn responses(&self, status: i16) -> impl Iterator<Item = TxResponse> + '_ {
        let first = self
            .slots()
            .first()
            .map(|s| TxResponse { id: s.id, status });
        let extras = (0..self.extras).map(|_| TxResponse {
            id: 0,
            status: XEN_NETIF_RSP_NULL,
        });
        let rest = self
            .slots()
            .iter()
            .skip(1)
            .map(move |s| TxResponse { id: s.id, status });
        first.into_iter().chain(extras).chain(rest)
    }
}

/// The verdict on one packet's slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxVerdict {
    /// Valid: build the packet from these slots, answer `RSP_OKAY` when it has left.
    Packet(TxChain),
    /// Answer every consumed slot with `RSP_ERROR` (extras with `RSP_NULL`), count it,
    /// carry on.
    Drop(TxDrop, TxChain),
    /// Disable the interface; do not touch its ring again.
    Fatal(TxFatal),
}

/// The verdict on one packet's slots read into a chain the caller keeps
/// ([`read_tx_packet_into`]): [`TxVerdict`] without the chain, so that a back end
/// reading packet after packet moves no chain around.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxJudgement {
    /// Valid: build the packet from the chain's slots.
    Packet,
    /// Answer every consumed slot with `RSP_ERROR` (extras with `RSP_NULL`).
    Drop(TxDrop),
    /// Disable the interface; do not touch its ring again. The chain is not valid.
    Fatal(TxFatal),
}

hv::reason!(TxDrop);
hv::reason!(TxFatal);

impl RxError {
    /// Every reason, in counter order.
    pub const ALL: [RxError; 4] = [
        RxError::BadId,
        RxError::NotInFlight,
        RxError::CrossesPage,
        RxError::ErrorStatus,
    ];
}
hv::reason!(RxError);

/// Per-interface counters of the TX checks; each reason has one. Invariant:
/// `packets + drops.total() + fatals.total() == chains examined`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TxCheckStats {
    /// Valid packets.
    pub packets: u64,
    /// Dropped packets, per [`TxDrop`].
    pub drops: PerReason<TxDrop>,
    /// Fatal errors, per [`TxFatal`].
    pub fatals: PerReason<TxFatal>,
}
hv::counter_set!(TxCheckStats {
    packets,
    drops,
    fatals
});

impl TxCheckStats {
    /// Counts a verdict.
    pub fn count(&mut self, v: &TxVerdict) {
        self.count_judgement(match v {
            TxVerdict::Packet(_) => TxJudgement::Packet,
            TxVerdict::Drop(r, _) => TxJudgement::Drop(*r),
            TxVerdict::Fatal(r) => TxJudgement::Fatal(*r),
        });
    }
    /// Counts a judgement.
    pub fn count_judgement(&mut self, j: TxJudgement) {
        match j {
            TxJudgement::Packet => self.packets += 1,
            TxJudgement::Drop(r) => self.drops.add(r),
            TxJudgement::Fatal(r) => self.fatals.add(r),
        }
    }
    /// Drops for one reason.
    pub fn drop_count(&self, r: TxDrop) -> u64 {
        self.drops.get(r)
    }
    /// Fatal errors for one reason.
    pub fn fatal_count(&self, r: TxFatal) -> u64 {
        self.fatals.get(r)
    }
}

fn crosses_page(offset: u16, len: u16) -> bool {
    offset as usize + len as usize > PAGE_SIZE
}

/// Reads one packet's slots: the first request (already taken), its extras, and the
/// slots that follow while `NETTXF_MORE_DATA` is set, taking each next request from
/// `take` — at most `available` more (what the front end published). This is netback's
/// `xenvif_get_extras` + `xenvif_count_requests` + the first-slot checks of
/// `xenvif_tx_build_gops`, on copies.
///
/// The chain is consumed to its end even when the packet is to be dropped, so that the
/// ring stays in step; it is never consumed past `available` or `FATAL_SKB_SLOTS`.
pub fn read_tx_packet(
    first: TxRequest,
    available: usize,
    take: impl FnMut() -> Option<TxRequest>,
) -> TxVerdict {
    let mut chain = TxChain::empty();
    match read_tx_packet_into(&mut chain, first, available, take) {
        TxJudgement::Packet => TxVerdict::Packet(chain),
        TxJudgement::Drop(r) => TxVerdict::Drop(r, chain),
        TxJudgement::Fatal(f) => TxVerdict::Fatal(f),
    }
}

/// Reads the extra-info slots after a packet's first slot into `chain` (their count,
/// and the GSO one's size and type), until one without `XEN_NETIF_EXTRA_FLAG_MORE`.
/// An unterminated chain, an unknown type or a bad GSO is fatal.
#[inline]
fn read_tx_extras(
    chain: &mut TxChain,
    next: &mut impl FnMut() -> Option<TxRequest>,
) -> Result<(), TxFatal> {
    loop {
        let raw = next().ok_or(TxFatal::Unterminated)?;
        chain.extras += 1;
        let e = ExtraInfo::from_tx_slot(&raw);
        if e.ty == XEN_NETIF_EXTRA_TYPE_NONE || e.ty >= XEN_NETIF_EXTRA_TYPE_MAX {
            return Err(TxFatal::BadExtraType);
        }
        if e.ty == XEN_NETIF_EXTRA_TYPE_GSO {
            if e.gso_size() == 0 {
                return Err(TxFatal::GsoSizeZero);
            }
            if !matches!(
                e.gso_type(),
                XEN_NETIF_GSO_TYPE_TCPV4 | XEN_NETIF_GSO_TYPE_TCPV6
            ) {
                return Err(TxFatal::BadGsoType);
            }
            chain.gso = Some(Gso {
                size: e.gso_size(),
                ty: e.gso_type(),
            });
        }
        if e.flags & XEN_NETIF_EXTRA_FLAG_MORE == 0 {
            return Ok(());
        }
    }
}

/// [`read_tx_packet`] into `chain`, which the caller keeps from packet to packet: the
/// same reading and checks, with only the slots this packet has written.
pub fn read_tx_packet_into(
    chain: &mut TxChain,
    first: TxRequest,
    available: usize,
    mut take: impl FnMut() -> Option<TxRequest>,
) -> TxJudgement {
    let mut left = available;
    let mut next = || -> Option<TxRequest> {
        if left == 0 {
            return None;
        }
        left -= 1;
        take()
    };
    chain.nr_slots = 1;
    chain.extras = 0;
    chain.len = first.size;
    chain.csum_flags = first.flags & (NETTXF_CSUM_BLANK | NETTXF_DATA_VALIDATED);
    chain.gso = None;

    // Extras follow the first slot.
    if first.flags & NETTXF_EXTRA_INFO != 0 {
        if let Err(f) = read_tx_extras(chain, &mut next) {
            return TxJudgement::Fatal(f);
        }
    }

    // Following slots: `remaining` is what the first slot's size leaves for them.
    let mut remaining = first.size;
    let mut drop = None;
    let mut more = first.flags & NETTXF_MORE_DATA != 0;
    while more {
        let frags = chain.nr_slots - 1;
        if frags >= FATAL_SKB_SLOTS - 1 {
            return TxJudgement::Fatal(TxFatal::ChainTooLong);
        }
        let Some(txp) = next() else {
            return TxJudgement::Fatal(TxFatal::Unterminated);
        };
        if drop.is_none() && frags + 1 >= LEGACY_SLOTS_MAX {
            drop = Some(TxDrop::TooManySlots);
        }
        if drop.is_none() && txp.size > remaining {
            drop = Some(TxDrop::SlotLargerThanPacket);
        }
        if drop.is_none() && txp.size == 0 {
            drop = Some(TxDrop::ZeroLengthSlot);
        }
        if crosses_page(txp.offset, txp.size) {
            return TxJudgement::Fatal(TxFatal::CrossesPage);
        }
        remaining = remaining.saturating_sub(txp.size);
        chain.slots[chain.nr_slots] = TxSlot {
            gref: txp.gref,
            offset: txp.offset,
            len: txp.size,
            id: txp.id,
        };
        chain.nr_slots += 1;
        more = txp.flags & NETTXF_MORE_DATA != 0;
    }

    // The first slot holds what the others leave.
    chain.slots[0] = TxSlot {
        gref: first.gref,
        offset: first.offset,
        len: remaining,
        id: first.id,
    };
    if drop.is_none() && first.size < ETH_HLEN {
        drop = Some(TxDrop::PacketTooShort);
    }
    if crosses_page(first.offset, remaining) {
        return TxJudgement::Fatal(TxFatal::CrossesPage);
    }
    match drop {
        Some(r) => TxJudgement::Drop(r),
        None => TxJudgement::Packet,
    }
}

// --- RX: what netfront checks -------------------------------------------------------

/// Why netfront rejects an RX response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum RxError {
    /// The id is beyond the ring.
    #[error("response id out of range")]
    BadId,
    /// The id names no buffer the front end posted and has not had back.
    #[error("response id not in flight")]
    NotInFlight,
    /// `offset + status` runs past the buffer page.
    #[error("response data crosses its page")]
    CrossesPage,
    /// The back end reported an error or drop.
    #[error("back end returned an error status")]
    ErrorStatus,
}

/// Buffers a front end has posted and not yet had back, by id (the ring's 256 ids).
#[derive(Debug, Clone, Default)]
pub struct InFlight {
    bits: [u64; 4],
}

/// Ids a netif ring can have in flight (its slot count for 12-byte TX / 8-byte RX
/// entries on one page).
pub const RING_IDS: u16 = 256;

/// Slots one packet takes at most on a guest-copy RX ring (pvio's own response form,
/// [`crate::xenbus::FEATURE_GUEST_COPY`]): one per run of its bytes in one page of the
/// driver domain's or of the guest that sent it, chained with `NETRXF_more_data`. A
/// full-size frame another guest sent is a copied head and at most two page pieces.
pub const RX_COPY_MAX_SLOTS: usize = 4;

impl InFlight {
    /// Marks `id` posted. Returns false if it was already in flight (a front-end bug).
    pub fn post(&mut self, id: u16) -> bool {
        if id >= RING_IDS {
            return false;
        }
        let (w, b) = ((id / 64) as usize, 1u64 << (id % 64));
        let was = self.bits[w] & b != 0;
        self.bits[w] |= b;
        !was
    }
    /// Takes `id` back; an error if it is out of range or not in flight.
    pub fn complete(&mut self, id: u16) -> Result<(), RxError> {
        if id >= RING_IDS {
            return Err(RxError::BadId);
        }
        let (w, b) = ((id / 64) as usize, 1u64 << (id % 64));
        if self.bits[w] & b == 0 {
            return Err(RxError::NotInFlight);
        }
        self.bits[w] &= !b;
        Ok(())
    }
    /// Ids in flight.
    pub fn count(&self) -> u32 {
        self.bits.iter().map(|w| w.count_ones()).sum()
    }
}

/// Checks one RX response (netfront's `xennet_get_responses`): the id is in range and in
/// flight (and is taken back), the status is not an error, and the data stays in its
/// page. Returns the data's length.
pub fn check_rx_response(rsp: &RxResponse, inflight: &mut InFlight) -> Result<u16, RxError> {
    inflight.complete(rsp.id)?;
    if rsp.status < 0 {
        return Err(RxError::ErrorStatus);
    }
    let len = rsp.status as u16;
    if crosses_page(rsp.offset, len) {
        return Err(RxError::CrossesPage);
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(gref: u32, offset: u16, flags: u16, id: u16, size: u16) -> TxRequest {
        TxRequest {
            gref,
            offset,
            flags,
            id,
            size,
        }
    }

    /// Runs the parser over `slots` (the first is taken already), all published.
    fn parse(slots: &[TxRequest]) -> (TxVerdict, usize) {
        let mut it = slots[1..].iter().copied();
        let mut taken = 0;
        let v = read_tx_packet(slots[0], slots.len() - 1, || {
            taken += 1;
            it.next()
        });
        (v, taken)
    }

    #[test]
    fn a_chain_read_into_again_holds_only_its_own_packet() {
        let long = [
            req(1, 0, NETTXF_MORE_DATA, 1, 3000),
            req(2, 0, NETTXF_MORE_DATA, 2, 1000),
            req(3, 0, 0, 3, 1000),
        ];
        let short = [req(9, 64, NETTXF_DATA_VALIDATED, 4, 60)];
        let mut chain = TxChain::empty();
        let read = |chain: &mut TxChain, slots: &[TxRequest]| {
            let mut it = slots[1..].iter().copied();
            read_tx_packet_into(chain, slots[0], slots.len() - 1, || it.next())
        };
        assert_eq!(read(&mut chain, &long), TxJudgement::Packet);
        assert_eq!(chain.slots().len(), 3);
        assert_eq!(read(&mut chain, &short), TxJudgement::Packet);
        let TxVerdict::Packet(fresh) = parse(&short).0 else {
            panic!("valid");
        };
        assert_eq!(chain.slots(), fresh.slots());
        assert_eq!(
            (chain.len, chain.csum_flags, chain.extras, chain.gso),
            (60, NETTXF_DATA_VALIDATED, 0, None)
        );
        // A bad chain read into it is judged as the by-value reader judges it.
        let bad = [req(1, 4090, 0, 5, 60)];
        assert_eq!(
            read(&mut chain, &bad),
            TxJudgement::Fatal(TxFatal::CrossesPage)
        );
        assert_eq!(parse(&bad).0, TxVerdict::Fatal(TxFatal::CrossesPage));
    }

    #[test]
    fn a_single_slot_packet() {
        let (v, taken) = parse(&[req(9, 100, NETTXF_CSUM_BLANK, 3, 1500)]);
        let TxVerdict::Packet(c) = v else {
            panic!("{v:?}")
        };
        assert_eq!(taken, 0);
        assert_eq!(
            c.slots(),
            &[TxSlot {
                gref: 9,
                offset: 100,
                len: 1500,
                id: 3
            }]
        );
        assert_eq!(
            (c.len, c.csum_flags, c.consumed()),
            (1500, NETTXF_CSUM_BLANK, 1)
        );
    }

    #[test]
    fn a_multi_slot_packet_with_gso_extra() {
        let slots = [
            req(1, 0, NETTXF_MORE_DATA | NETTXF_EXTRA_INFO, 10, 9000),
            ExtraInfo::gso(1448, XEN_NETIF_GSO_TYPE_TCPV4, false).to_tx_slot(),
            req(2, 0, NETTXF_MORE_DATA, 11, 4096),
            req(3, 0, 0, 12, 3000),
        ];
        let (v, taken) = parse(&slots);
        let TxVerdict::Packet(c) = v else {
            panic!("{v:?}")
        };
        assert_eq!(taken, 3);
        assert_eq!(
            c.slots().iter().map(|s| s.len).collect::<Vec<_>>(),
            vec![1904, 4096, 3000]
        );
        assert_eq!(
            c.gso,
            Some(Gso {
                size: 1448,
                ty: XEN_NETIF_GSO_TYPE_TCPV4
            })
        );
        // Responses in ring order: first, its extra (NULL), then the rest.
        let r: Vec<_> = c.responses(XEN_NETIF_RSP_OKAY).collect();
        assert_eq!(
            r,
            vec![
                TxResponse { id: 10, status: 0 },
                TxResponse {
                    id: 0,
                    status: XEN_NETIF_RSP_NULL
                },
                TxResponse { id: 11, status: 0 },
                TxResponse { id: 12, status: 0 },
            ]
        );
    }

    #[test]
    fn tolerated_errors_drop_the_packet_and_consume_its_whole_chain() {
        // Too short.
        let (v, _) = parse(&[req(1, 0, 0, 1, 13)]);
        assert!(matches!(v, TxVerdict::Drop(TxDrop::PacketTooShort, _)));
        // First slot's size smaller than its fragments.
        let (v, taken) = parse(&[
            req(1, 0, NETTXF_MORE_DATA, 1, 100),
            req(2, 0, NETTXF_MORE_DATA, 2, 200),
            req(3, 0, 0, 3, 10),
        ]);
        let TxVerdict::Drop(TxDrop::SlotLargerThanPacket, c) = v else {
            panic!("{v:?}")
        };
        assert_eq!(
            (taken, c.consumed()),
            (2, 3),
            "the whole chain is consumed and answered"
        );
        assert!(c
            .responses(XEN_NETIF_RSP_ERROR)
            .all(|r| r.status == XEN_NETIF_RSP_ERROR));
        // Zero-length fragment.
        let (v, _) = parse(&[req(1, 0, NETTXF_MORE_DATA, 1, 100), req(2, 0, 0, 2, 0)]);
        assert!(matches!(v, TxVerdict::Drop(TxDrop::ZeroLengthSlot, _)));
        // 19 slots: beyond the legacy limit, below the fatal one.
        let mut s = vec![req(1, 0, NETTXF_MORE_DATA, 0, 18 * 100)];
        for i in 1..19u16 {
            s.push(req(1, 0, if i < 18 { NETTXF_MORE_DATA } else { 0 }, i, 100));
        }
        let (v, taken) = parse(&s);
        let TxVerdict::Drop(TxDrop::TooManySlots, c) = v else {
            panic!("{v:?}")
        };
        assert_eq!((taken, c.consumed()), (18, 19));
    }

    #[test]
    fn protocol_breaks_are_fatal() {
        // Chain never terminates within what was published.
        let (v, _) = parse(&[
            req(1, 0, NETTXF_MORE_DATA, 1, 3000),
            req(2, 0, NETTXF_MORE_DATA, 2, 100),
        ]);
        assert_eq!(v, TxVerdict::Fatal(TxFatal::Unterminated));
        // Extras announced but none published.
        let (v, _) = parse(&[req(1, 0, NETTXF_EXTRA_INFO, 1, 100)]);
        assert_eq!(v, TxVerdict::Fatal(TxFatal::Unterminated));
        // A chain longer than the fatal limit (all published) stops at the limit.
        let mut s = vec![req(1, 0, NETTXF_MORE_DATA, 0, 60000)];
        for i in 1..40u16 {
            s.push(req(1, 0, NETTXF_MORE_DATA, i, 100));
        }
        let (v, taken) = parse(&s);
        assert_eq!(v, TxVerdict::Fatal(TxFatal::ChainTooLong));
        assert_eq!(
            taken,
            FATAL_SKB_SLOTS - 1,
            "never reads past the fatal limit"
        );
        // Crossing a page, in a fragment or in the first slot.
        let (v, _) = parse(&[
            req(1, 0, NETTXF_MORE_DATA, 1, 3000),
            req(2, 4000, 0, 2, 200),
        ]);
        assert_eq!(v, TxVerdict::Fatal(TxFatal::CrossesPage));
        let (v, _) = parse(&[req(1, 4000, 0, 1, 200)]);
        assert_eq!(v, TxVerdict::Fatal(TxFatal::CrossesPage));
        // Extra types.
        let bad = ExtraInfo {
            ty: 0,
            flags: 0,
            data: [0; 3],
        }
        .to_tx_slot();
        assert_eq!(
            parse(&[req(1, 0, NETTXF_EXTRA_INFO, 1, 100), bad]).0,
            TxVerdict::Fatal(TxFatal::BadExtraType)
        );
        let bad = ExtraInfo {
            ty: 99,
            flags: 0,
            data: [0; 3],
        }
        .to_tx_slot();
        assert_eq!(
            parse(&[req(1, 0, NETTXF_EXTRA_INFO, 1, 100), bad]).0,
            TxVerdict::Fatal(TxFatal::BadExtraType)
        );
        let z = ExtraInfo::gso(0, XEN_NETIF_GSO_TYPE_TCPV4, false).to_tx_slot();
        assert_eq!(
            parse(&[req(1, 0, NETTXF_EXTRA_INFO, 1, 100), z]).0,
            TxVerdict::Fatal(TxFatal::GsoSizeZero)
        );
        let t = ExtraInfo::gso(1448, 7, false).to_tx_slot();
        assert_eq!(
            parse(&[req(1, 0, NETTXF_EXTRA_INFO, 1, 100), t]).0,
            TxVerdict::Fatal(TxFatal::BadGsoType)
        );
    }

    #[test]
    fn counters_keep_their_invariant() {
        let mut st = TxCheckStats::default();
        for v in [
            parse(&[req(1, 0, 0, 1, 1500)]).0,
            parse(&[req(1, 0, 0, 1, 5)]).0,
            parse(&[req(1, 4000, 0, 1, 500)]).0,
        ] {
            st.count(&v);
        }
        assert_eq!(st.packets, 1);
        assert_eq!(st.drop_count(TxDrop::PacketTooShort), 1);
        assert_eq!(st.fatal_count(TxFatal::CrossesPage), 1);
        assert_eq!(st.packets + st.drops.total() + st.fatals.total(), 3);
    }

    #[test]
    fn netfront_checks_every_rx_response() {
        let mut f = InFlight::default();
        assert!(f.post(5));
        assert!(!f.post(5), "double post");
        assert!(!f.post(300), "out of range");
        assert_eq!(
            check_rx_response(
                &RxResponse {
                    id: 300,
                    offset: 0,
                    flags: 0,
                    status: 10
                },
                &mut f
            ),
            Err(RxError::BadId)
        );
        assert_eq!(
            check_rx_response(
                &RxResponse {
                    id: 6,
                    offset: 0,
                    flags: 0,
                    status: 10
                },
                &mut f
            ),
            Err(RxError::NotInFlight)
        );
        assert_eq!(
            check_rx_response(
                &RxResponse {
                    id: 5,
                    offset: 0,
                    flags: 0,
                    status: 1500
                },
                &mut f
            ),
            Ok(1500)
        );
        assert_eq!(
            check_rx_response(
                &RxResponse {
                    id: 5,
                    offset: 0,
                    flags: 0,
                    status: 1500
                },
                &mut f
            ),
            Err(RxError::NotInFlight),
            "answered twice"
        );
        f.post(7);
        assert_eq!(
            check_rx_response(
                &RxResponse {
                    id: 7,
                    offset: 4000,
                    flags: 0,
                    status: 200
                },
                &mut f
            ),
            Err(RxError::CrossesPage)
        );
        f.post(8);
        assert_eq!(
            check_rx_response(
                &RxResponse {
                    id: 8,
                    offset: 0,
                    flags: 0,
                    status: XEN_NETIF_RSP_ERROR
                },
                &mut f
            ),
            Err(RxError::ErrorStatus)
        );
        assert_eq!(f.count(), 0);
    }

    #[test]
    fn ring_sizes_match_netif() {
        assert_eq!(
            ring::ring_size(PAGE_SIZE, <TxRing as RingProtocol>::SLOT_SIZE),
            256
        );
        assert_eq!(
            ring::ring_size(PAGE_SIZE, <RxRing as RingProtocol>::SLOT_SIZE),
            256
        );
    }
}
