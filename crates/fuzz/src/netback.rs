//! netback against a hostile front end (issue 15's oracle).
//!
//! A driver domain with a well-behaved guest's vif and a hostile guest's vif. The
//! hostile guest writes raw TX slots with structure (chains, extras, every kind of
//! grant, one revoked mid-use), moves its producer index forward, back and at random,
//! and posts RX buffers of every kind while packets of every size are queued to it; the
//! driver domain runs its TX and RX actions, keeping or freeing what TX hands it. Half
//! the cases the guest asks for grant reuse: netback then serves its control ring
//! (messages of every type, length and list, at random) and reaches its buffers through
//! the grant cache, with direct placement or without.
//!
//! Oracle: after the vif is torn down and the guest destroyed, every packet buffer and
//! page of the driver domain is back in its pool, no mapping or port of the guest is
//! left, no frame of the guest is still held, and the well-behaved guest still sends.
//! A hang shows as a case that never returns (the suite's watchdog, libFuzzer's
//! `-timeout`).

use std::sync::Arc;

use hv::{Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
use net::netback::{self, Vif, VIF_WINDOW_SLOTS};
use net::netfront::FrontConfig;
use net::netfront::Netfront;
use net::netif::{CtrlRequest, NetifGref, RxRequest, TxRequest, NETTXF_MORE_DATA};
use net::skb::{SkbPool, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};
use net::xenbus;

use crate::Input;

pub use net::rawfront::RawFront;

/// Creates the vif in the store, probes the back end and publishes a raw front end
/// (with `feature-sg`): the toolstack's, the back end's and the guest's parts of the
/// handshake, up to the back end's connect.
pub fn connect_raw(hv: &Arc<Hypervisor>, dom: &Arc<Domain>, be: &Arc<Domain>) -> RawFront {
    let store = hv.store();
    xenbus::create_vif(store, be.id(), dom.id(), 0, [2, 0, 0, 0, 0, 9]).expect("toolstack");
    netback::probe(store, be.id(), dom.id(), 0).expect("probe");
    RawFront::publish(hv, dom, be.id(), 0).expect("front end")
}

/// The driver domain and its pool.
pub(crate) struct World {
    pub(crate) hv: Arc<Hypervisor>,
    pub(crate) drv: Arc<Domain>,
    pub(crate) pool: SkbPool,
}

/// A guest of `pages` pages (v2 grants, four grant frames, one vCPU).
pub fn guest(hv: &Arc<Hypervisor>, name: &str, pages: u32) -> Arc<Domain> {
    hv.create_domain(&DomainConfig {
        name: name.into(),
        pages,
        grant_frames: 4,
        grant_version: GrantVersion::V2,
        vcpus: 1,
        map_slots: 4,
        driver_domain: false,
    })
    .expect("guest")
}

/// Hands the packets the released fragments of `pool` belong to back to `vif`.
pub fn release(pool: &mut SkbPool, vif: &mut Vif) {
    let mut tokens = Vec::new();
    pool.take_released(|r| tokens.push(r.token));
    vif.tx_release(tokens);
}

/// A TX request.
pub fn req(gref: u32, offset: u16, flags: u16, id: u16, size: u16) -> TxRequest {
    TxRequest {
        gref,
        offset,
        flags,
        id,
        size,
    }
}

pub(crate) type Good = (Netfront, Vif, SkbPool);

/// The good guest sends a packet and it crosses.
pub(crate) fn good_sends(w: &mut World, (front, vif, gpool): &mut Good) {
    good_sends_through(&mut w.pool, front, vif, gpool);
}

/// A well-behaved guest sends a packet from `gpool` through `vif` (the driver domain's
/// pool `dpool`): it crosses, and the vif is still up.
pub fn good_sends_through(
    dpool: &mut SkbPool,
    front: &mut Netfront,
    vif: &mut Vif,
    gpool: &mut SkbPool,
) {
    front.poll_tx(gpool);
    let s = gpool.alloc(NET_SKB_PAD).expect("skb");
    gpool.put(s, &[0x5a; 100]).expect("put");
    front.xmit(gpool, s).expect("room");
    let mut got = 0;
    vif.tx_action(dpool, 64, |p, s| {
        got += 1;
        p.free(s)
    });
    release(dpool, vif);
    assert_eq!(got, 1, "the good vif is unaffected");
    assert_eq!(vif.disabled(), None);
}

/// One case.
pub fn case(inp: &mut Input<'_>) {
    WORLD.with_borrow_mut(|slot| {
        let (w, good) = slot.get_or_insert_with(world);
        w.hv.set_grant_path(inp.pick(&[GrantPath::Optimised, GrantPath::Original]));
        hostile(w, inp);
        good_sends(w, good);
    });
}

thread_local! {
    /// The driver domain and the good guest live for the thread: the oracle brings
    /// the world back to where it was after every case, which is what keeps cases
    /// independent (and a case costs what netback's work costs, not a machine's boot).
    static WORLD: std::cell::RefCell<Option<(World, Good)>> =
        const { std::cell::RefCell::new(None) };
}

pub(crate) fn world() -> (World, Good) {
    let hv = Hypervisor::new(HvConfig {
        frames: 4096,
        ..HvConfig::default()
    })
    .expect("hv");
    let drv = hv
        .create_domain(&DomainConfig {
            name: "drv".into(),
            pages: 512,
            grant_frames: 4,
            grant_version: GrantVersion::V2,
            vcpus: 1,
            map_slots: 2 * VIF_WINDOW_SLOTS,
            driver_domain: true,
        })
        .expect("drv");
    let pool = SkbPool::new(Arc::clone(&drv), 192, 16).expect("pool");
    let mut w = World { hv, drv, pool };
    let gd = guest(&w.hv, "good", 256);
    let spec = VifSpec {
        handle: 0,
        mac: [2, 0, 0, 0, 0, 7],
        index: 1,
        front: FrontConfig::default(),
    };
    let (front, vif) = toolstack::plug_vif(&w.hv, &w.drv, &gd, spec).expect("good vif");
    let gpool = SkbPool::new(Arc::clone(&gd), 16, 16).expect("pool");
    let mut good = (front, vif, gpool);
    // The good vif's own buffer use settles after its first packet.
    good_sends(&mut w, &mut good);
    (w, good)
}

/// The hostile guest's part of a case, with the oracle.
fn hostile(w: &mut World, inp: &mut Input<'_>) {
    let baseline = (
        w.pool.free_buffers(),
        w.pool.free_pages(),
        w.hv.mappings_held(&w.drv),
        w.hv.evtchn_open_ports(&w.drv),
    );
    let evil = guest(&w.hv, "fuzz", 256);
    let mut raw = connect_raw(&w.hv, &evil, &w.drv);
    let gt = evil.grant_table();
    // Grants of every kind: read-only data, writable, revoked, never issued.
    let rw = raw.rx_buffer(w.drv.id()).expect("buffer");
    let revoked = raw.rx_buffer(w.drv.id()).expect("buffer");
    gt.end_access(hv::GrantRef(revoked)).expect("revoke");
    let grefs = [raw.data_ref, raw.data_ref, rw, revoked, 9999, u32::MAX];
    let reuse = inp.below(2) == 0 && raw.publish_ctrl(&w.hv, w.drv.id(), 0).is_some();
    let mut bad = Vif::connect(hv::Pvio::new(&w.hv, &w.drv), evil.id(), 0, 0, 0).expect("vif");
    let direct = reuse && inp.below(2) == 0;
    if direct {
        bad.enable_direct();
    }
    // TX copied into the back end's own pages instead of mapped (what `pvio backend`
    // runs against a real Xen), on a coin.
    bad.set_tx_copy(inp.coin());
    let list = raw.ctrl.map_or(0, |c| c.2);
    let mut ctrl_prod = 0u32;
    let mut held = Vec::new();
    let (mut tx_prod, mut rx_prod) = (0u32, 0u32);
    for _round in 0..inp.below(4) + 1 {
        // TX: a few chains of structured slots.
        let mut i = tx_prod;
        for _ in 0..inp.below(24) {
            let slots = inp.pick(&[1u64, 1, 2, 3, 17, 18, 19, 21]);
            for k in 0..slots {
                let last = k + 1 == slots;
                let mut flags = if last { 0 } else { NETTXF_MORE_DATA };
                if inp.below(16) == 0 {
                    flags ^= 1 << inp.below(4);
                }
                let size = inp.pick(&[0u16, 10, 14, 60, 128, 129, 200, 1500, 4096, 9000, 65535]);
                let any = inp.below(65536) as u16;
                let offset = inp.pick(&[0u16, 1, 64, 2000, 3900, 4095, any]);
                raw.put(
                    i,
                    req(inp.pick(&grefs), offset, flags, inp.below(300) as u16, size),
                );
                i = i.wrapping_add(1);
            }
        }
        tx_prod = match inp.below(10) {
            0 => tx_prod.wrapping_sub(inp.below(3) as u32),
            1 => tx_prod.wrapping_add(inp.below(600) as u32),
            2 => inp.u64() as u32,
            _ => i,
        };
        raw.publish_tx(tx_prod);
        // RX: buffers posted (some bogus) and packets queued.
        for _ in 0..inp.below(8) {
            let r = RxRequest {
                id: inp.below(300) as u16,
                pad: 0,
                gref: inp.pick(&[rw, rw, raw.data_ref, revoked, 9999]),
            };
            rx_prod = rx_prod.wrapping_add(1);
            raw.post_rx(rx_prod.wrapping_sub(1), r, rx_prod);
        }
        if inp.below(12) == 0 {
            raw.post_rx(0, RxRequest::default(), inp.u64() as u32);
        }
        for _ in 0..inp.below(4) {
            let Ok(s) = w.pool.alloc(NET_SKB_PAD) else {
                break;
            };
            let n = inp.pick(&[14usize, 60, 1514, 1900]);
            w.pool.put(s, &vec![0x33; n]).expect("put");
            if inp.below(3) == 0 {
                if let Ok(g) = w.pool.alloc_page() {
                    let _ = w.pool.add_frag(
                        s,
                        net::skb::Frag {
                            page: net::skb::FragPage::Local(g),
                            offset: 0,
                            len: inp.pick(&[1u16, 2000, 4096]),
                        },
                    );
                }
            }
            bad.start_xmit(&mut w.pool, s);
        }
        let keep = inp.below(2) == 0;
        let mut got = Vec::new();
        bad.tx_action(
            &mut w.pool,
            64,
            |p, s| if keep { got.push(s) } else { p.free(s) },
        );
        bad.rx_action(&mut w.pool);
        if reuse {
            // Control messages of every type, length and list.
            let entries: Vec<NetifGref> = (0..inp.below(6))
                .map(|_| NetifGref {
                    gref: inp.pick(&grefs),
                    flags: inp.below(3) as u16,
                    status: 0,
                })
                .collect();
            raw.write_list(&entries);
            for _ in 0..inp.below(6) {
                let any = inp.u64() as u32;
                let r = CtrlRequest {
                    id: inp.below(65536) as u16,
                    ty: inp.pick(&[8u16, 9, 9, 10, 10, 0, 77]),
                    data: [
                        inp.pick(&[0u32, 0, 0, 1]),
                        inp.pick(&[list, list, list, rw, 9999]),
                        inp.pick(&[0u32, 1, 2, 5, 512, 513, any]),
                    ],
                };
                ctrl_prod = ctrl_prod.wrapping_add(1);
                raw.post_ctrl(ctrl_prod.wrapping_sub(1), r, ctrl_prod);
            }
            if inp.below(16) == 0 {
                raw.post_ctrl(0, CtrlRequest::default(), inp.u64() as u32);
            }
            bad.ctrl_action();
        }
        if direct {
            // The NIC's part: take buffers, hand some back filled, some not at all,
            // and tokens it never had.
            bad.rx_direct_refill();
            let mut tokens = Vec::new();
            bad.rx_direct_give(|_, _, t| {
                tokens.push(t);
                true
            });
            for t in tokens {
                if inp.below(4) != 0 {
                    bad.rx_direct_done(
                        t,
                        inp.pick(&[0u16, 60, 1514, 5000]),
                        true,
                        inp.below(8) == 0,
                    );
                }
            }
            bad.rx_direct_done(inp.u64() as u32, 60, false, false);
            bad.rx_direct_flush();
            bad.ctrl_action();
        }
        held.extend(got);
        if inp.below(3) == 0 {
            // The guest revokes (or tries to) its data grant in the middle of use.
            let _ = gt.end_access(hv::GrantRef(raw.data_ref));
        }
        if inp.below(2) == 0 {
            for s in held.drain(..) {
                w.pool.free(s);
            }
            release(&mut w.pool, &mut bad);
        }
    }
    for s in held.drain(..) {
        w.pool.free(s);
    }
    release(&mut w.pool, &mut bad);
    bad.disconnect(&mut w.pool);
    let id = evil.id();
    drop((raw, evil));
    w.hv.destroy_domain(id).expect("destroy");
    let store = w.hv.store();
    let _ = store.rm(hv::DomId::DOM0, &format!("/local/domain/{}", id.0));
    let _ = store.rm(
        hv::DomId::DOM0,
        &format!("/local/domain/{}/backend/vif/{}", w.drv.id().0, id.0),
    );
    // The oracle.
    assert_eq!(
        (
            w.pool.free_buffers(),
            w.pool.free_pages(),
            w.hv.mappings_held(&w.drv),
            w.hv.evtchn_open_ports(&w.drv),
        ),
        baseline,
        "buffers, pages, maps and ports of the driver domain are back"
    );
    assert_eq!(w.hv.reap(), 0, "no frame of the guest is held");
}
