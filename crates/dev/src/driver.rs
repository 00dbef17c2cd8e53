//! The NIC's driver, running in the kernel of the domain that owns the NIC (the driver
//! domain, a guest with the NIC assigned, or a native machine).
//!
//! Receive buffers are packet buffers from the kernel's pool, posted in the RX ring with
//! the IP-aligning offset Linux drivers use; the device fills them in place. The
//! interrupt handler turns interrupts off and schedules the poll; the poll takes
//! completed descriptors up to its budget, refills each slot with a fresh buffer, hands
//! the packets up, and turns interrupts back on when it runs dry (NAPI). Transmit maps
//! each page a packet lies in (its own pages, or foreign pages netback mapped) for the
//! device and rings the doorbell; completions free the buffers, which releases foreign
//! pages to their owner.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use hv::iommu::window_iova;
use hv::profile::{enter, Class};
use hv::{Domain, Gfn, Hypervisor, Iova, PAGE_SIZE};
use net::skb::{SegPage, SkbId, SkbPool, NET_IP_ALIGN, NET_SKB_PAD};

use net::offload::{Csum, Offload, MAX_HEADERS};

use crate::nic::{
    Desc, FilterError, NicRegs, DESC_CTX, DESC_CTX_NEXT, DESC_DD, DESC_EOP, DESC_ERR, DESC_L4_OK,
    DESC_LOOP, DESC_OFFLOAD, DESC_SIZE, RING_DESCS, RING_PAGES, RX_QUEUES,
};

/// Where the rings appear to the device: I/O-virtually contiguous, whatever frames hold
/// them.
const RX_RING_IOVA_PFN: u64 = 1 << 33;
const TX_RING_IOVA_PFN: u64 = (1 << 33) + 64;
/// Guest queue `q`'s ring at `VMQ_RING_IOVA_PFN + q * RING_PAGES`.
const VMQ_RING_IOVA_PFN: u64 = (1 << 33) + 128;

type Ring = [Gfn; RING_PAGES];

/// The kernel's DMA interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmaApi {
    /// Native Linux's `pci-nommu`: the bus address is the physical address.
    Direct,
    /// A Xen guest kernel's `swiotlb`: guest frames need not be machine-contiguous, so
    /// each mapping checks whether the buffer's pages are (and would bounce them if not;
    /// packet buffers never span pages, so none bounce).
    Swiotlb,
}

/// Why the driver could not start.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// No memory for rings or buffers.
    #[error("out of memory")]
    NoMemory,
    /// The IOMMU refused a mapping.
    #[error("iommu: {0}")]
    Iommu(#[from] hv::iommu::IommuError),
}

/// A buffer lent to a guest's receive queue (the paper's `vmq_alloc_skb` /
/// `vmq_alloc_page`): where the device may write (the I/O address under which the
/// driver domain's IOMMU context maps it), how much, and its owner's name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmqBuf {
    /// Where the device writes.
    pub iova: Iova,
    /// How much it may write.
    pub len: u16,
    /// The owner's name for it (netback's).
    pub token: u32,
}

/// A guest queue's buffer come back from the device (the paper's `vmq_netif_rx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmqDone {
    /// The owner's name for the buffer.
    pub token: u32,
    /// Bytes the device wrote (0 if `error`).
    pub len: u16,
    /// The device verified the frame's UDP checksum.
    pub csum_ok: bool,
    /// The device's DMA faulted: no data.
    pub error: bool,
    /// The frame goes on in the next buffer(s) (data, after a context if it is next).
    pub more: bool,
    /// The first buffer of a frame the queue took whole: the frame's offload (its GSO
    /// and checksum state), from the context descriptor that follows.
    pub offload: Option<Offload>,
    /// The buffer the device left for a whole frame's context: no data.
    pub context: bool,
}

impl VmqDone {
    /// What the buffer holds, for its vif's netback to answer.
    pub fn fill(&self) -> net::netback::Fill {
        use net::netback::Fill;
        if self.error {
            return Fill::Error;
        }
        if self.context {
            return Fill::Context;
        }
        match self.offload.and_then(|o| o.gso.map(|g| (g, o.csum))) {
            Some((gso, csum)) => Fill::First {
                len: self.len,
                more: self.more,
                gso,
                blank: matches!(csum, Csum::Partial { .. }),
            },
            None => Fill::Data {
                len: self.len,
                csum_ok: self.csum_ok,
                more: self.more,
            },
        }
    }
}

