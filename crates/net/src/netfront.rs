//! netfront: the guest's end of a virtual interface, in its original form (paper 000
//! §3.4.2).
//!
//! **Receive.** It keeps the RX ring full of whole pages, each granted writable to the
//! back end. A response names the buffer by id: the id must be in range and in flight
//! ([`crate::netif::check_rx_response`]), the data must stay in its page; then the grant
//! is revoked, a packet buffer is allocated, the first [`RX_COPY_LEN`] bytes are copied
//! into its linear area and the rest of the page stays attached as a fragment — the
//! fragment use the paper found expensive. Anything else a back end returns is counted
//! and dropped; a broken ring index disconnects.
//!
//! **Receive without fragments** ([`RxBuffers::Linear`], the paper's modified netfront
//! of §3.4.2, Figure 5's third bar): the ring is kept full of socket buffers allocated
//! in advance, each with a whole page as its linear area; the back end's copy lands
//! where the stack reads it, so there is no head copy and no fragment. Such a front end
//! does not offer `feature-sg`: a packet needing more than one slot is refused and
//! counted, since it would need a fragment.
//!
//! **Transmit.** Each page a packet's bytes lie in is granted read-only and described by
//! one request; the completion revokes the grants and frees the buffer.

use hv::counters::PerReason;
use std::collections::VecDeque;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use hv::profile::{enter, Class};
use hv::store::{Wake, WatchEvent, XenStore, XenbusState};
use hv::OwnPage;
use hv::{
    CopyPtr, DomId, Domain, Gfn, GrantCopy, GrantError, GrantRef, GrantStatus, Hypervisor, Port,
};
use ring::{FrontRing, PageRing};

use crate::netif::{
    check_rx_response, ExtraInfo, Gso, InFlight, RxError, RxRequest, RxResponse, RxRing, TxRequest,
    TxRing, LEGACY_SLOTS_MAX, NETRXF_CSUM_BLANK, NETRXF_DATA_VALIDATED, NETRXF_EXTRA_INFO,
    NETRXF_MORE_DATA, NETTXF_CSUM_BLANK, NETTXF_DATA_VALIDATED, NETTXF_EXTRA_INFO,
    NETTXF_MORE_DATA, RING_IDS, RX_COPY_MAX_SLOTS, XEN_NETIF_EXTRA_FLAG_MORE,
    XEN_NETIF_EXTRA_TYPE_GSO, XEN_NETIF_EXTRA_TYPE_MAX, XEN_NETIF_EXTRA_TYPE_NONE,
    XEN_NETIF_GSO_TYPE_TCPV4, XEN_NETIF_RSP_NULL, XEN_NETIF_RSP_OKAY,
};
use crate::offload::{Csum, Offload, OffloadError, MAX_HEADERS};
use crate::skb::{Frag, FragPage, Held, SegPage, SkbId, SkbPool, MAX_SKB_FRAGS, NET_SKB_PAD};
use crate::xenbus::{self, XenbusError};

mod reuse;

/// Bytes netfront copies from the first fragment into the linear area.
pub const RX_COPY_LEN: usize = 200;
/// Responses whose buffers' first lines the RX poll fetches ahead of the one it
/// handles (DPDK's drivers prefetch a burst's descriptors and packets the same way).
const RX_PREFETCH: u32 = 8;

/// How netfront gives its pages to the back end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Grants {
    /// A grant per I/O, ended at its response (the original protocol).
    #[default]
    PerIo,
    /// Grant reuse (paper 000 §4.4): each page granted once and bound to its
    /// reference, the back end's cache keeping it mapped, drops through the control
    /// ring. Falls back to [`Grants::PerIo`] with a back end that does not offer it.
    Reuse,
    /// **Unsafe, for measurement only**: the paper's stand-in for grant reuse. RX
    /// requests carry the buffer's machine frame instead of a grant; the back end
    /// programs its device with it, unchecked. Needs the back end's explicit offer
    /// (the lab's `pv-mq-unsafe`); never used by `pvio up`.
    MachineFramesUnsafe,
}
hv::named_enum!(Grants {
    PerIo => "per-io",
    Reuse => "reuse",
    MachineFramesUnsafe => "machine-frames-unsafe",
});

/// A netfront's switches: what it posts, how it grants its pages, and what it asks of
/// its back end. The one set of guest-side settings: the machine's guest spec, the
/// toolstack's vif, the lab's options and `pvio up`'s guests each carry it whole.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrontConfig {
    /// What it posts on its RX ring.
    pub rx_buffers: RxBuffers,
    /// How it gives its pages to the back end (grant reuse, paper 000 §4.4, or the
    /// paper's unsafe stand-in).
    pub grants: Grants,
    /// It offers checksum offload and GSO both ways (with page fragments).
    pub offloads: bool,
    /// It asks for pvio's split ring layout (each end's indices on a cache line of
    /// their own, `request-split-ring-indices`) where the back end offers it; ring.h's
    /// layout otherwise.
    pub split_ring: bool,
}

impl FrontConfig {
    /// The original netfront (the default): page fragments, a grant per I/O, no
    /// offloads, ring.h's layout.
    pub const ORIGINAL: Self = Self {
        rx_buffers: RxBuffers::Fragments,
        grants: Grants::PerIo,
        offloads: false,
        split_ring: false,
    };

    /// The original netfront, posting `rx_buffers`.
    pub fn posting(rx_buffers: RxBuffers) -> Self {
        Self {
            rx_buffers,
            ..Self::default()
        }
    }
}

/// What netfront posts on the RX ring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RxBuffers {
    /// Whole pages, attached as fragments after [`RX_COPY_LEN`] bytes are copied into
    /// a fresh buffer's linear area (the original netfront).
    #[default]
    Fragments,
    /// Socket buffers allocated in advance, a page of linear area each, filled in place
    /// (the paper's netfront without fragments). Single-slot packets only.
    Linear,
    /// No buffers: each posted slot is a credit, the back end lends its own buffer
    /// through a read-only sub-page grant, and netfront allocates a buffer of the
    /// packet's size, aligned with it, and copies (paper 000 §4.1). Needs the back
    /// end's `feature-rx-guest-copy`. Single-slot packets only.
    GuestCopy,
}
hv::named_enum!(RxBuffers {
    Fragments => "fragments",
    Linear => "linear",
    GuestCopy => "guest-copy",
});

type Front<P> = FrontRing<P, PageRing<OwnPage>>;

/// Counters of one interface.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrontStats {
    /// Packets received and handed to the stack.
    pub rx_packets: u64,
    /// Responses refused, per [`RxError`].
    pub rx_errors: PerReason<RxError>,
    /// Packets dropped for want of a packet buffer.
    pub rx_no_buffer: u64,
    /// Packets dropped for a malformed chain (extras not negotiated, too many slots).
    pub rx_bad_chain: u64,
    /// Guest copy: packets whose copy from the back end's buffer failed (the grant
    /// was revoked, or never covered those bytes).
    pub rx_copy_errors: u64,
    /// Grants the back end still held when revoked (pages kept out of use).
    pub grants_busy: u64,
    /// Packets transmitted (every slot answered OK).
    pub tx_packets: u64,
    /// Packets whose buffer stays out of use because a slot's grant was still mapped.
    pub tx_pinned: u64,
    /// Bytes of transmitted packets moved off a shared head page before granting
    /// (see [`crate::skb::SkbPool::own_head_pages`]).
    pub tx_bounced_bytes: u64,
    /// Transmit completions with an error status.
    pub tx_errors: u64,
    /// Transmit responses with a bad id.
    pub tx_bad_response: u64,
    /// Notifications sent to the back end.
    pub notifies: u64,
    /// Times a back end closed or went away.
    pub disconnects: u64,
    /// Unanswered packets kept across a disconnection to be sent again.
    pub tx_requeued: u64,
    /// Grant reuse: pages bound to a reference of their own (granted once, kept).
    pub reuse_bindings: u64,
    /// Grant reuse: pages whose drop was asked through the control ring.
    pub unbind_asked: u64,
    /// Grant reuse: of those, pages whose grant then ended (handed back).
    pub unbind_done: u64,
    /// Grant reuse: drops the back end did not confirm.
    pub unbind_refused: u64,
    /// Control-ring responses with an id or type not asked for.
    pub ctrl_bad_responses: u64,
    /// Offloads: large (GSO) packets received.
    pub rx_gso_packets: u64,
    /// Offloads: packets dropped for their metadata or the headers it describes, per
    /// [`OffloadError`] (a GSO extra of size 0 or an unknown type, a partial checksum
    /// on what is not TCP or UDP over IPv4, more than 64 KiB).
    pub rx_offload_errors: PerReason<OffloadError>,
    /// Offloads: large (GSO) packets sent.
    pub tx_gso_packets: u64,
    /// Offloads: large packets dropped because the back end takes none.
    pub tx_gso_refused: u64,
}

