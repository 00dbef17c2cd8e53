//! netback: the driver domain's end of a virtual interface, as Linux's `xen-netback`.
//!
//! **Guest receive** (`start_xmit` → [`Vif::rx_action`]): packets the bridge forwards
//! to the vif wait in a bounded queue; the RX action takes buffers the guest posted
//! (copied out of the ring, then used), builds one grant copy per page-sized piece of
//! each packet into those buffers, issues the whole batch as one `GNTTABOP_copy`,
//! answers each request with its length (or an error if its copy failed) and notifies
//! the guest once. A guest that stops posting buffers only fills its own queue, whose
//! overflow is dropped and counted.
//!
//! **Guest transmit** ([`Vif::tx_action`]): each packet's slot chain is copied out and
//! checked by [`crate::netif::read_tx_packet`] (tolerated errors are answered and
//! counted; fatal ones disable this vif and no other); the first
//! [`TX_COPY_LEN`] bytes are grant-copied into a fresh buffer's linear area (headers
//! must be local for the bridge to inspect safely), the rest of each slot is grant-mapped
//! and attached as a foreign fragment. Slots fully copied are answered at once; mapped
//! ones when the packet has left and its buffer is freed (the release queue of
//! [`crate::skb::SkbPool`]): then they are unmapped in one batch and answered.

use hv::profile::{enter, Class};
use hv::store::{XenStore, XenbusState};
use hv::{
    CopyPtr, DomId, GrantCopy, GrantError, GrantHandle, GrantRef, GrantStatus, MapOp, Port, Pvio,
    Xen, PAGE_SIZE,
};
use mem::MappedPage;
use ring::{BackRing, PageRing};

use hv::counters::{CopyAlign, PerReason};
use crate::netif::{
    read_tx_packet_into, ExtraInfo, Gso, InFlight, RxResponse, RxRing, TxChain, TxCheckStats,
    TxFatal, TxJudgement, TxResponse, TxRing, FATAL_SKB_SLOTS, NETRXF_CSUM_BLANK,
    NETRXF_DATA_VALIDATED, NETRXF_EXTRA_INFO, NETRXF_MORE_DATA, NETTXF_CSUM_BLANK,
    NETTXF_DATA_VALIDATED, RING_IDS, RX_COPY_MAX_SLOTS, XEN_NETIF_RSP_ERROR, XEN_NETIF_RSP_OKAY,
};
use crate::offload::{Csum, Offload, OffloadError, MAX_HEADERS, MAX_OFFLOAD_LEN};
use crate::skb::{Frag, FragPage, SegPage, SkbId, SkbPool, SkbQueue, MAX_SKB_FRAGS, NET_SKB_PAD};
use crate::wire::MAX_TAGGED_FRAME;
use crate::xenbus::{self, XenbusError};

/// Bytes of each transmitted packet copied into the back end's buffer (Linux's
/// `XEN_NETBACK_TX_COPY_LEN`).
pub const TX_COPY_LEN: usize = 128;
/// Slots ahead of the one taken whose bytes the TX action prefetches (grant cache).
const TX_PREFETCH: u32 = 8;
/// Packets per RX batch (one grant-copy hypercall).
pub const RX_BATCH: usize = 64;
/// TX slots that may be mapped at once (`MAX_PENDING_REQS`).
pub const MAX_PENDING: usize = 256;
/// Window slots a vif needs: its two rings, its pending TX maps, its RX buffers
/// mapped for direct placement, its grant cache, its control ring and the page of a
/// control message's list.
pub const VIF_WINDOW_SLOTS: u32 = CTRL_LIST_SLOT + 1;
/// A vif's first grant-cache slot (from its base).
const CACHE_SLOT0: u32 = 2 + MAX_PENDING as u32 + RX_MAPPED as u32;
/// A vif's control-ring slot.
const CTRL_RING_SLOT: u32 = CACHE_SLOT0 + CACHE_SLOTS as u32;
/// Where a control message's list page is mapped while it is read or answered.
const CTRL_LIST_SLOT: u32 = CTRL_RING_SLOT + 1;

mod cache;
mod ctrl;
mod direct;
pub use cache::{CacheError, CacheStats, DropOutcome, GrantCache, CACHE_SLOTS};
pub use ctrl::CTRL_WAITING;
pub use direct::{DirectToken, DIRECT_BRIDGE_RESERVE, DIRECT_OFFSET, RX_MAPPED};
/// Default bound on a vif's receive queue, in bytes (Linux's `rx_queue_max`).
pub const RX_QUEUE_BYTES: usize = 512 * 1024;
/// Packets a vif's queue takes beyond [`RX_QUEUE_BYTES`]: the stopped device's queueing
/// discipline (`XENVIF_QUEUE_LENGTH`, a vif's `tx_queue_len`). With 1500-byte frames
/// it adds little; with 64 KiB GSO packets it is what keeps a burst of a TCP window
/// from being dropped.
pub const RX_QUEUE_BACKLOG: usize = 32;
/// Bytes of a cache line: what aligned copies line source and destination up to.
pub const CACHE_LINE: usize = 64;

/// Driver-domain buffers one guest-copy vif may have lent to its guest at once; beyond
/// them netback revokes the oldest (paper 000 §4.1: a guest that never copies must not
/// hold the driver domain's memory). The pool's 3072 buffers hold a dozen such vifs.
pub const RX_LENT_MAX: usize = 128;
/// Of those, pieces of other guests' pages (passed on through transitive grants) one
/// guest-copy vif may hold at once; past it, such frames are copied into the driver
/// domain's own buffer first, so that a guest that never copies holds at most this
/// many of other guests' TX buffers (a sender has [`MAX_PENDING`]).
pub const RX_TRANSITIVE_MAX: usize = 32;

/// The guest buffers a packet of `len` bytes fills when the first is filled from
/// offset `start`: at least one, even for an empty packet.
pub fn rx_pages(len: usize, start: usize) -> usize {
    (start + len).div_ceil(PAGE_SIZE).max(1)
}

type Back<P> = BackRing<P, PageRing<MappedPage>>;

/// Why a vif stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disabled {
    /// A fatal TX error.
    Fatal(TxFatal),
    /// A ring index broke the protocol.
    RingBroken,
    /// Torn down.
    Disconnected,
}

/// Counters of one vif.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VifStats {
    /// Packets copied to the guest.
    pub rx_packets: u64,
    /// Bytes copied to the guest.
    pub rx_bytes: u64,
    /// Packets dropped because the receive queue was full (the guest is not posting).
    pub rx_queue_full: u64,
    /// Packets whose grant copy failed (bad gref from the guest), answered with an error.
    pub rx_copy_errors: u64,
    /// Packets copied (in part) straight from pages another guest granted: frames one
    /// guest sent to another, forwarded by the bridge without a local copy.
    pub rx_from_grants: u64,
    /// Times the RX action stopped for want of posted buffers.
    pub rx_stalls: u64,
    /// TX packets passed to the bridge.
    pub tx_packets: u64,
    /// Bytes of those packets.
    pub tx_bytes: u64,
    /// TX packets whose grant copy or map failed, answered with an error.
    pub tx_grant_errors: u64,
    /// TX packets dropped for want of a buffer.
    pub tx_no_buffer: u64,
    /// Packets dropped because they were longer than the front end can take (over
    /// [`MAX_TAGGED_FRAME`] to a front end without `feature-sg`).
    pub rx_oversize: u64,
    /// Packets dropped because the vif was disabled.
    pub dropped_disabled: u64,
    /// Notifications sent to the guest.
    pub notifies: u64,
    /// Bytes of the guest-RX copies built, by how source and destination line up.
    pub rx_copy_bytes: PerReason<CopyAlign>,
    /// Guest copy: buffers lent to the guest (a sub-page grant each).
    pub rx_lent: u64,
    /// Guest copy: lent buffers the guest gave back by posting their slot again.
    pub rx_returned: u64,
    /// Guest copy: lent buffers revoked because the guest held [`RX_LENT_MAX`].
    pub rx_revoked: u64,
    /// Guest copy: packets dropped because the oldest lent buffer was being copied and
    /// could not be revoked yet.
    pub rx_lent_full: u64,
    /// Guest copy: requests naming a slot out of range or already posted, answered
    /// with an error.
    pub rx_bad_requests: u64,
    /// Guest copy: packets whose bytes were in more pieces than a response chain
    /// carries, copied into one local buffer first.
    pub rx_linearized: u64,
    /// Guest copy: pieces lent through a windowed transitive grant of the sending
    /// guest's own grant (bytes of a frame another guest sent, not copied).
    pub rx_transitive: u64,
    /// Control-ring requests taken.
    pub ctrl_requests: u64,
    /// Control-ring requests answered with an error status (bad queue, length, list
    /// page or type).
    pub ctrl_errors: u64,
    /// Times the TX action stopped with requests waiting because a packet's worth of
    /// pending entries was not free (large packets hold many until sent).
    pub tx_pending_stalls: u64,
    /// Offloads: large (GSO) packets taken from the guest.
    pub tx_gso_packets: u64,
    /// Offloads: GSO packets the guest sent without `NETTXF_csum_blank`, made partial
    /// here (Linux's `rx_gso_checksum_fixup`).
    pub tx_gso_csum_fixups: u64,
    /// Offloads: guest packets dropped for their metadata or the headers it describes,
    /// per [`OffloadError`] (a blank checksum on what is not TCP or UDP over IPv4, GSO
    /// of what is not TCP, segments longer than a frame).
    pub tx_offload_errors: PerReason<OffloadError>,
    /// Offloads: large packets given to the guest whole, with a GSO extra.
    pub rx_gso_packets: u64,
    /// Offloads: large packets cut into frames here because the front end (or this
    /// vif's receive path) takes none whole; and the frames they became.
    pub rx_gso_segmented: u64,
    /// Frames those packets were cut into.
    pub rx_gso_segments: u64,
    /// Offloads: partial checksums filled in here for a front end that takes none.
    pub rx_csum_filled: u64,
    /// Offloads: packets that could not be segmented or checksummed here (bad headers,
    /// no buffer), dropped.
    pub rx_offload_drops: u64,
}

hv::counter_set!(VifStats {
    rx_packets,
    rx_bytes,
    rx_queue_full,
    rx_copy_errors,
    rx_from_grants,
    rx_stalls,
    tx_packets,
    tx_bytes,
    tx_grant_errors,
    tx_no_buffer,
    rx_oversize,
    dropped_disabled,
    notifies,
    rx_copy_bytes,
    rx_lent,
    rx_returned,
    rx_revoked,
    rx_lent_full,
    rx_bad_requests,
    rx_linearized,
    rx_transitive,
    ctrl_requests,
    ctrl_errors,
    tx_pending_stalls,
    tx_gso_packets,
    tx_gso_csum_fixups,
    tx_offload_errors,
    rx_gso_packets,
    rx_gso_segmented,
    rx_gso_segments,
    rx_csum_filled,
    rx_offload_drops
});

impl VifStats {
    /// The counters that count packets dropped or refused, one per reason.
    pub const DROPS: &'static [&'static str] = &[
        "rx_queue_full",
        "rx_copy_errors",
        "rx_oversize",
        "rx_lent_full",
        "rx_bad_requests",
        "tx_grant_errors",
        "tx_no_buffer",
        "dropped_disabled",
        "tx_offload_errors",
        "rx_offload_drops",
    ];
}

/// How full a vif's rings are: requests the front end has published (as netback last
/// read its index) that netback has not answered yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingOccupancy {
    /// TX ring: packets' slots waiting or in flight.
    pub tx: u32,
    /// RX ring: buffers (or credits) posted and not used yet.
    pub rx: u32,
    /// Slots in each ring.
    pub size: u32,
    /// TX requests published and not yet taken.
    pub tx_waiting: u32,
    /// Pending entries free (each slot of a packet in flight holds one).
    pub pending_free: u32,
}

