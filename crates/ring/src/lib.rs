//! The shared I/O ring of Xen's `io/ring.h`, over one shared page, generic over the
//! request and response types.
//!
//! Layout (as ring.h): a 64-byte header holding `req_prod`, `req_event`, `rsp_prod`,
//! `rsp_event` (free-running `u32`s) then padding, followed by a power-of-two number of
//! slots, each as large as the larger of a request and a response. The front end produces
//! requests and consumes responses; the back end the reverse. Names follow ring.h
//! (`req_prod_pvt`, `rsp_cons`, ...) so the code can be read beside it. Beyond ring.h,
//! two pvio ends may agree on [`Layout::SPLIT`], each end's index words on a cache line
//! of its own ([`PageRing::with_layout`]).
//!
//! What it owns: each end's private indices. What it trusts: nothing in the shared page.
//! Every index read from the peer is loaded once, checked against the ring size, and
//! every entry is copied out of its slot before the caller sees it
//! ([`BackRing::take_request`] returns a value, never a reference: Xen's
//! `RING_COPY_REQUEST`, XSA-155). A peer whose producer index runs more than a ring
//! ahead breaks this ring only: every later call returns [`RingError::Broken`].
//!
//! What it guarantees: with a well-behaved peer, no request or response is lost or read
//! before it is written, and a notification is asked for whenever the peer may be
//! waiting (checked with loom in `tests/loom.rs`).

use std::marker::PhantomData;
use std::sync::atomic::Ordering;

use mem::journal::Journal;
use mem::{MemError, PageAccess, PAGE_SIZE};

mod record;
pub use record::Recorded;
use record::Recorder;

/// Bytes a journal needs to record the responses of a `P` ring in a region of `region`
/// bytes ([`BackRing::record_in`], [`BackRing::resume`]).
pub const fn record_len<P: RingProtocol>(region: usize) -> usize {
    record::len_for(
        Layout::XEN.ring_size(region, P::SLOT_SIZE),
        std::mem::size_of::<P::Rsp>(),
    )
}

/// Size of the shared header (`struct *_sring` up to `ring[]`): four indices and padding.
pub const HEADER_SIZE: usize = 64;
const REQ_PROD: usize = 0;
const REQ_EVENT: usize = 4;
const RSP_PROD: usize = 8;
const RSP_EVENT: usize = 12;

/// Where a ring's four index words and its first slot lie in its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The front end's producer index.
    pub req_prod: usize,
    /// Where the back end asks to be notified of requests.
    pub req_event: usize,
    /// The back end's producer index.
    pub rsp_prod: usize,
    /// Where the front end asks to be notified of responses.
    pub rsp_event: usize,
    /// Bytes before the first slot.
    pub header: usize,
}

impl Layout {
    /// ring.h's: the four indices in the first 16 bytes, one cache line that both ends
    /// write (the front end `req_prod` and `rsp_event`, the back end the other two), the
    /// slots from byte 64. What a Xen peer expects, and the default.
    pub const XEN: Layout = Layout {
        req_prod: REQ_PROD,
        req_event: REQ_EVENT,
        rsp_prod: RSP_PROD,
        rsp_event: RSP_EVENT,
        header: HEADER_SIZE,
    };

    /// pvio's, beyond Xen, for two pvio ends that agree on it: the words each end writes
    /// on a 64-byte line of their own (the front end's `req_prod` and `rsp_event` on the
    /// first, the back end's `rsp_prod` and `req_event` on the second), so that an end
    /// polling its peer's producer index never takes from the peer the line the peer
    /// writes its own event index in, and the slots from byte 128. The ring holds as
    /// many slots as ring.h's for every protocol of pvio's (the 64 bytes come out of
    /// the rounding down).
    pub const SPLIT: Layout = Layout {
        req_prod: 0,
        rsp_event: 4,
        rsp_prod: 64,
        req_event: 68,
        header: 128,
    };

    /// Number of slots a region of `region` bytes holds for slots of `slot` bytes: the
    /// largest power of two that fits after the header.
    pub const fn ring_size(&self, region: usize, slot: usize) -> u32 {
        if slot == 0 || region <= self.header {
            return 0;
        }
        let n = (region - self.header) / slot;
        if n == 0 {
            0
        } else {
            1 << (usize::BITS - 1 - n.leading_zeros())
        }
    }
}

/// One ring protocol: the request and response entry types. Both are plain old data with
/// their ABI layout; a slot holds either.
pub trait RingProtocol {
    /// What the front end asks.
    type Req: bytemuck::Pod;
    /// What the back end answers.
    type Rsp: bytemuck::Pod;
    /// Size of one slot: the larger entry, as ring.h's union.
    const SLOT_SIZE: usize = if std::mem::size_of::<Self::Req>() > std::mem::size_of::<Self::Rsp>()
    {
        std::mem::size_of::<Self::Req>()
    } else {
        std::mem::size_of::<Self::Rsp>()
    };
}

/// Number of slots a region of `region` bytes holds for slots of `slot` bytes: the
/// largest power of two that fits after the header (ring.h's `__RD32`).
pub const fn ring_size(region: usize, slot: usize) -> u32 {
    Layout::XEN.ring_size(region, slot)
}

/// The shared region a ring lives in: four index words and the slot array. Implemented
/// for a page of machine memory (through [`PageAccess`]) and, in tests, for loom.
pub trait RingMemory {
    /// Bytes in the region (a page for real rings).
    fn region_size(&self) -> usize;
    /// Where the indices and slots are: ring.h's unless the region says otherwise.
    fn layout(&self) -> Layout {
        Layout::XEN
    }
    /// Loads the index word at byte offset `at` (0, 4, 8 or 12).
    fn load(&self, at: usize, order: Ordering) -> u32;
    /// Stores the index word at byte offset `at`.
    fn store(&self, at: usize, v: u32, order: Ordering);
    /// A memory fence (loom needs its own).
    fn fence(&self, order: Ordering);
    /// Copies the entry in slot `slot` out (slots are `slot_size` bytes apart).
    fn read_entry<T: bytemuck::Pod>(&self, slot: u32, slot_size: usize) -> T;
    /// Copies the entries of `out.len()` consecutive slots from slot `first` out (the
    /// run must not pass the ring's end). A region that can copies them in one go, so
    /// that their lines are fetched together.
    fn read_entries<T: bytemuck::Pod>(&self, first: u32, slot_size: usize, out: &mut [T]) {
        for (i, e) in out.iter_mut().enumerate() {
            *e = self.read_entry(first + i as u32, slot_size);
        }
    }
    /// Writes an entry into slot `slot`.
    fn write_entry<T: bytemuck::Pod>(&self, slot: u32, slot_size: usize, v: &T);
    /// Writes `v.len()` entries into consecutive slots from slot `first` (the run must
    /// not pass the ring's end). A region that can writes them in one go.
    fn write_entries<T: bytemuck::Pod>(&self, first: u32, slot_size: usize, v: &[T]) {
        for (i, e) in v.iter().enumerate() {
            self.write_entry(first + i as u32, slot_size, e);
        }
    }
}

/// A shared page as ring memory. Construction checks that the index words are reachable
/// as atomics (the page is mapped writable), so later accesses cannot fail.
#[derive(Debug)]
pub struct PageRing<P: PageAccess>(P, Layout);

impl<P: PageAccess> PageRing<P> {
    /// Wraps a page as a ring.h ring; fails if it cannot host a ring (read-only
    /// mapping, say).
    pub fn new(page: P) -> Result<Self, MemError> {
        Self::with_layout(page, Layout::XEN)
    }
    /// Wraps a page as a ring laid out as `layout` (both ends must agree on it).
    pub fn with_layout(page: P, layout: Layout) -> Result<Self, MemError> {
        for at in [
            layout.req_prod,
            layout.req_event,
            layout.rsp_prod,
            layout.rsp_event,
        ] {
            page.atomic_u32(at)?;
        }
        Ok(Self(page, layout))
    }
    /// The page.
    pub fn page(&self) -> &P {
        &self.0
    }
}

