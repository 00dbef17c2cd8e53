//! netback's side of the xenbus handshake: the back end's keys published before the
//! front end connects, and the connection itself, every key the front end wrote read
//! strictly, both rings mapped, the event channel bound. Linux's
//! `drivers/net/xen-netback/xenbus.c` holds the same work.

use super::*;
use hv::store::xenbus as netbus;

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
    probe_queues(store, be, fe, handle, 1)
}

/// As [`probe`], offering up to `max_queues` queues (`multi-queue-max-queues`, when
/// more than one), each a TX and an RX ring with their channels: a back end that
/// connects them with [`Vif::connect_queues`].
pub fn probe_queues(
    store: &impl XenStore,
    be: DomId,
    fe: DomId,
    handle: u32,
    max_queues: u32,
) -> Result<(), XenbusError> {
    let dir = xenbus::backend_dir(be, fe, handle);
    for (k, v) in xenbus::BACKEND_FEATURES {
        store.write(be, &format!("{dir}/{k}"), v)?;
    }
    let mq = format!("{dir}/{}", netbus::MULTI_QUEUE_MAX_QUEUES);
    if max_queues > 1 {
        store.write(be, &mq, &max_queues.to_string())?;
    } else {
        let _ = store.rm(be, &mq);
    }
    store.switch_state(be, &dir, XenbusState::InitWait)?;
    Ok(())
}

/// Where one of a vif's queues is: which of how many the front end set up (`queues`
/// `None`: it wrote no `multi-queue-num-queues`), its index in release tokens and its
/// window slots.
#[derive(Debug, Clone, Copy)]
struct QueueAt {
    /// The queues the front end set up, if it said.
    queues: Option<u32>,
    /// This one.
    queue: u32,
    /// Its index (high half of its release tokens).
    index: u16,
    /// Its first window slot ([`VIF_WINDOW_SLOTS`] from there).
    slot_base: u32,
}

impl QueueAt {
    fn several(&self) -> bool {
        self.queues.is_some_and(|n| n > 1)
    }
}

/// What the front end asked for and this end offers, read strictly from both
/// directories before anything is mapped.
struct Negotiated {
    can_sg: bool,
    gso_rx: bool,
    gso6_rx: bool,
    csum_rx: bool,
    guest_copy: bool,
    machine_frames: bool,
    grant_reuse: bool,
    layout: ring::Layout,
    tx_ref: u32,
    rx_ref: u32,
    /// The TX ring's channel (both rings' unless split).
    evtchn: u32,
    /// The RX ring's, with split event channels.
    evtchn_rx: Option<u32>,
    /// The toolstack's transmit rate (`rate` in the back end's directory), if any.
    rate: Option<Credit>,
}

impl Negotiated {
    /// The front end's features from the top of its directory `fdir`, its rings' and
    /// channels' keys from `qdir` (its queue's directory, or `fdir` itself).
    fn read(
        store: &impl XenStore,
        be: DomId,
        fdir: &str,
        qdir: &str,
        bdir: &str,
    ) -> Result<Self, XenbusError> {
        let st = store.xenbus_state(be, fdir);
        if !matches!(st, XenbusState::Initialised | XenbusState::Connected) {
            return Err(XenbusError::PeerState(st));
        }
        let front = |key: &str| xenbus::feature(store, be, fdir, key);
        let back = |key: &str| xenbus::feature(store, be, bdir, key);
        if !front("request-rx-copy") {
            return Err(XenbusError::MissingFeature("request-rx-copy"));
        }
        let can_sg = front("feature-sg");
        let guest_copy = front(xenbus::REQUEST_GUEST_COPY);
        if guest_copy && !back(xenbus::FEATURE_GUEST_COPY) {
            return Err(XenbusError::MissingFeature(xenbus::FEATURE_GUEST_COPY));
        }
        // The ring layout: ring.h's unless the front end asked for the split one this
        // end offered. Both rings use it.
        let split = front(xenbus::REQUEST_SPLIT_INDICES) && back(xenbus::FEATURE_SPLIT_INDICES);
        let key = |k: &str| xenbus::read_u32(store, be, &format!("{qdir}/{k}"));
        // One channel a ring if this end offered it and the front end wrote both.
        let split_events = back(xenbus::FEATURE_SPLIT_EVENTS)
            && store.read(be, &format!("{qdir}/event-channel-tx")).is_ok();
        let (evtchn, evtchn_rx) = if split_events {
            (key("event-channel-tx")?, Some(key("event-channel-rx")?))
        } else {
            (key("event-channel")?, None)
        };
        Ok(Self {
            can_sg,
            // Linux netback: GSO only if asked for; blank checksums unless refused.
            gso_rx: can_sg && front("feature-gso-tcpv4"),
            gso6_rx: can_sg && front("feature-gso-tcpv6"),
            csum_rx: !front("feature-no-csum-offload"),
            guest_copy,
            machine_frames: front(xenbus::REQUEST_MACHINE_FRAMES)
                && back(xenbus::FEATURE_MACHINE_FRAMES),
            // Grant reuse needs the control ring, through which the guest drops mappings.
            grant_reuse: front(xenbus::REQUEST_GRANT_REUSE),
            layout: if split {
                ring::Layout::SPLIT
            } else {
                ring::Layout::XEN
            },
            tx_ref: key("tx-ring-ref")?,
            rx_ref: key("rx-ring-ref")?,
            evtchn,
            evtchn_rx,
            rate: store
                .read(be, &format!("{bdir}/{}", xenbus::RATE))
                .ok()
                .and_then(|v| Credit::parse(&v, std::time::Instant::now())),
        })
    }
}

