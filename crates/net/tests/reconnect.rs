//! A driver domain dies under a guest's traffic: the toolstack retires its back end and
//! offers the vif on a new driver domain, and the guest's netfront follows through the
//! store — it takes back every grant, keeps the packets the dead back end never
//! answered, reconnects and sends them again, in order. Nothing of the guest stays held.

mod common;

use std::sync::Arc;

use common::domain;
use hv::{Domain, GrantPath, HvConfig, Hypervisor};
use net::netfront::FrontConfig;
use net::netfront::LinkChange;
use net::skb::{SkbId, SkbPool, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};

const SPEC: VifSpec = VifSpec {
    handle: 0,
    mac: [2, 0, 0, 0, 0, 2],
    index: 0,
    front: FrontConfig::ORIGINAL,
};

/// A hypervisor with a guest and a driver domain, and a small pool for each.
fn pair() -> (Arc<Hypervisor>, Arc<Domain>, Arc<Domain>, SkbPool, SkbPool) {
    common::pair((16, 16), (16, 16))
}

fn packet(i: u8, len: usize) -> Vec<u8> {
    (0..len).map(|k| (k as u8).wrapping_mul(13) ^ i).collect()
}

fn bytes(pool: &SkbPool, s: SkbId) -> Vec<u8> {
    let mut b = vec![0; pool.len(s)];
    pool.read(s, 0, &mut b).expect("read");
    b
}

#[test]
fn a_guest_follows_its_vif_to_a_new_driver_domain_and_resends_what_was_unanswered() {
    let hv = Hypervisor::new(HvConfig {
        frames: 8192,
        grant_path: GrantPath::Optimised,
        ..HvConfig::default()
    })
    .expect("hv");
    let guest = domain(&hv, "guest", false);
    let mut gpool = SkbPool::new(Arc::clone(&guest), 256, 300).expect("pool");
    let old = domain(&hv, "driver", true);
    let (mut front, mut vif) = toolstack::plug_vif(&hv, &old, &guest, SPEC).expect("plug");
    front.refill_rx(&mut gpool);
    let mut dpool = SkbPool::new(Arc::clone(&old), 128, 16).expect("pool");

    // Three packets cross and are answered; five more are taken by netback (their
    // pages mapped) and never answered.
    let sent: Vec<Vec<u8>> = (0..8u8)
        .map(|i| packet(i, if i == 5 { 3000 } else { 100 + usize::from(i) }))
        .collect();
    let xmit = |gpool: &mut SkbPool, front: &mut net::netfront::Netfront, d: &[u8]| {
        let s = gpool.alloc_page_linear().expect("skb");
        gpool.put(s, d).expect("put");
        front.xmit(gpool, s).expect("room");
    };
    for d in &sent[..3] {
        xmit(&mut gpool, &mut front, d);
    }
    vif.tx_action(&mut dpool, 64, |p, s| p.free(s));
    let mut tokens = Vec::new();
    dpool.take_released(|r| tokens.push(r.token));
    vif.tx_release(tokens);
    assert_eq!(front.poll_tx(&mut gpool), 3);
    for d in &sent[3..] {
        xmit(&mut gpool, &mut front, d);
    }
    let mut held = Vec::new();
    vif.tx_action(&mut dpool, 64, |_, s| held.push(s));
    assert_eq!(held.len(), 5, "netback holds five packets in flight");

    // The driver domain dies: the hypervisor unmaps what it mapped, closes its ports.
    hv.destroy_domain(old.id()).expect("destroy");
    // The toolstack retires its back end and offers the vif on a new driver domain.
    toolstack::close_backend(&hv, old.id(), guest.id(), 0);
    let new = domain(&hv, "driver", true);
    toolstack::offer_vif(&hv, &new, &guest, SPEC).expect("offer");
    assert!(!toolstack::frontend_connected(&hv, guest.id(), 0));

    // The guest's watch fired: it disconnects from the dead back end and reconnects.
    assert_eq!(front.check_backend(&mut gpool), LinkChange::Reconnected);
    assert_eq!(front.stats().disconnects, 1);
    assert_eq!(front.stats().tx_requeued, 5);
    assert!(toolstack::frontend_connected(&hv, guest.id(), 0));
    let mut vif = {
        drop(vif);
        toolstack::connect_backend(&hv, &new, &guest, SPEC).expect("connect")
    };
    assert_eq!(front.check_backend(&mut gpool), LinkChange::None);

    // The five unanswered packets arrive at the new back end, intact and in order.
    let mut dpool2 = SkbPool::new(Arc::clone(&new), 128, 16).expect("pool");
    let mut got = Vec::new();
    vif.tx_action(&mut dpool2, 64, |p, s| {
        got.push(bytes(p, s));
        p.free(s)
    });
    assert_eq!(got, sent[3..].to_vec());
    let mut tokens = Vec::new();
    dpool2.take_released(|r| tokens.push(r.token));
    vif.tx_release(tokens);
    assert_eq!(front.poll_tx(&mut gpool), 5);
    assert_eq!(front.stats().tx_packets, 8);

    // Receive works on the new back end, with a freshly posted ring.
    assert_eq!(front.rx_posted(), 256);
    let s = dpool2.alloc(NET_SKB_PAD).expect("skb");
    let frame = packet(9, 600);
    dpool2.put(s, &frame).expect("put");
    vif.start_xmit(&mut dpool2, s);
    vif.rx_action(&mut dpool2);
    let mut rx = Vec::new();
    front.poll_rx(&mut gpool, 64, |p, s| {
        rx.push(bytes(p, s));
        p.free(s)
    });
    assert_eq!(rx, vec![frame]);

    // Nothing of the guest is held by the dead driver domain once its last handles go.
    for s in held {
        dpool.free(s);
    }
    drop((dpool, old));
    assert_eq!(
        hv.reap(),
        0,
        "every frame of the dead driver domain is freed"
    );
    vif.disconnect(&mut dpool2);
    front.disconnect(&mut gpool);
    assert_eq!(
        (gpool.free_buffers(), gpool.free_pages()),
        (256, 300),
        "every buffer and page of the guest is back"
    );
}

