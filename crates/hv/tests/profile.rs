//! The profiler on real vCPUs: classes declared by a domain's code and by hypervisor
//! paths it calls land in that domain's breakdown, and its CPU time is the thread's.

use std::time::Duration;

use hv::profile::{enter, Class, GlobalClass};
use hv::*;

#[test]
fn a_domains_samples_follow_its_classes_and_hypercalls() {
    let hv = Hypervisor::new(HvConfig {
        frames: 512,
        ..Default::default()
    })
    .expect("machine");
    let d = hv
        .create_domain(&DomainConfig {
            name: "drv".into(),
            pages: 64,
            driver_domain: true,
            ..Default::default()
        })
        .expect("domain");
    let peer = hv
        .create_domain(&DomainConfig {
            name: "peer".into(),
            pages: 64,
            ..Default::default()
        })
        .expect("peer");
    let pp = hv.evtchn_alloc_unbound(&peer, d.id()).expect("offer");
    let port = hv.evtchn_bind_interdomain(&d, peer.id(), pp).expect("bind");
    let start = VcpuStart {
        vcpu: 0,
        core: None,
        mode: WaitMode::Polling,
        sample: Some(Duration::from_micros(200)),
    };
    let h = hv
        .start_vcpu(&d, start, move |v| {
            let burn = |ms: u64| {
                let t0 = mem::cpu::thread_cpu_time();
                let mut x = 0u64;
                while mem::cpu::thread_cpu_time() - t0 < Duration::from_millis(ms) {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
                }
            };
            // Long enough for tens of scheduler ticks each: the default sampler takes
            // its samples at ticks.
            {
                let _c = enter(Class::Bridge);
                burn(150);
            }
            {
                let _c = enter(Class::Netback);
                burn(50);
                // Hypercalls made from here are charged to Xen in this domain's context.
                let t0 = mem::cpu::thread_cpu_time();
                // The clock is read once per 1000 sends: a sample taken during the
                // clock's system call would be charged to netback.
                while mem::cpu::thread_cpu_time() - t0 < Duration::from_millis(100) {
                    for _ in 0..1000 {
                        let _ = v.hv().evtchn_send(v.domain(), port);
                    }
                }
            }
        })
        .expect("vcpu");
    h.join().expect("vcpu ran");
    let s = d.class_samples();
    let (bridge, netback, xen) = (
        s.of(Class::Bridge),
        s.of(Class::Netback),
        s.of(Class::XenEvent),
    );
    assert!(
        bridge > 0 && netback > 0 && xen > 0,
        "samples: {:?}",
        s.nonzero()
    );
    assert!(
        bridge > netback,
        "150 ms of bridge outweighs 50 ms of netback: {bridge} vs {netback}"
    );
    // The global classes of Table 3: a driver domain's kernel is kernel0, its Xen time xen0.
    assert_eq!(
        Class::Bridge.global(d.is_driver_domain()),
        GlobalClass::Kernel0
    );
    assert_eq!(
        Class::XenEvent.global(d.is_driver_domain()),
        GlobalClass::Xen0
    );
    // Exact CPU time is the thread's: at least the 300 ms it burned.
    assert!(
        d.cpu_time() >= Duration::from_millis(300),
        "{:?}",
        d.cpu_time()
    );
    assert_eq!(
        peer.class_samples().total(),
        0,
        "nothing charged to the peer"
    );
}
