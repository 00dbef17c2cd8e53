//! The control ring (netif.h's `xen_netif_ctrl`), as far as grant reuse needs it:
//! `GET_GREF_MAPPING_SIZE`, `ADD_GREF_MAPPING` and `DEL_GREF_MAPPING`.
//!
//! Each request is copied off the ring, then checked: the queue index (pvio has one
//! queue per vif), the list's length (one page of [`NetifGref`] entries at most) and
//! its page (mapped for the message and unmapped after). Anything else is answered
//! `INVALID_PARAMETER` or `NOT_SUPPORTED` and counted; a broken ring index disables
//! this vif only.
//!
//! A `DEL` whose grants have I/O in flight is answered when the last of them is
//! unmapped, not before: the guest must not end a grant the driver domain or its NIC
//! can still reach. Such answers wait in a bounded list; while it is full the ring is
//! not read further, so a guest that floods the ring only waits for its own answers.

use std::collections::VecDeque;

use hv::profile::{enter, Class};
use hv::{GrantError, GrantHandle, GrantRef, MapOp, Xen};
use ring::{BackRing, PageRing};

use super::cache::{DropOutcome, CACHE_SLOTS};
use super::{Disabled, Vif};
use crate::netif::{
    CtrlRequest, CtrlResponse, CtrlRing, NetifGref, GREF_LIST_MAX, XEN_NETIF_CTRLF_GREF_READONLY,
    XEN_NETIF_CTRL_STATUS_BUFFER_OVERFLOW, XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER,
    XEN_NETIF_CTRL_STATUS_NOT_SUPPORTED, XEN_NETIF_CTRL_STATUS_SUCCESS,
    XEN_NETIF_CTRL_TYPE_ADD_GREF_MAPPING, XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING,
    XEN_NETIF_CTRL_TYPE_GET_GREF_MAPPING_SIZE,
};

/// `DEL` messages that may wait for I/O in flight at once.
pub const CTRL_WAITING: usize = 8;
/// Control requests taken per call.
const CTRL_BUDGET: usize = 32;
/// An entry's status while its drop waits.
const PENDING: u16 = u16::MAX;

/// A `DEL` waiting for I/O in flight.
#[derive(Debug)]
struct WaitingDel {
    req: CtrlRequest,
    entries: Vec<NetifGref>,
    left: usize,
}

/// A vif's control ring and the `DEL`s waiting on it.
#[derive(Debug)]
pub(super) struct Ctrl {
    ring: BackRing<CtrlRing, PageRing<mem::MappedPage>>,
    pub(super) handle: GrantHandle,
    waiting: VecDeque<WaitingDel>,
}

impl Ctrl {
    pub(super) fn new(
        ring: BackRing<CtrlRing, PageRing<mem::MappedPage>>,
        handle: GrantHandle,
    ) -> Self {
        Self {
            ring,
            handle,
            waiting: VecDeque::with_capacity(CTRL_WAITING),
        }
    }
}

impl<X: Xen> Vif<X> {
    /// Whether the control ring has requests waiting, or a `DEL` can now be answered.
    pub fn ctrl_pending(&mut self) -> bool {
        let Some(c) = self.ctrl.as_mut() else {
            return false;
        };
        self.disabled.is_none()
            && (c.ring.requests_available().is_ok_and(|n| n > 0)
                || self.cache.as_ref().is_some_and(|k| k.has_dropped()))
    }

    /// Serves the control ring: answers `DEL`s whose last grant has now been
    /// unmapped, then takes new requests (at most a budget, and none while
    /// [`CTRL_WAITING`] answers wait). Returns the requests answered.
    pub fn ctrl_action(&mut self) -> usize {
        let _c = enter(Class::Netback);
        if self.disabled.is_some() || self.ctrl.is_none() {
            return 0;
        }
        let mut answered = self.ctrl_finish_waiting();
        let mut broken = false;
        for _ in 0..CTRL_BUDGET {
            let c = self.ctrl.as_mut().expect("checked");
            if c.waiting.len() >= CTRL_WAITING {
                break;
            }
            let req = match c.ring.take_request() {
                Ok(Some(r)) => r,
                Ok(None) => match c.ring.final_check_for_requests() {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(_) => {
                        broken = true;
                        break;
                    }
                },
                Err(_) => {
                    broken = true;
                    break;
                }
            };
            self.stats.ctrl_requests += 1;
            if let Some(rsp) = self.ctrl_serve(req) {
                self.ctrl_respond(rsp);
                answered += 1;
            }
        }
        if broken {
            self.disable(Disabled::RingBroken);
            return answered;
        }
        let notify = self
            .ctrl
            .as_mut()
            .is_some_and(|c| c.ring.push_responses_and_check_notify());
        if notify {
            self.notify();
        }
        answered
    }

