//! Batched frame I/O on a TAP (or any descriptor that reads and writes one frame a
//! call) through an io_uring: many frames each way for one system call.
//!
//! **Receive.** One multishot read (`IORING_OP_READ_MULTISHOT`, Linux 6.7) stays armed
//! on the descriptor with a ring of provided buffers (`IORING_REGISTER_PBUF_RING`,
//! 5.19): each frame the kernel has lands in a buffer it picks, and its completion
//! names the buffer. The ring is set up with cooperative task running
//! (`IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG`): the reads run in the
//! owner's thread the next time it enters the kernel, which the ring's shared flags say
//! it should; so a look that finds frames costs one `io_uring_enter` for all of them,
//! and one that finds none costs nothing but loads. A consumed buffer goes back to the
//! kernel by a store to the buffer ring, not a call. The descriptor itself stays what
//! wakes the owner (its queue is readable until the reads have run).
//!
//! **Transmit.** A frame is written into one of the ring's own slots (the copy its
//! owner would otherwise hand to `write`), queued as a write, and every queued write
//! goes to the kernel in one `io_uring_enter` ([`TapRing::flush`]); a TAP's write
//! completes inline, so its slot is free again when the call returns.
//!
//! **Receive from any thread** ([`RxMode::Nowait`]). The multishot read's frames are
//! read by the thread that armed it, so its owner must look from that thread. A ring
//! whose owner moves between threads (a device's engine that idle pCPUs may run)
//! instead hands the kernel several single reads in one `io_uring_enter`, each marked
//! `RWF_NOWAIT`: each takes a frame inside that call, or fails with `EAGAIN` rather
//! than wait (no poll is armed, so nothing is left as work of the calling thread). The
//! buffers are the ring's own, named by each read. A batch that came back full is
//! followed by a larger one in the same look, one that ran dry by one just larger than
//! what it found, so a look at a quiet descriptor costs one call with one read (as a
//! plain `read` would), and a busy one many frames a call. Writes there are marked
//! `RWF_NOWAIT` too.
//!
//! [`TapRing::new`] fails where the kernel has no io_uring, refuses it, or lacks the
//! read it needs (the multishot read for [`RxMode::Armed`]); the owner then reads and
//! writes one frame a call.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::{cqueue, opcode, types, IoUring, Probe};

use crate::MemError;

/// The provided-buffer group of the receive buffers.
const RX_GROUP: u16 = 7;
/// The user data of the multishot read's completions (a write's is its slot).
const RX_TAG: u64 = u64::MAX;
/// The user data of the cancellation of the read.
const CANCEL_TAG: u64 = u64::MAX - 1;
/// The user data of a single read (`RxMode::Nowait`) is this and its buffer's index.
const READ_TAG: u64 = 1 << 32;
/// The most single reads one `io_uring_enter` carries.
const READ_BATCH_MAX: usize = 64;
/// How long [`TapRing::close`] waits for the kernel to let go of the descriptor.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

fn os(e: std::io::Error) -> MemError {
    MemError::Os(e.raw_os_error().unwrap_or(libc::EIO))
}

/// Whether this kernel should run a [`TapRing`]: Linux 6.7 or later (the multishot
/// read), with io_uring not disabled (`kernel.io_uring_disabled`). Tests use it so that a
/// ring that fails where it should not is a failure, not a skip.
pub fn kernel_runs_rings() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    let version = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .and_then(|d| d.trim().parse::<u32>().ok())
        .unwrap_or(0);
    version >= (6, 7) && disabled == 0
}

/// Anonymous memory, page-aligned, unmapped when dropped.
#[derive(Debug)]
struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the region is plain memory owned by one TapRing; the kernel reads and writes it
// only through the ring the same owner drives.
unsafe impl Send for Region {}

