//! Grant tables: a domain's way of letting one other domain read or write one of its
//! pages, with the layouts of Xen's public `grant_table.h`.
//!
//! The table lives in the granting domain's own frames (gfns 1.. of its layout): the
//! guest writes entries, the hypervisor reads them when another domain asks to copy from
//! or map a granted page, and marks them in use (`GTF_reading`/`GTF_writing`) while it
//! holds them. Version 1 keeps that in-use status in the same 16-bit flags word the guest
//! writes, so revoking needs a compare-and-swap; version 2 keeps it in a separate status
//! array, so revoking is a plain store and a barrier (paper 000 §3.4.2). Sub-page and
//! transitive grants exist only in v2, as in Xen.
//!
//! Everything read from a table is copied once and validated before use; the other
//! domain, and the granting guest itself, may rewrite it at any moment.

mod ops;

pub use ops::{CopyPtr, GrantCopy, GrantPath, MapOp};

use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::Mutex;

use crate::domain::{Domain, GRANT_FRAMES_START};
use crate::profile::{enter, Class};
use crate::types::{DomId, Gfn, GrantHandle, GrantRef, Mfn};

// --- grant_table.h ------------------------------------------------------------------

/// Entry is not in use.
pub const GTF_INVALID: u16 = 0;
/// Entry grants access to a frame.
pub const GTF_PERMIT_ACCESS: u16 = 1;
/// Entry accepts a page transfer (not supported by pvio: treated as not granted).
pub const GTF_ACCEPT_TRANSFER: u16 = 2;
/// Entry grants access to another domain's grant (v2 only).
pub const GTF_TRANSITIVE: u16 = 3;
/// The type bits.
pub const GTF_TYPE_MASK: u16 = 3;
/// Only read access is granted.
pub const GTF_READONLY: u16 = 1 << 2;
/// Set by the hypervisor while the grantee reads.
pub const GTF_READING: u16 = 1 << 3;
/// Set by the hypervisor while the grantee may write.
pub const GTF_WRITING: u16 = 1 << 4;
/// Only `page_off..page_off+length` is granted (v2 only).
pub const GTF_SUB_PAGE: u16 = 1 << 8;

/// `GNTST_okay`.
pub const GNTST_OKAY: i16 = 0;
/// `GNTST_general_error`.
pub const GNTST_GENERAL_ERROR: i16 = -1;
/// `GNTST_bad_domain`.
pub const GNTST_BAD_DOMAIN: i16 = -2;
/// `GNTST_bad_gntref`.
pub const GNTST_BAD_GNTREF: i16 = -3;
/// `GNTST_bad_handle`.
pub const GNTST_BAD_HANDLE: i16 = -4;
/// `GNTST_bad_virt_addr`.
pub const GNTST_BAD_VIRT_ADDR: i16 = -5;
/// `GNTST_no_device_space`.
pub const GNTST_NO_DEVICE_SPACE: i16 = -7;
/// `GNTST_permission_denied`.
pub const GNTST_PERMISSION_DENIED: i16 = -8;
/// `GNTST_bad_page`.
pub const GNTST_BAD_PAGE: i16 = -9;
/// `GNTST_bad_copy_arg`.
pub const GNTST_BAD_COPY_ARG: i16 = -10;
/// `GNTST_no_space`.
pub const GNTST_NO_SPACE: i16 = -13;

/// `struct grant_entry_v1`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct GrantEntryV1 {
    /// `GTF_*`.
    pub flags: u16,
    /// The domain being granted access.
    pub domid: u16,
    /// The granted frame (a gfn of the granting domain).
    pub frame: u32,
}

/// `union grant_entry_v2`, as one struct whose fields overlay the union's members:
/// `full_page { hdr, pad0, frame }`, `sub_page { hdr, page_off, length, frame }`,
/// `transitive { hdr, trans_domid, pad0, gref }`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct GrantEntryV2 {
    /// `hdr.flags`.
    pub flags: u16,
    /// `hdr.domid`.
    pub domid: u16,
    /// `sub_page.page_off`, or `transitive.trans_domid`.
    pub page_off_or_trans_domid: u16,
    /// `sub_page.length`.
    pub length: u16,
    /// `full_page.frame` / `sub_page.frame`, or `transitive.gref` in the low 32 bits.
    pub frame_or_gref: u64,
}

