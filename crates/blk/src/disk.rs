//! The disk behind a virtual block device: a backing file read and written at sector
//! offsets (xen-blkback's `phy`/`file` back ends, here a file: the backing file
//! on tmpfs, so that the disk is not what is measured).
//!
//! Every access is checked against the disk's size again, whatever the request's
//! judgement said: a bug above cannot reach past the file's end.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use hv::{DiskPiece, Domain, DomainError};
use mem::MemError;

use crate::blkif::SECTOR_SIZE;

/// Bytes of zeros a discard writes at a time.
const ZEROS: usize = 64 * 1024;

/// Byte `offset` of a patterned backing file: a function of the offset whose period
/// (65,521 bytes, a prime) is no multiple of a sector or a page, so that a sector read
/// from the wrong place, or a page placed at the wrong offset, does not match.
pub fn pattern_byte(offset: u64) -> u8 {
    let x = offset % PERIOD as u64;
    (x ^ (x >> 8) ^ (x >> 13).wrapping_mul(7)) as u8
}

/// The pattern's period.
const PERIOD: usize = 65_521;

/// Fills `buf` with the pattern's bytes from `offset` on (a copy out of one period,
/// computed once).
pub fn pattern_fill(offset: u64, buf: &mut [u8]) {
    static PERIOD_BYTES: std::sync::OnceLock<Box<[u8]>> = std::sync::OnceLock::new();
    let p = PERIOD_BYTES.get_or_init(|| (0..PERIOD as u64).map(pattern_byte).collect());
    let mut at = (offset % PERIOD as u64) as usize;
    let mut done = 0;
    while done < buf.len() {
        let n = (buf.len() - done).min(PERIOD - at);
        buf[done..done + n].copy_from_slice(&p[at..at + n]);
        done += n;
        at = 0;
    }
}

/// Writes a backing file of `sectors` sectors holding [`pattern_byte`] at every offset.
pub fn write_patterned(path: &Path, sectors: u64) -> io::Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(File::create(path)?);
    let mut chunk = vec![0u8; 1 << 16];
    let total = sectors * SECTOR_SIZE;
    let mut at = 0u64;
    while at < total {
        let n = (total - at).min(chunk.len() as u64) as usize;
        pattern_fill(at, &mut chunk[..n]);
        f.write_all(&chunk[..n])?;
        at += n as u64;
    }
    f.flush()
}

/// A backing file as a disk of 512-byte sectors.
#[derive(Debug)]
pub struct FileDisk {
    file: File,
    sectors: u64,
    /// `physical-sector-size`.
    physical_sector_size: u32,
    read_only: bool,
    /// Zeros for discards, allocated once, with room to start them on a page boundary.
    zeros: Box<[u8]>,
    /// Opened `O_DIRECT`: no page cache of this domain between a write and the disk.
    direct: bool,
}

fn read_only() -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, "read-only disk")
}

fn mem_error(e: MemError) -> io::Error {
    match e {
        MemError::Os(errno) => io::Error::from_raw_os_error(errno),
        e => io::Error::other(e),
    }
}

fn domain_error(e: DomainError) -> io::Error {
    match e {
        DomainError::Access(m) => mem_error(m),
        e => io::Error::other(e),
    }
}

/// Bytes a transfer's pieces hold.
pub fn pieces_len(pieces: &[DiskPiece]) -> usize {
    pieces
        .iter()
        .map(|p| match *p {
            DiskPiece::Window { len, .. } | DiskPiece::Own { len, .. } => len,
        })
        .sum()
}

fn out_of_range() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "sectors beyond the disk")
}

impl FileDisk {
    /// Opens `path` (read-only if asked), a file or a block device; its size in whole
    /// sectors is the disk's (a block device's metadata says 0 bytes: its end is
    /// found by seeking there).
    pub fn open(path: &Path, read_only: bool) -> io::Result<Self> {
        Self::open_with(path, read_only, false)
    }

    /// [`FileDisk::open`], and `direct`: with `O_DIRECT`, so that a write answered has
    /// left this domain's memory for the disk. A driver domain's page cache dies with the
    /// domain: a write answered from it, and then lost, would be reported written to a
    /// guest whose next flush the next back end answers. Every transfer through a
    /// vbd lands in whole sectors of page-aligned pages, as `O_DIRECT` asks. Fails where
    /// the file system refuses `O_DIRECT` (tmpfs): the caller opens it cached instead.
    pub fn open_with(path: &Path, read_only: bool, direct: bool) -> io::Result<Self> {
        use std::io::Seek;
        use std::os::unix::fs::OpenOptionsExt;
        let mut opts = OpenOptions::new();
        opts.read(true).write(!read_only);
        if direct {
            opts.custom_flags(mem::file::O_DIRECT);
        }
        let mut file = opts.open(path)?;
        let sectors = file.seek(io::SeekFrom::End(0))? / SECTOR_SIZE;
        let physical_sector_size = mem::file::physical_block_size(&file)?;
        Ok(Self {
            file,
            sectors,
            physical_sector_size,
            read_only,
            zeros: vec![0u8; ZEROS + mem::PAGE_SIZE].into_boxed_slice(),
            direct,
        })
    }

