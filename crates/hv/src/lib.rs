//! pvio's hypervisor core.
//!
//! What it owns: machine memory and the frame table; domains with their P2M tables,
//! grant tables, event channels and foreign-map windows; vCPU threads; the store; the
//! IOMMU; the cost classes and the sampling profiler.
//!
//! What it trusts: nothing that a domain wrote. Grant entries, ring indices, port
//! numbers, handles and frame numbers coming from a domain are copied and checked on
//! every use; a bad one gets its own error, counted by the caller, and affects nothing
//! else.
//!
//! What it guarantees (each one a test under `tests/`): a domain reaches only its own
//! frames and the frames granted to it, in the way and the byte range granted; a revoked
//! grant gives nothing; a grant in use cannot be revoked; a destroyed domain's mappings
//! and pins are released and its frames are scrubbed before reuse.
//!
//! Hypercalls are ordinary method calls on [`Hypervisor`] made from the caller's thread,
//! so their work runs on the caller's core and is charged (by class) to the caller, as in
//! Xen.

/// Gives a field-less enum its names, the one spelling that machine files, the command
/// line and reports use, beside its definition: `NAMES` (every name, in declaration
/// order), `name()` and `parse()`.
#[macro_export]
macro_rules! named_enum {
    ($t:ty { $($v:ident => $n:literal),* $(,)? }) => {
        impl $t {
            /// Every name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($n),*];
            /// Its name.
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$v => $n,)*
                }
            }
            /// The value named `s`, if any.
            pub fn parse(s: &str) -> Option<Self> {
                match s {
                    $($n => Some(Self::$v),)*
                    _ => None,
                }
            }
        }
    };
}

pub mod counters;
pub mod domain;
pub mod event;
pub mod frame;
pub mod grant;
pub mod iommu;
pub mod mmu;
pub mod profile;
pub mod sched;
pub mod store;
pub mod time;
pub mod types;
pub mod vcpu;
pub mod xen;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};

pub use domain::{DiskPiece, Domain, DomainConfig, DomainError, OwnPage};
pub use event::{ChannelState, EvtchnError, IrqHandler, Virq};
pub use grant::{CopyPtr, GrantCopy, GrantError, GrantPath, GrantStatus, GrantVersion, MapOp};
pub use mem::{MachineMemory, MapBackend, PageAccess, PAGE_SIZE};
pub use types::*;
pub use vcpu::{Vcpu, VcpuStart, WaitMode, HALT_POLL_DEFAULT};
pub use xen::{Pvio, Xen};

use frame::FrameTable;

/// How to build a machine.
#[derive(Debug, Clone, Copy)]
pub struct HvConfig {
    /// Frames of machine memory.
    pub frames: u32,
    /// Grant implementation.
    pub grant_path: GrantPath,
    /// How domains' foreign-map windows are implemented (the software page table by
    /// default; see [`mem::MapBackend`]).
    pub map_backend: MapBackend,
    /// Where devices' DMA writes land (in memory by default: the papers' platforms).
    pub dma_landing: iommu::DmaLanding,
}

impl Default for HvConfig {
    fn default() -> Self {
        Self {
            frames: 16 * 1024,
            grant_path: GrantPath::Optimised,
            map_backend: MapBackend::Table,
            dma_landing: iommu::DmaLanding::Memory,
        }
    }
}

