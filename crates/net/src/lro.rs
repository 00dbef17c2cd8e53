//! Large Receive Offload: the engine a NIC driver runs during its poll (paper 001,
//! issue 18).
//!
//! During one NAPI poll the driver hands each received frame to [`Lro::receive`]. A TCP
//! segment that may join its flow's aggregate is held; anything else is handed back
//! ([`Delivery::Alone`]), after the flow's held aggregate if it has one, so a flow's
//! segments always leave in the order they came. At the end of the poll (or every Nth
//! poll: the paper's delayed aggregation is the caller's choice of when to call it)
//! [`Lro::flush_all`] hands back every aggregate. The merge rules are Linux's
//! (`inet_lro`'s, which the paper ported, with GRO's segment-size rule):
//!
//! * IPv4 without options, not a fragment, not marked ECN CE; TCP with ACK and nothing
//!   else but PSH (PSH joins and ends the aggregate; SYN, FIN, RST, URG, ECE and CWR
//!   never join and flush the flow); some payload;
//! * the next byte the flow expects (anything else flushes and starts anew);
//! * options as the aggregate's first segment's, apart from a timestamp whose value does
//!   not go backwards and whose echo is not zero (a timestamp is the only option
//!   taken, laid out as Linux does, NOP, NOP, TS, or as smoltcp does, TS and padding);
//! * the IPv4 header checksum verified, and the TCP checksum (by the NIC, or here),
//!   before a segment joins;
//! * a payload no longer than the first segment's (the segment size the aggregate
//!   carries); a shorter one joins and ends the aggregate, so that cutting it at the
//!   segment size gives back exactly the segments that arrived;
//! * at most [`LroConfig::max_segs`] segments and 64 KiB; at most
//!   [`LroConfig::max_flows`] flows held (the oldest is flushed to make room).
//!
//! The engine holds the frames themselves (`B`: the driver's buffer handle) with where
//! each one's payload lies, and a copy of the first segment's headers; an aggregate is
//! handed back as those headers, patched to describe the whole (IPv4 total length and
//! header checksum, the last segment's acknowledgement, window and timestamp, PSH if it
//! had it), and the chain of segments, for whoever builds the packet (skb-mode: the
//! frames as a fragment list; page-mode: their payloads as page fragments).
//!
//! The frames are the wire's and hostile: every length is checked before it is used,
//! and a frame the engine does not understand is handed back untouched with its
//! reason counted. Nothing is allocated after [`Lro::new`].

use std::ops::Range;

use hv::counters::PerReason;
use smoltcp::wire::checksum;

use crate::offload::{checksum_setup, verify, L4, MAX_HEADERS, MAX_OFFLOAD_LEN};

/// The engine's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LroConfig {
    /// Flows held at once.
    pub max_flows: usize,
    /// Segments in one aggregate.
    pub max_segs: usize,
}

impl Default for LroConfig {
    /// Linux's `inet_lro` drivers held 8–32 flows of up to 32–64 segments; 64 KiB of
    /// 1448-byte segments is 45.
    fn default() -> Self {
        Self {
            max_flows: 32,
            max_segs: 45,
        }
    }
}

/// Why a frame was not held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Not a TCP segment over IPv4 (or its headers are truncated or malformed).
    NotTcp,
    /// IPv4 options.
    IpOptions,
    /// ECN congestion experienced.
    EcnCe,
    /// A flag other than ACK and PSH, or no ACK.
    Flags,
    /// No payload (a pure acknowledgement).
    NoPayload,
    /// TCP options other than a timestamp, or a timestamp that went backwards or echoes
    /// zero.
    Options,
    /// The IPv4 header's or the TCP checksum is wrong.
    BadChecksum,
}

impl Pass {
    /// Every reason, in counter order.
    pub const ALL: [Pass; 7] = [
        Pass::NotTcp,
        Pass::IpOptions,
        Pass::EcnCe,
        Pass::Flags,
        Pass::NoPayload,
        Pass::Options,
        Pass::BadChecksum,
    ];
}
hv::reason!(Pass);

