//! Direct placement (paper 000 §4.3, `pv-mq`): the NIC writes a guest's frames straight
//! into the buffers its netfront posted.
//!
//! netback takes each RX request as it comes, checks it, and grant-maps the buffer's
//! page writable at one of the vif's RX map slots; the hypervisor adds the mapping to
//! the driver domain's IOMMU context, so the page is reachable by the NIC at
//! [`hv::iommu::window_iova`] of the slot. The driver domain's NIC driver takes mapped
//! buffers from netback ([`Vif::rx_direct_give`], the paper's `vmq_alloc_skb`) for the
//! guest's receive queue, and hands each one back filled ([`Vif::rx_direct_done`], the
//! paper's `vmq_netif_rx`): netback answers the request with the frame's offset and
//! length and unmaps the page. Nothing is copied.
//!
//! Requests are answered in the order the guest posted them, as a front end that takes
//! each answer's buffer by ring position (Linux's netfront) needs, and as netif's
//! extra-info slot needs in any front end: the slot has no request id and stands for
//! the request at its ring position. The buffers go to the NIC in ring order and the
//! NIC fills them in that order; a frame that reaches the vif through the bridge
//! (another guest's, a broadcast such as ARP) is sent into the vif's NIC queue by the
//! driver domain (the NIC's loopback between its queues) to take its turn there,
//! rather than written into a buffer out of turn. A large segment the NIC takes whole
//! comes as its first buffer, a buffer the NIC left empty for the frame's context,
//! and the rest: netback answers the empty one with the GSO extra ([`Fill`]).
//!
//! The request ids a guest posts are checked as in the copy path: one out of range, or
//! one already posted and not answered, is answered with an error and counted; a
//! buffer that cannot be mapped (a bad grant) likewise. Each mapping is undone before
//! its request is answered, so a guest that sees its answer may reuse the page.

use std::collections::VecDeque;

use hv::iommu::window_iova;
use hv::profile::{enter, Class};
use hv::{GrantHandle, GrantRef, Iova, MapOp, Xen};

use super::{GrantCache, Vif, MAX_PENDING};
use crate::netif::{
    ExtraInfo, Gso, InFlight, RxResponse, NETRXF_CSUM_BLANK, NETRXF_DATA_VALIDATED,
    NETRXF_EXTRA_INFO, NETRXF_MORE_DATA, RING_IDS, XEN_NETIF_RSP_ERROR,
};
use crate::skb::{SkbPool, NET_IP_ALIGN};

/// RX buffers one vif may hold mapped at once: a whole ring's worth.
pub const RX_MAPPED: usize = RING_IDS as usize;
/// Below this many buffers mapped, netback asks the guest for an event on its next
/// post.
pub const DIRECT_LOW_WATER: usize = 64;
/// Where in a mapped buffer a frame starts: IP-aligned, as NIC drivers post.
pub const DIRECT_OFFSET: usize = NET_IP_ALIGN;

/// A posted buffer, mapped: by a map of its own, or through the vif's grant cache.
#[derive(Debug, Clone, Copy)]
struct Mapped {
    id: u16,
    at: MappedAt,
}

#[derive(Debug, Clone, Copy)]
enum MappedAt {
    Own(GrantHandle),
    Cached(u16),
    /// The unsafe stand-in: a machine frame the guest named, reached by the device
    /// through the driver domain's unchecked mapping of all machine memory; the driver
    /// domain's CPU has no mapping of it.
    Machine(u32),
}

/// The vif's direct-placement state: the mapped buffers by map slot, the free slots,
/// the mapped buffers not yet given to the NIC (oldest first), the request ids taken
/// and not answered.
#[derive(Debug)]
pub(super) struct Direct {
    maps: Box<[Option<Mapped>]>,
    free: Vec<u16>,
    ready: VecDeque<u16>,
    taken: InFlight,
    /// The batch under way: the requests taken, in ring order (each with the map slot
    /// it has, and whether it waits for a map), and the maps (one hypercall).
    batch: Vec<(u16, u16, bool)>,
    ops: Vec<MapOp>,
    results: Vec<Result<GrantHandle, hv::GrantError>>,
    /// A large frame's first buffer was answered with `NETRXF_EXTRA_INFO`: the GSO for
    /// the extra slot its context buffer takes.
    extra_due: Option<Gso>,
}

/// What the NIC left in a buffer it handed back (the paper's `vmq_netif_rx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// `len` bytes of a frame; `more`: the frame goes on in the next buffers;
    /// `csum_ok`: the NIC verified its L4 checksum.
    Data { len: u16, csum_ok: bool, more: bool },
    /// The first `len` bytes of a large frame taken whole: its GSO, and whether its
    /// checksum is left to fill (partial), for the context buffer that comes next.
    First {
        len: u16,
        more: bool,
        gso: Gso,
        blank: bool,
    },
    /// The buffer the NIC left empty for a large frame's context: its request carries
    /// the frame's GSO extra.
    Context,
    /// The NIC's write failed: no data.
    Error,
}

