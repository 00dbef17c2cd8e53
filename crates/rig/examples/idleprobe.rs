//! Probe: native vs direct (or pv with and without netfront's fragments) at one message
//! size, alternating, printing CPU ns per packet and its classes.
//! `cargo run --release --example idleprobe -- 52 4 [native|direct|pv]`.
use std::time::Duration;

use hv::profile::Class;
use net::netfront::RxBuffers;
use rig::udp::{Config, Options, Running};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut a = std::env::args().skip(1);
    let size: usize = a.next().and_then(|s| s.parse().ok()).unwrap_or(52);
    let runs: usize = a.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    let frag = RxBuffers::Fragments;
    let which: Vec<(Config, RxBuffers)> = match a.next().as_deref() {
        Some("native") => vec![(Config::Native, frag)],
        Some("direct") => vec![(Config::Direct, frag)],
        Some("pv") => vec![(Config::Pv, frag), (Config::Pv, RxBuffers::Linear)],
        _ => vec![(Config::Native, frag), (Config::Direct, frag)],
    };
    for _ in 0..runs {
        for &(config, rx_buffers) in &which {
            let m = Running::start(Options {
                front: net::netfront::FrontConfig::posting(rx_buffers),
                ..Options::paper(config, size)
            })?;
            std::thread::sleep(Duration::from_millis(300));
            let s0 = m.snapshot();
            std::thread::sleep(Duration::from_secs(2));
            let s1 = m.snapshot();
            let f = m.finish(Duration::from_secs(2))?;
            let pk = (s1.frames_sent - s0.frames_sent) as f64;
            for ((name, _, d0), (_, _, d1)) in s0.domains.iter().zip(&s1.domains) {
                let cpu = (d1.cpu - d0.cpu).as_nanos() as f64 / pk;
                let tot: u64 = Class::ALL
                    .iter()
                    .map(|&c| d1.samples.of(c) - d0.samples.of(c))
                    .sum();
                let variant = if rx_buffers == frag { "" } else { "-linear" };
                let mut line = format!(
                    "{:7} {name:7} {cpu:7.0} ns/pkt |",
                    format!("{}{variant}", config.name())
                );
                for c in Class::ALL {
                    let n = d1.samples.of(c) - d0.samples.of(c);
                    if n > 0 {
                        line += &format!(" {c:?}={:.0}", cpu * n as f64 / tot as f64);
                    }
                }
                println!("{line}");
            }
            let mut ctr = String::new();
            for (c, n, v) in &f.counters.entries {
                ctr += &format!(" {c}.{n}={v}");
            }
            println!(
                "        lost={} {ctr}",
                f.messages_sent - f.messages_received
            );
        }
    }
    Ok(())
}
