//! The PV memory manager: guest page tables in the guest's own frames, validated by the
//! hypervisor, and the IOMMU kept in step with page types (paper 004).
//!
//! A PV guest builds its page tables itself, in x86-64's shape: four levels of 512
//! eight-byte entries, an entry holding a machine frame number and its flags (present,
//! writable, user, ...). It writes a fresh table while the page is still an ordinary
//! writable page, then *pins* it (`MMUEXT_PIN_Ln_TABLE`): the hypervisor copies the
//! entries out, validates every present one, takes a reference on each frame they name
//! and gives the page its page-table type. From then on the guest's own writes to the
//! page are refused (its kernel mapping of it is read-only); changes go through
//! [`Hypervisor::mmu_update`], which validates each new entry and swaps it in.
//! `MMUEXT_NEW_BASEPTR` installs a level-4 table as a vCPU's address space, and a
//! software walker ([`Hypervisor::pv_translate`]) translates through it as the MMU would.
//!
//! The rules validation enforces, each the subject of one of Xen's PV advisories:
//! * an entry names only a frame of the domain itself (never another domain's, never
//!   the hypervisor's), and never sets reserved or superpage bits;
//! * a writable level-1 entry takes the *writable* type on its frame, and a page-table
//!   page has the page-table type: the two exclude each other, so no page table is
//!   ever mapped writable;
//! * an upper entry takes the type of the level below on the table it names, so a
//!   table cannot appear at two levels or refer to itself (a linear page table);
//! * the level-4 slots the hypervisor keeps for itself are not the guest's to fill;
//! * a table in use (a vCPU's base, or referenced by another) cannot be unpinned or
//!   handed back as writable; counts never wrap; a validation that fails halfway
//!   drops every reference it took, so the counts are as they were.
//!
//! The IOMMU. For a domain whose devices reach its memory through an IOMMU context
//! ([`MmuConfig::iommu_sync`]: a direct-I/O guest, or a driver domain in Xen's strict
//! mode), every page of the domain is mapped for DMA, except page tables: a device
//! that could write a page table would undo all of the above. So a frame whose type
//! changes from writable to page table is unmapped from the I/O page table and its
//! IOTLB entry invalidated (page-selective, through the queued interface), and mapped
//! back when it becomes writable again (Xen's `_get_page_type` → `iommu_legacy_unmap` /
//! `map`). When the invalidation is issued is the [`FlushPolicy`]. That every process
//! creation and exit changes page types, and so flushes the IOTLB of every device the
//! domain drives, is paper 004's finding; its fix, keeping freed page-table pages in
//! the guest so that their type never changes, lives in the guest kernel.
//!
//! One lock per domain serialises its MMU operations (Xen locks per page); the walker
//! takes none. The I/O address of a domain's page is its guest frame number, as for
//! the pages pvio's drivers give their devices (Xen's PV domains use the machine frame).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::domain::Domain;
use crate::frame::{FrameError, PageType};
use crate::iommu::InvScope;
use crate::types::{Gfn, Iova, Mfn};
use crate::Hypervisor;

/// Present.
pub const PTE_P: u64 = 1 << 0;
/// Writable.
pub const PTE_RW: u64 = 1 << 1;
/// User-accessible.
pub const PTE_US: u64 = 1 << 2;
/// Accessed.
pub const PTE_A: u64 = 1 << 5;
/// Dirty.
pub const PTE_D: u64 = 1 << 6;
/// Page size (a superpage at level 2 or 3): not allowed to a PV guest here.
pub const PTE_PS: u64 = 1 << 7;
/// Global.
pub const PTE_G: u64 = 1 << 8;
/// No-execute.
pub const PTE_NX: u64 = 1 << 63;
/// The frame-address bits.
pub const PTE_ADDR: u64 = 0x000f_ffff_ffff_f000;
/// Bits 9–11, free for the guest's own use.
const PTE_AVAIL: u64 = 0x7 << 9;
/// Cache-control bits (write-through, cache-disable).
const PTE_CACHE: u64 = 0x3 << 3;
/// What a level-1 entry may set besides the address.
const L1_FLAGS: u64 =
    PTE_P | PTE_RW | PTE_US | PTE_CACHE | PTE_A | PTE_D | PTE_G | PTE_NX | PTE_AVAIL;
/// What an upper entry may set (no superpages).
const LN_FLAGS: u64 = PTE_P | PTE_RW | PTE_US | PTE_CACHE | PTE_A | PTE_NX | PTE_AVAIL;