    fn ctrl_respond(&mut self, rsp: CtrlResponse) {
        if rsp.status != XEN_NETIF_CTRL_STATUS_SUCCESS {
            self.stats.ctrl_errors += 1;
        }
        if let Some(c) = self.ctrl.as_mut() {
            // Cannot fail: one response per request taken.
            let _ = c.ring.push_response(&rsp);
        }
    }

    /// One request, checked and served; its answer, or none if it waits.
    fn ctrl_serve(&mut self, req: CtrlRequest) -> Option<CtrlResponse> {
        let answer = |status, data| CtrlResponse {
            id: req.id,
            ty: req.ty,
            status,
            data,
        };
        let [queue, list, count] = req.data;
        match req.ty {
            XEN_NETIF_CTRL_TYPE_GET_GREF_MAPPING_SIZE => Some(if queue != 0 {
                answer(XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER, 0)
            } else {
                answer(XEN_NETIF_CTRL_STATUS_SUCCESS, CACHE_SLOTS as u32)
            }),
            XEN_NETIF_CTRL_TYPE_ADD_GREF_MAPPING | XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING => {
                let add = req.ty == XEN_NETIF_CTRL_TYPE_ADD_GREF_MAPPING;
                if queue != 0 || count == 0 || count as usize > GREF_LIST_MAX {
                    return Some(answer(XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER, 0));
                }
                if add && count as usize > CACHE_SLOTS {
                    return Some(answer(XEN_NETIF_CTRL_STATUS_BUFFER_OVERFLOW, 0));
                }
                let Ok(mut entries) = self.ctrl_read_list(list, count as usize) else {
                    return Some(answer(XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER, 0));
                };
                if add {
                    Some(self.ctrl_add(&entries, answer))
                } else {
                    self.ctrl_del(req, &mut entries)
                }
            }
            _ => Some(answer(XEN_NETIF_CTRL_STATUS_NOT_SUPPORTED, 0)),
        }
    }

    /// `ADD`: every grant mapped and left idle in the cache, or, if one cannot be,
    /// none (those this message added are dropped again).
    fn ctrl_add(
        &mut self,
        entries: &[NetifGref],
        answer: impl Fn(u32, u32) -> CtrlResponse,
    ) -> CtrlResponse {
        let xen = &self.xen;
        let Some(cache) = self.cache.as_mut() else {
            return answer(XEN_NETIF_CTRL_STATUS_NOT_SUPPORTED, 0);
        };
        let mut added = Vec::with_capacity(entries.len());
        for e in entries {
            let known = cache.contains(e.gref);
            match cache.acquire(xen, e.gref, e.flags & XEN_NETIF_CTRLF_GREF_READONLY == 0) {
                Ok(k) => {
                    cache.release(xen, k);
                    if !known {
                        added.push(e.gref);
                    }
                }
                Err(_) => {
                    for g in added {
                        cache.drop_gref(xen, g);
                    }
                    return answer(XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER, 0);
                }
            }
        }
        answer(XEN_NETIF_CTRL_STATUS_SUCCESS, 0)
    }

    /// `DEL`: each grant unmapped now, or marked to go when its I/O completes; the
    /// answer (the count unmapped, each entry's status written back into the list)
    /// once none is left waiting.
    fn ctrl_del(&mut self, req: CtrlRequest, entries: &mut [NetifGref]) -> Option<CtrlResponse> {
        let xen = &self.xen;
        let cache = self.cache.as_mut()?;
        let mut left = 0;
        for e in entries.iter_mut() {
            e.status = match cache.drop_gref(xen, e.gref) {
                DropOutcome::Done => XEN_NETIF_CTRL_STATUS_SUCCESS as u16,
                DropOutcome::Unknown => XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER as u16,
                DropOutcome::Deferred => {
                    left += 1;
                    PENDING
                }
            };
        }
        if left == 0 {
            return Some(self.ctrl_del_answer(req, entries));
        }
        if let Some(c) = self.ctrl.as_mut() {
            c.waiting.push_back(WaitingDel {
                req,
                entries: entries.to_vec(),
                left,
            });
        }
        None
    }

