//! Pages of a file that outlive the process writing them: what a back end records of its
//! progress on a ring so that, if it dies, the one started after it can take the ring
//! over exactly (as vhost-user's in-flight region lets a restarted back end resubmit).
//!
//! The file lives in memory (under `/run`, a tmpfs): each record is a store to the
//! mapped pages, no system call. What they hold is this back end's own writing, but
//! it is read back after a crash as any input is: bounds-checked, and validated by the
//! caller against the ring it describes.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{shared, MemError, PAGE_SIZE};

/// Mapped pages of a file.
#[derive(Debug)]
pub struct Journal {
    base: NonNull<u8>,
    /// Bytes mapped: whole pages.
    len: usize,
}

// SAFETY: the mapping lives as long as `self` and is reached only through the
// bounds-checked methods below (atomics for the words, byte-wise copies for the rest).
unsafe impl Send for Journal {}
// SAFETY: as above.
unsafe impl Sync for Journal {}

impl Journal {
    /// Opens (creating it, zero-filled, if missing) the file at `path`, sized to hold
    /// at least `len` bytes in whole pages (at least one), and maps it shared: what is
    /// written survives this process.
    pub fn open(path: &Path, len: usize) -> io::Result<Self> {
        let len = len.max(1).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        f.set_len(len as u64)?;
        // SAFETY: a new shared mapping of `len` bytes of a file we hold open, at an address
        // the kernel picks; it aliases no Rust object. The mapping stays valid after the
        // descriptor is closed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
        Ok(Self { base, len })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is mapped (never: a journal is at least a page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks that `[offset, offset + n)` lies inside the mapping.
    fn check(&self, offset: usize, n: usize) -> Result<(), MemError> {
        if offset <= self.len && n <= self.len - offset {
            Ok(())
        } else {
            Err(MemError::CrossesPage { offset, len: n })
        }
    }

    fn word(&self, offset: usize) -> Result<&AtomicU32, MemError> {
        if !offset.is_multiple_of(4) {
            return Err(MemError::Misaligned(offset));
        }
        self.check(offset, 4)?;
        // SAFETY: aligned and inside the mapping (checked); the mapping lives as long as
        // `self`, and only atomics reach these four bytes.
        Ok(unsafe { &*self.base.as_ptr().add(offset).cast::<AtomicU32>() })
    }

    /// Loads the word at `offset` (Acquire: what was written before it was stored is
    /// seen).
    pub fn load(&self, offset: usize) -> Result<u32, MemError> {
        Ok(self.word(offset)?.load(Ordering::Acquire))
    }

    /// Stores the word at `offset` (Release: what was written before is published
    /// with it).
    pub fn store(&self, offset: usize, v: u32) -> Result<(), MemError> {
        self.word(offset)?.store(v, Ordering::Release);
        Ok(())
    }

    /// Copies `data` into the page at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.check(offset, data.len())?;
        // SAFETY: inside the mapping (checked); byte-wise copy, no reference to the
        // destination is formed.
        unsafe { shared::copy(data.as_ptr(), self.base.as_ptr().add(offset), data.len()) };
        Ok(())
    }

    /// Copies bytes of the page at `offset` out into `buf`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        self.check(offset, buf.len())?;
        // SAFETY: as in `write`, the other way.
        unsafe { shared::copy(self.base.as_ptr().add(offset), buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        // SAFETY: unmaps the pages mapped in `open`; `&mut self` means no reference into
        // them is alive.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_written_outlives_the_writer_and_bounds_are_checked() {
        let p = std::env::temp_dir().join(format!("pvio-journal-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        {
            let j = Journal::open(&p, 1).expect("open");
            assert_eq!(j.len(), PAGE_SIZE, "whole pages");
            assert_eq!(j.load(0).expect("word"), 0, "a new page reads as zeros");
            j.write(8, b"response").expect("write");
            j.store(0, 41).expect("store");
            assert!(j.store(4094, 1).is_err());
            assert!(j.load(2).is_err());
            assert!(j.write(4090, &[0; 8]).is_err());
        }
        let j = Journal::open(&p, PAGE_SIZE + 1).expect("again");
        assert_eq!(j.len(), 2 * PAGE_SIZE);
        j.store(PAGE_SIZE + 4, 7)
            .expect("the second page is mapped too");
        assert!(j.load(2 * PAGE_SIZE).is_err());
        assert_eq!(j.load(0).expect("word"), 41);
        let mut b = [0u8; 8];
        j.read(8, &mut b).expect("read");
        assert_eq!(&b, b"response");
        let _ = std::fs::remove_file(&p);
    }
}
