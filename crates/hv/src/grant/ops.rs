//! The hypervisor side of grants: `GNTTABOP_copy`, `map_grant_ref`, `unmap_grant_ref`.
//!
//! Pinning a grant (Xen's `acquire_grant_for_copy` / `map_grant_ref`): under the granting
//! table's lock, copy the entry, validate it (type, grantee, read-only, frame), mark it in
//! use in the shared table on first use, and count the pin in the active entry; then
//! take a reference on the frame (and the writable type for a write). Releasing undoes
//! this in reverse. A transitive grant pins the grant it names first, holding no lock
//! while doing so, so no two table locks are ever held at once.
//!
//! Two paths, switchable so that paper 000 §3.4.3's optimisations can be measured:
//! * [`GrantPath::Original`]: each operation takes the table lock for each pin and each
//!   release, and pins (references) the caller's own page as well as the foreign one;
//! * [`GrantPath::Optimised`]: a batch takes the foreign table's lock once to pin every
//!   operation and once to release them all, and the caller's own page is neither
//!   pinned nor mapped (it is the caller's, and the caller is running). The split status
//!   word of v2 tables is the third optimisation; it belongs to the table's version.

use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, MutexGuard};

use super::{
    ActiveEntry, EntryWords, GrantError, GrantStatus, GrantVersion, MapEntry, GTF_PERMIT_ACCESS,
    GTF_READING, GTF_READONLY, GTF_SUB_PAGE, GTF_TRANSITIVE, GTF_TYPE_MASK, GTF_WRITING,
    MAX_UNSTABLE_RETRIES,
};
use crate::domain::Domain;
use crate::frame::FrameError;
use crate::profile::{enter, Class};
use crate::types::{DomId, Gfn, GrantHandle, GrantRef, Mfn};
use crate::Hypervisor;

/// Which grant implementation the hypervisor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantPath {
    /// Lock per operation, pin both pages.
    Original,
    /// Lock per batch, pin only the foreign page.
    Optimised,
}
crate::named_enum!(GrantPath {
    Original => "original",
    Optimised => "optimised",
});

/// One side of a copy (`struct gnttab_copy_ptr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyPtr {
    /// A page another domain granted to the caller (`GNTCOPY_*_gref`).
    Gref {
        dom: DomId,
        gref: GrantRef,
        offset: u16,
    },
    /// One of the caller's own pages.
    Local { gfn: Gfn, offset: u16 },
}

impl CopyPtr {
    fn offset(&self) -> u16 {
        match *self {
            CopyPtr::Gref { offset, .. } | CopyPtr::Local { offset, .. } => offset,
        }
    }
    fn gref_dom(&self) -> Option<DomId> {
        match *self {
            CopyPtr::Gref { dom, .. } => Some(dom),
            CopyPtr::Local { .. } => None,
        }
    }
}

/// One copy (`struct gnttab_copy`): `len` bytes from `source` to `dest`, each staying in
/// one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantCopy {
    /// Where from.
    pub source: CopyPtr,
    /// Where to.
    pub dest: CopyPtr,
    /// Bytes.
    pub len: u16,
}

/// One map (`struct gnttab_map_grant_ref`): map grant `gref` of `dom` at window slot
/// `slot` of the caller (the `host_addr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapOp {
    /// Granting domain.
    pub dom: DomId,
    /// Its grant reference.
    pub gref: GrantRef,
    /// Map read-only (`GNTMAP_readonly`).
    pub readonly: bool,
    /// Slot of the caller's window.
    pub slot: u32,
}

/// Operations in one optimised batch (one lock acquisition each way).
const COPY_CHUNK: usize = 32;

/// Whether a v2 first pin fences and re-checks at once, or leaves that to its batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fence {
    Now,
    Deferred,
}

#[derive(Debug, Clone, Copy)]
enum Purpose {
    Copy,
    Map,
}

/// A pinned grant: what it gives, and what to release.
#[derive(Debug, Clone, Copy)]
struct Pinned {
    mfn: Mfn,
    owner: DomId,
    start: u16,
    len: u16,
}

#[derive(Debug)]
enum PinError {
    Grant(GrantError),
    /// The entry is transitive: resolve it without holding this lock.
    NeedTransitive,
}

impl From<GrantError> for PinError {
    fn from(e: GrantError) -> Self {
        PinError::Grant(e)
    }
}

fn frame_err(e: FrameError) -> GrantError {
    match e {
        FrameError::TypeConflict => GrantError::TypeConflict,
        _ => GrantError::BadPage,
    }
}

