//! Asynchronous transfers between a file and memory a transfer may reach (window slots,
//! the machine's own frames): a block back end's disk I/O, submitted and completed
//! through an io_uring (`io_uring_setup(2)`), as Linux's blkback hands a request's bio to
//! the block layer and answers it from the completion.
//!
//! A [`FileRing`] serves one file (a disk's descriptor, duplicated once when it is
//! made). [`FileRing::read`] and [`FileRing::write`] hold every slot the transfer
//! reaches (as a [`crate::MappedPage`] does: an unmap is refused), place the
//! request in the submission queue with a tag of the caller's, and return; the next
//! [`FileRing::submit`] hands every queued request to the kernel in one
//! `io_uring_enter`. The ring's event descriptor ([`FileRing::event_fd`]) becomes
//! readable when a completion is posted, for a scheduler to wake the device's unit on;
//! [`FileRing::complete`] reaps them: a short transfer is submitted again for the rest,
//! and a finished one lets its slots go and is reported with its tag. Dropping the ring
//! waits for every transfer in flight first: the kernel may write into the memory until
//! it has completed.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;

use io_uring::{opcode, types, IoUring};

use crate::poll::EventFd;
use crate::window::{IoPiece, MapWindow, EMPTY_IOVEC, HOLD_ONE, MAX_IO_PIECES};
use crate::MemError;

/// What a transfer does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    /// `fdatasync`.
    Sync,
}

/// One transfer's place: where its bytes lie (stable while it is in flight: the places
/// are allocated once and never move), what it holds, how far it has come.
#[derive(Debug)]
struct Op {
    busy: bool,
    tag: u64,
    kind: Kind,
    iov: [libc::iovec; MAX_IO_PIECES],
    pieces: [IoPiece; MAX_IO_PIECES],
    n: usize,
    /// Pieces held in use (`MapWindow::hold_pieces`) until it ends.
    held: usize,
    /// The first iovec not wholly moved yet.
    first: usize,
    /// The file offset of the next byte, and the bytes still to move.
    pos: u64,
    left: usize,
    window: Option<Arc<MapWindow>>,
}

// SAFETY: the iovecs point into memory the op holds (its window's slots, held in use, or
// the machine's frames the window keeps alive); they are only read by the kernel and by
// the ring's owner, one thread at a time.
unsafe impl Send for Op {}

/// How a transfer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The tag it was submitted with.
    pub tag: u64,
    /// Every byte moved (or the data synced), or why not.
    pub result: Result<(), MemError>,
}

/// An io_uring for one file's transfers.
pub struct FileRing {
    ring: IoUring,
    file: OwnedFd,
    event: EventFd,
    ops: Box<[Op]>,
    free: Vec<u16>,
    /// Transfers placed and not yet completed.
    in_flight: usize,
    /// Submission entries placed and not yet handed to the kernel.
    queued: usize,
    /// `io_uring_enter` calls made (what a reader compares with the transfers).
    enters: u64,
}

impl std::fmt::Debug for FileRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileRing")
            .field("file", &self.file)
            .field("depth", &self.ops.len())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

fn os(e: std::io::Error) -> MemError {
    MemError::Os(e.raw_os_error().unwrap_or(libc::EIO))
}

impl FileRing {
    /// A ring for `file` taking up to `depth` transfers in flight (1 to 256). Fails
    /// where the kernel has no io_uring or refuses it (`kernel.io_uring_disabled`, a
    /// seccomp filter): the caller then moves its bytes synchronously.
    pub fn new(file: BorrowedFd<'_>, depth: u16) -> Result<Self, MemError> {
        let depth = depth.clamp(1, 256);
        let ring = IoUring::new(u32::from(depth)).map_err(os)?;
        let event = EventFd::new().map_err(os)?;
        ring.submitter()
            .register_eventfd(event.as_raw_fd())
            .map_err(os)?;
        let file = file.try_clone_to_owned().map_err(os)?;
        let ops = (0..depth)
            .map(|_| Op {
                busy: false,
                tag: 0,
                kind: Kind::Sync,
                iov: [EMPTY_IOVEC; MAX_IO_PIECES],
                pieces: [IoPiece::Frame {
                    mfn: crate::Mfn(0),
                    offset: 0,
                    len: 0,
                }; MAX_IO_PIECES],
                n: 0,
                held: 0,
                first: 0,
                pos: 0,
                left: 0,
                window: None,
            })
            .collect();
        Ok(Self {
            ring,
            file,
            event,
            ops,
            free: (0..depth).rev().collect(),
            in_flight: 0,
            queued: 0,
            enters: 0,
        })
    }

