//! An AoE initiator: what turns block requests into ATA-over-Ethernet frames and the
//! target's answers back into finished requests (the remote virtual block device's
//! engine, wherever it runs: the driver domain's kernel or the SV-NIC's device cores).
//!
//! **Discovery.** It broadcasts a config query for its target's address until a target
//! answers, takes the target's MAC, how many frames it takes in flight (its buffer
//! count) and how many sectors one command may carry (bounded by the MTU), then asks
//! `IDENTIFY DEVICE` for the disk's size and whether it flushes.
//!
//! **Requests.** A request of `n` sectors goes out as frames of up to
//! [`Initiator::sectors_per_frame`] sectors, as many on the wire as the target's buffers
//! allow, in submission order. Each frame's tag names its initiator (bits 24–30), its
//! slot in the table of frames on the wire (bits 16–23) and which send it is (low
//! half), so an answer to an earlier
//! send of a frame sent again, a duplicate, or one after its request failed names no
//! live send and is dropped ([`BadFrame::Stale`]). A frame not answered within the
//! retransmission timeout is sent again with a new tag; the timeout follows the measured
//! round trip (Jacobson's estimator over frames sent once, Karn's rule) and doubles per
//! resend of a frame. A request outstanding past [`InitiatorConfig::fail_after`] fails
//! to its caller with an error and its frames leave the wire, so no guest hangs on a
//! dead target.
//!
//! **Answers are hostile.** Nothing is placed unless the answer comes from the target's
//! MAC and address, names a live send of an ATA frame, reports success, echoes that
//! frame's LBA and carries at least its sectors; then exactly those sectors go to
//! exactly that frame's place in its request ([`AoeIo::place`]). Anything else is
//! counted by reason and leaves every request as it was.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use hv::counters::PerReason;

use crate::aoe::{self, AtaCmd, BadFrame, Body, Target, ATA_DATA, MAJOR_ANY, MINOR_ANY, SECTOR};

/// Frames on the wire at most, whatever the target's buffer count.
pub const MAX_WINDOW: usize = 64;
/// The largest MTU an initiator takes (a jumbo frame); a larger one is clamped, so a
/// frame's sectors are at most 17.
pub const MAX_MTU: usize = 9000;
/// The smallest: one sector a frame. A smaller one is raised to it.
pub const MIN_MTU: usize = ATA_DATA - aoe::ETH_HEADER + SECTOR;

/// How an initiator is set up.
#[derive(Debug, Clone, Copy)]
pub struct InitiatorConfig {
    /// Its own MAC.
    pub me: [u8; 6],
    /// The target's major address ([`MAJOR_ANY`]: the first to answer).
    pub major: u16,
    /// Its minor address ([`MINOR_ANY`]: the first to answer).
    pub minor: u8,
    /// The link's MTU (sectors per frame follow from it).
    pub mtu: usize,
    /// A request outstanding this long fails.
    pub fail_after: Duration,
    /// The retransmission timeout before any round trip is measured.
    pub rto_initial: Duration,
    /// Its floor.
    pub rto_min: Duration,
    /// Its ceiling.
    pub rto_max: Duration,
    /// Bits 24–30 of every tag it sends (0 to 127): several initiators sharing a MAC
    /// (one per remote device of a driver domain) tell their answers apart by it.
    pub tag_prefix: u8,
}

impl InitiatorConfig {
    /// Defaults for `me` and the target at `major`/`minor` at a 1500-byte MTU: 20 ms
    /// before a round trip is known, 2 ms to 1 s after, requests failed after 5 s.
    pub fn new(me: [u8; 6], major: u16, minor: u8) -> Self {
        Self {
            me,
            major,
            minor,
            mtu: 1500,
            fail_after: Duration::from_secs(5),
            rto_initial: Duration::from_millis(20),
            rto_min: Duration::from_millis(2),
            rto_max: Duration::from_secs(1),
            tag_prefix: 0,
        }
    }
}