fn lock_active(d: &Domain) -> MutexGuard<'_, Box<[ActiveEntry]>> {
    d.grant.active.lock().unwrap_or_else(|p| p.into_inner())
}

/// Checks a shared entry's header against what the caller needs.
fn check_header(combo: u32, ty: u16, user: DomId, write: bool) -> Result<(), GrantError> {
    let flags = combo as u16;
    if flags & GTF_TYPE_MASK != ty {
        return Err(GrantError::NotGranted);
    }
    if (combo >> 16) as u16 != user.0 {
        return Err(GrantError::NotForYou);
    }
    if write && flags & GTF_READONLY != 0 {
        return Err(GrantError::ReadOnly);
    }
    Ok(())
}

/// Marks the entry in use for `user` (first pin, or first write pin).
///
/// v1 (`_set_status_v1`): a compare-and-swap of flags+domid, so that the guest's own
/// compare-and-swap in end-access either sees our bits or we see its revocation.
/// v2 (`_set_status_v2`): set the status bits, full fence, re-read the header; if the
/// guest revoked meanwhile, undo and fail.
///
/// With [`Fence::Deferred`] (v2 only) the fence and re-check are left to the caller's
/// batch (`copy_batch`), which fences once and re-checks every header.
fn set_status(
    w: &EntryWords<'_>,
    ty: u16,
    user: DomId,
    write: bool,
    act: &ActiveEntry,
    when: Fence,
) -> Result<(), GrantError> {
    let bits = GTF_READING | if write { GTF_WRITING } else { 0 };
    match w.status {
        None => {
            let mut cur = w.combo.load(Ordering::Acquire);
            for _ in 0..MAX_UNSTABLE_RETRIES {
                check_header(cur, ty, user, write)?;
                let new = cur | bits as u32;
                if new == cur {
                    return Ok(());
                }
                match w
                    .combo
                    .compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => return Ok(()),
                    Err(now) => cur = now,
                }
            }
            Err(GrantError::Unstable)
        }
        Some(status) => {
            check_header(w.combo.load(Ordering::Acquire), ty, user, write)?;
            // A plain store, not a read-modify-write: in v2 only the hypervisor writes the
            // status word, always under this table's lock (the guest only reads it).
            status.store(status.load(Ordering::Relaxed) | bits, Ordering::Relaxed);
            if when == Fence::Deferred {
                return Ok(());
            }
            // Full fence: our status bits must be visible before we re-read the header;
            // pairs with the guest's store-fence-load in end-access.
            fence(Ordering::SeqCst);
            if let Err(e) = check_header(w.combo.load(Ordering::Acquire), ty, user, write) {
                clear_status(w, act);
                return Err(e);
            }
            Ok(())
        }
    }
}

/// Clears the in-use bits no longer justified by `act`'s pins.
fn clear_status(w: &EntryWords<'_>, act: &ActiveEntry) {
    let mut clear = 0u16;
    if act.pin_rw == 0 {
        clear |= GTF_WRITING;
    }
    if act.pins() == 0 {
        clear |= GTF_READING;
    }
    if clear != 0 {
        match w.status {
            // v1: the guest may compare-and-swap this word at any moment: atomic RMW.
            None => {
                w.flags.fetch_and(!clear, Ordering::Release);
            }
            // v2: ours alone, under the table lock (see `set_status`).
            Some(s) => s.store(s.load(Ordering::Relaxed) & !clear, Ordering::Release),
        }
    }
}

/// A windowed transitive entry's window: the offset in bits 32–47 of the 64-bit word
/// (padding after `transitive.gref` in Xen's layout), the length in `transitive.pad0`.
fn transitive_window(e: &super::GrantEntryV2) -> (u16, u16) {
    ((e.frame_or_gref >> 32) as u16, e.length)
}

