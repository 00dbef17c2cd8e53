//! Domains: their frames (P2M), an accessor to their own memory only, their grant table,
//! event channels, foreign-map window and vCPUs.
//!
//! Guest frame layout (fixed at creation, so that tests and tools can find things):
//!
//! | gfn | what |
//! |---|---|
//! | 0 | shared info: vCPU info blocks, event pending and mask bitmaps |
//! | 1 .. 1+G | grant-table frames (entries) |
//! | then S frames | v2 grant status frames (none for v1) |
//! | the rest | the domain's own pages, handed out by [`Domain::alloc_page`] |

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mem::{FramePage, MachineMemory, MapWindow, MemError, PageAccess};

use crate::event::EventChannels;
use crate::grant::{GrantError, GrantTable, GrantVersion, Maptrack};
use crate::types::{DomId, Gfn, Mfn};
use crate::vcpu::VcpuState;

/// What a new domain gets.
#[derive(Debug, Clone)]
pub struct DomainConfig {
    /// A name for reports.
    pub name: String,
    /// Frames of memory, including the reserved ones of the layout above.
    pub pages: u32,
    /// Grant-table frames (entries: 512 per frame for v1, 256 for v2).
    pub grant_frames: u32,
    /// Grant-table layout.
    pub grant_version: GrantVersion,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Pages of the foreign-map window (how many grants it can map at once).
    pub map_slots: u32,
    /// A driver domain: its time counts as `kernel0`/`xen0` in Table 3.
    pub driver_domain: bool,
}

impl Default for DomainConfig {
    fn default() -> Self {
        Self {
            name: "guest".into(),
            pages: 1024,
            grant_frames: 4,
            grant_version: GrantVersion::V1,
            vcpus: 1,
            map_slots: 1024,
            driver_domain: false,
        }
    }
}

/// An empty piece (an array's filling).
const NO_PIECE: mem::IoPiece = mem::IoPiece::Frame {
    mfn: Mfn(0),
    offset: 0,
    len: 0,
};

/// A piece of a disk transfer ([`Domain::file_io`]): bytes of a page the domain maps at
/// a window slot (a guest's), or of one of its own pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskPiece {
    /// `len` bytes from `offset` of the page mapped at `slot`.
    Window {
        /// The window slot.
        slot: u32,
        /// Where in the page.
        offset: usize,
        /// How many bytes.
        len: usize,
    },
    /// `len` bytes from `offset` of the domain's own page `gfn`.
    Own {
        /// The page.
        gfn: Gfn,
        /// Where in it.
        offset: usize,
        /// How many bytes.
        len: usize,
    },
}

/// Why a domain operation on its own memory was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DomainError {
    /// The guest frame is beyond this domain's memory.
    #[error("guest frame {0:#x} is not this domain's")]
    BadGfn(u32),
    /// The access does not fit in the page, or is misaligned.
    #[error("bad access: {0}")]
    Access(#[from] MemError),
    /// The domain has no free page left.
    #[error("domain out of memory")]
    OutOfMemory,
    /// The domain is being destroyed.
    #[error("domain is dying")]
    Dying,
    /// The page is one of the domain's page tables (pinned, or not yet made writable
    /// again): its own writes are refused, as a PV kernel's mapping of a page table is
    /// read-only. Changes go through `mmu_update`.
    #[error("guest frame {0:#x} is a page table")]
    PageTable(u32),
}

