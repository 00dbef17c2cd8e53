//! A remote virtual block device from one thread: the back end finds its disk over AoE,
//! publishes it, the guest's blkfront connects, and its reads and writes go to the
//! target and back through frames, answered when the target has answered; a guest that
//! reuses an id still in flight is refused without disturbing the first; a target that
//! dies fails the guest's requests after the bound.

mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use blk::aoe::{self, SECTOR};
use blk::blkback::{FrameAt, VBD_WINDOW_SLOTS};
use blk::blkfront::{Bio, BioOp, BioSeg, Blkfront, Completion};
use blk::blkif::{BLKIF_OP_READ, BLKIF_RSP_ERROR, BLKIF_RSP_OKAY};
use blk::initiator::InitiatorConfig;
use blk::remote::RemoteVbd;
use blk::xenbus;
use common::{disk_byte, host, rw, seg, Host, Hostile, Target, ME, SECTORS};

struct Rig {
    h: Host,
    vbd: RemoteVbd,
    target: Target,
    wire: VecDeque<Vec<u8>>,
    t0: Instant,
    now: Duration,
}

impl Rig {
    fn new(h: Host, guest: &hv::Domain, fail_after: Duration) -> Self {
        xenbus::create_vbd(h.hv.store(), h.drv.id(), guest.id(), 51712, false).expect("vbd");
        let mut cfg = InitiatorConfig::new(ME, 1, 2);
        cfg.fail_after = fail_after;
        let vbd = RemoteVbd::new(
            &h.hv,
            &h.drv,
            guest.id(),
            51712,
            VBD_WINDOW_SLOTS,
            cfg,
            true,
        );
        let mut r = Self {
            h,
            vbd,
            target: Target::new(),
            wire: VecDeque::new(),
            t0: Instant::now(),
            now: Duration::ZERO,
        };
        // Discovery and publishing.
        r.step(Duration::from_micros(100), 10);
        r
    }

    /// Polls the device, serves its ring, delivers the target's answers; `n` times, the
    /// clock moved `dt` each time.
    fn step(&mut self, dt: Duration, n: usize) {
        for _ in 0..n {
            let now = self.t0 + self.now;
            let wire = &mut self.wire;
            self.vbd.poll(now, |f| {
                wire.push_back(f.to_vec());
                true
            });
            self.vbd.serve();
            while let Some(f) = self.wire.pop_front() {
                let Some(a) = self.target.answer(&f) else {
                    continue;
                };
                let head = &a[..a.len().min(aoe::HEAD)];
                let wire = &mut self.wire;
                let _ = self.vbd.input(head, a.len(), FrameAt::Bytes(&a), now, |f| {
                    wire.push_back(f.to_vec());
                    true
                });
            }
            self.now += dt;
        }
    }
}

fn pages(g: &hv::Domain, n: usize) -> Vec<BioSeg> {
    (0..n)
        .map(|_| BioSeg {
            gfn: g.alloc_page().expect("page"),
            offset: 0,
            len: 4096,
        })
        .collect()
}

#[test]
fn a_remote_disk_is_found_published_and_served_through_aoe_frames() {
    let h = host();
    let g = h.guest("guest");
    let mut r = Rig::new(h, &g, Duration::from_secs(5));
    let bdir = xenbus::backend_dir(r.h.drv.id(), g.id(), 51712);
    assert_eq!(
        r.h.hv
            .store()
            .read(r.h.drv.id(), &format!("{bdir}/sectors"))
            .as_deref(),
        Ok(SECTORS.to_string().as_str()),
        "the size IDENTIFY gave is published"
    );
    let mut front = Blkfront::connect(&r.h.hv, &g, 51712, true).expect("front");
    assert!(front.persistent());
    assert_eq!(front.sectors(), SECTORS);
    assert_eq!(front.max_segments(), 32);
    r.step(Duration::from_micros(100), 2);
    assert!(r.vbd.is_serving());

    // A 74-sector read (the paper's 37,601-byte response rounded up to sectors) over
    // 10 pages, the last a quarter used; and an 8-page write.
    let mut rd = pages(&g, 10);
    rd[9].len = 1024;
    let wr = pages(&g, 8);
    for (k, p) in wr.iter().enumerate() {
        g.fill(p.gfn, 0, 4096, 0xa0 + k as u8).expect("fill");
    }
    front
        .submit(
            1,
            &Bio {
                op: BioOp::Read,
                sector: 100,
                segs: &rd,
            },
        )
        .expect("read");
    front
        .submit(
            2,
            &Bio {
                op: BioOp::Write,
                sector: 600,
                segs: &wr,
            },
        )
        .expect("write");
    front.kick();
    r.step(Duration::from_micros(50), 20);
    let mut done = Vec::new();
    front.complete(|c| done.push(c));
    done.sort_by_key(|c| c.tag);
    assert_eq!(
        done,
        vec![
            Completion {
                tag: 1,
                status: BLKIF_RSP_OKAY
            },
            Completion {
                tag: 2,
                status: BLKIF_RSP_OKAY
            }
        ]
    );
    let mut got = Vec::new();
    for p in &rd {
        let mut b = vec![0u8; usize::from(p.len)];
        g.read(p.gfn, 0, &mut b).expect("read");
        got.extend(b);
    }
    let want: Vec<u8> = (100 * SECTOR..174 * SECTOR).map(disk_byte).collect();
    assert!(got == want, "every byte read is the target's");
    for k in 0..8 {
        let at = (600 * SECTOR) + k * 4096;
        assert!(r.target.disk[at..at + 4096]
            .iter()
            .all(|&b| b == 0xa0 + k as u8));
    }
    let b = r.vbd.backend().expect("serving");
    assert_eq!(
        (b.stats().reads, b.stats().writes, b.stats().sectors_read),
        (1, 1, 74)
    );
    let a = r.vbd.aoe_stats().expect("initiator");
    assert_eq!(a.frames, 37 + 32, "74 sectors and 64 sectors, two a frame");
    assert_eq!(
        r.h.hv.mappings_held(&r.h.drv),
        1 + 10 + 8,
        "ring and persistent pages"
    );
}