/// Pins grant `r` of `granter` for `user`, with the table lock held (`act`).
// Inlined: returned through memory, its result is read back wider than it was written
// (a store-forwarding stall measured at ~40% of the batch loop's own time).
#[inline(always)]
fn pin_locked(
    granter: &Domain,
    act: &mut [ActiveEntry],
    r: GrantRef,
    user: DomId,
    write: bool,
    purpose: Purpose,
    fence: Fence,
) -> Result<Pinned, PinError> {
    let e = granter.read_entry(r)?;
    let v2 = granter.grant.version() == GrantVersion::V2;
    match e.flags & GTF_TYPE_MASK {
        GTF_PERMIT_ACCESS => {}
        GTF_TRANSITIVE if v2 => {
            return Err(match purpose {
                Purpose::Map => PinError::Grant(GrantError::NotMappable),
                Purpose::Copy => PinError::NeedTransitive,
            })
        }
        _ => return Err(GrantError::NotGranted.into()),
    }
    check_header(
        e.flags as u32 | (e.domid as u32) << 16,
        GTF_PERMIT_ACCESS,
        user,
        write,
    )?;
    let sub_page = v2 && e.flags & GTF_SUB_PAGE != 0;
    if sub_page && matches!(purpose, Purpose::Map) {
        return Err(GrantError::NotMappable.into());
    }
    let (start, len) = if sub_page {
        mem::check_in_page(e.page_off_or_trans_domid as usize, e.length as usize)
            .map_err(|_| GrantError::BadCopyArg)?;
        (e.page_off_or_trans_domid, e.length)
    } else {
        (0, mem::PAGE_SIZE as u16)
    };
    let gfn = u32::try_from(e.frame_or_gref).map_err(|_| GrantError::BadPage)?;
    let mfn = granter
        .gfn_to_mfn(Gfn(gfn))
        .map_err(|_| GrantError::BadPage)?;
    let w = granter.grant_words(r)?;
    let a = &mut act[r.0 as usize];
    if a.pins() == 0 {
        set_status(&w, GTF_PERMIT_ACCESS, user, write, a, fence)?;
        *a = ActiveEntry {
            pin_ro: 0,
            pin_rw: 0,
            user,
            mfn,
            start,
            len,
            trans: None,
        };
    } else {
        // Already pinned: the entry must still say what it said (a v2 guest may have
        // revoked and re-granted it meanwhile).
        if a.user != user {
            return Err(GrantError::NotForYou.into());
        }
        if a.mfn != mfn || a.start != start || a.len != len || a.trans.is_some() {
            return Err(GrantError::Unstable.into());
        }
        if write && a.pin_rw == 0 {
            set_status(&w, GTF_PERMIT_ACCESS, user, true, a, Fence::Now)?;
        }
    }
    bump(a, write)?;
    Ok(Pinned {
        mfn,
        owner: granter.id,
        start,
        len,
    })
}

fn bump(a: &mut ActiveEntry, write: bool) -> Result<(), GrantError> {
    let c = if write { &mut a.pin_rw } else { &mut a.pin_ro };
    *c = c.checked_add(1).ok_or(GrantError::Unstable)?;
    Ok(())
}

/// Drops one pin of `r`, with the table lock held. Returns the underlying grant of a
/// transitive entry, whose pin the caller must drop next (without this lock).
fn release_locked(
    granter: &Domain,
    act: &mut [ActiveEntry],
    r: GrantRef,
    write: bool,
) -> Option<(DomId, GrantRef)> {
    let a = act.get_mut(r.0 as usize)?;
    if write {
        a.pin_rw = a.pin_rw.saturating_sub(1);
    } else {
        a.pin_ro = a.pin_ro.saturating_sub(1);
    }
    if let Ok(w) = granter.grant_words(r) {
        clear_status(&w, a);
    }
    let t = a.trans;
    if a.pins() == 0 {
        a.trans = None;
    }
    t
}

/// A side of a copy, held for the copy.
#[derive(Debug, Clone)]
enum Held {
    /// The caller's own frame; `pinned` if the original path took references on it.
    Local { mfn: Mfn, pinned: bool },
    /// A foreign grant, pinned; `referenced` once the frame reference is taken.
    Foreign {
        dom: Arc<Domain>,
        gref: GrantRef,
        pin: Pinned,
        referenced: bool,
    },
}

impl Held {
    fn mfn(&self) -> Mfn {
        match self {
            Held::Local { mfn, .. } => *mfn,
            Held::Foreign { pin, .. } => pin.mfn,
        }
    }
}

impl Hypervisor {
    /// Which grant path runs.
    pub fn grant_path(&self) -> GrantPath {
        if self.grant_optimised.load(Ordering::Relaxed) {
            GrantPath::Optimised
        } else {
            GrantPath::Original
        }
    }
    /// Switches the grant path (for experiments; takes effect on the next operation).
    pub fn set_grant_path(&self, p: GrantPath) {
        self.grant_optimised
            .store(p == GrantPath::Optimised, Ordering::Relaxed);
    }

