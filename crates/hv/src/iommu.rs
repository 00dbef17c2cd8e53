//! The IOMMU: device contexts, I/O page tables, the IOTLB, invalidation, and the DMA
//! helpers device models use.
//!
//! * A *context* binds a device (requester id) to a domain. A device without one
//!   faults on every access.
//! * Each domain with devices has a 4-level I/O page table in real machine frames owned
//!   by the hypervisor (like VT-d second-level tables): 512 eight-byte entries per level,
//!   bit 0 read, bit 1 write, bits 12.. the machine frame. A translation miss walks it:
//!   four dependent loads from memory.
//! * The IOTLB caches translations tagged by domain and I/O page number: 1024
//!   direct-mapped entries read lock-free (a sequence counter per entry), filled and
//!   invalidated under one lock so that an invalidation cannot race with a fill that
//!   walked the old table.
//! * Invalidation is global, domain-selective or page-selective, through a *register*
//!   interface (one synchronous operation per invalidation) or a *queued* one
//!   (descriptors written to an invalidation queue in memory, then a wait descriptor
//!   whose status write says the batch is done), as VT-d has both.
//! * Device models call [`DmaContext`]: translate, fault on a missing or read-only
//!   mapping (counted, and recorded in a bounded fault log), and copy. A device's
//!   writes land where the platform modelled puts them ([`DmaLanding`]): in memory,
//!   with non-temporal stores, as from the papers' NICs (the default), or in the cache
//!   hierarchy, as a NIC's writes on a processor with Data Direct I/O.
//!
//! Rule for users, as on hardware: change the page table first, then invalidate; a
//! translation already handed to a device stays valid until the invalidation returns.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mem::{MachineMemory, Mfn, PAGE_SIZE};

use crate::domain::Domain;
use crate::frame::FrameTable;
use crate::types::{DeviceId, DomId, Gfn, Iova};
use crate::Hypervisor;

pub(crate) const PTE_R: u64 = 1;
pub(crate) const PTE_W: u64 = 2;
const PTE_ADDR: u64 = 0x000f_ffff_ffff_f000;
const LEVELS: u32 = 4;
/// Highest I/O page number a 4-level table maps (48-bit IOVA).
pub const MAX_IOVA_PFN: u64 = (1 << 36) - 1;
/// IOTLB entries.
pub const IOTLB_ENTRIES: usize = 1024;
/// Faults kept in the fault log (the fault-recording registers).
pub const FAULT_LOG: usize = 64;
/// Devices (requester ids) the context table covers.
pub const MAX_DEVICES: usize = 256;
/// Invalidation-queue descriptors (one page of 16-byte descriptors, less the last
/// slot, whose bytes hold the wait descriptors' status word).
pub const IQ_ENTRIES: usize = PAGE_SIZE / 16 - 1;

/// First I/O page of the range where a domain's grant maps appear in its IOMMU context.
pub const WINDOW_IOVA_PFN: u64 = 1 << 34;

/// First I/O page of the range where [`Hypervisor::iommu_map_machine_unchecked`] puts
/// every machine frame (the unsafe stand-in's "machine addresses").
pub const MACHINE_IOVA_PFN: u64 = 1 << 35;

/// The I/O address at which the unsafe stand-in reaches machine frame `mfn`.
pub fn machine_iova(mfn: Mfn) -> Iova {
    Iova((MACHINE_IOVA_PFN + u64::from(mfn.0)) << mem::PAGE_SHIFT)
}

/// The I/O address of window slot `slot`'s page.
pub fn window_iova(slot: u32) -> Iova {
    Iova((WINDOW_IOVA_PFN + slot as u64) << mem::PAGE_SHIFT)
}

/// What an invalidation covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvScope {
    /// Everything.
    Global,
    /// Every entry of one domain.
    Domain(DomId),
    /// One I/O page of one domain.
    Page(DomId, Iova),
}

