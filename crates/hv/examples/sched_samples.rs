//! How the profiler's samples on a pCPU follow its units' running time: two units that
//! burn steps of different lengths share one pCPU; prints each unit's running time (the
//! scheduler's account, from the clock at every switch) and its samples (1 ms period).
//! On the 2-core VM of issue 40, with 50 µs and 10 µs steps, the short unit gets about
//! twice its share of samples, while the accounts match the steps' lengths: the
//! per-domain sample shares on a shared pCPU are an estimate.
//!
//! `cargo run --release -p hv --example sched_samples -- [step_us_a] [step_us_b]`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hv::sched::{CpuPlan, Cx, IdlePolicy, Scheduler, Step, Unit, UnitSpec};
use mem::cpu::SampleSlot;

struct Burn {
    us: u64,
    stop: Arc<AtomicBool>,
    slot: Arc<SampleSlot>,
}

impl Unit for Burn {
    type Output = ();
    fn samples(&self) -> Option<Arc<SampleSlot>> {
        Some(Arc::clone(&self.slot))
    }
    fn step(&mut self, _cx: &Cx) -> Step<()> {
        if self.stop.load(Ordering::Relaxed) {
            return Step::Done(());
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_micros(self.us) {
            std::hint::spin_loop();
        }
        Step::More
    }
}

fn main() {
    let arg = |i: usize, d: u64| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(d)
    };
    let (a, b) = (arg(1, 3), arg(2, 1));
    idle_only();
    for policy in [IdlePolicy::Poll, IdlePolicy::HALT_POLL] {
        let s = sampled_pcpu(policy);
        let stop = Arc::new(AtomicBool::new(false));
        let mk = |us| Burn {
            us,
            stop: Arc::clone(&stop),
            slot: Arc::new(SampleSlot::default()),
        };
        let (ua, ub) = (mk(a), mk(b));
        let (sa, sb) = (Arc::clone(&ua.slot), Arc::clone(&ub.slot));
        let ja = s.place(0, UnitSpec::named("a"), ua).expect("a");
        let jb = s.place(0, UnitSpec::named("b"), ub).expect("b");
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        let (ra, rb) = (ja.stats().report(), jb.stats().report());
        let _ = (ja.join(), jb.join());
        let n = |x: &SampleSlot| x.counts().iter().sum::<u64>();
        let rep = &s.reports()[0];
        println!(
            "{policy}: a ran {:?}, {} samples; b ran {:?}, {} samples; pCPU busy {:?} idle {:?} stolen {:?}",
            ra.running,
            n(&sa),
            rb.running,
            n(&sb),
            rep.busy,
            rep.idle,
            rep.stolen
        );
    }
}

/// An idle pCPU: its thread's CPU time, all in the idle loop, and the samples that see it.
fn idle_only() {
    for policy in [IdlePolicy::Poll, IdlePolicy::HALT_POLL] {
        let s = sampled_pcpu(policy);
        std::thread::sleep(Duration::from_secs(1));
        let r = &s.reports()[0];
        println!(
            "{policy} idle only: cpu {:?} samples {} idle {:?}",
            r.cpu, r.samples, r.idle
        );
    }
}

/// One pCPU on core 1 that samples every millisecond.
fn sampled_pcpu(policy: IdlePolicy) -> Arc<Scheduler> {
    Scheduler::new(
        &CpuPlan {
            cores: vec![Some(1)],
            policy,
            own_policy: Vec::new(),
        },
        Some(Duration::from_millis(1)),
    )
    .expect("scheduler")
}
