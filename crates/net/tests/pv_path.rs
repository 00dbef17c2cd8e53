//! netfront and netback connected through the store, driven from one thread: packets
//! cross in both directions intact, and every grant is released afterwards.

use std::sync::Arc;
use std::time::Duration;

use hv::counters::CopyAlign;
use hv::store::{XenStore, XenbusState};
use hv::{CopyPtr, GrantCopy, GrantRef};
use hv::{Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
use net::bridge::{Bridge, Forward};
use net::netback::{self, Vif, RX_LENT_MAX, VIF_WINDOW_SLOTS};
use net::netfront::FrontConfig;
use net::netfront::{Netfront, RxBuffers, RX_COPY_LEN};
use net::netif::{RxRequest, XEN_NETIF_RSP_ERROR};
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

/// A hypervisor of `frames` frames and a driver domain on it with window slots for two
/// vifs, and a maker of 2048-page guests.
fn machine(
    frames: u32,
    version: GrantVersion,
    path: GrantPath,
) -> (Arc<Hypervisor>, Arc<Domain>, impl Fn(&str) -> Arc<Domain>) {
    let hv = Hypervisor::new(HvConfig {
        frames,
        grant_path: path,
        ..HvConfig::default()
    })
    .expect("hv");
    let dom = move |hv: &Hypervisor, name: &str, driver: bool, slots| {
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
    let drv = dom(&hv, "drv", true, 2 * VIF_WINDOW_SLOTS);
    let h = Arc::clone(&hv);
    (hv, drv, move |name: &str| dom(&h, name, false, 4))
}

fn pair_with(version: GrantVersion, path: GrantPath, rx_buffers: RxBuffers) -> Pair {
    let (hv, drv, guest) = machine(8192, version, path);
    let guest = guest("guest");
    let spec = VifSpec {
        handle: 0,
        mac: flow().dst_mac,
        index: 0,
        front: FrontConfig {
            rx_buffers,
            ..FrontConfig::default()
        },
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
                RxBuffers::Linear | RxBuffers::GuestCopy => &[52, 1472, 8000],
            };
            let (stack, gfree) = receive_each_from(&mut p, headroom, sizes, true, |pool, skb| {
                // Where the back end put the frame's first byte: the start of the
                // linear buffer's data, or in a page fragment the head copy's length
                // before what stayed there (a frame short enough to be copied whole
                // shows nothing).
                let at = match (rx_buffers, pool.frags(skb).first()) {
                    (RxBuffers::Linear, _) => pool.data_location(skb).1,
                    (RxBuffers::Fragments, Some(f)) => f.offset as usize - RX_COPY_LEN,
                    (RxBuffers::Fragments, None) | (RxBuffers::GuestCopy, _) => return,
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
fn in_copy_mode_every_transmitted_packet_is_copied_answered_at_once_and_nothing_stays_mapped() {
    let mut p = pair(GrantVersion::V2, GrantPath::Optimised);
    p.vif.set_tx_copy(true);
    let pages0 = p.dpool.free_pages();
    let mut sent = Vec::new();
    for len in [60usize, 128, 129, 1514, 4000] {
        let f: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        let s = p.gpool.alloc(NET_SKB_PAD).expect("skb");
        p.gpool.append(s, &f).expect("append");
        p.front.xmit(&mut p.gpool, s).expect("ring has room");
        sent.push(f);
    }
    let mut out: Vec<SkbId> = Vec::new();
    let n = p.vif.tx_action(&mut p.dpool, 64, |_, s| out.push(s));
    assert_eq!(n, 5);
    for (s, want) in out.iter().zip(&sent) {
        let mut got = vec![0u8; p.dpool.len(*s)];
        p.dpool.read(*s, 0, &mut got).expect("read");
        assert_eq!(&got, want, "every byte, through the back end's own pages");
    }
    // Every slot of every packet answered already (the 4000-byte one took two); no
    // mapping held.
    assert_eq!(p.front.poll_tx(&mut p.gpool), 6);
    assert_eq!(p.hv.mappings_held(&p.drv), 2, "the two rings only");
    for s in out {
        p.dpool.free(s);
    }
    let mut tokens = Vec::new();
    p.dpool.take_released(|r| tokens.push(r.token));
    assert!(
        tokens.is_empty(),
        "nothing was mapped, so nothing waits for release"
    );
    assert_eq!(p.dpool.free_pages(), pages0, "every copied page came back");
    assert_eq!(p.front.stats().tx_packets, 5);
    assert_eq!(p.gpool.free_buffers(), p.gpool.capacity());
    assert_eq!(p.drv.grant_errors_total(), 0);
}

#[test]
fn a_burst_of_packets_reaches_the_back_end_only_when_published_and_crosses_intact() {
    let mut p = pair(GrantVersion::V2, GrantPath::Optimised);
    let mut sent = Vec::new();
    for (k, len) in [60usize, 1514, 200].into_iter().enumerate() {
        let f: Vec<u8> = (0..len).map(|i| (i * 7 + k) as u8).collect();
        let s = p.gpool.alloc(NET_SKB_PAD).expect("skb");
        p.gpool.put(s, &f).expect("put");
        p.front.xmit_more(&mut p.gpool, s).expect("ring has room");
        sent.push(f);
    }
    let mut out: Vec<SkbId> = Vec::new();
    assert_eq!(
        p.vif.tx_action(&mut p.dpool, 64, |_, s| out.push(s)),
        0,
        "written, not yet published"
    );
    p.front.xmit_flush();
    assert_eq!(p.vif.tx_action(&mut p.dpool, 64, |_, s| out.push(s)), 3);
    for (s, want) in out.iter().zip(&sent) {
        let mut got = vec![0u8; p.dpool.len(*s)];
        p.dpool.read(*s, 0, &mut got).expect("read");
        assert_eq!(&got, want);
        p.dpool.free(*s);
    }
    let mut tokens = Vec::new();
    p.dpool.take_released(|r| tokens.push(r.token));
    p.vif.tx_release(tokens);
    while p.front.poll_tx(&mut p.gpool) > 0 {}
    assert_eq!(p.front.stats().tx_packets, 3);
    assert_eq!(p.gpool.free_buffers(), p.gpool.capacity());
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

/// A driver domain and two guests on it, A (posting fragments) and B (receiving as
/// `rx_b`), each with its vif.
struct TwoGuests {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    a: Arc<Domain>,
    b: Arc<Domain>,
    front_a: Netfront,
    vif_a: Vif,
    front_b: Netfront,
    vif_b: Vif,
}

fn two_guests(version: GrantVersion, path: GrantPath, rx_b: RxBuffers) -> TwoGuests {
    let (hv, drv, guest) = machine(16384, version, path);
    let (a, b) = (guest("a"), guest("b"));
    let plug = |g: &Arc<Domain>, mac, rx_buffers, index| {
        let spec = VifSpec {
            handle: 0,
            mac,
            index,
            front: FrontConfig {
                rx_buffers,
                ..FrontConfig::default()
            },
        };
        toolstack::plug_vif(&hv, &drv, g, spec).expect("vif")
    };
    let (front_a, vif_a) = plug(&a, MAC_A, RxBuffers::Fragments, 0);
    let (front_b, vif_b) = plug(&b, MAC_B, rx_b, 1);
    TwoGuests {
        hv,
        drv,
        a,
        b,
        front_a,
        vif_a,
        front_b,
        vif_b,
    }
}

#[test]
fn frames_between_guests_are_copied_from_the_senders_grants_and_released_after() {
    for rx_b in [
        RxBuffers::Fragments,
        RxBuffers::Linear,
        RxBuffers::GuestCopy,
    ] {
        // Guest copy lends through sub-page grants, which need v2 tables.
        let version = if rx_b == RxBuffers::GuestCopy {
            GrantVersion::V2
        } else {
            GrantVersion::V1
        };
        let TwoGuests {
            hv,
            drv,
            a,
            b,
            mut front_a,
            mut vif_a,
            mut front_b,
            mut vif_b,
        } = two_guests(version, GrantPath::Original, rx_b);
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

        if rx_b == RxBuffers::GuestCopy {
            // Before B copies: through none of the slots lent to it can B read a whole
            // page (of the driver domain, or of A through a transitive grant), nor
            // write; each gives exactly its window.
            let dir = xenbus::backend_dir(drv.id(), b.id(), 0);
            let base = xenbus::read_u32(
                hv.store(),
                b.id(),
                &format!("{dir}/{}", xenbus::RX_GRANT_BASE),
            )
            .expect("rx-grant-base");
            let page = b.alloc_page().expect("page");
            let copy = |gref: u32, offset: u16, len: u16, write: bool| {
                let theirs = CopyPtr::Gref {
                    dom: drv.id(),
                    gref: GrantRef(gref),
                    offset,
                };
                let mine = CopyPtr::Local {
                    gfn: page,
                    offset: 0,
                };
                let (source, dest) = if write {
                    (mine, theirs)
                } else {
                    (theirs, mine)
                };
                let mut st = [Ok(())];
                hv.grant_copy(&b, &[GrantCopy { source, dest, len }], &mut st);
                st[0]
            };
            let mut windows = 0;
            for id in 0..256u32 {
                assert!(
                    copy(base + id, 0, 4096, false).is_err(),
                    "slot {id}: a whole page"
                );
                for off in (0..4096u16).step_by(16) {
                    if copy(base + id, off, 1, false).is_ok() {
                        windows += 1;
                        assert!(copy(base + id, off, 1, true).is_err(), "slot {id}: written");
                        break;
                    }
                }
            }
            assert!(windows >= 3, "the lent pieces are readable: {windows}");
            b.free_page(page).expect("free");
        }
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
            RxBuffers::GuestCopy => {
                assert_eq!(got, sent[..2], "the 3-page frame needs fragments");
                assert_eq!(vif_b.stats().rx_oversize, 1);
                // The full-size frame is lent as it lies: its head copied by netback's
                // TX, the rest in A's page, passed on through a windowed transitive
                // grant of A's own grant. Nothing is copied in the driver domain.
                assert_eq!(vif_b.stats().rx_lent, 2);
                assert_eq!(vif_b.stats().rx_linearized, 0);
                assert!(vif_b.stats().rx_transitive >= 1);
            }
        }
        // B's slots, posted again, give the lent buffers back; with the copy in B, the
        // frame lent from A's page is released to A only now that B has copied it.
        vif_b.rx_action(&mut dpool);
        let mut tokens = Vec::new();
        dpool.take_released(|r| tokens.push(r.token));
        vif_a.tx_release(tokens);
        front_a.poll_tx(&mut apool);
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

#[test]
fn a_guest_that_never_copies_holds_a_bounded_number_of_another_guests_tx_buffers() {
    let TwoGuests {
        drv,
        a,
        b,
        mut front_a,
        mut vif_a,
        mut front_b,
        mut vif_b,
        ..
    } = two_guests(GrantVersion::V2, GrantPath::Optimised, RxBuffers::GuestCopy);
    let mut dpool = SkbPool::new(Arc::clone(&drv), 512, 16).expect("pool");
    let mut apool = SkbPool::new(Arc::clone(&a), 512, 512).expect("pool");
    let mut bpool = SkbPool::new(Arc::clone(&b), 64, 64).expect("pool");
    front_b.refill_rx(&mut bpool);
    // A sends 100 full-size frames to B, which never copies.
    let mut sent = 0;
    for round in 0..10u8 {
        for i in 0..10u8 {
            let s = guest_packet(&mut apool, &frame_a_to_b(1514, round * 10 + i));
            front_a.xmit(&mut apool, s).expect("room");
        }
        sent += vif_a.tx_action(&mut dpool, 64, |pool, skb| vif_b.start_xmit(pool, skb));
        vif_b.rx_action(&mut dpool);
        let mut tokens = Vec::new();
        dpool.take_released(|r| tokens.push(r.token));
        vif_a.tx_release(tokens);
        front_a.poll_tx(&mut apool);
    }
    assert_eq!(sent, 100);
    let st = vif_b.stats();
    // B was lent frames up to its bound of driver-domain pieces, the rest wait in its
    // queue; of A's pages it holds pieces up to the transitive bound, and the frames
    // past it were copied into the driver domain's buffers and A's given back.
    assert_eq!(st.rx_lent as usize + vif_b.rx_queued(), 100, "{st:?}");
    assert!(
        st.rx_transitive as usize <= netback::RX_TRANSITIVE_MAX,
        "{st:?}"
    );
    assert!(st.rx_linearized > 0, "{st:?}");
    let held = 100 - front_a.stats().tx_packets as usize - vif_b.rx_queued();
    assert!(
        held <= netback::RX_TRANSITIVE_MAX,
        "A's buffers held for B: {held}"
    );
    // B copies at last: every frame arrives intact, in order, and A gets every buffer
    // back.
    let mut got = Vec::new();
    for _ in 0..4 {
        got.extend(take_all_from(&mut front_b, &mut bpool));
        vif_b.rx_action(&mut dpool);
        let mut tokens = Vec::new();
        dpool.take_released(|r| tokens.push(r.token));
        vif_a.tx_release(tokens);
        front_a.poll_tx(&mut apool);
    }
    assert_eq!(got.len(), 100);
    for (k, f) in got.iter().enumerate() {
        assert_eq!(f, &frame_a_to_b(1514, k as u8), "frame {k}");
    }
    assert_eq!(front_a.stats().tx_packets, 100);
    assert_eq!(dpool.free_buffers(), dpool.capacity());
}

/// What one poll of `front` delivers, each packet's bytes.
fn poll_once(front: &mut Netfront, pool: &mut SkbPool) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    front.poll_rx(pool, 64, |pool, s| {
        let mut b = vec![0u8; pool.len(s)];
        pool.read(s, 0, &mut b).expect("read");
        got.push(b);
        pool.free(s);
    });
    got
}

/// Everything `front` delivers until it has nothing more.
fn take_all_from(front: &mut Netfront, pool: &mut SkbPool) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    loop {
        let more = poll_once(front, pool);
        if more.is_empty() {
            return got;
        }
        got.extend(more);
    }
}

// --- The copy moved to the guest (paper 000 §4.1–4.2) ---------------------------------

fn guest_copy_pair() -> Pair {
    let mut p = pair_with(GrantVersion::V2, GrantPath::Optimised, RxBuffers::GuestCopy);
    p.front.refill_rx(&mut p.gpool);
    p
}

/// Queues `frame` to the vif as the NIC driver would receive it; returns where its
/// bytes lie in the driver domain.
fn queue_frame(p: &mut Pair, frame: &[u8]) -> (hv::Gfn, usize) {
    let s = p.dpool.alloc(NET_SKB_PAD + NET_IP_ALIGN).expect("skb");
    p.dpool.put(s, frame).expect("put");
    let at = p.dpool.data_location(s);
    p.vif.start_xmit(&mut p.dpool, s);
    at
}

/// Everything netfront delivers now, each packet's bytes.
fn take_all(p: &mut Pair) -> Vec<Vec<u8>> {
    poll_once(&mut p.front, &mut p.gpool)
}

/// The back end's grant for slot 0 of its guest-copy vif.
fn grant_base(p: &Pair) -> u32 {
    let dir = xenbus::backend_dir(p.drv.id(), p.guest.id(), 0);
    xenbus::read_u32(
        p.hv.store(),
        p.guest.id(),
        &format!("{dir}/{}", xenbus::RX_GRANT_BASE),
    )
    .expect("rx-grant-base")
}

/// The guest's own grant copy of `len` bytes at `offset` through the back end's grant
/// `gref`, into a fresh page of its own: the bytes, or the error.
fn guest_reads(p: &Pair, gref: u32, offset: usize, len: usize) -> Result<Vec<u8>, hv::GrantError> {
    let page = p.guest.alloc_page().expect("page");
    let mut st = [Ok(())];
    p.hv.grant_copy(
        &p.guest,
        &[GrantCopy {
            source: CopyPtr::Gref {
                dom: p.drv.id(),
                gref: GrantRef(gref),
                offset: offset as u16,
            },
            dest: CopyPtr::Local {
                gfn: page,
                offset: 0,
            },
            len: len as u16,
        }],
        &mut st,
    );
    let mut out = vec![0u8; len];
    p.guest.read(page, 0, &mut out).expect("read");
    p.guest.free_page(page).expect("free");
    st[0].map(|()| out)
}

#[test]
fn a_guest_copy_front_end_copies_every_message_itself_aligned_and_gives_every_buffer_back() {
    let mut p = pair_with(GrantVersion::V2, GrantPath::Optimised, RxBuffers::GuestCopy);
    let headroom = NET_SKB_PAD + NET_IP_ALIGN;
    let (stack, gfree) =
        receive_each_from(&mut p, headroom, &[52, 1472, 8000], true, |pool, skb| {
            // netfront placed each packet at its source's offset in a cache line.
            assert_eq!(pool.data_location(skb).1 % 64, headroom % 64);
        });
    let s = p.vif.stats().clone();
    assert_eq!((s.rx_lent, s.rx_packets), (8, 8), "1 + 1 + 6 frames");
    assert_eq!(s.rx_copy_bytes.total(), 0, "netback copies nothing");
    assert_eq!(p.front.stats().rx_packets, 8);
    // The slots the guest posted again give the buffers back.
    p.vif.rx_action(&mut p.dpool);
    assert_eq!(p.vif.stats().rx_returned, 8);
    all_returned(&p, &stack, gfree);
}

#[test]
fn a_guest_reads_only_the_lent_packets_bytes_only_while_lent_and_cannot_write_them() {
    let mut p = guest_copy_pair();
    // Two frames whose 2 KiB heads share one driver-domain page.
    let (f1, f2) = (vec![0xa1u8; 300], vec![0xb2u8; 300]);
    let (g1, o1) = queue_frame(&mut p, &f1);
    let (g2, o2) = queue_frame(&mut p, &f2);
    assert_eq!(g1, g2, "both heads in one page");
    p.vif.rx_action(&mut p.dpool);
    assert_eq!(p.vif.stats().rx_lent, 2);
    let base = grant_base(&p);
    // Which slots carry them: the guest can find out only by reading its own grants.
    let slot = |off| {
        (0..u32::from(net::netif::RING_IDS))
            .find(|i| guest_reads(&p, base + i, off, 300).is_ok())
            .expect("a lent slot")
    };
    let (s1, s2) = (slot(o1), slot(o2));
    assert_ne!(s1, s2);
    assert_eq!(guest_reads(&p, base + s1, o1, 300), Ok(f1.clone()));
    // Not a byte before or after the window, nor the other packet in the same page.
    assert!(guest_reads(&p, base + s1, o1 - 1, 1).is_err());
    assert!(guest_reads(&p, base + s1, o1 + 300, 1).is_err());
    assert!(guest_reads(&p, base + s1, o1, 301).is_err());
    assert!(guest_reads(&p, base + s1, o2, 300).is_err());
    assert!(guest_reads(&p, base + s1, 0, 64).is_err());
    // Read-only: the guest cannot write into the driver domain's buffer.
    let mine = p.guest.alloc_page().expect("page");
    let mut st = [Ok(())];
    p.hv.grant_copy(
        &p.guest,
        &[GrantCopy {
            source: CopyPtr::Local {
                gfn: mine,
                offset: 0,
            },
            dest: CopyPtr::Gref {
                dom: p.drv.id(),
                gref: GrantRef(base + s1),
                offset: o1 as u16,
            },
            len: 16,
        }],
        &mut st,
    );
    assert!(st[0].is_err());
    // The guest takes both, posts the slots again, and the back end revokes: the
    // grants read nothing after.
    assert_eq!(take_all(&mut p), vec![f1, f2]);
    p.vif.rx_action(&mut p.dpool);
    assert_eq!(p.vif.stats().rx_returned, 2);
    assert!(guest_reads(&p, base + s1, o1, 300).is_err());
    assert!(guest_reads(&p, base + s2, o2, 300).is_err());
    assert_eq!(p.dpool.free_buffers(), p.dpool.capacity());
}

#[test]
fn a_guest_that_never_copies_holds_at_most_its_bound_of_driver_domain_buffers() {
    let mut p = guest_copy_pair();
    let frame = |i: usize| vec![i as u8; 1514];
    for i in 0..RX_LENT_MAX + 10 {
        queue_frame(&mut p, &frame(i));
    }
    p.vif.rx_action(&mut p.dpool);
    // The bound lent; the rest wait in the queue, as for a guest that posts nothing.
    let s = p.vif.stats().clone();
    assert_eq!(
        (s.rx_lent, s.rx_revoked, p.vif.rx_queued()),
        (RX_LENT_MAX as u64, 0, 10)
    );
    // Traffic keeps coming and the queue fills: the guest is not copying, and each
    // packet that would not fit takes back the oldest lent buffer instead.
    let mut i = RX_LENT_MAX + 10;
    while p.vif.stats().rx_queue_full == 0 {
        queue_frame(&mut p, &frame(i));
        i += 1;
    }
    p.vif.rx_action(&mut p.dpool);
    let s = p.vif.stats().clone();
    assert!(s.rx_revoked >= 1, "{s:?}");
    let held = p.dpool.capacity() - p.dpool.free_buffers();
    assert_eq!(
        held,
        RX_LENT_MAX + p.vif.rx_queued(),
        "lent buffers stay at the bound"
    );
    // When the guest does copy, the revoked packets fail, counted, and the rest
    // arrive; every driver-domain buffer comes back.
    let mut got = Vec::new();
    for _ in 0..100 {
        p.front.poll_rx(&mut p.gpool, 256, |pool, s| {
            got.push(pool.domain().id());
            pool.free(s);
        });
        p.vif.rx_action(&mut p.dpool);
        if p.vif.rx_queued() == 0 && p.front.rx_posted() == 256 {
            break;
        }
    }
    p.front.poll_rx(&mut p.gpool, 256, |pool, s| {
        got.push(pool.domain().id());
        pool.free(s);
    });
    p.vif.rx_action(&mut p.dpool);
    let s = p.vif.stats().clone();
    assert_eq!(p.front.stats().rx_copy_errors, s.rx_revoked);
    assert_eq!(got.len() as u64 + s.rx_revoked + s.rx_queue_full, i as u64);
    assert_eq!(p.dpool.free_buffers(), p.dpool.capacity());
    assert_eq!(p.front.rx_posted(), 256);
    assert_eq!(p.gpool.free_buffers(), p.gpool.capacity());
}

/// The guest's own grant copy through `gref` as [`guest_reads`] does, from another
/// thread (a second vCPU of the guest): whether it succeeded.
fn copy_through(
    hv: &Hypervisor,
    guest: &Domain,
    drv: hv::DomId,
    gref: u32,
    at: (usize, usize),
    page: hv::Gfn,
) -> bool {
    let mut st = [Ok(())];
    hv.grant_copy(
        guest,
        &[GrantCopy {
            source: CopyPtr::Gref {
                dom: drv,
                gref: GrantRef(gref),
                offset: at.0 as u16,
            },
            dest: CopyPtr::Local {
                gfn: page,
                offset: 0,
            },
            len: at.1 as u16,
        }],
        &mut st,
    );
    st[0].is_ok()
}

/// Finding of issue 39: a guest with two vCPUs gives a slot back while its other vCPU
/// is still copying through the slot's grant. The grant cannot end while the copy is
/// under way, and the slot must not be lent again until it has: the next packet lent
/// through it would otherwise have its grant ended under it (or its buffer freed while
/// another piece is still lent). Each round one vCPU copies through packet A's slot
/// without pause while the other takes A, posts the slot again and the back end lends
/// packet B; B must then arrive whole, no copy fail, no buffer be freed twice, and every
/// buffer come back. The race is won within a few rounds of hundreds (before the fix,
/// within 1 to 11 tries); after it no round can fail, so the test is deterministic in
/// what it asserts.
#[test]
fn a_slot_given_back_while_the_guest_copies_through_it_is_lent_again_only_after_the_copy() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut p = guest_copy_pair();
    let base = grant_base(&p);
    let drv = p.drv.id();
    let start = std::time::Instant::now();
    let mut rounds = 0;
    while rounds < 400 && start.elapsed() < Duration::from_secs(3) {
        rounds += 1;
        let a = vec![0xa0u8 ^ rounds as u8; 1000];
        let (_, off) = queue_frame(&mut p, &a);
        p.vif.rx_action(&mut p.dpool);
        let slot = (0..u32::from(net::netif::RING_IDS))
            .find(|i| guest_reads(&p, base + i, off, a.len()).is_ok())
            .expect("A's slot");
        let stop = Arc::new(AtomicBool::new(false));
        let going = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let reader = {
            let (hv, guest) = (Arc::clone(&p.hv), Arc::clone(&p.guest));
            let (stop, going) = (Arc::clone(&stop), Arc::clone(&going));
            std::thread::spawn(move || {
                let page = guest.alloc_page().expect("page");
                while !stop.load(Ordering::Relaxed) {
                    copy_through(&hv, &guest, drv, base + slot, (off, 1000), page);
                    going.fetch_add(1, Ordering::Relaxed);
                }
                guest.free_page(page).expect("free");
            })
        };
        // Once the other vCPU is copying, take A (netfront posts its slot again) and
        // have B lent while it may still be copying.
        while going.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        assert_eq!(take_all(&mut p), vec![a]);
        let b = vec![0x0bu8 ^ rounds as u8; 1200];
        queue_frame(&mut p, &b);
        p.vif.rx_action(&mut p.dpool);
        stop.store(true, Ordering::Relaxed);
        reader.join().expect("reader");
        // The copy is over: the parked slot is credited, B lent if it was not yet.
        p.vif.rx_action(&mut p.dpool);
        assert_eq!(take_all(&mut p), vec![b], "round {rounds}");
        p.vif.rx_action(&mut p.dpool);
    }
    assert_eq!(p.front.stats().rx_copy_errors, 0);
    assert_eq!(p.vif.stats().rx_copy_errors, 0);
    assert_eq!(p.dpool.stats().double_frees, 0);
    assert_eq!(
        p.dpool.free_buffers(),
        p.dpool.capacity(),
        "every buffer back"
    );
}

/// A second guest on `p`'s driver domain, as vif index 1, whose front end writes its
/// rings by hand (offered as `rx_buffers` would be).
fn raw_guest(p: &Pair, rx_buffers: RxBuffers) -> (Arc<Domain>, net::rawfront::RawFront) {
    let bad =
        p.hv.create_domain(&DomainConfig {
            name: "bad".into(),
            pages: 256,
            grant_frames: 4,
            grant_version: GrantVersion::V2,
            vcpus: 1,
            map_slots: 4,
            driver_domain: false,
        })
        .expect("domain");
    let spec = VifSpec {
        handle: 0,
        mac: [2, 0, 0, 0, 0, 9],
        index: 1,
        front: FrontConfig {
            rx_buffers,
            ..FrontConfig::default()
        },
    };
    toolstack::offer_vif(&p.hv, &p.drv, &bad, spec).expect("offer");
    let raw = net::rawfront::RawFront::publish(&p.hv, &bad, p.drv.id(), 0).expect("publish");
    (bad, raw)
}

#[test]
fn a_hostile_guest_copy_front_end_posting_unknown_or_repeated_slots_is_counted_and_frees_nothing_of_another_guest(
) {
    let mut p = guest_copy_pair();
    // A second guest on the same driver domain, writing its RX ring by hand.
    let (bad, raw) = raw_guest(&p, RxBuffers::GuestCopy);
    let fdir = xenbus::frontend_dir(bad.id(), 0);
    p.hv.store()
        .write(
            bad.id(),
            &format!("{fdir}/{}", xenbus::REQUEST_GUEST_COPY),
            "1",
        )
        .expect("write");
    let mut bad_vif = Vif::connect(
        hv::Pvio::new(&p.hv, &p.drv),
        bad.id(),
        0,
        1,
        VIF_WINDOW_SLOTS,
    )
    .expect("the hostile front end connects");
    // The good guest has two packets lent and not yet copied.
    let (f1, f2) = (vec![0x11u8; 400], vec![0x22u8; 1400]);
    queue_frame(&mut p, &f1);
    queue_frame(&mut p, &f2);
    p.vif.rx_action(&mut p.dpool);
    assert_eq!(p.vif.stats().rx_lent, 2);
    // A ring's worth of requests: 254 slots, one of them again, one beyond the ring.
    for (i, id) in (0..254u16).chain([5, 300]).enumerate() {
        let i = i as u32;
        raw.post_rx(
            i,
            RxRequest {
                id,
                pad: 0,
                gref: 0,
            },
            i + 1,
        );
    }
    bad_vif.rx_action(&mut p.dpool);
    assert_eq!(bad_vif.stats().rx_bad_requests, 2);
    assert_eq!(bad_vif.stats().rx_returned, 0);
    assert!(bad_vif.disabled().is_none());
    // The good guest's packets are untouched and its buffers come back only by its
    // own posts.
    assert_eq!(take_all(&mut p), vec![f1, f2]);
    p.vif.rx_action(&mut p.dpool);
    assert_eq!(p.vif.stats().rx_returned, 2);
    bad_vif.disconnect(&mut p.dpool);
    assert_eq!(p.dpool.free_buffers(), p.dpool.capacity());
}

// --- Direct placement (paper 000 §4.3) ---------------------------------------------------

#[test]
fn direct_placement_maps_only_what_a_guest_posted_rightly_and_answers_the_rest_with_errors() {
    let mut p = pair(GrantVersion::V2, GrantPath::Optimised);
    let (bad, mut raw) = raw_guest(&p, RxBuffers::Linear);
    let mut vif = Vif::connect(
        hv::Pvio::new(&p.hv, &p.drv),
        bad.id(),
        0,
        1,
        VIF_WINDOW_SLOTS,
    )
    .expect("vif");
    vif.enable_direct();
    let (good, good2) = (
        raw.rx_buffer(p.drv.id()).expect("buffer"),
        raw.rx_buffer(p.drv.id()).expect("buffer"),
    );
    // A good buffer; its id again; an id beyond the ring; a reference never granted; the
    // read-only data page (cannot be written); a second good buffer.
    let reqs = [
        (7u16, good),
        (7, good2),
        (300, good2),
        (8, 4000),
        (9, raw.data_ref),
        (10, good2),
    ];
    for (i, &(id, gref)) in reqs.iter().enumerate() {
        raw.post_rx(i as u32, RxRequest { id, pad: 0, gref }, i as u32 + 1);
    }
    assert_eq!(vif.rx_direct_refill(), 2, "the good buffers mapped");
    let st = vif.stats().clone();
    assert_eq!((st.rx_bad_requests, st.rx_copy_errors), (2, 2), "{st:?}");
    // The four bad ones are answered with errors at once.
    let rsp: Vec<_> = (0..4).map(|i| raw.rx_response(i)).collect();
    assert!(
        rsp.iter().all(|r| r.status == XEN_NETIF_RSP_ERROR),
        "{rsp:?}"
    );
    let mut ids: Vec<u16> = rsp.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [7, 8, 9, 300]);
    // The good buffers go to the NIC, all of them; one comes back filled.
    let mut given = Vec::new();
    vif.rx_direct_give(|iova, len, token| {
        given.push((iova, len, token));
        true
    });
    assert_eq!(given.len(), 2);
    assert_eq!(vif.rx_direct_ready(), 0);
    vif.rx_direct_done(given[0].2, 200, true, false);
    // A token the NIC never had, or one already handed back: nothing.
    vif.rx_direct_done(given[0].2, 200, true, false);
    vif.rx_direct_done(9999, 200, true, false);
    vif.rx_direct_flush();
    let r = raw.rx_response(4);
    assert_eq!(
        (r.id, r.status, r.offset as usize),
        (7, 200, netback::DIRECT_OFFSET)
    );
    assert_eq!(vif.stats().rx_packets, 1);
    // Answered means unmapped: the guest can take its grant back.
    assert_eq!(bad.grant_table().end_access(GrantRef(good)), Ok(()));
    // The other buffer is still mapped (with the NIC): the guest cannot take it back,
    // until the vif goes, which unmaps it.
    assert!(bad.grant_table().end_access(GrantRef(good2)).is_err());
    vif.disconnect(&mut p.dpool);
    assert_eq!(bad.grant_table().end_access(GrantRef(good2)), Ok(()));
    assert_eq!(p.dpool.free_buffers(), p.dpool.capacity());
}

/// A back end that stops taking requests before it has seen its ring empty (its budget
/// ran out, or its pending entries) has not armed `req_event`, so the front end would
/// send no event for what it adds next. Once it looks and finds the ring empty, as the
/// driver domain's poll does before it goes idle, the guest's next request signals it.
#[test]
fn a_vif_that_stopped_early_is_signalled_by_the_guests_next_request_once_its_ring_is_empty() {
    let mut p = pair(GrantVersion::V2, GrantPath::Optimised);
    let send = |p: &mut Pair, seed: u8| {
        let f: Vec<u8> = (0..1514).map(|i| (i as u8).wrapping_mul(seed)).collect();
        let s = p.gpool.alloc(NET_SKB_PAD).expect("skb");
        p.gpool.put(s, &f).expect("put");
        p.front.xmit(&mut p.gpool, s).expect("ring has room");
    };
    for k in 0..4 {
        send(&mut p, k);
    }
    let mut out: Vec<SkbId> = Vec::new();
    // Exactly the budget: every request taken, the ring never seen empty.
    assert_eq!(p.vif.tx_action(&mut p.dpool, 4, |_, s| out.push(s)), 4);
    p.drv.take_pending(0, |_| {});
    assert!(!p.drv.evtchn_is_pending(p.vif.port()).expect("port"));
    assert!(!p.vif.tx_pending(), "the ring is empty");
    send(&mut p, 9);
    assert!(
        p.drv.evtchn_is_pending(p.vif.port()).expect("port"),
        "the request after the back end found its ring empty is signalled"
    );
    assert_eq!(p.vif.tx_action(&mut p.dpool, 64, |_, s| out.push(s)), 1);
    for s in out {
        p.dpool.free(s);
    }
    let mut tokens = Vec::new();
    p.dpool.take_released(|r| tokens.push(r.token));
    p.vif.tx_release(tokens);
    p.front.poll_tx(&mut p.gpool);
    assert_eq!(p.front.stats().tx_packets, 5);
    assert_eq!(p.gpool.free_buffers(), p.gpool.capacity());
}

/// A vif with page fragments, a grant per I/O and no offloads, at driver-domain index
/// `index`, its front end asking for the split ring layout if `split_indices`.
fn plain_spec(mac: [u8; 6], index: u16, split_indices: bool) -> VifSpec {
    VifSpec {
        handle: 0,
        mac,
        index,
        front: FrontConfig {
            split_ring: split_indices,
            ..FrontConfig::default()
        },
    }
}

/// Four packets out of the guest, each checked at netback and answered; returns the
/// driver domain's view of the TX ring's words at `at` (through the vif's mapping).
fn tx_four_and_read_ring_words(p: &mut Pair, at: &[usize]) -> Vec<u32> {
    for (k, len) in [60usize, 129, 1514, 300].into_iter().enumerate() {
        let f: Vec<u8> = (0..len).map(|i| (i * 5 + k) as u8).collect();
        let s = p.gpool.alloc(NET_SKB_PAD).expect("skb");
        p.gpool.put(s, &f).expect("put");
        p.front.xmit(&mut p.gpool, s).expect("room");
        let mut out = Vec::new();
        assert_eq!(p.vif.tx_action(&mut p.dpool, 64, |_, s| out.push(s)), 1);
        let mut got = vec![0u8; len];
        p.dpool.read(out[0], 0, &mut got).expect("read");
        assert_eq!(got, f);
        p.dpool.free(out[0]);
        let mut tokens = Vec::new();
        p.dpool.take_released(|r| tokens.push(r.token));
        p.vif.tx_release(tokens);
        while p.front.poll_tx(&mut p.gpool) > 0 {}
    }
    // The TX ring is the first page the vif maps (vif index 0: window slot 0).
    let ring = p.drv.window().page(0).expect("tx ring mapped");
    at.iter()
        .map(|&o| mem::PageAccess::read_obj::<u32>(&ring, o).expect("word"))
        .collect()
}

#[test]
fn the_split_ring_layout_is_used_only_where_both_ends_agree_and_carries_traffic_either_way() {
    // ring.h's words: rsp_prod at byte 8. The split layout's: rsp_prod at byte 64.
    let (ring_h_rsp_prod, split_rsp_prod) = (8, 64);
    for (offered, asked, split) in [
        (true, true, true),
        (false, true, false),
        (true, false, false),
    ] {
        let (hv, drv, guest) = machine(8192, GrantVersion::V2, GrantPath::Optimised);
        let guest = guest("guest");
        let spec = plain_spec(flow().dst_mac, 0, asked);
        toolstack::offer_vif(&hv, &drv, &guest, spec).expect("offer");
        let bdir = xenbus::backend_dir(drv.id(), guest.id(), 0);
        if !offered {
            hv.store()
                .write(
                    drv.id(),
                    &format!("{bdir}/{}", xenbus::FEATURE_SPLIT_INDICES),
                    "0",
                )
                .expect("withdraw the offer");
        }
        let cfg = FrontConfig {
            split_ring: asked,
            ..FrontConfig::ORIGINAL
        };
        let front = Netfront::connect_config(&hv, &guest, 0, cfg).expect("front");
        let vif = toolstack::connect_backend(&hv, &drv, &guest, spec).expect("back");
        let fdir = xenbus::frontend_dir(guest.id(), 0);
        assert_eq!(
            hv.store()
                .read(
                    guest.id(),
                    &format!("{fdir}/{}", xenbus::REQUEST_SPLIT_INDICES)
                )
                .as_deref(),
            Ok(if split { "1" } else { "0" })
        );
        let mut p = Pair {
            dpool: SkbPool::new(Arc::clone(&drv), 512, 64).expect("pool"),
            gpool: SkbPool::new(Arc::clone(&guest), 512, 512).expect("pool"),
            hv,
            drv,
            guest,
            front,
            vif,
        };
        let words = tx_four_and_read_ring_words(&mut p, &[ring_h_rsp_prod, split_rsp_prod]);
        let want = if split { [0, 4] } else { [4, 0] };
        assert_eq!(words, want, "offered {offered}, asked {asked}");
        let (stack, gfree) = receive_each(&mut p, &[60, 1400, 3000], false, |_, _| {});
        all_returned(&p, &stack, gfree);
    }
}

#[test]
fn a_front_end_that_asks_for_the_split_layout_and_lays_out_ring_h_harms_only_its_own_vif() {
    let (hv, drv, guest) = machine(16384, GrantVersion::V2, GrantPath::Optimised);
    let bad = guest("bad");
    let spec = plain_spec(MAC_B, 1, false);
    toolstack::offer_vif(&hv, &drv, &bad, spec).expect("offer");
    let raw = net::rawfront::RawFront::publish(&hv, &bad, drv.id(), 0).expect("raw");
    let fdir = xenbus::frontend_dir(bad.id(), 0);
    hv.store()
        .write(
            bad.id(),
            &format!("{fdir}/{}", xenbus::REQUEST_SPLIT_INDICES),
            "1",
        )
        .expect("ask");
    let mut vif = toolstack::connect_backend(&hv, &drv, &bad, spec).expect("back");
    // A request where ring.h puts slot 0, published where both layouts put req_prod:
    // netback reads the split layout's slot 0 (zeroes), a packet too short, dropped.
    raw.put(
        0,
        net::netif::TxRequest {
            gref: raw.data_ref,
            offset: 0,
            flags: 0,
            id: 0,
            size: 60,
        },
    );
    raw.publish_tx(1);
    let mut dpool = SkbPool::new(Arc::clone(&drv), 512, 64).expect("pool");
    let mut out = Vec::new();
    assert_eq!(vif.tx_action(&mut dpool, 64, |_, s| out.push(s)), 0);
    assert!(out.is_empty());
    assert_eq!(
        vif.tx_check_stats()
            .drop_count(net::netif::TxDrop::PacketTooShort),
        1
    );
    // A well-behaved guest on the same driver domain, with the split layout, is not
    // touched.
    let good = guest("good");
    let spec = plain_spec(flow().dst_mac, 0, true);
    let (front, vif) = toolstack::plug_vif(&hv, &drv, &good, spec).expect("good");
    let mut p = Pair {
        dpool,
        gpool: SkbPool::new(Arc::clone(&good), 512, 512).expect("pool"),
        hv,
        drv,
        guest: good,
        front,
        vif,
    };
    assert_eq!(tx_four_and_read_ring_words(&mut p, &[64]), [4]);
}