/// Entries per table.
pub const ENTRIES: usize = 512;
/// Level-4 slots the hypervisor keeps for its own mappings (x86-64 Xen's 256–271).
pub const XEN_L4_SLOTS: std::ops::Range<usize> = 256..272;
/// Highest user address plus one (the lower half of a 48-bit address space).
pub const USER_TOP: u64 = 1 << 47;

/// An entry naming `mfn` with `flags`.
pub const fn pte(mfn: Mfn, flags: u64) -> u64 {
    mfn.byte_offset() | flags
}

/// The frame an entry names.
pub const fn pte_mfn(e: u64) -> Mfn {
    Mfn(((e & PTE_ADDR) >> 12) as u32)
}

/// The index into a level-`level` table that translates `va`.
pub const fn va_index(va: u64, level: u8) -> usize {
    ((va >> (12 + 9 * (level as u32 - 1))) & 511) as usize
}

/// When the IOTLB invalidation for a page that became a page table is issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushPolicy {
    /// At once, one invalidation and wait per type change (Xen's default).
    Strict,
    /// Once per hypercall: the invalidations a batch of updates causes go in one
    /// queued submission with one wait (Xen's `iommu_dont_flush_iotlb` around a batch).
    Batched,
    /// Deferred to a flush queue, drained when it holds `entries` pages or its oldest
    /// is `timeout` old (Linux's non-strict IOMMU mode: 256 entries, 10 ms). Until the
    /// drain a device that cached the old translation can still write the page, which
    /// by then is a page table: the window [`MmuStats`] measures.
    Lazy {
        /// Pages queued before a drain.
        entries: usize,
        /// Age of the oldest queued page that forces a drain.
        timeout: Duration,
    },
}

/// How a domain's memory manager treats the IOMMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmuConfig {
    /// Keep the domain's IOMMU context in step with page types (every page mapped
    /// for DMA but its page tables).
    pub iommu_sync: bool,
    /// When invalidations are issued.
    pub flush: FlushPolicy,
    /// Also unmap and map again when a page-table page changes level (Xen before
    /// 4.14 did IOMMU work on every type change; since, only on changes to or from
    /// writable, which lets one pool serve every level).
    pub remap_on_level_change: bool,
}

impl Default for MmuConfig {
    fn default() -> Self {
        Self {
            iommu_sync: false,
            flush: FlushPolicy::Strict,
            remap_on_level_change: false,
        }
    }
}

/// An extended MMU operation (`struct mmuext_op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmuExtOp {
    /// `MMUEXT_PIN_Ln_TABLE`: validate the table at `mfn` as level `level` (1–4) and
    /// hold it at that type until unpinned.
    Pin {
        /// 1 to 4.
        level: u8,
        /// The table.
        mfn: Mfn,
    },
    /// `MMUEXT_UNPIN_TABLE`.
    Unpin(Mfn),
    /// `MMUEXT_NEW_BASEPTR`: the level-4 table `vcpu` translates through from now on
    /// (`None`: none, the kernel's own context only).
    NewBaseptr {
        /// Which vCPU.
        vcpu: u32,
        /// The level-4 table.
        mfn: Option<Mfn>,
    },
    /// The guest kernel's own mapping of a page made writable again (in Xen an
    /// `update_va_mapping` of that mapping with the writable bit): the page takes the
    /// writable type, so a former page table changes type and returns to the IOMMU.
    /// Refused while the page is pinned or referenced.
    MakeWritable(Mfn),
}

/// One page-table update (`struct mmu_update`, `MMU_NORMAL_PT_UPDATE`): write `val`
/// into the entry at machine address `ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmuUpdate {
    /// Machine address of the entry: the table's frame and the entry's byte offset.
    pub ptr: u64,
    /// The new entry.
    pub val: u64,
}

impl MmuUpdate {
    /// Entry `index` of the table at `table` becomes `val`.
    pub const fn new(table: Mfn, index: usize, val: u64) -> Self {
        Self {
            ptr: table.byte_offset() + (index as u64) * 8,
            val,
        }
    }
}

