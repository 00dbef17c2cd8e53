//! IPv4 reassembly with bounded memory.
//!
//! A fixed number of reassembly contexts, each with one buffer for the largest IPv4
//! payload and a bitmap of the 8-byte units received, all allocated at creation: a
//! hostile sender can make pvio drop datagrams, never grow its memory. Fragments that
//! overlap (the teardrop family), run past 65535 bytes, break the 8-byte unit rule, or
//! disagree about where the datagram ends drop the whole datagram; datagrams that never
//! complete expire; when every context is busy the oldest is evicted. Each outcome has a
//! counter. Time is an input (`now`), so tests are deterministic.

use std::time::Duration;

use smoltcp::wire::{IpProtocol, Ipv4Address};

use crate::wire::{Ipv4Fragment, IPV4_HEADER};

/// Largest IPv4 payload: a 65535-byte packet less its header.
pub const MAX_DATAGRAM: usize = 65535 - IPV4_HEADER;
/// Contexts in use at once by default.
pub const DEFAULT_CONTEXTS: usize = 8;
/// How long an incomplete datagram waits (Linux's `ipfrag_time` default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
const UNITS: usize = MAX_DATAGRAM.div_ceil(8);

/// Why fragments (and their datagram) were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum ReasmDrop {
    /// Offset plus length beyond the largest datagram.
    #[error("fragment beyond 65535 bytes")]
    OutOfRange,
    /// A non-final fragment whose length is not a multiple of 8.
    #[error("non-final fragment not a multiple of 8 bytes")]
    Misaligned,
    /// A fragment overlapping bytes already received.
    #[error("overlapping fragment")]
    Overlap,
    /// Fragments disagree about the datagram's end.
    #[error("conflicting datagram end")]
    ConflictingEnd,
    /// The datagram did not complete in time.
    #[error("reassembly timed out")]
    Timeout,
    /// Its context was taken for a newer datagram.
    #[error("evicted for a newer datagram")]
    Evicted,
}

impl ReasmDrop {
    /// Every reason, in counter order.
    pub const ALL: [ReasmDrop; 6] = [
        ReasmDrop::OutOfRange,
        ReasmDrop::Misaligned,
        ReasmDrop::Overlap,
        ReasmDrop::ConflictingEnd,
        ReasmDrop::Timeout,
        ReasmDrop::Evicted,
    ];
}

/// Counters. `datagrams` counts completed reassemblies (and whole datagrams passed
/// through); `drops` counts dropped datagrams per reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasmStats {
    /// Fragments offered.
    pub fragments: u64,
    /// Datagrams delivered.
    pub datagrams: u64,
    /// Datagrams dropped, per [`ReasmDrop`] (in `ReasmDrop::ALL` order).
    pub drops: [u64; 6],
}

