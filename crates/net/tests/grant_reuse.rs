//! Grant reuse (paper 000 §4.4): netback's cache of mapped grants, netfront's pages
//! bound to references, and the control ring between them. Steady traffic makes no
//! map and no unmap; a page leaves only through a confirmed drop, after which neither
//! the driver domain nor its device can reach it; hostile control messages and
//! references are bounded and counted.

use std::collections::VecDeque;
use std::sync::Arc;

use hv::{DeviceId, Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor, Iova};
use net::netback::{DirectToken, Vif, CACHE_SLOTS, CTRL_WAITING, VIF_WINDOW_SLOTS};
use net::netfront::FrontConfig;
use net::netfront::{Grants, Netfront, RxBuffers};
use net::netif::{
    CtrlRequest, NetifGref, RxRequest, GREF_LIST_MAX, XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER,
    XEN_NETIF_CTRL_STATUS_NOT_SUPPORTED, XEN_NETIF_CTRL_STATUS_SUCCESS,
    XEN_NETIF_CTRL_TYPE_ADD_GREF_MAPPING, XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING,
    XEN_NETIF_CTRL_TYPE_GET_GREF_MAPPING_SIZE,
};
use net::rawfront::RawFront;
use net::skb::{SkbId, SkbPool, NET_IP_ALIGN, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};

const DEV: DeviceId = DeviceId(7);

struct Pair {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    guest: Arc<Domain>,
    dpool: SkbPool,
    gpool: SkbPool,
    front: Netfront,
    vif: Vif,
    /// A direct vif's buffers the NIC holds, in the order given.
    held: VecDeque<(Iova, DirectToken)>,
}

fn machine() -> (Arc<Hypervisor>, Arc<Domain>) {
    let hv = Hypervisor::new(HvConfig {
        frames: 16384,
        grant_path: GrantPath::Optimised,
        ..HvConfig::default()
    })
    .expect("hv");
    let drv = domain(&hv, "drv", true, 3 * VIF_WINDOW_SLOTS);
    hv.iommu_attach(DEV, &drv).expect("attach");
    (hv, drv)
}

fn domain(hv: &Hypervisor, name: &str, driver: bool, slots: u32) -> Arc<Domain> {
    hv.create_domain(&DomainConfig {
        name: name.into(),
        pages: 2048,
        grant_frames: 8,
        grant_version: GrantVersion::V2,
        vcpus: 1,
        map_slots: slots,
        driver_domain: driver,
    })
    .expect("domain")
}

/// The guest's vif 0 (index 0) on `drv`, netfront giving its pages as `grants` says.
fn plug(
    hv: &Arc<Hypervisor>,
    drv: &Arc<Domain>,
    guest: &Arc<Domain>,
    grants: Grants,
) -> (Netfront, Vif) {
    let spec = VifSpec {
        handle: 0,
        mac: [0x02, 0, 0, 0, 0, 2],
        index: 0,
        front: FrontConfig {
            grants,
            ..FrontConfig::default()
        },
    };
    toolstack::plug_vif(hv, drv, guest, spec).expect("vif")
}

/// A guest with grant reuse on a direct-placement vif.
fn pair() -> Pair {
    let (hv, drv) = machine();
    let guest = domain(&hv, "guest", false, 4);
    let (front, mut vif) = plug(&hv, &drv, &guest, Grants::Reuse);
    assert!(front.grant_reuse(), "the back end offered it");
    vif.enable_direct();
    let dpool = SkbPool::new(Arc::clone(&drv), 512, 64).expect("pool");
    let gpool = SkbPool::new(Arc::clone(&guest), 512, 600).expect("pool");
    Pair {
        hv,
        drv,
        guest,
        dpool,
        gpool,
        front,
        vif,
        held: VecDeque::new(),
    }
}

fn frame(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed) as u8)
        .collect()
}

