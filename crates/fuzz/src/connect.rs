//! The xenbus handshake with odd store values, from both ends.
//!
//! A driver domain with a well-behaved guest's vif (netback's world) and a second
//! guest whose vif the fuzzer drives through connection and disconnection in any
//! order. Each step is one of:
//! - the guest writes a key of its front-end directory (the ring references, the event
//!   channel, the features, the state) with a value from a vocabulary of the valid,
//!   the stale and the malformed (signs, spaces, hex, leading zeros, overflow, digits
//!   outside ASCII, empty, long), removes a key or the directory, or changes its
//!   permissions;
//! - the back end writes a key of its own directory the same way (a hostile back end,
//!   as netfront sees it);
//! - the guest's netfront connects, follows its back end, or closes;
//! - netback connects (`Vif::connect` reads whatever is there), disconnects, or does
//!   what its watch does when the front end leaves;
//! - the toolstack closes the back end or offers the vif again;
//! - the guest revokes a grant or closes a channel it published;
//! - a packet goes each way over whatever is connected.
//!
//! Oracle: once netfront is closed the guest has every buffer, page, grant reference
//! and channel back; once the vif is disconnected and the guest destroyed, the driver
//! domain has every buffer, page, mapping and port back and no frame of the guest is
//! held; a second well-behaved guest then connects at the same vif index, carries a
//! packet each way and gives everything back on both sides (so nothing a case left
//! behind blocks the next vif); and the first well-behaved guest still sends.

use std::sync::Arc;

use hv::store::Perm;
use hv::{DomId, Domain, GrantRef, Hypervisor, Port};
use net::netback::Vif;
use net::netfront::FrontConfig;
use net::netfront::{Netfront, RxBuffers};
use net::skb::{SkbPool, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};
use net::xenbus;

use crate::netback::{good_sends, release, world, Good, World};
use crate::Input;

const SPEC: VifSpec = VifSpec {
    handle: 0,
    mac: [2, 0, 0, 0, 0, 0x0c],
    index: 0,
    front: FrontConfig::ORIGINAL,
};

const FRONT_KEYS: [&str; 9] = [
    "tx-ring-ref",
    "rx-ring-ref",
    "event-channel",
    "request-rx-copy",
    "feature-sg",
    "feature-rx-notify",
    "state",
    "backend-id",
    "junk",
];
const BACK_KEYS: [&str; 5] = [
    "state",
    "feature-rx-copy",
    "feature-sg",
    "frontend-id",
    "junk",
];
const ODD: [&str; 22] = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "255",
    "-1",
    "+1",
    " 1",
    "1 ",
    "0x1",
    "",
    "0001",
    "4294967295",
    "4294967296",
    "\u{663}",
    "99999999999999999999999999",
    "true",
    "1\n",
];

/// A guest with enough pages for a pool that posts part of the RX ring (netfront posts
/// what it has).
fn guest(hv: &Arc<Hypervisor>) -> Arc<Domain> {
    crate::netback::guest(hv, "hand", 128)
}

/// What the guest published by hand: two ring pages and a data page granted to the
/// driver domain, one of them revoked later, and two channels (one for the driver
/// domain, one for nobody).
struct Raw {
    refs: [u32; 4],
    ports: [Port; 2],
}

impl Raw {
    fn new(hv: &Hypervisor, g: &Domain, drv: DomId) -> Raw {
        let gt = g.grant_table();
        let mut refs = [0u32; 4];
        for (i, r) in refs.iter_mut().enumerate() {
            let page = g.alloc_page().expect("page");
            let gr = gt.alloc_ref().expect("ref");
            gt.grant_access(gr, drv, page, i == 2).expect("grant");
            *r = gr.0;
        }
        gt.end_access(GrantRef(refs[3])).expect("revoke");
        let ports = [
            hv.evtchn_alloc_unbound(g, drv).expect("port"),
            hv.evtchn_alloc_unbound(g, DomId(0x7ff0)).expect("port"),
        ];
        Raw { refs, ports }
    }

    fn value(&self, inp: &mut Input<'_>) -> String {
        match inp.below(6) {
            0 => inp.pick(&self.refs).to_string(),
            1 => inp.pick(&self.ports).0.to_string(),
            2 => "9".repeat(inp.pick(&[11usize, 200, 3000])),
            _ => inp.pick(&ODD).to_string(),
        }
    }
}

