//! Profiling aid: a tight loop of optimised grant copies (batch 32, 1500 B), to be run
//! under `perf record -e task-clock` when tuning the grant path.
use hv::*;
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let hv = Hypervisor::new(HvConfig {
        frames: 4096,
        grant_path: GrantPath::Optimised,
        ..HvConfig::default()
    })?;
    let drv = hv.create_domain(&DomainConfig {
        pages: 256,
        grant_version: GrantVersion::V2,
        driver_domain: true,
        ..Default::default()
    })?;
    let guest = hv.create_domain(&DomainConfig {
        pages: 256,
        grant_version: GrantVersion::V2,
        ..Default::default()
    })?;
    let mut ops = Vec::new();
    for _ in 0..32 {
        let l = drv.alloc_page()?;
        let g = guest.alloc_page()?;
        let r = guest.grant_table().alloc_ref().ok_or("no ref")?;
        guest.grant_table().grant_access(r, drv.id(), g, false)?;
        ops.push(GrantCopy {
            source: CopyPtr::Local { gfn: l, offset: 0 },
            dest: CopyPtr::Gref {
                dom: guest.id(),
                gref: r,
                offset: 0,
            },
            len: 1500,
        });
    }
    let mut st = vec![Ok(()); 32];
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(300_000);
    for _ in 0..n {
        hv.grant_copy(&drv, &ops, &mut st);
    }
    Ok(())
}
