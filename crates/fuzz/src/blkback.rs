//! blkback against a hostile front end (issue 20's oracle).
//!
//! A driver domain serves two virtual disks, each on a backing file of its own: a
//! well-behaved guest's through blkfront, and a hostile guest's, whose front end is
//! written by hand. The hostile guest puts raw requests on its ring with structure:
//! every operation (and unknown ones), segment counts from none to past the slot,
//! segments naming a page granted read-write, one granted read-only, a reference never
//! granted or past the table, sectors running backwards or past the page, first sectors
//! near the disk's end or overflowing, indirect requests whose pages are granted or not
//! and hold segments of every kind, ids repeated in a batch; it revokes a grant between
//! batches and, now and then, moves its producer index anywhere.
//!
//! Oracle: every request the back end took is answered exactly once (its counters
//! balance); a protocol break disconnects that device only; the well-behaved guest's
//! reads, between the hostile batches, bring back its own file's bytes; and once both
//! devices are torn down the driver domain holds no mapping at all.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use blk::blkback::{self, Blkback, VBD_WINDOW_SLOTS};
use blk::blkfront::{Bio, BioOp, BioSeg, Blkfront};
use blk::blkif::{
    BlkRing, RawIndirect, RawRequest, Segment, BLKIF_MAX_INDIRECT_PAGES_PER_REQUEST,
    BLKIF_OP_INDIRECT, SECTOR_SIZE,
};
use blk::disk::FileDisk;
use blk::xenbus;
use hv::store::{XenStore, XenbusState};
use hv::{Domain, DomainConfig, Gfn, GrantRef, GrantVersion, HvConfig, Hypervisor, OwnPage};
use ring::{FrontRing, PageRing};

use crate::Input;

/// Sectors of each disk.
const SECTORS: u64 = 256;

fn byte(disk: u8, at: u64) -> u8 {
    (at as u8).wrapping_mul(31) ^ (at >> 9) as u8 ^ disk
}

fn backing(tag: &str, disk: u8) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let p = std::env::temp_dir().join(format!("pvio-fuzz-blk-{}-{n}-{tag}", std::process::id()));
    let data: Vec<u8> = (0..SECTORS * SECTOR_SIZE).map(|i| byte(disk, i)).collect();
    std::fs::write(&p, data).expect("backing file");
    p
}

fn domain(hv: &Hypervisor, name: &str, driver: bool, slots: u32) -> Arc<Domain> {
    hv.create_domain(&DomainConfig {
        name: name.into(),
        pages: 512,
        grant_frames: 2,
        grant_version: GrantVersion::V1,
        vcpus: 1,
        map_slots: slots,
        driver_domain: driver,
    })
    .expect("domain")
}

