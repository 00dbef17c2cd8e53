//! The LRO engine against a hostile wire: merge rules, bounds, and the differential
//! oracle (with LRO each flow's segments arrive in the order and with the bytes they
//! came with, and cutting each aggregate at its segment size gives them back).

use net::lro::{Delivery, Flush, Lro, LroConfig, Pass};
use net::offload::{checksum_setup, fill_partial, segment_tcp, set_pseudo};
use net::wire::TcpSegment;

const ACK: u8 = 0x10;
const PSH: u8 = 0x08;

/// A TCP/IPv4 frame from port `sport` with `payload` at `seq`, correct checksums.
fn seg(sport: u16, seq: u32, payload: &[u8], flags: u8, ts: Option<(u32, u32)>) -> Vec<u8> {
    TcpSegment {
        sport,
        dport: 5001,
        seq,
        ack: 7,
        flags,
        window: 1000,
        ts,
    }
    .frame(payload)
}

fn bytes(n: usize, k: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(k))
        .collect()
}

/// What came out, per delivery: (port, seq, payload) of each segment, and for an
/// aggregate its reason; every aggregate is also re-segmented and checked against its
/// segments.
#[derive(Debug, Default)]
struct Out {
    segs: Vec<(u16, u32, Vec<u8>)>,
    aggregates: Vec<(usize, Flush)>,
    alone: usize,
}

fn run(frames: &[Vec<u8>], cfg: LroConfig, poll_every: usize) -> (Out, Lro<usize>) {
    let mut lro: Lro<usize> = Lro::new(cfg);
    let mut out = Out::default();
    let mut sink = |d: Delivery<'_, usize>| match d {
        Delivery::Alone(i) => {
            out.alone += 1;
            let f = &frames[i];
            let l4 = checksum_setup(f, f.len()).expect("tcp");
            let sport = u16::from_be_bytes([f[l4.l4], f[l4.l4 + 1]]);
            let seq = u32::from_be_bytes(f[l4.l4 + 4..l4.l4 + 8].try_into().expect("test frame"));
            out.segs
                .push((sport, seq, f[l4.headers()..l4.frame_len].to_vec()));
        }
        Delivery::Aggregate(a) => {
            let head = a.head.to_vec();
            let (gso, reason) = (a.gso_size as usize, a.reason);
            let segs: Vec<_> = a.segs.collect();
            out.aggregates.push((segs.len(), reason));
            // Linearize and cut: exactly the segments that joined.
            let mut whole = head.clone();
            for s in &segs {
                whole.extend_from_slice(&frames[s.buf][s.payload.clone()]);
            }
            let l4 = checksum_setup(&whole, whole.len()).expect("aggregate headers");
            assert_eq!(l4.frame_len, whole.len(), "IPv4 length covers the whole");
            let mut buf = vec![0u8; 2048];
            let mut cut = Vec::new();
            segment_tcp(&whole, &l4, gso, &mut buf, |f| {
                let l = checksum_setup(f, f.len()).expect("test frame");
                cut.push((
                    u32::from_be_bytes(f[l.l4 + 4..l.l4 + 8].try_into().expect("test frame")),
                    f[l.headers()..].to_vec(),
                ))
            })
            .expect("re-segments");
            let sport = u16::from_be_bytes([head[34], head[35]]);
            let arrived: Vec<_> = segs
                .iter()
                .map(|s| (s.seq, frames[s.buf][s.payload.clone()].to_vec()))
                .collect();
            assert_eq!(cut, arrived, "re-segmenting gives back what arrived");
            out.segs
                .extend(arrived.into_iter().map(|(q, p)| (sport, q, p)));
        }
    };
    for (i, f) in frames.iter().enumerate() {
        lro.receive(i, f, false, i as u64, &mut sink);
        assert!(lro.held_flows() <= cfg.max_flows);
        if (i + 1) % poll_every == 0 {
            lro.flush_all(Flush::Poll, &mut sink);
        }
    }
    lro.flush_all(Flush::Poll, &mut sink);
    (out, lro)
}

