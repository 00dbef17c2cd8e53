//! Foreign-map windows: virtual address ranges in which machine frames are really
//! mapped and unmapped, page by page, as Xen's grant map edits the mapping domain's page
//! tables.

use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::{check_in_page, MachineMemory, MemError, Mfn, PageAccess, PAGE_SIZE};

// Slot state word: the low bits count live accessors (`MappedPage`s and in-flight
// copies); the flags say whether a frame is mapped and how.
const USERS_MASK: u32 = (1 << 24) - 1;
const MAPPED: u32 = 1 << 28;
const WRITABLE: u32 = 1 << 29;
/// A map or unmap is changing the page tables of this slot.
const CHANGING: u32 = 1 << 30;

/// What a slot holds, as seen at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// No frame is mapped; the address range is `PROT_NONE`.
    Unmapped,
    /// A frame is mapped read-only (`PROT_READ`).
    ReadOnly,
    /// A frame is mapped read-write.
    ReadWrite,
}

/// A window of `slots` page-sized slots of virtual address space, reserved `PROT_NONE`.
///
/// `map` puts a machine frame at a slot with `mmap(MAP_FIXED | MAP_SHARED)` of the
/// machine-memory file, with `PROT_READ` for a read-only mapping; `unmap` replaces it by
/// a `PROT_NONE` reservation again. Both are real page-table updates, and an unmap in a
/// process whose threads run on other cores costs the kernel's TLB shoot-down, as in Xen.
///
/// Access is refused unless the slot is mapped (and writable, for a write), and a slot
/// cannot be unmapped while an access or a [`MappedPage`] holds it: the slot word counts
/// its users, so no safe call can ever touch an unmapped page.
#[derive(Debug)]
pub struct MapWindow {
    base: NonNull<u8>,
    slots: u32,
    state: Box<[AtomicU32]>,
    mfns: Box<[AtomicU32]>,
    mem: Arc<MachineMemory>,
}

// SAFETY: the window's memory is only reached through the slot protocol below (users
// counted in atomics); the raw base pointer is an address range owned by `self`.
unsafe impl Send for MapWindow {}
// SAFETY: as above.
unsafe impl Sync for MapWindow {}

