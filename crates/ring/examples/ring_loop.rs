//! Requests through a granted, mapped ring between two threads pinned to cores 0 and 1,
//! for a profiler: the front end posts up to 64 requests, publishes them, and takes the
//! responses; the back end takes each request, judges it and answers in place, 64 a
//! poll, as `bench core`'s shared-ring row. Prints requests per second, with ring.h's
//! layout (`xen`) or pvio's with each end's words on a line of their own (`split`).
//!
//! `cargo run --release -p ring --example ring_loop -- [xen|split] [secs]`

use std::time::{Duration, Instant};

use hv::*;
use ring::{BackRing, FrontRing, Layout, PageRing, RingProtocol};

#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Req {
    id: u16,
    offset: u16,
    size: u16,
    flags: u16,
    gref: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Rsp {
    id: u16,
    status: i16,
}

struct Proto;
impl RingProtocol for Proto {
    type Req = Req;
    type Rsp = Rsp;
}

fn main() {
    let mut args = std::env::args().skip(1);
    let layout = match args.next().as_deref() {
        Some("split") => Layout::SPLIT,
        _ => Layout::XEN,
    };
    let secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let hv = Hypervisor::new(HvConfig {
        frames: 1024,
        ..Default::default()
    })
    .expect("machine");
    let dom = |name: &str, driver_domain| DomainConfig {
        name: name.into(),
        pages: 64,
        driver_domain,
        ..Default::default()
    };
    let back_dom = hv.create_domain(&dom("drv", true)).expect("drv");
    let front_dom = hv.create_domain(&dom("guest", false)).expect("guest");
    let g = front_dom.alloc_page().expect("page");
    let mut front = FrontRing::<Proto, _>::init(
        PageRing::with_layout(front_dom.page(g).expect("own page"), layout).expect("ring page"),
    )
    .expect("init");
    let r = front_dom.grant_table().alloc_ref().expect("ref");
    front_dom
        .grant_table()
        .grant_access(r, back_dom.id(), g, false)
        .expect("grant");
    let mut out = [Ok(GrantHandle(0))];
    hv.grant_map(
        &back_dom,
        &[MapOp {
            dom: front_dom.id(),
            gref: r,
            readonly: false,
            slot: 0,
        }],
        &mut out,
    );
    out[0].expect("map");
    let page = back_dom.window().page(0).expect("mapped");
    let mut back =
        BackRing::<Proto, _>::attach(PageRing::with_layout(page, layout).expect("ring page"))
            .expect("attach");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = std::sync::Arc::clone(&stop);
    let backend = std::thread::spawn(move || {
        let _ = mem::cpu::pin_current_thread(1);
        let mut bad = 0u64;
        while !s2.load(std::sync::atomic::Ordering::Relaxed) {
            let mut n = 0;
            while n < 64 {
                let Ok(Some(req)) = back.take_request() else {
                    break;
                };
                let ok = req.id < 256
                    && req.size >= 14
                    && usize::from(req.offset) + usize::from(req.size) <= PAGE_SIZE;
                bad += u64::from(!ok);
                let _ = back.push_response(&Rsp {
                    id: req.id,
                    status: if ok { 0 } else { -1 },
                });
                n += 1;
            }
            if n > 0 {
                back.push_responses_and_check_notify();
            } else {
                std::hint::spin_loop();
            }
        }
        bad
    });
    let _ = mem::cpu::pin_current_thread(0);
    let (t0, run) = (Instant::now(), Duration::from_secs_f64(secs));
    let (mut next, mut done) = (0u16, 0u64);
    while t0.elapsed() < run {
        for _ in 0..256 {
            let mut posted = false;
            while front.free_requests() > 0 {
                front
                    .push_request(&Req {
                        id: next % 256,
                        offset: 0,
                        size: 64,
                        flags: 0,
                        gref: 0,
                    })
                    .expect("room");
                next = next.wrapping_add(1);
                posted = true;
            }
            if posted {
                front.push_requests_and_check_notify();
            }
            while let Ok(Some(rsp)) = front.take_response() {
                assert!(rsp.id < 256 && rsp.status == 0);
                done += 1;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(backend.join().expect("back end"), 0);
    println!("{layout:?}: {:.1} Mreq/s", done as f64 / secs / 1e6);
}