#[test]
fn an_id_reused_while_in_flight_is_refused_and_the_first_still_completes() {
    let h = host();
    let g = h.guest("hostile");
    let mut r = Rig::new(h, &g, Duration::from_secs(5));
    let mut bad = Hostile::connect(&r.h, &g, 51712);
    r.step(Duration::from_micros(100), 2);
    assert!(r.vbd.is_serving());
    let (page, gref) = bad.granted(&r.h, false);
    // The target is away: the first request stays in flight while the second comes.
    r.target.alive = false;
    bad.send(&[rw(BLKIF_OP_READ, 5, 8, &[seg(gref, 0, 7)])]);
    r.step(Duration::from_micros(100), 1);
    bad.send(&[rw(BLKIF_OP_READ, 5, 16, &[seg(gref, 0, 7)])]);
    r.step(Duration::from_micros(100), 1);
    let first = bad.responses();
    assert_eq!(first.len(), 1);
    assert_eq!(
        (first[0].id, first[0].status),
        (5, BLKIF_RSP_ERROR),
        "the reuse refused"
    );
    r.target.alive = true;
    r.step(Duration::from_millis(10), 10);
    let second = bad.responses();
    assert_eq!(second.len(), 1);
    assert_eq!(
        (second[0].id, second[0].status),
        (5, BLKIF_RSP_OKAY),
        "the first answered"
    );
    let mut b = vec![0u8; 4096];
    g.read(page, 0, &mut b).expect("read");
    let want: Vec<u8> = (8 * SECTOR..16 * SECTOR).map(disk_byte).collect();
    assert_eq!(b, want, "with the first request's sectors, not the reuse's");
    let s = r.vbd.backend().expect("serving").stats();
    assert_eq!((s.id_in_flight, s.done), (1, 1));
}

#[test]
fn a_dead_target_fails_the_guests_requests_after_the_bound_not_never() {
    let h = host();
    let g = h.guest("guest");
    let mut r = Rig::new(h, &g, Duration::from_millis(500));
    let mut front = Blkfront::connect(&r.h.hv, &g, 51712, false).expect("front");
    r.step(Duration::from_micros(100), 2);
    r.target.alive = false;
    let p = pages(&g, 1);
    front
        .submit(
            9,
            &Bio {
                op: BioOp::Read,
                sector: 0,
                segs: &p,
            },
        )
        .expect("read");
    front.kick();
    r.step(Duration::from_millis(20), 20);
    let mut done = Vec::new();
    front.complete(|c| done.push(c));
    assert!(done.is_empty(), "still retried at 400 ms");
    r.step(Duration::from_millis(20), 10);
    front.complete(|c| done.push(c));
    assert_eq!(
        done,
        vec![Completion {
            tag: 9,
            status: BLKIF_RSP_ERROR
        }]
    );
    let a = r.vbd.aoe_stats().expect("initiator");
    assert!(a.retransmits > 0);
    assert_eq!(a.timed_out, 1);
    assert_eq!(
        r.h.hv.mappings_held(&r.h.drv),
        1,
        "its page unmapped, the ring kept"
    );
}