/// What a connection that succeeded keeps: both rings, their pages' mappings, and the
/// channel (or, split, the TX ring's and the RX ring's).
struct Kept {
    tx: Back<TxRing>,
    rx: Back<RxRing>,
    ring_handles: [GrantHandle; 2],
    port: Port,
    rx_port: Option<Port>,
}

/// What a connection has taken so far, given back if it fails before the end, rings
/// first: a ring holds its mapped page open, and a held page cannot be unmapped.
struct Taken<'a, X: Xen> {
    xen: &'a X,
    rings: Option<(Back<TxRing>, Back<RxRing>)>,
    handles: [GrantHandle; 2],
    port: Option<Port>,
    rx_port: Option<Port>,
    ctrl: Option<ctrl::Ctrl>,
    /// The connection succeeded: the vif holds all of it now.
    kept: bool,
}

impl<X: Xen> Drop for Taken<'_, X> {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        drop(self.rings.take());
        let mut st = [Ok(()); 2];
        self.xen.grant_unmap(&self.handles, &mut st);
        if let Some(c) = self.ctrl.take() {
            let h = c.handle;
            drop(c);
            self.xen.grant_unmap(&[h], &mut [Ok(())]);
        }
        for port in [self.port.take(), self.rx_port.take()]
            .into_iter()
            .flatten()
        {
            let _ = self.xen.evtchn_close(port);
        }
    }
}

