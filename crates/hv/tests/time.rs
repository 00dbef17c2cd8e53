//! Guest time: the time-info block Xen stamps at every schedule-in, the guest's TSC
//! extrapolation from it, and the run-state accounting.

use std::time::Duration;

use hv::time::{read_system_time, RunstateKind, TscScale, VCPU_TIME_INFO};
use hv::*;

fn domain() -> (std::sync::Arc<Hypervisor>, std::sync::Arc<Domain>) {
    let hv = Hypervisor::new(HvConfig {
        frames: 512,
        grant_path: GrantPath::Original,
        ..HvConfig::default()
    })
    .expect("hv");
    let d = hv
        .create_domain(&DomainConfig {
            pages: 32,
            ..Default::default()
        })
        .expect("domain");
    (hv, d)
}

fn start() -> VcpuStart {
    VcpuStart {
        vcpu: 0,
        core: None,
        mode: WaitMode::Blocking,
        sample: None,
    }
}

#[test]
fn the_scale_turns_ticks_into_nanoseconds_at_any_rate() {
    for hz in [
        1_000_000u64,
        999_999_999,
        1_000_000_001,
        2_100_000_000,
        3_000_000_000,
        5_000_000_000,
    ] {
        let s = TscScale::for_hz(hz);
        // One second of ticks is one second, to within a part per million.
        let ns = s.ns(hz) as i64;
        assert!((ns - 1_000_000_000).abs() <= 1_000, "{hz} Hz: {ns} ns");
        assert_eq!(s.ns(0), 0);
    }
}

#[test]
fn any_scale_a_guest_writes_converts_without_overflow() {
    for shift in [i8::MIN, -64, -1, 0, 1, 63, 64, 100, i8::MAX] {
        let s = TscScale {
            mul: u32::MAX,
            shift,
        };
        let _ = s.ns(u64::MAX);
    }
    let wide = TscScale {
        mul: u32::MAX,
        shift: 64,
    };
    assert_eq!(wide.ns(1), 0, "a shift of 64 bits or more gives 0");
}

#[test]
fn a_guest_reads_the_hypervisor_clock_from_its_time_info_block() {
    let (hv, d) = domain();
    // Never stamped: the guest cannot read its clock.
    assert_eq!(read_system_time(&d, 0), None);
    let h = hv
        .start_vcpu(&d, start(), |v| {
            let mut worst = Duration::ZERO;
            let mut last = Duration::ZERO;
            let mut monotonic = true;
            for _ in 0..1000 {
                let before = v.hv().now();
                let t = v.system_time();
                let after = v.hv().now();
                monotonic &= t >= last;
                last = t;
                let off = if t < before {
                    before - t
                } else {
                    t.saturating_sub(after)
                };
                worst = worst.max(off);
            }
            (worst, monotonic)
        })
        .expect("vcpu");
    let (worst, monotonic) = h.join().expect("vcpu");
    assert!(monotonic);
    assert!(worst < Duration::from_millis(1), "clock off by {worst:?}");
}

#[test]
fn a_torn_or_scribbled_block_is_retried_or_refused_and_only_hurts_its_owner() {
    let (hv, d) = domain();
    let h = hv.start_vcpu(&d, start(), |_| ()).expect("vcpu");
    h.join().expect("vcpu");
    assert!(read_system_time(&d, 0).is_some());
    // The guest leaves its version odd (as if mid-update) for good: the read gives up.
    let ver = d
        .atomic_u32(hv::domain::SHARED_INFO_GFN, VCPU_TIME_INFO)
        .expect("version");
    let v = ver.load(std::sync::atomic::Ordering::Relaxed);
    ver.store(v | 1, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(read_system_time(&d, 0), None);
    // Another domain's clock is untouched.
    let other = hv
        .create_domain(&DomainConfig {
            pages: 32,
            ..Default::default()
        })
        .expect("domain");
    hv.start_vcpu(&other, start(), |_| ())
        .expect("vcpu")
        .join()
        .expect("vcpu");
    assert!(read_system_time(&other, 0).is_some());
}

#[test]
fn a_vcpu_accounts_its_time_running_and_blocked() {
    let (hv, d) = domain();
    let h = hv
        .start_vcpu(&d, start(), |v| {
            let r0 = v.domain().vcpus()[0].runstate();
            // Blocked until the timer fires 30 ms from now.
            let _ = v.hv().bind_virq(v.domain(), Virq::Timer, 0);
            v.set_timer(Some(v.hv().now() + Duration::from_millis(30)));
            v.wait();
            // After a block the time-info block was stamped again: the clock is right.
            let drift = v.system_time().abs_diff(v.hv().now());
            (r0, v.domain().vcpus()[0].runstate(), drift)
        })
        .expect("vcpu");
    let (r0, r1, drift) = h.join().expect("vcpu");
    assert_eq!(r0.state, RunstateKind::Running);
    assert_eq!(r1.state, RunstateKind::Running);
    let blocked = r1.time[RunstateKind::Blocked as usize];
    assert!(blocked >= Duration::from_millis(29), "{blocked:?}");
    assert!(r1.state_entry_time > r0.state_entry_time);
    assert!(drift < Duration::from_millis(1), "{drift:?}");
    // Once the kernel returned the vCPU is offline, and every interval is accounted.
    let fin = d.vcpus()[0].runstate();
    assert_eq!(fin.state, RunstateKind::Offline);
    let sum: Duration = fin.time[..3].iter().sum();
    assert!(fin.state_entry_time >= sum, "{fin:?}");
}
