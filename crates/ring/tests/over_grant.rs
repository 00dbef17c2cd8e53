//! A ring in a front end's page, granted to and mapped by a back-end domain: the set-up
//! every split driver uses. Requests cross through a real foreign mapping, and a hostile
//! front end can break its own ring and nothing else.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hv::OwnPage;
use hv::*;
use ring::{BackRing, FrontRing, PageRing, RingError, RingProtocol};

#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Req {
    id: u32,
    len: u32,
}

struct Proto;
impl RingProtocol for Proto {
    type Req = Req;
    type Rsp = Req;
}

struct Setup {
    hv: Arc<Hypervisor>,
    front_dom: Arc<Domain>,
    back_dom: Arc<Domain>,
}

fn setup() -> Setup {
    let hv = Hypervisor::new(HvConfig {
        frames: 1024,
        ..Default::default()
    })
    .expect("machine");
    let back_dom = hv
        .create_domain(&DomainConfig {
            name: "drv".into(),
            pages: 64,
            driver_domain: true,
            ..Default::default()
        })
        .expect("drv");
    let front_dom = hv
        .create_domain(&DomainConfig {
            name: "guest".into(),
            pages: 64,
            ..Default::default()
        })
        .expect("guest");
    Setup {
        hv,
        front_dom,
        back_dom,
    }
}

type Front = FrontRing<Proto, PageRing<OwnPage>>;
type Back = BackRing<Proto, PageRing<mem::MappedPage>>;

/// Front end initialises a ring in its page and grants it; back end maps it at `slot`.
fn connect(s: &Setup, slot: u32) -> (Front, Back, Gfn) {
    let g = s.front_dom.alloc_page().expect("page");
    let front =
        FrontRing::init(PageRing::new(s.front_dom.page(g).expect("own page")).expect("ring page"))
            .expect("init");
    let r = s.front_dom.grant_table().alloc_ref().expect("ref");
    s.front_dom
        .grant_table()
        .grant_access(r, s.back_dom.id(), g, false)
        .expect("grant");
    let mut out = [Ok(GrantHandle(0))];
    s.hv.grant_map(
        &s.back_dom,
        &[MapOp {
            dom: s.front_dom.id(),
            gref: r,
            readonly: false,
            slot,
        }],
        &mut out,
    );
    out[0].expect("map");
    let page = s.back_dom.window().page(slot).expect("mapped");
    let back = BackRing::attach(PageRing::new(page).expect("ring page")).expect("attach");
    (front, back, g)
}

#[test]
fn requests_cross_a_mapped_grant_and_a_hostile_index_breaks_only_that_ring() {
    let s = setup();
    let (mut f1, mut b1, g1) = connect(&s, 0);
    let (mut f2, mut b2, _g2) = connect(&s, 1);
    for i in 0..10 {
        f1.push_request(&Req {
            id: i,
            len: 100 + i,
        })
        .expect("room");
    }
    f1.push_requests_and_check_notify();
    for i in 0..10 {
        assert_eq!(
            b1.take_request(),
            Ok(Some(Req {
                id: i,
                len: 100 + i
            }))
        );
        b1.push_response(&Req { id: i, len: 0 }).expect("answer");
    }
    b1.push_responses_and_check_notify();
    for i in 0..10 {
        assert_eq!(f1.take_response().expect("valid").map(|r| r.id), Some(i));
    }
    // The guest scribbles a producer index far ahead into its ring page.
    s.front_dom
        .atomic_u32(g1, 0)
        .expect("req_prod")
        .store(10 + 1000, Ordering::Release);
    assert!(matches!(
        b1.take_request(),
        Err(RingError::ProducerOverrun { .. })
    ));
    assert_eq!(b1.take_request(), Err(RingError::Broken));
    // The other ring of the same guest is unaffected.
    f2.push_request(&Req { id: 7, len: 7 }).expect("room");
    f2.push_requests_and_check_notify();
    assert_eq!(b2.take_request(), Ok(Some(Req { id: 7, len: 7 })));
    // A mapped ring page cannot be unmapped under the back end's feet.
    let mut us = [Ok(())];
    s.hv.grant_unmap(&s.back_dom, &[GrantHandle(0)], &mut us);
    assert_eq!(us[0], Err(GrantError::MappingInUse));
    drop(b1);
    s.hv.grant_unmap(&s.back_dom, &[GrantHandle(0)], &mut us);
    assert_eq!(us[0], Ok(()));
}
