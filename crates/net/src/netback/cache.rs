//! Grant reuse (paper 000 §4.4, `pv-mq-reuse`): a bounded cache of mapped grants per
//! guest, keyed by grant reference.
//!
//! A posted RX buffer or a TX slot whose grant is cached is reached through the mapping
//! already there: no map, no unmap, no IOTLB invalidation. A miss maps the grant (one
//! `GNTTABOP_map_grant_ref`, which also enters it in the driver domain's IOMMU context)
//! and keeps it. Mappings outlive their I/O: an entry counts its users (RX buffers with
//! the NIC or being answered, TX slots whose packet has not left), and only an idle
//! entry may go, either evicted (least recently used first, when every entry is taken)
//! or dropped because the guest asked through the control ring. A drop of an entry in
//! use waits for its last user, and the guest hears of it only after the unmap and its
//! IOTLB invalidation have returned: from then on the driver domain cannot reach the
//! page by any address, and the guest may end its grant and repurpose it.
//!
//! The cache is per vif, so a guest that posts ever-new references churns only its own
//! entries; its size bounds the driver domain's window slots and IOMMU entries for that
//! guest.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use hv::profile::{enter, Class};
use hv::{DomId, GrantError, GrantHandle, GrantRef, MapOp, Xen};
use mem::MappedPage;

/// Grants one vif keeps mapped: more than a guest's working set of I/O pages (its
/// 256 posted RX buffers, its 256 TX slots, and the pages its stack holds), so that a
/// guest that recycles its pages hits in steady state.
pub const CACHE_SLOTS: usize = 1024;

use super::NIL;

/// References below this are remembered once seen, to tell compulsory misses (a
/// bit each: 8 KiB a vif).
pub const SEEN_REFS: u32 = 1 << 16;

/// A grant reference is its own hash, spread by a multiplication (the default
/// SipHash costs as much as the rest of a lookup).
#[derive(Default)]
struct GrefHasher(u64);

impl Hasher for GrefHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    gref: u32,
    handle: GrantHandle,
    writable: bool,
    /// I/O under way through the mapping.
    users: u16,
    /// The guest asked for it to go while in use: unmapped when the last user lets go.
    dropping: bool,
}

/// Counters of one vif's cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found the grant mapped.
    pub hits: u64,
    /// Lookups that mapped it.
    pub misses: u64,
    /// Of those, the first map of a reference the cache had never held (compulsory
    /// misses: what any cache pays once per page); the rest are what a bigger or
    /// better cache could have saved. References past [`SEEN_REFS`] always count as
    /// not cold.
    pub cold_misses: u64,
    /// Grant map hypercall operations issued (misses, and read-only entries mapped
    /// again writable).
    pub maps: u64,
    /// Unmap operations issued (evictions, drops, upgrades, teardown).
    pub unmaps: u64,
    /// Idle entries unmapped to make room.
    pub evictions: u64,
    /// Read-only entries mapped again writable for a receive buffer.
    pub upgrades: u64,
    /// Lookups refused: the grant could not be mapped (a bad reference), the entry
    /// was being dropped, or it was read-only and in use where a write was needed.
    pub refused: u64,
    /// Drops the guest asked for, completed (unmapped, IOTLB invalidated).
    pub drops: u64,
    /// Of those, drops that waited for I/O in flight.
    pub drops_deferred: u64,
    /// Drops asked for a reference the cache did not hold.
    pub drops_unknown: u64,
}

hv::counter_set!(CacheStats {
    hits,
    misses,
    cold_misses,
    maps,
    unmaps,
    evictions,
    upgrades,
    refused,
    drops,
    drops_deferred,
    drops_unknown
});

/// Why a lookup was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheError {
    /// The hypervisor refused the map.
    Map(GrantError),
    /// Every entry is in use (cannot happen while users are bounded by the rings).
    Full,
    /// The guest asked for this grant's mapping to go.
    Dropping,
    /// Mapped read-only and in use; a receive buffer needs it writable.
    ReadOnly,
}

/// What a drop did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropOutcome {
    /// Unmapped now.
    Done,
    /// In use: unmapped when its I/O completes.
    Deferred,
    /// Not in the cache.
    Unknown,
}