/// Why an MMU operation was refused. Each has its own counter in [`MmuStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MmuError {
    /// The frame is not this domain's (another domain's, or the hypervisor's).
    #[error("frame is not the domain's")]
    NotOwner,
    /// The frame number is beyond machine memory.
    #[error("no such frame")]
    NoSuchFrame,
    /// A level outside 1–4.
    #[error("bad page-table level")]
    BadLevel,
    /// The frame is in use as another type (a page table mapped writable, a table at
    /// two levels, a table referring to itself).
    #[error("frame is in use as another type")]
    TypeConflict,
    /// Reserved, superpage or address bits beyond memory set in an entry.
    #[error("reserved bits in entry")]
    BadFlags,
    /// A level-4 slot the hypervisor keeps.
    #[error("hypervisor slot")]
    HypervisorSlot,
    /// An update's address is not an entry's.
    #[error("misaligned entry address")]
    Misaligned,
    /// Unpin of a table that is not pinned.
    #[error("not pinned")]
    NotPinned,
    /// Pin of a table already pinned.
    #[error("already pinned")]
    AlreadyPinned,
    /// The table is in use: a vCPU's base, or pinned or referenced when asked back
    /// as writable.
    #[error("table in use")]
    Busy,
    /// A count would overflow.
    #[error("count overflow")]
    Overflow,
    /// No such vCPU.
    #[error("bad vcpu")]
    BadVcpu,
    /// The domain is being destroyed.
    #[error("domain is dying")]
    Dying,
    /// The IOMMU had no frame for its own page table.
    #[error("out of memory for I/O page tables")]
    NoMemory,
}

impl MmuError {
    /// Number of reasons.
    pub const REASONS: usize = 14;
    /// Every reason, in counter order.
    pub const ALL: [MmuError; Self::REASONS] = [
        MmuError::NotOwner,
        MmuError::NoSuchFrame,
        MmuError::BadLevel,
        MmuError::TypeConflict,
        MmuError::BadFlags,
        MmuError::HypervisorSlot,
        MmuError::Misaligned,
        MmuError::NotPinned,
        MmuError::AlreadyPinned,
        MmuError::Busy,
        MmuError::Overflow,
        MmuError::BadVcpu,
        MmuError::Dying,
        MmuError::NoMemory,
    ];
    /// This reason's counter.
    pub fn index(self) -> usize {
        Self::ALL.iter().position(|&e| e == self).unwrap_or(0)
    }
}

impl From<FrameError> for MmuError {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::NoSuchFrame => MmuError::NoSuchFrame,
            FrameError::WrongOwner => MmuError::NotOwner,
            FrameError::TypeConflict | FrameError::Referenced => MmuError::TypeConflict,
            FrameError::Overflow => MmuError::Overflow,
            FrameError::OutOfMemory => MmuError::NoMemory,
        }
    }
}

/// A refused batch: the operations before `done` took effect, the one at `done` was
/// refused with `error`, and those after it were not tried (Xen's `pdone`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("operation {done} of the batch: {error}")]
pub struct BatchError {
    /// Operations completed.
    pub done: usize,
    /// Why the next was refused.
    pub error: MmuError,
}

/// Why the walker could not translate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The vCPU has no base table.
    NoBase,
    /// Beyond the user half.
    NonCanonical,
    /// An entry on the way is not present.
    NotPresent,
    /// A write through an entry without the writable bit.
    Protection,
    /// The walk reached a frame that is not the domain's, or wrote a page table:
    /// impossible through validated tables, so counted apart as a broken invariant.
    Guard,
}

/// A page fault from the walker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("page fault at {va:#x} ({}) at level {level}: {kind:?}", if *.write { "write" } else { "read" })]
pub struct PageFault {
    /// The address.
    pub va: u64,
    /// Whether it was a write.
    pub write: bool,
    /// The level whose entry failed (0 for the leaf frame).
    pub level: u8,
    /// Why.
    pub kind: FaultKind,
}

/// A domain's memory-manager counters.
#[derive(Debug, Default)]
pub struct MmuStats {
    /// Tables pinned.
    pub pins: AtomicU64,
    /// Tables unpinned.
    pub unpins: AtomicU64,
    /// Entries updated through `mmu_update`.
    pub updates: AtomicU64,
    /// Present entries validated (pins, revalidations and updates).
    pub entries_validated: AtomicU64,
    /// Frames that changed type to a page table.
    pub to_page_table: AtomicU64,
    /// Frames that changed from a page table back to writable.
    pub to_writable: AtomicU64,
    /// Pages taken out of the domain's IOMMU context.
    pub iommu_unmaps: AtomicU64,
    /// Pages put back.
    pub iommu_maps: AtomicU64,
    /// Pages that could not be put back (left out of the context).
    pub iommu_map_failures: AtomicU64,
    /// Page-selective invalidations issued for page-table type changes.
    pub pt_invalidations: AtomicU64,
    /// Waits for them (one per strict change, one per batch, one per lazy drain).
    pub pt_flush_waits: AtomicU64,
    /// Lazy mode: longest time a page was a page table while the IOTLB could still
    /// hold its old writable translation, ns.
    pub lazy_window_max_ns: AtomicU64,
    /// Lazy mode: the sum of those windows, ns.
    pub lazy_window_sum_ns: AtomicU64,
    /// Walker translations.
    pub walks: AtomicU64,
    /// Walks that found a broken invariant (must stay zero).
    pub walk_guard: AtomicU64,
    errors: [AtomicU64; MmuError::REASONS],
}