impl Region {
    fn new(len: usize) -> Result<Self, MemError> {
        let len = len.div_ceil(crate::PAGE_SIZE).max(1) * crate::PAGE_SIZE;
        // SAFETY: an anonymous private mapping of `len` bytes, with no address hint; the
        // result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os(std::io::Error::last_os_error()));
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn addr(&self, at: usize) -> u64 {
        self.ptr as u64 + at as u64
    }

    fn bytes(&self, at: usize, len: usize) -> &[u8] {
        assert!(at + len <= self.len);
        // SAFETY: within the mapping (asserted); the kernel writes a buffer only while it
        // is with the kernel (posted to the buffer ring, or a write in flight reads it),
        // and the owner reads or writes it only after its completion, before it goes
        // back.
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) }
    }

    fn bytes_mut(&mut self, at: usize, len: usize) -> &mut [u8] {
        assert!(at + len <= self.len);
        // SAFETY: as `bytes`; `&mut self` makes this the only reference the owner holds.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of this length; nothing refers to it now
        // (the ring that used it was dropped first: see TapRing's field order).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// What one look at the ring found, frame by frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxEvent {
    /// A frame of this many bytes in buffer `bid`.
    Frame { bid: u16, len: usize },
    /// A read failed other than for want of input or buffers (its errno), or the input
    /// ended (0): nothing more will be read.
    Error(i32),
}

/// How a ring reads (see the module's notes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxMode {
    /// One multishot read stays armed and runs as work of the thread that armed it: a
    /// look that finds nothing costs no call, but only that thread's looks read.
    Armed,
    /// Single reads that never wait, several to a call, done inside the call of
    /// whichever thread looks: the owner may move between threads.
    Nowait,
}

/// Counters of the ring's work.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TapRingStats {
    /// `io_uring_enter` calls (system calls).
    pub enters: u64,
    /// Frames read.
    pub reads: u64,
    /// Frames written.
    pub writes: u64,
    /// Times the multishot read was armed again (it ended for want of buffers).
    pub rearms: u64,
    /// Single reads that found nothing (`RxMode::Nowait`).
    pub dry_reads: u64,
    /// Completions that named no read or write in flight: skipped.
    pub strays: u64,
}

/// An io_uring serving one TAP's frames both ways.
pub struct TapRing {
    // Dropped first: the kernel lets go of every buffer and slot with the ring.
    ring: IoUring,
    file: OwnedFd,
    mode: RxMode,
    rx_mem: Region,
    rx_ring: Region,
    rx_size: usize,
    rx_count: u16,
    /// The buffer ring's tail as last published.
    rx_tail: u16,
    /// The multishot read is in the kernel.
    rx_armed: bool,
    /// A read failed for good: not armed again.
    rx_failed: bool,
    /// Frames (and failures) reaped and not yet handed on, in order.
    ready: std::collections::VecDeque<RxEvent>,
    /// `RxMode::Nowait`: buffers free for a read.
    rx_free: Vec<u16>,
    /// `RxMode::Nowait`: whether each buffer is with a read in the kernel.
    rx_out: Box<[bool]>,
    /// `RxMode::Nowait`: how many reads the next batch carries.
    rx_batch: usize,
    /// `RxMode::Nowait`: a read of the batches reaped since last cleared found nothing.
    rx_dry: bool,
    tx_mem: Region,
    tx_size: usize,
    tx_free: Vec<u16>,
    /// Each slot's length as queued: a write that moved less failed.
    tx_len: Box<[u32]>,
    /// Whether each slot is with a write in the kernel.
    tx_out: Box<[bool]>,
    /// Writes placed in the submission queue and not yet handed to the kernel.
    tx_queued: usize,
    /// Writes whose completion has not been reaped.
    tx_in_flight: usize,
    tx_errors: u64,
    stats: TapRingStats,
}

impl Drop for TapRing {
    fn drop(&mut self) {
        self.close();
    }
}