/// One round of guest RX: the ring refilled and taken by netback, `n` frames written
/// by the NIC into the buffers it holds mapped (direct placement) or copied by netback
/// from the bridge, every byte checked at netfront.
fn rx_round(p: &mut Pair, n: usize, seed: u32) {
    p.front.refill_rx(&mut p.gpool);
    p.vif.rx_direct_refill();
    let held = &mut p.held;
    p.vif.rx_direct_give(|iova, _, token| {
        held.push_back((iova, token));
        true
    });
    let sent: Vec<Vec<u8>> = (0..n)
        .map(|k| frame(60 + (k * 97) % 1400, seed + k as u32))
        .collect();
    if p.vif.is_direct() {
        let mut dma = p.hv.iommu().device(DEV);
        for f in &sent {
            let (iova, token) = p.held.pop_front().expect("a buffer with the NIC");
            dma.dma_write(iova, f).expect("mapped");
            p.vif.rx_direct_done(token, f.len() as u16, false, false);
        }
        p.vif.rx_direct_flush();
    } else {
        for f in &sent {
            let s = p.dpool.alloc(NET_SKB_PAD + NET_IP_ALIGN).expect("skb");
            p.dpool.put(s, f).expect("put");
            p.vif.start_xmit(&mut p.dpool, s);
        }
        assert_eq!(p.vif.rx_action(&mut p.dpool), n);
    }
    let mut got = Vec::new();
    p.front.poll_rx(&mut p.gpool, 256, |pool, s| {
        let mut b = vec![0u8; pool.len(s)];
        pool.read(s, 0, &mut b).expect("read");
        got.push(b);
        pool.free(s);
    });
    assert_eq!(got, sent);
}

/// One round of guest TX: `n` packets (short ones copied whole, long ones read through
/// their page's mapping), every byte checked at netback, every buffer freed and
/// every slot answered.
fn tx_round(p: &mut Pair, n: usize, seed: u32) {
    let sent: Vec<Vec<u8>> = (0..n)
        .map(|k| frame(60 + (k * 211) % 1454, seed + k as u32))
        .collect();
    for f in &sent {
        let s = p.gpool.alloc(NET_SKB_PAD).expect("skb");
        p.gpool.put(s, f).expect("put");
        p.front.xmit(&mut p.gpool, s).expect("room");
    }
    let mut out: Vec<SkbId> = Vec::new();
    assert_eq!(p.vif.tx_action(&mut p.dpool, 256, |_, s| out.push(s)), n);
    for (s, want) in out.iter().zip(&sent) {
        let mut got = vec![0u8; p.dpool.len(*s)];
        p.dpool.read(*s, 0, &mut got).expect("read");
        assert_eq!(&got, want);
    }
    for s in out {
        p.dpool.free(s);
    }
    let mut tokens = Vec::new();
    p.dpool.take_released(|r| tokens.push(r.token));
    p.vif.tx_release(tokens);
    while p.front.poll_tx(&mut p.gpool) > 0 {}
}

#[test]
fn steady_traffic_through_the_cache_maps_and_unmaps_nothing_and_every_byte_arrives() {
    let mut p = pair();
    // The first rounds bind and map the pages the guest's pool hands out.
    for r in 0..4 {
        rx_round(&mut p, 200, r);
        tx_round(&mut p, 100, r);
    }
    let before = p.vif.cache_stats().expect("cache").clone();
    let held = p.hv.mappings_held(&p.drv);
    let bindings = p.front.stats().reuse_bindings;
    for r in 4..24 {
        rx_round(&mut p, 200, r);
        tx_round(&mut p, 100, r);
    }
    let after = p.vif.cache_stats().expect("cache").clone();
    // 20 rounds of 200 RX buffers and of 100 TX packets, long ones 2 lookups: all hits.
    assert_eq!(after.maps - before.maps, 0, "{after:?}");
    assert_eq!(after.unmaps - before.unmaps, 0, "{after:?}");
    assert!(after.hits - before.hits >= 20 * 300, "{after:?}");
    assert_eq!(p.hv.mappings_held(&p.drv), held);
    assert_eq!(
        p.front.stats().reuse_bindings,
        bindings,
        "pages keep their references"
    );
    assert!(p.vif.cached_grants() <= CACHE_SLOTS);
    assert_eq!(p.drv.grant_errors_total(), 0);
    assert_eq!(p.hv.iommu().fault_count(), 0);
}

