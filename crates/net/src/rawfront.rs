//! A front end that writes raw ring bytes: the hostile guest of pvio's fuzz targets,
//! hostile-front-end tests and soak.
//!
//! It does the front end's half of the xenbus handshake honestly (two ring pages and a
//! read-only data page granted to the back end, an unbound channel, the keys, with
//! `feature-sg`, then `Connected`), and afterwards writes whatever its user says into
//! the shared rings: requests with any grant, offset, size, flags and id, producer
//! indices anywhere. Nothing here checks anything; that is the point.

use std::sync::Arc;

use hv::store::{XenStore, XenbusState};
use hv::{DomId, Domain, Gfn, GrantRef, Hypervisor, Port};

use crate::netif::{
    CtrlRequest, CtrlResponse, NetifGref, RxRequest, RxResponse, TxRequest, TxResponse,
};
use crate::xenbus::{self, XenbusError};

/// Bytes before a ring's first slot (the shared ring's indices and padding).
const HDR: usize = 64;
/// Slots of a one-page netif ring.
const SLOTS: usize = 256;
/// Slots of a one-page control ring (16-byte slots).
pub const CTRL_SLOTS: usize = 128;

/// A raw front end over one vif.
#[derive(Debug)]
pub struct RawFront {
    /// The guest.
    pub dom: Arc<Domain>,
    /// Its TX ring page.
    pub tx: Gfn,
    /// Its RX ring page.
    pub rx: Gfn,
    /// A page of data, granted read-only.
    pub data: Gfn,
    /// The data page's grant.
    pub data_ref: u32,
    /// The channel it published.
    pub port: Port,
    /// Grants it made (ring and data pages, RX buffers), with their pages.
    grants: Vec<(GrantRef, Gfn)>,
    /// The control ring's page and the list page with its grant, once published.
    pub ctrl: Option<(Gfn, Gfn, u32)>,
}

fn oom() -> XenbusError {
    XenbusError::BadKey("out of pages, references or ports".into())
}

impl RawFront {
    /// Publishes three fresh pages (two rings, a read-only data page) granted to `be`
    /// and a channel in vif `handle`'s front-end directory, and moves to `Connected`.
    pub fn publish(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        be: DomId,
        handle: u32,
    ) -> Result<RawFront, XenbusError> {
        let f = Self::publish_at(hv, dom, be, handle, None)?;
        let dir = xenbus::frontend_dir(dom.id(), handle);
        hv.store()
            .switch_state(dom.id(), &dir, XenbusState::Connected)?;
        Ok(f)
    }

    /// As [`RawFront::publish`] with `n` queues, as Linux's netfront sets them up on a
    /// back end that offers them: `multi-queue-num-queues`, and each queue's rings and
    /// channel under `queue-<q>/` (at the top for one). One raw front end a queue.
    pub fn publish_queues(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        be: DomId,
        handle: u32,
        n: u32,
    ) -> Result<Vec<RawFront>, XenbusError> {
        let mut out: Vec<RawFront> = Vec::new();
        for q in 0..n {
            match Self::publish_at(hv, dom, be, handle, Some((q, n))) {
                Ok(f) => out.push(f),
                Err(e) => {
                    for f in out {
                        f.close(hv, handle);
                    }
                    return Err(e);
                }
            }
        }
        let store = hv.store();
        let dir = xenbus::frontend_dir(dom.id(), handle);
        store.write(
            dom.id(),
            &format!("{dir}/{}", hv::store::xenbus::MULTI_QUEUE_NUM_QUEUES),
            &n.to_string(),
        )?;
        store.switch_state(dom.id(), &dir, XenbusState::Connected)?;
        Ok(out)
    }

