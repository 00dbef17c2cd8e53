//! Packet buffers, shaped like Linux socket buffers.
//!
//! An [`Skb`] has a linear head (a 2 KiB buffer in one of its domain's pages, with
//! headroom), up to [`MAX_SKB_FRAGS`] page fragments, and a fragment list of further
//! buffers (what IPv4 reassembly links together). The bytes live in domain memory; the
//! descriptors live in the domain kernel's [`SkbPool`], which allocates all of them, the
//! head buffers and a pool of whole pages for fragments once, at creation. Allocating
//! and freeing on the data path is popping and pushing a free list: no heap allocation
//! per packet.
//!
//! A fragment is either one of the domain's own pages, which goes back to the page pool
//! when the buffer is freed, or a foreign page mapped through a grant (netback's TX
//! path), which is put on a release queue for its owner to unmap and answer — Linux's
//! zero-copy completion callback.

use std::sync::Arc;

use hv::{DomId, Domain, DomainError, Gfn, GrantRef, PAGE_SIZE};

/// Bytes of one head buffer (two per page).
pub const SKB_HEAD_SIZE: usize = 2048;
/// Headroom reserved in front of a received frame (Linux's `NET_SKB_PAD`).
pub const NET_SKB_PAD: usize = 64;
/// Extra offset so that the IP header after a 14-byte Ethernet header is 16-byte
/// aligned (`NET_IP_ALIGN`): received frames are deliberately misaligned.
pub const NET_IP_ALIGN: usize = 2;
/// Page fragments per buffer (`MAX_SKB_FRAGS` with 4 KiB pages).
pub const MAX_SKB_FRAGS: usize = 17;

/// Index of a buffer in its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SkbId(u32);

/// No buffer (end of a list).
const NONE: u32 = u32::MAX;

/// Where a fragment's page is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragPage {
    /// One of the domain's own pages, from its page pool.
    Local(Gfn),
    /// A foreign page mapped at a slot of the domain's window; `token` tells its owner
    /// which grant to release.
    Foreign {
        /// Window slot.
        slot: u32,
        /// The owner's cookie (netback's pending index).
        token: u32,
        /// The grant it is mapped through: the granting domain and its reference, which
        /// a grant copy names to read the page again (guest-to-guest forwarding).
        grant: (DomId, GrantRef),
    },
}

/// One page fragment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frag {
    /// The page.
    pub page: FragPage,
    /// Offset of the bytes in it.
    pub offset: u16,
    /// Bytes.
    pub len: u16,
}

const EMPTY_FRAG: Frag = Frag {
    page: FragPage::Local(Gfn(0)),
    offset: 0,
    len: 0,
};

/// A packet buffer's descriptor (`struct sk_buff`).
#[derive(Debug, Clone)]
pub struct Skb {
    head: Gfn,
    head_off: u16,
    /// The descriptor's own head buffer, while `head` is a whole page borrowed from the
    /// pool ([`SkbPool::alloc_page_linear`]).
    home: Option<(Gfn, u16)>,
    /// Offset of the first data byte in the head buffer.
    data: u16,
    /// Bytes in the head buffer.
    linear: u16,
    frags: [Frag; MAX_SKB_FRAGS],
    nr_frags: u8,
    frag_list: u32,
    next: u32,
    /// Bytes in all: linear, fragments and fragment list.
    len: u32,
    offload: crate::offload::Offload,
    in_port: u16,
    free: bool,
}

impl Skb {
    /// Bytes of the head buffer: a whole page when borrowed, else [`SKB_HEAD_SIZE`].
    #[inline]
    fn head_size(&self) -> usize {
        if self.home.is_some() {
            PAGE_SIZE
        } else {
            SKB_HEAD_SIZE
        }
    }
}

/// Why a buffer operation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SkbError {
    /// The pool (descriptors, heads or pages) is empty.
    #[error("out of packet buffers")]
    Exhausted,
    /// Not enough room in the head buffer, or too many fragments.
    #[error("no room in the buffer")]
    NoRoom,
    /// A read past the buffer's bytes.
    #[error("out of bounds")]
    OutOfBounds,
    /// The domain refused a memory access.
    #[error("domain memory: {0}")]
    Domain(#[from] DomainError),
}

/// A foreign fragment freed with its buffer, waiting for its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Window slot.
    pub slot: u32,
    /// The owner's cookie.
    pub token: u32,
}

/// Counters of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers allocated.
    pub allocs: u64,
    /// Allocations refused (pool empty).
    pub alloc_failures: u64,
    /// Pages handed out.
    pub page_allocs: u64,
    /// Page allocations refused.
    pub page_failures: u64,
    /// Frees of a buffer that was already free, refused (a bug in the caller: the
    /// buffer would otherwise be handed out twice, a packet's bytes to two owners).
    pub double_frees: u64,
}
hv::counter_set!(PoolStats {
    allocs,
    alloc_failures,
    page_allocs,
    page_failures,
    double_frees
});

