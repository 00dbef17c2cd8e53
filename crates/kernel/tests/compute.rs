//! A consolidated machine's neighbour: guests that compute share a pCPU by their weights.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::wire::{CountingSink, Silence};
use kernel::compute::ComputeSpec;
use kernel::driver_domain::DriverConfig;
use kernel::machine::{Above, CpuSet, GuestSpec, Layout, Machine, MachineSpec, NicSpec};
use net::netfront::FrontConfig;

fn computing(name: &str, weight: u32, passes: &Arc<AtomicU64>) -> GuestSpec {
    GuestSpec {
        weight,
        name: name.into(),
        mac: [2, 0, 0, 0, 0, 0],
        above: Above::Compute(ComputeSpec {
            heap_pages: 64,
            passes: Arc::clone(passes),
        }),
        // Both on the machine's one core, with the driver domain.
        core: Some(0),
        front: FrontConfig::default(),
    }
}

/// Two guests that always have work, on one pCPU with weights 1 and 3: the second
/// takes three passes for each of the first's, every pass reads its memory back as
/// written, and nothing else on the pCPU starves them.
#[test]
fn guests_that_compute_share_a_pcpu_by_their_weights_and_read_their_memory_back() {
    let (light, heavy) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let m = Machine::start(MachineSpec {
        // One core: the driver domain and both guests' vCPUs on the same pCPU.
        cpus: Some(CpuSet::range(0..1)),
        ..MachineSpec::new(
            NicSpec::new(Box::new(Silence), Box::new(CountingSink::default())),
            Layout::DriverDomain {
                driver: DriverConfig::default(),
                guests: vec![computing("light", 1, &light), computing("heavy", 3, &heavy)],
            },
        )
    })
    .expect("machine");
    let t = Instant::now();
    while light.load(Ordering::Relaxed) < 2000 && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let c = m.stop().expect("stops");
    let (l, h) = (light.load(Ordering::Relaxed), heavy.load(Ordering::Relaxed));
    assert!(l >= 2000, "the light guest made {l} passes");
    assert_eq!(
        c.get("compute", "passes"),
        l + h,
        "both guests' counts at stop"
    );
    assert_eq!(
        c.get("compute", "failed"),
        0,
        "every pass read back as written"
    );
    let ratio = h as f64 / l as f64;
    assert!(
        (2.7..=3.3).contains(&ratio),
        "weights 3 : 1 gave {h} : {l} passes"
    );
}
