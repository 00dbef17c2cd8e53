//! Checksum offload and GSO between netfront and netback: a large TCP segment crosses
//! the rings as one packet with its segment size, both ways, to a front end that offers
//! them; a front end that does not gets frames cut and checksummed in the driver domain;
//! and what a guest claims about its packets is checked against their headers.

use std::sync::Arc;

use hv::{Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
use net::netback::{Vif, VIF_WINDOW_SLOTS};
use net::netfront::FrontConfig;
use net::netfront::Netfront;
use net::offload::{Csum, Offload, OffloadError};
use net::skb::{SkbId, SkbPool, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};

mod common;

const GUEST_MAC: [u8; 6] = [2, 0, 0, 0, 0, 2];
const PEER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

struct Pair {
    dpool: SkbPool,
    gpool: SkbPool,
    front: Netfront,
    vif: Vif,
    _hv: Arc<Hypervisor>,
    _doms: [Arc<Domain>; 2],
}

fn pair(offloads: bool) -> Pair {
    let hv = Hypervisor::new(HvConfig {
        frames: 16384,
        grant_path: GrantPath::Optimised,
        ..HvConfig::default()
    })
    .expect("hv");
    let dom = |name: &str, driver: bool, slots| {
        hv.create_domain(&DomainConfig {
            name: name.into(),
            pages: 4096,
            grant_frames: 4,
            grant_version: GrantVersion::V1,
            vcpus: 1,
            map_slots: slots,
            driver_domain: driver,
        })
        .expect("domain")
    };
    let drv = dom("drv", true, 2 * VIF_WINDOW_SLOTS);
    let guest = dom("guest", false, 4);
    let spec = VifSpec {
        handle: 0,
        mac: GUEST_MAC,
        index: 0,
        front: FrontConfig {
            offloads,
            ..FrontConfig::default()
        },
    };
    let (mut front, vif) = toolstack::plug_vif(&hv, &drv, &guest, spec).expect("vif");
    let dpool = SkbPool::new(Arc::clone(&drv), 512, 512).expect("pool");
    let mut gpool = SkbPool::new(Arc::clone(&guest), 512, 1024).expect("pool");
    front.refill_rx(&mut gpool);
    Pair {
        dpool,
        gpool,
        front,
        vif,
        _hv: hv,
        _doms: [drv, guest],
    }
}

/// A packet buffer in `pool` holding `frame` with `off`.
fn skb(pool: &mut SkbPool, frame: &[u8], off: Offload) -> SkbId {
    let s = pool.alloc_page_linear().expect("skb");
    pool.append(s, frame).expect("append");
    pool.set_offload(s, off);
    s
}

fn bytes(pool: &SkbPool, s: SkbId) -> Vec<u8> {
    let mut b = vec![0u8; pool.len(s)];
    pool.read(s, 0, &mut b).expect("read");
    b
}

impl Pair {
    /// Sends `frame` from the guest; returns what netback delivered, bytes and offload.
    fn guest_sends(&mut self, frame: &[u8], off: Offload) -> Vec<(Vec<u8>, Offload)> {
        let s = skb(&mut self.gpool, frame, off);
        self.front.xmit(&mut self.gpool, s).expect("ring room");
        let mut out = Vec::new();
        self.vif.tx_action(&mut self.dpool, 64, |p, s| {
            out.push((bytes(p, s), p.offload(s)));
            p.free(s);
        });
        let mut tokens = Vec::new();
        self.dpool.take_released(|r| tokens.push(r.token));
        self.vif.tx_release(tokens);
        self.front.poll_tx(&mut self.gpool);
        out
    }

    /// Hands `frame` to the vif from the bridge; returns what netfront delivered.
    fn guest_receives(&mut self, frame: &[u8], off: Offload) -> Vec<(Vec<u8>, Offload)> {
        let s = skb(&mut self.dpool, frame, off);
        self.vif.start_xmit(&mut self.dpool, s);
        self.vif.rx_action(&mut self.dpool);
        let mut out = Vec::new();
        self.front.poll_rx(&mut self.gpool, 256, |p, s| {
            out.push((bytes(p, s), p.offload(s)));
            p.free(s);
        });
        out
    }
}

#[test]
fn a_large_segment_crosses_whole_both_ways_with_its_size_and_a_blank_checksum() {
    let mut p = pair(true);
    let (frame, off) = common::partial(
        common::tcp_frame(GUEST_MAC, PEER_MAC, 60_000, 1, 9),
        Some(1448),
    );
    // Guest to driver domain: one packet, its GSO size, its checksum located.
    let out = p.guest_sends(&frame, off);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, frame, "every byte");
    assert_eq!(out[0].1, off);
    assert_eq!(p.vif.stats().tx_gso_packets, 1);
    assert_eq!(p.front.stats().tx_gso_packets, 1);
    // Driver domain to guest: one packet, through one extra slot.
    let (frame, off) = common::partial(
        common::tcp_frame(PEER_MAC, GUEST_MAC, 64_000, 7, 3),
        Some(1448),
    );
    let got = p.guest_receives(&frame, off);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, frame);
    assert_eq!(got[0].1, off);
    assert_eq!(p.vif.stats().rx_gso_packets, 1);
    assert_eq!(p.front.stats().rx_gso_packets, 1);
    // A verified checksum stays verified; a small partial one stays partial.
    let plain = common::tcp_frame(PEER_MAC, GUEST_MAC, 500, 9, 4);
    let valid = Offload {
        csum: Csum::Valid,
        gso: None,
    };
    assert_eq!(
        p.guest_receives(&plain, valid),
        vec![(plain.clone(), valid)]
    );
    let (small, soff) = common::partial(plain, None);
    assert_eq!(p.guest_receives(&small, soff), vec![(small, soff)]);
}