/// What an initiator needs from whoever runs it.
pub trait AoeIo {
    /// Sends one frame; false if there was no room (it is sent again later).
    fn send(&mut self, frame: &[u8]) -> bool;
    /// Fills `buf` with request `req`'s bytes from `offset` (a write's data); false if
    /// its memory cannot be read (the request then fails).
    fn fetch(&mut self, req: u16, offset: usize, buf: &mut [u8]) -> bool;
    /// Puts `len` bytes of the frame being taken in, from its byte `at` on, into request
    /// `req`'s memory at `offset` (a read's sectors, straight from the frame); false if
    /// it cannot (the request then fails).
    fn place(&mut self, req: u16, offset: usize, at: usize, len: usize) -> bool;
    /// Request `req` finished, well or not.
    fn done(&mut self, req: u16, ok: bool);
}

/// Where discovery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Looking for the target.
    Discover,
    /// Asking it what it is.
    Identify,
    /// Serving requests.
    Ready,
}

/// What an initiator counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AoeStats {
    /// Requests submitted.
    pub requests: u64,
    /// Requests finished well.
    pub completed: u64,
    /// Requests failed: the target reported an error, or memory could not be reached.
    pub errors: u64,
    /// Requests failed for want of an answer within the bound.
    pub timed_out: u64,
    /// Frames sent the first time.
    pub frames: u64,
    /// Frames sent again after a timeout.
    pub retransmits: u64,
    /// Sends the link refused (tried again).
    pub send_busy: u64,
    /// Answers taken.
    pub answers: u64,
    /// Frames from the wire dropped, by reason.
    pub dropped: PerReason<BadFrame>,
    /// Discovery queries and identifies sent.
    pub discovery: u64,
}

hv::counter_set!(AoeStats {
    requests,
    completed,
    errors,
    timed_out,
    frames,
    retransmits,
    send_busy,
    answers,
    dropped,
    discovery,
});

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Flush,
}

#[derive(Debug, Clone, Copy)]
struct Req {
    in_use: bool,
    kind: Kind,
    lba: u64,
    sectors: u32,
    /// Sectors handed to frames so far.
    sent: u32,
    /// Sectors answered.
    answered: u32,
    started: Instant,
    /// Frames of it on the wire.
    on_wire: u16,
}

#[derive(Debug, Clone, Copy)]
struct Frame {
    in_use: bool,
    req: u16,
    /// First sector, from the request's start.
    first: u32,
    count: u8,
    seq: u16,
    sent_at: Instant,
    tries: u8,
    /// Waiting for the link to take it.
    unsent: bool,
}

/// One initiator and its target.
#[derive(Debug)]
pub struct Initiator {
    cfg: InitiatorConfig,
    phase: Phase,
    target: Option<Target>,
    disk_sectors: u64,
    flush: bool,
    per_frame: u8,
    window: usize,
    /// The discovery query's or identify's last send.
    probe_at: Option<Instant>,
    probe_tag: u32,
    probe_tries: u32,
    reqs: Vec<Req>,
    /// Requests with sectors not yet handed to frames, in submission order.
    order: VecDeque<u16>,
    frames: Vec<Frame>,
    seq: u16,
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    buf: Box<[u8]>,
    stats: AoeStats,
}

/// Why a request was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AoeSubmitError {
    /// No target yet.
    #[error("target not found yet")]
    NotReady,
    /// The id is in use or past the table.
    #[error("request id busy or out of range")]
    BadId,
    /// Sectors past the disk, or none.
    #[error("sectors beyond the disk")]
    Range,
    /// The target does not flush.
    #[error("flush not supported")]
    NoFlush,
}