impl MapWindow {
    /// Reserves a window of `slots` pages of address space over `mem`.
    pub fn new(mem: Arc<MachineMemory>, slots: u32) -> std::io::Result<Self> {
        let bytes = (slots.max(1) as usize) * PAGE_SIZE;
        // SAFETY: a fresh anonymous PROT_NONE reservation at a kernel-chosen address.
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
        let base = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
        Ok(Self {
            base,
            slots,
            state: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            mfns: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            mem,
        })
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    fn word(&self, slot: u32) -> Result<&AtomicU32, MemError> {
        self.state
            .get(slot as usize)
            .ok_or(MemError::NoSuchSlot(slot))
    }

    fn addr(&self, slot: u32) -> *mut u8 {
        // SAFETY: callers pass `slot < self.slots` (checked by `word`), so the offset is
        // inside the reservation made in `new`.
        unsafe { self.base.as_ptr().add(slot as usize * PAGE_SIZE) }
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

    /// Maps machine frame `mfn` at `slot` with a real `mmap(MAP_FIXED)`.
    pub fn map(&self, slot: u32, mfn: Mfn, writable: bool) -> Result<(), MemError> {
        let word = self.word(slot)?;
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
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: replaces exactly one page of our own reservation, which no Rust object
        // refers to (the slot was unmapped and is claimed CHANGING, so no accessor holds it).
        let p = unsafe {
            libc::mmap(
                self.addr(slot).cast(),
                PAGE_SIZE,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.mem.fd().as_raw_fd(),
                mfn.byte_offset() as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            word.store(0, Ordering::Release);
            return Err(MemError::Os(e));
        }
        self.mfns[slot as usize].store(mfn.0, Ordering::Relaxed);
        // Release: an accessor that sees MAPPED also sees the new page-table entry.
        word.store(
            MAPPED | if writable { WRITABLE } else { 0 },
            Ordering::Release,
        );
        Ok(())
    }

    /// Unmaps the frame at `slot` (a real page-table update and TLB flush), leaving a
    /// `PROT_NONE` reservation. Refused with [`MemError::InUse`] while accessed.
    pub fn unmap(&self, slot: u32) -> Result<Mfn, MemError> {
        let word = self.word(slot)?;
        let s = word.load(Ordering::Acquire);
        if s & MAPPED == 0 || s & CHANGING != 0 {
            return Err(MemError::NotMapped(slot));
        }
        if s & USERS_MASK != 0 {
            return Err(MemError::InUse(slot));
        }
        // Only succeeds with zero users; from here no accessor can get in.
        if word
            .compare_exchange(s, s | CHANGING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return Err(MemError::InUse(slot));
        }
        let mfn = Mfn(self.mfns[slot as usize].load(Ordering::Relaxed));
        // SAFETY: replaces one page of our own reservation; the slot has no users and is
        // marked CHANGING, so no reference into it exists.
        let p = unsafe {
            libc::mmap(
                self.addr(slot).cast(),
                PAGE_SIZE,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            word.store(s, Ordering::Release);
            return Err(MemError::Os(e));
        }
        word.store(0, Ordering::Release);
        Ok(mfn)
    }

    /// Registers one more user of a mapped slot; fails if the slot is not mapped (or is
    /// read-only and `write` is asked).
    fn enter(&self, slot: u32, write: bool) -> Result<(), MemError> {
        let word = self.word(slot)?;
        let mut s = word.load(Ordering::Acquire);
        loop {
            if s & MAPPED == 0 || s & CHANGING != 0 {
                return Err(MemError::NotMapped(slot));
            }
            if write && s & WRITABLE == 0 {
                return Err(MemError::ReadOnly(slot));
            }
            if s & USERS_MASK == USERS_MASK {
                return Err(MemError::InUse(slot));
            }
            // Cannot overflow into the flags: checked against USERS_MASK above.
            match word.compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(now) => s = now,
            }
        }
    }

    fn leave(&self, slot: u32) {
        // Release: our accesses happen before an unmapper sees zero users.
        self.state[slot as usize].fetch_sub(1, Ordering::Release);
    }

    /// Copies bytes out of the frame mapped at `slot`, through the window's own mapping.
    pub fn read(&self, slot: u32, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        check_in_page(offset, buf.len())?;
        self.enter(slot, false)?;
        // SAFETY: the slot is mapped and counted as in use, so it cannot be unmapped
        // during the copy; the range is inside the page (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(self.addr(slot).add(offset), buf.as_mut_ptr(), buf.len())
        };
        self.leave(slot);
        Ok(())
    }

    /// Copies bytes into the frame mapped at `slot`; refused for a read-only mapping.
    pub fn write(&self, slot: u32, offset: usize, data: &[u8]) -> Result<(), MemError> {
        check_in_page(offset, data.len())?;
        self.enter(slot, true)?;
        // SAFETY: as in `read`; the mapping is writable (checked by `enter`).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.addr(slot).add(offset), data.len())
        };
        self.leave(slot);
        Ok(())
    }

    /// Holds the page at `slot` for repeated access (a mapped ring, say) until dropped;
    /// the slot cannot be unmapped meanwhile.
    pub fn page(self: &Arc<Self>, slot: u32) -> Result<MappedPage, MemError> {
        self.enter(slot, false)?;
        let writable = self.state(slot)? == SlotState::ReadWrite;
        Ok(MappedPage {
            window: Arc::clone(self),
            slot,
            writable,
        })
    }
}

impl Drop for MapWindow {
    fn drop(&mut self) {
        // SAFETY: unmaps the whole reservation (with any frames still mapped in it);
        // `&mut self` means no accessor or `MappedPage` (which holds an Arc) is alive.
        unsafe {
            libc::munmap(
                self.base.as_ptr().cast(),
                self.slots.max(1) as usize * PAGE_SIZE,
            )
        };
    }
}

/// A mapped window slot held open for access; see [`MapWindow::page`].
#[derive(Debug)]
pub struct MappedPage {
    window: Arc<MapWindow>,
    slot: u32,
    writable: bool,
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
        // SAFETY: in bounds of the page (checked), which stays mapped while `self` lives.
        Ok(unsafe { self.window.addr(self.slot).add(offset) })
    }