hv::counter_set!(FrontStats {
    rx_packets,
    rx_errors,
    rx_no_buffer,
    rx_bad_chain,
    rx_copy_errors,
    grants_busy,
    tx_packets,
    tx_pinned,
    tx_bounced_bytes,
    tx_errors,
    tx_bad_response,
    notifies,
    disconnects,
    tx_requeued,
    reuse_bindings,
    unbind_asked,
    unbind_done,
    unbind_refused,
    ctrl_bad_responses,
    rx_gso_packets,
    rx_offload_errors,
    tx_gso_packets,
    tx_gso_refused
});

#[derive(Debug, Clone, Copy)]
struct RxBuf {
    gref: GrantRef,
    gfn: Option<Gfn>,
    /// The buffer whose linear area `gfn` is ([`RxBuffers::Linear`]).
    skb: Option<SkbId>,
}

/// One TX id. A packet's state lives in the entry of its first slot (its head): the
/// buffer, the slots still unanswered, and whether any slot failed or stayed mapped.
#[derive(Debug, Clone, Copy)]
struct TxBuf {
    gref: GrantRef,
    in_flight: bool,
    /// The back end still had this slot's grant mapped when answered.
    held: bool,
    head: u16,
    skb: Option<SkbId>,
    /// The packet's place in transmission order (its head's entry).
    seq: u64,
    left: u8,
    failed: bool,
    pinned: bool,
}

/// One connection to a back end: what a reconnection replaces.
#[derive(Debug)]
struct Link {
    be: DomId,
    /// The back end's directory, whose `state` is watched.
    bdir: String,
    port: Port,
    tx: Front<TxRing>,
    rx: Front<RxRing>,
    /// The ring pages, each with its grant.
    rings: [(Gfn, GrantRef); 2],
    /// Guest copy: the back end's grant for slot 0 (`base + id` for slot `id`).
    rx_grant_base: Option<u32>,
    /// Grant reuse: the control ring and the pages bound to references.
    reuse: Option<reuse::Reuse>,
    /// The unsafe stand-in: RX requests carry machine frames, not grants.
    machine_frames: bool,
    /// Offloads were offered: the back end may send GSO extras and blank checksums.
    offload_rx: bool,
    /// The back end takes large packets (`feature-gso-tcpv4`).
    gso_tx: bool,
    /// Requests pushed and responses taken on the RX ring since it was set up, and the
    /// id each request slot held: an extra-info response names no id, so the buffer
    /// its slot consumed is found by its place on the ring (netback answers requests
    /// in order, as Linux netfront's `xennet_get_extras` assumes).
    rx_req_seq: u32,
    rx_rsp_seq: u32,
    rx_pos: Box<[u16]>,
}

/// A change [`Netfront::check_backend`] made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkChange {
    /// Nothing to do.
    None,
    /// The back end closed or went away: every buffer and grant was taken back, and the
    /// packets it never answered are kept to be sent again.
    Disconnected,
    /// Connected to a (new) back end; kept packets are on their way again.
    Reconnected,
}

/// One interface's front end.
#[derive(Debug)]
pub struct Netfront {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    handle: u32,
    /// The connection; none between a back end going away and the next one.
    link: Option<Link>,
    /// Events on the front end's `backend-id` (the toolstack moving it to a new back end).
    moved: Receiver<WatchEvent>,
    /// The back-end directory whose `state` is watched, and its events.
    otherend: Option<(String, Receiver<WatchEvent>)>,
    rx_bufs: Box<[RxBuf]>,
    rx_free: Vec<u16>,
    inflight: InFlight,
    tx_bufs: Box<[TxBuf]>,
    tx_free: Vec<u16>,
    /// Packets whose pages a back end still maps: kept out of use until it lets go
    /// (tried again at disconnection, as Linux retries a deferred grant release).
    tx_pinned_skbs: Vec<SkbId>,
    /// Order of transmission, kept in each packet's head entry.
    tx_seq: u64,
    /// Packets a back end that went away never answered, oldest first: sent again
    /// once connected.
    resend: VecDeque<SkbId>,
    /// A packet being assembled from a multi-slot response chain.
    partial: Option<SkbId>,
    rx_buffers: RxBuffers,
    /// What to ask the back end for at each connection.
    want: Grants,
    /// The rest of a multi-slot chain a linear front end refused is being skipped.
    skipping: bool,
    /// Offer checksum offload and GSO (`feature-gso-tcpv4`, no
    /// `feature-no-csum-offload`); with page fragments only.
    offloads: bool,
    /// Ask for the split ring layout where the back end offers it.
    split_indices: bool,
    /// The guest-copy path's batch, allocated once.
    copy_batch: CopyBatch,
    stats: FrontStats,
    broken: bool,
}

/// Packets per guest-copy batch (one `GNTTABOP_copy`).
pub const COPY_BATCH: usize = 64;

/// One guest-copy batch: the copies (one per slot), the slots to post again, and per
/// packet its buffer, its length and its copies.
#[derive(Debug)]
struct CopyBatch {
    copies: Vec<GrantCopy>,
    status: Vec<GrantStatus>,
    slots: Vec<u16>,
    pkts: Vec<CopyPkt>,
}

/// A packet of a guest-copy batch.
#[derive(Debug, Clone, Copy)]
struct CopyPkt {
    skb: SkbId,
    len: usize,
    /// Its copies: `copies[first..first + n]`.
    first: usize,
    n: usize,
    /// A chain that broke: the buffer is freed after the copy, nothing delivered.
    bad: bool,
}

/// Copies a batch holds: a whole batch of packets, and the rest of the chain under way.
const COPY_SLOTS: usize = COPY_BATCH + RX_COPY_MAX_SLOTS;

impl CopyBatch {
    /// A buffer for the packet whose first slot is `rsp`, at the source's offset in its
    /// cache line (the alignment is chosen when the buffer is allocated, paper 000
    /// §4.1): a packet in one slot gets one of its own size. Returns its index, or
    /// `None` if the pool is empty.
    #[inline]
    fn open_packet(&mut self, pool: &mut SkbPool, rsp: &RxResponse) -> Option<usize> {
        let skb = {
            let _m = enter(Class::Mem);
            pool.alloc(NET_SKB_PAD + usize::from(rsp.offset) % 64)
                .ok()?
        };
        pool.set_csum_valid(skb, rsp.flags & NETRXF_DATA_VALIDATED != 0);
        self.pkts.push(CopyPkt {
            skb,
            len: 0,
            first: self.copies.len(),
            n: 0,
            bad: false,
        });
        Some(self.pkts.len() - 1)
    }

    /// Adds the copy of `len` bytes at `offset` through grant `src` of `be` to the end
    /// of packet `p`. A chain too long, or more bytes than a frame, drops the packet:
    /// returns false the first time that happens to it (for the caller to count).
    #[inline]
    fn add_copy(
        &mut self,
        pool: &SkbPool,
        p: usize,
        be: DomId,
        src: GrantRef,
        offset: u16,
        len: usize,
    ) -> bool {
        let pkt = &mut self.pkts[p];
        let (gfn, doff) = pool.data_location(pkt.skb);
        if pkt.bad || pkt.n == RX_COPY_MAX_SLOTS || pool.tailroom(pkt.skb) < pkt.len + len {
            let first = !pkt.bad;
            pkt.bad = true;
            return !first;
        }
        self.copies.push(GrantCopy {
            source: CopyPtr::Gref {
                dom: be,
                gref: src,
                offset,
            },
            dest: CopyPtr::Local {
                gfn,
                offset: (doff + pkt.len) as u16,
            },
            len: len as u16,
        });
        pkt.len += len;
        pkt.n += 1;
        true
    }

    fn new() -> Self {
        Self {
            copies: Vec::with_capacity(COPY_SLOTS),
            status: vec![Ok(()); COPY_SLOTS],
            slots: Vec::with_capacity(COPY_SLOTS),
            pkts: Vec::with_capacity(COPY_BATCH),
        }
    }
    fn clear(&mut self) {
        self.copies.clear();
        self.slots.clear();
        self.pkts.clear();
    }
}

/// The next response on a ring, copied out; when none is waiting, arms the ring's
/// event and looks once more (`RING_FINAL_CHECK_FOR_RESPONSES`). A broken index marks
/// the interface broken.
/// A transmitted packet's first slot's flags, from its offload: a blank or validated
/// checksum, and an extra (GSO) following.
#[inline]
fn tx_first_flags(off: &Offload) -> u16 {
    let mut flags = match off.csum {
        Csum::Partial { .. } => NETTXF_CSUM_BLANK | NETTXF_DATA_VALIDATED,
        Csum::Valid => NETTXF_DATA_VALIDATED,
        Csum::None => 0,
    };
    if off.gso.is_some() {
        flags |= NETTXF_EXTRA_INFO;
    }
    flags
}

/// What netfront publishes for its back end: the rings' grants, its channel, and what
/// it asks for.
#[derive(Debug, Clone, Copy)]
struct Published {
    refs: [GrantRef; 2],
    port: Port,
    guest_copy: bool,
    split: bool,
    machine_frames: bool,
    /// The control ring's grant, when grant reuse is asked for.
    ctrl_ref: Option<GrantRef>,
}