    /// Resolves and pins a transitive grant `r` of `granter` for `user`. No lock held on
    /// entry; at most one table lock held at any time.
    fn pin_transitive(
        &self,
        granter: &Arc<Domain>,
        r: GrantRef,
        user: DomId,
        write: bool,
    ) -> Result<Pinned, GrantError> {
        let e = granter.read_entry(r)?;
        check_header(
            e.flags as u32 | (e.domid as u32) << 16,
            GTF_TRANSITIVE,
            user,
            write,
        )?;
        let tdom = DomId(e.page_off_or_trans_domid);
        let tref = GrantRef(e.frame_or_gref as u32);
        // pvio's windowed form: the grantee sees only these bytes of what the grant
        // it names gives (Xen's transitive entries pass the whole of it on).
        let window = (e.flags & GTF_SUB_PAGE != 0).then(|| transitive_window(&e));
        if tdom == granter.id {
            return Err(GrantError::TransitiveLoop);
        }
        let inner_dom = self.domain(tdom).ok_or(GrantError::BadDomain(tdom))?;
        let inner = {
            let mut act = lock_active(&inner_dom);
            match pin_locked(
                &inner_dom,
                &mut act,
                tref,
                granter.id,
                write,
                Purpose::Copy,
                Fence::Now,
            ) {
                Ok(p) => p,
                Err(PinError::NeedTransitive) => return Err(GrantError::TransitiveChain),
                Err(PinError::Grant(e)) => return Err(e),
            }
        };
        let (start, len) = match window {
            None => (inner.start, inner.len),
            Some((off, n)) => {
                let inside = mem::check_in_page(off as usize, n as usize).is_ok()
                    && off >= inner.start
                    && u32::from(off) + u32::from(n)
                        <= u32::from(inner.start) + u32::from(inner.len);
                if !inside {
                    let mut act = lock_active(&inner_dom);
                    release_locked(&inner_dom, &mut act, tref, write);
                    return Err(GrantError::BadCopyArg);
                }
                (off, n)
            }
        };
        let outer = (|| {
            let mut act = lock_active(granter);
            // The entry must not have changed while we resolved it.
            if granter.read_entry(r)? != e {
                return Err(GrantError::Unstable);
            }
            let w = granter.grant_words(r)?;
            let a = &mut act[r.0 as usize];
            if a.pins() == 0 {
                set_status(&w, GTF_TRANSITIVE, user, write, a, Fence::Now)?;
                *a = ActiveEntry {
                    pin_ro: 0,
                    pin_rw: 0,
                    user,
                    mfn: inner.mfn,
                    start,
                    len,
                    trans: Some((tdom, tref)),
                };
            } else if a.user != user
                || a.trans != Some((tdom, tref))
                || (a.start, a.len) != (start, len)
            {
                return Err(GrantError::Unstable);
            } else if write && a.pin_rw == 0 {
                set_status(&w, GTF_TRANSITIVE, user, true, a, Fence::Now)?;
            }
            bump(a, write)
        })();
        if let Err(e) = outer {
            let mut act = lock_active(&inner_dom);
            release_locked(&inner_dom, &mut act, tref, write);
            return Err(e);
        }
        Ok(Pinned {
            start,
            len,
            ..inner
        })
    }

    /// Drops a pin taken by [`Self::pin_any`], following a transitive entry.
    fn unpin(&self, granter: &Domain, r: GrantRef, write: bool) {
        let trans = release_locked(granter, &mut lock_active(granter), r, write);
        if let Some((td, tr)) = trans {
            if let Some(inner) = self.domain(td) {
                release_locked(&inner, &mut lock_active(&inner), tr, write);
            }
        }
    }

    /// Pins a grant with its own lock acquisition (the per-operation path).
    fn pin_any(
        &self,
        granter: &Arc<Domain>,
        r: GrantRef,
        user: DomId,
        write: bool,
        purpose: Purpose,
    ) -> Result<Pinned, GrantError> {
        let first = pin_locked(
            granter,
            &mut lock_active(granter),
            r,
            user,
            write,
            purpose,
            Fence::Now,
        );
        match first {
            Ok(p) => Ok(p),
            Err(PinError::Grant(e)) => Err(e),
            Err(PinError::NeedTransitive) => self.pin_transitive(granter, r, user, write),
        }
    }