impl ReasmStats {
    /// Drops for one reason.
    pub fn drop_count(&self, r: ReasmDrop) -> u64 {
        self.drops[r as usize]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    src: Ipv4Address,
    dst: Ipv4Address,
    ident: u16,
    proto: IpProtocol,
}

#[derive(Debug)]
struct Context {
    key: Option<Key>,
    buf: Box<[u8]>,
    have: Box<[u64]>,
    received: usize,
    /// Highest byte offset received so far.
    max_end: usize,
    /// The datagram's length, once the final fragment arrived.
    end: Option<usize>,
    started: Duration,
}

impl Context {
    fn new() -> Self {
        Self {
            key: None,
            buf: vec![0; MAX_DATAGRAM].into_boxed_slice(),
            have: vec![0; UNITS.div_ceil(64)].into_boxed_slice(),
            received: 0,
            max_end: 0,
            end: None,
            started: Duration::ZERO,
        }
    }
    fn reset(&mut self) {
        self.key = None;
        self.have.iter_mut().for_each(|w| *w = 0);
        self.received = 0;
        self.max_end = 0;
        self.end = None;
    }
    fn any_set(&self, from: usize, to: usize) -> bool {
        (from..to).any(|u| self.have[u / 64] & (1 << (u % 64)) != 0)
    }
    fn set(&mut self, from: usize, to: usize) {
        for u in from..to {
            self.have[u / 64] |= 1 << (u % 64);
        }
    }
}

/// The reassembler of one receiver.
#[derive(Debug)]
pub struct Reassembler {
    contexts: Box<[Context]>,
    timeout: Duration,
    stats: ReasmStats,
}

impl Reassembler {
    /// `contexts` datagrams at a time, each waiting at most `timeout`. Allocates
    /// `contexts` × 64 KiB once.
    pub fn new(contexts: usize, timeout: Duration) -> Self {
        Self {
            contexts: (0..contexts.max(1)).map(|_| Context::new()).collect(),
            timeout,
            stats: ReasmStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> &ReasmStats {
        &self.stats
    }

    /// Datagrams being reassembled.
    pub fn in_progress(&self) -> usize {
        self.contexts.iter().filter(|c| c.key.is_some()).count()
    }

    /// Drops the datagrams older than the timeout. Returns how many.
    pub fn expire(&mut self, now: Duration) -> usize {
        let mut n = 0;
        for c in self.contexts.iter_mut() {
            if c.key.is_some() && now.saturating_sub(c.started) >= self.timeout {
                c.reset();
                n += 1;
            }
        }
        self.stats.drops[ReasmDrop::Timeout as usize] += n as u64;
        n
    }

    fn drop_datagram(&mut self, i: Option<usize>, why: ReasmDrop) -> ReasmDrop {
        if let Some(i) = i {
            self.contexts[i].reset();
        }
        self.stats.drops[why as usize] += 1;
        why
    }

    /// Offers one fragment (or a whole datagram). When it completes a datagram, calls
    /// `deliver` with the datagram's payload and returns `Ok(true)`; `Ok(false)` means
    /// it was kept for later; an error means its datagram was dropped (and counted).
    pub fn push(
        &mut self,
        now: Duration,
        f: &Ipv4Fragment<'_>,
        deliver: impl FnOnce(&[u8]),
    ) -> Result<bool, ReasmDrop> {
        self.stats.fragments += 1;
        self.expire(now);
        if f.is_whole() {
            self.stats.datagrams += 1;
            deliver(f.payload);
            return Ok(true);
        }
        let key = Key {
            src: f.src,
            dst: f.dst,
            ident: f.ident,
            proto: f.proto,
        };
        let found = self.contexts.iter().position(|c| c.key == Some(key));
        let (off, len) = (f.offset as usize, f.payload.len());
        let end_of = off + len;
        if end_of > MAX_DATAGRAM {
            return Err(self.drop_datagram(found, ReasmDrop::OutOfRange));
        }
        if f.more && len % 8 != 0 {
            return Err(self.drop_datagram(found, ReasmDrop::Misaligned));
        }
        let i = match found {
            Some(i) => i,
            None => {
                let i = match self.contexts.iter().position(|c| c.key.is_none()) {
                    Some(i) => i,
                    None => {
                        // All busy: evict the oldest.
                        let oldest = (0..self.contexts.len())
                            .min_by_key(|&j| self.contexts[j].started)
                            .unwrap_or(0);
                        self.drop_datagram(Some(oldest), ReasmDrop::Evicted);
                        oldest
                    }
                };
                let c = &mut self.contexts[i];
                c.key = Some(key);
                c.started = now;
                i
            }
        };
        let c = &self.contexts[i];
        let (u0, u1) = (off / 8, end_of.div_ceil(8));
        if c.any_set(u0, u1) {
            return Err(self.drop_datagram(Some(i), ReasmDrop::Overlap));
        }
        let conflict = if f.more {
            c.end.is_some_and(|e| end_of > e)
        } else {
            c.end.is_some_and(|e| e != end_of) || c.max_end > end_of
        };
        if conflict {
            return Err(self.drop_datagram(Some(i), ReasmDrop::ConflictingEnd));
        }
        let c = &mut self.contexts[i];
        c.buf[off..end_of].copy_from_slice(f.payload);
        c.set(u0, u1);
        c.received += len;
        c.max_end = c.max_end.max(end_of);
        if !f.more {
            c.end = Some(end_of);
        }
        match c.end {
            Some(e) if c.received == e => {
                deliver(&c.buf[..e]);
                c.reset();
                self.stats.datagrams += 1;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::tests::{flow, frames_of, message};
    use crate::wire::{parse_ipv4, parse_udp, UDP_HEADER};

    fn frag<'a>(ident: u16, offset: u16, more: bool, payload: &'a [u8]) -> Ipv4Fragment<'a> {
        Ipv4Fragment {
            src_mac: [0; 6],
            src: flow().src_ip,
            dst: flow().dst_ip,
            proto: IpProtocol::Udp,
            ident,
            offset,
            more,
            payload,
        }
    }

    fn reassemble(frames: &[Vec<u8>], order: &[usize]) -> (Option<Vec<u8>>, Reassembler) {
        let mut r = Reassembler::new(DEFAULT_CONTEXTS, DEFAULT_TIMEOUT);
        let mut out = None;
        for &i in order {
            let p = parse_ipv4(&frames[i]).expect("valid frame");
            r.push(Duration::ZERO, &p, |d| out = Some(d.to_vec()))
                .expect("accepted");
        }
        (out, r)
    }

    #[test]
    fn a_48000_byte_message_reassembles_in_any_order() {
        let fr = frames_of(48000, 5);
        let n = fr.len();
        for order in [
            (0..n).collect::<Vec<_>>(),
            (0..n).rev().collect(),
            (0..n).map(|i| (i * 7) % n).collect(),
        ] {
            let (d, r) = reassemble(&fr, &order);
            let d = d.expect("complete");
            let udp = parse_udp(flow().src_ip, flow().dst_ip, &d).expect("checksum holds");
            assert_eq!(udp.payload, &message(48000, 5)[..]);
            assert_eq!((r.stats().datagrams, r.in_progress()), (1, 0));
        }
    }

    #[test]
    fn interleaved_datagrams_do_not_mix() {
        let (a, b) = (frames_of(3000, 1), frames_of(3000, 2));
        let mut r = Reassembler::new(2, DEFAULT_TIMEOUT);
        let mut got = Vec::new();
        for i in 0..a.len() {
            for fr in [&a[i], &b[i]] {
                let p = parse_ipv4(fr).expect("valid");
                r.push(Duration::ZERO, &p, |d| got.push(d.to_vec()))
                    .expect("ok");
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(&got[0][UDP_HEADER..], &message(3000, 1)[..]);
        assert_eq!(&got[1][UDP_HEADER..], &message(3000, 2)[..]);
    }

    #[test]
    fn hostile_fragments_drop_their_datagram_and_are_counted() {
        let mut r = Reassembler::new(4, DEFAULT_TIMEOUT);
        let t = Duration::ZERO;
        let data = [7u8; 64];
        // Overlap (teardrop): second fragment starts inside the first.
        assert_eq!(r.push(t, &frag(1, 0, true, &data), |_| {}), Ok(false));
        assert_eq!(
            r.push(t, &frag(1, 32, false, &data), |_| {}),
            Err(ReasmDrop::Overlap)
        );
        assert_eq!(r.in_progress(), 0, "the whole datagram is gone");
        // A duplicate is an overlap too.
        r.push(t, &frag(2, 0, true, &data), |_| {}).expect("first");
        assert_eq!(
            r.push(t, &frag(2, 0, true, &data), |_| {}),
            Err(ReasmDrop::Overlap)
        );
        // Beyond 65535 bytes.
        assert_eq!(
            r.push(t, &frag(3, 65512, false, &data), |_| {}),
            Err(ReasmDrop::OutOfRange)
        );
        // Non-final fragment not a multiple of 8.
        assert_eq!(
            r.push(t, &frag(4, 0, true, &data[..13]), |_| {}),
            Err(ReasmDrop::Misaligned)
        );
        // Two different ends, and data past a known end.
        r.push(t, &frag(5, 64, false, &data), |_| {})
            .expect("last first");
        assert_eq!(
            r.push(t, &frag(5, 256, false, &data), |_| {}),
            Err(ReasmDrop::ConflictingEnd)
        );
        r.push(t, &frag(6, 0, false, &data[..8]).with_offset(8), |_| {})
            .expect("end at 16");
        assert_eq!(
            r.push(t, &frag(6, 64, true, &data), |_| {}),
            Err(ReasmDrop::ConflictingEnd)
        );
        let s = r.stats();
        for (why, n) in [
            (ReasmDrop::Overlap, 2),
            (ReasmDrop::OutOfRange, 1),
            (ReasmDrop::Misaligned, 1),
            (ReasmDrop::ConflictingEnd, 2),
        ] {
            assert_eq!(s.drop_count(why), n, "{why:?}");
        }
        assert_eq!(s.datagrams, 0);
        assert_eq!(r.in_progress(), 0);
    }

    #[test]
    fn never_completed_datagrams_expire_and_memory_stays_bounded() {
        let mut r = Reassembler::new(2, Duration::from_secs(30));
        let data = [1u8; 8];
        r.push(Duration::from_secs(0), &frag(1, 0, true, &data), |_| {})
            .expect("kept");
        r.push(Duration::from_secs(1), &frag(2, 0, true, &data), |_| {})
            .expect("kept");
        // A third datagram while both contexts are busy evicts the oldest.
        r.push(Duration::from_secs(2), &frag(3, 0, true, &data), |_| {})
            .expect("kept");
        assert_eq!(r.stats().drop_count(ReasmDrop::Evicted), 1);
        assert_eq!(r.in_progress(), 2);
        // Thirty seconds later both remaining ones time out.
        assert_eq!(r.expire(Duration::from_secs(40)), 2);
        assert_eq!(r.stats().drop_count(ReasmDrop::Timeout), 2);
        assert_eq!(r.in_progress(), 0);
        // A flood of never-completing datagrams never needs more than the fixed contexts.
        for id in 0..10_000u16 {
            let _ = r.push(Duration::from_secs(50), &frag(id, 0, true, &data), |_| {});
        }
        assert_eq!(r.in_progress(), 2);
        assert_eq!(r.stats().drop_count(ReasmDrop::Evicted), 1 + 9_998);
    }

    impl<'a> Ipv4Fragment<'a> {
        fn with_offset(mut self, offset: u16) -> Self {
            self.offset = offset;
            self
        }
    }
}