    /// The descriptor that becomes readable when a completion is posted.
    pub fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    /// Transfers that can be placed now.
    pub fn room(&self) -> usize {
        self.free.len()
    }

    /// Transfers placed and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// `io_uring_enter` calls made so far.
    pub fn enters(&self) -> u64 {
        self.enters
    }

    /// Places a read of the file from byte `pos` on into `pieces` (slots of `window`,
    /// each mapped writable, and frames of its machine), one after another.
    pub fn read(
        &mut self,
        window: &Arc<MapWindow>,
        pieces: &[IoPiece],
        pos: u64,
        tag: u64,
    ) -> Result<(), MemError> {
        self.place(Kind::Read, Some(window), pieces, pos, tag)
    }

    /// Places a write of `pieces`, one after another, to the file from byte `pos` on.
    pub fn write(
        &mut self,
        window: &Arc<MapWindow>,
        pieces: &[IoPiece],
        pos: u64,
        tag: u64,
    ) -> Result<(), MemError> {
        self.place(Kind::Write, Some(window), pieces, pos, tag)
    }

    /// Places an `fdatasync` of the file: the writes completed before it are durable
    /// when it completes.
    pub fn sync(&mut self, tag: u64) -> Result<(), MemError> {
        self.place(Kind::Sync, None, &[], 0, tag)
    }

    fn place(
        &mut self,
        kind: Kind,
        window: Option<&Arc<MapWindow>>,
        pieces: &[IoPiece],
        pos: u64,
        tag: u64,
    ) -> Result<(), MemError> {
        let Some(&k) = self.free.last() else {
            return Err(MemError::Os(libc::EBUSY));
        };
        let op = &mut self.ops[usize::from(k)];
        if let Some(w) = window {
            w.hold_pieces(pieces, kind == Kind::Read, HOLD_ONE, &mut op.iov)?;
            op.pieces[..pieces.len()].copy_from_slice(pieces);
            op.window = Some(Arc::clone(w));
        }
        op.held = if window.is_some() { pieces.len() } else { 0 };
        op.busy = true;
        op.tag = tag;
        op.kind = kind;
        op.n = pieces.len();
        op.first = 0;
        op.pos = pos;
        op.left = op.iov[..op.n].iter().map(|v| v.iov_len).sum();
        self.free.pop();
        self.in_flight += 1;
        if kind != Kind::Sync && op.left == 0 {
            // Nothing to move: done at the next reap, without the kernel.
            op.n = 0;
        }
        self.push(k);
        Ok(())
    }

    /// Puts op `k`'s next transfer (what is left of it) in the submission queue.
    fn push(&mut self, k: u16) {
        let op = &self.ops[usize::from(k)];
        let fd = types::Fd(self.file.as_raw_fd());
        let left = &op.iov[op.first..op.n];
        let entry = match op.kind {
            Kind::Read => opcode::Readv::new(fd, left.as_ptr(), left.len() as u32)
                .offset(op.pos)
                .build(),
            Kind::Write => opcode::Writev::new(fd, left.as_ptr(), left.len() as u32)
                .offset(op.pos)
                .build(),
            Kind::Sync => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        }
        .user_data(u64::from(k));
        // The queue holds as many entries as there are ops, and each op has at most one
        // entry queued or in flight at a time: there is room.
        // SAFETY: the iovecs and the memory they point to stay valid until the entry's
        // completion is reaped: the op is not reused before (`busy`), its arrays never
        // move (allocated once in a boxed slice), its slots are held in use and its
        // window kept alive, and dropping the ring waits for every op in flight.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        debug_assert!(pushed.is_ok(), "a submission slot per op");
        self.queued += 1;
    }

