//! netfront and netback connected through the store, driven from one thread: packets
//! cross in both directions intact, and every grant is released afterwards.

use std::sync::Arc;
use std::time::Duration;

use hv::store::XenbusState;
use hv::{Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
use net::bridge::{Bridge, Forward};
use net::counters::CopyAlign;
use net::netback::{Vif, VIF_WINDOW_SLOTS};
use net::netfront::{Netfront, RxBuffers, RX_COPY_LEN};
use net::skb::{Frag, FragPage, SegPage, SkbId, SkbPool, NET_IP_ALIGN, NET_SKB_PAD};
use net::stack::{Stack, UserBuf, DEFAULT_RCVBUF};
use net::toolstack::{self, VifSpec};
use net::wire::MAX_TAGGED_FRAME;
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
    pair_with(version, path, RxBuffers::Fragments)
}

fn pair_with(version: GrantVersion, path: GrantPath, rx_buffers: RxBuffers) -> Pair {
    let hv = Hypervisor::new(HvConfig {
        frames: 8192,
        grant_path: path,
        ..HvConfig::default()
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
    let spec = VifSpec {
        handle: 0,
        mac: flow().dst_mac,
        rx_buffers,
        index: 0,
    };
    let (front, vif) = toolstack::plug_vif(&hv, &drv, &guest, spec).expect("vif");
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

/// Fills netfront's ring, then sends one UDP message of each of `sizes` through netback
/// into the guest's stack and checks that `recv` gives it back intact. `offload` marks
/// single-frame messages' checksums verified, as the NIC would; `check` sees every
/// buffer netfront delivers. Returns the stack and the guest pool's free (buffers,
/// pages) after the refill, for [`all_returned`].
fn receive_each(
    p: &mut Pair,
    sizes: &[usize],
    offload: bool,
    check: impl Fn(&SkbPool, SkbId),
) -> (Stack, (usize, usize)) {
    receive_each_from(p, NET_SKB_PAD, sizes, offload, check)
}

/// As [`receive_each`], with each frame `headroom` bytes into its driver-domain buffer.
fn receive_each_from(
    p: &mut Pair,
    headroom: usize,
    sizes: &[usize],
    offload: bool,
    check: impl Fn(&SkbPool, SkbId),
) -> (Stack, (usize, usize)) {
    p.front.refill_rx(&mut p.gpool);
    assert_eq!(p.front.rx_posted(), 256);
    let mut stack = Stack::new(flow().dst_ip, flow().dst_mac);
    let sock = stack
        .bind_udp(flow().dst_port, DEFAULT_RCVBUF)
        .expect("bind");
    let ub = UserBuf::new(&p.guest, 65536).expect("user buffer");
    let gfree = (p.gpool.free_buffers(), p.gpool.free_pages());
    let mut framer = UdpFramer::new(flow());
    for (i, &len) in sizes.iter().enumerate() {
        let msg = message(len, i as u8);
        let mut frames = Vec::new();
        framer
            .frames(i as u16, &msg, |f| frames.push(f.to_vec()))
            .expect("frames");
        for f in &frames {
            let s = p.dpool.alloc(headroom).expect("skb");
            p.dpool.put(s, f).expect("put");
            if offload {
                p.dpool.set_csum_valid(s, frames.len() == 1);
            }
            p.vif.start_xmit(&mut p.dpool, s);
        }
        p.vif.rx_action(&mut p.dpool);
        let Pair { front, gpool, .. } = p;
        front.poll_rx(gpool, 64, |pool, skb| {
            check(pool, skb);
            stack.input(pool, skb, Duration::ZERO)
        });
        let r = stack
            .recv(&mut p.gpool, sock, &ub)
            .expect("copy")
            .expect("a datagram");
        let mut got = vec![0u8; r.len];
        ub.read(&p.guest, 0, &mut got).expect("read");
        assert_eq!(got, msg, "{len} bytes");
    }
    (stack, gfree)
}

/// Nothing dropped; every buffer and page came back, and the ring is full again.
fn all_returned(p: &Pair, stack: &Stack, gfree: (usize, usize)) {
    assert_eq!(stack.stats().drops_total(), 0);
    assert_eq!((p.gpool.free_buffers(), p.gpool.free_pages()), gfree);
    assert_eq!(p.front.rx_posted(), 256);
    assert_eq!(p.dpool.free_buffers(), p.dpool.capacity());
    assert_eq!(p.drv.grant_errors_total(), 0);
}

#[test]
fn received_messages_cross_intact_for_every_grant_layout() {
    for (v, path) in [
        (GrantVersion::V1, GrantPath::Original),
        (GrantVersion::V2, GrantPath::Optimised),
    ] {
        let mut p = pair(v, path);
        let (stack, gfree) = receive_each(&mut p, &[52, 1500, 48000], true, |_, _| {});
        assert_eq!(
            p.vif.stats().rx_packets,
            1 + 2 + 33,
            "a 1500-byte message takes two frames ({v:?})"
        );
        assert_eq!(p.front.stats().rx_packets, 36);
        all_returned(&p, &stack, gfree);
    }
}

#[test]
fn aligned_copies_start_each_frame_at_its_sources_cache_line_offset_and_lose_nothing() {
    // Frames as the NIC driver receives them: NET_IP_ALIGN bytes past the pad, so the
    // original copy to the start of the guest's page is misaligned by 62 bytes.
    let headroom = NET_SKB_PAD + NET_IP_ALIGN;
    for rx_buffers in [RxBuffers::Fragments, RxBuffers::Linear] {
        for aligned in [false, true] {
            let mut p = pair_with(GrantVersion::V2, GrantPath::Optimised, rx_buffers);
            p.vif.set_aligned_copies(aligned);
            let sizes: &[usize] = match rx_buffers {
                RxBuffers::Fragments => &[52, 1472, 48000],
                RxBuffers::Linear => &[52, 1472, 8000],
            };
            let (stack, gfree) = receive_each_from(&mut p, headroom, sizes, true, |pool, skb| {
                // Where the back end put the frame's first byte: the start of the
                // linear buffer's data, or in a page fragment the head copy's length
                // before what stayed there (a frame short enough to be copied whole
                // shows nothing).
                let at = match (rx_buffers, pool.frags(skb).first()) {
                    (RxBuffers::Linear, _) => pool.data_location(skb).1,
                    (RxBuffers::Fragments, Some(f)) => f.offset as usize - RX_COPY_LEN,
                    (RxBuffers::Fragments, None) => return,
                };
                let want = if aligned { headroom % 64 } else { 0 };
                assert_eq!(at, want, "{rx_buffers:?}");
            });
            let census = &p.vif.stats().rx_copy_bytes;
            let bytes = p.vif.stats().rx_bytes;
            let (line, un) = (
                census.get(CopyAlign::Line),
                census.get(CopyAlign::Unaligned),
            );
            if aligned {
                assert_eq!((line, un), (bytes, 0), "{rx_buffers:?}");
            } else {
                assert_eq!((line, un), (0, bytes), "{rx_buffers:?}");
            }
            all_returned(&p, &stack, gfree);
        }
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

#[test]
fn a_front_end_without_fragments_receives_every_size_in_linear_buffers() {
    let mut p = pair_with(GrantVersion::V1, GrantPath::Original, RxBuffers::Linear);
    assert!(!p.vif.can_sg());
    let (stack, gfree) = receive_each(&mut p, &[52, 1472, 48000], false, |pool, skb| {
        assert!(pool.frags(skb).is_empty(), "no fragment");
        assert_eq!(pool.linear_len(skb), pool.len(skb));
    });
    assert_eq!(p.front.stats().rx_packets, 1 + 1 + 33);
    // A frame longer than the vif's MTU without scatter-gather stops at netback.
    let s = p.dpool.alloc(NET_SKB_PAD).expect("skb");
    p.dpool.put(s, &[0u8; MAX_TAGGED_FRAME + 1]).expect("put");
    p.vif.start_xmit(&mut p.dpool, s);
    assert_eq!(p.vif.stats().rx_oversize, 1);
    assert_eq!(p.vif.rx_queued(), 0);
    all_returned(&p, &stack, gfree);
}

const MAC_A: [u8; 6] = [2, 0, 0, 0, 0, 0xa];
const MAC_B: [u8; 6] = [2, 0, 0, 0, 0, 0xb];

/// An Ethernet frame from A to B of `len` bytes (a local experimental ethertype, so the
/// bridge's IP hooks pass it by).
fn frame_a_to_b(len: usize, seed: u8) -> Vec<u8> {
    let mut f = message(len, seed);
    f[..6].copy_from_slice(&MAC_B);
    f[6..12].copy_from_slice(&MAC_A);
    f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
    f
}

/// A guest's packet as its stack would build a large one: up to 1000 bytes in the head,
/// the rest in page fragments.
fn guest_packet(pool: &mut SkbPool, bytes: &[u8]) -> SkbId {
    let s = pool.alloc(NET_SKB_PAD).expect("skb");
    let head = bytes.len().min(1000);
    pool.put(s, &bytes[..head]).expect("put");
    for chunk in bytes[head..].chunks(4096) {
        let g = pool.alloc_page().expect("page");
        pool.domain().write(g, 0, chunk).expect("write");
        pool.add_frag(
            s,
            Frag {
                page: FragPage::Local(g),
                offset: 0,
                len: chunk.len() as u16,
            },
        )
        .expect("frag");
    }
    s
}

#[test]
fn frames_between_guests_are_copied_from_the_senders_grants_and_released_after() {
    for rx_b in [RxBuffers::Fragments, RxBuffers::Linear] {
        let hv = Hypervisor::new(HvConfig {
            frames: 16384,
            grant_path: GrantPath::Original,
            ..HvConfig::default()
        })
        .expect("hv");
        let dom = |name: &str, driver: bool, slots| {
            hv.create_domain(&DomainConfig {
                name: name.into(),
                pages: 2048,
                grant_frames: 4,
                grant_version: GrantVersion::V1,
                vcpus: 1,
                map_slots: slots,
                driver_domain: driver,
            })
            .expect("domain")
        };
        let drv = dom("drv", true, 2 * VIF_WINDOW_SLOTS);
        let (a, b) = (dom("a", false, 4), dom("b", false, 4));
        let plug = |g: &Arc<Domain>, mac, rx_buffers, index| {
            let spec = VifSpec {
                handle: 0,
                mac,
                rx_buffers,
                index,
            };
            toolstack::plug_vif(&hv, &drv, g, spec).expect("vif")
        };
        let (mut front_a, mut vif_a) = plug(&a, MAC_A, RxBuffers::Fragments, 0);
        let (mut front_b, mut vif_b) = plug(&b, MAC_B, rx_b, 1);
        let mut dpool = SkbPool::new(Arc::clone(&drv), 64, 16).expect("pool");
        let mut apool = SkbPool::new(Arc::clone(&a), 64, 64).expect("pool");
        let mut bpool = SkbPool::new(Arc::clone(&b), 512, 512).expect("pool");
        front_b.refill_rx(&mut bpool);
        let bfree = (bpool.free_buffers(), bpool.free_pages());
        let mut bridge = Bridge::new(2, false);
        bridge.attach_vif(0, MAC_A);
        bridge.attach_vif(1, MAC_B);

        // A sends a minimum frame (copied whole by netback), a full-size one and one
        // spanning three pages (mapped past the first bytes).
        let sent: Vec<Vec<u8>> = [60usize, 1514, 9000]
            .iter()
            .enumerate()
            .map(|(i, &len)| frame_a_to_b(len, i as u8))
            .collect();
        for f in &sent {
            let s = guest_packet(&mut apool, f);
            front_a.xmit(&mut apool, s).expect("room");
        }
        let mut foreign_seen = 0;
        let n = vif_a.tx_action(&mut dpool, 64, |pool, skb| {
            let mut foreign = false;
            pool.walk(skb, 0, pool.len(skb), |seg, _| {
                if let SegPage::Window { grant, .. } = seg.page {
                    assert_eq!(grant.0, a.id(), "mapped from the sender");
                    foreign = true;
                }
                Ok(())
            })
            .expect("walk");
            foreign_seen += usize::from(foreign);
            match bridge.input(pool, skb, 0) {
                Forward::Port(1) => vif_b.start_xmit(pool, skb),
                other => panic!("bridge: {other:?}"),
            }
        });
        assert_eq!((n, foreign_seen), (3, 2));
        vif_b.rx_action(&mut dpool);
        // Netback copied from A's grants; the forwarded buffers are freed, so the
        // mapped slots are released and answered.
        let mut tokens = Vec::new();
        dpool.take_released(|r| tokens.push(r.token));
        vif_a.tx_release(tokens);

        let mut got = Vec::new();
        front_b.poll_rx(&mut bpool, 64, |pool, skb| {
            let mut buf = vec![0u8; pool.len(skb)];
            pool.read(skb, 0, &mut buf).expect("read");
            got.push(buf);
            pool.free(skb);
        });
        front_a.poll_tx(&mut apool);
        match rx_b {
            RxBuffers::Fragments => {
                assert_eq!(got, sent);
                assert_eq!(vif_b.stats().rx_from_grants, 2);
            }
            RxBuffers::Linear => {
                assert_eq!(got, sent[..2], "the 3-page frame needs fragments");
                assert_eq!(vif_b.stats().rx_oversize, 1);
                assert_eq!(vif_b.stats().rx_from_grants, 1);
            }
        }
        // A's packets all left: every grant revoked, every buffer and page back.
        assert_eq!(front_a.stats().tx_packets, 3, "{rx_b:?}");
        assert_eq!(apool.free_buffers(), apool.capacity());
        assert_eq!(apool.free_pages(), apool.page_capacity());
        assert_eq!(dpool.free_buffers(), dpool.capacity());
        assert_eq!((bpool.free_buffers(), bpool.free_pages()), bfree);
        assert_eq!(drv.grant_errors_total(), 0);
        assert_eq!(hv.iommu().fault_count(), 0);
    }
}