impl<P: PageAccess> RingMemory for PageRing<P> {
    fn region_size(&self) -> usize {
        PAGE_SIZE
    }
    fn layout(&self) -> Layout {
        self.1
    }
    #[inline]
    fn load(&self, at: usize, order: Ordering) -> u32 {
        // Cannot fail: `new` checked the four index words.
        self.0.atomic_u32(at).map_or(0, |a| a.load(order))
    }
    #[inline]
    fn store(&self, at: usize, v: u32, order: Ordering) {
        if let Ok(a) = self.0.atomic_u32(at) {
            a.store(v, order);
        }
    }
    #[inline]
    fn fence(&self, order: Ordering) {
        std::sync::atomic::fence(order);
    }
    #[inline]
    fn read_entry<T: bytemuck::Pod>(&self, slot: u32, slot_size: usize) -> T {
        // In bounds: slot < ring_size(PAGE_SIZE, slot_size), so the slot ends inside the
        // page; the accessor checks again and a failure reads as zeroes.
        self.0
            .read_obj(self.1.header + slot as usize * slot_size)
            .unwrap_or_else(|_| T::zeroed())
    }
    #[inline]
    fn write_entry<T: bytemuck::Pod>(&self, slot: u32, slot_size: usize, v: &T) {
        let _ = self
            .0
            .write_obj(self.1.header + slot as usize * slot_size, v);
    }
    fn write_entries<T: bytemuck::Pod>(&self, first: u32, slot_size: usize, v: &[T]) {
        let at = self.1.header + first as usize * slot_size;
        let width = std::mem::size_of::<T>();
        if width == slot_size {
            let _ = self.0.write(at, bytemuck::cast_slice(v));
            return;
        }
        // Entries narrower than their slots (a response in a request's slot): the image
        // of up to 512 bytes of slots is built here, each entry at its slot's start and
        // the rest of the slot zero (a union's other member, which its reader no longer
        // looks at), then written with one copy.
        const CHUNK: usize = 512;
        if width > slot_size || slot_size > CHUNK {
            for (i, e) in v.iter().enumerate() {
                self.write_entry(first + i as u32, slot_size, e);
            }
            return;
        }
        let per = CHUNK / slot_size;
        for (c, run) in v.chunks(per).enumerate() {
            let mut image = [0u8; CHUNK];
            for (i, e) in run.iter().enumerate() {
                image[i * slot_size..i * slot_size + width].copy_from_slice(bytemuck::bytes_of(e));
            }
            let _ = self
                .0
                .write(at + c * per * slot_size, &image[..run.len() * slot_size]);
        }
    }
    fn read_entries<T: bytemuck::Pod>(&self, first: u32, slot_size: usize, out: &mut [T]) {
        if std::mem::size_of::<T>() != slot_size {
            for (i, e) in out.iter_mut().enumerate() {
                *e = self.read_entry(first + i as u32, slot_size);
            }
            return;
        }
        // Slots as wide as the entry lie back to back: one copy of the run. The
        // accessor checks the run against the page; a failure reads as zeroes.
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        if self
            .0
            .read(self.1.header + first as usize * slot_size, bytes)
            .is_err()
        {
            bytes.fill(0);
        }
    }
}

/// Pages of a ring granted together (blkif's and netif's `ring-page-order`: `ring-ref0`
/// to `ring-ref<n-1>`), one region as ring.h sees it: the indices in the first page, the
/// slots running on across the pages, an entry cut where a page ends. One page is
/// [`PageRing`]'s region exactly.
#[derive(Debug)]
pub struct PagesRing<P: PageAccess> {
    pages: Vec<P>,
}

/// Most pages a ring takes (`XENBUS_MAX_RING_GRANT_ORDER`, order 4).
pub const MAX_RING_PAGES: usize = 16;

impl<P: PageAccess> PagesRing<P> {
    /// The pages, in the order the front end granted them, as a ring.h ring; fails for
    /// none, more than [`MAX_RING_PAGES`] or not a power of two of them, or if the index
    /// words cannot be reached (a read-only mapping).
    pub fn new(pages: Vec<P>) -> Result<Self, MemError> {
        if pages.is_empty() || pages.len() > MAX_RING_PAGES || !pages.len().is_power_of_two() {
            return Err(MemError::CrossesPage {
                offset: 0,
                len: pages.len() * PAGE_SIZE,
            });
        }
        for at in [REQ_PROD, REQ_EVENT, RSP_PROD, RSP_EVENT] {
            pages[0].atomic_u32(at)?;
        }
        Ok(Self { pages })
    }

    /// The pages.
    pub fn pages(&self) -> &[P] {
        &self.pages
    }

    /// Calls `f` with each piece of `[at, at + len)` of the region: its page, the offset
    /// in that page and the range of the whole it is.
    fn pieces(&self, at: usize, len: usize, mut f: impl FnMut(&P, usize, std::ops::Range<usize>)) {
        let mut done = 0;
        while done < len {
            let (page, off) = ((at + done) / PAGE_SIZE, (at + done) % PAGE_SIZE);
            let n = (PAGE_SIZE - off).min(len - done);
            if let Some(p) = self.pages.get(page) {
                f(p, off, done..done + n);
            }
            done += n;
        }
    }
}

impl<P: PageAccess> RingMemory for PagesRing<P> {
    fn region_size(&self) -> usize {
        self.pages.len() * PAGE_SIZE
    }
    #[inline]
    fn load(&self, at: usize, order: Ordering) -> u32 {
        // Cannot fail: `new` checked the four index words.
        self.pages[0].atomic_u32(at).map_or(0, |a| a.load(order))
    }
    #[inline]
    fn store(&self, at: usize, v: u32, order: Ordering) {
        if let Ok(a) = self.pages[0].atomic_u32(at) {
            a.store(v, order);
        }
    }
    #[inline]
    fn fence(&self, order: Ordering) {
        std::sync::atomic::fence(order);
    }
    fn read_entry<T: bytemuck::Pod>(&self, slot: u32, slot_size: usize) -> T {
        let mut v = T::zeroed();
        let b = bytemuck::bytes_of_mut(&mut v);
        let len = b.len();
        // In bounds: slot < ring_size(region, slot_size). A failed piece reads as zeroes.
        self.pieces(HEADER_SIZE + slot as usize * slot_size, len, |p, off, r| {
            if p.read(off, &mut b[r.clone()]).is_err() {
                b[r].fill(0);
            }
        });
        v
    }
    fn write_entry<T: bytemuck::Pod>(&self, slot: u32, slot_size: usize, v: &T) {
        let b = bytemuck::bytes_of(v);
        self.pieces(
            HEADER_SIZE + slot as usize * slot_size,
            b.len(),
            |p, off, r| {
                let _ = p.write(off, &b[r]);
            },
        );
    }
}

/// Copies the entries of `out.len()` slots (`slot_size` bytes apart) from slot `first`
/// of a ring of `size` slots, in order: the run up to the ring's end, then the rest
/// from slot 0.
fn read_run<M: RingMemory, T: bytemuck::Pod>(
    mem: &M,
    first: u32,
    size: u32,
    slot_size: usize,
    out: &mut [T],
) {
    let to_end = ((size - first) as usize).min(out.len());
    let (a, b) = out.split_at_mut(to_end);
    if !a.is_empty() {
        mem.read_entries(first, slot_size, a);
    }
    if !b.is_empty() {
        mem.read_entries(0, slot_size, b);
    }
}

/// Writes `v` into consecutive slots (`slot_size` bytes apart) from slot `first` of a
/// ring of `size` slots: the run up to the ring's end, then the rest from slot 0.
fn write_run<M: RingMemory, T: bytemuck::Pod>(
    mem: &M,
    first: u32,
    size: u32,
    slot_size: usize,
    v: &[T],
) {
    let to_end = ((size - first) as usize).min(v.len());
    let (a, b) = v.split_at(to_end);
    if !a.is_empty() {
        mem.write_entries(first, slot_size, a);
    }
    if !b.is_empty() {
        mem.write_entries(0, slot_size, b);
    }
}

/// A free-running ring index; it wraps, and is masked into a slot in exactly one place.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingIdx(pub u32);