/// A domain. Code running "inside" a domain holds an `Arc<Domain>` for its own memory
/// and calls the [`crate::Hypervisor`] for everything foreign.
#[derive(Debug)]
pub struct Domain {
    pub(crate) id: DomId,
    pub(crate) name: String,
    pub(crate) driver_domain: bool,
    pub(crate) mem: Arc<MachineMemory>,
    /// The machine's frame table: the owner's writes look at a frame's type.
    pub(crate) frames: Arc<crate::frame::FrameTable>,
    /// Guest frame → machine frame. Fixed for the domain's life, so lookups need no lock.
    pub(crate) p2m: Box<[Mfn]>,
    free_pages: Mutex<Vec<Gfn>>,
    pub(crate) grant: GrantTable,
    pub(crate) evtchn: EventChannels,
    pub(crate) window: Arc<MapWindow>,
    pub(crate) maptrack: Mutex<Maptrack>,
    pub(crate) vcpus: Box<[VcpuState]>,
    pub(crate) dying: AtomicBool,
    /// Failed grant operations this domain asked for, per [`GrantError::index`]. Only
    /// touched on failure, so off the data path.
    pub(crate) grant_errors: [AtomicU64; GrantError::REASONS],
    /// Whether a device is assigned to this domain, so that its grant maps must also
    /// appear in its IOMMU context (for the device to reach mapped foreign pages).
    pub(crate) iommu_grants: AtomicBool,
    /// The PV memory manager's state: pinned tables, base pointers, flush policy.
    pub(crate) mmu: crate::mmu::PvMmu,
}

/// The shared-info frame.
pub const SHARED_INFO_GFN: Gfn = Gfn(0);
/// First grant-table frame.
pub const GRANT_FRAMES_START: u32 = 1;

impl Domain {
    pub(crate) fn new(
        id: DomId,
        cfg: &DomainConfig,
        mem: Arc<MachineMemory>,
        frames: Arc<crate::frame::FrameTable>,
        p2m: Box<[Mfn]>,
        map_backend: mem::MapBackend,
        gntdev: Option<Arc<mem::xen::Gntdev>>,
    ) -> std::io::Result<Self> {
        let grant = GrantTable::new(cfg.grant_version, cfg.grant_frames);
        let reserved = GRANT_FRAMES_START + grant.entry_frames() + grant.status_frames();
        let pages = p2m.len() as u32;
        let free_pages = (reserved..pages).rev().map(Gfn).collect();
        let window = Arc::new(match gntdev {
            Some(g) => MapWindow::with_gntdev(Arc::clone(&mem), cfg.map_slots, g)?,
            None => MapWindow::with_backend(Arc::clone(&mem), cfg.map_slots, map_backend)?,
        });
        Ok(Self {
            id,
            name: cfg.name.clone(),
            driver_domain: cfg.driver_domain,
            mem,
            frames,
            p2m,
            free_pages: Mutex::new(free_pages),
            grant,
            evtchn: EventChannels::new(),
            window,
            maptrack: Mutex::new(Maptrack::new(cfg.map_slots)),
            vcpus: (0..cfg.vcpus.max(1)).map(VcpuState::new).collect(),
            dying: AtomicBool::new(false),
            grant_errors: std::array::from_fn(|_| AtomicU64::new(0)),
            iommu_grants: AtomicBool::new(false),
            mmu: crate::mmu::PvMmu::new(cfg.vcpus.max(1), pages),
        })
    }

    /// This domain's identifier.
    pub fn id(&self) -> DomId {
        self.id
    }
    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Whether it is a driver domain.
    pub fn is_driver_domain(&self) -> bool {
        self.driver_domain
    }
    /// Number of guest frames.
    pub fn pages(&self) -> u32 {
        self.p2m.len() as u32
    }
    /// Number of vCPUs.
    pub fn vcpu_count(&self) -> u32 {
        self.vcpus.len() as u32
    }
    /// Whether destruction has begun.
    pub fn is_dying(&self) -> bool {
        self.dying.load(Ordering::Acquire)
    }

    /// Machine frame of one of this domain's guest frames (the hypervisor's own
    /// look-up, which also serves while the domain is torn down).
    #[inline]
    pub(crate) fn gfn_to_mfn(&self, gfn: Gfn) -> Result<Mfn, DomainError> {
        self.p2m
            .get(gfn.0 as usize)
            .copied()
            .ok_or(DomainError::BadGfn(gfn.0))
    }

    /// The machine frame behind one of the domain's pages, as a PV guest reads it from
    /// its own physical-to-machine table (it is not secret from the guest). Only the
    /// lab's unsafe stand-in puts it on a ring.
    pub fn pv_machine_frame(&self, gfn: Gfn) -> Option<Mfn> {
        self.gfn_to_mfn(gfn).ok()
    }

