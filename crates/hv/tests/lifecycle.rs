//! A domain's life ends cleanly: once destruction begins, nothing reaches memory
//! through its handles, and its frames go to no one else while any of its code can still
//! run (issue 15, finding 9).

use std::sync::Arc;

use hv::*;
use mem::PageAccess;

fn machine() -> Arc<Hypervisor> {
    Hypervisor::new(HvConfig {
        frames: 512,
        grant_path: GrantPath::Optimised,
        ..HvConfig::default()
    })
    .expect("machine")
}

fn cfg(name: &str) -> DomainConfig {
    DomainConfig {
        name: name.into(),
        pages: 200,
        map_slots: 4,
        ..Default::default()
    }
}

#[test]
fn a_destroyed_domains_handles_reach_no_memory_and_its_frames_wait_for_them() {
    let hv = machine();
    let dead = hv.create_domain(&cfg("dead")).expect("dead");
    let g = dead.alloc_page().expect("page");
    dead.write(g, 0, b"mine").expect("alive: own page");
    let ring = dead.page(g).expect("own page as a ring page");
    hv.destroy_domain(dead.id()).expect("destroy");
    // Its code still runs (it holds `dead`) and tries every way in.
    let mut b = [0u8; 4];
    assert_eq!(dead.read(g, 0, &mut b), Err(DomainError::Dying));
    assert_eq!(dead.write(g, 0, b"evil"), Err(DomainError::Dying));
    assert_eq!(dead.fill(g, 0, 8, 0xee), Err(DomainError::Dying));
    assert!(dead.atomic_u32(g, 0).is_err());
    assert!(dead.page(g).is_err());
    assert!(
        ring.write(0, b"evil").is_err(),
        "a page taken before death is revoked"
    );
    assert!(ring.atomic_u32(0).is_err());
    // Its frames are not handed to a new domain while its handles exist.
    assert!(hv.reap() >= 200, "held back: {}", hv.reap());
    let next = hv.create_domain(&cfg("next")).expect("next");
    let mine: Vec<Gfn> = (0..50).map(|_| next.alloc_page().expect("page")).collect();
    for &p in &mine {
        next.write(p, 0, b"next").expect("write");
    }
    // Nothing written through the dead handles shows up in the new domain.
    for &p in &mine {
        let mut v = [0u8; 4];
        next.read(p, 0, &mut v).expect("read");
        assert_eq!(&v, b"next");
    }
    // The last handle gone, the frames come back.
    drop(ring);
    drop(dead);
    assert_eq!(hv.reap(), 0, "every frame back once no handle remains");
    drop(next);
}