    /// Takes the frame reference for a held foreign side.
    fn reference(&self, h: &mut Held, write: bool) -> Result<(), GrantError> {
        if let Held::Foreign {
            pin, referenced, ..
        } = h
        {
            if write {
                self.frames
                    .get_page_writable(pin.mfn, pin.owner)
                    .map_err(frame_err)?;
            } else {
                self.frames
                    .get_page(pin.mfn, pin.owner)
                    .map_err(frame_err)?;
            }
            *referenced = true;
        }
        Ok(())
    }

    /// Acquires one side of a copy on the per-operation path.
    fn acquire_side(
        &self,
        caller: &Domain,
        p: &CopyPtr,
        write: bool,
        len: u16,
        pin_local: bool,
    ) -> Result<Held, GrantError> {
        match *p {
            CopyPtr::Local { gfn, .. } => {
                let mfn = caller.gfn_to_mfn(gfn).map_err(|_| GrantError::BadPage)?;
                if pin_local {
                    if write {
                        self.frames
                            .get_page_writable(mfn, caller.id)
                            .map_err(frame_err)?;
                    } else {
                        self.frames.get_page(mfn, caller.id).map_err(frame_err)?;
                    }
                }
                Ok(Held::Local {
                    mfn,
                    pinned: pin_local,
                })
            }
            CopyPtr::Gref { dom, gref, offset } => {
                let d = self.domain(dom).ok_or(GrantError::BadDomain(dom))?;
                let pin = self.pin_any(&d, gref, caller.id, write, Purpose::Copy)?;
                let mut h = Held::Foreign {
                    dom: d,
                    gref,
                    pin,
                    referenced: false,
                };
                let r =
                    check_window(&pin, offset, len).and_then(|()| self.reference(&mut h, write));
                if let Err(e) = r {
                    self.release_side(h, write);
                    return Err(e);
                }
                Ok(h)
            }
        }
    }

    fn release_side(&self, h: Held, write: bool) {
        match h {
            Held::Local { mfn, pinned } => {
                if pinned {
                    self.put_ref(mfn, write);
                }
            }
            Held::Foreign {
                dom,
                gref,
                pin,
                referenced,
            } => {
                if referenced {
                    self.put_ref(pin.mfn, write);
                }
                self.unpin(&dom, gref, write);
            }
        }
    }

    fn put_ref(&self, mfn: Mfn, write: bool) {
        if write {
            self.frames.put_page_writable(mfn);
        } else {
            self.frames.put_page(mfn);
        }
    }

    fn do_copy(&self, src: &Held, src_off: u16, dst: &Held, dst_off: u16, len: u16) -> GrantStatus {
        let _c = enter(Class::GrantCopy);
        self.mem
            .copy(
                src.mfn(),
                src_off as usize,
                dst.mfn(),
                dst_off as usize,
                len as usize,
            )
            .map_err(|_| GrantError::BadCopyArg)
    }

    /// One copy on the per-operation path.
    fn copy_one(&self, caller: &Domain, op: &GrantCopy, pin_local: bool) -> GrantStatus {
        check_bounds(op)?;
        let src = self.acquire_side(caller, &op.source, false, op.len, pin_local)?;
        let dst = match self.acquire_side(caller, &op.dest, true, op.len, pin_local) {
            Ok(d) => d,
            Err(e) => {
                self.release_side(src, false);
                return Err(e);
            }
        };
        let r = self.do_copy(&src, op.source.offset(), &dst, op.dest.offset(), op.len);
        self.release_side(dst, true);
        self.release_side(src, false);
        r
    }

    /// `GNTTABOP_copy`: performs `ops` for `caller`, writing one status per operation
    /// into `status` (which must be at least as long). A failed operation does not stop
    /// the others. Returns how many succeeded.
    pub fn grant_copy(
        &self,
        caller: &Domain,
        ops: &[GrantCopy],
        status: &mut [GrantStatus],
    ) -> usize {
        let _c = enter(Class::XenGrant);
        let n = ops.len().min(status.len());
        match self.grant_path() {
            GrantPath::Original => {
                for (op, st) in ops[..n].iter().zip(status.iter_mut()) {
                    *st = self.copy_one(caller, op, true);
                }
            }
            GrantPath::Optimised => {
                for (o, s) in ops[..n]
                    .chunks(COPY_CHUNK)
                    .zip(status[..n].chunks_mut(COPY_CHUNK))
                {
                    self.copy_batch(caller, o, s);
                }
            }
        }
        count_errors(caller, status[..n].iter().copied())
    }

