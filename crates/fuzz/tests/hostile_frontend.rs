//! A hostile front end writes whatever it likes into its rings. netback must answer or
//! drop what it can, disable that vif on a protocol break, and leave every other vif —
//! and the driver domain — working.

use std::sync::Arc;

use hv::store::{XenStore, XenbusState};
use hv::{Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
use net::netback::{self, Disabled, Vif, VIF_WINDOW_SLOTS};
use net::netfront::FrontConfig;
use net::netfront::Netfront;
use net::netif::{RxRequest, TxFatal, NETRXF_MORE_DATA, NETTXF_MORE_DATA, XEN_NETIF_RSP_OKAY};
use net::skb::{SkbPool, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};
use net::xenbus;

use pvio_fuzz::netback::{connect_raw, release, req, RawFront as Raw};

/// Runs `f` on a thread of its own and fails the test if it does not return within a
/// few seconds: a guest that can hang the driver domain's loop must show as a failure,
/// not as a test that never ends.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("{what} did not return: a guest hung the driver domain"))
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
        ..HvConfig::default()
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
    pvio_fuzz::netback::guest(hv, name, 1024)
}

/// A well-behaved guest's vif, index 1 (window slots from VIF_WINDOW_SLOTS on).
fn plug_good(w: &World, good: &Arc<Domain>) -> (Netfront, Vif) {
    let spec = VifSpec {
        handle: 0,
        mac: [2, 0, 0, 0, 0, 7],
        index: 1,
        front: FrontConfig::default(),
    };
    toolstack::plug_vif(&w.hv, &w.drv, good, spec).expect("good vif")
}

/// The evil vif at window slots 0.., a good one beside it at VIF_WINDOW_SLOTS.. .
fn pair(w: &World) -> (Raw, Vif, Netfront, Vif, Arc<Domain>) {
    let evil = guest(&w.hv, "evil");
    let raw = connect_raw(&w.hv, &evil, &w.drv);
    let bad = Vif::connect(hv::Pvio::new(&w.hv, &w.drv), evil.id(), 0, 0, 0).expect("evil vif");
    let good = guest(&w.hv, "good");
    let (front, vif) = plug_good(w, &good);
    (raw, bad, front, vif, good)
}

/// The good vif still carries a packet both ways after the evil one misbehaved.
fn good_still_works(w: &mut World, (front, vif, dom): (&mut Netfront, &mut Vif, &Arc<Domain>)) {
    let mut gpool = SkbPool::new(Arc::clone(dom), 16, 16).expect("pool");
    good_sends(w, front, vif, &mut gpool);
}

/// The good guest sends a packet from `gpool` and it crosses.
fn good_sends(w: &mut World, front: &mut Netfront, vif: &mut Vif, gpool: &mut SkbPool) {
    pvio_fuzz::netback::good_sends_through(&mut w.pool, front, vif, gpool);
}

#[test]
fn a_producer_index_more_than_a_ring_ahead_disables_that_vif_only() {
    let mut w = world();
    let (raw, mut bad, mut front, mut vif, good) = pair(&w);
    raw.publish_tx(100_000);
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
        raw.publish_tx(reqs.len() as u32);
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
    raw.publish_tx(reqs.len() as u32);
    let mut delivered = Vec::new();
    bad.tx_action(&mut w.pool, 64, |_, s| delivered.push(s));
    assert_eq!(bad.disabled(), None, "tolerated errors keep the vif up");
    assert_eq!(delivered.len(), 1, "only the good packet goes on");
    assert_eq!(bad.stats().tx_grant_errors, 1);
    let c = bad.tx_check_stats();
    assert_eq!(c.drops.total(), 3);
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
    // The byte bound, and the stopped device's backlog behind it.
    assert!(
        bad.rx_queued() <= net::netback::RX_QUEUE_BYTES / 1514 + 1 + net::netback::RX_QUEUE_BACKLOG
    );
    assert!(w.pool.free_buffers() >= free - bad.rx_queued(), "bounded");
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}