/// Why a guest queue could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum VmqError {
    /// Not a guest queue (queue 0 is the driver domain's), or none left.
    #[error("no such guest queue: {0}")]
    NoQueue(usize),
    /// The queue is open already.
    #[error("queue {0} is in use")]
    InUse(usize),
    /// The filter table refused.
    #[error("filter: {0}")]
    Filter(#[from] FilterError),
    /// No memory, or no IOMMU mapping, for the ring.
    #[error("ring: {0}")]
    Ring(#[from] DriverError),
}

/// A guest receive queue, as the driver keeps it: its ring, the buffers posted in it,
/// the next descriptor the device completes and the next one free to post.
#[derive(Debug)]
struct Vmq {
    ring: Ring,
    bufs: Box<[Option<VmqBuf>]>,
    next: u32,
    tail: u32,
    napi: bool,
}

/// Counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Packets received and handed up.
    pub rx_packets: u64,
    /// Packets dropped for want of a replacement buffer.
    pub rx_no_buffer: u64,
    /// Descriptors the device completed with an error (its DMA faulted): dropped, the
    /// buffer posted again.
    pub rx_errors: u64,
    /// Packets transmitted (completed).
    pub tx_packets: u64,
    /// Transmit refusals: ring full.
    pub tx_ring_full: u64,
    /// Interrupts handled.
    pub irqs: u64,
    /// Buffers whose pages are not machine-contiguous (would bounce).
    pub dma_bounces: u64,
    /// Times adaptive moderation changed the packets per interrupt.
    pub itr_changes: u64,
    /// Large (GSO) frames received over several descriptors.
    pub rx_gso: u64,
    /// Frames whose offload (from the device's write-back) the frame's headers do not
    /// bear out: dropped.
    pub rx_bad_offload: u64,
    /// Packets sent with a context descriptor (a partial checksum or GSO for the
    /// device to finish).
    pub tx_offloaded: u64,
}

hv::counter_set!(DriverStats {
    rx_packets,
    rx_no_buffer,
    rx_errors,
    tx_packets,
    tx_ring_full,
    irqs,
    dma_bounces,
    itr_changes,
    rx_gso,
    rx_bad_offload,
    tx_offloaded
});

/// The driver of one NIC.
#[derive(Debug)]
pub struct NicDriver {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    regs: Arc<NicRegs>,
    dma: DmaApi,
    rx_ring: Ring,
    tx_ring: Ring,
    rx_skbs: Box<[Option<SkbId>]>,
    rx_next: u32,
    tx_skbs: Box<[Option<SkbId>]>,
    tx_next: u32,
    tx_clean: u32,
    napi: bool,
    /// Adaptive interrupt moderation, when on: each receive queue's own, from its own
    /// rate.
    adaptive: [Option<Adaptive>; RX_QUEUES],
    /// Guest receive queues by queue number (queue 0, the driver domain's, is above).
    vmq: Vec<Option<Vmq>>,
    /// A frame arriving over several descriptors, its buffers so far (the first, with
    /// the rest on its fragment list); or, after one was lost, `Err` while its remaining
    /// descriptors are skipped.
    rx_partial: Option<Result<SkbId, ()>>,
    /// Large Receive Offload, when on.
    lro: Option<crate::lro::DriverLro>,
    stats: DriverStats,
}

/// Adaptive interrupt moderation (in the spirit of Linux's dynamic interrupt
/// moderation, `net_dim`, and e1000's dynamic ITR): over each window the driver counts
/// the packets it received and sets the device's packets per interrupt so that, at
/// that rate, interrupts come about [`ADAPTIVE_IRQ_RATE`] times a second, from 1 (a
/// low rate: every packet signalled at once) to [`ADAPTIVE_MAX_PKTS`]. The device's
/// maximum delay still bounds how long a packet waits.
#[derive(Debug, Clone, Copy)]
struct Adaptive {
    since: std::time::Instant,
    packets: u64,
    itr: u32,
}

/// The interrupt rate adaptive moderation aims at, per second: at most one interrupt a
/// millisecond once the rate allows, so that a saturated gigabit link (81 000 frames a
/// second) gets the largest batch, and below 1000 packets a second every packet is
/// signalled at once. (First set at 2000: at the paper's load it chose 41 packets and
/// cost 10–14% more than 64.)
pub const ADAPTIVE_IRQ_RATE: f64 = 1000.0;
/// The most packets per interrupt it chooses.
pub const ADAPTIVE_MAX_PKTS: u32 = 64;
/// How often it looks at the rate.
pub const ADAPTIVE_WINDOW: std::time::Duration = std::time::Duration::from_millis(1);

/// The I/O address of a byte of the owner's memory (its IOMMU context maps every page
/// the driver gives the device at the page's own frame number).
pub fn iova_of(gfn: Gfn, offset: usize) -> Iova {
    Iova((gfn.0 as u64) << mem::PAGE_SHIFT | offset as u64)
}