/// Why an aggregate was handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flush {
    /// The caller's: end of a poll (or of every Nth), or the flow held too long.
    Poll,
    /// PSH ended it.
    Push,
    /// Its flow's next frame could not join (flags, options, no payload, bad checksum):
    /// it goes first.
    Unmergeable,
    /// Its flow's next segment was not the next byte.
    OutOfOrder,
    /// A segment shorter than the segment size ended it.
    Short,
    /// A segment longer than the segment size could not join.
    Longer,
    /// Another segment would pass 64 KiB or the segment bound.
    Full,
    /// Its flow's next segment had other options, or a timestamp that went back.
    Options,
    /// Its slot was taken for a new flow.
    Evicted,
}

impl Flush {
    /// Every reason, in counter order.
    pub const ALL: [Flush; 9] = [
        Flush::Poll,
        Flush::Push,
        Flush::Unmergeable,
        Flush::OutOfOrder,
        Flush::Short,
        Flush::Longer,
        Flush::Full,
        Flush::Options,
        Flush::Evicted,
    ];
}
hv::reason!(Flush);

/// The engine's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LroStats {
    /// Aggregates handed back (one segment or more).
    pub aggregates: u64,
    /// Segments in them.
    pub segments: u64,
    /// Frames handed back alone, by reason.
    pub passed: PerReason<Pass>,
    /// Aggregates handed back, by reason.
    pub flushed: PerReason<Flush>,
}

hv::counter_set!(LroStats {
    aggregates,
    segments,
    passed,
    flushed
});

impl LroStats {
    /// Mean segments per aggregate.
    pub fn segments_per_aggregate(&self) -> f64 {
        self.segments as f64 / self.aggregates.max(1) as f64
    }
}

/// One segment of an aggregate: the frame, where its payload lies, and its sequence
/// number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seg<B> {
    /// The driver's buffer.
    pub buf: B,
    /// The payload's bytes within the frame.
    pub payload: Range<usize>,
    /// Its first byte's sequence number.
    pub seq: u32,
    /// When it arrived (the caller's clock, as given to [`Lro::receive`]).
    pub at: u64,
}

/// What the engine hands back.
#[derive(Debug)]
pub enum Delivery<'a, B> {
    /// A frame as it came.
    Alone(B),
    /// An aggregate.
    Aggregate(Aggregate<'a, B>),
}

/// An aggregate handed back: valid only inside the callback; take its segments out of
/// `segs`.
#[derive(Debug)]
pub struct Aggregate<'a, B> {
    /// Ethernet, IPv4 and TCP headers describing the whole: IPv4 total length and
    /// header checksum for every segment's payload, the last segment's acknowledgement,
    /// window and timestamp, PSH if it had it. The TCP checksum field is the first
    /// segment's: every segment's was verified, and the aggregate goes up as validated.
    pub head: &'a [u8],
    /// The segment size: the first segment's payload (every one but the last has it).
    pub gso_size: u16,
    /// Payload bytes, all segments.
    pub payload_len: usize,
    /// Why it was handed back.
    pub reason: Flush,
    /// When its first segment arrived (the caller's clock, as given to
    /// [`Lro::receive`]).
    pub since: u64,
    /// Its segments, in order.
    pub segs: std::vec::Drain<'a, Seg<B>>,
}

/// One held aggregate, as a flush policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// When its first segment arrived.
    pub since: u64,
    /// When its latest did.
    pub last: u64,
    /// Segments in it.
    pub segs: usize,
}

/// A segment's fields that the rules look at, read from an untrusted frame.
#[derive(Debug, Clone, Copy)]
struct Parsed {
    key: [u8; 12],
    seq: u32,
    flags: u8,
    payload: (usize, usize),
    /// Offset of the TCP header, and its length.
    l4: usize,
    l4_len: usize,
    /// The timestamp option's offset (of its value) within the TCP header, if present.
    ts: Option<usize>,
}

