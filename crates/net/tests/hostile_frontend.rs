//! A hostile front end writes whatever it likes into its rings. netback must answer or
//! drop what it can, disable that vif on a protocol break, and leave every other vif —
//! and the driver domain — working.

use std::sync::Arc;

use hv::store::XenbusState;
use hv::{Domain, DomainConfig, Gfn, GrantPath, GrantVersion, HvConfig, Hypervisor};
use net::netback::{self, Disabled, Vif, VIF_WINDOW_SLOTS};
use net::netfront::Netfront;
use net::netif::{TxFatal, TxRequest, NETTXF_MORE_DATA};
use net::skb::{SkbPool, NET_SKB_PAD};
use net::xenbus;

/// A front end that does the handshake by hand and then writes raw ring bytes.
struct Raw {
    dom: Arc<Domain>,
    tx: Gfn,
    data: Gfn,
    data_ref: u32,
}

const HDR: usize = 64;

impl Raw {
    fn connect(hv: &Arc<Hypervisor>, dom: &Arc<Domain>, be: &Arc<Domain>) -> Raw {
        let store = hv.store();
        xenbus::create_vif(store, be.id(), dom.id(), 0, [2, 0, 0, 0, 0, 9]).expect("toolstack");
        netback::probe(store, be.id(), dom.id(), 0).expect("probe");
        let gt = dom.grant_table();
        let grant = |ro: bool| {
            let g = dom.alloc_page().expect("page");
            let r = gt.alloc_ref().expect("ref");
            gt.grant_access(r, be.id(), g, ro).expect("grant");
            (g, r)
        };
        let (tx, txr) = grant(false);
        let (_rx, rxr) = grant(false);
        let (data, dr) = grant(true);
        let port = hv.evtchn_alloc_unbound(dom, be.id()).expect("port");
        let dir = xenbus::frontend_dir(dom.id(), 0);
        for (k, v) in [
            ("tx-ring-ref", txr.0.to_string()),
            ("rx-ring-ref", rxr.0.to_string()),
            ("event-channel", port.0.to_string()),
            ("request-rx-copy", "1".into()),
        ] {
            store
                .write(dom.id(), &format!("{dir}/{k}"), &v)
                .expect("write");
        }
        store
            .switch_state(dom.id(), &dir, XenbusState::Connected)
            .expect("state");
        Raw {
            dom: Arc::clone(dom),
            tx,
            data,
            data_ref: dr.0,
        }
    }
    /// Writes request `i` and publishes `prod`.
    fn put(&self, i: u32, r: TxRequest) {
        self.dom
            .write(
                self.tx,
                HDR + (i as usize % 256) * 12,
                bytemuck::bytes_of(&r),
            )
            .expect("slot");
    }
    fn publish(&self, prod: u32) {
        self.dom
            .write(self.tx, 0, &prod.to_le_bytes())
            .expect("prod");
    }
}

struct World {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    pool: SkbPool,
}

fn world() -> World {
    let hv = Hypervisor::new(HvConfig {
        frames: 16384,
        grant_path: GrantPath::Optimised,
    })
    .expect("hv");
    let drv = hv
        .create_domain(&DomainConfig {
            name: "drv".into(),
            pages: 2048,
            grant_frames: 4,
            grant_version: GrantVersion::V2,
            vcpus: 1,
            map_slots: 2 * VIF_WINDOW_SLOTS,
            driver_domain: true,
        })
        .expect("drv");
    let pool = SkbPool::new(Arc::clone(&drv), 512, 16).expect("pool");
    World { hv, drv, pool }
}

fn guest(hv: &Arc<Hypervisor>, name: &str) -> Arc<Domain> {
    hv.create_domain(&DomainConfig {
        name: name.into(),
        pages: 1024,
        grant_frames: 4,
        grant_version: GrantVersion::V2,
        vcpus: 1,
        map_slots: 4,
        driver_domain: false,
    })
    .expect("guest")
}

/// The evil vif at window slots 0.., a good one beside it at VIF_WINDOW_SLOTS.. .
fn pair(w: &World) -> (Raw, Vif, Netfront, Vif, Arc<Domain>) {
    let evil = guest(&w.hv, "evil");
    let raw = Raw::connect(&w.hv, &evil, &w.drv);
    let bad = Vif::connect(&w.hv, &w.drv, evil.id(), 0, 0, 0).expect("evil vif");
    let good = guest(&w.hv, "good");
    xenbus::create_vif(w.hv.store(), w.drv.id(), good.id(), 0, [2, 0, 0, 0, 0, 7]).expect("ts");
    netback::probe(w.hv.store(), w.drv.id(), good.id(), 0).expect("probe");
    let front = Netfront::connect(&w.hv, &good, 0).expect("front");
    let vif = Vif::connect(&w.hv, &w.drv, good.id(), 0, 1, VIF_WINDOW_SLOTS).expect("good vif");
    (raw, bad, front, vif, good)
}

