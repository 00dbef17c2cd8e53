//! The LRO engine fed a hostile wire: any interleaving of flows; in-order, duplicate,
//! overlapping, out-of-order and wrapping sequence numbers; empty and short segments;
//! every TCP flag; timestamps that go back; window changes; spoiled checksums (reported
//! unverified, so the engine must catch them), IP fragments and ECN marks; and any
//! schedule of polls, hold-limit flushes and per-flow flush decisions.
//!
//! Oracle (the differential one): each flow's segments come out in the order they went
//! in, with the bytes they came with, each frame exactly once, as if there were no
//! LRO; cutting an aggregate at its segment size gives back exactly the segments that
//! joined it; no aggregate passes 64 KiB or its segment bound; the table never holds
//! more flows than it has room for; a segment with a bad checksum, any flag but ACK and
//! PSH, a fragment or an ECN mark never joins an aggregate; and after a last flush
//! nothing is held.

use net::lro::{Delivery, Flush, Lro, LroConfig};
use net::offload::{checksum_setup, segment_tcp};
use net::wire::TcpSegment;

use crate::Input;

const ACK: u8 = 0x10;
const PSH: u8 = 0x08;

/// What a frame was made to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Made {
    flow: u16,
    seq: u32,
    /// It must never join an aggregate.
    alone: bool,
}