#[inline]
fn next_response<P: ring::RingProtocol>(ring: &mut Front<P>, broken: &mut bool) -> Option<P::Rsp> {
    loop {
        match ring.take_response() {
            Ok(Some(r)) => return Some(r),
            Ok(None) => match ring.final_check_for_responses() {
                Ok(true) => continue,
                Ok(false) => return None,
                Err(_) => *broken = true,
            },
            Err(_) => *broken = true,
        }
        return None;
    }
}

/// What a step that ran out of pages or grant references reports.
fn oom() -> XenbusError {
    XenbusError::BadKey("out of pages or grant references".into())
}

/// Kicks the guest's vCPU 0 when a watch fires (the store's event channel). Holds the
/// hypervisor and the domain weakly: the store lives in the hypervisor.
fn waker(hv: &Arc<Hypervisor>, dom: &Arc<Domain>) -> Wake {
    let (h, d) = (Arc::downgrade(hv), Arc::downgrade(dom));
    Wake(Arc::new(move || {
        if let (Some(h), Some(d)) = (h.upgrade(), d.upgrade()) {
            h.kick_vcpu(&d, 0);
        }
    }))
}

/// Gives back a posted buffer that carries no packet.
fn free_buf(pool: &mut SkbPool, gfn: Gfn, skb: Option<SkbId>) {
    match skb {
        Some(s) => pool.free(s),
        None => pool.free_page(gfn),
    }
}

/// Why a packet's extra-info slots were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExtraFault {
    /// Missing, too long, or of an unknown type.
    Chain,
    /// A GSO extra with bad parameters.
    Offload(OffloadError),
}

impl Link {
    /// Notes the id of the request about to be pushed on the RX ring.
    fn note_rx_request(&mut self, id: u16) {
        let pos = self.rx_req_seq;
        self.rx_pos[(pos % u32::from(RING_IDS)) as usize] = id;
        self.rx_req_seq = pos.wrapping_add(1);
    }
}

/// Checks a received packet's offload against its headers (netfront's
/// `checksum_setup` and GSO checks): a blank checksum is located in the headers, a GSO
/// packet must be TCP over IPv4 with segments no longer than a frame, and no offloaded
/// packet may exceed 64 KiB.
fn finish_offload(pool: &mut SkbPool, skb: SkbId) -> Result<(), OffloadError> {
    let off = pool.offload(skb);
    let partial = matches!(off.csum, Csum::Partial { .. });
    if off.gso.is_none() && !partial {
        return Ok(());
    }
    let mut head = [0u8; MAX_HEADERS];
    let l4 = crate::offload::locate(pool, skb, off.gso, &mut head)?;
    let csum = if partial { l4.partial() } else { off.csum };
    pool.set_offload(skb, Offload { csum, gso: off.gso });
    Ok(())
}

impl Netfront {
    /// Connects to a back end in `InitWait`: sets up both rings (granted to it), an
    /// unbound event channel and the grant references of every buffer, publishes them,
    /// and moves to `Connected`.
    pub fn connect(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        handle: u32,
    ) -> Result<Self, XenbusError> {
        Self::connect_with(hv, dom, handle, RxBuffers::Fragments)
    }

    /// As [`Netfront::connect`], posting `rx_buffers` on the RX ring. A linear front end
    /// does not offer `feature-sg`.
    pub fn connect_with(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        handle: u32,
        rx_buffers: RxBuffers,
    ) -> Result<Self, XenbusError> {
        Self::connect_config(hv, dom, handle, FrontConfig::posting(rx_buffers))
    }

    /// As [`Netfront::connect_with`], with every switch of `cfg`: grant reuse (paper 000
    /// §4.4) if `grants` is [`Grants::Reuse`], every page then granted once, keeping its
    /// reference, and leaving I/O through [`Netfront::unbind`] (a back end that does not
    /// offer what is asked gets the original protocol; not with
    /// [`RxBuffers::GuestCopy`]); with `offloads` (and page fragments), checksum offload
    /// and GSO offered both ways; with `split_ring`, pvio's split ring layout
    /// ([`xenbus::FEATURE_SPLIT_INDICES`]) asked for where the back end offers it.
    pub fn connect_config(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        handle: u32,
        cfg: FrontConfig,
    ) -> Result<Self, XenbusError> {
        let FrontConfig {
            rx_buffers,
            grants,
            offloads,
            split_ring: split_indices,
        } = cfg;
        // One reference per ring id and direction, all or none: a front end that
        // cannot connect gives back what it took, so that a guest can try again.
        let gt = dom.grant_table();
        let n = 2 * usize::from(RING_IDS);
        let mut refs = Vec::with_capacity(n);
        while refs.len() < n {
            let Some(r) = gt.alloc_ref() else {
                refs.into_iter().for_each(|r| gt.free_ref(r));
                return Err(oom());
            };
            refs.push(r);
        }
        let rx_bufs = refs[..usize::from(RING_IDS)].iter().map(|&gref| RxBuf {
            gref,
            gfn: None,
            skb: None,
        });
        let tx_bufs = refs[usize::from(RING_IDS)..].iter().map(|&gref| TxBuf {
            gref,
            in_flight: false,
            held: false,
            head: 0,
            skb: None,
            seq: 0,
            left: 0,
            failed: false,
            pinned: false,
        });
        let fdir = xenbus::frontend_dir(dom.id(), handle);
        let moved = match hv.store().watch_waking(
            dom.id(),
            &format!("{fdir}/backend-id"),
            "netfront-backend-id",
            Some(waker(hv, dom)),
        ) {
            Ok(w) => w,
            Err(e) => {
                refs.into_iter().for_each(|r| gt.free_ref(r));
                return Err(e.into());
            }
        };
        let mut f = Self {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
            handle,
            link: None,
            moved,
            otherend: None,
            rx_bufs: rx_bufs.collect(),
            rx_free: (0..RING_IDS).rev().collect(),
            inflight: InFlight::default(),
            tx_bufs: tx_bufs.collect(),
            tx_free: (0..RING_IDS).rev().collect(),
            tx_pinned_skbs: Vec::new(),
            tx_seq: 0,
            resend: VecDeque::with_capacity(RING_IDS as usize),
            partial: None,
            rx_buffers,
            want: if rx_buffers == RxBuffers::GuestCopy {
                Grants::PerIo
            } else {
                grants
            },
            skipping: false,
            offloads: offloads && rx_buffers == RxBuffers::Fragments,
            split_indices,
            copy_batch: CopyBatch::new(),
            stats: FrontStats::default(),
            broken: false,
        };
        match f.open() {
            Ok(l) => f.link = Some(l),
            Err(e) => {
                f.forget();
                return Err(e);
            }
        }
        if let Some(l) = &f.link {
            let d = l.bdir.clone();
            f.follow_otherend(&d);
            // The watch's first event is its registration.
            if let Some((_, w)) = &f.otherend {
                let _ = w.try_iter().count();
            }
        }
        let _ = f.moved.try_iter().count();
        Ok(f)
    }

    /// Watches `<bdir>/state` (the back end's state) instead of whatever was watched.
    fn follow_otherend(&mut self, bdir: &str) {
        if self.otherend.as_ref().is_some_and(|(d, _)| d == bdir) {
            return;
        }
        let store = self.hv.store();
        let me = self.dom.id();
        if let Some((d, _)) = self.otherend.take() {
            store.unwatch(me, &format!("{d}/state"), "netfront-otherend");
        }
        let w = store.watch_waking(
            me,
            &format!("{bdir}/state"),
            "netfront-otherend",
            Some(waker(&self.hv, &self.dom)),
        );
        self.otherend = w.ok().map(|w| (bdir.to_string(), w));
    }

