//! Multi-queue netif, as Linux's netfront sets it up when a back end offers it
//! (`multi-queue-max-queues`): the front end writes `multi-queue-num-queues` and each
//! queue's rings and channel under `queue-<n>/`; the back end connects each queue as a
//! vif of its own over its own rings and channel, hands them over and takes them back,
//! and refuses more queues than it offered.

use std::sync::Arc;

use hv::store::xenbus::{MULTI_QUEUE_MAX_QUEUES, MULTI_QUEUE_NUM_QUEUES};
use hv::store::{XenStore, XenbusState};
use hv::{Domain, DomainConfig, GrantVersion, HvConfig, Hypervisor};
use net::netback::{self, Vif, VIF_WINDOW_SLOTS};
use net::netif::{RxRequest, TxRequest};
use net::rawfront::RawFront;
use net::skb::{SkbPool, NET_SKB_PAD};
use net::xenbus;

fn domain(hv: &Arc<Hypervisor>, name: &str, slots: u32) -> Arc<Domain> {
    hv.create_domain(&DomainConfig {
        name: name.into(),
        pages: 1024,
        grant_frames: 4,
        grant_version: GrantVersion::V2,
        vcpus: 1,
        map_slots: slots,
        driver_domain: slots > 4,
    })
    .expect("domain")
}

/// A hypervisor and a driver domain with window slots for four queues.
fn host() -> (Arc<Hypervisor>, Arc<Domain>) {
    let hv = Hypervisor::new(HvConfig {
        frames: 8192,
        ..HvConfig::default()
    })
    .expect("hv");
    let drv = domain(&hv, "driver", 4 * VIF_WINDOW_SLOTS);
    (hv, drv)
}

/// Queue `q` at index `q`, its window slots after the queue before it.
fn at(q: u32) -> (u16, u32) {
    (q as u16, q * VIF_WINDOW_SLOTS)
}

/// A frame of `len` bytes, byte `i` being `i * 3 + seed`.
fn frame(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(3) ^ seed).collect()
}

/// Sends `f` (at most a page) through queue `front`'s TX ring as request `i` and runs
/// every vif's TX: the frames each delivered.
fn send(front: &RawFront, vifs: &mut [Vif], pool: &mut SkbPool, i: u16, f: &[u8]) -> Vec<Vec<u8>> {
    front.dom.write(front.data, 0, f).expect("data");
    front.put(
        u32::from(i),
        TxRequest {
            gref: front.data_ref,
            offset: 0,
            flags: 0,
            id: i,
            size: f.len() as u16,
        },
    );
    front.publish_tx(u32::from(i) + 1);
    vifs.iter_mut()
        .map(|v| {
            // As `pvio backend` serves them: every slot copied and answered at once.
            v.set_tx_copy(true);
            let mut out = Vec::new();
            v.tx_action(pool, 64, |p, s| {
                let mut b = vec![0u8; p.len(s)];
                p.read(s, 0, &mut b).expect("read");
                out.push(b);
                p.free(s);
            });
            out.concat()
        })
        .collect()
}