impl NicDriver {
    /// Probes the NIC: allocates both rings, maps them and every page of `pool` in the
    /// owner's IOMMU context, posts a buffer in every RX slot, and enables the device
    /// and its interrupt.
    pub fn probe(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        regs: &Arc<NicRegs>,
        pool: &mut SkbPool,
        dma: DmaApi,
    ) -> Result<Self, DriverError> {
        let rx_ring = alloc_ring(hv, dom, RX_RING_IOVA_PFN)?;
        let tx_ring = alloc_ring(hv, dom, TX_RING_IOVA_PFN)?;
        for g in pool.all_pages() {
            hv.iommu_map(dom, iova_of(g, 0), g, true)?;
        }
        let mut d = Self {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
            regs: Arc::clone(regs),
            dma,
            rx_ring,
            tx_ring,
            rx_skbs: vec![None; RING_DESCS as usize].into_boxed_slice(),
            rx_next: 0,
            tx_skbs: vec![None; RING_DESCS as usize].into_boxed_slice(),
            tx_next: 0,
            tx_clean: 0,
            napi: false,
            adaptive: [None; RX_QUEUES],
            vmq: (0..RX_QUEUES).map(|_| None).collect(),
            rx_partial: None,
            lro: None,
            stats: DriverStats::default(),
        };
        for i in 0..RING_DESCS {
            let skb = pool
                .alloc(NET_SKB_PAD + NET_IP_ALIGN)
                .map_err(|_| DriverError::NoMemory)?;
            d.post_rx(pool, i, skb);
        }
        regs.rxq[0]
            .base
            .store(RX_RING_IOVA_PFN << mem::PAGE_SHIFT, Ordering::Relaxed);
        regs.tx_base
            .store(TX_RING_IOVA_PFN << mem::PAGE_SHIFT, Ordering::Relaxed);
        regs.set_rx_tail(0, RING_DESCS - 1);
        regs.rxq[0].irq_enabled.store(true, Ordering::Release);
        regs.enable();
        Ok(d)
    }

    /// TX descriptors posted and not yet cleaned.
    pub fn tx_ring_used(&self) -> u32 {
        (self.tx_next + RING_DESCS - self.tx_clean) % RING_DESCS
    }

    /// Counters.
    pub fn stats(&self) -> &DriverStats {
        &self.stats
    }
    /// The device's registers.
    pub fn regs(&self) -> &Arc<NicRegs> {
        &self.regs
    }
    /// Whether the poll is scheduled (interrupts off).
    pub fn napi_scheduled(&self) -> bool {
        self.napi
    }

    fn desc_at(ring: &Ring, i: u32) -> (Gfn, usize) {
        let at = (i % RING_DESCS) as usize * DESC_SIZE;
        (ring[at / PAGE_SIZE], at % PAGE_SIZE)
    }

    /// Descriptor `i` as the device hands it back: the word with its status and length
    /// in one load first, then (if done) its address, so that a done descriptor is never
    /// read with bytes from before the device's write-back, whose last store is that
    /// word ([`hv::iommu::DmaContext::dma_write_back`]). A copy of all 16 bytes keeps no
    /// order among its loads, and could take a stale length beside a done status
    /// (ARCHITECTURE §6). A descriptor not done comes with its status alone.
    fn read_desc(&self, ring: &Ring, i: u32) -> Desc {
        let (g, off) = Self::desc_at(ring, i);
        let Ok(last) = self
            .dom
            .atomic_u64(g, off + 8)
            .map(|w| w.load(Ordering::Acquire))
        else {
            return Desc::default();
        };
        let d = Desc::from_words(0, last);
        if d.status & DESC_DD == 0 {
            return d;
        }
        let addr = self
            .dom
            .atomic_u64(g, off)
            .map_or(0, |w| w.load(Ordering::Relaxed));
        Desc::from_words(addr, last)
    }

    fn write_desc(&self, ring: &Ring, i: u32, d: &Desc) {
        let (g, off) = Self::desc_at(ring, i);
        let _ = self.dom.write(g, off, bytemuck::bytes_of(d));
    }

    /// `dma_map_single`: the bus address of a buffer's bytes.
    fn dma_map(&mut self, gfn: Gfn, offset: usize, len: usize) -> Iova {
        let _c = enter(Class::Dma);
        if self.dma == DmaApi::Swiotlb {
            // swiotlb's `range_needs_mapping`: is every page of the buffer
            // machine-contiguous with the first?
            let first = self.hv.gfn_to_mfn(&self.dom, gfn);
            let pages = (offset + len.max(1)).div_ceil(PAGE_SIZE);
            for k in 1..pages {
                let next = self.hv.gfn_to_mfn(&self.dom, Gfn(gfn.0 + k as u32));
                if first.zip(next).is_none_or(|(a, b)| b.0 != a.0 + k as u32) {
                    self.stats.dma_bounces += 1;
                }
            }
        }
        iova_of(gfn, offset)
    }

    fn post_rx(&mut self, pool: &SkbPool, i: u32, skb: SkbId) {
        let (g, off) = pool.data_location(skb);
        let room = pool.tailroom(skb);
        let addr = self.dma_map(g, off, room);
        self.write_desc(
            &self.rx_ring,
            i,
            &Desc {
                addr: addr.0,
                len: room as u16,
                ..Default::default()
            },
        );
        self.rx_skbs[i as usize] = Some(skb);
    }

