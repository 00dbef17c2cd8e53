//! netfront's half of grant reuse (paper 000 §4.4): each page it gives the back end is
//! granted once, writable, and keeps its reference while it stays an I/O page, so
//! that the back end's cache, keyed by reference, finds it mapped the next time the
//! page comes round (the paper relies on Linux's slab allocator recycling buffers;
//! pvio's packet pool hands freed pages out again, last freed first).
//!
//! A page leaves I/O only through the control ring: [`Netfront::unbind`] sends a
//! `DEL_GREF_MAPPING` for it; the back end answers once its mapping and the IOTLB entry
//! are gone; then netfront ends the grant, which the hypervisor refuses while any
//! mapping remains, whatever the back end said. Only a page whose grant has ended is
//! handed back ([`Netfront::take_unbound`]). A page whose drop is never confirmed, or
//! whose grant will not end, stays granted and out of use, counted.

use hv::{DomId, Domain, Gfn, GrantRef};
use ring::{FrontRing, PageRing};

use super::{next_response, Front, FrontStats, Netfront};
use crate::netif::{
    CtrlRequest, CtrlRing, NetifGref, GREF_LIST_MAX, XEN_NETIF_CTRL_STATUS_SUCCESS,
    XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING,
};

/// A connection's grant-reuse state: the bindings of pages to references, the control
/// ring and the page its lists are written into.
#[derive(Debug)]
pub(super) struct Reuse {
    /// The reference each page is bound by, by guest frame.
    bound: Box<[Option<GrantRef>]>,
    pub(super) ring: Front<CtrlRing>,
    /// The control ring's page and the list page, each with its grant.
    pub(super) pages: [(Gfn, GrantRef); 2],
    /// Pages to drop, not yet sent.
    queued: Vec<(Gfn, GrantRef)>,
    /// The `DEL` under way (one at a time: one list page), its id and pages.
    sent: Option<(u16, Vec<(Gfn, GrantRef)>)>,
    next_id: u16,
    /// Pages whose grant has ended, for the caller.
    unbound: Vec<Gfn>,
    /// Pages whose grant would not end (still mapped): tried again at each poll,
    /// never used meanwhile.
    stuck: Vec<(Gfn, GrantRef)>,
}

impl Reuse {
    pub(super) fn new(dom: &Domain, ring: Front<CtrlRing>, pages: [(Gfn, GrantRef); 2]) -> Self {
        Self {
            bound: vec![None; dom.pages() as usize].into_boxed_slice(),
            ring,
            pages,
            queued: Vec::new(),
            sent: None,
            next_id: 0,
            unbound: Vec::new(),
            stuck: Vec::new(),
        }
    }

    /// Pages bound now.
    pub(super) fn bound_count(&self) -> usize {
        self.bound.iter().filter(|b| b.is_some()).count()
    }
}

/// Sets up the control ring: two pages (the ring, and the list page `ADD`/`DEL` name),
/// both granted writable to `be`. Gives back what it took if a step fails.
pub(super) fn open_ctrl(dom: &std::sync::Arc<Domain>, be: DomId) -> Option<Reuse> {
    let gt = dom.grant_table();
    let mut taken: Vec<(Gfn, GrantRef)> = Vec::with_capacity(2);
    let give_back = |taken: &[(Gfn, GrantRef)]| {
        for &(g, r) in taken {
            // Deferred: a back end that mapped it already keeps it until it unmaps.
            gt.end_access_deferred(r, Some(g));
        }
    };
    for _ in 0..2 {
        let Ok(g) = dom.alloc_page() else {
            give_back(&taken);
            return None;
        };
        let Some(r) = gt.alloc_ref() else {
            let _ = dom.free_page(g);
            give_back(&taken);
            return None;
        };
        taken.push((g, r));
        if gt.grant_access(r, be, g, false).is_err() {
            give_back(&taken);
            return None;
        }
    }
    let ring = dom
        .page(taken[0].0)
        .ok()
        .and_then(|p| PageRing::new(p).ok())
        .and_then(|p| FrontRing::init(p).ok());
    match ring {
        Some(ring) => Some(Reuse::new(dom, ring, [taken[0], taken[1]])),
        None => {
            give_back(&taken);
            None
        }
    }
}