/// A page of the guest's pool, not in flight, that netback holds in its cache, with
/// the I/O address its devices reach it at (checked: a DMA read sees the page).
fn cached_page(p: &mut Pair) -> (hv::Gfn, Iova) {
    rx_round(p, 200, 1);
    tx_round(p, 100, 1);
    let mut taken = Vec::new();
    let found = loop {
        let g = p
            .gpool
            .alloc_page()
            .expect("a cached page among the free ones");
        let at = p.front.binding(g).and_then(|r| p.vif.cached_at(r.0));
        if let Some(iova) = at {
            break (g, iova);
        }
        taken.push(g);
    };
    for g in taken {
        p.gpool.free_page(g);
    }
    let mark = frame(64, 77);
    p.guest.write(found.0, 0, &mark).expect("own page");
    let mut b = vec![0u8; 64];
    p.hv.iommu()
        .device(DEV)
        .dma_read(found.1, &mut b)
        .expect("mapped for the device");
    assert_eq!(b, mark);
    found
}

#[test]
fn after_a_confirmed_drop_neither_the_driver_domain_nor_its_device_reaches_the_page() {
    let mut p = pair();
    let (gfn, iova) = cached_page(&mut p);
    let held = p.hv.mappings_held(&p.drv);
    assert!(p.front.unbind(gfn), "the page was bound");
    assert_eq!(p.front.unbind_waiting(), 1);
    assert!(
        p.front.take_unbound().is_empty(),
        "nothing before the answer"
    );
    assert_eq!(p.vif.ctrl_action(), 1);
    p.front.poll_ctrl();
    assert_eq!(p.front.take_unbound(), [gfn]);
    assert_eq!(p.front.stats().unbind_done, 1);
    assert_eq!(p.hv.mappings_held(&p.drv), held - 1);
    // The driver domain's own mapping went first: its window slot reads nothing.
    let slot = (iova.0 >> 12) - hv::iommu::WINDOW_IOVA_PFN;
    assert!(p.drv.window().read(slot as u32, 0, &mut [0; 64]).is_err());
    // The device's write to where the page was faults: the IOTLB entry went with the
    // unmap, before the answer.
    let mut dma = p.hv.iommu().device(DEV);
    let faults = p.hv.iommu().fault_count();
    assert!(dma.dma_read(iova, &mut [0; 64]).is_err());
    assert!(dma.dma_write(iova, &[0xee; 64]).is_err());
    assert_eq!(p.hv.iommu().fault_count(), faults + 2);
    // The page is the guest's alone now; later traffic goes on without it.
    p.guest.write(gfn, 0, &[0x55; 64]).expect("own page");
    rx_round(&mut p, 50, 3);
    let mut b = [0u8; 64];
    p.guest.read(gfn, 0, &mut b).expect("own page");
    assert_eq!(b, [0x55; 64]);
}

#[test]
fn a_guest_cannot_end_the_grant_of_a_page_netback_still_caches() {
    let mut p = pair();
    let (gfn, _) = cached_page(&mut p);
    let gref = p.front.binding(gfn).expect("bound");
    let gt = p.guest.grant_table();
    assert_eq!(gt.in_use(gref), Ok(true));
    assert!(gt.end_access(gref).is_err(), "ended while mapped");
    // Nor does the drop go through while netback maps it: the unbind is what ends it.
    assert!(p.front.unbind(gfn));
    p.vif.ctrl_action();
    p.front.poll_ctrl();
    assert_eq!(p.front.take_unbound(), [gfn]);
    assert_eq!(gt.in_use(gref).ok(), Some(false));
}

