//! A PV guest kernel's memory manager and process model, and IOSUP's page-table cache
//! (paper 004).
//!
//! Processes have real address spaces: four-level page tables in the guest's own
//! frames, managed as Linux's PV port does. `fork` builds the child's tables (a top
//! level holding the kernel's shared slot, and the upper levels and level-1 tables its
//! regions need), copies the parent's entries for every page read-only on both sides
//! (copy on write), and `exec` replaces the image with fresh pages; `exit` tears it all
//! down. A fresh table page is zeroed and filled with the kernel's own writes while it
//! is still writable, then pinned: the hypervisor validates it and gives it its level's
//! type, which, for a domain whose devices sit behind an IOMMU, takes the page out of
//! the IOMMU context and flushes its IOTLB entry. Freeing reverses it: unpin, the page
//! made writable again (back into the IOMMU), and returned to the page allocator. So
//! every process created and exited flushes the IOTLB of every device the domain drives.
//!
//! IOSUP keeps freed table pages instead: each is cleared (its entries zeroed through
//! `mmu_update`, so it references nothing) and stays pinned in a pool, one per level
//! or one shared by all levels. A table taken from a pool already has its type, so no
//! type changes and no flushes; its entries are written through `mmu_update`. The pool
//! gives pages back to the allocator when the paper's rule says it holds too many
//! (pooled over in-use above a ratio, and their sum above a total), or when the domain
//! runs short of memory.
//!
//! A process runs by installing its top level as the vCPU's base and touching its
//! pages through the hypervisor's walker; what it reads is checked against what was
//! written.

use std::sync::Arc;
use std::time::Instant;

use hv::mmu::{
    pte, va_index, BatchError, MmuExtOp, MmuUpdate, PTE_P, PTE_RW, PTE_US, XEN_L4_SLOTS,
};
use hv::{Domain, DomainError, Gfn, Hypervisor, Mfn, PAGE_SIZE};

/// The level-4 slot where every address space maps the kernel (Linux's direct map sits
/// at slot 272, just above the hypervisor's).
pub const KERNEL_SLOT: usize = XEN_L4_SLOTS.end;

/// Whether and how freed page tables are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// No cache: every table page changes type on allocation and on free.
    Off,
    /// IOSUP: one pool per level.
    PerLevel,
    /// One pool for every level: a page changes level but never leaves the page-table
    /// types (needs a hypervisor that does no IOMMU work on a level change).
    Shared,
}

/// When a pool gives pages back (the paper's rule): if pooled / in use exceeds
/// `ratio` and pooled + in use exceeds `total`, release pooled − in use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FreePolicy {
    /// Pooled over in use.
    pub ratio: f64,
    /// Pooled plus in use.
    pub total: usize,
}

impl FreePolicy {
    /// Never gives anything back (but to memory pressure).
    pub const KEEP_ALL: FreePolicy = FreePolicy {
        ratio: f64::INFINITY,
        total: usize::MAX,
    };
}

impl Default for FreePolicy {
    fn default() -> Self {
        Self {
            ratio: 1.0,
            total: 64,
        }
    }
}

/// How a pool decides what to give back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sizing {
    /// The paper's rule, with its two factors set by hand.
    Fixed(FreePolicy),
    /// No factors: each pool keeps what its level's demand will want again if it
    /// returns to its recent peak ([`Demand`]), and learns peaks further apart from
    /// its own mistakes.
    Adaptive,
}

impl From<FreePolicy> for Sizing {
    fn from(p: FreePolicy) -> Self {
        Sizing::Fixed(p)
    }
}

/// What the adaptive rule knows of one pool's demand.
///
/// The rule bounds the pool's *footprint*, the tables in use plus those pooled: the
/// pool keeps what the level's demand will want again if it returns to its recent
/// peak. Time is counted in the pool's own allocations, so the rule follows the churn
/// rate without a clock: an *epoch* lasts until the pool has served as many
/// allocations as the most tables its level had in use during it (one turnover of the
/// tables in use, whatever the rate). The footprint may reach the peak in use of this
/// epoch or the last.
///
/// Peaks further apart than that are learned from regret: every page given back is
/// remembered (a ghost, as ARC keeps them), and an allocation the pool cannot serve
/// while ghosts remain raises a floor under the footprint to the tables now in use.
/// Pages that sit unused in the pool through `patience` epochs in a row were not
/// needed: the floor comes down by that many. A regret after such a decay doubles the
/// patience (the peaks are further apart than it waited), so a workload whose peaks
/// are far apart costs a few regrets, not one per peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demand {
    /// The most tables in use this epoch.
    pub hi: usize,
    /// The last epoch's.
    pub prev: usize,
    /// Allocations this epoch.
    pub allocs: usize,
    /// The fewest pages the pool held this epoch.
    pub idle: usize,
    /// Pages given back and not yet asked for again.
    pub ghosts: usize,
    /// A footprint learned from regret.
    pub floor: usize,
    /// Epochs of unused pages before the floor comes down.
    pub patience: u32,
    /// Epochs in a row with unused pages, and the fewest unused over them.
    idle_epochs: u32,
    idle_run: usize,
    /// The floor came down since the last regret.
    decayed: bool,
}

