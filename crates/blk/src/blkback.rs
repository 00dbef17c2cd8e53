//! blkback: the driver domain's end of a virtual block device, as Linux's
//! `xen-blkback`, serving a backing file ([`FileDisk`]).
//!
//! Each pass takes every request the ring holds, **copies** each slot, judges the copy
//! ([`read_request`]) and only then uses it: a refused request is answered with its
//! status and counted by reason, and the ring goes on. An id already taken in the same
//! pass and not yet answered is refused too ([`VbdStats::id_in_flight`]): its first
//! holder keeps its own answer.
//!
//! A read or write maps the request's segments into the driver domain's window in one
//! batch (read-only for a write, whose pages the back end only reads), moves the whole
//! request between the disk and the mapped pages in one vectored transfer with no buffer
//! between (the disk's [`FileDisk::read_vectored`], a controller's scatter-gather DMA
//! into the pages), and unmaps the batch (one shoot-down). A back end in user space
//! (`pvio backend`), where each map and unmap is a system call and a page-table update,
//! copies those segments through pages of its own by one batch of grant copies instead
//! ([`Blkback::copy_transient`]). With `feature-persistent` a front end grants a fixed pool of
//! pages once; the back end keeps each mapped at a slot of its own after its first use,
//! up to [`PERSISTENT_MAX`], and maps any beyond that per request, as Linux does. An
//! indirect request's segment pages are mapped read-only for the request, their
//! segments copied out and checked ([`check_segments`]) before any is mapped (Linux
//! keeps those persistently too; pvio's front end grants them read-only, and a
//! persistent mapping is read-write).
//!
//! A grant that does not map (outside the front end's table, not granted to this
//! domain, granted read-only to a read) fails that request with `BLKIF_RSP_ERROR` and
//! is counted; the disk's errors likewise. A ring whose indices break the protocol
//! disconnects this device only: it is marked [`Broken`], its state goes to `Closing`,
//! and it takes nothing more.

use std::collections::HashMap;
use std::time::Instant;

use hv::profile::{enter, Class};
use hv::store::xenbus::{self as netbus, XenbusError};
use hv::store::{XenStore, XenbusState};
use hv::{
    CopyPtr, DiskPiece, DomId, Domain, Gfn, GrantCopy, GrantError, GrantHandle, GrantRef,
    GrantStatus, MapOp, Port, Pvio, Xen,
};
use mem::MappedPage;
use ring::{BackRing, PagesRing, RingError, MAX_RING_PAGES};

use crate::aoe::BadFrame;
use crate::blkif::{
    check_segments, indirect_pages, read_request, response, BadRequests, BlkRing, Offer,
    RawRequest, Request, Response, Segment, BLKIF_MAX_INDIRECT_PAGES_PER_REQUEST, BLKIF_RSP_ERROR,
    BLKIF_RSP_OKAY, SECTOR_SIZE, SEGMENTS_PER_INDIRECT_PAGE,
};
use crate::disk::FileDisk;
use crate::initiator::{AoeIo, Initiator};
use crate::xenbus::{self, Offered};

/// Segments the back end offers in one indirect request
/// (`feature-max-indirect-segments`, Linux blkback's `MAX_INDIRECT_SEGMENTS`).
pub const MAX_INDIRECT_SEGMENTS: u16 = 256;
/// Grants a device keeps mapped persistently unless told otherwise (Linux's default
/// `max_persistent_grants`; [`Blkback::connect_queues`] takes another).
pub const PERSISTENT_MAX: usize = 1056;
/// The most persistent grants a queue may be told to keep: blkfront's own pool at its
/// largest, a full 16-page ring of requests of [`MAX_INDIRECT_SEGMENTS`] each.
pub const PERSISTENT_LIMIT: usize = 512 * MAX_INDIRECT_SEGMENTS as usize;
/// Requests on a one-page blkif ring: what one pass takes at most.
pub const RING_REQUESTS: usize = 32;
/// The largest ring a file's back end offers (`max-ring-page-order`): 2^4 pages, 512
/// requests, as Linux's blkback. A remote disk's keeps one page: each request in flight
/// there holds slots of its own.
pub const MAX_RING_PAGE_ORDER: u32 = 4;
/// Queues a file's back end takes (`multi-queue-max-queues`, Linux's blkback's default):
/// each its own ring, channel, journal and persistent grants, over the one disk, each
/// at [`VBD_WINDOW_SLOTS`] window slots of its own. A remote disk's takes one.
pub const MAX_QUEUES: u32 = 4;

/// Transfers a queue keeps in flight to its disk at once when its disk I/O is
/// asynchronous ([`Blkback::disk_async`]): fio's and Linux's usual queue depth.
pub const DISK_DEPTH: u16 = 32;

/// Requests one [`Blkback::serve`] takes at most before it returns, two rings' worth: a
/// guest that posts as fast as it is answered holds its back end for a bounded time, and
/// the other devices of the same thread get their turn. What is left stays on the ring
/// ([`Blkback::pending`]) for the caller's next pass.
pub const SERVE_BUDGET: usize = 2 * RING_REQUESTS;

/// Segments a remote device offers in one indirect request: each request in flight
/// keeps its segments mapped until the target answers, at slots of its own.
pub const REMOTE_MAX_SEGMENTS: u16 = 32;
/// Slots for segments mapped per request: one request's at a time from a file, every
/// request's in flight at once from a remote disk.
const SEG_SLOTS: u32 = {
    let one = MAX_INDIRECT_SEGMENTS as u32;
    let all = RING_REQUESTS as u32 * REMOTE_MAX_SEGMENTS as u32;
    if one > all {
        one
    } else {
        all
    }
};

/// A device's window slots from its base: the ring, the indirect pages, the segments
/// mapped for requests, the persistent grants.
const RING_SLOT0: u32 = 0;
const INDIRECT_SLOT0: u32 = RING_SLOT0 + MAX_RING_PAGES as u32;
const SEG_SLOT0: u32 = INDIRECT_SLOT0 + BLKIF_MAX_INDIRECT_PAGES_PER_REQUEST as u32;
const PERSISTENT_SLOT0: u32 = SEG_SLOT0 + SEG_SLOTS;
/// Window slots one device needs.
pub const VBD_WINDOW_SLOTS: u32 = vbd_window_slots(PERSISTENT_MAX);

/// Window slots one device (one queue) needs if it keeps up to `persistent` grants
/// mapped (at most [`PERSISTENT_LIMIT`]).
pub const fn vbd_window_slots(persistent: usize) -> u32 {
    let p = if persistent > PERSISTENT_LIMIT {
        PERSISTENT_LIMIT
    } else {
        persistent
    };
    PERSISTENT_SLOT0 + p as u32
}

type Back = BackRing<BlkRing, PagesRing<MappedPage>>;

/// Why a device stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broken {
    /// The front end moved a ring index out of the protocol.
    Ring(RingError),
}

/// A device's counters. Every request taken is answered exactly once:
/// `taken == done + refused.total() + id_in_flight + bad_grants + io_errors`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VbdStats {
    /// Requests copied off the ring.
    pub taken: u64,
    /// Answered `BLKIF_RSP_OKAY`.
    pub done: u64,
    /// Reads and writes done, flushes and discards done.
    pub reads: u64,
    /// Writes done.
    pub writes: u64,
    /// Flushes done.
    pub flushes: u64,
    /// Discards done.
    pub discards: u64,
    /// Of the reads and writes, those with indirect segments.
    pub indirect: u64,
    /// Sectors read and written.
    pub sectors_read: u64,
    /// Sectors written.
    pub sectors_written: u64,
    /// Refused on judgement, by reason.
    pub refused: BadRequests,
    /// Refused: the id was taken earlier in the same pass and not yet answered.
    pub id_in_flight: u64,
    /// Failed: a segment's or indirect page's grant did not map.
    pub bad_grants: u64,
    /// Failed: the disk returned an error.
    pub io_errors: u64,
    /// Segments found mapped already (persistent grants).
    pub persistent_hits: u64,
    /// Grants mapped and kept (persistent grants).
    pub persistent_maps: u64,
    /// Grants mapped for one request and unmapped after it (segments' pages and
    /// indirect pages).
    pub transient_maps: u64,
    /// Segments copied through the back end's own pages by grant copy instead of
    /// mapped ([`Blkback::copy_transient`]).
    pub transient_copies: u64,
    /// Notifications sent to the front end.
    pub notifies: u64,
    /// Reads, writes and flushes the disk carried out asynchronously, answered when
    /// they ended ([`Blkback::disk_async`]).
    pub async_transfers: u64,
    /// `io_uring_enter` calls that handed them to the kernel (several a call).
    pub disk_enters: u64,
}

