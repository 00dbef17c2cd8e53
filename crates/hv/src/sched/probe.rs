//! SCRATCH probe (not to be committed): per-pCPU event rings dumped around long net waits.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

pub const STEP: u64 = 1;
pub const ACC: u64 = 2;
pub const IDLE_IN: u64 = 3;
pub const IDLE_OUT: u64 = 4;
pub const GAP: u64 = 5;
pub const STOLE: u64 = 6;
pub const LOCKED: u64 = 7;
pub const WANTED: u64 = 8; // own table locked after idle (arg: ns it took)
pub const PUTBACK: u64 = 9;

const N: usize = 1 << 15;
struct Ring {
    i: AtomicUsize,
    ev: Vec<[AtomicU64; 3]>,
}
static RINGS: OnceLock<Vec<Ring>> = OnceLock::new();
static EPOCH: OnceLock<Instant> = OnceLock::new();
static DUMPS: AtomicUsize = AtomicUsize::new(0);

fn rings() -> &'static Vec<Ring> {
    RINGS.get_or_init(|| {
        (0..8)
            .map(|_| Ring { i: AtomicUsize::new(0), ev: (0..N).map(|_| Default::default()).collect() })
            .collect()
    })
}
pub fn ns(t: Instant) -> u64 {
    t.saturating_duration_since(*EPOCH.get_or_init(Instant::now)).as_nanos() as u64
}
pub fn ev(pcpu: usize, t: Instant, kind: u64, arg: u64) {
    let r = &rings()[pcpu % 8];
    let i = r.i.load(Ordering::Relaxed);
    let e = &r.ev[i % N];
    e[0].store(ns(t), Ordering::Relaxed);
    e[1].store(kind, Ordering::Relaxed);
    e[2].store(arg, Ordering::Relaxed);
    r.i.store(i + 1, Ordering::Relaxed);
}
pub fn dump(me: usize, owner: usize, unit: &str, w: Instant, start: Instant, wait: u64, host: u64) {
    if DUMPS.fetch_add(1, Ordering::Relaxed) >= 6 {
        return;
    }
    let (a, b) = (ns(w).saturating_sub(100_000), ns(start) + 20_000);
    let w0 = ns(w) as i64;
    let mut out = format!(
        "PROBE net wait {} us (wait {} host {}) unit {unit} on pcpu{me} owner pcpu{owner}\n",
        (wait - host) / 1000, wait / 1000, host / 1000
    );
    for (p, r) in rings().iter().enumerate().take(2) {
        let n = r.i.load(Ordering::Relaxed);
        let mut lines = Vec::new();
        for k in n.saturating_sub(N - 16)..n {
            let e = &r.ev[k % N];
            let t = e[0].load(Ordering::Relaxed);
            if t < a || t > b {
                continue;
            }
            let kind = e[1].load(Ordering::Relaxed);
            let arg = e[2].load(Ordering::Relaxed);
            let name = if kind == 103 { "STEAL_IN" } else if kind == 109 { "RUN" } else { ["?", "STEP", "ACC", "IDLE_IN", "IDLE_OUT", "GAP", "STOLE", "LOCKED", "OWNLOCK", "PUTBACK"]
                [kind as usize % 10] };
            lines.push(format!("  p{p} {:>9.1} {name} {}", (t as i64 - w0) as f64 / 1000.0, describe(kind, arg)));
        }
        // Compress runs of short STEP events.
        let mut last = String::new();
        let mut rep = 0;
        for l in lines {
            let key: String = l.split_whitespace().skip(2).take(2).collect::<Vec<_>>().join(" ");
            let short = false;
            if short && key == last {
                rep += 1;
                continue;
            }
            if rep > 0 {
                out += &format!("      (x{rep} more)\n");
                rep = 0;
            }
            last = if short { key } else { String::new() };
            out += &l;
            out.push('\n');
        }
        if rep > 0 {
            out += &format!("      (x{rep} more)\n");
        }
    }
    eprint!("{out}");
}
fn describe(kind: u64, arg: u64) -> String {
    match kind {
        STEP => {
            let ns = arg & 0xffff_ffff_ffff;
            let u = arg >> 48;
            let unit: String = [(u & 0xff) as u8 as char, (u >> 8) as u8 as char].iter().collect();
            format!("{unit} {:.1}us{}", ns as f64 / 1000.0, if ns >= 50_000 { " LONG" } else { "" })
        }
        GAP => format!("{:.1}us kind{}", (arg & 0xffff_ffff_ffff) as f64 / 1000.0, arg >> 48),
        IDLE_OUT => format!("after {:.1}us", arg as f64 / 1000.0),
        _ => format!("{arg:#x}"),
    }
}
