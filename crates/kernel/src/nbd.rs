//! The guest's own NBD client (paper 002's NBD baseline): the block layer's requests
//! carried by the guest's TCP stack to a remote `nbd-server` or `nbdkit`, every block
//! through the socket buffer.
//!
//! Fixed newstyle negotiation with `NBD_OPT_GO`, then the transmission phase with
//! simple replies (`NBD_CMD_READ`, `WRITE`, `FLUSH`, `DISC`), several requests in
//! flight, each under a handle naming its slot and its use of it. A read's data is
//! copied from the socket's buffer straight into the bio's pages: the one copy the
//! paper blames on NBD beside the stack's own work.
//!
//! The server is hostile: a reply whose magic is wrong, whose handle names no request
//! in flight (or an earlier use of a slot), an option reply longer than any real one,
//! or a connection that ends in the middle of a reply breaks the connection; every
//! request in flight then completes with an error, so no caller waits for ever.

use blk::blkfront::{Bio, BioOp, BioSeg, Completion, SubmitError};
use blk::blkif::{BLKIF_RSP_ERROR, BLKIF_RSP_OKAY, SECTOR_SIZE};
use hv::profile::{enter, Class};
use hv::Domain;
use smoltcp::socket::tcp;

/// The server's greeting magic (`NBDMAGIC`).
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// The option magic (`IHAVEOPT`).
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// An option reply's magic.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// A request's magic.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// A simple reply's magic.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Handshake flag: fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
/// Handshake flag: no zero padding after the export's data.
pub const FLAG_NO_ZEROES: u16 = 2;
/// `NBD_OPT_GO`.
pub const OPT_GO: u32 = 7;
/// `NBD_REP_ACK`.
pub const REP_ACK: u32 = 1;
/// `NBD_REP_INFO`.
pub const REP_INFO: u32 = 3;
/// `NBD_INFO_EXPORT`.
pub const INFO_EXPORT: u16 = 0;
/// Transmission flag: the export is read-only.
pub const FLAG_READ_ONLY: u16 = 2;
/// Transmission flag: the server takes `NBD_CMD_FLUSH`.
pub const FLAG_SEND_FLUSH: u16 = 4;
/// `NBD_CMD_READ`.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// The longest option reply taken (a real one is a few dozen bytes).
pub const MAX_OPTION_REPLY: u32 = 4096;
/// Requests in flight at most.
pub const SLOTS: usize = 32;

/// Why the connection was given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NbdError {
    /// A magic number other than the protocol's.
    #[error("bad magic")]
    BadMagic,
    /// The server does not speak fixed newstyle.
    #[error("not fixed newstyle")]
    OldStyle,
    /// An option reply for another option, or longer than any real one.
    #[error("bad option reply")]
    BadOptionReply,
    /// The server refused the export (an error reply to `NBD_OPT_GO`).
    #[error("export refused")]
    Refused,
    /// `NBD_OPT_GO` was acknowledged without the export's size.
    #[error("no export size")]
    NoSize,
    /// A reply whose handle names no request in flight.
    #[error("reply to no request in flight")]
    UnknownHandle,
    /// The connection ended (in the middle of a reply, or at all).
    #[error("connection closed")]
    Closed,
}

/// What the client counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NbdStats {
    /// Requests sent.
    pub requests: u64,
    /// Replies taken.
    pub replies: u64,
    /// Replies with an error.
    pub errors: u64,
    /// Bytes copied from the socket buffer into the block layer's pages.
    pub read_bytes: u64,
    /// Bytes copied from the block layer's pages into the socket buffer.
    pub write_bytes: u64,
    /// Requests failed because the connection broke.
    pub failed_by_break: u64,
}

hv::counter_set!(NbdStats {
    requests,
    replies,
    errors,
    read_bytes,
    write_bytes,
    failed_by_break,
});

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the server's greeting (18 bytes).
    Greeting,
    /// `NBD_OPT_GO` sent; an option reply's header (20 bytes) or its data next.
    Options,
    /// Serving requests.
    Ready,
    /// Given up.
    Broken(NbdError),
}

#[derive(Debug)]
struct Slot {
    busy: bool,
    /// Bumped at each use: a reply must name the current one.
    generation: u16,
    tag: u64,
    cmd: u16,
    segs: Vec<BioSeg>,
    len: u32,
}

/// What the receive side is taking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rx {
    /// `want` bytes of a header into `head`.
    Header { want: usize },
    /// An option reply's data: `left` bytes, the first `keep` kept in `head`.
    OptionData { kind: u32, left: usize },
    /// A read's data for slot `slot`: `done` of its bytes placed.
    Payload { slot: usize, done: usize },
}

