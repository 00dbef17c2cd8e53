//! One memfd of N frames, mapped once: the machine's RAM.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64};
use std::sync::Arc;

use crate::{check_in_page, shared, MemError, Mfn, PageAccess, PAGE_SIZE};

/// The machine's memory: `frames` 4 KiB frames in one memfd, mapped read-write once.
///
/// The mapping is the hypervisor's direct map. Domains never get this object; they get
/// handles (in `hv`) that translate their own guest frames and refuse everything else.
#[derive(Debug)]
pub struct MachineMemory {
    base: NonNull<u8>,
    frames: u32,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory that lives as long as `self`; every access
// goes through bounds-checked methods that copy or use atomics, so handing `&self` to
// several threads is what the type is for. Concurrent writers race on contents only,
// which callers treat as untrusted bytes (copy, then validate).
unsafe impl Send for MachineMemory {}
// SAFETY: as above.
unsafe impl Sync for MachineMemory {}

impl MachineMemory {
    /// Creates machine memory of `frames` frames, zero-filled.
    pub fn new(frames: u32) -> std::io::Result<Self> {
        let bytes = (frames as usize)
            .checked_mul(PAGE_SIZE)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: the name is a NUL-terminated literal; flags are valid for memfd_create.
        let raw = unsafe { libc::memfd_create(c"pvio-machine-memory".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscall on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), bytes as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new shared mapping of the whole file at an address the kernel picks;
        // it aliases no Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes.max(PAGE_SIZE),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
        Ok(Self { base, frames, fd })
    }

    /// Number of frames.
    pub fn frames(&self) -> u32 {
        self.frames
    }

    /// The memfd, for mapping frames elsewhere (grant map).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Pointer to `[offset, offset+len)` of frame `mfn`, after checking both bounds.
    #[inline]
    pub(crate) fn ptr(&self, mfn: Mfn, offset: usize, len: usize) -> Result<*mut u8, MemError> {
        if mfn.0 >= self.frames {
            return Err(MemError::NoSuchFrame(mfn.0));
        }
        check_in_page(offset, len)?;
        // Cannot overflow: mfn < frames and the whole range was allocated in `new`.
        let at = mfn.0 as usize * PAGE_SIZE + offset;
        // SAFETY: `at + len <= frames * PAGE_SIZE`, inside the mapping made in `new`.
        Ok(unsafe { self.base.as_ptr().add(at) })
    }

    /// Hints that the line holding byte `offset` of frame `mfn` is about to be read, or
    /// written with `write` (see `shared::prefetch`): a batch that prefetches the lines
    /// of its next items lets their cache misses overlap instead of paying each in
    /// turn. Changes nothing; a frame or offset out of range is ignored.
    #[inline]
    pub fn prefetch(&self, mfn: Mfn, offset: usize, write: bool) {
        if let Ok(p) = self.ptr(mfn, offset, 1) {
            shared::prefetch(p, write);
        }
    }

    /// Copies bytes out of a frame.
    #[inline]
    pub fn read(&self, mfn: Mfn, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        let p = self.ptr(mfn, offset, buf.len())?;
        // SAFETY: `p..p+len` is inside the mapping (checked by `ptr`); `buf` is ordinary
        // Rust memory outside it.
        unsafe { shared::copy(p, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// The Internet checksum's ones'-complement sum of `len` bytes at `offset` of a frame,
    /// as big-endian 16-bit words from the first byte (an odd last byte is padded with
    /// zero), folded to 16 bits. Reads the frame in place, as a kernel's `csum_partial`.
    pub fn csum_partial(&self, mfn: Mfn, offset: usize, len: usize) -> Result<u16, MemError> {
        self.ptr(mfn, offset, len)?;
        // Through a small private buffer: the frame may be changing under the sum, and
        // shared bytes are only ever moved by the copies of [`crate::shared`].
        let mut chunk = [0u8; 256];
        let mut sum: u64 = 0;
        let mut at = 0;
        while at < len {
            let n = (len - at).min(chunk.len());
            self.read(mfn, offset + at, &mut chunk[..n])?;
            let mut words = chunk[..n].chunks_exact(2);
            for w in &mut words {
                sum += u16::from_be_bytes([w[0], w[1]]) as u64;
            }
            // Only the last chunk can be odd (the others are 256 bytes).
            if let [b] = words.remainder() {
                sum += (*b as u64) << 8;
            }
            at += n;
        }
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        Ok(sum as u16)
    }

    /// Reads a plain-old-data value (a ring slot, say).
    #[inline]
    pub fn read_obj<T: bytemuck::Pod>(&self, mfn: Mfn, offset: usize) -> Result<T, MemError> {
        let p = self.ptr(mfn, offset, std::mem::size_of::<T>())?;
        // SAFETY: `p..p+size_of::<T>()` is inside the mapping (checked by `ptr`); `T` is
        // Pod, so any bytes make a valid value.
        Ok(unsafe { shared::read_obj(p) })
    }

    /// Writes a plain-old-data value.
    #[inline]
    pub fn write_obj<T: bytemuck::Pod>(
        &self,
        mfn: Mfn,
        offset: usize,
        v: &T,
    ) -> Result<(), MemError> {
        let p = self.ptr(mfn, offset, std::mem::size_of::<T>())?;
        // SAFETY: in bounds as in `read_obj`; `T` is Pod, so its bytes are all initialised.
        unsafe { shared::write_obj(p, v) };
        Ok(())
    }

    /// Copies bytes into a frame.
    #[inline]
    pub fn write(&self, mfn: Mfn, offset: usize, data: &[u8]) -> Result<(), MemError> {
        let p = self.ptr(mfn, offset, data.len())?;
        // SAFETY: as in `read`, with the direction reversed.
        unsafe { shared::copy(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    /// Copies bytes into a frame with non-temporal stores, so that they land in memory
    /// and not in this core's cache, as a NIC's DMA write does.
    pub fn write_nt(&self, mfn: Mfn, offset: usize, data: &[u8]) -> Result<(), MemError> {
        let p = self.ptr(mfn, offset, data.len())?;
        // SAFETY: `p..p+len` is inside the mapping, checked by `ptr`.
        unsafe { shared::stream(p, data) };
        Ok(())
    }

    /// Stores the 8-byte word `v` at `offset` (8-aligned) of a frame in one store that
    /// no reader sees before the stores that came before it: what a device writes last
    /// when it hands a descriptor back (its status, with the length beside it), so that
    /// a driver that loads the word and finds it done also finds what it announces.
    /// `stream`: non-temporal, as [`Self::write_nt`]; otherwise an ordinary store with
    /// release ordering.
    pub fn publish_u64(
        &self,
        mfn: Mfn,
        offset: usize,
        v: u64,
        stream: bool,
    ) -> Result<(), MemError> {
        if stream {
            let p = self.aligned(mfn, offset, 8)?;
            // SAFETY: `p..p+8` is inside the mapping and 8-aligned, checked by `aligned`.
            unsafe { shared::stream_word(p, v) };
        } else {
            self.atomic_u64(mfn, offset)?
                .store(v, std::sync::atomic::Ordering::Release);
        }
        Ok(())
    }

    /// Fills `len` bytes of a frame with `byte`.
    pub fn fill(&self, mfn: Mfn, offset: usize, len: usize, byte: u8) -> Result<(), MemError> {
        let p = self.ptr(mfn, offset, len)?;
        // SAFETY: `p..p+len` is inside the mapping, checked by `ptr`.
        unsafe { shared::fill(p, byte, len) };
        Ok(())
    }

    /// Copies `len` bytes between two frames (possibly the same one). This is the data
    /// movement of a grant copy.
    #[inline]
    pub fn copy(
        &self,
        src: Mfn,
        src_off: usize,
        dst: Mfn,
        dst_off: usize,
        len: usize,
    ) -> Result<(), MemError> {
        let s = self.ptr(src, src_off, len)?;
        let d = self.ptr(dst, dst_off, len)?;
        // SAFETY: both ranges are inside the mapping (checked above); overlap (the same
        // frame) is copied as `memmove` does.
        unsafe { shared::copy(s, d, len) };
        Ok(())
    }

    /// The 16-bit word at `offset` in frame `mfn` as an atomic.
    #[inline]
    pub fn atomic_u16(&self, mfn: Mfn, offset: usize) -> Result<&AtomicU16, MemError> {
        let p = self.aligned(mfn, offset, 2)?;
        // SAFETY: `p` is 2-aligned, inside the mapping for the lifetime of `&self`, and
        // only ever accessed atomically or by byte copies of untrusted contents.
        Ok(unsafe { AtomicU16::from_ptr(p.cast()) })
    }

    /// The 32-bit word at `offset` in frame `mfn` as an atomic.
    #[inline]
    pub fn atomic_u32(&self, mfn: Mfn, offset: usize) -> Result<&AtomicU32, MemError> {
        let p = self.aligned(mfn, offset, 4)?;
        // SAFETY: as in `atomic_u16`, with 4-byte alignment.
        Ok(unsafe { AtomicU32::from_ptr(p.cast()) })
    }

    /// The 64-bit word at `offset` in frame `mfn` as an atomic.
    #[inline]
    pub fn atomic_u64(&self, mfn: Mfn, offset: usize) -> Result<&AtomicU64, MemError> {
        let p = self.aligned(mfn, offset, 8)?;
        // SAFETY: as in `atomic_u16`, with 8-byte alignment.
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) })
    }

    #[inline]
    fn aligned(&self, mfn: Mfn, offset: usize, size: usize) -> Result<*mut u8, MemError> {
        if !offset.is_multiple_of(size) {
            return Err(MemError::Misaligned(offset));
        }
        self.ptr(mfn, offset, size)
    }
}

impl Drop for MachineMemory {
    fn drop(&mut self) {
        let bytes = (self.frames as usize * PAGE_SIZE).max(PAGE_SIZE);
        // SAFETY: unmaps exactly the mapping made in `new`; no borrow of it can outlive
        // `self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), bytes) };
    }
}

/// One machine frame reached through the direct map, as a [`PageAccess`]. Owned (holds
/// the memory by `Arc`) so that rings and tables can keep it.
#[derive(Debug, Clone)]
pub struct FramePage {
    mem: Arc<MachineMemory>,
    mfn: Mfn,
}

impl FramePage {
    /// The page of frame `mfn`, or an error if it does not exist.
    pub fn new(mem: Arc<MachineMemory>, mfn: Mfn) -> Result<Self, MemError> {
        if mfn.0 >= mem.frames() {
            return Err(MemError::NoSuchFrame(mfn.0));
        }
        Ok(Self { mem, mfn })
    }
    /// The frame.
    pub fn mfn(&self) -> Mfn {
        self.mfn
    }
}

impl PageAccess for FramePage {
    #[inline]
    fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        self.mem.read(self.mfn, offset, buf)
    }
    #[inline]
    fn read_obj<T: bytemuck::Pod>(&self, offset: usize) -> Result<T, MemError> {
        self.mem.read_obj(self.mfn, offset)
    }
    #[inline]
    fn write_obj<T: bytemuck::Pod>(&self, offset: usize, v: &T) -> Result<(), MemError> {
        self.mem.write_obj(self.mfn, offset, v)
    }
    #[inline]
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.mem.write(self.mfn, offset, data)
    }
    #[inline]
    fn write_nt(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.mem.write_nt(self.mfn, offset, data)
    }
    #[inline]
    fn atomic_u16(&self, offset: usize) -> Result<&AtomicU16, MemError> {
        self.mem.atomic_u16(self.mfn, offset)
    }
    #[inline]
    fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, MemError> {
        self.mem.atomic_u32(self.mfn, offset)
    }
    #[inline]
    fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, MemError> {
        self.mem.atomic_u64(self.mfn, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn frames_are_bounds_checked() {
        let m = MachineMemory::new(4).expect("memfd");
        let mut b = [0u8; 8];
        assert_eq!(m.read(Mfn(4), 0, &mut b), Err(MemError::NoSuchFrame(4)));
        assert_eq!(
            m.read(Mfn(0), 4090, &mut b),
            Err(MemError::CrossesPage {
                offset: 4090,
                len: 8
            })
        );
        assert_eq!(m.atomic_u32(Mfn(0), 2).err(), Some(MemError::Misaligned(2)));
        m.write(Mfn(3), 4088, &[7; 8]).expect("in bounds");
        m.read(Mfn(3), 4088, &mut b).expect("in bounds");
        assert_eq!(b, [7; 8]);
    }

    #[test]
    fn csum_partial_matches_a_word_by_word_sum() {
        let m = MachineMemory::new(1).expect("memfd");
        let data: Vec<u8> = (0..1501u32).map(|i| (i * 31 + 7) as u8).collect();
        m.write(Mfn(0), 5, &data).expect("write");
        for (off, len) in [(0, 1501), (1, 1500), (3, 17), (10, 0), (0, 1)] {
            let bytes = &data[off..off + len];
            let mut want: u64 = bytes
                .chunks(2)
                .map(|c| u64::from(c[0]) << 8 | u64::from(*c.get(1).unwrap_or(&0)))
                .sum();
            while want >> 16 != 0 {
                want = (want & 0xffff) + (want >> 16);
            }
            let got = m.csum_partial(Mfn(0), 5 + off, len).expect("in page");
            assert_eq!(got as u64, want, "off {off} len {len}");
        }
    }

    #[test]
    fn nt_write_and_copy_move_the_bytes() {
        let m = MachineMemory::new(2).expect("memfd");
        let data: Vec<u8> = (0..1500u32).map(|i| (i * 7) as u8).collect();
        m.write_nt(Mfn(0), 3, &data).expect("nt");
        m.copy(Mfn(0), 3, Mfn(1), 100, 1500).expect("copy");
        let mut out = vec![0u8; 1500];
        m.read(Mfn(1), 100, &mut out).expect("read");
        assert_eq!(out, data);
        m.atomic_u64(Mfn(1), 0)
            .expect("aligned")
            .store(5, Ordering::Relaxed);
        assert_eq!(
            m.atomic_u64(Mfn(1), 0)
                .expect("aligned")
                .load(Ordering::Relaxed),
            5
        );
    }
}