const _: () = assert!(std::mem::size_of::<GrantEntryV1>() == 8);
const _: () = assert!(std::mem::size_of::<GrantEntryV2>() == 16);
const _: () = assert!(std::mem::size_of::<u16>() == 2, "grant_status_t");

/// Which layout a domain's table uses (`GNTTABOP_set_version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantVersion {
    /// 8-byte entries; status bits in the flags word.
    V1,
    /// 16-byte entries; a separate status array; sub-page and transitive grants.
    V2,
}

impl GrantVersion {
    const fn entry_size(self) -> usize {
        match self {
            GrantVersion::V1 => 8,
            GrantVersion::V2 => 16,
        }
    }
}

/// Retries on an entry that keeps changing under a compare-and-swap before the
/// operation gives up (Xen's `_set_status_v1` gives up after 4).
pub const MAX_UNSTABLE_RETRIES: u32 = 4;

/// Why a grant operation failed. Each has its own `GNTST_*` code ([`Self::gntst`]), but
/// pvio keeps the finer reason so that counters and tests can tell them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// The grant reference is beyond the granting domain's table.
    #[error("grant reference {0} beyond the table")]
    BadGntRef(u32),
    /// The entry grants access to another domain, not the caller.
    #[error("grant is for another domain")]
    NotForYou,
    /// The entry is not (or no longer) a valid grant: never granted, or revoked.
    #[error("entry is not granted")]
    NotGranted,
    /// A write through a read-only grant.
    #[error("grant is read-only")]
    ReadOnly,
    /// `offset + len` crosses the end of a page.
    #[error("copy crosses a page boundary")]
    BadCopyArg,
    /// The copy reaches outside the bytes a sub-page grant names.
    #[error("copy outside the sub-page grant")]
    OutsideSubPage,
    /// A transitive grant that points at another transitive grant (chains are limited
    /// to one hop).
    #[error("transitive grant chain longer than one hop")]
    TransitiveChain,
    /// A transitive grant that points back into its own table.
    #[error("transitive grant loops")]
    TransitiveLoop,
    /// Transitive and sub-page grants can only be copied, never mapped.
    #[error("grant cannot be mapped")]
    NotMappable,
    /// The grant is in use (mapped or being copied): end-access refused.
    #[error("grant is in use")]
    InUse,
    /// The grant handle is not one of the caller's mappings.
    #[error("unknown grant handle {0}")]
    BadHandle(u32),
    /// The domain named does not exist.
    #[error("no such domain {0}")]
    BadDomain(DomId),
    /// The caller's own frame does not exist, or the granted frame is not the granter's.
    #[error("bad page")]
    BadPage,
    /// The map target slot is outside the caller's window or already in use.
    #[error("bad host address")]
    BadVirtAddr,
    /// The mapping is being accessed; unmap refused for now.
    #[error("mapping is in use")]
    MappingInUse,
    /// The caller's maptrack table is full.
    #[error("no maptrack space")]
    NoSpace,
    /// The entry kept changing under us.
    #[error("grant entry unstable")]
    Unstable,
    /// This operation needs a v2 table.
    #[error("operation needs a v2 grant table")]
    WrongVersion,
    /// The frame is in use with a conflicting type.
    #[error("frame type conflict")]
    TypeConflict,
    /// The kernel refused the page-table change of a map or unmap.
    #[error("mapping failed: errno {0}")]
    Os(i32),
}

impl GrantError {
    /// Number of distinct reasons (size of a per-reason counter array).
    pub const REASONS: usize = 20;

    /// A stable index per reason, for counters.
    pub fn index(self) -> usize {
        match self {
            GrantError::BadGntRef(_) => 0,
            GrantError::NotForYou => 1,
            GrantError::NotGranted => 2,
            GrantError::ReadOnly => 3,
            GrantError::BadCopyArg => 4,
            GrantError::OutsideSubPage => 5,
            GrantError::TransitiveChain => 6,
            GrantError::TransitiveLoop => 7,
            GrantError::NotMappable => 8,
            GrantError::InUse => 9,
            GrantError::BadHandle(_) => 10,
            GrantError::BadDomain(_) => 11,
            GrantError::BadPage => 12,
            GrantError::BadVirtAddr => 13,
            GrantError::MappingInUse => 14,
            GrantError::NoSpace => 15,
            GrantError::Unstable => 16,
            GrantError::WrongVersion => 17,
            GrantError::TypeConflict => 18,
            GrantError::Os(_) => 19,
        }
    }