/// Per flow, the segments in the order they were given.
fn per_flow(frames: &[Vec<u8>]) -> Vec<(u16, u32, Vec<u8>)> {
    frames
        .iter()
        .map(|f| {
            let l4 = checksum_setup(f, f.len()).expect("test frame");
            (
                u16::from_be_bytes([f[l4.l4], f[l4.l4 + 1]]),
                u32::from_be_bytes(f[l4.l4 + 4..l4.l4 + 8].try_into().expect("test frame")),
                f[l4.headers()..l4.frame_len].to_vec(),
            )
        })
        .collect()
}

fn same_per_flow(a: &[(u16, u32, Vec<u8>)], b: &[(u16, u32, Vec<u8>)]) {
    let mut ports: Vec<u16> = a.iter().map(|s| s.0).collect();
    ports.sort();
    ports.dedup();
    for p in ports {
        let x: Vec<_> = a.iter().filter(|s| s.0 == p).collect();
        let y: Vec<_> = b.iter().filter(|s| s.0 == p).collect();
        assert_eq!(x, y, "flow {p}: order and bytes as they came");
    }
}

#[test]
fn in_order_segments_of_a_flow_become_one_aggregate() {
    let frames: Vec<_> = (0..8u32)
        .map(|i| {
            seg(
                1,
                1000 + i * 1448,
                &bytes(1448, i as u8),
                ACK,
                Some((10 + i, 5)),
            )
        })
        .collect();
    let (out, lro) = run(&frames, LroConfig::default(), 64);
    assert_eq!(out.aggregates, vec![(8, Flush::Poll)]);
    assert_eq!(lro.stats.segments_per_aggregate(), 8.0);
    same_per_flow(&out.segs, &per_flow(&frames));
}

#[test]
fn sequence_numbers_that_wrap_still_merge() {
    let start = u32::MAX - 1448 * 2;
    let frames: Vec<_> = (0..5u32)
        .map(|i| {
            seg(
                1,
                start.wrapping_add(i * 1448),
                &bytes(1448, i as u8),
                ACK,
                None,
            )
        })
        .collect();
    let (out, _) = run(&frames, LroConfig::default(), 64);
    assert_eq!(out.aggregates, vec![(5, Flush::Poll)]);
}

#[test]
fn out_of_order_duplicate_and_overlapping_segments_flush_and_keep_their_order() {
    let p = |i: u32| seg(1, i * 100, &bytes(100, i as u8), ACK, None);
    let overlap = seg(1, 150, &bytes(100, 9), ACK, None);
    let frames = vec![p(0), p(1), p(3), p(2), p(2), overlap, p(4), p(5)];
    let (out, lro) = run(&frames, LroConfig::default(), 64);
    assert!(lro.stats.flushed.get(Flush::OutOfOrder) >= 3);
    same_per_flow(&out.segs, &per_flow(&frames));
}

#[test]
fn a_corrupt_checksum_is_never_merged() {
    let mut bad = seg(1, 200, &bytes(100, 2), ACK, None);
    let n = bad.len();
    bad[n - 1] ^= 0xff;
    let frames = vec![
        seg(1, 0, &bytes(100, 0), ACK, None),
        seg(1, 100, &bytes(100, 1), ACK, None),
        bad,
        seg(1, 300, &bytes(100, 3), ACK, None),
    ];
    let (out, lro) = run(&frames, LroConfig::default(), 64);
    assert_eq!(lro.stats.passed.get(Pass::BadChecksum), 1);
    assert_eq!(out.alone, 1);
    assert_eq!(
        out.aggregates,
        vec![(2, Flush::Unmergeable), (1, Flush::Poll)]
    );
    same_per_flow(&out.segs, &per_flow(&frames));
}

#[test]
fn a_corrupt_ipv4_header_checksum_is_never_merged_even_with_the_tcp_checksum_verified() {
    // The aggregate's IPv4 header is rewritten with a fresh checksum: a bad one must be
    // caught before, not laundered.
    let mut bad = seg(1, 100, &bytes(100, 1), ACK, None);
    bad[24] ^= 0x5a;
    let frames = [
        seg(1, 0, &bytes(100, 0), ACK, None),
        bad,
        seg(1, 200, &bytes(100, 2), ACK, None),
    ];
    let mut lro: Lro<usize> = Lro::new(LroConfig::default());
    let mut alone = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        lro.receive(i, f, true, 0, &mut |d| {
            if let Delivery::Alone(k) = d {
                alone.push(k);
            }
        });
    }
    lro.flush_all(Flush::Poll, &mut |_| {});
    assert_eq!(alone, vec![1]);
    assert_eq!(lro.stats.passed.get(Pass::BadChecksum), 1);
    assert_eq!(lro.stats.flushed.get(Flush::Unmergeable), 1);
}

