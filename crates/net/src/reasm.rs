//! IPv4 reassembly with bounded memory and no copying.
//!
//! As Linux's `ip_defrag`, the fragments are not copied: each context keeps the items
//! (packet buffers, in the stack) that carry its fragments, and hands them over in
//! offset order when the datagram completes, to be linked into one buffer's fragment
//! list. A fixed number of contexts, each with room for [`MAX_PIECES`] fragments and a
//! bitmap of the 8-byte units received, is allocated at creation: a hostile sender can
//! make pvio drop datagrams, never grow its memory. Fragments that overlap (the
//! teardrop family), run past 65535 bytes, break the 8-byte unit rule, disagree about
//! where the datagram ends, or are too many drop the whole datagram, and every item it
//! held is given back through `release`; datagrams that never complete expire; when
//! every context is busy the oldest is evicted. Each outcome has a counter. Time is an
//! input (`now`), so tests are deterministic.

use hv::counters::PerReason;
use std::time::Duration;

use smoltcp::wire::{IpProtocol, Ipv4Address};

use crate::wire::{Ipv4Header, IPV4_HEADER};

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
    /// More fragments than a context holds.
    #[error("too many fragments")]
    TooManyFragments,
    /// A fragment with no payload: it fills nothing, so the overlap check cannot see
    /// it, and it would sit among the datagram's pieces at an offset already covered
    /// (found by the reassembly fuzz target). Linux discards such fragments too.
    #[error("empty fragment")]
    Empty,
}

impl ReasmDrop {
    /// Every reason, in counter order.
    pub const ALL: [ReasmDrop; 8] = [
        ReasmDrop::OutOfRange,
        ReasmDrop::Misaligned,
        ReasmDrop::Overlap,
        ReasmDrop::ConflictingEnd,
        ReasmDrop::Timeout,
        ReasmDrop::Evicted,
        ReasmDrop::TooManyFragments,
        ReasmDrop::Empty,
    ];
}

hv::reason!(ReasmDrop);

/// Counters. `datagrams` counts completed reassemblies (and whole datagrams passed
/// through); `drops` counts dropped datagrams per reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasmStats {
    /// Fragments offered.
    pub fragments: u64,
    /// Datagrams delivered.
    pub datagrams: u64,
    /// Datagrams dropped, per [`ReasmDrop`].
    pub drops: PerReason<ReasmDrop>,
}

hv::counter_set!(ReasmStats {
    fragments,
    datagrams,
    drops
});

impl ReasmStats {
    /// Drops for one reason.
    pub fn drop_count(&self, r: ReasmDrop) -> u64 {
        self.drops.get(r)
    }
}

/// Fragments one context holds: a 65535-byte datagram in full-size Ethernet frames takes
/// 45, so 64 leaves room for smaller MTUs down to ~1000 bytes.
pub const MAX_PIECES: usize = 64;

/// What reassembly needs to know of a fragment (its IPv4 header, validated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragInfo {
    /// Source address.
    pub src: Ipv4Address,
    /// Destination address.
    pub dst: Ipv4Address,
    /// Protocol.
    pub proto: IpProtocol,
    /// Identification.
    pub ident: u16,
    /// Offset of the payload in the datagram, in bytes.
    pub offset: u16,
    /// More fragments follow.
    pub more: bool,
    /// Payload bytes.
    pub len: u16,
}

impl FragInfo {
    /// Why a fragment is refused whatever its datagram holds: it reaches past the
    /// largest datagram, carries nothing, or is not the last and not a multiple of 8
    /// bytes long.
    #[inline]
    fn refused(&self) -> Option<ReasmDrop> {
        let len = self.len as usize;
        if self.offset as usize + len > MAX_DATAGRAM {
            Some(ReasmDrop::OutOfRange)
        } else if len == 0 {
            Some(ReasmDrop::Empty)
        } else if self.more && !len.is_multiple_of(8) {
            Some(ReasmDrop::Misaligned)
        } else {
            None
        }
    }

