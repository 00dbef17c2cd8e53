//! netfront against a hostile back end.
//!
//! A guest with two interfaces: vif 1 on a real netback, vif 0 on a back end that maps
//! the guest's rings by hand and writes whatever the fuzzer says — RX and TX responses
//! with any id, status, offset and flags, data written into posted buffers, grants kept
//! mapped, response producers moved forward, back and at random — while the guest
//! sends packets of every size and polls both rings. The case ends as a dying back end
//! does: it unmaps what it mapped, the toolstack closes its directory, and the guest's
//! netfront follows the store, disconnects and is removed.
//!
//! Oracle: every packet buffer and page of the guest's pool is back, every grant
//! reference it gave out is free again, no event channel and no mapping is left, and
//! the guest's other interface still sends and receives. The world (hypervisor,
//! domains, the good interface) lives for the thread, so a case costs what the back
//! end's and netfront's work costs; the oracle is what keeps cases independent.

use std::cell::RefCell;
use std::sync::Arc;

use hv::{Domain, DomainConfig, GrantHandle, GrantRef, GrantVersion, HvConfig, Hypervisor, MapOp};
use net::netback::{Vif, VIF_WINDOW_SLOTS};
use net::netfront::FrontConfig;
use net::netfront::{LinkChange, Netfront, RxBuffers};
use net::netif::{
    RxResponse, TxRequest, TxResponse, NETRXF_DATA_VALIDATED, NETRXF_EXTRA_INFO, NETRXF_MORE_DATA,
    XEN_NETIF_RSP_DROPPED, XEN_NETIF_RSP_ERROR, XEN_NETIF_RSP_NULL, XEN_NETIF_RSP_OKAY,
};
use net::skb::{SkbPool, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};
use net::xenbus;

use crate::Input;

const HDR: usize = 64;
const SLOTS: u32 = 256;
/// The hostile back end's window slots: its two ring mappings, then buffers it keeps.
const RING_SLOT: u32 = VIF_WINDOW_SLOTS;
const KEEP_SLOTS: u32 = 4;

/// The hostile interface's handle, and the good one's.
const EVIL: u32 = 0;
const GOOD: u32 = 1;

struct World {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    guest: Arc<Domain>,
    gpool: SkbPool,
    dpool: SkbPool,
    good: (Netfront, Vif),
}

fn world() -> World {
    let hv = Hypervisor::new(HvConfig {
        frames: 4096,
        ..HvConfig::default()
    })
    .expect("hv");
    let dom = |name: &str, driver: bool, slots: u32| {
        hv.create_domain(&DomainConfig {
            name: name.into(),
            pages: 1024,
            // Two front ends' 2 × 256 buffer references and rings (v2: 256 a frame).
            grant_frames: 8,
            grant_version: GrantVersion::V2,
            vcpus: 1,
            map_slots: slots,
            driver_domain: driver,
        })
        .expect("domain")
    };
    let drv = dom("drv", true, RING_SLOT + 2 + KEEP_SLOTS);
    let guest = dom("guest", false, 4);
    let spec = VifSpec {
        handle: GOOD,
        mac: [2, 0, 0, 0, 0, 1],
        index: 0,
        front: FrontConfig::default(),
    };
    let good = toolstack::plug_vif(&hv, &drv, &guest, spec).expect("good vif");
    let mut gpool = SkbPool::new(Arc::clone(&guest), 128, 600).expect("pool");
    let dpool = SkbPool::new(Arc::clone(&drv), 64, 16).expect("pool");
    let mut good = good;
    good.0.refill_rx(&mut gpool);
    World {
        hv,
        drv,
        guest,
        gpool,
        dpool,
        good,
    }
}

/// The good interface carries one packet each way.
fn good_works(w: &mut World) {
    let (front, vif) = &mut w.good;
    front.poll_tx(&mut w.gpool);
    let s = w.gpool.alloc(NET_SKB_PAD).expect("guest skb");
    w.gpool.put(s, &[0x5a; 80]).expect("put");
    front.xmit(&mut w.gpool, s).expect("room");
    let mut sent = 0;
    vif.tx_action(&mut w.dpool, 64, |p, s| {
        sent += 1;
        p.free(s)
    });
    let mut tokens = Vec::new();
    w.dpool.take_released(|r| tokens.push(r.token));
    vif.tx_release(tokens);
    front.poll_tx(&mut w.gpool);
    assert_eq!(sent, 1, "the good interface still sends");
    let s = w.dpool.alloc(NET_SKB_PAD).expect("driver skb");
    w.dpool.put(s, &[0xa5; 90]).expect("put");
    vif.start_xmit(&mut w.dpool, s);
    vif.rx_action(&mut w.dpool);
    let mut got = 0;
    front.poll_rx(&mut w.gpool, 64, |p, s| {
        got += 1;
        p.free(s)
    });
    assert_eq!(got, 1, "the good interface still receives");
}

thread_local! {
    static WORLD: RefCell<Option<World>> = const { RefCell::new(None) };
}

