//! netfront and netback connected through the store, driven from one thread: packets
//! cross in both directions intact, and every grant is released afterwards.

use std::sync::Arc;
use std::time::Duration;

use hv::store::XenbusState;
use hv::{Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
use net::netback::{self, Vif, VIF_WINDOW_SLOTS};
use net::netfront::Netfront;
use net::skb::{SkbId, SkbPool, NET_SKB_PAD};
use net::stack::{Stack, UserBuf, DEFAULT_RCVBUF};
use net::wire::{UdpFlow, UdpFramer, DEFAULT_MTU};
use net::xenbus;
use smoltcp::wire::Ipv4Address;

#[derive(Debug)]
pub struct Pair {
    pub hv: Arc<Hypervisor>,
    pub drv: Arc<Domain>,
    pub guest: Arc<Domain>,
    pub dpool: SkbPool,
    pub gpool: SkbPool,
    pub front: Netfront,
    pub vif: Vif,
}

fn flow() -> UdpFlow {
    UdpFlow {
        src_mac: [2, 0, 0, 0, 0, 1],
        dst_mac: [2, 0, 0, 0, 0, 2],
        src_ip: Ipv4Address::new(10, 0, 0, 1),
        dst_ip: Ipv4Address::new(10, 0, 0, 2),
        src_port: 5001,
        dst_port: 5002,
        mtu: DEFAULT_MTU,
    }
}

fn pair(version: GrantVersion, path: GrantPath) -> Pair {
    let hv = Hypervisor::new(HvConfig {
        frames: 8192,
        grant_path: path,
    })
    .expect("hv");
    let dom = |name: &str, driver: bool, slots| {
        hv.create_domain(&DomainConfig {
            name: name.into(),
            pages: 2048,
            grant_frames: 4,
            grant_version: version,
            vcpus: 1,
            map_slots: slots,
            driver_domain: driver,
        })
        .expect("domain")
    };
    let drv = dom("drv", true, VIF_WINDOW_SLOTS);
    let guest = dom("guest", false, 4);
    xenbus::create_vif(hv.store(), drv.id(), guest.id(), 0, flow().dst_mac).expect("toolstack");
    netback::probe(hv.store(), drv.id(), guest.id(), 0).expect("probe");
    let front = Netfront::connect(&hv, &guest, 0).expect("front end");
    let vif = Vif::connect(&hv, &drv, guest.id(), 0, 0, 0).expect("back end");
    assert_eq!(
        hv.store()
            .xenbus_state(drv.id(), &xenbus::backend_dir(drv.id(), guest.id(), 0)),
        XenbusState::Connected
    );
    let dpool = SkbPool::new(Arc::clone(&drv), 512, 64).expect("pool");
    let gpool = SkbPool::new(Arc::clone(&guest), 512, 512).expect("pool");
    Pair {
        hv,
        drv,
        guest,
        dpool,
        gpool,
        front,
        vif,
    }
}

fn message(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

#[test]
fn received_messages_cross_intact_for_every_grant_layout() {
    for (v, path) in [
        (GrantVersion::V1, GrantPath::Original),
        (GrantVersion::V2, GrantPath::Optimised),
    ] {
        let mut p = pair(v, path);
        p.front.refill_rx(&mut p.gpool);
        assert_eq!(p.front.rx_posted(), 256);
        let mut stack = Stack::new(flow().dst_ip, flow().dst_mac);
        let sock = stack
            .bind_udp(flow().dst_port, DEFAULT_RCVBUF)
            .expect("bind");
        let ub = UserBuf::new(&p.guest, 65536).expect("user buffer");
        let gfree = (p.gpool.free_buffers(), p.gpool.free_pages());
        let mut framer = UdpFramer::new(flow());
        for (i, len) in [52usize, 1500, 48000].into_iter().enumerate() {
            let msg = message(len, i as u8);
            let mut frames = Vec::new();
            framer
                .frames(i as u16, &msg, |f| frames.push(f.to_vec()))
                .expect("frames");
            for f in &frames {
                let s = p.dpool.alloc(NET_SKB_PAD).expect("skb");
                p.dpool.put(s, f).expect("put");
                p.dpool.set_csum_valid(s, frames.len() == 1);
                p.vif.start_xmit(&mut p.dpool, s);
            }
            p.vif.rx_action(&mut p.dpool);
            let Pair { front, gpool, .. } = &mut p;
            front.poll_rx(gpool, 64, |pool, skb| {
                stack.input(pool, skb, Duration::ZERO)
            });
            let r = stack
                .recv(&mut p.gpool, sock, &ub)
                .expect("copy")
                .expect("a datagram");
            let mut got = vec![0u8; r.len];
            ub.read(&p.guest, 0, &mut got).expect("read");
            assert_eq!(got, msg, "{len} bytes, {v:?}");
        }
        assert_eq!(
            p.vif.stats().rx_packets,
            1 + 2 + 33,
            "a 1500-byte message takes two frames"
        );
        assert_eq!(p.front.stats().rx_packets, 36);
        assert_eq!(stack.stats().drops_total(), 0);
        // Every buffer and page came back, and the ring is full again.
        assert_eq!((p.gpool.free_buffers(), p.gpool.free_pages()), gfree);
        assert_eq!(p.front.rx_posted(), 256);
        assert_eq!(p.dpool.free_buffers(), p.dpool.capacity());
        assert_eq!(p.drv.grant_errors_total(), 0);
    }
}

#[test]
fn transmitted_packets_cross_intact_and_their_grants_are_released() {
    let mut p = pair(GrantVersion::V2, GrantPath::Optimised);
    let mut sent = Vec::new();
    for len in [60usize, 128, 129, 1514] {
        let f: Vec<u8> = (0..len).map(|i| (i * 3) as u8).collect();
        let s = p.gpool.alloc(NET_SKB_PAD).expect("skb");
        p.gpool.put(s, &f).expect("put");
        p.front.xmit(&mut p.gpool, s).expect("ring has room");
        sent.push(f);
    }
    let mut out: Vec<SkbId> = Vec::new();
    let n = p.vif.tx_action(&mut p.dpool, 64, |_, s| out.push(s));
    assert_eq!(n, 4);
    for (s, want) in out.iter().zip(&sent) {
        let mut got = vec![0u8; p.dpool.len(*s)];
        p.dpool.read(*s, 0, &mut got).expect("read");
        assert_eq!(&got, want);
    }
    // Short packets were copied whole and are answered already; long ones are mapped
    // and wait for their buffers to be freed.
    assert_eq!(p.front.poll_tx(&mut p.gpool), 2);
    for s in out {
        p.dpool.free(s);
    }
    let mut tokens = Vec::new();
    p.dpool.take_released(|r| tokens.push(r.token));
    assert_eq!(tokens.len(), 2);
    p.vif.tx_release(tokens);
    assert_eq!(p.front.poll_tx(&mut p.gpool), 2);
    assert_eq!(p.front.stats().tx_packets, 4);
    assert_eq!(p.gpool.free_buffers(), p.gpool.capacity());
    assert_eq!(p.drv.grant_errors_total(), 0);
    assert_eq!(p.hv.iommu().fault_count(), 0);
}
