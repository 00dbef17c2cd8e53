//! netback's guest receive: the bridge's packets queued for the vif, the guest's
//! posted buffers taken off the RX ring, one batched grant copy per pass (or, for a
//! guest-copy front end, the driver domain's own buffers lent through sub-page grants),
//! and the responses. Linux's `drivers/net/xen-netback/rx.c` holds the same work.

use super::*;

/// A guest-copy vif's receive side (paper 000 §4.1–4.2): instead of copying a packet
/// into a buffer the guest posted, netback lends the guest the driver domain's own
/// buffer through a read-only sub-page grant covering exactly the packet's bytes, and
/// the guest copies. The grants are a block of [`RING_IDS`] references, one per ring
/// slot: the packet answered on slot `id` is readable through `base + id`, and the
/// guest gives the buffer back by posting slot `id` again. A request is a credit, not
/// a buffer.
#[derive(Debug)]
pub(super) struct GuestCopy {
    pub(super) base: GrantRef,
    /// The buffer lent through slot `id`'s grant.
    pub(super) lent: Box<[Option<SkbId>]>,
    /// Lent slots, oldest first.
    pub(super) order: LentOrder,
    /// Slots the guest posted and netback has not answered.
    pub(super) credits: Vec<u16>,
    pub(super) credited: InFlight,
    /// Lent buffers whose grant was in use when ended: ended and freed later. Until
    /// then the slot is neither free nor lendable: a slot the guest gave back while its
    /// other vCPU still copied through it is credited only once its grant has ended
    /// (`credit`), or the next packet's grant would be lent through a slot the guest
    /// can still read the old one's bytes through.
    pub(super) ending: Vec<Ending>,
    /// The slots of one packet lent in pieces, as a ring: slot `id`'s next piece, or
    /// `id` itself when it is the packet's only one left. The buffer is freed when its
    /// last piece's grant has ended.
    pub(super) piece_next: Box<[u16]>,
    /// Slots lent through a transitive grant (bytes of another guest's page), and how
    /// many: each holds the sending guest's TX buffer until the guest copies.
    pub(super) transitive: Box<[bool]>,
    pub(super) transitive_held: usize,
}

/// A lent slot whose grant could not be ended yet.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ending {
    pub(super) id: u16,
    pub(super) skb: SkbId,
    /// The guest posted the slot again: it becomes a credit when the grant ends.
    pub(super) credit: bool,
}

/// The slots lent through, oldest first: a list threaded through two arrays indexed by
/// slot, so that a return in any order, as a guest chooses it, is taken out in constant
/// time (a search was 25% of the path when netfront gave a batch back last first).
#[derive(Debug)]
pub(super) struct LentOrder {
    pub(super) prev: Box<[u16]>,
    pub(super) next: Box<[u16]>,
    pub(super) head: u16,
    pub(super) tail: u16,
    pub(super) len: usize,
}

/// No slot: the end of the list, or a slot not on it.
pub(super) const NIL: u16 = u16::MAX;

impl LentOrder {
    pub(super) fn new() -> Self {
        Self::with_capacity(RING_IDS as usize)
    }