#[test]
fn a_guest_that_stops_posting_holds_the_nics_poll_only_for_a_bounded_time_and_loses_nothing_before()
{
    use netback::{RX_DESC_COST, RX_HOLD_LIMIT, RX_QUEUE_BYTES};
    use std::time::Duration;
    let mut w = world();
    let (mut raw, mut bad, mut front, mut vif, good) = pair(&w);
    let t0 = Duration::from_secs(1);
    let empty = bad.rx_room(t0).expect("an empty queue limits the poll");
    assert_eq!(empty, RX_QUEUE_BYTES / RX_DESC_COST);
    // The driver domain polls the NIC for no more than the room it is given, here a
    // full-sized frame a descriptor: the queue fills, nothing is dropped.
    let mut queued = 0;
    while let Some(room) = bad.rx_room(t0).filter(|&r| r > 0) {
        for _ in 0..room {
            let s = w.pool.alloc(NET_SKB_PAD).expect("buffer");
            w.pool.put(s, &[1u8; 1514]).expect("put");
            bad.start_xmit(&mut w.pool, s);
            queued += 1;
        }
    }
    assert_eq!(bad.stats().rx_queue_full, 0, "flow control lost nothing");
    assert_eq!(bad.rx_queued(), queued);
    // No room: the vif holds the poll, once counted, until its limit.
    assert_eq!(bad.rx_room(t0), Some(0));
    assert_eq!(bad.stats().rx_nic_held, 1);
    assert_eq!(bad.rx_hold_until(), Some(t0 + RX_HOLD_LIMIT));
    let almost = t0 + RX_HOLD_LIMIT - Duration::from_millis(1);
    assert_eq!(bad.rx_room(almost), Some(0));
    // The guest took nothing for the whole limit: let go, so that the NIC's other
    // traffic flows; the well-behaved vif beside it never limited anything.
    let late = t0 + RX_HOLD_LIMIT;
    assert_eq!(bad.rx_room(late), None);
    assert_eq!(bad.stats().rx_hold_expired, 1);
    assert_eq!(bad.rx_hold_until(), None);
    assert_eq!(bad.rx_room(late + Duration::from_secs(5)), None);
    assert!(vif.rx_room(late).is_some_and(|r| r > 0));
    // Its packets meanwhile are dropped at its own bounded queue (past the stopped
    // device's backlog) and counted.
    for _ in 0..=netback::RX_QUEUE_BACKLOG + RX_DESC_COST / 1514 + 1 {
        let s = w.pool.alloc(NET_SKB_PAD).expect("buffer");
        w.pool.put(s, &[1u8; 1514]).expect("put");
        bad.start_xmit(&mut w.pool, s);
    }
    assert!(bad.stats().rx_queue_full > 0);
    // Once it takes packets again and its queue drains to half, it is flow-controlled
    // again.
    for i in 0..256u32 {
        let gref = raw.rx_buffer(w.drv.id()).expect("buffer");
        raw.post_rx(
            i,
            RxRequest {
                id: i as u16,
                pad: 0,
                gref,
            },
            i + 1,
        );
    }
    bad.rx_action(&mut w.pool);
    assert!(bad.rx_queued() * 1514 <= RX_QUEUE_BYTES / 2);
    assert!(bad.rx_room(late).is_some_and(|r| r > 0));
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}

// --- Findings of the hostile-input run (issue 15) -----------------------------------

#[test]
fn a_guest_with_too_few_rx_buffers_for_a_packet_cannot_hang_the_rx_action() {
    // Finding 1: one buffer posted, a packet that needs two (the front end offers
    // feature-sg). The RX action must stop, ask to be told of more buffers, and return.
    let mut w = world();
    let (mut raw, mut bad, mut front, mut vif, good) = pair(&w);
    assert!(bad.can_sg());
    let b0 = raw.rx_buffer(w.drv.id()).expect("buffer");
    raw.post_rx(
        0,
        RxRequest {
            id: 10,
            pad: 0,
            gref: b0,
        },
        1,
    );
    let s = w.pool.alloc(NET_SKB_PAD).expect("skb");
    w.pool.put(s, &[0x11; 1500]).expect("put");
    let frag = w.pool.alloc_page().expect("page");
    w.drv.fill(frag, 0, 3500, 0x22).expect("fill");
    w.pool
        .add_frag(
            s,
            net::skb::Frag {
                page: net::skb::FragPage::Local(frag),
                offset: 0,
                len: 3500,
            },
        )
        .expect("frag");
    bad.start_xmit(&mut w.pool, s);
    let (mut w, mut bad, n) = within("rx_action", move || {
        let n = bad.rx_action(&mut w.pool);
        (w, bad, n)
    });
    assert_eq!(n, 0, "nothing can be delivered yet");
    assert_eq!(bad.rx_queued(), 1, "the packet waits for buffers");
    assert!(bad.stats().rx_stalls > 0, "the stall is counted");
    assert_eq!(bad.disabled(), None, "too few buffers is no protocol break");
    assert_eq!(
        raw.word(raw.rx, 4),
        2,
        "req_event asks for a notification at the next buffer posted"
    );
    // A second buffer lets the packet through, over two responses.
    let b1 = raw.rx_buffer(w.drv.id()).expect("buffer");
    raw.post_rx(
        1,
        RxRequest {
            id: 11,
            pad: 0,
            gref: b1,
        },
        2,
    );
    assert_eq!(bad.rx_action(&mut w.pool), 1);
    assert_eq!(bad.stats().rx_packets, 1);
    let (r0, r1) = (raw.rx_response(0), raw.rx_response(1));
    assert_eq!(
        (r0.id, r0.status, r0.flags & NETRXF_MORE_DATA),
        (10, 4096, NETRXF_MORE_DATA)
    );
    assert_eq!(
        (r1.id, r1.status, r1.flags & NETRXF_MORE_DATA),
        (11, 904, 0)
    );
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}