impl RingIdx {
    /// The slot this index names in a ring of `size` (a power of two).
    #[inline]
    pub fn slot(self, size: u32) -> u32 {
        self.0 & (size - 1)
    }
    /// Distance from `earlier` to `self`, modulo 2^32.
    #[inline]
    pub fn since(self, earlier: RingIdx) -> u32 {
        self.0.wrapping_sub(earlier.0)
    }
    #[inline]
    fn bump(&mut self) {
        self.0 = self.0.wrapping_add(1);
    }
}

/// Why a ring refuses to go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The peer's producer index is more than a ring ahead of what this end has answered
    /// or consumed: a protocol break, fatal for this ring.
    #[error("peer producer index {prod} is more than a ring ahead of {base} (ring of {size})")]
    ProducerOverrun { prod: u32, base: u32, size: u32 },
    /// The peer moved its producer index back behind requests this end has already
    /// consumed: a protocol break, fatal for this ring.
    #[error("peer producer index {prod} is behind the consumer {cons}")]
    ProducerBehind { prod: u32, cons: u32 },
    /// This ring was broken by an earlier protocol break; it is not touched again.
    #[error("ring is broken by an earlier protocol error")]
    Broken,
    /// No free slot for another request (front end) or no consumed request to answer
    /// (back end).
    #[error("ring is full")]
    Full,
    /// The region cannot hold a single slot.
    #[error("region too small for a ring")]
    TooSmall,
}

/// The front end of a ring: produces requests, consumes responses.
#[derive(Debug)]
pub struct FrontRing<P: RingProtocol, M: RingMemory> {
    mem: M,
    /// Where the indices are (the region's layout, read once).
    at: Layout,
    size: u32,
    req_prod_pvt: RingIdx,
    rsp_cons: RingIdx,
    /// Last `rsp_prod` loaded and validated.
    rsp_prod_seen: RingIdx,
    broken: bool,
    _p: PhantomData<P>,
}

impl<P: RingProtocol, M: RingMemory> FrontRing<P, M> {
    /// Initialises the shared header (`SHARED_RING_INIT`) and the front end's private
    /// state (`FRONT_RING_INIT`). Done by the front end before granting the page.
    pub fn init(mem: M) -> Result<Self, RingError> {
        let at = mem.layout();
        let size = at.ring_size(mem.region_size(), P::SLOT_SIZE);
        if size == 0 {
            return Err(RingError::TooSmall);
        }
        mem.store(at.req_prod, 0, Ordering::Relaxed);
        mem.store(at.rsp_prod, 0, Ordering::Relaxed);
        mem.store(at.req_event, 1, Ordering::Relaxed);
        mem.store(at.rsp_event, 1, Ordering::Relaxed);
        mem.fence(Ordering::Release);
        Ok(Self {
            mem,
            at,
            size,
            req_prod_pvt: RingIdx(0),
            rsp_cons: RingIdx(0),
            rsp_prod_seen: RingIdx(0),
            broken: false,
            _p: PhantomData,
        })
    }

    /// Number of slots.
    pub fn size(&self) -> u32 {
        self.size
    }
    /// The ring memory.
    pub fn memory(&self) -> &M {
        &self.mem
    }
    /// Requests pushed privately or published but not yet answered.
    pub fn outstanding(&self) -> u32 {
        self.req_prod_pvt.since(self.rsp_cons)
    }
    /// Free slots for new requests (`RING_FREE_REQUESTS`).
    pub fn free_requests(&self) -> u32 {
        self.size - self.outstanding()
    }
    /// Whether a protocol break stopped this ring.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Writes a request into the next private slot; not visible to the back end until
    /// [`Self::push_requests_and_check_notify`].
    pub fn push_request(&mut self, req: &P::Req) -> Result<(), RingError> {
        if self.broken {
            return Err(RingError::Broken);
        }
        if self.free_requests() == 0 {
            return Err(RingError::Full);
        }
        self.mem
            .write_entry(self.req_prod_pvt.slot(self.size), P::SLOT_SIZE, req);
        self.req_prod_pvt.bump();
        Ok(())
    }

    /// Writes as many of `reqs` as there are free slots into the next private slots,
    /// with one copy per contiguous run; returns how many. They are published by
    /// [`FrontRing::push_requests_and_check_notify`].
    pub fn push_requests(&mut self, reqs: &[P::Req]) -> Result<usize, RingError> {
        if self.broken {
            return Err(RingError::Broken);
        }
        let n = (self.free_requests() as usize).min(reqs.len());
        let first = self.req_prod_pvt.slot(self.size);
        write_run(&self.mem, first, self.size, P::SLOT_SIZE, &reqs[..n]);
        self.req_prod_pvt = RingIdx(self.req_prod_pvt.0.wrapping_add(n as u32));
        Ok(n)
    }

    /// Publishes the private requests and says whether the back end asked to be notified
    /// (`RING_PUSH_REQUESTS_AND_CHECK_NOTIFY`).
    pub fn push_requests_and_check_notify(&mut self) -> bool {
        let new = self.req_prod_pvt.0;
        // We are the only writer of req_prod, so a relaxed load gives our last value.
        let old = self.mem.load(self.at.req_prod, Ordering::Relaxed);
        // Release: the back end that sees the new req_prod also sees the slots.
        self.mem.store(self.at.req_prod, new, Ordering::Release);
        // Full fence: our req_prod store must be visible before we read req_event, or we
        // could miss the back end arming req_event just after checking req_prod (and
        // both sides would wait).
        self.mem.fence(Ordering::SeqCst);
        let event = self.mem.load(self.at.req_event, Ordering::Relaxed);
        new.wrapping_sub(event) < new.wrapping_sub(old)
    }

    fn responses_available(&mut self) -> Result<u32, RingError> {
        if self.broken {
            return Err(RingError::Broken);
        }
        if self.rsp_cons != self.rsp_prod_seen {
            return Ok(self.rsp_prod_seen.since(self.rsp_cons));
        }
        // Acquire: pairs with the back end's Release store; slots up to prod are written.
        let prod = RingIdx(self.mem.load(self.at.rsp_prod, Ordering::Acquire));
        // The back end may answer only what we asked: anything beyond our outstanding
        // requests is a protocol break.
        if prod.since(self.rsp_cons) > self.outstanding() {
            self.broken = true;
            return Err(RingError::ProducerOverrun {
                prod: prod.0,
                base: self.rsp_cons.0,
                size: self.size,
            });
        }
        self.rsp_prod_seen = prod;
        Ok(prod.since(self.rsp_cons))
    }

    /// Copies out the next response, if one is published.
    pub fn take_response(&mut self) -> Result<Option<P::Rsp>, RingError> {
        if self.responses_available()? == 0 {
            return Ok(None);
        }
        let rsp = self
            .mem
            .read_entry(self.rsp_cons.slot(self.size), P::SLOT_SIZE);
        self.rsp_cons.bump();
        Ok(Some(rsp))
    }

    /// Copies out as many published responses as `out` holds, in order, with one read
    /// of the producer index and one copy per contiguous run of slots; returns how
    /// many. The caller validates each copy.
    pub fn take_responses(&mut self, out: &mut [P::Rsp]) -> Result<usize, RingError> {
        let n = (self.responses_available()? as usize).min(out.len());
        let first = self.rsp_cons.slot(self.size);
        read_run(&self.mem, first, self.size, P::SLOT_SIZE, &mut out[..n]);
        self.rsp_cons = RingIdx(self.rsp_cons.0.wrapping_add(n as u32));
        Ok(n)
    }

    /// Copies out the response `ahead` places after the next one, if it is published,
    /// without taking it: a look ahead (to prefetch what a batch will touch). The copy
    /// is only a hint; the response taken later is copied again and judged then.
    pub fn peek_response(&mut self, ahead: u32) -> Result<Option<P::Rsp>, RingError> {
        if self.responses_available()? <= ahead {
            return Ok(None);
        }
        let at = RingIdx(self.rsp_cons.0.wrapping_add(ahead));
        Ok(Some(self.mem.read_entry(at.slot(self.size), P::SLOT_SIZE)))
    }