    /// Matches completed deferred drops with the `DEL`s waiting for them and answers
    /// each one whose grants are all gone. Returns the answers given.
    fn ctrl_finish_waiting(&mut self) -> usize {
        let (Some(cache), Some(c)) = (self.cache.as_mut(), self.ctrl.as_mut()) else {
            return 0;
        };
        let waiting = &mut c.waiting;
        cache.take_dropped(|g| {
            for w in waiting.iter_mut() {
                if let Some(e) = w
                    .entries
                    .iter_mut()
                    .find(|e| e.gref == g && e.status == PENDING)
                {
                    e.status = XEN_NETIF_CTRL_STATUS_SUCCESS as u16;
                    w.left -= 1;
                    return;
                }
            }
        });
        let mut done = Vec::new();
        waiting.retain_mut(|w| {
            if w.left == 0 {
                done.push((w.req, std::mem::take(&mut w.entries)));
                false
            } else {
                true
            }
        });
        let n = done.len();
        for (req, mut entries) in done {
            let rsp = self.ctrl_del_answer(req, &mut entries);
            self.ctrl_respond(rsp);
        }
        n
    }

    /// A `DEL`'s answer: each entry's status written back into the guest's list.
    fn ctrl_del_answer(&mut self, req: CtrlRequest, entries: &mut [NetifGref]) -> CtrlResponse {
        let unmapped = entries
            .iter()
            .filter(|e| u32::from(e.status) == XEN_NETIF_CTRL_STATUS_SUCCESS)
            .count() as u32;
        let written = self.ctrl_with_list(req.data[1], |w, slot| {
            w.write(slot, 0, bytemuck::cast_slice(entries)).is_ok()
        });
        CtrlResponse {
            id: req.id,
            ty: req.ty,
            status: if written == Ok(true) {
                XEN_NETIF_CTRL_STATUS_SUCCESS
            } else {
                XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER
            },
            data: unmapped,
        }
    }

    /// A copy of the `count` entries of the list in granted page `gref`.
    fn ctrl_read_list(&mut self, gref: u32, count: usize) -> Result<Vec<NetifGref>, ()> {
        let mut entries = vec![NetifGref::default(); count];
        match self.ctrl_with_list(gref, |w, slot| {
            w.read(slot, 0, bytemuck::cast_slice_mut(&mut entries))
                .is_ok()
        }) {
            Ok(true) => Ok(entries),
            _ => Err(()),
        }
    }

    /// Maps the guest's list page `gref` writable at the vif's list slot for `f`, then
    /// unmaps it.
    fn ctrl_with_list(
        &mut self,
        gref: u32,
        f: impl FnOnce(&mem::MapWindow, u32) -> bool,
    ) -> Result<bool, GrantError> {
        let slot = self.slot_base + super::CTRL_LIST_SLOT;
        let op = [MapOp {
            dom: self.fe,
            gref: GrantRef(gref),
            readonly: false,
            slot,
        }];
        let mut res = [Err(GrantError::BadPage)];
        self.xen.grant_map(&op, &mut res);
        let h = res[0]?;
        let ok = f(self.xen.domain().window(), slot);
        let mut st = [Ok(())];
        self.xen.grant_unmap(&[h], &mut st);
        Ok(ok)
    }

    /// At disconnection: every cached grant unmapped, the control ring let go of (its
    /// page's mapping is undone with the rings').
    pub(super) fn cache_teardown(&mut self) -> Option<GrantHandle> {
        if let Some(cache) = self.cache.as_mut() {
            cache.teardown(&self.xen);
        }
        self.ctrl.take().map(|c| {
            let Ctrl { ring, handle, .. } = c;
            drop(ring);
            handle
        })
    }
}
