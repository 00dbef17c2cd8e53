//! blkfront: the guest's end of a virtual block device, and the small block layer its
//! applications submit to, as Linux's `xen-blkfront` under `blk-mq`.
//!
//! A [`Bio`] names sectors of the device and the guest pages they move to or from
//! ([`BioSeg`], sector-aligned pieces of pages). [`Blkfront::submit`] turns it into one
//! ring request: its segments in the slot, or, past 11 segments, in an indirect page
//! when the back end offers them (up to [`FRONT_MAX_SEGMENTS`], 128 KiB, blkfront's
//! default). Without persistent grants each page is granted for the request (read-only
//! for a write) and the grant ended at its response. With `feature-persistent` on both
//! ends, the front end grants a pool of pages once, read-write, and copies each write's
//! data into pool pages before the request and each read's out of them after: the copy
//! the back end's saved map and unmap are traded for.
//!
//! A response is the back end's word and is checked: its id must name a request in
//! flight and its operation must be that request's, or it is counted and dropped. A ring
//! index out of the protocol marks the device broken; every request in flight then
//! completes with an error, so no caller waits for ever.

use std::sync::Arc;

use hv::profile::{enter, Class};
use hv::store::xenbus::{self as netbus, XenbusError};
use hv::store::{XenStore, XenbusState};
use hv::{DomId, Domain, Gfn, GrantRef, Hypervisor, OwnPage, Port};
use ring::{FrontRing, PageRing};

use crate::blkif::{
    BlkRing, RawDiscard, RawIndirect, RawRequest, Segment, BLKIF_MAX_SEGMENTS_PER_REQUEST,
    BLKIF_OP_DISCARD, BLKIF_OP_FLUSH_DISKCACHE, BLKIF_OP_INDIRECT, BLKIF_OP_READ, BLKIF_OP_WRITE,
    BLKIF_RSP_ERROR, BLKIF_RSP_OKAY, SECTOR_SIZE, SEGMENTS_PER_INDIRECT_PAGE,
};
use crate::xenbus::{self, Offered};

/// Segments blkfront puts in one request when the back end takes indirect ones
/// (Linux's `xen_blkif_max_segments` default): 128 KiB of whole pages.
pub const FRONT_MAX_SEGMENTS: usize = 32;
/// Requests in flight at once (the ring's size).
pub const RING_IDS: usize = 32;
/// Indirect pages a request of [`FRONT_MAX_SEGMENTS`] needs.
const INDIRECT_PAGES: usize = FRONT_MAX_SEGMENTS.div_ceil(SEGMENTS_PER_INDIRECT_PAGE);

/// A piece of a guest page a request moves: sector-aligned, within the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BioSeg {
    /// The page.
    pub gfn: Gfn,
    /// Its first byte (a multiple of 512).
    pub offset: u16,
    /// Bytes (a positive multiple of 512, `offset + len <= 4096`).
    pub len: u16,
}

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BioOp {
    /// Device to memory.
    Read,
    /// Memory to device.
    Write,
    /// Write the device's cache out.
    Flush,
    /// Sectors no longer in use.
    Discard {
        /// How many.
        nr_sectors: u64,
    },
}

/// One block request.
#[derive(Debug, Clone, Copy)]
pub struct Bio<'a> {
    /// What it does.
    pub op: BioOp,
    /// First sector.
    pub sector: u64,
    /// The memory (reads and writes).
    pub segs: &'a [BioSeg],
}

/// Why a bio was not submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The ring is full: resubmit after a completion.
    #[error("ring full")]
    Busy,
    /// The device is disconnected.
    #[error("device disconnected")]
    Disconnected,
    /// The back end does not offer the operation, or the device is read-only.
    #[error("operation not offered")]
    NotOffered,
    /// More segments than one request carries.
    #[error("too many segments")]
    TooLarge,
    /// A segment not sector-aligned, empty, or past its page; or no segments.
    #[error("bad segment")]
    BadSegment,
    /// Sectors past the device's end.
    #[error("beyond the device")]
    BeyondDevice,
    /// The guest has no grant reference or page left.
    #[error("out of grants or pages")]
    NoMemory,
}

/// A finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The caller's tag.
    pub tag: u64,
    /// `BLKIF_RSP_OKAY`, or the error the back end (or a broken ring) gave.
    pub status: i16,
}