/// Why a DMA access faulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultReason {
    /// The device has no context (not assigned to a domain).
    NoContext,
    /// No mapping for the address.
    NotPresent,
    /// A write to a read-only mapping.
    ReadOnly,
    /// Address beyond the table's reach.
    OutOfRange,
}

/// A DMA fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("DMA fault: device {dev:?} {} {iova:?}: {reason:?}", if *.write { "write" } else { "read" })]
pub struct DmaFault {
    /// The device.
    pub dev: DeviceId,
    /// The address.
    pub iova: Iova,
    /// Whether it was a write.
    pub write: bool,
    /// Why.
    pub reason: FaultReason,
}

/// Why a mapping operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IommuError {
    /// The guest frame is not the domain's.
    #[error("bad guest frame")]
    BadGfn,
    /// The address is beyond the table.
    #[error("iova out of range")]
    OutOfRange,
    /// No frame for a page-table page.
    #[error("out of memory for page tables")]
    OutOfMemory,
    /// No mapping there.
    #[error("not mapped")]
    NotMapped,
    /// Device id beyond the context table.
    #[error("bad device id")]
    BadDevice,
}

/// Invalidation counters (the experiment of paper 004 counts these).
#[derive(Debug, Default)]
pub struct InvalidationStats {
    /// Global invalidations.
    pub global: AtomicU64,
    /// Domain-selective invalidations.
    pub domain: AtomicU64,
    /// Page-selective invalidations.
    pub page: AtomicU64,
    /// Wait descriptors completed (queued interface).
    pub waits: AtomicU64,
}

#[derive(Debug)]
struct TlbEntry {
    seq: AtomicU32,
    /// valid bit 63 | domain << 40 | I/O page number.
    tag: AtomicU64,
    /// mfn << 2 | write << 1 | read.
    data: AtomicU64,
}

#[derive(Debug)]
struct IoTable {
    root: Mfn,
    frames: Vec<Mfn>,
}

#[derive(Debug)]
struct InvQueue {
    frame: Mfn,
    tail: usize,
    /// Where the wait descriptor writes its completion.
    status: u32,
}

/// The IOMMU unit.
#[derive(Debug)]
pub struct Iommu {
    mem: Arc<MachineMemory>,
    /// Where a device context's writes land until it is told otherwise: the
    /// platform's (Data Direct I/O or not).
    landing: DmaLanding,
    /// Per device: valid bit 63 | domain << 32.
    context: Box<[AtomicU64]>,
    tables: Mutex<HashMap<DomId, IoTable>>,
    /// Per domain: the root frame, read by the walk without the table lock.
    roots: Box<[AtomicU64]>,
    tlb: Box<[TlbEntry]>,
    /// Serialises IOTLB fills and invalidations.
    tlb_lock: Mutex<()>,
    queue: Mutex<Option<InvQueue>>,
    faults: AtomicU64,
    fault_log: Mutex<VecDeque<DmaFault>>,
    /// Whether page-selective invalidation is supported (VT-d's `PSI` capability);
    /// without it a page's invalidation covers its whole domain, as Xen falls back.
    page_selective: std::sync::atomic::AtomicBool,
    /// Invalidation counters.
    pub stats: InvalidationStats,
}

fn tag(dom: DomId, pfn: u64) -> u64 {
    1 << 63 | (dom.0 as u64) << 40 | pfn
}

fn tlb_index(dom: DomId, pfn: u64) -> usize {
    ((pfn ^ (pfn >> 10) ^ ((dom.0 as u64) << 5)) as usize) & (IOTLB_ENTRIES - 1)
}

fn level_index(pfn: u64, level: u32) -> usize {
    ((pfn >> (9 * (level - 1))) & 511) as usize
}