    /// Turns LRO on with `setup` (or off), before the device has received anything: in
    /// page-mode every posted buffer is replaced with a whole page of its own (the pool
    /// needs a page per descriptor, [`RING_DESCS`], besides its others).
    pub fn set_lro(
        &mut self,
        pool: &mut SkbPool,
        setup: Option<crate::lro::LroSetup>,
    ) -> Result<(), DriverError> {
        if let Some(l) = self.lro.as_mut() {
            l.discard(pool);
        }
        self.lro = setup.map(crate::lro::DriverLro::new);
        for i in 0..RING_DESCS {
            if let Some(old) = self.rx_skbs[i as usize].take() {
                pool.free(old);
            }
            let skb = self.rx_alloc(pool).map_err(|_| DriverError::NoMemory)?;
            self.post_rx(pool, i, skb);
        }
        Ok(())
    }

    /// LRO, if on.
    pub fn lro(&self) -> Option<&crate::lro::DriverLro> {
        self.lro.as_ref()
    }

    /// How long until LRO's oldest held aggregate reaches its limit (`None`: nothing
    /// held).
    pub fn lro_due_in(&self) -> Option<std::time::Duration> {
        let l = self.lro.as_ref()?;
        let due = l.deadline()?;
        Some(std::time::Duration::from_nanos(due.saturating_sub(l.now())))
    }

    /// Hands up the aggregates LRO has held past their limit (the driver's timer).
    pub fn lro_expire(&mut self, pool: &mut SkbPool, mut deliver: impl FnMut(&mut SkbPool, SkbId)) {
        if let Some(l) = self.lro.as_mut() {
            let _c = enter(Class::Driver);
            l.expire(pool, &mut deliver);
        }
    }

    /// A receive buffer: a head with room for a frame, or (page-mode LRO) a whole page.
    fn rx_alloc(&self, pool: &mut SkbPool) -> Result<SkbId, net::skb::SkbError> {
        let _m = enter(Class::Mem);
        if self
            .lro
            .as_ref()
            .is_some_and(|l| l.setup().form == crate::lro::Form::Page)
        {
            let skb = pool.alloc_page_linear()?;
            if let Err(e) = pool.reserve(skb, NET_SKB_PAD + NET_IP_ALIGN) {
                pool.free(skb);
                return Err(e);
            }
            Ok(skb)
        } else {
            pool.alloc(NET_SKB_PAD + NET_IP_ALIGN)
        }
    }

    /// Turns adaptive interrupt moderation on or off (off: the device keeps the count
    /// it was started with, or last given).
    pub fn set_adaptive(&mut self, on: bool) {
        for q in 0..RX_QUEUES {
            let open = q == 0 || self.vmq[q].is_some();
            self.adaptive[q] = (on && open).then(|| self.fresh_adaptive(q));
        }
    }

    fn fresh_adaptive(&self, q: usize) -> Adaptive {
        Adaptive {
            since: std::time::Instant::now(),
            packets: 0,
            itr: self.regs.rxq[q].itr_pkts.load(Ordering::Relaxed),
        }
    }

    /// Counts `n` packets received on queue `q` for adaptive moderation and, once a
    /// window has passed, sets that queue's packets per interrupt for the rate measured.
    fn moderate(&mut self, q: usize, n: usize) {
        let Some(a) = self.adaptive[q].as_mut() else {
            return;
        };
        a.packets += n as u64;
        let now = std::time::Instant::now();
        let took = now.duration_since(a.since);
        if took < ADAPTIVE_WINDOW {
            return;
        }
        let rate = a.packets as f64 / took.as_secs_f64();
        let itr = ((rate / ADAPTIVE_IRQ_RATE).ceil() as u32).clamp(1, ADAPTIVE_MAX_PKTS);
        if itr != a.itr {
            a.itr = itr;
            self.regs.rxq[q].itr_pkts.store(itr, Ordering::Relaxed);
            self.stats.itr_changes += 1;
        }
        (a.since, a.packets) = (now, 0);
    }

    /// The interrupt handler: masks the device's interrupt and schedules the poll.
    pub fn interrupt(&mut self) {
        let _c = enter(Class::Interrupt);
        self.stats.irqs += 1;
        self.regs.rxq[0].irq_enabled.store(false, Ordering::Release);
        self.napi = true;
    }