impl Direct {
    /// A posted buffer that needs no map of its own now, at map slot `k`: the unsafe
    /// stand-in's machine frame (taken as the guest gave it; nothing is checked, mapped
    /// or pinned, as the paper measured it), or, with grant reuse, a page looked up in
    /// the cache (mapped only on a miss, and mapped still after its frame is answered).
    /// `Some(true)`: it is placed; `Some(false)`: it could not be had (the request is
    /// done, for the caller to answer with an error); `None`: it needs a map.
    #[inline]
    fn place_without_map<X: Xen>(
        &mut self,
        k: u16,
        req: &crate::netif::RxRequest,
        machine_frames: bool,
        cache: Option<&mut GrantCache>,
        xen: &X,
    ) -> Option<bool> {
        let at = if machine_frames {
            MappedAt::Machine(req.gref)
        } else {
            match cache?.acquire(xen, req.gref, true) {
                Ok(e) => MappedAt::Cached(e),
                Err(_) => {
                    let _ = self.taken.complete(req.id);
                    return Some(false);
                }
            }
        };
        self.maps[k as usize] = Some(Mapped { id: req.id, at });
        Some(true)
    }

    /// Request `id`'s buffer at map slot `k`, as its map came back: placed (true), or,
    /// if the map failed, the request done for the caller to answer with an error.
    #[inline]
    fn place_mapped(
        &mut self,
        k: u16,
        id: u16,
        result: Result<GrantHandle, hv::GrantError>,
    ) -> bool {
        match result {
            Ok(handle) => {
                self.maps[k as usize] = Some(Mapped {
                    id,
                    at: MappedAt::Own(handle),
                });
                true
            }
            Err(_) => {
                let _ = self.taken.complete(id);
                false
            }
        }
    }

    pub(super) fn new() -> Self {
        Self {
            maps: vec![None; RX_MAPPED].into_boxed_slice(),
            free: (0..RX_MAPPED as u16).rev().collect(),
            ready: VecDeque::with_capacity(RX_MAPPED),
            taken: InFlight::default(),
            batch: Vec::with_capacity(RX_MAPPED),
            ops: Vec::with_capacity(RX_MAPPED),
            results: vec![Err(hv::GrantError::BadPage); RX_MAPPED],
            extra_due: None,
        }
    }
}

/// The window slot of a vif's RX map `k` (the vif's slots from `slot_base`): after its
/// rings and its TX pending maps.
fn map_slot(slot_base: u32, k: u16) -> u32 {
    slot_base + 2 + MAX_PENDING as u32 + u32::from(k)
}

impl<X: Xen> Vif<X> {
    /// Where buffer `k` is reached: the driver domain's window slot (none for the
    /// unsafe stand-in's machine frames, which only the device reaches), and the I/O
    /// address of its page for the device.
    fn direct_place(&self, k: u16) -> Option<(Option<u32>, Iova)> {
        let m = self
            .direct
            .as_ref()?
            .maps
            .get(usize::from(k))
            .copied()
            .flatten()?;
        let slot = match m.at {
            MappedAt::Own(_) => map_slot(self.slot_base, k),
            MappedAt::Cached(e) => self.cache.as_ref()?.slot(e),
            MappedAt::Machine(f) => return Some((None, hv::iommu::machine_iova(hv::Mfn(f)))),
        };
        Some((Some(slot), window_iova(slot)))
    }
}

/// The answer to a request netback cannot serve.
fn rx_error(id: u16) -> RxResponse {
    RxResponse {
        id,
        offset: 0,
        flags: 0,
        status: XEN_NETIF_RSP_ERROR,
    }
}

/// A filled buffer's token back from the NIC driver (the map slot it was given under).
pub type DirectToken = u32;

impl<X: Xen> Vif<X> {
    /// Turns direct placement on (before the first RX action): from now on the
    /// guest's posted buffers are mapped for the NIC instead of copied into.
    pub fn enable_direct(&mut self) {
        if self.guest_copy.is_none() && self.direct.is_none() {
            self.direct = Some(Box::new(Direct::new()));
        }
    }