impl MmuStats {
    /// Refusals for `e`.
    pub fn errors(&self, e: MmuError) -> u64 {
        self.errors[e.index()].load(Ordering::Relaxed)
    }
    /// All refusals.
    pub fn errors_total(&self) -> u64 {
        self.errors.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

#[derive(Debug)]
struct MmuState {
    cfg: MmuConfig,
    /// Per guest frame: pinned.
    pinned: Vec<bool>,
    pinned_count: usize,
    /// Batched policy: I/O pages waiting for the end of the hypercall.
    pending: Vec<InvScope>,
    /// Lazy policy: I/O pages unmapped and when.
    lazy: VecDeque<(InvScope, Instant)>,
}

/// A domain's memory-manager state.
#[derive(Debug)]
pub(crate) struct PvMmu {
    state: Mutex<MmuState>,
    /// Per vCPU: its level-4 table's frame + 1, 0 for none.
    base: Box<[AtomicU64]>,
    pub(crate) stats: MmuStats,
}

impl PvMmu {
    pub(crate) fn new(vcpus: u32, pages: u32) -> Self {
        Self {
            state: Mutex::new(MmuState {
                cfg: MmuConfig::default(),
                pinned: vec![false; pages as usize],
                pinned_count: 0,
                pending: Vec::new(),
                lazy: VecDeque::new(),
            }),
            base: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            stats: MmuStats::default(),
        }
    }
}

/// One hypercall's work on one domain, holding its MMU lock.
struct Op<'a> {
    hv: &'a Hypervisor,
    dom: &'a Domain,
    st: &'a mut MmuState,
}

fn level_of(t: PageType) -> Option<u8> {
    match t {
        PageType::PageTable(l) => Some(l),
        _ => None,
    }
}

impl Op<'_> {
    fn stats(&self) -> &MmuStats {
        &self.dom.mmu.stats
    }

    fn gfn(&self, mfn: Mfn) -> Result<Gfn, MmuError> {
        match self.hv.frames.owner(mfn) {
            _ if mfn.0 >= self.hv.frames.total() => Err(MmuError::NoSuchFrame),
            Some(o) if o == self.dom.id => self.hv.frames.m2p(mfn).ok_or(MmuError::NotOwner),
            _ => Err(MmuError::NotOwner),
        }
    }

    fn get_page(&self, mfn: Mfn) -> Result<(), MmuError> {
        if mfn.0 >= self.hv.frames.total() {
            return Err(MmuError::NoSuchFrame);
        }
        Ok(self.hv.frames.get_page(mfn, self.dom.id)?)
    }

    /// Takes a type reference; a page table taken at count zero is validated first,
    /// and a change of type is carried to the IOMMU.
    fn get_type(&mut self, mfn: Mfn, ty: PageType) -> Result<(), MmuError> {
        let count = self.hv.frames.page_type(mfn).1;
        let changed = self.hv.frames.get_page_type_from(mfn, ty)?;
        // Under the domain's lock no other page-table reference to this domain's frame
        // can be taken, so a count read as zero before is the count we moved from.
        let was = changed.unwrap_or(ty);
        if let (Some(level), 0) = (level_of(ty), count) {
            if let Err(e) = self.validate(mfn, level) {
                if !self.hv.frames.restore_type(mfn, ty, was) {
                    self.hv.frames.put_page_type(mfn);
                }
                return Err(e);
            }
        }
        if changed.is_some() {
            self.sync(mfn, was, ty);
        }
        Ok(())
    }

    /// Drops a type reference; the last reference to a page table first drops the
    /// references its entries hold (Xen's `free_page_type`, done while the count is
    /// still one so that nothing retypes the frame meanwhile).
    fn put_type(&mut self, mfn: Mfn) {
        let (t, c) = self.hv.frames.page_type(mfn);
        if let (Some(level), 1) = (level_of(t), c) {
            self.devalidate(mfn, level);
        }
        self.hv.frames.put_page_type(mfn);
    }

    fn read_table(&self, mfn: Mfn) -> [u64; ENTRIES] {
        let mut t = [0u64; ENTRIES];
        let _ = self.hv.mem.read(mfn, 0, bytemuck::cast_slice_mut(&mut t));
        t
    }