    /// The handshake with the back end the store names: checks its state and
    /// features, sets up both rings (granted to it) and an unbound event channel,
    /// publishes them, and moves to `Connected`. What it took is given back if a step
    /// fails.
    fn open(&self) -> Result<Link, XenbusError> {
        let (hv, dom) = (&self.hv, &self.dom);
        let store = hv.store();
        let me = dom.id();
        let fdir = xenbus::frontend_dir(me, self.handle);
        let be = DomId(xenbus::read_u32(store, me, &format!("{fdir}/backend-id"))? as u16);
        let bdir = store
            .read(me, &format!("{fdir}/backend"))
            .map_err(|_| XenbusError::BadKey(format!("{fdir}/backend")))?;
        // Only a back end waiting for this end (`InitWait`), as Linux's netfront
        // talks to its back end only then: one still `Connected` is the dead or
        // retired end of an earlier connection, whose rings these would not be.
        let st = store.xenbus_state(me, &bdir);
        if st != XenbusState::InitWait {
            return Err(XenbusError::PeerState(st));
        }
        if !xenbus::feature(store, me, &bdir, "feature-rx-copy") {
            return Err(XenbusError::MissingFeature("feature-rx-copy"));
        }
        let guest_copy = self.rx_buffers == RxBuffers::GuestCopy;
        if guest_copy && !xenbus::feature(store, me, &bdir, xenbus::FEATURE_GUEST_COPY) {
            return Err(XenbusError::MissingFeature(xenbus::FEATURE_GUEST_COPY));
        }
        let gt = dom.grant_table();
        let mut taken: Vec<(Gfn, GrantRef)> = Vec::with_capacity(2);
        let mut port = None;
        let give_back = |taken: &[(Gfn, GrantRef)], port: Option<Port>| {
            for &(g, r) in taken {
                // Deferred: a back end that mapped it already keeps it until it unmaps.
                gt.end_access_deferred(r, Some(g));
            }
            if let Some(p) = port {
                let _ = hv.evtchn_close(dom, p);
            }
        };
        let offered = |key: &str| xenbus::feature(store, me, &bdir, key);
        let reuse_offered = self.want == Grants::Reuse
            && offered(xenbus::FEATURE_GRANT_REUSE)
            && offered(xenbus::FEATURE_CTRL_RING);
        let machine_frames =
            self.want == Grants::MachineFramesUnsafe && offered(xenbus::FEATURE_MACHINE_FRAMES);
        let split = self.split_indices && offered(xenbus::FEATURE_SPLIT_INDICES);
        let layout = [ring::Layout::XEN, ring::Layout::SPLIT][usize::from(split)];
        let mut reuse = None;
        let r = (|| {
            for _ in 0..2 {
                taken.push(self.grant_ring_page(be)?);
            }
            let ring = |g| {
                dom.page(g)
                    .ok()
                    .and_then(|p| PageRing::with_layout(p, layout).ok())
                    .ok_or_else(oom)
            };
            let tx = FrontRing::init(ring(taken[0].0)?).map_err(|_| oom())?;
            let rx = FrontRing::init(ring(taken[1].0)?).map_err(|_| oom())?;
            let p = hv.evtchn_alloc_unbound(dom, be).map_err(|_| oom())?;
            port = Some(p);
            if reuse_offered {
                reuse = Some(reuse::open_ctrl(dom, be).ok_or_else(oom)?);
            }
            let keys = Published {
                refs: [taken[0].1, taken[1].1],
                port: p,
                guest_copy,
                split,
                machine_frames,
                ctrl_ref: reuse.as_ref().map(|r| r.pages[0].1),
            };
            self.publish(&fdir, &keys)?;
            Ok(Link {
                be,
                bdir: bdir.clone(),
                port: p,
                tx,
                rx,
                rings: [taken[0], taken[1]],
                rx_grant_base: None,
                reuse: reuse.take(),
                machine_frames,
                offload_rx: self.offloads,
                gso_tx: self.offloads && xenbus::feature(store, me, &bdir, "feature-gso-tcpv4"),
                rx_req_seq: 0,
                rx_rsp_seq: 0,
                rx_pos: vec![0; usize::from(RING_IDS)].into(),
            })
        })();
        if r.is_err() {
            if let Some(rs) = reuse {
                let mut st = FrontStats::default();
                let _ = rs.close(dom, &mut st);
            }
            give_back(&taken, port);
        }
        r
    }

    /// A page for a ring, granted to back end `be`. Out of pages or references is
    /// `oom`; what it took is given back.
    fn grant_ring_page(&self, be: DomId) -> Result<(Gfn, GrantRef), XenbusError> {
        let gt = self.dom.grant_table();
        let g = self.dom.alloc_page().map_err(|_| oom())?;
        let Some(r) = gt.alloc_ref() else {
            let _ = self.dom.free_page(g);
            return Err(oom());
        };
        if gt.grant_access(r, be, g, false).is_err() {
            gt.free_ref(r);
            let _ = self.dom.free_page(g);
            return Err(oom());
        }
        Ok((g, r))
    }

    /// Publishes this end's keys in its directory `fdir` and moves to `Connected`: its
    /// offloads, both rings' grants and its channel, and what it asks for. A
    /// reconnection starts from `Closed`, a first connection from `Initialising`; a key
    /// a reconnection no longer asks for is taken away.
    fn publish(&self, fdir: &str, k: &Published) -> Result<(), XenbusError> {
        let store = self.hv.store();
        let me = self.dom.id();
        if store.xenbus_state(me, fdir) == XenbusState::Closed {
            store.switch_state(me, fdir, XenbusState::Initialising)?;
        }
        let flag = |b: bool| if b { "1" } else { "0" }.to_string();
        for (key, v) in [
            ("feature-gso-tcpv4", flag(self.offloads)),
            ("feature-no-csum-offload", flag(!self.offloads)),
            ("tx-ring-ref", k.refs[0].0.to_string()),
            ("rx-ring-ref", k.refs[1].0.to_string()),
            ("event-channel", k.port.0.to_string()),
            ("request-rx-copy", flag(true)),
            ("feature-rx-notify", flag(true)),
            ("feature-sg", flag(self.rx_buffers == RxBuffers::Fragments)),
            (xenbus::REQUEST_GUEST_COPY, flag(k.guest_copy)),
            (xenbus::REQUEST_SPLIT_INDICES, flag(k.split)),
        ] {
            store.write(me, &format!("{fdir}/{key}"), &v)?;
        }
        let mf_key = format!("{fdir}/{}", xenbus::REQUEST_MACHINE_FRAMES);
        if k.machine_frames {
            store.write(me, &mf_key, "1")?;
        } else {
            let _ = store.rm(me, &mf_key);
        }
        // Grant reuse: the control ring, and the request.
        let ring_key = format!("{fdir}/{}", xenbus::CTRL_RING_REF);
        let req_key = format!("{fdir}/{}", xenbus::REQUEST_GRANT_REUSE);
        match k.ctrl_ref {
            Some(r) => {
                store.write(me, &ring_key, &r.0.to_string())?;
                store.write(me, &req_key, "1")?;
            }
            None => {
                let _ = store.rm(me, &ring_key);
                let _ = store.rm(me, &req_key);
            }
        }
        store.switch_state(me, fdir, XenbusState::Connected)?;
        Ok(())
    }

    /// Follows the back end after a store event (`backend_changed`): if it closed, went
    /// away or the toolstack named another, disconnects; if disconnected and a back end
    /// waits for this end, reconnects. Cheap when no event is waiting.
    pub fn check_backend(&mut self, pool: &mut SkbPool) -> LinkChange {
        let mut any = self.moved.try_iter().count() > 0;
        if let Some((_, w)) = &self.otherend {
            any |= w.try_iter().count() > 0;
        }
        if !any {
            return LinkChange::None;
        }
        // A back end that went may have let go of grants revoked while it held them.
        self.dom.grant_table().retry_deferred();
        let hv = Arc::clone(&self.hv);
        let store = hv.store();
        let me = self.dom.id();
        let fdir = xenbus::frontend_dir(me, self.handle);
        let be = xenbus::read_u32(store, me, &format!("{fdir}/backend-id")).ok();
        // Follow whichever back end the store names now.
        if let Ok(bdir) = store.read(me, &format!("{fdir}/backend")) {
            self.follow_otherend(&bdir);
        }
        let mut change = LinkChange::None;
        if let Some(l) = &self.link {
            let st = store.xenbus_state(me, &l.bdir);
            // A dead back end's channel is closed at its end; one still connecting
            // (`InitWait`) has not bound it yet.
            let unbound = st != XenbusState::InitWait
                && !matches!(
                    self.dom.evtchn_state(l.port),
                    Ok(hv::ChannelState::Interdomain { .. })
                );
            let gone = unbound
                || be != Some(u32::from(l.be.0))
                || matches!(
                    st,
                    XenbusState::Closing | XenbusState::Closed | XenbusState::Unknown
                );
            if gone {
                self.disconnect(pool);
                change = LinkChange::Disconnected;
            }
        }
        if self.link.is_none() {
            if let Ok(l) = self.open() {
                self.link = Some(l);
                self.broken = false;
                self.refill_rx(pool);
                self.flush_resend(pool);
                change = LinkChange::Reconnected;
            }
        }
        change
    }

    /// Whether connected to a back end.
    pub fn is_connected(&self) -> bool {
        self.link.is_some()
    }

    /// Packets kept for sending again after a back end went away.
    pub fn resend_queued(&self) -> usize {
        self.resend.len()
    }