impl Completion {
    /// Whether it succeeded.
    pub fn ok(&self) -> bool {
        self.status == BLKIF_RSP_OKAY
    }
}

/// Front-end counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrontStats {
    /// Requests put on the ring.
    pub submitted: u64,
    /// Of those, with indirect segments.
    pub indirect: u64,
    /// Completions handed back, and of those with an error.
    pub completed: u64,
    /// Completions with an error status.
    pub errors: u64,
    /// Responses dropped: id out of range or not in flight, or the wrong operation.
    pub bad_responses: u64,
    /// Grants the back end still held at completion (ended later).
    pub grants_held: u64,
    /// Bytes copied through persistent pages.
    pub bounce_bytes: u64,
    /// Notifications sent.
    pub notifies: u64,
}

hv::counter_set!(FrontStats {
    submitted,
    indirect,
    completed,
    errors,
    bad_responses,
    grants_held,
    bounce_bytes,
    notifies,
});

/// A granted page: the guest's own (persistent pool, indirect pages).
#[derive(Debug, Clone, Copy)]
struct Granted {
    gfn: Gfn,
    gref: GrantRef,
}

/// What a request in flight holds.
#[derive(Debug)]
struct Shadow {
    in_use: bool,
    tag: u64,
    operation: u8,
    read: bool,
    /// The bio's pieces (reads through persistent pages copy into them at the end).
    segs: Vec<BioSeg>,
    /// Per segment: the persistent page it went through, or the grant made for it.
    grants: Vec<(GrantRef, Option<Gfn>)>,
    /// Indirect pages used.
    indirect: usize,
}

type Front = FrontRing<BlkRing, PageRing<OwnPage>>;

/// One virtual block device's front end.
#[derive(Debug)]
pub struct Blkfront {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    devid: u32,
    be: DomId,
    port: Port,
    ring: Option<Front>,
    ring_page: Granted,
    offered: Offered,
    persistent: bool,
    max_segments: usize,
    shadow: Vec<Shadow>,
    free_ids: Vec<u16>,
    /// Persistent pages not in use (granted once, read-write).
    pool: Vec<Granted>,
    /// Persistent pages in all.
    pool_pages: usize,
    /// Each id's indirect pages (granted read-only for good: the back end only reads
    /// them, and the front end writes them only while the id is not in flight).
    indirect: Vec<[Granted; INDIRECT_PAGES]>,
    stats: FrontStats,
}

fn oom() -> XenbusError {
    XenbusError::MissingFeature("memory for the ring")
}