    /// The frame behind one of the domain's own pages, for an access by the domain's
    /// code: refused once destruction has begun, so code of a dead domain that still
    /// runs reaches nothing (its frames are not handed on while it holds this handle
    /// either: see [`crate::Hypervisor::reap`]).
    #[inline]
    fn own(&self, gfn: Gfn) -> Result<Mfn, DomainError> {
        if self.is_dying() {
            return Err(DomainError::Dying);
        }
        self.gfn_to_mfn(gfn)
    }

    /// [`Self::own`] for a write: also refused if the page is a page table (one load of
    /// its type; see [`crate::frame::FrameTable::is_page_table`]).
    #[inline]
    fn own_w(&self, gfn: Gfn) -> Result<Mfn, DomainError> {
        let m = self.own(gfn)?;
        if self.frames.is_page_table(m) {
            return Err(DomainError::PageTable(gfn.0));
        }
        Ok(m)
    }

    /// Hands out one of the domain's free pages (its kernel's page allocator).
    pub fn alloc_page(&self) -> Result<Gfn, DomainError> {
        self.free_pages
            .lock()
            .map_err(|_| DomainError::OutOfMemory)?
            .pop()
            .ok_or(DomainError::OutOfMemory)
    }
    /// Returns a page to the domain's allocator.
    pub fn free_page(&self, gfn: Gfn) -> Result<(), DomainError> {
        self.gfn_to_mfn(gfn)?;
        self.free_pages
            .lock()
            .map_err(|_| DomainError::OutOfMemory)?
            .push(gfn);
        Ok(())
    }
    /// Free pages left.
    pub fn free_page_count(&self) -> usize {
        self.free_pages.lock().map(|f| f.len()).unwrap_or(0)
    }