    /// Publishes one queue's pages and channel (`queue`: which of how many, `None`
    /// for a front end that writes no queue count), its state left as it is.
    fn publish_at(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        be: DomId,
        handle: u32,
        queue: Option<(u32, u32)>,
    ) -> Result<RawFront, XenbusError> {
        let store = hv.store();
        let gt = dom.grant_table();
        let mut grants: Vec<(GrantRef, Gfn)> = Vec::with_capacity(3);
        let mut port = None;
        let r = (|| {
            for ro in [false, false, true] {
                let g = dom.alloc_page().map_err(|_| oom())?;
                let Some(r) = gt.alloc_ref() else {
                    let _ = dom.free_page(g);
                    return Err(oom());
                };
                grants.push((r, g));
                gt.grant_access(r, be, g, ro).map_err(|_| oom())?;
            }
            let p = hv.evtchn_alloc_unbound(dom, be).map_err(|_| oom())?;
            port = Some(p);
            let dir = xenbus::frontend_dir(dom.id(), handle);
            if store.xenbus_state(dom.id(), &dir) == XenbusState::Closed {
                store.switch_state(dom.id(), &dir, XenbusState::Initialising)?;
            }
            let (q, n) = queue.unwrap_or((0, 1));
            let qdir = hv::store::xenbus::queue_dir(&dir, Some(n), q);
            for (k, v) in [
                ("tx-ring-ref", grants[0].0 .0.to_string()),
                ("rx-ring-ref", grants[1].0 .0.to_string()),
                ("event-channel", p.0.to_string()),
            ] {
                store.write(dom.id(), &format!("{qdir}/{k}"), &v)?;
            }
            for (k, v) in [("request-rx-copy", "1"), ("feature-sg", "1")] {
                store.write(dom.id(), &format!("{dir}/{k}"), v)?;
            }
            Ok(p)
        })();
        match r {
            Ok(port) => Ok(RawFront {
                dom: Arc::clone(dom),
                tx: grants[0].1,
                rx: grants[1].1,
                data: grants[2].1,
                data_ref: grants[2].0 .0,
                port,
                grants,
                ctrl: None,
            }),
            Err(e) => {
                // Nothing was published: give back what was taken.
                for (r, g) in grants {
                    gt.end_access_deferred(r, Some(g));
                }
                if let Some(p) = port {
                    let _ = hv.evtchn_close(dom, p);
                }
                Err(e)
            }
        }
    }

    /// Gives back what it published, as far as the back end lets go: every grant it
    /// can end (its page freed), the channel closed, the directory `Closed`. Returns
    /// how many grants a back end still held (their pages stay out of use).
    pub fn close(self, hv: &Hypervisor, handle: u32) -> usize {
        let gt = self.dom.grant_table();
        let mut held = 0;
        for &(r, g) in &self.grants {
            if !gt.end_access_deferred(r, Some(g)) {
                held += 1;
            }
        }
        let _ = hv.evtchn_close(&self.dom, self.port);
        let dir = xenbus::frontend_dir(self.dom.id(), handle);
        let store = hv.store();
        let _ = store.switch_state(self.dom.id(), &dir, XenbusState::Closing);
        let _ = store.switch_state(self.dom.id(), &dir, XenbusState::Closed);
        held
    }

    /// Writes TX request `i` (not yet published).
    pub fn put(&self, i: u32, r: TxRequest) {
        let _ = self.dom.write(
            self.tx,
            HDR + (i as usize % SLOTS) * 12,
            bytemuck::bytes_of(&r),
        );
    }

    /// Publishes `prod` as the TX ring's request producer.
    pub fn publish_tx(&self, prod: u32) {
        let _ = self.dom.write(self.tx, 0, &prod.to_le_bytes());
    }

    /// Writes RX request `i` (a buffer) and publishes `prod`.
    pub fn post_rx(&self, i: u32, r: RxRequest, prod: u32) {
        let _ = self.dom.write(
            self.rx,
            HDR + (i as usize % SLOTS) * 8,
            bytemuck::bytes_of(&r),
        );
        let _ = self.dom.write(self.rx, 0, &prod.to_le_bytes());
    }

    /// A 32-bit word of a ring's header (`req_prod` 0, `req_event` 4, `rsp_prod` 8).
    pub fn word(&self, ring: Gfn, at: usize) -> u32 {
        let mut b = [0u8; 4];
        let _ = self.dom.read(ring, at, &mut b);
        u32::from_le_bytes(b)
    }

    /// TX response `i`.
    pub fn tx_response(&self, i: u32) -> TxResponse {
        let mut b = [0u8; 4];
        let _ = self
            .dom
            .read(self.tx, HDR + (i as usize % SLOTS) * 12, &mut b);
        bytemuck::pod_read_unaligned(&b)
    }