    /// Validates a table's entries from a copy, taking each one's references; on a bad
    /// entry drops those taken so far.
    fn validate(&mut self, mfn: Mfn, level: u8) -> Result<(), MmuError> {
        let t = self.read_table(mfn);
        for (i, &e) in t.iter().enumerate() {
            if e & PTE_P == 0 {
                continue;
            }
            let r = if level == 4 && XEN_L4_SLOTS.contains(&i) {
                Err(MmuError::HypervisorSlot)
            } else {
                self.get_entry(e, level)
            };
            if let Err(err) = r {
                for &prev in &t[..i] {
                    self.put_entry(prev, level);
                }
                return Err(err);
            }
        }
        Ok(())
    }

    fn devalidate(&mut self, mfn: Mfn, level: u8) {
        let t = self.read_table(mfn);
        for &e in &t {
            self.put_entry(e, level);
        }
    }

    /// The references a present entry at `level` holds (Xen's `get_page_from_lNe`).
    fn get_entry(&mut self, e: u64, level: u8) -> Result<(), MmuError> {
        let allowed = if level == 1 { L1_FLAGS } else { LN_FLAGS };
        if e & !(allowed | PTE_ADDR) != 0 {
            return Err(MmuError::BadFlags);
        }
        if (e & PTE_ADDR) >> 12 > u32::MAX as u64 {
            return Err(MmuError::NoSuchFrame);
        }
        self.stats()
            .entries_validated
            .fetch_add(1, Ordering::Relaxed);
        let target = pte_mfn(e);
        self.get_page(target)?;
        let ty = match level {
            1 if e & PTE_RW != 0 => Some(PageType::Writable),
            1 => None,
            l => Some(PageType::PageTable(l - 1)),
        };
        if let Some(ty) = ty {
            if let Err(err) = self.get_type(target, ty) {
                self.hv.frames.put_page(target);
                return Err(err);
            }
        }
        Ok(())
    }

    fn put_entry(&mut self, e: u64, level: u8) {
        if e & PTE_P == 0 {
            return;
        }
        let target = pte_mfn(e);
        if level > 1 {
            self.put_type(target);
        } else if e & PTE_RW != 0 {
            self.hv.frames.put_page_type(target);
        }
        self.hv.frames.put_page(target);
    }

    /// Carries a type change to the IOMMU. A page that cannot be mapped back (the
    /// IOMMU out of frames for its own tables) stays out of the context: the safe side,
    /// counted apart.
    fn sync(&mut self, mfn: Mfn, was: PageType, now: PageType) {
        let (was_pt, now_pt) = (level_of(was).is_some(), level_of(now).is_some());
        if was_pt != now_pt {
            let s = self.stats();
            if now_pt {
                s.to_page_table.fetch_add(1, Ordering::Relaxed);
            } else {
                s.to_writable.fetch_add(1, Ordering::Relaxed);
            }
        }
        if !self.st.cfg.iommu_sync {
            return;
        }
        let remap = was_pt && now_pt && self.st.cfg.remap_on_level_change;
        let Some(gfn) = self.hv.frames.m2p(mfn) else {
            return;
        };
        let pfn = gfn.0 as u64;
        let iommu = &self.hv.iommu;
        if (was_pt && !now_pt) || remap {
            let leaf = mfn.byte_offset() | crate::iommu::PTE_R | crate::iommu::PTE_W;
            match iommu.set_entry(&self.hv.frames, self.dom.id, pfn, Some(leaf)) {
                Ok(_) => self.stats().iommu_maps.fetch_add(1, Ordering::Relaxed),
                Err(_) => self
                    .stats()
                    .iommu_map_failures
                    .fetch_add(1, Ordering::Relaxed),
            };
        }
        if (now_pt && !was_pt) || remap {
            let _ = iommu.set_entry(&self.hv.frames, self.dom.id, pfn, None);
            self.stats().iommu_unmaps.fetch_add(1, Ordering::Relaxed);
            let scope = InvScope::Page(self.dom.id, Iova(pfn << mem::PAGE_SHIFT));
            match self.st.cfg.flush {
                FlushPolicy::Strict => self.invalidate(&[scope]),
                FlushPolicy::Batched => self.st.pending.push(scope),
                FlushPolicy::Lazy { .. } => self.st.lazy.push_back((scope, Instant::now())),
            }
        }
    }

    fn invalidate(&self, scopes: &[InvScope]) {
        if scopes.is_empty() {
            return;
        }
        self.hv.iommu.invalidate_queued(scopes);
        let s = self.stats();
        s.pt_invalidations
            .fetch_add(scopes.len() as u64, Ordering::Relaxed);
        s.pt_flush_waits.fetch_add(1, Ordering::Relaxed);
    }

