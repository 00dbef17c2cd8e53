//! IPv4 reassembly fed hostile fragments: any offsets, lengths, identifications, flags,
//! overlaps, duplicates and timings, across a few contexts.
//!
//! Oracle: every item pushed comes back exactly once, either in a delivered datagram
//! or released (dropped, expired, cleared); a delivered datagram's pieces are in offset
//! order, contiguous from 0, end with the last fragment, and fit in 65 535 bytes; after
//! a final clear nothing is held.

use std::collections::BTreeSet;
use std::time::Duration;

use net::reasm::{FragInfo, Reassembler};
use smoltcp::wire::{IpProtocol, Ipv4Address};

use crate::Input;

/// One case.
pub fn case(inp: &mut Input<'_>) {
    let contexts = 1 + inp.below(4) as usize;
    let timeout = Duration::from_millis(1 + inp.below(50));
    let mut r: Reassembler<u32> = Reassembler::new(contexts, timeout);
    let mut live = BTreeSet::new();
    let mut next = 1u32;
    let mut now = Duration::ZERO;
    let gone = |live: &mut BTreeSet<u32>, id: u32| {
        assert!(
            live.remove(&id),
            "item {id} given back twice or never pushed"
        );
    };
    let ops = 1 + inp.below(96);
    for _ in 0..ops {
        if inp.exhausted() {
            break;
        }
        if inp.below(8) == 0 {
            now += Duration::from_millis(inp.below(60));
            r.expire(now, &mut |id| gone(&mut live, id));
            continue;
        }
        let len = inp.pick(&[0u16, 1, 7, 8, 1480, 1481, 4000, 65535]);
        let offset = if inp.coin() {
            (inp.below(46) * 1480) as u16
        } else {
            (inp.below(8192) * 8) as u16
        };
        let f = FragInfo {
            src: Ipv4Address::new(10, 0, 0, inp.pick(&[1, 2])),
            dst: Ipv4Address::new(10, 0, 0, 9),
            proto: inp.pick(&[IpProtocol::Udp, IpProtocol::Tcp]),
            ident: inp.below(3) as u16,
            offset,
            more: inp.coin(),
            len,
        };
        let id = next;
        next += 1;
        live.insert(id);
        let mut delivered = Vec::new();
        let _ = r.push(
            now,
            &f,
            id,
            |ps| delivered.extend_from_slice(ps),
            &mut |x| gone(&mut live, x),
        );
        if !delivered.is_empty() {
            let mut at = 0usize;
            for p in &delivered {
                assert_eq!(usize::from(p.offset), at, "pieces contiguous, in order");
                at += usize::from(p.len);
                gone(&mut live, p.item);
            }
            assert!(at <= 65535, "a datagram fits in 65 535 bytes");
        }
    }
    r.clear(&mut |id| gone(&mut live, id));
    assert!(live.is_empty(), "items never given back: {live:?}");
    assert_eq!(r.in_progress(), 0);
}