    /// Whether responses are pending; if none, arms `rsp_event` so that the back end
    /// notifies on the next one, then checks again (`RING_FINAL_CHECK_FOR_RESPONSES`).
    pub fn final_check_for_responses(&mut self) -> Result<bool, RingError> {
        if self.responses_available()? > 0 {
            return Ok(true);
        }
        self.mem.store(
            self.at.rsp_event,
            self.rsp_cons.0.wrapping_add(1),
            Ordering::Relaxed,
        );
        // Full fence: rsp_event must be visible before we re-read rsp_prod, so a response
        // published in between is either seen here or notified.
        self.mem.fence(Ordering::SeqCst);
        Ok(self.responses_available()? > 0)
    }
}

/// The back end of a ring: consumes requests, produces responses.
#[derive(Debug)]
pub struct BackRing<P: RingProtocol, M: RingMemory> {
    mem: M,
    /// Where the indices are (the region's layout, read once).
    at: Layout,
    size: u32,
    rsp_prod_pvt: RingIdx,
    req_cons: RingIdx,
    /// Last `req_prod` loaded and validated.
    req_prod_seen: RingIdx,
    broken: bool,
    /// Where each batch of responses is recorded before its slots are written.
    record: Option<Box<Recorder<P::Rsp>>>,
    /// Responses written again from a record when this end took the ring over.
    replayed: u32,
    _p: PhantomData<P>,
}

impl<P: RingProtocol, M: RingMemory> BackRing<P, M> {
    /// Attaches to a ring the front end initialised (`BACK_RING_INIT`).
    pub fn attach(mem: M) -> Result<Self, RingError> {
        let at = mem.layout();
        let size = at.ring_size(mem.region_size(), P::SLOT_SIZE);
        if size == 0 {
            return Err(RingError::TooSmall);
        }
        Ok(Self {
            mem,
            at,
            size,
            rsp_prod_pvt: RingIdx(0),
            req_cons: RingIdx(0),
            req_prod_seen: RingIdx(0),
            broken: false,
            record: None,
            replayed: 0,
            _p: PhantomData,
        })
    }

    /// Records every batch of responses from now on in `journal` (at least
    /// [`record_len`] bytes, or this refuses it and answers `false`): a batch is staged
    /// as it is answered and, when published, recorded whole before its slots are
    /// written, so that a back end started after this one dies takes the ring over
    /// exactly ([`BackRing::resume`]). Right only for a back end that has answered every
    /// request it took whenever it publishes (see the [`record`] module); to be called
    /// before the first response.
    pub fn record_in(&mut self, journal: Journal) -> bool {
        match Recorder::start(journal, self.size, self.rsp_prod_pvt.0) {
            Some(r) => {
                self.record = Some(Box::new(r));
                true
            }
            None => false,
        }
    }

    /// Responses written again from the journal's record when this end took the ring
    /// over ([`BackRing::resume`]): those the back end before had recorded and not
    /// published.
    pub fn replayed(&self) -> u32 {
        self.replayed
    }

    /// What the journal this ring records in holds now.
    pub fn recorded(&self) -> Option<Recorded<P::Rsp>> {
        self.record
            .as_ref()
            .and_then(|r| Recorder::last(r.journal(), self.size))
    }

    /// Takes over a ring another back end served and left (its process died, or stopped
    /// to hand it over): carries on from its last response, so that every request after
    /// it is taken again and answered once. Right only for a protocol whose back end
    /// has answered every request it took whenever it publishes (blkif from a file,
    /// netif copying); one that answers out of order may have answered some already.
    ///
    /// Its last response is the last it published (`rsp_prod`), unless `journal` (the
    /// one it recorded in, [`BackRing::record_in`]) holds a batch that reaches further:
    /// a batch recorded and not wholly published, whose slots may hold responses now,
    /// so that without the record they would be taken again as requests. Then its
    /// responses not yet published are written again from the record and published by
    /// the next [`BackRing::push_responses_and_check_notify`]. A record of another shape,
    /// or whose batch does not contain `rsp_prod`, is not taken. Recording goes on in
    /// `journal`. The front end's producer must lie within one ring of the point taken,
    /// or the ring is refused (`ProducerOverrun`), as on any later look.
    pub fn resume(mem: M, journal: Option<Journal>) -> Result<Self, RingError> {
        let mut r = Self::attach(mem)?;
        // Acquire: what the earlier back end wrote before publishing is visible.
        let published = RingIdx(r.mem.load(r.at.rsp_prod, Ordering::Acquire));
        let last = journal
            .as_ref()
            .and_then(|j| Recorder::<P::Rsp>::last(j, r.size));
        let at = match last {
            Some(b) if published.since(RingIdx(b.start)) <= b.responses.len() as u32 => {
                // Only the slots not yet published: those before may hold the front
                // end's next requests already.
                let done = published.since(RingIdx(b.start)) as usize;
                let first = published.slot(r.size);
                write_run(&r.mem, first, r.size, P::SLOT_SIZE, &b.responses[done..]);
                r.replayed = (b.responses.len() - done) as u32;
                RingIdx(b.end())
            }
            _ => published,
        };
        r.rsp_prod_pvt = at;
        r.req_cons = at;
        r.req_prod_seen = at;
        if let Some(j) = journal {
            // The record goes on from the point taken (the batch it holds stays named
            // until the next is committed).
            r.record = Recorder::start(j, r.size, at.0).map(Box::new);
        }
        r.load_req_prod()?;
        Ok(r)
    }

    /// Number of slots.
    pub fn size(&self) -> u32 {
        self.size
    }
    /// The ring memory.
    pub fn memory(&self) -> &M {
        &self.mem
    }
    /// Whether a protocol break stopped this ring.
    pub fn is_broken(&self) -> bool {
        self.broken
    }
    /// Requests consumed but not yet answered.
    pub fn unanswered(&self) -> u32 {
        self.req_cons.since(self.rsp_prod_pvt)
    }

    /// Requests published (as far as this end last read the producer index) and not
    /// yet answered: how full the ring is, from this side. Reads no shared memory.
    pub fn occupancy(&self) -> u32 {
        self.req_prod_seen.since(self.rsp_prod_pvt)
    }

    /// Number of requests published and not yet consumed, validating the peer's index.
    /// The index is re-read only once everything seen before has been consumed.
    pub fn requests_available(&mut self) -> Result<u32, RingError> {
        if self.broken {
            return Err(RingError::Broken);
        }
        if self.req_cons != self.req_prod_seen {
            return Ok(self.req_prod_seen.since(self.req_cons));
        }
        self.load_req_prod()
    }

    /// Loads the front end's `req_prod` and checks it against what this end has
    /// consumed and answered; returns the requests published and not yet consumed.
    fn load_req_prod(&mut self) -> Result<u32, RingError> {
        if self.broken {
            return Err(RingError::Broken);
        }
        // Acquire: pairs with the front end's Release store of req_prod.
        let prod = RingIdx(self.mem.load(self.at.req_prod, Ordering::Acquire));
        // Measured from rsp_prod_pvt, the producer must lie between what we consumed
        // and one ring further. Beyond a ring means a bogus index (netback's
        // RING_REQUEST_PROD_OVERFLOW); behind req_cons means the front end took back
        // requests we already hold, and `prod - req_cons` would wrap to ~2^32. Both are
        // fatal for this ring.
        let ahead = prod.since(self.rsp_prod_pvt);
        if ahead > self.size {
            self.broken = true;
            return Err(RingError::ProducerOverrun {
                prod: prod.0,
                base: self.rsp_prod_pvt.0,
                size: self.size,
            });
        }
        if ahead < self.req_cons.since(self.rsp_prod_pvt) {
            self.broken = true;
            return Err(RingError::ProducerBehind {
                prod: prod.0,
                cons: self.req_cons.0,
            });
        }
        self.req_prod_seen = prod;
        Ok(prod.since(self.req_cons))
    }