hv::counter_set!(VbdStats {
    taken,
    done,
    reads,
    writes,
    flushes,
    discards,
    indirect,
    sectors_read,
    sectors_written,
    refused,
    id_in_flight,
    bad_grants,
    io_errors,
    persistent_hits,
    persistent_maps,
    transient_maps,
    transient_copies,
    notifies,
    async_transfers,
    disk_enters,
});

/// The persistent grants of a device: each kept mapped at a slot of its own.
#[derive(Debug)]
struct Persistent {
    /// Grant reference to its window slot and mapping (capacity reserved: no
    /// allocation on insert).
    slots: HashMap<u32, (u32, GrantHandle)>,
    free: Vec<u32>,
}

/// How a request failed after it was judged.
#[derive(Debug, Clone, Copy)]
enum Failed {
    Grant,
    Io,
}

/// Whether a request was answered at once or is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Done,
    Pending,
}

/// What a transfer in flight to the disk counts as once it ends well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Moved {
    Read(u64),
    Write(u64),
    Flush,
}

/// A request taken from the ring and not yet answered, while the disk moves bytes.
#[derive(Debug, Clone, Copy)]
struct Taken {
    id: u64,
    operation: u8,
    /// Its answer, once known; none while its transfer is in flight.
    status: Option<i16>,
    /// Its transfer in flight, if it has one.
    moved: Option<Moved>,
}

/// A file's disk I/O in flight ([`Blkback::disk_async`]). Answers go out in the order
/// the requests were taken, whatever order the disk ends them in: a back end that takes
/// the ring over after a crash carries on from the last answer published, and takes
/// every request after it again ([`BackRing::resume`]), which is right only if every
/// request before it was answered. The disk still works on up to [`DISK_DEPTH`] at once.
#[derive(Debug)]
struct Aio {
    ring: mem::uring::FileRing,
    /// Every request taken and not yet answered, oldest first.
    order: std::collections::VecDeque<Taken>,
    /// The number of `order`'s first request since the device was served (a transfer's
    /// tag is its request's number).
    head: u64,
    /// The transfer the request being handled placed (set by it, taken by `pass`).
    placed: Option<Moved>,
}

impl Aio {
    /// Requests `order` holds at most: a whole ring's.
    fn room(&self) -> usize {
        (self.order.capacity() - self.order.len()).min(self.ring.room())
    }

    /// The tag of the request being handled: its number in `order` once pushed.
    fn next_tag(&self) -> u64 {
        self.head + self.order.len() as u64
    }

    /// Takes the transfers that ended (all of them, waiting, if `wait`): each one's
    /// request gets its answer, counted in `stats`.
    fn reap(&mut self, stats: &mut VbdStats, wait: bool) {
        let (head, order) = (self.head, &mut self.order);
        let mark = |c| mark(order, head, c, stats);
        if wait {
            self.ring.wait_all(mark);
        } else {
            self.ring.complete(mark);
        }
    }
}

/// Hands a judged request to a remote disk's initiator under a free in-flight slot:
/// its segments (`segs`, mapped at `at`) recorded for the data to go to or come from.
fn remote_submit(
    r: &mut Remote,
    raw: &RawRequest,
    write: bool,
    sector: u64,
    segs: &[Segment],
    at: &[u32],
) -> Result<(), Failed> {
    let Some(k) = r.free.pop() else {
        return Err(Failed::Io);
    };
    let f = &mut r.slots[usize::from(k)];
    f.busy = true;
    f.id = raw.id;
    f.operation = raw.response_operation();
    f.write = write;
    f.segs.clear();
    let mut sectors = 0u64;
    for (s, &slot) in segs.iter().zip(at) {
        let n = u16::from(s.last_sect - s.first_sect) + 1;
        f.segs.push((
            slot,
            u16::from(s.first_sect) * SECTOR_SIZE as u16,
            n * SECTOR_SIZE as u16,
        ));
        sectors += u64::from(n);
    }
    f.sectors = sectors;
    let now = Instant::now();
    let sent = if segs.is_empty() {
        r.ini.submit_flush(k, now)
    } else {
        r.ini.submit(k, write, sector, sectors as u32, now)
    };
    if sent.is_err() {
        r.slots[usize::from(k)].busy = false;
        r.free.push(k);
        return Err(Failed::Io);
    }
    Ok(())
}

/// What stands behind a device.
#[derive(Debug)]
enum Store {
    /// A backing file, read and written as each request is taken.
    File(FileDisk),
    /// A remote disk over AoE: requests stay in flight until the target answers.
    Remote(Box<Remote>),
}

/// A remote disk's initiator and the requests it has in flight.
#[derive(Debug)]
struct Remote {
    ini: Initiator,
    /// By initiator request id (`0..RING_REQUESTS`).
    slots: Vec<InFlight>,
    free: Vec<u16>,
    /// Requests the initiator finished in the last call.
    done: Vec<(u16, bool)>,
}

/// A request in flight to a remote disk.
#[derive(Debug)]
struct InFlight {
    /// In flight now.
    busy: bool,
    id: u64,
    operation: u8,
    write: bool,
    sectors: u64,
    /// Each segment's window slot, byte offset and length, in order.
    segs: Vec<(u32, u16, u16)>,
    /// Its transient mappings, unmapped when it is answered.
    unmaps: Vec<GrantHandle>,
}

/// Where a received frame lies, for a read's sectors to be placed from.
#[derive(Debug, Clone, Copy)]
pub enum FrameAt<'a> {
    /// In the back end's own memory at hand (a device's buffer).
    Bytes(&'a [u8]),
    /// In one of the back end's domain's pages (a NIC's receive buffer).
    Page {
        /// The page.
        gfn: hv::Gfn,
        /// Where the frame starts in it.
        offset: usize,
    },
}

/// The initiator's view of a remote device's memory and link.
struct RemoteIo<'a, S: FnMut(&[u8]) -> bool> {
    dom: &'a Domain,
    slots: &'a [InFlight],
    done: &'a mut Vec<(u16, bool)>,
    frame: FrameAt<'a>,
    send: S,
}

impl<S: FnMut(&[u8]) -> bool> RemoteIo<'_, S> {
    /// Calls `f(slot, page offset, piece offset, piece length)` for each piece of
    /// request `req`'s bytes `[offset, offset + len)`, as its segments lay them out;
    /// false if one fails or the range runs past them.
    fn walk(
        &self,
        req: u16,
        offset: usize,
        len: usize,
        mut f: impl FnMut(u32, usize, usize, usize) -> bool,
    ) -> bool {
        let Some(r) = self.slots.get(usize::from(req)) else {
            return false;
        };
        let (mut base, mut done) = (0usize, 0usize);
        for &(slot, off, seg_len) in &r.segs {
            let seg_len = usize::from(seg_len);
            let at = offset + done;
            if at < base + seg_len && done < len {
                let rel = at - base;
                let n = (seg_len - rel).min(len - done);
                if !f(slot, usize::from(off) + rel, done, n) {
                    return false;
                }
                done += n;
            }
            base += seg_len;
        }
        done == len
    }
}

impl<S: FnMut(&[u8]) -> bool> AoeIo for RemoteIo<'_, S> {
    fn send(&mut self, frame: &[u8]) -> bool {
        (self.send)(frame)
    }

    fn fetch(&mut self, req: u16, offset: usize, buf: &mut [u8]) -> bool {
        let win = self.dom.window();
        self.walk(req, offset, buf.len(), |slot, off, at, len| {
            win.read(slot, off, &mut buf[at..at + len]).is_ok()
        })
    }

    fn place(&mut self, req: u16, offset: usize, at: usize, len: usize) -> bool {
        let (dom, frame) = (self.dom, self.frame);
        let win = dom.window();
        self.walk(req, offset, len, |slot, off, done, n| match frame {
            FrameAt::Bytes(b) => b
                .get(at + done..at + done + n)
                .is_some_and(|src| win.write(slot, off, src).is_ok()),
            FrameAt::Page { gfn, offset: fo } => dom
                .copy_to_window(gfn, fo + at + done, slot, off, n)
                .is_ok(),
        })
    }

    fn done(&mut self, req: u16, ok: bool) {
        self.done.push((req, ok));
    }
}

/// Pages of a back end's own that requests' segments are copied through
/// ([`Blkback::copy_transient`]): one a segment of the largest request. One set serves
/// any number of devices (a request holds it while it is served, so devices served by
/// one thread never wait for it); the pages go back to their domain with the last
/// holder.
#[derive(Debug, Clone)]
pub struct Bounce {
    pages: std::sync::Arc<std::sync::Mutex<BouncePages>>,
}

#[derive(Debug)]
struct BouncePages {
    dom: std::sync::Arc<Domain>,
    gfns: Vec<Gfn>,
}

impl std::ops::Deref for BouncePages {
    type Target = [Gfn];
    fn deref(&self) -> &[Gfn] {
        &self.gfns
    }
}