/// A domain kernel's packet buffers and fragment pages, allocated once.
#[derive(Debug)]
pub struct SkbPool {
    dom: Arc<Domain>,
    skbs: Box<[Skb]>,
    free: Vec<u32>,
    pages: Vec<Gfn>,
    page_count: usize,
    head_pages: Vec<Gfn>,
    released: Vec<Released>,
    deferred: Vec<Deferred>,
    stats: PoolStats,
}

/// What a grant still mapped by a peer keeps out of use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// A fragment page of the pool.
    Page(Gfn),
    /// A buffer (with whatever pages it holds).
    Skb(SkbId),
}

/// Grants a front end revoked while a peer still mapped them, and what they keep out
/// of use until every one of them is released.
#[derive(Debug)]
struct Deferred {
    refs: Vec<GrantRef>,
    held: Vec<Held>,
}

impl SkbPool {
    /// A pool of `buffers` buffers (with their heads) and `pages` fragment pages, taken
    /// from `dom`'s allocator now.
    pub fn new(dom: Arc<Domain>, buffers: usize, pages: usize) -> Result<Self, SkbError> {
        let per_page = PAGE_SIZE / SKB_HEAD_SIZE;
        let mut head_pages = Vec::with_capacity(buffers.div_ceil(per_page));
        let mut skbs = Vec::with_capacity(buffers);
        for i in 0..buffers {
            if i % per_page == 0 {
                head_pages.push(dom.alloc_page().map_err(|_| SkbError::Exhausted)?);
            }
            let head = *head_pages.last().ok_or(SkbError::Exhausted)?;
            skbs.push(Skb {
                head,
                head_off: ((i % per_page) * SKB_HEAD_SIZE) as u16,
                home: None,
                data: 0,
                linear: 0,
                frags: [EMPTY_FRAG; MAX_SKB_FRAGS],
                nr_frags: 0,
                frag_list: NONE,
                next: NONE,
                len: 0,
                offload: crate::offload::Offload::NONE,
                in_port: 0,
                free: true,
            });
        }
        let mut page_list = Vec::with_capacity(pages);
        for _ in 0..pages {
            page_list.push(dom.alloc_page().map_err(|_| SkbError::Exhausted)?);
        }
        Ok(Self {
            dom,
            free: (0..buffers as u32).rev().collect(),
            skbs: skbs.into_boxed_slice(),
            page_count: pages,
            pages: page_list,
            head_pages,
            released: Vec::with_capacity(buffers * MAX_SKB_FRAGS),
            deferred: Vec::new(),
            stats: PoolStats::default(),
        })
    }

    /// Keeps `held` out of use until each of `refs` (the domain's grants, revoked
    /// while a peer mapped them) can be ended; then frees the references and `held`
    /// ([`Self::retry_deferred`]). A front end removed while its back end still maps its
    /// buffers leaves them here, as Linux's `gnttab_end_foreign_access` defers the
    /// page of a grant still in use.
    pub fn defer_release(&mut self, refs: Vec<GrantRef>, held: Vec<Held>) {
        self.deferred.push(Deferred { refs, held });
        self.retry_deferred();
    }

    /// Tries the deferred grants again; frees each group whose grants all ended.
    /// Returns how many groups still wait. Cheap when none does.
    pub fn retry_deferred(&mut self) -> usize {
        if self.deferred.is_empty() {
            return 0;
        }
        let dom = Arc::clone(&self.dom);
        let gt = dom.grant_table();
        let mut done = Vec::new();
        self.deferred.retain_mut(|d| {
            d.refs.retain(|&r| {
                let ended = gt.end_access(r).is_ok();
                if ended {
                    gt.free_ref(r);
                }
                !ended
            });
            if d.refs.is_empty() {
                done.append(&mut d.held);
            }
            !d.refs.is_empty()
        });
        for h in done {
            match h {
                Held::Page(g) => self.free_page(g),
                Held::Skb(s) => self.free(s),
            }
        }
        self.deferred.len()
    }