/// One case.
pub fn case(input: &mut Input<'_>) {
    let hv = Hypervisor::new(HvConfig {
        frames: 4096,
        ..HvConfig::default()
    })
    .expect("hv");
    let drv = domain(&hv, "drv", true, 2 * VBD_WINDOW_SLOTS);
    let good = domain(&hv, "good", false, 4);
    let bad = domain(&hv, "bad", false, 4);
    let (good_file, bad_file) = (backing("good", 0x11), backing("bad", 0x77));
    let persistent = input.coin();
    let offer = |g: &Domain, path: &std::path::Path, devid: u32| {
        let disk = FileDisk::open(path, false).expect("disk");
        xenbus::create_vbd(hv.store(), drv.id(), g.id(), devid, false).expect("vbd");
        blkback::probe(hv.store(), drv.id(), g.id(), devid, &disk, persistent).expect("probe");
        disk
    };
    // The well-behaved guest's device.
    let disk = offer(&good, &good_file, 51712);
    let mut front = Blkfront::connect(&hv, &good, 51712, persistent).expect("front");
    let mut gb =
        Blkback::connect(hv::Pvio::new(&hv, &drv), good.id(), 51712, 0, disk).expect("back");
    let page = good.alloc_page().expect("page");
    // The hostile guest's, its ring written by hand.
    let disk = offer(&bad, &bad_file, 51712);
    let ring_gfn = bad.alloc_page().expect("page");
    let gt = bad.grant_table();
    let ring_ref = gt.alloc_ref().expect("ref");
    gt.grant_access(ring_ref, drv.id(), ring_gfn, false)
        .expect("grant");
    let mut ring: FrontRing<BlkRing, PageRing<OwnPage>> =
        FrontRing::init(PageRing::new(bad.page(ring_gfn).expect("page")).expect("ring"))
            .expect("ring");
    let port = hv.evtchn_alloc_unbound(&bad, drv.id()).expect("port");
    let fdir = xenbus::frontend_dir(bad.id(), 51712);
    let store = hv.store();
    store
        .write(
            bad.id(),
            &format!("{fdir}/ring-ref"),
            &ring_ref.0.to_string(),
        )
        .expect("key");
    store
        .write(
            bad.id(),
            &format!("{fdir}/event-channel"),
            &port.0.to_string(),
        )
        .expect("key");
    store
        .switch_state(bad.id(), &fdir, XenbusState::Connected)
        .expect("state");
    let mut bb = Blkback::connect(
        hv::Pvio::new(&hv, &drv),
        bad.id(),
        51712,
        VBD_WINDOW_SLOTS,
        disk,
    )
    .expect("back");
    // Its pages: read-write, read-only, and an indirect page, each granted.
    let granted = |ro: bool| -> (Gfn, GrantRef) {
        let g = bad.alloc_page().expect("page");
        let r = gt.alloc_ref().expect("ref");
        gt.grant_access(r, drv.id(), g, ro).expect("grant");
        (g, r)
    };
    let (_, rw) = granted(false);
    let (_, ro) = granted(true);
    let (ind_gfn, ind) = granted(true);
    let mut revoked = false;

    for round in 0..input.below(6) + 1 {
        let gref = |input: &mut Input<'_>| match input.below(5) {
            0 | 1 => rw,
            2 => ro,
            3 => GrantRef(input.below(4096) as u32),
            _ => GrantRef(u32::MAX - input.below(3) as u32),
        };
        let seg = |input: &mut Input<'_>| {
            let g = gref(input);
            Segment {
                gref: g.0,
                first_sect: input.below(10) as u8,
                last_sect: input.below(10) as u8,
                pad: 0,
            }
        };
        let n = input.below(u64::from(ring.free_requests()) + 1);
        for _ in 0..n {
            let sector = match input.below(4) {
                0 => input.below(SECTORS),
                1 => SECTORS - input.below(4),
                2 => u64::MAX - input.below(4),
                _ => input.u64(),
            };
            let id = input.below(8);
            let req = if input.below(5) == 0 {
                // Indirect: segments written into its page, the page granted or not.
                let nr = input.below(300) as u16;
                let segs: Vec<Segment> = (0..nr.min(512)).map(|_| seg(input)).collect();
                let _ = bad.write(ind_gfn, 0, bytemuck::cast_slice(&segs));
                let mut r = RawIndirect {
                    operation: BLKIF_OP_INDIRECT,
                    indirect_op: input.below(3) as u8,
                    nr_segments: nr,
                    id,
                    sector_number: sector,
                    ..RawIndirect::default()
                };
                for p in r
                    .indirect_grefs
                    .iter_mut()
                    .take(BLKIF_MAX_INDIRECT_PAGES_PER_REQUEST)
                {
                    *p = if input.coin() { ind.0 } else { gref(input).0 };
                }
                r.to_slot()
            } else {
                let mut r = RawRequest {
                    operation: input.below(8) as u8,
                    nr_segments: input.below(14) as u8,
                    id,
                    sector_number: sector,
                    ..RawRequest::default()
                };
                for s in r.seg.iter_mut() {
                    *s = seg(input);
                }
                r
            };
            let _ = ring.push_request(&req);
        }
        ring.push_requests_and_check_notify();
        if input.below(8) == 0 {
            // The producer index anywhere: forward past a ring, or back.
            let _ = bad
                .atomic_u32(ring_gfn, 0)
                .map(|a| a.store(input.u64() as u32, Ordering::Release));
        }
        bb.serve();
        while let Ok(Some(_)) = ring.take_response() {}
        if !revoked && input.coin() {
            // A grant revoked between batches: later requests naming it fail to map.
            let _ = gt.end_access(rw);
            revoked = true;
        }
        // The well-behaved guest reads its own disk meanwhile, and gets its own bytes.
        let sector = (round * 17) % (SECTORS - 8);
        let seg = [BioSeg {
            gfn: page,
            offset: 0,
            len: 4096,
        }];
        front
            .submit(
                round,
                &Bio {
                    op: BioOp::Read,
                    sector,
                    segs: &seg,
                },
            )
            .expect("submit");
        front.kick();
        gb.serve();
        let mut ok = false;
        front.complete(|c| ok = c.ok());
        assert!(ok, "the good guest's read completes");
        let mut b = vec![0u8; 4096];
        good.read(page, 0, &mut b).expect("read");
        let at = sector * SECTOR_SIZE;
        assert!(
            b.iter()
                .enumerate()
                .all(|(i, &x)| x == byte(0x11, at + i as u64)),
            "the good guest reads its own bytes"
        );
    }

    let s = bb.stats();
    assert_eq!(
        s.taken,
        s.done + s.refused.total() + s.id_in_flight + s.bad_grants + s.io_errors,
        "every request answered once: {s:?}"
    );
    assert!(
        gb.broken().is_none(),
        "the good guest's device is never broken"
    );
    gb.disconnect();
    bb.disconnect();
    front.close();
    assert_eq!(
        hv.mappings_held(&drv),
        0,
        "no mapping left in the driver domain"
    );
    let _ = std::fs::remove_file(&good_file);
    let _ = std::fs::remove_file(&bad_file);
}
