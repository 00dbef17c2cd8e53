//! A hostile back end writes whatever it likes into a guest's rings. netfront must
//! count and drop what it cannot use, never hand the stack bytes from outside the
//! buffer it posted, never reuse a page the back end still holds, and stop only the
//! interface whose ring index broke — the guest's other interface keeps working.

use std::sync::Arc;

use hv::{
    Domain, DomainConfig, GrantHandle, GrantPath, GrantRef, GrantVersion, HvConfig, Hypervisor,
    MapOp,
};
use net::netback::{self, Vif, VIF_WINDOW_SLOTS};
use net::netfront::FrontConfig;
use net::netfront::{Netfront, RxBuffers, RX_COPY_LEN};
use net::netif::{
    ExtraInfo, RxError, RxRequest, RxResponse, TxRequest, TxResponse, NETRXF_CSUM_BLANK,
    NETRXF_EXTRA_INFO, NETRXF_MORE_DATA, NETTXF_MORE_DATA, RX_COPY_MAX_SLOTS,
    XEN_NETIF_EXTRA_FLAG_MORE, XEN_NETIF_GSO_TYPE_TCPV4, XEN_NETIF_RSP_ERROR, XEN_NETIF_RSP_NULL,
    XEN_NETIF_RSP_OKAY,
};
use net::skb::{Frag, FragPage, SkbPool, NET_SKB_PAD};

mod common;
use net::xenbus;

const HDR: usize = 64;
const SLOTS: u32 = 256;
/// Window slots of the raw back end: TX ring, RX ring, one for buffer pages.
const TX_SLOT: u32 = 0;
const RX_SLOT: u32 = 1;
const BUF_SLOT: u32 = 2;

/// A back end that maps the guest's rings by hand and writes raw entries.
struct Raw {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    fe: hv::DomId,
    rx_req_cons: u32,
    rx_rsp_prod: u32,
    tx_req_cons: u32,
    tx_rsp_prod: u32,
    /// RX buffers posted: (id, gref), in ring order.
    posted: Vec<RxRequest>,
    /// The ring mappings, kept for the test's life.
    _rings: Vec<GrantHandle>,
    /// Guest copy: the first of the per-slot grants the back end lends through.
    lend_base: Option<GrantRef>,
}

impl Raw {
    fn connect(
        hv: &Arc<Hypervisor>,
        drv: &Arc<Domain>,
        guest: &Arc<Domain>,
        rx_buffers: RxBuffers,
        offloads: bool,
    ) -> (Raw, Netfront) {
        let store = hv.store();
        xenbus::create_vif(store, drv.id(), guest.id(), 0, [2, 0, 0, 0, 0, 9]).expect("toolstack");
        let bdir = xenbus::backend_dir(drv.id(), guest.id(), 0);
        let lend_base = (rx_buffers == RxBuffers::GuestCopy).then(|| {
            let base = drv.grant_table().alloc_block(SLOTS).expect("grant block");
            for (k, v) in [
                (xenbus::FEATURE_GUEST_COPY, "1".to_string()),
                (xenbus::RX_GRANT_BASE, base.0.to_string()),
            ] {
                store
                    .write(drv.id(), &format!("{bdir}/{k}"), &v)
                    .expect("store");
            }
            base
        });
        netback::probe(store, drv.id(), guest.id(), 0).expect("probe");
        let cfg = FrontConfig {
            rx_buffers,
            offloads,
            ..FrontConfig::ORIGINAL
        };
        let front = Netfront::connect_config(hv, guest, 0, cfg).expect("front end");
        let dir = xenbus::frontend_dir(guest.id(), 0);
        let key = |k: &str| xenbus::read_u32(store, drv.id(), &format!("{dir}/{k}")).expect(k);
        let ops = [("tx-ring-ref", TX_SLOT), ("rx-ring-ref", RX_SLOT)].map(|(k, slot)| MapOp {
            dom: guest.id(),
            gref: GrantRef(key(k)),
            readonly: false,
            slot,
        });
        let mut res = [Err(hv::GrantError::BadPage); 2];
        hv.grant_map(drv, &ops, &mut res);
        let rings = res.into_iter().map(|r| r.expect("ring map")).collect();
        let raw = Raw {
            hv: Arc::clone(hv),
            drv: Arc::clone(drv),
            fe: guest.id(),
            rx_req_cons: 0,
            rx_rsp_prod: 0,
            tx_req_cons: 0,
            tx_rsp_prod: 0,
            posted: Vec::new(),
            _rings: rings,
            lend_base,
        };
        (raw, front)
    }

    fn read_u32(&self, slot: u32, off: usize) -> u32 {
        let mut b = [0u8; 4];
        self.drv.window().read(slot, off, &mut b).expect("read");
        u32::from_le_bytes(b)
    }