    #[inline]
    fn atomic_at(&self, offset: usize, size: usize) -> Result<*mut u8, MemError> {
        // Atomics are read-modify-write capable: refuse them on a read-only mapping.
        if !self.writable {
            return Err(MemError::ReadOnly(self.slot));
        }
        self.at(offset, size, size)
    }
}

impl PageAccess for MappedPage {
    #[inline]
    fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        let p = self.at(offset, buf.len(), 1)?;
        // SAFETY: `p..p+len` is in the held, mapped page; `buf` is separate memory.
        unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }
    #[inline]
    fn read_obj<T: bytemuck::Pod>(&self, offset: usize) -> Result<T, MemError> {
        let p = self.at(offset, std::mem::size_of::<T>(), 1)?;
        // SAFETY: in the held, mapped page; `T` is Pod; unaligned-tolerant load.
        Ok(unsafe { std::ptr::read_unaligned(p.cast::<T>()) })
    }
    #[inline]
    fn write_obj<T: bytemuck::Pod>(&self, offset: usize, v: &T) -> Result<(), MemError> {
        if !self.writable {
            return Err(MemError::ReadOnly(self.slot));
        }
        let p = self.at(offset, std::mem::size_of::<T>(), 1)?;
        // SAFETY: in the held, writable mapped page; `T` is Pod.
        unsafe { std::ptr::write_unaligned(p.cast::<T>(), *v) };
        Ok(())
    }
    #[inline]
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        if !self.writable {
            return Err(MemError::ReadOnly(self.slot));
        }
        let p = self.at(offset, data.len(), 1)?;
        // SAFETY: as in `read`; the mapping is writable.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }
    #[inline]
    fn atomic_u16(&self, offset: usize) -> Result<&AtomicU16, MemError> {
        let p = self.atomic_at(offset, 2)?;
        // SAFETY: aligned, in a writable mapped page that outlives the borrow of `self`.
        Ok(unsafe { AtomicU16::from_ptr(p.cast()) })
    }
    #[inline]
    fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, MemError> {
        let p = self.atomic_at(offset, 4)?;
        // SAFETY: as in `atomic_u16`.
        Ok(unsafe { AtomicU32::from_ptr(p.cast()) })
    }
    #[inline]
    fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, MemError> {
        let p = self.atomic_at(offset, 8)?;
        // SAFETY: as in `atomic_u16`.
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) })
    }
}

impl Drop for MappedPage {
    fn drop(&mut self) {
        self.window.leave(self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapping_shows_the_frame_and_unmap_removes_it() {
        let mem = Arc::new(MachineMemory::new(8).expect("memfd"));
        mem.write(Mfn(5), 10, b"hello").expect("write");
        let w = Arc::new(MapWindow::new(Arc::clone(&mem), 4).expect("window"));
        let mut b = [0u8; 5];
        assert_eq!(w.read(1, 10, &mut b), Err(MemError::NotMapped(1)));
        w.map(1, Mfn(5), false).expect("map");
        w.read(1, 10, &mut b).expect("read");
        assert_eq!(&b, b"hello");
        assert_eq!(w.write(1, 0, b"x"), Err(MemError::ReadOnly(1)));
        assert_eq!(w.map(1, Mfn(6), true), Err(MemError::AlreadyMapped(1)));
        {
            let held = w.page(1).expect("held");
            assert_eq!(w.unmap(1), Err(MemError::InUse(1)));
            assert_eq!(held.read_obj::<u8>(10), Ok(b'h'));
        }
        assert_eq!(w.unmap(1), Ok(Mfn(5)));
        assert_eq!(w.read(1, 10, &mut b), Err(MemError::NotMapped(1)));
        // Writable mapping: writes land in machine memory.
        w.map(2, Mfn(6), true).expect("map rw");
        w.write(2, 0, b"abc").expect("write");
        let mut c = [0u8; 3];
        mem.read(Mfn(6), 0, &mut c).expect("read");
        assert_eq!(&c, b"abc");
        assert_eq!(w.map(9, Mfn(6), true), Err(MemError::NoSuchSlot(9)));
    }
}