    /// Takes everything back from a back end that closed or died
    /// (`xennet_disconnect_backend`): revokes every grant it was given — a grant it
    /// still maps is counted and its page kept out of use, as Linux defers such pages —
    /// frees posted RX buffers, keeps each unanswered TX packet whose pages came back to
    /// send again, frees the rings, closes the channel and moves to `Closed`. A no-op
    /// when not connected.
    pub fn disconnect(&mut self, pool: &mut SkbPool) {
        let Some(mut l) = self.link.take() else {
            return;
        };
        let dom = Arc::clone(&self.dom);
        let gt = dom.grant_table();
        self.abandon_partial(pool);
        // Grant reuse: every binding ended first (the back end's cache went with it); a
        // page whose grant will not end is still mapped and stays out of use.
        let stuck = match l.reuse.take() {
            Some(r) => r.close(&dom, &mut self.stats),
            None => Vec::new(),
        };
        // RX: buffers in flight, and those parked because the back end held their
        // grant when answered (tried again now: a dead back end's maps are gone).
        for id in 0..RING_IDS {
            let was = self.inflight.complete(id).is_ok();
            if was && self.rx_buffers == RxBuffers::GuestCopy {
                self.rx_free.push(id);
            }
            let b = self.rx_bufs[id as usize];
            let Some(g) = b.gfn else { continue };
            if !stuck.contains(&g) && gt.end_access(b.gref).is_ok() {
                let b = &mut self.rx_bufs[id as usize];
                b.gfn = None;
                let s = b.skb.take();
                self.rx_free.push(id);
                free_buf(pool, g, s);
            }
        }
        self.inflight = InFlight::default();
        // TX: every slot still out is revoked; a packet comes back whole or not at all.
        let mut kept: Vec<(u64, SkbId)> = Vec::new();
        // Slots parked because the back end held their grant are tried again first;
        // the packets they pinned go once none is held any more.
        for b in self.tx_bufs.iter_mut().filter(|b| b.held && !b.in_flight) {
            b.held = gt.end_access(b.gref).is_err();
        }
        if self.tx_bufs.iter().all(|b| !b.held || b.in_flight) {
            for s in self.tx_pinned_skbs.drain(..) {
                pool.free(s);
            }
        }
        for id in 0..RING_IDS as usize {
            let b = self.tx_bufs[id];
            if !b.in_flight {
                continue;
            }
            let mapped = gt.end_access(b.gref).is_err();
            let me = &mut self.tx_bufs[id];
            me.in_flight = false;
            me.held = mapped;
            if mapped {
                self.stats.grants_busy += 1;
            }
            self.tx_bufs[b.head as usize].pinned |= mapped;
        }
        for id in 0..RING_IDS as usize {
            let h = &mut self.tx_bufs[id];
            let Some(skb) = h.skb.take() else {
                continue;
            };
            if h.pinned {
                self.stats.tx_pinned += 1;
                self.tx_pinned_skbs.push(skb);
            } else {
                kept.push((h.seq, skb));
            }
        }
        kept.sort_unstable_by_key(|&(seq, _)| seq);
        self.resend.extend(kept.into_iter().map(|(_, s)| s));
        self.stats.tx_requeued += self.resend.len() as u64;
        // Every id whose grant came back is free again.
        self.tx_free = (0..RING_IDS)
            .rev()
            .filter(|&i| !self.tx_bufs[i as usize].held)
            .collect();
        // A ring the back end still maps goes back once it lets go.
        for &(g, r) in &l.rings {
            if !gt.end_access_deferred(r, Some(g)) {
                self.stats.grants_busy += 1;
            }
        }
        let Link { port, tx, rx, .. } = l;
        drop((tx, rx));
        let _ = self.hv.evtchn_close(&self.dom, port);
        let store = self.hv.store();
        let me = self.dom.id();
        let fdir = xenbus::frontend_dir(me, self.handle);
        let _ = store.switch_state(me, &fdir, XenbusState::Closing);
        let _ = store.switch_state(me, &fdir, XenbusState::Closed);
        self.broken = false;
        self.stats.disconnects += 1;
    }

    /// Removes the interface (`xennet_remove`): disconnects, frees the packets kept for
    /// sending again, and gives back every grant reference it owns. A buffer whose
    /// grant a back end still maps is left to the pool's deferred list
    /// ([`SkbPool::defer_release`]) with its reference, and comes back when the back end
    /// lets go.
    pub fn close(mut self, pool: &mut SkbPool) {
        self.disconnect(pool);
        for s in self.resend.drain(..) {
            pool.free(s);
        }
        // Every reference no back end maps goes back now; the rest below.
        self.forget();
        // RX buffers whose grant is still mapped, one by one.
        for b in self.rx_bufs.iter_mut() {
            if let Some(g) = b.gfn.take() {
                let held = b.skb.take().map_or(Held::Page(g), Held::Skb);
                pool.defer_release(vec![b.gref], vec![held]);
            }
        }
        // TX slots still mapped, with the packets they pin: together, since a packet
        // may span several.
        let held: Vec<GrantRef> = self
            .tx_bufs
            .iter_mut()
            .filter_map(|b| std::mem::take(&mut b.held).then_some(b.gref))
            .collect();
        let pinned: Vec<Held> = self.tx_pinned_skbs.drain(..).map(Held::Skb).collect();
        if !held.is_empty() || !pinned.is_empty() {
            pool.defer_release(held, pinned);
        }
    }

    /// Gives back every grant reference no back end still maps, and the watches.
    fn forget(&mut self) {
        let gt = self.dom.grant_table();
        let tx = self.tx_bufs.iter().filter(|b| !b.held).map(|b| b.gref);
        let rx = self
            .rx_bufs
            .iter()
            .filter(|b| b.gfn.is_none())
            .map(|b| b.gref);
        for r in tx.chain(rx) {
            gt.free_ref(r);
        }
        let store = self.hv.store();
        let me = self.dom.id();
        store.unwatch(
            me,
            &format!("{}/backend-id", xenbus::frontend_dir(me, self.handle)),
            "netfront-backend-id",
        );
        if let Some((d, _)) = self.otherend.take() {
            store.unwatch(me, &format!("{d}/state"), "netfront-otherend");
        }
    }

    /// Sends kept packets again, oldest first, while the ring has room.
    fn flush_resend(&mut self, pool: &mut SkbPool) {
        while let Some(skb) = self.resend.pop_front() {
            if let Err(s) = self.xmit_now(pool, skb) {
                self.resend.push_front(s);
                break;
            }
        }
        self.xmit_flush();
    }

    /// The guest's end of the event channel (none while disconnected).
    pub fn port(&self) -> Option<Port> {
        self.link.as_ref().map(|l| l.port)
    }
    /// Counters.
    pub fn stats(&self) -> &FrontStats {
        &self.stats
    }
    /// Whether a ring broke and the interface stopped.
    pub fn is_broken(&self) -> bool {
        self.broken
    }
    /// TX slots free now: a packet of up to this many pages can be queued (a stack
    /// stops its queue below one packet's worth, as `netif_stop_queue`).
    pub fn tx_room(&self) -> usize {
        match &self.link {
            Some(l) if !self.broken && self.resend.is_empty() => {
                (l.tx.free_requests() as usize).min(self.tx_free.len())
            }
            _ => 0,
        }
    }
    /// What the RX ring is kept full of.
    pub fn rx_buffers(&self) -> RxBuffers {
        self.rx_buffers
    }
    /// RX buffers posted and not yet returned.
    pub fn rx_posted(&self) -> u32 {
        self.inflight.count()
    }

    fn notify(&mut self) {
        let _c = enter(Class::Hypercall);
        if let Some(l) = &self.link {
            self.stats.notifies += 1;
            let _ = self.hv.evtchn_send(&self.dom, l.port);
        }
    }

    /// Posts a granted page for every free RX slot (`xennet_alloc_rx_buffers`).
    pub fn refill_rx(&mut self, pool: &mut SkbPool) {
        let _c = enter(Class::Driver);
        let Some(l) = self.link.as_mut().filter(|_| !self.broken) else {
            return;
        };
        let mut posted = false;
        while l.rx.free_requests() > 0 {
            let Some(id) = self.rx_free.pop() else { break };
            if self.rx_buffers == RxBuffers::GuestCopy {
                // A credit; posting the slot again gives back what was lent through it.
                self.inflight.post(id);
                l.note_rx_request(id);
                let _ = l.rx.push_request(&RxRequest {
                    id,
                    pad: 0,
                    gref: 0,
                });
                posted = true;
                continue;
            }
            let buf = {
                let _m = enter(Class::Mem);
                match self.rx_buffers {
                    RxBuffers::Fragments | RxBuffers::GuestCopy => {
                        pool.alloc_page().map(|g| (g, None))
                    }
                    RxBuffers::Linear => pool
                        .alloc_page_linear()
                        .map(|s| (pool.data_location(s).0, Some(s))),
                }
            };
            let Ok((gfn, skb)) = buf else {
                self.rx_free.push(id);
                break;
            };
            let b = &mut self.rx_bufs[id as usize];
            // With grant reuse, the page's own binding; else this slot's reference,
            // granted for the page now and ended at its response.
            let gref = match l.reuse.as_mut() {
                Some(r) => r.bind(&self.dom, l.be, gfn, &mut self.stats),
                // The unsafe stand-in: the page's machine frame, no grant at all.
                None if l.machine_frames => self.dom.pv_machine_frame(gfn).map(|m| GrantRef(m.0)),
                None => self
                    .dom
                    .grant_table()
                    .grant_access(b.gref, l.be, gfn, false)
                    .ok()
                    .map(|()| b.gref),
            };
            let Some(gref) = gref else {
                free_buf(pool, gfn, skb);
                self.rx_free.push(id);
                break;
            };
            b.gfn = Some(gfn);
            b.skb = skb;
            self.inflight.post(id);
            l.note_rx_request(id);
            let _ = l.rx.push_request(&RxRequest {
                id,
                pad: 0,
                gref: gref.0,
            });
            posted = true;
        }
        if posted && l.rx.push_requests_and_check_notify() {
            self.notify();
        }
    }