impl<'a, X: Xen> Taken<'a, X> {
    /// Maps both ring pages at `slot_base` and `slot_base + 1` and attaches the rings in
    /// `layout`; gives back whatever was mapped if either fails.
    /// With `resume`, the rings are taken over where a dead back end left them
    /// ([`BackRing::resume`], with the journals it recorded in), not attached afresh.
    fn map_rings(
        xen: &'a X,
        fe: DomId,
        fdir: &str,
        n: &Negotiated,
        slot_base: u32,
        resume: Option<Option<Journals>>,
    ) -> Result<Self, XenbusError> {
        let op = |gref, slot| MapOp {
            dom: fe,
            gref: GrantRef(gref),
            readonly: false,
            slot,
        };
        let ops = [op(n.tx_ref, slot_base), op(n.rx_ref, slot_base + 1)];
        let mut res = [Err(GrantError::BadHandle(0)); 2];
        xen.grant_map(&ops, &mut res);
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
                return Err(XenbusError::BadKey(format!("{fdir}/*-ring-ref: {e}")));
            }
        };
        let mut taken = Self {
            xen,
            rings: None,
            handles: [th, rh],
            port: None,
            rx_port: None,
            ctrl: None,
            kept: false,
        };
        let page = |slot| xen.domain().window().page(slot).ok();
        let ring = |slot| page(slot).and_then(|p| PageRing::with_layout(p, n.layout).ok());
        let (tx, rx) = (ring(slot_base), ring(slot_base + 1));
        taken.rings = match resume {
            None => tx
                .and_then(|p| BackRing::<TxRing, _>::attach(p).ok())
                .zip(rx.and_then(|p| BackRing::<RxRing, _>::attach(p).ok())),
            Some(j) => {
                let (tj, rj) = j.map(|j| (j.tx, j.rx)).unzip();
                tx.and_then(|p| BackRing::<TxRing, _>::resume(p, tj).ok())
                    .zip(rx.and_then(|p| BackRing::<RxRing, _>::resume(p, rj).ok()))
            }
        };
        if taken.rings.is_none() {
            return Err(XenbusError::BadKey(format!("{fdir}/*-ring-ref")));
        }
        Ok(taken)
    }

    /// Everything taken, kept: the connection succeeded.
    /// Binds the guest's channel, or its two (split event channels).
    fn bind(&mut self, fe: DomId, fdir: &str, n: &Negotiated) -> Result<(), XenbusError> {
        let xen = self.xen;
        let bind = |p: u32, key: &str| {
            xen.evtchn_bind_interdomain(fe, Port(p))
                .map_err(|e| XenbusError::BadKey(format!("{fdir}/{key}: {e}")))
        };
        let tx_key = match n.evtchn_rx {
            Some(_) => "event-channel-tx",
            None => "event-channel",
        };
        self.port = Some(bind(n.evtchn, tx_key)?);
        if let Some(rx) = n.evtchn_rx {
            self.rx_port = Some(bind(rx, "event-channel-rx")?);
        }
        Ok(())
    }

    fn keep(mut self) -> (Kept, Option<ctrl::Ctrl>) {
        let (tx, rx) = self
            .rings
            .take()
            .expect("mapped before the channel was bound");
        let port = self
            .port
            .take()
            .expect("bound before the connection is kept");
        self.kept = true;
        let k = Kept {
            tx,
            rx,
            ring_handles: self.handles,
            port,
            rx_port: self.rx_port.take(),
        };
        (k, self.ctrl.take())
    }
}

impl GuestCopy {
    /// A guest-copy receive side whose slots' grants start at `base`.
    fn new(base: GrantRef) -> Self {
        Self {
            base,
            lent: vec![None; RING_IDS as usize].into_boxed_slice(),
            order: LentOrder::new(),
            credits: Vec::with_capacity(RING_IDS as usize),
            credited: InFlight::default(),
            ending: Vec::with_capacity(RING_IDS as usize),
            piece_next: (0..RING_IDS).collect(),
            transitive: vec![false; RING_IDS as usize].into_boxed_slice(),
            transitive_held: 0,
        }
    }
}

impl<X: Xen> Vif<X> {
    /// Connects to a front end that published its rings: reads and checks its keys,
    /// maps both ring pages at window slots `slot_base` and `slot_base + 1` (the vif
    /// uses [`VIF_WINDOW_SLOTS`] slots from there), binds the event channel, and moves
    /// to `Connected`. `index` names the vif in release tokens. A failure at any step
    /// gives back what the earlier steps took.
    pub fn connect(
        xen: X,
        fe: DomId,
        handle: u32,
        index: u16,
        slot_base: u32,
    ) -> Result<Self, XenbusError> {
        let at = QueueAt {
            queues: None,
            queue: 0,
            index,
            slot_base,
        };
        let v = Self::connect_at(xen, fe, handle, at)?;
        let (be, bdir) = (v.xen.id(), xenbus::backend_dir(v.xen.id(), fe, handle));
        if let Err(e) = v
            .xen
            .store()
            .switch_state(be, &bdir, XenbusState::Connected)
        {
            v.abandon_unpooled();
            return Err(e.into());
        }
        Ok(v)
    }

    /// Connects every queue the front end set up (`multi-queue-num-queues`, at most
    /// `max`, each queue's rings and channels under `queue-<n>/`; or the one at the top
    /// of its directory), queue `q` where `at(q)` says (its index and window slots),
    /// then moves to `Connected`, as Linux's netback connects its queues. A queue that
    /// fails gives back every queue taken before it. Grant reuse, guest copy and
    /// machine frames (pvio's own protocols, whose state is the device's) are refused
    /// with more than one queue.
    pub fn connect_queues(
        xen: X,
        fe: DomId,
        handle: u32,
        max: u32,
        at: impl Fn(u32) -> (u16, u32),
    ) -> Result<Vec<Self>, XenbusError>
    where
        X: Clone,
    {
        Self::queues(xen, fe, handle, max, at, None)
    }

