//! LRO in the NIC driver (paper 001): the driver's NAPI poll hands each received frame
//! to [`net::lro`]'s engine and builds a packet from each aggregate it hands back, in
//! one of the paper's two forms, and flushes held aggregates on one of three schedules.
//!
//! Forms (Linux's `inet_lro` has both):
//! * **skb-mode**: the segments' buffers are kept as they are, chained on the first
//!   one's fragment list; the first keeps the aggregate's headers, the others are cut to
//!   their payload. Nothing is copied.
//! * **page-mode**: the driver posts whole pages as receive buffers; an aggregate is a
//!   fresh buffer holding the headers, with each segment's payload attached as a page
//!   fragment where it lies (the segment's page moves to the aggregate). The headers
//!   are copied; at most [`MAX_SKB_FRAGS`] segments fit.
//!
//! Schedules:
//! * every poll (Linux's `lro_flush_all` at the end of the poll: the paper's LRO);
//! * every Nth poll with a maximum hold (the paper's delayed aggregation, N = 2);
//! * adaptive (beyond the paper): at the end of each poll a held aggregate stays only
//!   while its flow's next segment is expected, from the arrival interval measured
//!   within the aggregate, before the latency budget since its first segment runs
//!   out. A flow with one segment held (request/response), or one whose PSH ended its
//!   aggregate, is flushed at once; a bulk flow is held while it streams.
//!
//! An aggregate goes up marked with its GSO type and segment size, its checksum
//! validated (every segment's was, by the NIC or by the engine), so whoever cannot take
//! it whole cuts it back into exactly the segments that arrived.

use std::time::{Duration, Instant};

use net::lro::{Aggregate, Delivery, Held, Lro, LroConfig, LroStats};
use net::netif::{Gso, XEN_NETIF_GSO_TYPE_TCPV4};
use net::offload::{Csum, Offload, MAX_HEADERS};
use net::skb::{Frag, FragPage, SkbId, SkbPool, MAX_SKB_FRAGS, NET_SKB_PAD};
use net::wire::MAX_TAGGED_FRAME;

/// How an aggregate is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// The segments' buffers chained (the fragment list).
    Skb,
    /// The segments' payloads as page fragments of one buffer.
    Page,
}

/// When held aggregates are handed up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flushing {
    /// At the end of every poll.
    EveryPoll,
    /// At the end of every `n`th poll, and whenever one has been held `max_hold`.
    Delayed {
        /// Polls between flushes (the paper's N).
        n: u32,
        /// The longest an aggregate is held.
        max_hold: Duration,
    },
    /// Per flow, from its arrival interval, within `budget` of its first segment.
    Adaptive {
        /// The longest an aggregate is held.
        budget: Duration,
    },
}

/// LRO's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LroSetup {
    /// skb-mode or page-mode.
    pub form: Form,
    /// When to flush.
    pub flushing: Flushing,
    /// Flows held at once (the engine's table).
    pub max_flows: usize,
}

impl LroSetup {
    /// skb-mode, flushed every poll, Linux's 32 flows: the paper's LRO.
    pub const PAPER: LroSetup = LroSetup {
        form: Form::Skb,
        flushing: Flushing::EveryPoll,
        max_flows: 32,
    };

    /// The paper's delayed aggregation: every second poll, held at most 1 ms.
    pub const DELAYED: Flushing = Self::delayed(2);

    /// A flush every `n`th poll, each aggregate held at most 1 ms.
    pub const fn delayed(n: u32) -> Flushing {
        Flushing::Delayed {
            n,
            max_hold: Duration::from_millis(1),
        }
    }

    /// The adaptive flush with a 200 µs budget.
    pub const ADAPTIVE: Flushing = Flushing::Adaptive {
        budget: Duration::from_micros(200),
    };
}

/// The driver's LRO counters, beside the engine's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LroDriverStats {
    /// Aggregates built and handed up (one segment or more).
    pub aggregates: u64,
    /// Segments in them.
    pub segments: u64,
    /// Frames handed up alone.
    pub passed: u64,
    /// Aggregates whose packet could not be built (no buffer): their segments freed.
    pub build_failures: u64,
    /// Nanoseconds aggregates were held, from their first segment to their flush.
    pub held_ns: u64,
    /// The longest any was held.
    pub held_ns_max: u64,
    /// Polls.
    pub polls: u64,
    /// Flushes by the hold limit (a timer, or a poll that found one too old).
    pub timer_flushes: u64,
}

