//! Per-frame information and the frame allocator (Xen's `struct page_info`).
//!
//! Every machine frame has an owner, a *type* with a type count, and a general reference
//! count. A reference (`get_page`) keeps a frame from being freed or reassigned while a
//! grant operation or a mapping uses it; a type reference (`get_page_type`) says how it
//! is used: a frame may be writable or a page-table page of one level, never both at
//! once. Paper 000 §3.4.3 measures that taking the writable type is the dearer pin (one
//! more atomic on a contended word); paper 004 builds on the page-table types.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::types::{DomId, Mfn};

/// What a frame is used as. A frame changes type only when its type count is zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageType {
    /// No type reference held.
    None,
    /// Mapped or accessed writably (by a grant copy or map, say).
    Writable,
    /// A page-table page of level 1 to 4.
    PageTable(u8),
}

impl PageType {
    fn encode(self) -> u64 {
        match self {
            PageType::None => 0,
            PageType::Writable => 1,
            PageType::PageTable(l) => 1 + l.clamp(1, 4) as u64,
        }
    }
    fn decode(v: u64) -> Self {
        match v {
            0 => PageType::None,
            1 => PageType::Writable,
            l => PageType::PageTable((l - 1) as u8),
        }
    }
}

const TYPE_SHIFT: u32 = 48;
const COUNT_MASK: u64 = (1 << TYPE_SHIFT) - 1;
const NO_OWNER: u32 = u32::MAX;

/// Why a frame reference was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The frame number is beyond machine memory.
    #[error("no such frame")]
    NoSuchFrame,
    /// The frame does not belong to the domain the caller expected.
    #[error("frame owned by another domain")]
    WrongOwner,
    /// The frame has another type with a nonzero type count.
    #[error("frame is in use as another type")]
    TypeConflict,
    /// A count would overflow.
    #[error("reference count overflow")]
    Overflow,
    /// No free frame is left.
    #[error("out of machine memory")]
    OutOfMemory,
    /// The frame still has references and cannot be freed.
    #[error("frame still referenced")]
    Referenced,
}

/// The frame table: one entry per machine frame, plus the free list.
#[derive(Debug)]
pub struct FrameTable {
    owner: Box<[AtomicU32]>,
    count: Box<[AtomicU64]>,
    type_info: Box<[AtomicU64]>,
    /// Machine frame → the owner's guest frame (Xen's `machine_to_phys_mapping`).
    m2p: Box<[AtomicU32]>,
    free: Mutex<Vec<Mfn>>,
}

impl FrameTable {
    /// A table for `frames` frames, all free and unowned.
    pub fn new(frames: u32) -> Self {
        Self {
            owner: (0..frames).map(|_| AtomicU32::new(NO_OWNER)).collect(),
            count: (0..frames).map(|_| AtomicU64::new(0)).collect(),
            type_info: (0..frames).map(|_| AtomicU64::new(0)).collect(),
            m2p: (0..frames).map(|_| AtomicU32::new(u32::MAX)).collect(),
            // Popped from the end: hand out low frames first.
            free: Mutex::new((0..frames).rev().map(Mfn).collect()),
        }
    }

    /// Machine frames in all.
    pub fn total(&self) -> u32 {
        self.owner.len() as u32
    }

    /// Frames not allocated.
    pub fn free_frames(&self) -> usize {
        self.free.lock().map(|f| f.len()).unwrap_or(0)
    }

    /// Allocates a frame to `owner`.
    pub fn alloc(&self, owner: DomId) -> Result<Mfn, FrameError> {
        let mfn = self
            .free
            .lock()
            .map_err(|_| FrameError::OutOfMemory)?
            .pop()
            .ok_or(FrameError::OutOfMemory)?;
        self.owner[mfn.0 as usize].store(owner.0 as u32, Ordering::Release);
        Ok(mfn)
    }