impl Default for Demand {
    fn default() -> Self {
        Self {
            hi: 0,
            allocs: 0,
            prev: 0,
            idle: 0,
            ghosts: 0,
            floor: 0,
            patience: 1,
            idle_epochs: 0,
            idle_run: 0,
            decayed: false,
        }
    }
}

impl Demand {
    /// Starts counting with `in_use` tables in use.
    fn new(in_use: usize) -> Self {
        Self {
            hi: in_use,
            ..Default::default()
        }
    }

    /// The most pages the pool and the tables in use may come to now.
    pub fn footprint(&self) -> usize {
        self.hi.max(self.prev).max(self.floor)
    }

    /// `n` pages given back; `pooled` left.
    fn released(&mut self, n: usize, pooled: usize) {
        self.ghosts += n;
        self.idle = self.idle.min(pooled);
    }

    /// An allocation with `in_use` tables now in use (this one counted) and `pooled`
    /// left in the pool; `miss` if the pool had none.
    fn alloc(&mut self, in_use: usize, pooled: usize, miss: bool) {
        if miss && self.ghosts > 0 {
            self.ghosts -= 1;
            self.floor = self.floor.max(in_use);
            if std::mem::take(&mut self.decayed) {
                self.patience = self.patience.saturating_mul(2);
            }
        }
        self.hi = self.hi.max(in_use);
        self.idle = self.idle.min(pooled);
        self.allocs += 1;
        if self.allocs < self.hi.max(1) {
            return;
        }
        // The epoch ends.
        self.prev = self.hi;
        if self.idle > 0 {
            self.idle_run = if self.idle_epochs == 0 {
                self.idle
            } else {
                self.idle_run.min(self.idle)
            };
            self.idle_epochs += 1;
            if self.idle_epochs >= self.patience && self.floor > 0 {
                self.floor -= self.idle_run.min(self.floor);
                self.decayed = true;
                self.idle_epochs = 0;
            }
        } else {
            self.idle_epochs = 0;
        }
        (self.hi, self.allocs, self.idle) = (in_use, 0, pooled);
    }
}

/// Why a memory-manager operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MmError {
    /// The domain has no page left.
    #[error("out of memory")]
    OutOfMemory,
    /// The guest's own access was refused.
    #[error("guest access: {0}")]
    Domain(#[from] DomainError),
    /// The hypervisor refused an MMU operation (a bug in this kernel).
    #[error("hypervisor: {0}")]
    Mmu(#[from] BatchError),
    /// A touch through the walker faulted or read the wrong bytes.
    #[error("process: {0}")]
    Touch(String),
}

/// A region of a process: `pages` pages from `va`, writable or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionSpec {
    /// Start address (page aligned, below the user top).
    pub va: u64,
    /// Pages.
    pub pages: usize,
    /// Writable.
    pub writable: bool,
}

/// A small program's image: text, data, heap, libraries and stack, spread over the
/// address space as Linux lays them out (so that it needs three upper tables).
pub const SMALL_PROCESS: [RegionSpec; 5] = [
    RegionSpec {
        va: 0x0040_0000,
        pages: 8,
        writable: false,
    },
    RegionSpec {
        va: 0x0060_0000,
        pages: 4,
        writable: true,
    },
    RegionSpec {
        va: 0x1000_0000,
        pages: 8,
        writable: true,
    },
    RegionSpec {
        va: 0x7f00_0000_0000,
        pages: 16,
        writable: false,
    },
    RegionSpec {
        va: 0x7fff_ff00_0000,
        pages: 4,
        writable: true,
    },
];

#[derive(Debug, Clone, Copy)]
struct Table {
    level: u8,
    /// The address bits above what this table translates.
    prefix: u64,
    gfn: Gfn,
    mfn: Mfn,
}

#[derive(Debug, Clone)]
struct Region {
    spec: RegionSpec,
    pages: Vec<Gfn>,
    /// The byte every page of the image was filled with.
    seed: u8,
}

/// A process.
#[derive(Debug)]
pub struct Process {
    /// Its id.
    pub pid: u32,
    tables: Vec<Table>,
    /// Per table, the entries set (index into `tables`, entry).
    set: Vec<(usize, u16)>,
    regions: Vec<Region>,
}

impl Process {
    fn l4(&self) -> Mfn {
        self.tables[0].mfn
    }
    /// Page-table pages it holds.
    pub fn tables(&self) -> usize {
        self.tables.len()
    }
}

/// Per level (index 1–4; 0 unused), counts and CPU time of table allocation and free.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct LevelStats {
    /// Tables allocated.
    pub allocs: u64,
    /// Of which from the pool.
    pub pool_hits: u64,
    /// Time allocating, ns.
    pub alloc_ns: u64,
    /// Tables freed.
    pub frees: u64,
    /// Time freeing, ns.
    pub free_ns: u64,
}

/// The memory manager's counters.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct MmStats {
    /// Per level, 1–4.
    pub level: [LevelStats; 5],
    /// Pool pages given back to the allocator.
    pub released: u64,
    /// Processes created (`spawn` and `fork`).
    pub forks: u64,
    /// Exits.
    pub exits: u64,
    /// Pages touched through the walker.
    pub touched: u64,
    /// Times the pool was drained because the domain ran out of pages.
    pub reclaims: u64,
    /// Longest such drain, ns.
    pub reclaim_ns: u64,
}

