//! The AoE initiator against a target played in the test, as `vblade` answers (its
//! config reply, identify, `READ`/`WRITE SECTORS EXT`, two sectors a frame, sixteen
//! buffers), on a clock the test moves: requests split into frames and come back whole;
//! lost frames are sent again; a dead target's requests fail after the bound and later
//! ones complete once it is back; and no hostile answer puts a byte anywhere but where
//! a live frame's sectors belong.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use blk::aoe::{self, BadFrame, AOE_HEADER_END, ATA_DATA, CMD_CONFIG, SECTOR};
use blk::initiator::{AoeIo, Initiator, InitiatorConfig, Phase};

mod common;

use common::{disk_byte, Target, ME, SECTORS, TARGET};

/// The memory of each request, what was sent, what finished.
#[derive(Default)]
struct Io {
    mem: Vec<Vec<u8>>,
    wire: VecDeque<Vec<u8>>,
    done: Vec<(u16, bool)>,
    /// Every placement: (request, offset, length).
    placed: Vec<(u16, usize, usize)>,
    refuse_sends: bool,
    /// The frame being taken in.
    frame: Vec<u8>,
}

impl AoeIo for Io {
    fn send(&mut self, frame: &[u8]) -> bool {
        if self.refuse_sends {
            return false;
        }
        self.wire.push_back(frame.to_vec());
        true
    }
    fn fetch(&mut self, req: u16, offset: usize, buf: &mut [u8]) -> bool {
        let m = &self.mem[usize::from(req)];
        buf.copy_from_slice(&m[offset..offset + buf.len()]);
        true
    }
    fn place(&mut self, req: u16, offset: usize, at: usize, len: usize) -> bool {
        self.placed.push((req, offset, len));
        self.mem[usize::from(req)][offset..offset + len].copy_from_slice(&self.frame[at..at + len]);
        true
    }
    fn done(&mut self, req: u16, ok: bool) {
        self.done.push((req, ok));
    }
}

struct Rig {
    ini: Initiator,
    io: Io,
    target: Target,
    t0: Instant,
    now: Duration,
}

impl Rig {
    fn new() -> Self {
        Self::with(InitiatorConfig::new(ME, 1, 2), 2)
    }

    /// An initiator set up as `cfg` and a target of `per_frame` sectors a frame, the
    /// target found.
    fn with(cfg: InitiatorConfig, per_frame: u8) -> Self {
        let mut target = Target::new();
        target.per_frame = per_frame;
        let mut r = Self {
            ini: Initiator::new(cfg, 32),
            io: Io {
                mem: vec![vec![0u8; 128 * 1024]; 32],
                ..Io::default()
            },
            target,
            t0: Instant::now(),
            now: Duration::ZERO,
        };
        r.run(Duration::from_millis(1));
        assert_eq!(r.ini.phase(), Phase::Ready);
        r
    }

    fn at(&self) -> Instant {
        self.t0 + self.now
    }

    /// Polls and delivers every answer, `steps` times `dt` apart.
    fn run(&mut self, dt: Duration) {
        for _ in 0..50 {
            let at = self.at();
            self.ini.poll(at, &mut self.io);
            while let Some(f) = self.io.wire.pop_front() {
                if let Some(a) = self.target.answer(&f) {
                    let at = self.at();
                    let _ = input(&mut self.ini, &mut self.io, &a, at);
                }
            }
            self.now += dt;
        }
    }
}

/// Hands `f` to the initiator as a receiver does: its head copied out, the rest left in
/// the frame for placement.
fn input(ini: &mut Initiator, io: &mut Io, f: &[u8], now: Instant) -> Result<(), BadFrame> {
    io.frame = f.to_vec();
    let head = f[..f.len().min(aoe::HEAD)].to_vec();
    ini.input(&head, f.len(), now, io)
}

