//! A target played in memory, as Debian's `vblade` answers: shelf 1 slot 2, sixteen
//! buffers, two sectors a frame, no flush; it can die, come back, and drop frames.

#![allow(dead_code)]

use blk::aoe::{self, AOE_HEADER_END, ATA_DATA, CMD_ATA, CMD_CONFIG, FLAG_RESPONSE, SECTOR};

/// The initiator's MAC.
pub const ME: [u8; 6] = [2, 0, 0, 0, 0, 1];
/// The target's.
pub const TARGET: [u8; 6] = [2, 0, 0, 0, 0, 0x99];
/// The target's disk (1 MiB).
pub const SECTORS: u64 = 2048;

/// Byte `off` of the target's disk as it starts.
pub fn disk_byte(off: usize) -> u8 {
    (off.wrapping_mul(31) ^ (off >> 9)) as u8
}

/// vblade, in memory: shelf 1 slot 2.
pub struct Target {
    pub disk: Vec<u8>,
    pub alive: bool,
    /// Drop every `n`th request.
    pub drop_every: Option<usize>,
    /// Sectors a frame it offers and takes (vblade's are its MTU's: 2 at 1500 bytes,
    /// 17 at 9000).
    pub per_frame: u8,
    seen: usize,
}

impl Target {
    pub fn new() -> Self {
        Self {
            disk: (0..SECTORS as usize * SECTOR).map(disk_byte).collect(),
            alive: true,
            drop_every: None,
            per_frame: 2,
            seen: 0,
        }
    }

    /// The answer to `req`, if any.
    pub fn answer(&mut self, req: &[u8]) -> Option<Vec<u8>> {
        if !self.alive || req.len() < AOE_HEADER_END || req[12..14] != [0x88, 0xa2] {
            return None;
        }
        self.seen += 1;
        if self.drop_every.is_some_and(|n| self.seen.is_multiple_of(n)) {
            return None;
        }
        let mut r = req[..AOE_HEADER_END].to_vec();
        r[..6].copy_from_slice(&req[6..12]);
        r[6..12].copy_from_slice(&TARGET);
        r[14] |= FLAG_RESPONSE;
        r[16..19].copy_from_slice(&[0, 1, 2]);
        match req[19] {
            CMD_CONFIG => {
                r.extend_from_slice(&[0, 16, 0x40, 0x19, self.per_frame, 0x10, 0, 0]);
                Some(r)
            }
            CMD_ATA => {
                let a = &req[AOE_HEADER_END..ATA_DATA];
                let mut lba = [0u8; 8];
                lba[..6].copy_from_slice(&a[4..10]);
                let lba = u64::from_le_bytes(lba) as usize;
                let count = usize::from(a[2]);
                let mut h = a.to_vec();
                h[3] = 0x40;
                let mut data = Vec::new();
                match a[3] {
                    aoe::ATA_IDENTIFY => {
                        let mut s = vec![0u8; 512];
                        s[83 * 2 + 1] = 0x04;
                        s[200..208].copy_from_slice(&SECTORS.to_le_bytes());
                        data = s;
                    }
                    aoe::ATA_READ_EXT
                        if (lba + count) as u64 <= SECTORS
                            && count <= usize::from(self.per_frame) =>
                    {
                        data = self.disk[lba * SECTOR..(lba + count) * SECTOR].to_vec();
                    }
                    aoe::ATA_WRITE_EXT
                        if (lba + count) as u64 <= SECTORS
                            && count <= usize::from(self.per_frame) =>
                    {
                        self.disk[lba * SECTOR..(lba + count) * SECTOR]
                            .copy_from_slice(&req[ATA_DATA..ATA_DATA + count * SECTOR]);
                    }
                    _ => {
                        h[3] = 0x41;
                        h[1] = 0x04;
                    }
                }
                r.extend_from_slice(&h);
                r.extend_from_slice(&data);
                Some(r)
            }
            _ => None,
        }
    }
}

use std::sync::Arc;

use blk::blkback::VBD_WINDOW_SLOTS;
use blk::blkif::{BlkRing, RawRequest, Response, Segment};
use blk::xenbus;
use hv::store::{XenStore, XenbusState};
use hv::{Domain, DomainConfig, Gfn, GrantRef, GrantVersion, HvConfig, Hypervisor, OwnPage, Port};
use ring::{FrontRing, PagesRing};

/// A hypervisor and a driver domain with window slots for two devices.
pub struct Host {
    pub hv: Arc<Hypervisor>,
    pub drv: Arc<Domain>,
}

/// A fresh [`Host`].
pub fn host() -> Host {
    let hv = Hypervisor::new(HvConfig {
        frames: 16384,
        ..HvConfig::default()
    })
    .expect("hv");
    let drv = hv
        .create_domain(&DomainConfig {
            name: "drv".into(),
            pages: 1024,
            grant_frames: 4,
            grant_version: GrantVersion::V1,
            vcpus: 1,
            map_slots: 2 * VBD_WINDOW_SLOTS,
            driver_domain: true,
        })
        .expect("driver domain");
    Host { hv, drv }
}