impl Blkfront {
    /// Connects to a back end in `InitWait`: reads what it offers, sets up the ring
    /// (granted to it) and an unbound event channel, publishes them, and moves to
    /// `Connected`. `persistent` asks for persistent grants (used if offered).
    pub fn connect(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        devid: u32,
        persistent: bool,
    ) -> Result<Self, XenbusError> {
        let store = hv.store();
        let me = dom.id();
        let fdir = xenbus::frontend_dir(me, devid);
        let be = DomId(netbus::read_u32(store, me, &format!("{fdir}/backend-id"))? as u16);
        let bdir = store
            .read(me, &format!("{fdir}/backend"))
            .map_err(|_| XenbusError::BadKey(format!("{fdir}/backend")))?;
        let st = store.xenbus_state(me, &bdir);
        if st != XenbusState::InitWait {
            return Err(XenbusError::PeerState(st));
        }
        let offered = Offered::read(store, me, &bdir)?;
        let persistent = persistent && offered.persistent;
        let max_segments =
            if offered.offer.max_indirect_segments as usize > BLKIF_MAX_SEGMENTS_PER_REQUEST {
                FRONT_MAX_SEGMENTS.min(usize::from(offered.offer.max_indirect_segments))
            } else {
                BLKIF_MAX_SEGMENTS_PER_REQUEST
            };
        let indirect = max_segments > BLKIF_MAX_SEGMENTS_PER_REQUEST;

        // Everything taken is given back if a later step fails.
        let gt = dom.grant_table();
        let mut taken: Vec<Granted> = Vec::new();
        let give_back = |taken: &[Granted]| {
            for g in taken {
                // Deferred: a back end that mapped it already keeps it until it unmaps.
                gt.end_access_deferred(g.gref, Some(g.gfn));
            }
        };
        let mut grant_page = |readonly: bool| -> Result<Granted, XenbusError> {
            let gfn = dom.alloc_page().map_err(|_| oom())?;
            let Some(gref) = gt.alloc_ref() else {
                let _ = dom.free_page(gfn);
                return Err(oom());
            };
            let g = Granted { gfn, gref };
            taken.push(g);
            gt.grant_access(gref, be, gfn, readonly)
                .map_err(|_| oom())?;
            Ok(g)
        };
        let r = (|| {
            let ring_page = grant_page(false)?;
            let mut ind = Vec::with_capacity(RING_IDS);
            if indirect {
                for _ in 0..RING_IDS {
                    let mut pages = [ring_page; INDIRECT_PAGES];
                    for p in pages.iter_mut() {
                        *p = grant_page(true)?;
                    }
                    ind.push(pages);
                }
            }
            Ok((ring_page, ind))
        })();
        let (ring_page, ind) = match r {
            Ok(v) => v,
            Err(e) => {
                give_back(&taken);
                return Err(e);
            }
        };
        let ring = dom
            .page(ring_page.gfn)
            .ok()
            .and_then(|p| PageRing::new(p).ok())
            .and_then(|p| FrontRing::init(p).ok());
        let Some(ring) = ring else {
            give_back(&taken);
            return Err(oom());
        };
        let port = match hv.evtchn_alloc_unbound(dom, be) {
            Ok(p) => p,
            Err(_) => {
                drop(ring);
                give_back(&taken);
                return Err(oom());
            }
        };
        let publish = || -> Result<(), XenbusError> {
            for (k, v) in [
                ("ring-ref", ring_page.gref.0.to_string()),
                ("event-channel", port.0.to_string()),
                ("protocol", xenbus::PROTOCOL.to_string()),
                (
                    xenbus::FEATURE_PERSISTENT,
                    if persistent { "1" } else { "0" }.into(),
                ),
            ] {
                store.write(me, &format!("{fdir}/{k}"), &v)?;
            }
            store.switch_state(me, &fdir, XenbusState::Connected)?;
            Ok(())
        };
        if let Err(e) = publish() {
            drop(ring);
            let _ = hv.evtchn_close(dom, port);
            give_back(&taken);
            return Err(e);
        }
        let pool_cap = if persistent {
            RING_IDS * max_segments
        } else {
            0
        };
        Ok(Self {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
            devid,
            be,
            port,
            ring: Some(ring),
            ring_page,
            offered,
            persistent,
            max_segments,
            shadow: (0..RING_IDS)
                .map(|_| Shadow {
                    in_use: false,
                    tag: 0,
                    operation: 0,
                    read: false,
                    segs: Vec::with_capacity(max_segments),
                    grants: Vec::with_capacity(max_segments),
                    indirect: 0,
                })
                .collect(),
            free_ids: (0..RING_IDS as u16).rev().collect(),
            pool: Vec::with_capacity(pool_cap),
            pool_pages: 0,
            indirect: ind,
            stats: FrontStats::default(),
        })
    }