    /// Takes back buffer `id` after its response: revokes the grant and returns the
    /// page, or keeps it out of use if the back end still holds it.
    fn reclaim(&mut self, id: u16) -> Option<(Gfn, Option<SkbId>)> {
        let b = self.rx_bufs[id as usize];
        let gfn = b.gfn?;
        // With grant reuse the page keeps its grant (and the back end its mapping).
        let end = if self
            .link
            .as_ref()
            .is_some_and(|l| l.reuse.is_some() || l.machine_frames)
        {
            Ok(())
        } else {
            self.dom.grant_table().end_access(b.gref)
        };
        match end {
            Ok(()) => {
                let b = &mut self.rx_bufs[id as usize];
                b.gfn = None;
                let skb = b.skb.take();
                self.rx_free.push(id);
                Some((gfn, skb))
            }
            Err(GrantError::InUse) | Err(_) => {
                // The back end mapped it and kept it: neither the page nor the id can
                // be reused safely. Both stay out of circulation.
                self.stats.grants_busy += 1;
                None
            }
        }
    }

    /// Prefetches the first line of the buffer that the response `ahead` places after
    /// the next one answers, if it is published. Only a hint: a response that names no
    /// buffer of ours, or lies, costs a useless prefetch; it is judged when taken.
    fn prefetch_rx(&mut self, ahead: u32) {
        let Some(l) = self.link.as_mut() else {
            return;
        };
        let Ok(Some(rsp)) = l.rx.peek_response(ahead) else {
            return;
        };
        if let Some(gfn) = self.rx_bufs.get(usize::from(rsp.id)).and_then(|b| b.gfn) {
            self.dom.prefetch(gfn, usize::from(rsp.offset), false);
        }
    }

    /// Handles up to `budget` packets from the RX ring, handing each to `deliver`, then
    /// refills the ring. Returns the packets delivered.
    pub fn poll_rx(
        &mut self,
        pool: &mut SkbPool,
        budget: usize,
        mut deliver: impl FnMut(&mut SkbPool, SkbId),
    ) -> usize {
        let _c = enter(Class::Driver);
        if self.rx_buffers == RxBuffers::GuestCopy {
            return self.poll_rx_lent(pool, budget, &mut deliver);
        }
        let mut n = 0;
        // The first lines of the next responses' buffers, fetched ahead: the back end
        // wrote them on its core, and each is read below (the headers pulled into the
        // buffer's linear area); fetched together, the transfers overlap.
        for ahead in 0..RX_PREFETCH {
            self.prefetch_rx(ahead);
        }
        while n < budget && !self.broken {
            self.prefetch_rx(RX_PREFETCH);
            let Some(l) = self.link.as_mut() else {
                break;
            };
            let Some(rsp) = next_response(&mut l.rx, &mut self.broken) else {
                break;
            };
            l.rx_rsp_seq = l.rx_rsp_seq.wrapping_add(1);
            let offload_rx = l.offload_rx;
            if let Some(skb) = self.rx_slot(pool, &rsp, offload_rx) {
                self.stats.rx_packets += 1;
                n += 1;
                deliver(pool, skb);
            }
        }
        self.refill_rx(pool);
        n
    }

    /// [`Netfront::poll_rx`] for a guest-copy front end: batches of lent buffers until
    /// the budget is spent or a batch comes back short.
    #[inline]
    fn poll_rx_lent(
        &mut self,
        pool: &mut SkbPool,
        budget: usize,
        deliver: &mut impl FnMut(&mut SkbPool, SkbId),
    ) -> usize {
        let mut n = 0;
        while n < budget {
            let (delivered, taken) = self.poll_rx_copy(pool, budget - n, &mut *deliver);
            n += delivered;
            if taken < COPY_BATCH {
                break;
            }
        }
        self.refill_rx(pool);
        n
    }

    /// One response off the RX ring, judged: its extras taken, its buffer reclaimed and
    /// joined to the packet under way. Returns a packet it completed; a slot refused
    /// (counted) or one packet's middle returns nothing.
    #[inline]
    fn rx_slot(&mut self, pool: &mut SkbPool, rsp: &RxResponse, offload_rx: bool) -> Option<SkbId> {
        // A packet's extras follow its first slot, whatever that slot's status
        // (`xennet_get_extras`): their slots are taken now, so that they are not read as
        // data.
        let extras = (rsp.flags & NETRXF_EXTRA_INFO != 0 && self.partial.is_none() && offload_rx)
            .then(|| self.take_extras(pool));
        let len = match check_rx_response(rsp, &mut self.inflight) {
            Ok(l) => l,
            Err(e) => {
                self.stats.rx_errors.add(e);
                if matches!(e, RxError::CrossesPage | RxError::ErrorStatus) {
                    // The id was ours: take the buffer back.
                    if let Some((g, s)) = self.reclaim(rsp.id) {
                        free_buf(pool, g, s);
                    }
                }
                self.abandon_partial(pool);
                return None;
            }
        };
        let Some((gfn, linear)) = self.reclaim(rsp.id) else {
            self.abandon_partial(pool);
            return None;
        };
        let more = rsp.flags & NETRXF_MORE_DATA != 0;
        let gso = match extras {
            None => None,
            Some(Ok(g)) => g,
            Some(Err(fault)) => {
                // A bad extra loses its packet, whole: the rest of its slots are skipped.
                match fault {
                    ExtraFault::Chain => self.stats.rx_bad_chain += 1,
                    ExtraFault::Offload(e) => self.stats.rx_offload_errors.add(e),
                }
                free_buf(pool, gfn, linear);
                self.skipping = more;
                return None;
            }
        };
        if rsp.flags & NETRXF_EXTRA_INFO != 0 && extras.is_none() {
            // No extras were negotiated.
            self.stats.rx_bad_chain += 1;
            free_buf(pool, gfn, linear);
            self.abandon_partial(pool);
            return None;
        }
        if let Some(skb) = linear {
            return self.rx_linear(pool, rsp, skb, len);
        }
        if self.skipping {
            // The rest of a packet already lost.
            self.skipping = more;
            pool.free_page(gfn);
            return None;
        }
        let skb = match self.partial.take() {
            Some(s) => s,
            None => self.rx_new_packet(pool, rsp, gso, gfn)?,
        };
        if !self.rx_attach(pool, skb, gfn, rsp.offset as usize, len as usize) {
            self.stats.rx_bad_chain += 1;
            pool.free(skb);
            return None;
        }
        if more {
            if pool.frags(skb).len() == MAX_SKB_FRAGS {
                self.stats.rx_bad_chain += 1;
                pool.free(skb);
                self.skipping = true;
            } else {
                self.partial = Some(skb);
            }
            return None;
        }
        if let Err(e) = finish_offload(pool, skb) {
            self.stats.rx_offload_errors.add(e);
            pool.free(skb);
            return None;
        }
        self.stats.rx_gso_packets += u64::from(pool.offload(skb).gso.is_some());
        Some(skb)
    }

    /// A response into a linear buffer (no fragments were posted): the back end wrote
    /// into the buffer's own linear area, so the packet is whole, or refused whole if it
    /// is a chain (no scatter-gather was offered).
    #[inline]
    fn rx_linear(
        &mut self,
        pool: &mut SkbPool,
        rsp: &RxResponse,
        skb: SkbId,
        len: u16,
    ) -> Option<SkbId> {
        let more = rsp.flags & NETRXF_MORE_DATA != 0;
        if more || self.skipping {
            self.stats.rx_bad_chain += u64::from(!self.skipping);
            self.skipping = more;
            pool.free(skb);
            return None;
        }
        if pool
            .reserve(skb, rsp.offset as usize)
            .and_then(|()| pool.extend_linear(skb, len as usize))
            .is_err()
        {
            // Cannot happen once the response is checked to stay in its page.
            self.stats.rx_bad_chain += 1;
            pool.free(skb);
            return None;
        }
        pool.set_csum_valid(skb, rsp.flags & NETRXF_DATA_VALIDATED != 0);
        Some(skb)
    }

    /// A packet's first slot: a buffer for it, with the offload the response's flags
    /// and extras say. `None` (counted, the page given back) if the pool is empty.
    #[inline]
    fn rx_new_packet(
        &mut self,
        pool: &mut SkbPool,
        rsp: &RxResponse,
        gso: Option<Gso>,
        gfn: Gfn,
    ) -> Option<SkbId> {
        let _m = enter(Class::Mem);
        let Ok(s) = pool.alloc(NET_SKB_PAD) else {
            self.stats.rx_no_buffer += 1;
            pool.free_page(gfn);
            return None;
        };
        let csum = if rsp.flags & NETRXF_CSUM_BLANK != 0 && self.offloads {
            // Where it lies is found from the headers at the end.
            Csum::Partial {
                start: 0,
                offset: 0,
            }
        } else if rsp.flags & NETRXF_DATA_VALIDATED != 0 {
            Csum::Valid
        } else {
            Csum::None
        };
        pool.set_offload(s, Offload { csum, gso });
        Some(s)
    }