impl Drop for BouncePages {
    fn drop(&mut self) {
        for g in self.gfns.drain(..) {
            let _ = self.dom.free_page(g);
        }
    }
}

impl Bounce {
    /// [`MAX_INDIRECT_SEGMENTS`] pages of `dom`'s; `None` if it has not that many free.
    pub fn new(dom: &std::sync::Arc<Domain>) -> Option<Self> {
        let mut pages = BouncePages {
            dom: std::sync::Arc::clone(dom),
            gfns: Vec::with_capacity(usize::from(MAX_INDIRECT_SEGMENTS)),
        };
        for _ in 0..MAX_INDIRECT_SEGMENTS {
            pages.gfns.push(dom.alloc_page().ok()?);
        }
        Some(Self {
            pages: std::sync::Arc::new(std::sync::Mutex::new(pages)),
        })
    }
}

/// One virtual block device's back end.
#[derive(Debug)]
pub struct Blkback<X: Xen = Pvio> {
    xen: X,
    fe: DomId,
    devid: u32,
    port: Port,
    ring: Option<Back>,
    /// The ring's pages' mappings.
    ring_handles: Vec<GrantHandle>,
    slot_base: u32,
    store: Store,
    offer: Offered,
    persistent: Option<Persistent>,
    /// Requests copied off the ring in one pass.
    batch: Vec<RawRequest>,
    /// Requests one `serve` takes at most ([`SERVE_BUDGET`]).
    budget: usize,
    /// A request's segments (from its slot or its indirect pages).
    segs: Vec<Segment>,
    /// The window slot each segment is at.
    at: Vec<u32>,
    maps: Vec<MapOp>,
    map_res: Vec<Result<GrantHandle, GrantError>>,
    unmaps: Vec<GrantHandle>,
    unmap_st: Vec<Result<(), GrantError>>,
    /// A request's pieces for the disk: its segments' bytes where they lie.
    pieces: Vec<DiskPiece>,
    /// The back end's own pages a request's segments that are not persistent are
    /// copied through (none: they are mapped instead).
    bounce: Option<Bounce>,
    copies: Vec<GrantCopy>,
    copy_st: Vec<GrantStatus>,
    /// Disk I/O in flight through an io_uring (none: each request's bytes move before
    /// the next is taken).
    aio: Option<Box<Aio>>,
    stats: VbdStats,
    broken: Option<Broken>,
}

/// Bytes of a vbd's journal ([`Blkback::set_journal`]): the record of the largest ring.
pub const JOURNAL_LEN: usize = ring::record_len::<BlkRing>(MAX_RING_PAGES * mem::PAGE_SIZE);

/// Writes `rsp` into the ring (staged, if the ring records its responses).
fn answer(ring: &mut Option<Back>, rsp: &Response) -> Result<(), RingError> {
    match ring.as_mut() {
        Some(ring) => ring.push_response(rsp),
        None => Ok(()),
    }
}

/// The request a disk transfer ended for (tag: its number, `head` being `order`'s
/// first's) gets its answer, counted.
fn mark(
    order: &mut std::collections::VecDeque<Taken>,
    head: u64,
    c: mem::uring::Completion,
    stats: &mut VbdStats,
) {
    let Some(t) = c
        .tag
        .checked_sub(head)
        .and_then(|i| order.get_mut(usize::try_from(i).ok()?))
    else {
        return;
    };
    if t.status.is_some() {
        return;
    }
    stats.async_transfers += 1;
    t.status = Some(match (c.result, t.moved) {
        (Ok(()), Some(m)) => {
            stats.done += 1;
            match m {
                Moved::Read(n) => {
                    stats.reads += 1;
                    stats.sectors_read += n;
                }
                Moved::Write(n) => {
                    stats.writes += 1;
                    stats.sectors_written += n;
                }
                Moved::Flush => stats.flushes += 1,
            }
            BLKIF_RSP_OKAY
        }
        _ => {
            stats.io_errors += 1;
            BLKIF_RSP_ERROR
        }
    });
}

/// Where a segment's sectors lie in its page: their offset and length in bytes.
fn seg_bytes(seg: &Segment) -> (usize, usize) {
    let nsect = usize::from(seg.last_sect - seg.first_sect) + 1;
    (
        usize::from(seg.first_sect) * SECTOR_SIZE as usize,
        nsect * SECTOR_SIZE as usize,
    )
}

/// Moves a request's `pieces` between the disk (from `sector` on) and memory in one
/// vectored transfer, counted as disk time; the sectors moved.
fn transfer(
    disk: &FileDisk,
    dom: &Domain,
    write: bool,
    pieces: &[DiskPiece],
    sector: u64,
) -> Result<u64, Failed> {
    let _d = enter(Class::Disk);
    let io = if write {
        disk.write_vectored(dom, pieces, sector)
    } else {
        disk.read_vectored(dom, pieces, sector)
    };
    io.map_err(|_| Failed::Io)?;
    Ok(crate::disk::pieces_len(pieces) as u64 / SECTOR_SIZE)
}

/// The slot a persistent grant is mapped at: found, or mapped read-write now and kept
/// while slots last. `None`: no slot left, or not mappable read-write (the request then
/// maps or copies it as it needs, a write needing only to read it).
fn persistent_slot<X: Xen>(
    p: &mut Persistent,
    xen: &X,
    fe: DomId,
    gref: u32,
    stats: &mut VbdStats,
) -> Option<u32> {
    if let Some(&(slot, _)) = p.slots.get(&gref) {
        stats.persistent_hits += 1;
        return Some(slot);
    }
    let slot = p.free.pop()?;
    let mut res = [Err(GrantError::BadHandle(0))];
    xen.grant_map(
        &[MapOp {
            dom: fe,
            gref: GrantRef(gref),
            readonly: false,
            slot,
        }],
        &mut res,
    );
    match res[0] {
        Ok(h) => {
            p.slots.insert(gref, (slot, h));
            stats.persistent_maps += 1;
            Some(slot)
        }
        Err(_) => {
            p.free.push(slot);
            None
        }
    }
}

/// Publishes the disk's size and the back end's features and waits for the front end
/// (`InitWait`). `persistent` offers persistent grants.
pub fn probe(
    store: &impl XenStore,
    be: DomId,
    fe: DomId,
    devid: u32,
    disk: &FileDisk,
    persistent: bool,
) -> Result<(), XenbusError> {
    publish(
        store,
        be,
        fe,
        devid,
        &Offered {
            offer: Offer {
                sectors: disk.sectors(),
                read_only: disk.read_only(),
                flush: true,
                discard: true,
                max_indirect_segments: MAX_INDIRECT_SEGMENTS,
            },
            persistent,
            physical_sector_size: disk.physical_sector_size(),
            max_ring_page_order: MAX_RING_PAGE_ORDER,
            max_queues: MAX_QUEUES,
        },
    )
}

/// Publishes a remote disk as its initiator found it (size, whether it flushes; no
/// discard: ATA over Ethernet has none) and waits for the front end.
pub fn probe_remote(
    store: &impl XenStore,
    be: DomId,
    fe: DomId,
    devid: u32,
    ini: &Initiator,
    persistent: bool,
) -> Result<(), XenbusError> {
    publish(
        store,
        be,
        fe,
        devid,
        &Offered {
            offer: Offer {
                sectors: ini.sectors(),
                read_only: false,
                flush: ini.flushes(),
                discard: false,
                max_indirect_segments: REMOTE_MAX_SEGMENTS,
            },
            persistent,
            physical_sector_size: SECTOR_SIZE as u32,
            max_ring_page_order: 0,
            max_queues: 1,
        },
    )
}

/// Where one of a device's queues lives: which of how many (`queues` `None`: the front
/// end wrote no `multi-queue-num-queues`; with one queue its keys are at the top of the
/// front end's directory, [`netbus::queue_dir`]), its window slots, and whether
/// connecting it announces the device (`Connected`).
#[derive(Debug, Clone, Copy)]
struct QueueAt {
    queues: Option<u32>,
    queue: u32,
    slot_base: u32,
    announce: bool,
    /// Grants it keeps mapped at most.
    persistent: usize,
}

impl QueueAt {
    /// The device's only ring, at `slot_base`, announced when connected.
    fn only(slot_base: u32) -> Self {
        Self {
            queues: None,
            queue: 0,
            slot_base,
            announce: true,
            persistent: PERSISTENT_MAX,
        }
    }
}

pub use netbus::front_queues;