impl Initiator {
    /// An initiator for requests with ids `0..max_requests`.
    pub fn new(mut cfg: InitiatorConfig, max_requests: usize) -> Self {
        cfg.mtu = cfg.mtu.clamp(MIN_MTU, MAX_MTU);
        let now = Instant::now();
        Self {
            cfg,
            phase: Phase::Discover,
            target: None,
            disk_sectors: 0,
            flush: false,
            per_frame: aoe::sectors_per_frame(cfg.mtu).max(1),
            window: 1,
            probe_at: None,
            probe_tag: 0,
            probe_tries: 0,
            reqs: vec![
                Req {
                    in_use: false,
                    kind: Kind::Read,
                    lba: 0,
                    sectors: 0,
                    sent: 0,
                    answered: 0,
                    started: now,
                    on_wire: 0,
                };
                max_requests
            ],
            order: VecDeque::with_capacity(max_requests),
            frames: vec![
                Frame {
                    in_use: false,
                    req: 0,
                    first: 0,
                    count: 0,
                    seq: 0,
                    sent_at: now,
                    tries: 0,
                    unsent: false,
                };
                MAX_WINDOW
            ],
            seq: 0,
            srtt: None,
            rttvar: Duration::ZERO,
            rto: cfg.rto_initial,
            // One frame of the link's MTU and its Ethernet header: sectors per frame
            // follow the same MTU (`aoe::sectors_per_frame`), so a write's sectors always
            // fit, whatever the target offers (it is held to the MTU's count).
            buf: vec![0u8; aoe::ETH_HEADER + cfg.mtu].into_boxed_slice(),
            stats: AoeStats::default(),
        }
    }

    /// Where discovery is.
    pub fn phase(&self) -> Phase {
        self.phase
    }
    /// The target, once found.
    pub fn target(&self) -> Option<Target> {
        self.target
    }
    /// The disk's size in sectors (0 before identify).
    pub fn sectors(&self) -> u64 {
        self.disk_sectors
    }
    /// Whether the target flushes its cache on request.
    pub fn flushes(&self) -> bool {
        self.flush
    }
    /// Sectors one frame carries.
    pub fn sectors_per_frame(&self) -> u8 {
        self.per_frame
    }
    /// Frames on the wire at once.
    pub fn window(&self) -> usize {
        self.window
    }
    /// The retransmission timeout now.
    pub fn rto(&self) -> Duration {
        self.rto
    }
    /// Counters.
    pub fn stats(&self) -> &AoeStats {
        &self.stats
    }
    /// Requests not yet finished.
    pub fn outstanding(&self) -> usize {
        self.reqs.iter().filter(|r| r.in_use).count()
    }

    /// When [`Initiator::poll`] next has something to do: a discovery resend, a frame's
    /// retransmission, a request's bound; none while nothing is outstanding.
    pub fn next_due(&self) -> Option<Instant> {
        match self.phase {
            Phase::Discover | Phase::Identify => Some(
                self.probe_at
                    .map_or_else(Instant::now, |t| t + self.backoff(self.probe_tries)),
            ),
            Phase::Ready => {
                let frames = self.frames[..self.window]
                    .iter()
                    .filter(|f| f.in_use)
                    .map(|f| f.sent_at + self.backoff(u32::from(f.tries)));
                let bounds = self
                    .reqs
                    .iter()
                    .filter(|r| r.in_use)
                    .map(|r| r.started + self.cfg.fail_after);
                frames.chain(bounds).min()
            }
        }
    }

    /// Takes request `id`: `sectors` sectors from `lba`, read or written.
    pub fn submit(
        &mut self,
        id: u16,
        write: bool,
        lba: u64,
        sectors: u32,
        now: Instant,
    ) -> Result<(), AoeSubmitError> {
        let kind = if write { Kind::Write } else { Kind::Read };
        if sectors == 0
            || lba
                .checked_add(u64::from(sectors))
                .is_none_or(|e| e > self.disk_sectors)
        {
            return Err(AoeSubmitError::Range);
        }
        self.take(id, kind, lba, sectors, now)
    }

    /// Takes request `id`: a cache flush.
    pub fn submit_flush(&mut self, id: u16, now: Instant) -> Result<(), AoeSubmitError> {
        if !self.flush {
            return Err(AoeSubmitError::NoFlush);
        }
        self.take(id, Kind::Flush, 0, 0, now)
    }