    /// Another handle on the same disk (a queue of its own serves through it).
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            file: self.file.try_clone()?,
            sectors: self.sectors,
            physical_sector_size: self.physical_sector_size,
            read_only: self.read_only,
            zeros: vec![0u8; self.zeros.len()].into_boxed_slice(),
            direct: self.direct,
        })
    }

    /// The disk's size in sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// The unit below which a write costs a read first (`physical-sector-size`): the
    /// block device's physical block, or the file system's block for a file.
    pub fn physical_sector_size(&self) -> u32 {
        self.physical_sector_size
    }

    /// Whether it was opened `O_DIRECT` ([`FileDisk::open_with`]).
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Zeros to write, starting on a page boundary (`O_DIRECT` asks for aligned memory).
    fn zeros(&self) -> &[u8] {
        let skew = self.zeros.as_ptr() as usize % mem::PAGE_SIZE;
        let at = (mem::PAGE_SIZE - skew) % mem::PAGE_SIZE;
        &self.zeros[at..at + ZEROS]
    }

    /// Whether it takes no writes.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The byte offset of `len` bytes at `sector`, if they lie on the disk.
    fn at(&self, sector: u64, len: usize) -> io::Result<u64> {
        let bytes = self.sectors * SECTOR_SIZE;
        let off = sector.checked_mul(SECTOR_SIZE).ok_or_else(out_of_range)?;
        match off.checked_add(len as u64) {
            Some(end) if end <= bytes => Ok(off),
            _ => Err(out_of_range()),
        }
    }

    /// Reads `buf.len()` bytes from `sector` on.
    pub fn read(&self, sector: u64, buf: &mut [u8]) -> io::Result<()> {
        let off = self.at(sector, buf.len())?;
        self.file.read_exact_at(buf, off)
    }

    /// Writes `data` from `sector` on.
    pub fn write(&self, sector: u64, data: &[u8]) -> io::Result<()> {
        if self.read_only {
            return Err(read_only());
        }
        let off = self.at(sector, data.len())?;
        self.file.write_all_at(data, off)
    }

    /// Reads the sectors from `sector` on into `pieces`, one after another, as a
    /// controller's scatter-gather DMA lands one request in its pages: one `preadv` for
    /// the whole request (the pages `dom` maps for it and its own).
    pub fn read_vectored(&self, dom: &Domain, pieces: &[DiskPiece], sector: u64) -> io::Result<()> {
        let off = self.at(sector, pieces_len(pieces))?;
        dom.file_io(true, pieces, self.file.as_fd(), off)
            .map_err(domain_error)
    }

    /// Writes `pieces`, one after another, to the disk from `sector` on: one `pwritev`.
    pub fn write_vectored(
        &self,
        dom: &Domain,
        pieces: &[DiskPiece],
        sector: u64,
    ) -> io::Result<()> {
        if self.read_only {
            return Err(read_only());
        }
        let off = self.at(sector, pieces_len(pieces))?;
        dom.file_io(false, pieces, self.file.as_fd(), off)
            .map_err(domain_error)
    }

    /// A ring that moves this disk's bytes asynchronously, up to `depth` transfers in
    /// flight ([`mem::uring::FileRing`]); an error where the kernel has no io_uring.
    pub fn async_ring(&self, depth: u16) -> io::Result<mem::uring::FileRing> {
        mem::uring::FileRing::new(self.file.as_fd(), depth).map_err(mem_error)
    }

    /// Places a read (into `pieces`) or a write (out of them) of the sectors from
    /// `sector` on in `ring`, one of this disk's ([`FileDisk::async_ring`]), to end
    /// with `tag`: checked against the disk's size and its being read-only first, as a
    /// transfer made at once is.
    pub fn start_vectored(
        &self,
        dom: &Domain,
        ring: &mut mem::uring::FileRing,
        write: bool,
        pieces: &[DiskPiece],
        sector: u64,
        tag: u64,
    ) -> io::Result<()> {
        if write && self.read_only {
            return Err(read_only());
        }
        let off = self.at(sector, pieces_len(pieces))?;
        dom.file_io_start(ring, !write, pieces, off, tag)
            .map_err(domain_error)
    }

    /// Writes what the disk holds in its cache out (`BLKIF_OP_FLUSH_DISKCACHE`).
    pub fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// `nr` sectors from `sector` are no longer in use; they read as zeros afterwards.
    /// A hole is punched in the file (one call, whatever the length: a discard of a
    /// whole disk does not stall the back end writing it); a file system without holes
    /// gets zeros written.
    pub fn discard(&self, sector: u64, nr: u64) -> io::Result<()> {
        if self.read_only {
            return Err(read_only());
        }
        let len = nr.checked_mul(SECTOR_SIZE).ok_or_else(out_of_range)?;
        let mut off = self.at(sector, usize::try_from(len).map_err(|_| out_of_range())?)?;
        if mem::file::punch_hole(&self.file, off, len)? {
            return Ok(());
        }
        let end = off + len;
        while off < end {
            let n = (end - off).min(ZEROS as u64) as usize;
            self.file.write_all_at(&self.zeros()[..n], off)?;
            off += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `sectors` sectors, each filled with its number's low byte.
    fn file(name: &str, sectors: u64) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("pvio-disk-{}-{name}", std::process::id()));
        let data: Vec<u8> = (0..sectors * SECTOR_SIZE)
            .map(|i| (i / SECTOR_SIZE) as u8)
            .collect();
        std::fs::write(&p, data).expect("backing file");
        p
    }

    #[test]
    fn sectors_read_and_write_where_they_are_and_nowhere_past_the_end() {
        let p = file("rw", 64);
        let d = FileDisk::open(&p, false).expect("open");
        assert_eq!(d.sectors(), 64);
        let mut b = vec![0u8; 1024];
        d.read(5, &mut b).expect("read");
        assert!(b[..512].iter().all(|&x| x == 5) && b[512..].iter().all(|&x| x == 6));
        d.write(10, &[0xaa; 512]).expect("write");
        d.read(10, &mut b[..512]).expect("read back");
        assert!(b[..512].iter().all(|&x| x == 0xaa));
        // The last sector is reachable; one byte more is not, nor an overflowing one.
        d.read(63, &mut b[..512]).expect("last sector");
        assert!(d.read(63, &mut b[..513]).is_err());
        assert!(d.write(64, &[0; 512]).is_err());
        assert!(d.read(u64::MAX / 2, &mut b[..512]).is_err());
        d.discard(20, 3).expect("discard");
        d.read(20, &mut b[..1024]).expect("read discarded");
        assert!(b.iter().all(|&x| x == 0));
        assert!(d.discard(62, 3).is_err());
        d.flush().expect("flush");
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn the_zeros_a_discard_writes_start_on_a_page_as_o_direct_asks() {
        let p = file("zeros", 8);
        let d = FileDisk::open(&p, false).expect("disk");
        assert_eq!(d.zeros().as_ptr() as usize % mem::PAGE_SIZE, 0);
        assert_eq!(d.zeros().len(), ZEROS);
        assert!(d.zeros().iter().all(|&b| b == 0));
        assert!(!d.direct());
        let _ = std::fs::remove_file(&p);
    }

    /// Issue 39: a discard deallocates its range (a hole, one call) rather than writing
    /// zeros over it, so a discard of a whole disk does not stall the back end; what
    /// is read back is zeros either way, and the sectors around it are untouched.
    #[test]
    fn a_discard_punches_a_hole_and_reads_back_zeros() {
        use std::os::unix::fs::MetadataExt;
        let p = file("hole", 8192);
        let d = FileDisk::open(&p, false).expect("open");
        let before = std::fs::metadata(&p).expect("meta").blocks();
        d.discard(1024, 4096).expect("discard");
        let after = std::fs::metadata(&p).expect("meta").blocks();
        // 2 MiB is 4096 blocks of 512 bytes; a file system without holes keeps them.
        // Whether this file system has holes, asked of a scratch file beside it.
        let probe = file("hole-probe", 16);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&probe)
            .expect("probe");
        let holes = mem::file::punch_hole(&f, 0, 4096).expect("punch");
        let _ = std::fs::remove_file(&probe);
        if holes {
            assert!(after + 4096 <= before, "{before} → {after} blocks");
        }
        let mut b = vec![0u8; 512];
        d.read(1023, &mut b).expect("read");
        assert!(b.iter().all(|&x| x == (1023 % 256) as u8));
        d.read(1024, &mut b).expect("read");
        assert!(b.iter().all(|&x| x == 0));
        d.read(5119, &mut b).expect("read");
        assert!(b.iter().all(|&x| x == 0));
        d.read(5120, &mut b).expect("read");
        assert!(b.iter().all(|&x| x == (5120 % 256) as u8));
        assert_eq!(std::fs::metadata(&p).expect("meta").len(), 8192 * 512);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn the_pattern_is_the_same_byte_by_byte_and_in_pieces() {
        let mut b = vec![0u8; 200_000];
        pattern_fill(12_345, &mut b);
        assert!(b
            .iter()
            .enumerate()
            .all(|(i, &x)| x == pattern_byte(12_345 + i as u64)));
        // A sector read from one sector off does not match.
        let mut c = vec![0u8; 512];
        pattern_fill(12_345 + 512, &mut c);
        assert_ne!(&b[..512], &c[..]);
    }

    #[test]
    fn a_read_only_disk_takes_no_write_and_no_discard() {
        let p = file("ro", 8);
        let d = FileDisk::open(&p, true).expect("open");
        assert!(d.read_only());
        assert!(d.write(0, &[1; 512]).is_err());
        assert!(d.discard(0, 1).is_err());
        let mut b = [0u8; 512];
        d.read(7, &mut b).expect("read");
        assert!(b.iter().all(|&x| x == 7));
        let _ = std::fs::remove_file(&p);
    }
}