/// The guest kernel's memory manager.
#[derive(Debug)]
pub struct Mm {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    vcpu: u32,
    mode: PoolMode,
    sizing: Sizing,
    demand: [Demand; 5],
    /// Pools, per level (index 1–4), or all in index 0 when shared.
    /// Each page with the level it is pinned at.
    pools: [Vec<(Gfn, Mfn, u8)>; 5],
    in_use: [usize; 5],
    kernel_l3: Mfn,
    /// Per guest frame, how many processes map it.
    shares: Vec<u16>,
    next_pid: u32,
    /// Counters.
    pub stats: MmStats,
    updates: Vec<MmuUpdate>,
    ext: Vec<MmuExtOp>,
    batch: bool,
}

fn ns(t: Instant) -> u64 {
    t.elapsed().as_nanos() as u64
}

impl Mm {
    /// The kernel's memory manager for `dom`, running on `vcpu`: pins the kernel's
    /// shared level-3 table that every address space maps at [`KERNEL_SLOT`].
    pub fn new(hv: Arc<Hypervisor>, dom: Arc<Domain>, vcpu: u32) -> Result<Self, MmError> {
        let g = dom.alloc_page().map_err(|_| MmError::OutOfMemory)?;
        dom.fill(g, 0, PAGE_SIZE, 0)?;
        let m = dom.pv_machine_frame(g).ok_or(MmError::OutOfMemory)?;
        hv.mmuext(&dom, &[MmuExtOp::Pin { level: 3, mfn: m }])?;
        let pages = dom.pages() as usize;
        Ok(Self {
            hv,
            dom,
            vcpu,
            mode: PoolMode::Off,
            sizing: Sizing::Fixed(FreePolicy::default()),
            demand: Default::default(),
            pools: Default::default(),
            in_use: [0; 5],
            kernel_l3: m,
            shares: vec![0; pages],
            next_pid: 1,
            stats: MmStats::default(),
            updates: Vec::with_capacity(512),
            ext: Vec::with_capacity(64),
            batch: false,
        })
    }

    /// Turns the cache on or off (at boot or while running) and sets how it sizes
    /// itself. Turning it off, or changing its shape, gives every pooled page back.
    pub fn set_pool(&mut self, mode: PoolMode, sizing: impl Into<Sizing>) -> Result<(), MmError> {
        if mode != self.mode {
            self.drain()?;
        }
        self.mode = mode;
        self.sizing = sizing.into();
        for i in 0..5 {
            self.demand[i] = Demand::new(self.in_use_of(i));
        }
        Ok(())
    }

    /// What the adaptive rule knows of each pool (index as [`Mm::pool_sizes`]).
    pub fn demand(&self) -> [Demand; 5] {
        self.demand
    }

    /// Tables in use that draw on pool `i`.
    fn in_use_of(&self, i: usize) -> usize {
        if i == 0 {
            self.in_use.iter().sum()
        } else {
            self.in_use[i]
        }
    }

    /// The pool's shape.
    pub fn pool_mode(&self) -> PoolMode {
        self.mode
    }

    /// Pages pooled now, per level (index 1–4; index 0 for the shared pool).
    pub fn pool_sizes(&self) -> [usize; 5] {
        std::array::from_fn(|i| self.pools[i].len())
    }

    /// Pages pooled now, all levels.
    pub fn pooled(&self) -> usize {
        self.pools.iter().map(Vec::len).sum()
    }

    /// Table pages held by processes now, per level.
    pub fn in_use(&self) -> [usize; 5] {
        self.in_use
    }

    fn pool_index(&self, level: u8) -> usize {
        match self.mode {
            PoolMode::Shared => 0,
            _ => level as usize,
        }
    }

    /// A table page for `level`: pooled (already a pinned, empty table; true) or
    /// fresh (zeroed, writable, to be pinned; false).
    fn alloc_table(&mut self, level: u8) -> Result<((Gfn, Mfn), bool), MmError> {
        let t = Instant::now();
        let l = &mut self.stats.level[level as usize];
        l.allocs += 1;
        self.in_use[level as usize] += 1;
        if self.mode != PoolMode::Off {
            let i = self.pool_index(level);
            let popped = self.pools[i].pop();
            let (u, left) = (self.in_use_of(i), self.pools[i].len());
            self.demand[i].alloc(u, left, popped.is_none());
            if let Some((g, m, pinned)) = popped {
                if pinned != level {
                    // The shared pool: the page changes level, never leaving the
                    // page-table types (no IOMMU work on a hypervisor that skips it).
                    self.hv.mmuext(
                        &self.dom,
                        &[MmuExtOp::Unpin(m), MmuExtOp::Pin { level, mfn: m }],
                    )?;
                }
                let p = (g, m);
                let l = &mut self.stats.level[level as usize];
                l.pool_hits += 1;
                l.alloc_ns += ns(t);
                return Ok((p, true));
            }
        }
        let g = self.alloc_page()?;
        self.dom.fill(g, 0, PAGE_SIZE, 0)?;
        let m = self.dom.pv_machine_frame(g).ok_or(MmError::OutOfMemory)?;
        self.stats.level[level as usize].alloc_ns += ns(t);
        Ok(((g, m), false))
    }