    /// The optimised path for up to [`COPY_CHUNK`] operations: one lock acquisition of
    /// the batch's foreign table to pin every operation whose grants are all in it, one
    /// to release them; everything else goes the per-operation way (without pinning the
    /// caller's own pages).
    fn copy_batch(&self, caller: &Domain, ops: &[GrantCopy], status: &mut [GrantStatus]) {
        let mut state = [Fast::Done; COPY_CHUNK];
        let foreign = ops
            .iter()
            .find_map(|op| op.source.gref_dom().or(op.dest.gref_dom()))
            .and_then(|d| self.domain(d));

        if let Some(fd) = &foreign {
            let mut act = lock_active(fd);
            for (i, op) in ops.iter().enumerate() {
                if let Err(e) = check_bounds(op) {
                    status[i] = Err(e);
                    continue;
                }
                let same = [op.source.gref_dom(), op.dest.gref_dom()]
                    .iter()
                    .all(|d| d.is_none_or(|d| d == fd.id));
                state[i] = if !same {
                    Fast::Slow
                } else {
                    match pin_pair_locked(caller, fd, &mut act, op) {
                        Ok((src, dst)) => Fast::Pinned { src, dst },
                        Err(PinError::NeedTransitive) => Fast::Slow,
                        Err(PinError::Grant(e)) => {
                            status[i] = Err(e);
                            Fast::Done
                        }
                    }
                };
            }
            if fd.grant.version() == GrantVersion::V2 {
                // One full fence for the batch: every status store above is visible
                // before any header below is re-read (pairs with the guest's
                // store-fence-load in end-access). Every pinned side is re-checked, not
                // only first pins: a reference pinned twice in one batch must fail both
                // times if the guest revoked it in between.
                fence(Ordering::SeqCst);
                for (i, st) in state.iter_mut().enumerate().take(ops.len()) {
                    let Fast::Pinned { src, dst } = *st else {
                        continue;
                    };
                    let bad = [(src, false), (dst, true)]
                        .into_iter()
                        .find_map(|(side, write)| {
                            let r = side.gref?;
                            let w = fd.grant_words(r).ok()?;
                            check_header(
                                w.combo.load(Ordering::Acquire),
                                GTF_PERMIT_ACCESS,
                                caller.id,
                                write,
                            )
                            .err()
                        });
                    if let Some(e) = bad {
                        for (side, write) in [(dst, true), (src, false)] {
                            if let Some(r) = side.gref {
                                release_locked(fd, &mut act, r, write);
                            }
                        }
                        *st = Fast::Done;
                        status[i] = Err(e);
                    }
                }
            }
        } else {
            state[..ops.len()].iter_mut().for_each(|s| *s = Fast::Slow);
        }

        for (i, op) in ops.iter().enumerate() {
            match state[i] {
                Fast::Slow => status[i] = self.copy_one(caller, op, false),
                Fast::Pinned { src, dst } => {
                    status[i] =
                        self.copy_pinned(src, op.source.offset(), dst, op.dest.offset(), op.len)
                }
                Fast::Done => {}
            }
        }

        if let Some(fd) = &foreign {
            let mut act = lock_active(fd);
            for st in &state[..ops.len()] {
                if let Fast::Pinned { src, dst } = *st {
                    // Not transitive (those went the slow way), so nothing follows.
                    for (side, write) in [(dst, true), (src, false)] {
                        if let Some(r) = side.gref {
                            release_locked(fd, &mut act, r, write);
                        }
                    }
                }
            }
        }
    }

    /// The copy of an operation pinned on the optimised path: reference the foreign
    /// frames (not the caller's own), copy, drop the references.
    fn copy_pinned(
        &self,
        src: FastSide,
        src_off: u16,
        dst: FastSide,
        dst_off: u16,
        len: u16,
    ) -> GrantStatus {
        if let Some(o) = src.owner {
            self.frames.get_page(src.mfn, o).map_err(frame_err)?;
        }
        if let Some(o) = dst.owner {
            if let Err(e) = self.frames.get_page_writable(dst.mfn, o) {
                if src.owner.is_some() {
                    self.frames.put_page(src.mfn);
                }
                return Err(frame_err(e));
            }
        }
        let r = {
            let _c = enter(Class::GrantCopy);
            self.mem
                .copy(
                    src.mfn,
                    src_off as usize,
                    dst.mfn,
                    dst_off as usize,
                    len as usize,
                )
                .map_err(|_| GrantError::BadCopyArg)
        };
        if dst.owner.is_some() {
            self.frames.put_page_writable(dst.mfn);
        }
        if src.owner.is_some() {
            self.frames.put_page(src.mfn);
        }
        r
    }