    /// The domain whose memory holds the bytes.
    pub fn domain(&self) -> &Arc<Domain> {
        &self.dom
    }
    /// Every page the pool owns (heads and fragment pages), e.g. to map them for DMA.
    pub fn all_pages(&self) -> impl Iterator<Item = Gfn> + '_ {
        self.head_pages
            .iter()
            .copied()
            .chain(self.pages.iter().copied())
    }
    /// Counters.
    pub fn stats(&self) -> PoolStats {
        self.stats
    }
    /// Buffers free.
    pub fn free_buffers(&self) -> usize {
        self.free.len()
    }
    /// Fragment pages free.
    pub fn free_pages(&self) -> usize {
        self.pages.len()
    }
    /// Buffers in the pool.
    pub fn capacity(&self) -> usize {
        self.skbs.len()
    }
    /// Fragment pages in the pool.
    pub fn page_capacity(&self) -> usize {
        self.page_count
    }

    /// A fresh buffer with `headroom` bytes reserved in front of its data.
    #[inline]
    pub fn alloc(&mut self, headroom: usize) -> Result<SkbId, SkbError> {
        let Some(i) = self.free.pop() else {
            self.stats.alloc_failures += 1;
            return Err(SkbError::Exhausted);
        };
        self.stats.allocs += 1;
        let s = &mut self.skbs[i as usize];
        s.data = headroom.min(SKB_HEAD_SIZE) as u16;
        s.linear = 0;
        s.nr_frags = 0;
        s.frag_list = NONE;
        s.next = NONE;
        s.len = 0;
        s.offload = crate::offload::Offload::NONE;
        s.in_port = 0;
        s.free = false;
        Ok(SkbId(i))
    }

    /// A fresh buffer whose head is a whole page of its own, at the start of which its
    /// data begins (a linear buffer a device or a back end can fill up to a page, as
    /// the paper's modified netfront posted, §3.4.2). Freeing it gives the page back.
    pub fn alloc_page_linear(&mut self) -> Result<SkbId, SkbError> {
        let page = self.alloc_page()?;
        let id = match self.alloc(0) {
            Ok(id) => id,
            Err(e) => {
                self.free_page(page);
                return Err(e);
            }
        };
        self.borrow_head_page(id.0, page);
        Ok(id)
    }

    /// Makes a pool page the head of buffer `idx`, keeping its own head buffer to
    /// return to when it is freed.
    #[inline]
    fn borrow_head_page(&mut self, idx: u32, page: Gfn) {
        let s = &mut self.skbs[idx as usize];
        s.home = Some((s.head, s.head_off));
        s.head = page;
        s.head_off = 0;
    }

    /// Gives the linear data of the buffer, and of each buffer on its fragment list, a
    /// whole page of its own: data in a 2 KiB head that shares its page with another
    /// buffer is copied to the same offset of a fresh pool page, which becomes the head
    /// (returned to the pool when the buffer is freed). A grant covers a whole page, so
    /// this is what a front end does before granting a packet to a back end it does not
    /// trust with its other buffers (Linux netfront's bounce, XSA-403). Heads that are
    /// already whole pages, and empty ones, are left as they are. Returns the bytes
    /// copied; on `Exhausted` the buffers already moved stay valid.
    pub fn own_head_pages(&mut self, id: SkbId) -> Result<usize, SkbError> {
        let mut copied = 0;
        let mut cur = id.0;
        while cur != NONE {
            let s = &self.skbs[cur as usize];
            let next = s.frag_list;
            if s.home.is_none() && s.linear > 0 {
                let (head, head_off, data, linear) = (s.head, s.head_off, s.data, s.linear);
                let page = self.alloc_page()?;
                let at = data as usize;
                // Cannot cross the page: data + linear <= SKB_HEAD_SIZE < PAGE_SIZE.
                if let Err(e) =
                    self.dom
                        .copy(head, head_off as usize + at, page, at, linear as usize)
                {
                    self.free_page(page);
                    return Err(e.into());
                }
                self.borrow_head_page(cur, page);
                copied += linear as usize;
            }
            cur = next;
        }
        Ok(copied)
    }

    /// Takes the whole page that is buffer `id`'s head (given by
    /// [`SkbPool::alloc_page_linear`]) out of it and frees the buffer: the page is the
    /// caller's, to become a fragment of another buffer (page-mode LRO moves a
    /// segment's payload so). `None`, the buffer untouched, if its head is not such a
    /// page or it has fragments or a fragment list.
    pub fn detach_head_page(&mut self, id: SkbId) -> Option<Gfn> {
        let s = &mut self.skbs[id.0 as usize];
        if s.nr_frags != 0 || s.frag_list != NONE {
            return None;
        }
        let (g, off) = s.home.take()?;
        let page = std::mem::replace(&mut s.head, g);
        s.head_off = off;
        self.free(id);
        Some(page)
    }

    /// A whole page for a fragment (or an RX buffer to post).
    #[inline]
    pub fn alloc_page(&mut self) -> Result<Gfn, SkbError> {
        match self.pages.pop() {
            Some(g) => {
                self.stats.page_allocs += 1;
                Ok(g)
            }
            None => {
                self.stats.page_failures += 1;
                Err(SkbError::Exhausted)
            }
        }
    }

    /// Gives a page back to the pool.
    #[inline]
    pub fn free_page(&mut self, gfn: Gfn) {
        debug_assert!(self.pages.len() < self.page_count);
        self.pages.push(gfn);
    }

    #[inline]
    fn get(&self, id: SkbId) -> &Skb {
        &self.skbs[id.0 as usize]
    }
    #[inline]
    fn get_mut(&mut self, id: SkbId) -> &mut Skb {
        &mut self.skbs[id.0 as usize]
    }

    /// Frees a buffer, its fragments and its fragment list. Local pages go back to the
    /// pool; foreign ones to the release queue.
    ///
    /// A buffer that is already free is refused in every build: counted in
    /// [`PoolStats::double_frees`] and reported on standard error the first time, and
    /// nothing of the pool changes (putting it on the free list twice would lend one
    /// buffer to two packets).
    pub fn free(&mut self, id: SkbId) {
        let mut cur = id.0;
        while cur != NONE {
            let s = &mut self.skbs[cur as usize];
            if s.free {
                if self.stats.double_frees == 0 {
                    eprintln!(
                        "pvio: packet buffer {cur} freed twice; refused (a bug: please report it)"
                    );
                }
                self.stats.double_frees += 1;
                return;
            }
            s.free = true;
            let (nf, fl) = (s.nr_frags as usize, s.frag_list);
            s.nr_frags = 0;
            s.frag_list = NONE;
            let borrowed = s.home.take().map(|(g, off)| {
                s.head_off = off;
                std::mem::replace(&mut s.head, g)
            });
            if let Some(page) = borrowed {
                self.pages.push(page);
            }
            for k in 0..nf {
                self.release_page(self.skbs[cur as usize].frags[k].page)
            }
            self.free.push(cur);
            cur = fl;
        }
    }

    /// A fragment's page leaves its buffer: own pages back to the pool, foreign ones to
    /// their owner's release queue.
    #[inline]
    fn release_page(&mut self, page: FragPage) {
        match page {
            FragPage::Local(g) => self.pages.push(g),
            FragPage::Foreign { slot, token, .. } => self.released.push(Released { slot, token }),
        }
    }

    /// Takes the foreign fragments released since the last call.
    pub fn take_released(&mut self, mut f: impl FnMut(Released)) {
        for r in self.released.drain(..) {
            f(r);
        }
    }

    // --- the bytes ---------------------------------------------------------------

    /// Bytes in all.
    #[inline]
    pub fn len(&self, id: SkbId) -> usize {
        self.get(id).len as usize
    }
    /// Whether the checksums were verified before the stack (by a device or back end).
    #[inline]
    pub fn csum_valid(&self, id: SkbId) -> bool {
        self.get(id).offload.csum == crate::offload::Csum::Valid
    }
    /// Marks the checksums verified (or not).
    #[inline]
    pub fn set_csum_valid(&mut self, id: SkbId, v: bool) {
        self.get_mut(id).offload.csum = if v {
            crate::offload::Csum::Valid
        } else {
            crate::offload::Csum::None
        };
    }
    /// What rides beside the buffer's bytes: checksum state and GSO.
    #[inline]
    pub fn offload(&self, id: SkbId) -> crate::offload::Offload {
        self.get(id).offload
    }
    /// Sets the checksum state and GSO.
    #[inline]
    pub fn set_offload(&mut self, id: SkbId, o: crate::offload::Offload) {
        self.get_mut(id).offload = o;
    }
    /// The bridge port the buffer came in on.
    #[inline]
    pub fn in_port(&self, id: SkbId) -> u16 {
        self.get(id).in_port
    }
    /// Records the bridge port the buffer came in on.
    #[inline]
    pub fn set_in_port(&mut self, id: SkbId, port: u16) {
        self.get_mut(id).in_port = port;
    }
    /// Bytes in the head buffer.
    #[inline]
    pub fn linear_len(&self, id: SkbId) -> usize {
        self.get(id).linear as usize
    }
    /// Where the data starts: the head's page and the byte offset in it.
    #[inline]
    pub fn data_location(&self, id: SkbId) -> (Gfn, usize) {
        let s = self.get(id);
        (s.head, s.head_off as usize + s.data as usize)
    }
    /// The offset in its page of the packet's first byte: in the head if it has linear
    /// data, else in the first fragment (0 for a packet with neither, whose bytes, if
    /// any, are on its fragment list).
    pub fn first_offset(&self, id: SkbId) -> usize {
        let s = self.get(id);
        if s.linear > 0 {
            return (s.head_off as usize + s.data as usize) % PAGE_SIZE;
        }
        self.frags(id).first().map_or(0, |f| f.offset as usize)
    }
    /// Room left at the end of the head buffer.
    #[inline]
    pub fn tailroom(&self, id: SkbId) -> usize {
        let s = self.get(id);
        s.head_size() - s.data as usize - s.linear as usize
    }
    /// The fragments.
    #[inline]
    pub fn frags(&self, id: SkbId) -> &[Frag] {
        let s = self.get(id);
        &s.frags[..s.nr_frags as usize]
    }
    /// The first buffer of the fragment list.
    #[inline]
    pub fn frag_list(&self, id: SkbId) -> Option<SkbId> {
        let f = self.get(id).frag_list;
        (f != NONE).then_some(SkbId(f))
    }

    /// Appends `data` to the head buffer (`skb_put` and a copy).
    pub fn put(&mut self, id: SkbId, data: &[u8]) -> Result<(), SkbError> {
        if data.len() > self.tailroom(id) {
            return Err(SkbError::NoRoom);
        }
        let (g, off) = self.data_location(id);
        let at = off + self.get(id).linear as usize;
        self.dom.write(g, at, data)?;
        self.extend_linear(id, data.len())
    }

    /// Appends `data`: the head buffer's tailroom first, then whole pages from the pool
    /// as fragments (a packet of up to 64 KiB from a TAP or a software segmenter). On
    /// `Exhausted` or `NoRoom` the buffer keeps what was appended, for the caller to
    /// free.
    pub fn append(&mut self, id: SkbId, data: &[u8]) -> Result<(), SkbError> {
        let lin = data.len().min(self.tailroom(id));
        if self.get(id).nr_frags == 0 {
            self.put(id, &data[..lin])?;
        }
        let rest = if self.get(id).nr_frags == 0 {
            &data[lin..]
        } else {
            data
        };
        for chunk in rest.chunks(PAGE_SIZE) {
            if self.get(id).nr_frags as usize == MAX_SKB_FRAGS {
                return Err(SkbError::NoRoom);
            }
            let g = self.alloc_page()?;
            if let Err(e) = self.dom.write(g, 0, chunk) {
                self.free_page(g);
                return Err(e.into());
            }
            self.add_frag(
                id,
                Frag {
                    page: FragPage::Local(g),
                    offset: 0,
                    len: chunk.len() as u16,
                },
            )?;
        }
        Ok(())
    }

    /// Overwrites bytes `[offset, offset + data.len())` of the head buffer's data (a
    /// header fix-up); refused past the linear area.
    pub fn write_linear(&mut self, id: SkbId, offset: usize, data: &[u8]) -> Result<(), SkbError> {
        if offset + data.len() > self.linear_len(id) {
            return Err(SkbError::OutOfBounds);
        }
        let (g, off) = self.data_location(id);
        self.dom.write(g, off + offset, data)?;
        Ok(())
    }

    /// Counts `n` more bytes in the head buffer, already written there (by a device's
    /// DMA or a copy into [`Self::data_location`]).
    #[inline]
    pub fn extend_linear(&mut self, id: SkbId, n: usize) -> Result<(), SkbError> {
        if n > self.tailroom(id) {
            return Err(SkbError::NoRoom);
        }
        let s = self.get_mut(id);
        s.linear += n as u16;
        s.len += n as u32;
        Ok(())
    }

    /// Moves the start of an empty buffer's data `n` bytes on (`skb_reserve`), e.g. to
    /// where a back end wrote it.
    #[inline]
    pub fn reserve(&mut self, id: SkbId, n: usize) -> Result<(), SkbError> {
        let s = self.get_mut(id);
        if s.linear != 0 || s.data as usize + n > s.head_size() {
            return Err(SkbError::NoRoom);
        }
        s.data += n as u16;
        Ok(())
    }

    /// Drops `n` bytes from the front of the linear data (`skb_pull`).
    #[inline]
    pub fn pull(&mut self, id: SkbId, n: usize) -> Result<(), SkbError> {
        let s = self.get_mut(id);
        if n > s.linear as usize {
            return Err(SkbError::OutOfBounds);
        }
        s.data += n as u16;
        s.linear -= n as u16;
        s.len -= n as u32;
        Ok(())
    }

    /// Gives back `n` bytes in front of the data (`skb_push`), undoing a pull.
    #[inline]
    pub fn push_front(&mut self, id: SkbId, n: usize) -> Result<(), SkbError> {
        let s = self.get_mut(id);
        if n > s.data as usize {
            return Err(SkbError::NoRoom);
        }
        s.data -= n as u16;
        s.linear += n as u16;
        s.len += n as u32;
        Ok(())
    }

    /// Cuts the buffer down to `len` bytes (dropping link padding, say). Only the
    /// linear part and the fragments are trimmed; a buffer with a fragment list is
    /// never trimmed.
    pub fn trim(&mut self, id: SkbId, len: usize) -> Result<(), SkbError> {
        let s = self.get_mut(id);
        if len >= s.len as usize {
            return Ok(());
        }
        if s.frag_list != NONE {
            return Err(SkbError::OutOfBounds);
        }
        if len <= s.linear as usize {
            s.linear = len as u16;
            let nf = s.nr_frags as usize;
            s.nr_frags = 0;
            s.len = len as u32;
            for k in 0..nf {
                self.release_page(self.skbs[id.0 as usize].frags[k].page)
            }
            return Ok(());
        }
        let mut left = len - s.linear as usize;
        for k in 0..s.nr_frags as usize {
            let f = &mut s.frags[k];
            if left <= f.len as usize {
                f.len = left as u16;
                // Later fragments go.
                let nf = s.nr_frags as usize;
                s.nr_frags = (k + 1) as u8;
                s.len = len as u32;
                for j in k + 1..nf {
                    self.release_page(self.skbs[id.0 as usize].frags[j].page)
                }
                return Ok(());
            }
            left -= f.len as usize;
        }
        Ok(())
    }

    /// Appends a page fragment; the buffer now owns the page.
    #[inline]
    pub fn add_frag(&mut self, id: SkbId, frag: Frag) -> Result<(), SkbError> {
        let s = self.get_mut(id);
        if s.nr_frags as usize == MAX_SKB_FRAGS
            || frag.offset as usize + frag.len as usize > PAGE_SIZE
        {
            return Err(SkbError::NoRoom);
        }
        s.frags[s.nr_frags as usize] = frag;
        s.nr_frags += 1;
        s.len += frag.len as u32;
        Ok(())
    }

    /// Links `tail` at the end of `id`'s fragment list; `id` now owns it.
    pub fn append_frag_list(&mut self, id: SkbId, tail: SkbId) {
        let add = self.get(tail).len;
        let mut cur = id.0;
        loop {
            let s = &self.skbs[cur as usize];
            if s.frag_list == NONE {
                break;
            }
            cur = s.frag_list;
        }
        // The fragment list is walked as a chain: each member's `frag_list` is the next.
        self.skbs[cur as usize].frag_list = tail.0;
        self.get_mut(id).len += add;
        // The members' own lengths stay theirs: reading walks them.
    }

    /// Copies `out.len()` bytes starting at byte `offset` of the buffer (across the
    /// head, the fragments and the fragment list) into `out` (for headers).
    pub fn read(&self, id: SkbId, offset: usize, out: &mut [u8]) -> Result<(), SkbError> {
        let mut done = 0;
        self.walk(id, offset, out.len(), |seg, at| {
            let n = seg.len;
            let r = match seg.page {
                SegPage::Own(g) => self.dom.read(g, seg.offset, &mut out[at..at + n]),
                SegPage::Window { slot, .. } => self
                    .dom
                    .window()
                    .read(slot, seg.offset, &mut out[at..at + n])
                    .map_err(DomainError::from),
            };
            done += n;
            r.map_err(SkbError::from)
        })?;
        if done == out.len() {
            Ok(())
        } else {
            Err(SkbError::OutOfBounds)
        }
    }

    /// Visits the bytes `[offset, offset + len)` of the buffer as segments, each in one
    /// page: `f(segment, position in the range)`. Used to copy data out (the
    /// `usercopy` of a receive) or into grant-copy operations.
    pub fn walk(
        &self,
        id: SkbId,
        offset: usize,
        len: usize,
        mut f: impl FnMut(Segment, usize) -> Result<(), SkbError>,
    ) -> Result<(), SkbError> {
        let mut skip = offset;
        let mut left = len;
        let mut at = 0;
        let mut cur = id.0;
        let mut emit = |page: SegPage, off: usize, n: usize, skip: &mut usize, left: &mut usize| {
            if *left == 0 {
                return Ok(());
            }
            if *skip >= n {
                *skip -= n;
                return Ok(());
            }
            let take = (n - *skip).min(*left);
            let seg = Segment {
                page,
                offset: off + *skip,
                len: take,
            };
            *skip = 0;
            *left -= take;
            let r = f(seg, at);
            at += take;
            r
        };
        while cur != NONE && left > 0 {
            let s = &self.skbs[cur as usize];
            // A fragment-list member's own bytes: its linear part and fragments.
            let lin = s.linear as usize;
            emit(
                SegPage::Own(s.head),
                s.head_off as usize + s.data as usize,
                lin,
                &mut skip,
                &mut left,
            )?;
            for fr in &s.frags[..s.nr_frags as usize] {
                let page = match fr.page {
                    FragPage::Local(g) => SegPage::Own(g),
                    FragPage::Foreign { slot, grant, .. } => SegPage::Window { slot, grant },
                };
                emit(
                    page,
                    fr.offset as usize,
                    fr.len as usize,
                    &mut skip,
                    &mut left,
                )?;
            }
            cur = s.frag_list;
        }
        if left == 0 {
            Ok(())
        } else {
            Err(SkbError::OutOfBounds)
        }
    }

    // --- queues ------------------------------------------------------------------

    #[inline]
    fn set_next(&mut self, id: SkbId, next: Option<SkbId>) {
        self.get_mut(id).next = next.map_or(NONE, |n| n.0);
    }
    #[inline]
    fn next_of(&self, id: SkbId) -> Option<SkbId> {
        let n = self.get(id).next;
        (n != NONE).then_some(SkbId(n))
    }
}

