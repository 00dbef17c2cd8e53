//! The optimised grant copy in a loop, for a profiler: batches of 32 operations from the
//! driver domain's own pages into 32 pages a guest granted it, `len` bytes each, for
//! `secs` seconds; prints the time per operation. The thread has a sample slot bound, as
//! a pCPU running a unit has, so the profiler's class changes cost what they cost there.
//!
//! `cargo run --release -p hv --example grant_copy_loop -- [len] [secs]`, then e.g.
//! `perf record -e cpu-clock -F 20000 target/release/examples/grant_copy_loop 64 3`.

use std::time::{Duration, Instant};

use hv::{
    CopyPtr, DomainConfig, GrantCopy, GrantPath, GrantVersion, HvConfig, Hypervisor, PAGE_SIZE,
};

const BATCH: usize = 32;

fn main() {
    let mut args = std::env::args().skip(1);
    let len: u16 = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let hv = Hypervisor::new(HvConfig {
        frames: 4096,
        grant_path: GrantPath::Optimised,
        ..HvConfig::default()
    })
    .expect("hypervisor");
    let dom = |name: &str, driver_domain| DomainConfig {
        name: name.into(),
        pages: 256,
        grant_version: GrantVersion::V2,
        driver_domain,
        ..Default::default()
    };
    let drv = hv.create_domain(&dom("drv", true)).expect("driver domain");
    let guest = hv.create_domain(&dom("guest", false)).expect("guest");
    let ops: Vec<GrantCopy> = (0..BATCH)
        .map(|i| {
            let local = drv.alloc_page().expect("page");
            drv.fill(local, 0, PAGE_SIZE, i as u8).expect("fill");
            let page = guest.alloc_page().expect("page");
            let gref = guest.grant_table().alloc_ref().expect("a reference");
            guest
                .grant_table()
                .grant_access(gref, drv.id(), page, false)
                .expect("grant");
            GrantCopy {
                source: CopyPtr::Local {
                    gfn: local,
                    offset: 0,
                },
                dest: CopyPtr::Gref {
                    dom: guest.id(),
                    gref,
                    offset: 0,
                },
                len,
            }
        })
        .collect();
    let _slot = mem::cpu::SlotBinding::bind(std::sync::Arc::default(), None).expect("a slot");
    let mut status = vec![Ok(()); BATCH];
    let (t0, run) = (Instant::now(), Duration::from_secs_f64(secs));
    let mut calls = 0u64;
    while t0.elapsed() < run {
        for _ in 0..1000 {
            assert_eq!(hv.grant_copy(&drv, &ops, &mut status), BATCH);
        }
        calls += 1000;
    }
    let ns = t0.elapsed().as_nanos() as f64 / (calls * BATCH as u64) as f64;
    println!("{len} B, batch {BATCH}: {ns:.1} ns an operation ({calls} calls)");
}
