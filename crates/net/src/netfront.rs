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

use crate::counters::PerReason;
use std::sync::Arc;

use hv::profile::{enter, Class};
use hv::store::XenbusState;
use hv::OwnPage;
use hv::{DomId, Domain, Gfn, GrantError, GrantRef, Hypervisor, Port};
use ring::{FrontRing, PageRing};

use crate::netif::{
    check_rx_response, InFlight, RxError, RxRequest, RxRing, TxRequest, TxRing, LEGACY_SLOTS_MAX,
    NETRXF_DATA_VALIDATED, NETRXF_EXTRA_INFO, NETRXF_MORE_DATA, NETTXF_MORE_DATA, RING_IDS,
    XEN_NETIF_RSP_NULL, XEN_NETIF_RSP_OKAY,
};
use crate::skb::{Frag, FragPage, SegPage, SkbId, SkbPool, MAX_SKB_FRAGS, NET_SKB_PAD};
use crate::xenbus::{self, XenbusError};

/// Bytes netfront copies from the first fragment into the linear area.
pub const RX_COPY_LEN: usize = 200;

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
}

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
}

crate::counter_set!(FrontStats {
    rx_packets,
    rx_errors,
    rx_no_buffer,
    rx_bad_chain,
    grants_busy,
    tx_packets,
    tx_pinned,
    tx_bounced_bytes,
    tx_errors,
    tx_bad_response,
    notifies
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
    left: u8,
    failed: bool,
    pinned: bool,
}

/// One interface's front end.
#[derive(Debug)]
pub struct Netfront {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    be: DomId,
    port: Port,
    tx: Front<TxRing>,
    rx: Front<RxRing>,
    rx_bufs: Box<[RxBuf]>,
    rx_free: Vec<u16>,
    inflight: InFlight,
    tx_bufs: Box<[TxBuf]>,
    tx_free: Vec<u16>,
    /// A packet being assembled from a multi-slot response chain.
    partial: Option<SkbId>,
    rx_buffers: RxBuffers,
    /// The rest of a multi-slot chain a linear front end refused is being skipped.
    skipping: bool,
    stats: FrontStats,
    broken: bool,
}

/// The next response on a ring, copied out; when none is waiting, arms the ring's
/// event and looks once more (`RING_FINAL_CHECK_FOR_RESPONSES`). A broken index marks
/// the interface broken.
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

/// Gives back a posted buffer that carries no packet.
fn free_buf(pool: &mut SkbPool, gfn: Gfn, skb: Option<SkbId>) {
    match skb {
        Some(s) => pool.free(s),
        None => pool.free_page(gfn),
    }
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
        let store = hv.store();
        let me = dom.id();
        let fdir = xenbus::frontend_dir(me, handle);
        let be = DomId(xenbus::read_u32(store, me, &format!("{fdir}/backend-id"))? as u16);
        let bdir = store
            .read(me, &format!("{fdir}/backend"))
            .map_err(|_| XenbusError::BadKey(format!("{fdir}/backend")))?;
        let st = store.xenbus_state(me, &bdir);
        if !matches!(st, XenbusState::InitWait | XenbusState::Connected) {
            return Err(XenbusError::PeerState(st));
        }
        if !xenbus::feature(store, me, &bdir, "feature-rx-copy") {
            return Err(XenbusError::MissingFeature("feature-rx-copy"));
        }
        let gt = dom.grant_table();
        let oom = || XenbusError::BadKey("out of pages or grant references".into());
        let ring = || -> Result<(Gfn, GrantRef), XenbusError> {
            let g = dom.alloc_page().map_err(|_| oom())?;
            let r = gt.alloc_ref().ok_or_else(oom)?;
            gt.grant_access(r, be, g, false).map_err(|_| oom())?;
            Ok((g, r))
        };
        let (tg, tr) = ring()?;
        let (rg, rr) = ring()?;
        let page = |g| dom.page(g).map_err(|_| oom());
        let tx =
            FrontRing::init(PageRing::new(page(tg)?).map_err(|_| oom())?).map_err(|_| oom())?;
        let rx =
            FrontRing::init(PageRing::new(page(rg)?).map_err(|_| oom())?).map_err(|_| oom())?;
        let port = hv.evtchn_alloc_unbound(dom, be).map_err(|_| oom())?;
        let refs = || gt.alloc_ref().ok_or_else(oom);
        let rx_bufs = (0..RING_IDS)
            .map(|_| {
                Ok(RxBuf {
                    gref: refs()?,
                    gfn: None,
                    skb: None,
                })
            })
            .collect::<Result<Vec<_>, XenbusError>>()?;
        let tx_bufs = (0..RING_IDS)
            .map(|_| {
                Ok(TxBuf {
                    gref: refs()?,
                    in_flight: false,
                    held: false,
                    head: 0,
                    skb: None,
                    left: 0,
                    failed: false,
                    pinned: false,
                })
            })
            .collect::<Result<Vec<_>, XenbusError>>()?;
        let sg = if rx_buffers == RxBuffers::Fragments {
            "1"
        } else {
            "0"
        };
        for (k, v) in [
            ("tx-ring-ref", tr.0.to_string()),
            ("rx-ring-ref", rr.0.to_string()),
            ("event-channel", port.0.to_string()),
            ("request-rx-copy", "1".into()),
            ("feature-rx-notify", "1".into()),
            ("feature-sg", sg.into()),
        ] {
            store.write(me, &format!("{fdir}/{k}"), &v)?;
        }
        store.switch_state(me, &fdir, XenbusState::Connected)?;
        Ok(Self {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
            be,
            port,
            tx,
            rx,
            rx_bufs: rx_bufs.into_boxed_slice(),
            rx_free: (0..RING_IDS).rev().collect(),
            inflight: InFlight::default(),
            tx_bufs: tx_bufs.into_boxed_slice(),
            tx_free: (0..RING_IDS).rev().collect(),
            partial: None,
            rx_buffers,
            skipping: false,
            stats: FrontStats::default(),
            broken: false,
        })
    }

    /// The guest's end of the event channel.
    pub fn port(&self) -> Port {
        self.port
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
        if self.broken {
            return 0;
        }
        (self.tx.free_requests() as usize).min(self.tx_free.len())
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
        self.stats.notifies += 1;
        let _ = self.hv.evtchn_send(&self.dom, self.port);
    }

    /// Posts a granted page for every free RX slot (`xennet_alloc_rx_buffers`).
    pub fn refill_rx(&mut self, pool: &mut SkbPool) {
        let _c = enter(Class::Driver);
        if self.broken {
            return;
        }
        let mut posted = false;
        while self.rx.free_requests() > 0 {
            let Some(id) = self.rx_free.pop() else { break };
            let buf = {
                let _m = enter(Class::Mem);
                match self.rx_buffers {
                    RxBuffers::Fragments => pool.alloc_page().map(|g| (g, None)),
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
            if self
                .dom
                .grant_table()
                .grant_access(b.gref, self.be, gfn, false)
                .is_err()
            {
                free_buf(pool, gfn, skb);
                self.rx_free.push(id);
                break;
            }
            b.gfn = Some(gfn);
            b.skb = skb;
            self.inflight.post(id);
            let _ = self.rx.push_request(&RxRequest {
                id,
                pad: 0,
                gref: b.gref.0,
            });
            posted = true;
        }
        if posted && self.rx.push_requests_and_check_notify() {
            self.notify();
        }
    }

    /// Takes back buffer `id` after its response: revokes the grant and returns the
    /// page, or keeps it out of use if the back end still holds it.
    fn reclaim(&mut self, id: u16) -> Option<(Gfn, Option<SkbId>)> {
        let b = self.rx_bufs[id as usize];
        let gfn = b.gfn?;
        match self.dom.grant_table().end_access(b.gref) {
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

    /// Handles up to `budget` packets from the RX ring, handing each to `deliver`, then
    /// refills the ring. Returns the packets delivered.
    pub fn poll_rx(
        &mut self,
        pool: &mut SkbPool,
        budget: usize,
        mut deliver: impl FnMut(&mut SkbPool, SkbId),
    ) -> usize {
        let _c = enter(Class::Driver);
        let mut n = 0;
        while n < budget && !self.broken {
            let Some(rsp) = next_response(&mut self.rx, &mut self.broken) else {
                break;
            };
            let len = match check_rx_response(&rsp, &mut self.inflight) {
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
                    continue;
                }
            };
            let Some((gfn, linear)) = self.reclaim(rsp.id) else {
                self.abandon_partial(pool);
                continue;
            };
            if rsp.flags & NETRXF_EXTRA_INFO != 0 {
                // No extras were negotiated.
                self.stats.rx_bad_chain += 1;
                free_buf(pool, gfn, linear);
                self.abandon_partial(pool);
                continue;
            }
            if let Some(skb) = linear {
                // The back end wrote into the buffer's own linear area.
                let more = rsp.flags & NETRXF_MORE_DATA != 0;
                if more || self.skipping {
                    // No scatter-gather was offered: a chain is refused whole.
                    self.stats.rx_bad_chain += u64::from(!self.skipping);
                    self.skipping = more;
                    pool.free(skb);
                    continue;
                }
                if pool
                    .reserve(skb, rsp.offset as usize)
                    .and_then(|()| pool.extend_linear(skb, len as usize))
                    .is_err()
                {
                    // Cannot happen once the response is checked to stay in its page.
                    self.stats.rx_bad_chain += 1;
                    pool.free(skb);
                    continue;
                }
                pool.set_csum_valid(skb, rsp.flags & NETRXF_DATA_VALIDATED != 0);
                self.stats.rx_packets += 1;
                n += 1;
                deliver(pool, skb);
                continue;
            }
            let skb = match self.partial.take() {
                Some(s) => s,
                None => {
                    let _m = enter(Class::Mem);
                    match pool.alloc(NET_SKB_PAD) {
                        Ok(s) => {
                            pool.set_csum_valid(s, rsp.flags & NETRXF_DATA_VALIDATED != 0);
                            s
                        }
                        Err(_) => {
                            self.stats.rx_no_buffer += 1;
                            pool.free_page(gfn);
                            continue;
                        }
                    }
                }
            };
            let (off, len) = (rsp.offset as usize, len as usize);
            // The first bytes go to the linear area; the rest stays in the page.
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
                    pool.add_frag(
                        skb,
                        Frag {
                            page: FragPage::Local(gfn),
                            offset: (off + lin) as u16,
                            len: (len - lin) as u16,
                        },
                    )
                    .is_ok()
                } else {
                    pool.free_page(gfn);
                    true
                };
            if !attached {
                if copied && len > lin {
                    pool.free_page(gfn);
                }
                self.stats.rx_bad_chain += 1;
                pool.free(skb);
                continue;
            }
            if rsp.flags & NETRXF_MORE_DATA != 0 {
                if pool.frags(skb).len() == MAX_SKB_FRAGS {
                    self.stats.rx_bad_chain += 1;
                    pool.free(skb);
                } else {
                    self.partial = Some(skb);
                }
                continue;
            }
            self.stats.rx_packets += 1;
            n += 1;
            deliver(pool, skb);
        }
        self.refill_rx(pool);
        n
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
    pub fn xmit(&mut self, pool: &mut SkbPool, skb: SkbId) -> Result<(), SkbId> {
        let _c = enter(Class::Driver);
        if self.broken {
            pool.free(skb);
            return Ok(());
        }
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
        if segs == 0
            || segs > LEGACY_SLOTS_MAX
            || segs > self.tx.free_requests() as usize
            || segs > self.tx_free.len()
            || len > u16::MAX as usize
        {
            return Err(skb);
        }
        let (be, dom) = (self.be, &self.dom);
        let gt = dom.grant_table();
        let (tx, tx_free, tx_bufs) = (&mut self.tx, &mut self.tx_free, &mut self.tx_bufs);
        let mut k = 0;
        let mut head = None;
        let r = pool.walk(skb, 0, len, |seg, _| {
            let SegPage::Own(gfn) = seg.page else {
                return Err(crate::skb::SkbError::OutOfBounds);
            };
            let id = tx_free.pop().ok_or(crate::skb::SkbError::Exhausted)?;
            let b = &mut tx_bufs[id as usize];
            gt.grant_access(b.gref, be, gfn, true)
                .map_err(|_| crate::skb::SkbError::Exhausted)?;
            let h = *head.get_or_insert(id);
            b.in_flight = true;
            b.held = false;
            b.head = h;
            k += 1;
            let _ = tx.push_request(&TxRequest {
                gref: b.gref.0,
                offset: seg.offset as u16,
                flags: if k < segs { NETTXF_MORE_DATA } else { 0 },
                id,
                size: if k == 1 { len as u16 } else { seg.len as u16 },
            });
            Ok(())
        });
        let Some(head) = head.filter(|_| r.is_ok()) else {
            // Cannot happen for a buffer of our own pages within the slot limit; if it
            // did, the requests already written are not published, and are withdrawn.
            self.broken = true;
            pool.free(skb);
            return Ok(());
        };
        let h = &mut self.tx_bufs[head as usize];
        h.skb = Some(skb);
        h.left = segs as u8;
        h.failed = false;
        h.pinned = false;
        if self.tx.push_requests_and_check_notify() {
            self.notify();
        }
        Ok(())
    }

    /// Handles transmit completions: revokes each slot's grant and frees finished
    /// packets. Returns completions handled.
    pub fn poll_tx(&mut self, pool: &mut SkbPool) -> usize {
        let _c = enter(Class::Driver);
        let mut n = 0;
        while !self.broken {
            let Some(rsp) = next_response(&mut self.tx, &mut self.broken) else {
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
            let mapped = self.dom.grant_table().end_access(b.gref).is_err();
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
        n
    }

    /// Whether RX responses are waiting.
    pub fn rx_ready(&mut self) -> bool {
        !self.broken && self.rx.final_check_for_responses().unwrap_or(false)
    }
}