    /// End of a hypercall: the batch's invalidations, and a lazy drain if one is due.
    fn finish(&mut self) {
        let pending = std::mem::take(&mut self.st.pending);
        self.invalidate(&pending);
        self.st.pending = pending;
        self.st.pending.clear();
        self.drain_lazy(false);
    }

    fn drain_lazy(&mut self, force: bool) {
        let FlushPolicy::Lazy { entries, timeout } = self.st.cfg.flush else {
            return;
        };
        let due =
            self.st.lazy.front().is_some_and(|(_, t)| {
                force || self.st.lazy.len() >= entries || t.elapsed() >= timeout
            });
        if !due {
            return;
        }
        let scopes: Vec<InvScope> = self.st.lazy.iter().map(|(s, _)| *s).collect();
        self.invalidate(&scopes);
        let now = Instant::now();
        let s = &self.dom.mmu.stats;
        for (_, t) in self.st.lazy.drain(..) {
            let w = now.duration_since(t).as_nanos() as u64;
            s.lazy_window_sum_ns.fetch_add(w, Ordering::Relaxed);
            s.lazy_window_max_ns.fetch_max(w, Ordering::Relaxed);
        }
    }

    fn is_base(&self, mfn: Mfn) -> bool {
        let v = mfn.0 as u64 + 1;
        self.dom
            .mmu
            .base
            .iter()
            .any(|b| b.load(Ordering::Relaxed) == v)
    }

    fn update(&mut self, u: MmuUpdate) -> Result<(), MmuError> {
        if !u.ptr.is_multiple_of(8) {
            return Err(MmuError::Misaligned);
        }
        if u.ptr >> 12 > u32::MAX as u64 {
            return Err(MmuError::NoSuchFrame);
        }
        let table = Mfn((u.ptr >> 12) as u32);
        let off = (u.ptr & 0xfff) as usize;
        self.gfn(table)?;
        let (t, c) = self.hv.frames.page_type(table);
        let level = match (level_of(t), c) {
            (Some(l), 1..) => l,
            // Not a live page table: an ordinary write to a writable page.
            _ => {
                self.get_page(table)?;
                let r = self.get_type(table, PageType::Writable);
                if r.is_ok() {
                    let _ = self.hv.mem.write(table, off, &u.val.to_le_bytes());
                    self.hv.frames.put_page_type(table);
                }
                self.hv.frames.put_page(table);
                return r;
            }
        };
        if level == 4 && XEN_L4_SLOTS.contains(&(off / 8)) {
            return Err(MmuError::HypervisorSlot);
        }
        if u.val & PTE_P != 0 {
            self.get_entry(u.val, level)?;
        }
        let slot = self
            .hv
            .mem
            .atomic_u64(table, off)
            .map_err(|_| MmuError::Misaligned)?;
        let old = slot.swap(u.val, Ordering::AcqRel);
        self.put_entry(old, level);
        self.stats().updates.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn ext(&mut self, op: MmuExtOp) -> Result<(), MmuError> {
        match op {
            MmuExtOp::Pin { level, mfn } => {
                if !(1..=4).contains(&level) {
                    return Err(MmuError::BadLevel);
                }
                let gfn = self.gfn(mfn)?;
                if self.st.pinned[gfn.0 as usize] {
                    return Err(MmuError::AlreadyPinned);
                }
                self.get_page(mfn)?;
                if let Err(e) = self.get_type(mfn, PageType::PageTable(level)) {
                    self.hv.frames.put_page(mfn);
                    return Err(e);
                }
                self.st.pinned[gfn.0 as usize] = true;
                self.st.pinned_count += 1;
                self.stats().pins.fetch_add(1, Ordering::Relaxed);
            }
            MmuExtOp::Unpin(mfn) => {
                let gfn = self.gfn(mfn)?;
                if !self.st.pinned[gfn.0 as usize] {
                    return Err(MmuError::NotPinned);
                }
                if self.is_base(mfn) {
                    return Err(MmuError::Busy);
                }
                self.st.pinned[gfn.0 as usize] = false;
                self.st.pinned_count -= 1;
                self.put_type(mfn);
                self.hv.frames.put_page(mfn);
                self.stats().unpins.fetch_add(1, Ordering::Relaxed);
            }
            MmuExtOp::NewBaseptr { vcpu, mfn } => {
                let slot = self
                    .dom
                    .mmu
                    .base
                    .get(vcpu as usize)
                    .ok_or(MmuError::BadVcpu)?;
                let new = match mfn {
                    Some(m) => {
                        self.gfn(m)?;
                        self.get_page(m)?;
                        if let Err(e) = self.get_type(m, PageType::PageTable(4)) {
                            self.hv.frames.put_page(m);
                            return Err(e);
                        }
                        m.0 as u64 + 1
                    }
                    None => 0,
                };
                let old = slot.swap(new, Ordering::AcqRel);
                if old != 0 {
                    let m = Mfn((old - 1) as u32);
                    self.put_type(m);
                    self.hv.frames.put_page(m);
                }
            }
            MmuExtOp::MakeWritable(mfn) => {
                let gfn = self.gfn(mfn)?;
                if self.st.pinned[gfn.0 as usize] || self.hv.frames.page_type(mfn).1 != 0 {
                    return Err(MmuError::Busy);
                }
                self.get_page(mfn)?;
                let r = self.get_type(mfn, PageType::Writable);
                if r.is_ok() {
                    self.hv.frames.put_page_type(mfn);
                }
                self.hv.frames.put_page(mfn);
                r?;
            }
        }
        Ok(())
    }
}

/// What a domain's memory manager holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MmuSnapshot {
    /// Tables pinned.
    pub pinned: usize,
    /// Pages unmapped, their invalidation still queued (lazy policy).
    pub lazy_queued: usize,
}