/// One case.
pub fn case(inp: &mut Input<'_>) {
    WORLD.with_borrow_mut(|slot| {
        let (w, good, next) = slot.get_or_insert_with(|| {
            let (w, good) = world();
            let g = guest(&w.hv);
            let pool = SkbPool::new(Arc::clone(&g), 32, 48).expect("pool");
            (w, good, (g, pool))
        });
        handshakes(w, inp);
        next_vif_works(w, next);
        good_sends(w, good);
    });
}

/// A second well-behaved guest, which takes the hostile guest's vif index after every
/// case.
type Next = (Arc<Domain>, SkbPool);

thread_local! {
    static WORLD: std::cell::RefCell<Option<(World, Good, Next)>> =
        const { std::cell::RefCell::new(None) };
}

fn drv_counts(w: &World) -> (usize, usize, usize, usize) {
    (
        w.pool.free_buffers(),
        w.pool.free_pages(),
        w.hv.mappings_held(&w.drv),
        w.hv.evtchn_open_ports(&w.drv),
    )
}

/// Removes a destroyed guest's directories, as the toolstack does.
fn forget(w: &World, id: DomId) {
    let store = w.hv.store();
    let _ = store.rm(DomId::DOM0, &format!("/local/domain/{}", id.0));
    let _ = store.rm(
        DomId::DOM0,
        &format!("/local/domain/{}/backend/vif/{}", w.drv.id().0, id.0),
    );
}

/// A packet each way over whatever is connected; what arrives is dropped.
fn traffic(
    w: &mut World,
    gpool: &mut SkbPool,
    front: &mut Option<Netfront>,
    vif: &mut Option<Vif>,
) {
    if let Some(f) = front.as_mut() {
        f.poll_tx(gpool);
        if let Ok(s) = gpool.alloc(NET_SKB_PAD) {
            gpool.put(s, &[0x42; 120]).expect("put");
            if let Err(s) = f.xmit(gpool, s) {
                gpool.free(s);
            }
        }
    }
    if let Some(v) = vif.as_mut() {
        v.tx_action(&mut w.pool, 64, |p, s| p.free(s));
        release(&mut w.pool, v);
        if let Ok(s) = w.pool.alloc(NET_SKB_PAD) {
            w.pool.put(s, &[0x24; 90]).expect("put");
            v.start_xmit(&mut w.pool, s);
        }
        v.rx_action(&mut w.pool);
    }
    if let Some(f) = front.as_mut() {
        f.poll_rx(gpool, 64, |p, s| p.free(s));
        f.poll_tx(gpool);
    }
}