impl hv::counters::CounterSet for RingOccupancy {
    fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
        f("tx_ring_used", u64::from(self.tx));
        f("rx_ring_used", u64::from(self.rx));
        f("ring_size", u64::from(self.size));
        f("tx_waiting", u64::from(self.tx_waiting));
        f("pending_free", u64::from(self.pending_free));
    }
}

/// A guest-copy vif's receive side (paper 000 §4.1–4.2): instead of copying a packet
/// into a buffer the guest posted, netback lends the guest the driver domain's own
/// buffer through a read-only sub-page grant covering exactly the packet's bytes, and
/// the guest copies. The grants are a block of [`RING_IDS`] references, one per ring
/// slot: the packet answered on slot `id` is readable through `base + id`, and the
/// guest gives the buffer back by posting slot `id` again. A request is a credit, not
/// a buffer.
#[derive(Debug)]
struct GuestCopy {
    base: GrantRef,
    /// The buffer lent through slot `id`'s grant.
    lent: Box<[Option<SkbId>]>,
    /// Lent slots, oldest first.
    order: LentOrder,
    /// Slots the guest posted and netback has not answered.
    credits: Vec<u16>,
    credited: InFlight,
    /// Lent buffers whose grant was in use when ended: ended and freed later. Until
    /// then the slot is neither free nor lendable: a slot the guest gave back while its
    /// other vCPU still copied through it is credited only once its grant has ended
    /// (`credit`), or the next packet's grant would be lent through a slot the guest
    /// can still read the old one's bytes through.
    ending: Vec<Ending>,
    /// The slots of one packet lent in pieces, as a ring: slot `id`'s next piece, or
    /// `id` itself when it is the packet's only one left. The buffer is freed when its
    /// last piece's grant has ended.
    piece_next: Box<[u16]>,
    /// Slots lent through a transitive grant (bytes of another guest's page), and how
    /// many: each holds the sending guest's TX buffer until the guest copies.
    transitive: Box<[bool]>,
    transitive_held: usize,
}

/// A lent slot whose grant could not be ended yet.
#[derive(Debug, Clone, Copy)]
struct Ending {
    id: u16,
    skb: SkbId,
    /// The guest posted the slot again: it becomes a credit when the grant ends.
    credit: bool,
}

/// The slots lent through, oldest first: a list threaded through two arrays indexed by
/// slot, so that a return in any order, as a guest chooses it, is taken out in constant
/// time (a search was 25% of the path when netfront gave a batch back last first).
#[derive(Debug)]
struct LentOrder {
    prev: Box<[u16]>,
    next: Box<[u16]>,
    head: u16,
    tail: u16,
    len: usize,
}

/// No slot: the end of the list, or a slot not on it.
const NIL: u16 = u16::MAX;

impl LentOrder {
    fn new() -> Self {
        Self::with_capacity(RING_IDS as usize)
    }