/// Why a machine or domain could not be built.
#[derive(Debug, thiserror::Error)]
pub enum HvError {
    /// Not enough free machine frames.
    #[error("out of machine memory")]
    OutOfMemory,
    /// No free domain id.
    #[error("too many domains")]
    TooManyDomains,
    /// The kernel refused memory or address space.
    #[error("os: {0}")]
    Os(#[from] std::io::Error),
    /// The domain does not exist.
    #[error("no such domain {0}")]
    NoSuchDomain(DomId),
}

/// Most domains alive at once.
pub const MAX_DOMAINS: usize = 256;
/// Interrupt vectors.
pub const NR_VECTORS: usize = 256;

/// The machine: memory, domains, and the hypercall interface.
#[derive(Debug)]
pub struct Hypervisor {
    pub(crate) mem: Arc<MachineMemory>,
    pub(crate) frames: Arc<FrameTable>,
    domains: RwLock<Vec<Option<Arc<Domain>>>>,
    /// Where the search for a free domain id starts: ids rotate, as Xen's do, so a
    /// destroyed domain's id is not given straight to the next domain (a peer that
    /// still names the old one must not reach the new one).
    next_domid: std::sync::atomic::AtomicUsize,
    pub(crate) grant_optimised: AtomicBool,
    pub(crate) irqs: Box<[AtomicU64]>,
    /// Per vector, the line's state at the interrupt controller (`event::IRQ_*`).
    pub(crate) irq_lines: Box<[AtomicU8]>,
    pub(crate) irq_unbound: AtomicU64,
    /// Per vector, the hypervisor's own handler if it is routed to one
    /// ([`Hypervisor::bind_irq_handler`]) rather than to a domain's port.
    pub(crate) irq_handlers: event::IrqHandlers,
    store: store::Store,
    iommu: Arc<iommu::Iommu>,
    /// Frames of destroyed domains still referenced by someone; freed by `reap`.
    zombies: Mutex<Vec<Mfn>>,
    /// Destroyed domains whose code still holds a handle: their frames wait, so that
    /// nothing it does (even an access that passed its liveness check just before the
    /// destruction) can reach a frame that another domain has since been given.
    dead: Mutex<Vec<Arc<Domain>>>,
    /// Time zero of the hypervisor's clock (`NOW()`).
    boot: std::time::Instant,
    /// How new domains' foreign-map windows are implemented.
    map_backend: MapBackend,
}

impl Hypervisor {
    /// Builds a machine.
    pub fn new(cfg: HvConfig) -> Result<Arc<Self>, HvError> {
        let mem = Arc::new(MachineMemory::new(cfg.frames)?);
        let frames = Arc::new(FrameTable::new(cfg.frames));
        let iommu = Arc::new(iommu::Iommu::new(Arc::clone(&mem), cfg.dma_landing));
        let hv = Arc::new(Self {
            mem,
            frames,
            domains: RwLock::new(vec![None; MAX_DOMAINS]),
            next_domid: std::sync::atomic::AtomicUsize::new(0),
            grant_optimised: AtomicBool::new(cfg.grant_path == GrantPath::Optimised),
            map_backend: cfg.map_backend,
            irqs: (0..NR_VECTORS).map(|_| AtomicU64::new(0)).collect(),
            irq_lines: (0..NR_VECTORS).map(|_| AtomicU8::new(0)).collect(),
            irq_unbound: AtomicU64::new(0),
            irq_handlers: event::IrqHandlers::new(NR_VECTORS),
            store: store::Store::new(),
            iommu,
            zombies: Mutex::new(Vec::new()),
            dead: Mutex::new(Vec::new()),
            boot: std::time::Instant::now(),
        });
        hv.iommu_setup()?;
        Ok(hv)
    }

    /// The hypervisor's system time (`NOW()`): time since the machine started.
    #[inline]
    pub fn now(&self) -> std::time::Duration {
        self.boot.elapsed()
    }

    /// Machine memory (for device models' DMA through the IOMMU, and tools).
    pub fn machine_memory(&self) -> &Arc<MachineMemory> {
        &self.mem
    }
    /// The frame table.
    pub fn frame_table(&self) -> &FrameTable {
        &self.frames
    }
    /// The store.
    pub fn store(&self) -> &store::Store {
        &self.store
    }
    /// The IOMMU.
    pub fn iommu(&self) -> &Arc<iommu::Iommu> {
        &self.iommu
    }

    /// Looks a domain up (`rcu_lock_domain_by_id`).
    #[inline]
    pub fn domain(&self, id: DomId) -> Option<Arc<Domain>> {
        let d = self.domains.read().unwrap_or_else(|p| p.into_inner());
        d.get(id.0 as usize)?
            .as_ref()
            .filter(|d| !d.is_dying())
            .cloned()
    }

    /// Creates a domain: allocates and scrubs its frames, builds its P2M, grant table,
    /// event channels and window. Frames are scrubbed so that nothing of a previous
    /// owner survives.
    pub fn create_domain(&self, cfg: &DomainConfig) -> Result<Arc<Domain>, HvError> {
        self.create_domain_in(cfg, None)
    }