    /// Collects the RX requests published since the last call.
    fn take_rx_requests(&mut self) {
        let prod = self.read_u32(RX_SLOT, 0);
        while self.rx_req_cons != prod {
            let mut r = RxRequest::default();
            let at = HDR + (self.rx_req_cons % SLOTS) as usize * 8;
            self.drv
                .window()
                .read(RX_SLOT, at, bytemuck::bytes_of_mut(&mut r))
                .expect("read");
            self.posted.push(r);
            self.rx_req_cons += 1;
        }
    }

    /// The TX requests published since the last call.
    fn take_tx_requests(&mut self) -> Vec<TxRequest> {
        let prod = self.read_u32(TX_SLOT, 0);
        let mut out = Vec::new();
        while self.tx_req_cons != prod {
            let mut r = TxRequest::default();
            let at = HDR + (self.tx_req_cons % SLOTS) as usize * 12;
            self.drv
                .window()
                .read(TX_SLOT, at, bytemuck::bytes_of_mut(&mut r))
                .expect("read");
            out.push(r);
            self.tx_req_cons += 1;
        }
        out
    }

    /// Takes the oldest posted RX buffer.
    fn buffer(&mut self) -> RxRequest {
        self.take_rx_requests();
        self.posted.remove(0)
    }

    /// Maps `gref` at the buffer slot; the handle is returned for [`Self::unmap`].
    fn map(&self, gref: u32, readonly: bool) -> GrantHandle {
        self.try_map(gref, readonly).expect("buffer map")
    }

    fn try_map(&self, gref: u32, readonly: bool) -> Result<GrantHandle, hv::GrantError> {
        let mut res = [Err(hv::GrantError::BadPage)];
        self.hv.grant_map(
            &self.drv,
            &[MapOp {
                dom: self.fe,
                gref: GrantRef(gref),
                readonly,
                slot: BUF_SLOT,
            }],
            &mut res,
        );
        res[0]
    }

    /// Whether none of `reqs`' grants can be mapped any more (all revoked). The buffer
    /// slot is free before each try, so a failure is the grant's.
    fn all_revoked(&self, reqs: &[TxRequest]) -> bool {
        reqs.iter().all(|r| match self.try_map(r.gref, true) {
            Ok(h) => {
                self.unmap(h);
                false
            }
            Err(_) => true,
        })
    }

    fn unmap(&self, h: GrantHandle) {
        let mut st = [Ok(())];
        self.hv.grant_unmap(&self.drv, &[h], &mut st);
        st[0].expect("unmap");
    }

    /// Writes `data` into a posted buffer at `off` (as netback's grant copy would).
    fn fill(&self, buf: &RxRequest, off: usize, data: &[u8]) {
        let h = self.map(buf.gref, false);
        self.drv.window().write(BUF_SLOT, off, data).expect("write");
        self.unmap(h);
    }

    fn rx_respond(&mut self, id: u16, offset: u16, flags: u16, status: i16) {
        let rsp = RxResponse {
            id,
            offset,
            flags,
            status,
        };
        let at = HDR + (self.rx_rsp_prod % SLOTS) as usize * 8;
        self.drv
            .window()
            .write(RX_SLOT, at, bytemuck::bytes_of(&rsp))
            .expect("write");
        self.rx_rsp_prod += 1;
    }

    /// An extra-info slot, in the next response's place.
    fn rx_extra(&mut self, e: ExtraInfo) {
        let r = e.to_rx_slot();
        self.rx_respond(r.id, r.offset, r.flags, r.status);
    }

    fn tx_respond(&mut self, id: u16, status: i16) {
        let at = HDR + (self.tx_rsp_prod % SLOTS) as usize * 12;
        self.drv
            .window()
            .write(TX_SLOT, at, bytemuck::bytes_of(&TxResponse { id, status }))
            .expect("write");
        self.tx_rsp_prod += 1;
    }

    fn publish(&self) {
        let w = self.drv.window();
        w.write(RX_SLOT, 8, &self.rx_rsp_prod.to_le_bytes())
            .expect("rx prod");
        w.write(TX_SLOT, 8, &self.tx_rsp_prod.to_le_bytes())
            .expect("tx prod");
    }

    /// A well-formed one-slot packet in the oldest posted buffer (guest copy: lent
    /// through the oldest posted slot).
    fn deliver(&mut self, data: &[u8]) {
        let b = self.buffer();
        if self.lend_base.is_some() {
            let off = self.lend(b.id, data);
            self.rx_respond(b.id, off, 0, data.len() as i16);
            return;
        }
        self.fill(&b, 0, data);
        self.rx_respond(b.id, 0, 0, data.len() as i16);
    }

    /// Guest copy: puts `data` in a fresh page of the back end's, at an offset of its
    /// choosing, and lends exactly those bytes through slot `id`'s grant. Returns the
    /// offset.
    fn lend(&self, id: u16, data: &[u8]) -> u16 {
        let base = self.lend_base.expect("a guest-copy back end");
        let page = self.drv.alloc_page().expect("page");
        let off = 3 + (id % 5) * 17;
        self.drv.write(page, off as usize, data).expect("write");
        self.drv
            .grant_table()
            .grant_access_subpage(
                GrantRef(base.0 + u32::from(id)),
                self.fe,
                page,
                off,
                data.len() as u16,
                true,
            )
            .expect("lend");
        off
    }
}