    /// Hands every placed transfer to the kernel: one `io_uring_enter`, none if
    /// nothing is queued.
    pub fn submit(&mut self) -> Result<(), MemError> {
        if self.queued == 0 {
            return Ok(());
        }
        loop {
            self.enters += 1;
            match self.ring.submit() {
                Ok(n) => {
                    // What the kernel did not take yet stays queued for the next enter.
                    self.queued -= n.min(self.queued);
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {
                    // The completion queue is full, or the kernel is short of memory for
                    // a moment: handed over by the caller's next `submit` or `complete`.
                    return Ok(());
                }
                Err(e) => return Err(os(e)),
            }
        }
    }

    /// Transfers placed and not yet handed to the kernel.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Reaps the completions posted, calling `done` for each transfer that has ended;
    /// a short one is placed again for the rest (and submitted). Returns how many ended.
    pub fn complete(&mut self, mut done: impl FnMut(Completion)) -> usize {
        self.event.drain();
        let mut ended = 0;
        loop {
            let Some(cqe) = self.ring.completion().next() else {
                break;
            };
            let Ok(k) = u16::try_from(cqe.user_data()) else {
                continue;
            };
            let Some(op) = self.ops.get_mut(usize::from(k)) else {
                continue;
            };
            if !op.busy {
                continue;
            }
            let res = cqe.result();
            let outcome = match op.kind {
                Kind::Sync if res < 0 && res != -libc::EINTR => Some(Err(MemError::Os(-res))),
                Kind::Sync if res >= 0 => Some(Ok(())),
                _ if res == -libc::EINTR || res == -libc::EAGAIN => None,
                _ if res < 0 => Some(Err(MemError::Os(-res))),
                _ if op.n == 0 => Some(Ok(())),
                // The file ended first.
                _ if res == 0 => Some(Err(MemError::Os(libc::EIO))),
                _ => {
                    let mut n = res as usize;
                    op.left = op.left.saturating_sub(n);
                    op.pos += n as u64;
                    while n > 0 && op.first < op.n {
                        let v = &mut op.iov[op.first];
                        if n >= v.iov_len {
                            n -= v.iov_len;
                            op.first += 1;
                        } else {
                            // SAFETY: `n < iov_len`, so the pointer stays inside the
                            // piece.
                            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                            v.iov_len -= n;
                            n = 0;
                        }
                    }
                    (op.left == 0).then_some(Ok(()))
                }
            };
            match outcome {
                // Not finished: the rest goes in again.
                None => self.push(k),
                Some(result) => {
                    let op = &mut self.ops[usize::from(k)];
                    if let Some(w) = op.window.take() {
                        w.release_pieces(&op.pieces[..op.held], HOLD_ONE);
                    }
                    op.busy = false;
                    self.free.push(k);
                    self.in_flight -= 1;
                    ended += 1;
                    done(Completion {
                        tag: op.tag,
                        result,
                    });
                }
            }
        }
        if self.queued > 0 {
            // What went in again, and what a full completion queue held back.
            let _ = self.submit();
        }
        ended
    }

    /// Waits until every transfer placed has ended, calling `done` for each.
    pub fn wait_all(&mut self, mut done: impl FnMut(Completion)) {
        while self.in_flight > 0 {
            self.enters += 1;
            match self.ring.submit_and_wait(1) {
                Ok(_) => self.queued = 0,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(_) => {
                    // Nothing can be handed to the kernel: what is still queued and not
                    // submitted never will be. Given up as failed.
                    break;
                }
            }
            self.complete(&mut done);
        }
    }
}

impl Drop for FileRing {
    fn drop(&mut self) {
        // The kernel may still move bytes into the held memory: wait for it.
        self.wait_all(|_| {});
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MachineMemory, MapBackend, Mfn, PAGE_SIZE};
    use std::os::fd::AsFd;

    fn file(tag: &str, len: u32) -> (std::path::PathBuf, std::fs::File, Vec<u8>) {
        let path = std::env::temp_dir().join(format!("pvio-uring-{tag}-{}", std::process::id()));
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).expect("file");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open");
        (path, f, data)
    }

    fn ended(r: &mut FileRing) -> Vec<Completion> {
        let mut v = Vec::new();
        r.wait_all(|c| v.push(c));
        v
    }