    /// Whether this is a whole datagram.
    pub fn is_whole(&self) -> bool {
        self.offset == 0 && !self.more
    }
}

impl From<&Ipv4Header> for FragInfo {
    fn from(f: &Ipv4Header) -> Self {
        Self {
            src: f.src,
            dst: f.dst,
            proto: f.proto,
            ident: f.ident,
            offset: f.offset,
            more: f.more,
            len: f.payload_len() as u16,
        }
    }
}

/// One fragment held: where its payload goes in the datagram, and its item.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Piece<T> {
    /// Offset in the datagram.
    pub offset: u16,
    /// Payload bytes.
    pub len: u16,
    /// What carries it.
    pub item: T,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    src: Ipv4Address,
    dst: Ipv4Address,
    ident: u16,
    proto: IpProtocol,
}

#[derive(Debug)]
struct Context<T> {
    key: Option<Key>,
    pieces: Box<[Piece<T>]>,
    nr: usize,
    have: Box<[u64]>,
    received: usize,
    /// Highest byte offset received so far.
    max_end: usize,
    /// The datagram's length, once the final fragment arrived.
    end: Option<usize>,
    started: Duration,
}

impl<T: Copy + Default> Context<T> {
    /// Why this datagram refuses fragment `f`: it overlaps bytes already here, its end
    /// contradicts the datagram's (a last fragment's, or one past it), or the datagram
    /// has as many pieces as it may.
    #[inline]
    fn refuses(&self, f: &FragInfo) -> Option<ReasmDrop> {
        let (off, end_of) = (f.offset as usize, f.offset as usize + f.len as usize);
        let conflicting_end = if f.more {
            self.end.is_some_and(|e| end_of > e)
        } else {
            self.end.is_some_and(|e| e != end_of) || self.max_end > end_of
        };
        if self.any_set(off / 8, end_of.div_ceil(8)) {
            Some(ReasmDrop::Overlap)
        } else if conflicting_end {
            Some(ReasmDrop::ConflictingEnd)
        } else if self.nr == MAX_PIECES {
            Some(ReasmDrop::TooManyFragments)
        } else {
            None
        }
    }

    /// Takes fragment `f`'s piece in, keeping the pieces in offset order (insertion; a
    /// handful, usually in order), and notes the bytes it covers and, for the last
    /// fragment, the datagram's end.
    #[inline]
    fn insert(&mut self, f: &FragInfo, piece: Piece<T>) {
        let (off, len) = (f.offset as usize, f.len as usize);
        let end_of = off + len;
        let mut at = self.nr;
        while at > 0 && self.pieces[at - 1].offset > f.offset {
            self.pieces[at] = self.pieces[at - 1];
            at -= 1;
        }
        self.pieces[at] = piece;
        self.nr += 1;
        self.set(off / 8, end_of.div_ceil(8));
        self.received += len;
        self.max_end = self.max_end.max(end_of);
        if !f.more {
            self.end = Some(end_of);
        }
    }