#[test]
fn discovery_finds_the_target_and_requests_come_back_whole_over_many_frames() {
    let mut r = Rig::new();
    assert_eq!(r.ini.target().map(|t| t.mac), Some(TARGET));
    assert_eq!(
        (r.ini.sectors(), r.ini.window(), r.ini.sectors_per_frame()),
        (SECTORS, 16, 2)
    );
    assert!(!r.ini.flushes(), "vblade does not say it flushes");
    // A 74-sector read (the paper's 37,601-byte response, rounded up to sectors) and a
    // 256-sector write at once.
    let now = r.at();
    r.ini.submit(0, false, 100, 74, now).expect("read");
    for (i, b) in r.io.mem[1].iter_mut().enumerate().take(256 * SECTOR) {
        *b = (i % 253) as u8;
    }
    r.ini.submit(1, true, 1000, 256, now).expect("write");
    r.run(Duration::from_micros(50));
    r.io.done.sort();
    assert_eq!(r.io.done, vec![(0, true), (1, true)]);
    let want: Vec<u8> = (100 * SECTOR..174 * SECTOR).map(disk_byte).collect();
    assert_eq!(&r.io.mem[0][..74 * SECTOR], &want[..]);
    assert_eq!(
        &r.target.disk[1000 * SECTOR..1256 * SECTOR],
        &r.io.mem[1][..256 * SECTOR]
    );
    let s = r.ini.stats();
    assert_eq!(s.frames, 37 + 128);
    assert_eq!((s.retransmits, s.completed, s.errors), (0, 2, 0));
    assert_eq!(s.dropped.total(), 0);
}

/// A jumbo-frame link (MTU 9000) to a target that takes 17 sectors a frame: the
/// initiator's frame buffer follows the MTU, so a write's 8.5 KiB of sectors fit in it and
/// a read's come back whole.
#[test]
fn a_jumbo_frame_target_gets_frames_of_its_size_whole() {
    let mut cfg = InitiatorConfig::new(ME, 1, 2);
    cfg.mtu = 9000;
    let mut r = Rig::with(cfg, 17);
    assert_eq!(r.ini.sectors_per_frame(), 17);
    let now = r.at();
    for (i, b) in r.io.mem[1].iter_mut().enumerate().take(74 * SECTOR) {
        *b = (i % 251) as u8;
    }
    r.ini.submit(1, true, 1000, 74, now).expect("write");
    r.ini.submit(0, false, 100, 74, now).expect("read");
    r.run(Duration::from_micros(50));
    r.io.done.sort();
    assert_eq!(r.io.done, vec![(0, true), (1, true)]);
    let want: Vec<u8> = (100 * SECTOR..174 * SECTOR).map(disk_byte).collect();
    assert_eq!(&r.io.mem[0][..74 * SECTOR], &want[..]);
    assert_eq!(
        &r.target.disk[1000 * SECTOR..1074 * SECTOR],
        &r.io.mem[1][..74 * SECTOR]
    );
    // 74 sectors in frames of 17: five each way.
    assert_eq!(r.ini.stats().frames, 10);
}

#[test]
fn lost_frames_are_sent_again_and_a_dead_target_fails_requests_only_past_the_bound() {
    let mut r = Rig::new();
    r.target.drop_every = Some(5);
    let now = r.at();
    r.ini.submit(3, false, 0, 64, now).expect("read");
    r.run(Duration::from_millis(5));
    assert_eq!(r.io.done, vec![(3, true)]);
    assert!(r.ini.stats().retransmits > 0);
    let want: Vec<u8> = (0..64 * SECTOR).map(disk_byte).collect();
    assert_eq!(&r.io.mem[3][..64 * SECTOR], &want[..]);

    // The target dies: the request is retried, then fails after the bound (5 s).
    r.target.drop_every = None;
    r.target.alive = false;
    let now = r.at();
    r.ini.submit(4, false, 8, 8, now).expect("read");
    r.run(Duration::from_millis(50));
    assert_eq!(
        r.io.done,
        vec![(3, true)],
        "retried, not yet failed, at 2.5 s"
    );
    r.run(Duration::from_millis(100));
    assert_eq!(r.io.done.last(), Some(&(4, false)), "failed, not hung");
    assert_eq!(r.ini.stats().timed_out, 1);
    assert_eq!(r.ini.outstanding(), 0);
    // Back again: a new request completes, with the right bytes.
    r.target.alive = true;
    let now = r.at();
    r.ini.submit(4, false, 500, 10, now).expect("read");
    r.run(Duration::from_millis(5));
    assert_eq!(r.io.done.last(), Some(&(4, true)));
    let want: Vec<u8> = (500 * SECTOR..510 * SECTOR).map(disk_byte).collect();
    assert_eq!(&r.io.mem[4][..10 * SECTOR], &want[..]);
}

