//! What a disk's back end asks of the file behind it beyond reads and writes.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `open(2)`'s flag for I/O that bypasses this kernel's page cache, straight between the
/// caller's (aligned) memory and the device (`OpenOptionsExt::custom_flags`).
pub const O_DIRECT: i32 = libc::O_DIRECT;

/// Deallocates `len` bytes of `file` from `offset` on, keeping its size: they read as
/// zeros afterwards (`fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`, what a
/// discard on a loop device does to its file). One call whatever the length, so a
/// discard of a whole disk does not write it. `Ok(false)`: the file system cannot
/// punch holes (`EOPNOTSUPP`), nothing changed, and the caller writes zeros.
pub fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<bool> {
    let bad = || io::Error::from_raw_os_error(libc::EINVAL);
    let off = libc::off_t::try_from(offset).map_err(|_| bad())?;
    let n = libc::off_t::try_from(len).map_err(|_| bad())?;
    loop {
        // SAFETY: `fallocate` takes a file descriptor that `file` keeps open for the
        // call and plain integers; it touches no memory of this process.
        let r = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                n,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
            return Ok(false);
        }
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `BLKPBSZGET`, `_IO(0x12, 123)`: a block device's physical block size.
const BLKPBSZGET: libc::c_ulong = 0x127b;

/// The unit below which a write to `file` costs its device (or its file system) a read
/// first: a block device's physical block size (`BLKPBSZGET`), a file's preferred I/O
/// size (`st_blksize`, the file system's block). A value that is not a power of two from
/// 512 to 64 KiB reads as 512.
pub fn physical_block_size(file: &File) -> io::Result<u32> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = file.metadata()?;
    let size = if m.file_type().is_block_device() {
        let mut v: libc::c_uint = 0;
        // SAFETY: BLKPBSZGET writes one unsigned int through the pointer, which is `v`'s;
        // `file` is an open block device.
        if unsafe { libc::ioctl(file.as_raw_fd(), BLKPBSZGET, &mut v as *mut libc::c_uint) } < 0 {
            return Err(io::Error::last_os_error());
        }
        u64::from(v)
    } else {
        m.blksize()
    };
    Ok(match u32::try_from(size) {
        Ok(s) if s.is_power_of_two() && (512..=65536).contains(&s) => s,
        _ => 512,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_punched_range_reads_as_zeros_and_the_size_stays() {
        let p = std::env::temp_dir().join(format!("pvio-punch-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .expect("file");
        f.write_all_at(&[0xabu8; 16384], 0).expect("write");
        match punch_hole(&f, 4096, 8192).expect("punch") {
            true => {
                let mut b = [0u8; 16384];
                f.read_exact_at(&mut b, 0).expect("read");
                assert!(b[..4096].iter().all(|&x| x == 0xab));
                assert!(b[4096..12288].iter().all(|&x| x == 0));
                assert!(b[12288..].iter().all(|&x| x == 0xab));
                assert_eq!(f.metadata().expect("meta").len(), 16384);
            }
            // A file system without holes: said so, nothing changed.
            false => {
                let mut b = [0u8; 16384];
                f.read_exact_at(&mut b, 0).expect("read");
                assert!(b.iter().all(|&x| x == 0xab));
            }
        }
        let _ = std::fs::remove_file(&p);
    }
}