struct World {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    guest: Arc<Domain>,
    raw: Raw,
    front: Netfront,
    pool: SkbPool,
}

fn world() -> World {
    world_with(RxBuffers::Fragments)
}

fn world_with(rx_buffers: RxBuffers) -> World {
    world_config(rx_buffers, false)
}

fn world_config(rx_buffers: RxBuffers, offloads: bool) -> World {
    let hv = Hypervisor::new(HvConfig {
        frames: 16384,
        grant_path: GrantPath::Optimised,
        ..HvConfig::default()
    })
    .expect("hv");
    let drv = hv
        .create_domain(&DomainConfig {
            name: "evil-drv".into(),
            pages: 2048,
            grant_frames: 4,
            grant_version: GrantVersion::V2,
            vcpus: 1,
            map_slots: 2 * VIF_WINDOW_SLOTS,
            driver_domain: true,
        })
        .expect("drv");
    let guest = hv
        .create_domain(&DomainConfig {
            name: "guest".into(),
            pages: 4096,
            grant_frames: 8,
            grant_version: GrantVersion::V2,
            vcpus: 1,
            map_slots: 4,
            driver_domain: false,
        })
        .expect("guest");
    let (raw, mut front) = Raw::connect(&hv, &drv, &guest, rx_buffers, offloads);
    // A linear front end keeps a buffer on each posted page.
    let buffers = match rx_buffers {
        RxBuffers::Fragments | RxBuffers::GuestCopy => 64,
        RxBuffers::Linear => 320,
    };
    let mut pool = SkbPool::new(Arc::clone(&guest), buffers, 320).expect("pool");
    front.refill_rx(&mut pool);
    assert_eq!(front.rx_posted(), 256);
    World {
        hv,
        drv,
        guest,
        raw,
        front,
        pool,
    }
}

impl World {
    /// Polls the RX ring and returns each delivered packet's bytes.
    fn poll(&mut self) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        self.front.poll_rx(&mut self.pool, 64, |p, s| {
            let mut b = vec![0u8; p.len(s)];
            p.read(s, 0, &mut b).expect("read");
            got.push(b);
            p.free(s);
        });
        got
    }

    /// Polls `n` times, as a budget would, and returns every packet delivered.
    fn poll_rounds(&mut self, n: usize) -> Vec<Vec<u8>> {
        (0..n).flat_map(|_| self.poll()).collect()
    }

    /// Pages either free in the pool or posted to the back end: what netfront owns.
    fn pages_accounted(&self) -> usize {
        self.pool.free_pages() + self.front.rx_posted() as usize
    }

    /// A good packet still crosses after the misbehaviour, and every page and buffer is
    /// back where it belongs.
    fn still_receives(&mut self, pages: usize) {
        let msg: Vec<u8> = (0..700u32).map(|i| (i * 13) as u8).collect();
        self.raw.deliver(&msg);
        self.raw.publish();
        assert_eq!(self.poll(), vec![msg], "a good packet after the bad ones");
        assert_eq!(self.pages_accounted(), pages, "no page lost or duplicated");
        assert_eq!(self.front.rx_posted(), 256, "the ring is full again");
        let on_ring = match self.front.rx_buffers() {
            RxBuffers::Fragments | RxBuffers::GuestCopy => 0,
            RxBuffers::Linear => 256,
        };
        assert_eq!(self.pool.free_buffers() + on_ring, self.pool.capacity());
        assert!(!self.front.is_broken());
    }
}