impl Reuse {
    /// The reference page `gfn` is given to back end `be` by: its binding, or a new
    /// one (a reference granted writable, kept). `None` when out of references.
    pub(super) fn bind(
        &mut self,
        dom: &Domain,
        be: DomId,
        gfn: Gfn,
        stats: &mut FrontStats,
    ) -> Option<GrantRef> {
        let slot = self.bound.get_mut(gfn.0 as usize)?;
        if let Some(g) = *slot {
            return Some(g);
        }
        let gt = dom.grant_table();
        let g = gt.alloc_ref()?;
        if gt.grant_access(g, be, gfn, false).is_err() {
            gt.free_ref(g);
            return None;
        }
        *slot = Some(g);
        stats.reuse_bindings += 1;
        Some(g)
    }
}

impl Netfront {
    /// Whether this connection reuses grants.
    pub fn grant_reuse(&self) -> bool {
        self.link.as_ref().is_some_and(|l| l.reuse.is_some())
    }

    /// The reference page `gfn` is bound by, if any.
    pub fn binding(&self, gfn: Gfn) -> Option<GrantRef> {
        self.link
            .as_ref()
            .and_then(|l| l.reuse.as_ref())
            .and_then(|r| r.bound.get(gfn.0 as usize).copied().flatten())
    }

    /// Pages bound to a reference now.
    pub fn bound_pages(&self) -> usize {
        self.link
            .as_ref()
            .and_then(|l| l.reuse.as_ref())
            .map_or(0, Reuse::bound_count)
    }

    /// Takes page `gfn` out of I/O before the guest repurposes it: asks the back end
    /// (`DEL_GREF_MAPPING`) to drop its mapping. The page must not be in flight (the
    /// caller holds it). Returns false if it was not bound (it may be used at once).
    pub fn unbind(&mut self, gfn: Gfn) -> bool {
        let Some(r) = self.link.as_mut().and_then(|l| l.reuse.as_mut()) else {
            return false;
        };
        let Some(g) = r.bound.get_mut(gfn.0 as usize).and_then(Option::take) else {
            return false;
        };
        r.queued.push((gfn, g));
        self.stats.unbind_asked += 1;
        self.ctrl_send();
        true
    }

    /// Pages whose drop the back end confirmed and whose grant has ended: the guest's
    /// to use as it likes.
    pub fn take_unbound(&mut self) -> Vec<Gfn> {
        self.link
            .as_mut()
            .and_then(|l| l.reuse.as_mut())
            .map(|r| std::mem::take(&mut r.unbound))
            .unwrap_or_default()
    }

    /// Pages whose drop is asked for and not yet confirmed (kept granted and unused).
    pub fn unbind_waiting(&self) -> usize {
        self.link
            .as_ref()
            .and_then(|l| l.reuse.as_ref())
            .map_or(0, |r| {
                r.queued.len() + r.sent.as_ref().map_or(0, |s| s.1.len()) + r.stuck.len()
            })
    }

    /// Sends the queued drops as one `DEL`, if none is under way.
    fn ctrl_send(&mut self) {
        let dom = std::sync::Arc::clone(&self.dom);
        let Some(r) = self.link.as_mut().and_then(|l| l.reuse.as_mut()) else {
            return;
        };
        if r.sent.is_some() || r.queued.is_empty() || r.ring.free_requests() == 0 {
            return;
        }
        let n = r.queued.len().min(GREF_LIST_MAX);
        let batch: Vec<(Gfn, GrantRef)> = r.queued.drain(..n).collect();
        let list: Vec<NetifGref> = batch
            .iter()
            .map(|&(_, g)| NetifGref {
                gref: g.0,
                flags: 0,
                status: u16::MAX,
            })
            .collect();
        if dom
            .write(r.pages[1].0, 0, bytemuck::cast_slice(&list))
            .is_err()
        {
            r.queued.splice(0..0, batch);
            return;
        }
        let id = r.next_id;
        r.next_id = r.next_id.wrapping_add(1);
        let _ = r.ring.push_request(&CtrlRequest {
            id,
            ty: XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING,
            data: [0, r.pages[1].1 .0, n as u32],
        });
        r.sent = Some((id, batch));
        if r.ring.push_requests_and_check_notify() {
            self.notify();
        }
    }