#[test]
fn hostile_answers_place_nothing_but_a_live_frames_exact_sectors() {
    let mut r = Rig::new();
    let now = r.at();
    r.ini.submit(7, false, 40, 2, now).expect("read");
    r.ini.poll(now, &mut r.io);
    let req = r.io.wire.pop_front().expect("a frame");
    let good = r.target.answer(&req).expect("answer");
    let mut bad = Vec::new();
    // Unknown tag (a slot past the window), a stale send of the right slot, from
    // another MAC, from another slot address, a short answer, the wrong LBA, a
    // request (not a response), a config reply now, a frame cut short.
    let mut x = good.clone();
    x[20] = 0x7f;
    bad.push((x, BadFrame::UnknownTag));
    let mut x = good.clone();
    x[23] ^= 0x55;
    bad.push((x, BadFrame::Stale));
    let mut x = good.clone();
    x[6..12].copy_from_slice(&[2, 9, 9, 9, 9, 9]);
    bad.push((x, BadFrame::WrongSource));
    let mut x = good.clone();
    x[18] = 3;
    bad.push((x, BadFrame::WrongSource));
    bad.push((good[..ATA_DATA + 700].to_vec(), BadFrame::Mismatch));
    let mut x = good.clone();
    x[AOE_HEADER_END + 4] ^= 1;
    bad.push((x, BadFrame::Mismatch));
    bad.push((req.clone(), BadFrame::NotResponse));
    let mut x = good[..AOE_HEADER_END].to_vec();
    x[19] = CMD_CONFIG;
    x.extend_from_slice(&[0, 16, 0, 0, 2, 0x10, 0, 0]);
    bad.push((x, BadFrame::UnknownTag));
    bad.push((good[..20].to_vec(), BadFrame::Short));
    for (f, why) in &bad {
        assert_eq!(input(&mut r.ini, &mut r.io, f, now), Err(*why));
    }
    assert!(r.io.placed.is_empty(), "no hostile answer placed a byte");
    assert!(r.io.done.is_empty());
    // The real answer, then it again (a duplicate), then an answer no one asked for.
    input(&mut r.ini, &mut r.io, &good, now).expect("the answer");
    assert_eq!(
        input(&mut r.ini, &mut r.io, &good, now),
        Err(BadFrame::Stale)
    );
    assert_eq!(r.io.placed, vec![(7, 0, 2 * SECTOR)]);
    assert_eq!(r.io.done, vec![(7, true)]);
    let want: Vec<u8> = (40 * SECTOR..42 * SECTOR).map(disk_byte).collect();
    assert_eq!(&r.io.mem[7][..2 * SECTOR], &want[..]);
    assert!(
        r.io.mem[7][2 * SECTOR..].iter().all(|&b| b == 0),
        "nothing past its sectors"
    );
    assert_eq!(r.ini.stats().dropped.total(), bad.len() as u64 + 1);
}

#[test]
fn a_link_that_refuses_frames_delays_them_without_losing_any() {
    let mut r = Rig::new();
    r.io.refuse_sends = true;
    let now = r.at();
    r.ini.submit(0, false, 0, 20, now).expect("read");
    r.run(Duration::from_micros(10));
    assert!(r.io.done.is_empty());
    assert!(r.ini.stats().send_busy > 0);
    r.io.refuse_sends = false;
    r.run(Duration::from_micros(10));
    assert_eq!(r.io.done, vec![(0, true)]);
    assert_eq!(r.ini.stats().frames, 10);
}
