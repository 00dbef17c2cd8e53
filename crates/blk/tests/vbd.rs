//! blkfront and blkback connected through the store, driven from one thread: data
//! written through the guest's block layer lands in the backing file and reads back
//! intact, with and without persistent grants, in the slot and indirect; and a hostile
//! front end's every malformed request is refused, counted and answered, while a ring
//! index out of the protocol disconnects that device and no other.

mod common;

use common::{host, rw, seg, Host, Hostile};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use blk::blkback::{self, Blkback, Broken, VbdStats, MAX_INDIRECT_SEGMENTS, VBD_WINDOW_SLOTS};
use blk::blkfront::{Bio, BioOp, BioSeg, Blkfront, Completion, SubmitError};
use blk::blkif::{
    BadRequest, BlkRing, RawIndirect, RawRequest, Segment, BLKIF_OP_INDIRECT, BLKIF_OP_READ,
    BLKIF_OP_WRITE, BLKIF_RSP_EOPNOTSUPP, BLKIF_RSP_ERROR, BLKIF_RSP_OKAY, SECTOR_SIZE,
};
use blk::disk::FileDisk;
use blk::xenbus;
use hv::store::{XenStore, XenbusState};
use hv::{DomId, Domain, GrantRef};
use ring::PageRing;

/// Sectors of the test disks (2 MiB).
const SECTORS: u64 = 4096;

/// A backing file of `SECTORS` sectors, byte `i` holding `(i * 7 + i / 4096) as u8`.
fn backing(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("pvio-vbd-{}-{name}", std::process::id()));
    let data: Vec<u8> = (0..SECTORS * SECTOR_SIZE)
        .map(|i| (i.wrapping_mul(7) + i / 4096) as u8)
        .collect();
    std::fs::write(&p, data).expect("backing file");
    p
}

impl Host {
    /// The toolstack's and the back end's part: both directories, the disk opened and
    /// published (`InitWait`).
    fn offer(
        &self,
        guest: &Domain,
        devid: u32,
        path: &Path,
        ro: bool,
        persistent: bool,
    ) -> FileDisk {
        let disk = FileDisk::open(path, ro).expect("disk");
        xenbus::create_vbd(self.hv.store(), self.drv.id(), guest.id(), devid, ro).expect("vbd");
        blkback::probe(
            self.hv.store(),
            self.drv.id(),
            guest.id(),
            devid,
            &disk,
            persistent,
        )
        .expect("probe");
        disk
    }

    /// A connected pair on device `devid` (the back end at window slots `index`).
    fn plug(
        &self,
        guest: &Arc<Domain>,
        devid: u32,
        index: u32,
        path: &Path,
        persistent: bool,
    ) -> (Blkfront, Blkback) {
        let disk = self.offer(guest, devid, path, false, persistent);
        let front = Blkfront::connect(&self.hv, guest, devid, persistent).expect("front");
        let back = Blkback::connect(
            hv::Pvio::new(&self.hv, &self.drv),
            guest.id(),
            devid,
            index * VBD_WINDOW_SLOTS,
            disk,
        )
        .expect("back");
        (front, back)
    }
}

/// Every request taken was answered exactly once.
fn answered_once(s: &VbdStats) {
    assert_eq!(
        s.taken,
        s.done + s.refused.total() + s.id_in_flight + s.bad_grants + s.io_errors,
        "{s:?}"
    );
}

/// Serves, and again as the disk's transfers end ([`Blkback::disk_async`]) until none
/// is in flight; the requests taken.
fn serve_settled(back: &mut Blkback) -> usize {
    let mut n = back.serve();
    while back.disk_in_flight() > 0 {
        if let Some(fd) = back.disk_event_fd() {
            let mut p = [mem::poll::PollFd::readable(fd)];
            let _ = mem::poll::wait(&mut p, Some(std::time::Duration::from_secs(5)));
        }
        n += back.serve();
    }
    n
}