/// One NBD connection's client side.
#[derive(Debug)]
pub struct NbdClient {
    export: String,
    phase: Phase,
    rx: Rx,
    head: [u8; 32],
    have: usize,
    size: u64,
    flags: u16,
    no_zeroes: bool,
    slots: Vec<Slot>,
    free: Vec<u16>,
    done: Vec<Completion>,
    stats: NbdStats,
}

impl NbdClient {
    /// A client for export `export`, before the greeting.
    pub fn new(export: &str) -> Self {
        Self {
            export: export.to_string(),
            phase: Phase::Greeting,
            rx: Rx::Header { want: 18 },
            head: [0; 32],
            have: 0,
            size: 0,
            flags: 0,
            no_zeroes: false,
            slots: (0..SLOTS)
                .map(|_| Slot {
                    busy: false,
                    generation: 0,
                    tag: 0,
                    cmd: 0,
                    segs: Vec::with_capacity(32),
                    len: 0,
                })
                .collect(),
            free: (0..SLOTS as u16).rev().collect(),
            done: Vec::with_capacity(SLOTS),
            stats: NbdStats::default(),
        }
    }

    /// Whether the export is open for requests.
    pub fn is_ready(&self) -> bool {
        self.phase == Phase::Ready
    }
    /// Why the connection was given up, if it was.
    pub fn broken(&self) -> Option<NbdError> {
        match self.phase {
            Phase::Broken(e) => Some(e),
            _ => None,
        }
    }
    /// The export's size in sectors.
    pub fn sectors(&self) -> u64 {
        self.size / SECTOR_SIZE
    }
    /// Counters.
    pub fn stats(&self) -> &NbdStats {
        &self.stats
    }
    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        SLOTS - self.free.len()
    }

    /// Hands each finished request's completion to `f`.
    pub fn take_completions(&mut self, mut f: impl FnMut(Completion)) -> usize {
        let n = self.done.len();
        for c in self.done.drain(..) {
            f(c);
        }
        n
    }

    /// Gives up: every request in flight completes with an error.
    fn fail(&mut self, e: NbdError) {
        self.phase = Phase::Broken(e);
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.busy {
                s.busy = false;
                self.free.push(i as u16);
                self.stats.failed_by_break += 1;
                self.done.push(Completion {
                    tag: s.tag,
                    status: BLKIF_RSP_ERROR,
                });
            }
        }
    }

    /// Takes what the socket has and acts on it (the negotiation's next step, replies,
    /// read data into the bio's pages). Returns whether anything moved.
    pub fn recv(&mut self, sock: &mut tcp::Socket<'_>, dom: &Domain) -> bool {
        let mut moved = false;
        loop {
            if matches!(self.phase, Phase::Broken(_)) {
                return moved;
            }
            if !sock.can_recv() {
                // Nothing to take. A connection that has ended with the negotiation
                // unfinished, a reply half taken or requests in flight is a break.
                let ended = matches!(
                    sock.state(),
                    tcp::State::CloseWait
                        | tcp::State::Closed
                        | tcp::State::LastAck
                        | tcp::State::TimeWait
                        | tcp::State::Closing
                );
                let mid = self.phase != Phase::Ready
                    || self.in_flight() > 0
                    || self.have > 0
                    || !matches!(self.rx, Rx::Header { .. });
                if ended && mid {
                    self.fail(NbdError::Closed);
                }
                return moved;
            }
            let step = match self.rx {
                Rx::Header { want } => {
                    let have = self.have;
                    let got = sock.recv_slice(&mut self.head[have..want]).unwrap_or(0);
                    self.have += got;
                    if self.have < want {
                        return moved || got > 0;
                    }
                    self.have = 0;
                    self.header(sock)
                }
                Rx::OptionData { kind, left } => {
                    // INFO_EXPORT's 12 bytes are kept; anything else is skipped.
                    let keep = if kind == REP_INFO { 12 } else { 0 };
                    let at = self.have;
                    let mut scratch = [0u8; 256];
                    let take = left.min(scratch.len());
                    let got = sock.recv_slice(&mut scratch[..take]).unwrap_or(0);
                    for (k, &b) in scratch[..got].iter().enumerate() {
                        if at + k < keep {
                            self.head[at + k] = b;
                        }
                    }
                    self.have += got;
                    let left = left - got;
                    if left > 0 {
                        self.rx = Rx::OptionData { kind, left };
                        return moved || got > 0;
                    }
                    let n = self.have;
                    self.have = 0;
                    if kind == REP_INFO && n >= 12 {
                        let info = u16::from_be_bytes([self.head[0], self.head[1]]);
                        if info == INFO_EXPORT {
                            self.size = be64(&self.head[2..10]);
                            self.flags = u16::from_be_bytes([self.head[10], self.head[11]]);
                        }
                    }
                    self.rx = Rx::Header { want: 20 };
                    Ok(())
                }
                Rx::Payload { slot, done } => self.payload(sock, dom, slot, done),
            };
            moved = true;
            if let Err(e) = step {
                self.fail(e);
            }
        }
    }

    /// A complete header in `head` for the phase.
    fn header(&mut self, sock: &mut tcp::Socket<'_>) -> Result<(), NbdError> {
        match self.phase {
            Phase::Greeting => {
                if be64(&self.head[..8]) != NBDMAGIC || be64(&self.head[8..16]) != IHAVEOPT {
                    return Err(NbdError::BadMagic);
                }
                let hflags = u16::from_be_bytes([self.head[16], self.head[17]]);
                if hflags & FLAG_FIXED_NEWSTYLE == 0 {
                    return Err(NbdError::OldStyle);
                }
                self.no_zeroes = hflags & FLAG_NO_ZEROES != 0;
                let cflags = u32::from(FLAG_FIXED_NEWSTYLE)
                    | if self.no_zeroes {
                        u32::from(FLAG_NO_ZEROES)
                    } else {
                        0
                    };
                // NBD_OPT_GO: the export's name, no information requests.
                let name = self.export.as_bytes();
                let mut m = [0u8; 4 + 16 + 4 + 256 + 2];
                m[..4].copy_from_slice(&cflags.to_be_bytes());
                m[4..12].copy_from_slice(&IHAVEOPT.to_be_bytes());
                m[12..16].copy_from_slice(&OPT_GO.to_be_bytes());
                let name = &name[..name.len().min(256)];
                let data_len = 4 + name.len() + 2;
                m[16..20].copy_from_slice(&(data_len as u32).to_be_bytes());
                m[20..24].copy_from_slice(&(name.len() as u32).to_be_bytes());
                m[24..24 + name.len()].copy_from_slice(name);
                let end = 24 + name.len() + 2;
                if sock.send_slice(&m[..end]).ok() != Some(end) {
                    return Err(NbdError::Closed);
                }
                self.phase = Phase::Options;
                self.rx = Rx::Header { want: 20 };
                Ok(())
            }
            Phase::Options => {
                if be64(&self.head[..8]) != OPT_REPLY_MAGIC {
                    return Err(NbdError::BadMagic);
                }
                let option = be32(&self.head[8..12]);
                let kind = be32(&self.head[12..16]);
                let len = be32(&self.head[16..20]);
                if option != OPT_GO || len > MAX_OPTION_REPLY {
                    return Err(NbdError::BadOptionReply);
                }
                if kind & 0x8000_0000 != 0 {
                    return Err(NbdError::Refused);
                }
                if kind == REP_ACK {
                    if self.size == 0 {
                        return Err(NbdError::NoSize);
                    }
                    self.phase = Phase::Ready;
                    self.rx = Rx::Header { want: 16 };
                    return Ok(());
                }
                self.rx = if len == 0 {
                    Rx::Header { want: 20 }
                } else {
                    Rx::OptionData {
                        kind,
                        left: len as usize,
                    }
                };
                Ok(())
            }
            Phase::Ready => {
                if be32(&self.head[..4]) != SIMPLE_REPLY_MAGIC {
                    return Err(NbdError::BadMagic);
                }
                let error = be32(&self.head[4..8]);
                let handle = be64(&self.head[8..16]);
                let slot = (handle & 0xffff) as usize;
                let generation = (handle >> 16) as u16;
                let ok = handle >> 32 == 0
                    && self
                        .slots
                        .get(slot)
                        .is_some_and(|s| s.busy && s.generation == generation);
                if !ok {
                    return Err(NbdError::UnknownHandle);
                }
                self.stats.replies += 1;
                let s = &self.slots[slot];
                if error == 0 && s.cmd == CMD_READ && s.len > 0 {
                    self.rx = Rx::Payload { slot, done: 0 };
                    return Ok(());
                }
                // No payload follows an error (simple replies to reads included).
                self.finish(slot, error == 0);
                self.rx = Rx::Header { want: 16 };
                Ok(())
            }
            Phase::Broken(e) => Err(e),
        }
    }

    /// A read's data from the socket's buffer straight into its bio's pages.
    fn payload(
        &mut self,
        sock: &mut tcp::Socket<'_>,
        dom: &Domain,
        slot: usize,
        done: usize,
    ) -> Result<(), NbdError> {
        let _c = enter(Class::UserCopy);
        let s = &self.slots[slot];
        let total = s.len as usize;
        let segs = &s.segs;
        let placed = sock
            .recv(|buf| {
                let n = buf.len().min(total - done);
                let mut at = done;
                let mut k = 0;
                // Walk the segments from byte `done`.
                let mut base = 0usize;
                for seg in segs {
                    let len = usize::from(seg.len);
                    if at < base + len && k < n {
                        let rel = at - base;
                        let m = (len - rel).min(n - k);
                        let _ = dom.write(seg.gfn, usize::from(seg.offset) + rel, &buf[k..k + m]);
                        k += m;
                        at += m;
                    }
                    base += len;
                }
                (n, n)
            })
            .unwrap_or(0);
        self.stats.read_bytes += placed as u64;
        let done = done + placed;
        if done < total {
            self.rx = Rx::Payload { slot, done };
            return Ok(());
        }
        self.finish(slot, true);
        self.rx = Rx::Header { want: 16 };
        Ok(())
    }

    fn finish(&mut self, slot: usize, ok: bool) {
        let s = &mut self.slots[slot];
        s.busy = false;
        self.free.push(slot as u16);
        if !ok {
            self.stats.errors += 1;
        }
        self.done.push(Completion {
            tag: s.tag,
            status: if ok { BLKIF_RSP_OKAY } else { BLKIF_RSP_ERROR },
        });
    }

    /// Sends `bio` under `tag`: the request's header and, for a write, its data copied
    /// from the bio's pages into the socket's buffer. `Busy` if no slot is free or the
    /// socket has no room for the whole request yet.
    pub fn submit(
        &mut self,
        sock: &mut tcp::Socket<'_>,
        dom: &Domain,
        tag: u64,
        bio: &Bio<'_>,
    ) -> Result<(), SubmitError> {
        if !self.is_ready() {
            return Err(if matches!(self.phase, Phase::Broken(_)) {
                SubmitError::Disconnected
            } else {
                SubmitError::Busy
            });
        }
        let len: u32 = bio.segs.iter().map(|s| u32::from(s.len)).sum();
        let (cmd, len) = match bio.op {
            BioOp::Read => (CMD_READ, len),
            BioOp::Write if self.flags & FLAG_READ_ONLY != 0 => {
                return Err(SubmitError::NotOffered)
            }
            BioOp::Write => (CMD_WRITE, len),
            BioOp::Flush if self.flags & FLAG_SEND_FLUSH != 0 => (CMD_FLUSH, 0),
            BioOp::Flush | BioOp::Discard { .. } => return Err(SubmitError::NotOffered),
        };
        let end = bio
            .sector
            .checked_mul(SECTOR_SIZE)
            .and_then(|o| o.checked_add(u64::from(len)));
        if end.is_none_or(|e| e > self.size) {
            return Err(SubmitError::BeyondDevice);
        }
        let need = 28 + if cmd == CMD_WRITE { len as usize } else { 0 };
        if sock.send_capacity() - sock.send_queue() < need {
            return Err(SubmitError::Busy);
        }
        let Some(slot) = self.free.pop() else {
            return Err(SubmitError::Busy);
        };
        let s = &mut self.slots[usize::from(slot)];
        s.busy = true;
        s.generation = s.generation.wrapping_add(1);
        s.tag = tag;
        s.cmd = cmd;
        s.len = len;
        s.segs.clear();
        s.segs.extend_from_slice(bio.segs);
        let handle = u64::from(s.generation) << 16 | u64::from(slot);
        let mut h = [0u8; 28];
        h[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h[6..8].copy_from_slice(&cmd.to_be_bytes());
        h[8..16].copy_from_slice(&handle.to_be_bytes());
        h[16..24].copy_from_slice(&(bio.sector * SECTOR_SIZE).to_be_bytes());
        h[24..28].copy_from_slice(&len.to_be_bytes());
        let _ = sock.send_slice(&h);
        if cmd == CMD_WRITE {
            let _c = enter(Class::UserCopy);
            for seg in bio.segs {
                let mut left = usize::from(seg.len);
                let mut off = usize::from(seg.offset);
                while left > 0 {
                    let n = sock
                        .send(|buf| {
                            let n = buf.len().min(left);
                            let _ = dom.read(seg.gfn, off, &mut buf[..n]);
                            (n, n)
                        })
                        .unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    left -= n;
                    off += n;
                }
            }
            self.stats.write_bytes += u64::from(len);
        }
        self.stats.requests += 1;
        Ok(())
    }

    /// Says goodbye (`NBD_CMD_DISC`) if the export is open.
    pub fn disconnect(&mut self, sock: &mut tcp::Socket<'_>) {
        if self.is_ready() && sock.can_send() {
            let mut h = [0u8; 28];
            h[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
            h[6..8].copy_from_slice(&CMD_DISC.to_be_bytes());
            let _ = sock.send_slice(&h);
        }
    }
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

fn be32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_be_bytes(a)
}