/// The grant references of a ring's pages, under `qdir` (the front end's directory, or
/// a queue's): `ring-ref`, or, if the front end wrote `ring-page-order` (at the top of
/// its directory `fdir`, for every queue alike; at most the `max` this end offered),
/// `ring-ref0` to `ring-ref<2^order - 1>`.
fn ring_refs(
    store: &impl XenStore,
    be: DomId,
    fdir: &str,
    qdir: &str,
    max: u32,
) -> Result<Vec<u32>, XenbusError> {
    let order_key = format!("{fdir}/ring-page-order");
    if store.read(be, &order_key).is_err() {
        return Ok(vec![netbus::read_u32(
            store,
            be,
            &format!("{qdir}/ring-ref"),
        )?]);
    }
    let order = netbus::read_u32(store, be, &order_key)?;
    if order > max {
        return Err(XenbusError::BadKey(order_key));
    }
    (0..1u32 << order)
        .map(|i| netbus::read_u32(store, be, &format!("{qdir}/ring-ref{i}")))
        .collect()
}

/// Writes what the back end offers into its directory and moves to `InitWait`. The
/// toolstack's `mode = r` makes the device read-only whatever the disk allows.
fn publish(
    store: &impl XenStore,
    be: DomId,
    fe: DomId,
    devid: u32,
    o: &Offered,
) -> Result<(), XenbusError> {
    let dir = xenbus::backend_dir(be, fe, devid);
    let mode_ro = store
        .read(be, &format!("{dir}/mode"))
        .is_ok_and(|m| m == "r");
    let ro = mode_ro || o.offer.read_only;
    let info = if ro { xenbus::VDISK_READONLY } else { 0 };
    let flag = |b: bool| if b { "1" } else { "0" }.to_string();
    // The toolstack's `discard-enable` (xl's `discard`/`no-discard`) can only take the
    // feature away.
    let discard = o.offer.discard
        && store
            .read(be, &format!("{dir}/{}", xenbus::DISCARD_ENABLE))
            .map_or(true, |v| v != "0");
    for (k, v) in [
        ("sectors", o.offer.sectors.to_string()),
        ("sector-size", SECTOR_SIZE.to_string()),
        ("info", info.to_string()),
        (xenbus::FEATURE_FLUSH, flag(o.offer.flush)),
        ("physical-sector-size", o.physical_sector_size.to_string()),
        (
            xenbus::MAX_RING_PAGE_ORDER,
            o.max_ring_page_order.to_string(),
        ),
        (xenbus::MULTI_QUEUE_MAX_QUEUES, o.max_queues.to_string()),
        (xenbus::FEATURE_DISCARD, flag(discard)),
        ("discard-granularity", SECTOR_SIZE.to_string()),
        ("discard-alignment", "0".to_string()),
        ("discard-secure", "0".to_string()),
        (xenbus::FEATURE_PERSISTENT, flag(o.persistent)),
        (
            xenbus::FEATURE_MAX_INDIRECT,
            o.offer.max_indirect_segments.to_string(),
        ),
    ] {
        store.write(be, &format!("{dir}/{k}"), &v)?;
    }
    store.switch_state(be, &dir, XenbusState::InitWait)?;
    Ok(())
}

impl<X: Xen> Blkback<X> {
    /// Connects to a front end that published its ring: checks its keys, maps the ring
    /// at window slot `slot_base` (the device uses [`VBD_WINDOW_SLOTS`] slots from
    /// there), binds the event channel, and moves to `Connected`. Serves `disk`, as
    /// [`probe`] published it.
    pub fn connect(
        xen: X,
        fe: DomId,
        devid: u32,
        slot_base: u32,
        disk: FileDisk,
    ) -> Result<Self, XenbusError> {
        Self::connect_store(
            xen,
            fe,
            devid,
            QueueAt::only(slot_base),
            Store::File(disk),
            None,
        )
    }

    /// Connects every queue the front end set up ([`front_queues`]: each ring and
    /// channel under `queue-<n>/`, or the one at the top), each keeping up to
    /// `persistent` grants mapped (at most [`PERSISTENT_LIMIT`]), queue `n` at window
    /// slots from `slot_base + n * vbd_window_slots(persistent)`
    /// ([`vbd_window_slots`]), each over its own handle on `disk`; then
    /// moves to `Connected`, once. With `resume` (a journal per queue, or none), takes
    /// each queue over instead ([`Blkback::resume`]). A queue that fails gives back what
    /// the ones before it took, and the device is not connected.
    pub fn connect_queues(
        xen: X,
        fe: DomId,
        devid: u32,
        slot_base: u32,
        persistent: usize,
        disk: FileDisk,
        resume: Option<Vec<Option<mem::journal::Journal>>>,
    ) -> Result<Vec<Self>, XenbusError>
    where
        X: Clone,
    {
        let (store, be) = (xen.store(), xen.id());
        let fdir = xenbus::frontend_dir(fe, devid);
        let bdir = xenbus::backend_dir(be, fe, devid);
        let offer = Offered::read(store, be, &bdir)?;
        let queues = front_queues(store, be, &fdir, offer.max_queues)?;
        let mut journals = resume.map(|v| v.into_iter());
        let mut done: Vec<Self> = Vec::new();
        let persistent = persistent.min(PERSISTENT_LIMIT);
        for q in 0..queues.unwrap_or(1) {
            let at = QueueAt {
                queues,
                queue: q,
                slot_base: slot_base + q * vbd_window_slots(persistent),
                announce: false,
                persistent,
            };
            let r = disk
                .try_clone()
                .map_err(|e| XenbusError::BadKey(format!("{bdir}: {e}")));
            let journal = journals.as_mut().map(|j| j.next().flatten());
            match r.and_then(|d| {
                Self::connect_store(xen.clone(), fe, devid, at, Store::File(d), journal)
            }) {
                Ok(b) => done.push(b),
                Err(e) => {
                    for b in done {
                        b.abandon();
                    }
                    return Err(e);
                }
            }
        }
        if journals.is_some() {
            for b in &mut done {
                // What the dead one wrote and did not publish goes to the front end now.
                b.flush_responses();
            }
        }
        if let Err(e) = store.switch_state(be, &bdir, XenbusState::Connected) {
            for b in done {
                b.abandon();
            }
            return Err(e.into());
        }
        Ok(done)
    }

    /// Takes over a device another back end served and left without closing (its
    /// process died, in a real dom0): the front end still `Connected`, its ring and
    /// event channel as they were. Maps the ring again and carries on from the
    /// responses published (`BackRing::resume`): every request after them is taken
    /// again and answered once, which a file's back end can do because it answers in
    /// request order. The front end sees nothing but a delay (Linux's blkfront cannot
    /// reconnect once its back end closed: it marks the disk dead). Persistent grants
    /// are mapped again as requests name them.
    ///
    /// `journal` is the one the dead back end recorded in ([`Blkback::set_journal`]):
    /// with it, responses it wrote but had not published are published, not taken again
    /// as requests (their slots may hold responses now); recording goes on in it.
    pub fn resume(
        xen: X,
        fe: DomId,
        devid: u32,
        slot_base: u32,
        disk: FileDisk,
        journal: Option<mem::journal::Journal>,
    ) -> Result<Self, XenbusError> {
        let mut b = Self::connect_store(
            xen,
            fe,
            devid,
            QueueAt::only(slot_base),
            Store::File(disk),
            Some(journal),
        )?;
        // What the dead one wrote and did not publish goes to the front end now.
        b.flush_responses();
        Ok(b)
    }

    /// Responses written again from the journal's record when this back end took the
    /// ring over ([`Blkback::resume`]): those the one before recorded and had not
    /// published.
    pub fn replayed(&self) -> u32 {
        self.ring.as_ref().map_or(0, |r| r.replayed())
    }

    /// Records every batch of responses from now on in `journal` (a file in memory
    /// that outlives this process, under `/run`, of at least [`JOURNAL_LEN`] bytes), so
    /// that a back end started after this one dies takes the ring over exactly
    /// ([`ring::BackRing::record_in`]). Whether it was taken (a journal too small is
    /// not). A fresh connection starts it afresh.
    pub fn set_journal(&mut self, journal: mem::journal::Journal) -> bool {
        self.ring.as_mut().is_some_and(|r| r.record_in(journal))
    }

    /// As [`Blkback::connect`], serving the remote disk `ini` found (and
    /// [`probe_remote`] published): each request goes to the target as AoE frames
    /// through the link its owner gives [`Blkback::net_poll`] and
    /// [`Blkback::net_input`], and is answered when the target has answered every
    /// frame.
    pub fn connect_remote(
        xen: X,
        fe: DomId,
        devid: u32,
        slot_base: u32,
        ini: Initiator,
    ) -> Result<Self, XenbusError> {
        let segs = usize::from(REMOTE_MAX_SEGMENTS);
        let remote = Remote {
            ini,
            slots: (0..RING_REQUESTS)
                .map(|_| InFlight {
                    busy: false,
                    id: 0,
                    operation: 0,
                    write: false,
                    sectors: 0,
                    segs: Vec::with_capacity(segs),
                    unmaps: Vec::with_capacity(segs),
                })
                .collect(),
            free: (0..RING_REQUESTS as u16).rev().collect(),
            done: Vec::with_capacity(RING_REQUESTS),
        };
        Self::connect_store(
            xen,
            fe,
            devid,
            QueueAt::only(slot_base),
            Store::Remote(Box::new(remote)),
            None,
        )
    }