#[test]
fn psh_ends_an_aggregate_and_syn_fin_rst_urg_never_join() {
    for (flags, joins) in [
        (ACK | PSH, true),
        (ACK | 0x01, false),
        (ACK | 0x02, false),
        (ACK | 0x04, false),
        (ACK | 0x20, false),
        (0, false),
    ] {
        let frames = vec![
            seg(1, 0, &bytes(100, 0), ACK, None),
            seg(1, 100, &bytes(100, 1), flags, None),
            seg(1, 200, &bytes(100, 2), ACK, None),
        ];
        let (out, lro) = run(&frames, LroConfig::default(), 64);
        if joins {
            assert_eq!(out.aggregates, vec![(2, Flush::Push), (1, Flush::Poll)]);
        } else {
            assert_eq!(lro.stats.passed.get(Pass::Flags), 1, "{flags:#x}");
            assert_eq!(out.aggregates[0], (1, Flush::Unmergeable));
        }
        same_per_flow(&out.segs, &per_flow(&frames));
    }
}

#[test]
fn option_changes_and_timestamps_going_back_flush_and_a_window_change_merges() {
    let frames = vec![
        seg(1, 0, &bytes(100, 0), ACK, Some((10, 1))),
        seg(1, 100, &bytes(100, 1), ACK, Some((11, 1))),
        seg(1, 200, &bytes(100, 2), ACK, Some((9, 1))), // back in time
        seg(1, 300, &bytes(100, 3), ACK, None),         // options gone
        seg(1, 400, &bytes(100, 4), ACK, Some((0, 0))), // echo of zero: alone
    ];
    let (out, lro) = run(&frames, LroConfig::default(), 64);
    assert_eq!(lro.stats.flushed.get(Flush::Options), 2);
    assert_eq!(lro.stats.passed.get(Pass::Options), 1);
    same_per_flow(&out.segs, &per_flow(&frames));
    // A new window: the aggregate carries the latest.
    let mut w = seg(1, 100, &bytes(100, 1), ACK, None);
    w[48..50].copy_from_slice(&2000u16.to_be_bytes());
    let l4 = checksum_setup(&w, w.len()).expect("test frame");
    set_pseudo(&mut w, &l4);
    fill_partial(&mut w, l4.l4, l4.csum_offset).expect("test frame");
    let frames = [seg(1, 0, &bytes(100, 0), ACK, None), w];
    let mut lro: Lro<usize> = Lro::new(LroConfig::default());
    let mut window = 0;
    for (i, f) in frames.iter().enumerate() {
        lro.receive(i, f, false, 0, &mut |_| panic!("held"));
    }
    lro.flush_all(Flush::Poll, &mut |d| {
        if let Delivery::Aggregate(a) = d {
            window = u16::from_be_bytes([a.head[48], a.head[49]]);
            assert_eq!(a.segs.count(), 2);
        }
    });
    assert_eq!(window, 2000);
}

#[test]
fn ip_fragments_and_options_pass_alone() {
    let mut frag = seg(1, 0, &bytes(100, 0), ACK, None);
    frag[20] = 0x20; // more fragments
    let mut ce = seg(1, 0, &bytes(100, 0), ACK, None);
    ce[15] |= 0x03;
    ce[24..26].copy_from_slice(&[0, 0]);
    let sum = !smoltcp::wire::checksum::data(&ce[14..34]);
    ce[24..26].copy_from_slice(&sum.to_be_bytes());
    let mut lro: Lro<usize> = Lro::new(LroConfig::default());
    let mut alone = 0;
    for (i, f) in [frag, ce].iter().enumerate() {
        lro.receive(i, f, true, 0, &mut |d| {
            assert!(matches!(d, Delivery::Alone(_)));
            alone += 1;
        });
    }
    assert_eq!(alone, 2);
    assert_eq!(lro.stats.passed.get(Pass::NotTcp), 1);
    assert_eq!(lro.stats.passed.get(Pass::EcnCe), 1);
}