    /// A list of indices below `n` (the grant cache's idle entries use one too).
    fn with_capacity(n: usize) -> Self {
        Self {
            prev: vec![NIL; n].into_boxed_slice(),
            next: vec![NIL; n].into_boxed_slice(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn front(&self) -> Option<u16> {
        (self.head != NIL).then_some(self.head)
    }

    fn contains(&self, id: u16) -> bool {
        self.head == id || self.prev.get(usize::from(id)).is_some_and(|&p| p != NIL)
    }

    /// Appends `id` (newest), unless it is on the list or no slot.
    fn push_back(&mut self, id: u16) {
        if usize::from(id) >= self.prev.len() || self.contains(id) {
            return;
        }
        self.prev[usize::from(id)] = self.tail;
        self.next[usize::from(id)] = NIL;
        match self.tail {
            NIL => self.head = id,
            t => self.next[usize::from(t)] = id,
        }
        self.tail = id;
        self.len += 1;
    }

    /// Takes `id` off the list wherever it is; nothing if it is not on it.
    fn remove(&mut self, id: u16) {
        if !self.contains(id) {
            return;
        }
        let i = usize::from(id);
        let (p, n) = (self.prev[i], self.next[i]);
        match p {
            NIL => self.head = n,
            p => self.next[usize::from(p)] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[usize::from(n)] = p,
        }
        (self.prev[i], self.next[i]) = (NIL, NIL);
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u16> {
        let h = self.front()?;
        self.remove(h);
        Some(h)
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Pending {
    handle: Option<GrantHandle>,
    /// The grant-cache entry the slot is read through, instead of a map of its own.
    cached: Option<u16>,
    id: u16,
}

/// A free TX pending slot, taken for request `id`'s page: reached through grant-cache
/// entry `cached`, or (none) through a map of its own still to be made. The caller has
/// checked that a chain's worth is free.
fn take_pending(pending: &mut [Pending], free: &mut Vec<u16>, id: u16, cached: Option<u16>) -> u16 {
    let p = free.pop().expect("checked: a chain's worth is free");
    pending[usize::from(p)] = Pending {
        handle: None,
        cached,
        id,
    };
    p
}

/// One request a guest-RX batch took, and the bytes its buffer receives.
#[derive(Debug, Clone, Copy)]
struct RxMeta {
    id: u16,
    /// Where in the buffer's page the bytes start.
    offset: u16,
    size: u16,
}

/// One packet of a guest-RX batch: its copies and its requests, as ranges of the
/// batch's vectors.
#[derive(Debug, Clone, Copy)]
struct RxPkt {
    skb: SkbId,
    first_meta: usize,
    metas: usize,
    first_op: usize,
    ops: usize,
    csum: bool,
    /// The checksum is left blank (`NETRXF_csum_blank`).
    blank: bool,
    /// A large packet given whole: its GSO extra takes the second request.
    gso: Option<Gso>,
}

impl RxPkt {
    fn ops_at(&self) -> std::ops::Range<usize> {
        self.first_op..self.first_op + self.ops
    }
    fn metas_at(&self) -> std::ops::Range<usize> {
        self.first_meta..self.first_meta + self.metas
    }
}

/// What adding one packet to a guest-RX batch found.
#[derive(Debug, Clone, Copy, Default)]
struct RxBuilt {
    /// Some of its bytes are in a page another guest granted.
    foreign: bool,
    /// The ring ran dry under a request the check had promised: a protocol break.
    broken: bool,
}

/// A guest-RX batch: the grant copies of up to [`RX_BATCH`] packets and the requests
/// they fill, built before the one hypercall that performs them. Allocated once.
#[derive(Debug)]
struct RxBatch {
    copies: Vec<GrantCopy>,
    status: Vec<GrantStatus>,
    meta: Vec<RxMeta>,
    pkts: Vec<RxPkt>,
}

impl RxBatch {
    fn new() -> Self {
        let max_ops = RX_BATCH * (65536 / PAGE_SIZE + 2);
        Self {
            copies: Vec::with_capacity(max_ops),
            status: vec![Ok(()); max_ops],
            meta: Vec::with_capacity(max_ops),
            pkts: Vec::with_capacity(RX_BATCH),
        }
    }

    fn clear(&mut self) {
        self.copies.clear();
        self.meta.clear();
        self.pkts.clear();
    }

    /// Adds a packet: takes a request from `rx` for each page its bytes fill, the
    /// first page from offset `start` and each further one from offset 0 (the packet
    /// needs [`rx_pages`] of them). A packet whose bytes cannot all be walked keeps the
    /// requests it took, to be answered with errors (no copies). Counts the copies'
    /// bytes by alignment into `census`.
    fn add(
        &mut self,
        rx: &mut Back<RxRing>,
        pool: &SkbPool,
        (skb, start, gso, blank): (SkbId, usize, Option<Gso>, bool),
        fe: DomId,
        census: &mut PerReason<CopyAlign>,
    ) -> RxBuilt {
        let (first_meta, first_op) = (self.meta.len(), self.copies.len());
        let len = pool.len(skb);
        let mut built = RxBuilt::default();
        let mut page_off = PAGE_SIZE;
        let mut next_start = start;
        let mut gref = 0u32;
        // The GSO extra's request follows the first one's; the data's meta is tracked
        // by index, not as the last pushed.
        let mut extra_due = gso.is_some();
        let mut cur = 0usize;
        let (ops, meta) = (&mut self.copies, &mut self.meta);
        let r = pool.walk(skb, 0, len, |seg, _| {
            // A page of our own is copied from; a page another guest granted (a packet
            // it sent, forwarded by the bridge) is copied from through its grant, as
            // Linux netback does for foreign pages: the driver domain's mapping is not
            // a frame it owns.
            let source = |offset: usize| match seg.page {
                SegPage::Own(gfn) => CopyPtr::Local {
                    gfn,
                    offset: offset as u16,
                },
                SegPage::Window {
                    grant: (dom, gref), ..
                } => CopyPtr::Gref {
                    dom,
                    gref,
                    offset: offset as u16,
                },
            };
            built.foreign |= matches!(seg.page, SegPage::Window { .. });
            let mut done = 0;
            while done < seg.len {
                if page_off == PAGE_SIZE {
                    let Ok(Some(req)) = rx.take_request() else {
                        built.broken = true;
                        return Ok(());
                    };
                    page_off = std::mem::take(&mut next_start);
                    cur = meta.len();
                    meta.push(RxMeta {
                        id: req.id,
                        offset: page_off as u16,
                        size: 0,
                    });
                    gref = req.gref;
                    if std::mem::take(&mut extra_due) {
                        let Ok(Some(x)) = rx.take_request() else {
                            built.broken = true;
                            return Ok(());
                        };
                        meta.push(RxMeta {
                            id: x.id,
                            offset: 0,
                            size: 0,
                        });
                    }
                }
                let n = (seg.len - done).min(PAGE_SIZE - page_off);
                census.add_n(CopyAlign::of(seg.offset + done, page_off), n as u64);
                ops.push(GrantCopy {
                    source: source(seg.offset + done),
                    dest: CopyPtr::Gref {
                        dom: fe,
                        gref: GrantRef(gref),
                        offset: page_off as u16,
                    },
                    len: n as u16,
                });
                if let Some(m) = meta.get_mut(cur) {
                    m.size += n as u16;
                }
                page_off += n;
                done += n;
            }
            Ok(())
        });
        if r.is_err() {
            // Requests already taken still need answers: error ones.
            self.copies.truncate(first_op);
            for m in &mut self.meta[first_meta..] {
                m.size = 0;
            }
        }
        self.pkts.push(RxPkt {
            skb,
            first_meta,
            metas: self.meta.len() - first_meta,
            first_op,
            ops: self.copies.len() - first_op,
            csum: pool.csum_valid(skb) && r.is_ok(),
            blank,
            gso: gso.filter(|_| self.meta.len() - first_meta >= 2),
        });
        built
    }
}

/// One packet of a guest-TX batch, as ranges of the batch's vectors.
#[derive(Debug, Clone, Copy)]
struct TxPkt {
    skb: SkbId,
    /// A second buffer for the maps beyond [`MAX_SKB_FRAGS`], linked on the first's
    /// fragment list.
    overflow: Option<SkbId>,
    copy_op: usize,
    copy_len: usize,
    /// Index into the batch's maps of its first map, and how many.
    first_map: usize,
    maps: usize,
    /// Request id of the first slot when it was copied whole (answered now).
    copied_id: Option<u16>,
    /// Extras to answer with `RSP_NULL`.
    extras: usize,
    /// Copy mode: its pages copied into the back end's own (`pages` of the batch's,
    /// their copies following the header copy) and its slots' ids, all answered now.
    first_page: usize,
    pages: usize,
    first_id: usize,
    ids: usize,
}

impl TxPkt {
    fn maps_at(&self) -> std::ops::Range<usize> {
        self.first_map..self.first_map + self.maps
    }
    fn pages_at(&self) -> std::ops::Range<usize> {
        self.first_page..self.first_page + self.pages
    }
    /// Its copies: the header's, then one per page in copy mode.
    fn copies_at(&self) -> std::ops::Range<usize> {
        self.copy_op..self.copy_op + 1 + self.pages
    }
}

/// Copy mode: a page of the back end's own that a TX slot was copied into.
#[derive(Debug, Clone, Copy)]
struct TxCopied {
    gfn: hv::Gfn,
    len: u16,
}

/// Copies a copy-mode batch may hold (the header's and one per page of each packet).
const TX_COPIES_MAX: usize = MAX_PENDING * 2;

/// A mapped TX slot: the pending entry that holds its mapping until the packet has
/// left, and the bytes of the page it contributes.
#[derive(Debug, Clone, Copy)]
struct TxMapped {
    pending: u16,
    offset: u16,
    len: u16,
}

/// A guest-TX batch: the header copies and page maps of the packets built, before the
/// two hypercalls that perform them, and their results. Allocated once.
#[derive(Debug)]
struct TxBatch {
    copies: Vec<GrantCopy>,
    copy_status: Vec<GrantStatus>,
    maps: Vec<MapOp>,
    map_results: Vec<Result<GrantHandle, GrantError>>,
    /// One per entry of `maps`.
    mapped: Vec<TxMapped>,
    /// Copy mode: the pages copied into, and the slot ids answered with each packet.
    pages: Vec<TxCopied>,
    ids: Vec<u16>,
    pkts: Vec<TxPkt>,
    /// Responses were pushed and must be published.
    responses: bool,
}

impl TxBatch {
    fn new() -> Self {
        Self {
            copies: Vec::with_capacity(TX_COPIES_MAX),
            copy_status: vec![Ok(()); TX_COPIES_MAX],
            maps: Vec::with_capacity(MAX_PENDING),
            map_results: vec![Err(GrantError::BadHandle(0)); MAX_PENDING],
            mapped: Vec::with_capacity(MAX_PENDING),
            pages: Vec::with_capacity(TX_COPIES_MAX),
            ids: Vec::with_capacity(TX_COPIES_MAX),
            pkts: Vec::with_capacity(MAX_PENDING),
            responses: false,
        }
    }

    fn clear(&mut self) {
        self.copies.clear();
        self.maps.clear();
        self.mapped.clear();
        self.pages.clear();
        self.ids.clear();
        self.pkts.clear();
        self.responses = false;
    }
}

/// The unmaps of one release: handles, the pending entries they free, their status.
#[derive(Debug)]
struct Unmaps {
    handles: Vec<GrantHandle>,
    pending: Vec<u16>,
    status: Vec<GrantStatus>,
}

/// Bytes of a vif's offload scratch: a 64 KiB packet and one frame cut from it.
const OFFLOAD_SCRATCH: usize = MAX_OFFLOAD_LEN + 2048;

/// The offload a guest's TX chain asks for, before its headers are looked at: a blank
/// checksum's place is found by [`Vif::tx_offload`].
fn chain_offload(chain: &TxChain) -> Offload {
    let csum = if chain.csum_flags & NETTXF_CSUM_BLANK != 0 {
        Csum::Partial {
            start: 0,
            offset: 0,
        }
    } else if chain.csum_flags & NETTXF_DATA_VALIDATED != 0 {
        Csum::Valid
    } else {
        Csum::None
    };
    Offload {
        csum,
        gso: chain.gso,
    }
}

/// One virtual interface's back end, over pvio's hypervisor or a real Xen.
#[derive(Debug)]
pub struct Vif<X: Xen = Pvio> {
    xen: X,
    fe: DomId,
    handle: u32,
    index: u16,
    port: Port,
    tx: Back<TxRing>,
    rx: Back<RxRing>,
    ring_handles: [GrantHandle; 2],
    slot_base: u32,
    rx_queue: SkbQueue,
    /// The front end takes packets over several slots (`feature-sg`).
    can_sg: bool,
    /// The front end takes large TCP packets whole (`feature-gso-tcpv4`).
    gso_rx: bool,
    /// The front end takes blank checksums (no `feature-no-csum-offload`).
    csum_rx: bool,
    /// A packet being cut up or checksummed for a front end that cannot take it as it
    /// is: its bytes, then one frame of the result (allocated at connection).
    offload_scratch: Box<[u8]>,
    /// Guest-RX copies start at the source's offset in its cache line (paper 000
    /// §3.4.1) instead of at the start of the guest's page.
    aligned_copies: bool,
    /// Guest TX copies every slot into the back end's own pages instead of mapping
    /// them ([`Vif::set_tx_copy`]).
    tx_copy: bool,
    /// The front end asked to copy received packets itself.
    guest_copy: Option<GuestCopy>,
    /// The NIC places received frames in the guest's buffers (paper 000 §4.3).
    direct: Option<Box<direct::Direct>>,
    /// **Unsafe stand-in** (paper 000 §4.4's estimate): the guest's RX requests carry
    /// machine frames, used for DMA unchecked. Only when the toolstack offered it.
    machine_frames: bool,
    /// Grant reuse (paper 000 §4.4): the mapped grants kept across I/O.
    cache: Option<Box<GrantCache>>,
    /// The control ring through which the guest drops cached mappings.
    ctrl: Option<ctrl::Ctrl>,
    /// Packets a cached TX build assembled, to be delivered.
    tx_ready: Vec<SkbId>,
    /// A page of bounce for copies between two foreign pages.
    bounce: Box<[u8]>,
    rxb: RxBatch,
    txb: TxBatch,
    unmaps: Unmaps,
    pending: Box<[Pending]>,
    pending_free: Vec<u16>,
    /// `req_event` on the TX ring is armed for the next request: the last look found
    /// the ring empty and nothing has been taken since. A build that stops early (its
    /// budget, or too few pending entries) leaves it stale, and the front end then
    /// sends no event for what it adds; [`Vif::tx_pending`] arms it again.
    tx_armed: bool,
    tx_check: TxCheckStats,
    stats: VifStats,
    disabled: Option<Disabled>,
}

/// Maps the front end's control ring (`ctrl-ring-ref`) at `slot`.
fn map_ctrl_ring<X: Xen>(
    xen: &X,
    fe: DomId,
    fdir: &str,
    slot: u32,
) -> Result<ctrl::Ctrl, XenbusError> {
    let r = xenbus::read_u32(
        xen.store(),
        xen.id(),
        &format!("{fdir}/{}", xenbus::CTRL_RING_REF),
    )?;
    let op = [MapOp {
        dom: fe,
        gref: GrantRef(r),
        readonly: false,
        slot,
    }];
    let mut res = [Err(GrantError::BadHandle(0))];
    xen.grant_map(&op, &mut res);
    let bad = |e: String| XenbusError::BadKey(format!("{fdir}/{}: {e}", xenbus::CTRL_RING_REF));
    let h = res[0].map_err(|e| bad(e.to_string()))?;
    match xen
        .domain()
        .window()
        .page(slot)
        .ok()
        .and_then(|p| PageRing::new(p).ok())
        .and_then(|p| BackRing::<crate::netif::CtrlRing, _>::attach(p).ok())
    {
        Some(ring) => Ok(ctrl::Ctrl::new(ring, h)),
        None => {
            xen.grant_unmap(&[h], &mut [Ok(())]);
            Err(bad("not a ring".into()))
        }
    }
}

/// Publishes the back end's features and waits for the front end (`InitWait`).
pub fn probe(store: &impl XenStore, be: DomId, fe: DomId, handle: u32) -> Result<(), XenbusError> {
    let dir = xenbus::backend_dir(be, fe, handle);
    for (k, v) in xenbus::BACKEND_FEATURES {
        store.write(be, &format!("{dir}/{k}"), v)?;
    }
    store.switch_state(be, &dir, XenbusState::InitWait)?;
    Ok(())
}

impl<X: Xen> Vif<X> {
    /// Connects to a front end that published its rings: reads and checks its keys,
    /// maps both ring pages at window slots `slot_base` and `slot_base + 1` (the vif
    /// uses [`VIF_WINDOW_SLOTS`] slots from there), binds the event channel, and moves
    /// to `Connected`. `index` names the vif in release tokens.
    pub fn connect(
        xen: X,
        fe: DomId,
        handle: u32,
        index: u16,
        slot_base: u32,
    ) -> Result<Self, XenbusError> {
        let store = xen.store();
        let be = xen.id();
        let dom = xen.domain();
        let fdir = xenbus::frontend_dir(fe, handle);
        let bdir = xenbus::backend_dir(be, fe, handle);
        let st = store.xenbus_state(be, &fdir);
        if !matches!(st, XenbusState::Initialised | XenbusState::Connected) {
            return Err(XenbusError::PeerState(st));
        }
        if !xenbus::feature(store, be, &fdir, "request-rx-copy") {
            return Err(XenbusError::MissingFeature("request-rx-copy"));
        }
        let can_sg = xenbus::feature(store, be, &fdir, "feature-sg");
        // Linux netback: GSO only if asked for; blank checksums unless refused.
        let gso_rx = can_sg && xenbus::feature(store, be, &fdir, "feature-gso-tcpv4");
        let csum_rx = !xenbus::feature(store, be, &fdir, "feature-no-csum-offload");
        let wants_copy = xenbus::feature(store, be, &fdir, xenbus::REQUEST_GUEST_COPY);
        let machine_frames = xenbus::feature(store, be, &fdir, xenbus::REQUEST_MACHINE_FRAMES)
            && xenbus::feature(store, be, &bdir, xenbus::FEATURE_MACHINE_FRAMES);
        if wants_copy && !xenbus::feature(store, be, &bdir, xenbus::FEATURE_GUEST_COPY) {
            return Err(XenbusError::MissingFeature(xenbus::FEATURE_GUEST_COPY));
        }
        // The ring layout: ring.h's unless the front end asked for the split one this
        // end offered. Both rings use it.
        let layout = if xenbus::feature(store, be, &fdir, xenbus::REQUEST_SPLIT_INDICES)
            && xenbus::feature(store, be, &bdir, xenbus::FEATURE_SPLIT_INDICES)
        {
            ring::Layout::SPLIT
        } else {
            ring::Layout::XEN
        };
        let tx_ref = xenbus::read_u32(store, be, &format!("{fdir}/tx-ring-ref"))?;
        let rx_ref = xenbus::read_u32(store, be, &format!("{fdir}/rx-ring-ref"))?;
        let evtchn = xenbus::read_u32(store, be, &format!("{fdir}/event-channel"))?;

        let ops = [
            MapOp {
                dom: fe,
                gref: GrantRef(tx_ref),
                readonly: false,
                slot: slot_base,
            },
            MapOp {
                dom: fe,
                gref: GrantRef(rx_ref),
                readonly: false,
                slot: slot_base + 1,
            },
        ];
        let mut res = [Err(GrantError::BadHandle(0)); 2];
        xen.grant_map(&ops, &mut res);
        let bad = |e: &GrantError| XenbusError::BadKey(format!("{fdir}/*-ring-ref: {e}"));
        let (th, rh) = match res {
            [Ok(t), Ok(r)] => (t, r),
            [a, b] => {
                let mut st = [Ok(()); 2];
                let hs: Vec<GrantHandle> = [a, b].iter().filter_map(|r| r.ok()).collect();
                xen.grant_unmap(&hs, &mut st);
                let e = [a, b]
                    .into_iter()
                    .find_map(|r| r.err())
                    .unwrap_or(GrantError::BadPage);
                return Err(bad(&e));
            }
        };
        let unmap = |xen: &X| {
            let mut st = [Ok(()); 2];
            xen.grant_unmap(&[th, rh], &mut st);
        };
        let page = |slot| dom.window().page(slot);
        let rings = page(slot_base)
            .ok()
            .and_then(|p| PageRing::with_layout(p, layout).ok())
            .and_then(|p| BackRing::<TxRing, _>::attach(p).ok())
            .zip(
                page(slot_base + 1)
                    .ok()
                    .and_then(|p| PageRing::with_layout(p, layout).ok())
                    .and_then(|p| BackRing::<RxRing, _>::attach(p).ok()),
            );
        let Some((tx, rx)) = rings else {
            unmap(&xen);
            return Err(XenbusError::BadKey(format!("{fdir}/*-ring-ref")));
        };
        // From here each failure gives back what was taken, rings first: a ring holds
        // its mapped page open, and a held page cannot be unmapped.
        let port = match xen.evtchn_bind_interdomain(fe, Port(evtchn)) {
            Ok(p) => p,
            Err(e) => {
                drop((tx, rx));
                unmap(&xen);
                return Err(XenbusError::BadKey(format!("{fdir}/event-channel: {e}")));
            }
        };
        // Grant reuse needs the control ring, through which the guest drops mappings.
        let reuse = xenbus::feature(store, be, &fdir, xenbus::REQUEST_GRANT_REUSE);
        let ctrl = if reuse {
            match map_ctrl_ring(&xen, fe, &fdir, slot_base + CTRL_RING_SLOT) {
                Ok(c) => Some(c),
                Err(e) => {
                    drop((tx, rx));
                    unmap(&xen);
                    let _ = xen.evtchn_close(port);
                    return Err(e);
                }
            }
        } else {
            None
        };
        // A guest-copy front end learns where its slots' grants start before it sees
        // `Connected`.
        let gt = dom.grant_table();
        let guest_copy = wants_copy
            .then(|| gt.alloc_block(u32::from(RING_IDS)))
            .map(|b| b.ok_or(XenbusError::MissingFeature(xenbus::FEATURE_GUEST_COPY)));
        let guest_copy = match guest_copy.transpose().and_then(|b| {
            if let Some(base) = b {
                store.write(
                    be,
                    &format!("{bdir}/{}", xenbus::RX_GRANT_BASE),
                    &base.0.to_string(),
                )?;
            }
            store.switch_state(be, &bdir, XenbusState::Connected)?;
            Ok(b)
        }) {
            Ok(b) => b.map(|base| GuestCopy {
                base,
                lent: vec![None; RING_IDS as usize].into_boxed_slice(),
                order: LentOrder::new(),
                credits: Vec::with_capacity(RING_IDS as usize),
                credited: InFlight::default(),
                ending: Vec::with_capacity(RING_IDS as usize),
                piece_next: (0..RING_IDS).collect(),
                transitive: vec![false; RING_IDS as usize].into_boxed_slice(),
                transitive_held: 0,
            }),
            Err(e) => {
                drop((tx, rx));
                unmap(&xen);
                if let Some(c) = ctrl {
                    let h = c.handle;
                    drop(c);
                    xen.grant_unmap(&[h], &mut [Ok(())]);
                }
                let _ = xen.evtchn_close(port);
                return Err(e);
            }
        };
        let cache = reuse.then(|| Box::new(GrantCache::new(fe, slot_base + CACHE_SLOT0)));
        Ok(Self {
            xen,
            fe,
            handle,
            index,
            port,
            tx,
            rx,
            ring_handles: [th, rh],
            slot_base,
            rx_queue: SkbQueue::with_backlog(RX_QUEUE_BYTES, RX_QUEUE_BACKLOG),
            can_sg,
            gso_rx,
            csum_rx,
            offload_scratch: vec![0; OFFLOAD_SCRATCH].into_boxed_slice(),
            aligned_copies: false,
            tx_copy: false,
            guest_copy,
            direct: None,
            machine_frames,
            cache,
            ctrl,
            tx_ready: Vec::with_capacity(MAX_PENDING),
            bounce: vec![0; PAGE_SIZE].into_boxed_slice(),
            rxb: RxBatch::new(),
            txb: TxBatch::new(),
            unmaps: Unmaps {
                handles: Vec::with_capacity(MAX_PENDING),
                pending: Vec::with_capacity(MAX_PENDING),
                status: vec![Ok(()); MAX_PENDING],
            },
            pending: vec![Pending::default(); MAX_PENDING].into_boxed_slice(),
            pending_free: (0..MAX_PENDING as u16).rev().collect(),
            tx_armed: false,
            tx_check: TxCheckStats::default(),
            stats: VifStats::default(),
            disabled: None,
        })
    }

    /// The local end of the vif's event channel.
    pub fn port(&self) -> Port {
        self.port
    }
    /// The front end's domain.
    pub fn frontend(&self) -> DomId {
        self.fe
    }
    /// The index given at connection (high half of release tokens).
    pub fn index(&self) -> u16 {
        self.index
    }
    /// Counters.
    pub fn stats(&self) -> &VifStats {
        &self.stats
    }
    /// TX check counters (per tolerated and fatal reason).
    pub fn tx_check_stats(&self) -> &TxCheckStats {
        &self.tx_check
    }
    /// Why the vif stopped, if it did.
    pub fn disabled(&self) -> Option<Disabled> {
        self.disabled
    }
    /// The vif's name as Xen's toolstack gives it: `vif<front-end domain>.<handle>`.
    pub fn name(&self) -> String {
        format!("vif{}.{}", self.fe.0, self.handle)
    }

    /// How full its rings are.
    pub fn ring_occupancy(&self) -> RingOccupancy {
        RingOccupancy {
            tx: self.tx.occupancy(),
            rx: self.rx.occupancy(),
            size: self.tx.size(),
            tx_waiting: self.tx.occupancy().saturating_sub(self.tx.unanswered()),
            pending_free: self.pending_free.len() as u32,
        }
    }

    /// Grant reuse: the cache's counters, if the front end asked for it.
    pub fn cache_stats(&self) -> Option<&CacheStats> {
        self.cache.as_deref().map(GrantCache::stats)
    }
    /// Grant reuse: grants mapped in the cache now.
    pub fn cached_grants(&self) -> usize {
        self.cache.as_deref().map_or(0, GrantCache::len)
    }
    /// Grant reuse: the I/O address at which the cache holds `gref` mapped for the
    /// driver domain's devices, if it does.
    pub fn cached_at(&self, gref: u32) -> Option<hv::Iova> {
        let c = self.cache.as_deref()?;
        c.entry_of(gref).map(|k| hv::iommu::window_iova(c.slot(k)))
    }
    /// Whether the front end takes multi-slot packets (`feature-sg`).
    pub fn can_sg(&self) -> bool {
        self.can_sg
    }

    /// Has guest TX copy every slot into the back end's own pages with grant copies
    /// instead of mapping the pages beyond the header (off when connected, Linux's
    /// netback). For a back end to which a map costs more than a copy: a dom0 process,
    /// where a map is an ioctl and an `mmap` and its unmap the same again (QEMU's
    /// `xen_nic` copies too). Nothing then stays mapped, and every slot is answered
    /// when its packet is built, in ring order.
    pub fn set_tx_copy(&mut self, on: bool) {
        self.tx_copy = on;
    }

    /// Whether guest TX copies instead of mapping ([`Vif::set_tx_copy`]).
    pub fn tx_copy(&self) -> bool {
        self.tx_copy
    }

    /// Turns aligned guest-RX copies on or off (off when connected, the original
    /// netback): with them on, a packet starts in the guest's buffer at its source's
    /// offset within a cache line and the response's `offset` says where.
    pub fn set_aligned_copies(&mut self, on: bool) {
        self.aligned_copies = on;
    }

    /// Whether guest-RX copies are aligned.
    pub fn aligned_copies(&self) -> bool {
        self.aligned_copies
    }

    /// Packets waiting to be copied to the guest.
    pub fn rx_queued(&self) -> usize {
        self.rx_queue.len()
    }

    fn disable(&mut self, why: Disabled) {
        if self.disabled.is_none() {
            self.disabled = Some(why);
            let be = self.xen.id();
            let dir = xenbus::backend_dir(be, self.fe, self.handle);
            let _ = self
                .xen
                .store()
                .switch_state(be, &dir, XenbusState::Closing);
        }
    }

    fn notify(&mut self) {
        let _c = enter(Class::Hypercall);
        self.stats.notifies += 1;
        let _ = self.xen.evtchn_send(self.port);
    }

    /// The bridge hands a packet to the vif (`xenvif_start_xmit`): queued for the RX
    /// action, or dropped and counted if the queue is full or the vif is down.
    pub fn start_xmit(&mut self, pool: &mut SkbPool, skb: SkbId) {
        let _c = enter(Class::Netback);
        if self.disabled.is_some() {
            self.stats.dropped_disabled += 1;
            pool.free(skb);
            return;
        }
        // What the front end (and this vif's receive path) cannot take as it is, is
        // cut into frames or checksummed here, as Linux's `validate_xmit_skb` does for
        // a device without the feature.
        let off = pool.offload(skb);
        let whole = self.rx_carries_offload();
        let partial = matches!(off.csum, Csum::Partial { .. });
        if (off.gso.is_some() && !(whole && self.gso_rx)) || (partial && !(whole && self.csum_rx)) {
            self.rx_software_offload(pool, skb);
            return;
        }
        self.rx_enqueue(pool, skb);
    }

    fn rx_enqueue(&mut self, pool: &mut SkbPool, skb: SkbId) {
        if !self.can_sg && pool.len(skb) > MAX_TAGGED_FRAME {
            self.stats.rx_oversize += 1;
            pool.free(skb);
            return;
        }
        if let Err(skb) = self.rx_queue.push(pool, skb) {
            self.stats.rx_queue_full += 1;
            pool.free(skb);
        }
    }

    /// Whether this vif's receive path passes checksum and GSO metadata to the guest:
    /// the grant-copy path does; the guest-copy, direct-placement and grant-cache paths
    /// give frames as they are (their responses carry no extras).
    fn rx_carries_offload(&self) -> bool {
        self.guest_copy.is_none() && self.direct.is_none() && self.cache.is_none()
    }

    /// Software segmentation and checksumming for the guest: the packet is read into
    /// the scratch, freed, and its frames (with complete checksums) built in fresh
    /// buffers and queued. A packet whose headers do not bear it out, or that does not
    /// fit, is dropped and counted.
    fn rx_software_offload(&mut self, pool: &mut SkbPool, skb: SkbId) {
        let off = pool.offload(skb);
        let len = pool.len(skb);
        let mut scratch = std::mem::take(&mut self.offload_scratch);
        let (frame, out) = scratch.split_at_mut(MAX_OFFLOAD_LEN);
        let read = len <= MAX_OFFLOAD_LEN && pool.read(skb, 0, &mut frame[..len]).is_ok();
        pool.free(skb);
        let l4 = if read {
            crate::offload::checksum_setup(&frame[..len.min(MAX_HEADERS)], len).ok()
        } else {
            None
        };
        let frame = &mut frame[..len];
        match (l4, off.gso) {
            (Some(l4), Some(g)) => {
                let mut segs = 0;
                let r = crate::offload::segment_tcpv4(frame, &l4, g.size.into(), out, |f| {
                    segs += 1;
                    self.rx_enqueue_copy(pool, f);
                });
                if r.is_ok() {
                    self.stats.rx_gso_segmented += 1;
                    self.stats.rx_gso_segments += segs;
                } else {
                    self.stats.rx_offload_drops += 1;
                }
            }
            (Some(l4), None) => {
                if crate::offload::fill_partial(frame, l4.l4, l4.csum_offset).is_ok() {
                    self.stats.rx_csum_filled += 1;
                    self.rx_enqueue_copy(pool, frame);
                } else {
                    self.stats.rx_offload_drops += 1;
                }
            }
            (None, _) => self.stats.rx_offload_drops += 1,
        }
        self.offload_scratch = scratch;
    }

    /// Queues a copy of `frame` (complete checksums: marked valid) in a fresh buffer.
    fn rx_enqueue_copy(&mut self, pool: &mut SkbPool, frame: &[u8]) {
        let Ok(c) = pool.alloc(NET_SKB_PAD) else {
            self.stats.rx_offload_drops += 1;
            return;
        };
        if pool.append(c, frame).is_err() {
            pool.free(c);
            self.stats.rx_offload_drops += 1;
            return;
        }
        pool.set_csum_valid(c, true);
        self.rx_enqueue(pool, c);
    }

    /// Whether the RX action has work it can do now.
    pub fn rx_pending(&self) -> bool {
        self.disabled.is_none() && !self.rx_queue.is_empty()
    }

    /// Copies queued packets into buffers the guest posted, in batches of
    /// [`RX_BATCH`]. Returns the packets taken off the queue (delivered, or answered
    /// with an error and counted).
    ///
    /// Each batch goes through four stages, as Linux's `xenvif_rx_action`: **build**
    /// the grant copies of up to [`RX_BATCH`] packets into the requests they take;
    /// **flush** them as one `GNTTABOP_copy`; **check** each packet's copies and
    /// **respond** to its requests (a length, or an error); then notify once and free.
    pub fn rx_action(&mut self, pool: &mut SkbPool) -> usize {
        let _c = enter(Class::Netback);
        if self.guest_copy.is_some() {
            return self.rx_lend(pool);
        }
        if self.direct.is_some() {
            return self.rx_direct_copy(pool);
        }
        if self.cache.is_some() {
            return self.rx_cached_copy(pool);
        }
        let mut total = 0;
        while self.disabled.is_none() && !self.rx_queue.is_empty() {
            self.rxb.clear();
            self.rx_build(pool);
            if self.rxb.pkts.is_empty() {
                break;
            }
            self.rx_flush();
            self.rx_respond(pool);
            total += self.rxb.pkts.len();
        }
        total
    }

    /// The guest-copy RX action: takes the guest's posted slots (each a credit, and the
    /// return of whatever was lent through it), then lends a buffer per queued packet
    /// while credits last, answering each slot with the packet's offset and length in
    /// the lent buffer. Returns the packets taken off the queue.
    fn rx_lend(&mut self, pool: &mut SkbPool) -> usize {
        let Some(gc) = self.guest_copy.as_mut() else {
            return 0;
        };
        let gt = self.xen.domain().grant_table();
        let mut broken = false;
        // Credits and returns.
        loop {
            let req = match self.rx.take_request() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(_) => {
                    broken = true;
                    break;
                }
            };
            take_credit(gc, &gt, pool, req, &mut self.rx, &mut self.stats);
        }
        gc.end_pending(&gt, pool);
        let mut n = 0;
        loop {
            // The pieces of the packet at the head of the queue. Bytes in another
            // guest's page are passed on only while this guest holds few of them: each
            // holds a sender's TX buffer until this guest copies.
            let foreign_ok = gc.transitive_held + RX_COPY_MAX_SLOTS <= RX_TRANSITIVE_MAX;
            let pieces = self
                .rx_queue
                .peek()
                .map(|skb| Pieces::of(pool, skb, foreign_ok));
            let need = pieces.as_ref().map_or(1, Pieces::slots);
            let waiting = gc.credits.len() < need
                || (gc.order.len() + need > RX_LENT_MAX
                    && self.rx_queue.bytes() + MAX_TAGGED_FRAME <= RX_QUEUE_BYTES);
            if waiting && !self.rx_queue.is_empty() {
                // Out of credits, or the guest holds as much as it may while the queue
                // behind it has room (the packet waits, as for a guest that posts no
                // buffers): arm `req_event` and look once more, so that the guest's
                // next post, a credit or a return, wakes this vif.
                match self.rx.final_check_for_at_least(1) {
                    Ok(true) => match self.rx.take_request() {
                        Ok(Some(req)) => {
                            take_credit(gc, &gt, pool, req, &mut self.rx, &mut self.stats);
                            continue;
                        }
                        _ => break,
                    },
                    Ok(false) => {
                        if gc.credits.len() < need {
                            self.stats.rx_stalls += 1;
                        } else {
                            self.stats.rx_lent_full += 1;
                        }
                        break;
                    }
                    Err(_) => {
                        broken = true;
                        break;
                    }
                }
            }
            let Some(pieces) = pieces else {
                break;
            };
            if gc.credits.len() < need {
                break;
            }
            // The guest holds as much as it may and the queue behind it is full: it is
            // not copying. netback takes back its oldest pieces (their packets are lost
            // to it, counted), unless the guest is copying from one this moment: an
            // in-use grant cannot be revoked.
            let mut room = true;
            while gc.order.len() + need > RX_LENT_MAX {
                let Some(old) = gc.order.front() else {
                    break;
                };
                if gt.end_access(GrantRef(gc.base.0 + u32::from(old))).is_err() {
                    self.stats.rx_lent_full += 1;
                    room = false;
                    break;
                }
                gc.order.pop_front();
                if let Some(s) = gc.lent[old as usize].take() {
                    if gc.unlink(old) {
                        pool.free(s);
                    }
                }
                self.stats.rx_revoked += 1;
            }
            if !room {
                break;
            }
            let Some(skb) = self.rx_queue.pop(pool) else {
                break;
            };
            n += 1;
            // A packet whose bytes are in more pieces than a response chain carries is
            // copied into one local buffer first.
            let (skb, pieces) = match pieces {
                Pieces::Lend(p) => (skb, p),
                Pieces::Linearize => {
                    let Some(c) = local_linear(pool, skb, &mut self.stats.rx_linearized) else {
                        self.stats.rx_copy_errors += 1;
                        continue;
                    };
                    let (gfn, off) = pool.data_location(c);
                    let mut p = PieceList::default();
                    p.push(Piece {
                        page: SegPage::Own(gfn),
                        offset: off as u16,
                        len: pool.len(c) as u16,
                    });
                    (c, p)
                }
            };
            // One slot and one grant per piece: a sub-page of the driver domain's own
            // page, or, for bytes in a page another guest granted (a frame it sent),
            // a windowed transitive grant of that guest's grant: no copy.
            let ids = &gc.credits[gc.credits.len() - pieces.len..];
            let mut granted = 0;
            for (piece, &id) in pieces.iter().zip(ids) {
                let r = GrantRef(gc.base.0 + u32::from(id));
                let ok = match piece.page {
                    SegPage::Own(gfn) => gt
                        .grant_access_subpage(r, self.fe, gfn, piece.offset, piece.len, true)
                        .is_ok(),
                    SegPage::Window { grant, .. } => gt
                        .grant_access_transitive_window(
                            r,
                            self.fe,
                            grant,
                            piece.offset,
                            piece.len,
                            true,
                        )
                        .is_ok(),
                };
                if !ok {
                    break;
                }
                granted += 1;
            }
            if granted < pieces.len {
                // Cannot happen for a valid buffer; undo what was granted.
                for &id in &ids[..granted] {
                    let _ = gt.end_access(GrantRef(gc.base.0 + u32::from(id)));
                }
                self.stats.rx_copy_errors += 1;
                pool.free(skb);
                continue;
            }
            let first = gc.credits.len() - pieces.len;
            let flags = if pool.csum_valid(skb) {
                NETRXF_DATA_VALIDATED
            } else {
                0
            };
            for (k, piece) in pieces.iter().enumerate() {
                let id = gc.credits[first + k];
                let next = gc.credits[first + (k + 1) % pieces.len];
                let _ = gc.credited.complete(id);
                gc.lent[id as usize] = Some(skb);
                gc.piece_next[id as usize] = next;
                gc.order.push_back(id);
                if matches!(piece.page, SegPage::Window { .. }) {
                    gc.transitive[id as usize] = true;
                    gc.transitive_held += 1;
                    self.stats.rx_transitive += 1;
                }
                let more = if k + 1 < pieces.len {
                    NETRXF_MORE_DATA
                } else {
                    0
                };
                // Cannot fail: one response per request taken.
                let _ = self.rx.push_response(&RxResponse {
                    id,
                    offset: piece.offset,
                    flags: if k == 0 { flags | more } else { more },
                    status: piece.len as i16,
                });
            }
            gc.credits.truncate(first);
            self.stats.rx_lent += 1;
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += pool.len(skb) as u64;
        }
        if broken {
            self.disable(Disabled::RingBroken);
            return n;
        }
        if self.rx.push_responses_and_check_notify() {
            self.notify();
        }
        n
    }

    /// Build: takes packets off the queue while the guest has posted enough buffers
    /// for each, and adds their copies to the batch.
    fn rx_build(&mut self, pool: &mut SkbPool) {
        while self.rxb.pkts.len() < RX_BATCH {
            let Some(skb) = self.rx_queue.peek() else {
                break;
            };
            // Aligned copies (paper 000 §3.4.1) start the packet in the guest's page at
            // the source's offset within a cache line, so that both share it.
            let start = if self.aligned_copies {
                pool.first_offset(skb) % CACHE_LINE
            } else {
                0
            };
            let off = pool.offload(skb);
            let gso = off.gso.filter(|_| self.gso_rx);
            let blank = matches!(off.csum, Csum::Partial { .. }) && self.csum_rx;
            let need = (rx_pages(pool.len(skb), start) + usize::from(gso.is_some())) as u32;
            // All the buffers the packet needs, or wait for the guest's next post (the
            // check arms `req_event`). Asking again without an event would get the
            // same answer, so a short ring ends the batch: looping on it was a hang.
            match self.rx.final_check_for_at_least(need) {
                Ok(true) => {}
                Ok(false) => {
                    self.stats.rx_stalls += 1;
                    break;
                }
                Err(_) => {
                    self.disable(Disabled::RingBroken);
                    break;
                }
            }
            let _ = self.rx_queue.pop(pool);
            let built = self.rxb.add(
                &mut self.rx,
                pool,
                (skb, start, gso, blank),
                self.fe,
                &mut self.stats.rx_copy_bytes,
            );
            self.stats.rx_from_grants += u64::from(built.foreign);
            if built.broken {
                self.disable(Disabled::RingBroken);
                break;
            }
        }
    }

    /// Flush: one hypercall performs every copy of the batch.
    fn rx_flush(&mut self) {
        let n = self.rxb.copies.len();
        if n > 0 {
            let _h = enter(Class::Hypercall);
            self.xen
                .grant_copy(&self.rxb.copies, &mut self.rxb.status[..n]);
        }
    }

    /// Check and respond: a packet whose copies all succeeded is answered with the
    /// bytes each request's buffer holds; any other with an error on every request it
    /// took. Then one notification, and the buffers go back to the pool.
    fn rx_respond(&mut self, pool: &mut SkbPool) {
        let b = &self.rxb;
        for p in &b.pkts {
            let ok = p.ops > 0 && b.status[p.ops_at()].iter().all(|s| s.is_ok());
            if ok {
                self.stats.rx_packets += 1;
                self.stats.rx_bytes += pool.len(p.skb) as u64;
            } else if p.ops > 0 {
                self.stats.rx_copy_errors += 1;
            }
            if ok && p.gso.is_some() {
                self.stats.rx_gso_packets += 1;
            }
            for (j, m) in b.meta[p.metas_at()].iter().enumerate() {
                // The GSO extra, in the second slot: only for a packet that went; a
                // failed one's extra request is answered with an error like the rest.
                if let (1, Some(g), true) = (j, p.gso, ok) {
                    let _ = self
                        .rx
                        .push_response(&ExtraInfo::gso(g.size, g.ty, false).to_rx_slot());
                    continue;
                }
                let mut flags = 0;
                if j == 0 && p.blank && ok {
                    flags |= NETRXF_CSUM_BLANK | NETRXF_DATA_VALIDATED;
                } else if j == 0 && p.csum {
                    flags |= NETRXF_DATA_VALIDATED;
                }
                if j == 0 && ok && p.gso.is_some() {
                    flags |= NETRXF_EXTRA_INFO;
                }
                // More data follows unless this is the last data slot (a packet of one
                // data slot and an extra has none after it).
                let data_after = if j == 0 && p.gso.is_some() && ok {
                    p.metas > 2
                } else {
                    j + 1 < p.metas
                };
                if data_after {
                    flags |= NETRXF_MORE_DATA;
                }
                let status = if ok {
                    m.size as i16
                } else {
                    XEN_NETIF_RSP_ERROR
                };
                // Cannot fail: one response per request taken.
                let _ = self.rx.push_response(&RxResponse {
                    id: m.id,
                    offset: m.offset,
                    flags,
                    status,
                });
            }
        }
        if self.rx.push_responses_and_check_notify() {
            self.notify();
        }
        let _m = enter(Class::Mem);
        for p in &self.rxb.pkts {
            pool.free(p.skb);
        }
    }

    /// Takes the guest's transmitted packets (at most `budget` chains), builds them and
    /// hands each valid one to `deliver` (the bridge). Returns the packets delivered.
    ///
    /// Four stages, as Linux's `xenvif_tx_action`: **build** reads and checks each
    /// chain and lays out its header copy and page maps; **flush** issues them as one
    /// `GNTTABOP_copy` and one `GNTTABOP_map_grant_ref`; **check** each packet's
    /// results; **respond**: a packet whose grants all worked is assembled and
    /// delivered, any other answered with errors and its buffers freed.
    pub fn tx_action(
        &mut self,
        pool: &mut SkbPool,
        budget: usize,
        mut deliver: impl FnMut(&mut SkbPool, SkbId),
    ) -> usize {
        let _c = enter(Class::Netback);
        if self.disabled.is_some() {
            return 0;
        }
        self.txb.clear();
        // A ring or fatal error ends the build, but the packets already built go on
        // through the later stages: their buffers and maps are then released and their
        // requests answered as usual (returning early leaked them).
        self.tx_build(pool, budget);
        self.tx_flush();
        let mut delivered = 0;
        let mut ready = std::mem::take(&mut self.tx_ready);
        for skb in ready.drain(..) {
            if self.tx_offload(pool, skb) {
                self.stats.tx_packets += 1;
                self.stats.tx_bytes += pool.len(skb) as u64;
                delivered += 1;
                deliver(pool, skb);
            }
        }
        self.tx_ready = ready;
        for k in 0..self.txb.pkts.len() {
            if let Some(skb) = self.tx_complete(pool, k) {
                if self.tx_offload(pool, skb) {
                    self.stats.tx_packets += 1;
                    self.stats.tx_bytes += pool.len(skb) as u64;
                    delivered += 1;
                    deliver(pool, skb);
                }
            }
        }
        if self.txb.responses && self.tx.push_responses_and_check_notify() {
            self.notify();
        }
        delivered
    }

    /// Checks an assembled guest packet's offload against its headers (netback's
    /// `xenvif_set_skb_gso` and `checksum_setup`): a blank checksum is located, a GSO
    /// packet sent without one is made partial (Linux's GSO checksum fix-up), and GSO
    /// must be TCP over IPv4 with segments no longer than a frame. A packet that fails
    /// is dropped and counted by reason; its slots are answered as its buffer is freed.
    fn tx_offload(&mut self, pool: &mut SkbPool, skb: SkbId) -> bool {
        let off = pool.offload(skb);
        let partial = matches!(off.csum, Csum::Partial { .. });
        if off.gso.is_none() && !partial {
            return true;
        }
        let mut head = [0u8; MAX_HEADERS];
        let r = crate::offload::locate(pool, skb, off.gso, &mut head).and_then(|l4| {
            if !partial {
                // The pseudo-header sum goes into the field, in the copied head.
                let sum = crate::offload::pseudo_sum(&head, &l4);
                pool.write_linear(skb, l4.l4 + l4.csum_offset, &sum.to_be_bytes())
                    .map_err(|_| OffloadError::Truncated)?;
                self.stats.tx_gso_csum_fixups += 1;
            }
            Ok(l4)
        });
        match r {
            Ok(l4) => {
                pool.set_offload(
                    skb,
                    Offload {
                        csum: l4.partial(),
                        gso: off.gso,
                    },
                );
                self.stats.tx_gso_packets += u64::from(off.gso.is_some());
                true
            }
            Err(e) => {
                self.stats.tx_offload_errors.add(e);
                pool.free(skb);
                false
            }
        }
    }

    /// Build: reads chains while the budget lasts and a chain's worth of pending
    /// entries is free. Every chain consumed counts against the budget, dropped ones
    /// too: answering a bad chain costs as much as building a packet, and a front end
    /// that keeps its ring full of them must not hold this vCPU.
    fn tx_build(&mut self, pool: &mut SkbPool, budget: usize) {
        let mut chains = 0;
        if self.pending_free.len() < FATAL_SKB_SLOTS {
            self.stats.tx_pending_stalls += 1;
        }
        // One chain for the whole action, read into in place: a chain is a few hundred
        // bytes, and moving one per packet cost more than reading it.
        let mut chain = TxChain::empty();
        while chains < budget
            && self.pending_free.len() >= FATAL_SKB_SLOTS
            && self.txb.copies.len() + FATAL_SKB_SLOTS < TX_COPIES_MAX
        {
            self.tx_prefetch(TX_PREFETCH);
            let Some(verdict) = self.tx_take_chain(&mut chain) else {
                break;
            };
            chains += 1;
            self.tx_check.count_judgement(verdict);
            match verdict {
                TxJudgement::Fatal(r) => {
                    self.disable(Disabled::Fatal(r));
                    break;
                }
                TxJudgement::Drop(_) => self.tx_answer(&chain, XEN_NETIF_RSP_ERROR),
                TxJudgement::Packet if self.cache.is_some() => self.tx_build_cached(pool, &chain),
                TxJudgement::Packet if self.tx_copy => self.tx_build_copied(pool, &chain),
                TxJudgement::Packet => self.tx_build_packet(pool, &chain),
            }
        }
    }

    /// With the grant cache, prefetches the first line of the bytes that the request
    /// `ahead` slots on names, if it is published and its grant is mapped: the guest
    /// wrote that line on its core, and the header copy reads it. Only a hint; the
    /// request is judged when taken.
    fn tx_prefetch(&self, ahead: u32) {
        let Some(cache) = self.cache.as_deref() else {
            return;
        };
        let Some(req) = self.tx.peek_request(ahead) else {
            return;
        };
        if let Some(page) = cache.entry_of(req.gref).and_then(|k| cache.page(k)) {
            page.prefetch(usize::from(req.offset), false);
        }
    }

    /// The next chain on the ring, copied out and checked; `None` when the ring is
    /// empty (with `req_event` armed) or broken (the vif disabled).
    fn tx_take_chain(&mut self, chain: &mut TxChain) -> Option<TxJudgement> {
        let avail = loop {
            match self.tx.requests_available() {
                Ok(0) => match self.tx.final_check_for_requests() {
                    Ok(true) => continue,
                    Ok(false) => {
                        self.tx_armed = true;
                        return None;
                    }
                    Err(_) => break None,
                },
                Ok(a) => break Some(a),
                Err(_) => break None,
            }
        };
        self.tx_armed = false;
        let first = avail.and_then(|_| self.tx.take_request().ok().flatten());
        let (Some(avail), Some(first)) = (avail, first) else {
            self.disable(Disabled::RingBroken);
            return None;
        };
        let tx = &mut self.tx;
        Some(read_tx_packet_into(
            chain,
            first,
            avail as usize - 1,
            || tx.take_request().ok().flatten(),
        ))
    }

    /// Answers every slot of a chain not built into a packet.
    fn tx_answer(&mut self, chain: &TxChain, status: i16) {
        for r in chain.responses(status) {
            let _ = self.tx.push_response(&r);
        }
        self.txb.responses = true;
    }

    /// Queues the grant copy of a chain's first `copy_len` bytes (of its first slot
    /// `s0`) into `skb`'s linear area; its index among the batch's copies.
    fn tx_copy_header(
        &mut self,
        pool: &SkbPool,
        s0: &crate::netif::TxSlot,
        copy_len: usize,
        skb: SkbId,
    ) -> usize {
        let (hg, hoff) = pool.data_location(skb);
        self.txb.copies.push(GrantCopy {
            source: CopyPtr::Gref {
                dom: self.fe,
                gref: GrantRef(s0.gref),
                offset: s0.offset,
            },
            dest: CopyPtr::Local {
                gfn: hg,
                offset: hoff as u16,
            },
            len: copy_len as u16,
        });
        self.txb.copies.len() - 1
    }

    /// Lays out one valid chain: a buffer (two when the maps overflow one buffer's
    /// fragments), the copy of its first [`TX_COPY_LEN`] bytes, and a map per page
    /// beyond them, each with a pending entry.
    fn tx_build_packet(&mut self, pool: &mut SkbPool, chain: &TxChain) {
        let Some((s0, copy_len, skb, overflow)) = self.tx_layout(pool, chain) else {
            return;
        };
        let slots = chain.slots();
        let copy_op = self.tx_copy_header(pool, &s0, copy_len, skb);
        let b = &mut self.txb;
        let first_map = b.maps.len();
        let copied_id = if s0.len as usize > copy_len {
            let c = copy_len as u16;
            self.tx_map_slot(s0.gref, s0.id, s0.offset + c, s0.len - c);
            None
        } else {
            Some(s0.id)
        };
        for s in &slots[1..] {
            self.tx_map_slot(s.gref, s.id, s.offset, s.len);
        }
        let b = &mut self.txb;
        b.pkts.push(TxPkt {
            skb,
            overflow,
            copy_op,
            copy_len,
            first_map,
            maps: b.maps.len() - first_map,
            copied_id,
            extras: chain.extras,
            first_page: 0,
            pages: 0,
            first_id: 0,
            ids: 0,
        });
    }

    /// Copy mode: lays out one valid chain as [`Vif::tx_build_packet`] does, but every
    /// byte beyond the header copy is grant-copied into a page of the back end's own
    /// (one copy per slot), so nothing stays mapped and every slot is answered when the
    /// batch's copies are checked, in ring order. Without pages, the chain is answered
    /// with errors and counted.
    fn tx_build_copied(&mut self, pool: &mut SkbPool, chain: &TxChain) {
        let Some((s0, copy_len, skb, overflow)) = self.tx_layout(pool, chain) else {
            return;
        };
        let slots = chain.slots();
        let fe = self.fe;
        let copy_op = self.tx_copy_header(pool, &s0, copy_len, skb);
        let b = &mut self.txb;
        let (first_page, first_id) = (b.pages.len(), b.ids.len());
        let c = copy_len as u16;
        let tail = (s0.len > c).then_some((s0.gref, s0.offset + c, s0.len - c));
        let rest = slots[1..].iter().map(|s| (s.gref, s.offset, s.len));
        let mut ok = true;
        for (gref, offset, len) in tail.into_iter().chain(rest) {
            let Ok(gfn) = pool.alloc_page() else {
                ok = false;
                break;
            };
            b.copies.push(GrantCopy {
                source: CopyPtr::Gref {
                    dom: fe,
                    gref: GrantRef(gref),
                    offset,
                },
                dest: CopyPtr::Local { gfn, offset: 0 },
                len,
            });
            b.pages.push(TxCopied { gfn, len });
        }
        if !ok {
            for p in b.pages.drain(first_page..) {
                pool.free_page(p.gfn);
            }
            b.copies.truncate(copy_op);
            pool.free(skb);
            if let Some(o) = overflow {
                pool.free(o);
            }
            self.stats.tx_no_buffer += 1;
            self.tx_answer(chain, XEN_NETIF_RSP_ERROR);
            return;
        }
        b.ids.extend(slots.iter().map(|s| s.id));
        b.pkts.push(TxPkt {
            skb,
            overflow,
            copy_op,
            copy_len,
            first_map: b.maps.len(),
            maps: 0,
            copied_id: None,
            extras: chain.extras,
            first_page,
            pages: b.pages.len() - first_page,
            first_id,
            ids: slots.len(),
        });
    }

    /// A valid chain's layout: its first slot, the bytes of it copied into the linear
    /// area, and the buffers. Pages beyond the copy: every slot after the first, and
    /// the first one's tail. The legal maximum (`LEGACY_SLOTS_MAX`) with a long first
    /// slot is one more than a buffer's fragments; the rest go on a second buffer on the
    /// fragment list, as Linux netback's `frag_overflow` does. Without a buffer, the
    /// chain is answered with errors and counted.
    fn tx_layout(
        &mut self,
        pool: &mut SkbPool,
        chain: &TxChain,
    ) -> Option<(crate::netif::TxSlot, usize, SkbId, Option<SkbId>)> {
        let slots = chain.slots();
        let s0 = slots[0];
        let copy_len = (s0.len as usize).min(TX_COPY_LEN);
        let maps = slots.len() - 1 + usize::from(s0.len as usize > copy_len);
        let Some((skb, overflow)) = Self::tx_buffers(pool, maps) else {
            self.stats.tx_no_buffer += 1;
            self.tx_answer(chain, XEN_NETIF_RSP_ERROR);
            return None;
        };
        pool.set_offload(skb, chain_offload(chain));
        Some((s0, copy_len, skb, overflow))
    }

    /// The buffer for a packet of `maps` mapped pages: one, or two when the maps
    /// overflow one buffer's fragments.
    fn tx_buffers(pool: &mut SkbPool, maps: usize) -> Option<(SkbId, Option<SkbId>)> {
        match pool.alloc(NET_SKB_PAD) {
            Ok(skb) if maps > MAX_SKB_FRAGS => match pool.alloc(0) {
                Ok(o) => Some((skb, Some(o))),
                Err(_) => {
                    pool.free(skb);
                    None
                }
            },
            Ok(skb) => Some((skb, None)),
            Err(_) => None,
        }
    }

    /// Grant reuse: builds one valid chain through the grant cache. Every slot's
    /// grant is looked up (mapped only on a miss); the first [`TX_COPY_LEN`] bytes
    /// are copied out of the first slot's mapping into a fresh buffer's linear area,
    /// and every page beyond them is attached as a fragment read through its mapping.
    /// A slot's entry is released when the packet has left ([`Vif::tx_release`]), and
    /// stays mapped. When every grant hits, no hypercall at all.
    fn tx_build_cached(&mut self, pool: &mut SkbPool, chain: &TxChain) {
        let Some((s0, copy_len, skb, overflow)) = self.tx_layout(pool, chain) else {
            return;
        };
        let slots = chain.slots();
        let free_bufs = |pool: &mut SkbPool| {
            pool.free(skb);
            if let Some(o) = overflow {
                pool.free(o);
            }
        };
        let (xen, dom) = (&self.xen, self.xen.domain());
        let Some(cache) = self.cache.as_mut() else {
            free_bufs(pool);
            return;
        };
        let mut ks = [0u16; FATAL_SKB_SLOTS];
        let mut got = 0;
        for s in slots {
            match cache.acquire(xen, s.gref, false) {
                Ok(k) => {
                    ks[got] = k;
                    got += 1;
                }
                Err(_) => break,
            }
        }
        // The header, out of the first slot's mapping.
        let (hg, hoff) = pool.data_location(skb);
        let copied = got == slots.len() && {
            let _c = enter(Class::GrantCopy);
            let off = usize::from(s0.offset);
            match cache.page(ks[0]) {
                Some(page) => dom.copy_from_page(page, off, hg, hoff, copy_len),
                None => dom.copy_from_window(cache.slot(ks[0]), off, hg, hoff, copy_len),
            }
            .is_ok()
                && pool.extend_linear(skb, copy_len).is_ok()
        };
        if !copied {
            for &k in &ks[..got] {
                cache.release(xen, k);
            }
            self.stats.tx_grant_errors += 1;
            self.tx_answer(chain, XEN_NETIF_RSP_ERROR);
            free_bufs(pool);
            return;
        }
        for _ in 0..chain.extras {
            let _ = self.tx.push_response(&TxResponse {
                id: 0,
                status: crate::netif::XEN_NETIF_RSP_NULL,
            });
        }
        self.txb.responses = true;
        // The pieces read through their mappings: the first slot's tail, if any, and
        // every later slot.
        let first_whole = s0.len as usize <= copy_len;
        if first_whole {
            cache.release(xen, ks[0]);
            let _ = self.tx.push_response(&TxResponse {
                id: s0.id,
                status: XEN_NETIF_RSP_OKAY,
            });
        }
        let c = copy_len as u16;
        let pieces = slots
            .iter()
            .zip(&ks[..got])
            .enumerate()
            .filter_map(|(j, (s, &k))| match j {
                0 if first_whole => None,
                0 => Some((s, k, s.offset + c, s.len - c)),
                _ => Some((s, k, s.offset, s.len)),
            });
        let mut ok = true;
        for (j, (s, k, offset, len)) in pieces.enumerate() {
            let p = take_pending(&mut self.pending, &mut self.pending_free, s.id, Some(k));
            let to = match overflow {
                Some(o) if j >= MAX_SKB_FRAGS => o,
                _ => skb,
            };
            let frag = Frag {
                page: FragPage::Foreign {
                    slot: cache.slot(k),
                    token: u32::from(self.index) << 16 | u32::from(p),
                    grant: (self.fe, GrantRef(s.gref)),
                },
                offset,
                len,
            };
            // Cannot fail for a chain read_tx_packet passed; if it did, the slot is
            // answered now rather than leaked, and the packet dropped.
            if pool.add_frag(to, frag).is_err() {
                self.pending[p as usize].cached = None;
                cache.release(xen, k);
                self.pending_free.push(p);
                let _ = self.tx.push_response(&TxResponse {
                    id: s.id,
                    status: XEN_NETIF_RSP_ERROR,
                });
                ok = false;
            }
        }
        if let Some(o) = overflow {
            pool.append_frag_list(skb, o);
        }
        if ok {
            self.tx_ready.push(skb);
        } else {
            pool.free(skb);
        }
    }

    /// One mapped slot: a pending entry, a map op, and the bytes of the page it
    /// contributes.
    fn tx_map_slot(&mut self, gref: u32, id: u16, offset: u16, len: u16) {
        let p = take_pending(&mut self.pending, &mut self.pending_free, id, None);
        self.txb.maps.push(MapOp {
            dom: self.fe,
            gref: GrantRef(gref),
            readonly: true,
            slot: self.slot_base + 2 + p as u32,
        });
        self.txb.mapped.push(TxMapped {
            pending: p,
            offset,
            len,
        });
    }

    /// Flush: one copy hypercall for every header, one map hypercall for every page.
    fn tx_flush(&mut self) {
        let b = &mut self.txb;
        let (nc, nm) = (b.copies.len(), b.maps.len());
        if nc > 0 {
            let _h = enter(Class::Hypercall);
            self.xen.grant_copy(&b.copies, &mut b.copy_status[..nc]);
        }
        if nm > 0 {
            let _h = enter(Class::Hypercall);
            self.xen.grant_map(&b.maps, &mut b.map_results[..nm]);
        }
    }

    /// Check and respond for packet `k` of the batch: records its map handles and
    /// answers its extras; then either assembles it (header in the linear area, each
    /// mapped page a foreign fragment) and returns it for delivery, or, if a grant
    /// failed, answers every slot with an error and frees its buffers.
    fn tx_complete(&mut self, pool: &mut SkbPool, k: usize) -> Option<SkbId> {
        let p = self.txb.pkts[k];
        let b = &self.txb;
        let copy_ok = b.copy_status[p.copies_at()].iter().all(|s| s.is_ok());
        let maps_ok = b.map_results[p.maps_at()].iter().all(|r| r.is_ok());
        for (m, r) in b.mapped[p.maps_at()]
            .iter()
            .zip(&b.map_results[p.maps_at()])
        {
            self.pending[m.pending as usize].handle = r.ok();
        }
        // Extras are answered now, whatever happens to the packet.
        for _ in 0..p.extras {
            let _ = self.tx.push_response(&TxResponse {
                id: 0,
                status: crate::netif::XEN_NETIF_RSP_NULL,
            });
        }
        self.txb.responses |= p.extras > 0 || p.copied_id.is_some();
        let status = if copy_ok && maps_ok {
            XEN_NETIF_RSP_OKAY
        } else {
            XEN_NETIF_RSP_ERROR
        };
        if let Some(id) = p.copied_id {
            let _ = self.tx.push_response(&TxResponse { id, status });
        }
        // Copy mode: every slot is answered now, in ring order.
        for i in p.first_id..p.first_id + p.ids {
            let id = self.txb.ids[i];
            let _ = self.tx.push_response(&TxResponse { id, status });
            self.txb.responses = true;
        }
        if !(copy_ok && maps_ok) {
            self.stats.tx_grant_errors += 1;
            for j in p.maps_at() {
                self.release_pending(self.txb.mapped[j].pending, XEN_NETIF_RSP_ERROR);
            }
            self.txb.responses = true;
            for j in p.pages_at() {
                pool.free_page(self.txb.pages[j].gfn);
            }
            pool.free(p.skb);
            if let Some(o) = p.overflow {
                pool.free(o);
            }
            return None;
        }
        let _ = pool.extend_linear(p.skb, p.copy_len);
        let mut ok = true;
        for (j, at) in p.pages_at().enumerate() {
            let c = self.txb.pages[at];
            let to = match p.overflow {
                Some(o) if j >= MAX_SKB_FRAGS => o,
                _ => p.skb,
            };
            let frag = Frag {
                page: FragPage::Local(c.gfn),
                offset: 0,
                len: c.len,
            };
            // As for a map below: cannot fail for a chain that passed; if it did, the
            // page goes back and the packet is dropped (its slots are answered above).
            if pool.add_frag(to, frag).is_err() {
                pool.free_page(c.gfn);
                ok = false;
            }
        }
        for (j, at) in p.maps_at().enumerate() {
            let m = self.txb.mapped[at];
            let to = match p.overflow {
                Some(o) if j >= MAX_SKB_FRAGS => o,
                _ => p.skb,
            };
            let frag = Frag {
                page: FragPage::Foreign {
                    slot: self.slot_base + 2 + m.pending as u32,
                    token: (self.index as u32) << 16 | m.pending as u32,
                    grant: (self.fe, self.txb.maps[at].gref),
                },
                offset: m.offset,
                len: m.len,
            };
            // Cannot fail for a chain read_tx_packet passed (each slot within its
            // page, and room counted above); if it did, the slot is answered now
            // rather than leaked, and the packet dropped.
            if pool.add_frag(to, frag).is_err() {
                self.release_pending(m.pending, XEN_NETIF_RSP_ERROR);
                self.txb.responses = true;
                ok = false;
            }
        }
        if let Some(o) = p.overflow {
            pool.append_frag_list(p.skb, o);
        }
        if !ok {
            pool.free(p.skb);
            return None;
        }
        Some(p.skb)
    }

    /// Answers the requests of mapped slots whose buffers were freed (`token`s from the
    /// pool's release queue that belong to this vif), unmapping them in one batch.
    pub fn tx_release(&mut self, tokens: impl IntoIterator<Item = u32>) {
        let _c = enter(Class::Netback);
        self.unmaps.handles.clear();
        self.unmaps.pending.clear();
        let mut cached_answers = false;
        for t in tokens {
            if t >> 16 != self.index as u32 {
                continue;
            }
            let pi = (t & 0xffff) as u16;
            // A slot read through the grant cache: its mapping stays.
            if let Some(k) = self
                .pending
                .get_mut(pi as usize)
                .and_then(|p| p.cached.take())
            {
                if let Some(c) = self.cache.as_mut() {
                    c.release(&self.xen, k);
                }
                self.pending_free.push(pi);
                if self.disabled.is_none() {
                    let _ = self.tx.push_response(&TxResponse {
                        id: self.pending[pi as usize].id,
                        status: XEN_NETIF_RSP_OKAY,
                    });
                    cached_answers = true;
                }
                continue;
            }
            // Taken, not read: a token seen twice must not free its entry twice.
            if let Some(h) = self
                .pending
                .get_mut(pi as usize)
                .and_then(|p| p.handle.take())
            {
                self.unmaps.handles.push(h);
                self.unmaps.pending.push(pi);
            }
        }
        let n = self.unmaps.handles.len();
        if n == 0 {
            if cached_answers && self.tx.push_responses_and_check_notify() {
                self.notify();
            }
            return;
        }
        {
            let _h = enter(Class::Hypercall);
            self.xen
                .grant_unmap(&self.unmaps.handles, &mut self.unmaps.status[..n]);
        }
        for k in 0..n {
            let pi = self.unmaps.pending[k];
            let id = self.pending[pi as usize].id;
            self.pending_free.push(pi);
            if self.disabled.is_none() {
                let _ = self.tx.push_response(&TxResponse {
                    id,
                    status: XEN_NETIF_RSP_OKAY,
                });
            }
        }
        if self.disabled.is_none() && self.tx.push_responses_and_check_notify() {
            self.notify();
        }
    }

    fn release_pending(&mut self, pi: u16, status: i16) {
        let p = self.pending[pi as usize];
        if let Some(h) = p.handle {
            let mut st = [Ok(())];
            self.xen.grant_unmap(&[h], &mut st);
        }
        if let (Some(k), Some(c)) = (p.cached, self.cache.as_mut()) {
            c.release(&self.xen, k);
        }
        self.pending[pi as usize].handle = None;
        self.pending[pi as usize].cached = None;
        self.pending_free.push(pi);
        let _ = self.tx.push_response(&TxResponse { id: p.id, status });
    }

    /// Whether the guest has published TX requests not yet taken. When there are none
    /// and `req_event` went stale (a build that stopped early), it is armed and the ring
    /// looked at once more (`RING_FINAL_CHECK_FOR_REQUESTS`, as Linux's netback does
    /// before it stops polling): the front end then signals its next request. Without
    /// it, a vif that ran out of pending entries and then found its ring empty slept
    /// through every request the front end added after, until some other event came.
    pub fn tx_pending(&mut self) -> bool {
        if self.disabled.is_some() {
            return false;
        }
        match self.tx.requests_available() {
            Ok(0) if !self.tx_armed => match self.tx.final_check_for_requests() {
                Ok(more) => {
                    self.tx_armed = !more;
                    more
                }
                Err(_) => false,
            },
            Ok(n) => n > 0,
            Err(_) => false,
        }
    }

    /// Tears the vif down: frees its queue, unmaps whatever it still maps (answering
    /// nothing more), rings included, and closes its channel. The vif is gone after:
    /// its rings are dropped before their pages are unmapped, since a ring holds its
    /// page open and a held page cannot be unmapped.
    pub fn disconnect(mut self, pool: &mut SkbPool) {
        self.disable(Disabled::Disconnected);
        self.rx_queue.purge(pool);
        self.direct_teardown();
        let ctrl_ring = self.cache_teardown();
        if let Some(gc) = self.guest_copy.as_mut() {
            let gt = self.xen.domain().grant_table();
            for id in 0..RING_IDS {
                if let Some(skb) = gc.lent[id as usize].take() {
                    end_lent(&gt, gc, pool, id, skb, false);
                }
            }
            // A copy in flight ends within a hypercall: wait for it, since a buffer
            // freed under a grant would show the guest the buffer's next packet.
            for _ in 0..1000 {
                gc.end_pending(&gt, pool);
                if gc.ending.is_empty() {
                    break;
                }
                std::thread::yield_now();
            }
            if gc.ending.is_empty() {
                for i in 0..u32::from(RING_IDS) {
                    gt.free_ref(GrantRef(gc.base.0 + i));
                }
            }
        }
        let held: Vec<GrantHandle> = self
            .pending
            .iter()
            .filter_map(|p| p.handle)
            .chain(self.ring_handles)
            .chain(ctrl_ring)
            .collect();
        let Vif {
            xen, port, tx, rx, ..
        } = self;
        drop((tx, rx));
        let mut st = vec![Ok(()); held.len()];
        xen.grant_unmap(&held, &mut st);
        let _ = xen.evtchn_close(port);
    }
}

/// One request a guest-copy front end posted: a credit for the slot it names, and the
/// return of the buffer lent through that slot, if any. A slot out of range or already
/// credited is answered with an error and counted; nothing of the vif's changes.
fn take_credit(
    gc: &mut GuestCopy,
    gt: &hv::grant::GuestGrants<'_>,
    pool: &mut SkbPool,
    req: crate::netif::RxRequest,
    rx: &mut Back<RxRing>,
    stats: &mut VifStats,
) {
    if req.id >= RING_IDS || !gc.credited.post(req.id) {
        stats.rx_bad_requests += 1;
        // Cannot fail: one response per request taken.
        let _ = rx.push_response(&RxResponse {
            id: req.id,
            offset: 0,
            flags: 0,
            status: XEN_NETIF_RSP_ERROR,
        });
        return;
    }
    if let Some(skb) = gc.lent[req.id as usize].take() {
        stats.rx_returned += 1;
        gc.order.remove(req.id);
        if !end_lent(gt, gc, pool, req.id, skb, true) {
            // Still being copied from: credited when its grant ends (`end_pending`).
            return;
        }
    }
    gc.credits.push(req.id);
}

impl GuestCopy {
    /// Tries again the grants that were in use when ended, freeing each buffer whose
    /// grant ends now.
    fn end_pending(&mut self, gt: &hv::grant::GuestGrants<'_>, pool: &mut SkbPool) {
        let base = self.base.0;
        let mut ending = std::mem::take(&mut self.ending);
        ending.retain(|e| {
            let done = gt.end_access(GrantRef(base + u32::from(e.id))).is_ok();
            if done {
                if self.unlink(e.id) {
                    pool.free(e.skb);
                }
                if e.credit {
                    self.credits.push(e.id);
                }
            }
            !done
        });
        self.ending = ending;
    }

    /// Slot `id`'s grant has ended: the slot leaves its packet's pieces. Returns
    /// whether it was the last (the buffer may go).
    fn unlink(&mut self, id: u16) -> bool {
        let i = usize::from(id);
        if std::mem::take(&mut self.transitive[i]) {
            self.transitive_held -= 1;
        }
        let next = self.piece_next[i];
        if next == id {
            return true;
        }
        // The ring is at most RX_COPY_MAX_SLOTS long.
        let mut p = next;
        while self.piece_next[usize::from(p)] != id {
            p = self.piece_next[usize::from(p)];
        }
        self.piece_next[usize::from(p)] = next;
        self.piece_next[i] = id;
        false
    }
}

/// Ends the grant through which `skb` was lent on slot `id` and frees it (once the
/// packet's last piece has ended), or, if the guest is copying from it this moment,
/// leaves both for later, with the slot's credit if the guest posted it again
/// (`credit`). Returns whether the grant ended now.
fn end_lent(
    gt: &hv::grant::GuestGrants<'_>,
    gc: &mut GuestCopy,
    pool: &mut SkbPool,
    id: u16,
    skb: SkbId,
    credit: bool,
) -> bool {
    if gt.end_access(GrantRef(gc.base.0 + u32::from(id))).is_ok() {
        if gc.unlink(id) {
            pool.free(skb);
        }
        true
    } else {
        gc.ending.push(Ending { id, skb, credit });
        false
    }
}

/// One run of a packet's bytes in one page, lent through one slot.
#[derive(Debug, Clone, Copy)]
struct Piece {
    page: SegPage,
    offset: u16,
    len: u16,
}

/// A packet's pieces, at most [`RX_COPY_MAX_SLOTS`], in a fixed array.
#[derive(Debug, Clone, Copy)]
struct PieceList {
    pieces: [Piece; RX_COPY_MAX_SLOTS],
    len: usize,
}

impl Default for PieceList {
    fn default() -> Self {
        Self {
            pieces: [Piece {
                page: SegPage::Own(hv::Gfn(0)),
                offset: 0,
                len: 0,
            }; RX_COPY_MAX_SLOTS],
            len: 0,
        }
    }
}

impl PieceList {
    /// Appends a piece; false if full.
    fn push(&mut self, p: Piece) -> bool {
        let Some(slot) = self.pieces.get_mut(self.len) else {
            return false;
        };
        *slot = p;
        self.len += 1;
        true
    }
    fn iter(&self) -> impl Iterator<Item = &Piece> {
        self.pieces[..self.len].iter()
    }
}

/// How a queued packet goes to a guest-copy front end.
#[derive(Debug, Clone, Copy)]
enum Pieces {
    /// Lent as it lies, a slot per piece.
    Lend(PieceList),
    /// Copied into one local buffer first.
    Linearize,
}

impl Pieces {
    /// `skb`'s pieces: each run of its bytes in one page (a driver-domain page, or, if
    /// `foreign_ok`, a page another guest granted).
    fn of(pool: &SkbPool, skb: SkbId, foreign_ok: bool) -> Self {
        let mut list = PieceList::default();
        let fits = pool
            .walk(skb, 0, pool.len(skb), |seg, _| {
                let foreign = matches!(seg.page, SegPage::Window { .. });
                let ok = (foreign_ok || !foreign)
                    && list.push(Piece {
                        page: seg.page,
                        offset: seg.offset as u16,
                        len: seg.len as u16,
                    });
                if ok {
                    Ok(())
                } else {
                    Err(crate::skb::SkbError::OutOfBounds)
                }
            })
            .is_ok();
        if fits && list.len > 0 {
            Pieces::Lend(list)
        } else {
            Pieces::Linearize
        }
    }

    /// Slots it takes.
    fn slots(&self) -> usize {
        match self {
            Pieces::Lend(p) => p.len,
            Pieces::Linearize => 1,
        }
    }
}

/// `skb` if its bytes are all in its own linear area in one of the driver domain's
/// pages; otherwise a copy that is (counted in `linearized`), `skb` freed. `None` if
/// no buffer could be had.
fn local_linear(pool: &mut SkbPool, skb: SkbId, linearized: &mut u64) -> Option<SkbId> {
    let len = pool.len(skb);
    if pool.linear_len(skb) == len && pool.frags(skb).is_empty() && pool.frag_list(skb).is_none() {
        return Some(skb);
    }
    *linearized += 1;
    let mut frame = [0u8; MAX_TAGGED_FRAME];
    let copy = (len <= frame.len() && pool.read(skb, 0, &mut frame[..len]).is_ok())
        .then(|| pool.alloc(NET_SKB_PAD).ok())
        .flatten();
    let csum = pool.csum_valid(skb);
    pool.free(skb);
    let c = copy?;
    if pool.put(c, &frame[..len]).is_err() {
        pool.free(c);
        return None;
    }
    pool.set_csum_valid(c, csum);
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(o: &mut LentOrder) -> Vec<u16> {
        std::iter::from_fn(|| o.pop_front()).collect()
    }

    #[test]
    fn lent_slots_leave_in_any_order_and_the_oldest_stays_first() {
        let mut o = LentOrder::new();
        for id in [7, 3, 200, 0, 255] {
            o.push_back(id);
        }
        // Already on it, or no slot: ignored.
        o.push_back(3);
        o.push_back(NIL);
        o.push_back(RING_IDS);
        assert_eq!((o.len(), o.front()), (5, Some(7)));
        // Returned newest first (netfront gives a batch back last first), then from
        // the middle; a slot not lent is nothing.
        o.remove(255);
        o.remove(200);
        o.remove(200);
        o.remove(9);
        assert_eq!(o.len(), 3);
        o.push_back(200);
        assert_eq!(drain(&mut o), [7, 3, 0, 200]);
        assert_eq!((o.len(), o.front()), (0, None));
        // The oldest alone, then the list again from empty.
        o.push_back(0);
        o.remove(0);
        o.push_back(5);
        assert_eq!(drain(&mut o), [5]);
    }
}