#[test]
fn a_drop_of_a_page_with_io_in_flight_is_answered_only_after_the_io() {
    let mut p = pair();
    rx_round(&mut p, 8, 1);
    p.front.refill_rx(&mut p.gpool);
    p.vif.rx_direct_refill();
    // The device holds one buffer.
    let mut given = None;
    p.vif.rx_direct_give(|iova, _, token| {
        given.get_or_insert((iova, token));
        true
    });
    let (iova, token) = given.expect("buffer");
    // Which of the guest's pages the device holds: it writes a mark there.
    let mark = [0xa5u8, 0x5a, 0xc3, 0x3c, 0x99, 0x66, 0x0f, 0xf0];
    let mut dma = p.hv.iommu().device(DEV);
    dma.dma_write(iova, &mark).expect("mapped");
    let target = (0..p.guest.pages())
        .map(hv::Gfn)
        .find(|&g| {
            let mut b = [0u8; 8];
            p.guest.read(g, iova.page_offset(), &mut b).is_ok() && b == mark
        })
        .expect("the device's page is one of the guest's");
    assert!(p.front.unbind(target));
    assert_eq!(p.vif.ctrl_action(), 0, "waits for the I/O");
    p.front.poll_ctrl();
    assert!(p.front.take_unbound().is_empty());
    // The device is still allowed to write: the mapping stays until its I/O is done.
    dma.dma_write(iova, &frame(100, 4)).expect("still mapped");
    p.vif.rx_direct_done(token, 100, true, false);
    p.vif.rx_direct_flush();
    assert_eq!(p.vif.ctrl_action(), 1, "answered once the I/O completed");
    p.front.poll_ctrl();
    assert_eq!(p.front.take_unbound(), [target]);
    assert_eq!(p.vif.cache_stats().expect("cache").drops_deferred, 1);
    assert!(dma.dma_write(iova, &[1; 8]).is_err(), "unreachable after");
}

#[test]
fn a_back_end_that_never_confirms_leaves_the_page_granted_and_out_of_use() {
    let mut p = pair();
    let (gfn, _) = cached_page(&mut p);
    let gref = p.front.binding(gfn).expect("bound");
    assert!(p.front.unbind(gfn));
    // The back end never serves its control ring.
    for _ in 0..10 {
        p.front.poll_ctrl();
        rx_round(&mut p, 20, 5);
    }
    assert!(p.front.take_unbound().is_empty());
    assert_eq!(p.front.unbind_waiting(), 1);
    assert_eq!(p.front.stats().unbind_done, 0);
    // Still mapped by the back end, so still granted and in use: the guest cannot end
    // it, and its page stays out of the pool.
    assert_eq!(p.guest.grant_table().in_use(gref), Ok(true));
    assert!(p.guest.grant_table().end_access(gref).is_err());
}

/// A raw guest with a control ring, on vif index 1.
fn raw_with_ctrl(p: &Pair) -> (Arc<Domain>, RawFront, Vif) {
    let (bad, raw, mut vif) = raw_with_ctrl_copying(p);
    vif.enable_direct();
    (bad, raw, vif)
}

/// As [`raw_with_ctrl`], netback copying into the cached pages (no direct placement).
fn raw_with_ctrl_copying(p: &Pair) -> (Arc<Domain>, RawFront, Vif) {
    let bad = domain(&p.hv, "bad", false, 4);
    let spec = VifSpec {
        handle: 0,
        mac: [0x02, 0, 0, 0, 0, 9],
        index: 1,
        front: FrontConfig {
            rx_buffers: RxBuffers::Linear,
            grants: Grants::Reuse,
            ..FrontConfig::default()
        },
    };
    toolstack::offer_vif(&p.hv, &p.drv, &bad, spec).expect("offer");
    let mut raw = RawFront::publish(&p.hv, &bad, p.drv.id(), 0).expect("raw");
    raw.publish_ctrl(&p.hv, p.drv.id(), 0).expect("ctrl");
    let vif = toolstack::connect_backend(&p.hv, &p.drv, &bad, spec).expect("vif");
    (bad, raw, vif)
}