    /// `GNTTABOP_map_grant_ref`: validates and pins each grant and writes its entry in
    /// the caller's foreign-map table (and its IOMMU context); one result (a handle or an
    /// error) per operation.
    pub fn grant_map(
        &self,
        caller: &Domain,
        ops: &[MapOp],
        out: &mut [Result<GrantHandle, GrantError>],
    ) -> usize {
        let _c = enter(Class::XenGrant);
        let n = ops.len().min(out.len());
        for (op, o) in ops[..n].iter().zip(out.iter_mut()) {
            *o = self.map_one(caller, op);
        }
        count_errors(caller, out[..n].iter().map(|r| r.map(|_| ())))
    }

    fn map_one(&self, caller: &Domain, op: &MapOp) -> Result<GrantHandle, GrantError> {
        if caller.is_dying() {
            return Err(GrantError::BadDomain(caller.id));
        }
        match caller.window.state(op.slot) {
            Ok(mem::SlotState::Unmapped) => {}
            _ => return Err(GrantError::BadVirtAddr),
        }
        let d = self.domain(op.dom).ok_or(GrantError::BadDomain(op.dom))?;
        let write = !op.readonly;
        let pin = self.pin_any(&d, op.gref, caller.id, write, Purpose::Map)?;
        let mut h = Held::Foreign {
            dom: Arc::clone(&d),
            gref: op.gref,
            pin,
            referenced: false,
        };
        if let Err(e) = self.reference(&mut h, write) {
            self.release_side(h, write);
            return Err(e);
        }
        if let Err(e) = caller.window.map(op.slot, pin.mfn, write) {
            self.release_side(h, write);
            return Err(match e {
                mem::MemError::Os(n) => GrantError::Os(n),
                _ => GrantError::BadVirtAddr,
            });
        }
        if let Err(e) = self.iommu_map_grant(caller, op.slot, pin.mfn, write) {
            let _ = caller.window.unmap(op.slot);
            self.release_side(h, write);
            // Out of page-table frames (or a window slot beyond the I/O address range).
            let _ = e;
            return Err(GrantError::NoSpace);
        }
        let entry = MapEntry {
            granter: d,
            gref: op.gref,
            writable: write,
            slot: op.slot,
            mfn: pin.mfn,
        };
        let handle = caller
            .maptrack
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(entry);
        match handle {
            Some(hd) => Ok(hd),
            None => {
                let _ = caller.window.unmap(op.slot);
                self.release_side(h, write);
                Err(GrantError::NoSpace)
            }
        }
    }

    /// `GNTTABOP_unmap_grant_ref`: clears each mapping's entry, waits once for every
    /// access still translating through any of them (the shoot-down, one per call as
    /// `gnttab_unmap_refs` flushes once per batch), and releases the grants; one status
    /// per handle. A mapping the caller still holds open (a mapped ring) is refused with
    /// `MappingInUse` and stays.
    pub fn grant_unmap(
        &self,
        caller: &Domain,
        handles: &[GrantHandle],
        out: &mut [GrantStatus],
    ) -> usize {
        let _c = enter(Class::XenGrant);
        let n = handles.len().min(out.len());
        let mut mt = caller.maptrack.lock().unwrap_or_else(|p| p.into_inner());
        // The slots of the valid handles, in order (a handle named twice finds its slot
        // already closed the second time: `BadHandle`).
        let mut slots = [0u32; UNMAP_BATCH];
        let mut done = 0;
        while done < n {
            let chunk = (n - done).min(UNMAP_BATCH);
            let mut which = [usize::MAX; UNMAP_BATCH];
            let mut k = 0;
            for i in done..done + chunk {
                out[i] = match mt.get(handles[i]) {
                    Some(e) => {
                        slots[k] = e.slot;
                        which[k] = i;
                        k += 1;
                        Ok(())
                    }
                    _ => Err(GrantError::BadHandle(handles[i].0)),
                };
            }
            let mut res = [Ok(Mfn(0)); UNMAP_BATCH];
            caller.window.unmap_batch(&slots[..k], &mut res[..k]);
            for j in 0..k {
                let i = which[j];
                if let Err(err) = res[j] {
                    out[i] = Err(match err {
                        mem::MemError::InUse(_) => GrantError::MappingInUse,
                        mem::MemError::Os(n) => GrantError::Os(n),
                        _ => GrantError::BadHandle(handles[i].0),
                    });
                    continue;
                }
                if let Some(e) = mt.remove(handles[i]) {
                    self.iommu_unmap_grant(caller, e.slot);
                    self.put_ref(e.mfn, e.writable);
                    self.unpin(&e.granter, e.gref, e.writable);
                }
            }
            done += chunk;
        }
        drop(mt);
        count_errors(caller, out[..n].iter().copied())
    }