    /// Takes control-ring answers: for a `DEL`, ends the grant of each page dropped
    /// and hands the page back through [`Netfront::take_unbound`]. A page the back
    /// end says it dropped but whose grant will not end (still mapped), or one it
    /// refused, stays granted and out of use, counted. Returns answers taken.
    pub fn poll_ctrl(&mut self) -> usize {
        let dom = std::sync::Arc::clone(&self.dom);
        let gt = dom.grant_table();
        let mut n = 0;
        while let Some(r) = self.link.as_mut().and_then(|l| l.reuse.as_mut()) {
            let Some(rsp) = next_response(&mut r.ring, &mut self.broken) else {
                break;
            };
            n += 1;
            let ours = r.sent.as_ref().is_some_and(|(id, _)| *id == rsp.id)
                && rsp.ty == XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING;
            if !ours {
                self.stats.ctrl_bad_responses += 1;
                continue;
            }
            let (_, batch) = r.sent.take().expect("checked");
            // The statuses, copied out of the list page before use.
            let mut list = vec![NetifGref::default(); batch.len()];
            let read = dom
                .read(r.pages[1].0, 0, bytemuck::cast_slice_mut(&mut list))
                .is_ok();
            // The back end's word is counted, but what decides is whether the grant
            // ends: the hypervisor refuses while any mapping of it remains.
            for (k, &(gfn, g)) in batch.iter().enumerate() {
                let confirmed = read
                    && rsp.status == XEN_NETIF_CTRL_STATUS_SUCCESS
                    && u32::from(list[k].status) == XEN_NETIF_CTRL_STATUS_SUCCESS;
                if !confirmed {
                    self.stats.unbind_refused += 1;
                }
                if gt.end_access(g).is_ok() {
                    gt.free_ref(g);
                    r.unbound.push(gfn);
                    self.stats.unbind_done += 1;
                } else {
                    self.stats.grants_busy += 1;
                    r.stuck.push((gfn, g));
                }
            }
        }
        // Pages whose grant would not end, tried again.
        if let Some(r) = self.link.as_mut().and_then(|l| l.reuse.as_mut()) {
            let unbound = &mut r.unbound;
            r.stuck.retain(|&(gfn, g)| {
                let ended = gt.end_access(g).is_ok();
                if ended {
                    gt.free_ref(g);
                    unbound.push(gfn);
                }
                !ended
            });
        }
        self.ctrl_send();
        n
    }
}

impl Reuse {
    /// At disconnection: every binding's grant ended (the back end's cache went with
    /// it) and its reference freed; the control ring's pages given back once the back
    /// end lets go. A grant that will not end is counted and its page left granted;
    /// returns those pages, which must stay out of use.
    pub(super) fn close(mut self, dom: &Domain, stats: &mut FrontStats) -> Vec<Gfn> {
        let gt = dom.grant_table();
        let sent = self.sent.take().map(|s| s.1).unwrap_or_default();
        let bound = self
            .bound
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.map(|g| (Gfn(i as u32), g)));
        let leaving: Vec<(Gfn, GrantRef)> = bound
            .chain(self.queued.drain(..))
            .chain(sent)
            .chain(self.stuck.drain(..))
            .collect();
        let mut stuck = Vec::new();
        for (gfn, g) in leaving {
            if gt.end_access(g).is_ok() {
                gt.free_ref(g);
            } else {
                stats.grants_busy += 1;
                stuck.push(gfn);
            }
        }
        let Reuse { ring, pages, .. } = self;
        drop(ring);
        for (g, r) in pages {
            if !gt.end_access_deferred(r, Some(g)) {
                stats.grants_busy += 1;
            }
        }
        stuck
    }
}
