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
use hv::counters::{CopyAlign, PerReason};

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
mod credit;
mod ctrl;
mod direct;
mod flow;
mod handshake;
mod rx;
mod stats;
mod tx;

pub use cache::{CacheError, CacheStats, DropOutcome, GrantCache, CACHE_SLOTS};
pub use credit::Credit;
pub use ctrl::CTRL_WAITING;
pub use direct::{DirectToken, Fill, DIRECT_OFFSET, RX_MAPPED};
use flow::RxHold;
pub use flow::{RX_DESC_COST, RX_HOLD_LIMIT};
pub use handshake::{probe, probe_queues};
use rx::{end_lent, GuestCopy, LentOrder, RxBatch, NIL};
pub use stats::{RingOccupancy, VifStats};
use tx::{Pending, TxBatch, Unmaps, OFFLOAD_SCRATCH};
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

/// The journals a vif records its two rings in ([`Vif::record_in`], [`Vif::resume`]):
/// files in memory that outlive the process, each at least [`JOURNAL_LEN_TX`] or
/// [`JOURNAL_LEN_RX`] bytes.
#[derive(Debug)]
pub struct Journals {
    /// The TX ring's.
    pub tx: mem::journal::Journal,
    /// The RX ring's.
    pub rx: mem::journal::Journal,
}

/// Bytes of a vif's TX journal: the record of a one-page TX ring.
pub const JOURNAL_LEN_TX: usize = ring::record_len::<TxRing>(PAGE_SIZE);
/// Bytes of a vif's RX journal.
pub const JOURNAL_LEN_RX: usize = ring::record_len::<RxRing>(PAGE_SIZE);

/// Queues a vif offers its front end (`multi-queue-max-queues`, [`probe_queues`]), as
/// Linux's netback offers one a CPU of its domain, up to its `max_queues`.
pub const MAX_QUEUES: u32 = 4;

/// The queue of `queues` a frame for the guest goes to: one flow's frames always the
/// same one, so that each arrives in order, as Linux's netback picks by the packet's
/// flow hash (`xenvif_select_queue`). The flow is the IPv4 or IPv6 addresses and, for
/// an unfragmented TCP or UDP packet, its ports (FNV-1a over them); any other frame
/// goes to queue 0. Reads only within `frame`, whatever it holds.
pub fn select_queue(frame: &[u8], queues: usize) -> usize {
    if queues <= 1 {
        return 0;
    }
    let mut h: u32 = 0x811c_9dc5;
    let mut mix = |b: &[u8]| {
        for &x in b {
            h = (h ^ u32::from(x)).wrapping_mul(0x0100_0193);
        }
    };
    let (mut at, mut ty) = (12, frame.get(12..14));
    if ty == Some(&[0x81, 0x00]) {
        at += 4;
        ty = frame.get(at..at + 2);
    }
    let ip = at + 2;
    let ports = |l4: usize| frame.get(l4..l4 + 4);
    let l4 = match ty {
        Some([0x08, 0x00]) => {
            let Some(hdr) = frame.get(ip..ip + 20) else {
                return 0;
            };
            mix(&hdr[12..20]);
            let fragment = u16::from_be_bytes([hdr[6], hdr[7]]) & 0x3fff != 0;
            let l4 = ip + usize::from(hdr[0] & 0x0f) * 4;
            (matches!(hdr[9], 6 | 17) && !fragment).then_some(l4)
        }
        Some([0x86, 0xdd]) => {
            let Some(hdr) = frame.get(ip..ip + 40) else {
                return 0;
            };
            mix(&hdr[8..40]);
            matches!(hdr[6], 6 | 17).then_some(ip + 40)
        }
        _ => return 0,
    };
    if let Some(p) = l4.and_then(ports) {
        mix(p);
    }
    h as usize % queues
}

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

/// One virtual interface's back end, over pvio's hypervisor or a real Xen.
#[derive(Debug)]
pub struct Vif<X: Xen = Pvio> {
    xen: X,
    fe: DomId,
    handle: u32,
    index: u16,
    /// The channel of the TX ring, and of both unless split.
    port: Port,
    /// The RX ring's own channel, with split event channels.
    rx_port: Option<Port>,
    tx: Back<TxRing>,
    rx: Back<RxRing>,
    ring_handles: [GrantHandle; 2],
    slot_base: u32,
    rx_queue: SkbQueue,
    /// Its hold on the NIC's receive poll while the queue has no room.
    rx_hold: RxHold,
    /// The front end takes packets over several slots (`feature-sg`).
    can_sg: bool,
    /// The front end takes large TCP packets whole (`feature-gso-tcpv4`).
    gso_rx: bool,
    /// And TCP/IPv6 ones (`feature-gso-tcpv6`).
    gso6_rx: bool,
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
    /// The toolstack's transmit rate: the guest's packets wait on the ring for credit.
    credit: Option<Credit>,
    tx_check: TxCheckStats,
    stats: VifStats,
    disabled: Option<Disabled>,
}