#[test]
fn a_producer_index_moved_behind_the_consumer_disables_that_vif_only() {
    // Finding 2: with one request consumed and still unanswered (its page is mapped
    // and the packet not yet freed), the front end moves req_prod back by one. The
    // ring used to see ~2^32 requests.
    let mut w = world();
    let (raw, mut bad, mut front, mut vif, good) = pair(&w);
    let free = w.pool.free_buffers();
    raw.put(0, req(raw.data_ref, 0, 0, 1, 200));
    raw.publish_tx(1);
    let mut held = Vec::new();
    assert_eq!(bad.tx_action(&mut w.pool, 64, |_, s| held.push(s)), 1);
    assert_eq!(
        raw.word(raw.tx, 8),
        0,
        "the mapped slot is not answered yet"
    );
    raw.publish_tx(0);
    let (mut w, mut bad, n) = within("tx_action", move || {
        let n = bad.tx_action(&mut w.pool, 64, |p, s| p.free(s));
        (w, bad, n)
    });
    assert_eq!(n, 0);
    assert_eq!(bad.disabled(), Some(Disabled::RingBroken));
    for s in held {
        w.pool.free(s);
    }
    release(&mut w.pool, &mut bad);
    bad.disconnect(&mut w.pool);
    assert_eq!(w.pool.free_buffers(), free, "nothing leaked");
    assert_eq!(
        w.hv.mappings_held(&w.drv),
        2,
        "only the good vif's rings stay mapped"
    );
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}

#[test]
fn dropped_chains_count_against_the_tx_budget() {
    // Finding 2, second half: requests that are answered with an error at once cost
    // the back end as much as packets do; a budget that counts only delivered packets
    // lets a front end that keeps refilling its ring hold netback forever.
    let mut w = world();
    let (raw, mut bad, _front, _vif, _good) = pair(&w);
    for i in 0..200 {
        raw.put(i, req(raw.data_ref, 0, 0, i as u16, 10));
    }
    raw.publish_tx(200);
    assert_eq!(bad.tx_action(&mut w.pool, 64, |p, s| p.free(s)), 0);
    assert_eq!(
        raw.word(raw.tx, 8),
        64,
        "one budget's worth of chains consumed"
    );
    while bad.tx_pending() {
        bad.tx_action(&mut w.pool, 64, |p, s| p.free(s));
    }
    assert_eq!(raw.word(raw.tx, 8), 200, "the rest in later calls");
    assert_eq!(bad.disabled(), None);
}

#[test]
fn a_fatal_chain_after_good_packets_leaks_nothing_and_answers_them() {
    // Finding 3: a good packet, then an unterminated chain, in one batch.
    let mut w = world();
    let (raw, mut bad, mut front, mut vif, good) = pair(&w);
    let free = w.pool.free_buffers();
    raw.put(0, req(raw.data_ref, 0, 0, 1, 100));
    raw.put(1, req(raw.data_ref, 0, NETTXF_MORE_DATA, 2, 200));
    raw.put(2, req(raw.data_ref, 0, NETTXF_MORE_DATA, 3, 100));
    raw.publish_tx(3);
    let mut delivered = 0;
    bad.tx_action(&mut w.pool, 64, |p, s| {
        delivered += 1;
        p.free(s)
    });
    assert_eq!(bad.disabled(), Some(Disabled::Fatal(TxFatal::Unterminated)));
    assert_eq!(
        delivered, 1,
        "the packet before the fatal chain still goes on"
    );
    let r = raw.tx_response(0);
    assert_eq!((r.id, r.status), (1, XEN_NETIF_RSP_OKAY), "and is answered");
    bad.disconnect(&mut w.pool);
    assert_eq!(w.pool.free_buffers(), free, "no buffer of the batch leaked");
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}