impl Iommu {
    pub(crate) fn new(mem: Arc<MachineMemory>, landing: DmaLanding) -> Self {
        Self {
            mem,
            landing,
            context: (0..MAX_DEVICES).map(|_| AtomicU64::new(0)).collect(),
            tables: Mutex::new(HashMap::new()),
            roots: (0..crate::MAX_DOMAINS).map(|_| AtomicU64::new(0)).collect(),
            tlb: (0..IOTLB_ENTRIES)
                .map(|_| TlbEntry {
                    seq: AtomicU32::new(0),
                    tag: AtomicU64::new(0),
                    data: AtomicU64::new(0),
                })
                .collect(),
            tlb_lock: Mutex::new(()),
            queue: Mutex::new(None),
            faults: AtomicU64::new(0),
            fault_log: Mutex::new(VecDeque::new()),
            page_selective: std::sync::atomic::AtomicBool::new(true),
            stats: InvalidationStats::default(),
        }
    }

    /// Binds device `dev` to domain `dom`.
    pub fn attach(&self, dev: DeviceId, dom: DomId) -> Result<(), IommuError> {
        let c = self
            .context
            .get(dev.0 as usize)
            .ok_or(IommuError::BadDevice)?;
        c.store(1 << 63 | (dom.0 as u64) << 32, Ordering::Release);
        Ok(())
    }

    /// Models a unit with or without page-selective invalidation: without, each page's
    /// invalidation empties the domain's whole IOTLB share.
    pub fn set_page_selective(&self, supported: bool) {
        self.page_selective.store(supported, Ordering::Relaxed);
    }

    /// Unbinds a device; its later accesses fault.
    pub fn detach(&self, dev: DeviceId) {
        if let Some(c) = self.context.get(dev.0 as usize) {
            c.store(0, Ordering::Release);
        }
    }

    pub(crate) fn detach_domain(&self, dom: DomId) {
        for c in self.context.iter() {
            let v = c.load(Ordering::Acquire);
            if v >> 63 == 1 && ((v >> 32) & 0xffff) as u16 == dom.0 {
                c.store(0, Ordering::Release);
            }
        }
        self.invalidate_register(InvScope::Domain(dom));
    }

    /// A DMA handle for a device model's thread (owns its counters); its writes land
    /// in memory.
    pub fn device(self: &Arc<Self>, dev: DeviceId) -> DmaContext {
        DmaContext {
            iommu: Arc::clone(self),
            dev,
            landing: self.landing,
            hits: 0,
            misses: 0,
            faults: 0,
        }
    }

    /// All faults so far.
    pub fn fault_count(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }
    /// The most recent faults, oldest first.
    pub fn fault_log(&self) -> Vec<DmaFault> {
        self.fault_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .collect()
    }

    fn record_fault(&self, f: DmaFault) -> DmaFault {
        self.faults.fetch_add(1, Ordering::Relaxed);
        let mut log = self.fault_log.lock().unwrap_or_else(|p| p.into_inner());
        if log.len() == FAULT_LOG {
            log.pop_front();
        }
        log.push_back(f);
        f
    }

    fn pte(&self, table: Mfn, idx: usize) -> Option<&AtomicU64> {
        self.mem.atomic_u64(table, idx * 8).ok()
    }

    /// Walks the I/O page table of `dom` (a miss): returns the leaf entry.
    fn walk(&self, dom: DomId, pfn: u64) -> u64 {
        let root = self
            .roots
            .get(dom.0 as usize)
            .map_or(0, |r| r.load(Ordering::Acquire));
        if root == 0 {
            return 0;
        }
        let mut table = Mfn((root >> 12) as u32);
        for level in (1..=LEVELS).rev() {
            let Some(e) = self.pte(table, level_index(pfn, level)) else {
                return 0;
            };
            let v = e.load(Ordering::Acquire);
            if v & (PTE_R | PTE_W) == 0 {
                return 0;
            }
            if level == 1 {
                return v;
            }
            table = Mfn(((v & PTE_ADDR) >> 12) as u32);
        }
        0
    }