hv::counter_set!(LroDriverStats {
    aggregates,
    segments,
    passed,
    build_failures,
    held_ns,
    held_ns_max,
    polls,
    timer_flushes
});

/// Buckets of [`SegWait`], one a microsecond; the last takes every longer wait.
pub const WAIT_BUCKETS: usize = 2048;

/// Aggregation latency per segment: how long each segment that joined an aggregate
/// waited in LRO, from the poll that received it to its aggregate's hand-up, in 1 µs
/// buckets (the paper's "latency from the aggregation to the flush", kept for every
/// segment so that its median and tail can be read, not only a mean).
#[derive(Debug, Clone)]
pub struct SegWait {
    buckets: Box<[u64; WAIT_BUCKETS]>,
}

impl Default for SegWait {
    fn default() -> Self {
        Self {
            buckets: Box::new([0; WAIT_BUCKETS]),
        }
    }
}

impl SegWait {
    fn record(&mut self, ns: u64) {
        let us = ((ns / 1000) as usize).min(WAIT_BUCKETS - 1);
        self.buckets[us] += 1;
    }

    /// Segments that waited `us` microseconds (the last bucket: at least that long).
    pub fn bucket(&self, us: usize) -> u64 {
        self.buckets.get(us).copied().unwrap_or(0)
    }

    /// Calls `f(us, segments)` for every bucket that holds any, in order.
    pub fn visit(&self, mut f: impl FnMut(usize, u64)) {
        for (us, &n) in self.buckets.iter().enumerate() {
            if n > 0 {
                f(us, n);
            }
        }
    }
}

/// The histogram by name, a counter per bucket that holds any (named by its
/// microseconds), and whole for code that reads it by type.
impl hv::counters::CounterSet for SegWait {
    fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
        SegWait::visit(self, |us, n| f(&us.to_string(), n));
    }
    fn snapshot(&self) -> Option<std::sync::Arc<dyn std::any::Any + Send + Sync>> {
        Some(std::sync::Arc::new(self.clone()))
    }
}

/// LRO as the driver runs it.
#[derive(Debug)]
pub struct DriverLro {
    setup: LroSetup,
    engine: Lro<SkbId>,
    epoch: Instant,
    polls: u32,
    head: Box<[u8; MAX_TAGGED_FRAME]>,
    stats: LroDriverStats,
    wait: SegWait,
}

impl DriverLro {
    /// LRO with `setup`, its memory allocated now.
    pub fn new(setup: LroSetup) -> Self {
        let cfg = LroConfig {
            max_flows: setup.max_flows,
            max_segs: match setup.form {
                Form::Skb => LroConfig::default().max_segs,
                // One fragment per segment.
                Form::Page => MAX_SKB_FRAGS,
            },
        };
        Self {
            setup,
            engine: Lro::new(cfg),
            epoch: Instant::now(),
            polls: 0,
            head: Box::new([0; MAX_TAGGED_FRAME]),
            stats: LroDriverStats::default(),
            wait: SegWait::default(),
        }
    }

    /// Its settings.
    pub fn setup(&self) -> LroSetup {
        self.setup
    }

    /// The engine's counters.
    pub fn engine_stats(&self) -> &LroStats {
        &self.engine.stats
    }

    /// The driver's.
    pub fn stats(&self) -> &LroDriverStats {
        &self.stats
    }

    /// Each aggregated segment's wait.
    pub fn seg_wait(&self) -> &SegWait {
        &self.wait
    }