impl Host {
    /// A guest of 4096 pages.
    pub fn guest(&self, name: &str) -> Arc<Domain> {
        self.hv
            .create_domain(&DomainConfig {
                name: name.into(),
                pages: 4096,
                grant_frames: 8,
                grant_version: GrantVersion::V1,
                vcpus: 1,
                map_slots: 4,
                driver_domain: false,
            })
            .expect("guest")
    }
}

/// A front end written by hand, as a hostile guest would: its own ring, raw requests.
pub struct Hostile {
    pub g: Arc<Domain>,
    pub ring: FrontRing<BlkRing, PagesRing<OwnPage>>,
    pub ring_gfn: Gfn,
    pub port: Port,
}

impl Hostile {
    /// Publishes its ring by hand and says it is connected.
    pub fn connect(h: &Host, g: &Arc<Domain>, devid: u32) -> Self {
        Self::connect_order(h, g, devid, None)
    }

    /// As [`Hostile::connect`], its ring on 2^`order` pages (`ring-page-order`,
    /// `ring-ref0`...) if `order` is given.
    pub fn connect_order(h: &Host, g: &Arc<Domain>, devid: u32, order: Option<u32>) -> Self {
        Self::connect_queue(h, g, devid, None, order)
    }

    /// As [`Hostile::connect_order`], as queue `q` of `n` (`multi-queue-num-queues`,
    /// its ring and channel under `queue-<q>/`) if `queue` is `Some((q, n))`.
    pub fn connect_queue(
        h: &Host,
        g: &Arc<Domain>,
        devid: u32,
        queue: Option<(u32, u32)>,
        order: Option<u32>,
    ) -> Self {
        let me = g.id();
        let n = 1usize << order.unwrap_or(0);
        let mut gfns = Vec::new();
        let mut pages = Vec::new();
        let top = xenbus::frontend_dir(me, devid);
        let dir = match queue {
            Some((q, _)) => format!("{top}/queue-{q}"),
            None => top.clone(),
        };
        if let Some((_, all)) = queue {
            h.hv.store()
                .write(
                    me,
                    &format!("{top}/multi-queue-num-queues"),
                    &all.to_string(),
                )
                .expect("key");
        }
        let store = h.hv.store();
        for i in 0..n {
            let gfn = g.alloc_page().expect("page");
            let gref = g.grant_table().alloc_ref().expect("ref");
            g.grant_table()
                .grant_access(gref, h.drv.id(), gfn, false)
                .expect("grant");
            let key = match order {
                Some(_) => format!("{dir}/ring-ref{i}"),
                None => format!("{dir}/ring-ref"),
            };
            store.write(me, &key, &gref.0.to_string()).expect("key");
            gfns.push(gfn);
            pages.push(g.page(gfn).expect("page"));
        }
        if let Some(o) = order {
            // At the top, for every queue alike, as Linux's blkfront writes it.
            store
                .write(me, &format!("{top}/ring-page-order"), &o.to_string())
                .expect("key");
        }
        let gfn = gfns[0];
        let ring = FrontRing::init(PagesRing::new(pages).expect("ring")).expect("ring");
        let port = h.hv.evtchn_alloc_unbound(g, h.drv.id()).expect("port");
        store
            .write(me, &format!("{dir}/event-channel"), &port.0.to_string())
            .expect("key");
        store
            .switch_state(me, &top, XenbusState::Connected)
            .expect("state");
        Self {
            g: Arc::clone(g),
            ring,
            ring_gfn: gfn,
            port,
        }
    }

    /// A page granted to the driver domain, read-only or not.
    pub fn granted(&self, h: &Host, readonly: bool) -> (Gfn, GrantRef) {
        let gfn = self.g.alloc_page().expect("page");
        let r = self.g.grant_table().alloc_ref().expect("ref");
        self.g
            .grant_table()
            .grant_access(r, h.drv.id(), gfn, readonly)
            .expect("grant");
        (gfn, r)
    }

    /// Pushes `reqs` and publishes them; whether the back end asked to be notified.
    pub fn send(&mut self, reqs: &[RawRequest]) -> bool {
        for r in reqs {
            self.ring.push_request(r).expect("push");
        }
        self.ring.push_requests_and_check_notify()
    }

    /// Every response published.
    pub fn responses(&mut self) -> Vec<Response> {
        let mut v = Vec::new();
        while let Ok(Some(r)) = self.ring.take_response() {
            v.push(r);
        }
        v
    }
}

/// A read or write request with `segs` in its slot.
pub fn rw(op: u8, id: u64, sector: u64, segs: &[Segment]) -> RawRequest {
    let mut r = RawRequest {
        operation: op,
        nr_segments: segs.len() as u8,
        id,
        sector_number: sector,
        ..RawRequest::default()
    };
    r.seg[..segs.len()].copy_from_slice(segs);
    r
}

/// A segment of sectors `first..=last` of grant `gref`'s page.
pub fn seg(gref: GrantRef, first: u8, last: u8) -> Segment {
    Segment {
        gref: gref.0,
        first_sect: first,
        last_sect: last,
        pad: 0,
    }
}