    fn take(
        &mut self,
        id: u16,
        kind: Kind,
        lba: u64,
        sectors: u32,
        now: Instant,
    ) -> Result<(), AoeSubmitError> {
        if self.phase != Phase::Ready {
            return Err(AoeSubmitError::NotReady);
        }
        let Some(r) = self.reqs.get_mut(usize::from(id)) else {
            return Err(AoeSubmitError::BadId);
        };
        if r.in_use {
            return Err(AoeSubmitError::BadId);
        }
        *r = Req {
            in_use: true,
            kind,
            lba,
            sectors,
            sent: 0,
            answered: 0,
            started: now,
            on_wire: 0,
        };
        self.order.push_back(id);
        self.stats.requests += 1;
        Ok(())
    }

    /// Does what time asks: discovery's sends, retransmissions, requests failed past
    /// their bound, and new frames while the target has buffers free. Returns the
    /// frames sent.
    pub fn poll(&mut self, now: Instant, io: &mut impl AoeIo) -> usize {
        match self.phase {
            Phase::Discover | Phase::Identify => self.probe(now, io),
            Phase::Ready => {
                self.expire(now, io);
                self.retransmit(now, io) + self.fill(now, io)
            }
        }
    }

    /// Sends the config query or the identify if it is due.
    fn probe(&mut self, now: Instant, io: &mut impl AoeIo) -> usize {
        if self
            .probe_at
            .is_some_and(|t| now.duration_since(t) < self.backoff(self.probe_tries))
        {
            return 0;
        }
        self.seq = self.seq.wrapping_add(1);
        // Discovery's tags have the top bit set: no frame's has it.
        self.probe_tag = 0x8000_0000 | self.prefix() | u32::from(self.seq);
        let n = match (self.phase, self.target) {
            (Phase::Identify, Some(t)) => aoe::ata_request(
                &mut self.buf,
                self.cfg.me,
                &t,
                self.probe_tag,
                AtaCmd::Identify,
            ),
            _ => aoe::config_query(
                &mut self.buf,
                self.cfg.me,
                [0xff; 6],
                self.cfg.major,
                self.cfg.minor,
                self.probe_tag,
            ),
        };
        if !io.send(&self.buf[..n]) {
            self.stats.send_busy += 1;
            return 0;
        }
        self.probe_at = Some(now);
        self.probe_tries = self.probe_tries.saturating_add(1);
        self.stats.discovery += 1;
        1
    }

    /// The tag bits naming this initiator.
    fn prefix(&self) -> u32 {
        u32::from(self.cfg.tag_prefix & 0x7f) << 24
    }

    /// The initiator an answer's tag names (its bits 24–30), for whoever dispatches
    /// answers among several.
    pub fn tag_prefix_of(head: &[u8]) -> Option<u8> {
        head.get(20).map(|b| b & 0x7f)
    }

    /// The timeout of a frame sent `tries` times.
    fn backoff(&self, tries: u32) -> Duration {
        let shift = tries.saturating_sub(1).min(10);
        (self.rto * (1 << shift)).min(self.cfg.rto_max)
    }

    /// Fails every request outstanding past the bound.
    fn expire(&mut self, now: Instant, io: &mut impl AoeIo) {
        for id in 0..self.reqs.len() {
            let r = self.reqs[id];
            if r.in_use && now.duration_since(r.started) > self.cfg.fail_after {
                self.stats.timed_out += 1;
                self.finish(id as u16, false, io);
            }
        }
    }

    /// Ends request `id`: its frames leave the wire, it leaves the queue, its caller
    /// is told.
    fn finish(&mut self, id: u16, ok: bool, io: &mut impl AoeIo) {
        for f in self.frames.iter_mut().filter(|f| f.in_use && f.req == id) {
            f.in_use = false;
        }
        self.order.retain(|&r| r != id);
        self.reqs[usize::from(id)].in_use = false;
        // Failures are counted by the caller, as errors or timeouts.
        if ok {
            self.stats.completed += 1;
        }
        io.done(id, ok);
    }

    /// Sends again each frame whose answer is overdue (or that the link refused).
    fn retransmit(&mut self, now: Instant, io: &mut impl AoeIo) -> usize {
        let mut n = 0;
        for i in 0..self.frames.len().min(self.window) {
            let f = self.frames[i];
            if !f.in_use {
                continue;
            }
            let due = f.unsent || now.duration_since(f.sent_at) >= self.backoff(u32::from(f.tries));
            if due && self.send_frame(i, now, io) {
                n += 1;
            }
        }
        n
    }