    /// Copies out the next request, if one is published. The caller validates the copy
    /// and acts only on it.
    pub fn take_request(&mut self) -> Result<Option<P::Req>, RingError> {
        if self.requests_available()? == 0 {
            return Ok(None);
        }
        let req = self
            .mem
            .read_entry(self.req_cons.slot(self.size), P::SLOT_SIZE);
        self.req_cons.bump();
        Ok(Some(req))
    }

    /// Copies out as many published requests as `out` holds, in order, with one read of
    /// the producer index (when all seen before are taken) and one copy per contiguous
    /// run of slots; returns how many. The caller validates each copy and acts only on
    /// it.
    pub fn take_requests(&mut self, out: &mut [P::Req]) -> Result<usize, RingError> {
        let n = (self.requests_available()? as usize).min(out.len());
        let first = self.req_cons.slot(self.size);
        read_run(&self.mem, first, self.size, P::SLOT_SIZE, &mut out[..n]);
        self.req_cons = RingIdx(self.req_cons.0.wrapping_add(n as u32));
        Ok(n)
    }

    /// Copies out the request `ahead` places after the next one, if it is published (as
    /// far as this end last read the producer index), without taking it: a look ahead
    /// to prefetch what a batch will touch. The copy is only a hint; the request taken
    /// later is copied again and judged then. Reads no index.
    pub fn peek_request(&self, ahead: u32) -> Option<P::Req> {
        if self.broken || self.req_prod_seen.since(self.req_cons) <= ahead {
            return None;
        }
        let at = RingIdx(self.req_cons.0.wrapping_add(ahead));
        Some(self.mem.read_entry(at.slot(self.size), P::SLOT_SIZE))
    }

    /// Writes a response into the next private slot. There must be a consumed,
    /// unanswered request (the response reuses its slot).
    pub fn push_response(&mut self, rsp: &P::Rsp) -> Result<(), RingError> {
        if self.broken {
            return Err(RingError::Broken);
        }
        if self.unanswered() == 0 {
            return Err(RingError::Full);
        }
        match self.record.as_mut() {
            // Fits: staged responses answer requests not yet answered, at most a ring.
            Some(r) => r.staged.push(*rsp),
            None => self
                .mem
                .write_entry(self.rsp_prod_pvt.slot(self.size), P::SLOT_SIZE, rsp),
        }
        self.rsp_prod_pvt.bump();
        Ok(())
    }

    /// Writes as many of `rsps` as there are consumed, unanswered requests into the next
    /// private slots (each response reuses its request's slot), with one copy per
    /// contiguous run; returns how many. They are published by
    /// [`BackRing::push_responses_and_check_notify`].
    pub fn push_responses(&mut self, rsps: &[P::Rsp]) -> Result<usize, RingError> {
        if self.broken {
            return Err(RingError::Broken);
        }
        let n = (self.unanswered() as usize).min(rsps.len());
        match self.record.as_mut() {
            Some(r) => r.staged.extend_from_slice(&rsps[..n]),
            None => {
                let first = self.rsp_prod_pvt.slot(self.size);
                write_run(&self.mem, first, self.size, P::SLOT_SIZE, &rsps[..n]);
            }
        }
        self.rsp_prod_pvt = RingIdx(self.rsp_prod_pvt.0.wrapping_add(n as u32));
        Ok(n)
    }

    /// Publishes the private responses and says whether the front end asked to be
    /// notified (`RING_PUSH_RESPONSES_AND_CHECK_NOTIFY`). A ring that records its
    /// responses records the staged batch first, then writes its slots.
    pub fn push_responses_and_check_notify(&mut self) -> bool {
        if self.broken {
            return false;
        }
        if let Some(r) = self.record.as_mut().filter(|r| !r.staged.is_empty()) {
            let start = self.rsp_prod_pvt.0.wrapping_sub(r.staged.len() as u32);
            r.commit(start);
            let first = RingIdx(start).slot(self.size);
            write_run(&self.mem, first, self.size, P::SLOT_SIZE, &r.staged);
            r.staged.clear();
        }
        let new = self.rsp_prod_pvt.0;
        let old = self.mem.load(self.at.rsp_prod, Ordering::Relaxed);
        // Release: slots before index.
        self.mem.store(self.at.rsp_prod, new, Ordering::Release);
        // Full fence: rsp_prod before reading rsp_event (see the front end's twin).
        self.mem.fence(Ordering::SeqCst);
        let event = self.mem.load(self.at.rsp_event, Ordering::Relaxed);
        new.wrapping_sub(event) < new.wrapping_sub(old)
    }

    /// Whether at least `need` requests are published, re-reading the producer index
    /// even if some are already seen. If fewer, arms `req_event` so that the front end
    /// notifies at its next request, and checks once more (netback's
    /// `xenvif_rx_ring_slots_available`: a packet needing several buffers waits for all
    /// of them). A caller that gets `false` must stop and wait for the event: the same
    /// question asked again without one gets the same answer.
    pub fn final_check_for_at_least(&mut self, need: u32) -> Result<bool, RingError> {
        // Enough already seen (and validated when loaded): no shared read.
        if !self.broken && self.req_prod_seen.since(self.req_cons) >= need {
            return Ok(true);
        }
        if self.load_req_prod()? >= need {
            return Ok(true);
        }
        self.mem.store(
            self.at.req_event,
            self.req_prod_seen.0.wrapping_add(1),
            Ordering::Relaxed,
        );
        // Full fence: req_event before re-reading req_prod, as in the final check below.
        self.mem.fence(Ordering::SeqCst);
        Ok(self.load_req_prod()? >= need)
    }