    /// IOTLB lookup: `Some(data)` on a hit.
    #[inline]
    fn tlb_lookup(&self, dom: DomId, pfn: u64) -> Option<u64> {
        let e = &self.tlb[tlb_index(dom, pfn)];
        let s1 = e.seq.load(Ordering::Acquire);
        if s1 & 1 != 0 {
            return None;
        }
        let t = e.tag.load(Ordering::Relaxed);
        let d = e.data.load(Ordering::Relaxed);
        // Acquire fence: the two loads above happen before the re-read of seq, so an
        // unchanged even seq means they saw one consistent write.
        fence(Ordering::Acquire);
        (e.seq.load(Ordering::Relaxed) == s1 && t == tag(dom, pfn)).then_some(d)
    }

    /// Writes an IOTLB entry; caller holds `tlb_lock`.
    fn tlb_write(&self, i: usize, t: u64, d: u64) {
        let e = &self.tlb[i];
        let s = e.seq.load(Ordering::Relaxed);
        e.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        // Release fence: the odd seq is visible before the new contents.
        fence(Ordering::Release);
        e.tag.store(t, Ordering::Relaxed);
        e.data.store(d, Ordering::Relaxed);
        e.seq.store(s.wrapping_add(2), Ordering::Release);
    }

    fn translate(&self, dom: DomId, pfn: u64, hit: &mut bool) -> u64 {
        if let Some(d) = self.tlb_lookup(dom, pfn) {
            *hit = true;
            return d;
        }
        *hit = false;
        let _g = self.tlb_lock.lock().unwrap_or_else(|p| p.into_inner());
        let leaf = self.walk(dom, pfn);
        if leaf & (PTE_R | PTE_W) == 0 {
            return 0;
        }
        let data = ((leaf & PTE_ADDR) >> 12) << 2 | (leaf & (PTE_R | PTE_W));
        self.tlb_write(tlb_index(dom, pfn), tag(dom, pfn), data);
        data
    }

    fn apply(&self, scope: InvScope) {
        match scope {
            InvScope::Global => {
                self.stats.global.fetch_add(1, Ordering::Relaxed);
                for i in 0..IOTLB_ENTRIES {
                    if self.tlb[i].tag.load(Ordering::Relaxed) != 0 {
                        self.tlb_write(i, 0, 0);
                    }
                }
            }
            InvScope::Domain(d) => {
                self.stats.domain.fetch_add(1, Ordering::Relaxed);
                for i in 0..IOTLB_ENTRIES {
                    let t = self.tlb[i].tag.load(Ordering::Relaxed);
                    if t >> 63 == 1 && ((t >> 40) & 0xffff) as u16 == d.0 {
                        self.tlb_write(i, 0, 0);
                    }
                }
            }
            InvScope::Page(d, _) if !self.page_selective.load(Ordering::Relaxed) => {
                self.apply(InvScope::Domain(d));
            }
            InvScope::Page(d, iova) => {
                self.stats.page.fetch_add(1, Ordering::Relaxed);
                let i = tlb_index(d, iova.pfn());
                if self.tlb[i].tag.load(Ordering::Relaxed) == tag(d, iova.pfn()) {
                    self.tlb_write(i, 0, 0);
                }
            }
        }
    }

    /// Register-based invalidation: one synchronous invalidation (write the command
    /// register, wait for completion).
    pub fn invalidate_register(&self, scope: InvScope) {
        let _g = self.tlb_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.apply(scope);
    }