/// A run of bytes in one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The page.
    pub page: SegPage,
    /// Offset in it.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// A segment's page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegPage {
    /// One of the domain's own pages.
    Own(Gfn),
    /// A foreign page at a window slot, mapped through `grant`.
    Window {
        /// Window slot.
        slot: u32,
        /// The granting domain and its reference.
        grant: (DomId, GrantRef),
    },
}

/// A FIFO of buffers linked through their descriptors (`sk_buff_head`), bounded by a
/// byte budget: what does not fit is refused, for the caller to drop and count.
#[derive(Debug, Clone)]
pub struct SkbQueue {
    head: Option<SkbId>,
    tail: Option<SkbId>,
    len: usize,
    bytes: usize,
    limit: usize,
    /// Packets taken beyond the byte limit, and how many may be.
    over: usize,
    backlog: usize,
}

impl SkbQueue {
    /// An empty queue holding at most `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self::with_backlog(limit, 0)
    }

    /// An empty queue that takes packets while it holds less than `limit` bytes, and
    /// then `backlog` more: Linux's netback queue, which stops its device at the byte
    /// limit, and the device's queueing discipline in front of it (`tx_queue_len`
    /// packets), which holds what comes meanwhile. A packet taken off lets one more in.
    pub fn with_backlog(limit: usize, backlog: usize) -> Self {
        Self {
            head: None,
            tail: None,
            len: 0,
            bytes: 0,
            limit,
            over: 0,
            backlog,
        }
    }
    /// Buffers queued.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes queued.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Appends `id` if it fits; otherwise gives it back.
    pub fn push(&mut self, pool: &mut SkbPool, id: SkbId) -> Result<(), SkbId> {
        let n = pool.len(id);
        if self.bytes + n > self.limit && self.len > 0 {
            if self.over >= self.backlog {
                return Err(id);
            }
            self.over += 1;
        }
        pool.set_next(id, None);
        match self.tail {
            Some(t) => pool.set_next(t, Some(id)),
            None => self.head = Some(id),
        }
        self.tail = Some(id);
        self.len += 1;
        self.bytes += n;
        Ok(())
    }
    /// The first buffer, without taking it.
    pub fn peek(&self) -> Option<SkbId> {
        self.head
    }
    /// Takes the first buffer.
    pub fn pop(&mut self, pool: &SkbPool) -> Option<SkbId> {
        let h = self.head?;
        self.head = pool.next_of(h);
        if self.head.is_none() {
            self.tail = None;
        }
        self.len -= 1;
        self.bytes -= pool.len(h);
        self.over = self.over.saturating_sub(1);
        Some(h)
    }
    /// Frees everything queued.
    pub fn purge(&mut self, pool: &mut SkbPool) {
        while let Some(id) = self.pop(pool) {
            pool.free(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hv::{DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};

    fn pool(buffers: usize, pages: usize) -> (Arc<Hypervisor>, SkbPool) {
        let hv = Hypervisor::new(HvConfig {
            frames: 2048,
            grant_path: GrantPath::Optimised,
            ..HvConfig::default()
        })
        .expect("hv");
        let d = hv
            .create_domain(&DomainConfig {
                name: "g".into(),
                pages: 512,
                grant_frames: 1,
                grant_version: GrantVersion::V2,
                vcpus: 1,
                map_slots: 4,
                driver_domain: false,
            })
            .expect("dom");
        (hv, SkbPool::new(d, buffers, pages).expect("pool"))
    }

    #[test]
    fn head_fragments_and_frag_list_read_back_in_order() {
        let (_hv, mut p) = pool(8, 8);
        let a = p.alloc(NET_SKB_PAD).expect("skb");
        p.put(a, b"hello ").expect("put");
        let g = p.alloc_page().expect("page");
        p.domain().write(g, 100, b"page ").expect("write");
        p.add_frag(
            a,
            Frag {
                page: FragPage::Local(g),
                offset: 100,
                len: 5,
            },
        )
        .expect("frag");
        let b = p.alloc(0).expect("skb");
        p.put(b, b"world").expect("put");
        p.append_frag_list(a, b);
        assert_eq!(p.len(a), 16);
        let mut out = [0u8; 16];
        p.read(a, 0, &mut out).expect("read");
        assert_eq!(&out, b"hello page world");
        let mut mid = [0u8; 6];
        p.read(a, 4, &mut mid).expect("read");
        assert_eq!(&mid, b"o page");
        assert_eq!(p.read(a, 12, &mut [0u8; 5]), Err(SkbError::OutOfBounds));
        // Freeing the head frees the list and returns the page.
        let (fb, fp) = (p.free_buffers(), p.free_pages());
        p.free(a);
        assert_eq!((p.free_buffers(), p.free_pages()), (fb + 2, fp + 1));
    }

    #[test]
    fn a_page_linear_buffer_holds_a_page_and_gives_it_back() {
        let (_hv, mut p) = pool(2, 2);
        let a = p.alloc_page_linear().expect("skb");
        assert_eq!(p.free_pages(), 1);
        let (g, off) = p.data_location(a);
        assert_eq!((off, p.tailroom(a)), (0, PAGE_SIZE));
        // Data a back end wrote at an offset of its choosing.
        p.domain().write(g, 300, &[9u8; 3000]).expect("write");
        p.reserve(a, 300).expect("reserve");
        p.extend_linear(a, 3000).expect("extend");
        assert_eq!(p.extend_linear(a, PAGE_SIZE - 3299), Err(SkbError::NoRoom));
        assert_eq!(p.reserve(a, 1), Err(SkbError::NoRoom), "only when empty");
        let mut out = [0u8; 3000];
        p.read(a, 0, &mut out).expect("read");
        assert_eq!(out, [9u8; 3000]);
        p.free(a);
        assert_eq!((p.free_pages(), p.free_buffers()), (2, 2));
        // The descriptor has its own head again.
        let b = p.alloc(0).expect("skb");
        let c = p.alloc(0).expect("skb");
        assert_eq!(p.tailroom(b).max(p.tailroom(c)), SKB_HEAD_SIZE);
        assert_ne!(p.data_location(b).0, g);
        assert_ne!(p.data_location(c).0, g);
        assert_eq!(p.alloc_page_linear(), Err(SkbError::Exhausted));
        assert_eq!(p.free_pages(), 2, "a failed allocation keeps no page");
    }

    /// A buffer freed twice is refused and counted, in release builds too: the free
    /// list never holds it twice, so two allocations never share it.
    #[test]
    fn a_double_free_is_refused_and_counted() {
        let (_hv, mut p) = pool(4, 2);
        let a = p.alloc(0).expect("skb");
        p.free(a);
        p.free(a);
        assert_eq!(p.stats().double_frees, 1);
        assert_eq!(p.free_buffers(), 4, "the buffer is on the free list once");
        let ids: Vec<_> = (0..4).map(|_| p.alloc(0).expect("skb")).collect();
        for (i, x) in ids.iter().enumerate() {
            assert!(!ids[..i].contains(x), "a buffer lent twice");
        }
        assert_eq!(p.alloc(0), Err(SkbError::Exhausted));
    }

    #[test]
    fn the_pool_is_bounded_and_recycles() {
        let (_hv, mut p) = pool(4, 2);
        let ids: Vec<_> = (0..4).map(|_| p.alloc(0).expect("skb")).collect();
        assert_eq!(p.alloc(0), Err(SkbError::Exhausted));
        assert_eq!(p.stats().alloc_failures, 1);
        for id in ids {
            p.free(id);
        }
        assert_eq!(p.free_buffers(), 4);
        assert!(p.alloc(0).is_ok());
        p.alloc_page().expect("1");
        p.alloc_page().expect("2");
        assert_eq!(p.alloc_page(), Err(SkbError::Exhausted));
    }

    #[test]
    fn foreign_fragments_are_released_to_their_owner() {
        let (_hv, mut p) = pool(4, 2);
        let a = p.alloc(0).expect("skb");
        p.add_frag(
            a,
            Frag {
                page: FragPage::Foreign {
                    slot: 3,
                    token: 77,
                    grant: (DomId(9), GrantRef(5)),
                },
                offset: 0,
                len: 100,
            },
        )
        .expect("frag");
        p.free(a);
        let mut got = Vec::new();
        p.take_released(|r| got.push(r));
        assert_eq!(got, vec![Released { slot: 3, token: 77 }]);
    }

    #[test]
    fn queues_are_fifo_and_bounded_by_bytes() {
        let (_hv, mut p) = pool(8, 0);
        let mut q = SkbQueue::new(250);
        let ids: Vec<_> = (0..3)
            .map(|_| {
                let id = p.alloc(0).expect("skb");
                p.put(id, &[0u8; 100]).expect("put");
                id
            })
            .collect();
        assert!(q.push(&mut p, ids[0]).is_ok());
        assert!(q.push(&mut p, ids[1]).is_ok());
        assert_eq!(q.push(&mut p, ids[2]), Err(ids[2]), "over the byte limit");
        assert_eq!(q.pop(&p), Some(ids[0]));
        assert_eq!(q.pop(&p), Some(ids[1]));
        assert_eq!(q.pop(&p), None);
    }

    #[test]
    fn trim_drops_padding_and_pull_push_move_the_data_start() {
        let (_hv, mut p) = pool(2, 0);
        let a = p.alloc(NET_SKB_PAD).expect("skb");
        p.put(a, &[1u8; 60]).expect("put");
        p.trim(a, 42).expect("trim");
        assert_eq!(p.len(a), 42);
        p.pull(a, 14).expect("pull");
        assert_eq!((p.len(a), p.data_location(a).1), (28, NET_SKB_PAD + 14));
        p.push_front(a, 14).expect("push");
        assert_eq!(p.len(a), 42);
        assert_eq!(p.pull(a, 43), Err(SkbError::OutOfBounds));
    }
}