    /// The `GNTST_*` status Xen would return.
    pub fn gntst(self) -> i16 {
        match self {
            GrantError::BadGntRef(_) => GNTST_BAD_GNTREF,
            GrantError::NotForYou | GrantError::ReadOnly => GNTST_PERMISSION_DENIED,
            GrantError::BadCopyArg | GrantError::OutsideSubPage => GNTST_BAD_COPY_ARG,
            GrantError::BadHandle(_) => GNTST_BAD_HANDLE,
            GrantError::BadDomain(_) => GNTST_BAD_DOMAIN,
            GrantError::BadPage | GrantError::TypeConflict => GNTST_BAD_PAGE,
            GrantError::BadVirtAddr => GNTST_BAD_VIRT_ADDR,
            GrantError::NoSpace => GNTST_NO_SPACE,
            GrantError::MappingInUse => GNTST_NO_DEVICE_SPACE,
            GrantError::NotGranted
            | GrantError::TransitiveChain
            | GrantError::TransitiveLoop
            | GrantError::NotMappable
            | GrantError::InUse
            | GrantError::Unstable
            | GrantError::WrongVersion
            | GrantError::Os(_) => GNTST_GENERAL_ERROR,
        }
    }
}

impl GrantError {
    /// The reason a real Xen's `GNTST_*` status `code` (not success) stands for, as
    /// near as its coarser codes tell: `gref` and `dom` name what the operation used.
    pub fn from_gntst(code: i16, gref: u32, dom: DomId) -> Self {
        match code {
            GNTST_BAD_GNTREF => GrantError::BadGntRef(gref),
            GNTST_PERMISSION_DENIED => GrantError::NotForYou,
            GNTST_BAD_COPY_ARG => GrantError::BadCopyArg,
            GNTST_BAD_HANDLE => GrantError::BadHandle(gref),
            GNTST_BAD_DOMAIN => GrantError::BadDomain(dom),
            GNTST_BAD_PAGE => GrantError::BadPage,
            GNTST_BAD_VIRT_ADDR => GrantError::BadVirtAddr,
            GNTST_NO_SPACE => GrantError::NoSpace,
            GNTST_NO_DEVICE_SPACE => GrantError::MappingInUse,
            // GNTST_general_error, and anything Xen adds: most often an entry that is
            // not (or no longer) granted.
            _ => GrantError::NotGranted,
        }
    }
}

/// One operation's outcome in a batch.
pub type GrantStatus = Result<(), GrantError>;

/// What a pinned entry grants, cached while pinned (Xen's `struct active_grant_entry`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ActiveEntry {
    pub pin_ro: u32,
    pub pin_rw: u32,
    /// The domain using the grant.
    pub user: DomId,
    /// The frame.
    pub mfn: Mfn,
    /// Granted byte window.
    pub start: u16,
    pub len: u16,
    /// For a transitive entry: the grant it resolves to (one underlying pin per pin).
    pub trans: Option<(DomId, GrantRef)>,
}

impl ActiveEntry {
    pub fn pins(&self) -> u32 {
        self.pin_ro + self.pin_rw
    }
}

/// A domain's grant table: where its entries live and the hypervisor's active entries.
#[derive(Debug)]
pub struct GrantTable {
    version: GrantVersion,
    frames: u32,
    entries: u32,
    /// The table lock: Xen's per-table lock around active entries.
    pub(crate) active: Mutex<Box<[ActiveEntry]>>,
    free_refs: Mutex<Vec<GrantRef>>,
    /// Grants revoked while a peer still mapped them, with the page each covers: tried
    /// again later (Linux's `gnttab_end_foreign_access` deferred list).
    deferred: Mutex<Vec<(GrantRef, Option<Gfn>)>>,
    /// Its length, read without the lock by the idle path's check.
    deferred_len: std::sync::atomic::AtomicUsize,
}

