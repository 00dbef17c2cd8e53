//! A vif's transmit rate (the toolstack's `rate` key, `xl`'s `rate=`): the guest's
//! packets beyond the period's credit wait on the ring, none is dropped, and the back end
//! is told when to look again; a vif without one, or with a key that is no rate, is not
//! held back.

mod common;

use std::time::{Duration, Instant};

use hv::DomId;
use net::netback::Vif;
use net::netfront::{FrontConfig, Netfront};
use net::skb::SkbPool;
use net::toolstack::{self, VifSpec};

const SPEC: VifSpec = VifSpec {
    handle: 0,
    mac: [2, 0, 0, 0, 0, 2],
    index: 0,
    front: FrontConfig::ORIGINAL,
};

/// A guest that has put `n` packets of `len` bytes on its vif's TX ring, the vif's
/// back-end directory holding `rate` (if any) as the toolstack wrote it.
fn sent(rate: Option<&str>, n: usize, len: usize) -> (Netfront, Vif, SkbPool, SkbPool) {
    let (hv, guest, drv, mut gpool, dpool) = common::pair((256, 300), (128, 64));
    toolstack::offer_vif(&hv, &drv, &guest, SPEC).expect("offer");
    if let Some(r) = rate {
        let dir = net::xenbus::backend_dir(drv.id(), guest.id(), SPEC.handle);
        hv.store()
            .write(DomId::DOM0, &format!("{dir}/{}", net::xenbus::RATE), r)
            .expect("rate");
    }
    let mut front = Netfront::connect_config(&hv, &guest, SPEC.handle, SPEC.front).expect("front");
    let vif = toolstack::connect_backend(&hv, &drv, &guest, SPEC).expect("back");
    let _ = front.check_backend(&mut gpool);
    for i in 0..n {
        let s = gpool.alloc_page_linear().expect("skb");
        gpool.put(s, &vec![i as u8; len]).expect("put");
        front.xmit(&mut gpool, s).expect("room");
    }
    (front, vif, gpool, dpool)
}

/// Runs the vif's TX action once; the packets it delivered.
fn transmit(vif: &mut Vif, pool: &mut SkbPool) -> usize {
    vif.tx_action(pool, 64, |p, s| p.free(s))
}

#[test]
fn packets_beyond_the_periods_credit_wait_on_the_ring_and_none_is_dropped() {
    // 3000 bytes a minute: the test never reaches the next period.
    let (_front, mut vif, _gpool, mut dpool) = sent(Some("3000,60000000"), 10, 1000);
    assert_eq!(vif.tx_rate(), Some((3000, Duration::from_secs(60))));
    let at = Instant::now();
    assert_eq!(
        transmit(&mut vif, &mut dpool),
        3,
        "three packets' worth of credit"
    );
    let s = vif.stats().clone();
    assert!(s.tx_rate_limited >= 1, "{s:?}");
    assert_eq!(s.tx_offload_errors.total(), 0);
    let until = vif.tx_credit_wait().expect("told when to look again");
    assert!(until > at + Duration::from_secs(59) && until <= at + Duration::from_secs(61));
    assert!(!vif.tx_pending(), "no spin while it waits");
    assert_eq!(transmit(&mut vif, &mut dpool), 0, "still the same period");
    assert_eq!(
        vif.stats().tx_packets,
        3,
        "the rest wait on the ring, none dropped"
    );
}

#[test]
fn a_vif_without_a_rate_or_with_a_key_that_is_none_goes_unlimited() {
    for rate in [None, Some("fast"), Some("0,100"), Some("1000")] {
        let (_front, mut vif, _gpool, mut dpool) = sent(rate, 10, 1000);
        assert_eq!(vif.tx_rate(), None, "{rate:?}");
        assert_eq!(transmit(&mut vif, &mut dpool), 10, "{rate:?}");
        assert_eq!(vif.tx_credit_wait(), None);
        assert_eq!(vif.stats().tx_rate_limited, 0);
    }
}