    fn connect_store(
        xen: X,
        fe: DomId,
        devid: u32,
        at: QueueAt,
        backing: Store,
        // Taking over a ring a dead back end left, with the journal it recorded in.
        resume: Option<Option<mem::journal::Journal>>,
    ) -> Result<Self, XenbusError> {
        let store = xen.store();
        let be = xen.id();
        let dom = xen.domain();
        let fdir = xenbus::frontend_dir(fe, devid);
        let bdir = xenbus::backend_dir(be, fe, devid);
        let st = store.xenbus_state(be, &fdir);
        let ready = if resume.is_some() {
            st == XenbusState::Connected && store.xenbus_state(be, &bdir) == XenbusState::Connected
        } else {
            matches!(st, XenbusState::Initialised | XenbusState::Connected)
        };
        if !ready {
            return Err(XenbusError::PeerState(st));
        }
        // Only the native layout: a 32-bit guest's slots would be misread.
        match store.read(be, &format!("{fdir}/protocol")) {
            Ok(p) if p == xenbus::PROTOCOL => {}
            Err(_) => {}
            Ok(_) => return Err(XenbusError::BadKey(format!("{fdir}/protocol"))),
        }
        let offer = Offered::read(store, be, &bdir)?;
        let slot_base = at.slot_base;
        // A queue's ring and channel are under `queue-<n>/` when there are several; the
        // rest at the top.
        let qdir = netbus::queue_dir(&fdir, at.queues, at.queue);
        let refs = ring_refs(store, be, &fdir, &qdir, offer.max_ring_page_order)?;
        let evtchn = netbus::read_u32(store, be, &format!("{qdir}/event-channel"))?;
        let persistent =
            offer.persistent && netbus::feature(store, be, &fdir, xenbus::FEATURE_PERSISTENT);

        let ops: Vec<MapOp> = refs
            .iter()
            .enumerate()
            .map(|(i, r)| MapOp {
                dom: fe,
                gref: GrantRef(*r),
                readonly: false,
                slot: slot_base + RING_SLOT0 + i as u32,
            })
            .collect();
        let mut res = vec![Err(GrantError::BadHandle(0)); ops.len()];
        xen.grant_map(&ops, &mut res);
        let hs: Vec<GrantHandle> = res.iter().filter_map(|r| r.ok()).collect();
        let unmap = || xen.grant_unmap(&hs, &mut vec![Ok(()); hs.len()]);
        if let Some(e) = res.iter().find_map(|r| r.err()) {
            unmap();
            return Err(XenbusError::BadKey(format!("{fdir}/ring-ref: {e}")));
        }
        let pages: Option<Vec<MappedPage>> = ops
            .iter()
            .map(|op| dom.window().page(op.slot).ok())
            .collect();
        let Some(ring) = pages
            .and_then(|p| PagesRing::new(p).ok())
            .and_then(|p| match resume {
                Some(journal) => BackRing::<BlkRing, _>::resume(p, journal).ok(),
                None => BackRing::<BlkRing, _>::attach(p).ok(),
            })
        else {
            unmap();
            return Err(XenbusError::BadKey(format!("{fdir}/ring-ref")));
        };
        let port = match xen.evtchn_bind_interdomain(fe, Port(evtchn)) {
            Ok(p) => p,
            Err(e) => {
                drop(ring);
                unmap();
                return Err(XenbusError::BadKey(format!("{fdir}/event-channel: {e}")));
            }
        };
        let announced = match at.announce {
            true => store.switch_state(be, &bdir, XenbusState::Connected),
            false => Ok(()),
        };
        if let Err(e) = announced {
            drop(ring);
            unmap();
            let _ = xen.evtchn_close(port);
            return Err(e.into());
        }
        let max_segs = usize::from(MAX_INDIRECT_SEGMENTS);
        Ok(Self {
            xen,
            fe,
            devid,
            port,
            batch: Vec::with_capacity(ring.size() as usize),
            ring: Some(ring),
            ring_handles: hs,
            slot_base,
            store: backing,
            offer,
            persistent: persistent.then(|| Persistent {
                slots: HashMap::with_capacity(at.persistent),
                free: (0..at.persistent as u32)
                    .rev()
                    .map(|i| slot_base + PERSISTENT_SLOT0 + i)
                    .collect(),
            }),
            budget: SERVE_BUDGET,
            segs: Vec::with_capacity(max_segs),
            at: Vec::with_capacity(max_segs),
            maps: Vec::with_capacity(max_segs),
            map_res: vec![Err(GrantError::BadHandle(0)); max_segs],
            unmaps: Vec::with_capacity(max_segs),
            unmap_st: vec![Ok(()); max_segs],
            pieces: Vec::with_capacity(max_segs),
            bounce: None,
            copies: Vec::with_capacity(max_segs),
            copy_st: vec![Ok(()); max_segs],
            aio: None,
            stats: VbdStats::default(),
            broken: None,
        })
    }

    /// Copies each segment that is not persistently mapped through `bounce` (pages of
    /// the back end's own) by grant copy, one batch a request, instead of mapping it for
    /// the request and unmapping it after: what a back end in user space does, where
    /// each map and unmap is a system call and a page-table update, and a batch of
    /// copies is one call (QEMU's `xen_disk` does the same). `false` (and segments
    /// mapped as before) for a remote disk, whose requests stay in flight.
    pub fn copy_transient(&mut self, bounce: Bounce) -> bool {
        if !matches!(self.store, Store::File(_)) {
            return false;
        }
        self.bounce = Some(bounce);
        true
    }

    /// Moves the disk's bytes asynchronously from now on: each read, write or flush is
    /// placed in an io_uring of the device's own and answered when it ends (answers
    /// published in the order requests were taken), so a queue keeps up to
    /// [`DISK_DEPTH`] transfers in flight, and its pCPU serves other devices while the
    /// disk works. Reads and writes whose every segment is kept mapped (persistent
    /// grants) go to the disk straight from the guest's pages; the rest, and discards,
    /// are carried out at once, as before. `false` (nothing changes) for a remote disk,
    /// or where the kernel has no io_uring. The ring's event descriptor
    /// ([`Blkback::disk_event_fd`]) becomes readable when a transfer ends: whoever
    /// serves the device serves it again then.
    pub fn disk_async(&mut self) -> bool {
        if self.aio.is_some() {
            return true;
        }
        let Store::File(disk) = &self.store else {
            return false;
        };
        let Ok(ring) = disk.async_ring(DISK_DEPTH) else {
            return false;
        };
        let depth = self
            .ring
            .as_ref()
            .map_or(RING_REQUESTS, |r| r.size() as usize);
        self.aio = Some(Box::new(Aio {
            ring,
            order: std::collections::VecDeque::with_capacity(depth),
            head: 0,
            placed: None,
        }));
        true
    }

    /// The descriptor that becomes readable when a disk transfer ends
    /// ([`Blkback::disk_async`]).
    pub fn disk_event_fd(&self) -> Option<std::os::fd::RawFd> {
        self.aio.as_ref().map(|a| a.ring.event_fd())
    }

    /// Disk transfers in flight now.
    pub fn disk_in_flight(&self) -> usize {
        self.aio.as_ref().map_or(0, |a| a.ring.in_flight())
    }

    /// The local end of the device's event channel.
    pub fn port(&self) -> Port {
        self.port
    }
    /// The front end's domain.
    pub fn frontend(&self) -> DomId {
        self.fe
    }
    /// The device's id (`virtual-device`).
    pub fn devid(&self) -> u32 {
        self.devid
    }
    /// Counters.
    pub fn stats(&self) -> &VbdStats {
        &self.stats
    }
    /// Why the device stopped, if it did.
    pub fn broken(&self) -> Option<Broken> {
        self.broken
    }
    /// Whether the front end's grants are kept mapped.
    pub fn persistent(&self) -> bool {
        self.persistent.is_some()
    }
    /// Grants mapped persistently now.
    pub fn persistent_mapped(&self) -> usize {
        self.persistent.as_ref().map_or(0, |p| p.slots.len())
    }