impl GrantTable {
    pub(crate) fn new(version: GrantVersion, frames: u32) -> Self {
        let entries = frames * (mem::PAGE_SIZE / version.entry_size()) as u32;
        Self {
            version,
            frames,
            entries,
            active: Mutex::new(vec![ActiveEntry::default(); entries as usize].into_boxed_slice()),
            // Reference 0..7 are reserved in Linux (GNTTAB_NR_RESERVED_ENTRIES); keep that.
            free_refs: Mutex::new((8..entries).rev().map(GrantRef).collect()),
            deferred: Mutex::new(Vec::new()),
            deferred_len: std::sync::atomic::AtomicUsize::new(0),
        }
    }
    /// Layout version.
    pub fn version(&self) -> GrantVersion {
        self.version
    }
    /// Number of entries.
    pub fn entries(&self) -> u32 {
        self.entries
    }
    pub(crate) fn entry_frames(&self) -> u32 {
        self.frames
    }
    pub(crate) fn status_frames(&self) -> u32 {
        match self.version {
            GrantVersion::V1 => 0,
            GrantVersion::V2 => (self.entries * 2).div_ceil(mem::PAGE_SIZE as u32),
        }
    }
    /// Where entry `r` lives: (gfn, byte offset).
    pub(crate) fn entry_at(&self, r: GrantRef) -> (Gfn, usize) {
        let per = (mem::PAGE_SIZE / self.version.entry_size()) as u32;
        (
            Gfn(GRANT_FRAMES_START + r.0 / per),
            (r.0 % per) as usize * self.version.entry_size(),
        )
    }
    /// Where v2 status word `r` lives.
    pub(crate) fn status_at(&self, r: GrantRef) -> (Gfn, usize) {
        let per = (mem::PAGE_SIZE / 2) as u32;
        (
            Gfn(GRANT_FRAMES_START + self.frames + r.0 / per),
            (r.0 % per) as usize * 2,
        )
    }
    pub(crate) fn check_ref(&self, r: GrantRef) -> Result<(), GrantError> {
        if r.0 < self.entries {
            Ok(())
        } else {
            Err(GrantError::BadGntRef(r.0))
        }
    }
}

/// The words of one entry as atomics in the granting domain's memory.
pub(crate) struct EntryWords<'a> {
    /// flags (low 16) and domid (high 16): v1's compare-and-swap target.
    pub combo: &'a AtomicU32,
    pub flags: &'a AtomicU16,
    /// v2 status word.
    pub status: Option<&'a AtomicU16>,
}

impl Domain {
    pub(crate) fn grant_words(&self, r: GrantRef) -> Result<EntryWords<'_>, GrantError> {
        self.grant.check_ref(r)?;
        let (gfn, off) = self.grant.entry_at(r);
        let combo = self.atomic_u32(gfn, off).map_err(|_| GrantError::BadPage)?;
        let flags = self.atomic_u16(gfn, off).map_err(|_| GrantError::BadPage)?;
        let status = match self.grant.version {
            GrantVersion::V1 => None,
            GrantVersion::V2 => {
                let (sg, so) = self.grant.status_at(r);
                Some(self.atomic_u16(sg, so).map_err(|_| GrantError::BadPage)?)
            }
        };
        Ok(EntryWords {
            combo,
            flags,
            status,
        })
    }

    /// A copy of entry `r` in v2 form (a v1 entry is widened).
    pub(crate) fn read_entry(&self, r: GrantRef) -> Result<GrantEntryV2, GrantError> {
        self.grant.check_ref(r)?;
        let (gfn, off) = self.grant.entry_at(r);
        match self.grant.version {
            GrantVersion::V1 => {
                let mut e = GrantEntryV1::default();
                self.read(gfn, off, bytemuck::bytes_of_mut(&mut e))
                    .map_err(|_| GrantError::BadPage)?;
                Ok(GrantEntryV2 {
                    flags: e.flags,
                    domid: e.domid,
                    frame_or_gref: e.frame as u64,
                    ..Default::default()
                })
            }
            GrantVersion::V2 => {
                let mut e = GrantEntryV2::default();
                self.read(gfn, off, bytemuck::bytes_of_mut(&mut e))
                    .map_err(|_| GrantError::BadPage)?;
                Ok(e)
            }
        }
    }
}

/// The guest side of a domain's grant table: issuing and revoking grants, as Linux's
/// `gnttab_*` functions do. Every call writes only the domain's own memory.
#[derive(Debug)]
pub struct GuestGrants<'a> {
    dom: &'a Domain,
}

impl<'a> GuestGrants<'a> {
    pub(crate) fn new(dom: &'a Domain) -> Self {
        Self { dom }
    }

