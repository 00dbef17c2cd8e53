//! How much of a blocking thread's CPU time each sampler sees, and what it costs.
//!
//! One thread burns `work` µs of CPU, wakes a partner on the other core and parks until
//! woken back, over and over; it is sampled every `interval` µs. Prints blocks per
//! second, the thread's CPU time, samples × interval over that CPU time (coverage), and
//! wall time per round trip, for no sampler, the POSIX CPU timer and perf task-clock.
//!
//! `cargo run --release -p mem --example coverage -- [work_us] [interval_us]`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use mem::cpu::{pin_current_thread, thread_cpu_time, SampleSlot, Sampler, SlotBinding};

fn main() {
    let arg = |i: usize, d: u64| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(d)
    };
    let work = Duration::from_micros(arg(1, 5));
    let interval = Duration::from_micros(arg(2, 1000));
    for sampler in [
        Sampler::None,
        Sampler::PosixCpuTimer,
        Sampler::PerfTaskClock,
    ] {
        round_trips(work, interval, sampler);
    }
}

fn round_trips(work: Duration, interval: Duration, sampler: Sampler) {
    let stop = Arc::new(AtomicBool::new(false));
    // Not a channel: std's mpsc parks the receiver, and its wake-up could swallow the
    // first of ours.
    let worker_thread = Arc::new(OnceLock::<std::thread::Thread>::new());
    let (stop_p, wt) = (Arc::clone(&stop), Arc::clone(&worker_thread));
    let partner = std::thread::spawn(move || {
        let _ = pin_current_thread(0);
        let a = loop {
            match wt.get() {
                Some(a) => break a.clone(),
                None => std::thread::yield_now(),
            }
        };
        while !stop_p.load(Ordering::Acquire) {
            std::thread::park();
            a.unpark();
        }
    });
    let p = partner.thread().clone();
    let slot = Arc::new(SampleSlot::default());
    let s = Arc::clone(&slot);
    let worker = std::thread::spawn(move || {
        let _ = pin_current_thread(1);
        let b = SlotBinding::bind_with(s, Some(interval), sampler).expect("sampler");
        let _ = worker_thread.set(std::thread::current());
        let (t0, w0) = (thread_cpu_time(), Instant::now());
        let mut blocks = 0u64;
        let mut x = 0u64;
        while w0.elapsed() < Duration::from_secs(1) {
            let s = thread_cpu_time();
            while thread_cpu_time() - s < work {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
            }
            p.unpark();
            std::thread::park();
            blocks += 1;
        }
        let r = (b.sampler(), blocks, thread_cpu_time() - t0, w0.elapsed());
        drop(b);
        r
    });
    let (used, blocks, cpu, wall) = worker.join().expect("worker");
    stop.store(true, Ordering::Release);
    partner.thread().unpark();
    let _ = partner.join();
    let n: u64 = slot.counts().iter().sum();
    let coverage = if used == Sampler::None {
        0.0
    } else {
        n as f64 * interval.as_nanos() as f64 / cpu.as_nanos().max(1) as f64
    };
    println!(
        "{used:?}: {blocks} blocks/s, CPU {cpu:?}, coverage {:.1}%, {:.2} µs per round trip",
        coverage * 100.0,
        wall.as_secs_f64() * 1e6 / blocks.max(1) as f64
    );
}