#[test]
fn a_front_end_without_offloads_gets_frames_cut_and_checksummed_by_netback() {
    let mut p = pair(false);
    let (frame, off) = common::partial(
        common::tcp_frame(PEER_MAC, GUEST_MAC, 30_000, 100, 5),
        Some(1448),
    );
    let got = p.guest_receives(&frame, off);
    assert_eq!(got.len(), 30_000usize.div_ceil(1448));
    let mut payload = Vec::new();
    for (f, o) in &got {
        assert!(f.len() <= net::wire::MAX_FRAME);
        assert!(common::checksum_ok(f), "complete checksum");
        assert_eq!(o.gso, None);
        payload.extend_from_slice(&f[54..]);
    }
    assert_eq!(payload, frame[54..], "every byte, in order");
    let st = p.vif.stats();
    assert_eq!(
        (st.rx_gso_segmented, st.rx_gso_segments),
        (1, got.len() as u64)
    );
    // A blank checksum is filled in.
    let (small, soff) = common::partial(common::tcp_frame(PEER_MAC, GUEST_MAC, 900, 1, 1), None);
    let got = p.guest_receives(&small, soff);
    assert_eq!(got.len(), 1);
    assert!(common::checksum_ok(&got[0].0));
    assert_eq!(p.vif.stats().rx_csum_filled, 1);
    // Such a front end sends no large packet: its stack is never given one.
    let (big, boff) = common::partial(
        common::tcp_frame(GUEST_MAC, PEER_MAC, 9000, 1, 1),
        Some(1448),
    );
    assert!(p.guest_sends(&big, boff).is_empty());
    assert_eq!(p.front.stats().tx_gso_refused, 1);
}

#[test]
fn what_a_guest_claims_about_its_packets_is_checked_against_their_headers() {
    let mut p = pair(true);
    let tcp = common::tcp_frame(GUEST_MAC, PEER_MAC, 8000, 1, 2);
    let gso = |size| net::netif::Gso {
        size,
        ty: net::netif::XEN_NETIF_GSO_TYPE_TCPV4,
    };
    // GSO of a UDP datagram, a blank checksum on ICMP, segments longer than a frame.
    let mut udp = tcp.clone();
    udp[14 + 9] = 17;
    let mut icmp = tcp.clone();
    icmp[14 + 9] = 1;
    let blank = Csum::Partial {
        start: 34,
        offset: 16,
    };
    for (f, o) in [
        (
            &udp,
            Offload {
                csum: blank,
                gso: Some(gso(1448)),
            },
        ),
        (
            &icmp,
            Offload {
                csum: blank,
                gso: None,
            },
        ),
        (
            &tcp,
            Offload {
                csum: blank,
                gso: Some(gso(4000)),
            },
        ),
    ] {
        assert!(p.guest_sends(f, o).is_empty(), "dropped");
    }
    let e = &p.vif.stats().tx_offload_errors;
    assert_eq!(e.get(OffloadError::GsoNotTcp), 1);
    assert_eq!(e.get(OffloadError::NotTcpUdp), 1);
    assert_eq!(e.get(OffloadError::GsoSegmentTooLong), 1);
    // GSO without a blank checksum (a buggy front end): made partial, as Linux does.
    let out = p.guest_sends(
        &tcp,
        Offload {
            csum: Csum::None,
            gso: Some(gso(1448)),
        },
    );
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].1.csum, blank);
    let (want, _) = common::partial(tcp.clone(), None);
    assert_eq!(out[0].0, want, "the field holds the pseudo-header sum");
    assert_eq!(p.vif.stats().tx_gso_csum_fixups, 1);
    // Every slot was answered and every buffer is back.
    assert!(p.vif.disabled().is_none());
    assert_eq!(p.gpool.free_buffers(), p.gpool.capacity());
    assert_eq!(p.dpool.free_buffers(), p.dpool.capacity());
    // The interface still works.
    let plain = common::tcp_frame(GUEST_MAC, PEER_MAC, 100, 1, 1);
    assert_eq!(p.guest_sends(&plain, Offload::NONE).len(), 1);
}