impl Hypervisor {
    fn with_mmu<R>(&self, dom: &Domain, f: impl FnOnce(&mut Op<'_>) -> R) -> Result<R, MmuError> {
        if dom.is_dying() {
            dom.mmu.stats.errors[MmuError::Dying.index()].fetch_add(1, Ordering::Relaxed);
            return Err(MmuError::Dying);
        }
        let mut st = dom.mmu.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut op = Op {
            hv: self,
            dom,
            st: &mut st,
        };
        let r = f(&mut op);
        op.finish();
        Ok(r)
    }

    fn batch<T: Copy>(
        &self,
        dom: &Domain,
        items: &[T],
        f: impl Fn(&mut Op<'_>, T) -> Result<(), MmuError>,
    ) -> Result<(), BatchError> {
        let r = self
            .with_mmu(dom, |op| {
                for (i, &it) in items.iter().enumerate() {
                    if let Err(error) = f(op, it) {
                        return Err(BatchError { done: i, error });
                    }
                }
                Ok(())
            })
            .unwrap_or_else(|error| Err(BatchError { done: 0, error }));
        if let Err(e) = r {
            if e.error != MmuError::Dying {
                dom.mmu.stats.errors[e.error.index()].fetch_add(1, Ordering::Relaxed);
            }
        }
        r
    }

    /// Sets how `dom`'s memory manager treats the IOMMU. Turning the sync on maps every
    /// page of the domain that is not a page table into its IOMMU context (writable, at
    /// its guest frame number); turning it off leaves the context as it is. A lazy
    /// flush queue is drained first.
    pub fn mmu_configure(&self, dom: &Domain, cfg: MmuConfig) -> Result<(), MmuError> {
        self.with_mmu(dom, |op| {
            op.drain_lazy(true);
            let was = op.st.cfg.iommu_sync;
            op.st.cfg = cfg;
            if cfg.iommu_sync && !was {
                for (g, &m) in dom.p2m.iter().enumerate() {
                    if level_of(self.frames.page_type(m).0).is_some() {
                        continue;
                    }
                    let leaf = m.byte_offset() | crate::iommu::PTE_R | crate::iommu::PTE_W;
                    self.iommu
                        .set_entry(&self.frames, dom.id, g as u64, Some(leaf))
                        .map_err(|_| MmuError::NoMemory)?;
                }
            }
            Ok(())
        })?
    }

    /// `HYPERVISOR_mmu_update`: each update validated and applied in order; stops at
    /// the first refused.
    pub fn mmu_update(&self, dom: &Domain, updates: &[MmuUpdate]) -> Result<(), BatchError> {
        self.batch(dom, updates, |op, u| op.update(u))
    }

    /// `HYPERVISOR_mmuext_op`: each operation in order; stops at the first refused.
    pub fn mmuext(&self, dom: &Domain, ops: &[MmuExtOp]) -> Result<(), BatchError> {
        self.batch(dom, ops, |op, o| op.ext(o))
    }

    /// The timer of the lazy flush queue: drains it if it is due.
    pub fn mmu_flush_due(&self, dom: &Domain) {
        let _ = self.with_mmu(dom, |_| ());
    }

    /// The domain's memory-manager counters.
    pub fn mmu_stats<'d>(&self, dom: &'d Domain) -> &'d MmuStats {
        &dom.mmu.stats
    }