    /// Returns a frame to the free list; refused while it has references.
    pub fn free(&self, mfn: Mfn) -> Result<(), FrameError> {
        let i = self.index(mfn)?;
        if self.count[i].load(Ordering::Acquire) != 0
            || self.type_info[i].load(Ordering::Acquire) & COUNT_MASK != 0
        {
            return Err(FrameError::Referenced);
        }
        self.owner[i].store(NO_OWNER, Ordering::Release);
        self.type_info[i].store(0, Ordering::Relaxed);
        self.m2p[i].store(u32::MAX, Ordering::Relaxed);
        self.free
            .lock()
            .map_err(|_| FrameError::OutOfMemory)?
            .push(mfn);
        Ok(())
    }

    fn index(&self, mfn: Mfn) -> Result<usize, FrameError> {
        let i = mfn.0 as usize;
        (i < self.owner.len())
            .then_some(i)
            .ok_or(FrameError::NoSuchFrame)
    }

    /// The owner of a frame, if allocated.
    pub fn owner(&self, mfn: Mfn) -> Option<DomId> {
        let o = self.owner.get(mfn.0 as usize)?.load(Ordering::Acquire);
        (o != NO_OWNER).then_some(DomId(o as u16))
    }

    /// General reference count.
    pub fn refcount(&self, mfn: Mfn) -> u64 {
        self.count
            .get(mfn.0 as usize)
            .map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Current type and type count.
    pub fn page_type(&self, mfn: Mfn) -> (PageType, u64) {
        let t = self
            .type_info
            .get(mfn.0 as usize)
            .map_or(0, |c| c.load(Ordering::Acquire));
        (PageType::decode(t >> TYPE_SHIFT), t & COUNT_MASK)
    }

    /// Takes a general reference on a frame owned by `owner` (Xen's `get_page`).
    pub fn get_page(&self, mfn: Mfn, owner: DomId) -> Result<(), FrameError> {
        let i = self.index(mfn)?;
        if self.owner[i].load(Ordering::Acquire) != owner.0 as u32 {
            return Err(FrameError::WrongOwner);
        }
        // A compare-and-swap loop as in Xen: the count must never wrap.
        let c = &self.count[i];
        let mut cur = c.load(Ordering::Relaxed);
        loop {
            let next = cur.checked_add(1).ok_or(FrameError::Overflow)?;
            match c.compare_exchange_weak(cur, next, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// Drops a general reference taken with [`Self::get_page`].
    pub fn put_page(&self, mfn: Mfn) {
        if let Some(c) = self.count.get(mfn.0 as usize) {
            // One `lock xadd`, not a compare-and-swap loop: callers only put what they got,
            // so the count cannot underflow (checked in debug builds). Release: our
            // accesses to the frame happen before a free that sees zero.
            let old = c.fetch_sub(1, Ordering::Release);
            debug_assert!(old > 0, "put_page without get_page on {mfn}");
        }
    }

    /// Records which of its owner's guest frames `mfn` is.
    pub(crate) fn set_m2p(&self, mfn: Mfn, gfn: crate::types::Gfn) {
        if let Some(e) = self.m2p.get(mfn.0 as usize) {
            e.store(gfn.0, Ordering::Relaxed);
        }
    }

    /// The owner's guest frame of `mfn` (Xen's `mfn_to_gmfn`).
    pub fn m2p(&self, mfn: Mfn) -> Option<crate::types::Gfn> {
        let g = self.m2p.get(mfn.0 as usize)?.load(Ordering::Relaxed);
        (g != u32::MAX).then_some(crate::types::Gfn(g))
    }

    /// Whether the frame's recorded type is a page-table level, in use or not: such a
    /// frame is not writable by its owner's own accesses (in Xen its kernel mapping is
    /// read-only) until the owner asks for it back
    /// ([`crate::mmu::MmuExtOp::MakeWritable`]). One load, on the owner's write paths.
    #[inline]
    pub fn is_page_table(&self, mfn: Mfn) -> bool {
        self.type_info
            .get(mfn.0 as usize)
            .is_some_and(|t| t.load(Ordering::Acquire) >> TYPE_SHIFT > 1)
    }

    /// Takes a type reference (`get_page_type`): sets the type if the type count is zero,
    /// otherwise requires the same type.
    pub fn get_page_type(&self, mfn: Mfn, ty: PageType) -> Result<(), FrameError> {
        self.get_page_type_from(mfn, ty).map(|_| ())
    }

    /// [`Self::get_page_type`], saying what the frame was before when the type changed
    /// (`Some(old)`: a change the caller may have to act on, as the PV MMU syncs the
    /// IOMMU); `None` when the frame already had this type.
    pub fn get_page_type_from(
        &self,
        mfn: Mfn,
        ty: PageType,
    ) -> Result<Option<PageType>, FrameError> {
        let i = self.index(mfn)?;
        let t = &self.type_info[i];
        let mut cur = t.load(Ordering::Relaxed);
        loop {
            let (cty, cnt) = (cur >> TYPE_SHIFT, cur & COUNT_MASK);
            let next = if cnt == 0 {
                (ty.encode() << TYPE_SHIFT) | 1
            } else if cty == ty.encode() {
                if cnt == COUNT_MASK {
                    return Err(FrameError::Overflow);
                }
                cur + 1
            } else {
                return Err(FrameError::TypeConflict);
            };
            match t.compare_exchange_weak(cur, next, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => {
                    return Ok((cur >> TYPE_SHIFT != ty.encode())
                        .then(|| PageType::decode(cur >> TYPE_SHIFT)))
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Undoes a [`Self::get_page_type_from`] that changed the type, whose caller then
    /// failed to validate the frame: the type count goes from one back to zero and the
    /// recorded type back to `old`, as if nothing happened. Refused (false) if someone
    /// else took a reference in between.
    pub(crate) fn restore_type(&self, mfn: Mfn, ty: PageType, old: PageType) -> bool {
        self.type_info.get(mfn.0 as usize).is_some_and(|t| {
            t.compare_exchange(
                (ty.encode() << TYPE_SHIFT) | 1,
                old.encode() << TYPE_SHIFT,
                Ordering::Release,
                Ordering::Relaxed,
            )
            .is_ok()
        })
    }

    /// Drops a type reference; the type stays recorded (Xen keeps it validated) until
    /// another type is taken at count zero.
    pub fn put_page_type(&self, mfn: Mfn) {
        if let Some(t) = self.type_info.get(mfn.0 as usize) {
            // The count is the low bits and is nonzero (callers put what they got), so a
            // plain decrement never borrows from the type bits.
            let old = t.fetch_sub(1, Ordering::Release);
            debug_assert!(
                old & COUNT_MASK != 0,
                "put_page_type without get_page_type on {mfn}"
            );
        }
    }

    /// Reference and writable type together: what a write pin costs.
    pub fn get_page_writable(&self, mfn: Mfn, owner: DomId) -> Result<(), FrameError> {
        self.get_page(mfn, owner)?;
        if let Err(e) = self.get_page_type(mfn, PageType::Writable) {
            self.put_page(mfn);
            return Err(e);
        }
        Ok(())
    }

    /// Undoes [`Self::get_page_writable`].
    pub fn put_page_writable(&self, mfn: Mfn) {
        self.put_page_type(mfn);
        self.put_page(mfn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_exclude_each_other_and_references_block_free() {
        let ft = FrameTable::new(4);
        let m = ft.alloc(DomId(1)).expect("frame");
        assert_eq!(ft.owner(m), Some(DomId(1)));
        assert_eq!(ft.get_page(m, DomId(2)), Err(FrameError::WrongOwner));
        ft.get_page_writable(m, DomId(1)).expect("pin");
        assert_eq!(
            ft.get_page_type(m, PageType::PageTable(1)),
            Err(FrameError::TypeConflict)
        );
        assert_eq!(ft.free(m), Err(FrameError::Referenced));
        ft.put_page_writable(m);
        ft.get_page_type(m, PageType::PageTable(1))
            .expect("type change at count 0");
        assert_eq!(ft.page_type(m), (PageType::PageTable(1), 1));
        ft.put_page_type(m);
        ft.free(m).expect("free");
        assert_eq!(ft.owner(m), None);
        assert_eq!(ft.free_frames(), 4);
    }
}
