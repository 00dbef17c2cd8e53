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
//! length and unmaps the page. Nothing is copied. A frame that reaches the vif
//! through the bridge instead (another guest's, a broadcast) is written into a mapped
//! buffer netback has not yet given to the NIC.
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
use crate::netif::{InFlight, RxResponse, NETRXF_DATA_VALIDATED, RING_IDS, XEN_NETIF_RSP_ERROR};
use crate::skb::{SkbId, SkbPool, NET_IP_ALIGN};
use crate::wire::MAX_TAGGED_FRAME;

/// RX buffers one vif may hold mapped at once: a whole ring's worth.
pub const RX_MAPPED: usize = RING_IDS as usize;
/// Below this many buffers mapped, netback asks the guest for an event on its next
/// post.
pub const DIRECT_LOW_WATER: usize = 64;
/// Mapped buffers netback keeps back from the NIC for frames that reach the vif
/// through the bridge (broadcasts such as ARP, frames from other guests): given all to
/// the NIC, such a frame would wait for a buffer the NIC holds until frames arrive on
/// its queue, which for a guest that must answer an ARP first may be never.
pub const DIRECT_BRIDGE_RESERVE: usize = 8;
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
    /// The batch of maps under way (one hypercall).
    ops: Vec<MapOp>,
    ids: Vec<u16>,
    results: Vec<Result<GrantHandle, hv::GrantError>>,
    frame: Box<[u8]>,
}

impl Direct {
    /// A posted buffer that needs no map of its own now: the unsafe stand-in's machine
    /// frame (taken as the guest gave it; nothing is checked, mapped or pinned, as the
    /// paper measured it), or, with grant reuse, a page looked up in the cache (mapped
    /// only on a miss, and mapped still after its frame is answered). `Some(true)`: it
    /// is ready for the NIC; `Some(false)`: it could not be had (the request is done,
    /// for the caller to answer with an error); `None`: it needs a map.
    #[inline]
    fn place_without_map<X: Xen>(
        &mut self,
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
        let k = self.free.pop().expect("one free slot per request taken");
        self.maps[k as usize] = Some(Mapped { id: req.id, at });
        self.ready.push_back(k);
        Some(true)
    }