    /// Layout version.
    pub fn version(&self) -> GrantVersion {
        self.dom.grant.version
    }
    /// Number of entries.
    pub fn entries(&self) -> u32 {
        self.dom.grant.entries
    }

    /// Takes a free reference from the domain's allocator.
    pub fn alloc_ref(&self) -> Option<GrantRef> {
        self.dom
            .grant
            .free_refs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
    }
    /// Takes `n` free references with consecutive numbers from the domain's allocator
    /// and returns the first: a block a peer can name by index (a back end's per-slot
    /// grants, `base + id`). `None` if no such run is free. A control-path call: it
    /// scans the free list.
    pub fn alloc_block(&self, n: u32) -> Option<GrantRef> {
        let mut free = self
            .dom
            .grant
            .free_refs
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut sorted: Vec<u32> = free.iter().map(|r| r.0).collect();
        sorted.sort_unstable();
        let (mut start, mut run) = (0u32, 0u32);
        for (i, &r) in sorted.iter().enumerate() {
            if i > 0 && r == sorted[i - 1] + 1 {
                run += 1;
            } else {
                (start, run) = (r, 1);
            }
            if run == n {
                free.retain(|x| x.0 < start || x.0 >= start + n);
                return Some(GrantRef(start));
            }
        }
        None
    }
    /// References free in the domain's allocator (what an oracle checks a front end
    /// gave back).
    pub fn refs_free(&self) -> usize {
        self.dom
            .grant
            .free_refs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }
    /// Returns a reference (after a successful [`Self::end_access`]).
    pub fn free_ref(&self, r: GrantRef) {
        if self.dom.grant.check_ref(r).is_ok() {
            self.dom
                .grant
                .free_refs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(r);
        }
    }

    /// Ends access to `r` and gives back the reference and `page` (one of the domain's
    /// own pages, freed to it) — now if no peer maps the grant, otherwise later, from
    /// [`Self::retry_deferred`] (`gnttab_end_foreign_access`: a grant a back end still
    /// maps must not be reused, nor its page, until the back end lets go). Returns
    /// whether it was done now.
    pub fn end_access_deferred(&self, r: GrantRef, page: Option<Gfn>) -> bool {
        if self.end_access_deferred_now(r, page) {
            return true;
        }
        self.deferred_list().push((r, page));
        self.dom.grant.deferred_len.fetch_add(1, Ordering::Release);
        false
    }

    /// Tries the deferred grants again (Linux runs this from a timer; pvio's guest
    /// kernels from their poll loop): each no longer mapped is ended and given back.
    /// Returns how many are still waiting.
    pub fn retry_deferred(&self) -> usize {
        if self.dom.grant.deferred_len.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut d = self.deferred_list();
        if d.is_empty() {
            return 0;
        }
        let waiting = std::mem::take(&mut *d);
        drop(d);
        let still: Vec<_> = waiting
            .into_iter()
            .filter(|&(r, page)| !self.end_access_deferred_now(r, page))
            .collect();
        let mut d = self.deferred_list();
        d.extend(still);
        self.dom
            .grant
            .deferred_len
            .store(d.len(), Ordering::Release);
        d.len()
    }

    /// Grants waiting in the deferred list.
    pub fn deferred(&self) -> usize {
        self.dom.grant.deferred_len.load(Ordering::Acquire)
    }

    fn deferred_list(&self) -> std::sync::MutexGuard<'_, Vec<(GrantRef, Option<Gfn>)>> {
        self.dom
            .grant
            .deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn end_access_deferred_now(&self, r: GrantRef, page: Option<Gfn>) -> bool {
        if self.end_access(r).is_err() {
            return false;
        }
        self.free_ref(r);
        if let Some(g) = page {
            let _ = self.dom.free_page(g);
        }
        true
    }

