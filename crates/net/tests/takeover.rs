//! A back end stops (a clean stop for an upgrade) or dies (a crash) while a guest's vif
//! is connected, and the next back end takes the vif over where it was left: both ends
//! stay `Connected`, the front end notices nothing, every request is answered once and
//! every packet arrives intact. `pvio backend` does this across its own restart.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use hv::store::{XenStore, XenbusState};
use hv::{Domain, Hypervisor};
use net::netback::{Journals, Vif, JOURNAL_LEN_RX, JOURNAL_LEN_TX};
use net::netfront::{FrontConfig, LinkChange, Netfront};
use net::skb::{SkbId, SkbPool, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};

const SPEC: VifSpec = VifSpec {
    handle: 0,
    mac: [2, 0, 0, 0, 0, 2],
    index: 0,
    front: FrontConfig::ORIGINAL,
};

struct Rig {
    hv: Arc<Hypervisor>,
    guest: Arc<Domain>,
    drv: Arc<Domain>,
    gpool: SkbPool,
    dpool: SkbPool,
    front: Netfront,
    jpath: [PathBuf; 2],
}

fn journals(jpath: &[PathBuf; 2]) -> Journals {
    Journals {
        tx: mem::journal::Journal::open(&jpath[0], JOURNAL_LEN_TX).expect("tx journal"),
        rx: mem::journal::Journal::open(&jpath[1], JOURNAL_LEN_RX).expect("rx journal"),
    }
}