/// Which entry maps each grant reference: a table indexed by the reference for the
/// references a guest uses in practice (below [`SEEN_REFS`]: one load per lookup, the
/// hot path's), a hash map for the rest (a guest may name any 32-bit reference).
#[derive(Debug)]
struct GrefIndex {
    direct: Box<[u16]>,
    spill: HashMap<u32, u16, BuildHasherDefault<GrefHasher>>,
    len: usize,
}

impl GrefIndex {
    fn new() -> Self {
        Self {
            direct: vec![NIL; SEEN_REFS as usize].into_boxed_slice(),
            spill: HashMap::default(),
            len: 0,
        }
    }

    #[inline]
    fn get(&self, gref: u32) -> Option<u16> {
        match self.direct.get(gref as usize) {
            Some(&k) => (k != NIL).then_some(k),
            None => self.spill.get(&gref).copied(),
        }
    }

    /// Enters `gref` → `k`; `gref` must not be present.
    fn insert(&mut self, gref: u32, k: u16) {
        match self.direct.get_mut(gref as usize) {
            Some(slot) => *slot = k,
            None => {
                self.spill.insert(gref, k);
            }
        }
        self.len += 1;
    }

    fn remove(&mut self, gref: u32) {
        let was = match self.direct.get_mut(gref as usize) {
            Some(slot) => std::mem::replace(slot, NIL) != NIL,
            None => self.spill.remove(&gref).is_some(),
        };
        self.len -= usize::from(was);
    }

    fn clear(&mut self) {
        self.direct.fill(NIL);
        self.spill.clear();
        self.len = 0;
    }
}

/// One vif's cache of mapped grants.
#[derive(Debug)]
pub struct GrantCache {
    fe: DomId,
    /// The window slot of entry 0; entry `k` is at `slot0 + k`.
    slot0: u32,
    index: GrefIndex,
    entries: Box<[Option<Entry>]>,
    /// Each mapped entry's page, held while the entry lives, so that copies through it
    /// take no reference of their own (dropped before the unmap, which a hold refuses).
    pages: Box<[Option<MappedPage>]>,
    free: Vec<u16>,
    /// The idle entries (`users` 0), least recently used first.
    idle: super::LentOrder,
    /// References whose deferred drop completed, for the control ring to confirm.
    dropped: Vec<u32>,
    /// References ever mapped (below [`SEEN_REFS`]), a bit each.
    seen: Box<[u64]>,
    stats: CacheStats,
}