#[test]
fn a_small_packet_without_metadata_is_untouched() {
    let mut p = pair(true);
    let f = common::tcp_frame(PEER_MAC, GUEST_MAC, 1000, 1, 1);
    let s = p.dpool.alloc(NET_SKB_PAD).expect("skb");
    p.dpool.put(s, &f).expect("put");
    p.vif.start_xmit(&mut p.dpool, s);
    p.vif.rx_action(&mut p.dpool);
    let mut got = Vec::new();
    p.front.poll_rx(&mut p.gpool, 8, |pool, s| {
        got.push((bytes(pool, s), pool.offload(s)));
        pool.free(s);
    });
    assert_eq!(got, vec![(f, Offload::NONE)]);
}

/// Direct placement (paper 000 §4.3) with GSO: the NIC writes a large segment into the
/// guest's posted buffers in ring order, leaving the buffer after the first for the
/// frame's context; netback answers that buffer's request with the GSO extra, so the
/// guest's netfront gets one packet, whole, with its segment size. A frame after it
/// follows in order; a context no large frame came before (a device fault) is answered
/// with an error, counted, and spoils nothing after it.
#[test]
fn through_direct_placement_a_large_segment_reaches_the_guest_whole_with_its_extra_in_the_contexts_place(
) {
    use net::netback::{Fill, DIRECT_OFFSET};
    const DEV: hv::DeviceId = hv::DeviceId(5);
    let mut p = pair(true);
    p._hv.iommu_attach(DEV, &p._doms[0]).expect("attach");
    let mut dma = p._hv.iommu().device(DEV);
    p.vif.enable_direct();
    assert!(p.vif.rx_direct_refill() > 20);
    let mut given = Vec::new();
    p.vif.rx_direct_give(|iova, room, token| {
        given.push((iova, usize::from(room), token));
        true
    });
    let (big, off) = common::partial(
        common::tcp_frame(PEER_MAC, GUEST_MAC, 30_000, 7, 3),
        Some(1448),
    );
    let gso = off.gso.expect("gso");
    // As the NIC places it: the first buffer, the context's left empty, the rest.
    let mut bufs = given.iter();
    let mut at = 0;
    let mut fills = Vec::new();
    while at < big.len() {
        let &(iova, room, token) = bufs.next().expect("a buffer");
        let n = (big.len() - at).min(room);
        dma.dma_write(iova, &big[at..at + n]).expect("mapped");
        let more = at + n < big.len();
        fills.push((
            token,
            if at == 0 {
                Fill::First {
                    len: n as u16,
                    more,
                    gso,
                    blank: true,
                }
            } else {
                Fill::Data {
                    len: n as u16,
                    csum_ok: false,
                    more,
                }
            },
        ));
        if at == 0 {
            fills.push((bufs.next().expect("a buffer").2, Fill::Context));
        }
        at += n;
    }
    assert_eq!(fills.len(), big.len().div_ceil(4096 - DIRECT_OFFSET) + 1);
    // A small frame after it, then a context out of nowhere, then another frame.
    let small = common::tcp_frame(PEER_MAC, GUEST_MAC, 100, 9, 1);
    for (fill, frame) in [
        (None, &small),
        (Some(Fill::Context), &small),
        (None, &small),
    ] {
        let &(iova, _, token) = bufs.next().expect("a buffer");
        dma.dma_write(iova, frame).expect("mapped");
        fills.push((
            token,
            fill.unwrap_or(Fill::Data {
                len: frame.len() as u16,
                csum_ok: true,
                more: false,
            }),
        ));
    }
    for (token, fill) in fills {
        p.vif.rx_direct_filled(token, fill);
    }
    p.vif.rx_direct_flush();
    let mut got = Vec::new();
    p.front.poll_rx(&mut p.gpool, 256, |pool, s| {
        got.push((bytes(pool, s), pool.offload(s)));
        pool.free(s);
    });
    assert_eq!(got.len(), 3, "the large one, then the two small");
    assert_eq!(got[0].0, big, "every byte, in order");
    assert_eq!(got[0].1.gso, Some(gso), "with its segment size");
    assert!(common::is_partial(&got[0].1), "its checksum left blank");
    assert_eq!((&got[1].0, &got[2].0), (&small, &small));
    let st = p.vif.stats();
    assert_eq!((st.rx_gso_packets, st.rx_packets), (1, 3), "{st:?}");
    assert_eq!(st.rx_copy_errors, 1, "the stray context");
    assert_eq!(p.front.stats().rx_errors.total(), 1);
    // Every buffer answered: the guest's ring takes posts again in full.
    assert_eq!(p.vif.stats().rx_bad_requests, 0);
}