impl std::fmt::Debug for TapRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TapRing")
            .field("rx", &(self.rx_count, self.rx_size))
            .field("tx_free", &self.tx_free.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl TapRing {
    /// A ring for `file` with `rx_count` receive buffers (a power of two, at most
    /// 32768; 0 for a ring that only transmits) and `tx_count` transmit slots, each
    /// `size` bytes. The calling thread is the one whose kernel entries run the reads:
    /// make it on the thread that will look at it. Any thread may look, as a unit moves
    /// between threads; the read armed by a thread that ends is cancelled by the kernel
    /// and armed again by the next look, on that look's thread (so the ring is not
    /// `IORING_SETUP_SINGLE_ISSUER`, which would refuse every thread but its first).
    /// Fails where the kernel lacks what it needs (see the module's notes).
    pub fn new(
        file: BorrowedFd<'_>,
        rx_count: u16,
        tx_count: u16,
        size: usize,
    ) -> Result<Self, MemError> {
        Self::with_mode(file, rx_count, tx_count, size, RxMode::Armed)
    }

    /// As [`TapRing::new`], reading as `mode` says. With [`RxMode::Nowait`] no read
    /// waits in the kernel between looks, and any thread may look.
    pub fn with_mode(
        file: BorrowedFd<'_>,
        rx_count: u16,
        tx_count: u16,
        size: usize,
        mode: RxMode,
    ) -> Result<Self, MemError> {
        if (rx_count != 0 && !rx_count.is_power_of_two())
            || rx_count > 32768
            || tx_count == 0
            || size == 0
        {
            return Err(MemError::Os(libc::EINVAL));
        }
        let reads = match mode {
            RxMode::Armed => 0,
            RxMode::Nowait => READ_BATCH_MAX.min(usize::from(rx_count)) as u32,
        };
        let entries = (u32::from(tx_count) + reads + 8).next_power_of_two();
        let ring = IoUring::builder()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_cqsize(4 * (entries + u32::from(rx_count)))
            .build(entries)
            .map_err(os)?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe).map_err(os)?;
        let read = match mode {
            RxMode::Armed => opcode::ReadMulti::CODE,
            RxMode::Nowait => opcode::Read::CODE,
        };
        if !probe.is_supported(read) || !probe.is_supported(opcode::Write::CODE) {
            return Err(MemError::Os(libc::EOPNOTSUPP));
        }
        let file = file.try_clone_to_owned().map_err(os)?;
        let rx_mem = Region::new(usize::from(rx_count) * size)?;
        let rx_ring =
            Region::new(usize::from(rx_count) * std::mem::size_of::<types::BufRingEntry>())?;
        if rx_count > 0 && mode == RxMode::Armed {
            // SAFETY: `rx_ring` is page-aligned, `rx_count` entries long, zeroed (its
            // tail 0), and lives as long as the ring (dropped after it).
            unsafe {
                ring.submitter()
                    .register_buf_ring_with_flags(rx_ring.addr(0), rx_count, RX_GROUP, 0)
                    .map_err(os)?;
            }
        }
        let tx_mem = Region::new(usize::from(tx_count) * size)?;
        let mut r = Self {
            ring,
            file,
            mode,
            rx_mem,
            rx_ring,
            rx_size: size,
            rx_count,
            rx_tail: 0,
            rx_armed: false,
            rx_failed: false,
            ready: std::collections::VecDeque::with_capacity(usize::from(rx_count)),
            rx_free: match mode {
                RxMode::Armed => Vec::new(),
                RxMode::Nowait => (0..rx_count).rev().collect(),
            },
            rx_out: vec![false; usize::from(rx_count)].into_boxed_slice(),
            rx_batch: 1,
            rx_dry: false,
            tx_mem,
            tx_size: size,
            tx_free: (0..tx_count).rev().collect(),
            tx_len: vec![0; usize::from(tx_count)].into_boxed_slice(),
            tx_out: vec![false; usize::from(tx_count)].into_boxed_slice(),
            tx_queued: 0,
            tx_in_flight: 0,
            tx_errors: 0,
            stats: TapRingStats::default(),
        };
        if rx_count == 0 {
            // Transmit only: nothing is ever read.
            r.rx_failed = true;
            return Ok(r);
        }
        if mode == RxMode::Nowait {
            // Nothing waits in the kernel: the first look reads.
            return Ok(r);
        }
        for bid in 0..rx_count {
            r.put_back(bid);
        }
        r.arm()?;
        r.enter()?;
        Ok(r)
    }

    /// How the ring reads.
    pub fn mode(&self) -> RxMode {
        self.mode
    }

    /// The ring's counters.
    pub fn stats(&self) -> TapRingStats {
        self.stats
    }

    /// Writes that failed or came up short.
    pub fn tx_errors(&self) -> u64 {
        self.tx_errors
    }

    /// The descriptor served.
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// The ring's own descriptor: readable while completions wait to be reaped.
    pub fn ring_fd(&self) -> RawFd {
        self.ring.as_raw_fd()
    }

    /// Gives receive buffer `bid` back to the kernel.
    fn put_back(&mut self, bid: u16) {
        let base = self.rx_ring.ptr.cast::<types::BufRingEntry>();
        let i = self.rx_tail & (self.rx_count - 1);
        // SAFETY: entry `i` is within the buffer ring (i < rx_count); the kernel reads
        // entries only below the tail published next, so this one is the owner's.
        let e = unsafe { &mut *base.add(usize::from(i)) };
        e.set_addr(self.rx_mem.addr(usize::from(bid) * self.rx_size));
        e.set_len(self.rx_size as u32);
        e.set_bid(bid);
        self.rx_tail = self.rx_tail.wrapping_add(1);
        // SAFETY: the tail field of entry 0 (the ring's base), a u16 the kernel reads
        // concurrently: published with a release store after the entry is written.
        let tail = unsafe { &*types::BufRingEntry::tail(base).cast::<AtomicU16>() };
        tail.store(self.rx_tail, Ordering::Release);
    }

    /// Places the multishot read in the submission queue.
    fn arm(&mut self) -> Result<(), MemError> {
        let e = opcode::ReadMulti::new(types::Fd(self.file.as_raw_fd()), 0, RX_GROUP)
            .build()
            .user_data(RX_TAG);
        // SAFETY: the read writes only into provided buffers of group RX_GROUP, which
        // live in `rx_mem` as long as the ring.
        unsafe { self.ring.submission().push(&e) }.map_err(|_| MemError::Os(libc::EBUSY))?;
        self.rx_armed = true;
        Ok(())
    }

    /// One `io_uring_enter`: hands queued entries to the kernel and runs the reads
    /// that input has made due.
    fn enter(&mut self) -> Result<(), MemError> {
        self.stats.enters += 1;
        self.tx_in_flight += self.tx_queued;
        self.tx_queued = 0;
        match self.ring.submit() {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(()),
            Err(e) => Err(os(e)),
        }
    }

    /// Whether a look would find something: frames already reaped, completions
    /// posted, or reads the kernel has made due for this thread to run.
    pub fn pending(&self) -> bool {
        if !self.ready.is_empty() {
            return true;
        }
        if self.mode == RxMode::Nowait {
            // Reads complete inside the call that made them: nothing is due later.
            return false;
        }
        // SAFETY: the shared queues are only read here (their flags and indices), and
        // dropped before returning; every other use of them takes `&mut self`, which
        // cannot coexist with this `&self`.
        unsafe {
            self.ring.submission_shared().taskrun() || !self.ring.completion_shared().is_empty()
        }
    }

    /// Moves every posted completion out of the queue: a write's frees its slot, a
    /// read's frame (or failure) joins the frames ready, in order.
    fn reap(&mut self) {
        let mut eof_bid = None;
        // One completion at a time, each given back to the kernel as it is taken.
        loop {
            let next = self.ring.completion().next();
            let Some(c) = next else {
                break;
            };
            let res = c.result();
            let tag = c.user_data();
            if tag == CANCEL_TAG {
                continue;
            }
            if (READ_TAG..CANCEL_TAG).contains(&tag) {
                self.reaped_read(tag - READ_TAG, res);
                continue;
            }
            if tag != RX_TAG {
                // A write's: the kernel names only slots it was given; one that is not
                // in flight is counted and skipped, never freed twice.
                let Some(slot) = u16::try_from(tag)
                    .ok()
                    .map(usize::from)
                    .filter(|&s| s < self.tx_out.len() && self.tx_out[s])
                else {
                    self.stats.strays += 1;
                    continue;
                };
                self.tx_out[slot] = false;
                self.tx_in_flight = self.tx_in_flight.saturating_sub(1);
                self.tx_free.push(slot as u16);
                if res < 0 || res as u32 != self.tx_len[slot] {
                    self.tx_errors += 1;
                } else {
                    self.stats.writes += 1;
                }
                continue;
            }
            if !cqueue::more(c.flags()) {
                self.rx_armed = false;
            }
            if res < 0 {
                // For want of input or of buffers the read is armed again at the next
                // look, and so is one cancelled by the kernel because the thread that
                // armed it ended (a request belongs to the thread that submitted it; a
                // unit moves between threads when a hung pCPU's others go to a fresh
                // one): the descriptor is fine, and this thread arms it anew. Any
                // other failure ends it (a descriptor in error would fail at once
                // again); `close`'s own cancellation ends it there.
                let again = [libc::ENOBUFS, libc::EAGAIN, libc::EINTR, libc::ECANCELED];
                if !again.contains(&-res) {
                    self.rx_failed = true;
                    self.ready.push_back(RxEvent::Error(-res));
                }
                continue;
            }
            if res == 0 {
                // End of input (a peer gone): nothing more will come.
                eof_bid = cqueue::buffer_select(c.flags());
                self.rx_failed = true;
                self.ready.push_back(RxEvent::Error(0));
                continue;
            }
            // The kernel names only buffers it was given; one it was not is counted
            // and skipped rather than trusted.
            if let Some(bid) = cqueue::buffer_select(c.flags()).filter(|&b| b < self.rx_count) {
                self.stats.reads += 1;
                let len = (res as usize).min(self.rx_size);
                self.ready.push_back(RxEvent::Frame { bid, len });
            }
        }
        if let Some(bid) = eof_bid {
            self.put_back(bid);
        }
    }

    /// One single read's completion (`RxMode::Nowait`): buffer `bid`, result `res`.
    fn reaped_read(&mut self, bid: u64, res: i32) {
        let Some(bid) = u16::try_from(bid)
            .ok()
            .filter(|&b| b < self.rx_count && self.rx_out[usize::from(b)])
        else {
            self.stats.strays += 1;
            return;
        };
        self.rx_out[usize::from(bid)] = false;
        if res > 0 {
            self.stats.reads += 1;
            let len = (res as usize).min(self.rx_size);
            self.ready.push_back(RxEvent::Frame { bid, len });
            return;
        }
        self.rx_free.push(bid);
        if res == -libc::EAGAIN || res == -libc::EINTR {
            self.stats.dry_reads += 1;
            self.rx_dry = true;
        } else if !self.rx_failed {
            // End of input (0), or the descriptor failed: nothing more will be read.
            self.rx_failed = true;
            self.ready.push_back(RxEvent::Error(-res));
        }
    }

    /// Hands the kernel a batch of single reads that never wait and reaps what they
    /// found (`RxMode::Nowait`): false if none could be made.
    fn read_batch(&mut self, want: usize) -> bool {
        let k = want
            .min(self.rx_batch)
            .min(self.rx_free.len())
            .min(READ_BATCH_MAX);
        let mut made = 0;
        while made < k {
            let Some(&bid) = self.rx_free.last() else {
                break;
            };
            let at = usize::from(bid) * self.rx_size;
            let e = opcode::Read::new(
                types::Fd(self.file.as_raw_fd()),
                self.rx_mem.addr(at) as *mut u8,
                self.rx_size as u32,
            )
            .offset(u64::MAX)
            .rw_flags(libc::RWF_NOWAIT)
            .build()
            .user_data(READ_TAG + u64::from(bid));
            // SAFETY: the read writes at most `rx_size` bytes into buffer `bid` of
            // `rx_mem`, which stays out of the free list until its completion is reaped.
            if unsafe { self.ring.submission().push(&e) }.is_err() {
                break;
            }
            self.rx_free.pop();
            self.rx_out[usize::from(bid)] = true;
            made += 1;
        }
        if made == 0 {
            return false;
        }
        let found = self.stats.reads;
        self.rx_dry = false;
        let entered = self.enter();
        self.reap();
        let found = (self.stats.reads - found) as usize;
        // Full: more may wait, so the next batch is larger; dry: the next is just
        // larger than what this one found.
        self.rx_batch = if self.rx_dry {
            found + 1
        } else {
            (2 * made).min(READ_BATCH_MAX)
        };
        entered.is_ok()
    }

    /// Hands the frames read so far to `f` in order, until `f` has taken `max` or
    /// refuses one (returns false: that frame is handed on first next time). Enters
    /// the kernel at most once, and only if it has reads due (or the read must be armed
    /// again). Returns the frames taken; a read's failure is handed on as
    /// [`RxEvent::Error`] with no bytes, and ends the reading.
    pub fn recv(&mut self, max: usize, mut f: impl FnMut(RxEvent, &[u8]) -> bool) -> usize {
        let mut n = 0;
        let mut entered = false;
        while n < max {
            if self.ready.is_empty() {
                self.reap();
            }
            let Some(ev) = self.ready.pop_front() else {
                if self.mode == RxMode::Nowait {
                    // Another batch while the last came back full.
                    if (entered && self.rx_dry) || self.rx_failed || !self.read_batch(max - n) {
                        break;
                    }
                    entered = true;
                    continue;
                }
                let rearm = !self.rx_armed && !self.rx_failed;
                if entered || !(rearm || self.ring.submission().taskrun()) {
                    break;
                }
                if rearm && self.arm().is_ok() {
                    self.stats.rearms += 1;
                }
                entered = true;
                if self.enter().is_err() {
                    break;
                }
                continue;
            };
            match ev {
                RxEvent::Frame { bid, len } => {
                    let at = usize::from(bid) * self.rx_size;
                    if !f(ev, self.rx_mem.bytes(at, len)) {
                        self.ready.push_front(ev);
                        return n;
                    }
                    match self.mode {
                        RxMode::Armed => self.put_back(bid),
                        RxMode::Nowait => self.rx_free.push(bid),
                    }
                    n += 1;
                }
                RxEvent::Error(_) => {
                    f(ev, &[]);
                    return n;
                }
            }
        }
        n
    }

    /// Hands every queued write to the kernel in one call, and frees the slots of
    /// those done.
    pub fn flush(&mut self) {
        if self.tx_queued > 0 {
            let _ = self.enter();
        }
        self.reap();
    }

    /// Writes queued and not yet handed to the kernel.
    pub fn queued(&self) -> usize {
        self.tx_queued
    }

    /// Ends the ring's work on the descriptor: sends what is queued, cancels the read
    /// and waits (a bounded while) until the kernel has let go of the descriptor. A
    /// request in flight holds the file open, and a TAP whose file stays open after its
    /// owner is done keeps its name, so the next TAP of that name could not be made. The
    /// kernel finishes a cancelled read in the thread that armed it: call this there
    /// (dropping the ring does, wherever it is dropped, and waits no longer than
    /// [`CLOSE_WAIT`]).
    pub fn close(&mut self) {
        self.flush();
        if self.rx_armed {
            let e = opcode::AsyncCancel::new(RX_TAG)
                .build()
                .user_data(CANCEL_TAG);
            // SAFETY: a cancellation names a request by its user data; it reads no
            // memory of ours.
            if unsafe { self.ring.submission().push(&e) }.is_err() {
                return;
            }
        }
        let t0 = std::time::Instant::now();
        let ts = types::Timespec::new().nsec(10_000_000);
        while (self.rx_armed || self.rx_out.contains(&true) || self.tx_in_flight > 0)
            && t0.elapsed() < CLOSE_WAIT
        {
            let args = types::SubmitArgs::new().timespec(&ts);
            self.stats.enters += 1;
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {}
                Err(_) => break,
            }
            self.reap();
        }
        self.rx_failed = true;
    }

    /// Writes one frame: `fill` puts at most `len` bytes in a slot and says how many;
    /// the write goes with the next [`TapRing::flush`] (or now, if the queue is full).
    /// False if no slot could be had.
    pub fn send(&mut self, len: usize, fill: impl FnOnce(&mut [u8]) -> usize) -> bool {
        if len > self.tx_size {
            self.tx_errors += 1;
            return false;
        }
        if self.tx_free.is_empty() {
            self.reap();
        }
        if self.tx_free.is_empty() || self.ring.submission().is_full() {
            self.flush();
        }
        let Some(slot) = self.tx_free.pop() else {
            return false;
        };
        let at = usize::from(slot) * self.tx_size;
        let n = fill(self.tx_mem.bytes_mut(at, len)).min(len);
        let e = opcode::Write::new(
            types::Fd(self.file.as_raw_fd()),
            self.tx_mem.addr(at) as *const u8,
            n as u32,
        )
        .offset(u64::MAX)
        .rw_flags(match self.mode {
            RxMode::Armed => 0,
            // Fails rather than leave a poll armed for the calling thread.
            RxMode::Nowait => libc::RWF_NOWAIT,
        })
        .build()
        .user_data(u64::from(slot));
        // SAFETY: the write reads `n` bytes of slot `slot`, which stays out of the free
        // list until its completion is reaped.
        if unsafe { self.ring.submission().push(&e) }.is_err() {
            self.tx_free.push(slot);
            self.tx_errors += 1;
            return false;
        }
        self.tx_len[usize::from(slot)] = n as u32;
        self.tx_out[usize::from(slot)] = true;
        self.tx_queued += 1;
        true
    }
}