#[test]
fn hostile_control_messages_are_answered_with_errors_bounded_and_counted() {
    let p = pair();
    let (_bad, mut raw, mut vif) = raw_with_ctrl(&p);
    let list_ref = raw.ctrl.expect("ctrl").2;
    let good = raw.rx_buffer(p.drv.id()).expect("buffer");
    let req = |id, ty, data| CtrlRequest { id, ty, data };
    raw.write_list(&[
        NetifGref {
            gref: good,
            flags: 0,
            status: 0,
        },
        NetifGref {
            gref: 4000,
            flags: 0,
            status: 0,
        },
    ]);
    let reqs = [
        req(1, XEN_NETIF_CTRL_TYPE_GET_GREF_MAPPING_SIZE, [0, 0, 0]),
        req(2, XEN_NETIF_CTRL_TYPE_GET_GREF_MAPPING_SIZE, [3, 0, 0]),
        req(3, 77, [0, 0, 0]),
        req(4, XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING, [0, list_ref, 0]),
        req(
            5,
            XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING,
            [0, list_ref, GREF_LIST_MAX as u32 + 1],
        ),
        req(6, XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING, [0, 4000, 1]),
        // An ADD of a good buffer and a reference never granted: none added.
        req(7, XEN_NETIF_CTRL_TYPE_ADD_GREF_MAPPING, [0, list_ref, 2]),
        // An ADD of the good buffer alone, then a DEL of it and of an unknown one.
        req(8, XEN_NETIF_CTRL_TYPE_ADD_GREF_MAPPING, [0, list_ref, 1]),
        req(9, XEN_NETIF_CTRL_TYPE_DEL_GREF_MAPPING, [0, list_ref, 2]),
    ];
    for (i, r) in reqs[..8].iter().enumerate() {
        raw.post_ctrl(i as u32, *r, i as u32 + 1);
    }
    assert_eq!(vif.ctrl_action(), 8);
    let st: Vec<_> = (0..8).map(|i| raw.ctrl_response(i)).collect();
    assert_eq!(
        (st[0].status, st[0].data),
        (XEN_NETIF_CTRL_STATUS_SUCCESS, CACHE_SLOTS as u32)
    );
    assert_eq!(st[1].status, XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER);
    assert_eq!(st[2].status, XEN_NETIF_CTRL_STATUS_NOT_SUPPORTED);
    for s in &st[3..7] {
        assert_eq!(s.status, XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER, "{s:?}");
    }
    assert_eq!(st[7].status, XEN_NETIF_CTRL_STATUS_SUCCESS);
    assert_eq!(vif.cached_grants(), 1, "only the good buffer, once");
    raw.post_ctrl(8, reqs[8], 9);
    assert_eq!(vif.ctrl_action(), 1);
    let r = raw.ctrl_response(8);
    assert_eq!((r.status, r.data), (XEN_NETIF_CTRL_STATUS_SUCCESS, 1));
    let l = raw.read_list(2);
    assert_eq!(u32::from(l[0].status), XEN_NETIF_CTRL_STATUS_SUCCESS);
    assert_eq!(
        u32::from(l[1].status),
        XEN_NETIF_CTRL_STATUS_INVALID_PARAMETER
    );
    assert_eq!(vif.cached_grants(), 0);
    assert_eq!(vif.stats().ctrl_requests, 9);
    assert_eq!(vif.stats().ctrl_errors, 6);
    // A flood: a whole ring of requests is served in bounded steps, each answered.
    for i in 0..128u32 {
        raw.post_ctrl(9 + i, req(100, 77, [0; 3]), 9 + i + 1);
    }
    let mut answered = 0;
    let mut calls = 0;
    while answered < 128 {
        let n = vif.ctrl_action();
        assert!(n > 0 && n <= 32, "{n}");
        answered += n;
        calls += 1;
    }
    assert_eq!(calls, 4);
    assert!(vif.disabled().is_none());
    assert_eq!(CTRL_WAITING, 8);
}