    /// Joins `len` bytes at `off` in page `gfn` to `skb`: the first bytes of a packet go
    /// to its linear area (copied), the rest stay in the page as a fragment. Returns
    /// false if they could not be joined.
    #[inline]
    fn rx_attach(
        &mut self,
        pool: &mut SkbPool,
        skb: SkbId,
        gfn: Gfn,
        off: usize,
        len: usize,
    ) -> bool {
        let lin = if pool.len(skb) == 0 {
            len.min(RX_COPY_LEN)
        } else {
            0
        };
        let (hg, hoff) = pool.data_location(skb);
        let copied = lin == 0
            || self
                .dom
                .copy(gfn, off, hg, hoff, lin)
                .is_ok_and(|()| pool.extend_linear(skb, lin).is_ok());
        let attached = copied
            && if len > lin {
                let frag = Frag {
                    page: FragPage::Local(gfn),
                    offset: (off + lin) as u16,
                    len: (len - lin) as u16,
                };
                pool.add_frag(skb, frag).is_ok()
            } else {
                pool.free_page(gfn);
                true
            };
        if !attached && copied && len > lin {
            pool.free_page(gfn);
        }
        attached
    }

    /// The guest-copy receive path: up to `budget` responses, each a packet in a
    /// buffer the back end lends; a buffer of the packet's size for each, placed at the
    /// same offset in its cache line as the source; one `GNTTABOP_copy` for them all,
    /// issued by this guest (so the copy and the hypervisor's work are the guest's);
    /// then each packet is delivered and its slot posted again, which gives the back end
    /// its buffer back. Returns the packets delivered and the responses taken.
    fn poll_rx_copy(
        &mut self,
        pool: &mut SkbPool,
        budget: usize,
        deliver: &mut impl FnMut(&mut SkbPool, SkbId),
    ) -> (usize, usize) {
        let Some(l) = self.link.as_mut() else {
            return (0, 0);
        };
        let base = match l.rx_grant_base {
            Some(b) => b,
            None => {
                let key = format!("{}/{}", l.bdir, xenbus::RX_GRANT_BASE);
                match xenbus::read_u32(self.hv.store(), self.dom.id(), &key) {
                    Ok(b) => *l.rx_grant_base.insert(b),
                    Err(_) => return (0, 0),
                }
            }
        };
        let be = l.be;
        let batch = &mut self.copy_batch;
        batch.clear();
        // The packet under way, while its chain goes on: its index in `pkts`, or, for
        // a packet no buffer could be had for, its remaining slots are skipped.
        let mut open: Option<Option<usize>> = None;
        while !self.broken
            && (open.is_some()
                || (batch.pkts.len() < budget.min(COPY_BATCH) && batch.copies.len() < COPY_BATCH))
        {
            let Some(rsp) = next_response(&mut l.rx, &mut self.broken) else {
                break;
            };
            l.rx_rsp_seq = l.rx_rsp_seq.wrapping_add(1);
            let len = match check_rx_response(&rsp, &mut self.inflight) {
                Ok(len) => len as usize,
                Err(e) => {
                    self.stats.rx_errors.add(e);
                    // A slot that was ours is posted again.
                    if !matches!(e, RxError::BadId | RxError::NotInFlight) {
                        self.rx_free.push(rsp.id);
                    }
                    // The chain it belonged to is broken.
                    if let Some(p) = open.take() {
                        self.stats.rx_bad_chain += 1;
                        if let Some(p) = p {
                            batch.pkts[p].bad = true;
                        }
                    }
                    continue;
                }
            };
            batch.slots.push(rsp.id);
            let more = rsp.flags & NETRXF_MORE_DATA != 0;
            if rsp.flags & NETRXF_EXTRA_INFO != 0 {
                // Extras were not negotiated.
                self.stats.rx_bad_chain += 1;
                if let Some(Some(p)) = open.take() {
                    batch.pkts[p].bad = true;
                }
                continue;
            }
            let p = match open {
                Some(Some(p)) => p,
                Some(None) => {
                    open = more.then_some(None);
                    continue;
                }
                None => match batch.open_packet(pool, &rsp) {
                    Some(p) => p,
                    None => {
                        self.stats.rx_no_buffer += 1;
                        // The rest of its chain, if any, is skipped.
                        open = more.then_some(None);
                        continue;
                    }
                },
            };
            let src = GrantRef(base.wrapping_add(u32::from(rsp.id)));
            if !batch.add_copy(pool, p, be, src, rsp.offset, len) {
                self.stats.rx_bad_chain += 1;
            }
            open = more.then_some(Some(p));
        }
        if let Some(p) = open {
            // The back end stopped in the middle of a chain.
            self.stats.rx_bad_chain += 1;
            if let Some(p) = p {
                batch.pkts[p].bad = true;
            }
        }
        let taken = batch.slots.len();
        (self.deliver_copied(pool, deliver), taken)
    }

    /// The guest-copy batch's end: one `GNTTABOP_copy` for every copy, every slot taken
    /// posted again (which gives the back end what it lent), and each packet whose
    /// copies all succeeded delivered. Returns the packets delivered.
    #[inline]
    fn deliver_copied(
        &mut self,
        pool: &mut SkbPool,
        deliver: &mut impl FnMut(&mut SkbPool, SkbId),
    ) -> usize {
        let batch = &mut self.copy_batch;
        let k = batch.copies.len();
        if k > 0 {
            let _h = enter(Class::Hypercall);
            self.hv
                .grant_copy(&self.dom, &batch.copies, &mut batch.status[..k]);
        }
        self.rx_free.extend_from_slice(&batch.slots);
        let mut n = 0;
        for pkt in &batch.pkts {
            let copied = batch.status[pkt.first..pkt.first + pkt.n]
                .iter()
                .all(|s| s.is_ok());
            if pkt.bad {
                pool.free(pkt.skb);
                continue;
            }
            if !copied || pool.extend_linear(pkt.skb, pkt.len).is_err() {
                self.stats.rx_copy_errors += 1;
                pool.free(pkt.skb);
                continue;
            }
            self.stats.rx_packets += 1;
            n += 1;
            deliver(pool, pkt.skb);
        }
        n
    }

    /// Takes the extra-info slots after a packet's first response, giving back the
    /// buffer each one's request slot held. Returns the GSO they carry; a chain that is
    /// cut short, longer than there are extra types, with an extra of type 0 or
    /// unknown, or a GSO extra of size 0 or a type other than TCPv4, is refused.
    fn take_extras(&mut self, pool: &mut SkbPool) -> Result<Option<Gso>, ExtraFault> {
        let mut gso = None;
        let mut fault = None;
        // The whole chain is taken, however long (bounded by what the ring holds), so
        // that no extra is read as data; more extras than there are types is a fault.
        for taken in 1.. {
            if taken > usize::from(XEN_NETIF_EXTRA_TYPE_MAX) {
                fault.get_or_insert(ExtraFault::Chain);
            }
            let Some(l) = self.link.as_mut() else {
                return Err(ExtraFault::Chain);
            };
            let Some(raw) = next_response(&mut l.rx, &mut self.broken) else {
                return Err(ExtraFault::Chain);
            };
            let pos = l.rx_rsp_seq;
            l.rx_rsp_seq = pos.wrapping_add(1);
            let id = l.rx_pos[(pos % u32::from(RING_IDS)) as usize];
            // The slot's buffer comes back unused, if it is still out (a back end
            // that answered it by id already gave it back then).
            if self.inflight.complete(id).is_ok() {
                if let Some((g, s)) = self.reclaim(id) {
                    free_buf(pool, g, s);
                }
            }
            let e = ExtraInfo::from_rx_slot(&raw);
            if e.ty == XEN_NETIF_EXTRA_TYPE_NONE || e.ty >= XEN_NETIF_EXTRA_TYPE_MAX {
                fault.get_or_insert(ExtraFault::Chain);
            } else if e.ty == XEN_NETIF_EXTRA_TYPE_GSO {
                if e.gso_size() == 0 {
                    fault.get_or_insert(ExtraFault::Offload(OffloadError::GsoSizeZero));
                } else if e.gso_type() != XEN_NETIF_GSO_TYPE_TCPV4 {
                    fault.get_or_insert(ExtraFault::Offload(OffloadError::BadGsoType));
                } else {
                    gso = Some(Gso {
                        size: e.gso_size(),
                        ty: e.gso_type(),
                    });
                }
            }
            if e.flags & XEN_NETIF_EXTRA_FLAG_MORE == 0 {
                break;
            }
        }
        fault.map_or(Ok(gso), Err)
    }

    fn abandon_partial(&mut self, pool: &mut SkbPool) {
        self.skipping = false;
        if let Some(s) = self.partial.take() {
            self.stats.rx_bad_chain += 1;
            pool.free(s);
        }
    }

    /// Queues a packet for transmission (`xennet_start_xmit`): one read-only grant and
    /// one request per page its bytes lie in. Gives the buffer back if the ring is full.
    /// While disconnected, or while packets a dead back end never answered still wait
    /// to be sent again, the buffer is given back as for a full ring.
    pub fn xmit(&mut self, pool: &mut SkbPool, skb: SkbId) -> Result<(), SkbId> {
        self.xmit_more(pool, skb)?;
        self.xmit_flush();
        Ok(())
    }

