//! Foreign-map windows: the slots at which a domain maps other domains' frames (grant
//! maps), with two implementations chosen per window ([`MapBackend`]).
//!
//! * [`MapBackend::Table`] (the default) is a software page table, as a hypervisor keeps
//!   one: a map validates the slot and writes one entry (the frame and its rights), an
//!   access translates through the entry and reaches the frame in machine memory, and an
//!   unmap clears the entry and then waits until no access that translated through it
//!   is still running (the TLB shoot-down: in Xen, the flush IPI to every CPU that may
//!   hold the translation, and the wait for their acknowledgement). A batch of unmaps
//!   clears every entry first and waits once, as `gnttab_unmap_refs` flushes once per
//!   batch.
//! * [`MapBackend::Mmap`] puts the frame at a reserved address with
//!   `mmap(MAP_FIXED | MAP_SHARED)` of the machine-memory file and takes it away with
//!   `mmap(PROT_NONE)`. What that costs is Linux's: a VMA split and merge under the
//!   process's mmap lock per call, 15–20× a full-size grant copy; it is kept to measure
//!   beside the table, not as a model of what a hypervisor does.
//! * A window over Linux's grant device ([`MapWindow::with_gntdev`]) is a reservation
//!   like `Mmap`'s whose slots a real Xen fills: [`MapWindow::map_grant`] asks
//!   `/dev/xen/gntdev` for the grant and maps it at the slot, and an unmap takes the
//!   page away and gives the grant back. Everything that reaches a slot's bytes goes
//!   through its address, with the same slot protocol as the other two.

use std::os::fd::{AsFd, AsRawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::xen::Gntdev;
use crate::{
    check_in_page, shared, FramePage, MachineMemory, MemError, Mfn, PageAccess, PAGE_SHIFT,
    PAGE_SIZE,
};

// Slot entry word: accesses in flight (a copy through the slot) in the low 12 bits,
// holders (a `MappedPage`, a mapped ring say) in the next 12; the flags say whether a
// frame is mapped and how.
pub(crate) const INFLIGHT_ONE: u32 = 1;
const INFLIGHT_MASK: u32 = (1 << 12) - 1;
pub(crate) const HOLD_ONE: u32 = 1 << 12;
const HOLDS_MASK: u32 = ((1 << 12) - 1) << 12;
const MAPPED: u32 = 1 << 28;
const WRITABLE: u32 = 1 << 29;
/// A map or unmap is changing this slot's entry: no new access may translate through it.
const CHANGING: u32 = 1 << 30;

/// How a window implements its mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MapBackend {
    /// A software page table: entry writes, checked translation, shoot-down by waiting.
    #[default]
    Table,
    /// Real `mmap(MAP_FIXED)` / `mmap(PROT_NONE)` of a reserved address range.
    Mmap,
}

impl MapBackend {
    /// Its name, as configurations and reports give it.
    pub fn name(self) -> &'static str {
        match self {
            MapBackend::Table => "table",
            MapBackend::Mmap => "mmap",
        }
    }
}

/// What a slot holds, as seen at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// No frame is mapped.
    Unmapped,
    /// A frame is mapped read-only.
    ReadOnly,
    /// A frame is mapped read-write.
    ReadWrite,
}

/// Pieces one vectored file transfer takes at most (a blkif request's 256 segments;
/// Linux's `IOV_MAX` is 1024).
pub const MAX_IO_PIECES: usize = 256;

/// A piece of a vectored file transfer ([`MapWindow::read_file_vectored`]): bytes of the
/// frame mapped at a window slot, or of one of the caller's own frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoPiece {
    /// `len` bytes from `offset` of the page mapped at `slot`.
    Slot {
        /// The window slot.
        slot: u32,
        /// Where in the page.
        offset: usize,
        /// How many bytes.
        len: usize,
    },
    /// `len` bytes from `offset` of the caller's frame `mfn`.
    Frame {
        /// The frame.
        mfn: Mfn,
        /// Where in it.
        offset: usize,
        /// How many bytes.
        len: usize,
    },
}

impl IoPiece {
    /// Its offset in its page and its length.
    pub fn range(&self) -> (usize, usize) {
        match *self {
            IoPiece::Slot { offset, len, .. } | IoPiece::Frame { offset, len, .. } => (offset, len),
        }
    }
}