    /// As [`Hypervisor::create_domain`], with a window that Linux's grant device fills
    /// (see [`xen::Dom0`]): the domain stands for a real dom0 process's own memory.
    pub(crate) fn create_domain_in(
        &self,
        cfg: &DomainConfig,
        gntdev: Option<Arc<mem::xen::Gntdev>>,
    ) -> Result<Arc<Domain>, HvError> {
        let mut doms = self.domains.write().unwrap_or_else(|p| p.into_inner());
        let from = self.next_domid.load(Ordering::Relaxed);
        let id = (0..MAX_DOMAINS)
            .map(|k| (from + k) % MAX_DOMAINS)
            .find(|&i| doms[i].is_none())
            .ok_or(HvError::TooManyDomains)?;
        self.next_domid.store(id + 1, Ordering::Relaxed);
        let id = DomId(id as u16);
        let mut p2m = Vec::with_capacity(cfg.pages as usize);
        for _ in 0..cfg.pages {
            match self.frames.alloc(id) {
                Ok(m) => {
                    let _ = self.mem.fill(m, 0, PAGE_SIZE, 0);
                    self.frames.set_m2p(m, Gfn(p2m.len() as u32));
                    p2m.push(m);
                }
                Err(_) => {
                    for m in p2m {
                        let _ = self.frames.free(m);
                    }
                    return Err(HvError::OutOfMemory);
                }
            }
        }
        let d = Arc::new(Domain::new(
            id,
            cfg,
            Arc::clone(&self.mem),
            Arc::clone(&self.frames),
            p2m.into_boxed_slice(),
            self.map_backend,
            gntdev,
        )?);
        doms[id.0 as usize] = Some(Arc::clone(&d));
        Ok(d)
    }

    /// Destroys a domain: its mappings of others' grants are unmapped and released, its
    /// event channels closed (peers see them unbound), its devices detached from the
    /// IOMMU, and its frames freed once nothing references them.
    pub fn destroy_domain(&self, id: DomId) -> Result<(), HvError> {
        let d = self.domain(id).ok_or(HvError::NoSuchDomain(id))?;
        d.dying.store(true, Ordering::Release);
        let handles = d
            .maptrack
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .handles();
        let mut st = vec![Ok(()); handles.len()];
        self.grant_unmap(&d, &handles, &mut st);
        let open: Vec<Port> = d.evtchn.open_ports().collect();
        for p in open {
            let _ = self.evtchn_close(&d, p);
        }
        self.mmu_teardown(&d);
        self.iommu.detach_domain(id);
        self.iommu_teardown(id);
        // Its store transactions end unapplied, as xenstored ends a dead domain's.
        self.store.end_transactions_of(id);
        for v in d.vcpus.iter() {
            v.kick();
        }
        self.domains.write().unwrap_or_else(|p| p.into_inner())[id.0 as usize] = None;
        self.dead.lock().unwrap_or_else(|p| p.into_inner()).push(d);
        self.reap();
        Ok(())
    }

    /// Frees the frames of destroyed domains once no handle to the domain remains and
    /// nothing references the frame. Returns how many frames of destroyed domains are
    /// still held back.
    ///
    /// It first releases what destruction could not: a grant mapping that the dying
    /// domain's code still held open (a ring it was reading) when it was destroyed is
    /// unmapped here once that code has let go, so that the granting guest can end its
    /// grant (Xen's `gnttab_release_mappings`, which a real hypervisor can do at once
    /// because it need not wait for the dead domain's code).
    pub fn reap(&self) -> usize {
        let dying: Vec<Arc<Domain>> = self.dead.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for d in &dying {
            let handles = d
                .maptrack
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .handles();
            if !handles.is_empty() {
                let mut st = vec![Ok(()); handles.len()];
                self.grant_unmap(d, &handles, &mut st);
            }
        }
        drop(dying);
        let mut dead = self.dead.lock().unwrap_or_else(|p| p.into_inner());
        let mut z = self.zombies.lock().unwrap_or_else(|p| p.into_inner());
        // The list holds the last handle: the domain left the table at destruction, so
        // no new handle can be made, and a count of one cannot rise again.
        dead.retain(|d| {
            if Arc::strong_count(d) > 1 {
                return true;
            }
            z.extend(d.p2m.iter().copied());
            false
        });
        z.retain(|&m| self.frames.free(m).is_err());
        z.len() + dead.iter().map(|d| d.p2m.len()).sum::<usize>()
    }

    /// The machine frame behind a domain's guest frame (a privileged look-up for tools
    /// and tests; domains themselves never need machine frame numbers).
    pub fn gfn_to_mfn(&self, dom: &Domain, gfn: Gfn) -> Option<Mfn> {
        dom.gfn_to_mfn(gfn).ok()
    }

    /// All live domains.
    pub fn domains(&self) -> Vec<Arc<Domain>> {
        self.domains
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .flatten()
            .cloned()
            .collect()
    }
}