    /// Queued invalidation: writes one descriptor per scope into the invalidation queue
    /// (a page of memory), then a wait descriptor, and returns when the wait's status
    /// write shows the batch done. The queue is drained by the IOMMU as the submitting
    /// thread rings the tail register (this model has no separate IOMMU thread).
    pub fn invalidate_queued(&self, scopes: &[InvScope]) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let Some(q) = q.as_mut() else {
            // No queue set up: fall back to registers.
            scopes.iter().for_each(|s| self.invalidate_register(*s));
            return;
        };
        // A ring of N slots holds N - 1 entries (head == tail is empty): a chunk and
        // its wait descriptor must fit in that.
        for chunk in scopes.chunks(IQ_ENTRIES - 2) {
            let start = q.tail;
            for s in chunk {
                let (ty, did, addr) = match *s {
                    InvScope::Global => (1u64, 0u64, 0u64),
                    InvScope::Domain(d) => (2, d.0 as u64, 0),
                    InvScope::Page(d, a) => (3, d.0 as u64, a.0),
                };
                let desc = [ty | did << 16, addr];
                let _ = self
                    .mem
                    .write(q.frame, q.tail * 16, bytemuck::cast_slice(&desc));
                q.tail = (q.tail + 1) % IQ_ENTRIES;
            }
            q.status = q.status.wrapping_add(1);
            let wait = [4u64 | (q.status as u64) << 16, 0];
            let _ = self
                .mem
                .write(q.frame, q.tail * 16, bytemuck::cast_slice(&wait));
            q.tail = (q.tail + 1) % IQ_ENTRIES;
            // The hardware side: fetch descriptors from memory up to the tail.
            let _g = self.tlb_lock.lock().unwrap_or_else(|p| p.into_inner());
            let mut head = start;
            while head != q.tail {
                let mut raw = [0u64; 2];
                let _ = self
                    .mem
                    .read(q.frame, head * 16, bytemuck::cast_slice_mut(&mut raw));
                head = (head + 1) % IQ_ENTRIES;
                let did = DomId((raw[0] >> 16) as u16);
                match raw[0] & 0xf {
                    1 => self.apply(InvScope::Global),
                    2 => self.apply(InvScope::Domain(did)),
                    3 => self.apply(InvScope::Page(did, Iova(raw[1]))),
                    4 => {
                        // Wait descriptor: write its status word where the waiter polls.
                        if let Ok(st) = self.mem.atomic_u32(q.frame, PAGE_SIZE - 4) {
                            st.store((raw[0] >> 16) as u32, Ordering::Release);
                        }
                        self.stats.waits.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
            // The waiter's poll: done when the status shows our wait.
            debug_assert!(self
                .mem
                .atomic_u32(q.frame, PAGE_SIZE - 4)
                .map_or(true, |s| s.load(Ordering::Acquire) == q.status));
        }
    }

    pub(crate) fn set_entry(
        &self,
        frames: &FrameTable,
        dom: DomId,
        pfn: u64,
        leaf: Option<u64>,
    ) -> Result<Option<u64>, IommuError> {
        if pfn > MAX_IOVA_PFN {
            return Err(IommuError::OutOfRange);
        }
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        let alloc = |v: &mut Vec<Mfn>| -> Result<Mfn, IommuError> {
            let m = frames
                .alloc(DomId::XEN)
                .map_err(|_| IommuError::OutOfMemory)?;
            let _ = self.mem.fill(m, 0, PAGE_SIZE, 0);
            v.push(m);
            Ok(m)
        };
        let t = match tables.get_mut(&dom) {
            Some(t) => t,
            None => {
                if leaf.is_none() {
                    return Err(IommuError::NotMapped);
                }
                let mut v = Vec::new();
                let root = alloc(&mut v)?;
                self.roots[dom.0 as usize]
                    .store(root.byte_offset() | PTE_R | PTE_W, Ordering::Release);
                tables.entry(dom).or_insert(IoTable { root, frames: v })
            }
        };
        let mut table = t.root;
        for level in (2..=LEVELS).rev() {
            let e = self
                .pte(table, level_index(pfn, level))
                .ok_or(IommuError::OutOfRange)?;
            let v = e.load(Ordering::Acquire);
            table = if v & (PTE_R | PTE_W) != 0 {
                Mfn(((v & PTE_ADDR) >> 12) as u32)
            } else {
                if leaf.is_none() {
                    return Err(IommuError::NotMapped);
                }
                let next = alloc(&mut t.frames)?;
                // Release: the zeroed table is visible before the entry that points to it.
                e.store(next.byte_offset() | PTE_R | PTE_W, Ordering::Release);
                next
            };
        }
        let e = self
            .pte(table, level_index(pfn, 1))
            .ok_or(IommuError::OutOfRange)?;
        let old = e.swap(leaf.unwrap_or(0), Ordering::AcqRel);
        Ok((old & (PTE_R | PTE_W) != 0).then_some(old))
    }

    pub(crate) fn setup_queue(&self, frame: Mfn) {
        *self.queue.lock().unwrap_or_else(|p| p.into_inner()) = Some(InvQueue {
            frame,
            tail: 0,
            status: 0,
        });
    }

    pub(crate) fn teardown(&self, frames: &FrameTable, dom: DomId) {
        if let Some(t) = self
            .tables
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&dom)
        {
            self.roots[dom.0 as usize].store(0, Ordering::Release);
            self.invalidate_register(InvScope::Domain(dom));
            let _ = t.root;
            for m in t.frames {
                let _ = frames.free(m);
            }
        }
    }
}

impl Hypervisor {
    /// Maps I/O page `iova` of `dom`'s devices to its guest frame `gfn` (read-only
    /// unless `write`). The domain must own the frame; the page table lives in
    /// hypervisor frames. No invalidation is needed for a new mapping.
    pub fn iommu_map(
        &self,
        dom: &Domain,
        iova: Iova,
        gfn: Gfn,
        write: bool,
    ) -> Result<(), IommuError> {
        let mfn = dom.gfn_to_mfn(gfn).map_err(|_| IommuError::BadGfn)?;
        let leaf = mfn.byte_offset() | PTE_R | if write { PTE_W } else { 0 };
        self.iommu
            .set_entry(&self.frames, dom.id, iova.pfn(), Some(leaf))
            .map(|_| ())
    }