/// Moves every byte `iov` describes between it and a file from byte `pos` on, calling
/// `io(iovecs left, file offset)` (a `preadv` or `pwritev`) until all have moved: a
/// short transfer goes on from where it stopped, an interrupted call is made again, the
/// file's end is `EIO`.
pub(crate) fn vectored_io(
    iov: &mut [libc::iovec],
    pos: u64,
    mut io: impl FnMut(&[libc::iovec], libc::off_t) -> isize,
) -> Result<(), MemError> {
    let total: usize = iov.iter().map(|v| v.iov_len).sum();
    let (mut first, mut done) = (0, 0);
    while done < total {
        let at =
            libc::off_t::try_from(pos + done as u64).map_err(|_| MemError::Os(libc::EINVAL))?;
        let mut n = match io(&iov[first..], at) {
            0 => return Err(MemError::Os(libc::EIO)),
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(MemError::Os(e.raw_os_error().unwrap_or(libc::EIO)));
            }
            n => n as usize,
        };
        done += n;
        while n > 0 && first < iov.len() {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: `n < iov_len`, so the pointer stays inside the piece.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// An iovec that covers nothing (an array's filling before use).
pub(crate) const EMPTY_IOVEC: libc::iovec = libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
};

/// A window of `slots` page-sized slots.
///
/// Access is refused unless the slot is mapped (and writable, for a write). An unmap is
/// refused while a [`MappedPage`] holds the slot ([`MemError::InUse`]); accesses in
/// flight are waited for. So no safe call can ever reach a frame through a slot after
/// its unmap returned.
#[derive(Debug)]
pub struct MapWindow {
    backend: MapBackend,
    /// The reserved address range (the `Mmap` backend only).
    base: Option<NonNull<u8>>,
    slots: u32,
    state: Box<[AtomicU32]>,
    mfns: Box<[AtomicU32]>,
    mem: Arc<MachineMemory>,
    /// Linux's grant device, for a window a real Xen fills (its slots' `mfns` then hold
    /// the device's page index for each mapping).
    gntdev: Option<Arc<Gntdev>>,
    shootdowns: AtomicU64,
}

// SAFETY: the window's memory is only reached through the slot protocol below (users
// counted in atomics); the raw base pointer is an address range owned by `self`.
unsafe impl Send for MapWindow {}
// SAFETY: as above.
unsafe impl Sync for MapWindow {}

impl MapWindow {
    /// A window of `slots` slots over `mem`, a software page table.
    pub fn new(mem: Arc<MachineMemory>, slots: u32) -> std::io::Result<Self> {
        Self::with_backend(mem, slots, MapBackend::Table)
    }

    /// A window of `slots` slots over `mem` implemented by `backend` (the `Mmap` backend
    /// reserves `slots` pages of address space, `PROT_NONE`).
    pub fn with_backend(
        mem: Arc<MachineMemory>,
        slots: u32,
        backend: MapBackend,
    ) -> std::io::Result<Self> {
        let base = match backend {
            MapBackend::Table => None,
            MapBackend::Mmap => {
                let bytes = (slots.max(1) as usize) * PAGE_SIZE;
                // SAFETY: a fresh anonymous PROT_NONE reservation at a kernel-chosen
                // address.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        bytes,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    return Err(std::io::Error::last_os_error());
                }
                Some(
                    NonNull::new(p.cast::<u8>())
                        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?,
                )
            }
        };
        Ok(Self {
            backend,
            base,
            slots,
            state: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            mfns: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            mem,
            gntdev: None,
            shootdowns: AtomicU64::new(0),
        })
    }

    /// A window of `slots` slots that `/dev/xen/gntdev` fills with a real Xen's grants
    /// ([`MapWindow::map_grant`]); `mem` is the process's own memory, which copies in
    /// and out of the slots name as their other side.
    pub fn with_gntdev(
        mem: Arc<MachineMemory>,
        slots: u32,
        gntdev: Arc<Gntdev>,
    ) -> std::io::Result<Self> {
        let mut w = Self::with_backend(mem, slots, MapBackend::Mmap)?;
        w.gntdev = Some(gntdev);
        Ok(w)
    }

    /// Maps domain `dom`'s grant `gref` at `slot` through the grant device (a window made
    /// by [`MapWindow::with_gntdev`] only): the device reserves it, `mmap(MAP_FIXED)` of
    /// the device at the slot's address maps it, and Xen checks the grant then. An
    /// error leaves the slot empty.
    pub fn map_grant(
        &self,
        slot: u32,
        dom: u16,
        gref: u32,
        writable: bool,
    ) -> Result<(), MemError> {
        let dev = self.gntdev.as_ref().ok_or(MemError::Os(libc::ENODEV))?;
        let word = self.word(slot)?;
        let addr = self.addr(slot).ok_or(MemError::Os(libc::ENODEV))?;
        if word
            .compare_exchange(0, CHANGING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return Err(MemError::AlreadyMapped(slot));
        }
        let fail = |e: std::io::Error| {
            word.store(0, Ordering::Release);
            MemError::Os(e.raw_os_error().unwrap_or(libc::EIO))
        };
        let index = dev.reserve(dom, gref).map_err(fail)?;
        // The slot is claimed CHANGING and was unmapped: no accessor holds it.
        if let Err(e) = map_page(addr, dev.as_fd().as_raw_fd(), index, writable) {
            let _ = dev.release(index);
            return Err(fail(e));
        }
        // `reserve` checked that the page index fits.
        self.open(slot, (index >> PAGE_SHIFT) as u32, writable);
        Ok(())
    }

    /// Opens a claimed slot's entry on what it now maps (a frame, or the grant
    /// device's page index).
    fn open(&self, slot: u32, what: u32, writable: bool) {
        self.mfns[slot as usize].store(what, Ordering::Relaxed);
        // Release: an accessor that sees MAPPED also sees the frame.
        self.state[slot as usize].store(
            MAPPED | if writable { WRITABLE } else { 0 },
            Ordering::Release,
        );
    }

    /// The address of the page at `slot` when the window reaches its slots by address
    /// and the slot holds something other than a frame of `mem` (a grant device window).
    fn foreign_addr(&self, slot: u32) -> Option<*mut u8> {
        self.gntdev.as_ref().and(self.addr(slot))
    }

    /// Its implementation.
    pub fn backend(&self) -> MapBackend {
        self.backend
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Shoot-downs done so far: one per unmap call that cleared any entry, however many
    /// it cleared.
    pub fn shootdowns(&self) -> u64 {
        self.shootdowns.load(Ordering::Relaxed)
    }

    fn word(&self, slot: u32) -> Result<&AtomicU32, MemError> {
        self.state
            .get(slot as usize)
            .ok_or(MemError::NoSuchSlot(slot))
    }

    /// The address of `slot` in the `Mmap` backend's reservation.
    fn addr(&self, slot: u32) -> Option<*mut u8> {
        // SAFETY: callers pass `slot < self.slots` (checked by `word`), so the offset is
        // inside the reservation made in `with_backend`.
        self.base
            .map(|b| unsafe { b.as_ptr().add(slot as usize * PAGE_SIZE) })
    }

    /// What the slot holds now.
    pub fn state(&self, slot: u32) -> Result<SlotState, MemError> {
        let s = self.word(slot)?.load(Ordering::Acquire);
        Ok(if s & MAPPED == 0 || s & CHANGING != 0 {
            SlotState::Unmapped
        } else if s & WRITABLE != 0 {
            SlotState::ReadWrite
        } else {
            SlotState::ReadOnly
        })
    }

    /// The frame mapped at `slot`, if any.
    pub fn mfn(&self, slot: u32) -> Result<Option<Mfn>, MemError> {
        Ok(match self.state(slot)? {
            SlotState::Unmapped => None,
            _ => Some(Mfn(self.mfns[slot as usize].load(Ordering::Relaxed))),
        })
    }

    /// Maps machine frame `mfn` at `slot`: writes its entry (the `Mmap` backend: a real
    /// `mmap(MAP_FIXED)` first).
    pub fn map(&self, slot: u32, mfn: Mfn, writable: bool) -> Result<(), MemError> {
        let word = self.word(slot)?;
        if self.gntdev.is_some() {
            // Only the grant device fills its window.
            return Err(MemError::Os(libc::ENODEV));
        }
        if mfn.0 >= self.mem.frames() {
            return Err(MemError::NoSuchFrame(mfn.0));
        }
        // Claim the empty slot; nobody can access it meanwhile (not MAPPED).
        if word
            .compare_exchange(0, CHANGING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return Err(MemError::AlreadyMapped(slot));
        }
        if let Some(addr) = self.addr(slot) {
            // The slot was unmapped and is claimed CHANGING: no accessor holds it.
            let fd = self.mem.fd().as_raw_fd();
            if let Err(e) = map_page(addr, fd, mfn.byte_offset(), writable) {
                word.store(0, Ordering::Release);
                return Err(MemError::Os(e.raw_os_error().unwrap_or(0)));
            }
        }
        self.open(slot, mfn.0, writable);
        Ok(())
    }

    /// Unmaps the frame at `slot`; see [`MapWindow::unmap_batch`].
    pub fn unmap(&self, slot: u32) -> Result<Mfn, MemError> {
        let mut out = [Err(MemError::NotMapped(slot))];
        self.unmap_batch(&[slot], &mut out);
        out[0]
    }

    /// Unmaps the frames at `slots`, one result each: every entry is closed to new
    /// accesses first, then one shoot-down waits for the accesses in flight through any
    /// of them, then the entries are cleared (the `Mmap` backend: each range goes back
    /// to `PROT_NONE`). A slot held by a [`MappedPage`] is refused with
    /// [`MemError::InUse`] and left mapped.
    pub fn unmap_batch(&self, slots: &[u32], out: &mut [Result<Mfn, MemError>]) {
        let n = slots.len().min(out.len());
        let mut closed = 0;
        for (&slot, o) in slots[..n].iter().zip(out.iter_mut()) {
            *o = self.close(slot);
            closed += usize::from(o.is_ok());
        }
        if closed == 0 {
            return;
        }
        // The shoot-down: every access that translated through a closed entry ends.
        self.shootdowns.fetch_add(1, Ordering::Relaxed);
        for (&slot, o) in slots[..n].iter().zip(out.iter()) {
            if o.is_ok() {
                let word = &self.state[slot as usize];
                let mut spins = 0u32;
                while word.load(Ordering::Acquire) & INFLIGHT_MASK != 0 {
                    spins += 1;
                    if spins < 128 {
                        std::hint::spin_loop();
                    } else {
                        // The access's thread is descheduled: let it finish.
                        std::thread::yield_now();
                    }
                }
            }
        }
        for (&slot, o) in slots[..n].iter().zip(out.iter_mut()) {
            if o.is_err() {
                continue;
            }
            let word = &self.state[slot as usize];
            if let Some(addr) = self.addr(slot) {
                // SAFETY: replaces one page of our own reservation; the slot is CHANGING
                // with no accesses in flight and no holders, so no reference into it
                // exists.
                let p = unsafe {
                    libc::mmap(
                        addr.cast(),
                        PAGE_SIZE,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_FIXED
                            | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                    // Still mapped: open the entry again.
                    word.fetch_and(!CHANGING, Ordering::Release);
                    *o = Err(MemError::Os(e));
                    continue;
                }
            }
            if let Some(dev) = &self.gntdev {
                // The page is gone from this process; the grant goes back with it.
                let index =
                    u64::from(self.mfns[slot as usize].load(Ordering::Relaxed)) << PAGE_SHIFT;
                if let Err(e) = dev.release(index) {
                    *o = Err(MemError::Os(e.raw_os_error().unwrap_or(libc::EIO)));
                }
            }
            word.store(0, Ordering::Release);
        }
    }

    /// Closes a mapped, unheld slot's entry to new accesses; its frame.
    fn close(&self, slot: u32) -> Result<Mfn, MemError> {
        let word = self.word(slot)?;
        let mut s = word.load(Ordering::Acquire);
        loop {
            if s & MAPPED == 0 || s & CHANGING != 0 {
                return Err(MemError::NotMapped(slot));
            }
            if s & HOLDS_MASK != 0 {
                return Err(MemError::InUse(slot));
            }
            match word.compare_exchange_weak(s, s | CHANGING, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(Mfn(self.mfns[slot as usize].load(Ordering::Relaxed))),
                Err(now) => s = now,
            }
        }
    }

    /// Translates through a mapped slot's entry and registers one more user (`one`: an
    /// access in flight or a holder); fails if the slot is not mapped (or is read-only
    /// and `write` is asked).
    fn enter(&self, slot: u32, write: bool, one: u32) -> Result<Mfn, MemError> {
        let word = self.word(slot)?;
        let mask = if one == HOLD_ONE {
            HOLDS_MASK
        } else {
            INFLIGHT_MASK
        };
        let mut s = word.load(Ordering::Acquire);
        loop {
            if s & MAPPED == 0 || s & CHANGING != 0 {
                return Err(MemError::NotMapped(slot));
            }
            if write && s & WRITABLE == 0 {
                return Err(MemError::ReadOnly(slot));
            }
            if s & mask == mask {
                return Err(MemError::InUse(slot));
            }
            // Cannot overflow into the next field: checked against its mask above.
            match word.compare_exchange_weak(s, s + one, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return Ok(Mfn(self.mfns[slot as usize].load(Ordering::Relaxed))),
                Err(now) => s = now,
            }
        }
    }

    fn leave(&self, slot: u32, one: u32) {
        // Release: our accesses happen before an unmapper sees the count drop.
        self.state[slot as usize].fetch_sub(one, Ordering::Release);
    }

    /// Copies bytes out of the frame mapped at `slot`.
    pub fn read(&self, slot: u32, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        check_in_page(offset, buf.len())?;
        let mfn = self.enter(slot, false, INFLIGHT_ONE)?;
        let r = match self.addr(slot) {
            Some(addr) => {
                // SAFETY: the slot is mapped and counted as in use, so it cannot be
                // unmapped during the copy; the range is inside the page (checked above).
                unsafe { shared::copy(addr.add(offset), buf.as_mut_ptr(), buf.len()) };
                Ok(())
            }
            None => self.mem.read(mfn, offset, buf),
        };
        self.leave(slot, INFLIGHT_ONE);
        r
    }

    /// Copies bytes into the frame mapped at `slot`; refused for a read-only mapping.
    pub fn write(&self, slot: u32, offset: usize, data: &[u8]) -> Result<(), MemError> {
        check_in_page(offset, data.len())?;
        let mfn = self.enter(slot, true, INFLIGHT_ONE)?;
        let r = match self.addr(slot) {
            Some(addr) => {
                // SAFETY: as in `read`; the mapping is writable (checked by `enter`).
                unsafe { shared::copy(data.as_ptr(), addr.add(offset), data.len()) };
                Ok(())
            }
            None => self.mem.write(mfn, offset, data),
        };
        self.leave(slot, INFLIGHT_ONE);
        r
    }

    /// Hints that byte `offset` of the page mapped at `slot` is about to be read, or
    /// written with `write` (see [`MachineMemory::prefetch`]). Takes no reference: a
    /// slot unmapped meanwhile costs a useless prefetch, never an access.
    #[inline]
    pub fn prefetch(&self, slot: u32, offset: usize, write: bool) {
        if self.gntdev.is_some() {
            return;
        }
        if let Ok(Some(mfn)) = self.mfn(slot) {
            self.mem.prefetch(mfn, offset, write);
        }
    }

    /// Copies `len` bytes of frame `src` from `src_offset` into the frame mapped at
    /// `slot` (a driver domain copying its own buffer into a guest page it maps): one
    /// copy, frame to frame; refused for a read-only mapping. The caller owns `src`.
    pub fn copy_in(
        &self,
        slot: u32,
        offset: usize,
        src: Mfn,
        src_offset: usize,
        len: usize,
    ) -> Result<(), MemError> {
        check_in_page(offset, len)?;
        let mfn = self.enter(slot, true, INFLIGHT_ONE)?;
        let r = match self.foreign_addr(slot) {
            Some(addr) => self.mem.ptr(src, src_offset, len).map(|from| {
                // SAFETY: `from` is checked inside machine memory; the slot is mapped,
                // writable and counted in use, and the range is inside its page.
                unsafe { shared::copy(from, addr.add(offset), len) }
            }),
            None => self.mem.copy(src, src_offset, mfn, offset, len),
        };
        self.leave(slot, INFLIGHT_ONE);
        r
    }

    /// Copies `len` bytes of the frame mapped at `slot` from `offset` into frame `dst`
    /// at `dst_offset` (the caller's own): one copy, frame to frame.
    pub fn copy_out(
        &self,
        slot: u32,
        offset: usize,
        dst: Mfn,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), MemError> {
        check_in_page(offset, len)?;
        let mfn = self.enter(slot, false, INFLIGHT_ONE)?;
        let r = match self.foreign_addr(slot) {
            Some(addr) => self.mem.ptr(dst, dst_offset, len).map(|to| {
                // SAFETY: `to` is checked inside machine memory; the slot is mapped and
                // counted in use, and the range is inside its page.
                unsafe { shared::copy(addr.add(offset), to, len) }
            }),
            None => self.mem.copy(mfn, offset, dst, dst_offset, len),
        };
        self.leave(slot, INFLIGHT_ONE);
        r
    }

    /// Reads file `fd` from byte `pos` on into `pieces`, one after another (a block back
    /// end's read of a whole request, landing in the guest's pages it maps and in its
    /// own): one `preadv` for all of them, a short transfer carried on from where it
    /// stopped. A slot must be mapped writable. A file that ends first is `EIO`; more
    /// than [`MAX_IO_PIECES`] pieces is refused.
    pub fn read_file_vectored(
        &self,
        pieces: &[IoPiece],
        fd: std::os::fd::BorrowedFd<'_>,
        pos: u64,
    ) -> Result<(), MemError> {
        self.file_vectored(pieces, fd, pos, true)
    }

    /// Writes `pieces`, one after another, to file `fd` from byte `pos` on (a block back
    /// end's write of a whole request): one `pwritev`.
    pub fn write_file_vectored(
        &self,
        pieces: &[IoPiece],
        fd: std::os::fd::BorrowedFd<'_>,
        pos: u64,
    ) -> Result<(), MemError> {
        self.file_vectored(pieces, fd, pos, false)
    }

    fn file_vectored(
        &self,
        pieces: &[IoPiece],
        fd: std::os::fd::BorrowedFd<'_>,
        pos: u64,
        read: bool,
    ) -> Result<(), MemError> {
        let mut iov = [EMPTY_IOVEC; MAX_IO_PIECES];
        self.hold_pieces(pieces, read, INFLIGHT_ONE, &mut iov)?;
        let r = vectored_io(&mut iov[..pieces.len()], pos, |v, at| {
            let n = v.len() as libc::c_int;
            if read {
                // SAFETY: each iovec covers bytes inside a mapped, held page or one of
                // the process's frames (`hold_pieces`); the kernel writes into them as
                // into any shared memory, and no Rust reference to them exists.
                unsafe { libc::preadv(fd.as_raw_fd(), v.as_ptr(), n, at) }
            } else {
                // SAFETY: as above; the kernel only reads them.
                unsafe { libc::pwritev(fd.as_raw_fd(), v.as_ptr(), n, at) }
            }
        });
        self.release_pieces(pieces, INFLIGHT_ONE);
        r
    }

    /// Holds every slot among `pieces` in use (none can be unmapped; a read's must be
    /// writable) and writes where each piece's bytes lie into `iov`, until
    /// [`MapWindow::release_pieces`]: the memory a transfer by the kernel moves. `one`
    /// says how: as an access in flight (`INFLIGHT_ONE`: a `preadv` now, which an unmap
    /// waits for) or as a holder (`HOLD_ONE`: an io_uring transfer that ends later,
    /// which an unmap is refused for, as for a [`MappedPage`]). Refused whole, nothing
    /// held, if a piece lies outside its page, a slot is not mapped so, or there are
    /// more than [`MAX_IO_PIECES`] pieces.
    pub(crate) fn hold_pieces(
        &self,
        pieces: &[IoPiece],
        read: bool,
        one: u32,
        iov: &mut [libc::iovec; MAX_IO_PIECES],
    ) -> Result<(), MemError> {
        if pieces.len() > MAX_IO_PIECES {
            return Err(MemError::TooManyPieces(pieces.len()));
        }
        for p in pieces {
            let (offset, len) = p.range();
            check_in_page(offset, len)?;
        }
        for (i, p) in pieces.iter().enumerate() {
            let (offset, len) = p.range();
            let base = match *p {
                IoPiece::Slot { slot, .. } => match self.enter(slot, read, one) {
                    Ok(mfn) => match self.foreign_addr(slot) {
                        // SAFETY: the slot's page is mapped (entered above) and
                        // `offset` lies inside it (checked above).
                        Some(a) => Ok(unsafe { a.add(offset) }),
                        // A frame of this machine's own: reached where it lives.
                        None => self.mem.ptr(mfn, offset, len),
                    }
                    .inspect_err(|_| self.leave(slot, one)),
                    Err(e) => Err(e),
                },
                IoPiece::Frame { mfn, .. } => self.mem.ptr(mfn, offset, len),
            };
            match base {
                Ok(b) => {
                    iov[i] = libc::iovec {
                        iov_base: b.cast(),
                        iov_len: len,
                    }
                }
                Err(e) => {
                    self.release_pieces(&pieces[..i], one);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Lets go of the slots [`MapWindow::hold_pieces`] held for `pieces`.
    pub(crate) fn release_pieces(&self, pieces: &[IoPiece], one: u32) {
        for p in pieces {
            if let IoPiece::Slot { slot, .. } = *p {
                self.leave(slot, one);
            }
        }
    }

    /// Holds the page at `slot` for repeated access (a mapped ring, say) until dropped;
    /// the slot cannot be unmapped meanwhile.
    pub fn page(self: &Arc<Self>, slot: u32) -> Result<MappedPage, MemError> {
        let mfn = self.enter(slot, false, HOLD_ONE)?;
        let writable = self.state(slot)? == SlotState::ReadWrite;
        let frame = match self.backend {
            MapBackend::Table => match FramePage::new(Arc::clone(&self.mem), mfn) {
                Ok(f) => Some(f),
                Err(e) => {
                    self.leave(slot, HOLD_ONE);
                    return Err(e);
                }
            },
            MapBackend::Mmap => None,
        };
        Ok(MappedPage {
            window: Arc::clone(self),
            slot,
            writable,
            frame,
        })
    }
}

impl Drop for MapWindow {
    fn drop(&mut self) {
        if let Some(base) = self.base {
            // SAFETY: unmaps the whole reservation (with any frames still mapped in it);
            // `&mut self` means no accessor or `MappedPage` (which holds an Arc) is alive.
            unsafe { libc::munmap(base.as_ptr().cast(), self.slots.max(1) as usize * PAGE_SIZE) };
        }
    }
}

/// Maps one page of `fd` from byte `offset` at `addr`, a page of a window's own
/// reservation that nothing refers to (its slot claimed and empty).
fn map_page(
    addr: *mut u8,
    fd: std::os::fd::RawFd,
    offset: u64,
    writable: bool,
) -> std::io::Result<()> {
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: replaces exactly one page of the window's own reservation, which no Rust
    // object refers to (the caller holds its slot claimed, with no accessor).
    let p = unsafe {
        libc::mmap(
            addr.cast(),
            PAGE_SIZE,
            prot,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A mapped window slot held open for access; see [`MapWindow::page`]. Holding it keeps
/// the translation, as a kernel keeps a pointer into a page it mapped: the slot cannot
/// be unmapped while it lives.
#[derive(Debug)]
pub struct MappedPage {
    window: Arc<MapWindow>,
    slot: u32,
    writable: bool,
    /// The frame, translated once (the `Table` backend); `None`: through the reserved
    /// address (the `Mmap` backend).
    frame: Option<FramePage>,
}

impl MappedPage {
    /// The slot this page occupies.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    #[inline]
    fn at(&self, offset: usize, len: usize, align: usize) -> Result<*mut u8, MemError> {
        if !offset.is_multiple_of(align) {
            return Err(MemError::Misaligned(offset));
        }
        check_in_page(offset, len)?;
        let addr = self
            .window
            .addr(self.slot)
            .ok_or(MemError::NotMapped(self.slot))?;
        // SAFETY: in bounds of the page (checked), which stays mapped while `self` lives.
        Ok(unsafe { addr.add(offset) })
    }

    #[inline]
    fn writable(&self) -> Result<(), MemError> {
        if self.writable {
            Ok(())
        } else {
            Err(MemError::ReadOnly(self.slot))
        }
    }

    #[inline]
    fn atomic_at(&self, offset: usize, size: usize) -> Result<*mut u8, MemError> {
        // Atomics are read-modify-write capable: refuse them on a read-only mapping.
        self.writable()?;
        self.at(offset, size, size)
    }
}

impl MappedPage {
    /// Copies `len` bytes of frame `src` (the caller's own) from `src_offset` into this
    /// page at `offset`: one copy, frame to frame, as [`MapWindow::copy_in`] but with no
    /// reference taken per copy, since the hold keeps the page mapped (a driver
    /// domain writing through a mapping it keeps, with plain stores, as through a
    /// page-table entry). Refused for a read-only mapping.
    #[inline]
    pub fn copy_in(
        &self,
        offset: usize,
        src: Mfn,
        src_offset: usize,
        len: usize,
    ) -> Result<(), MemError> {
        self.writable()?;
        let mem = &self.window.mem;
        if let Some(f) = &self.frame {
            return mem.copy(src, src_offset, f.mfn(), offset, len);
        }
        let d = self.at(offset, len, 1)?;
        let s = mem.ptr(src, src_offset, len)?;
        // SAFETY: `s..s+len` is inside the machine memory (checked by `ptr`) and
        // `d..d+len` inside the held, mapped, writable page (checked by `at`); they may
        // be the same frame through two addresses, which `shared::copy` tolerates as a
        // byte-wise copy.
        unsafe { shared::copy(s, d, len) };
        Ok(())
    }

    /// Copies `len` bytes of this page from `offset` into frame `dst` (the caller's own)
    /// at `dst_offset`: the read twin of [`Self::copy_in`], no reference taken.
    #[inline]
    pub fn copy_out(
        &self,
        offset: usize,
        dst: Mfn,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), MemError> {
        let mem = &self.window.mem;
        if let Some(f) = &self.frame {
            return mem.copy(f.mfn(), offset, dst, dst_offset, len);
        }
        let s = self.at(offset, len, 1)?;
        let d = mem.ptr(dst, dst_offset, len)?;
        // SAFETY: `s..s+len` is inside the held, mapped page (checked by `at`) and
        // `d..d+len` inside the machine memory (checked by `ptr`); the same frame
        // through two addresses is tolerated as in `copy_in`.
        unsafe { shared::copy(s, d, len) };
        Ok(())
    }

    /// Hints that byte `offset` of this page is about to be read, or written with
    /// `write` (see [`MachineMemory::prefetch`]).
    #[inline]
    pub fn prefetch(&self, offset: usize, write: bool) {
        if let Some(f) = &self.frame {
            self.window.mem.prefetch(f.mfn(), offset, write);
        } else if let Ok(p) = self.at(offset, 1, 1) {
            shared::prefetch(p, write);
        }
    }
}

impl PageAccess for MappedPage {
    #[inline]
    fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        if let Some(f) = &self.frame {
            return f.read(offset, buf);
        }
        let p = self.at(offset, buf.len(), 1)?;
        // SAFETY: `p..p+len` is in the held, mapped page; `buf` is separate memory.
        unsafe { shared::copy(p, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }
    #[inline]
    fn read_obj<T: bytemuck::Pod>(&self, offset: usize) -> Result<T, MemError> {
        if let Some(f) = &self.frame {
            return f.read_obj(offset);
        }
        let p = self.at(offset, std::mem::size_of::<T>(), 1)?;
        // SAFETY: in the held, mapped page; `T` is Pod.
        Ok(unsafe { shared::read_obj(p) })
    }
    #[inline]
    fn write_obj<T: bytemuck::Pod>(&self, offset: usize, v: &T) -> Result<(), MemError> {
        self.writable()?;
        if let Some(f) = &self.frame {
            return f.write_obj(offset, v);
        }
        let p = self.at(offset, std::mem::size_of::<T>(), 1)?;
        // SAFETY: in the held, writable mapped page; `T` is Pod.
        unsafe { shared::write_obj(p, v) };
        Ok(())
    }
    #[inline]
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.writable()?;
        if let Some(f) = &self.frame {
            return f.write(offset, data);
        }
        let p = self.at(offset, data.len(), 1)?;
        // SAFETY: as in `read`; the mapping is writable.
        unsafe { shared::copy(data.as_ptr(), p, data.len()) };
        Ok(())
    }
    #[inline]
    fn write_nt(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.writable()?;
        if let Some(f) = &self.frame {
            return f.write_nt(offset, data);
        }
        let p = self.at(offset, data.len(), 1)?;
        // SAFETY: `p..p+len` is in the held, writable mapped page, checked by `at`.
        unsafe { shared::stream(p, data) };
        Ok(())
    }
    #[inline]
    fn atomic_u16(&self, offset: usize) -> Result<&AtomicU16, MemError> {
        if let Some(f) = &self.frame {
            self.writable()?;
            return f.atomic_u16(offset);
        }
        let p = self.atomic_at(offset, 2)?;
        // SAFETY: aligned, in a writable mapped page that outlives the borrow of `self`.
        Ok(unsafe { AtomicU16::from_ptr(p.cast()) })
    }
    #[inline]
    fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, MemError> {
        if let Some(f) = &self.frame {
            self.writable()?;
            return f.atomic_u32(offset);
        }
        let p = self.atomic_at(offset, 4)?;
        // SAFETY: as in `atomic_u16`.
        Ok(unsafe { AtomicU32::from_ptr(p.cast()) })
    }
    /// As the default, but through a read-only mapping too: only a load is made.
    #[inline]
    fn load_u32(&self, offset: usize, order: std::sync::atomic::Ordering) -> Result<u32, MemError> {
        if let Some(f) = &self.frame {
            return Ok(f.atomic_u32(offset)?.load(order));
        }
        let p = self.at(offset, 4, 4)?;
        // SAFETY: aligned, in a mapped page (readable, if not writable) held for the
        // call; the atomic is only loaded from and does not outlive the call.
        Ok(unsafe { AtomicU32::from_ptr(p.cast()) }.load(order))
    }
    #[inline]
    fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, MemError> {
        if let Some(f) = &self.frame {
            self.writable()?;
            return f.atomic_u64(offset);
        }
        let p = self.atomic_at(offset, 8)?;
        // SAFETY: as in `atomic_u16`.
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) })
    }
}

impl Drop for MappedPage {
    fn drop(&mut self) {
        self.window.leave(self.slot, HOLD_ONE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BACKENDS: [MapBackend; 2] = [MapBackend::Table, MapBackend::Mmap];

    #[test]
    fn a_mapping_shows_the_frame_and_unmap_removes_it() {
        for backend in BACKENDS {
            let mem = Arc::new(MachineMemory::new(8).expect("memfd"));
            mem.write(Mfn(5), 10, b"hello").expect("write");
            let w =
                Arc::new(MapWindow::with_backend(Arc::clone(&mem), 4, backend).expect("window"));
            let mut b = [0u8; 5];
            assert_eq!(w.read(1, 10, &mut b), Err(MemError::NotMapped(1)));
            w.map(1, Mfn(5), false).expect("map");
            w.read(1, 10, &mut b).expect("read");
            assert_eq!(&b, b"hello");
            assert_eq!(w.write(1, 0, b"x"), Err(MemError::ReadOnly(1)));
            assert_eq!(w.map(1, Mfn(6), true), Err(MemError::AlreadyMapped(1)));
            {
                let held = w.page(1).expect("held");
                assert_eq!(w.unmap(1), Err(MemError::InUse(1)), "{backend:?}");
                assert_eq!(held.read_obj::<u8>(10), Ok(b'h'));
                assert_eq!(held.write(0, b"x"), Err(MemError::ReadOnly(1)));
                assert_eq!(held.write_nt(0, b"x"), Err(MemError::ReadOnly(1)));
                assert!(held.atomic_u32(0).is_err(), "no atomics on a read-only map");
                // ...but a load of an index its peer moves, whole.
                mem.atomic_u32(Mfn(5), 16)
                    .expect("peer's word")
                    .store(0xdead_beef, std::sync::atomic::Ordering::Release);
                assert_eq!(
                    held.load_u32(16, std::sync::atomic::Ordering::Acquire),
                    Ok(0xdead_beef)
                );
                assert!(held
                    .load_u32(18, std::sync::atomic::Ordering::Acquire)
                    .is_err());
            }
            assert_eq!(w.unmap(1), Ok(Mfn(5)));
            assert_eq!(w.read(1, 10, &mut b), Err(MemError::NotMapped(1)));
            assert_eq!(w.unmap(1), Err(MemError::NotMapped(1)));
            // Writable mapping: writes land in machine memory, held or not.
            w.map(2, Mfn(6), true).expect("map rw");
            w.write(2, 0, b"abc").expect("write");
            w.page(2).expect("held").write(3, b"d").expect("held write");
            let mut c = [0u8; 4];
            mem.read(Mfn(6), 0, &mut c).expect("read");
            assert_eq!(&c, b"abcd");
            // A posted write lands every byte at any offset, and no other byte.
            let posted: Vec<u8> = (0..77u8).collect();
            w.page(2)
                .expect("held")
                .write_nt(4093 - 77, &posted)
                .expect("posted");
            let mut all = vec![0u8; 4096];
            mem.read(Mfn(6), 0, &mut all).expect("read");
            assert_eq!(&all[4093 - 77..4093], &posted[..]);
            assert_eq!(&all[..4], b"abcd");
            assert!(all[4..4093 - 77]
                .iter()
                .chain(&all[4093..])
                .all(|&b| b == 0));
            assert_eq!(
                w.page(2).expect("held").write_nt(4090, &posted),
                Err(MemError::CrossesPage {
                    offset: 4090,
                    len: 77
                })
            );
            assert_eq!(w.map(9, Mfn(6), true), Err(MemError::NoSuchSlot(9)));
            assert_eq!(w.map(3, Mfn(8), true), Err(MemError::NoSuchFrame(8)));
        }
    }

    #[test]
    fn a_held_page_copies_frame_to_frame_both_ways_and_only_as_mapped() {
        for backend in BACKENDS {
            let mem = Arc::new(MachineMemory::new(8).expect("memfd"));
            let w = Arc::new(MapWindow::with_backend(Arc::clone(&mem), 4, backend).expect("w"));
            let data: Vec<u8> = (0..200u32).map(|i| (i * 7 % 251) as u8).collect();
            mem.write(Mfn(2), 100, &data).expect("source");
            w.map(0, Mfn(5), true).expect("map rw");
            w.map(1, Mfn(6), false).expect("map ro");
            let (rw, ro) = (w.page(0).expect("held"), w.page(1).expect("held"));
            // In: the bytes land at the offset asked, in the mapped frame only.
            rw.copy_in(3000, Mfn(2), 100, 200).expect("copy in");
            let mut b = vec![0u8; PAGE_SIZE];
            mem.read(Mfn(5), 0, &mut b).expect("frame");
            assert_eq!(&b[3000..3200], &data[..], "{backend:?}");
            assert!(b[..3000].iter().chain(&b[3200..]).all(|&x| x == 0));
            // A read-only mapping takes no copy in; a copy past the page is refused.
            assert_eq!(ro.copy_in(0, Mfn(2), 0, 8), Err(MemError::ReadOnly(1)));
            assert!(rw.copy_in(4000, Mfn(2), 0, 200).is_err());
            assert!(rw.copy_in(0, Mfn(8), 0, 8).is_err(), "no such source frame");
            // Out, from either mapping, into a frame of the caller's.
            mem.write(Mfn(6), 10, b"read-only bytes").expect("peer");
            ro.copy_out(10, Mfn(3), 50, 15).expect("copy out");
            rw.copy_out(3000, Mfn(3), 0, 50).expect("copy out");
            let mut c = [0u8; 65];
            mem.read(Mfn(3), 0, &mut c).expect("frame");
            assert_eq!(&c[..50], &data[..50]);
            assert_eq!(&c[50..], b"read-only bytes");
            assert!(ro.copy_out(4090, Mfn(3), 0, 10).is_err());
            // A prefetch changes nothing, anywhere (past the page too).
            rw.prefetch(3000, true);
            ro.prefetch(PAGE_SIZE + 5, false);
            mem.prefetch(Mfn(99), 0, true);
            mem.read(Mfn(5), 0, &mut b).expect("frame");
            assert_eq!(&b[3000..3200], &data[..]);
            // Held, the slots cannot go.
            assert_eq!(w.unmap(0), Err(MemError::InUse(0)));
            drop((rw, ro));
            assert_eq!(w.unmap(0), Ok(Mfn(5)));
        }
    }

    /// A file of `len` bytes (`i % 251`) for a test named `tag`, opened read-write: its
    /// path, the file and its bytes.
    fn patterned_file(
        tag: &str,
        backend: MapBackend,
        len: u32,
    ) -> (std::path::PathBuf, std::fs::File, Vec<u8>) {
        let path = std::env::temp_dir().join(format!(
            "pvio-window-{tag}-{}-{}",
            std::process::id(),
            backend.name()
        ));
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).expect("file");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open");
        (path, f, data)
    }

    #[test]
    fn a_file_is_read_into_and_written_from_a_mapped_frame_and_only_as_mapped() {
        use std::os::fd::AsFd;
        let slot = |slot, offset, len| IoPiece::Slot { slot, offset, len };
        for backend in BACKENDS {
            let mem = Arc::new(MachineMemory::new(8).expect("memfd"));
            let w = Arc::new(MapWindow::with_backend(Arc::clone(&mem), 4, backend).expect("w"));
            let (path, f, data) = patterned_file("file", backend, 8192);
            assert_eq!(
                w.read_file_vectored(&[slot(0, 0, 512)], f.as_fd(), 0),
                Err(MemError::NotMapped(0))
            );
            w.map(0, Mfn(3), true).expect("map");
            w.map(1, Mfn(4), false).expect("map");
            // Sectors 3..5 of the file land at byte 512 of the frame, nowhere else.
            w.read_file_vectored(&[slot(0, 512, 1024)], f.as_fd(), 1536)
                .expect("read");
            let mut b = vec![0u8; PAGE_SIZE];
            mem.read(Mfn(3), 0, &mut b).expect("frame");
            assert!(b[..512].iter().all(|&x| x == 0) && b[1536..].iter().all(|&x| x == 0));
            assert_eq!(&b[512..1536], &data[1536..2560]);
            // Into a read-only mapping: refused; past the file's end: an error.
            assert_eq!(
                w.read_file_vectored(&[slot(1, 0, 512)], f.as_fd(), 0),
                Err(MemError::ReadOnly(1))
            );
            assert_eq!(
                w.read_file_vectored(&[slot(0, 0, 1024)], f.as_fd(), 7680),
                Err(MemError::Os(libc::EIO))
            );
            // Out of a read-only mapping into the file.
            mem.fill(Mfn(4), 0, PAGE_SIZE, 0xab).expect("fill");
            w.write_file_vectored(&[slot(1, 0, 512)], f.as_fd(), 4096)
                .expect("write");
            let back = std::fs::read(&path).expect("read back");
            assert!(back[4096..4608].iter().all(|&x| x == 0xab));
            assert_eq!(&back[..4096], &data[..4096]);
            assert_eq!(&back[4608..], &data[4608..]);
            let _ = std::fs::remove_file(&path);
        }
    }

    #[test]
    fn a_request_moves_between_a_file_and_its_pages_in_one_vectored_call_and_only_as_mapped() {
        use std::os::fd::AsFd;
        for backend in BACKENDS {
            let mem = Arc::new(MachineMemory::new(8).expect("memfd"));
            let w = Arc::new(MapWindow::with_backend(Arc::clone(&mem), 4, backend).expect("w"));
            let (path, f, data) = patterned_file("vectored", backend, 16384);
            w.map(0, Mfn(3), true).expect("map");
            w.map(1, Mfn(4), false).expect("map");
            // A guest page's tail, one of our own frames whole, another guest page's head.
            let pieces = [
                IoPiece::Slot {
                    slot: 0,
                    offset: 3584,
                    len: 512,
                },
                IoPiece::Frame {
                    mfn: Mfn(6),
                    offset: 0,
                    len: PAGE_SIZE,
                },
                IoPiece::Slot {
                    slot: 0,
                    offset: 0,
                    len: 1024,
                },
            ];
            w.read_file_vectored(&pieces, f.as_fd(), 512).expect("read");
            let mut b = vec![0u8; PAGE_SIZE];
            mem.read(Mfn(3), 0, &mut b).expect("frame");
            assert_eq!(&b[3584..], &data[512..1024]);
            assert_eq!(&b[..1024], &data[1024 + PAGE_SIZE..2048 + PAGE_SIZE]);
            assert!(b[1024..3584].iter().all(|&x| x == 0));
            mem.read(Mfn(6), 0, &mut b).expect("frame");
            assert_eq!(&b[..], &data[1024..1024 + PAGE_SIZE]);
            // Into a read-only mapping: refused, and nothing is held after.
            let ro = [IoPiece::Slot {
                slot: 1,
                offset: 0,
                len: 512,
            }];
            assert_eq!(
                w.read_file_vectored(&ro, f.as_fd(), 0),
                Err(MemError::ReadOnly(1))
            );
            assert_eq!(
                w.read_file_vectored(&pieces, f.as_fd(), 16384 - 1024),
                Err(MemError::Os(libc::EIO)),
                "past the file's end"
            );
            // Out of the read-only mapping and a frame, into the file, in order.
            mem.fill(Mfn(4), 0, PAGE_SIZE, 0xab).expect("fill");
            mem.fill(Mfn(7), 0, PAGE_SIZE, 0xcd).expect("fill");
            let out = [
                IoPiece::Slot {
                    slot: 1,
                    offset: 0,
                    len: 512,
                },
                IoPiece::Frame {
                    mfn: Mfn(7),
                    offset: 100,
                    len: 1000,
                },
            ];
            w.write_file_vectored(&out, f.as_fd(), 8192).expect("write");
            let back = std::fs::read(&path).expect("read back");
            assert!(back[8192..8704].iter().all(|&x| x == 0xab));
            assert!(back[8704..9704].iter().all(|&x| x == 0xcd));
            assert_eq!(&back[..8192], &data[..8192]);
            assert_eq!(&back[9704..], &data[9704..]);
            assert_eq!(w.unmap(0), Ok(Mfn(3)), "no slot left held");
            let crossing = [IoPiece::Frame {
                mfn: Mfn(7),
                offset: 4000,
                len: 200,
            }];
            assert!(w.write_file_vectored(&crossing, f.as_fd(), 0).is_err());
            let _ = std::fs::remove_file(&path);
        }
    }

    #[test]
    fn a_short_transfer_carries_on_from_where_it_stopped() {
        let src: Vec<u8> = (0..3000u32).map(|i| (i % 241) as u8).collect();
        let mut a = vec![0u8; 1000];
        let mut b = vec![0u8; 7];
        let mut c = vec![0u8; 1993];
        let mut iov = [&mut a, &mut b, &mut c].map(|v| libc::iovec {
            iov_base: v.as_mut_ptr().cast(),
            iov_len: v.len(),
        });
        let mut calls = 0;
        // A kernel that moves at most 13 bytes a call, and is interrupted once.
        vectored_io(&mut iov, 0, |v, at| {
            calls += 1;
            if calls == 2 {
                // SAFETY: sets this thread's errno, as an interrupted call does.
                unsafe { *libc::__errno_location() = libc::EINTR };
                return -1;
            }
            let n = v[0].iov_len.min(13);
            let from = &src[at as usize..at as usize + n];
            // SAFETY: `v[0]` points into one of the buffers above, `n` bytes of it at
            // most, and no reference to them is alive while this runs.
            unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), v[0].iov_base.cast(), n) };
            n as isize
        })
        .expect("all moved");
        assert_eq!([&a[..], &b[..], &c[..]].concat(), src);
        assert!(calls > 3000 / 13);
    }

    #[test]
    fn a_batch_of_unmaps_shoots_down_once_and_refuses_only_held_slots() {
        for backend in BACKENDS {
            let mem = Arc::new(MachineMemory::new(64).expect("memfd"));
            let w = Arc::new(MapWindow::with_backend(Arc::clone(&mem), 40, backend).expect("w"));
            for s in 0..32 {
                w.map(s, Mfn(s), s % 2 == 0).expect("map");
            }
            let held = w.page(7).expect("held");
            let slots: Vec<u32> = (0..32).chain([35]).collect();
            let mut out = vec![Ok(Mfn(0)); slots.len()];
            let before = w.shootdowns();
            w.unmap_batch(&slots, &mut out);
            assert_eq!(
                w.shootdowns(),
                before + 1,
                "{backend:?}: one shoot-down per batch"
            );
            for (i, r) in out.iter().enumerate() {
                match i {
                    7 => assert_eq!(*r, Err(MemError::InUse(7))),
                    32 => assert_eq!(*r, Err(MemError::NotMapped(35))),
                    _ => assert_eq!(*r, Ok(Mfn(i as u32))),
                }
            }
            assert_eq!(w.state(7), Ok(SlotState::ReadOnly), "the held slot stays");
            assert_eq!(w.state(6), Ok(SlotState::Unmapped));
            drop(held);
            assert_eq!(w.unmap(7), Ok(Mfn(7)));
            // Nothing closed, nothing to shoot down.
            let n = w.shootdowns();
            w.unmap(7).expect_err("gone");
            assert_eq!(w.shootdowns(), n);
        }
    }

    #[test]
    fn once_an_unmap_returns_no_access_reaches_the_frame() {
        use std::sync::atomic::AtomicU32;
        const N: u32 = 2000;
        for backend in BACKENDS {
            let mem = Arc::new(MachineMemory::new(4).expect("memfd"));
            let w = Arc::new(MapWindow::with_backend(Arc::clone(&mem), N, backend).expect("w"));
            // Slots below `done` were mapped once and unmapped, never to be mapped again.
            let done = Arc::new(AtomicU32::new(0));
            let reader = {
                let (w, done) = (Arc::clone(&w), Arc::clone(&done));
                std::thread::spawn(move || {
                    let (mut late, mut raced) = (0u64, 0u64);
                    let mut page = [0u8; PAGE_SIZE];
                    loop {
                        let d = done.load(Ordering::Acquire);
                        if d > 0 && w.read(d - 1, 0, &mut page).is_ok() {
                            late += 1;
                        }
                        if d == N {
                            return (late, raced);
                        }
                        // Racing the map and unmap of slot `d`: whole pages in flight.
                        raced += u64::from(w.read(d, 0, &mut page).is_ok());
                    }
                })
            };
            for s in 0..N {
                w.map(s, Mfn(1), true).expect("map");
                w.unmap(s).expect("unmap");
                done.store(s + 1, Ordering::Release);
            }
            let (late, _raced) = reader.join().expect("reader");
            assert_eq!(late, 0, "{backend:?}");
        }
    }
}