impl GrantCache {
    /// An empty cache for grants of `fe`, mapping at window slots `slot0..slot0 +`
    /// [`CACHE_SLOTS`].
    pub fn new(fe: DomId, slot0: u32) -> Self {
        Self {
            fe,
            slot0,
            index: GrefIndex::new(),
            entries: vec![None; CACHE_SLOTS].into_boxed_slice(),
            pages: (0..CACHE_SLOTS).map(|_| None).collect(),
            free: (0..CACHE_SLOTS as u16).rev().collect(),
            idle: super::LentOrder::with_capacity(CACHE_SLOTS),
            dropped: Vec::with_capacity(CACHE_SLOTS),
            seen: vec![0; (SEEN_REFS / 64) as usize].into_boxed_slice(),
            stats: CacheStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// Grants mapped now.
    pub fn len(&self) -> usize {
        self.index.len
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.index.len == 0
    }

    /// The window slot of entry `k`.
    pub fn slot(&self, k: u16) -> u32 {
        self.slot0 + u32::from(k)
    }

    /// Entry `k`'s page, held while it is mapped.
    pub fn page(&self, k: u16) -> Option<&MappedPage> {
        self.pages.get(usize::from(k))?.as_ref()
    }

    /// The entry mapping `gref`, if any.
    pub fn entry_of(&self, gref: u32) -> Option<u16> {
        self.index.get(gref)
    }

    /// Whether `gref` is mapped now.
    pub fn contains(&self, gref: u32) -> bool {
        self.index.get(gref).is_some()
    }

    /// The entry mapping `gref` (writable if `write`), mapping it on a miss, with one
    /// more user: the caller must [`Self::release`] it when its I/O is done.
    pub fn acquire(&mut self, xen: &impl Xen, gref: u32, write: bool) -> Result<u16, CacheError> {
        if let Some(k) = self.index.get(gref) {
            let e = self.entries[usize::from(k)].expect("indexed entries exist");
            if e.dropping {
                self.stats.refused += 1;
                return Err(CacheError::Dropping);
            }
            if write && !e.writable {
                if e.users > 0 {
                    self.stats.refused += 1;
                    return Err(CacheError::ReadOnly);
                }
                self.stats.upgrades += 1;
                self.idle.remove(k);
                self.remove(xen, k);
                return self.insert(xen, gref, write);
            }
            self.stats.hits += 1;
            if e.users == 0 {
                self.idle.remove(k);
            }
            self.entry(k).users += 1;
            return Ok(k);
        }
        self.insert(xen, gref, write)
    }

    /// A user of entry `k` is done. The entry stays mapped (idle, most recently used)
    /// unless a drop was waiting for it.
    pub fn release(&mut self, xen: &impl Xen, k: u16) {
        let Some(e) = self
            .entries
            .get_mut(usize::from(k))
            .and_then(Option::as_mut)
        else {
            return;
        };
        e.users = e.users.saturating_sub(1);
        if e.users > 0 {
            return;
        }
        if e.dropping {
            let gref = e.gref;
            self.remove(xen, k);
            self.stats.drops += 1;
            self.dropped.push(gref);
        } else {
            self.idle.push_back(k);
        }
    }

    /// The guest asks for `gref`'s mapping to go.
    pub fn drop_gref(&mut self, xen: &impl Xen, gref: u32) -> DropOutcome {
        let Some(k) = self.index.get(gref) else {
            self.stats.drops_unknown += 1;
            return DropOutcome::Unknown;
        };
        let e = self.entry(k);
        if e.users > 0 {
            if !e.dropping {
                e.dropping = true;
                self.stats.drops_deferred += 1;
            }
            return DropOutcome::Deferred;
        }
        self.idle.remove(k);
        self.remove(xen, k);
        self.stats.drops += 1;
        DropOutcome::Done
    }

    /// Whether deferred drops completed and wait to be confirmed.
    pub fn has_dropped(&self) -> bool {
        !self.dropped.is_empty()
    }

    /// Takes the references whose deferred drops completed since the last call.
    pub fn take_dropped(&mut self, mut f: impl FnMut(u32)) {
        for g in self.dropped.drain(..) {
            f(g);
        }
    }

    /// Unmaps every entry, in use or not (the vif is going).
    pub fn teardown(&mut self, xen: &impl Xen) {
        self.pages.iter_mut().for_each(|p| *p = None);
        let handles: Vec<GrantHandle> = self
            .entries
            .iter_mut()
            .filter_map(Option::take)
            .map(|e| e.handle)
            .collect();
        self.index.clear();
        self.idle = super::LentOrder::with_capacity(CACHE_SLOTS);
        self.free = (0..CACHE_SLOTS as u16).rev().collect();
        if !handles.is_empty() {
            self.stats.unmaps += handles.len() as u64;
            let mut st = vec![Ok(()); handles.len()];
            xen.grant_unmap(&handles, &mut st);
        }
    }

    fn entry(&mut self, k: u16) -> &mut Entry {
        self.entries[usize::from(k)]
            .as_mut()
            .expect("indexed entries exist")
    }

    /// A miss: a free entry (evicting the least recently used idle one if none is
    /// free), the grant mapped into it, one user.
    fn insert(&mut self, xen: &impl Xen, gref: u32, write: bool) -> Result<u16, CacheError> {
        let k = match self.free.pop() {
            Some(k) => k,
            None => {
                let Some(k) = self.idle.pop_front() else {
                    self.stats.refused += 1;
                    return Err(CacheError::Full);
                };
                self.remove(xen, k);
                self.stats.evictions += 1;
                self.free.pop().expect("just freed")
            }
        };
        // Writable where the grant allows, even for a read: a page a guest sent from
        // and later posts for receive then needs no second map. A read-only grant is
        // mapped read-only on a second try (such a miss costs one more pin).
        let tries: &[bool] = if write { &[true] } else { &[true, false] };
        let mut res = [Err(GrantError::BadPage)];
        let mut writable = write;
        for &w in tries {
            let op = [MapOp {
                dom: self.fe,
                gref: GrantRef(gref),
                readonly: !w,
                slot: self.slot(k),
            }];
            {
                let _h = enter(Class::Hypercall);
                xen.grant_map(&op, &mut res);
            }
            self.stats.maps += 1;
            writable = w;
            if res[0].is_ok() {
                break;
            }
        }
        match res[0] {
            Ok(handle) => {
                self.stats.misses += 1;
                if gref < SEEN_REFS {
                    let (w, b) = ((gref / 64) as usize, gref % 64);
                    if self.seen[w] & 1 << b == 0 {
                        self.seen[w] |= 1 << b;
                        self.stats.cold_misses += 1;
                    }
                }
                self.entries[usize::from(k)] = Some(Entry {
                    gref,
                    handle,
                    writable,
                    users: 1,
                    dropping: false,
                });
                self.index.insert(gref, k);
                // Held for the entry's life. Cannot fail right after the map; without
                // it, copies go through the slot, each taking a reference.
                self.pages[usize::from(k)] = xen.domain().window().page(self.slot(k)).ok();
                Ok(k)
            }
            Err(e) => {
                self.free.push(k);
                self.stats.refused += 1;
                Err(CacheError::Map(e))
            }
        }
    }

    /// Unmaps entry `k` (not on the idle list) and frees it.
    fn remove(&mut self, xen: &impl Xen, k: u16) {
        let Some(e) = self.entries[usize::from(k)].take() else {
            return;
        };
        self.index.remove(e.gref);
        self.pages[usize::from(k)] = None;
        let mut st = [Ok(())];
        {
            let _h = enter(Class::Hypercall);
            xen.grant_unmap(&[e.handle], &mut st);
        }
        self.stats.unmaps += 1;
        self.free.push(k);
    }
}

/// Requests one packet may fill on the copy path through the cache (a frame of up to
/// 64 KiB over pages, plus one for a start offset).
const RX_CACHED_SLOTS: usize = 18;
/// Packets gathered before their copies start, and the requests they may hold (a
/// batch of 64-byte frames, or three of 64 KiB).
const RX_CACHED_BATCH: usize = 32;
const RX_CACHED_BATCH_SLOTS: usize = 64;

/// One packet of a cached-copy batch: where its requests lie in the batch's arrays.
#[derive(Clone, Copy)]
struct Gathered {
    skb: crate::skb::SkbId,
    /// Offset of the first byte in the first buffer (the source's offset in its cache
    /// line when copies are aligned).
    start: usize,
    len: usize,
    /// The packet's requests: `first..first + need` of the batch.
    first: usize,
    need: usize,
    /// Every buffer was looked up (mapped on a miss) writable.
    ok: bool,
}

/// Copies `k` bytes from `from` (a page and an offset) into cache entry `to.0`'s page
/// at offset `to.1`: straight from a page of the driver domain's own, or, for another
/// guest's page (a frame it sent), through `bounce`, window to window.
#[inline]
fn copy_piece(
    dom: &hv::Domain,
    cache: &GrantCache,
    bounce: &mut [u8],
    (page, from): (crate::skb::SegPage, usize),
    (ent, page_off): (u16, usize),
    k: usize,
) -> bool {
    use crate::skb::SegPage;
    let slot = cache.slot(ent);
    match (page, cache.page(ent)) {
        (SegPage::Own(gfn), Some(p)) => dom.copy_to_page(gfn, from, p, page_off, k).is_ok(),
        (SegPage::Own(gfn), None) => dom.copy_to_window(gfn, from, slot, page_off, k).is_ok(),
        (
            SegPage::Window {
                slot: from_slot, ..
            },
            _,
        ) => {
            let b = &mut bounce[..k];
            dom.window().read(from_slot, from, b).is_ok()
                && dom.window().write(slot, page_off, b).is_ok()
        }
    }
}

impl<X: Xen> super::Vif<X> {
    /// Guest RX with grant reuse and no direct placement: each queued packet is copied
    /// by the driver domain's CPU into the buffers the guest posted, through their
    /// cached mappings, one copy per piece (frame to frame). No hypercall when every
    /// buffer hits; a miss maps and keeps. Requests are copied off the ring and
    /// checked as on the grant-copy path; a buffer that cannot be mapped fails its
    /// packet, answered with errors and counted. Returns the packets taken.
    ///
    /// Packets go in batches, as Linux netback's RX action builds its copy operations
    /// before issuing them: the batch's requests are taken and their buffers looked up
    /// first, each buffer's first line is prefetched for writing, then the copies run
    /// and the responses are written, published once at the end. The guest's core read
    /// those lines last (its stack took the previous packet from them), so each copy
    /// would otherwise wait for one line transfer after another; prefetched together,
    /// the transfers overlap.
    pub(super) fn rx_cached_copy(&mut self, pool: &mut crate::skb::SkbPool) -> usize {
        let mut n = 0;
        while self.disabled.is_none() && !self.rx_queue.is_empty() {
            let mut batch = [const { None::<Gathered> }; RX_CACHED_BATCH];
            let mut ids = [0u16; RX_CACHED_BATCH_SLOTS];
            let mut ents = [NIL; RX_CACHED_BATCH_SLOTS];
            let (taken, stalled) = self.rx_cached_gather(pool, &mut batch, &mut ids, &mut ents);
            for g in batch[..taken].iter().flatten() {
                self.rx_cached_answer(pool, g, &ids, &ents);
            }
            n += taken;
            if stalled || taken == 0 {
                break;
            }
        }
        if self.rx.push_responses_and_check_notify() {
            self.notify_rx();
        }
        n
    }

    /// Takes up to a batch of queued packets with their requests, looking up each
    /// buffer and prefetching its first line. Returns the packets taken and whether the
    /// ring ran out of requests (or broke) before the queue did.
    fn rx_cached_gather(
        &mut self,
        pool: &mut crate::skb::SkbPool,
        batch: &mut [Option<Gathered>; RX_CACHED_BATCH],
        ids: &mut [u16; RX_CACHED_BATCH_SLOTS],
        ents: &mut [u16; RX_CACHED_BATCH_SLOTS],
    ) -> (usize, bool) {
        let (mut taken, mut used) = (0, 0);
        while taken < RX_CACHED_BATCH && self.disabled.is_none() {
            let Some(skb) = self.rx_queue.peek() else {
                return (taken, false);
            };
            let start = if self.aligned_copies {
                pool.first_offset(skb) % super::CACHE_LINE
            } else {
                0
            };
            let len = pool.len(skb);
            let need = super::rx_pages(len, start);
            if need > RX_CACHED_SLOTS {
                let _ = self.rx_queue.pop(pool);
                self.stats.rx_oversize += 1;
                pool.free(skb);
                continue;
            }
            if used + need > RX_CACHED_BATCH_SLOTS {
                break;
            }
            match self.rx.final_check_for_at_least(need as u32) {
                Ok(true) => {}
                Ok(false) => {
                    self.stats.rx_stalls += 1;
                    return (taken, true);
                }
                Err(_) => {
                    self.disable(super::Disabled::RingBroken);
                    return (taken, true);
                }
            }
            let _ = self.rx_queue.pop(pool);
            // The requests, copied off the ring; each buffer looked up (mapped on a
            // miss) writable, and the line its bytes start in fetched for writing.
            let mut ok = true;
            for i in used..used + need {
                let Ok(Some(req)) = self.rx.take_request() else {
                    // Cannot happen: `need` requests were seen. The packet is dropped;
                    // what the batch holds is answered (the ring is broken, so nothing
                    // is published) and released.
                    self.disable(super::Disabled::RingBroken);
                    for &k in ents[used..i].iter().filter(|&&k| k != NIL) {
                        let xen = &self.xen;
                        if let Some(c) = self.cache.as_mut() {
                            c.release(xen, k);
                        }
                    }
                    pool.free(skb);
                    return (taken, true);
                };
                ids[i] = req.id;
                if !ok {
                    continue;
                }
                let xen = &self.xen;
                match self.cache.as_mut().map(|c| c.acquire(xen, req.gref, true)) {
                    Some(Ok(k)) => ents[i] = k,
                    _ => ok = false,
                }
            }
            if ok {
                if let Some(c) = self.cache.as_deref() {
                    match c.page(ents[used]) {
                        Some(page) => page.prefetch(start, true),
                        None => {
                            self.xen
                                .domain()
                                .window()
                                .prefetch(c.slot(ents[used]), start, true)
                        }
                    }
                }
            }
            batch[taken] = Some(Gathered {
                skb,
                start,
                len,
                first: used,
                need,
                ok,
            });
            taken += 1;
            used += need;
        }
        (taken, false)
    }

    /// Copies one gathered packet into its buffers, piece by piece, and answers its
    /// requests; releases its cache entries and frees it.
    fn rx_cached_answer(
        &mut self,
        pool: &mut crate::skb::SkbPool,
        g: &Gathered,
        ids: &[u16; RX_CACHED_BATCH_SLOTS],
        ents: &[u16; RX_CACHED_BATCH_SLOTS],
    ) {
        use crate::netif::{
            RxResponse, NETRXF_DATA_VALIDATED, NETRXF_MORE_DATA, XEN_NETIF_RSP_ERROR,
        };
        let (skb, len, need) = (g.skb, g.len, g.need);
        let ents = &ents[g.first..g.first + need];
        let ids = &ids[g.first..g.first + need];
        let mut sizes = [0u16; RX_CACHED_SLOTS];
        let mut ok = g.ok;
        if ok {
            let Some(cache) = self.cache.as_deref() else {
                pool.free(skb);
                return;
            };
            let (dom, bounce) = (self.xen.domain(), &mut self.bounce);
            // The bytes, piece by piece: page `p` of the request list from `page_off`.
            let (mut p, mut page_off) = (0usize, g.start);
            let _c = enter(Class::GrantCopy);
            ok = pool
                .walk(skb, 0, len, |seg, _| {
                    let mut done = 0;
                    while done < seg.len {
                        if page_off == mem::PAGE_SIZE {
                            p += 1;
                            page_off = 0;
                        }
                        let k = (seg.len - done).min(mem::PAGE_SIZE - page_off);
                        let from = (seg.page, seg.offset + done);
                        if !copy_piece(dom, cache, bounce, from, (ents[p], page_off), k) {
                            return Err(crate::skb::SkbError::OutOfBounds);
                        }
                        sizes[p] += k as u16;
                        page_off += k;
                        done += k;
                    }
                    Ok(())
                })
                .is_ok();
        }
        if ok {
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += len as u64;
        } else {
            self.stats.rx_copy_errors += 1;
        }
        let csum = ok && pool.csum_valid(skb);
        for i in 0..need {
            let mut flags = 0;
            if i == 0 && csum {
                flags |= NETRXF_DATA_VALIDATED;
            }
            if i + 1 < need {
                flags |= NETRXF_MORE_DATA;
            }
            // Cannot fail on a sound ring: one response per request taken.
            let _ = self.rx.push_response(&RxResponse {
                id: ids[i],
                offset: if i == 0 { g.start as u16 } else { 0 },
                flags,
                status: if ok {
                    sizes[i] as i16
                } else {
                    XEN_NETIF_RSP_ERROR
                },
            });
            if ents[i] != NIL {
                let xen = &self.xen;
                if let Some(c) = self.cache.as_mut() {
                    c.release(xen, ents[i]);
                }
            }
        }
        pool.free(skb);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_index_holds_any_reference_a_guest_names() {
        let mut ix = GrefIndex::new();
        let refs = [8, SEEN_REFS - 1, SEEN_REFS, 0xdead_beef, u32::MAX];
        for (k, &g) in refs.iter().enumerate() {
            assert_eq!(ix.get(g), None);
            ix.insert(g, k as u16);
        }
        assert_eq!(ix.len, refs.len());
        for (k, &g) in refs.iter().enumerate() {
            assert_eq!(ix.get(g), Some(k as u16), "{g:#x}");
        }
        assert_eq!(ix.get(9), None);
        ix.remove(SEEN_REFS - 1);
        ix.remove(u32::MAX);
        assert_eq!((ix.get(SEEN_REFS - 1), ix.get(u32::MAX)), (None, None));
        assert_eq!(ix.get(SEEN_REFS), Some(2));
        assert_eq!(ix.len, refs.len() - 2);
        ix.clear();
        assert_eq!(ix.len, 0);
        assert!(refs.iter().all(|&g| ix.get(g).is_none()));
    }
}
