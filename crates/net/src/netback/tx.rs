//! netback's guest transmit: each packet's slot chain copied off the TX ring and
//! judged, its headers grant-copied into a local buffer and the rest grant-mapped (or,
//! in copy mode, grant-copied; or read through the grant cache), the packet handed to
//! the bridge, and each slot answered when its page is released. Linux's
//! `drivers/net/xen-netback/netback.c` holds the same work.

use super::*;

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Pending {
    pub(super) handle: Option<GrantHandle>,
    /// The grant-cache entry the slot is read through, instead of a map of its own.
    pub(super) cached: Option<u16>,
    pub(super) id: u16,
}

/// A free TX pending slot, taken for request `id`'s page: reached through grant-cache
/// entry `cached`, or (none) through a map of its own still to be made. The caller has
/// checked that a chain's worth is free.
pub(super) fn take_pending(
    pending: &mut [Pending],
    free: &mut Vec<u16>,
    id: u16,
    cached: Option<u16>,
) -> u16 {
    let p = free.pop().expect("checked: a chain's worth is free");
    pending[usize::from(p)] = Pending {
        handle: None,
        cached,
        id,
    };
    p
}

/// Acquires each slot's grant through the cache (mapped only on a miss), stopping at the
/// first that fails. Returns the entries and how many were acquired.
#[inline]
fn acquire_slots<X: Xen>(
    cache: &mut GrantCache,
    xen: &X,
    slots: &[crate::netif::TxSlot],
) -> ([u16; FATAL_SKB_SLOTS], usize) {
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
    (ks, got)
}

/// Answers a packet's `n` extra slots (`XEN_NETIF_RSP_NULL`), as netback does whatever
/// happens to the packet.
#[inline]
fn answer_extras(tx: &mut Back<TxRing>, n: usize) {
    for _ in 0..n {
        let _ = tx.push_response(&TxResponse {
            id: 0,
            status: crate::netif::XEN_NETIF_RSP_NULL,
        });
    }
}

/// One packet of a guest-TX batch, as ranges of the batch's vectors.
#[derive(Debug, Clone, Copy)]
pub(super) struct TxPkt {
    pub(super) skb: SkbId,
    /// A second buffer for the maps beyond [`MAX_SKB_FRAGS`], linked on the first's
    /// fragment list.
    pub(super) overflow: Option<SkbId>,
    pub(super) copy_op: usize,
    pub(super) copy_len: usize,
    /// Index into the batch's maps of its first map, and how many.
    pub(super) first_map: usize,
    pub(super) maps: usize,
    /// Request id of the first slot when it was copied whole (answered now).
    pub(super) copied_id: Option<u16>,
    /// Extras to answer with `RSP_NULL`.
    pub(super) extras: usize,
    /// Copy mode: its pages copied into the back end's own (`pages` of the batch's,
    /// their copies following the header copy) and its slots' ids, all answered now.
    pub(super) first_page: usize,
    pub(super) pages: usize,
    pub(super) first_id: usize,
    pub(super) ids: usize,
}

impl TxPkt {
    pub(super) fn maps_at(&self) -> std::ops::Range<usize> {
        self.first_map..self.first_map + self.maps
    }
    pub(super) fn pages_at(&self) -> std::ops::Range<usize> {
        self.first_page..self.first_page + self.pages
    }
    /// Its copies: the header's, then one per page in copy mode.
    pub(super) fn copies_at(&self) -> std::ops::Range<usize> {
        self.copy_op..self.copy_op + 1 + self.pages
    }
}

/// Copy mode: a page of the back end's own that a TX slot was copied into.
#[derive(Debug, Clone, Copy)]
pub(super) struct TxCopied {
    pub(super) gfn: hv::Gfn,
    pub(super) len: u16,
}

/// Copies a copy-mode batch may hold (the header's and one per page of each packet).
pub(super) const TX_COPIES_MAX: usize = MAX_PENDING * 2;

/// A mapped TX slot: the pending entry that holds its mapping until the packet has
/// left, and the bytes of the page it contributes.
#[derive(Debug, Clone, Copy)]
pub(super) struct TxMapped {
    pub(super) pending: u16,
    pub(super) offset: u16,
    pub(super) len: u16,
}

/// A guest-TX batch: the header copies and page maps of the packets built, before the
/// two hypercalls that perform them, and their results. Allocated once.
#[derive(Debug)]
pub(super) struct TxBatch {
    pub(super) copies: Vec<GrantCopy>,
    pub(super) copy_status: Vec<GrantStatus>,
    pub(super) maps: Vec<MapOp>,
    pub(super) map_results: Vec<Result<GrantHandle, GrantError>>,
    /// One per entry of `maps`.
    pub(super) mapped: Vec<TxMapped>,
    /// Copy mode: the pages copied into, and the slot ids answered with each packet.
    pub(super) pages: Vec<TxCopied>,
    pub(super) ids: Vec<u16>,
    pub(super) pkts: Vec<TxPkt>,
    /// Responses were pushed and must be published.
    pub(super) responses: bool,
}