    /// RX response `i`.
    pub fn rx_response(&self, i: u32) -> RxResponse {
        let mut b = [0u8; 8];
        let _ = self
            .dom
            .read(self.rx, HDR + (i as usize % SLOTS) * 8, &mut b);
        bytemuck::pod_read_unaligned(&b)
    }

    /// The page behind a reference this front end granted, if any.
    pub fn page_of(&self, gref: u32) -> Option<Gfn> {
        self.grants
            .iter()
            .find(|(r, _)| r.0 == gref)
            .map(|&(_, g)| g)
    }

    /// A fresh page granted writable to `be` (an RX buffer); its reference.
    pub fn rx_buffer(&mut self, be: DomId) -> Option<u32> {
        let gt = self.dom.grant_table();
        let g = self.dom.alloc_page().ok()?;
        let Some(r) = gt.alloc_ref() else {
            let _ = self.dom.free_page(g);
            return None;
        };
        gt.grant_access(r, be, g, false).ok()?;
        self.grants.push((r, g));
        Some(r.0)
    }

    /// Publishes a control ring and a list page, both granted writable to `be`, and
    /// asks for grant reuse (before the back end connects).
    pub fn publish_ctrl(&mut self, hv: &Hypervisor, be: DomId, handle: u32) -> Option<()> {
        let gt = self.dom.grant_table();
        let mut pages = [(GrantRef(0), Gfn(0)); 2];
        for p in &mut pages {
            let g = self.dom.alloc_page().ok()?;
            let r = gt.alloc_ref()?;
            gt.grant_access(r, be, g, false).ok()?;
            self.grants.push((r, g));
            *p = (r, g);
        }
        // The ring's events start armed, as `FRONT_RING_INIT` leaves them.
        let _ = self.dom.write(pages[0].1, 4, &1u32.to_le_bytes());
        let _ = self.dom.write(pages[0].1, 12, &1u32.to_le_bytes());
        let dir = xenbus::frontend_dir(self.dom.id(), handle);
        let store = hv.store();
        store
            .write(
                self.dom.id(),
                &format!("{dir}/{}", xenbus::CTRL_RING_REF),
                &pages[0].0 .0.to_string(),
            )
            .ok()?;
        store
            .write(
                self.dom.id(),
                &format!("{dir}/{}", xenbus::REQUEST_GRANT_REUSE),
                "1",
            )
            .ok()?;
        self.ctrl = Some((pages[0].1, pages[1].1, pages[1].0 .0));
        Some(())
    }

    /// Writes control request `i` and publishes `prod`.
    pub fn post_ctrl(&self, i: u32, r: CtrlRequest, prod: u32) {
        let Some((ring, _, _)) = self.ctrl else {
            return;
        };
        let _ = self.dom.write(
            ring,
            HDR + (i as usize % CTRL_SLOTS) * 16,
            bytemuck::bytes_of(&r),
        );
        let _ = self.dom.write(ring, 0, &prod.to_le_bytes());
    }

    /// Control response `i`.
    pub fn ctrl_response(&self, i: u32) -> CtrlResponse {
        let mut b = [0u8; 12];
        if let Some((ring, _, _)) = self.ctrl {
            let _ = self
                .dom
                .read(ring, HDR + (i as usize % CTRL_SLOTS) * 16, &mut b);
        }
        bytemuck::pod_read_unaligned(&b)
    }

    /// Writes a gref list into the list page.
    pub fn write_list(&self, list: &[NetifGref]) {
        if let Some((_, page, _)) = self.ctrl {
            let _ = self.dom.write(page, 0, bytemuck::cast_slice(list));
        }
    }

    /// Reads `n` entries of the list page back (the statuses the back end wrote).
    pub fn read_list(&self, n: usize) -> Vec<NetifGref> {
        let mut l = vec![NetifGref::default(); n];
        if let Some((_, page, _)) = self.ctrl {
            let _ = self.dom.read(page, 0, bytemuck::cast_slice_mut(&mut l));
        }
        l
    }
}