    /// The NAPI poll: up to `budget` received packets handed to `deliver`, and transmit
    /// completions cleaned. When it runs dry it re-enables the interrupt (and keeps the
    /// poll scheduled if a packet slipped in meanwhile). Returns packets received.
    pub fn poll(
        &mut self,
        pool: &mut SkbPool,
        budget: usize,
        mut deliver: impl FnMut(&mut SkbPool, SkbId),
    ) -> usize {
        let _c = enter(Class::Driver);
        self.clean_tx(pool);
        let now = self.lro.as_ref().map_or(0, |l| l.now());
        let mut n = 0;
        while n < budget {
            let i = self.rx_next;
            let d = self.read_desc(&self.rx_ring, i);
            if d.status & DESC_DD == 0 {
                break;
            }
            // The descriptor is read before the data it announces.
            fence(Ordering::Acquire);
            let Some(skb) = self.rx_skbs[i as usize].take() else {
                break;
            };
            let eop = d.status & DESC_EOP != 0;
            if d.status & DESC_ERR != 0 {
                // No data arrived: nothing to hand up, and the buffer goes back as is
                // (with what came of its frame before it).
                if eop {
                    self.stats.rx_errors += 1;
                }
                self.drop_partial(pool, eop);
                self.post_rx(pool, i, skb);
                self.rx_next = (i + 1) % RING_DESCS;
                n += 1;
                continue;
            }
            let fresh = self.rx_alloc(pool);
            match (fresh, self.rx_partial.take()) {
                (Ok(new), Some(Err(()))) => {
                    // The rest of a frame already lost.
                    self.post_rx(pool, i, skb);
                    pool.free(new);
                    self.rx_partial = (!eop).then_some(Err(()));
                }
                (Ok(new), partial) => {
                    let len = (d.len as usize).min(pool.tailroom(skb));
                    let _ = pool.extend_linear(skb, len);
                    self.post_rx(pool, i, new);
                    let pkt = match partial {
                        Some(Ok(first)) => {
                            pool.append_frag_list(first, skb);
                            first
                        }
                        _ => skb,
                    };
                    if !eop {
                        self.rx_partial = Some(Ok(pkt));
                    } else if self.rx_offload(pool, pkt, &d) {
                        self.stats.rx_packets += 1;
                        match self.lro.as_mut() {
                            Some(l) => l.receive(pool, pkt, now, &mut deliver),
                            None => deliver(pool, pkt),
                        }
                    }
                }
                (Err(_), partial) => {
                    // No buffer to replace it: drop the packet, reuse its buffer.
                    self.stats.rx_no_buffer += 1;
                    self.post_rx(pool, i, skb);
                    self.rx_partial = partial;
                    self.drop_partial(pool, eop);
                }
            }
            self.rx_next = (i + 1) % RING_DESCS;
            n += 1;
        }
        if n > 0 {
            self.regs
                .set_rx_tail(0, (self.rx_next + RING_DESCS - 1) % RING_DESCS);
        }
        if let Some(l) = self.lro.as_mut() {
            l.end_poll(pool, &mut deliver);
        }
        // Each poll feeds the moderation, as a Linux driver feeds net_dim from its NAPI
        // poll.
        self.moderate(0, n);
        if n < budget {
            self.napi = false;
            self.regs.rxq[0].irq_enabled.store(true, Ordering::Release);
            // A completion that arrived between the last check and the re-enable
            // raised no interrupt: look once more.
            fence(Ordering::SeqCst);
            if self.read_desc(&self.rx_ring, self.rx_next).status & DESC_DD != 0 {
                self.regs.rxq[0].irq_enabled.store(false, Ordering::Release);
                self.napi = true;
            }
        }
        n
    }

    /// Drops the frame under way (its buffers back to the pool); unless `eop`, its
    /// remaining descriptors are then skipped.
    fn drop_partial(&mut self, pool: &mut SkbPool, eop: bool) {
        if let Some(Ok(p)) = self.rx_partial.take() {
            pool.free(p);
        }
        self.rx_partial = (!eop).then_some(Err(()));
    }

    /// A received frame's offload, from its last descriptor: the device's verified
    /// UDP checksum, or the metadata its write-back carries, checked against the
    /// frame's headers (the device is trusted with the IOMMU's leave only). Returns
    /// false, the frame freed and counted, if the headers do not bear it out.
    fn rx_offload(&mut self, pool: &mut SkbPool, skb: SkbId, d: &Desc) -> bool {
        if d.status & DESC_OFFLOAD == 0 {
            pool.set_csum_valid(skb, d.status & DESC_L4_OK != 0);
            return true;
        }
        let len = pool.len(skb);
        let mut head = [0u8; MAX_HEADERS];
        let h = len.min(MAX_HEADERS);
        let ok = Offload::from_bits(d.addr).filter(|off| {
            pool.read(skb, 0, &mut head[..h]).is_ok()
                && net::offload::validate(off, &head[..h], len).is_ok()
        });
        match ok {
            Some(off) => {
                self.stats.rx_gso += u64::from(off.gso.is_some());
                pool.set_offload(skb, off);
                true
            }
            None => {
                self.stats.rx_bad_offload += 1;
                pool.free(skb);
                false
            }
        }
    }