#[test]
fn a_bad_reference_in_a_batch_of_copies_fails_its_own_packet_and_no_other() {
    // Netback's copy path through the cache takes its requests a batch at a time
    // (buffers looked up for the whole batch before the copies run): a reference the
    // guest never granted, anywhere in a batch, fails only the packet it was posted
    // for.
    let p = pair();
    let (bad, mut raw, mut vif) = raw_with_ctrl_copying(&p);
    let mut dpool = SkbPool::new(Arc::clone(&p.drv), 512, 64).expect("pool");
    // 80 buffers (more than two batches); the 6th and the 70th name references never
    // granted.
    const N: u32 = 80;
    let bad_at = [5u32, 69];
    let mut grefs = Vec::new();
    for i in 0..N {
        let g = if bad_at.contains(&i) {
            4000 + i
        } else {
            raw.rx_buffer(p.drv.id()).expect("buffer")
        };
        grefs.push(g);
        let req = RxRequest {
            id: i as u16,
            pad: 0,
            gref: g,
        };
        raw.post_rx(i, req, i + 1);
    }
    let sent: Vec<Vec<u8>> = (0..N).map(|k| frame(60 + k as usize * 7, k)).collect();
    for f in &sent {
        let s = dpool.alloc(NET_SKB_PAD).expect("skb");
        dpool.put(s, f).expect("put");
        vif.start_xmit(&mut dpool, s);
    }
    assert_eq!(vif.rx_action(&mut dpool), N as usize);
    for i in 0..N {
        let rsp = raw.rx_response(i);
        assert_eq!(u32::from(rsp.id), i);
        if bad_at.contains(&i) {
            assert_eq!(rsp.status, net::netif::XEN_NETIF_RSP_ERROR, "slot {i}");
            continue;
        }
        let want = &sent[i as usize];
        assert_eq!(rsp.status as usize, want.len(), "slot {i}");
        let page = raw.page_of(grefs[i as usize]).expect("page");
        let mut got = vec![0u8; want.len()];
        bad.read(page, usize::from(rsp.offset), &mut got)
            .expect("read");
        assert_eq!(&got, want, "slot {i}");
    }
    assert_eq!(vif.stats().rx_copy_errors, 2);
    assert_eq!(vif.stats().rx_packets, u64::from(N) - 2);
    assert!(vif.disabled().is_none());
    // Every entry was let go: the good pages are idle in the cache, and a second round
    // through them hits every one.
    let before = vif.cache_stats().expect("cache").clone();
    let mut prod = N;
    for (i, &g) in grefs.iter().enumerate() {
        if bad_at.contains(&(i as u32)) {
            continue;
        }
        let req = RxRequest {
            id: i as u16,
            pad: 0,
            gref: g,
        };
        raw.post_rx(prod, req, prod + 1);
        prod += 1;
    }
    for k in 0..N - 2 {
        let s = dpool.alloc(NET_SKB_PAD).expect("skb");
        dpool.put(s, &frame(64, 1000 + k)).expect("put");
        vif.start_xmit(&mut dpool, s);
    }
    assert_eq!(vif.rx_action(&mut dpool), N as usize - 2);
    let after = vif.cache_stats().expect("cache");
    assert_eq!(after.hits - before.hits, u64::from(N) - 2);
    assert_eq!(after.maps, before.maps);
}

#[test]
fn a_guest_posting_ever_new_references_churns_only_its_own_cache() {
    let mut p = pair();
    rx_round(&mut p, 200, 1);
    let mine = p.vif.cached_grants();
    let before = p.vif.cache_stats().expect("cache").clone();
    let (_bad, mut raw, mut vif) = raw_with_ctrl(&p);
    // 1440 fresh pages, each posted once and handed back filled.
    let mut prod = 0u32;
    for _ in 0..6 {
        for _ in 0..240 {
            let g = raw.rx_buffer(p.drv.id()).expect("buffer");
            raw.post_rx(
                prod,
                RxRequest {
                    id: (prod % 256) as u16,
                    pad: 0,
                    gref: g,
                },
                prod + 1,
            );
            prod += 1;
        }
        assert_eq!(vif.rx_direct_refill(), 240);
        let mut tokens = Vec::new();
        vif.rx_direct_give(|_, _, t| {
            tokens.push(t);
            true
        });
        for t in tokens {
            vif.rx_direct_done(t, 60, false, false);
        }
        vif.rx_direct_flush();
        assert!(vif.cached_grants() <= CACHE_SLOTS);
    }
    let st = vif.cache_stats().expect("cache");
    assert_eq!(st.misses, 1440);
    assert_eq!(st.evictions, 1440 - CACHE_SLOTS as u64);
    // The other guest's entries are untouched and still hit.
    assert_eq!(p.vif.cached_grants(), mine);
    rx_round(&mut p, 200, 2);
    let after = p.vif.cache_stats().expect("cache");
    assert_eq!(after.misses, before.misses);
    assert_eq!(after.evictions, 0);
}

