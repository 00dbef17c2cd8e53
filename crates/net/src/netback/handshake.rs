//! netback's side of the xenbus handshake: the back end's keys published before the
//! front end connects, and the connection itself, every key the front end wrote read
//! strictly, both rings mapped, the event channel bound. Linux's
//! `drivers/net/xen-netback/xenbus.c` holds the same work.

use super::*;

/// Maps the front end's control ring (`ctrl-ring-ref`) at `slot`.
pub(super) fn map_ctrl_ring<X: Xen>(
    xen: &X,
    fe: DomId,
    fdir: &str,
    slot: u32,
) -> Result<ctrl::Ctrl, XenbusError> {
    let r = xenbus::read_u32(
        xen.store(),
        xen.id(),
        &format!("{fdir}/{}", xenbus::CTRL_RING_REF),
    )?;
    let op = [MapOp {
        dom: fe,
        gref: GrantRef(r),
        readonly: false,
        slot,
    }];
    let mut res = [Err(GrantError::BadHandle(0))];
    xen.grant_map(&op, &mut res);
    let bad = |e: String| XenbusError::BadKey(format!("{fdir}/{}: {e}", xenbus::CTRL_RING_REF));
    let h = res[0].map_err(|e| bad(e.to_string()))?;
    match xen
        .domain()
        .window()
        .page(slot)
        .ok()
        .and_then(|p| PageRing::new(p).ok())
        .and_then(|p| BackRing::<crate::netif::CtrlRing, _>::attach(p).ok())
    {
        Some(ring) => Ok(ctrl::Ctrl::new(ring, h)),
        None => {
            xen.grant_unmap(&[h], &mut [Ok(())]);
            Err(bad("not a ring".into()))
        }
    }
}

/// Publishes the back end's features and waits for the front end (`InitWait`).
pub fn probe(store: &impl XenStore, be: DomId, fe: DomId, handle: u32) -> Result<(), XenbusError> {
    let dir = xenbus::backend_dir(be, fe, handle);
    for (k, v) in xenbus::BACKEND_FEATURES {
        store.write(be, &format!("{dir}/{k}"), v)?;
    }
    store.switch_state(be, &dir, XenbusState::InitWait)?;
    Ok(())
}