#[test]
fn each_queue_moves_packets_on_its_own_rings_survives_a_hand_over_and_too_many_are_refused() {
    let (hv, drv) = host();
    let guest = domain(&hv, "guest", 4);
    let mut pool = SkbPool::new(Arc::clone(&drv), 64, 64).expect("pool");
    let store = hv.store();
    let xen = || hv::Pvio::new(&hv, &drv);

    // The toolstack's and the back end's part: four queues offered.
    xenbus::create_vif(store, drv.id(), guest.id(), 0, [2, 0, 0, 0, 0, 7]).expect("vif");
    netback::probe_queues(store, drv.id(), guest.id(), 0, 4).expect("probe");
    let bdir = xenbus::backend_dir(drv.id(), guest.id(), 0);
    assert_eq!(
        store
            .read(drv.id(), &format!("{bdir}/{MULTI_QUEUE_MAX_QUEUES}"))
            .as_deref(),
        Ok("4")
    );
    // The guest sets up two.
    let fronts = RawFront::publish_queues(&hv, &guest, drv.id(), 0, 2).expect("front");
    let fdir = xenbus::frontend_dir(guest.id(), 0);
    assert!(store
        .read(guest.id(), &format!("{fdir}/queue-1/tx-ring-ref"))
        .is_ok());
    let mut vifs = Vif::connect_queues(xen(), guest.id(), 0, 4, at).expect("queues");
    assert_eq!(vifs.len(), 2);
    assert_eq!(store.xenbus_state(drv.id(), &bdir), XenbusState::Connected);
    assert_ne!(vifs[0].port(), vifs[1].port(), "a channel each");

    // Guest TX on queue 1 leaves through queue 1's vif alone.
    let f1 = frame(200, 1);
    let got = send(&fronts[1], &mut vifs, &mut pool, 0, &f1);
    assert_eq!(got, vec![Vec::new(), f1.clone()]);
    assert_eq!(fronts[1].tx_response(0).status, 0, "answered OKAY");
    assert_eq!(fronts[1].word(fronts[1].tx, 8), 1, "on queue 1's ring");
    assert_eq!(fronts[0].word(fronts[0].tx, 8), 0, "nothing on queue 0's");

    // Guest RX on queue 0: a buffer posted there is filled by queue 0's vif.
    let mut f0 = fronts.into_iter();
    let (mut q0, q1) = (f0.next().expect("q0"), f0.next().expect("q1"));
    let gref = q0.rx_buffer(drv.id()).expect("buffer");
    q0.post_rx(
        0,
        RxRequest {
            id: 5,
            pad: 0,
            gref,
        },
        1,
    );
    let rx = frame(300, 9);
    let skb = pool.alloc(NET_SKB_PAD).expect("skb");
    pool.put(skb, &rx).expect("put");
    vifs[0].start_xmit(&mut pool, skb);
    assert_eq!(vifs[0].rx_action(&mut pool), 1);
    let r = q0.rx_response(0);
    assert_eq!((r.id, r.status), (5, 300));
    let mut placed = vec![0u8; 300];
    let page = q0.page_of(gref).expect("page");
    guest
        .read(page, usize::from(r.offset), &mut placed)
        .expect("read");
    assert_eq!(placed, rx);
    assert_eq!(q1.word(q1.rx, 8), 0, "queue 1's RX ring untouched");

    // A clean stop hands both over; the next back end takes each back on its rings.
    for v in vifs {
        v.hand_over(&mut pool);
    }
    assert_eq!(hv.mappings_held(&drv), 0);
    let mut vifs = Vif::resume_queues(xen(), guest.id(), 0, 4, at, |_| None).expect("resumed");
    assert_eq!(vifs.len(), 2);
    let f2 = frame(120, 4);
    let got = send(&q1, &mut vifs, &mut pool, 1, &f2);
    assert_eq!(got, vec![Vec::new(), f2]);
    assert_eq!(q1.tx_response(1).status, 0);
    for v in vifs {
        v.disconnect(&mut pool);
    }
    assert_eq!(hv.mappings_held(&drv), 0);

    // One queue with the count written: its keys at the top, as Linux's netfront
    // writes them.
    let solo = domain(&hv, "solo", 4);
    xenbus::create_vif(store, drv.id(), solo.id(), 0, [2, 0, 0, 0, 0, 8]).expect("vif");
    netback::probe_queues(store, drv.id(), solo.id(), 0, 4).expect("probe");
    let one = RawFront::publish_queues(&hv, &solo, drv.id(), 0, 1).expect("front");
    let sdir = xenbus::frontend_dir(solo.id(), 0);
    assert_eq!(
        store
            .read(solo.id(), &format!("{sdir}/{MULTI_QUEUE_NUM_QUEUES}"))
            .as_deref(),
        Ok("1")
    );
    assert!(store
        .read(solo.id(), &format!("{sdir}/tx-ring-ref"))
        .is_ok());
    let mut vifs = Vif::connect_queues(xen(), solo.id(), 0, 4, at).expect("one queue");
    let f3 = frame(64, 2);
    assert_eq!(send(&one[0], &mut vifs, &mut pool, 0, &f3), vec![f3]);
    for v in vifs {
        v.disconnect(&mut pool);
    }

    // More queues than offered: refused, nothing kept.
    let greedy = domain(&hv, "greedy", 4);
    xenbus::create_vif(store, drv.id(), greedy.id(), 0, [2, 0, 0, 0, 0, 9]).expect("vif");
    netback::probe_queues(store, drv.id(), greedy.id(), 0, 4).expect("probe");
    let _five = RawFront::publish_queues(&hv, &greedy, drv.id(), 0, 5).expect("front");
    assert!(Vif::connect_queues(xen(), greedy.id(), 0, 4, at).is_err());
    assert_eq!(hv.mappings_held(&drv), 0);
    assert_ne!(
        store.xenbus_state(drv.id(), &xenbus::backend_dir(drv.id(), greedy.id(), 0)),
        XenbusState::Connected
    );
}