#[test]
fn machine_frames_go_on_the_ring_only_where_the_toolstack_offered_the_unsafe_stand_in() {
    let (hv, drv) = machine();
    let guest = domain(&hv, "guest", false, 4);
    // No offer: netfront asks for nothing and grants its buffers as usual.
    let (mut front, mut vif) = plug(&hv, &drv, &guest, Grants::MachineFramesUnsafe);
    vif.enable_direct();
    let mut gpool = SkbPool::new(Arc::clone(&guest), 512, 600).expect("pool");
    front.refill_rx(&mut gpool);
    assert_eq!(vif.rx_direct_refill(), 256);
    assert_eq!(
        hv.mappings_held(&drv),
        2 + 256,
        "every buffer granted and mapped"
    );
    let mut iovas = Vec::new();
    vif.rx_direct_give(|iova, _, _| {
        iovas.push(iova);
        true
    });
    assert!(
        iovas
            .iter()
            .all(|i| i.0 >> 12 < hv::iommu::MACHINE_IOVA_PFN),
        "window addresses only"
    );
}

#[test]
fn without_direct_placement_netback_copies_into_cached_pages_and_maps_nothing_in_steady_state() {
    let (hv, drv) = machine();
    let guest = domain(&hv, "guest", false, 4);
    let (front, vif) = plug(&hv, &drv, &guest, Grants::Reuse);
    let mut p = Pair {
        dpool: SkbPool::new(Arc::clone(&drv), 512, 64).expect("pool"),
        gpool: SkbPool::new(Arc::clone(&guest), 512, 600).expect("pool"),
        hv,
        drv,
        guest,
        front,
        vif,
        held: VecDeque::new(),
    };
    for r in 0..3 {
        rx_round(&mut p, 200, r);
    }
    let before = p.vif.cache_stats().expect("cache").clone();
    for r in 3..13 {
        rx_round(&mut p, 200, r);
    }
    let after = p.vif.cache_stats().expect("cache").clone();
    assert_eq!(
        (after.maps, after.unmaps),
        (before.maps, before.unmaps),
        "{after:?}"
    );
    assert_eq!(after.hits - before.hits, 10 * 200);
    assert_eq!(p.vif.stats().rx_copy_errors, 0);
}

#[test]
fn when_the_back_end_goes_every_binding_ends_and_every_page_comes_back() {
    let mut p = pair();
    let refs_before = p.guest.grant_table().refs_free();
    for r in 0..3 {
        rx_round(&mut p, 200, r);
        tx_round(&mut p, 100, r);
    }
    assert!(p.front.bound_pages() > 256);
    let Pair {
        hv,
        drv,
        guest,
        mut dpool,
        mut gpool,
        mut front,
        vif,
        ..
    } = p;
    vif.disconnect(&mut dpool);
    toolstack::close_backend(&hv, drv.id(), guest.id(), 0);
    assert_eq!(
        front.check_backend(&mut gpool),
        net::netfront::LinkChange::Disconnected
    );
    assert_eq!(front.bound_pages(), 0);
    assert_eq!(
        front.stats().grants_busy,
        0,
        "the back end's cache went with it"
    );
    // Every RX page posted and every page bound is the guest's again.
    assert_eq!(gpool.free_pages(), gpool.page_capacity());
    assert_eq!(hv.mappings_held(&drv), 0);
    // The references of the bindings and of the control ring are free again (the
    // ring and the data path's per-slot references stay with netfront).
    assert!(guest.grant_table().refs_free() >= refs_before);
}