    /// Frees the buffers of transmitted packets.
    pub fn clean_tx(&mut self, pool: &mut SkbPool) -> usize {
        let mut n = 0;
        while self.tx_clean != self.tx_next {
            let d = self.read_desc(&self.tx_ring, self.tx_clean);
            if d.status & DESC_DD == 0 {
                break;
            }
            if let Some(skb) = self.tx_skbs[self.tx_clean as usize].take() {
                let _m = enter(Class::Mem);
                pool.free(skb);
                self.stats.tx_packets += 1;
            }
            self.tx_clean = (self.tx_clean + 1) % RING_DESCS;
            n += 1;
        }
        n
    }

    /// Transmits a packet: one descriptor per page its bytes lie in. Gives the buffer
    /// back if the ring has no room.
    pub fn xmit(&mut self, pool: &mut SkbPool, skb: SkbId) -> Result<(), SkbId> {
        self.xmit_to(pool, skb, None)
    }

    /// Sends a frame into guest queue `q` through the device's loopback instead of
    /// onto the cable (VMDq's switching between pools): the bridge's frames for a
    /// guest whose buffers the queue holds reach them in the queue's order, the order
    /// its netback answers in. Gives the buffer back if the ring is full.
    pub fn xmit_to_queue(&mut self, pool: &mut SkbPool, skb: SkbId, q: usize) -> Result<(), SkbId> {
        self.xmit_to(pool, skb, Some(q))
    }

    fn xmit_to(&mut self, pool: &mut SkbPool, skb: SkbId, q: Option<usize>) -> Result<(), SkbId> {
        let _c = enter(Class::Driver);
        let len = pool.len(skb);
        let mut segs = 0u32;
        let _ = pool.walk(skb, 0, len, |_, _| {
            segs += 1;
            Ok(())
        });
        // A partial checksum or GSO goes to the device in a context descriptor first.
        let off = pool.offload(skb);
        let ctx = matches!(off.csum, Csum::Partial { .. }) || off.gso.is_some();
        let used = (self.tx_next + RING_DESCS - self.tx_clean) % RING_DESCS;
        if segs == 0 || used + segs + u32::from(ctx) >= RING_DESCS {
            self.stats.tx_ring_full += 1;
            return Err(skb);
        }
        let mut k = 0;
        let mut descs = [Desc::default(); net::skb::MAX_SKB_FRAGS * 2 + 2];
        let _ = pool.walk(skb, 0, len, |seg, _| {
            if k < descs.len() {
                descs[k] = Desc {
                    addr: match seg.page {
                        SegPage::Own(g) => iova_of(g, seg.offset).0,
                        SegPage::Window { slot, .. } => window_iova(slot).0 + seg.offset as u64,
                    },
                    len: seg.len as u16,
                    ..Default::default()
                };
            }
            k += 1;
            Ok(())
        });
        if k > descs.len() {
            self.stats.tx_ring_full += 1;
            return Err(skb);
        }
        if ctx {
            self.write_desc(
                &self.tx_ring,
                self.tx_next,
                &Desc {
                    addr: off.to_bits(),
                    flags: DESC_CTX,
                    ..Default::default()
                },
            );
            self.tx_next = (self.tx_next + 1) % RING_DESCS;
            self.stats.tx_offloaded += 1;
        }
        for (j, d) in descs[..k].iter_mut().enumerate() {
            if let Some(g) = pool_page_of(d.addr) {
                let _ = self.dma_map(g, (d.addr as usize) % PAGE_SIZE, d.len as usize);
            }
            if j + 1 == k {
                d.flags = DESC_EOP;
                if let Some(q) = q {
                    d.flags |= DESC_LOOP;
                    d.pad = q as u16;
                }
            }
            self.write_desc(&self.tx_ring, self.tx_next, d);
            if j + 1 == k {
                self.tx_skbs[self.tx_next as usize] = Some(skb);
            }
            self.tx_next = (self.tx_next + 1) % RING_DESCS;
        }
        // Descriptors before the doorbell.
        fence(Ordering::Release);
        self.regs.ring_tx_doorbell(self.tx_next);
        Ok(())
    }