fn message(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn rx_ids_out_of_range_or_not_in_flight_are_counted_and_dropped() {
    let mut w = world();
    let pages = w.pages_accounted();
    let good = w.raw.buffer();
    let data = message(300, 1);
    w.raw.fill(&good, 0, &data);
    w.raw.rx_respond(300, 0, 0, 64); // beyond the ring's ids
    w.raw.rx_respond(good.id, 0, 0, 300);
    w.raw.rx_respond(good.id, 0, 0, 300); // the same buffer twice
    w.raw.publish();
    assert_eq!(w.poll(), vec![data], "only the real answer is delivered");
    let st = w.front.stats();
    assert_eq!(st.rx_errors.get(RxError::BadId), 1, "bad id");
    assert_eq!(st.rx_errors.get(RxError::NotInFlight), 1, "not in flight");
    assert_eq!(st.rx_packets, 1);
    w.still_receives(pages);
}

#[test]
fn rx_data_crossing_its_page_or_an_error_status_gives_the_buffer_back() {
    let mut w = world();
    let pages = w.pages_accounted();
    for (offset, status) in [
        (4000u16, 200i16),
        (0, 4097),
        (u16::MAX, 1),
        (0, XEN_NETIF_RSP_ERROR),
    ] {
        let b = w.raw.buffer();
        w.raw.rx_respond(b.id, offset, 0, status);
    }
    w.raw.publish();
    assert!(w.poll().is_empty());
    let st = w.front.stats();
    assert_eq!(
        st.rx_errors.get(RxError::CrossesPage),
        3,
        "crosses its page"
    );
    assert_eq!(st.rx_errors.get(RxError::ErrorStatus), 1, "error status");
    w.still_receives(pages);
}

#[test]
fn rx_extras_never_negotiated_and_overlong_chains_are_dropped() {
    let mut w = world();
    let pages = w.pages_accounted();
    // An extra-info flag, though no extras were negotiated.
    let b = w.raw.buffer();
    w.raw.rx_respond(b.id, 0, NETRXF_EXTRA_INFO, 100);
    // A chain of more fragments than a packet buffer holds.
    for _ in 0..40 {
        let b = w.raw.buffer();
        w.raw.fill(&b, 0, &message(1000, 2));
        w.raw.rx_respond(b.id, 0, NETRXF_MORE_DATA, 1000);
    }
    // Then a chain cut short by a bad id: the half-built packet is thrown away.
    let b = w.raw.buffer();
    w.raw.rx_respond(b.id, 0, NETRXF_MORE_DATA, 1000);
    w.raw.rx_respond(999, 0, 0, 10);
    w.raw.publish();
    let got = w.poll_rounds(4);
    assert!(
        got.is_empty(),
        "no packet from a broken chain: {}",
        got.len()
    );
    let st = w.front.stats().clone();
    // The flag, and the overlong chain: dropped whole, so the chain after it (never
    // ended: every slot says more data) is read as its continuation until the bad id.
    assert_eq!(st.rx_bad_chain, 2, "{st:?}");
    assert_eq!(st.rx_errors.get(RxError::BadId), 1);
    w.still_receives(pages);
}

#[test]
fn rx_data_is_taken_from_the_buffer_page_only() {
    // Offset and length are the back end's; the bytes delivered are those of the
    // posted page at that place, with the first RX_COPY_LEN copied to the head.
    let mut w = world();
    let b = w.raw.buffer();
    let data = message(1500, 3);
    w.raw.fill(&b, 2000, &data);
    w.raw.rx_respond(b.id, 2000, 0, 1500);
    w.raw.publish();
    let mut got = Vec::new();
    w.front.poll_rx(&mut w.pool, 8, |p, s| {
        assert_eq!(
            p.linear_len(s),
            RX_COPY_LEN,
            "the head holds the first bytes"
        );
        let mut b = vec![0u8; p.len(s)];
        p.read(s, 0, &mut b).expect("read");
        got.push(b);
        p.free(s);
    });
    assert_eq!(got, vec![data]);
}

#[test]
fn an_rx_buffer_the_back_end_keeps_mapped_is_never_reused() {
    let mut w = world();
    let pages = w.pages_accounted();
    let b = w.raw.buffer();
    let h = w.raw.map(b.gref, false);
    w.raw.rx_respond(b.id, 0, 0, 64);
    w.raw.publish();
    assert!(
        w.poll().is_empty(),
        "a page the back end still maps is not delivered"
    );
    assert_eq!(w.front.stats().grants_busy, 1);
    // The page and its id stay out of circulation: one fewer buffer on the ring.
    assert_eq!(w.front.rx_posted(), 255);
    assert_eq!(w.pages_accounted(), pages - 1);
    // The back end can still write to it, and nothing the guest owns changes.
    w.drv
        .window()
        .write(BUF_SLOT, 0, &[0xee; 64])
        .expect("still mapped");
    w.raw.unmap(h);
    let msg = message(500, 4);
    w.raw.deliver(&msg);
    w.raw.publish();
    assert_eq!(w.poll(), vec![msg]);
    assert_eq!(w.pages_accounted(), pages - 1);
}

#[test]
fn pages_a_back_end_held_and_let_go_come_back_when_the_interface_is_removed() {
    // Found by the netfront fuzz target: a page parked because the back end held its
    // grant stayed lost for good, with its grant reference, after the back end let go.
    let mut w = world();
    let (buffers, pages) = (w.pool.free_buffers(), w.pool.free_pages());
    let refs = w.guest.grant_table().refs_free();
    let b = w.raw.buffer();
    let rx = w.raw.map(b.gref, false);
    w.raw.rx_respond(b.id, 0, 0, 64);
    w.raw.publish();
    assert!(w.poll().is_empty());
    w.raw.unmap(rx);
    let r = xmit(&mut w, &[100, 1000]);
    let tx = w.raw.map(r[1].gref, true);
    w.raw.tx_respond(r[0].id, XEN_NETIF_RSP_OKAY);
    w.raw.tx_respond(r[1].id, XEN_NETIF_RSP_OKAY);
    w.raw.publish();
    w.front.poll_tx(&mut w.pool);
    assert_eq!(w.front.stats().grants_busy, 2);
    w.raw.unmap(tx);
    let World { front, pool, .. } = w;
    let mut pool = pool;
    front.close(&mut pool);
    assert_eq!(
        (pool.free_buffers(), pool.free_pages()),
        (buffers, pages + 256)
    );
    assert_eq!(
        w.guest.grant_table().refs_free(),
        refs + 2 * 256,
        "every buffer reference is free again (the rings' stay mapped by the back end)"
    );
}

#[test]
fn a_linear_front_end_takes_data_where_the_back_end_put_it_and_refuses_chains_whole() {
    let mut w = world_with(RxBuffers::Linear);
    let dir = xenbus::frontend_dir(w.guest.id(), 0);
    assert!(
        !xenbus::feature(w.hv.store(), w.drv.id(), &dir, "feature-sg"),
        "no scatter-gather offered"
    );
    let pages = w.pages_accounted();
    // One packet at an offset of the back end's choosing: all of it in the linear
    // area, no fragment, nothing copied by the guest.
    let b = w.raw.buffer();
    let data = message(1514, 6);
    w.raw.fill(&b, 100, &data);
    w.raw.rx_respond(b.id, 100, 0, 1514);
    w.raw.publish();
    let mut got = Vec::new();
    w.front.poll_rx(&mut w.pool, 8, |p, s| {
        assert_eq!((p.linear_len(s), p.frags(s).len()), (1514, 0));
        let mut b = vec![0u8; p.len(s)];
        p.read(s, 0, &mut b).expect("read");
        got.push(b);
        p.free(s);
    });
    assert_eq!(got, vec![data]);
    // A three-slot chain would need fragments: refused whole, counted once. Then a
    // chain cut by a bad id, and data crossing its page.
    for flags in [NETRXF_MORE_DATA, NETRXF_MORE_DATA, 0, NETRXF_MORE_DATA] {
        let b = w.raw.buffer();
        w.raw.fill(&b, 0, &message(1000, 7));
        w.raw.rx_respond(b.id, 0, flags, 1000);
    }
    w.raw.rx_respond(999, 0, 0, 10);
    let b = w.raw.buffer();
    w.raw.rx_respond(b.id, 3000, 0, 1500);
    w.raw.publish();
    assert!(w.poll().is_empty());
    let st = w.front.stats().clone();
    assert_eq!(st.rx_bad_chain, 2, "{st:?}");
    assert_eq!(
        (
            st.rx_errors.get(RxError::BadId),
            st.rx_errors.get(RxError::CrossesPage)
        ),
        (1, 1),
        "{st:?}"
    );
    assert_eq!(st.rx_packets, 1);
    w.still_receives(pages);
}

/// A second interface of the same guest, on a real netback in the same driver domain.
fn good_interface(w: &World) -> (Netfront, Vif, SkbPool, SkbPool) {
    let store = w.hv.store();
    xenbus::create_vif(store, w.drv.id(), w.guest.id(), 1, [2, 0, 0, 0, 0, 7]).expect("ts");
    netback::probe(store, w.drv.id(), w.guest.id(), 1).expect("probe");
    let front = Netfront::connect(&w.hv, &w.guest, 1).expect("front");
    let vif = Vif::connect(
        hv::Pvio::new(&w.hv, &w.drv),
        w.guest.id(),
        1,
        1,
        VIF_WINDOW_SLOTS,
    )
    .expect("vif");
    let gpool = SkbPool::new(Arc::clone(&w.guest), 16, 300).expect("pool");
    let dpool = SkbPool::new(Arc::clone(&w.drv), 16, 16).expect("pool");
    (front, vif, gpool, dpool)
}

#[test]
fn a_broken_rx_index_stops_that_interface_only() {
    let mut w = world();
    let (mut front, mut vif, mut gpool, mut dpool) = good_interface(&w);
    front.refill_rx(&mut gpool);
    // More responses than requests outstanding.
    w.raw.rx_rsp_prod = 1000;
    w.raw.publish();
    assert!(w.poll().is_empty());
    assert!(w.front.is_broken());
    // A broken interface takes nothing more, and gives back what it is handed.
    let s = w.pool.alloc(NET_SKB_PAD).expect("skb");
    w.pool.put(s, &[1; 60]).expect("put");
    assert_eq!(w.front.xmit(&mut w.pool, s), Ok(()));
    assert_eq!(w.pool.free_buffers(), w.pool.capacity());
    assert!(w.raw.take_tx_requests().is_empty());
    // The guest's other interface carries a packet each way.
    let s = dpool.alloc(NET_SKB_PAD).expect("skb");
    let msg = message(200, 5);
    dpool.put(s, &msg).expect("put");
    vif.start_xmit(&mut dpool, s);
    vif.rx_action(&mut dpool);
    let mut got = Vec::new();
    front.poll_rx(&mut gpool, 8, |p, s| {
        let mut b = vec![0u8; p.len(s)];
        p.read(s, 0, &mut b).expect("read");
        got.push(b);
        p.free(s);
    });
    assert_eq!(got, vec![msg]);
    let s = gpool.alloc(NET_SKB_PAD).expect("skb");
    gpool.put(s, &[7; 100]).expect("put");
    front.xmit(&mut gpool, s).expect("room");
    assert_eq!(vif.tx_action(&mut dpool, 8, |p, s| p.free(s)), 1);
    assert!(!front.is_broken());
    assert_eq!(vif.disabled(), None);
}

/// Sends a packet of `lens` bytes in its head and then one fragment per further length,
/// so that it takes one TX slot per entry.
fn xmit(w: &mut World, lens: &[usize]) -> Vec<TxRequest> {
    let s = w.pool.alloc(NET_SKB_PAD).expect("skb");
    w.pool.put(s, &message(lens[0], 6)).expect("put");
    for &l in &lens[1..] {
        let g = w.pool.alloc_page().expect("page");
        w.guest.write(g, 0, &message(l, 7)).expect("write");
        w.pool
            .add_frag(
                s,
                Frag {
                    page: FragPage::Local(g),
                    offset: 0,
                    len: l as u16,
                },
            )
            .expect("frag");
    }
    w.front.xmit(&mut w.pool, s).expect("room");
    let reqs = w.raw.take_tx_requests();
    assert_eq!(reqs.len(), lens.len());
    reqs
}

#[test]
fn tx_answers_with_bad_ids_not_in_flight_null_or_error_are_counted() {
    let mut w = world();
    let buffers = w.pool.free_buffers();
    let sent: Vec<TxRequest> = (0..6).map(|_| xmit(&mut w, &[100])[0]).collect();
    let (a, b) = (sent[0], sent[1]);
    let never = (0..256u16)
        .find(|i| sent.iter().all(|r| r.id != *i))
        .expect("id");
    // One answer per request, as the ring allows; four of them are bogus.
    w.raw.tx_respond(256, XEN_NETIF_RSP_OKAY); // beyond the ring's ids
    w.raw.tx_respond(never, XEN_NETIF_RSP_OKAY); // never sent
    w.raw.tx_respond(a.id, XEN_NETIF_RSP_NULL); // a filler, skipped
    w.raw.tx_respond(a.id, XEN_NETIF_RSP_OKAY);
    w.raw.tx_respond(a.id, XEN_NETIF_RSP_OKAY); // twice
    w.raw.tx_respond(b.id, XEN_NETIF_RSP_ERROR);
    w.raw.publish();
    w.front.poll_tx(&mut w.pool);
    let st = w.front.stats();
    assert_eq!(st.tx_bad_response, 3);
    assert_eq!(st.tx_packets, 1);
    assert_eq!(st.tx_errors, 1);
    assert!(!w.front.is_broken());
    // a and b were freed once each; the four never answered stay with the back end,
    // their pages granted, as a real front end's would.
    assert_eq!(w.pool.free_buffers(), buffers - 4);
    assert!(w.raw.all_revoked(&[a, b]), "no grant left open");
    assert!(!w.raw.all_revoked(&sent[2..3]));
}

#[test]
fn a_tx_packet_is_freed_only_when_every_slot_is_answered() {
    let mut w = world();
    let (buffers, pages) = (w.pool.free_buffers(), w.pool.free_pages());
    let r = xmit(&mut w, &[200, 1000, 1000]);
    assert_eq!(r[0].flags & NETTXF_MORE_DATA, NETTXF_MORE_DATA);
    // The back end answers the last slot first, then the head: the middle page is
    // still granted, so the packet's pages must not go back to the pool.
    w.raw.tx_respond(r[2].id, XEN_NETIF_RSP_OKAY);
    w.raw.tx_respond(r[0].id, XEN_NETIF_RSP_OKAY);
    w.raw.publish();
    w.front.poll_tx(&mut w.pool);
    assert_eq!(w.pool.free_buffers(), buffers - 1, "still in flight");
    // Two fragment pages, and the page the head was moved to before granting.
    assert_eq!(w.pool.free_pages(), pages - 3);
    // Another packet meanwhile must not take over the first one's state.
    let s = xmit(&mut w, &[64]);
    assert_ne!(s[0].id, r[0].id, "the head's id is not reused early");
    w.raw.tx_respond(s[0].id, XEN_NETIF_RSP_OKAY);
    w.raw.tx_respond(r[1].id, XEN_NETIF_RSP_OKAY);
    w.raw.publish();
    w.front.poll_tx(&mut w.pool);
    assert_eq!(w.front.stats().tx_packets, 2);
    assert_eq!(
        (w.pool.free_buffers(), w.pool.free_pages()),
        (buffers, pages)
    );
    assert!(w.raw.all_revoked(&r));
}

#[test]
fn a_tx_page_the_back_end_keeps_mapped_is_never_freed() {
    let mut w = world();
    let (buffers, pages) = (w.pool.free_buffers(), w.pool.free_pages());
    let r = xmit(&mut w, &[100, 1000]);
    let h = w.raw.map(r[1].gref, true);
    w.raw.tx_respond(r[0].id, XEN_NETIF_RSP_OKAY);
    w.raw.tx_respond(r[1].id, XEN_NETIF_RSP_OKAY);
    w.raw.publish();
    w.front.poll_tx(&mut w.pool);
    let st = w.front.stats();
    assert_eq!((st.grants_busy, st.tx_pinned, st.tx_packets), (1, 1, 0));
    // Neither the buffer nor its fragment page returns while a peer can read it.
    assert_eq!(w.pool.free_buffers(), buffers - 1);
    // The fragment page, and the page the head was moved to before granting.
    assert_eq!(w.pool.free_pages(), pages - 2);
    w.raw.unmap(h);
    // The interface goes on.
    let s = xmit(&mut w, &[80]);
    w.raw.tx_respond(s[0].id, XEN_NETIF_RSP_OKAY);
    w.raw.publish();
    w.front.poll_tx(&mut w.pool);
    assert_eq!(w.front.stats().tx_packets, 1);
}

#[test]
fn a_broken_tx_index_stops_the_interface() {
    let mut w = world();
    xmit(&mut w, &[100]);
    w.raw.tx_rsp_prod = 5; // one request outstanding
    w.raw.publish();
    assert_eq!(w.front.poll_tx(&mut w.pool), 0);
    assert!(w.front.is_broken());
    assert!(w.poll().is_empty());
}

#[test]
fn a_back_end_reads_only_the_packet_it_was_granted_never_a_neighbouring_buffer() {
    // Issue 11: two 2 KiB heads share a page, and netfront granted the whole page of a
    // packet's head, so a back end could read the buffer beside it (the XSA-403 class
    // that the RX side already avoids).
    let mut w = world();
    let secret = [0x5e_u8; 1500];
    // Find a buffer whose head page also holds another buffer's head.
    let mut spare = Vec::new();
    let (pkt, neighbour) = loop {
        let a = w.pool.alloc(NET_SKB_PAD).expect("skb");
        let b = w.pool.alloc(NET_SKB_PAD).expect("skb");
        if w.pool.data_location(a).0 == w.pool.data_location(b).0 {
            break (a, b);
        }
        spare.extend([a, b]);
    };
    w.pool.put(neighbour, &secret).expect("secret");
    w.pool.put(pkt, &message(300, 3)).expect("packet");
    w.front.xmit(&mut w.pool, pkt).expect("room");
    let reqs = w.raw.take_tx_requests();
    assert_eq!(reqs.len(), 1);
    // The back end maps the grant and reads the whole page.
    let h = w.raw.map(reqs[0].gref, true);
    let mut page = vec![0u8; 4096];
    w.drv.window().read(BUF_SLOT, 0, &mut page).expect("read");
    w.raw.unmap(h);
    let at = reqs[0].offset as usize;
    assert_eq!(
        &page[at..at + 300],
        &message(300, 3)[..],
        "the packet is there"
    );
    assert!(
        !page.windows(64).any(|win| win == &secret[..64]),
        "the neighbouring buffer is not readable through the grant"
    );
    // Answered, the packet's buffer and page go back to the pool.
    let free = (w.pool.free_buffers(), w.pool.free_pages());
    w.raw.tx_respond(reqs[0].id, XEN_NETIF_RSP_OKAY);
    w.raw.publish();
    w.front.poll_tx(&mut w.pool);
    assert_eq!(w.front.stats().tx_packets, 1);
    assert!(w.pool.free_buffers() > free.0);
    w.pool.free(neighbour);
    for s in spare {
        w.pool.free(s);
    }
}

#[test]
fn guest_copy_chains_are_delivered_whole_or_dropped_whole_and_every_slot_is_posted_again() {
    let mut w = world_with(RxBuffers::GuestCopy);
    let pages = w.pages_accounted();
    // A good packet in three pieces (a head and two runs, as a frame another guest
    // sent is lent).
    let parts = [message(128, 1), message(900, 2), message(472, 3)];
    for (k, part) in parts.iter().enumerate() {
        let b = w.raw.buffer();
        let off = w.raw.lend(b.id, part);
        let more = if k + 1 < parts.len() {
            NETRXF_MORE_DATA
        } else {
            0
        };
        w.raw.rx_respond(b.id, off, more, part.len() as i16);
    }
    w.raw.publish();
    assert_eq!(
        w.poll(),
        vec![parts.concat()],
        "one packet, its pieces in order"
    );
    // Broken: a chain longer than the form allows; one cut by a bad id; an extra-info
    // slot in a chain; a chain whose pieces add up to more than a frame; and one left
    // open at the end of what the back end published.
    let chain = |w: &mut World, lens: &[usize], last_flags: u16| {
        for (k, &len) in lens.iter().enumerate() {
            let b = w.raw.buffer();
            let off = w.raw.lend(b.id, &message(len, k as u8));
            let flags = if k + 1 < lens.len() {
                NETRXF_MORE_DATA
            } else {
                last_flags
            };
            w.raw.rx_respond(b.id, off, flags, len as i16);
        }
    };
    chain(&mut w, &[100; RX_COPY_MAX_SLOTS + 1], 0);
    chain(&mut w, &[100], NETRXF_MORE_DATA);
    w.raw.rx_respond(999, 0, 0, 10);
    chain(&mut w, &[100, 100], NETRXF_MORE_DATA | NETRXF_EXTRA_INFO);
    chain(&mut w, &[1000, 1000], 0);
    chain(&mut w, &[100, 100], NETRXF_MORE_DATA);
    w.raw.publish();
    let got = w.poll_rounds(4);
    assert!(
        got.is_empty(),
        "no packet from a broken chain: {}",
        got.len()
    );
    let st = w.front.stats().clone();
    assert_eq!(st.rx_bad_chain, 5, "{st:?}");
    assert_eq!(st.rx_errors.get(RxError::BadId), 1);
    assert_eq!(st.rx_packets, 1);
    w.still_receives(pages);
}

impl World {
    /// A large packet over data slots of at most a page, its first slot followed by
    /// `extras` (each taking the place of a posted buffer, which comes back unused).
    fn deliver_offloaded(&mut self, frame: &[u8], extras: &[ExtraInfo]) {
        let chunks: Vec<&[u8]> = frame.chunks(4096).collect();
        for (i, c) in chunks.iter().enumerate() {
            let b = self.raw.buffer();
            self.raw.fill(&b, 0, c);
            let mut flags = if i + 1 < chunks.len() {
                NETRXF_MORE_DATA
            } else {
                0
            };
            if i == 0 {
                flags |= NETRXF_CSUM_BLANK;
                if !extras.is_empty() {
                    flags |= NETRXF_EXTRA_INFO;
                }
            }
            self.raw.rx_respond(b.id, 0, flags, c.len() as i16);
            if i == 0 {
                for e in extras {
                    let _unused = self.raw.buffer();
                    self.raw.rx_extra(*e);
                }
            }
        }
    }

    /// Polls once; each packet's bytes and offload.
    fn poll_offloaded(&mut self) -> Vec<(Vec<u8>, net::offload::Offload)> {
        let mut got = Vec::new();
        self.front.poll_rx(&mut self.pool, 64, |p, s| {
            let mut b = vec![0u8; p.len(s)];
            p.read(s, 0, &mut b).expect("read");
            got.push((b, p.offload(s)));
            p.free(s);
        });
        got
    }
}

#[test]
fn offloaded_rx_is_checked_and_a_bad_extra_loses_only_its_packet() {
    use net::offload::{Csum, OffloadError};
    let mut w = world_config(RxBuffers::Fragments, true);
    let pages = w.pages_accounted();
    let (frame, _) = common::partial(common::tcp_frame([2; 6], [3; 6], 9000, 77, 1), None);
    let gso = |size, ty, more| {
        let mut e = ExtraInfo::gso(size, ty, more);
        if more {
            e.flags |= XEN_NETIF_EXTRA_FLAG_MORE;
        }
        e
    };
    // A good one: one packet, its GSO size, its checksum located from its headers.
    w.deliver_offloaded(&frame, &[gso(1448, XEN_NETIF_GSO_TYPE_TCPV4, false)]);
    w.raw.publish();
    let got = w.poll_offloaded();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, frame, "every byte, in order");
    assert_eq!(got[0].1.gso.map(|g| g.size), Some(1448));
    assert_eq!(
        got[0].1.csum,
        Csum::Partial {
            start: 34,
            offset: 16
        }
    );
    assert_eq!(w.front.stats().rx_gso_packets, 1);
    // Bad extras: size 0, a GSO type other than TCPv4, an extra of type 0, a chain of
    // extras longer than there are types. Each loses its packet, whole.
    let mut none = ExtraInfo::gso(1448, 1, false);
    none.ty = 0;
    let mut chain = [gso(1448, 1, true); 6];
    chain[5] = gso(1448, 1, false);
    for extras in [
        &[gso(0, XEN_NETIF_GSO_TYPE_TCPV4, false)][..],
        &[gso(1448, 7, false)][..],
        &[none][..],
        &chain[..],
    ] {
        w.deliver_offloaded(&frame, extras);
    }
    // More than 64 KiB in one offloaded packet (17 pages).
    let mut big = frame.clone();
    big.resize(17 * 4096, 0x5a);
    w.deliver_offloaded(&big, &[gso(1448, XEN_NETIF_GSO_TYPE_TCPV4, false)]);
    // A blank checksum on what is no TCP/IPv4 packet.
    let mut icmp = frame[..600].to_vec();
    icmp[14 + 9] = 1;
    icmp[16..18].copy_from_slice(&586u16.to_be_bytes());
    w.deliver_offloaded(&icmp, &[]);
    w.raw.publish();
    let got = w.poll_rounds(4);
    assert!(got.is_empty(), "{} packets from bad chains", got.len());
    let st = w.front.stats().clone();
    assert_eq!(st.rx_offload_errors.get(OffloadError::GsoSizeZero), 1);
    assert_eq!(st.rx_offload_errors.get(OffloadError::BadGsoType), 1);
    assert_eq!(st.rx_offload_errors.get(OffloadError::TooLong), 1);
    assert_eq!(st.rx_offload_errors.get(OffloadError::NotTcpUdp), 1);
    assert_eq!(st.rx_bad_chain, 2, "{st:?}");
    // Every buffer, the extras' unused ones too, is back.
    w.still_receives(pages);
}