    /// Removes a mapping. The caller must invalidate the IOTLB (page-selective, say)
    /// before reusing the frame, as on hardware.
    pub fn iommu_unmap(&self, dom: &Domain, iova: Iova) -> Result<(), IommuError> {
        match self
            .iommu
            .set_entry(&self.frames, dom.id, iova.pfn(), None)?
        {
            Some(_) => Ok(()),
            None => Err(IommuError::NotMapped),
        }
    }

    /// **Unsafe, for measurement only**: paper 000 §4.4's stand-in for grant reuse, in
    /// which guests put machine addresses on the ring and the driver domain programs
    /// the device with them. Maps every machine frame writable into `dom`'s IOMMU
    /// context at [`machine_iova`], once: from then on `dom`'s devices reach any frame
    /// of any domain, with no grant, no ownership check and no reference held. pvio's
    /// safe configurations never call it; the lab's `pv-mq-unsafe` does, and says so.
    pub fn iommu_map_machine_unchecked(&self, dom: &Domain) -> Result<(), IommuError> {
        for m in 0..self.frames.total() {
            let mfn = Mfn(m);
            let leaf = mfn.byte_offset() | PTE_R | PTE_W;
            self.iommu
                .set_entry(&self.frames, dom.id, machine_iova(mfn).pfn(), Some(leaf))?;
        }
        Ok(())
    }

    /// Binds a device to a domain. From now on the domain's grant maps also enter its
    /// IOMMU context, at [`window_iova`] of their window slot, as Xen adds a grant
    /// mapping to the IOMMU of a domain with an assigned device.
    pub fn iommu_attach(&self, dev: DeviceId, dom: &Domain) -> Result<(), IommuError> {
        dom.iommu_grants
            .store(true, std::sync::atomic::Ordering::Release);
        self.iommu.attach(dev, dom.id)
    }