    /// As [`Vif::resume`], for every queue the front end set up ([`Vif::connect_queues`]),
    /// queue `q` from the journals `journals(q)` gives.
    pub fn resume_queues(
        xen: X,
        fe: DomId,
        handle: u32,
        max: u32,
        at: impl Fn(u32) -> (u16, u32),
        journals: impl FnMut(u32) -> Option<Journals>,
    ) -> Result<Vec<Self>, XenbusError>
    where
        X: Clone,
    {
        Self::queues(xen, fe, handle, max, at, Some(Box::new(journals)))
    }

    #[allow(clippy::type_complexity)]
    fn queues(
        xen: X,
        fe: DomId,
        handle: u32,
        max: u32,
        at: impl Fn(u32) -> (u16, u32),
        mut resume: Option<Box<dyn FnMut(u32) -> Option<Journals> + '_>>,
    ) -> Result<Vec<Self>, XenbusError>
    where
        X: Clone,
    {
        let (store, be) = (xen.store(), xen.id());
        let fdir = xenbus::frontend_dir(fe, handle);
        let bdir = xenbus::backend_dir(be, fe, handle);
        let queues = netbus::front_queues(store, be, &fdir, max)?;
        let mut done: Vec<Self> = Vec::new();
        for q in 0..queues.unwrap_or(1) {
            let (index, slot_base) = at(q);
            let at = QueueAt {
                queues,
                queue: q,
                index,
                slot_base,
            };
            let r = match resume.as_mut() {
                None => Self::connect_at(xen.clone(), fe, handle, at),
                Some(j) => Self::resume_at(xen.clone(), fe, handle, at, j(q)),
            };
            match r {
                Ok(v) => done.push(v),
                Err(e) => {
                    done.into_iter().for_each(Self::abandon_unpooled);
                    return Err(e);
                }
            }
        }
        if resume.is_none() {
            if let Err(e) = store.switch_state(be, &bdir, XenbusState::Connected) {
                done.into_iter().for_each(Self::abandon_unpooled);
                return Err(e.into());
            }
        }
        Ok(done)
    }

    /// Connects one queue, the store's state left as it is.
    fn connect_at(xen: X, fe: DomId, handle: u32, at: QueueAt) -> Result<Self, XenbusError> {
        let (store, be) = (xen.store(), xen.id());
        let fdir = xenbus::frontend_dir(fe, handle);
        let bdir = xenbus::backend_dir(be, fe, handle);
        let qdir = netbus::queue_dir(&fdir, at.queues, at.queue);
        let n = Negotiated::read(store, be, &fdir, &qdir, &bdir)?;
        if at.several() && (n.guest_copy || n.grant_reuse || n.machine_frames) {
            return Err(XenbusError::BadKey(format!(
                "{fdir}: grant reuse, guest copy or machine frames with several queues"
            )));
        }
        let slot_base = at.slot_base;
        let mut taken = Taken::map_rings(&xen, fe, &qdir, &n, slot_base, None)?;
        taken.bind(fe, &qdir, &n)?;
        if n.grant_reuse {
            taken.ctrl = Some(map_ctrl_ring(&xen, fe, &fdir, slot_base + CTRL_RING_SLOT)?);
        }
        // A guest-copy front end learns where its slots' grants start before it sees
        // `Connected`.
        let base = match n.guest_copy {
            true => Some(
                xen.domain()
                    .grant_table()
                    .alloc_block(u32::from(RING_IDS))
                    .ok_or(XenbusError::MissingFeature(xenbus::FEATURE_GUEST_COPY))?,
            ),
            false => None,
        };
        if let Some(base) = base {
            let key = format!("{bdir}/{}", xenbus::RX_GRANT_BASE);
            store.write(be, &key, &base.0.to_string())?;
        }
        let (kept, ctrl) = taken.keep();
        Ok(Self::connected(
            xen,
            fe,
            handle,
            at.index,
            slot_base,
            &n,
            kept,
            ctrl,
            base.map(GuestCopy::new),
        ))
    }