    /// Serves every request on the ring until it stays empty (the event handler's
    /// loop, `do_block_io_op`); returns how many were answered. A protocol break
    /// disconnects the device.
    pub fn serve(&mut self) -> usize {
        let _c = enter(Class::Block);
        let mut answered = 0;
        let mut taken = 0;
        // What the disk ended since the last serve is answered first.
        self.reap_disk();
        while self.broken.is_none() {
            if taken >= self.budget {
                // The rest waits for the caller's next pass (`pending`).
                break;
            }
            if self.aio.as_ref().is_some_and(|a| a.room() == 0) {
                // As many in flight as the disk takes: a transfer's end serves again.
                break;
            }
            let room = self.budget - taken;
            match self.pass(room) {
                Ok(0) => match self.ring.as_mut().map(|r| r.final_check_for_requests()) {
                    Some(Ok(true)) => continue,
                    Some(Ok(false)) | None => break,
                    Some(Err(e)) => self.protocol_break(e),
                },
                Ok(n) => {
                    answered += n;
                    taken += n;
                }
                Err(e) => self.protocol_break(e),
            }
        }
        answered
    }

    /// Whether requests wait on the ring that the last [`Blkback::serve`] left for its
    /// budget: the caller serves again at its next pass, without waiting for an event.
    /// If none do, the front end is asked to notify its next one (`req_event` armed, then
    /// the ring looked at again): a serve that stopped at its budget just as the ring
    /// emptied had not asked, and a front end posting after it would not have notified.
    pub fn pending(&mut self) -> bool {
        if let Some(a) = self.aio.as_mut() {
            if a.ring.queued() > 0 {
                // Transfers the kernel did not take: handed over again now, and while it
                // still does not take them, at the next step.
                let _ = a.ring.submit();
                if a.ring.queued() > 0 {
                    return self.broken.is_none();
                }
            }
        }
        self.broken.is_none()
            && self.aio.as_ref().is_none_or(|a| a.room() > 0)
            && self
                .ring
                .as_mut()
                .is_some_and(|r| r.final_check_for_requests().is_ok_and(|more| more))
    }

    /// Sets the requests one `serve` takes at most (at least 1).
    pub fn set_budget(&mut self, requests: usize) {
        self.budget = requests.max(1);
    }

    /// Copies the requests the ring holds (at most `room`), serves each, and answers
    /// them; one notification for the pass.
    fn pass(&mut self, room: usize) -> Result<usize, RingError> {
        let Some(ring) = self.ring.as_mut() else {
            return Ok(0);
        };
        let n = ring.requests_available()?;
        // Each request may take a transfer in flight: no more than there is room for.
        let room = room.min(self.aio.as_ref().map_or(usize::MAX, |a| a.room()));
        self.batch.clear();
        for _ in 0..n.min(RING_REQUESTS.min(room) as u32) {
            match ring.take_request()? {
                Some(r) => self.batch.push(r),
                None => break,
            }
        }
        let n = self.batch.len();
        for i in 0..n {
            let raw = self.batch[i];
            self.stats.taken += 1;
            let in_flight = self.batch[..i].iter().any(|r| r.id == raw.id)
                || match &self.store {
                    Store::Remote(r) => r.slots.iter().any(|f| f.busy && f.id == raw.id),
                    Store::File(_) => false,
                }
                || self
                    .aio
                    .as_ref()
                    .is_some_and(|a| a.order.iter().any(|t| t.id == raw.id));
            let status = if in_flight {
                self.stats.id_in_flight += 1;
                Some(BLKIF_RSP_ERROR)
            } else {
                self.handle(&raw)
            };
            if let Some(a) = self.aio.as_mut() {
                // In the order taken, answered or not yet.
                let moved = a.placed.take();
                a.order.push_back(Taken {
                    id: raw.id,
                    operation: raw.response_operation(),
                    status: match moved {
                        Some(_) => None,
                        None => Some(status.unwrap_or(BLKIF_RSP_ERROR)),
                    },
                    moved,
                });
                continue;
            }
            let Some(status) = status else {
                // In flight to a remote disk: answered when it is done.
                continue;
            };
            let rsp = response(raw.id, raw.response_operation(), status);
            // Room is certain: each response answers a request taken.
            answer(&mut self.ring, &rsp)?;
        }
        if let Some(a) = self.aio.as_mut() {
            // Every transfer placed in the pass, in one call.
            let before = a.ring.enters();
            // What the kernel does not take now stays queued, handed over again at the
            // next step (`pending` says there is one to come).
            let _ = a.ring.submit();
            self.stats.disk_enters += a.ring.enters() - before;
            self.retire()?;
        } else if n > 0 {
            self.flush_responses();
        }
        Ok(n)
    }

    /// Takes what the disk ended: each transfer's request gets its answer (counted as
    /// done, or as the disk's error), and the answers now due go out.
    fn reap_disk(&mut self) {
        let Some(a) = self.aio.as_mut() else {
            return;
        };
        if a.ring.in_flight() == 0 {
            // Nothing to reap (and no read of the ring's event counter to clear it: a
            // wake it leaves costs one step that finds nothing).
            return;
        }
        a.reap(&mut self.stats, false);
        if let Err(e) = self.retire() {
            self.protocol_break(e);
        }
    }

    /// Writes the answers of the requests at the head of `order` whose answer is known,
    /// in order, and publishes them.
    fn retire(&mut self) -> Result<(), RingError> {
        let Some(a) = self.aio.as_mut() else {
            return Ok(());
        };
        let mut n = 0;
        while let Some(t) = a.order.front().copied() {
            let Some(status) = t.status else {
                break;
            };
            a.order.pop_front();
            a.head += 1;
            n += 1;
            // Room is certain: each response answers a request taken.
            answer(&mut self.ring, &response(t.id, t.operation, status))?;
        }
        if n > 0 {
            self.flush_responses();
        }
        Ok(())
    }

    /// Waits for every disk transfer in flight to end and takes each: what a device
    /// that is let go does first, since the kernel writes into its pages until then.
    fn settle_disk(&mut self) {
        if let Some(a) = self.aio.as_mut() {
            a.reap(&mut self.stats, true);
        }
    }

    /// Judges one copied request and carries it out; its status, or none if it went
    /// to a remote disk and is answered later.
    fn handle(&mut self, raw: &RawRequest) -> Option<i16> {
        let req = match read_request(raw, &self.offer.offer) {
            Ok(r) => r,
            Err(e) => {
                self.stats.refused.add(e);
                return Some(e.status());
            }
        };
        // A secure discard (erase beyond recovery) is never offered (`discard-secure` is
        // 0): a hole punched in a file is not one. Refused, as Linux's blkback refuses it
        // on a device that cannot.
        if let Request::Discard { secure: true, .. } = req {
            self.stats.refused.add(crate::blkif::BadRequest::NotOffered);
            return Some(crate::blkif::BadRequest::NotOffered.status());
        }
        let r = match req {
            Request::Rw {
                write,
                sector,
                seg,
                nr,
                ..
            } => {
                self.segs.clear();
                self.segs.extend_from_slice(&seg[..usize::from(nr)]);
                self.rw(raw, write, sector)
            }
            Request::Indirect {
                write,
                sector,
                nr_segments,
                pages,
                ..
            } => match self.read_indirect(nr_segments, &pages) {
                Ok(()) => match check_segments(&self.segs, sector, &self.offer.offer) {
                    Ok(_) => {
                        self.stats.indirect += 1;
                        self.rw(raw, write, sector)
                    }
                    Err(e) => {
                        self.stats.refused.add(e);
                        return Some(e.status());
                    }
                },
                Err(f) => Err(f),
            },
            Request::Flush { .. } => match (&mut self.store, self.aio.as_mut()) {
                (Store::File(_), Some(a)) => {
                    let tag = a.next_tag();
                    a.ring.sync(tag).map_err(|_| Failed::Io).map(|()| {
                        a.placed = Some(Moved::Flush);
                        Outcome::Pending
                    })
                }
                (Store::File(disk), None) => {
                    let _d = enter(Class::Disk);
                    disk.flush().map_err(|_| Failed::Io).map(|()| {
                        self.stats.flushes += 1;
                        Outcome::Done
                    })
                }
                (Store::Remote(r), _) => {
                    self.segs.clear();
                    remote_submit(r, raw, false, 0, &[], &[]).map(|()| Outcome::Pending)
                }
            },
            Request::Discard {
                sector, nr_sectors, ..
            } => match &self.store {
                Store::File(disk) => {
                    let _d = enter(Class::Disk);
                    disk.discard(sector, nr_sectors)
                        .map_err(|_| Failed::Io)
                        .map(|()| {
                            self.stats.discards += 1;
                            Outcome::Done
                        })
                }
                // Never offered (AoE has no discard): judged away before here.
                Store::Remote(_) => Err(Failed::Io),
            },
        };
        match r {
            Ok(Outcome::Pending) => None,
            Ok(Outcome::Done) => {
                self.stats.done += 1;
                Some(BLKIF_RSP_OKAY)
            }
            Err(Failed::Grant) => {
                self.stats.bad_grants += 1;
                Some(BLKIF_RSP_ERROR)
            }
            Err(Failed::Io) => {
                self.stats.io_errors += 1;
                Some(BLKIF_RSP_ERROR)
            }
        }
    }