    /// Whether requests are pending; if none, arms `req_event` and checks again
    /// (`RING_FINAL_CHECK_FOR_REQUESTS`).
    pub fn final_check_for_requests(&mut self) -> Result<bool, RingError> {
        if self.requests_available()? > 0 {
            return Ok(true);
        }
        self.mem.store(
            self.at.req_event,
            self.req_cons.0.wrapping_add(1),
            Ordering::Relaxed,
        );
        // Full fence: req_event before re-reading req_prod.
        self.mem.fence(Ordering::SeqCst);
        Ok(self.requests_available()? > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mem::{FramePage, MachineMemory, Mfn};
    use std::sync::Arc;

    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    #[repr(C)]
    struct Req {
        id: u16,
        pad: u16,
        val: u32,
    }
    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    #[repr(C)]
    struct Rsp {
        id: u16,
        status: i16,
    }
    struct Proto;
    impl RingProtocol for Proto {
        type Req = Req;
        type Rsp = Rsp;
    }

    type Front = FrontRing<Proto, PageRing<FramePage>>;
    type Back = BackRing<Proto, PageRing<FramePage>>;

    fn pair() -> (Front, Back, Arc<MachineMemory>) {
        pair_with(Layout::XEN)
    }

    fn pair_with(layout: Layout) -> (Front, Back, Arc<MachineMemory>) {
        let mem = Arc::new(MachineMemory::new(1).expect("memfd"));
        let page = || {
            let frame = FramePage::new(Arc::clone(&mem), Mfn(0)).expect("frame");
            PageRing::with_layout(frame, layout).expect("ring")
        };
        (
            FrontRing::init(page()).expect("init"),
            BackRing::attach(page()).expect("attach"),
            Arc::clone(&mem),
        )
    }

    #[test]
    fn sizes_follow_ring_h() {
        // netif TX: 12-byte requests, 8-byte responses -> 12-byte slots, 256 of them.
        assert_eq!(ring_size(4096, 12), 256);
        assert_eq!(ring_size(4096, 8), 256);
        assert_eq!(ring_size(4096, 112), 32); // blkif
        assert_eq!(ring_size(64, 8), 0);
    }

    #[test]
    fn the_split_layout_keeps_each_ends_words_on_its_own_line_and_as_many_slots() {
        let l = Layout::SPLIT;
        let line = |at: usize| at / 64;
        assert_eq!(line(l.req_prod), line(l.rsp_event));
        assert_eq!(line(l.rsp_prod), line(l.req_event));
        assert_ne!(line(l.req_prod), line(l.rsp_prod));
        assert!(l.header >= 64 * (line(l.rsp_prod) + 1));
        // Every protocol's slot size: netif TX and RX, blkif, the benchmarks'.
        for slot in [12, 8, 112, 4, 16] {
            assert_eq!(l.ring_size(4096, slot), Layout::XEN.ring_size(4096, slot));
        }
        // The back end's words are where the split puts them, not where ring.h does.
        let (mut f, mut b, m) = pair_with(l);
        f.push_request(&Req {
            id: 7,
            pad: 0,
            val: 1,
        })
        .expect("push");
        f.push_requests_and_check_notify();
        assert_eq!(b.take_request().expect("ok").map(|r| r.id), Some(7));
        b.push_response(&Rsp { id: 7, status: 0 }).expect("rsp");
        b.push_responses_and_check_notify();
        let word = |at| {
            m.atomic_u32(Mfn(0), at)
                .expect("word")
                .load(Ordering::Relaxed)
        };
        assert_eq!((word(l.req_prod), word(l.rsp_prod)), (1, 1));
        assert_eq!(word(RSP_PROD), 0, "nothing writes ring.h's rsp_prod word");
        assert_eq!(f.take_response().expect("ok").map(|r| r.id), Some(7));
        // A hostile back end's producer index, at the split's place: the ring breaks.
        m.atomic_u32(Mfn(0), l.rsp_prod)
            .expect("word")
            .store(1000, Ordering::Release);
        assert!(matches!(
            f.take_response(),
            Err(RingError::ProducerOverrun { prod: 1000, .. })
        ));
        assert_eq!(f.take_response(), Err(RingError::Broken));
    }

    #[test]
    fn requests_and_responses_round_trip_with_notifications() {
        for layout in [Layout::XEN, Layout::SPLIT] {
            round_trip_with_notifications(layout);
        }
    }

    fn round_trip_with_notifications(layout: Layout) {
        let (mut f, mut b, _m) = pair_with(layout);
        assert_eq!(f.size(), 256);
        // Back end idle and armed (req_event = 1): the first push notifies.
        f.push_request(&Req {
            id: 1,
            pad: 0,
            val: 10,
        })
        .expect("push");
        assert!(f.push_requests_and_check_notify());
        // Second push without the back end re-arming: no notification needed.
        f.push_request(&Req {
            id: 2,
            pad: 0,
            val: 20,
        })
        .expect("push");
        assert!(!f.push_requests_and_check_notify());
        assert_eq!(
            b.take_request(),
            Ok(Some(Req {
                id: 1,
                pad: 0,
                val: 10
            }))
        );
        assert_eq!(
            b.take_request(),
            Ok(Some(Req {
                id: 2,
                pad: 0,
                val: 20
            }))
        );
        assert_eq!(b.take_request(), Ok(None));
        assert_eq!(b.final_check_for_requests(), Ok(false));
        b.push_response(&Rsp { id: 1, status: 0 }).expect("rsp");
        b.push_response(&Rsp { id: 2, status: 0 }).expect("rsp");
        assert_eq!(
            b.push_response(&Rsp { id: 3, status: 0 }),
            Err(RingError::Full)
        );
        assert!(b.push_responses_and_check_notify());
        assert_eq!(f.take_response().expect("ok").map(|r| r.id), Some(1));
        assert_eq!(f.take_response().expect("ok").map(|r| r.id), Some(2));
        assert_eq!(f.final_check_for_responses(), Ok(false));
        // Re-armed by the final check: the next request notifies again.
        f.push_request(&Req {
            id: 3,
            pad: 0,
            val: 0,
        })
        .expect("push");
        assert!(f.push_requests_and_check_notify());
    }

    #[test]
    fn front_end_cannot_overfill() {
        let (mut f, _b, _m) = pair();
        for i in 0..256 {
            f.push_request(&Req {
                id: i,
                pad: 0,
                val: 0,
            })
            .expect("room");
        }
        assert_eq!(
            f.push_request(&Req {
                id: 0,
                pad: 0,
                val: 0
            }),
            Err(RingError::Full)
        );
    }

    #[test]
    fn producer_index_more_than_a_ring_ahead_breaks_only_that_ring() {
        let (_f, mut b, mem) = pair();
        // A hostile front end writes req_prod = size + 1 directly.
        mem.atomic_u32(Mfn(0), REQ_PROD)
            .expect("idx")
            .store(257, Ordering::Release);
        assert_eq!(
            b.take_request(),
            Err(RingError::ProducerOverrun {
                prod: 257,
                base: 0,
                size: 256
            })
        );
        assert!(b.is_broken());
        // Even after the peer "fixes" its index, the ring stays broken.
        mem.atomic_u32(Mfn(0), REQ_PROD)
            .expect("idx")
            .store(1, Ordering::Release);
        assert_eq!(b.take_request(), Err(RingError::Broken));
        assert_eq!(
            b.push_response(&Rsp { id: 0, status: 0 }),
            Err(RingError::Broken)
        );
        assert!(!b.push_responses_and_check_notify());
    }

    #[test]
    fn exactly_one_ring_ahead_is_legal_and_wrapping_is_handled() {
        let (mut f, mut b, mem) = pair();
        // Start both ends near the 2^32 wrap to exercise wrapping arithmetic.
        let start = u32::MAX - 3;
        f.req_prod_pvt = RingIdx(start);
        f.rsp_cons = RingIdx(start);
        f.rsp_prod_seen = RingIdx(start);
        b.req_cons = RingIdx(start);
        b.rsp_prod_pvt = RingIdx(start);
        b.req_prod_seen = RingIdx(start);
        mem.atomic_u32(Mfn(0), REQ_PROD)
            .expect("idx")
            .store(start, Ordering::Relaxed);
        mem.atomic_u32(Mfn(0), RSP_PROD)
            .expect("idx")
            .store(start, Ordering::Relaxed);
        for i in 0..256u32 {
            f.push_request(&Req {
                id: i as u16,
                pad: 0,
                val: i,
            })
            .expect("room");
        }
        f.push_requests_and_check_notify();
        for i in 0..256u32 {
            assert_eq!(b.take_request().expect("valid").map(|r| r.val), Some(i));
            b.push_response(&Rsp {
                id: i as u16,
                status: 0,
            })
            .expect("answer");
        }
        b.push_responses_and_check_notify();
        for i in 0..256u32 {
            assert_eq!(
                f.take_response().expect("valid").map(|r| r.id),
                Some(i as u16)
            );
        }
    }

    /// Pushes requests `id` 0.. with `val` from `base` on, and publishes them.
    fn send_requests(f: &mut Front, n: u32, base: u32) {
        for i in 0..n {
            f.push_request(&Req {
                id: i as u16,
                pad: 0,
                val: base + i,
            })
            .expect("room");
        }
        f.push_requests_and_check_notify();
    }

    #[test]
    fn a_back_end_resuming_a_ring_takes_again_exactly_the_requests_not_answered() {
        let (mut f, mut b, mem) = pair();
        send_requests(&mut f, 10, 0);
        // The first back end answers 4 and publishes them, takes 3 more, and dies.
        for i in 0..7u32 {
            let r = b.take_request().expect("valid").expect("one");
            if i < 4 {
                b.push_response(&Rsp {
                    id: r.id,
                    status: 0,
                })
                .expect("answer");
            }
        }
        b.push_responses_and_check_notify();
        drop(b);
        let ring = || {
            let page = FramePage::new(Arc::clone(&mem), Mfn(0)).expect("frame");
            PageRing::new(page).expect("ring")
        };
        let mut b2: Back = BackRing::resume(ring(), None).expect("resume");
        let again: Vec<u32> = std::iter::from_fn(|| b2.take_request().expect("valid"))
            .map(|r| r.val)
            .collect();
        assert_eq!(
            again,
            (4..10).collect::<Vec<_>>(),
            "every unanswered request, once"
        );
        answer_and_publish(&mut b2, again.iter().map(|v| *v as u16));
        assert_eq!(
            response_ids(&mut f),
            (0..10).collect::<Vec<_>>(),
            "each answered once, in order"
        );
        // A producer more than a ring beyond the published responses: refused.
        mem.atomic_u32(Mfn(0), REQ_PROD)
            .expect("idx")
            .store(10 + 300, Ordering::Release);
        assert!(matches!(
            Back::resume(ring(), None),
            Err(RingError::ProducerOverrun { .. })
        ));
    }

    #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    #[repr(C)]
    struct Wide {
        id: u32,
        body: [u32; 27],
    }
    struct WideProto;
    impl RingProtocol for WideProto {
        type Req = Wide;
        type Rsp = Rsp;
    }

    #[test]
    fn a_ring_over_four_pages_carries_entries_cut_by_page_ends_whole() {
        let mem = Arc::new(MachineMemory::new(4).expect("memfd"));
        let pages = || {
            let v = (0..4)
                .map(|i| FramePage::new(Arc::clone(&mem), Mfn(i)).expect("frame"))
                .collect();
            PagesRing::new(v).expect("ring")
        };
        let mut f: FrontRing<WideProto, _> = FrontRing::init(pages()).expect("init");
        let mut b: BackRing<WideProto, _> = BackRing::attach(pages()).expect("attach");
        // ring.h's size for four pages of 112-byte slots.
        assert_eq!(f.size(), 128);
        assert_eq!(b.size(), 128);
        let wide = |i: u32| Wide {
            id: i,
            body: std::array::from_fn(|k| k as u32 * 7 + i),
        };
        for round in 0..3u32 {
            for i in 0..128 {
                f.push_request(&wide(round * 1000 + i)).expect("room");
            }
            f.push_requests_and_check_notify();
            for i in 0..128 {
                let r = b.take_request().expect("valid").expect("one");
                assert_eq!(
                    r,
                    wide(round * 1000 + i),
                    "slot {i} whole across its page end"
                );
                b.push_response(&Rsp {
                    id: i as u16,
                    status: round as i16,
                })
                .expect("answer");
            }
            b.push_responses_and_check_notify();
            for i in 0..128u16 {
                let r = f.take_response().expect("valid").expect("one");
                assert_eq!((r.id, r.status), (i, round as i16));
            }
        }
        let three = (0..3)
            .map(|i| FramePage::new(Arc::clone(&mem), Mfn(i)).expect("frame"))
            .collect();
        assert!(PagesRing::new(three).is_err(), "not a power of two");
        assert!(PagesRing::<FramePage>::new(Vec::new()).is_err());
    }

    fn journal(name: &str) -> (std::path::PathBuf, Journal) {
        let p = std::env::temp_dir().join(format!("pvio-ring-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let j = Journal::open(&p, record_len::<Proto>(PAGE_SIZE)).expect("journal");
        (p, j)
    }

    #[test]
    fn responses_written_and_not_published_are_recovered_from_the_record_not_taken_as_requests() {
        let (mut f, mut b, mem) = pair();
        let (path, j) = journal("unpublished");
        assert!(b.record_in(j), "a journal of record_len bytes is taken");
        send_requests(&mut f, 6, 100);
        // The dead back end took all six and answered two, published; then answered
        // two more, and died after their batch was recorded and their slots written,
        // before publishing them: rsp_prod still at 2.
        take_and_answer(&mut b, 2, 7);
        assert!(b.push_responses_and_check_notify());
        assert_eq!(response_ids(&mut f), [0, 1]);
        take_and_answer(&mut b, 2, 7);
        let staged = b.recorded().expect("a record");
        assert_eq!(staged.end(), 2, "staged, not yet recorded");
        b.push_responses_and_check_notify();
        let rec = b.recorded().expect("a record");
        assert_eq!((rec.start, rec.end()), (2, 4));
        drop(b);
        let rsp_prod = mem.atomic_u32(Mfn(0), RSP_PROD).expect("idx");
        rsp_prod.store(2, Ordering::Release);
        let ring = || {
            let page = FramePage::new(Arc::clone(&mem), Mfn(0)).expect("frame");
            PageRing::new(page).expect("ring")
        };
        // Without the record, a written response would be read back as a request.
        let mut blind: Back = BackRing::resume(ring(), None).expect("resume");
        let first = blind.take_request().expect("valid").expect("one");
        assert_eq!(
            first.pad, 7,
            "slot 2 holds a response now: its status where pad was"
        );
        drop(blind);
        // Killed before even the slots were written: they still hold the requests.
        // The record's responses are written in again either way.
        let slot = |i: u32| HEADER_SIZE + i as usize * Proto::SLOT_SIZE;
        for i in 2..4u32 {
            mem.write(
                Mfn(0),
                slot(i),
                bytemuck::bytes_of(&Req {
                    id: i as u16,
                    pad: 0,
                    val: 100 + i,
                }),
            )
            .expect("slot");
        }
        let j = Journal::open(&path, record_len::<Proto>(PAGE_SIZE)).expect("journal");
        let mut b2: Back = BackRing::resume(ring(), Some(j)).expect("resume");
        let again: Vec<u32> = std::iter::from_fn(|| b2.take_request().expect("valid"))
            .map(|r| r.val)
            .collect();
        assert_eq!(again, [104, 105], "only the requests never answered");
        assert_eq!(b2.replayed(), 2);
        answer_and_publish(&mut b2, again.iter().map(|v| (v - 100) as u16));
        assert_eq!(
            response_ids(&mut f),
            (2..6).collect::<Vec<_>>(),
            "each answered once, in order"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_record_torn_while_written_leaves_the_one_before_and_one_of_another_shape_is_none() {
        let (mut f, mut b, mem) = pair();
        let (path, j) = journal("torn");
        assert!(b.record_in(j));
        send_requests(&mut f, 4, 0);
        let ids: Vec<u16> = (0..2).map(|_| b_take(&mut b)).collect();
        answer_and_publish(&mut b, ids.into_iter());
        let kept = b.recorded().expect("record");
        assert_eq!((kept.start, kept.end()), (0, 2));
        drop(b);
        // A back end killed while writing the next batch's area: the area the commit
        // word does not name is scribbled on, the word never stored.
        {
            let j = Journal::open(&path, record_len::<Proto>(PAGE_SIZE)).expect("journal");
            let seq = j.load(12).expect("seq");
            let other = 64 + ((seq + 1) & 1) as usize * record::area_len(256, 4);
            j.write(other, &[0xee; 64]).expect("scribble");
            let ring = PageRing::new(FramePage::new(Arc::clone(&mem), Mfn(0)).expect("frame"))
                .expect("ring");
            let b2: Back = BackRing::resume(ring, Some(j)).expect("resume");
            assert_eq!(b2.recorded().map(|r| (r.start, r.end())), Some((2, 2)));
        }
        // A journal of another ring's shape is no record.
        let j = Journal::open(&path, record_len::<Proto>(PAGE_SIZE)).expect("journal");
        j.store(8, 16).expect("slots");
        assert_eq!(Recorder::<Rsp>::last(&j, 256), None);
        let _ = std::fs::remove_file(&path);
    }

    /// Takes `n` requests and answers each with `status` (not yet published).
    fn take_and_answer(b: &mut Back, n: usize, status: i16) {
        for _ in 0..n {
            let r = b.take_request().expect("valid").expect("one");
            b.push_response(&Rsp { id: r.id, status }).expect("answer");
        }
    }

    fn b_take(b: &mut Back) -> u16 {
        b.take_request().expect("valid").expect("one").id
    }

    /// Answers each id and publishes the answers.
    fn answer_and_publish(b: &mut Back, ids: impl Iterator<Item = u16>) {
        for id in ids {
            b.push_response(&Rsp { id, status: 0 }).expect("answer");
        }
        b.push_responses_and_check_notify();
    }

    /// Every response published, by id.
    fn response_ids(f: &mut Front) -> Vec<u16> {
        std::iter::from_fn(|| f.take_response().expect("valid"))
            .map(|r| r.id)
            .collect()
    }

    #[test]
    fn a_producer_index_moved_behind_the_consumer_breaks_only_that_ring() {
        let (mut f, mut b, mem) = pair();
        for id in 0..2 {
            f.push_request(&Req { id, pad: 0, val: 0 }).expect("push");
        }
        f.push_requests_and_check_notify();
        assert!(b.take_request().expect("valid").is_some());
        assert!(b.take_request().expect("valid").is_some());
        b.push_response(&Rsp { id: 0, status: 0 }).expect("answer");
        // One request is consumed and unanswered; the peer takes req_prod back to 1.
        mem.atomic_u32(Mfn(0), REQ_PROD)
            .expect("idx")
            .store(1, Ordering::Release);
        assert_eq!(
            b.final_check_for_at_least(1),
            Err(RingError::ProducerBehind { prod: 1, cons: 2 })
        );
        assert_eq!(b.requests_available(), Err(RingError::Broken));
    }

    #[test]
    fn waiting_for_several_requests_arms_the_event_at_the_next_one() {
        let (mut f, mut b, mem) = pair();
        f.push_request(&Req {
            id: 0,
            pad: 0,
            val: 0,
        })
        .expect("push");
        f.push_requests_and_check_notify();
        assert_eq!(b.requests_available(), Ok(1));
        // Three are needed, one is there: wait, and be told at the second.
        assert_eq!(b.final_check_for_at_least(3), Ok(false));
        assert_eq!(
            mem.atomic_u32(Mfn(0), REQ_EVENT)
                .expect("idx")
                .load(Ordering::Relaxed),
            2
        );
        f.push_request(&Req {
            id: 1,
            pad: 0,
            val: 0,
        })
        .expect("push");
        assert!(f.push_requests_and_check_notify(), "the front end notifies");
        // Seen although one request was still unconsumed (no cached index).
        assert_eq!(b.final_check_for_at_least(2), Ok(true));
        assert_eq!(b.final_check_for_at_least(3), Ok(false));
    }

    #[test]
    fn back_end_answering_more_than_asked_breaks_the_front_ring() {
        let (mut f, _b, mem) = pair();
        f.push_request(&Req {
            id: 1,
            pad: 0,
            val: 0,
        })
        .expect("push");
        f.push_requests_and_check_notify();
        mem.atomic_u32(Mfn(0), RSP_PROD)
            .expect("idx")
            .store(2, Ordering::Release);
        assert!(matches!(
            f.take_response(),
            Err(RingError::ProducerOverrun { .. })
        ));
        assert_eq!(f.take_response(), Err(RingError::Broken));
    }

    #[test]
    fn batches_cross_the_ring_end_in_order_within_what_each_side_may_take() {
        let (mut f, mut b, _mem) = pair();
        let size = f.size() as usize;
        let mut next = 0u16;
        let mut got = [Req {
            id: 0,
            pad: 0,
            val: 0,
        }; 64];
        let mut rsps = [Rsp { id: 0, status: 0 }; 300];
        // Five rounds of 100 through 256 slots: the runs wrap at the ring's end.
        for _ in 0..5 {
            let reqs: Vec<Req> = (0..100)
                .map(|i| Req {
                    id: next.wrapping_add(i),
                    pad: 0,
                    val: 0xa5a5_0000 | u32::from(next.wrapping_add(i)),
                })
                .collect();
            assert_eq!(f.push_requests(&reqs), Ok(100));
            f.push_requests_and_check_notify();
            let mut taken = Vec::new();
            loop {
                let n = b.take_requests(&mut got).expect("take");
                if n == 0 {
                    break;
                }
                assert!(n <= got.len());
                taken.extend_from_slice(&got[..n]);
            }
            assert_eq!(taken, reqs, "in order, byte for byte");
            let answers: Vec<Rsp> = taken
                .iter()
                .map(|r| Rsp {
                    id: r.id,
                    status: 1,
                })
                .collect();
            // Only as many responses as requests taken.
            let mut more = answers.clone();
            more.push(Rsp { id: 0, status: 9 });
            assert_eq!(b.push_responses(&more), Ok(100));
            b.push_responses_and_check_notify();
            let n = f.take_responses(&mut rsps).expect("responses");
            assert_eq!(&rsps[..n], &answers[..]);
            next = next.wrapping_add(100);
        }
        // The front end may fill only the free slots.
        let many = vec![
            Req {
                id: 1,
                pad: 0,
                val: 0
            };
            size + 10
        ];
        assert_eq!(f.push_requests(&many), Ok(size));
        assert_eq!(f.push_requests(&many), Ok(0));
    }

    #[test]
    fn a_batch_take_judges_the_producer_index_and_copies_nothing_past_a_bad_one() {
        let (mut f, mut b, mem) = pair();
        f.push_requests(
            &[Req {
                id: 7,
                pad: 0,
                val: 1,
            }; 3],
        )
        .expect("push");
        f.push_requests_and_check_notify();
        let mut got = [Req {
            id: 0,
            pad: 0,
            val: 0,
        }; 8];
        assert_eq!(b.take_requests(&mut got[..2]), Ok(2));
        // The front end claims a ring and more: the back end's next look breaks the ring
        // (its last request, seen before, is still taken first).
        mem.atomic_u32(Mfn(0), REQ_PROD)
            .expect("idx")
            .store(3 + 300, Ordering::Release);
        assert_eq!(b.take_requests(&mut got), Ok(1));
        got = [Req {
            id: 0,
            pad: 0,
            val: 0,
        }; 8];
        assert!(matches!(
            b.take_requests(&mut got),
            Err(RingError::ProducerOverrun { .. })
        ));
        assert!(got.iter().all(|r| r.id == 0), "nothing copied");
        assert_eq!(b.take_requests(&mut got), Err(RingError::Broken));
        assert_eq!(
            b.push_responses(&[Rsp { id: 7, status: 0 }]),
            Err(RingError::Broken)
        );
    }

    #[test]
    fn a_look_ahead_copies_published_entries_without_taking_them_and_judges_the_index() {
        let (mut f, mut b, mem) = pair();
        for id in 0..3 {
            f.push_request(&Req { id, pad: 0, val: 0 }).expect("push");
        }
        // Unpublished: nothing to see.
        assert_eq!(b.peek_request(0), None);
        f.push_requests_and_check_notify();
        // The back end sees what it last read of the index: nothing until it reads it.
        assert_eq!(b.peek_request(0), None);
        assert_eq!(b.requests_available(), Ok(3));
        let id = |r: Option<Req>| r.map(|r| r.id);
        assert_eq!(
            (id(b.peek_request(0)), id(b.peek_request(2))),
            (Some(0), Some(2))
        );
        assert_eq!(b.peek_request(3), None);
        assert_eq!(b.take_request().expect("ok").map(|r| r.id), Some(0));
        assert_eq!(id(b.peek_request(1)), Some(2), "relative to the next one");
        assert_eq!(id(b.take_request().expect("ok")), Some(1));
        for id in [0, 1] {
            b.push_response(&Rsp { id, status: 0 }).expect("rsp");
        }
        b.push_responses_and_check_notify();
        let rid = |r: Result<Option<Rsp>, RingError>| r.expect("ok").map(|r| r.id);
        assert_eq!(rid(f.peek_response(1)), Some(1));
        assert_eq!(rid(f.peek_response(2)), None);
        assert_eq!(rid(f.take_response()), Some(0), "peeking took nothing");
        assert_eq!(rid(f.peek_response(0)), Some(1));
        // A look ahead reads the peer's index as a take would, and judges it the same.
        mem.atomic_u32(Mfn(0), RSP_PROD)
            .expect("idx")
            .store(9, Ordering::Release);
        assert_eq!(rid(f.take_response()), Some(1));
        assert!(matches!(
            f.peek_response(0),
            Err(RingError::ProducerOverrun { .. })
        ));
        assert_eq!(f.take_response(), Err(RingError::Broken));
    }

    #[test]
    fn a_read_only_page_cannot_host_a_ring() {
        let mem = Arc::new(MachineMemory::new(1).expect("memfd"));
        let w = Arc::new(mem::MapWindow::new(Arc::clone(&mem), 1).expect("window"));
        w.map(0, Mfn(0), false).expect("map");
        let page = w.page(0).expect("page");
        assert_eq!(PageRing::new(page).err(), Some(MemError::ReadOnly(0)));
    }
}