fn handshakes(w: &mut World, inp: &mut Input<'_>) {
    let drv_base = drv_counts(w);
    let g = guest(&w.hv);
    let id = g.id();
    let mut gpool = SkbPool::new(Arc::clone(&g), 32, 48).expect("pool");
    let hv = Arc::clone(&w.hv);
    let store = hv.store();
    toolstack::offer_vif(&w.hv, &w.drv, &g, SPEC).expect("offer");
    let raw = Raw::new(&w.hv, &g, w.drv.id());
    let fdir = xenbus::frontend_dir(id, SPEC.handle);
    let bdir = xenbus::backend_dir(w.drv.id(), id, SPEC.handle);
    let guest_base = (
        gpool.free_buffers(),
        gpool.free_pages(),
        g.grant_table().refs_free(),
    );
    let mut front: Option<Netfront> = None;
    let mut vif: Option<Vif> = None;

    for _ in 0..1 + inp.below(24) {
        if inp.exhausted() {
            break;
        }
        match inp.below(13) {
            0 | 1 => {
                let k = inp.pick(&FRONT_KEYS);
                let v = raw.value(inp);
                let _ = store.write(id, &format!("{fdir}/{k}"), &v);
            }
            2 => {
                let path = if inp.below(4) == 0 {
                    fdir.clone()
                } else {
                    format!("{fdir}/{}", inp.pick(&FRONT_KEYS))
                };
                let _ = store.rm(id, &path);
            }
            3 => {
                let path = if inp.coin() {
                    fdir.clone()
                } else {
                    format!("{fdir}/{}", inp.pick(&FRONT_KEYS))
                };
                let perms: &[(DomId, Perm)] = match inp.below(3) {
                    0 => &[],
                    1 => &[(DomId(0x7ff0), Perm::Write)],
                    _ => &[(w.drv.id(), Perm::Write)],
                };
                let _ = store.set_perms(id, &path, id, perms);
            }
            4 | 5 => {
                let k = inp.pick(&BACK_KEYS);
                let v = raw.value(inp);
                let _ = store.write(w.drv.id(), &format!("{bdir}/{k}"), &v);
            }
            6 => {
                if inp.coin() {
                    toolstack::close_backend(&w.hv, w.drv.id(), id, SPEC.handle);
                } else {
                    let _ = toolstack::offer_vif(&w.hv, &w.drv, &g, SPEC);
                }
            }
            7 => match front.as_mut() {
                None => {
                    let kind = inp.pick(&[RxBuffers::Fragments, RxBuffers::Linear]);
                    front = Netfront::connect_with(&w.hv, &g, SPEC.handle, kind).ok();
                    if let Some(f) = front.as_mut() {
                        f.refill_rx(&mut gpool);
                    }
                }
                Some(f) => {
                    f.check_backend(&mut gpool);
                }
            },
            8 => {
                if let Some(f) = front.take() {
                    f.close(&mut gpool);
                }
            }
            9 => match vif.take() {
                None => {
                    vif = toolstack::connect_backend(&w.hv, &w.drv, &g, SPEC).ok();
                }
                Some(v) => v.disconnect(&mut w.pool),
            },
            10 => {
                // netback's watch on the front end: a front end that is no longer
                // connected loses its vif.
                if vif.is_some() && !toolstack::frontend_connected(&w.hv, id, SPEC.handle) {
                    if let Some(v) = vif.take() {
                        v.disconnect(&mut w.pool);
                    }
                }
            }
            11 => {
                if inp.coin() {
                    let _ = g.grant_table().end_access(GrantRef(inp.pick(&raw.refs)));
                } else {
                    let _ = w.hv.evtchn_close(&g, inp.pick(&raw.ports));
                }
            }
            _ => traffic(w, &mut gpool, &mut front, &mut vif),
        }
    }

    // The guest's oracle: a closed netfront gives back all it took, what the back end
    // still mapped once the back end lets go.
    if let Some(f) = front.take() {
        f.close(&mut gpool);
    }
    if let Some(v) = vif.take() {
        v.disconnect(&mut w.pool);
    }
    assert_eq!(
        g.grant_table().retry_deferred(),
        0,
        "no grant is still held"
    );
    assert_eq!(gpool.retry_deferred(), 0, "no buffer is still held");
    for p in raw.ports {
        let _ = w.hv.evtchn_close(&g, p);
    }
    assert_eq!(
        (
            gpool.free_buffers(),
            gpool.free_pages(),
            g.grant_table().refs_free(),
            w.hv.evtchn_open_ports(&g),
        ),
        (guest_base.0, guest_base.1, guest_base.2, 0),
        "the guest's buffers, pages, references and channels are back"
    );
    // The driver domain's.
    drop(gpool);
    drop(g);
    w.hv.destroy_domain(id).expect("destroy");
    forget(w, id);
    assert_eq!(
        drv_counts(w),
        drv_base,
        "buffers, pages, maps and ports of the driver domain are back"
    );
    assert_eq!(w.hv.reap(), 0, "no frame of the guest is held");
}

/// Another guest connects at the same vif index and carries a packet each way, then
/// disconnects and gives back everything on both sides.
fn next_vif_works(w: &mut World, (g, gpool): &mut Next) {
    let base = drv_counts(w);
    let gbase = (
        gpool.free_buffers(),
        gpool.free_pages(),
        g.grant_table().refs_free(),
        w.hv.evtchn_open_ports(g),
    );
    let (f, v) = toolstack::plug_vif(&w.hv, &w.drv, g, SPEC).expect("the next vif connects");
    let (mut front, mut vif) = (Some(f), Some(v));
    // A packet out before the RX ring takes the small pool's pages, then one in.
    traffic(w, gpool, &mut front, &mut None);
    front.as_mut().expect("front").refill_rx(gpool);
    traffic(w, gpool, &mut None, &mut vif);
    traffic(w, gpool, &mut front, &mut None);
    let vif = vif.expect("vif");
    assert_eq!(vif.stats().tx_packets, 1, "its packet crosses");
    assert_eq!(vif.stats().rx_packets, 1, "and one comes back");
    assert_eq!(front.as_ref().expect("front").stats().rx_packets, 1);
    vif.disconnect(&mut w.pool);
    front.expect("front").close(gpool);
    forget(w, g.id());
    assert_eq!(drv_counts(w), base, "the driver domain has everything back");
    assert_eq!(
        (
            gpool.free_buffers(),
            gpool.free_pages(),
            g.grant_table().refs_free(),
            w.hv.evtchn_open_ports(g),
        ),
        gbase,
        "and so has the guest"
    );
}