/// A guest's vif served in copy mode by a back end that records both rings.
fn rig(name: &str) -> (Rig, Vif) {
    let (hv, guest, drv, mut gpool, dpool) = common::pair((256, 300), (128, 64));
    let (mut front, mut vif) = toolstack::plug_vif(&hv, &drv, &guest, SPEC).expect("plug");
    front.refill_rx(&mut gpool);
    // The handshake's own store events, followed as a front end's watch does.
    let _ = front.check_backend(&mut gpool);
    vif.set_tx_copy(true);
    let jpath = ["tx", "rx"].map(|r| {
        let p = std::env::temp_dir().join(format!("pvio-vif-{name}-{r}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    });
    assert!(vif.record_in(journals(&jpath)), "a copying vif records");
    let r = Rig {
        hv,
        guest,
        drv,
        gpool,
        dpool,
        front,
        jpath,
    };
    (r, vif)
}

impl Rig {
    /// The next back end, in the same driver domain, taking the vif over.
    fn resume(&self) -> Vif {
        Vif::resume(
            hv::Pvio::new(&self.hv, &self.drv),
            self.guest.id(),
            SPEC.handle,
            SPEC.index,
            0,
            Some(journals(&self.jpath)),
        )
        .expect("taken over")
    }

    fn send(&mut self, d: &[u8]) {
        let s = self.gpool.alloc_page_linear().expect("skb");
        self.gpool.put(s, d).expect("put");
        self.front.xmit(&mut self.gpool, s).expect("room");
    }

    fn queue_for_guest(&mut self, vif: &mut Vif, d: &[u8]) {
        let s = self.dpool.alloc(NET_SKB_PAD).expect("skb");
        self.dpool.put(s, d).expect("put");
        vif.start_xmit(&mut self.dpool, s);
    }

    fn received(&mut self) -> Vec<Vec<u8>> {
        let mut rx = Vec::new();
        self.front.poll_rx(&mut self.gpool, 64, |p, s| {
            rx.push(bytes(p, s));
            p.free(s)
        });
        rx
    }

    fn states(&self) -> (XenbusState, XenbusState) {
        let (be, fe) = (self.drv.id(), self.guest.id());
        let store = self.hv.store();
        (
            store.xenbus_state(be, &net::xenbus::frontend_dir(fe, 0)),
            store.xenbus_state(be, &net::xenbus::backend_dir(be, fe, 0)),
        )
    }

    /// Moves `rsp_prod` of the ring at window slot `slot` back by `n`: as if the back
    /// end died after recording a batch and writing its slots, before publishing it.
    fn unpublish(&self, slot: u32, n: u32) {
        let w = self.drv.window();
        let mut b = [0u8; 4];
        w.read(slot, 8, &mut b).expect("rsp_prod");
        let back = u32::from_le_bytes(b).wrapping_sub(n);
        w.write(slot, 8, &back.to_le_bytes()).expect("rsp_prod");
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for p in &self.jpath {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn packet(i: u8, len: usize) -> Vec<u8> {
    (0..len).map(|k| (k as u8).wrapping_mul(31) ^ i).collect()
}

fn bytes(pool: &SkbPool, s: SkbId) -> Vec<u8> {
    let mut b = vec![0; pool.len(s)];
    pool.read(s, 0, &mut b).expect("read");
    b
}

fn transmitted(vif: &mut Vif, pool: &mut SkbPool) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    vif.tx_action(pool, 64, |p, s| {
        got.push(bytes(p, s));
        p.free(s)
    });
    got
}

#[test]
fn a_vif_handed_over_on_a_clean_stop_goes_on_with_the_next_back_end_unseen_by_the_guest() {
    let (mut r, mut vif) = rig("handover");
    let sent: Vec<Vec<u8>> = (0..7u8)
        .map(|i| packet(i, if i == 4 { 3000 } else { 60 + usize::from(i) }))
        .collect();
    for d in &sent[..3] {
        r.send(d);
    }
    assert_eq!(transmitted(&mut vif, &mut r.dpool), sent[..3].to_vec());
    assert_eq!(r.front.poll_tx(&mut r.gpool), 3);
    let down = [packet(0x40, 1400), packet(0x41, 90)];
    for d in &down {
        r.queue_for_guest(&mut vif, d);
    }
    vif.rx_action(&mut r.dpool);
    assert_eq!(r.received(), down.to_vec());

    // Four more packets posted, and a frame for the guest queued, when the stop comes.
    for d in &sent[3..] {
        r.send(d);
    }
    r.queue_for_guest(&mut vif, &packet(0x42, 100));
    vif.hand_over(&mut r.dpool);
    assert_eq!(
        r.states(),
        (XenbusState::Connected, XenbusState::Connected),
        "the store is not written"
    );
    assert_eq!(
        r.hv.mappings_held(&r.drv),
        0,
        "the stopped one holds nothing"
    );
    assert_eq!(
        r.front.check_backend(&mut r.gpool),
        LinkChange::None,
        "no store event reaches the front end"
    );

    let mut vif = r.resume();
    assert_eq!(vif.stats().resumed, 1);
    assert_eq!(vif.stats().resume_replayed, 0, "everything was published");
    assert_eq!(
        transmitted(&mut vif, &mut r.dpool),
        sent[3..].to_vec(),
        "the four posted packets, once each, in order"
    );
    assert_eq!(r.front.poll_tx(&mut r.gpool), 4);
    assert_eq!(r.front.stats().tx_packets, 7);
    // The guest's posted buffers are the new back end's to fill.
    let more = [packet(0x43, 1514), packet(0x44, 60), packet(0x45, 700)];
    for d in &more {
        r.queue_for_guest(&mut vif, d);
    }
    vif.rx_action(&mut r.dpool);
    assert_eq!(r.received(), more.to_vec());
    assert_eq!(r.front.check_backend(&mut r.gpool), LinkChange::None);
    assert_eq!(r.front.stats().disconnects, 0);

    vif.disconnect(&mut r.dpool);
    r.front.disconnect(&mut r.gpool);
    assert_eq!(
        (r.gpool.free_buffers(), r.gpool.free_pages()),
        (256, 300),
        "every buffer and page of the guest is back"
    );
}

#[test]
fn a_back_end_killed_before_publishing_is_taken_over_and_each_request_is_answered_once() {
    let (mut r, mut vif) = rig("crash");
    let sent: Vec<Vec<u8>> = (0..5u8).map(|i| packet(i, 100 + usize::from(i))).collect();
    for d in &sent {
        r.send(d);
    }
    assert_eq!(transmitted(&mut vif, &mut r.dpool), sent);
    let down = [packet(0x50, 1000), packet(0x51, 64)];
    for d in &down {
        r.queue_for_guest(&mut vif, d);
    }
    vif.rx_action(&mut r.dpool);
    // It dies after both batches were recorded and their slots written, before either
    // was published: the guest has seen no answer and no packet.
    r.unpublish(0, 5);
    r.unpublish(1, 2);
    vif.abandon(&mut r.dpool);
    assert_eq!(r.front.poll_tx(&mut r.gpool), 0);
    assert!(r.received().is_empty());

    let mut vif = r.resume();
    assert_eq!(
        vif.stats().resume_replayed,
        7,
        "five TX answers and two RX answers published from the journals"
    );
    assert!(
        transmitted(&mut vif, &mut r.dpool).is_empty(),
        "the answered slots are not taken again as requests"
    );
    assert_eq!(r.front.poll_tx(&mut r.gpool), 5);
    assert_eq!(
        r.received(),
        down.to_vec(),
        "copied before the crash, intact"
    );

    // And it goes on both ways.
    r.send(&packet(9, 333));
    assert_eq!(transmitted(&mut vif, &mut r.dpool), [packet(9, 333)]);
    assert_eq!(r.front.poll_tx(&mut r.gpool), 1);
    r.queue_for_guest(&mut vif, &packet(0x52, 1514));
    vif.rx_action(&mut r.dpool);
    assert_eq!(r.received(), [packet(0x52, 1514)]);
    assert_eq!(r.front.stats().disconnects, 0);

    vif.disconnect(&mut r.dpool);
    r.front.disconnect(&mut r.gpool);
    assert_eq!((r.gpool.free_buffers(), r.gpool.free_pages()), (256, 300));
}

#[test]
fn only_a_vif_connected_at_both_ends_is_taken_over() {
    let (r, vif) = rig("closing");
    let mut dpool = SkbPool::new(Arc::clone(&r.drv), 16, 16).expect("pool");
    vif.hand_over(&mut dpool);
    let bdir = net::xenbus::backend_dir(r.drv.id(), r.guest.id(), 0);
    r.hv.store()
        .switch_state(r.drv.id(), &bdir, XenbusState::Closing)
        .expect("closing");
    assert!(Vif::resume(
        hv::Pvio::new(&r.hv, &r.drv),
        r.guest.id(),
        0,
        0,
        0,
        Some(journals(&r.jpath)),
    )
    .is_err());
    assert_eq!(
        r.hv.mappings_held(&r.drv),
        0,
        "a refused takeover keeps nothing"
    );
}

/// A front end that split its event channels (`event-channel-tx` and `-rx`, as Linux's
/// netfront does when offered `feature-split-event-channels`) has both bound, and is
/// told of a received packet on the RX one and of a TX completion on the TX one.
#[test]
fn split_event_channels_are_bound_and_each_ring_notifies_on_its_own() {
    let (mut r, vif) = rig("split");
    let bdir = net::xenbus::backend_dir(r.drv.id(), r.guest.id(), 0);
    let fdir = net::xenbus::frontend_dir(r.guest.id(), 0);
    let store = r.hv.store();
    assert_eq!(
        store
            .read(
                r.drv.id(),
                &format!("{bdir}/{}", net::xenbus::FEATURE_SPLIT_EVENTS)
            )
            .as_deref(),
        Ok("1")
    );
    // The guest splits its channels (taken over, the rings stay where they are).
    vif.hand_over(&mut r.dpool);
    let g = r.guest.id();
    let tx =
        r.hv.evtchn_alloc_unbound(&r.guest, r.drv.id())
            .expect("port");
    let rx =
        r.hv.evtchn_alloc_unbound(&r.guest, r.drv.id())
            .expect("port");
    store
        .write(g, &format!("{fdir}/event-channel-tx"), &tx.0.to_string())
        .expect("key");
    // Half a split: refused before anything is mapped or bound.
    assert!(Vif::resume(
        hv::Pvio::new(&r.hv, &r.drv),
        g,
        0,
        0,
        0,
        Some(journals(&r.jpath)),
    )
    .is_err());
    assert_eq!(r.hv.mappings_held(&r.drv), 0);
    store
        .write(g, &format!("{fdir}/event-channel-rx"), &rx.0.to_string())
        .expect("key");
    let mut vif = r.resume();
    assert!(vif.rx_port().is_some(), "two channels bound");
    // The takeover's one notification, on each channel; the guest takes them.
    assert!(r.guest.evtchn_is_pending(tx).expect("tx"));
    assert!(r.guest.evtchn_is_pending(rx).expect("rx"));
    r.guest.take_pending(0, |_| {});
    assert!(!r.guest.evtchn_is_pending(rx).expect("rx"));
    r.queue_for_guest(&mut vif, &packet(0x60, 200));
    vif.rx_action(&mut r.dpool);
    assert!(
        r.guest.evtchn_is_pending(rx).expect("rx"),
        "RX on its own channel"
    );
    assert!(!r.guest.evtchn_is_pending(tx).expect("tx"));
    vif.disconnect(&mut r.dpool);
}