    /// A list of indices below `n` (the grant cache's idle entries use one too).
    pub(super) fn with_capacity(n: usize) -> Self {
        Self {
            prev: vec![NIL; n].into_boxed_slice(),
            next: vec![NIL; n].into_boxed_slice(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn front(&self) -> Option<u16> {
        (self.head != NIL).then_some(self.head)
    }

    pub(super) fn contains(&self, id: u16) -> bool {
        self.head == id || self.prev.get(usize::from(id)).is_some_and(|&p| p != NIL)
    }

    /// Appends `id` (newest), unless it is on the list or no slot.
    pub(super) fn push_back(&mut self, id: u16) {
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
    pub(super) fn remove(&mut self, id: u16) {
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

    pub(super) fn pop_front(&mut self) -> Option<u16> {
        let h = self.front()?;
        self.remove(h);
        Some(h)
    }
}

/// One request a guest-RX batch took, and the bytes its buffer receives.
#[derive(Debug, Clone, Copy)]
pub(super) struct RxMeta {
    pub(super) id: u16,
    /// Where in the buffer's page the bytes start.
    pub(super) offset: u16,
    pub(super) size: u16,
}

/// One packet of a guest-RX batch: its copies and its requests, as ranges of the
/// batch's vectors.
#[derive(Debug, Clone, Copy)]
pub(super) struct RxPkt {
    pub(super) skb: SkbId,
    pub(super) first_meta: usize,
    pub(super) metas: usize,
    pub(super) first_op: usize,
    pub(super) ops: usize,
    pub(super) csum: bool,
    /// The checksum is left blank (`NETRXF_csum_blank`).
    pub(super) blank: bool,
    /// A large packet given whole: its GSO extra takes the second request.
    pub(super) gso: Option<Gso>,
}

impl RxPkt {
    pub(super) fn ops_at(&self) -> std::ops::Range<usize> {
        self.first_op..self.first_op + self.ops
    }
    pub(super) fn metas_at(&self) -> std::ops::Range<usize> {
        self.first_meta..self.first_meta + self.metas
    }
}

/// What adding one packet to a guest-RX batch found.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RxBuilt {
    /// Some of its bytes are in a page another guest granted.
    pub(super) foreign: bool,
    /// The ring ran dry under a request the check had promised: a protocol break.
    pub(super) broken: bool,
}

/// A guest-RX batch: the grant copies of up to [`RX_BATCH`] packets and the requests
/// they fill, built before the one hypercall that performs them. Allocated once.
#[derive(Debug)]
pub(super) struct RxBatch {
    pub(super) copies: Vec<GrantCopy>,
    pub(super) status: Vec<GrantStatus>,
    pub(super) meta: Vec<RxMeta>,
    pub(super) pkts: Vec<RxPkt>,
}

impl RxBatch {
    pub(super) fn new() -> Self {
        let max_ops = RX_BATCH * (65536 / PAGE_SIZE + 2);
        Self {
            copies: Vec::with_capacity(max_ops),
            status: vec![Ok(()); max_ops],
            meta: Vec::with_capacity(max_ops),
            pkts: Vec::with_capacity(RX_BATCH),
        }
    }

    pub(super) fn clear(&mut self) {
        self.copies.clear();
        self.meta.clear();
        self.pkts.clear();
    }

    /// Adds a packet: takes a request from `rx` for each page its bytes fill, the
    /// first page from offset `start` and each further one from offset 0 (the packet
    /// needs [`rx_pages`] of them). A packet whose bytes cannot all be walked keeps the
    /// requests it took, to be answered with errors (no copies). Counts the copies'
    /// bytes by alignment into `census`.
    pub(super) fn add(
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
            built.foreign |= matches!(seg.page, SegPage::Window { .. });
            let mut done = 0;
            while done < seg.len {
                if page_off == PAGE_SIZE {
                    page_off = std::mem::take(&mut next_start);
                    let Some((c, g)) = take_page(rx, meta, page_off, &mut extra_due) else {
                        built.broken = true;
                        return Ok(());
                    };
                    (cur, gref) = (c, g);
                }
                let n = (seg.len - done).min(PAGE_SIZE - page_off);
                census.add_n(CopyAlign::of(seg.offset + done, page_off), n as u64);
                ops.push(GrantCopy {
                    source: copy_source(&seg.page, seg.offset + done),
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

impl<X: Xen> Vif<X> {
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
        if (off.gso.is_some() && !(whole && self.takes_gso(off.gso)))
            || (partial && !(whole && self.csum_rx))
        {
            self.rx_software_offload(pool, skb);
            return;
        }
        self.rx_enqueue(pool, skb);
    }

    pub(super) fn rx_enqueue(&mut self, pool: &mut SkbPool, skb: SkbId) {
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

    /// Whether the front end takes this large segment whole: TCP/IPv4 with
    /// `feature-gso-tcpv4`, TCP/IPv6 with `feature-gso-tcpv6`.
    pub(super) fn takes_gso(&self, gso: Option<crate::netif::Gso>) -> bool {
        match gso.map(|g| g.ty) {
            Some(crate::netif::XEN_NETIF_GSO_TYPE_TCPV4) => self.gso_rx,
            Some(crate::netif::XEN_NETIF_GSO_TYPE_TCPV6) => self.gso6_rx,
            _ => false,
        }
    }

    /// The large packets the front end takes whole: bit `1 << t` for each netif GSO
    /// type `t` it negotiated.
    pub fn rx_gso_types(&self) -> u32 {
        u32::from(self.gso_rx) << crate::netif::XEN_NETIF_GSO_TYPE_TCPV4
            | u32::from(self.gso6_rx) << crate::netif::XEN_NETIF_GSO_TYPE_TCPV6
    }

    /// Whether this vif's receive path passes checksum and GSO metadata to the guest:
    /// the grant-copy path does; the guest-copy, direct-placement and grant-cache paths
    /// give frames as they are (their responses carry no extras).
    pub(super) fn rx_carries_offload(&self) -> bool {
        self.guest_copy.is_none() && self.direct.is_none() && self.cache.is_none()
    }

    /// Software segmentation and checksumming for the guest: the packet is read into
    /// the scratch, freed, and its frames (with complete checksums) built in fresh
    /// buffers and queued. A packet whose headers do not bear it out, or that does not
    /// fit, is dropped and counted.
    pub(super) fn rx_software_offload(&mut self, pool: &mut SkbPool, skb: SkbId) {
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
                let r = crate::offload::segment_tcp(frame, &l4, g.size.into(), out, |f| {
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
    pub(super) fn rx_enqueue_copy(&mut self, pool: &mut SkbPool, frame: &[u8]) {
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
            return self.rx_direct_unplaced(pool);
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
    pub(super) fn rx_lend(&mut self, pool: &mut SkbPool) -> usize {
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
                match gc.wait_for_post(&gt, pool, &mut self.rx, &mut self.stats, need) {
                    Waited::Credited => continue,
                    Waited::Nothing => break,
                    Waited::Broken => {
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
            if !gc.revoke_oldest(&gt, pool, need, &mut self.stats) {
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
                Pieces::Linearize => match linearized(pool, skb, &mut self.stats) {
                    Some(c) => c,
                    None => continue,
                },
            };
            // One slot and one grant per piece: a sub-page of the driver domain's own
            // page, or, for bytes in a page another guest granted (a frame it sent),
            // a windowed transitive grant of that guest's grant: no copy.
            if !gc.grant_pieces(&gt, self.fe, &pieces) {
                // Cannot happen for a valid buffer.
                self.stats.rx_copy_errors += 1;
                pool.free(skb);
                continue;
            }
            let validated = pool.csum_valid(skb);
            gc.lend(&mut self.rx, skb, &pieces, validated, &mut self.stats);
            self.stats.rx_lent += 1;
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += pool.len(skb) as u64;
        }
        if broken {
            self.disable(Disabled::RingBroken);
            return n;
        }
        if self.rx.push_responses_and_check_notify() {
            self.notify_rx();
        }
        n
    }

    /// Build: takes packets off the queue while the guest has posted enough buffers
    /// for each, and adds their copies to the batch.
    pub(super) fn rx_build(&mut self, pool: &mut SkbPool) {
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
            let gso = off.gso.filter(|_| self.takes_gso(off.gso));
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
    pub(super) fn rx_flush(&mut self) {
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
    pub(super) fn rx_respond(&mut self, pool: &mut SkbPool) {
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
            self.notify_rx();
        }
        let _m = enter(Class::Mem);
        for p in &self.rxb.pkts {
            pool.free(p.skb);
        }
    }
}

/// One request a guest-copy front end posted: a credit for the slot it names, and the
/// return of the buffer lent through that slot, if any. A slot out of range or already
/// credited is answered with an error and counted; nothing of the vif's changes.
pub(super) fn take_credit(
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

/// Where a copy from `offset` in a segment's page reads: a page of our own is copied
/// from; a page another guest granted (a packet it sent, forwarded by the bridge) is
/// copied from through its grant, as Linux netback does for foreign pages: the driver
/// domain's mapping is not a frame it owns.
#[inline]
fn copy_source(page: &SegPage, offset: usize) -> CopyPtr {
    match *page {
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
    }
}

/// Takes the request for a packet's next page, whose bytes start at `offset`, and
/// after the first, the GSO extra's (`extra_due`, then cleared), each recorded in
/// `meta`. Returns the page's index in `meta` and its grant; `None` if the ring holds
/// no request.
#[inline]
fn take_page(
    rx: &mut Back<RxRing>,
    meta: &mut Vec<RxMeta>,
    offset: usize,
    extra_due: &mut bool,
) -> Option<(usize, u32)> {
    let Ok(Some(req)) = rx.take_request() else {
        return None;
    };
    let cur = meta.len();
    meta.push(RxMeta {
        id: req.id,
        offset: offset as u16,
        size: 0,
    });
    if std::mem::take(extra_due) {
        let Ok(Some(x)) = rx.take_request() else {
            return None;
        };
        meta.push(RxMeta {
            id: x.id,
            offset: 0,
            size: 0,
        });
    }
    Some((cur, req.gref))
}

/// What waiting for the guest's next post found.
enum Waited {
    /// A post came meanwhile, and was taken as a credit (or a return).
    Credited,
    /// Nothing: `req_event` is armed, and the guest's next post wakes the vif.
    Nothing,
    /// The ring broke the protocol.
    Broken,
}

/// A packet's bytes copied into one local buffer, as one piece: for a packet in more
/// pieces than a response chain carries. `None` (counted) if no buffer was free.
#[inline]
fn linearized(pool: &mut SkbPool, skb: SkbId, stats: &mut VifStats) -> Option<(SkbId, PieceList)> {
    let Some(c) = local_linear(pool, skb, &mut stats.rx_linearized) else {
        stats.rx_copy_errors += 1;
        return None;
    };
    let (gfn, off) = pool.data_location(c);
    let mut p = PieceList::default();
    p.push(Piece {
        page: SegPage::Own(gfn),
        offset: off as u16,
        len: pool.len(c) as u16,
    });
    Some((c, p))
}

impl GuestCopy {
    /// Out of credits (fewer than `need`), or the guest holds as much as it may while
    /// the queue behind it has room (the packet waits, as for a guest that posts no
    /// buffers): arms `req_event` and looks once more, so that the guest's next post, a
    /// credit or a return, wakes this vif.
    #[inline]
    fn wait_for_post(
        &mut self,
        gt: &hv::grant::GuestGrants<'_>,
        pool: &mut SkbPool,
        rx: &mut Back<RxRing>,
        stats: &mut VifStats,
        need: usize,
    ) -> Waited {
        match rx.final_check_for_at_least(1) {
            Ok(true) => match rx.take_request() {
                Ok(Some(req)) => {
                    take_credit(self, gt, pool, req, rx, stats);
                    Waited::Credited
                }
                _ => Waited::Nothing,
            },
            Ok(false) => {
                if self.credits.len() < need {
                    stats.rx_stalls += 1;
                } else {
                    stats.rx_lent_full += 1;
                }
                Waited::Nothing
            }
            Err(_) => Waited::Broken,
        }
    }

    /// The guest holds as much as it may and the queue behind it is full: it is not
    /// copying. Takes back its oldest pieces until `need` more fit (their packets are
    /// lost to it, counted), unless the guest is copying from one this moment: an
    /// in-use grant cannot be revoked. Returns whether there is room now.
    fn revoke_oldest(
        &mut self,
        gt: &hv::grant::GuestGrants<'_>,
        pool: &mut SkbPool,
        need: usize,
        stats: &mut VifStats,
    ) -> bool {
        while self.order.len() + need > RX_LENT_MAX {
            let Some(old) = self.order.front() else {
                break;
            };
            if gt
                .end_access(GrantRef(self.base.0 + u32::from(old)))
                .is_err()
            {
                stats.rx_lent_full += 1;
                return false;
            }
            self.order.pop_front();
            if let Some(s) = self.lent[old as usize].take() {
                if self.unlink(old) {
                    pool.free(s);
                }
            }
            stats.rx_revoked += 1;
        }
        true
    }

    /// One grant per piece through the last credits' slots: a sub-page of the driver
    /// domain's own page, or, for bytes in a page another guest granted (a frame it
    /// sent), a windowed transitive grant of that guest's grant: no copy. On a failure,
    /// undoes what was granted and returns false.
    #[inline]
    fn grant_pieces(&self, gt: &hv::grant::GuestGrants<'_>, fe: DomId, pieces: &PieceList) -> bool {
        let ids = &self.credits[self.credits.len() - pieces.len..];
        let mut granted = 0;
        for (piece, &id) in pieces.iter().zip(ids) {
            let r = GrantRef(self.base.0 + u32::from(id));
            let (off, len) = (piece.offset, piece.len);
            let ok = match piece.page {
                SegPage::Own(gfn) => gt.grant_access_subpage(r, fe, gfn, off, len, true).is_ok(),
                SegPage::Window { grant, .. } => gt
                    .grant_access_transitive_window(r, fe, grant, off, len, true)
                    .is_ok(),
            };
            if !ok {
                break;
            }
            granted += 1;
        }
        if granted < pieces.len {
            for &id in &ids[..granted] {
                let _ = gt.end_access(GrantRef(self.base.0 + u32::from(id)));
            }
            return false;
        }
        true
    }

    /// Lends `skb` through the last credits' slots, granted by
    /// [`GuestCopy::grant_pieces`]: each slot answered with its piece's offset and
    /// length, chained with `NETRXF_MORE_DATA`, the first marked validated if the
    /// packet's checksum was.
    #[inline]
    fn lend(
        &mut self,
        rx: &mut Back<RxRing>,
        skb: SkbId,
        pieces: &PieceList,
        validated: bool,
        stats: &mut VifStats,
    ) {
        let first = self.credits.len() - pieces.len;
        let flags = if validated { NETRXF_DATA_VALIDATED } else { 0 };
        for (k, piece) in pieces.iter().enumerate() {
            let id = self.credits[first + k];
            let next = self.credits[first + (k + 1) % pieces.len];
            let _ = self.credited.complete(id);
            self.lent[id as usize] = Some(skb);
            self.piece_next[id as usize] = next;
            self.order.push_back(id);
            if matches!(piece.page, SegPage::Window { .. }) {
                self.transitive[id as usize] = true;
                self.transitive_held += 1;
                stats.rx_transitive += 1;
            }
            let more = if k + 1 < pieces.len {
                NETRXF_MORE_DATA
            } else {
                0
            };
            // Cannot fail: one response per request taken.
            let _ = rx.push_response(&RxResponse {
                id,
                offset: piece.offset,
                flags: if k == 0 { flags | more } else { more },
                status: piece.len as i16,
            });
        }
        self.credits.truncate(first);
    }

    /// Tries again the grants that were in use when ended, freeing each buffer whose
    /// grant ends now.
    pub(super) fn end_pending(&mut self, gt: &hv::grant::GuestGrants<'_>, pool: &mut SkbPool) {
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
    pub(super) fn unlink(&mut self, id: u16) -> bool {
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
pub(super) fn end_lent(
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
pub(super) struct Piece {
    pub(super) page: SegPage,
    pub(super) offset: u16,
    pub(super) len: u16,
}

/// A packet's pieces, at most [`RX_COPY_MAX_SLOTS`], in a fixed array.
#[derive(Debug, Clone, Copy)]
pub(super) struct PieceList {
    pub(super) pieces: [Piece; RX_COPY_MAX_SLOTS],
    pub(super) len: usize,
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
    pub(super) fn push(&mut self, p: Piece) -> bool {
        let Some(slot) = self.pieces.get_mut(self.len) else {
            return false;
        };
        *slot = p;
        self.len += 1;
        true
    }
    pub(super) fn iter(&self) -> impl Iterator<Item = &Piece> {
        self.pieces[..self.len].iter()
    }
}

/// How a queued packet goes to a guest-copy front end.
#[derive(Debug, Clone, Copy)]
pub(super) enum Pieces {
    /// Lent as it lies, a slot per piece.
    Lend(PieceList),
    /// Copied into one local buffer first.
    Linearize,
}

impl Pieces {
    /// `skb`'s pieces: each run of its bytes in one page (a driver-domain page, or, if
    /// `foreign_ok`, a page another guest granted).
    pub(super) fn of(pool: &SkbPool, skb: SkbId, foreign_ok: bool) -> Self {
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
    pub(super) fn slots(&self) -> usize {
        match self {
            Pieces::Lend(p) => p.len,
            Pieces::Linearize => 1,
        }
    }
}

/// `skb` if its bytes are all in its own linear area in one of the driver domain's
/// pages; otherwise a copy that is (counted in `linearized`), `skb` freed. `None` if
/// no buffer could be had.
pub(super) fn local_linear(pool: &mut SkbPool, skb: SkbId, linearized: &mut u64) -> Option<SkbId> {
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