    /// Puts a granted frame just mapped at window `slot` into `dom`'s IOMMU context.
    pub(crate) fn iommu_map_grant(
        &self,
        dom: &Domain,
        slot: u32,
        mfn: Mfn,
        write: bool,
    ) -> Result<(), IommuError> {
        if !dom.iommu_grants.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let leaf = mfn.byte_offset() | PTE_R | if write { PTE_W } else { 0 };
        self.iommu
            .set_entry(&self.frames, dom.id, window_iova(slot).pfn(), Some(leaf))
            .map(|_| ())
    }

    /// Takes a grant mapping out of `dom`'s IOMMU context and flushes its IOTLB entry
    /// (the flush every grant unmap costs a domain with a device, paper 004's subject).
    pub(crate) fn iommu_unmap_grant(&self, dom: &Domain, slot: u32) {
        if !dom.iommu_grants.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let iova = window_iova(slot);
        if let Ok(Some(_)) = self.iommu.set_entry(&self.frames, dom.id, iova.pfn(), None) {
            self.iommu.invalidate_register(InvScope::Page(dom.id, iova));
        }
    }

    pub(crate) fn iommu_setup(&self) -> Result<(), crate::HvError> {
        let f = self
            .frames
            .alloc(DomId::XEN)
            .map_err(|_| crate::HvError::OutOfMemory)?;
        self.iommu.setup_queue(f);
        Ok(())
    }

    pub(crate) fn iommu_teardown(&self, dom: DomId) {
        self.iommu.teardown(&self.frames, dom);
    }
}

/// A device model's DMA handle: translates through the IOMMU and moves data. Owned by
/// one device thread, so its counters are plain fields.
#[derive(Debug)]
pub struct DmaContext {
    iommu: Arc<Iommu>,
    dev: DeviceId,
    landing: DmaLanding,
    /// IOTLB hits.
    pub hits: u64,
    /// IOTLB misses (page walks).
    pub misses: u64,
    /// Faults raised by this device.
    pub faults: u64,
}

/// Where a device's DMA writes land.
///
/// The papers' NICs (2008) wrote to memory: the driver that reads a frame takes a cache
/// miss on every line, and a device model stands in with non-temporal stores. Since
/// Intel's Data Direct I/O (2012) a NIC's writes allocate into the last-level cache
/// instead, and the frame is found there; a device model stands in with ordinary
/// stores, which leave the lines in its core's caches for the reader to take. The
/// stand-in for memory is dearer on the device model's core than the DMA it stands in
/// for (about 100 ns for a 64-byte frame on this machine, with its fence and the line
/// flushed through the write-combining buffers), so where a device model shares a core
/// with a domain its landing is chosen, and said, by the experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DmaLanding {
    /// In memory, not in any cache (non-temporal stores): the papers' hardware.
    #[default]
    Memory,
    /// In the cache hierarchy (ordinary stores): a NIC with Data Direct I/O.
    Cache,
}

impl DmaLanding {
    /// The name a machine file and the command line give it.
    pub fn name(self) -> &'static str {
        match self {
            DmaLanding::Memory => "memory",
            DmaLanding::Cache => "cache",
        }
    }

    /// Parses [`DmaLanding::name`]'s spellings.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "memory" => Ok(DmaLanding::Memory),
            "cache" => Ok(DmaLanding::Cache),
            _ => Err(format!("DMA landing {s:?}: memory or cache")),
        }
    }
}

impl DmaContext {
    /// The device.
    pub fn device_id(&self) -> DeviceId {
        self.dev
    }

    /// Where this device's writes land from now on.
    pub fn land_in(&mut self, landing: DmaLanding) {
        self.landing = landing;
    }

    /// Where this device's writes land.
    pub fn landing(&self) -> DmaLanding {
        self.landing
    }