    /// As [`Self::xmit`], but the packet's requests are not published yet: more packets
    /// follow at once (Linux's `netdev_xmit_more`, a DPDK burst). [`Self::xmit_flush`]
    /// publishes them all with one index write and one notification check; until then
    /// the back end does not see them.
    pub fn xmit_more(&mut self, pool: &mut SkbPool, skb: SkbId) -> Result<(), SkbId> {
        if !self.resend.is_empty() {
            self.flush_resend(pool);
            if !self.resend.is_empty() {
                return Err(skb);
            }
        }
        self.xmit_now(pool, skb)
    }

    /// Publishes the requests written since the last publication, and notifies the back
    /// end if it asked (`RING_PUSH_REQUESTS_AND_CHECK_NOTIFY`).
    pub fn xmit_flush(&mut self) {
        let Some(l) = self.link.as_mut() else {
            return;
        };
        if !self.broken && l.tx.push_requests_and_check_notify() {
            self.notify();
        }
    }

    /// Writes one packet's requests, unpublished. `Err` gives the packet back to be
    /// held (the ring or the slots are full, or no link); a packet no ring will ever
    /// take is dropped, counted.
    fn xmit_now(&mut self, pool: &mut SkbPool, skb: SkbId) -> Result<(), SkbId> {
        let _c = enter(Class::Driver);
        if self.broken {
            pool.free(skb);
            return Ok(());
        }
        let Some(segs) = self.tx_admit(pool, skb)? else {
            return Ok(());
        };
        let Some(l) = self.link.as_mut() else {
            return Err(skb);
        };
        let len = pool.len(skb);
        let off = pool.offload(skb);
        let first_flags = tx_first_flags(&off);
        let (be, dom) = (l.be, &self.dom);
        // With grant reuse, each page's binding (found or made before the walk).
        let mut bound = [None; LEGACY_SLOTS_MAX];
        if let Some(r) = l.reuse.as_mut() {
            let mut k = 0;
            let _ = pool.walk(skb, 0, len, |seg, _| {
                if let SegPage::Own(gfn) = seg.page {
                    bound[k] = r.bind(dom, be, gfn, &mut self.stats);
                }
                k += 1;
                Ok(())
            });
            if bound[..segs].iter().any(Option::is_none) {
                return Err(skb);
            }
        }
        let reuse = l.reuse.is_some();
        let gt = dom.grant_table();
        let (tx, tx_free, tx_bufs) = (&mut l.tx, &mut self.tx_free, &mut self.tx_bufs);
        let mut k = 0;
        let mut head = None;
        let r = pool.walk(skb, 0, len, |seg, _| {
            let SegPage::Own(gfn) = seg.page else {
                return Err(crate::skb::SkbError::OutOfBounds);
            };
            let id = tx_free.pop().ok_or(crate::skb::SkbError::Exhausted)?;
            let b = &mut tx_bufs[id as usize];
            let gref = match bound[k] {
                Some(g) if reuse => g,
                _ => {
                    gt.grant_access(b.gref, be, gfn, true)
                        .map_err(|_| crate::skb::SkbError::Exhausted)?;
                    b.gref
                }
            };
            let h = *head.get_or_insert(id);
            b.in_flight = true;
            b.held = false;
            b.head = h;
            k += 1;
            let more = if k < segs { NETTXF_MORE_DATA } else { 0 };
            let _ = tx.push_request(&TxRequest {
                gref: gref.0,
                offset: seg.offset as u16,
                flags: if k == 1 { more | first_flags } else { more },
                id,
                size: if k == 1 { len as u16 } else { seg.len as u16 },
            });
            // The GSO extra follows the first slot.
            if let (1, Some(g)) = (k, off.gso) {
                let _ = tx.push_request(&ExtraInfo::gso(g.size, g.ty, false).to_tx_slot());
            }
            Ok(())
        });
        let Some(head) = head.filter(|_| r.is_ok()) else {
            // Cannot happen for a buffer of our own pages within the slot limit; if it
            // did, the requests already written are not published, and are withdrawn.
            self.broken = true;
            pool.free(skb);
            return Ok(());
        };
        self.stats.tx_gso_packets += u64::from(off.gso.is_some());
        let h = &mut self.tx_bufs[head as usize];
        h.skb = Some(skb);
        h.seq = self.tx_seq;
        self.tx_seq += 1;
        h.left = segs as u8;
        h.failed = false;
        h.pinned = false;
        Ok(())
    }

    /// Whether a packet can go now: `Ok(Some(slots))` it can, in that many slots;
    /// `Ok(None)` it was dropped (counted) since no ring will ever take it; `Err` it
    /// waits (no link, the ring or the slots are full, or no page to move its head to).
    #[inline]
    fn tx_admit(&mut self, pool: &mut SkbPool, skb: SkbId) -> Result<Option<usize>, SkbId> {
        let Some(l) = self.link.as_ref() else {
            return Err(skb);
        };
        // A grant opens a whole page: data in a head that shares its page with
        // another buffer moves to a page of its own first, so the back end can read
        // this packet and nothing else (XSA-403). Without a page to move to, the
        // buffer is given back as for a full ring.
        {
            let _m = enter(Class::Mem);
            match pool.own_head_pages(skb) {
                Ok(n) => self.stats.tx_bounced_bytes += n as u64,
                Err(_) => return Err(skb),
            }
        }
        let len = pool.len(skb);
        let mut segs = 0usize;
        let _ = pool.walk(skb, 0, len, |_, _| {
            segs += 1;
            Ok(())
        });
        // A large packet goes as one only to a back end that takes it (the guest's
        // stack offers the TAP large packets only when the interface has GSO).
        let gso = pool.offload(skb).gso.is_some();
        if gso && !l.gso_tx {
            self.stats.tx_gso_refused += 1;
            pool.free(skb);
            return Ok(None);
        }
        if segs == 0 || segs > LEGACY_SLOTS_MAX || len > u16::MAX as usize {
            self.stats.tx_errors += 1;
            pool.free(skb);
            return Ok(None);
        }
        if segs + usize::from(gso) > l.tx.free_requests() as usize || segs > self.tx_free.len() {
            return Err(skb);
        }
        Ok(Some(segs))
    }

    /// Handles transmit completions: revokes each slot's grant and frees finished
    /// packets. Returns completions handled.
    pub fn poll_tx(&mut self, pool: &mut SkbPool) -> usize {
        let _c = enter(Class::Driver);
        let mut n = 0;
        while !self.broken {
            let Some(l) = self.link.as_mut() else {
                break;
            };
            let Some(rsp) = next_response(&mut l.tx, &mut self.broken) else {
                break;
            };
            if rsp.status == XEN_NETIF_RSP_NULL {
                continue;
            }
            let Some(b) = self.tx_bufs.get(rsp.id as usize).copied() else {
                self.stats.tx_bad_response += 1;
                continue;
            };
            if !b.in_flight {
                self.stats.tx_bad_response += 1;
                continue;
            }
            // With grant reuse the pages keep their grants.
            let reuse = self.link.as_ref().is_some_and(|l| l.reuse.is_some());
            let mapped = !reuse && self.dom.grant_table().end_access(b.gref).is_err();
            let me = &mut self.tx_bufs[rsp.id as usize];
            me.in_flight = false;
            me.held = mapped;
            if mapped {
                // Still mapped by the back end: this id and the packet's pages stay out
                // of use for good.
                self.stats.grants_busy += 1;
            } else if rsp.id != b.head {
                // The head's id carries the packet's state until its last slot is in.
                self.tx_free.push(rsp.id);
            }
            if rsp.status != XEN_NETIF_RSP_OKAY {
                self.stats.tx_errors += 1;
            }
            let h = &mut self.tx_bufs[b.head as usize];
            h.pinned |= mapped;
            h.failed |= rsp.status != XEN_NETIF_RSP_OKAY;
            h.left -= 1;
            if h.left == 0 {
                // The last slot of the packet is answered: its pages are granted to
                // no one any more (unless pinned), so the buffer can go.
                let (skb, failed, pinned) = (h.skb.take(), h.failed, h.pinned);
                if !h.held {
                    self.tx_free.push(b.head);
                }
                if let Some(skb) = skb {
                    if pinned {
                        self.stats.tx_pinned += 1;
                        self.tx_pinned_skbs.push(skb);
                    } else {
                        if !failed {
                            self.stats.tx_packets += 1;
                        }
                        let _m = enter(Class::Mem);
                        pool.free(skb);
                    }
                }
            }
            n += 1;
        }
        if !self.resend.is_empty() {
            self.flush_resend(pool);
        }
        n
    }

    /// Whether RX responses are waiting.
    pub fn rx_ready(&mut self) -> bool {
        match self.link.as_mut() {
            Some(l) if !self.broken => l.rx.final_check_for_responses().unwrap_or(false),
            _ => false,
        }
    }
}