    /// Puts `tables` (their entries already cleared, still pinned) in the pool, then
    /// applies the release rule.
    fn pool_tables(&mut self, tables: &[Table]) -> Result<(), MmError> {
        for tb in tables {
            let t = Instant::now();
            self.in_use[tb.level as usize] -= 1;
            let i = self.pool_index(tb.level);
            self.pools[i].push((tb.gfn, tb.mfn, tb.level));
            let l = &mut self.stats.level[tb.level as usize];
            l.frees += 1;
            l.free_ns += ns(t);
        }
        self.apply_policy()
    }

    /// A pinned, empty table page back to the allocator: unpin, writable, free.
    fn release(&mut self, g: Gfn, m: Mfn) -> Result<(), MmError> {
        self.hv
            .mmuext(&self.dom, &[MmuExtOp::Unpin(m), MmuExtOp::MakeWritable(m)])?;
        self.dom.free_page(g)?;
        Ok(())
    }

    fn apply_policy(&mut self) -> Result<(), MmError> {
        for i in 0..5 {
            let pooled = self.pools[i].len();
            let in_use = self.in_use_of(i);
            if pooled == 0 {
                continue;
            }
            let n = match self.sizing {
                Sizing::Fixed(p) => {
                    let over_ratio = pooled as f64 > p.ratio * in_use as f64;
                    if over_ratio && pooled + in_use > p.total {
                        pooled.saturating_sub(in_use).max(1).min(pooled)
                    } else {
                        0
                    }
                }
                Sizing::Adaptive => (pooled + in_use)
                    .saturating_sub(self.demand[i].footprint())
                    .min(pooled),
            };
            for _ in 0..n {
                if let Some((g, m, _)) = self.pools[i].pop() {
                    self.release(g, m)?;
                    self.stats.released += 1;
                }
            }
            let left = self.pools[i].len();
            self.demand[i].released(n, left);
        }
        Ok(())
    }

    /// A page from the domain's allocator. When none is left, the pool is memory the
    /// kernel can take back at once: it is drained (every pooled page unpinned, made
    /// writable and freed, counted in [`MmStats::reclaims`]) and the allocation tried
    /// again, so the pool never holds memory the domain needs (Linux's page-table
    /// quicklists, which did not, grew unaccounted until they were removed).
    pub fn alloc_page(&mut self) -> Result<Gfn, MmError> {
        if let Ok(g) = self.dom.alloc_page() {
            return Ok(g);
        }
        if self.pooled() > 0 {
            let t = Instant::now();
            self.drain()?;
            self.stats.reclaims += 1;
            self.stats.reclaim_ns = self.stats.reclaim_ns.max(ns(t));
        }
        self.dom.alloc_page().map_err(|_| MmError::OutOfMemory)
    }

    /// Gives every pooled page back (memory pressure, or the cache turned off).
    pub fn drain(&mut self) -> Result<usize, MmError> {
        let mut n = 0;
        for i in 0..5 {
            while let Some((g, m, _)) = self.pools[i].pop() {
                self.release(g, m)?;
                n += 1;
            }
        }
        self.stats.released += n as u64;
        Ok(n)
    }

    fn table_for(p: &Process, level: u8, va: u64) -> Option<usize> {
        let prefix = va >> (12 + 9 * level as u32);
        p.tables
            .iter()
            .position(|t| t.level == level && t.prefix == prefix)
    }

    /// Writes entries into the process's tables: `fresh` ones with the kernel's own
    /// writes, pooled ones through `mmu_update`. `entries` are (table index, slot,
    /// value).
    fn write_entries(
        &mut self,
        p: &mut Process,
        fresh: &[bool],
        entries: &[(usize, usize, u64)],
    ) -> Result<(), MmError> {
        self.updates.clear();
        for &(ti, slot, val) in entries {
            let tb = p.tables[ti];
            if fresh[ti] {
                self.dom.write(tb.gfn, slot * 8, &val.to_le_bytes())?;
            } else {
                self.updates.push(MmuUpdate::new(tb.mfn, slot, val));
            }
            p.set.push((ti, slot as u16));
        }
        Ok(())
    }

    /// Sends the updates gathered in `self.updates` as one `mmu_update` batch.
    fn send_updates(&mut self) -> Result<(), MmError> {
        self.hv.mmu_update(&self.dom, &self.updates)?;
        Ok(())
    }

    /// Issues `ops`, each tagged with the level of the table it concerns, and charges
    /// their time to those levels' allocation (`alloc`) or free: one hypercall per
    /// operation, or one for all when the kernel batches (split evenly).
    fn ext_timed(&mut self, ops: &[(u8, MmuExtOp)], alloc: bool) -> Result<(), MmError> {
        let charge = |st: &mut MmStats, level: u8, t: u64| {
            let l = &mut st.level[level as usize];
            if alloc {
                l.alloc_ns += t;
            } else {
                l.free_ns += t;
            }
        };
        if self.batch {
            self.ext.clear();
            self.ext.extend(ops.iter().map(|o| o.1));
            let t = Instant::now();
            self.hv.mmuext(&self.dom, &self.ext)?;
            let per = ns(t) / ops.len().max(1) as u64;
            for o in ops {
                charge(&mut self.stats, o.0, per);
            }
        } else {
            for o in ops {
                let t = Instant::now();
                self.hv.mmuext(&self.dom, &[o.1])?;
                charge(&mut self.stats, o.0, ns(t));
            }
        }
        Ok(())
    }