/// One case.
pub fn case(inp: &mut Input<'_>) {
    WORLD.with_borrow_mut(|slot| {
        let w = slot.get_or_insert_with(|| {
            let mut w = world();
            // The good interface's buffer use settles after its first packets.
            good_works(&mut w);
            w
        });
        hostile(w, inp);
        good_works(w);
    });
}

/// `drv` maps `guest`'s grant `gref` at window slot `slot`.
fn map_grant(
    hv: &Hypervisor,
    drv: &Domain,
    guest: hv::DomId,
    gref: u32,
    readonly: bool,
    slot: u32,
) -> Option<GrantHandle> {
    let mut res = [Err(hv::GrantError::BadPage)];
    hv.grant_map(
        drv,
        &[MapOp {
            dom: guest,
            gref: GrantRef(gref),
            readonly,
            slot,
        }],
        &mut res,
    );
    res[0].ok()
}

/// The hostile back end: the guest's rings mapped at its window, its own indices.
struct RawBack {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    guest: hv::DomId,
    rings: [GrantHandle; 2],
    kept: Vec<GrantHandle>,
    rx_rsp: u32,
    tx_rsp: u32,
    tx_seen: u32,
    rx_seen: u32,
    /// Ids the guest used in requests, for responses that look right.
    tx_ids: Vec<u16>,
    rx_ids: Vec<(u16, u32)>,
}

impl RawBack {
    fn word(&self, ring: u32, at: usize) -> u32 {
        let mut b = [0u8; 4];
        self.drv
            .window()
            .read(RING_SLOT + ring, at, &mut b)
            .expect("ring index");
        u32::from_le_bytes(b)
    }
    fn set_word(&self, ring: u32, at: usize, v: u32) {
        self.drv
            .window()
            .write(RING_SLOT + ring, at, &v.to_le_bytes())
            .expect("ring index");
    }
    /// Reads the requests published since the last look.
    fn look(&mut self) {
        let prod = self.word(0, 0);
        while self.tx_seen != prod && self.tx_ids.len() < 512 {
            let mut r = TxRequest::default();
            let at = HDR + (self.tx_seen % SLOTS) as usize * 12;
            let _ = self
                .drv
                .window()
                .read(RING_SLOT, at, bytemuck::bytes_of_mut(&mut r));
            self.tx_ids.push(r.id);
            self.tx_seen = self.tx_seen.wrapping_add(1);
        }
        let prod = self.word(1, 0);
        while self.rx_seen != prod && self.rx_ids.len() < 512 {
            let mut r = net::netif::RxRequest::default();
            let at = HDR + (self.rx_seen % SLOTS) as usize * 8;
            let _ = self
                .drv
                .window()
                .read(RING_SLOT + 1, at, bytemuck::bytes_of_mut(&mut r));
            self.rx_ids.push((r.id, r.gref));
            self.rx_seen = self.rx_seen.wrapping_add(1);
        }
    }
    fn map(&self, gref: u32, readonly: bool, slot: u32) -> Option<GrantHandle> {
        map_grant(&self.hv, &self.drv, self.guest, gref, readonly, slot)
    }
    fn unmap(&self, hs: &[GrantHandle]) {
        let mut st = vec![Ok(()); hs.len()];
        self.hv.grant_unmap(&self.drv, hs, &mut st);
    }
}