    /// How many grant mappings `caller` holds (its live maptrack entries): what a
    /// back end's teardown must bring back to zero.
    pub fn mappings_held(&self, caller: &Domain) -> usize {
        caller
            .maptrack
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries
            .iter()
            .filter(|e| e.is_some())
            .count()
    }

    /// The granted frame of a live mapping and whether it is writable (for tools/tests).
    pub fn mapping(&self, caller: &Domain, h: GrantHandle) -> Option<(u32, bool)> {
        caller
            .maptrack
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(h)
            .map(|e| (e.slot, e.writable))
    }
}

/// One side of an operation on the optimised path: the frame, and for a foreign side
/// the grant pinned and the frame's owner.
#[derive(Debug, Clone, Copy)]
struct FastSide {
    mfn: Mfn,
    gref: Option<GrantRef>,
    owner: Option<DomId>,
}

/// Where an operation of an optimised batch stands.
#[derive(Debug, Clone, Copy)]
enum Fast {
    /// Finished (failed validation) or not in the batch.
    Done,
    /// Goes the per-operation way (another domain, or a transitive grant).
    Slow,
    /// Both sides pinned under the batch's lock.
    Pinned { src: FastSide, dst: FastSide },
}

/// Pins both sides of `op` under the held lock of `fd` (all its grants are in `fd`).
#[inline(always)]
fn pin_pair_locked(
    caller: &Domain,
    fd: &Domain,
    act: &mut [ActiveEntry],
    op: &GrantCopy,
) -> Result<(FastSide, FastSide), PinError> {
    let side = |p: &CopyPtr, write: bool, act: &mut [ActiveEntry]| -> Result<FastSide, PinError> {
        match *p {
            CopyPtr::Local { gfn, .. } => {
                let mfn = caller.gfn_to_mfn(gfn).map_err(|_| GrantError::BadPage)?;
                Ok(FastSide {
                    mfn,
                    gref: None,
                    owner: None,
                })
            }
            CopyPtr::Gref { gref, offset, .. } => {
                let pin = pin_locked(
                    fd,
                    act,
                    gref,
                    caller.id,
                    write,
                    Purpose::Copy,
                    Fence::Deferred,
                )?;
                if let Err(e) = check_window(&pin, offset, op.len) {
                    release_locked(fd, act, gref, write);
                    return Err(e.into());
                }
                Ok(FastSide {
                    mfn: pin.mfn,
                    gref: Some(gref),
                    owner: Some(pin.owner),
                })
            }
        }
    };
    let src = side(&op.source, false, act)?;
    match side(&op.dest, true, act) {
        Ok(dst) => Ok((src, dst)),
        Err(e) => {
            if let Some(r) = src.gref {
                release_locked(fd, act, r, false);
            }
            Err(e)
        }
    }
}

/// Counts the failures of a batch against the caller; returns the successes.
/// Unmaps cleared under one shoot-down (Linux's netback unmaps up to `MAX_PENDING_REQS`
/// at once; a larger batch is taken in chunks).
const UNMAP_BATCH: usize = 64;

fn count_errors(caller: &Domain, statuses: impl Iterator<Item = GrantStatus>) -> usize {
    let mut ok = 0;
    for s in statuses {
        match s {
            Ok(()) => ok += 1,
            Err(e) => caller.count_grant_error(e),
        }
    }
    ok
}

fn check_bounds(op: &GrantCopy) -> GrantStatus {
    for p in [&op.source, &op.dest] {
        mem::check_in_page(p.offset() as usize, op.len as usize)
            .map_err(|_| GrantError::BadCopyArg)?;
    }
    Ok(())
}

/// The bytes `offset..offset+len` must lie inside what the grant gives.
fn check_window(pin: &Pinned, offset: u16, len: u16) -> GrantStatus {
    let (o, l, s, n) = (offset as u32, len as u32, pin.start as u32, pin.len as u32);
    if o >= s && o + l <= s + n {
        Ok(())
    } else {
        Err(GrantError::OutsideSubPage)
    }
}