    /// Whether the kernel batches its pins and unpins into one hypercall per fork or
    /// exit (as Linux's lazy MMU mode batches into multicalls).
    pub fn set_batching(&mut self, batch: bool) {
        self.batch = batch;
    }

    fn new_space(&mut self) -> Result<(Process, bool), MmError> {
        let ((g, m), pooled) = self.alloc_table(4)?;
        let pid = self.next_pid;
        self.next_pid += 1;
        let mut p = Process {
            pid,
            tables: vec![Table {
                level: 4,
                prefix: 0,
                gfn: g,
                mfn: m,
            }],
            set: Vec::new(),
            regions: Vec::new(),
        };
        // The kernel's slot, as pgd_alloc copies it.
        let k = pte(self.kernel_l3, PTE_P | PTE_RW);
        if pooled {
            self.hv
                .mmu_update(&self.dom, &[MmuUpdate::new(m, KERNEL_SLOT, k)])?;
        } else {
            self.dom.write(g, KERNEL_SLOT * 8, &k.to_le_bytes())?;
        }
        p.set.push((0, KERNEL_SLOT as u16));
        Ok((p, !pooled))
    }

    /// Loads a fresh image into `p`: new pages, filled by the kernel, mapped.
    fn load(
        &mut self,
        p: &mut Process,
        image: &[RegionSpec],
        fresh_top: bool,
    ) -> Result<(), MmError> {
        let mut maps = Vec::new();
        for (k, r) in image.iter().enumerate() {
            let seed = (p.pid as u8).wrapping_mul(31).wrapping_add(k as u8) | 1;
            let mut pages = Vec::with_capacity(r.pages);
            for i in 0..r.pages {
                let g = self.alloc_page()?;
                self.dom.fill(g, 0, PAGE_SIZE, seed)?;
                self.shares[g.0 as usize] += 1;
                pages.push(g);
                maps.push((r.va + (i * PAGE_SIZE) as u64, g, r.writable));
            }
            p.regions.push(Region {
                spec: *r,
                pages,
                seed,
            });
        }
        self.build(p, fresh_top, &maps)
    }

    /// Builds the tables `maps` (address, frame, writable) need into `p`, whose top
    /// level is fresh or pooled: fresh tables get their entries by the kernel's own
    /// writes and are pinned bottom-up (each validation finds its children typed), the
    /// top last; pooled tables get theirs through `mmu_update`.
    fn build(
        &mut self,
        p: &mut Process,
        fresh_top: bool,
        maps: &[(u64, Gfn, bool)],
    ) -> Result<(), MmError> {
        let mut fresh = vec![false; p.tables.len()];
        fresh[0] = fresh_top;
        let mut entries: Vec<(usize, usize, u64)> = Vec::new();
        for &(va, g, w) in maps {
            let mut parent = 0usize;
            for level in (1..=3u8).rev() {
                let ti = match Self::table_for(p, level, va) {
                    Some(ti) => ti,
                    None => {
                        let ((tg, tm), pooled) = self.alloc_table(level)?;
                        p.tables.push(Table {
                            level,
                            prefix: va >> (12 + 9 * level as u32),
                            gfn: tg,
                            mfn: tm,
                        });
                        fresh.push(!pooled);
                        entries.push((
                            parent,
                            va_index(va, level + 1),
                            pte(tm, PTE_P | PTE_RW | PTE_US),
                        ));
                        p.tables.len() - 1
                    }
                };
                parent = ti;
            }
            let m = self.dom.pv_machine_frame(g).ok_or(MmError::OutOfMemory)?;
            let flags = PTE_P | PTE_US | if w { PTE_RW } else { 0 };
            entries.push((parent, va_index(va, 1), pte(m, flags)));
        }
        self.write_entries(p, &fresh, &entries)?;
        let mut order: Vec<usize> = (0..p.tables.len()).filter(|&i| fresh[i]).collect();
        order.sort_by_key(|&i| p.tables[i].level);
        let pins: Vec<(u8, MmuExtOp)> = order
            .iter()
            .map(|&i| {
                let tb = p.tables[i];
                (
                    tb.level,
                    MmuExtOp::Pin {
                        level: tb.level,
                        mfn: tb.mfn,
                    },
                )
            })
            .collect();
        self.ext_timed(&pins, true)?;
        self.send_updates()?;
        Ok(())
    }

    /// A first process with `image` (the kernel starting init).
    pub fn spawn(&mut self, image: &[RegionSpec]) -> Result<Process, MmError> {
        let (mut p, fresh) = self.new_space()?;
        self.load(&mut p, image, fresh)?;
        self.stats.forks += 1;
        Ok(p)
    }