    fn write_entry(&self, r: GrantRef, e: GrantEntryV2) -> Result<(), GrantError> {
        let _c = enter(Class::Grant);
        let w = self.dom.grant_words(r)?;
        let (gfn, off) = self.dom.grant.entry_at(r);
        // Body first, flags last with Release: the hypervisor that sees the flags sees a
        // complete entry (Linux's wmb() before setting flags).
        match self.dom.grant.version {
            GrantVersion::V1 => {
                let frame = u32::try_from(e.frame_or_gref).map_err(|_| GrantError::BadPage)?;
                self.dom
                    .write(gfn, off + 4, &frame.to_le_bytes())
                    .map_err(|_| GrantError::BadPage)?;
            }
            GrantVersion::V2 => {
                self.dom
                    .write(gfn, off + 4, &e.page_off_or_trans_domid.to_le_bytes())
                    .map_err(|_| GrantError::BadPage)?;
                self.dom
                    .write(gfn, off + 6, &e.length.to_le_bytes())
                    .map_err(|_| GrantError::BadPage)?;
                self.dom
                    .write(gfn, off + 8, &e.frame_or_gref.to_le_bytes())
                    .map_err(|_| GrantError::BadPage)?;
            }
        }
        // flags and domid go in one 32-bit store so that no reader sees new flags with an
        // old domid.
        w.combo
            .store(e.flags as u32 | (e.domid as u32) << 16, Ordering::Release);
        Ok(())
    }

    /// Grants `domid` access to the whole of page `gfn` (`gnttab_grant_foreign_access_ref`).
    pub fn grant_access(
        &self,
        r: GrantRef,
        domid: DomId,
        gfn: Gfn,
        readonly: bool,
    ) -> Result<(), GrantError> {
        self.dom.gfn_to_mfn(gfn).map_err(|_| GrantError::BadPage)?;
        let flags = GTF_PERMIT_ACCESS | if readonly { GTF_READONLY } else { 0 };
        self.write_entry(
            r,
            GrantEntryV2 {
                flags,
                domid: domid.0,
                frame_or_gref: gfn.0 as u64,
                ..Default::default()
            },
        )
    }

    /// Grants `domid` access to bytes `offset..offset+len` of page `gfn` only (v2).
    pub fn grant_access_subpage(
        &self,
        r: GrantRef,
        domid: DomId,
        gfn: Gfn,
        offset: u16,
        len: u16,
        readonly: bool,
    ) -> Result<(), GrantError> {
        if self.dom.grant.version != GrantVersion::V2 {
            return Err(GrantError::WrongVersion);
        }
        self.dom.gfn_to_mfn(gfn).map_err(|_| GrantError::BadPage)?;
        mem::check_in_page(offset as usize, len as usize).map_err(|_| GrantError::BadCopyArg)?;
        let flags = GTF_PERMIT_ACCESS | GTF_SUB_PAGE | if readonly { GTF_READONLY } else { 0 };
        self.write_entry(
            r,
            GrantEntryV2 {
                flags,
                domid: domid.0,
                page_off_or_trans_domid: offset,
                length: len,
                frame_or_gref: gfn.0 as u64,
            },
        )
    }

    /// Grants `domid` access to whatever grant `trans_ref` of domain `trans_dom` gives
    /// this domain (v2, copy only). The hypervisor resolves it on use.
    pub fn grant_access_transitive(
        &self,
        r: GrantRef,
        domid: DomId,
        trans_dom: DomId,
        trans_ref: GrantRef,
        readonly: bool,
    ) -> Result<(), GrantError> {
        self.write_transitive(r, domid, (trans_dom, trans_ref), None, readonly)
    }

    /// As [`GuestGrants::grant_access_transitive`], but `domid` may reach only bytes
    /// `offset..offset+len` of the page, which must lie inside what `trans_ref` gives
    /// (checked on use). pvio's extension: Xen's transitive entries pass on the whole
    /// of the grant they name, which for a page a guest granted whole would show the
    /// grantee bytes the driver domain never meant to forward. It is the transitive
    /// form with `GTF_sub_page` set: the length in the entry's `pad0`, the offset in the
    /// padding after `gref`.
    pub fn grant_access_transitive_window(
        &self,
        r: GrantRef,
        domid: DomId,
        trans: (DomId, GrantRef),
        offset: u16,
        len: u16,
        readonly: bool,
    ) -> Result<(), GrantError> {
        mem::check_in_page(offset as usize, len as usize).map_err(|_| GrantError::BadCopyArg)?;
        self.write_transitive(r, domid, trans, Some((offset, len)), readonly)
    }