const TCP_PSH: u8 = 0x08;
const TCP_ACK: u8 = 0x10;

/// Where a TCP/IPv4 frame's headers lie, and its flow; `None` for anything else (or
/// headers truncated or malformed).
fn locate(frame: &[u8], len: usize) -> Option<(L4, [u8; 12])> {
    let l4 = checksum_setup(frame, len).ok()?;
    if !l4.tcp || l4.v6 {
        return None;
    }
    let mut key = [0u8; 12];
    key[..8].copy_from_slice(&frame[l4.l3 + 12..l4.l3 + 20]);
    key[8..].copy_from_slice(&frame[l4.l4..l4.l4 + 4]);
    Some((l4, key))
}

/// The source and destination addresses of an IPv4 packet carrying TCP (whole or a
/// fragment), untagged or with one VLAN tag.
fn tcp_ip_pair(frame: &[u8]) -> Option<[u8; 8]> {
    let l3 = match frame.get(12..14)? {
        [0x08, 0x00] => crate::wire::ETH_HEADER,
        [0x81, 0x00] if frame.get(16..18)? == [0x08, 0x00] => {
            crate::wire::ETH_HEADER + crate::wire::VLAN_HEADER
        }
        _ => return None,
    };
    if *frame.get(l3 + 9)? != 6 {
        return None;
    }
    frame.get(l3 + 12..l3 + 20)?.try_into().ok()
}