    /// Opens guest receive queue `q` for frames to `mac` (on `vlan`, or untagged): its
    /// ring, its registers, and a filter entry (the queue's own), with the default
    /// queue's coalescing. No buffer is posted yet ([`NicDriver::vmq_post`]); frames
    /// that come first are dropped and counted on the queue.
    pub fn vmq_open(&mut self, q: usize, mac: [u8; 6], vlan: Option<u16>) -> Result<(), VmqError> {
        if q == 0 || q >= RX_QUEUES {
            return Err(VmqError::NoQueue(q));
        }
        if self.vmq[q].is_some() {
            return Err(VmqError::InUse(q));
        }
        let base = VMQ_RING_IOVA_PFN + (q * RING_PAGES) as u64;
        let ring = alloc_ring(&self.hv, &self.dom, base)?;
        let r = &self.regs.rxq[q];
        r.base.store(base << mem::PAGE_SHIFT, Ordering::Relaxed);
        r.tail.store(0, Ordering::Relaxed);
        r.itr_pkts.store(
            self.regs.rxq[0].itr_pkts.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        r.irq_enabled.store(true, Ordering::Release);
        r.enabled.store(true, Ordering::Release);
        if let Err(e) = self.regs.set_filter(q, mac, vlan, q) {
            self.close_ring(q, &ring);
            return Err(e.into());
        }
        self.vmq[q] = Some(Vmq {
            ring,
            bufs: vec![None; RING_DESCS as usize].into_boxed_slice(),
            next: 0,
            tail: 0,
            napi: false,
        });
        // Moderated as the default queue is.
        if self.adaptive[0].is_some() {
            self.adaptive[q] = Some(self.fresh_adaptive(q));
        }
        Ok(())
    }

    /// The large frames guest queue `q` takes whole (bit `1 << t` for netif GSO type
    /// `t`; its owner answers a buffer chain with netif's extra-info slot at the
    /// context's place); the device cuts others into frames.
    pub fn vmq_set_whole(&mut self, q: usize, gso_types: u32) {
        if self.vmq.get(q).is_some_and(Option::is_some) {
            self.regs.rxq[q].whole.store(gso_types, Ordering::Release);
        }
    }

    /// Buffers guest queue `q` can still take.
    pub fn vmq_room(&self, q: usize) -> usize {
        self.vmq.get(q).and_then(Option::as_ref).map_or(0, |v| {
            // One slot stays empty, so that a full ring is not an empty one.
            (RING_DESCS - 1 - (v.tail + RING_DESCS - v.next) % RING_DESCS) as usize
        })
    }

    /// Posts `buf` in guest queue `q` for the device to fill; gives it back if the
    /// queue is not open or is full.
    pub fn vmq_post(&mut self, q: usize, buf: VmqBuf) -> Result<(), VmqBuf> {
        if self.vmq_room(q) == 0 {
            return Err(buf);
        }
        let Some(v) = self.vmq.get_mut(q).and_then(Option::as_mut) else {
            return Err(buf);
        };
        let i = v.tail;
        v.bufs[i as usize] = Some(buf);
        v.tail = (i + 1) % RING_DESCS;
        let (ring, tail) = (v.ring, v.tail);
        self.write_desc(
            &ring,
            i,
            &Desc {
                addr: buf.iova.0,
                len: buf.len,
                ..Default::default()
            },
        );
        // The descriptor before the tail that hands it over.
        fence(Ordering::Release);
        self.regs.set_rx_tail(q, tail);
        Ok(())
    }

    /// Guest queue `q`'s interrupt handler: masks its interrupt and schedules its poll.
    pub fn vmq_interrupt(&mut self, q: usize) {
        let _c = enter(Class::Interrupt);
        self.stats.irqs += 1;
        if let Some(v) = self.vmq.get_mut(q).and_then(Option::as_mut) {
            self.regs.rxq[q].irq_enabled.store(false, Ordering::Release);
            v.napi = true;
        }
    }

    /// Guest queue `q`'s poll: up to `budget` filled buffers handed to `done` (the
    /// frame is already where the guest will read it), whole frames only (the last may
    /// go past the budget), re-enabling the queue's interrupt when it runs dry.
    /// Returns the buffers handed back.
    pub fn vmq_poll(&mut self, q: usize, budget: usize, mut done: impl FnMut(VmqDone)) -> usize {
        let _c = enter(Class::Driver);
        let Some(ring) = self.vmq.get(q).and_then(Option::as_ref).map(|v| v.ring) else {
            return 0;
        };
        let mut n = 0;
        // Inside a frame (the device writes a frame's descriptors back from its last,
        // so the rest of one begun is done), and whether the next is its context.
        let (mut in_frame, mut context) = (false, false);
        while n < budget || in_frame {
            let Some(v) = self.vmq[q].as_mut() else {
                break;
            };
            let i = v.next;
            if i == v.tail {
                break;
            }
            let d = self.read_desc(&ring, i);
            if d.status & DESC_DD == 0 {
                break;
            }
            // The descriptor is read before the data it announces.
            fence(Ordering::Acquire);
            let Some(v) = self.vmq[q].as_mut() else {
                break;
            };
            let Some(buf) = v.bufs[i as usize].take() else {
                break;
            };
            v.next = (i + 1) % RING_DESCS;
            let (next, tail) = (v.next, v.tail);
            let error = d.status & DESC_ERR != 0;
            let eop = d.status & DESC_EOP != 0;
            let is_context = std::mem::take(&mut context);
            let (mut more, mut offload) = (!eop, None);
            if !error && !is_context && d.status & DESC_CTX_NEXT != 0 && next != tail {
                // A frame taken whole: its offload is in the context after this.
                let c = self.read_desc(&ring, next);
                if c.status & (DESC_DD | DESC_OFFLOAD) == DESC_DD | DESC_OFFLOAD {
                    offload = Offload::from_bits(c.addr);
                    more = c.status & DESC_EOP == 0;
                    context = true;
                }
            }
            if error {
                self.stats.rx_errors += 1;
            } else if !in_frame {
                self.stats.rx_packets += 1;
            }
            in_frame = !eop;
            done(VmqDone {
                token: buf.token,
                len: if error || is_context {
                    0
                } else {
                    d.len.min(buf.len)
                },
                csum_ok: d.status & DESC_L4_OK != 0,
                error,
                more,
                offload,
                context: is_context,
            });
            n += 1;
        }
        self.moderate(q, n);
        if n < budget {
            if let Some(v) = self.vmq[q].as_mut() {
                v.napi = false;
                let (next, tail) = (v.next, v.tail);
                self.regs.rxq[q].irq_enabled.store(true, Ordering::Release);
                // A completion between the last check and the re-enable raised no
                // interrupt: look once more.
                fence(Ordering::SeqCst);
                if next != tail && self.read_desc(&ring, next).status & DESC_DD != 0 {
                    self.regs.rxq[q].irq_enabled.store(false, Ordering::Release);
                    if let Some(v) = self.vmq[q].as_mut() {
                        v.napi = true;
                    }
                }
            }
        }
        n
    }

    /// Whether guest queue `q`'s poll is scheduled.
    pub fn vmq_scheduled(&self, q: usize) -> bool {
        self.vmq
            .get(q)
            .and_then(Option::as_ref)
            .is_some_and(|v| v.napi)
    }

    /// Closes guest queue `q` (its vif went): the filter and the queue off, and once
    /// the device has seen that, every buffer still posted given back by its token
    /// (filled or not: its owner unmaps it and answers the guest), the ring freed.
    pub fn vmq_close(&mut self, q: usize) -> Vec<u32> {
        let Some(v) = self.vmq.get_mut(q).and_then(Option::take) else {
            return Vec::new();
        };
        self.adaptive[q] = None;
        let _ = self.regs.clear_filter(q);
        let r = &self.regs.rxq[q];
        r.enabled.store(false, Ordering::Release);
        r.irq_enabled.store(false, Ordering::Release);
        self.regs.quiesce();
        let tokens = v.bufs.iter().flatten().map(|b| b.token).collect();
        self.close_ring(q, &v.ring);
        tokens
    }

    fn close_ring(&mut self, q: usize, ring: &Ring) {
        let r = &self.regs.rxq[q];
        r.enabled.store(false, Ordering::Release);
        r.base.store(0, Ordering::Release);
        r.tail.store(0, Ordering::Release);
        let base = VMQ_RING_IOVA_PFN + (q * RING_PAGES) as u64;
        for (k, g) in ring.iter().enumerate() {
            let _ = self
                .hv
                .iommu_unmap(&self.dom, Iova((base + k as u64) << mem::PAGE_SHIFT));
            let _ = self.dom.free_page(*g);
        }
    }

    /// Stops the device and frees every buffer the rings hold.
    pub fn shutdown(&mut self, pool: &mut SkbPool) {
        self.regs.enabled.store(false, Ordering::Release);
        self.regs.rxq[0].irq_enabled.store(false, Ordering::Release);
        for s in self.rx_skbs.iter_mut().chain(self.tx_skbs.iter_mut()) {
            if let Some(id) = s.take() {
                pool.free(id);
            }
        }
        if let Some(Ok(p)) = self.rx_partial.take() {
            pool.free(p);
        }
        if let Some(l) = self.lro.as_mut() {
            l.discard(pool);
        }
    }
}

/// A zeroed ring of `RING_PAGES` pages, mapped for the device from I/O page `base` on.
fn alloc_ring(hv: &Hypervisor, dom: &Domain, base: u64) -> Result<Ring, DriverError> {
    let mut r = [Gfn(0); RING_PAGES];
    for (k, g) in r.iter_mut().enumerate() {
        *g = dom.alloc_page().map_err(|_| DriverError::NoMemory)?;
        let _ = dom.fill(*g, 0, PAGE_SIZE, 0);
        hv.iommu_map(dom, Iova((base + k as u64) << mem::PAGE_SHIFT), *g, true)?;
    }
    Ok(r)
}

/// The page of an own-memory I/O address (foreign window pages have none: they were
/// mapped by the hypervisor when granted).
fn pool_page_of(addr: u64) -> Option<Gfn> {
    let pfn = addr >> mem::PAGE_SHIFT;
    (pfn < hv::iommu::WINDOW_IOVA_PFN).then_some(Gfn(pfn as u32))
}