    /// `fork`: a child with the parent's image shared copy-on-write: both sides' entries
    /// read-only.
    pub fn fork(&mut self, parent: &mut Process) -> Result<Process, MmError> {
        // Write-protect the parent's writable entries (ptep_set_wrprotect).
        self.updates.clear();
        for r in &parent.regions {
            if !r.spec.writable {
                continue;
            }
            for (i, &g) in r.pages.iter().enumerate() {
                let va = r.spec.va + (i * PAGE_SIZE) as u64;
                let ti = Self::table_for(parent, 1, va)
                    .ok_or_else(|| MmError::Touch("no table".into()))?;
                let m = self.dom.pv_machine_frame(g).ok_or(MmError::OutOfMemory)?;
                self.updates.push(MmuUpdate::new(
                    parent.tables[ti].mfn,
                    va_index(va, 1),
                    pte(m, PTE_P | PTE_US),
                ));
            }
        }
        self.send_updates()?;
        for r in parent.regions.iter_mut() {
            r.spec.writable = false;
        }
        let (mut child, fresh) = self.new_space()?;
        let mut maps = Vec::new();
        for r in &parent.regions {
            for (i, &g) in r.pages.iter().enumerate() {
                self.shares[g.0 as usize] += 1;
                maps.push((r.spec.va + (i * PAGE_SIZE) as u64, g, false));
            }
            child.regions.push(r.clone());
        }
        self.build(&mut child, fresh, &maps)?;
        self.stats.forks += 1;
        Ok(child)
    }

    /// `exec`: the image replaced by a fresh one.
    pub fn exec(&mut self, p: &mut Process, image: &[RegionSpec]) -> Result<(), MmError> {
        self.teardown(p)?;
        let (mut q, fresh) = self.new_space()?;
        q.pid = p.pid;
        self.load(&mut q, image, fresh)?;
        *p = q;
        Ok(())
    }

    /// `exit`: the address space torn down.
    pub fn exit(&mut self, mut p: Process) -> Result<(), MmError> {
        self.teardown(&mut p)?;
        self.stats.exits += 1;
        Ok(())
    }