    /// Takes over a vif another back end served and left (its process died, or stopped
    /// to hand it over, [`Vif::hand_over`]), with both ends still `Connected` and the
    /// store untouched: the front end sees nothing but a pause. Reads the front end's
    /// keys as [`Vif::connect`] does, maps both rings again and carries each on from its
    /// last response ([`BackRing::resume`], with `journals`, the ones the dead back end
    /// recorded in, [`Vif::record_in`]): every TX request after it is taken again (a
    /// packet the dead one sent and had not answered goes out twice, as a retransmission
    /// might; none is lost), every RX buffer after it is filled again, and each is
    /// answered once. Binds the channel again and notifies the front end once, in case
    /// it waits on a notification the dead one never sent. Only a vif served in copy
    /// mode ([`Vif::set_tx_copy`]) answers in the order it takes requests, so only one
    /// without grant reuse, guest copy or machine frames can be taken over.
    pub fn resume(
        xen: X,
        fe: DomId,
        handle: u32,
        index: u16,
        slot_base: u32,
        journals: Option<Journals>,
    ) -> Result<Self, XenbusError> {
        let at = QueueAt {
            queues: None,
            queue: 0,
            index,
            slot_base,
        };
        Self::resume_at(xen, fe, handle, at, journals)
    }

    /// Takes one queue over.
    fn resume_at(
        xen: X,
        fe: DomId,
        handle: u32,
        at: QueueAt,
        journals: Option<Journals>,
    ) -> Result<Self, XenbusError> {
        let (index, slot_base) = (at.index, at.slot_base);
        let (store, be) = (xen.store(), xen.id());
        let fdir = xenbus::frontend_dir(fe, handle);
        let bdir = xenbus::backend_dir(be, fe, handle);
        let qdir = netbus::queue_dir(&fdir, at.queues, at.queue);
        let (fst, bst) = (store.xenbus_state(be, &fdir), store.xenbus_state(be, &bdir));
        if fst != XenbusState::Connected {
            return Err(XenbusError::PeerState(fst));
        }
        if bst != XenbusState::Connected {
            return Err(XenbusError::BadKey(format!("{bdir}/state: {bst:?}")));
        }
        let n = Negotiated::read(store, be, &fdir, &qdir, &bdir)?;
        if n.guest_copy || n.grant_reuse || n.machine_frames {
            return Err(XenbusError::BadKey(format!(
                "{fdir}: a vif with grant reuse, guest copy or machine frames is not taken over"
            )));
        }
        let mut taken = Taken::map_rings(&xen, fe, &qdir, &n, slot_base, Some(journals))?;
        taken.bind(fe, &qdir, &n)?;
        let (kept, ctrl) = taken.keep();
        let mut v = Self::connected(xen, fe, handle, index, slot_base, &n, kept, ctrl, None);
        v.tx_copy = true;
        // What the dead one recorded and did not publish goes to the front end now, and
        // one notification whatever the front end asked for.
        v.stats.resumed += 1;
        v.stats.resume_replayed = u64::from(v.tx.replayed() + v.rx.replayed());
        v.tx.push_responses_and_check_notify();
        v.rx.push_responses_and_check_notify();
        v.notify();
        if v.rx_port.is_some() {
            v.notify_rx();
        }
        Ok(v)
    }

    /// The vif, connected: its rings, handles and channel as the handshake took them,
    /// its offloads as negotiated, every queue and batch allocated now, none later.
    #[allow(clippy::too_many_arguments)]
    fn connected(
        xen: X,
        fe: DomId,
        handle: u32,
        index: u16,
        slot_base: u32,
        n: &Negotiated,
        Kept {
            tx,
            rx,
            ring_handles,
            port,
            rx_port,
        }: Kept,
        ctrl: Option<ctrl::Ctrl>,
        guest_copy: Option<GuestCopy>,
    ) -> Self {
        let cache = n
            .grant_reuse
            .then(|| Box::new(GrantCache::new(fe, slot_base + CACHE_SLOT0)));
        Self {
            xen,
            fe,
            handle,
            index,
            port,
            rx_port,
            tx,
            rx,
            ring_handles,
            slot_base,
            rx_queue: SkbQueue::with_backlog(RX_QUEUE_BYTES, RX_QUEUE_BACKLOG),
            rx_hold: RxHold::default(),
            can_sg: n.can_sg,
            gso_rx: n.gso_rx,
            gso6_rx: n.gso6_rx,
            csum_rx: n.csum_rx,
            offload_scratch: vec![0; OFFLOAD_SCRATCH].into_boxed_slice(),
            aligned_copies: false,
            tx_copy: false,
            guest_copy,
            direct: None,
            machine_frames: n.machine_frames,
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
            credit: n.rate,
            tx_check: TxCheckStats::default(),
            stats: VifStats::default(),
            disabled: None,
        }
    }
}