    fn new() -> Self {
        Self {
            key: None,
            pieces: vec![Piece::default(); MAX_PIECES].into_boxed_slice(),
            nr: 0,
            have: vec![0; UNITS.div_ceil(64)].into_boxed_slice(),
            received: 0,
            max_end: 0,
            end: None,
            started: Duration::ZERO,
        }
    }
    /// Empties the context, giving back every item it held.
    fn reset(&mut self, release: &mut impl FnMut(T)) {
        for p in &self.pieces[..self.nr] {
            release(p.item);
        }
        self.nr = 0;
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

/// The reassembler of one receiver, holding items of type `T`.
#[derive(Debug)]
pub struct Reassembler<T> {
    contexts: Box<[Context<T>]>,
    timeout: Duration,
    stats: ReasmStats,
}

impl<T: Copy + Default> Reassembler<T> {
    /// `contexts` datagrams at a time, each waiting at most `timeout`. Allocates every
    /// context once.
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

    /// When the oldest datagram in progress times out (for the kernel's timer), if any.
    pub fn next_expiry(&self) -> Option<Duration> {
        self.contexts
            .iter()
            .filter(|c| c.key.is_some())
            .map(|c| c.started + self.timeout)
            .min()
    }

    /// Drops the datagrams older than the timeout, giving back their items. Returns how
    /// many datagrams.
    pub fn expire(&mut self, now: Duration, release: &mut impl FnMut(T)) -> usize {
        let mut n = 0;
        for c in self.contexts.iter_mut() {
            if c.key.is_some() && now.saturating_sub(c.started) >= self.timeout {
                c.reset(release);
                n += 1;
            }
        }
        self.stats.drops.add_n(ReasmDrop::Timeout, n as u64);
        n
    }

    /// Drops everything held (an interface going down), giving back the items.
    pub fn clear(&mut self, release: &mut impl FnMut(T)) {
        for c in self.contexts.iter_mut() {
            c.reset(release);
        }
    }

    fn drop_datagram(
        &mut self,
        i: Option<usize>,
        why: ReasmDrop,
        release: &mut impl FnMut(T),
    ) -> ReasmDrop {
        if let Some(i) = i {
            self.contexts[i].reset(release);
        }
        self.stats.drops.add(why);
        why
    }

    /// A context for a new datagram `key`: a free one, or, all busy, the oldest, its
    /// datagram dropped (counted as evicted).
    fn open_context(&mut self, key: Key, now: Duration, release: &mut impl FnMut(T)) -> usize {
        let i = match self.contexts.iter().position(|c| c.key.is_none()) {
            Some(i) => i,
            None => {
                let oldest = (0..self.contexts.len())
                    .min_by_key(|&j| self.contexts[j].started)
                    .unwrap_or(0);
                self.drop_datagram(Some(oldest), ReasmDrop::Evicted, release);
                oldest
            }
        };
        let c = &mut self.contexts[i];
        c.key = Some(key);
        c.started = now;
        i
    }

    /// Offers one fragment (or a whole datagram) carried by `item`. When it completes a
    /// datagram, calls `deliver` with the datagram's pieces in offset order (their
    /// items now belong to the caller) and returns `Ok(true)`; `Ok(false)` means it was
    /// kept; an error means its datagram was dropped (and counted) and every item of it,
    /// `item` included, was given to `release`.
    pub fn push(
        &mut self,
        now: Duration,
        f: &FragInfo,
        item: T,
        deliver: impl FnOnce(&[Piece<T>]),
        release: &mut impl FnMut(T),
    ) -> Result<bool, ReasmDrop> {
        self.stats.fragments += 1;
        self.expire(now, release);
        let piece = Piece {
            offset: f.offset,
            len: f.len,
            item,
        };
        if f.is_whole() {
            self.stats.datagrams += 1;
            deliver(&[piece]);
            return Ok(true);
        }
        let key = Key {
            src: f.src,
            dst: f.dst,
            ident: f.ident,
            proto: f.proto,
        };
        let found = self.contexts.iter().position(|c| c.key == Some(key));
        if let Some(why) = f.refused() {
            release(item);
            return Err(self.drop_datagram(found, why, release));
        }
        let i = match found {
            Some(i) => i,
            None => self.open_context(key, now, release),
        };
        if let Some(why) = self.contexts[i].refuses(f) {
            release(item);
            return Err(self.drop_datagram(Some(i), why, release));
        }
        let c = &mut self.contexts[i];
        c.insert(f, piece);
        match c.end {
            Some(e) if c.received == e => {
                deliver(&c.pieces[..c.nr]);
                // The items went to the caller.
                c.nr = 0;
                c.reset(&mut |_| {});
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

    fn frag(ident: u16, offset: u16, more: bool, len: u16) -> FragInfo {
        FragInfo {
            src: flow().src_ip,
            dst: flow().dst_ip,
            proto: IpProtocol::Udp,
            ident,
            offset,
            more,
            len,
        }
    }

    /// Rebuilds a datagram from its pieces, each item an index into `frames`.
    fn join(frames: &[Vec<u8>], pieces: &[Piece<usize>]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in pieces {
            let (_, payload) = parse_ipv4(&frames[p.item]).expect("valid");
            assert_eq!(p.offset as usize, out.len(), "pieces come in offset order");
            out.extend_from_slice(payload);
        }
        out
    }

    fn push_frames(
        r: &mut Reassembler<usize>,
        frames: &[Vec<u8>],
        order: &[usize],
        got: &mut Vec<Vec<u8>>,
    ) {
        for &i in order {
            let (p, _) = parse_ipv4(&frames[i]).expect("valid frame");
            r.push(
                Duration::ZERO,
                &FragInfo::from(&p),
                i,
                |d| got.push(join(frames, d)),
                &mut |_| panic!("nothing is dropped"),
            )
            .expect("accepted");
        }
    }

    #[test]
    fn an_empty_fragment_is_dropped_with_its_datagram_not_delivered_among_the_pieces() {
        // Found by the reassembly fuzz target: a zero-length fragment at an offset
        // already received passed the overlap check (it fills no unit) and was
        // delivered between the datagram's pieces, breaking their contiguity.
        let mut r: Reassembler<u32> = Reassembler::new(2, DEFAULT_TIMEOUT);
        let frag = |offset, more, len| FragInfo {
            src: Ipv4Address::new(10, 0, 0, 1),
            dst: Ipv4Address::new(10, 0, 0, 2),
            proto: IpProtocol::Udp,
            ident: 1,
            offset,
            more,
            len,
        };
        let mut released = Vec::new();
        let mut rel = |x| released.push(x);
        let none = |_: &[Piece<u32>]| panic!("nothing completes");
        assert_eq!(
            r.push(Duration::ZERO, &frag(0, true, 8), 1, none, &mut rel),
            Ok(false)
        );
        assert_eq!(
            r.push(Duration::ZERO, &frag(0, true, 0), 2, none, &mut rel),
            Err(ReasmDrop::Empty)
        );
        released.sort_unstable();
        assert_eq!(released, [1, 2], "the datagram's items are given back");
        assert_eq!(
            (r.in_progress(), r.stats().drop_count(ReasmDrop::Empty)),
            (0, 1)
        );
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
            let mut r = Reassembler::new(DEFAULT_CONTEXTS, DEFAULT_TIMEOUT);
            let mut got = Vec::new();
            push_frames(&mut r, &fr, &order, &mut got);
            assert_eq!(got.len(), 1);
            let (_, payload) =
                parse_udp(flow().src_ip, flow().dst_ip, &got[0]).expect("checksum holds");
            assert_eq!(payload, &message(48000, 5)[..]);
            assert_eq!((r.stats().datagrams, r.in_progress()), (1, 0));
        }
    }

    #[test]
    fn interleaved_datagrams_do_not_mix() {
        let (a, b) = (frames_of(3000, 1), frames_of(3000, 2));
        let all: Vec<Vec<u8>> = a.iter().chain(b.iter()).cloned().collect();
        let order: Vec<usize> = (0..a.len()).flat_map(|i| [i, a.len() + i]).collect();
        let mut r = Reassembler::new(2, DEFAULT_TIMEOUT);
        let mut got = Vec::new();
        push_frames(&mut r, &all, &order, &mut got);
        assert_eq!(got.len(), 2);
        assert_eq!(&got[0][UDP_HEADER..], &message(3000, 1)[..]);
        assert_eq!(&got[1][UDP_HEADER..], &message(3000, 2)[..]);
    }

    #[test]
    fn hostile_fragments_drop_their_datagram_and_every_item_comes_back() {
        let mut r = Reassembler::new(4, DEFAULT_TIMEOUT);
        let t = Duration::ZERO;
        let mut released = Vec::new();
        let mut next = 0usize;
        let mut push = |r: &mut Reassembler<usize>, f: FragInfo| {
            next += 1;
            r.push(t, &f, next, |_| panic!("never completes"), &mut |i| {
                released.push(i)
            })
        };
        // Overlap (teardrop): second fragment starts inside the first.
        assert_eq!(push(&mut r, frag(1, 0, true, 64)), Ok(false));
        assert_eq!(
            push(&mut r, frag(1, 32, false, 64)),
            Err(ReasmDrop::Overlap)
        );
        assert_eq!(r.in_progress(), 0, "the whole datagram is gone");
        // A duplicate is an overlap too.
        push(&mut r, frag(2, 0, true, 64)).expect("first");
        assert_eq!(push(&mut r, frag(2, 0, true, 64)), Err(ReasmDrop::Overlap));
        // Beyond 65535 bytes.
        assert_eq!(
            push(&mut r, frag(3, 65512, false, 64)),
            Err(ReasmDrop::OutOfRange)
        );
        // Non-final fragment not a multiple of 8.
        assert_eq!(
            push(&mut r, frag(4, 0, true, 13)),
            Err(ReasmDrop::Misaligned)
        );
        // Two different ends, and data past a known end.
        push(&mut r, frag(5, 64, false, 64)).expect("last first");
        assert_eq!(
            push(&mut r, frag(5, 256, false, 64)),
            Err(ReasmDrop::ConflictingEnd)
        );
        push(&mut r, frag(6, 8, false, 8)).expect("end at 16");
        assert_eq!(
            push(&mut r, frag(6, 64, true, 64)),
            Err(ReasmDrop::ConflictingEnd)
        );
        // More pieces than a context holds.
        for k in 0..MAX_PIECES as u16 {
            push(&mut r, frag(7, k * 8, true, 8)).expect("room");
        }
        assert_eq!(
            push(&mut r, frag(7, MAX_PIECES as u16 * 8, true, 8)),
            Err(ReasmDrop::TooManyFragments)
        );
        let s = r.stats().clone();
        for (why, n) in [
            (ReasmDrop::Overlap, 2),
            (ReasmDrop::OutOfRange, 1),
            (ReasmDrop::Misaligned, 1),
            (ReasmDrop::ConflictingEnd, 2),
            (ReasmDrop::TooManyFragments, 1),
        ] {
            assert_eq!(s.drop_count(why), n, "{why:?}");
        }
        assert_eq!(s.datagrams, 0);
        assert_eq!(r.in_progress(), 0);
        // Every item offered came back exactly once: nothing leaks, nothing is freed twice.
        released.sort_unstable();
        assert_eq!(released, (1..=next).collect::<Vec<_>>());
    }

    #[test]
    fn never_completed_datagrams_expire_and_memory_stays_bounded() {
        let mut r = Reassembler::new(2, Duration::from_secs(30));
        let mut freed = 0;
        let mut rel = |_: u32| freed += 1;
        let s = Duration::from_secs;
        r.push(s(0), &frag(1, 0, true, 8), 1, |_| {}, &mut rel)
            .expect("kept");
        r.push(s(1), &frag(2, 0, true, 8), 2, |_| {}, &mut rel)
            .expect("kept");
        // A third datagram while both contexts are busy evicts the oldest.
        r.push(s(2), &frag(3, 0, true, 8), 3, |_| {}, &mut rel)
            .expect("kept");
        assert_eq!(r.stats().drop_count(ReasmDrop::Evicted), 1);
        assert_eq!(r.in_progress(), 2);
        // Thirty seconds later both remaining ones time out.
        assert_eq!(r.expire(s(40), &mut rel), 2);
        assert_eq!(r.stats().drop_count(ReasmDrop::Timeout), 2);
        assert_eq!(r.in_progress(), 0);
        // A flood of never-completing datagrams never needs more than the fixed contexts.
        for id in 0..10_000u16 {
            let _ = r.push(s(50), &frag(id, 0, true, 8), 9, |_| {}, &mut rel);
        }
        assert_eq!(r.in_progress(), 2);
        assert_eq!(r.stats().drop_count(ReasmDrop::Evicted), 1 + 9_998);
        r.clear(&mut rel);
        assert_eq!(freed, 10_003, "every item held was given back");
    }
}