#[test]
fn a_front_end_waits_disconnected_until_a_back_end_is_offered() {
    let hv = Hypervisor::new(HvConfig {
        frames: 8192,
        ..HvConfig::default()
    })
    .expect("hv");
    let guest = domain(&hv, "guest", false);
    let mut gpool = SkbPool::new(Arc::clone(&guest), 64, 300).expect("pool");
    let old = domain(&hv, "driver", true);
    let (mut front, _vif) = toolstack::plug_vif(&hv, &old, &guest, SPEC).expect("plug");
    front.refill_rx(&mut gpool);
    hv.destroy_domain(old.id()).expect("destroy");
    toolstack::close_backend(&hv, old.id(), guest.id(), 0);
    assert_eq!(front.check_backend(&mut gpool), LinkChange::Disconnected);
    assert!(!front.is_connected());
    assert_eq!(front.tx_room(), 0);
    let s = gpool.alloc(NET_SKB_PAD).expect("skb");
    gpool.put(s, &[1; 60]).expect("put");
    let s = front
        .xmit(&mut gpool, s)
        .expect_err("no back end: the buffer comes back");
    gpool.free(s);
    // Only the first write (backend-id) of the offer has happened yet: the back end
    // is not waiting, so the front end stays down and follows the new directory.
    let new = domain(&hv, "driver", true);
    hv.store()
        .write(
            hv::DomId::DOM0,
            &format!("{}/backend-id", net::xenbus::frontend_dir(guest.id(), 0)),
            &new.id().0.to_string(),
        )
        .expect("write");
    assert_eq!(front.check_backend(&mut gpool), LinkChange::None);
    toolstack::offer_vif(&hv, &new, &guest, SPEC).expect("offer");
    assert_eq!(front.check_backend(&mut gpool), LinkChange::Reconnected);
    assert!(toolstack::connect_backend(&hv, &new, &guest, SPEC).is_ok());
}

/// Found by the connect fuzz target: a front end whose back end is not ready failed
/// its handshake and kept the 512 grant references it had taken, so a guest retrying
/// ran out of references.
#[test]
fn a_handshake_that_fails_gives_back_its_grant_references() {
    let (hv, guest, drv, mut gpool, mut dpool) = pair();
    let free = guest.grant_table().refs_free();
    // The toolstack wrote both directories, but the back end has not probed.
    net::xenbus::create_vif(hv.store(), drv.id(), guest.id(), 0, SPEC.mac).expect("vif");
    for _ in 0..4 {
        let r = net::netfront::Netfront::connect(&hv, &guest, 0);
        assert!(r.is_err(), "no back end waits");
        assert_eq!(
            guest.grant_table().refs_free(),
            free,
            "every reference is back"
        );
    }
    // Once the back end probes, the same guest connects.
    net::netback::probe(hv.store(), drv.id(), guest.id(), 0).expect("probe");
    let front = net::netfront::Netfront::connect(&hv, &guest, 0).expect("connects");
    let vif = toolstack::connect_backend(&hv, &drv, &guest, SPEC).expect("back end");
    assert!(front.is_connected());
    vif.disconnect(&mut dpool);
    front.close(&mut gpool);
    assert_eq!(guest.grant_table().refs_free(), free);
}