#[test]
fn a_packet_of_the_most_slots_with_a_long_first_slot_is_carried_whole_and_answered() {
    // Finding 4: 18 slots (the legal maximum) whose first slot is longer than the
    // copied header: 18 pages to map, one more than a buffer's fragments.
    let mut w = world();
    let (raw, mut bad, mut front, mut vif, good) = pair(&w);
    let free = w.pool.free_buffers();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    raw.dom.write(raw.data, 0, &data).expect("data");
    let first = 200u16;
    let rest = 60u16;
    let total = first + 17 * rest;
    let mut want = data[..first as usize].to_vec();
    for i in 1..18usize {
        want.extend_from_slice(&data[200 * i..200 * i + rest as usize]);
    }
    let slot = |i: u32| {
        if i == 0 {
            req(raw.data_ref, 0, NETTXF_MORE_DATA, 0, total)
        } else {
            let more = if i < 17 { NETTXF_MORE_DATA } else { 0 };
            req(raw.data_ref, 200 * i as u16, more, i as u16, rest)
        }
    };
    // Many times over: a leaked pending slot per packet would stop the vif's TX.
    for round in 0..300u32 {
        let base = round * 18;
        for i in 0..18u32 {
            raw.put(base + i, slot(i));
        }
        raw.publish_tx(base + 18);
        let mut got = Vec::new();
        bad.tx_action(&mut w.pool, 64, |_, s| got.push(s));
        assert_eq!(got.len(), 1, "round {round}: the packet goes on");
        let s = got[0];
        assert_eq!(w.pool.len(s), total as usize);
        let mut bytes = vec![0u8; total as usize];
        w.pool.read(s, 0, &mut bytes).expect("read");
        assert_eq!(bytes, want, "round {round}: every byte in order");
        w.pool.free(s);
        release(&mut w.pool, &mut bad);
        assert_eq!(
            raw.word(raw.tx, 8),
            base + 18,
            "round {round}: all 18 answered"
        );
        for i in 0..18 {
            assert_eq!(raw.tx_response(base + i).status, XEN_NETIF_RSP_OKAY);
        }
    }
    assert_eq!(bad.disabled(), None);
    assert_eq!(w.pool.free_buffers(), free);
    good_still_works(&mut w, (&mut front, &mut vif, &good));
}

#[test]
fn disconnect_unmaps_the_rings_so_the_guest_leaves_no_frame_behind() {
    // Finding 5.
    let mut w = world();
    let (raw, bad, _front, _vif, _good) = pair(&w);
    assert_eq!(w.hv.mappings_held(&w.drv), 4, "two vifs, two rings each");
    bad.disconnect(&mut w.pool);
    assert_eq!(
        w.hv.mappings_held(&w.drv),
        2,
        "the evil vif's rings are unmapped"
    );
    let evil = raw.dom.id();
    drop(raw);
    w.hv.destroy_domain(evil).expect("destroy");
    assert_eq!(
        w.hv.reap(),
        0,
        "no frame of the destroyed guest is still referenced"
    );
}

#[test]
fn a_failed_connect_releases_what_it_took_and_a_retry_succeeds() {
    // Finding 6: a bad event-channel value, then a back end whose state cannot move to
    // Connected. Each failure must leave nothing mapped and no port open.
    let w = world();
    let evil = guest(&w.hv, "evil");
    let raw = connect_raw(&w.hv, &evil, &w.drv);
    let store = w.hv.store();
    let fdir = xenbus::frontend_dir(evil.id(), 0);
    let good_port = store
        .read(evil.id(), &format!("{fdir}/event-channel"))
        .expect("port");
    store
        .write(evil.id(), &format!("{fdir}/event-channel"), "9999")
        .expect("write");
    assert!(Vif::connect(hv::Pvio::new(&w.hv, &w.drv), evil.id(), 0, 0, 0).is_err());
    assert_eq!(
        w.hv.mappings_held(&w.drv),
        0,
        "bad port: rings unmapped again"
    );
    store
        .write(evil.id(), &format!("{fdir}/event-channel"), &good_port)
        .expect("write");
    // The back end's state is moved to Closed behind its back: Connected is refused.
    let bdir = xenbus::backend_dir(w.drv.id(), evil.id(), 0);
    store
        .switch_state(hv::DomId::DOM0, &bdir, XenbusState::Closing)
        .expect("closing");
    store
        .switch_state(hv::DomId::DOM0, &bdir, XenbusState::Closed)
        .expect("closed");
    assert!(Vif::connect(hv::Pvio::new(&w.hv, &w.drv), evil.id(), 0, 0, 0).is_err());
    assert_eq!(
        w.hv.mappings_held(&w.drv),
        0,
        "failed switch: rings unmapped again"
    );
    assert_eq!(
        w.hv.evtchn_open_ports(&w.drv),
        0,
        "failed switch: the bound port is closed again"
    );
    store
        .switch_state(hv::DomId::DOM0, &bdir, XenbusState::Initialising)
        .expect("restart");
    netback::probe(store, w.drv.id(), evil.id(), 0).expect("probe");
    let vif =
        Vif::connect(hv::Pvio::new(&w.hv, &w.drv), evil.id(), 0, 0, 0).expect("a retry connects");
    assert_eq!(vif.disabled(), None);
    let _ = raw;
}