    /// The device's size in sectors.
    pub fn sectors(&self) -> u64 {
        self.offered.offer.sectors
    }
    /// Whether the device takes no writes.
    pub fn read_only(&self) -> bool {
        self.offered.offer.read_only
    }
    /// Whether persistent grants are in use.
    pub fn persistent(&self) -> bool {
        self.persistent
    }
    /// The most segments one request carries (11, or more with indirect requests).
    pub fn max_segments(&self) -> usize {
        self.max_segments
    }
    /// Requests that may be submitted before a completion.
    pub fn room(&self) -> usize {
        if self.ring.is_some() {
            self.free_ids.len()
        } else {
            0
        }
    }
    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        RING_IDS - self.free_ids.len()
    }
    /// Whether the device is connected.
    pub fn is_connected(&self) -> bool {
        self.ring.is_some()
    }
    /// The local end of the event channel.
    pub fn port(&self) -> Port {
        self.port
    }
    /// The device's id.
    pub fn devid(&self) -> u32 {
        self.devid
    }
    /// Counters.
    pub fn stats(&self) -> &FrontStats {
        &self.stats
    }
    /// Persistent pages granted so far.
    pub fn pool_pages(&self) -> usize {
        self.pool_pages
    }

    /// Checks a bio against the device before it takes a ring slot.
    fn check(&self, bio: &Bio<'_>) -> Result<(), SubmitError> {
        let o = &self.offered.offer;
        let sectors = match bio.op {
            BioOp::Read | BioOp::Write => {
                if bio.segs.is_empty() {
                    return Err(SubmitError::BadSegment);
                }
                if bio.segs.len() > self.max_segments {
                    return Err(SubmitError::TooLarge);
                }
                let mut n = 0u64;
                for s in bio.segs {
                    let (off, len) = (u64::from(s.offset), u64::from(s.len));
                    if len == 0
                        || off % SECTOR_SIZE != 0
                        || len % SECTOR_SIZE != 0
                        || off + len > 4096
                    {
                        return Err(SubmitError::BadSegment);
                    }
                    n += len / SECTOR_SIZE;
                }
                n
            }
            BioOp::Flush => 0,
            BioOp::Discard { nr_sectors } => nr_sectors,
        };
        let writes = !matches!(bio.op, BioOp::Read);
        if writes && o.read_only
            || matches!(bio.op, BioOp::Flush) && !o.flush
            || matches!(bio.op, BioOp::Discard { .. }) && !o.discard
        {
            return Err(SubmitError::NotOffered);
        }
        match bio.sector.checked_add(sectors) {
            Some(end) if end <= o.sectors => Ok(()),
            _ => Err(SubmitError::BeyondDevice),
        }
    }

    /// Puts `bio` on the ring under `tag` (not yet pushed: [`Blkfront::kick`] does that
    /// for a batch). Its pages must stay untouched until its completion.
    pub fn submit(&mut self, tag: u64, bio: &Bio<'_>) -> Result<(), SubmitError> {
        let _c = enter(Class::Block);
        if self.ring.is_none() {
            return Err(SubmitError::Disconnected);
        }
        self.check(bio)?;
        let Some(&id) = self.free_ids.last() else {
            return Err(SubmitError::Busy);
        };
        let write = matches!(bio.op, BioOp::Write);
        // Grant (or take pool pages for) every segment first: a failure leaves nothing.
        let mut segs = [Segment::default(); FRONT_MAX_SEGMENTS];
        let (gt, be) = (self.dom.grant_table(), self.be);
        let sh = &mut self.shadow[usize::from(id)];
        sh.segs.clear();
        sh.grants.clear();
        for (i, s) in bio.segs.iter().enumerate() {
            let (g, via) = if self.persistent {
                let p = match self.pool.pop() {
                    Some(p) => p,
                    None => {
                        // The pool grows to what the ring needs, a page at a time.
                        let Ok(gfn) = self.dom.alloc_page() else {
                            return Err(undo(&self.dom, sh, &mut self.pool, SubmitError::NoMemory));
                        };
                        let Some(gref) = gt.alloc_ref() else {
                            let _ = self.dom.free_page(gfn);
                            return Err(undo(&self.dom, sh, &mut self.pool, SubmitError::NoMemory));
                        };
                        if gt.grant_access(gref, be, gfn, false).is_err() {
                            gt.free_ref(gref);
                            let _ = self.dom.free_page(gfn);
                            return Err(undo(&self.dom, sh, &mut self.pool, SubmitError::NoMemory));
                        }
                        self.pool_pages += 1;
                        Granted { gfn, gref }
                    }
                };
                if write {
                    let _m = enter(Class::Mem);
                    let off = usize::from(s.offset);
                    if self
                        .dom
                        .copy(s.gfn, off, p.gfn, off, usize::from(s.len))
                        .is_err()
                    {
                        self.pool.push(p);
                        return Err(undo(&self.dom, sh, &mut self.pool, SubmitError::BadSegment));
                    }
                    self.stats.bounce_bytes += u64::from(s.len);
                }
                (p.gref, Some(p.gfn))
            } else {
                let Some(gref) = gt.alloc_ref() else {
                    return Err(undo(&self.dom, sh, &mut self.pool, SubmitError::NoMemory));
                };
                if gt.grant_access(gref, be, s.gfn, write).is_err() {
                    gt.free_ref(gref);
                    return Err(undo(&self.dom, sh, &mut self.pool, SubmitError::BadSegment));
                }
                (gref, None)
            };
            sh.grants.push((g, via));
            sh.segs.push(*s);
            let first = (s.offset / SECTOR_SIZE as u16) as u8;
            segs[i] = Segment {
                gref: g.0,
                first_sect: first,
                last_sect: first + (s.len / SECTOR_SIZE as u16) as u8 - 1,
                pad: 0,
            };
        }
        let n = bio.segs.len();
        let rw_op = if write { BLKIF_OP_WRITE } else { BLKIF_OP_READ };
        let mut used_indirect = 0;
        let raw = match bio.op {
            BioOp::Read | BioOp::Write if n <= BLKIF_MAX_SEGMENTS_PER_REQUEST => {
                let mut r = RawRequest {
                    operation: rw_op,
                    nr_segments: n as u8,
                    handle: self.devid as u16,
                    id: u64::from(id),
                    sector_number: bio.sector,
                    ..RawRequest::default()
                };
                r.seg[..n].copy_from_slice(&segs[..n]);
                r
            }
            BioOp::Read | BioOp::Write => {
                let pages = &self.indirect[usize::from(id)];
                let mut r = RawIndirect {
                    operation: BLKIF_OP_INDIRECT,
                    indirect_op: rw_op,
                    nr_segments: n as u16,
                    id: u64::from(id),
                    sector_number: bio.sector,
                    handle: self.devid as u16,
                    ..RawIndirect::default()
                };
                for (k, chunk) in segs[..n].chunks(SEGMENTS_PER_INDIRECT_PAGE).enumerate() {
                    let bytes: &[u8] = bytemuck::cast_slice(chunk);
                    if self.dom.write(pages[k].gfn, 0, bytes).is_err() {
                        return Err(undo(&self.dom, sh, &mut self.pool, SubmitError::NoMemory));
                    }
                    r.indirect_grefs[k] = pages[k].gref.0;
                    used_indirect += 1;
                }
                r.to_slot()
            }
            BioOp::Flush => RawRequest {
                operation: BLKIF_OP_FLUSH_DISKCACHE,
                handle: self.devid as u16,
                id: u64::from(id),
                ..RawRequest::default()
            },
            BioOp::Discard { nr_sectors } => RawDiscard {
                operation: BLKIF_OP_DISCARD,
                handle: self.devid as u16,
                id: u64::from(id),
                sector_number: bio.sector,
                nr_sectors,
                ..RawDiscard::default()
            }
            .to_slot(),
        };
        let Some(ring) = self.ring.as_mut() else {
            return Err(undo(
                &self.dom,
                sh,
                &mut self.pool,
                SubmitError::Disconnected,
            ));
        };
        if ring.push_request(&raw).is_err() {
            return Err(undo(&self.dom, sh, &mut self.pool, SubmitError::Busy));
        }
        self.free_ids.pop();
        sh.in_use = true;
        sh.tag = tag;
        sh.operation = raw.response_operation();
        sh.read = matches!(bio.op, BioOp::Read);
        sh.indirect = used_indirect;
        self.stats.submitted += 1;
        if used_indirect > 0 {
            self.stats.indirect += 1;
        }
        Ok(())
    }

    /// Makes the requests submitted visible to the back end and notifies it if it
    /// asked.
    pub fn kick(&mut self) {
        if let Some(ring) = self.ring.as_mut() {
            if ring.push_requests_and_check_notify() {
                self.stats.notifies += 1;
                let _ = self.hv.evtchn_send(&self.dom, self.port);
            }
        }
    }

    /// Takes the back end's responses, checks each, finishes its request (a read's data
    /// copied out of persistent pages, grants ended) and hands `done` its completion.
    /// Returns how many completed. A broken ring completes everything in flight with
    /// an error and disconnects.
    pub fn complete(&mut self, mut done: impl FnMut(Completion)) -> usize {
        let _c = enter(Class::Block);
        let mut n = 0;
        while let Some(ring) = self.ring.as_mut() {
            let rsp = match ring.take_response() {
                Ok(Some(r)) => r,
                Ok(None) => match ring.final_check_for_responses() {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(_) => {
                        n += self.fail_all(&mut done);
                        break;
                    }
                },
                Err(_) => {
                    n += self.fail_all(&mut done);
                    break;
                }
            };
            let id = rsp.id;
            let ok = id < RING_IDS as u64 && {
                let sh = &self.shadow[id as usize];
                sh.in_use && sh.operation == rsp.operation
            };
            if !ok {
                self.stats.bad_responses += 1;
                continue;
            }
            let status = if rsp.status == BLKIF_RSP_OKAY {
                BLKIF_RSP_OKAY
            } else if rsp.status < 0 {
                rsp.status
            } else {
                BLKIF_RSP_ERROR
            };
            let tag = self.finish(id as u16, status == BLKIF_RSP_OKAY);
            self.stats.completed += 1;
            if status != BLKIF_RSP_OKAY {
                self.stats.errors += 1;
            }
            done(Completion { tag, status });
            n += 1;
        }
        n
    }

    /// Ends request `id`: copies a successful read out of its persistent pages, gives
    /// the pages back to the pool or ends the grants, frees the id. Its tag.
    fn finish(&mut self, id: u16, ok: bool) -> u64 {
        let sh = &mut self.shadow[usize::from(id)];
        let gt = self.dom.grant_table();
        for (s, &(gref, via)) in sh.segs.iter().zip(&sh.grants) {
            match via {
                Some(gfn) => {
                    if ok && sh.read {
                        let _m = enter(Class::Mem);
                        let off = usize::from(s.offset);
                        let _ = self.dom.copy(gfn, off, s.gfn, off, usize::from(s.len));
                        self.stats.bounce_bytes += u64::from(s.len);
                    }
                    self.pool.push(Granted { gfn, gref });
                }
                None => {
                    if !gt.end_access_deferred(gref, None) {
                        self.stats.grants_held += 1;
                    }
                }
            }
        }
        sh.grants.clear();
        sh.segs.clear();
        sh.in_use = false;
        self.free_ids.push(id);
        sh.tag
    }

    /// Completes every request in flight with an error and disconnects (a broken ring).
    fn fail_all(&mut self, done: &mut impl FnMut(Completion)) -> usize {
        self.ring = None;
        let mut n = 0;
        for id in 0..RING_IDS as u16 {
            if self.shadow[usize::from(id)].in_use {
                let tag = self.finish(id, false);
                self.stats.completed += 1;
                self.stats.errors += 1;
                done(Completion {
                    tag,
                    status: BLKIF_RSP_ERROR,
                });
                n += 1;
            }
        }
        let dir = xenbus::frontend_dir(self.dom.id(), self.devid);
        let _ = self
            .hv
            .store()
            .switch_state(self.dom.id(), &dir, XenbusState::Closing);
        n
    }

    /// Whether the back end has answered something not yet taken (for a poll loop).
    pub fn has_responses(&mut self) -> bool {
        self.ring
            .as_mut()
            .is_some_and(|r| r.final_check_for_responses().unwrap_or(true))
    }

    /// Disconnects (requests still in flight are dropped without completions): ends the
    /// ring's and the pool's grants (deferred where the back end still maps them) and closes the
    /// channel.
    pub fn close(mut self) {
        self.ring = None;
        for id in 0..RING_IDS as u16 {
            if self.shadow[usize::from(id)].in_use {
                self.finish(id, false);
            }
        }
        let gt = self.dom.grant_table();
        let pages = self
            .pool
            .drain(..)
            .chain(self.indirect.drain(..).flatten())
            .chain(std::iter::once(self.ring_page));
        for g in pages {
            gt.end_access_deferred(g.gref, Some(g.gfn));
        }
        let _ = self.hv.evtchn_close(&self.dom, self.port);
        let dir = xenbus::frontend_dir(self.dom.id(), self.devid);
        let _ = self
            .hv
            .store()
            .switch_state(self.dom.id(), &dir, XenbusState::Closed);
    }
}

/// Gives back what a failed submission took for its segments so far; `e`.
fn undo(dom: &Domain, sh: &mut Shadow, pool: &mut Vec<Granted>, e: SubmitError) -> SubmitError {
    let gt = dom.grant_table();
    for &(gref, via) in &sh.grants {
        match via {
            Some(gfn) => pool.push(Granted { gfn, gref }),
            // The reference is not reused while a back end that guessed it still maps
            // the page (the page is the bio's, not freed here).
            None => {
                gt.end_access_deferred(gref, None);
            }
        }
    }
    sh.grants.clear();
    sh.segs.clear();
    e
}