impl<X: Xen> Vif<X> {
    /// Connects to a front end that published its rings: reads and checks its keys,
    /// maps both ring pages at window slots `slot_base` and `slot_base + 1` (the vif
    /// uses [`VIF_WINDOW_SLOTS`] slots from there), binds the event channel, and moves
    /// to `Connected`. `index` names the vif in release tokens.
    pub fn connect(
        xen: X,
        fe: DomId,
        handle: u32,
        index: u16,
        slot_base: u32,
    ) -> Result<Self, XenbusError> {
        let store = xen.store();
        let be = xen.id();
        let dom = xen.domain();
        let fdir = xenbus::frontend_dir(fe, handle);
        let bdir = xenbus::backend_dir(be, fe, handle);
        let st = store.xenbus_state(be, &fdir);
        if !matches!(st, XenbusState::Initialised | XenbusState::Connected) {
            return Err(XenbusError::PeerState(st));
        }
        if !xenbus::feature(store, be, &fdir, "request-rx-copy") {
            return Err(XenbusError::MissingFeature("request-rx-copy"));
        }
        let can_sg = xenbus::feature(store, be, &fdir, "feature-sg");
        // Linux netback: GSO only if asked for; blank checksums unless refused.
        let gso_rx = can_sg && xenbus::feature(store, be, &fdir, "feature-gso-tcpv4");
        let csum_rx = !xenbus::feature(store, be, &fdir, "feature-no-csum-offload");
        let wants_copy = xenbus::feature(store, be, &fdir, xenbus::REQUEST_GUEST_COPY);
        let machine_frames = xenbus::feature(store, be, &fdir, xenbus::REQUEST_MACHINE_FRAMES)
            && xenbus::feature(store, be, &bdir, xenbus::FEATURE_MACHINE_FRAMES);
        if wants_copy && !xenbus::feature(store, be, &bdir, xenbus::FEATURE_GUEST_COPY) {
            return Err(XenbusError::MissingFeature(xenbus::FEATURE_GUEST_COPY));
        }
        // The ring layout: ring.h's unless the front end asked for the split one this
        // end offered. Both rings use it.
        let layout = if xenbus::feature(store, be, &fdir, xenbus::REQUEST_SPLIT_INDICES)
            && xenbus::feature(store, be, &bdir, xenbus::FEATURE_SPLIT_INDICES)
        {
            ring::Layout::SPLIT
        } else {
            ring::Layout::XEN
        };
        let tx_ref = xenbus::read_u32(store, be, &format!("{fdir}/tx-ring-ref"))?;
        let rx_ref = xenbus::read_u32(store, be, &format!("{fdir}/rx-ring-ref"))?;
        let evtchn = xenbus::read_u32(store, be, &format!("{fdir}/event-channel"))?;

        let ops = [
            MapOp {
                dom: fe,
                gref: GrantRef(tx_ref),
                readonly: false,
                slot: slot_base,
            },
            MapOp {
                dom: fe,
                gref: GrantRef(rx_ref),
                readonly: false,
                slot: slot_base + 1,
            },
        ];
        let mut res = [Err(GrantError::BadHandle(0)); 2];
        xen.grant_map(&ops, &mut res);
        let bad = |e: &GrantError| XenbusError::BadKey(format!("{fdir}/*-ring-ref: {e}"));
        let (th, rh) = match res {
            [Ok(t), Ok(r)] => (t, r),
            [a, b] => {
                let mut st = [Ok(()); 2];
                let hs: Vec<GrantHandle> = [a, b].iter().filter_map(|r| r.ok()).collect();
                xen.grant_unmap(&hs, &mut st);
                let e = [a, b]
                    .into_iter()
                    .find_map(|r| r.err())
                    .unwrap_or(GrantError::BadPage);
                return Err(bad(&e));
            }
        };
        let unmap = |xen: &X| {
            let mut st = [Ok(()); 2];
            xen.grant_unmap(&[th, rh], &mut st);
        };
        let page = |slot| dom.window().page(slot);
        let rings = page(slot_base)
            .ok()
            .and_then(|p| PageRing::with_layout(p, layout).ok())
            .and_then(|p| BackRing::<TxRing, _>::attach(p).ok())
            .zip(
                page(slot_base + 1)
                    .ok()
                    .and_then(|p| PageRing::with_layout(p, layout).ok())
                    .and_then(|p| BackRing::<RxRing, _>::attach(p).ok()),
            );
        let Some((tx, rx)) = rings else {
            unmap(&xen);
            return Err(XenbusError::BadKey(format!("{fdir}/*-ring-ref")));
        };
        // From here each failure gives back what was taken, rings first: a ring holds
        // its mapped page open, and a held page cannot be unmapped.
        let port = match xen.evtchn_bind_interdomain(fe, Port(evtchn)) {
            Ok(p) => p,
            Err(e) => {
                drop((tx, rx));
                unmap(&xen);
                return Err(XenbusError::BadKey(format!("{fdir}/event-channel: {e}")));
            }
        };
        // Grant reuse needs the control ring, through which the guest drops mappings.
        let reuse = xenbus::feature(store, be, &fdir, xenbus::REQUEST_GRANT_REUSE);
        let ctrl = if reuse {
            match map_ctrl_ring(&xen, fe, &fdir, slot_base + CTRL_RING_SLOT) {
                Ok(c) => Some(c),
                Err(e) => {
                    drop((tx, rx));
                    unmap(&xen);
                    let _ = xen.evtchn_close(port);
                    return Err(e);
                }
            }
        } else {
            None
        };
        // A guest-copy front end learns where its slots' grants start before it sees
        // `Connected`.
        let gt = dom.grant_table();
        let guest_copy = wants_copy
            .then(|| gt.alloc_block(u32::from(RING_IDS)))
            .map(|b| b.ok_or(XenbusError::MissingFeature(xenbus::FEATURE_GUEST_COPY)));
        let guest_copy = match guest_copy.transpose().and_then(|b| {
            if let Some(base) = b {
                store.write(
                    be,
                    &format!("{bdir}/{}", xenbus::RX_GRANT_BASE),
                    &base.0.to_string(),
                )?;
            }
            store.switch_state(be, &bdir, XenbusState::Connected)?;
            Ok(b)
        }) {
            Ok(b) => b.map(|base| GuestCopy {
                base,
                lent: vec![None; RING_IDS as usize].into_boxed_slice(),
                order: LentOrder::new(),
                credits: Vec::with_capacity(RING_IDS as usize),
                credited: InFlight::default(),
                ending: Vec::with_capacity(RING_IDS as usize),
                piece_next: (0..RING_IDS).collect(),
                transitive: vec![false; RING_IDS as usize].into_boxed_slice(),
                transitive_held: 0,
            }),
            Err(e) => {
                drop((tx, rx));
                unmap(&xen);
                if let Some(c) = ctrl {
                    let h = c.handle;
                    drop(c);
                    xen.grant_unmap(&[h], &mut [Ok(())]);
                }
                let _ = xen.evtchn_close(port);
                return Err(e);
            }
        };
        let cache = reuse.then(|| Box::new(GrantCache::new(fe, slot_base + CACHE_SLOT0)));
        Ok(Self {
            xen,
            fe,
            handle,
            index,
            port,
            tx,
            rx,
            ring_handles: [th, rh],
            slot_base,
            rx_queue: SkbQueue::with_backlog(RX_QUEUE_BYTES, RX_QUEUE_BACKLOG),
            can_sg,
            gso_rx,
            csum_rx,
            offload_scratch: vec![0; OFFLOAD_SCRATCH].into_boxed_slice(),
            aligned_copies: false,
            tx_copy: false,
            guest_copy,
            direct: None,
            machine_frames,
            cache,
            ctrl,
            tx_ready: Vec::with_capacity(MAX_PENDING),
            bounce: vec![0; PAGE_SIZE].into_boxed_slice(),
            rxb: RxBatch::new(),
            txb: TxBatch::new(),
            unmaps: Unmaps {
                handles: Vec::with_capacity(MAX_PENDING),
                pending: Vec::with_capacity(MAX_PENDING),
                status: vec![Ok(()); MAX_PENDING],
            },
            pending: vec![Pending::default(); MAX_PENDING].into_boxed_slice(),
            pending_free: (0..MAX_PENDING as u16).rev().collect(),
            tx_armed: false,
            tx_check: TxCheckStats::default(),
            stats: VifStats::default(),
            disabled: None,
        })
    }
}