/// The good vif still carries a packet both ways after the evil one misbehaved.
fn good_still_works(w: &mut World, (front, vif, dom): (&mut Netfront, &mut Vif, &Arc<Domain>)) {
    let mut gpool = SkbPool::new(Arc::clone(dom), 16, 16).expect("pool");
    let s = gpool.alloc(NET_SKB_PAD).expect("skb");
    gpool.put(s, &[0x5a; 100]).expect("put");
    front.xmit(&mut gpool, s).expect("room");
    let mut got = 0;
    vif.tx_action(&mut w.pool, 64, |p, s| {
        got += 1;
        p.free(s)
    });
    assert_eq!(got, 1, "the good vif is unaffected");
    assert_eq!(vif.disabled(), None);
}

fn req(gref: u32, offset: u16, flags: u16, id: u16, size: u16) -> TxRequest {
    TxRequest {
        gref,
        offset,
        flags,
        id,
        size,
    }
}

#[test]
fn a_producer_index_more_than_a_ring_ahead_disables_that_vif_only() {
    let mut w = world();
    let (raw, mut bad, mut front, mut vif, good) = pair(&w);
    raw.publish(100_000);
    assert_eq!(bad.tx_action(&mut w.pool, 64, |p, s| p.free(s)), 0);
    assert_eq!(bad.disabled(), Some(Disabled::RingBroken));
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}

#[test]
fn fatal_chains_disable_and_tolerated_ones_are_answered_with_errors() {
    for (name, reqs, want) in [
        (
            "unterminated chain",
            vec![
                req(0, 0, NETTXF_MORE_DATA, 0, 200),
                req(0, 0, NETTXF_MORE_DATA, 1, 100),
            ],
            Some(TxFatal::Unterminated),
        ),
        (
            "offset + size beyond a page",
            vec![req(0, 4000, 0, 0, 200)],
            Some(TxFatal::CrossesPage),
        ),
        (
            "chain too long",
            (0..21)
                .map(|i| req(0, 0, if i < 20 { NETTXF_MORE_DATA } else { 0 }, i, 60))
                .collect(),
            Some(TxFatal::ChainTooLong),
        ),
    ] {
        let mut w = world();
        let (raw, mut bad, mut front, mut vif, good) = pair(&w);
        for (i, r) in reqs.iter().enumerate() {
            let mut r = *r;
            r.gref = raw.data_ref;
            raw.put(i as u32, r);
        }
        raw.publish(reqs.len() as u32);
        bad.tx_action(&mut w.pool, 64, |p, s| p.free(s));
        assert_eq!(bad.disabled(), want.map(Disabled::Fatal), "{name}");
        assert_eq!(bad.tx_check_stats().fatal_count(want.expect("fatal")), 1);
        good_still_works(&mut w, (&mut front, &mut vif, &good));
    }
}

#[test]
fn bad_grants_short_packets_and_zero_length_slots_are_answered_and_counted() {
    let mut w = world();
    let (raw, mut bad, mut front, mut vif, good) = pair(&w);
    let free = w.pool.free_buffers();
    let g = raw.data_ref;
    let reqs = [
        req(9999, 0, 0, 1, 100),             // a grant that does not exist
        req(g, 0, 0, 2, 10),                 // below an Ethernet header
        req(g, 0, NETTXF_MORE_DATA, 3, 300), // first slot ...
        req(g, 0, 0, 4, 0),                  // ... then a zero-length slot
        req(g, 0, NETTXF_MORE_DATA, 5, 100), // first slot smaller than ...
        req(g, 0, 0, 6, 200),                // ... its fragment
        req(g, 0, 0, 7, 100),                // and one good packet
    ];
    for (i, r) in reqs.iter().enumerate() {
        raw.put(i as u32, *r);
    }
    raw.publish(reqs.len() as u32);
    let mut delivered = Vec::new();
    bad.tx_action(&mut w.pool, 64, |_, s| delivered.push(s));
    assert_eq!(bad.disabled(), None, "tolerated errors keep the vif up");
    assert_eq!(delivered.len(), 1, "only the good packet goes on");
    assert_eq!(bad.stats().tx_grant_errors, 1);
    let c = bad.tx_check_stats();
    assert_eq!(c.drops.iter().sum::<u64>(), 3);
    for s in delivered {
        w.pool.free(s);
    }
    assert_eq!(w.pool.free_buffers(), free, "nothing leaked");
    // Every consumed request got a response: the response producer moved by 7.
    let mut prod = [0u8; 4];
    raw.dom.read(raw.tx, 8, &mut prod).expect("rsp_prod");
    assert_eq!(u32::from_le_bytes(prod), 7);
    let _ = raw.data;
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}

#[test]
fn a_guest_that_stops_posting_rx_buffers_only_fills_its_own_bounded_queue() {
    let mut w = world();
    let (_raw, mut bad, mut front, mut vif, good) = pair(&w);
    let free = w.pool.free_buffers();
    for _ in 0..400 {
        let Ok(s) = w.pool.alloc(NET_SKB_PAD) else {
            break;
        };
        w.pool.put(s, &[1u8; 1514]).expect("put");
        bad.start_xmit(&mut w.pool, s);
        bad.rx_action(&mut w.pool);
    }
    assert!(
        bad.stats().rx_queue_full > 0,
        "the overflow is dropped and counted"
    );
    assert!(bad.rx_queued() <= net::netback::RX_QUEUE_BYTES / 1514);
    assert!(w.pool.free_buffers() >= free - bad.rx_queued(), "bounded");
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}