/// One case.
pub fn case(inp: &mut Input<'_>) {
    let cfg = LroConfig {
        max_flows: 1 + inp.below(4) as usize,
        max_segs: inp.pick(&[2usize, 3, 8, 17, 45]),
    };
    let flows = 1 + inp.below(4) as u16;
    let mut next: Vec<u32> = (0..flows)
        .map(|_| {
            // Some flows start just short of the sequence space's end, so they wrap.
            if inp.coin() {
                u32::MAX - inp.below(5000) as u32
            } else {
                inp.u64() as u32
            }
        })
        .collect();
    let mut tsval = vec![1000u32; flows as usize];
    let mut frames: Vec<Vec<u8>> = Vec::new();
    let mut made: Vec<Made> = Vec::new();
    let n = 1 + inp.below(120) as usize;
    for _ in 0..n {
        if inp.exhausted() {
            break;
        }
        let f = inp.below(u64::from(flows)) as usize;
        let len = inp.pick(&[1448usize, 1448, 1448, 1448, 700, 1, 0]);
        let seq = match inp.below(12) {
            0 => next[f].wrapping_sub(len as u32), // a duplicate
            1 => next[f].wrapping_sub(100),        // an overlap
            2 => next[f].wrapping_add(1448),       // a gap
            _ => next[f],
        };
        let flags = match inp.below(24) {
            0 => ACK | PSH,
            1 => ACK | 0x01, // FIN
            2 => ACK | 0x04, // RST
            3 => ACK | 0x20, // URG
            4 => 0x02,       // SYN
            _ => ACK,
        };
        let ts = match inp.below(6) {
            0 => None,
            1 => Some((tsval[f].wrapping_sub(5), 1)), // going back
            _ => {
                tsval[f] = tsval[f].wrapping_add(inp.below(3) as u32);
                Some((tsval[f], 1))
            }
        };
        let window = if inp.below(10) == 0 { 2000 } else { 1000 };
        let payload: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seq as u8))
            .collect();
        let mut frame = TcpSegment {
            sport: 40000 + f as u16,
            dport: 5001,
            seq,
            ack: 7,
            flags,
            window,
            ts,
        }
        .frame(&payload);
        let mut alone = flags & !PSH != ACK;
        match inp.below(16) {
            // A payload byte spoiled: the TCP checksum no longer holds.
            0 if len > 0 => {
                let last = frame.len() - 1;
                frame[last] ^= 0x40;
                alone = true;
            }
            // A fragment (more-fragments set), its header checksum made good again.
            1 => {
                frame[20] |= 0x20;
                fix_ipv4_checksum(&mut frame);
                alone = true;
            }
            // ECN congestion experienced.
            2 => {
                frame[15] |= 0x03;
                fix_ipv4_checksum(&mut frame);
                alone = true;
            }
            _ => {}
        }
        next[f] = seq.wrapping_add(len as u32);
        made.push(Made {
            flow: f as u16,
            seq,
            alone,
        });
        frames.push(frame);
    }

    let mut lro: Lro<usize> = Lro::new(cfg);
    let mut seen = vec![false; frames.len()];
    let mut order: Vec<usize> = Vec::new();
    let mut check = |d: Delivery<'_, usize>| match d {
        Delivery::Alone(i) => {
            assert!(!seen[i], "frame {i} handed back twice");
            seen[i] = true;
            order.push(i);
        }
        Delivery::Aggregate(a) => {
            let head = a.head.to_vec();
            let gso = a.gso_size as usize;
            let segs: Vec<_> = a.segs.collect();
            assert!(!segs.is_empty() && segs.len() <= cfg.max_segs);
            let mut whole = head;
            for s in &segs {
                let i = s.buf;
                assert!(!seen[i], "frame {i} handed back twice");
                seen[i] = true;
                order.push(i);
                if segs.len() > 1 {
                    assert!(!made[i].alone, "frame {i} must not join: {:?}", made[i]);
                }
                assert_eq!(s.seq, made[i].seq);
                whole.extend_from_slice(&frames[i][s.payload.clone()]);
            }
            assert!(whole.len() - net::wire::ETH_HEADER <= 65535, "over 64 KiB");
            let l4 = checksum_setup(&whole, whole.len()).expect("aggregate headers");
            assert_eq!(l4.frame_len, whole.len(), "IPv4 length covers the whole");
            // Cut at the segment size: exactly the segments that joined.
            let mut buf = vec![0u8; 2048];
            let mut cut = Vec::new();
            segment_tcp(&whole, &l4, gso, &mut buf, |f| {
                let l = checksum_setup(f, f.len()).expect("cut segment");
                let seq = u32::from_be_bytes([f[l.l4 + 4], f[l.l4 + 5], f[l.l4 + 6], f[l.l4 + 7]]);
                cut.push((seq, f[l.headers()..].to_vec()));
            })
            .expect("re-segments");
            let arrived: Vec<_> = segs
                .iter()
                .map(|s| (s.seq, frames[s.buf][s.payload.clone()].to_vec()))
                .collect();
            assert_eq!(cut, arrived, "re-segmenting gives back what arrived");
        }
    };
    let mut now = 0u64;
    for (i, f) in frames.iter().enumerate() {
        now += inp.below(40);
        // A spoiled frame is never reported verified: the engine checks it itself.
        let valid = !made[i].alone && inp.coin();
        lro.receive(i, f, valid, now, &mut check);
        assert!(lro.held_flows() <= cfg.max_flows, "flow table overflowed");
        match inp.below(8) {
            0 => lro.flush_all(Flush::Poll, &mut check),
            1 => lro.flush_since(now.saturating_sub(inp.below(100)), &mut check),
            2 => {
                let keep = inp.coin();
                lro.flush_where(|h| (h.segs > 2) != keep, &mut check);
            }
            _ => {}
        }
    }
    lro.flush_all(Flush::Poll, &mut check);
    assert_eq!(lro.held_flows(), 0, "held after the last flush");
    assert!(seen.iter().all(|&s| s), "a frame was never handed back");
    // Per flow, the order they came in.
    for f in 0..flows {
        let out: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&i| made[i].flow == f)
            .collect();
        let came: Vec<usize> = (0..frames.len()).filter(|&i| made[i].flow == f).collect();
        assert_eq!(out, came, "flow {f} reordered");
    }
}

/// Recomputes a frame's IPv4 header checksum.
fn fix_ipv4_checksum(frame: &mut [u8]) {
    let ip = net::wire::ETH_HEADER;
    frame[ip + 10..ip + 12].copy_from_slice(&[0, 0]);
    let sum = !smoltcp::wire::checksum::data(&frame[ip..ip + net::wire::IPV4_HEADER]);
    frame[ip + 10..ip + 12].copy_from_slice(&sum.to_be_bytes());
}