    fn write_transitive(
        &self,
        r: GrantRef,
        domid: DomId,
        (trans_dom, trans_ref): (DomId, GrantRef),
        window: Option<(u16, u16)>,
        readonly: bool,
    ) -> Result<(), GrantError> {
        if self.dom.grant.version != GrantVersion::V2 {
            return Err(GrantError::WrongVersion);
        }
        let (offset, len) = window.unwrap_or((0, 0));
        let flags = GTF_TRANSITIVE
            | if window.is_some() { GTF_SUB_PAGE } else { 0 }
            | if readonly { GTF_READONLY } else { 0 };
        self.write_entry(
            r,
            GrantEntryV2 {
                flags,
                domid: domid.0,
                page_off_or_trans_domid: trans_dom.0,
                length: len,
                frame_or_gref: u64::from(trans_ref.0) | u64::from(offset) << 32,
            },
        )
    }

    /// Revokes a grant (`gnttab_end_foreign_access_ref`). Refuses with
    /// [`GrantError::InUse`] while the grantee holds it.
    ///
    /// v1: one compare-and-swap on the flags word that both sides write: it succeeds
    /// only if neither `GTF_reading` nor `GTF_writing` is set at that instant, so the
    /// hypervisor cannot pin in between (the expensive atomic of paper 000 §3.4.2).
    ///
    /// v2: a plain store clearing the flags, a full barrier, then a read of the separate
    /// status word. If the status shows the grant in use, the entry is revoked for new
    /// users already but the page is still held: the caller keeps it and asks again.
    pub fn end_access(&self, r: GrantRef) -> Result<(), GrantError> {
        let _c = enter(Class::Grant);
        let w = self.dom.grant_words(r)?;
        match w.status {
            None => {
                let mut cur = w.flags.load(Ordering::Acquire);
                loop {
                    if cur & (GTF_READING | GTF_WRITING) != 0 {
                        return Err(GrantError::InUse);
                    }
                    match w
                        .flags
                        .compare_exchange(cur, 0, Ordering::AcqRel, Ordering::Acquire)
                    {
                        Ok(_) => return Ok(()),
                        Err(now) => cur = now,
                    }
                }
            }
            Some(status) => {
                w.flags.store(0, Ordering::Relaxed);
                // Full barrier: the cleared flags must be visible before we read the
                // status; the hypervisor sets status, fences, then re-reads the flags.
                std::sync::atomic::fence(Ordering::SeqCst);
                if status.load(Ordering::Relaxed) & (GTF_READING | GTF_WRITING) != 0 {
                    return Err(GrantError::InUse);
                }
                Ok(())
            }
        }
    }

    /// Whether the grantee currently holds the grant (`GTF_reading`/`GTF_writing`).
    pub fn in_use(&self, r: GrantRef) -> Result<bool, GrantError> {
        let w = self.dom.grant_words(r)?;
        let s = match w.status {
            None => w.flags.load(Ordering::Acquire),
            Some(s) => s.load(Ordering::Acquire),
        };
        Ok(s & (GTF_READING | GTF_WRITING) != 0)
    }

    /// A copy of the raw entry (widened to the v2 form), for tools and tests.
    pub fn entry(&self, r: GrantRef) -> Result<GrantEntryV2, GrantError> {
        self.dom.read_entry(r)
    }
}

/// One live mapping of a foreign grant in a domain's window.
#[derive(Debug, Clone)]
pub(crate) struct MapEntry {
    pub granter: std::sync::Arc<Domain>,
    pub gref: GrantRef,
    pub writable: bool,
    pub slot: u32,
    pub mfn: Mfn,
}

/// A domain's maptrack table: its live grant mappings, indexed by handle.
#[derive(Debug)]
pub(crate) struct Maptrack {
    pub entries: Vec<Option<MapEntry>>,
    free: Vec<u32>,
}

impl Maptrack {
    pub fn new(capacity: u32) -> Self {
        Self {
            entries: vec![None; capacity as usize],
            free: (0..capacity).rev().collect(),
        }
    }
    pub fn insert(&mut self, e: MapEntry) -> Option<GrantHandle> {
        let h = self.free.pop()?;
        self.entries[h as usize] = Some(e);
        Some(GrantHandle(h))
    }
    pub fn get(&self, h: GrantHandle) -> Option<&MapEntry> {
        self.entries.get(h.0 as usize)?.as_ref()
    }
    pub fn remove(&mut self, h: GrantHandle) -> Option<MapEntry> {
        let e = self.entries.get_mut(h.0 as usize)?.take()?;
        self.free.push(h.0);
        Some(e)
    }
    pub fn handles(&self) -> Vec<GrantHandle> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.is_some())
            .map(|(i, _)| GrantHandle(i as u32))
            .collect()
    }
}