    /// Hands the next sectors of queued requests to free frame slots.
    fn fill(&mut self, now: Instant, io: &mut impl AoeIo) -> usize {
        let mut n = 0;
        while let Some(&id) = self.order.front() {
            let Some(slot) = self.frames[..self.window].iter().position(|f| !f.in_use) else {
                break;
            };
            let r = &mut self.reqs[usize::from(id)];
            let count = if r.kind == Kind::Flush {
                0
            } else {
                (r.sectors - r.sent).min(u32::from(self.per_frame)) as u8
            };
            self.frames[slot] = Frame {
                in_use: true,
                req: id,
                first: r.sent,
                count,
                seq: 0,
                sent_at: now,
                tries: 0,
                unsent: true,
            };
            r.sent += u32::from(count);
            r.on_wire += 1;
            if r.sent >= r.sectors {
                self.order.pop_front();
            }
            if self.send_frame(slot, now, io) {
                n += 1;
            }
        }
        n
    }

    /// Builds and sends frame `i` with a new tag; false if the link refused it or its
    /// request could not be read (then failed).
    fn send_frame(&mut self, i: usize, now: Instant, io: &mut impl AoeIo) -> bool {
        let Some(t) = self.target else {
            return false;
        };
        let f = self.frames[i];
        let r = self.reqs[usize::from(f.req)];
        let lba = r.lba + u64::from(f.first);
        let cmd = match r.kind {
            Kind::Read => AtaCmd::Read {
                lba,
                count: f.count,
            },
            Kind::Write => AtaCmd::Write {
                lba,
                count: f.count,
            },
            Kind::Flush => AtaCmd::Flush,
        };
        self.seq = self.seq.wrapping_add(1);
        let tag = self.prefix() | (i as u32) << 16 | u32::from(self.seq);
        let len = aoe::ata_request(&mut self.buf, self.cfg.me, &t, tag, cmd);
        if r.kind == Kind::Write {
            let bytes = usize::from(f.count) * SECTOR;
            let off = f.first as usize * SECTOR;
            if !io.fetch(f.req, off, &mut self.buf[ATA_DATA..ATA_DATA + bytes]) {
                self.stats.errors += 1;
                self.finish(f.req, false, io);
                return false;
            }
        }
        if !io.send(&self.buf[..len]) {
            self.stats.send_busy += 1;
            self.frames[i].unsent = true;
            return false;
        }
        let fr = &mut self.frames[i];
        if fr.tries == 0 {
            self.stats.frames += 1;
        } else {
            self.stats.retransmits += 1;
        }
        fr.seq = self.seq;
        fr.sent_at = now;
        fr.tries = fr.tries.saturating_add(1);
        fr.unsent = false;
        true
    }

    /// Takes a frame of `len` bytes from the wire, of which `head` is the first
    /// `min(len, aoe::HEAD)` bytes, copied out (the rest stays where it arrived, for
    /// [`AoeIo::place`]). Anything but a well-formed answer to a live send is counted and
    /// dropped.
    pub fn input(
        &mut self,
        head: &[u8],
        len: usize,
        now: Instant,
        io: &mut impl AoeIo,
    ) -> Result<(), BadFrame> {
        let r = self.accept(head, len, now, io);
        if let Err(e) = r {
            self.stats.dropped.add(e);
        }
        r
    }