    /// The clock aggregates are stamped with, read once a poll.
    pub fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// One received frame, its offload set by the driver: held, or handed to `deliver`
    /// (after whatever it flushes).
    pub fn receive(
        &mut self,
        pool: &mut SkbPool,
        skb: SkbId,
        now: u64,
        deliver: &mut impl FnMut(&mut SkbPool, SkbId),
    ) {
        let len = pool.len(skb);
        let valid = pool.csum_valid(skb);
        // The headers; the whole frame if the engine must verify its checksum.
        let want = if valid {
            len.min(MAX_HEADERS)
        } else {
            len.min(self.head.len())
        };
        if pool.read(skb, 0, &mut self.head[..want]).is_err() {
            self.stats.passed += 1;
            deliver(pool, skb);
            return;
        }
        let Self {
            engine,
            head,
            stats,
            wait,
            setup,
            ..
        } = self;
        engine.receive_head(skb, &head[..want], len, valid, now, &mut |d| {
            hand_up(setup.form, pool, d, now, stats, wait, deliver)
        });
    }

    /// The end of a poll: flushes what the schedule says. The clock is read again
    /// (the poll's own work is part of a segment's wait), and only if something is
    /// held.
    pub fn end_poll(&mut self, pool: &mut SkbPool, deliver: &mut impl FnMut(&mut SkbPool, SkbId)) {
        self.stats.polls += 1;
        self.polls = self.polls.wrapping_add(1);
        if self.engine.held_flows() == 0 {
            return;
        }
        let now = self.now();
        let Self {
            engine,
            stats,
            wait,
            setup,
            polls,
            ..
        } = self;
        let form = setup.form;
        let mut out = |d: Delivery<'_, SkbId>| hand_up(form, pool, d, now, stats, wait, deliver);
        match setup.flushing {
            Flushing::EveryPoll => {
                engine.flush_all(net::lro::Flush::Poll, &mut out);
            }
            Flushing::Delayed { n, max_hold } => {
                if *polls % n.max(1) == 0 {
                    engine.flush_all(net::lro::Flush::Poll, &mut out);
                } else {
                    let cut = now.saturating_sub(max_hold.as_nanos() as u64);
                    engine.flush_since(cut, &mut out);
                }
            }
            Flushing::Adaptive { budget } => {
                let budget = budget.as_nanos() as u64;
                engine.flush_where(|h| !worth_holding(h, now, budget), &mut out);
            }
        }
    }

    /// Flushes what has been held past its limit by now (the driver domain's timer).
    /// With nothing held it reads no clock.
    pub fn expire(&mut self, pool: &mut SkbPool, deliver: &mut impl FnMut(&mut SkbPool, SkbId)) {
        let Some(due) = self.deadline() else {
            return;
        };
        let now = self.now();
        if due > now {
            return;
        }
        let Self {
            engine,
            stats,
            wait,
            setup,
            ..
        } = self;
        let form = setup.form;
        let limit = hold_limit(setup.flushing);
        let before = stats.aggregates;
        engine.flush_since(now.saturating_sub(limit), &mut |d| {
            hand_up(form, pool, d, now, stats, wait, deliver)
        });
        stats.timer_flushes += stats.aggregates - before;
    }

    /// When the oldest held aggregate reaches its limit, on [`DriverLro::now`]'s
    /// clock; `None` if nothing is held.
    pub fn deadline(&self) -> Option<u64> {
        self.engine
            .oldest()
            .map(|t| t + hold_limit(self.setup.flushing))
    }

    /// Frees every held segment (the driver stops).
    pub fn discard(&mut self, pool: &mut SkbPool) {
        self.engine
            .flush_all(net::lro::Flush::Poll, &mut |d| match d {
                Delivery::Alone(s) => pool.free(s),
                Delivery::Aggregate(a) => {
                    for s in a.segs {
                        pool.free(s.buf);
                    }
                }
            });
    }
}

/// The longest a schedule holds an aggregate, in ns.
fn hold_limit(f: Flushing) -> u64 {
    match f {
        Flushing::EveryPoll => 0,
        Flushing::Delayed { max_hold, .. } => max_hold.as_nanos() as u64,
        Flushing::Adaptive { budget } => budget.as_nanos() as u64,
    }
}

/// The adaptive rule: hold an aggregate while its flow streams (two segments or more,
/// so an interval is known) and its next segment is due, at the interval measured so
/// far, before the budget since its first one runs out; the interval is given a factor
/// of two of slack, as arrivals jitter.
fn worth_holding(h: Held, now: u64, budget: u64) -> bool {
    if h.segs < 2 {
        return false;
    }
    let gap = (h.last - h.since) / (h.segs as u64 - 1);
    let next = now.max(h.last) + 2 * gap;
    next <= h.since + budget
}