    /// Request `id`'s buffer, as its map came back: ready for the NIC (true), or, if
    /// the map failed, the request done for the caller to answer with an error.
    #[inline]
    fn place_mapped(&mut self, id: u16, result: Result<GrantHandle, hv::GrantError>) -> bool {
        let k = self.free.pop().expect("one free slot per op");
        match result {
            Ok(handle) => {
                self.maps[k as usize] = Some(Mapped {
                    id,
                    at: MappedAt::Own(handle),
                });
                self.ready.push_back(k);
                true
            }
            Err(_) => {
                self.free.push(k);
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
            ops: Vec::with_capacity(RX_MAPPED),
            ids: Vec::with_capacity(RX_MAPPED),
            results: vec![Err(hv::GrantError::BadPage); RX_MAPPED],
            frame: vec![0; MAX_TAGGED_FRAME].into_boxed_slice(),
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

    /// The window slot buffer `k` is reached through by the driver domain's CPU.
    fn direct_slot(&self, k: u16) -> Option<u32> {
        self.direct_place(k)?.0
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

    /// Takes the guest's posted RX requests and maps each buffer (one map hypercall);
    /// a request that is bad or cannot be mapped is answered with an error and
    /// counted. Returns the buffers mapped.
    pub fn rx_direct_refill(&mut self) -> usize {
        let _c = enter(Class::Netback);
        if self.disabled.is_some() {
            return 0;
        }
        let Some(d) = self.direct.as_mut() else {
            return 0;
        };
        let (mut broken, mut answered) = (false, false);
        let mut cached = 0;
        d.ops.clear();
        d.ids.clear();
        while d.ops.len() < d.free.len() {
            let req = match self.rx.take_request() {
                Ok(Some(r)) => r,
                // None waiting. While the NIC holds plenty of this guest's buffers the
                // driver domain looks again at its next poll anyway; only when they run
                // low is `req_event` armed, so that the guest's next post wakes this
                // vif (an event per post would wake the driver domain per packet).
                Ok(None) if RX_MAPPED - d.free.len() + d.ops.len() >= DIRECT_LOW_WATER => break,
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
            match d.place_without_map(
                &req,
                self.machine_frames,
                self.cache.as_deref_mut(),
                &self.xen,
            ) {
                Some(true) => {
                    cached += 1;
                    continue;
                }
                Some(false) => {
                    self.stats.rx_copy_errors += 1;
                    let _ = self.rx.push_response(&rx_error(req.id));
                    answered = true;
                    continue;
                }
                None => {}
            }
            let k = d.free[d.free.len() - 1 - d.ops.len()];
            d.ops.push(MapOp {
                dom: self.fe,
                gref: GrantRef(req.gref),
                readonly: false,
                slot: map_slot(self.slot_base, k),
            });
            d.ids.push(req.id);
        }
        let n = d.ops.len();
        if n > 0 {
            let _h = enter(Class::Hypercall);
            self.xen.grant_map(&d.ops, &mut d.results[..n]);
        }
        let mut mapped = cached;
        for j in 0..n {
            let id = d.ids[j];
            if d.place_mapped(id, d.results[j]) {
                mapped += 1;
            } else {
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
    /// (`vmq_alloc_skb`): each as the I/O address the device writes to, the room it
    /// has, and a token to hand back with it; [`DIRECT_BRIDGE_RESERVE`] stay back for
    /// frames through the bridge. Returns the buffers given.
    pub fn rx_direct_give(
        &mut self,
        mut post: impl FnMut(Iova, u16, DirectToken) -> bool,
    ) -> usize {
        let mut n = 0;
        while let Some(k) = self
            .direct
            .as_ref()
            .filter(|d| d.ready.len() > DIRECT_BRIDGE_RESERVE)
            .and_then(|d| d.ready.front().copied())
        {
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

    /// A buffer the NIC filled (`vmq_netif_rx`): its mapping undone, and its request
    /// answered with the frame's place and length (or an error if the device's write
    /// failed). Responses are published by [`Vif::rx_direct_flush`].
    pub fn rx_direct_done(&mut self, token: DirectToken, len: u16, csum_ok: bool, error: bool) {
        let _c = enter(Class::Netback);
        let ok = !error && usize::from(len) <= mem::PAGE_SIZE - DIRECT_OFFSET && len > 0;
        let Some(id) = self.direct_release(token) else {
            return;
        };
        if ok {
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += u64::from(len);
        } else {
            self.stats.rx_copy_errors += 1;
        }
        // Cannot fail: one response per request taken.
        let _ = self.rx.push_response(&RxResponse {
            id,
            offset: DIRECT_OFFSET as u16,
            flags: if ok && csum_ok {
                NETRXF_DATA_VALIDATED
            } else {
                0
            },
            status: if ok { len as i16 } else { XEN_NETIF_RSP_ERROR },
        });
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

    /// The RX action of a direct vif, for frames that came through the bridge: each is
    /// written into the oldest mapped buffer not yet with the NIC, through the
    /// driver domain's mapping of it, and answered. Returns the packets taken.
    pub(super) fn rx_direct_copy(&mut self, pool: &mut SkbPool) -> usize {
        if self.disabled.is_some() {
            return 0;
        }
        let mut n = 0;
        loop {
            let Some(k) = self.direct.as_ref().and_then(|d| d.ready.front().copied()) else {
                if !self.rx_queue.is_empty() {
                    self.stats.rx_stalls += 1;
                }
                break;
            };
            let Some(skb) = self.rx_queue.pop(pool) else {
                break;
            };
            n += 1;
            let len = pool.len(skb);
            let csum = pool.csum_valid(skb);
            let written = self.direct_write(pool, skb, k, len);
            pool.free(skb);
            if let Some(d) = self.direct.as_mut() {
                d.ready.pop_front();
            }
            let ok = written && len > 0;
            self.rx_direct_done(u32::from(k), if ok { len as u16 } else { 0 }, csum, !ok);
        }
        self.rx_direct_flush();
        n
    }

    /// Writes `skb`'s `len` bytes into mapped buffer `k` at the frame offset.
    fn direct_write(&mut self, pool: &SkbPool, skb: SkbId, k: u16, len: usize) -> bool {
        let Some(slot) = self.direct_slot(k) else {
            return false;
        };
        let Some(d) = self.direct.as_mut() else {
            return false;
        };
        if len > d.frame.len() || DIRECT_OFFSET + len > mem::PAGE_SIZE {
            return false;
        }
        let _c = enter(Class::GrantCopy);
        pool.read(skb, 0, &mut d.frame[..len]).is_ok()
            && self
                .xen
                .domain()
                .window()
                .write(slot, DIRECT_OFFSET, &d.frame[..len])
                .is_ok()
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
        if !handles.is_empty() {
            let mut st = vec![Ok(()); handles.len()];
            self.xen.grant_unmap(&handles, &mut st);
        }
    }
}