    fn accept(
        &mut self,
        head: &[u8],
        len: usize,
        now: Instant,
        io: &mut impl AoeIo,
    ) -> Result<(), BadFrame> {
        let rep = aoe::parse_head(head, len)?;
        if rep.dst != self.cfg.me {
            return Err(BadFrame::WrongSource);
        }
        match self.phase {
            Phase::Discover => {
                let Body::Config(c) = rep.body else {
                    return Err(BadFrame::UnknownTag);
                };
                let addr_ok = (self.cfg.major == MAJOR_ANY || rep.major == self.cfg.major)
                    && (self.cfg.minor == MINOR_ANY || rep.minor == self.cfg.minor);
                if !addr_ok || rep.aoe_error.is_some() {
                    return Err(BadFrame::WrongSource);
                }
                if rep.tag != self.probe_tag {
                    return Err(BadFrame::Stale);
                }
                self.target = Some(Target {
                    mac: rep.src,
                    major: rep.major,
                    minor: rep.minor,
                });
                self.window = usize::from(c.buffers).clamp(1, MAX_WINDOW);
                let offered = if c.sectors == 0 { 2 } else { c.sectors };
                self.per_frame = offered.min(aoe::sectors_per_frame(self.cfg.mtu)).max(1);
                self.phase = Phase::Identify;
                self.probe_at = None;
                self.probe_tries = 0;
                self.stats.answers += 1;
                Ok(())
            }
            Phase::Identify | Phase::Ready => {
                let t = self.target.ok_or(BadFrame::WrongSource)?;
                if rep.src != t.mac || rep.major != t.major || rep.minor != t.minor {
                    return Err(BadFrame::WrongSource);
                }
                let Body::Ata(a) = rep.body else {
                    return Err(BadFrame::UnknownTag);
                };
                if self.phase == Phase::Identify {
                    if rep.tag != self.probe_tag {
                        return Err(BadFrame::Stale);
                    }
                    if rep.aoe_error.is_some() || a.failed() {
                        return Err(BadFrame::Mismatch);
                    }
                    let (sectors, flush) = aoe::identify(a.data).ok_or(BadFrame::Mismatch)?;
                    self.disk_sectors = sectors;
                    self.flush = flush;
                    self.phase = Phase::Ready;
                    self.stats.answers += 1;
                    return Ok(());
                }
                self.answer(rep.tag, rep.aoe_error, a, now, io)
            }
        }
    }

    /// An ATA answer from the target, matched against the frame its tag names.
    fn answer(
        &mut self,
        tag: u32,
        aoe_error: Option<u8>,
        a: aoe::AtaReply<'_>,
        now: Instant,
        io: &mut impl AoeIo,
    ) -> Result<(), BadFrame> {
        let i = (tag >> 16 & 0xff) as usize;
        if i >= self.window || tag & 0xff00_0000 != self.prefix() {
            return Err(BadFrame::UnknownTag);
        }
        let f = self.frames[i];
        if !f.in_use || f.unsent || f.seq != tag as u16 {
            return Err(BadFrame::Stale);
        }
        let r = self.reqs[usize::from(f.req)];
        let id = f.req;
        if aoe_error.is_some() || a.failed() {
            self.stats.answers += 1;
            self.stats.errors += 1;
            self.finish(id, false, io);
            return Ok(());
        }
        let lba = r.lba + u64::from(f.first);
        let bytes = usize::from(f.count) * SECTOR;
        if r.kind != Kind::Flush && (a.lba != lba || r.kind == Kind::Read && a.data_len < bytes) {
            return Err(BadFrame::Mismatch);
        }
        if r.kind == Kind::Read && !io.place(id, f.first as usize * SECTOR, ATA_DATA, bytes) {
            self.stats.answers += 1;
            self.stats.errors += 1;
            self.finish(id, false, io);
            return Ok(());
        }
        // Karn: only a frame sent once measures the round trip.
        if f.tries == 1 {
            self.sample(now.duration_since(f.sent_at));
        }
        self.stats.answers += 1;
        self.frames[i].in_use = false;
        let req = &mut self.reqs[usize::from(id)];
        req.answered += u32::from(f.count);
        req.on_wire -= 1;
        if req.answered >= req.sectors && req.sent >= req.sectors && req.on_wire == 0 {
            self.finish(id, true, io);
        }
        Ok(())
    }

    /// Jacobson's estimator: `rto = srtt + 4 · rttvar`, within the configured bounds.
    fn sample(&mut self, rtt: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(rtt);
                self.rttvar = (self.rttvar * 3 + diff) / 4;
                self.srtt = Some((s * 7 + rtt) / 8);
            }
        }
        let s = self.srtt.unwrap_or(rtt);
        self.rto = (s + self.rttvar * 4).clamp(self.cfg.rto_min, self.cfg.rto_max);
    }
}