/// Hands one delivery up: a frame as it is, or an aggregate built in `form`.
fn hand_up(
    form: Form,
    pool: &mut SkbPool,
    d: Delivery<'_, SkbId>,
    now: u64,
    stats: &mut LroDriverStats,
    wait: &mut SegWait,
    deliver: &mut impl FnMut(&mut SkbPool, SkbId),
) {
    match d {
        Delivery::Alone(skb) => {
            stats.passed += 1;
            deliver(pool, skb);
        }
        Delivery::Aggregate(a) => {
            let held = now.saturating_sub(a.since);
            stats.held_ns += held;
            stats.held_ns_max = stats.held_ns_max.max(held);
            stats.aggregates += 1;
            stats.segments += a.segs.len() as u64;
            let mut waited = |at: u64| wait.record(now.saturating_sub(at));
            let built = match form {
                Form::Skb => build_chain(pool, a, &mut waited),
                Form::Page => build_pages(pool, a, &mut waited),
            };
            match built {
                Some(skb) => deliver(pool, skb),
                None => stats.build_failures += 1,
            }
        }
    }
}

/// The offload an aggregate of `segs` segments goes up with.
fn offload_of(segs: usize, gso_size: u16) -> Offload {
    Offload {
        csum: Csum::Valid,
        gso: (segs > 1).then_some(Gso {
            size: gso_size,
            ty: XEN_NETIF_GSO_TYPE_TCPV4,
        }),
    }
}

/// skb-mode: the first segment's buffer with the aggregate's headers, the rest cut to
/// their payloads and chained on its fragment list.
fn build_chain(
    pool: &mut SkbPool,
    a: Aggregate<'_, SkbId>,
    waited: &mut impl FnMut(u64),
) -> Option<SkbId> {
    let n = a.segs.len();
    let off = offload_of(n, a.gso_size);
    let head = a.head;
    let mut first: Option<SkbId> = None;
    let mut ok = true;
    for s in a.segs {
        waited(s.at);
        let skb = s.buf;
        let shaped = match first {
            None => pool
                .trim(skb, s.payload.end)
                .and_then(|()| pool.write_linear(skb, 0, head)),
            Some(_) => pool
                .trim(skb, s.payload.end)
                .and_then(|()| pool.pull(skb, s.payload.start)),
        };
        ok &= shaped.is_ok();
        match first {
            None => first = Some(skb),
            Some(f) => pool.append_frag_list(f, skb),
        }
    }
    let f = first?;
    if !ok {
        pool.free(f);
        return None;
    }
    pool.set_offload(f, off);
    Some(f)
}

/// page-mode: a fresh buffer with the headers, each segment's payload a fragment of the
/// page it was received in.
fn build_pages(
    pool: &mut SkbPool,
    a: Aggregate<'_, SkbId>,
    waited: &mut impl FnMut(u64),
) -> Option<SkbId> {
    let n = a.segs.len();
    let off = offload_of(n, a.gso_size);
    let agg = pool.alloc(NET_SKB_PAD).ok();
    let mut ok = agg.is_some_and(|g| pool.put(g, a.head).is_ok());
    for s in a.segs {
        waited(s.at);
        let (_, at) = pool.data_location(s.buf);
        let page = if ok {
            pool.detach_head_page(s.buf)
        } else {
            None
        };
        match (agg, page) {
            (Some(g), Some(p)) => {
                let frag = Frag {
                    page: FragPage::Local(p),
                    offset: (at + s.payload.start) as u16,
                    len: (s.payload.end - s.payload.start) as u16,
                };
                if pool.add_frag(g, frag).is_err() {
                    pool.free_page(p);
                    ok = false;
                }
            }
            (_, Some(p)) => pool.free_page(p),
            (_, None) => {
                ok = false;
                pool.free(s.buf);
            }
        }
    }
    let g = agg?;
    if !ok {
        pool.free(g);
        return None;
    }
    pool.set_offload(g, off);
    Some(g)
}