    /// Copies bytes out of one of this domain's pages.
    #[inline]
    pub fn read(&self, gfn: Gfn, offset: usize, buf: &mut [u8]) -> Result<(), DomainError> {
        Ok(self.mem.read(self.own(gfn)?, offset, buf)?)
    }
    /// Copies bytes into one of this domain's pages.
    #[inline]
    pub fn write(&self, gfn: Gfn, offset: usize, data: &[u8]) -> Result<(), DomainError> {
        Ok(self.mem.write(self.own_w(gfn)?, offset, data)?)
    }
    /// Copies bytes between two of this domain's pages (its kernel's `memcpy`).
    #[inline]
    pub fn copy(
        &self,
        src: Gfn,
        src_offset: usize,
        dst: Gfn,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DomainError> {
        let (s, d) = (self.own(src)?, self.own_w(dst)?);
        Ok(self.mem.copy(s, src_offset, d, dst_offset, len)?)
    }
    /// Hints that byte `offset` of this domain's page `gfn` is about to be read (or
    /// written, with `write`): see [`mem::MachineMemory::prefetch`]. A page the domain
    /// does not have is ignored.
    #[inline]
    pub fn prefetch(&self, gfn: Gfn, offset: usize, write: bool) {
        if let Ok(m) = self.gfn_to_mfn(gfn) {
            self.mem.prefetch(m, offset, write);
        }
    }
    /// Copies bytes of one of this domain's pages into the foreign page it maps at
    /// window `slot` (see [`mem::MapWindow::copy_in`]).
    pub fn copy_to_window(
        &self,
        src: Gfn,
        src_offset: usize,
        slot: u32,
        offset: usize,
        len: usize,
    ) -> Result<(), DomainError> {
        Ok(self
            .window
            .copy_in(slot, offset, self.own(src)?, src_offset, len)?)
    }
    /// Moves bytes between file `fd` (from byte `pos` on) and `pieces` in one vectored
    /// call: pages this domain maps at window slots, and its own pages by frame number
    /// (see [`mem::MapWindow::read_file_vectored`]). `read` fills the pieces from the
    /// file; else they are written to it. A page the domain does not own refuses the
    /// whole transfer before any byte moves.
    pub fn file_io(
        &self,
        read: bool,
        pieces: &[DiskPiece],
        fd: std::os::fd::BorrowedFd<'_>,
        pos: u64,
    ) -> Result<(), DomainError> {
        let mut at = [NO_PIECE; mem::MAX_IO_PIECES];
        let at = self.io_pieces(read, pieces, &mut at)?;
        Ok(if read {
            self.window.read_file_vectored(at, fd, pos)
        } else {
            self.window.write_file_vectored(at, fd, pos)
        }?)
    }

    /// [`Domain::file_io`] through `ring`'s file, placed to end later: the transfer
    /// holds its slots until `ring` reports it ended with `tag` ([`mem::uring`]).
    pub fn file_io_start(
        &self,
        ring: &mut mem::uring::FileRing,
        read: bool,
        pieces: &[DiskPiece],
        pos: u64,
        tag: u64,
    ) -> Result<(), DomainError> {
        let mut at = [NO_PIECE; mem::MAX_IO_PIECES];
        let at = self.io_pieces(read, pieces, &mut at)?;
        Ok(if read {
            ring.read(&self.window, at, pos, tag)
        } else {
            ring.write(&self.window, at, pos, tag)
        }?)
    }

    /// Where `pieces` lie, for the window: a page of the domain's own by its frame (one
    /// it owns, writable for a `read`).
    fn io_pieces<'a>(
        &self,
        read: bool,
        pieces: &[DiskPiece],
        at: &'a mut [mem::IoPiece; mem::MAX_IO_PIECES],
    ) -> Result<&'a [mem::IoPiece], DomainError> {
        if pieces.len() > at.len() {
            return Err(DomainError::Access(MemError::TooManyPieces(pieces.len())));
        }
        for (a, p) in at.iter_mut().zip(pieces) {
            *a = match *p {
                DiskPiece::Window { slot, offset, len } => mem::IoPiece::Slot { slot, offset, len },
                DiskPiece::Own { gfn, offset, len } => mem::IoPiece::Frame {
                    mfn: if read {
                        self.own_w(gfn)?
                    } else {
                        self.own(gfn)?
                    },
                    offset,
                    len,
                },
            };
        }
        Ok(&at[..pieces.len()])
    }

    /// Copies bytes of one of this domain's pages into a foreign page it maps and holds
    /// (see [`mem::MappedPage::copy_in`]): no reference taken per copy.
    #[inline]
    pub fn copy_to_page(
        &self,
        src: Gfn,
        src_offset: usize,
        page: &mem::MappedPage,
        offset: usize,
        len: usize,
    ) -> Result<(), DomainError> {
        Ok(page.copy_in(offset, self.own(src)?, src_offset, len)?)
    }
    /// Copies bytes of a foreign page this domain maps and holds into one of its own
    /// pages (see [`mem::MappedPage::copy_out`]): no reference taken per copy.
    #[inline]
    pub fn copy_from_page(
        &self,
        page: &mem::MappedPage,
        offset: usize,
        dst: Gfn,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DomainError> {
        Ok(page.copy_out(offset, self.own_w(dst)?, dst_offset, len)?)
    }
    /// Copies bytes of the foreign page this domain maps at window `slot` into one of
    /// its own pages (see [`mem::MapWindow::copy_out`]).
    pub fn copy_from_window(
        &self,
        slot: u32,
        offset: usize,
        dst: Gfn,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DomainError> {
        Ok(self
            .window
            .copy_out(slot, offset, self.own_w(dst)?, dst_offset, len)?)
    }
    /// Ones'-complement sum of bytes of one of this domain's pages (see
    /// [`mem::MachineMemory::csum_partial`]).
    #[inline]
    pub fn csum_partial(&self, gfn: Gfn, offset: usize, len: usize) -> Result<u16, DomainError> {
        Ok(self.mem.csum_partial(self.own(gfn)?, offset, len)?)
    }
    /// Fills part of one of this domain's pages.
    pub fn fill(&self, gfn: Gfn, offset: usize, len: usize, byte: u8) -> Result<(), DomainError> {
        Ok(self.mem.fill(self.own_w(gfn)?, offset, len, byte)?)
    }
    /// A 16-bit word of this domain's memory as an atomic.
    pub fn atomic_u16(&self, gfn: Gfn, offset: usize) -> Result<&AtomicU16, DomainError> {
        Ok(self.mem.atomic_u16(self.own_w(gfn)?, offset)?)
    }
    /// A 32-bit word of this domain's memory as an atomic.
    pub fn atomic_u32(&self, gfn: Gfn, offset: usize) -> Result<&AtomicU32, DomainError> {
        Ok(self.mem.atomic_u32(self.own_w(gfn)?, offset)?)
    }
    /// A 64-bit word of this domain's memory as an atomic.
    pub fn atomic_u64(&self, gfn: Gfn, offset: usize) -> Result<&AtomicU64, DomainError> {
        Ok(self.mem.atomic_u64(self.own_w(gfn)?, offset)?)
    }
    /// One of this domain's pages as a [`mem::PageAccess`] (to host a shared ring, say).
    /// It holds the domain, and every access through it is refused once the domain is
    /// being destroyed.
    pub fn page(self: &Arc<Self>, gfn: Gfn) -> Result<OwnPage, DomainError> {
        Ok(OwnPage {
            page: FramePage::new(Arc::clone(&self.mem), self.own_w(gfn)?)?,
            dom: Arc::clone(self),
        })
    }
    /// How many of this domain's grant operations failed for `reason`.
    pub fn grant_error_count(&self, reason: GrantError) -> u64 {
        self.grant_errors[reason.index()].load(Ordering::Relaxed)
    }

    /// Failed grant operations of this domain, all reasons together.
    pub fn grant_errors_total(&self) -> u64 {
        self.grant_errors
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    pub(crate) fn count_grant_error(&self, e: GrantError) {
        self.grant_errors[e.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Exact CPU time of all the domain's vCPUs (thread CPU clocks).
    pub fn cpu_time(&self) -> std::time::Duration {
        self.vcpus.iter().map(|v| v.cpu_time()).sum()
    }

    /// Profiler samples of all the domain's vCPUs, per class.
    pub fn class_samples(&self) -> crate::profile::ClassSamples {
        crate::profile::ClassSamples::collect(self.vcpus.iter().map(|v| v.samples()))
    }

    /// The domain's vCPUs (CPU time, samples, wake counters).
    pub fn vcpus(&self) -> &[VcpuState] {
        &self.vcpus
    }
    /// This domain's foreign-map window: where grant maps land; read and write mapped
    /// pages through it.
    pub fn window(&self) -> &Arc<MapWindow> {
        &self.window
    }
    /// The domain's grant table (the guest side: issuing and revoking grants).
    pub fn grant_table(&self) -> crate::grant::GuestGrants<'_> {
        crate::grant::GuestGrants::new(self)
    }
}

/// One of a domain's own pages, kept by the domain's code (a ring it hosts). Holding
/// it holds the domain, so its frame goes to no other domain while it lives; every
/// access first checks that the domain is not being destroyed.
#[derive(Debug, Clone)]
pub struct OwnPage {
    dom: Arc<Domain>,
    page: FramePage,
}

impl OwnPage {
    #[inline]
    fn live(&self) -> Result<&FramePage, MemError> {
        if self.dom.is_dying() {
            return Err(MemError::Revoked);
        }
        Ok(&self.page)
    }
}

impl PageAccess for OwnPage {
    #[inline]
    fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        self.live()?.read(offset, buf)
    }
    #[inline]
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.live()?.write(offset, data)
    }
    #[inline]
    fn write_nt(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.live()?.write_nt(offset, data)
    }
    #[inline]
    fn atomic_u16(&self, offset: usize) -> Result<&AtomicU16, MemError> {
        self.live()?.atomic_u16(offset)
    }
    #[inline]
    fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, MemError> {
        self.live()?.atomic_u32(offset)
    }
    #[inline]
    fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, MemError> {
        self.live()?.atomic_u64(offset)
    }
    #[inline]
    fn read_obj<T: bytemuck::Pod>(&self, offset: usize) -> Result<T, MemError> {
        self.live()?.read_obj(offset)
    }
    #[inline]
    fn write_obj<T: bytemuck::Pod>(&self, offset: usize, v: &T) -> Result<(), MemError> {
        self.live()?.write_obj(offset, v)
    }
}