/// Found by the connect fuzz target: a front end removed while its back end still
/// mapped the rings abandoned both ring grants and pages for good. They now wait in
/// the grant table's deferred list and go back once the back end lets go.
#[test]
fn rings_a_back_end_still_maps_go_back_when_it_lets_go() {
    let (hv, guest, drv, mut gpool, mut dpool) = pair();
    let (refs, pages) = (guest.grant_table().refs_free(), guest.free_page_count());
    let (front, vif) = toolstack::plug_vif(&hv, &drv, &guest, SPEC).expect("plug");
    front.close(&mut gpool);
    let gt = guest.grant_table();
    assert_eq!(
        gt.deferred(),
        2,
        "both rings are still mapped by the back end"
    );
    assert_eq!(
        gt.retry_deferred(),
        2,
        "and stay deferred while it maps them"
    );
    vif.disconnect(&mut dpool);
    assert_eq!(gt.retry_deferred(), 0, "the back end let go");
    assert_eq!(gt.refs_free(), refs, "every reference is back");
    assert_eq!(guest.free_page_count(), pages, "and both ring pages");
}

/// Found by the restart benchmark: a store event reaching a front end that had
/// published its rings but whose back end had not yet bound the channel made the
/// front end take the unbound channel for a dead back end; it revoked the rings the
/// back end was about to map, and the restart failed or stalled.
#[test]
fn a_front_end_waits_for_its_back_end_to_bind_before_calling_it_gone() {
    let (hv, guest, drv, mut gpool, mut dpool) = pair();
    toolstack::offer_vif(&hv, &drv, &guest, SPEC).expect("offer");
    let mut front = net::netfront::Netfront::connect(&hv, &guest, 0).expect("front");
    // The back end writes to its directory before it connects: the front end's watch
    // fires.
    let bdir = net::xenbus::backend_dir(drv.id(), guest.id(), 0);
    hv.store()
        .write(drv.id(), &format!("{bdir}/hotplug-status"), "connected")
        .expect("write");
    assert_eq!(front.check_backend(&mut gpool), LinkChange::None);
    assert!(front.is_connected());
    let vif = toolstack::connect_backend(&hv, &drv, &guest, SPEC).expect("the rings are mapped");
    // Once bound, a back end that goes is seen going.
    let port = vif.port();
    hv.evtchn_close(&drv, port).expect("close");
    hv.store()
        .write(drv.id(), &format!("{bdir}/hotplug-status"), "gone")
        .expect("write");
    assert_eq!(front.check_backend(&mut gpool), LinkChange::Disconnected);
    vif.disconnect(&mut dpool);
    front.close(&mut gpool);
}

/// Found by the soak: a driver domain destroyed while its kernel still held its vifs'
/// rings open kept both ring grants of every guest mapped for good (the destruction's
/// unmap is refused while a ring reads the page), so each restart cost every guest two
/// pages. The reaper now unmaps them once the dead kernel lets go.
#[test]
fn rings_a_destroyed_driver_domain_held_open_are_unmapped_once_it_lets_go() {
    let (hv, guest, drv, mut gpool, _) = pair();
    let pages = guest.free_page_count();
    let refs = guest.grant_table().refs_free();
    let (front, vif) = toolstack::plug_vif(&hv, &drv, &guest, SPEC).expect("plug");
    // The driver domain dies with its kernel still holding the vif.
    let id = drv.id();
    drop(drv);
    hv.destroy_domain(id).expect("destroy");
    toolstack::close_backend(&hv, id, guest.id(), 0);
    front.close(&mut gpool);
    let gt = guest.grant_table();
    assert_eq!(
        gt.retry_deferred(),
        2,
        "the dead kernel still reads both rings"
    );
    // Its kernel ends and drops what it held; the toolstack's reaper runs.
    drop(vif);
    hv.reap();
    assert_eq!(gt.retry_deferred(), 0, "both ring grants are released");
    assert_eq!(gt.refs_free(), refs);
    assert_eq!(guest.free_page_count(), pages);
    assert_eq!(hv.reap(), 0, "and the dead domain's frames are free");
}