    /// Copies an indirect request's segments out of its pages (mapped read-only for
    /// the copy, unmapped after) into `segs`, unchecked.
    fn read_indirect(&mut self, nr_segments: u16, pages: &[u32]) -> Result<(), Failed> {
        let npages = indirect_pages(nr_segments);
        if self.bounce.is_some() {
            return self.read_indirect_copying(nr_segments, &pages[..npages]);
        }
        self.maps.clear();
        for (i, &g) in pages[..npages].iter().enumerate() {
            self.maps.push(MapOp {
                dom: self.fe,
                gref: GrantRef(g),
                readonly: true,
                slot: self.slot_base + INDIRECT_SLOT0 + i as u32,
            });
        }
        let n = self.maps.len();
        self.xen.grant_map(&self.maps, &mut self.map_res[..n]);
        self.segs.clear();
        let mut ok = self.map_res[..n].iter().all(|r| r.is_ok());
        if ok {
            let win = self.xen.domain().window();
            let mut left = usize::from(nr_segments);
            let mut entry = [0u8; std::mem::size_of::<Segment>()];
            'pages: for op in &self.maps {
                for k in 0..SEGMENTS_PER_INDIRECT_PAGE.min(left) {
                    if win.read(op.slot, k * entry.len(), &mut entry).is_err() {
                        ok = false;
                        break 'pages;
                    }
                    self.segs.push(bytemuck::pod_read_unaligned(&entry));
                }
                left = left.saturating_sub(SEGMENTS_PER_INDIRECT_PAGE);
            }
        }
        self.unmaps.clear();
        self.unmaps
            .extend(self.map_res[..n].iter().filter_map(|r| r.ok()));
        let u = self.unmaps.len();
        self.stats.transient_maps += u as u64;
        self.xen.grant_unmap(&self.unmaps, &mut self.unmap_st[..u]);
        if ok {
            Ok(())
        } else {
            Err(Failed::Grant)
        }
    }

    /// [`Blkback::read_indirect`] with [`Blkback::copy_transient`]: the segment entries
    /// are grant-copied out of the indirect pages into the back end's own pages (one
    /// batch), instead of the pages being mapped and unmapped, and read there.
    fn read_indirect_copying(&mut self, nr_segments: u16, pages: &[u32]) -> Result<(), Failed> {
        let Self {
            xen,
            fe,
            segs,
            bounce,
            copies,
            copy_st,
            stats,
            ..
        } = self;
        let Some(bounce) = bounce.as_ref() else {
            return Err(Failed::Grant);
        };
        let bounce = bounce.pages.lock().unwrap_or_else(|p| p.into_inner());
        let entry_len = std::mem::size_of::<Segment>();
        copies.clear();
        let mut left = usize::from(nr_segments);
        for (&g, &gfn) in pages.iter().zip(bounce.iter()) {
            let k = SEGMENTS_PER_INDIRECT_PAGE.min(left);
            left -= k;
            copies.push(GrantCopy {
                source: CopyPtr::Gref {
                    dom: *fe,
                    gref: GrantRef(g),
                    offset: 0,
                },
                dest: CopyPtr::Local { gfn, offset: 0 },
                len: (k * entry_len) as u16,
            });
        }
        let n = copies.len();
        stats.transient_copies += n as u64;
        segs.clear();
        if n != pages.len() || xen.grant_copy(copies, &mut copy_st[..n]) != n {
            return Err(Failed::Grant);
        }
        let dom = xen.domain();
        let mut entry = [0u8; std::mem::size_of::<Segment>()];
        for c in copies.iter() {
            let CopyPtr::Local { gfn, .. } = c.dest else {
                return Err(Failed::Grant);
            };
            for k in 0..usize::from(c.len) / entry_len {
                dom.read(gfn, k * entry_len, &mut entry)
                    .map_err(|_| Failed::Grant)?;
                segs.push(bytemuck::pod_read_unaligned(&entry));
            }
        }
        Ok(())
    }

    /// A read or write of the checked segments in `segs` from `sector` on: done now
    /// from a file, or sent to a remote disk with its segments left mapped.
    fn rw(&mut self, raw: &RawRequest, write: bool, sector: u64) -> Result<Outcome, Failed> {
        if self.bounce.is_some() && matches!(self.store, Store::File(_)) {
            return self.rw_copying(write, sector);
        }
        let k = match &self.store {
            Store::Remote(r) => match r.free.last() {
                Some(&k) => Some(k),
                // The ring holds no more requests than there are slots.
                None => return Err(Failed::Io),
            },
            Store::File(_) => None,
        };
        let base = self.slot_base
            + SEG_SLOT0
            + k.map_or(0, |k| u32::from(k) * u32::from(REMOTE_MAX_SEGMENTS));
        let n = self.map_segments(write, base);
        self.unmaps.clear();
        self.unmaps
            .extend(self.map_res[..n].iter().filter_map(|r| r.ok()));
        self.stats.transient_maps += self.unmaps.len() as u64;
        let mapped = self.unmaps.len() == n;
        let r = match (&mut self.store, mapped) {
            (_, false) => Err(Failed::Grant),
            (Store::File(disk), true) => {
                // The whole request in one transfer, each segment's sectors straight
                // into or out of its mapped page.
                self.pieces.clear();
                self.pieces
                    .extend(self.segs.iter().zip(&self.at).map(|(seg, &slot)| {
                        let (offset, len) = seg_bytes(seg);
                        DiskPiece::Window { slot, offset, len }
                    }));
                transfer(disk, self.xen.domain(), write, &self.pieces, sector).map(|n| {
                    self.count_rw(write, n);
                    Outcome::Done
                })
            }
            (Store::Remote(rm), true) => {
                // Its mappings stay until the target has answered.
                let r = remote_submit(rm, raw, write, sector, &self.segs, &self.at);
                if r.is_ok() {
                    if let Some(f) = k.and_then(|k| rm.slots.get_mut(usize::from(k))) {
                        f.unmaps.clear();
                        f.unmaps.extend_from_slice(&self.unmaps);
                    }
                    self.unmaps.clear();
                }
                r.map(|()| Outcome::Pending)
            }
        };
        let u = self.unmaps.len();
        if u > 0 {
            self.xen.grant_unmap(&self.unmaps, &mut self.unmap_st[..u]);
        }
        r
    }

    /// A read or write from a file with [`Blkback::copy_transient`]: persistent grants
    /// are used where they are mapped (or mapped now, while slots last); every other
    /// segment is copied by one batch of grant copies into the back end's own pages
    /// before a write, or out of them after a read. The disk moves the whole request in
    /// one transfer either way.
    fn rw_copying(&mut self, write: bool, sector: u64) -> Result<Outcome, Failed> {
        let Self {
            xen,
            fe,
            store,
            persistent,
            segs,
            pieces,
            bounce,
            copies,
            copy_st,
            stats,
            ..
        } = self;
        let (Store::File(disk), Some(bounce)) = (store, bounce.as_ref()) else {
            return Err(Failed::Io);
        };
        // Held for the request: a set of pages may serve several devices.
        let bounce = bounce.pages.lock().unwrap_or_else(|p| p.into_inner());
        pieces.clear();
        copies.clear();
        for seg in segs.iter() {
            let (offset, len) = seg_bytes(seg);
            if let Some(slot) = persistent
                .as_mut()
                .and_then(|p| persistent_slot(p, xen, *fe, seg.gref, stats))
            {
                pieces.push(DiskPiece::Window { slot, offset, len });
                continue;
            }
            let Some(&gfn) = bounce.get(copies.len()) else {
                return Err(Failed::Io);
            };
            pieces.push(DiskPiece::Own { gfn, offset, len });
            let theirs = CopyPtr::Gref {
                dom: *fe,
                gref: GrantRef(seg.gref),
                offset: offset as u16,
            };
            let ours = CopyPtr::Local {
                gfn,
                offset: offset as u16,
            };
            let (source, dest) = if write {
                (theirs, ours)
            } else {
                (ours, theirs)
            };
            copies.push(GrantCopy {
                source,
                dest,
                len: len as u16,
            });
        }
        let n = copies.len();
        if n == 0 {
            if let Some(a) = self.aio.as_mut() {
                // Every segment kept mapped: the disk moves the bytes straight to or
                // from the guest's pages while the back end goes on.
                drop(bounce);
                let tag = a.next_tag();
                let sectors = crate::disk::pieces_len(pieces) as u64 / SECTOR_SIZE;
                let _d = enter(Class::Disk);
                disk.start_vectored(xen.domain(), &mut a.ring, write, pieces, sector, tag)
                    .map_err(|_| Failed::Io)?;
                a.placed = Some(if write {
                    Moved::Write(sectors)
                } else {
                    Moved::Read(sectors)
                });
                return Ok(Outcome::Pending);
            }
        }
        stats.transient_copies += n as u64;
        let copy = |st: &mut [GrantStatus]| n == 0 || xen.grant_copy(copies, st) == n;
        if write && !copy(&mut copy_st[..n]) {
            return Err(Failed::Grant);
        }
        let dom = xen.domain();
        let sectors = transfer(disk, dom, write, pieces, sector)?;
        if !write && !copy(&mut copy_st[..n]) {
            return Err(Failed::Grant);
        }
        drop(bounce);
        self.count_rw(write, sectors);
        Ok(Outcome::Done)
    }

    fn count_rw(&mut self, write: bool, sectors: u64) {
        if write {
            self.stats.writes += 1;
            self.stats.sectors_written += sectors;
        } else {
            self.stats.reads += 1;
            self.stats.sectors_read += sectors;
        }
    }

    /// Finds or maps every segment's page: `at[i]` is its slot. Persistent grants
    /// already mapped are found; new ones are mapped read-write and kept while slots
    /// last; the rest go in one batch of transient maps (`maps`, results in `map_res`;
    /// returns how many), read-only for a write.
    fn map_segments(&mut self, write: bool, transient_base: u32) -> usize {
        self.at.clear();
        self.maps.clear();
        let mut transient = transient_base;
        for seg in &self.segs {
            if let Some(slot) = self
                .persistent
                .as_mut()
                .and_then(|p| persistent_slot(p, &self.xen, self.fe, seg.gref, &mut self.stats))
            {
                self.at.push(slot);
                continue;
            }
            self.maps.push(MapOp {
                dom: self.fe,
                gref: GrantRef(seg.gref),
                readonly: write,
                slot: transient,
            });
            self.at.push(transient);
            transient += 1;
        }
        let n = self.maps.len();
        if n > 0 {
            self.xen.grant_map(&self.maps, &mut self.map_res[..n]);
        }
        n
    }

    /// Drives a remote disk's initiator: retransmissions, requests failed past their
    /// bound, new frames while the target has buffers (sent through `send`); answers
    /// what finished. Returns the frames sent.
    pub fn net_poll(&mut self, now: Instant, send: impl FnMut(&[u8]) -> bool) -> usize {
        let Store::Remote(r) = &mut self.store else {
            return 0;
        };
        let Remote {
            ini, slots, done, ..
        } = &mut **r;
        let mut io = RemoteIo {
            dom: self.xen.domain(),
            slots,
            done,
            frame: FrameAt::Bytes(&[]),
            send,
        };
        let n = ini.poll(now, &mut io);
        self.answer_remote();
        n
    }

    /// Takes a frame from the link for a remote disk's initiator: `head` its first
    /// `min(len, aoe::HEAD)` bytes copied out, `at` where the whole lies (a read's
    /// sectors are placed from there). Answers what finished.
    pub fn net_input(
        &mut self,
        head: &[u8],
        len: usize,
        at: FrameAt<'_>,
        now: Instant,
        send: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), BadFrame> {
        let Store::Remote(r) = &mut self.store else {
            return Err(BadFrame::UnknownTag);
        };
        let Remote {
            ini, slots, done, ..
        } = &mut **r;
        let mut io = RemoteIo {
            dom: self.xen.domain(),
            slots,
            done,
            frame: at,
            send,
        };
        let res = ini.input(head, len, now, &mut io);
        self.answer_remote();
        res
    }

    /// When a remote disk's initiator next needs [`Blkback::net_poll`] (its earliest
    /// retransmission or request bound), if anything is on the wire.
    pub fn net_due(&self) -> Option<Instant> {
        match &self.store {
            Store::Remote(r) => r.ini.next_due(),
            Store::File(_) => None,
        }
    }

    /// The remote disk's initiator's counters, if the device has one.
    pub fn aoe_stats(&self) -> Option<&crate::initiator::AoeStats> {
        match &self.store {
            Store::Remote(r) => Some(r.ini.stats()),
            Store::File(_) => None,
        }
    }

    /// Answers the requests a remote disk finished: unmaps their segments, pushes each
    /// response, notifies once.
    fn answer_remote(&mut self) {
        let Store::Remote(r) = &mut self.store else {
            return;
        };
        if r.done.is_empty() {
            return;
        }
        let mut n = 0;
        for i in 0..r.done.len() {
            let (k, ok) = r.done[i];
            let Some(f) = r.slots.get_mut(usize::from(k)) else {
                continue;
            };
            let u = f.unmaps.len();
            if u > 0 {
                self.xen.grant_unmap(&f.unmaps, &mut self.unmap_st[..u]);
                f.unmaps.clear();
            }
            let status = if ok {
                self.stats.done += 1;
                if f.operation == crate::blkif::BLKIF_OP_FLUSH_DISKCACHE {
                    self.stats.flushes += 1;
                } else if f.write {
                    self.stats.writes += 1;
                    self.stats.sectors_written += f.sectors;
                } else {
                    self.stats.reads += 1;
                    self.stats.sectors_read += f.sectors;
                }
                BLKIF_RSP_OKAY
            } else {
                self.stats.io_errors += 1;
                BLKIF_RSP_ERROR
            };
            f.busy = false;
            r.free.push(k);
            if self.ring.is_some()
                && answer(&mut self.ring, &response(f.id, f.operation, status)).is_ok()
            {
                n += 1;
            }
        }
        r.done.clear();
        if n > 0 {
            self.flush_responses();
        }
    }

    /// Publishes the responses written and notifies the front end if it asked.
    fn flush_responses(&mut self) {
        if self
            .ring
            .as_mut()
            .is_some_and(|r| r.push_responses_and_check_notify())
        {
            self.stats.notifies += 1;
            let _ = self.xen.evtchn_send(self.port);
        }
    }

    /// Marks the device broken by a protocol break and tells the front end (`Closing`).
    fn protocol_break(&mut self, e: RingError) {
        self.broken = Some(Broken::Ring(e));
        let dir = xenbus::backend_dir(self.xen.id(), self.fe, self.devid);
        let _ = self
            .xen
            .store()
            .switch_state(self.xen.id(), &dir, XenbusState::Closing);
    }

    /// Goes as a back end's process dies: what the kernel takes back from a dead
    /// process (every mapping, the channel) is given back, and nothing else happens:
    /// no request is answered and the store is not written, so the front end stays
    /// `Connected` and another back end may [`Blkback::resume`] the device.
    pub fn abandon(mut self) {
        // The kernel ends a dead process's transfers too; their answers are not written.
        self.settle_disk();
        self.release();
    }

    /// Hands the device over, as a clean stop for an upgrade does: every response
    /// written is published (and the front end told), then what [`Blkback::abandon`]
    /// gives back is given back. The store is not written, so the front end stays
    /// `Connected` and never sees the back end change; the next back end takes the ring
    /// over where this one left it ([`Blkback::resume`]). Closing a device is an explicit
    /// act ([`Blkback::disconnect`]), never the side effect of a stop.
    pub fn hand_over(mut self) {
        // Every transfer in flight ended and answered, so that the next back end finds
        // the ring answered up to what it takes.
        self.settle_disk();
        let _ = self.retire();
        self.flush_responses();
        self.release_remote_slots();
        self.release();
    }

    /// A remote disk's slots' mappings of guest pages, given back.
    fn release_remote_slots(&mut self) {
        if let Store::Remote(r) = &mut self.store {
            for f in &mut r.slots {
                let u = f.unmaps.len();
                if u > 0 {
                    self.xen.grant_unmap(&f.unmaps, &mut self.unmap_st[..u]);
                    f.unmaps.clear();
                }
            }
        }
    }

    /// Gives back every persistent mapping, the ring and the channel.
    fn release(&mut self) {
        if let Some(p) = self.persistent.take() {
            let handles: Vec<GrantHandle> = p.slots.values().map(|&(_, h)| h).collect();
            let mut st = vec![Ok(()); handles.len()];
            self.xen.grant_unmap(&handles, &mut st);
        }
        self.ring = None;
        let n = self.ring_handles.len();
        self.xen
            .grant_unmap(&self.ring_handles, &mut self.unmap_st[..n]);
        let _ = self.xen.evtchn_close(self.port);
        self.bounce = None;
        self.aio = None;
    }

    /// Disconnects: gives back every persistent mapping, the ring and the channel.
    pub fn disconnect(mut self) {
        self.settle_disk();
        self.release_remote_slots();
        self.release();
        let dir = xenbus::backend_dir(self.xen.id(), self.fe, self.devid);
        let store = self.xen.store();
        let _ = store.switch_state(self.xen.id(), &dir, XenbusState::Closing);
        let _ = store.switch_state(self.xen.id(), &dir, XenbusState::Closed);
    }
}