#[cfg(test)]
impl TapRing {
    /// Has the kernel post a completion with user data `tag` for nothing the ring made
    /// (a no-op's), as a completion the ring never asked for would come.
    fn post_stray(&mut self, tag: u64) {
        let e = opcode::Nop::new().build().user_data(tag);
        // SAFETY: a no-op reads and writes no memory.
        unsafe { self.ring.submission().push(&e) }.expect("room");
        self.ring.submit().expect("enter");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixDatagram;

    /// A ring over one end of a datagram socket pair (a frame a read, as a TAP gives),
    /// or None where the kernel cannot run it.
    fn pair() -> Option<(TapRing, UnixDatagram, UnixDatagram)> {
        pair_of(RxMode::Armed)
    }

    fn pair_of(mode: RxMode) -> Option<(TapRing, UnixDatagram, UnixDatagram)> {
        let (a, b) = UnixDatagram::pair().expect("pair");
        a.set_nonblocking(true).expect("nonblocking");
        match TapRing::with_mode(a.as_fd(), 16, 8, 2048, mode) {
            Ok(r) => Some((r, a, b)),
            Err(e) => {
                assert!(!kernel_runs_rings(), "this kernel should run a ring: {e:?}");
                eprintln!("no io_uring with multishot reads here: {e:?}");
                None
            }
        }
    }

    #[test]
    fn frames_cross_in_order_both_ways_many_to_a_call() {
        for mode in [RxMode::Armed, RxMode::Nowait] {
            frames_cross(mode);
        }
    }

    fn frames_cross(mode: RxMode) {
        let Some((mut r, _a, peer)) = pair_of(mode) else {
            return;
        };
        // More frames than buffers: the read ends for want of them and is armed again.
        let frames: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 60 + usize::from(i)]).collect();
        for f in &frames {
            peer.send(f).expect("send");
        }
        let mut got: Vec<Vec<u8>> = Vec::new();
        for _ in 0..20 {
            r.recv(64, |ev, bytes| {
                assert!(matches!(ev, RxEvent::Frame { .. }));
                got.push(bytes.to_vec());
                true
            });
            if got.len() == frames.len() {
                break;
            }
        }
        assert_eq!(got, frames);
        let st = r.stats();
        assert!(
            st.enters < frames.len() as u64 / 2,
            "{mode:?} batched: {st:?}"
        );
        // A refused frame is handed on first next time.
        peer.send(&[7u8; 70]).expect("send");
        peer.send(&[8u8; 80]).expect("send");
        let mut refused = 0;
        while refused == 0 {
            r.recv(64, |_, b| {
                assert_eq!(b, &[7u8; 70][..]);
                refused += 1;
                false
            });
        }
        let mut next = Vec::new();
        while next.len() < 2 {
            r.recv(64, |_, b| {
                next.push(b[0]);
                true
            });
        }
        assert_eq!(next, [7, 8]);
        // Twenty frames out (more than the slots), one call a full queue.
        for i in 0..20u8 {
            assert!(r.send(100, |buf| {
                buf[..50].fill(i);
                50
            }));
        }
        r.flush();
        let mut buf = [0u8; 200];
        for i in 0..20u8 {
            let n = peer.recv(&mut buf).expect("frame");
            assert_eq!(&buf[..n], &[i; 50][..]);
        }
        assert_eq!(r.tx_errors(), 0);
        assert!(r.stats().writes >= 20);
        assert!(!r.send(4096, |_| 0), "larger than a slot: refused");
    }

    #[test]
    fn a_read_armed_by_a_thread_that_ended_is_armed_again_by_the_next() {
        // The ring is made, and its multishot read goes to the kernel, in a thread that
        // then ends: the kernel cancels what that thread submitted.
        let Some((mut r, _a, peer)) = std::thread::spawn(pair).join().expect("arming thread")
        else {
            return;
        };
        let frames: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 64]).collect();
        for f in &frames {
            peer.send(f).expect("send");
        }
        let mut got = Vec::new();
        for _ in 0..100 {
            r.recv(64, |ev, bytes| {
                assert!(matches!(ev, RxEvent::Frame { .. }), "{ev:?}");
                got.push(bytes.to_vec());
                true
            });
            if got.len() == frames.len() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            got,
            frames,
            "the frames arrive through the read armed again: {:?} armed {} failed {}",
            r.stats(),
            r.rx_armed,
            r.rx_failed
        );
        assert_eq!(r.stats().rearms, 1, "{:?}", r.stats());
    }

    #[test]
    fn a_look_that_finds_nothing_makes_no_system_call() {
        let Some((mut r, _a, peer)) = pair() else {
            return;
        };
        peer.send(b"last").expect("send");
        let mut seen = Vec::new();
        while seen.is_empty() {
            r.recv(64, |_, b| {
                seen.push(b.to_vec());
                true
            });
        }
        let before = r.stats().enters;
        for _ in 0..100 {
            assert_eq!(r.recv(64, |_, _| true), 0);
            assert!(!r.pending());
        }
        assert_eq!(r.stats().enters, before, "idle looks are loads, not calls");
        assert_eq!(seen, [b"last".to_vec()]);
    }

    #[test]
    fn reads_that_never_wait_serve_whichever_thread_looks() {
        // Made on a thread that ends before any look: nothing of its is left in the
        // kernel, and every other thread's look reads.
        let Some((r, _a, peer)) = std::thread::spawn(|| pair_of(RxMode::Nowait))
            .join()
            .expect("making thread")
        else {
            return;
        };
        let r = std::sync::Mutex::new(r);
        let mut got = Vec::new();
        for round in 0..4u8 {
            for i in 0..10u8 {
                peer.send(&[round * 10 + i; 90]).expect("send");
            }
            // Each round's frames all wait when a thread never seen before looks once.
            let took = std::thread::scope(|s| {
                s.spawn(|| {
                    let mut r = r.lock().expect("ring");
                    let mut took = Vec::new();
                    r.recv(64, |ev, b| {
                        assert!(matches!(ev, RxEvent::Frame { .. }), "{ev:?}");
                        took.push(b[0]);
                        true
                    });
                    took
                })
                .join()
                .expect("looking thread")
            });
            got.extend(took);
        }
        let want: Vec<u8> = (0..40).collect();
        assert_eq!(got, want, "every frame, in order, one look each round");
        let st = r.lock().expect("ring").stats();
        assert_eq!(st.reads, 40);
        assert!(st.enters <= 4 * 5, "a few calls a round of ten: {st:?}");
        assert_eq!(st.strays, 0);
    }

    #[test]
    fn a_quiet_look_without_waiting_reads_costs_one_call_of_one_read() {
        let Some((mut r, _a, peer)) = pair_of(RxMode::Nowait) else {
            return;
        };
        peer.send(b"first").expect("send");
        assert_eq!(r.recv(64, |_, b| b == b"first"), 1);
        let before = r.stats();
        for _ in 0..10 {
            assert_eq!(r.recv(64, |_, _| true), 0);
            assert!(!r.pending(), "nothing is due later: no read waits");
        }
        let st = r.stats();
        assert_eq!(st.enters - before.enters, 10, "one call a look: {st:?}");
        assert_eq!(st.dry_reads - before.dry_reads, 10, "of one read: {st:?}");
        // Nothing waits in the kernel, so a peer's frame waits in the socket until a look.
        peer.send(b"later").expect("send");
        let mut seen = Vec::new();
        r.recv(64, |_, b| {
            seen.push(b.to_vec());
            true
        });
        assert_eq!(seen, [b"later".to_vec()]);
    }

    #[test]
    fn a_completion_for_no_read_or_write_in_flight_is_counted_and_frees_nothing() {
        for mode in [RxMode::Armed, RxMode::Nowait] {
            let Some((mut r, _a, peer)) = pair_of(mode) else {
                return;
            };
            let free = r.tx_free.len();
            // A read's buffer not with the kernel, one past the buffers, a write's slot
            // not in flight, one past the slots.
            for tag in [READ_TAG + 3, READ_TAG + 9999, 5, 60_000] {
                r.post_stray(tag);
            }
            r.reap();
            assert_eq!(r.stats().strays, 4, "{mode:?}");
            assert_eq!(r.tx_free.len(), free, "{mode:?}: no slot freed twice");
            assert!(r.ready.is_empty(), "{mode:?}: no frame made up");
            // Frames still cross both ways.
            peer.send(b"after").expect("send");
            let mut got = Vec::new();
            for _ in 0..100 {
                r.recv(64, |_, b| {
                    got.push(b.to_vec());
                    true
                });
                if !got.is_empty() {
                    break;
                }
            }
            assert_eq!(got, [b"after".to_vec()], "{mode:?}");
            assert!(r.send(10, |b| {
                b.fill(1);
                10
            }));
            r.flush();
            let mut buf = [0u8; 16];
            assert_eq!(peer.recv(&mut buf).expect("frame"), 10);
            assert_eq!(r.tx_errors(), 0, "{mode:?}");
        }
    }
}