    #[test]
    fn transfers_land_where_a_synchronous_one_would_and_hold_their_slots_until_they_end() {
        for backend in [MapBackend::Table, MapBackend::Mmap] {
            let mem = Arc::new(MachineMemory::new(8).expect("memfd"));
            let w = Arc::new(MapWindow::with_backend(Arc::clone(&mem), 4, backend).expect("w"));
            let (path, f, data) = file(backend.name(), 16384);
            let mut r = FileRing::new(f.as_fd(), 4).expect("io_uring");
            w.map(0, Mfn(3), true).expect("map");
            w.map(1, Mfn(4), false).expect("map");
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
            ];
            r.read(&w, &pieces, 512, 7).expect("placed");
            assert_eq!((r.in_flight(), r.room()), (1, 3));
            // Placed, not yet ended: its slot cannot go.
            assert_eq!(w.unmap(0), Err(MemError::InUse(0)));
            r.submit().expect("submit");
            assert_eq!(
                ended(&mut r),
                [Completion {
                    tag: 7,
                    result: Ok(())
                }]
            );
            assert_eq!(r.in_flight(), 0);
            let mut b = vec![0u8; PAGE_SIZE];
            mem.read(Mfn(3), 0, &mut b).expect("frame");
            assert_eq!(&b[3584..], &data[512..1024]);
            assert!(b[..3584].iter().all(|&x| x == 0));
            mem.read(Mfn(6), 0, &mut b).expect("frame");
            assert_eq!(&b[..], &data[1024..1024 + PAGE_SIZE]);
            // Into a read-only mapping: refused at once, nothing held or placed.
            let ro = [IoPiece::Slot {
                slot: 1,
                offset: 0,
                len: 512,
            }];
            assert_eq!(r.read(&w, &ro, 0, 8), Err(MemError::ReadOnly(1)));
            assert_eq!(r.in_flight(), 0);
            // Past the file's end: the transfer ends in EIO.
            r.read(&w, &pieces, 16384 - 1024, 9).expect("placed");
            // A write out of the read-only mapping, then a sync: several in one enter.
            mem.fill(Mfn(4), 0, PAGE_SIZE, 0xab).expect("fill");
            r.write(&w, &ro, 8192, 10).expect("placed");
            let enters = r.enters();
            r.submit().expect("submit");
            assert_eq!(r.enters(), enters + 1, "one enter for both");
            let mut got = ended(&mut r);
            got.sort_by_key(|c| c.tag);
            assert_eq!(
                got,
                [
                    Completion {
                        tag: 9,
                        result: Err(MemError::Os(libc::EIO))
                    },
                    Completion {
                        tag: 10,
                        result: Ok(())
                    }
                ]
            );
            r.sync(11).expect("placed");
            r.submit().expect("submit");
            assert_eq!(
                ended(&mut r),
                [Completion {
                    tag: 11,
                    result: Ok(())
                }]
            );
            let back = std::fs::read(&path).expect("read back");
            assert!(back[8192..8704].iter().all(|&x| x == 0xab));
            assert_eq!(&back[..8192], &data[..8192]);
            assert_eq!(&back[8704..], &data[8704..]);
            // Every slot let go.
            assert_eq!(w.unmap(0), Ok(Mfn(3)));
            assert_eq!(w.unmap(1), Ok(Mfn(4)));
            let _ = std::fs::remove_file(&path);
        }
    }

    #[test]
    fn a_full_ring_refuses_more_and_a_dropped_one_waits_for_its_transfers() {
        let mem = Arc::new(MachineMemory::new(8).expect("memfd"));
        let w = Arc::new(MapWindow::new(Arc::clone(&mem), 4).expect("w"));
        let (path, f, data) = file("full", 8192);
        w.map(2, Mfn(5), true).expect("map");
        let mut r = FileRing::new(f.as_fd(), 2).expect("io_uring");
        let piece = |offset| IoPiece::Slot {
            slot: 2,
            offset,
            len: 1024,
        };
        r.read(&w, &[piece(0)], 0, 1).expect("placed");
        r.read(&w, &[piece(1024)], 1024, 2).expect("placed");
        assert_eq!(
            r.read(&w, &[piece(2048)], 2048, 3),
            Err(MemError::Os(libc::EBUSY))
        );
        r.submit().expect("submit");
        drop(r);
        // Both ended before the drop returned: the slot is free and holds their bytes.
        assert_eq!(w.unmap(2), Ok(Mfn(5)));
        let mut b = vec![0u8; 2048];
        mem.read(Mfn(5), 0, &mut b).expect("frame");
        assert_eq!(&b[..], &data[..2048]);
        let _ = std::fs::remove_file(&path);
    }
}