    /// Runs `p` for a moment: its tables become the vCPU's base, and it reads the first
    /// and last word of every page through them (checking the image) and writes its
    /// pid into the second word of its writable pages; then the vCPU goes back to the
    /// kernel's own context.
    pub fn run(&mut self, p: &Process) -> Result<(), MmError> {
        let hv = Arc::clone(&self.hv);
        hv.mmuext(
            &self.dom,
            &[MmuExtOp::NewBaseptr {
                vcpu: self.vcpu,
                mfn: Some(p.l4()),
            }],
        )?;
        let mut r = Ok(());
        'regions: for reg in &p.regions {
            for i in 0..reg.pages.len() {
                let va = reg.spec.va + (i * PAGE_SIZE) as u64;
                let mut w = [0u8; 8];
                for off in [0, PAGE_SIZE as u64 - 8] {
                    if let Err(e) = hv.pv_read(&self.dom, self.vcpu, va + off, &mut w) {
                        r = Err(MmError::Touch(e.to_string()));
                        break 'regions;
                    }
                    if w != [reg.seed; 8] {
                        r = Err(MmError::Touch(format!(
                            "{va:#x}+{off}: {w:?}, not {}",
                            reg.seed
                        )));
                        break 'regions;
                    }
                }
                if reg.spec.writable {
                    if let Err(e) = hv.pv_write(&self.dom, self.vcpu, va + 8, &p.pid.to_le_bytes())
                    {
                        r = Err(MmError::Touch(e.to_string()));
                        break 'regions;
                    }
                }
                self.stats.touched += 1;
            }
        }
        hv.mmuext(
            &self.dom,
            &[MmuExtOp::NewBaseptr {
                vcpu: self.vcpu,
                mfn: None,
            }],
        )?;
        r
    }

    fn teardown(&mut self, p: &mut Process) -> Result<(), MmError> {
        let t = Instant::now();
        if self.mode == PoolMode::Off {
            // Unpin every table, top first: each unpin drops the entries' references.
            let mut order: Vec<usize> = (0..p.tables.len()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(p.tables[i].level));
            let unpins: Vec<(u8, MmuExtOp)> = order
                .iter()
                .map(|&i| (p.tables[i].level, MmuExtOp::Unpin(p.tables[i].mfn)))
                .collect();
            self.ext_timed(&unpins, false)?;
        } else {
            // Clear every entry set, so the pooled pages reference nothing.
            self.updates.clear();
            for &(ti, slot) in &p.set {
                self.updates
                    .push(MmuUpdate::new(p.tables[ti].mfn, slot as usize, 0));
            }
            self.send_updates()?;
            // The clearing is part of freeing; spread over the tables by count.
            let per = ns(t) / p.tables.len().max(1) as u64;
            for tb in &p.tables {
                self.stats.level[tb.level as usize].free_ns += per;
            }
        }
        let tables = std::mem::take(&mut p.tables);
        if self.mode == PoolMode::Off {
            let back: Vec<(u8, MmuExtOp)> = tables
                .iter()
                .map(|tb| (tb.level, MmuExtOp::MakeWritable(tb.mfn)))
                .collect();
            self.ext_timed(&back, false)?;
            for tb in &tables {
                let t = Instant::now();
                self.in_use[tb.level as usize] -= 1;
                self.dom.free_page(tb.gfn)?;
                let l = &mut self.stats.level[tb.level as usize];
                l.frees += 1;
                l.free_ns += ns(t);
            }
        } else {
            // Unpinned nothing: every table is still pinned, empty.
            self.pool_tables(&tables)?;
        }
        for r in std::mem::take(&mut p.regions) {
            for g in r.pages {
                let s = &mut self.shares[g.0 as usize];
                *s -= 1;
                if *s == 0 {
                    self.dom.free_page(g)?;
                }
            }
        }
        p.set.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hv::mmu::{FlushPolicy, MmuConfig};
    use hv::{DeviceId, DomainConfig, HvConfig};
    use std::sync::atomic::Ordering;

    /// A release rule that keeps whatever the tests' workloads pool.
    const ROOMY: FreePolicy = FreePolicy {
        ratio: 4.0,
        total: 1000,
    };

    fn guest(pages: u32, sync: bool, remap: bool) -> Mm {
        let hv = Hypervisor::new(HvConfig {
            frames: pages + 512,
            ..Default::default()
        })
        .expect("hv");
        let dom = hv
            .create_domain(&DomainConfig {
                name: "g".into(),
                pages,
                ..Default::default()
            })
            .expect("dom");
        if sync {
            hv.iommu_attach(DeviceId(1), &dom).expect("attach");
            hv.mmu_configure(
                &dom,
                MmuConfig {
                    iommu_sync: true,
                    flush: FlushPolicy::Strict,
                    remap_on_level_change: remap,
                },
            )
            .expect("sync");
        }
        Mm::new(hv, dom, 0).expect("mm")
    }

    fn flushes(mm: &Mm) -> u64 {
        mm.hv
            .mmu_stats(&mm.dom)
            .pt_invalidations
            .load(Ordering::Relaxed)
    }

    /// fork, exec in the child, run both, exit the child: `n` times.
    fn churn(mm: &mut Mm, parent: &mut Process, n: usize) {
        for _ in 0..n {
            let mut c = mm.fork(parent).expect("fork");
            mm.run(&c).expect("child runs the parent's image");
            mm.exec(&mut c, &SMALL_PROCESS).expect("exec");
            mm.run(&c).expect("child runs its own image");
            mm.run(parent).expect("parent still runs");
            mm.exit(c).expect("exit");
        }
    }

    #[test]
    fn processes_fork_exec_run_and_exit_and_give_back_every_page() {
        let mut mm = guest(2048, true, false);
        let free = mm.dom.free_page_count();
        let mut init = mm.spawn(&SMALL_PROCESS).expect("init");
        assert_eq!(
            init.tables(),
            1 + 3 + 3 + 5,
            "L4, 3 L3s, 3 L2s, 5 L1s for five regions"
        );
        mm.run(&init).expect("init runs");
        let f0 = flushes(&mm);
        churn(&mut mm, &mut init, 5);
        // Without the cache every table of every child changed type: 12 tables for
        // the fork and 12 for the exec, each a flush.
        assert_eq!(flushes(&mm) - f0, 5 * 24);
        assert!(mm.stats.touched > 0);
        mm.exit(init).expect("exit init");
        assert_eq!(
            mm.dom.free_page_count(),
            free,
            "every page is back with the allocator"
        );
        assert_eq!(
            mm.hv.mmu_snapshot(&mm.dom).pinned,
            1,
            "the kernel's own table"
        );
        assert_eq!(
            mm.hv.mmu_stats(&mm.dom).walk_guard.load(Ordering::Relaxed),
            0
        );
    }

    #[test]
    fn with_the_per_level_pool_a_warm_churn_changes_no_type_and_flushes_nothing() {
        let mut mm = guest(2048, true, false);
        mm.set_pool(PoolMode::PerLevel, ROOMY).expect("pool");
        let mut init = mm.spawn(&SMALL_PROCESS).expect("init");
        churn(&mut mm, &mut init, 2);
        let f0 = flushes(&mm);
        let sizes = mm.pool_sizes();
        churn(&mut mm, &mut init, 20);
        assert_eq!(flushes(&mm), f0, "steady state: not one flush");
        assert_eq!(mm.pool_sizes(), sizes);
        assert_eq!(mm.pooled(), 12, "one child's tables, level by level");
        let hits: u64 = (1..5).map(|l| mm.stats.level[l].pool_hits).sum();
        assert!(hits >= 20 * 24);
        // Turning the cache off gives every page back.
        let free = mm.dom.free_page_count();
        mm.set_pool(PoolMode::Off, FreePolicy::default())
            .expect("off");
        assert_eq!(mm.pooled(), 0);
        assert_eq!(mm.dom.free_page_count(), free + 12);
        mm.exit(init).expect("exit");
    }

    #[test]
    fn a_shared_pool_needs_a_hypervisor_that_leaves_level_changes_alone() {
        for (remap, quiet) in [(false, true), (true, false)] {
            let mut mm = guest(2048, true, remap);
            mm.set_pool(PoolMode::Shared, ROOMY).expect("pool");
            let mut init = mm.spawn(&SMALL_PROCESS).expect("init");
            churn(&mut mm, &mut init, 2);
            let f0 = flushes(&mm);
            churn(&mut mm, &mut init, 5);
            assert_eq!(flushes(&mm) == f0, quiet, "remap on level change: {remap}");
            assert!(mm.pool_sizes()[0] > 0 && mm.pool_sizes()[1..].iter().all(|&n| n == 0));
            mm.exit(init).expect("exit");
        }
    }

    #[test]
    fn a_domain_short_of_memory_takes_the_pool_back_at_once() {
        let mut mm = guest(1024, true, false);
        mm.set_pool(PoolMode::PerLevel, FreePolicy::KEEP_ALL)
            .expect("pool");
        let mut init = mm.spawn(&SMALL_PROCESS).expect("init");
        let kids: Vec<Process> = (0..8).map(|_| mm.fork(&mut init).expect("fork")).collect();
        for k in kids {
            mm.exit(k).expect("exit");
        }
        let pooled = mm.pooled();
        assert_eq!(pooled, 8 * 12);
        // Everything else the domain has is taken; the pool is what is left.
        let mut held = Vec::new();
        while let Ok(g) = mm.dom.alloc_page() {
            held.push(g);
        }
        let g = mm.alloc_page().expect("the pool gives its pages back");
        assert_eq!(mm.pooled(), 0);
        assert_eq!(mm.stats.reclaims, 1);
        assert_eq!(mm.dom.free_page_count(), pooled - 1);
        mm.dom.write(g, 0, &[1]).expect("an ordinary page again");
        assert!(mm.stats.reclaim_ns < 100_000_000, "drained within 100 ms");
        for g in held {
            mm.dom.free_page(g).expect("free");
        }
        mm.exit(init).expect("exit");
    }

    #[test]
    fn the_free_policy_gives_back_what_the_pool_holds_beyond_its_thresholds() {
        let mut mm = guest(4096, false, false);
        mm.set_pool(
            PoolMode::PerLevel,
            FreePolicy {
                ratio: 1.0,
                total: 0,
            },
        )
        .expect("pool");
        let mut init = mm.spawn(&SMALL_PROCESS).expect("init");
        // Eight children alive at once, then all exit: the pool may keep no more per
        // level than the tables still in use (init's).
        let kids: Vec<Process> = (0..8).map(|_| mm.fork(&mut init).expect("fork")).collect();
        for k in kids {
            mm.exit(k).expect("exit");
        }
        let in_use = mm.in_use();
        for l in 1..5 {
            assert!(
                mm.pool_sizes()[l] <= in_use[l],
                "level {l}: {:?} vs {:?}",
                mm.pool_sizes(),
                in_use
            );
        }
        assert!(mm.stats.released > 0);
        mm.exit(init).expect("exit");
    }

    /// A strict-IOMMU guest with adaptive per-level pools, and its first process.
    fn adaptive_guest() -> (Mm, Process) {
        let mut mm = guest(4096, true, false);
        mm.set_pool(PoolMode::PerLevel, Sizing::Adaptive)
            .expect("pool");
        let init = mm.spawn(&SMALL_PROCESS).expect("init");
        (mm, init)
    }

    /// `k` children alive at once, then all exit.
    fn burst(mm: &mut Mm, parent: &mut Process, k: usize) {
        let kids: Vec<Process> = (0..k).map(|_| mm.fork(parent).expect("fork")).collect();
        for c in kids {
            mm.exit(c).expect("exit");
        }
    }

    #[test]
    fn the_adaptive_pool_keeps_a_recurring_swing_and_nothing_more() {
        let (mut mm, mut init) = adaptive_guest();
        burst(&mut mm, &mut init, 8);
        let f0 = flushes(&mm);
        assert_eq!(mm.pooled(), 8 * 12, "the whole swing is kept");
        for _ in 0..10 {
            burst(&mut mm, &mut init, 8);
            assert_eq!(mm.pooled(), 8 * 12);
        }
        assert_eq!(flushes(&mm), f0, "steady state: not one flush");
        assert_eq!(mm.stats.released, 0);
        mm.exit(init).expect("exit");
    }

    #[test]
    fn the_adaptive_pool_shrinks_when_demand_falls() {
        let (mut mm, mut init) = adaptive_guest();
        for _ in 0..4 {
            burst(&mut mm, &mut init, 8);
        }
        assert_eq!(mm.pooled(), 8 * 12);
        // Two children at a time now: within a few turnovers the pool holds their
        // swing, and the flushes stop again.
        for _ in 0..8 {
            burst(&mut mm, &mut init, 2);
        }
        assert_eq!(mm.pooled(), 2 * 12);
        let f0 = flushes(&mm);
        for _ in 0..8 {
            burst(&mut mm, &mut init, 2);
        }
        assert_eq!(flushes(&mm), f0);
        assert_eq!(mm.stats.released, 6 * 12);
        mm.exit(init).expect("exit");
    }

    #[test]
    fn the_adaptive_pool_learns_a_swing_slower_than_its_epochs() {
        let (mut mm, mut init) = adaptive_guest();
        // Eight children at once, then a long quiet stretch of one child at a time
        // (many epochs), again and again: the pool gives the eight back at first,
        // regrets it, and after a few rounds of doubling patience keeps them.
        let mut per_round = Vec::new();
        for _ in 0..12 {
            let f0 = flushes(&mm);
            burst(&mut mm, &mut init, 8);
            for _ in 0..40 {
                burst(&mut mm, &mut init, 1);
            }
            per_round.push(flushes(&mm) - f0);
        }
        assert!(
            per_round[1] > 0,
            "it gave the swing back at first: {per_round:?}"
        );
        assert!(
            per_round[8..].iter().all(|&f| f == 0),
            "then it learned it: {per_round:?}"
        );
        assert!(mm.pooled() <= 8 * 12);
        mm.exit(init).expect("exit");
    }
}