    /// What the domain's memory manager holds now.
    pub fn mmu_snapshot(&self, dom: &Domain) -> MmuSnapshot {
        let st = dom.mmu.state.lock().unwrap_or_else(|p| p.into_inner());
        MmuSnapshot {
            pinned: st.pinned_count,
            lazy_queued: st.lazy.len(),
        }
    }

    /// Releases everything a destroyed domain's memory manager holds: its base
    /// pointers and pins, so its frames' counts fall to zero and they can be freed.
    pub(crate) fn mmu_teardown(&self, dom: &Domain) {
        let mut st = dom.mmu.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut op = Op {
            hv: self,
            dom,
            st: &mut st,
        };
        op.drain_lazy(true);
        for b in dom.mmu.base.iter() {
            let old = b.swap(0, Ordering::AcqRel);
            if old != 0 {
                let m = Mfn((old - 1) as u32);
                op.put_type(m);
                self.frames.put_page(m);
            }
        }
        for g in 0..op.st.pinned.len() {
            if op.st.pinned[g] {
                op.st.pinned[g] = false;
                let m = dom.p2m[g];
                op.put_type(m);
                self.frames.put_page(m);
            }
        }
        op.st.pinned_count = 0;
    }

    /// The MMU's walk: translates `va` through the tables `vcpu` has as its base,
    /// checking the present and writable bits of every level, as the hardware does.
    #[inline]
    pub fn pv_translate(
        &self,
        dom: &Domain,
        vcpu: u32,
        va: u64,
        write: bool,
    ) -> Result<Mfn, PageFault> {
        let fault = |level, kind| PageFault {
            va,
            write,
            level,
            kind,
        };
        let base = dom
            .mmu
            .base
            .get(vcpu as usize)
            .map_or(0, |b| b.load(Ordering::Acquire));
        if base == 0 {
            return Err(fault(4, FaultKind::NoBase));
        }
        if va >= USER_TOP {
            return Err(fault(4, FaultKind::NonCanonical));
        }
        dom.mmu.stats.walks.fetch_add(1, Ordering::Relaxed);
        let mut table = Mfn((base - 1) as u32);
        for level in (1..=4u8).rev() {
            let e = self
                .mem
                .atomic_u64(table, va_index(va, level) * 8)
                .map_err(|_| fault(level, FaultKind::Guard))?
                .load(Ordering::Acquire);
            if e & PTE_P == 0 {
                return Err(fault(level, FaultKind::NotPresent));
            }
            if write && e & PTE_RW == 0 {
                return Err(fault(level, FaultKind::Protection));
            }
            table = pte_mfn(e);
        }
        // Validation makes these impossible; the walker still refuses them, so that a
        // guest racing its own pin with a write to the table (pvio's kernel writes
        // have no TLB to shoot down) reaches nothing but its own ordinary pages.
        if self.frames.owner(table) != Some(dom.id) || (write && self.frames.is_page_table(table)) {
            dom.mmu.stats.walk_guard.fetch_add(1, Ordering::Relaxed);
            return Err(fault(0, FaultKind::Guard));
        }
        Ok(table)
    }

    /// Splits `len` bytes at `va` into page pieces, translating each: `f(frame,
    /// offset in the page, offset in the caller's buffer, length)`.
    fn each_page(
        &self,
        dom: &Domain,
        vcpu: u32,
        va: u64,
        len: usize,
        write: bool,
        mut f: impl FnMut(Mfn, usize, usize, usize),
    ) -> Result<(), PageFault> {
        let mut done = 0;
        while done < len {
            let at = va + done as u64;
            let off = (at & 0xfff) as usize;
            let n = (mem::PAGE_SIZE - off).min(len - done);
            f(self.pv_translate(dom, vcpu, at, write)?, off, done, n);
            done += n;
        }
        Ok(())
    }

    /// A process's read through its page tables.
    pub fn pv_read(
        &self,
        dom: &Domain,
        vcpu: u32,
        va: u64,
        buf: &mut [u8],
    ) -> Result<(), PageFault> {
        self.each_page(dom, vcpu, va, buf.len(), false, |m, off, at, n| {
            let _ = self.mem.read(m, off, &mut buf[at..at + n]);
        })
    }

    /// A process's write through its page tables.
    pub fn pv_write(&self, dom: &Domain, vcpu: u32, va: u64, data: &[u8]) -> Result<(), PageFault> {
        self.each_page(dom, vcpu, va, data.len(), true, |m, off, at, n| {
            let _ = self.mem.write(m, off, &data[at..at + n]);
        })
    }
}