/// Submits each bio under its index as tag, serves, and collects every completion.
fn run(front: &mut Blkfront, back: &mut Blkback, bios: &[Bio<'_>]) -> Vec<Completion> {
    let mut out = Vec::new();
    for (i, b) in bios.iter().enumerate() {
        front.submit(i as u64, b).expect("submit");
    }
    front.kick();
    serve_settled(back);
    front.complete(|c| out.push(c));
    out.sort_by_key(|c| c.tag);
    out
}

/// Pages of the guest for I/O, one `BioSeg` each of `len` bytes at `offset`.
fn pages(g: &Domain, n: usize, offset: u16, len: u16) -> Vec<BioSeg> {
    (0..n)
        .map(|_| BioSeg {
            gfn: g.alloc_page().expect("page"),
            offset,
            len,
        })
        .collect()
}

fn fill(g: &Domain, segs: &[BioSeg], seed: u8) -> Vec<u8> {
    let mut all = Vec::new();
    for (k, s) in segs.iter().enumerate() {
        let d: Vec<u8> = (0..s.len as usize)
            .map(|i| (i as u8).wrapping_mul(13) ^ seed ^ k as u8)
            .collect();
        g.write(s.gfn, s.offset as usize, &d).expect("write");
        all.extend(d);
    }
    all
}

fn gather(g: &Domain, segs: &[BioSeg]) -> Vec<u8> {
    let mut all = Vec::new();
    for s in segs {
        let mut d = vec![0u8; s.len as usize];
        g.read(s.gfn, s.offset as usize, &mut d).expect("read");
        all.extend(d);
    }
    all
}

fn file_at(path: &Path, sector: u64, len: usize) -> Vec<u8> {
    let f = std::fs::read(path).expect("file");
    let at = (sector * SECTOR_SIZE) as usize;
    f[at..at + len].to_vec()
}

#[test]
fn writes_land_in_the_file_and_read_back_intact_with_and_without_persistent_grants() {
    // Segments not persistently mapped are mapped per request, or (`copy`, as `pvio
    // backend` serves them) copied through the back end's own pages; `aio`: the disk's
    // bytes move through an io_uring (as `pvio backend` moves them), persistent segments
    // straight to and from the guest's pages.
    for (persistent, copy, aio) in [
        (false, false, false),
        (true, false, false),
        (false, true, false),
        (true, true, false),
        (false, true, true),
        (true, true, true),
    ] {
        let h = host();
        let g = h.guest("guest");
        let path = backing(&format!("rw-{persistent}-{copy}-{aio}"));
        let refs0 = g.grant_table().refs_free();
        let free0 = h.drv.free_page_count();
        let (mut front, mut back) = h.plug(&g, 51712, 0, &path, persistent);
        if copy {
            let bounce = blkback::Bounce::new(&h.drv).expect("the back end has the pages");
            assert!(back.copy_transient(bounce));
        }
        assert!(!aio || back.disk_async(), "io_uring taken");
        assert_eq!(front.sectors(), SECTORS);
        assert_eq!(front.persistent(), persistent);
        assert_eq!(back.persistent(), persistent);
        assert_eq!(
            front.max_segments(),
            32,
            "indirect offered: 128 KiB requests"
        );

        // Shapes: one sector in the middle of a page, 11 whole pages in the slot, 32 whole
        // pages indirect, 5 pages of mixed pieces.
        let one = pages(&g, 1, 1024, 512);
        let slot = pages(&g, 11, 0, 4096);
        let ind = pages(&g, 32, 0, 4096);
        let mut mixed = pages(&g, 5, 0, 4096);
        mixed[0].offset = 3584;
        mixed[0].len = 512;
        mixed[4].len = 2048;
        let shapes: [(&[BioSeg], u64); 4] = [(&one, 7), (&slot, 100), (&ind, 1000), (&mixed, 3001)];
        for round in 0..2u8 {
            let data: Vec<Vec<u8>> = shapes.iter().map(|(s, _)| fill(&g, s, round)).collect();
            let writes: Vec<Bio<'_>> = shapes
                .iter()
                .map(|&(segs, sector)| Bio {
                    op: BioOp::Write,
                    sector,
                    segs,
                })
                .collect();
            let c = run(&mut front, &mut back, &writes);
            assert_eq!(c.len(), 4);
            assert!(c.iter().all(Completion::ok), "{c:?}");
            for ((_, sector), d) in shapes.iter().zip(&data) {
                assert_eq!(
                    &file_at(&path, *sector, d.len()),
                    d,
                    "the file holds what was written"
                );
            }
            // Clobber the guest's pages, read back.
            for (s, _) in &shapes {
                for p in s.iter() {
                    g.fill(p.gfn, 0, 4096, 0xee).expect("fill");
                }
            }
            let reads: Vec<Bio<'_>> = shapes
                .iter()
                .map(|&(segs, sector)| Bio {
                    op: BioOp::Read,
                    sector,
                    segs,
                })
                .collect();
            let c = run(&mut front, &mut back, &reads);
            assert!(c.iter().all(Completion::ok), "{c:?}");
            for ((s, _), d) in shapes.iter().zip(&data) {
                assert_eq!(&gather(&g, s), d, "read back intact");
            }
        }
        let s = back.stats().clone();
        answered_once(&s);
        assert_eq!((s.reads, s.writes, s.indirect), (8, 8, 4));
        if aio && persistent {
            // Every read and write through the ring, each pass's in one enter.
            assert_eq!((s.async_transfers, s.disk_enters), (16, 4), "{s:?}");
        } else {
            // Segments copied through the back end's pages: moved at once.
            assert_eq!((s.async_transfers, s.disk_enters), (0, 0), "{s:?}");
        }
        assert_eq!(s.sectors_read, 2 * (1 + 88 + 256 + 29));
        // The indirect pages (granted read-only, one a 32-segment request) are mapped
        // for their request, or copied from.
        let indirect = 2 * 2;
        if persistent {
            // Each pool page mapped once and found mapped ever after.
            let (maps, copies) = if copy { (0, indirect) } else { (indirect, 0) };
            assert_eq!((s.transient_maps, s.transient_copies), (maps, copies));
            assert_eq!(s.persistent_maps as usize, front.pool_pages());
            assert!(s.persistent_hits > 0);
            assert!(front.stats().bounce_bytes > 0);
        } else if copy {
            // Every segment and indirect page copied, one batch a request; none mapped.
            assert_eq!(s.persistent_maps + s.persistent_hits, 0);
            assert_eq!(s.transient_maps, 0);
            assert_eq!(s.transient_copies, 2 * 2 * (1 + 11 + 32 + 5) + indirect);
        } else {
            assert_eq!(s.persistent_maps + s.persistent_hits, 0);
            assert_eq!(s.transient_maps, 2 * 2 * (1 + 11 + 32 + 5) + 2 * 2);
            assert_eq!(s.transient_copies, 0);
            assert_eq!(front.stats().bounce_bytes, 0);
        }
        // Teardown gives every mapping, grant and page back.
        back.disconnect();
        assert_eq!(h.hv.mappings_held(&h.drv), 0);
        assert_eq!(h.drv.free_page_count(), free0);
        front.close();
        assert_eq!(g.grant_table().refs_free(), refs0);
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn a_full_queue_of_random_reads_completes_each_with_its_own_sectors() {
    let h = host();
    let g = h.guest("guest");
    let path = backing("qd");
    let (mut front, mut back) = h.plug(&g, 51712, 0, &path, false);
    let bufs = pages(&g, 32, 0, 4096);
    let sectors: Vec<u64> = (0..32u64)
        .map(|i| (i * 2654435761) % (SECTORS - 8) / 8 * 8)
        .collect();
    let one: Vec<[BioSeg; 1]> = bufs.iter().map(|&b| [b]).collect();
    let bios: Vec<Bio<'_>> = one
        .iter()
        .zip(&sectors)
        .map(|(s, &sector)| Bio {
            op: BioOp::Read,
            sector,
            segs: s,
        })
        .collect();
    for (i, b) in bios.iter().enumerate() {
        front.submit(i as u64, b).expect("submit");
    }
    assert_eq!(front.room(), 0);
    assert_eq!(
        front.submit(99, &bios[0]),
        Err(SubmitError::Busy),
        "33rd request waits for a completion"
    );
    front.kick();
    assert_eq!(back.serve(), 32);
    let mut n = 0;
    front.complete(|c| {
        assert!(c.ok());
        n += 1;
    });
    assert_eq!(n, 32);
    for (b, &sector) in bufs.iter().zip(&sectors) {
        assert_eq!(gather(&g, &[*b]), file_at(&path, sector, 4096));
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn flush_and_discard_are_served_and_a_read_only_device_refuses_writes() {
    let h = host();
    let g = h.guest("guest");
    let path = backing("fd");
    let (mut front, mut back) = h.plug(&g, 51712, 0, &path, true);
    let c = run(
        &mut front,
        &mut back,
        &[
            Bio {
                op: BioOp::Flush,
                sector: 0,
                segs: &[],
            },
            Bio {
                op: BioOp::Discard { nr_sectors: 16 },
                sector: 64,
                segs: &[],
            },
        ],
    );
    assert!(c.iter().all(Completion::ok));
    assert!(
        file_at(&path, 64, 16 * 512).iter().all(|&b| b == 0),
        "discarded sectors read as zeros"
    );
    assert_eq!((back.stats().flushes, back.stats().discards), (1, 1));
    // Past the end is refused before it takes a slot.
    let b = pages(&g, 1, 0, 4096);
    assert_eq!(
        front.submit(
            0,
            &Bio {
                op: BioOp::Read,
                sector: SECTORS - 4,
                segs: &b
            }
        ),
        Err(SubmitError::BeyondDevice)
    );

    // A read-only device: the front end knows, and refuses writes itself.
    let g2 = h.guest("reader");
    let disk = h.offer(&g2, 51728, &path, true, false);
    let mut ro = Blkfront::connect(&h.hv, &g2, 51728, false).expect("front");
    let _back = Blkback::connect(
        hv::Pvio::new(&h.hv, &h.drv),
        g2.id(),
        51728,
        VBD_WINDOW_SLOTS,
        disk,
    )
    .expect("back");
    assert!(ro.read_only());
    let b = pages(&g2, 1, 0, 4096);
    assert_eq!(
        ro.submit(
            0,
            &Bio {
                op: BioOp::Write,
                sector: 0,
                segs: &b
            }
        ),
        Err(SubmitError::NotOffered)
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_hostile_front_end_gets_each_malformed_request_refused_and_counted() {
    // Segments mapped, or copied through the back end's pages (`pvio backend`).
    for copy in [false, true] {
        hostile_requests(copy);
    }
}

fn hostile_requests(copy: bool) {
    let h = host();
    let g = h.guest("hostile");
    let path = backing(&format!("hostile-{copy}"));
    let disk = h.offer(&g, 51712, &path, false, false);
    let mut bad = Hostile::connect(&h, &g, 51712);
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    assert!(!copy || back.copy_transient(blkback::Bounce::new(&h.drv).expect("pages")));
    let before = file_at(&path, 24, 4096);
    let (page, r) = bad.granted(&h, false);
    let (ro_page, ro) = bad.granted(&h, true);
    g.fill(ro_page, 0, 4096, 0x5a).expect("fill");
    let mut twelve = rw(BLKIF_OP_READ, 1, 0, &[seg(r, 0, 7); 11]);
    twelve.nr_segments = 12;
    let reqs = [
        twelve,
        // A grant reference far outside the table.
        rw(BLKIF_OP_READ, 2, 0, &[seg(GrantRef(1 << 20), 0, 7)]),
        // Sectors past the device, and a range that overflows.
        rw(BLKIF_OP_READ, 3, SECTORS - 4, &[seg(r, 0, 7)]),
        rw(BLKIF_OP_READ, 4, u64::MAX - 2, &[seg(r, 0, 7)]),
        // A segment past its page, and one running backwards.
        rw(BLKIF_OP_READ, 5, 0, &[seg(r, 0, 8)]),
        rw(BLKIF_OP_READ, 6, 0, &[seg(r, 5, 4)]),
        // A read into a page granted read-only: the back end must not write it.
        rw(BLKIF_OP_READ, 7, 0, &[seg(ro, 0, 7)]),
        // No segments; an unknown operation.
        rw(BLKIF_OP_READ, 8, 0, &[]),
        RawRequest {
            operation: 9,
            id: 9,
            ..RawRequest::default()
        },
        // A good read, and then its id again in the same batch.
        rw(BLKIF_OP_READ, 10, 8, &[seg(r, 0, 7)]),
        rw(BLKIF_OP_WRITE, 10, 16, &[seg(r, 0, 7)]),
        // A write from a good page and one outside the table: nothing reaches the disk.
        rw(
            BLKIF_OP_WRITE,
            11,
            24,
            &[seg(r, 0, 7), seg(GrantRef(1 << 20), 0, 7)],
        ),
    ];
    bad.send(&reqs);
    assert_eq!(back.serve(), reqs.len());
    let rsp = bad.responses();
    let status: Vec<(u64, i16)> = rsp.iter().map(|r| (r.id, r.status)).collect();
    let e = BLKIF_RSP_ERROR;
    assert_eq!(
        status,
        vec![
            (1, e),
            (2, e),
            (3, e),
            (4, e),
            (5, e),
            (6, e),
            (7, e),
            (8, e),
            (9, BLKIF_RSP_EOPNOTSUPP),
            (10, BLKIF_RSP_OKAY),
            (10, e),
            (11, e)
        ]
    );
    let s = back.stats();
    for (reason, n) in [
        (BadRequest::TooManySegments, 1),
        (BadRequest::BeyondDevice, 2),
        (BadRequest::BadSegment, 2),
        (BadRequest::NoSegments, 1),
        (BadRequest::NotOffered, 1),
    ] {
        assert_eq!(s.refused.get(reason), n, "{reason:?}");
    }
    assert_eq!((s.bad_grants, s.id_in_flight, s.done), (3, 1, 1));
    answered_once(s);
    assert_eq!(
        file_at(&path, 24, 4096),
        before,
        "a failed write writes nothing"
    );
    let mut b = [0u8; 4096];
    g.read(ro_page, 0, &mut b).expect("read");
    assert!(
        b.iter().all(|&x| x == 0x5a),
        "a read-only page stays as it was"
    );
    g.read(page, 0, &mut b).expect("read");
    assert_eq!(
        b.to_vec(),
        file_at(&path, 8, 4096),
        "the good read got its sectors"
    );
    assert_eq!(h.hv.mappings_held(&h.drv), 1, "only the ring stays mapped");
    assert!(
        back.broken().is_none(),
        "refused requests do not disconnect"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_back_end_that_dies_with_requests_in_flight_is_resumed_by_another_and_each_is_answered_once() {
    let h = host();
    let g = h.guest("guest");
    let path = backing("resume");
    let (mut front, back) = h.plug(&g, 51712, 0, &path, true);
    // Writes in flight when the back end dies: taken by nobody, answered by nobody.
    let segs: Vec<Vec<BioSeg>> = (0..4).map(|_| pages(&g, 4, 0, 4096)).collect();
    let data: Vec<Vec<u8>> = segs
        .iter()
        .enumerate()
        .map(|(k, s)| fill(&g, s, k as u8))
        .collect();
    for (k, s) in segs.iter().enumerate() {
        let bio = Bio {
            op: BioOp::Write,
            sector: 64 * k as u64,
            segs: s,
        };
        front.submit(k as u64, &bio).expect("submit");
    }
    front.kick();
    back.abandon();
    assert_eq!(
        h.hv.mappings_held(&h.drv),
        0,
        "the dead back end holds nothing"
    );
    let disk = FileDisk::open(&path, false).expect("disk");
    let mut again = Blkback::resume(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk, None)
        .expect("resume");
    again.serve();
    let mut done = Vec::new();
    front.complete(|c| done.push(c));
    done.sort_by_key(|c| c.tag);
    assert_eq!(done.iter().map(|c| c.tag).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert!(done.iter().all(Completion::ok), "{done:?}");
    for (k, d) in data.iter().enumerate() {
        assert_eq!(&file_at(&path, 64 * k as u64, d.len()), d);
    }
    answered_once(again.stats());
    // And it goes on serving: a read of what was written comes back whole.
    let back_in = pages(&g, 4, 0, 4096);
    let c = run(
        &mut front,
        &mut again,
        &[Bio {
            op: BioOp::Read,
            sector: 64,
            segs: &back_in,
        }],
    );
    assert!(c.iter().all(Completion::ok), "{c:?}");
    assert_eq!(gather(&g, &back_in), data[1]);
    // Only a device whose both ends are still Connected is resumed.
    let bdir = xenbus::backend_dir(h.drv.id(), g.id(), 51712);
    h.hv.store()
        .switch_state(h.drv.id(), &bdir, XenbusState::Closing)
        .expect("closing");
    let disk = FileDisk::open(&path, false).expect("disk");
    again.abandon();
    assert!(Blkback::resume(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk, None).is_err());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn responses_written_but_not_published_when_the_back_end_died_are_published_by_the_next_not_redone()
{
    let h = host();
    let g = h.guest("guest");
    let Journaled {
        mut bad,
        mut back,
        path,
        jpath,
        r,
    } = journaled(&h, &g, "journal");
    bad.send(&[
        rw(BLKIF_OP_READ, 1, 0, &[seg(r, 0, 0)]),
        rw(BLKIF_OP_READ, 2, 1, &[seg(r, 1, 1)]),
        rw(BLKIF_OP_READ, 3, 2, &[seg(r, 2, 2)]),
        rw(BLKIF_OP_READ, 4, 3, &[seg(r, 3, 3)]),
    ]);
    assert_eq!(back.serve(), 4);
    // As if it died after writing the last two responses and before publishing them:
    // rsp_prod (ring.h's third word) back at 2. Their slots hold responses now.
    bad.g
        .write(bad.ring_gfn, 8, &2u32.to_le_bytes())
        .expect("rsp_prod");
    back.abandon();
    let mut again = resume_journaled(&h, &g, &path, &jpath);
    assert_eq!(
        again.serve(),
        0,
        "nothing is taken again: those slots are responses"
    );
    let rsp = bad.responses();
    assert_eq!(
        rsp.iter().map(|r| r.id).collect::<Vec<_>>(),
        [1, 2, 3, 4],
        "{rsp:?}"
    );
    assert!(rsp.iter().all(|r| r.status == BLKIF_RSP_OKAY));
    // And it goes on: a fifth request is taken and answered once.
    bad.send(&[rw(BLKIF_OP_READ, 5, 4, &[seg(r, 4, 4)])]);
    assert_eq!(again.serve(), 1);
    assert_eq!(
        bad.responses().iter().map(|r| r.id).collect::<Vec<_>>(),
        [5]
    );
    let _ = std::fs::remove_file(&jpath);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn indirect_pages_that_point_anywhere_are_refused_before_any_segment_is_used() {
    // Indirect pages mapped, or copied from (`pvio backend`).
    for copy in [false, true] {
        hostile_indirect(copy);
    }
}

fn hostile_indirect(copy: bool) {
    let h = host();
    let g = h.guest("hostile");
    let path = backing(&format!("indirect-{copy}"));
    let disk = h.offer(&g, 51712, &path, false, false);
    let mut bad = Hostile::connect(&h, &g, 51712);
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    assert!(!copy || back.copy_transient(blkback::Bounce::new(&h.drv).expect("pages")));
    let (data, dr) = bad.granted(&h, false);
    let (ind, ir) = bad.granted(&h, true);
    let write_segs = |segs: &[Segment]| g.write(ind, 0, bytemuck::cast_slice(segs)).expect("write");
    let indirect = |id: u64, nr: u16, pages: &[u32]| {
        let mut r = RawIndirect {
            operation: BLKIF_OP_INDIRECT,
            indirect_op: BLKIF_OP_READ,
            nr_segments: nr,
            id,
            sector_number: 0,
            ..RawIndirect::default()
        };
        r.indirect_grefs[..pages.len()].copy_from_slice(pages);
        r.to_slot()
    };
    // A good one: 16 one-sector segments of the data page in its indirect page.
    let good: Vec<Segment> = (0..16).map(|_| seg(dr, 0, 0)).collect();
    write_segs(&good);
    bad.send(&[indirect(1, 16, &[ir.0])]);
    back.serve();
    let ok = bad.responses()[0];
    assert_eq!(ok.status, BLKIF_RSP_OKAY);
    // Answered with the operation it carries, not BLKIF_OP_INDIRECT: Linux's blkfront
    // checks exactly that, and disables the disk otherwise (found against Xen).
    assert_eq!(ok.operation, BLKIF_OP_READ);
    assert_eq!(back.stats().indirect, 1);
    // Segments pointing past their page; a segment naming an ungranted reference; an
    // indirect page not granted at all; more segments than offered; more pages than one
    // request has.
    let mut past = good.clone();
    past[9] = seg(dr, 3, 9);
    write_segs(&past);
    bad.send(&[indirect(2, 16, &[ir.0])]);
    back.serve();
    let mut ungranted = good.clone();
    ungranted[15] = seg(GrantRef(4000), 0, 0);
    write_segs(&ungranted);
    bad.send(&[
        indirect(3, 16, &[ir.0]),
        indirect(4, 16, &[4001]),
        indirect(5, MAX_INDIRECT_SEGMENTS + 1, &[ir.0; 2]),
    ]);
    back.serve();
    let rsp = bad.responses();
    assert!(rsp.iter().all(|r| r.status == BLKIF_RSP_ERROR), "{rsp:?}");
    assert!(rsp.iter().all(|r| r.operation == BLKIF_OP_READ), "{rsp:?}");
    let s = back.stats();
    assert_eq!(s.refused.get(BadRequest::BadSegment), 1);
    assert_eq!(s.refused.get(BadRequest::TooManySegments), 1);
    assert_eq!(s.bad_grants, 2);
    answered_once(s);
    assert_eq!(
        h.hv.mappings_held(&h.drv),
        1,
        "nothing stays mapped but the ring"
    );
    let _ = data;
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_ring_index_moved_backwards_disconnects_that_device_and_no_other() {
    let h = host();
    let path = backing("break");
    let g = h.guest("hostile");
    let disk = h.offer(&g, 51712, &path, false, false);
    let mut bad = Hostile::connect(&h, &g, 51712);
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    let good_guest = h.guest("good");
    let (mut front, mut other) = h.plug(&good_guest, 51712, 1, &path, true);

    let (_, r) = bad.granted(&h, false);
    bad.send(&[
        rw(BLKIF_OP_READ, 1, 0, &[seg(r, 0, 7)]),
        rw(BLKIF_OP_READ, 2, 8, &[seg(r, 0, 7)]),
    ]);
    back.serve();
    assert_eq!(bad.responses().len(), 2);
    // The front end takes back a request the back end consumed: req_prod 2 → 1.
    g.atomic_u32(bad.ring_gfn, 0)
        .expect("req_prod")
        .store(1, std::sync::atomic::Ordering::Release);
    let _ = h.hv.evtchn_send(&g, bad.port);
    back.serve();
    assert!(matches!(back.broken(), Some(Broken::Ring(_))));
    let bdir = xenbus::backend_dir(h.drv.id(), g.id(), 51712);
    assert_eq!(
        h.hv.store().xenbus_state(h.drv.id(), &bdir),
        XenbusState::Closing
    );
    assert_eq!(back.serve(), 0, "a broken device takes nothing more");

    // The other guest's device goes on.
    let b = pages(&good_guest, 2, 0, 4096);
    let c = run(
        &mut front,
        &mut other,
        &[Bio {
            op: BioOp::Read,
            sector: 40,
            segs: &b,
        }],
    );
    assert!(c[0].ok());
    assert_eq!(gather(&good_guest, &b), file_at(&path, 40, 8192));
    assert!(other.broken().is_none());
    back.disconnect();
    other.disconnect();
    assert_eq!(h.hv.mappings_held(&h.drv), 0);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_front_end_drops_responses_that_name_no_request_in_flight() {
    // A hostile back end is played by writing responses on the ring by hand.
    let h = host();
    let g = h.guest("guest");
    let path = backing("badrsp");
    let disk = h.offer(&g, 51712, &path, false, false);
    let mut front = Blkfront::connect(&h.hv, &g, 51712, false).expect("front");
    let dom = Arc::clone(&h.drv);
    let ring_ref =
        h.hv.store()
            .read(
                dom.id(),
                &format!("{}/ring-ref", xenbus::frontend_dir(g.id(), 51712)),
            )
            .expect("ring-ref");
    drop(disk);
    let mut res = [Err(hv::GrantError::BadHandle(0))];
    h.hv.grant_map(
        &dom,
        &[hv::MapOp {
            dom: g.id(),
            gref: GrantRef(ring_ref.parse().expect("n")),
            readonly: false,
            slot: 0,
        }],
        &mut res,
    );
    res[0].expect("map");
    let mut ring = ring::BackRing::<BlkRing, _>::attach(
        PageRing::new(dom.window().page(0).expect("page")).expect("ring"),
    )
    .expect("attach");
    // Four requests; the back end answers four times, but only once rightly.
    let b = pages(&g, 4, 0, 4096);
    for (i, p) in b.iter().enumerate() {
        let one = [*p];
        front
            .submit(
                77 + i as u64,
                &Bio {
                    op: BioOp::Read,
                    sector: 0,
                    segs: &one,
                },
            )
            .expect("submit");
    }
    front.kick();
    let req = ring.take_request().expect("ring").expect("a request");
    for _ in 0..3 {
        ring.take_request().expect("ring").expect("a request");
    }
    // An id not in flight, the right id with the wrong operation, the real answer, and
    // the same again.
    for (id, op) in [
        (31, BLKIF_OP_READ),
        (req.id, BLKIF_OP_WRITE),
        (req.id, BLKIF_OP_READ),
        (req.id, BLKIF_OP_READ),
    ] {
        ring.push_response(&blk::blkif::response(id, op, BLKIF_RSP_OKAY))
            .expect("push");
    }
    ring.push_responses_and_check_notify();
    let mut got = Vec::new();
    front.complete(|c| got.push(c));
    assert_eq!(
        got,
        vec![Completion {
            tag: 77,
            status: BLKIF_RSP_OKAY
        }]
    );
    assert_eq!(front.stats().bad_responses, 3);
    assert_eq!(
        front.in_flight(),
        3,
        "the others still wait for their answers"
    );
    let _ = std::fs::remove_file(&path);
}

/// A clean stop hands a vbd over instead of closing it: the responses written are
/// published, the store is not written (both ends stay `Connected`, so Linux's
/// blkfront never marks the disk dead), and the next back end resumes the ring where
/// this one left it, answering each request once.
#[test]
fn a_clean_stop_hands_the_disk_over_connected_and_the_next_back_end_goes_on() {
    let h = host();
    let g = h.guest("guest");
    let Journaled {
        mut bad,
        mut back,
        path,
        jpath,
        r,
    } = journaled(&h, &g, "handover");
    bad.send(&[
        rw(BLKIF_OP_READ, 1, 0, &[seg(r, 0, 0)]),
        rw(BLKIF_OP_READ, 2, 1, &[seg(r, 1, 1)]),
    ]);
    assert_eq!(back.serve(), 2);
    back.hand_over();
    let bdir = xenbus::backend_dir(h.drv.id(), g.id(), 51712);
    let fdir = xenbus::frontend_dir(g.id(), 51712);
    assert_eq!(
        h.hv.store().xenbus_state(h.drv.id(), &bdir),
        XenbusState::Connected
    );
    assert_eq!(
        h.hv.store().xenbus_state(h.drv.id(), &fdir),
        XenbusState::Connected
    );
    assert_eq!(
        bad.responses().iter().map(|r| r.id).collect::<Vec<_>>(),
        [1, 2],
        "what was answered is published before the hand-over"
    );
    // Requests posted while no back end runs wait on the ring for the next one.
    bad.send(&[rw(BLKIF_OP_READ, 3, 2, &[seg(r, 2, 2)])]);
    let mut again = resume_journaled(&h, &g, &path, &jpath);
    assert_eq!(again.serve(), 1, "only the new request is taken");
    let rsp = bad.responses();
    assert_eq!(rsp.iter().map(|r| r.id).collect::<Vec<_>>(), [3], "{rsp:?}");
    assert!(rsp.iter().all(|r| r.status == BLKIF_RSP_OKAY));
    let _ = std::fs::remove_file(&jpath);
    let _ = std::fs::remove_file(&path);
}

/// A vbd of `g` (device 51712, a backing file named `name`) served by a back end that
/// journals every response, a hostile front end on it, and a page granted to read into.
struct Journaled {
    bad: Hostile,
    back: Blkback,
    path: PathBuf,
    jpath: PathBuf,
    r: GrantRef,
}

fn journaled(h: &Host, g: &Arc<Domain>, name: &str) -> Journaled {
    journaled_as(h, g, name, false)
}

/// [`journaled`], and `served`: as `pvio backend` serves a vbd, the front end taking
/// persistent grants, other segments copied through the back end's pages, and the
/// disk's bytes moving through an io_uring.
fn journaled_as(h: &Host, g: &Arc<Domain>, name: &str, served: bool) -> Journaled {
    let path = backing(name);
    let (disk, bad) = hostile_on(h, g, &path, served);
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    if served {
        assert!(back.persistent());
        assert!(back.copy_transient(blkback::Bounce::new(&h.drv).expect("pages")));
        assert!(back.disk_async(), "io_uring taken");
    }
    let jpath = std::env::temp_dir().join(format!("pvio-vbd-{name}-j-{}", std::process::id()));
    let _ = std::fs::remove_file(&jpath);
    assert!(back
        .set_journal(mem::journal::Journal::open(&jpath, blkback::JOURNAL_LEN).expect("journal")));
    let (_, r) = bad.granted(h, false);
    Journaled {
        bad,
        back,
        path,
        jpath,
        r,
    }
}

/// Device 51712 of `g` on the file at `path`, offered, and a hand-driven front end
/// connected to it, taking persistent grants if `persistent` (as Linux's blkfront).
fn hostile_on(h: &Host, g: &Arc<Domain>, path: &Path, persistent: bool) -> (FileDisk, Hostile) {
    let disk = h.offer(g, 51712, path, false, persistent);
    let bad = Hostile::connect(h, g, 51712);
    if persistent {
        let fdir = xenbus::frontend_dir(g.id(), 51712);
        h.hv.store()
            .write(g.id(), &format!("{fdir}/feature-persistent"), "1")
            .expect("key");
    }
    (disk, bad)
}

/// The back end started after the one of [`journaled`] left: it takes the ring over from
/// the journal at `jpath`.
fn resume_journaled(h: &Host, g: &Arc<Domain>, path: &Path, jpath: &Path) -> Blkback {
    let disk = FileDisk::open(path, false).expect("disk");
    let journal = mem::journal::Journal::open(jpath, blkback::JOURNAL_LEN).expect("journal");
    Blkback::resume(
        hv::Pvio::new(&h.hv, &h.drv),
        g.id(),
        51712,
        0,
        disk,
        Some(journal),
    )
    .expect("resumed")
}

/// A guest that keeps its ring full holds its back end for a bounded time: one `serve`
/// takes at most its budget, says what is left (`pending`), and the next takes the rest,
/// each request answered once, in order.
#[test]
fn one_serve_takes_at_most_its_budget_and_the_rest_waits_for_the_next() {
    let h = host();
    let g = h.guest("flood");
    let path = backing("budget");
    let disk = h.offer(&g, 51712, &path, false, false);
    let mut bad = Hostile::connect(&h, &g, 51712);
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    back.set_budget(8);
    let (_, r) = bad.granted(&h, false);
    let reqs: Vec<_> = (0..20u64)
        .map(|i| rw(BLKIF_OP_READ, i + 1, i, &[seg(r, 0, 0)]))
        .collect();
    bad.send(&reqs);
    assert_eq!(back.serve(), 8);
    assert!(back.pending(), "twelve left on the ring");
    assert_eq!(back.serve(), 8);
    assert_eq!(back.serve(), 4);
    assert!(!back.pending());
    let ids: Vec<u64> = bad.responses().iter().map(|r| r.id).collect();
    assert_eq!(ids, (1..=20).collect::<Vec<_>>());
    assert_eq!(back.stats().taken, 20);
    // A serve that stops at its budget just as the ring empties: the back end then asks
    // for the next request's notification (found under Xen: Linux's blkfront posted
    // its next request without one, and the disk hung).
    let more: Vec<_> = (20..28u64)
        .map(|i| rw(BLKIF_OP_READ, i + 1, i, &[seg(r, 0, 0)]))
        .collect();
    bad.send(&more);
    assert_eq!(back.serve(), 8, "exactly its budget, the ring now empty");
    assert!(!back.pending());
    assert!(
        bad.send(&[rw(BLKIF_OP_READ, 99, 0, &[seg(r, 0, 0)])]),
        "the next request notifies the back end"
    );
    let _ = std::fs::remove_file(&path);
}

/// A front end whose ring spans four pages (`ring-page-order` 2, as Linux's blkfront
/// asks with `max_ring_page_order`) fills all 128 slots; each request is read from
/// wherever a page end cuts it and answered once. An order beyond the one offered is
/// refused.
#[test]
fn a_ring_of_four_pages_is_served_whole_and_a_larger_order_than_offered_refused() {
    let h = host();
    let g = h.guest("guest");
    let path = backing("pages");
    let disk = h.offer(&g, 51712, &path, false, false);
    let bdir = xenbus::backend_dir(h.drv.id(), g.id(), 51712);
    let store = h.hv.store();
    assert_eq!(
        store
            .read(
                h.drv.id(),
                &format!("{bdir}/{}", xenbus::MAX_RING_PAGE_ORDER)
            )
            .as_deref(),
        Ok("4")
    );
    let mut bad = Hostile::connect_order(&h, &g, 51712, Some(2));
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    let (_, r) = bad.granted(&h, false);
    let reqs: Vec<_> = (0..128u64)
        .map(|i| rw(BLKIF_OP_READ, 1000 + i, i % 64, &[seg(r, 0, 7)]))
        .collect();
    bad.send(&reqs);
    let mut served = 0;
    while served < 128 {
        let n = back.serve();
        assert!(n > 0, "every request is taken, {served} so far");
        served += n;
    }
    let rsp = bad.responses();
    assert_eq!(
        rsp.iter().map(|r| r.id).collect::<Vec<_>>(),
        (1000..1128).collect::<Vec<_>>()
    );
    assert!(rsp.iter().all(|r| r.status == BLKIF_RSP_OKAY), "{rsp:?}");
    answered_once(back.stats());
    back.disconnect();
    assert_eq!(h.hv.mappings_held(&h.drv), 0, "every ring page unmapped");

    // Order 5 (32 pages) was not offered.
    let g2 = h.guest("greedy");
    let disk = h.offer(&g2, 51712, &path, false, false);
    let _bad = Hostile::connect_order(&h, &g2, 51712, Some(2));
    let fdir = xenbus::frontend_dir(g2.id(), 51712);
    store
        .write(g2.id(), &format!("{fdir}/ring-page-order"), "5")
        .expect("key");
    assert!(Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g2.id(), 51712, 0, disk).is_err());
    assert_eq!(h.hv.mappings_held(&h.drv), 0);
    let _ = std::fs::remove_file(&path);
}

/// The disk's keys Linux's blkfront reads: its physical sector, discard's granularity,
/// alignment and (never) secure erase; the toolstack's `discard-enable = 0` takes discard
/// away; a secure discard, not offered, is refused and counted, and the disk unchanged.
#[test]
fn the_disk_keys_are_published_discard_enable_is_honoured_and_secure_discard_refused() {
    let h = host();
    let g = h.guest("guest");
    let path = backing("keys");
    let disk = h.offer(&g, 51712, &path, false, false);
    let bdir = xenbus::backend_dir(h.drv.id(), g.id(), 51712);
    let store = h.hv.store();
    let key = |k: &str| store.read(h.drv.id(), &format!("{bdir}/{k}")).expect(k);
    let pss: u32 = key("physical-sector-size").parse().expect("number");
    assert!(pss.is_power_of_two() && pss >= 512, "{pss}");
    assert_eq!(key("feature-discard"), "1");
    assert_eq!(key("discard-granularity"), "512");
    assert_eq!(key("discard-alignment"), "0");
    assert_eq!(key("discard-secure"), "0");
    let mut bad = Hostile::connect(&h, &g, 51712);
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    let before = file_at(&path, 8, 4096);
    let d = blk::blkif::RawDiscard {
        operation: blk::blkif::BLKIF_OP_DISCARD,
        flag: blk::blkif::BLKIF_DISCARD_SECURE,
        id: 9,
        sector_number: 8,
        nr_sectors: 8,
        ..blk::blkif::RawDiscard::default()
    };
    bad.send(&[d.to_slot()]);
    assert_eq!(back.serve(), 1);
    let rsp = bad.responses();
    assert_eq!(
        rsp.iter().map(|r| (r.id, r.status)).collect::<Vec<_>>(),
        [(9, BLKIF_RSP_EOPNOTSUPP)]
    );
    assert_eq!(back.stats().refused.get(BadRequest::NotOffered), 1);
    assert_eq!(file_at(&path, 8, 4096), before, "nothing discarded");
    back.disconnect();

    // The toolstack said no-discard.
    let g2 = h.guest("nodiscard");
    xenbus::create_vbd(h.hv.store(), h.drv.id(), g2.id(), 51712, false).expect("vbd");
    let bdir2 = xenbus::backend_dir(h.drv.id(), g2.id(), 51712);
    store
        .write(
            DomId::DOM0,
            &format!("{bdir2}/{}", xenbus::DISCARD_ENABLE),
            "0",
        )
        .expect("key");
    let disk = FileDisk::open(&path, false).expect("disk");
    blkback::probe(store, h.drv.id(), g2.id(), 51712, &disk, false).expect("probe");
    assert_eq!(
        store
            .read(h.drv.id(), &format!("{bdir2}/feature-discard"))
            .as_deref(),
        Ok("0")
    );
    let _ = std::fs::remove_file(&path);
}

/// A front end with two queues (`multi-queue-num-queues`, each ring and channel under
/// `queue-<n>/`, as Linux's blkfront sets them up on a guest of several vCPUs): each
/// queue is served on its own ring over the one disk, what one writes the other reads,
/// and a count beyond the one offered is refused.
#[test]
fn two_queues_are_served_each_on_its_ring_over_one_disk_and_too_many_refused() {
    let h = host();
    let g = h.guest("guest");
    let path = backing("queues");
    let disk = h.offer(&g, 51712, &path, false, false);
    let bdir = xenbus::backend_dir(h.drv.id(), g.id(), 51712);
    let store = h.hv.store();
    assert_eq!(
        store
            .read(
                h.drv.id(),
                &format!("{bdir}/{}", xenbus::MULTI_QUEUE_MAX_QUEUES)
            )
            .as_deref(),
        Ok("4")
    );
    // Each on a ring of two pages: `ring-page-order` at the top, `ring-ref<n>` per queue,
    // as Linux's blkfront writes them.
    let mut q0 = Hostile::connect_queue(&h, &g, 51712, Some((0, 2)), Some(1));
    let mut q1 = Hostile::connect_queue(&h, &g, 51712, Some((1, 2)), Some(1));
    let mut backs = Blkback::connect_queues(
        hv::Pvio::new(&h.hv, &h.drv),
        g.id(),
        51712,
        0,
        blkback::PERSISTENT_MAX,
        disk,
        None,
    )
    .expect("queues");
    assert_eq!(backs.len(), 2);
    assert_eq!(
        store.xenbus_state(h.drv.id(), &bdir),
        XenbusState::Connected
    );
    // Queue 0 writes a page at sector 16; queue 1 reads it back.
    let (src, w) = q0.granted(&h, true);
    let data: Vec<u8> = (0..4096).map(|i| (i * 13 + 5) as u8).collect();
    g.write(src, 0, &data).expect("fill");
    q0.send(&[rw(BLKIF_OP_WRITE, 1, 16, &[seg(w, 0, 7)])]);
    assert_eq!(backs[0].serve(), 1);
    assert_eq!(backs[1].serve(), 0, "queue 1's ring holds nothing");
    assert_eq!(
        q0.responses()
            .iter()
            .map(|r| (r.id, r.status))
            .collect::<Vec<_>>(),
        [(1, BLKIF_RSP_OKAY)]
    );
    let (dst, r) = q1.granted(&h, false);
    q1.send(&[rw(BLKIF_OP_READ, 2, 16, &[seg(r, 0, 7)])]);
    assert_eq!(backs[1].serve(), 1);
    assert_eq!(
        q1.responses()
            .iter()
            .map(|r| (r.id, r.status))
            .collect::<Vec<_>>(),
        [(2, BLKIF_RSP_OKAY)]
    );
    let mut back_in = vec![0u8; 4096];
    g.read(dst, 0, &mut back_in).expect("read");
    assert_eq!(back_in, data, "one disk under both queues");
    assert!(q0.responses().is_empty(), "each answer on its own ring");
    for b in backs.drain(..) {
        b.disconnect();
    }
    assert_eq!(h.hv.mappings_held(&h.drv), 0);

    // Five queues: more than offered.
    let g2 = h.guest("greedy");
    let disk = h.offer(&g2, 51712, &path, false, false);
    let _q = Hostile::connect_queue(&h, &g2, 51712, Some((0, 5)), None);
    assert!(Blkback::connect_queues(
        hv::Pvio::new(&h.hv, &h.drv),
        g2.id(),
        51712,
        0,
        blkback::PERSISTENT_MAX,
        disk,
        None
    )
    .is_err());
    assert_eq!(h.hv.mappings_held(&h.drv), 0);
    let _ = std::fs::remove_file(&path);
}

/// With the disk's bytes moving asynchronously, requests the disk ends in any order are
/// answered in the order they were taken (what a back end that takes the ring over
/// after a crash relies on), each once, refusals and flushes among them.
#[test]
fn asynchronous_disk_io_answers_every_request_once_in_the_order_taken() {
    let h = host();
    let g = h.guest("guest");
    let Journaled {
        mut bad,
        mut back,
        path,
        jpath,
        r: r0,
    } = journaled_as(&h, &g, "aio-order", true);
    let pages: Vec<(hv::Gfn, GrantRef)> = (0..3).map(|_| bad.granted(&h, false)).collect();
    for (k, (gfn, _)) in pages.iter().enumerate() {
        g.fill(*gfn, 0, 4096, 0x10 + k as u8).expect("fill");
    }
    let (w1, w2, rd) = (pages[0].1, pages[1].1, pages[2].1);
    let before = file_at(&path, 200, 4096);
    let reqs = [
        rw(BLKIF_OP_WRITE, 1, 0, &[seg(w1, 0, 7)]),
        rw(BLKIF_OP_READ, 2, 200, &[seg(rd, 0, 7)]),
        RawRequest {
            operation: blk::blkif::BLKIF_OP_FLUSH_DISKCACHE,
            id: 3,
            ..RawRequest::default()
        },
        // Past the device: refused at once, answered after the three before it.
        rw(BLKIF_OP_READ, 4, SECTORS - 4, &[seg(r0, 0, 7)]),
        rw(BLKIF_OP_WRITE, 5, 64, &[seg(w2, 0, 7)]),
        // Its id again while the first is in flight: refused.
        rw(BLKIF_OP_WRITE, 5, 128, &[seg(w2, 0, 7)]),
    ];
    bad.send(&reqs);
    assert_eq!(back.serve(), reqs.len());
    assert!(
        bad.responses().is_empty(),
        "nothing is answered before the first request's transfer has ended"
    );
    serve_settled(&mut back);
    let got: Vec<(u64, i16)> = bad.responses().iter().map(|r| (r.id, r.status)).collect();
    let (ok, e) = (BLKIF_RSP_OKAY, BLKIF_RSP_ERROR);
    assert_eq!(got, [(1, ok), (2, ok), (3, ok), (4, e), (5, ok), (5, e)]);
    assert_eq!(file_at(&path, 0, 4096), vec![0x10; 4096]);
    assert_eq!(file_at(&path, 64, 4096), vec![0x11; 4096]);
    let mut b = vec![0u8; 4096];
    g.read(pages[2].0, 0, &mut b).expect("read");
    assert_eq!(b, before, "the read got its own sectors");
    let s = back.stats().clone();
    answered_once(&s);
    assert_eq!((s.async_transfers, s.disk_enters), (4, 1), "{s:?}");
    assert_eq!((s.writes, s.reads, s.flushes, s.id_in_flight), (2, 1, 1, 1));
    let _ = std::fs::remove_file(&jpath);
    let _ = std::fs::remove_file(&path);
}

/// A back end that stops (hand-over) or dies (abandon) while the disk moves its
/// requests' bytes: a stop answers them all first; a crash answers none, and the next
/// back end takes each again from the ring; no request is lost or answered twice, and
/// no mapping stays held.
#[test]
fn a_stop_or_a_crash_with_disk_transfers_in_flight_loses_no_request_and_answers_none_twice() {
    let h = host();
    let g = h.guest("guest");
    let Journaled {
        mut bad,
        mut back,
        path,
        jpath,
        ..
    } = journaled_as(&h, &g, "aio-stop", true);
    let pages: Vec<(hv::Gfn, GrantRef)> = (0..8).map(|_| bad.granted(&h, false)).collect();
    for (k, (gfn, _)) in pages.iter().enumerate() {
        g.fill(*gfn, 0, 4096, 0x40 + k as u8).expect("fill");
    }
    let writes = |ids: std::ops::Range<u64>| -> Vec<RawRequest> {
        ids.map(|id| {
            let (_, r) = pages[(id - 1) as usize];
            rw(BLKIF_OP_WRITE, id, 8 * id, &[seg(r, 0, 7)])
        })
        .collect()
    };
    // The crash: placed, none answered, and the dead back end holds nothing.
    bad.send(&writes(1..5));
    assert_eq!(back.serve(), 4);
    back.abandon();
    assert!(
        bad.responses().is_empty(),
        "a dead back end answers nothing"
    );
    assert_eq!(h.hv.mappings_held(&h.drv), 0, "its transfers' pages let go");
    let mut again = resume_journaled(&h, &g, &path, &jpath);
    assert!(again.copy_transient(blkback::Bounce::new(&h.drv).expect("pages")));
    assert!(again.disk_async());
    assert_eq!(serve_settled(&mut again), 4, "each taken again");
    let got: Vec<u64> = bad.responses().iter().map(|r| r.id).collect();
    assert_eq!(got, [1, 2, 3, 4]);
    // The clean stop: every transfer ended and answered before the hand-over returns.
    bad.send(&writes(5..9));
    assert_eq!(again.serve(), 4);
    again.hand_over();
    let rsp = bad.responses();
    assert_eq!(rsp.iter().map(|r| r.id).collect::<Vec<_>>(), [5, 6, 7, 8]);
    assert!(rsp.iter().all(|r| r.status == BLKIF_RSP_OKAY), "{rsp:?}");
    let mut third = resume_journaled(&h, &g, &path, &jpath);
    assert_eq!(serve_settled(&mut third), 0, "nothing left to take again");
    for id in 1..9u64 {
        assert_eq!(
            file_at(&path, 8 * id, 4096),
            vec![0x40 + (id - 1) as u8; 4096],
            "write {id}"
        );
    }
    let _ = std::fs::remove_file(&jpath);
    let _ = std::fs::remove_file(&path);
}

/// A vbd whose disk is opened `O_DIRECT` (`pvio backend` in a driver domain, whose page
/// cache would die with it): every transfer lands in whole sectors of page-aligned pages,
/// so writes and reads, moved at once or through the io_uring, go straight to the file
/// and back.
#[test]
fn a_disk_opened_direct_takes_every_transfer_the_front_end_can_send() {
    let h = host();
    let g = h.guest("guest");
    // On the build's own file system (O_DIRECT needs one that takes it; tmpfs does not).
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("pvio-vbd-direct-{}", std::process::id()));
    std::fs::copy(backing("direct-src"), &path).expect("backing file");
    let disk = FileDisk::open_with(&path, false, true).expect("O_DIRECT taken here");
    assert!(disk.direct());
    xenbus::create_vbd(h.hv.store(), h.drv.id(), g.id(), 51712, false).expect("vbd");
    blkback::probe(h.hv.store(), h.drv.id(), g.id(), 51712, &disk, true).expect("probe");
    let mut front = Blkfront::connect(&h.hv, &g, 51712, true).expect("front");
    let mut back =
        Blkback::connect(hv::Pvio::new(&h.hv, &h.drv), g.id(), 51712, 0, disk).expect("back");
    assert!(back.copy_transient(blkback::Bounce::new(&h.drv).expect("pages")));
    for aio in [false, true] {
        assert!(!aio || back.disk_async());
        // A sector in the middle of a page, whole pages, and 32 pages indirect.
        let one = pages(&g, 1, 1024, 512);
        let slot = pages(&g, 11, 0, 4096);
        let ind = pages(&g, 32, 0, 4096);
        let shapes: [(&[BioSeg], u64); 3] = [(&one, 7), (&slot, 100), (&ind, 1000)];
        let data: Vec<Vec<u8>> = shapes
            .iter()
            .map(|(s, _)| fill(&g, s, 0x31 + u8::from(aio)))
            .collect();
        let bios = |op| -> Vec<Bio<'_>> {
            shapes
                .iter()
                .map(|&(segs, sector)| Bio { op, sector, segs })
                .collect()
        };
        let c = run(&mut front, &mut back, &bios(BioOp::Write));
        assert!(c.len() == 3 && c.iter().all(Completion::ok), "{c:?}");
        for ((_, sector), d) in shapes.iter().zip(&data) {
            assert_eq!(&file_at(&path, *sector, d.len()), d, "on the disk");
        }
        for (s, _) in &shapes {
            for p in s.iter() {
                g.fill(p.gfn, 0, 4096, 0xee).expect("fill");
            }
        }
        let c = run(&mut front, &mut back, &bios(BioOp::Read));
        assert!(c.iter().all(Completion::ok), "{c:?}");
        for ((s, _), d) in shapes.iter().zip(&data) {
            assert_eq!(&gather(&g, s), d, "read back");
        }
    }
    let s = back.stats().clone();
    answered_once(&s);
    assert_eq!((s.io_errors, s.writes, s.reads), (0, 6, 6), "{s:?}");
    back.disconnect();
    front.close();
    let _ = std::fs::remove_file(&path);
}

/// A queue told to keep N grants mapped (`pvio backend --persistent-grants`, Linux's
/// `max_persistent_grants`) keeps the first N it meets and no more; a segment whose grant
/// comes after is copied through the back end's pages, and the bytes the guest reads are
/// the disk's either way.
#[test]
fn a_queue_keeps_as_many_persistent_grants_as_it_was_told_and_copies_the_rest() {
    let h = host();
    let g = h.guest("few");
    let path = backing("few-grants");
    let (disk, mut bad) = hostile_on(&h, &g, &path, true);
    let mut backs = Blkback::connect_queues(
        hv::Pvio::new(&h.hv, &h.drv),
        g.id(),
        51712,
        0,
        3,
        disk,
        None,
    )
    .expect("connected");
    assert_eq!(backs.len(), 1, "a front end without queues has one");
    let mut back = backs.pop().expect("one");
    assert!(back.persistent());
    assert!(back.copy_transient(blkback::Bounce::new(&h.drv).expect("pages")));
    let pages: Vec<_> = (0..5).map(|_| bad.granted(&h, false)).collect();
    let expect = |i: usize| -> Vec<u8> {
        (i * 4096..(i + 1) * 4096)
            .map(|b| (b.wrapping_mul(7) + b / 4096) as u8)
            .collect()
    };
    for round in 1..=2u64 {
        for (gfn, _) in &pages {
            g.write(*gfn, 0, &[0u8; 4096]).expect("cleared");
        }
        let reqs: Vec<_> = pages
            .iter()
            .enumerate()
            .map(|(i, (_, r))| {
                rw(
                    BLKIF_OP_READ,
                    round * 10 + i as u64,
                    i as u64 * 8,
                    &[seg(*r, 0, 7)],
                )
            })
            .collect();
        bad.send(&reqs);
        while back.pending() || back.disk_in_flight() > 0 {
            back.serve();
        }
        let rsp = bad.responses();
        assert_eq!(rsp.len(), 5, "round {round}");
        assert!(rsp.iter().all(|r| r.status == BLKIF_RSP_OKAY), "{rsp:?}");
        for (i, (gfn, _)) in pages.iter().enumerate() {
            let mut got = vec![0u8; 4096];
            g.read(*gfn, 0, &mut got).expect("read");
            assert!(
                got == expect(i),
                "round {round}: page {i} holds the disk's sector {}",
                i * 8
            );
        }
        let s = back.stats();
        assert_eq!(
            s.persistent_maps, 3,
            "round {round}: only the first three are kept"
        );
        assert_eq!(s.persistent_hits, 3 * (round - 1), "round {round}");
        assert_eq!(
            s.transient_copies,
            2 * round,
            "round {round}: the other two copied"
        );
    }
    let _ = std::fs::remove_file(&path);
}
