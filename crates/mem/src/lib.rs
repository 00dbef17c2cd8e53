//! Machine memory and the operating-system interfaces of pvio.
//!
//! This is the only crate of the workspace that contains `unsafe` code. It owns:
//!
//! * [`MachineMemory`]: one memfd of N 4 KiB frames, mapped once (the hypervisor's
//!   "direct map"). Every byte any domain, device model or hypervisor path touches lives
//!   here. Access is by machine frame number ([`Mfn`]) plus an offset, bounds-checked on
//!   every call; shared structures are reached through atomics with an explicit
//!   `Ordering`, never through a Rust reference to the frame's bytes, and bytes move
//!   with the byte-wise atomic copies of `shared`, since another thread may be writing
//!   any frame at the same moment.
//! * [`MapWindow`]: a reserved range of virtual addresses in which machine frames are
//!   really mapped with `mmap(MAP_FIXED)` and really unmapped, as a grant map does in Xen.
//! * [`cpu`]: pinning threads to cores, thread CPU clocks, the time-stamp counter, and the
//!   per-thread CPU-time sampling timer behind the cost-class profiler.
//!
//! What it trusts: nothing in the frames. Frame contents are bytes that another domain may
//! be rewriting at any moment; callers copy out, then validate. What it guarantees: no
//! safe method can touch memory outside the frame, slot or page it names, and no safe
//! method can fault (a window slot that is not mapped is refused, not dereferenced).

pub mod cpu;
pub mod file;
pub mod journal;
mod machine;
pub mod packet;
pub mod poll;
mod shared;
pub mod tap;
pub mod tapring;
pub mod uring;
mod window;
pub mod xen;

pub use machine::{FramePage, MachineMemory};
pub use window::{IoPiece, MapBackend, MapWindow, MappedPage, SlotState, MAX_IO_PIECES};

use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64};

/// Maps `len` bytes of what `fd` offers for mapping (a packet socket's rings, a perf
/// event's buffer), readable and writable, shared with the kernel, at an address the
/// kernel chooses. The caller owns the range and unmaps it.
pub(crate) fn map_shared(
    fd: &std::os::fd::OwnedFd,
    len: usize,
) -> std::io::Result<*mut libc::c_void> {
    use std::os::fd::AsRawFd;
    // SAFETY: a new mapping at an address the kernel chooses, of a descriptor the
    // caller owns; nothing else in this process refers to that range.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p)
}

/// Size of a machine frame, as on x86.
pub const PAGE_SIZE: usize = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;

// Ring and grant entries are laid out little-endian, as on the x86 machines the papers
// used; the byte views of those plain-old-data types rely on it.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "pvio assumes a little-endian host"
);

/// A machine frame number: the index of a 4 KiB frame in [`MachineMemory`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mfn(pub u32);

impl Mfn {
    /// Byte offset of the frame inside the machine memory file.
    pub const fn byte_offset(self) -> u64 {
        // Cannot overflow: u32 frame numbers times 4096 fit in 44 bits.
        (self.0 as u64) << PAGE_SHIFT
    }
}

impl std::fmt::Display for Mfn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "mfn {:#x}", self.0)
    }
}

/// Why an access to machine memory or to a window was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    /// The frame number is beyond the end of machine memory.
    #[error("machine frame {0:#x} does not exist")]
    NoSuchFrame(u32),
    /// `offset + len` runs past the end of the page.
    #[error("access [{offset}, +{len}) crosses the page boundary")]
    CrossesPage { offset: usize, len: usize },
    /// An atomic access at an offset not aligned to its size.
    #[error("atomic access at offset {0} is misaligned")]
    Misaligned(usize),
    /// The window slot index is beyond the window.
    #[error("window slot {0} does not exist")]
    NoSuchSlot(u32),
    /// The window slot has no frame mapped (or is being changed).
    #[error("window slot {0} is not mapped")]
    NotMapped(u32),
    /// The window slot already has a frame mapped.
    #[error("window slot {0} is already mapped")]
    AlreadyMapped(u32),
    /// A write through a read-only mapping.
    #[error("window slot {0} is mapped read-only")]
    ReadOnly(u32),
    /// The slot is still being accessed; it cannot be unmapped now.
    #[error("window slot {0} is in use")]
    InUse(u32),
    /// Access to the page was withdrawn: the domain it belongs to is being destroyed.
    #[error("access revoked: the page's domain is being destroyed")]
    Revoked,
    /// The kernel refused an mmap/munmap; the errno is kept.
    #[error("operating system error {0}")]
    Os(i32),
    /// A vectored transfer of more pieces than [`MAX_IO_PIECES`].
    #[error("{0} pieces in one transfer (at most {MAX_IO_PIECES})")]
    TooManyPieces(usize),
}

/// Checks that `[offset, offset + len)` lies inside one page.
#[inline]
pub fn check_in_page(offset: usize, len: usize) -> Result<(), MemError> {
    // `offset <= PAGE_SIZE` first so that the subtraction cannot underflow.
    if offset <= PAGE_SIZE && len <= PAGE_SIZE - offset {
        Ok(())
    } else {
        Err(MemError::CrossesPage { offset, len })
    }
}

/// Uniform access to one 4 KiB page of shared memory, wherever it is reached from: a
/// machine frame through the direct map ([`FramePage`]) or a foreign frame mapped into a
/// window ([`MappedPage`]). Offsets are relative to the page; every method bounds-checks.
pub trait PageAccess {
    /// Copies `buf.len()` bytes at `offset` out of the page.
    fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), MemError>;
    /// Copies `data` into the page at `offset`.
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError>;
    /// Copies `data` into the page at `offset` with non-temporal stores: the bytes go to
    /// memory without the writer's cache reading their lines first, as a write across a
    /// bus into a device's memory is posted. The default is [`PageAccess::write`].
    fn write_nt(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.write(offset, data)
    }
    /// The 16-bit word at `offset` as an atomic (offset must be 2-aligned).
    fn atomic_u16(&self, offset: usize) -> Result<&AtomicU16, MemError>;
    /// The 32-bit word at `offset` as an atomic (offset must be 4-aligned).
    fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, MemError>;
    /// The 64-bit word at `offset` as an atomic (offset must be 8-aligned).
    fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, MemError>;

    /// Loads the 32-bit word at `offset` atomically with `order` (offset 4-aligned): what
    /// a reader of a read-only mapping uses for an index its peer moves, where a copy
    /// could tear. The default asks for the atomic itself, so it needs write access.
    fn load_u32(&self, offset: usize, order: std::sync::atomic::Ordering) -> Result<u32, MemError> {
        Ok(self.atomic_u32(offset)?.load(order))
    }

    /// Reads a plain-old-data value (a copy; the page may change right after).
    fn read_obj<T: bytemuck::Pod>(&self, offset: usize) -> Result<T, MemError> {
        let mut v = T::zeroed();
        self.read(offset, bytemuck::bytes_of_mut(&mut v))?;
        Ok(v)
    }
    /// Writes a plain-old-data value.
    fn write_obj<T: bytemuck::Pod>(&self, offset: usize, v: &T) -> Result<(), MemError> {
        self.write(offset, bytemuck::bytes_of(v))
    }
}