impl TxBatch {
    pub(super) fn new() -> Self {
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

    pub(super) fn clear(&mut self) {
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
pub(super) struct Unmaps {
    pub(super) handles: Vec<GrantHandle>,
    pub(super) pending: Vec<u16>,
    pub(super) status: Vec<GrantStatus>,
}

/// Bytes of a vif's offload scratch: a 64 KiB packet and one frame cut from it.
pub(super) const OFFLOAD_SCRATCH: usize = MAX_OFFLOAD_LEN + 2048;

/// The offload a guest's TX chain asks for, before its headers are looked at: a blank
/// checksum's place is found by [`Vif::tx_offload`].
pub(super) fn chain_offload(chain: &TxChain) -> Offload {
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

impl<X: Xen> Vif<X> {
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
    pub(super) fn tx_offload(&mut self, pool: &mut SkbPool, skb: SkbId) -> bool {
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
    pub(super) fn tx_build(&mut self, pool: &mut SkbPool, budget: usize) {
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
    pub(super) fn tx_prefetch(&self, ahead: u32) {
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
    pub(super) fn tx_take_chain(&mut self, chain: &mut TxChain) -> Option<TxJudgement> {
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
        // The toolstack's rate: a packet whose size the credit does not cover waits on
        // the ring (its first slot's size is the packet's, as the guest claims it; a
        // claim the chain belies is judged below, and the chain dropped).
        if let (Some(c), Some(_)) = (self.credit.as_mut(), avail) {
            let size = self.tx.peek_request(0).map_or(0, |r| u64::from(r.size));
            if !c.admit(size, std::time::Instant::now()) {
                self.stats.tx_rate_limited += 1;
                return None;
            }
        }
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
    pub(super) fn tx_answer(&mut self, chain: &TxChain, status: i16) {
        for r in chain.responses(status) {
            let _ = self.tx.push_response(&r);
        }
        self.txb.responses = true;
    }

    /// Queues the grant copy of a chain's first `copy_len` bytes (of its first slot
    /// `s0`) into `skb`'s linear area; its index among the batch's copies.
    pub(super) fn tx_copy_header(
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
    pub(super) fn tx_build_packet(&mut self, pool: &mut SkbPool, chain: &TxChain) {
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
    pub(super) fn tx_build_copied(&mut self, pool: &mut SkbPool, chain: &TxChain) {
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
    pub(super) fn tx_layout(
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
    pub(super) fn tx_buffers(pool: &mut SkbPool, maps: usize) -> Option<(SkbId, Option<SkbId>)> {
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
    pub(super) fn tx_build_cached(&mut self, pool: &mut SkbPool, chain: &TxChain) {
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
        let (ks, got) = acquire_slots(cache, xen, slots);
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
        answer_extras(&mut self.tx, chain.extras);
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
    pub(super) fn tx_map_slot(&mut self, gref: u32, id: u16, offset: u16, len: u16) {
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
    pub(super) fn tx_flush(&mut self) {
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
    pub(super) fn tx_complete(&mut self, pool: &mut SkbPool, k: usize) -> Option<SkbId> {
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
        answer_extras(&mut self.tx, p.extras);
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
            self.tx_fail_packet(pool, &p);
            return None;
        }
        if !self.tx_assemble(pool, &p) {
            pool.free(p.skb);
            return None;
        }
        Some(p.skb)
    }

    /// A packet whose grant copy or map failed: every mapped slot answered with an
    /// error, and its buffers and pages freed (copied slots were answered already).
    #[cold]
    fn tx_fail_packet(&mut self, pool: &mut SkbPool, p: &TxPkt) {
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
    }

    /// Assembles packet `p`: its header in the linear area, each copied page a local
    /// fragment and each mapped one a foreign fragment (past `MAX_SKB_FRAGS`, on the
    /// overflow buffer chained behind it). Returns false if a fragment could not be
    /// added; what it held is then given back or answered, and the caller frees the
    /// packet.
    #[inline]
    fn tx_assemble(&mut self, pool: &mut SkbPool, p: &TxPkt) -> bool {
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
        ok
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

    pub(super) fn release_pending(&mut self, pi: u16, status: i16) {
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

    /// When a packet waiting for the vif's rate may go (the next period), if one waits
    /// and its time has not come: the caller looks at the vif again then, as Linux's
    /// netback arms a timer. No event will come for it: the guest signalled already.
    pub fn tx_credit_wait(&self) -> Option<std::time::Instant> {
        self.credit
            .and_then(|c| c.waiting_until())
            .filter(|&t| t > std::time::Instant::now())
    }

    /// The toolstack's rate for this vif (bytes a period, the period), if it set one.
    pub fn tx_rate(&self) -> Option<(u64, std::time::Duration)> {
        self.credit.map(|c| c.rate())
    }

    /// Whether the guest has published TX requests not yet taken. When there are none
    /// and `req_event` went stale (a build that stopped early), it is armed and the ring
    /// looked at once more (`RING_FINAL_CHECK_FOR_REQUESTS`, as Linux's netback does
    /// before it stops polling): the front end then signals its next request. Without
    /// it, a vif that ran out of pending entries and then found its ring empty slept
    /// through every request the front end added after, until some other event came.
    pub fn tx_pending(&mut self) -> bool {
        if self.disabled.is_some() || self.tx_credit_wait().is_some() {
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
}