fn hostile(w: &mut World, inp: &mut Input<'_>) {
    let gt = w.guest.grant_table();
    let baseline = (
        w.gpool.free_buffers(),
        w.gpool.free_pages(),
        gt.refs_free(),
        w.hv.evtchn_open_ports(&w.guest),
        w.hv.mappings_held(&w.drv),
    );
    let spec = VifSpec {
        handle: EVIL,
        mac: [2, 0, 0, 0, 0, 9],
        index: 1,
        front: FrontConfig {
            rx_buffers: inp.pick(&[RxBuffers::Fragments, RxBuffers::Linear]),
            ..FrontConfig::default()
        },
    };
    toolstack::offer_vif(&w.hv, &w.drv, &w.guest, spec).expect("offer");
    let mut front =
        Netfront::connect_with(&w.hv, &w.guest, EVIL, spec.front.rx_buffers).expect("front end");
    front.refill_rx(&mut w.gpool);
    // The back end maps both rings by hand.
    let fdir = xenbus::frontend_dir(w.guest.id(), EVIL);
    let key = |k: &str| {
        xenbus::read_u32(w.hv.store(), w.drv.id(), &format!("{fdir}/{k}")).expect("ring ref")
    };
    let (tref, rref) = (key("tx-ring-ref"), key("rx-ring-ref"));
    let ring = |gref, slot| map_grant(&w.hv, &w.drv, w.guest.id(), gref, false, slot);
    let rings = [
        ring(tref, RING_SLOT).expect("tx ring"),
        ring(rref, RING_SLOT + 1).expect("rx ring"),
    ];
    let mut be = RawBack {
        hv: Arc::clone(&w.hv),
        drv: Arc::clone(&w.drv),
        guest: w.guest.id(),
        rings,
        kept: Vec::new(),
        rx_rsp: 0,
        tx_rsp: 0,
        tx_seen: 0,
        rx_seen: 0,
        tx_ids: Vec::new(),
        rx_ids: Vec::new(),
    };
    let rounds = inp.below(6) + 1;
    for _ in 0..rounds {
        // The guest sends.
        for _ in 0..inp.below(6) {
            let len = inp.pick(&[14usize, 60, 200, 1514, 3000]);
            let Ok(s) = w.gpool.alloc(NET_SKB_PAD) else {
                break;
            };
            if w.gpool.put(s, &vec![0x77; len]).is_err() {
                w.gpool.free(s);
                continue;
            }
            if let Err(s) = front.xmit(&mut w.gpool, s) {
                w.gpool.free(s);
            }
        }
        be.look();
        // TX responses.
        for _ in 0..inp.below(10) {
            let id = match inp.below(4) {
                0 => inp.below(300) as u16,
                _ => be
                    .tx_ids
                    .get(inp.below(be.tx_ids.len() as u64) as usize)
                    .copied()
                    .unwrap_or(0),
            };
            let any = inp.u64();
            let status = inp.pick(&[
                XEN_NETIF_RSP_OKAY,
                XEN_NETIF_RSP_OKAY,
                XEN_NETIF_RSP_ERROR,
                XEN_NETIF_RSP_DROPPED,
                XEN_NETIF_RSP_NULL,
                any as i16,
            ]);
            let at = HDR + (be.tx_rsp % SLOTS) as usize * 12;
            let _ = be.drv.window().write(
                RING_SLOT,
                at,
                bytemuck::bytes_of(&TxResponse { id, status }),
            );
            be.tx_rsp = be.tx_rsp.wrapping_add(1);
        }
        // RX responses, some with data written into the buffer first.
        for _ in 0..inp.below(10) {
            let (id, gref) = match inp.below(4) {
                0 => (inp.below(300) as u16, 0),
                _ => be
                    .rx_ids
                    .get(inp.below(be.rx_ids.len() as u64) as usize)
                    .copied()
                    .unwrap_or((0, 0)),
            };
            if inp.below(3) == 0 && (be.kept.len() as u32) < KEEP_SLOTS {
                let slot = RING_SLOT + 2 + be.kept.len() as u32;
                if let Some(h) = be.map(gref, false, slot) {
                    let _ = be.drv.window().write(slot, 0, &[inp.u64() as u8; 4096]);
                    if inp.coin() {
                        be.kept.push(h);
                    } else {
                        be.unmap(&[h]);
                    }
                }
            }
            let any = inp.u64();
            let flags = inp.pick(&[
                0,
                0,
                NETRXF_MORE_DATA,
                NETRXF_DATA_VALIDATED,
                NETRXF_EXTRA_INFO,
                any as u16,
            ]);
            let status = inp.pick(&[
                0i16,
                1,
                14,
                60,
                1514,
                4000,
                4096,
                5000,
                XEN_NETIF_RSP_ERROR,
                (any >> 16) as i16,
            ]);
            let offset = inp.pick(&[0u16, 2, 100, 4000, 4095, (any >> 32) as u16]);
            let at = HDR + (be.rx_rsp % SLOTS) as usize * 8;
            let _ = be.drv.window().write(
                RING_SLOT + 1,
                at,
                bytemuck::bytes_of(&RxResponse {
                    id,
                    offset,
                    flags,
                    status,
                }),
            );
            be.rx_rsp = be.rx_rsp.wrapping_add(1);
        }
        // Publish, honestly or not.
        for (ring, prod) in [(0, be.tx_rsp), (1, be.rx_rsp)] {
            let v = match inp.below(10) {
                0 => prod.wrapping_sub(inp.below(4) as u32 + 1),
                1 => prod.wrapping_add(inp.below(600) as u32),
                2 => inp.u64() as u32,
                _ => prod,
            };
            be.set_word(ring, 8, v);
        }
        if inp.below(4) == 0 && !be.kept.is_empty() {
            let h = be.kept.remove(0);
            be.unmap(&[h]);
        }
        // The guest polls both rings (what it delivers is bytes of its own pages).
        front.poll_rx(&mut w.gpool, 64, |p, s| p.free(s));
        front.poll_tx(&mut w.gpool);
    }
    // The back end dies: it unmaps what it holds, and the toolstack closes it.
    let mut all = be.kept.clone();
    all.extend(be.rings);
    be.unmap(&all);
    toolstack::close_backend(&w.hv, w.drv.id(), w.guest.id(), EVIL);
    assert_eq!(
        front.check_backend(&mut w.gpool),
        LinkChange::Disconnected,
        "the front end follows its back end's closing"
    );
    front.close(&mut w.gpool);
    let _ = w.hv.store().rm(hv::DomId::DOM0, &fdir);
    assert_eq!(
        (
            w.gpool.free_buffers(),
            w.gpool.free_pages(),
            gt.refs_free(),
            w.hv.evtchn_open_ports(&w.guest),
            w.hv.mappings_held(&w.drv),
        ),
        baseline,
        "buffers, pages, grant references, ports and mappings are back"
    );
}