    /// Translates `iova` for a read or a write: the machine frame, or a fault.
    #[inline]
    pub fn translate(&mut self, iova: Iova, write: bool) -> Result<Mfn, DmaFault> {
        let fault = |reason| DmaFault {
            dev: self.dev,
            iova,
            write,
            reason,
        };
        let ctx = self.iommu.context[self.dev.0 as usize % MAX_DEVICES].load(Ordering::Acquire);
        if ctx >> 63 == 0 {
            self.faults += 1;
            return Err(self.iommu.record_fault(fault(FaultReason::NoContext)));
        }
        if iova.pfn() > MAX_IOVA_PFN {
            self.faults += 1;
            return Err(self.iommu.record_fault(fault(FaultReason::OutOfRange)));
        }
        let dom = DomId((ctx >> 32) as u16);
        let mut hit = false;
        let d = self.iommu.translate(dom, iova.pfn(), &mut hit);
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        if d & (PTE_R | PTE_W) == 0 {
            self.faults += 1;
            return Err(self.iommu.record_fault(fault(FaultReason::NotPresent)));
        }
        if write && d & PTE_W == 0 {
            self.faults += 1;
            return Err(self.iommu.record_fault(fault(FaultReason::ReadOnly)));
        }
        Ok(Mfn((d >> 2) as u32))
    }

    /// Writes `data` at `iova` as a device would: page by page through the IOMMU, landing
    /// where [`DmaContext::landing`] says. Stops at the first fault (bytes before it are
    /// written).
    pub fn dma_write(&mut self, iova: Iova, data: &[u8]) -> Result<(), DmaFault> {
        let mut done = 0;
        while done < data.len() {
            let at = Iova(iova.0 + done as u64);
            let off = at.page_offset();
            let n = (PAGE_SIZE - off).min(data.len() - done);
            let mfn = self.translate(at, true)?;
            // Cannot fail: off + n <= PAGE_SIZE and the frame exists (it is in a table).
            let _ = match self.landing {
                DmaLanding::Memory => self.iommu.mem.write_nt(mfn, off, &data[done..done + n]),
                DmaLanding::Cache => self.iommu.mem.write(mfn, off, &data[done..done + n]),
            };
            done += n;
        }
        Ok(())
    }

    /// Hands a 16-byte descriptor back as a device does: its first 8 bytes (the
    /// buffer's address, or what a write-back puts there), then its last 8 (length,
    /// status, flags) in one store that is visible only after the first, so a driver
    /// that loads the status word and finds it done finds the length written with it.
    /// A string move of all 16 bytes promises no order among them. A descriptor not on
    /// a 16-byte boundary (a ring base a device would refuse) is written as bytes.
    pub fn dma_write_back(&mut self, iova: Iova, desc: &[u8; 16]) -> Result<(), DmaFault> {
        if !iova.0.is_multiple_of(16) {
            return self.dma_write(iova, desc);
        }
        // A 16-byte-aligned descriptor lies in one page.
        let mfn = self.translate(iova, true)?;
        let off = iova.page_offset();
        let (head, last) = desc.split_at(8);
        let last = u64::from_le_bytes(last.try_into().unwrap_or([0; 8]));
        let stream = self.landing == DmaLanding::Memory;
        // Cannot fail: the frame exists and `off + 16 <= PAGE_SIZE`, 8-aligned.
        let _ = if stream {
            self.iommu.mem.write_nt(mfn, off, head)
        } else {
            self.iommu.mem.write(mfn, off, head)
        };
        let _ = self.iommu.mem.publish_u64(mfn, off + 8, last, stream);
        Ok(())
    }

    /// Reads `buf.len()` bytes at `iova` as a device would.
    pub fn dma_read(&mut self, iova: Iova, buf: &mut [u8]) -> Result<(), DmaFault> {
        let mut done = 0;
        while done < buf.len() {
            let at = Iova(iova.0 + done as u64);
            let off = at.page_offset();
            let n = (PAGE_SIZE - off).min(buf.len() - done);
            let mfn = self.translate(at, false)?;
            let _ = self.iommu.mem.read(mfn, off, &mut buf[done..done + n]);
            done += n;
        }
        Ok(())
    }
}