    /// Whether direct placement is on.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Takes the guest's posted RX requests and maps each buffer (one map hypercall),
    /// keeping them in ring order for the NIC; a request that is bad or cannot be
    /// mapped is answered with an error at once and counted (only a guest that posts
    /// such requests sees its answers out of ring order). Returns the buffers mapped.
    pub fn rx_direct_refill(&mut self) -> usize {
        let _c = enter(Class::Netback);
        if self.disabled.is_some() {
            return 0;
        }
        let Some(d) = self.direct.as_mut() else {
            return 0;
        };
        let (mut broken, mut answered) = (false, false);
        d.ops.clear();
        d.batch.clear();
        while d.batch.len() < d.free.len() {
            let req = match self.rx.take_request() {
                Ok(Some(r)) => r,
                // None waiting. While the NIC holds plenty of this guest's buffers the
                // driver domain looks again at its next poll anyway; only when they run
                // low is `req_event` armed, so that the guest's next post wakes this
                // vif (an event per post would wake the driver domain per packet).
                Ok(None) if RX_MAPPED - d.free.len() + d.batch.len() >= DIRECT_LOW_WATER => break,
                Ok(None) => match self.rx.final_check_for_at_least(1) {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(_) => {
                        broken = true;
                        break;
                    }
                },
                Err(_) => {
                    broken = true;
                    break;
                }
            };
            if !d.taken.post(req.id) {
                self.stats.rx_bad_requests += 1;
                // Cannot fail: one response per request taken.
                let _ = self.rx.push_response(&rx_error(req.id));
                answered = true;
                continue;
            }
            // The free slots are taken from the top of the stack, one per request.
            let k = d.free[d.free.len() - 1 - d.batch.len()];
            match d.place_without_map(
                k,
                &req,
                self.machine_frames,
                self.cache.as_deref_mut(),
                &self.xen,
            ) {
                Some(true) => d.batch.push((k, req.id, false)),
                Some(false) => {
                    self.stats.rx_copy_errors += 1;
                    let _ = self.rx.push_response(&rx_error(req.id));
                    answered = true;
                }
                None => {
                    d.ops.push(MapOp {
                        dom: self.fe,
                        gref: GrantRef(req.gref),
                        readonly: false,
                        slot: map_slot(self.slot_base, k),
                    });
                    d.batch.push((k, req.id, true));
                }
            }
        }
        let n = d.ops.len();
        if n > 0 {
            let _h = enter(Class::Hypercall);
            self.xen.grant_map(&d.ops, &mut d.results[..n]);
        }
        let taken = d.batch.len();
        d.free.truncate(d.free.len() - taken);
        let (mut mapped, mut op) = (0, 0);
        for j in 0..taken {
            let (k, id, needs_map) = d.batch[j];
            let placed = !needs_map || {
                op += 1;
                d.place_mapped(k, id, d.results[op - 1])
            };
            if placed {
                d.ready.push_back(k);
                mapped += 1;
            } else {
                d.free.push(k);
                self.stats.rx_copy_errors += 1;
                let _ = self.rx.push_response(&rx_error(id));
                answered = true;
            }
        }
        if broken {
            self.disable(super::Disabled::RingBroken);
        } else if answered && self.rx.push_responses_and_check_notify() {
            self.notify_rx();
        }
        mapped
    }

    /// Gives mapped buffers to the NIC's queue for this guest while `post` takes them
    /// (`vmq_alloc_skb`), in ring order: each as the I/O address the device writes to,
    /// the room it has, and a token to hand back with it. Returns the buffers given.
    pub fn rx_direct_give(
        &mut self,
        mut post: impl FnMut(Iova, u16, DirectToken) -> bool,
    ) -> usize {
        let mut n = 0;
        while let Some(k) = self.direct.as_ref().and_then(|d| d.ready.front().copied()) {
            let Some((_, page)) = self.direct_place(k) else {
                break;
            };
            let iova = Iova(page.0 + DIRECT_OFFSET as u64);
            let room = (mem::PAGE_SIZE - DIRECT_OFFSET) as u16;
            if !post(iova, room, u32::from(k)) {
                break;
            }
            if let Some(d) = self.direct.as_mut() {
                d.ready.pop_front();
            }
            n += 1;
        }
        n
    }

    /// A buffer the NIC filled with a frame of its own (`vmq_netif_rx`): its mapping
    /// undone, and its request answered with the frame's place and length (or an error
    /// if the device's write failed). Responses are published by
    /// [`Vif::rx_direct_flush`].
    pub fn rx_direct_done(&mut self, token: DirectToken, len: u16, csum_ok: bool, error: bool) {
        let fill = if error {
            Fill::Error
        } else {
            Fill::Data {
                len,
                csum_ok,
                more: false,
            }
        };
        self.rx_direct_filled(token, fill);
    }