/// Applies the rules to a located frame: the fields they need, or why it cannot join
/// anything.
fn parse(frame: &[u8], l4: &L4, key: [u8; 12]) -> Result<Parsed, Pass> {
    let ip = &frame[l4.l3..l4.l4];
    if ip.len() != 20 {
        return Err(Pass::IpOptions);
    }
    // The header is rewritten (and its checksum made anew) when an aggregate is handed
    // back, so a bad one must not get that far.
    if checksum::data(ip) != !0 {
        return Err(Pass::BadChecksum);
    }
    if ip[1] & 0x03 == 0x03 {
        return Err(Pass::EcnCe);
    }
    let t = &frame[l4.l4..l4.l4 + l4.l4_len];
    let flags = t[13];
    if flags & !TCP_PSH != TCP_ACK || t[12] & 0x0f != 0 {
        // Anything but ACK (and PSH); the reserved bits and NS, too.
        return Err(Pass::Flags);
    }
    let payload = (l4.l4 + l4.l4_len, l4.frame_len);
    if payload.0 >= payload.1 {
        return Err(Pass::NoPayload);
    }
    // Options: none, or a timestamp alone, in Linux's aligned form (NOP, NOP, TS) or
    // as smoltcp writes it (TS, then two bytes of end-of-list or NOP padding).
    let pad = |b: u8| b == 0 || b == 1;
    let ts = match l4.l4_len {
        20 => None,
        32 if t[20..24] == [1, 1, 8, 10] => Some(24),
        32 if t[20..22] == [8, 10] && pad(t[30]) && pad(t[31]) => Some(22),
        _ => return Err(Pass::Options),
    };
    if let Some(o) = ts {
        if t[o + 4..o + 8] == [0, 0, 0, 0] {
            return Err(Pass::Options);
        }
    }
    Ok(Parsed {
        key,
        seq: be32(t, 4),
        flags,
        payload,
        l4: l4.l4,
        l4_len: l4.l4_len,
        ts,
    })
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// A flow being aggregated.
#[derive(Debug)]
struct Flow<B> {
    key: [u8; 12],
    /// The first segment's headers, patched as segments join.
    head: [u8; MAX_HEADERS],
    head_len: usize,
    l4: usize,
    ts: Option<usize>,
    next_seq: u32,
    gso_size: usize,
    payload_len: usize,
    since: u64,
    /// When its latest segment arrived (the caller's clock).
    last: u64,
    /// When it was last touched (for eviction).
    touched: u64,
    segs: Vec<Seg<B>>,
}

/// The engine: a bounded table of flows, each holding one aggregate.
#[derive(Debug)]
pub struct Lro<B> {
    cfg: LroConfig,
    flows: Vec<Flow<B>>,
    /// Flows in use: the first `live` of `flows`.
    live: usize,
    tick: u64,
    /// Counters.
    pub stats: LroStats,
}

impl<B> Lro<B> {
    /// An engine with `cfg`'s bounds, its memory allocated now.
    pub fn new(cfg: LroConfig) -> Self {
        let cfg = LroConfig {
            max_flows: cfg.max_flows.max(1),
            max_segs: cfg.max_segs.max(1),
        };
        Self {
            cfg,
            flows: (0..cfg.max_flows)
                .map(|_| Flow {
                    key: [0; 12],
                    head: [0; MAX_HEADERS],
                    head_len: 0,
                    l4: 0,
                    ts: None,
                    next_seq: 0,
                    gso_size: 0,
                    payload_len: 0,
                    since: 0,
                    last: 0,
                    touched: 0,
                    segs: Vec::with_capacity(cfg.max_segs),
                })
                .collect(),
            live: 0,
            tick: 0,
            stats: LroStats::default(),
        }
    }

    /// Flows holding an aggregate now.
    pub fn held_flows(&self) -> usize {
        self.live
    }

    /// Segments held now, all flows.
    pub fn held_segments(&self) -> usize {
        self.flows[..self.live].iter().map(|f| f.segs.len()).sum()
    }

    /// The earliest arrival among held aggregates.
    pub fn oldest(&self) -> Option<u64> {
        self.flows[..self.live].iter().map(|f| f.since).min()
    }

    /// Takes one received frame (`bytes` is its content, `buf` the driver's handle on
    /// it; `csum_ok` if the NIC verified its checksum; `now` the caller's clock).
    /// Whatever is handed back goes to `out`, in order.
    pub fn receive(
        &mut self,
        buf: B,
        bytes: &[u8],
        csum_ok: bool,
        now: u64,
        out: &mut impl FnMut(Delivery<'_, B>),
    ) {
        self.receive_head(buf, bytes, bytes.len(), csum_ok, now, out);
    }

    /// As [`Lro::receive`], given the frame's first bytes (`head`: at least its
    /// headers, [`MAX_HEADERS`] will do) and its length: what a driver reads from a
    /// buffer in domain memory. The rules need only the headers; a checksum the NIC did
    /// not verify needs the whole frame, so without it (`head` shorter than `len`) such
    /// a frame is passed as [`Pass::BadChecksum`].
    pub fn receive_head(
        &mut self,
        buf: B,
        head: &[u8],
        len: usize,
        csum_ok: bool,
        now: u64,
        out: &mut impl FnMut(Delivery<'_, B>),
    ) {
        let bytes = head;
        self.tick += 1;
        let Some((l4, key)) = locate(bytes, len) else {
            // A TCP packet the rules cannot read (an IP fragment) may belong to a held
            // flow: what is held between the same two hosts goes first, as Linux's
            // GRO flushes a held packet whose addresses and protocol a non-mergeable
            // one shares.
            if let Some(pair) = tcp_ip_pair(bytes) {
                while let Some(i) = (0..self.live).find(|&i| self.flows[i].key[..8] == pair) {
                    self.flush(i, Flush::Unmergeable, out);
                }
            }
            self.stats.passed.add(Pass::NotTcp);
            out(Delivery::Alone(buf));
            return;
        };
        let checked = parse(bytes, &l4, key).and_then(|p| {
            if csum_ok || (bytes.len() >= len && verify(bytes, &l4)) {
                Ok(p)
            } else {
                Err(Pass::BadChecksum)
            }
        });
        let p = match checked {
            Ok(p) => p,
            Err(why) => {
                // A frame of a held flow that cannot join goes after the flow's
                // aggregate, so the flow keeps its order.
                if let Some(i) = self.find(&key) {
                    self.flush(i, Flush::Unmergeable, out);
                }
                self.stats.passed.add(why);
                out(Delivery::Alone(buf));
                return;
            }
        };
        let len = p.payload.1 - p.payload.0;
        if let Some(i) = self.find(&p.key) {
            match self.joins(i, &p, bytes) {
                Ok(()) => {
                    self.flows[i].last = now;
                    self.join(i, buf, &p, bytes);
                    let f = &self.flows[i];
                    if p.flags & TCP_PSH != 0 {
                        self.flush(i, Flush::Push, out);
                    } else if len < f.gso_size {
                        self.flush(i, Flush::Short, out);
                    } else if f.segs.len() == self.cfg.max_segs {
                        self.flush(i, Flush::Full, out);
                    }
                    return;
                }
                Err(why) => self.flush(i, why, out),
            }
        }
        // A new aggregate; with PSH it is handed back at once.
        self.start(buf, &p, bytes, now, out);
        if p.flags & TCP_PSH != 0 {
            let i = self.live - 1;
            self.flush(i, Flush::Push, out);
        }
    }

    /// Hands back every aggregate (end of a poll; `reason` is [`Flush::Poll`] there).
    pub fn flush_all(&mut self, reason: Flush, out: &mut impl FnMut(Delivery<'_, B>)) {
        while self.live > 0 {
            self.flush(0, reason, out);
        }
    }

    /// Hands back the aggregates whose first segment came at or before `t` (a maximum
    /// hold time).
    pub fn flush_since(&mut self, t: u64, out: &mut impl FnMut(Delivery<'_, B>)) {
        let mut i = 0;
        while i < self.live {
            if self.flows[i].since <= t {
                self.flush(i, Flush::Poll, out);
            } else {
                i += 1;
            }
        }
    }

    /// Hands back, as [`Flush::Poll`], every aggregate for which `now_due` says so,
    /// given what is held: the adaptive flush's per-flow decision.
    pub fn flush_where(
        &mut self,
        mut now_due: impl FnMut(Held) -> bool,
        out: &mut impl FnMut(Delivery<'_, B>),
    ) {
        let mut i = 0;
        while i < self.live {
            let f = &self.flows[i];
            let h = Held {
                since: f.since,
                last: f.last,
                segs: f.segs.len(),
            };
            if now_due(h) {
                self.flush(i, Flush::Poll, out);
            } else {
                i += 1;
            }
        }
    }

    /// What each held aggregate is, for a caller's flush policy.
    pub fn held(&self) -> impl Iterator<Item = Held> + '_ {
        self.flows[..self.live].iter().map(|f| Held {
            since: f.since,
            last: f.last,
            segs: f.segs.len(),
        })
    }

    fn find(&self, key: &[u8; 12]) -> Option<usize> {
        self.flows[..self.live].iter().position(|f| f.key == *key)
    }

    /// Whether segment `p` may join flow `i`, or why the flow must be flushed first.
    fn joins(&self, i: usize, p: &Parsed, bytes: &[u8]) -> Result<(), Flush> {
        let f = &self.flows[i];
        if p.seq != f.next_seq {
            return Err(Flush::OutOfOrder);
        }
        let len = p.payload.1 - p.payload.0;
        if len > f.gso_size {
            return Err(Flush::Longer);
        }
        if f.segs.len() >= self.cfg.max_segs || f.head_len + f.payload_len + len > MAX_OFFLOAD_LEN {
            return Err(Flush::Full);
        }
        // The same options as the first segment's, but a timestamp that does not go
        // backwards.
        let (h, t) = (&f.head[f.l4..], &bytes[p.l4..p.l4 + p.l4_len]);
        if p.l4_len != f.head_len - f.l4 || p.ts != f.ts {
            return Err(Flush::Options);
        }
        if let Some(o) = p.ts {
            if (be32(t, o).wrapping_sub(be32(h, o)) as i32) < 0 {
                return Err(Flush::Options);
            }
        }
        Ok(())
    }

    fn join(&mut self, i: usize, buf: B, p: &Parsed, bytes: &[u8]) {
        let f = &mut self.flows[i];
        let len = p.payload.1 - p.payload.0;
        let t = p.l4;
        // The latest acknowledgement, window and timestamp, and PSH.
        let h = f.l4;
        f.head[h + 8..h + 12].copy_from_slice(&bytes[t + 8..t + 12]);
        f.head[h + 14..h + 16].copy_from_slice(&bytes[t + 14..t + 16]);
        f.head[h + 13] |= p.flags & TCP_PSH;
        if let Some(o) = p.ts {
            f.head[h + o..h + o + 8].copy_from_slice(&bytes[t + o..t + o + 8]);
        }
        f.segs.push(Seg {
            buf,
            payload: p.payload.0..p.payload.1,
            seq: p.seq,
            at: f.last,
        });
        f.next_seq = p.seq.wrapping_add(len as u32);
        f.payload_len += len;
        f.touched = self.tick;
    }

    /// Starts an aggregate with `p`, evicting the least recently touched flow if the
    /// table is full.
    fn start(
        &mut self,
        buf: B,
        p: &Parsed,
        bytes: &[u8],
        now: u64,
        out: &mut impl FnMut(Delivery<'_, B>),
    ) {
        if self.live == self.flows.len() {
            let lru = (0..self.live)
                .min_by_key(|&k| self.flows[k].touched)
                .unwrap_or(0);
            self.flush(lru, Flush::Evicted, out);
        }
        let i = self.live;
        self.live += 1;
        let f = &mut self.flows[i];
        let hl = p.payload.0;
        f.key = p.key;
        f.head[..hl].copy_from_slice(&bytes[..hl]);
        f.head_len = hl;
        f.l4 = p.l4;
        f.ts = p.ts;
        let len = p.payload.1 - p.payload.0;
        f.gso_size = len;
        f.payload_len = len;
        f.next_seq = p.seq.wrapping_add(len as u32);
        f.since = now;
        f.last = now;
        f.touched = self.tick;
        f.segs.clear();
        f.segs.push(Seg {
            buf,
            payload: p.payload.0..p.payload.1,
            seq: p.seq,
            at: now,
        });
    }

    /// Hands back flow `i`'s aggregate and frees its slot (the last live flow takes its
    /// place).
    fn flush(&mut self, i: usize, reason: Flush, out: &mut impl FnMut(Delivery<'_, B>)) {
        let last = self.live - 1;
        self.flows.swap(i, last);
        self.live -= 1;
        let f = &mut self.flows[last];
        // IPv4 total length and header checksum for the whole.
        let ip = crate::wire::ETH_HEADER;
        let total = (f.head_len - ip + f.payload_len) as u16;
        f.head[ip + 2..ip + 4].copy_from_slice(&total.to_be_bytes());
        f.head[ip + 10..ip + 12].copy_from_slice(&[0, 0]);
        let sum = !checksum::data(&f.head[ip..f.l4]);
        f.head[ip + 10..ip + 12].copy_from_slice(&sum.to_be_bytes());
        self.stats.aggregates += 1;
        self.stats.segments += f.segs.len() as u64;
        self.stats.flushed.add(reason);
        out(Delivery::Aggregate(Aggregate {
            head: &f.head[..f.head_len],
            gso_size: f.gso_size as u16,
            payload_len: f.payload_len,
            reason,
            since: f.since,
            segs: f.segs.drain(..),
        }));
    }
}