/// A TCP/IPv4 frame's headers, from `sport` to port 80, addresses 10.0.0.1 → 10.0.0.2.
fn tcp4(sport: u16) -> Vec<u8> {
    let mut f = vec![0u8; 14 + 20 + 20];
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    f[14] = 0x45;
    f[14 + 9] = 6;
    f[14 + 12..14 + 16].copy_from_slice(&[10, 0, 0, 1]);
    f[14 + 16..14 + 20].copy_from_slice(&[10, 0, 0, 2]);
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&80u16.to_be_bytes());
    f
}

/// Frames for the guest go to the queue of their flow: one flow always to the same
/// queue, many flows over every queue, and any bytes at all (cut short, not IP, a
/// fragment) to a queue that exists.
#[test]
fn a_flow_keeps_its_queue_flows_spread_over_all_and_any_frame_gets_one() {
    for n in [2usize, 3, 4] {
        let mut used = vec![0usize; n];
        for port in 1000..1064u16 {
            let q = netback::select_queue(&tcp4(port), n);
            assert_eq!(q, netback::select_queue(&tcp4(port), n), "same flow");
            used[q] += 1;
        }
        assert!(used.iter().all(|&u| u > 0), "{n} queues: {used:?}");
    }
    // A fragment's ports are not looked at: every fragment of a datagram alike.
    let mut frag = tcp4(1000);
    frag[14 + 6] = 0x20;
    let mut other = tcp4(2000);
    other[14 + 6] = 0x20;
    assert_eq!(
        netback::select_queue(&frag, 4),
        netback::select_queue(&other, 4)
    );
    assert_eq!(netback::select_queue(&tcp4(1000), 1), 0);
    let whole = tcp4(1234);
    for len in 0..whole.len() {
        assert!(netback::select_queue(&whole[..len], 4) < 4);
    }
    for b in 0..=255u8 {
        assert!(netback::select_queue(&[b; 60], 3) < 3);
    }
}

/// A queue count that is no number, zero, or a queue whose keys are missing: the vif is
/// refused whole, no ring or channel kept, and the back end does not go `Connected`.
#[test]
fn a_bad_queue_count_or_a_queue_without_its_keys_refuses_the_vif_whole() {
    let (hv, drv) = host();
    let store = hv.store();
    for (i, bad) in ["0", "two", "-1", "", "3"].iter().enumerate() {
        let g = domain(&hv, &format!("g{i}"), 4);
        xenbus::create_vif(store, drv.id(), g.id(), 0, [2, 0, 0, 0, 0, 1]).expect("vif");
        netback::probe_queues(store, drv.id(), g.id(), 0, 4).expect("probe");
        let _f = RawFront::publish_queues(&hv, &g, drv.id(), 0, 2).expect("front");
        let fdir = xenbus::frontend_dir(g.id(), 0);
        // "3": one more queue than it set up, whose keys are not there.
        store
            .write(g.id(), &format!("{fdir}/{MULTI_QUEUE_NUM_QUEUES}"), bad)
            .expect("key");
        let r = Vif::connect_queues(hv::Pvio::new(&hv, &drv), g.id(), 0, 4, at);
        assert!(r.is_err(), "{bad:?} accepted");
        assert_eq!(hv.mappings_held(&drv), 0, "{bad:?}: something kept");
        assert_ne!(
            store.xenbus_state(drv.id(), &xenbus::backend_dir(drv.id(), g.id(), 0)),
            XenbusState::Connected
        );
    }
}