    /// A buffer the NIC handed back (`vmq_netif_rx`), as [`Fill`] says: its mapping
    /// undone, and its request answered, in the order the buffers come back (the
    /// guest's ring order). A large frame's buffers are answered as one response
    /// chain: the first with `NETRXF_EXTRA_INFO` (and its checksum left blank if it
    /// came partial), the context buffer's request with the GSO extra, the rest with
    /// `NETRXF_MORE_DATA` but the last. A context with no large frame before it (a
    /// device fault) is answered with an error and counted. Responses are published
    /// by [`Vif::rx_direct_flush`].
    pub fn rx_direct_filled(&mut self, token: DirectToken, fill: Fill) {
        let _c = enter(Class::Netback);
        let Some(id) = self.direct_release(token) else {
            return;
        };
        let extra_due = self.direct.as_mut().and_then(|d| d.extra_due.take());
        let room = (mem::PAGE_SIZE - DIRECT_OFFSET) as u16;
        let rsp = match fill {
            Fill::Context => {
                if let Some(g) = extra_due {
                    // Cannot fail: one response per request taken.
                    let _ = self
                        .rx
                        .push_response(&ExtraInfo::gso(g.size, g.ty, false).to_rx_slot());
                    return;
                }
                self.stats.rx_copy_errors += 1;
                rx_error(id)
            }
            Fill::Data { len, csum_ok, more } if len > 0 && len <= room => {
                if !more {
                    self.stats.rx_packets += 1;
                }
                self.stats.rx_bytes += u64::from(len);
                RxResponse {
                    id,
                    offset: DIRECT_OFFSET as u16,
                    flags: if csum_ok { NETRXF_DATA_VALIDATED } else { 0 }
                        | if more { NETRXF_MORE_DATA } else { 0 },
                    status: len as i16,
                }
            }
            Fill::First {
                len,
                more,
                gso,
                blank,
            } if len > 0 && len <= room => {
                if let Some(d) = self.direct.as_mut() {
                    d.extra_due = Some(gso);
                }
                self.stats.rx_gso_packets += 1;
                self.stats.rx_bytes += u64::from(len);
                RxResponse {
                    id,
                    offset: DIRECT_OFFSET as u16,
                    flags: NETRXF_EXTRA_INFO
                        | if blank {
                            NETRXF_CSUM_BLANK | NETRXF_DATA_VALIDATED
                        } else {
                            NETRXF_DATA_VALIDATED
                        }
                        | if more { NETRXF_MORE_DATA } else { 0 },
                    status: len as i16,
                }
            }
            Fill::Data { .. } | Fill::First { .. } | Fill::Error => {
                self.stats.rx_copy_errors += 1;
                rx_error(id)
            }
        };
        // Cannot fail: one response per request taken.
        let _ = self.rx.push_response(&rsp);
    }

    /// Unmaps the buffer given under `token` and frees its slot; its request id, if the
    /// token named a mapped buffer.
    fn direct_release(&mut self, token: DirectToken) -> Option<u16> {
        let d = self.direct.as_mut()?;
        let k = u16::try_from(token)
            .ok()
            .filter(|&k| usize::from(k) < RX_MAPPED)?;
        let m = d.maps[usize::from(k)].take()?;
        match m.at {
            MappedAt::Own(h) => {
                let mut st = [Ok(())];
                let _h = enter(Class::Hypercall);
                self.xen.grant_unmap(&[h], &mut st);
            }
            MappedAt::Cached(e) => {
                if let Some(c) = self.cache.as_mut() {
                    c.release(&self.xen, e);
                }
            }
            MappedAt::Machine(_) => {}
        }
        d.free.push(k);
        let _ = d.taken.complete(m.id);
        Some(m.id)
    }

    /// Publishes the responses of the buffers handed back, notifying the guest once.
    pub fn rx_direct_flush(&mut self) {
        if self.rx.push_responses_and_check_notify() {
            self.notify_rx();
        }
    }

    /// Buffers mapped and not yet given to the NIC.
    pub fn rx_direct_ready(&self) -> usize {
        self.direct.as_ref().map_or(0, |d| d.ready.len())
    }

    /// The RX action of a direct vif: its frames come through its NIC queue only (the
    /// driver domain sends the bridge's there), so that its answers keep ring order;
    /// any queued here are dropped and counted. Returns the packets taken.
    pub(super) fn rx_direct_unplaced(&mut self, pool: &mut SkbPool) -> usize {
        let mut n = 0;
        while let Some(skb) = self.rx_queue.pop(pool) {
            self.stats.rx_unplaced += 1;
            pool.free(skb);
            n += 1;
        }
        n
    }

    /// At disconnection: every mapping undone, no response (the ring is going).
    pub(super) fn direct_teardown(&mut self) {
        let Some(d) = self.direct.as_mut() else {
            return;
        };
        // Buffers held through the cache go with it (`cache_teardown`).
        let handles: Vec<GrantHandle> = d
            .maps
            .iter_mut()
            .filter_map(Option::take)
            .filter_map(|m| match m.at {
                MappedAt::Own(h) => Some(h),
                MappedAt::Cached(_) | MappedAt::Machine(_) => None,
            })
            .collect();
        d.ready.clear();
        d.extra_due = None;
        if !handles.is_empty() {
            let mut st = vec![Ok(()); handles.len()];
            self.xen.grant_unmap(&handles, &mut st);
        }
    }
}