impl<X: Xen> Vif<X> {
    /// The local end of the vif's event channel.
    pub fn port(&self) -> Port {
        self.port
    }

    /// The RX ring's own channel, if the front end split them
    /// ([`xenbus::FEATURE_SPLIT_EVENTS`]); else both rings use [`Vif::port`].
    pub fn rx_port(&self) -> Option<Port> {
        self.rx_port
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

    /// Notifies the guest of TX (or control) responses.
    fn notify(&mut self) {
        let _c = enter(Class::Hypercall);
        self.stats.notifies += 1;
        let _ = self.xen.evtchn_send(self.port);
    }

    /// Notifies the guest of RX responses: on the RX ring's own channel if split.
    fn notify_rx(&mut self) {
        let _c = enter(Class::Hypercall);
        self.stats.notifies += 1;
        let _ = self.xen.evtchn_send(self.rx_port.unwrap_or(self.port));
    }

    /// Records both rings' responses from now on in `j`, so that a back end started
    /// after this one dies (or after it hands the vif over) takes the vif over exactly
    /// ([`Vif::resume`]). Whether it was taken: only a vif that answers every request it
    /// takes before it publishes can be recorded, one in copy mode
    /// ([`Vif::set_tx_copy`], which must stay on) without guest copy, direct placement
    /// or grant reuse; and only before its first response.
    pub fn record_in(&mut self, j: Journals) -> bool {
        if !self.tx_copy
            || self.guest_copy.is_some()
            || self.direct.is_some()
            || self.cache.is_some()
        {
            return false;
        }
        self.tx.record_in(j.tx) && self.rx.record_in(j.rx)
    }

    /// Hands the vif over, as a clean stop for an upgrade does: every response written
    /// is published (and the guest told), the packets queued for the guest are freed
    /// (dropped, as a wire does), and the rings, maps and channel are given back. The
    /// store is not written: the front end stays `Connected` and never sees the back end
    /// change; the next back end takes the vif over where this one left it
    /// ([`Vif::resume`]). Closing a vif is an explicit act ([`Vif::disconnect`]), never
    /// the side effect of a stop.
    pub fn hand_over(mut self, pool: &mut SkbPool) {
        if self.disabled.is_none() {
            if self.tx.push_responses_and_check_notify() {
                self.notify();
            }
            if self.rx.push_responses_and_check_notify() {
                self.notify_rx();
            }
        }
        self.release(pool);
    }

    /// Gives back what the vif holds as a back end's death does (the hypervisor unmaps
    /// a dead process's grants and closes its channels): nothing more is written to
    /// the rings or the store; responses answered and not yet published are lost with
    /// it. What a crash leaves, for the next back end to take over ([`Vif::resume`]).
    pub fn abandon(self, pool: &mut SkbPool) {
        self.release(pool);
    }

    /// Tears the vif down: frees its queue, unmaps whatever it still maps (answering
    /// nothing more), rings included, and closes its channel. The vif is gone after:
    /// its rings are dropped before their pages are unmapped, since a ring holds its
    /// page open and a held page cannot be unmapped.
    pub fn disconnect(mut self, pool: &mut SkbPool) {
        self.disable(Disabled::Disconnected);
        self.release(pool);
    }

    /// Gives back what a vif that never moved a packet holds (one connected with
    /// others that could not be): its rings' mappings and its channels. It holds no
    /// buffer yet, so no pool is needed.
    pub(crate) fn abandon_unpooled(self) {
        self.release_with(None);
    }

    /// Gives back everything the vif holds, the store untouched.
    fn release(self, pool: &mut SkbPool) {
        self.release_with(Some(pool));
    }

    /// [`Vif::release`]; without a pool for a vif that holds no buffer.
    fn release_with(mut self, mut pool: Option<&mut SkbPool>) {
        if let Some(pool) = pool.as_deref_mut() {
            self.rx_queue.purge(pool);
        }
        self.direct_teardown();
        let ctrl_ring = self.cache_teardown();
        if let Some(gc) = self.guest_copy.as_mut() {
            let gt = self.xen.domain().grant_table();
            for id in 0..RING_IDS {
                if let Some(pool) = pool.as_deref_mut() {
                    if let Some(skb) = gc.lent[id as usize].take() {
                        end_lent(&gt, gc, pool, id, skb, false);
                    }
                }
            }
            // A copy in flight ends within a hypercall: wait for it, since a buffer
            // freed under a grant would show the guest the buffer's next packet.
            if let Some(pool) = pool {
                for _ in 0..1000 {
                    gc.end_pending(&gt, pool);
                    if gc.ending.is_empty() {
                        break;
                    }
                    std::thread::yield_now();
                }
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
            xen,
            port,
            rx_port,
            tx,
            rx,
            ..
        } = self;
        drop((tx, rx));
        let mut st = vec![Ok(()); held.len()];
        xen.grant_unmap(&held, &mut st);
        let _ = xen.evtchn_close(port);
        if let Some(p) = rx_port {
            let _ = xen.evtchn_close(p);
        }
    }
}