/// A fragment of a flow that LRO holds (its ports unreadable to the rules) goes after
/// what is held between the same two hosts, not before it: the flow keeps its order.
/// (Found by the fuzz target.)
#[test]
fn a_fragment_of_a_held_flow_goes_after_its_aggregate() {
    let held = seg(1, 0, &bytes(1448, 0), ACK, None);
    let mut frag = seg(1, 1448, &bytes(100, 1), ACK, None);
    frag[20] = 0x20;
    frag[24..26].copy_from_slice(&[0, 0]);
    let sum = !smoltcp::wire::checksum::data(&frag[14..34]);
    frag[24..26].copy_from_slice(&sum.to_be_bytes());
    let mut lro: Lro<usize> = Lro::new(LroConfig::default());
    let mut order = Vec::new();
    for (i, f) in [held, frag].iter().enumerate() {
        lro.receive(i, f, true, 0, &mut |d| match d {
            Delivery::Alone(b) => order.push(b),
            Delivery::Aggregate(a) => order.extend(a.segs.map(|s| s.buf)),
        });
    }
    assert_eq!(order, [0, 1]);
    assert_eq!(lro.held_flows(), 0);
    assert_eq!(lro.stats.flushed.get(Flush::Unmergeable), 1);
}

#[test]
fn a_flood_of_flows_keeps_the_table_bounded() {
    let frames: Vec<_> = (0..1000u16)
        .map(|p| seg(p, 0, &bytes(100, p as u8), ACK, None))
        .collect();
    let cfg = LroConfig {
        max_flows: 8,
        max_segs: 45,
    };
    let (out, lro) = run(&frames, cfg, 10_000);
    assert_eq!(lro.stats.flushed.get(Flush::Evicted), 1000 - 8);
    assert_eq!(out.segs.len(), 1000);
}

#[test]
fn an_aggregate_stops_short_of_64_kib_and_of_its_segment_bound() {
    let frames: Vec<_> = (0..100u32)
        .map(|i| seg(1, i * 1448, &bytes(1448, i as u8), ACK, None))
        .collect();
    let big = LroConfig {
        max_flows: 4,
        max_segs: 1000,
    };
    let (out, _) = run(&frames, big, 1000);
    assert!(out.aggregates.iter().all(|a| a.0 * 1448 + 54 <= 65536));
    assert!(out.aggregates.iter().any(|a| a.1 == Flush::Full));
    let (out, _) = run(
        &frames,
        LroConfig {
            max_flows: 4,
            max_segs: 8,
        },
        1000,
    );
    assert!(out.aggregates.iter().all(|a| a.0 <= 8));
}

#[test]
fn differential_any_sequence_gives_each_flow_its_segments_as_they_came() {
    let mut x = 0x9e37_79b9_u64;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for round in 0..200 {
        let mut next = [0u32; 3];
        let mut frames = Vec::new();
        for _ in 0..60 {
            let f = rnd(3) as usize;
            let len = [1448, 1448, 1448, 700, 1][rnd(5) as usize];
            let seq = match rnd(10) {
                0 => next[f].wrapping_sub(len as u32), // duplicate-ish
                1 => next[f].wrapping_add(1448),       // a gap
                _ => next[f],
            };
            let flags = match rnd(20) {
                0 => ACK | PSH,
                1 => ACK | 0x01,
                _ => ACK,
            };
            let ts = (rnd(4) == 0).then(|| (rnd(100) as u32, 1));
            let mut s = seg(f as u16 + 1, seq, &bytes(len, rnd(256) as u8), flags, ts);
            if rnd(50) == 0 {
                let n = s.len();
                s[n - 1] ^= 1;
            }
            next[f] = seq.wrapping_add(len as u32);
            frames.push(s);
        }
        let poll = 1 + rnd(16) as usize;
        let (out, _) = run(
            &frames,
            LroConfig {
                max_flows: 2,
                max_segs: 8,
            },
            poll,
        );
        assert_eq!(out.segs.len(), frames.len(), "round {round}");
        same_per_flow(&out.segs, &per_flow(&frames));
    }
}
