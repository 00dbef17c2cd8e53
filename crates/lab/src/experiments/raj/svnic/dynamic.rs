//! Beyond the paper (b): dynamic core partitioning, the paper's future work. The
//! SV-NIC's engines and its sidecore poll on (the paper's design), sleep the moment
//! they find nothing (an interrupt-driven device), or poll while there is work and
//! sleep once a spin of idleness has passed (dynamic): the cores go back to the guests
//! as load falls. Measured against load: the round trip of probes crossing the two
//! hosts beside a flood at a fraction of the link, and the CPU the whole process used.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::peer::{crossover, WireRate};
use dev::svnic::device::{Idle, SignalMode};
use dev::wire::Samples;
use kernel::probe::{FloodSpec, ProbeCounters, ProbeSpec, SinkCounters};
use kernel::svnic_guest::RawApp;

use super::{client_mac, host, quantile, server_mac, Design, GuestApp, Placement, Side, SPIN};
use crate::{Error, Mode, Report};

/// The three idle policies, all with the sidecore.
const POLICIES: [(&str, Idle); 3] = [
    ("always polling", Idle::Poll),
    ("dynamic", Idle::Block { spin: SPIN }),
    (
        "interrupt-driven",
        Idle::Block {
            spin: Duration::ZERO,
        },
    ),
];

/// The flood's frames.
const FRAME: usize = 1514;
/// The link.
const LINK_BPS: u64 = 1_000_000_000;

/// What one policy measured at one load.
struct Point {
    /// Round trips, µs, sorted.
    rtts: Vec<f64>,
    /// CPU seconds the process used per second of the window.
    cpu: f64,
    probes_bad: u64,
    flood_sent: u64,
    flood_received: u64,
    flood_bad: u64,
    /// Frames the devices dropped: no device buffer, or a VIF's receive queue full.
    dropped: u64,
    /// How the devices held back instead: pauses of the cable, their µs in all, the
    /// longest, and frames that waited for their VIF ([`super::device_pauses`]).
    paused: [u64; 4],
}

fn measure(
    run_idle: rig::IdlePolicy,
    idle: Idle,
    load: f64,
    window: Duration,
    max_gap: Duration,
) -> Result<Point, Error> {
    let (a, b) = crossover(WireRate::GIGABIT);
    let design = Design::SvNic(SignalMode::Sidecore, idle);
    let probes = Arc::new(ProbeCounters::default());
    let cap = (window.as_millis() as usize * 4 / max_gap.as_millis().max(1) as usize) + 256;
    let rtts = Arc::new(Samples::new(cap));
    let sink = Arc::new(SinkCounters::default());
    let sent = Arc::new(AtomicU64::new(0));
    // Rate 0 means flat out: a tiny load still paces.
    let rate = Arc::new(AtomicU64::new(((LINK_BPS as f64 * load) as u64).max(1)));
    let servers = host(run_idle, design, Side::Server, b, 2, &|i| {
        GuestApp::Raw(if i == 0 {
            RawApp::Echo(server_mac(0))
        } else {
            RawApp::Sink(server_mac(1), Arc::clone(&sink))
        })
    })?;
    let clients = host(run_idle, design, Side::Client, a, 2, &|i| {
        GuestApp::Raw(if i == 0 {
            RawApp::Ping(ProbeSpec {
                me: client_mac(0),
                peer: server_mac(0),
                max_gap,
                seed: 0x5eed,
                rtts: Arc::clone(&rtts),
                counters: Arc::clone(&probes),
            })
        } else {
            RawApp::Flood(FloodSpec {
                me: client_mac(1),
                peer: server_mac(1),
                len: FRAME,
                rate: Arc::clone(&rate),
                sent: Arc::clone(&sent),
            })
        })
    })?;
    // Settled, then the window.
    std::thread::sleep(Duration::from_millis(200));
    let place = Placement::of_host();
    // The CPU the devices' cores used: where each host has cores of its own, its
    // engines' and sidecore's pCPUs (the guests' poll alike in every design); where the
    // hosts share the cores, the whole process.
    let cpu = || match place {
        Placement::Own(_) => [(&clients, Side::Client), (&servers, Side::Server)]
            .into_iter()
            .map(|(m, side)| {
                let own = place.device_pcpus(m, side);
                m.scheduler()
                    .reports()
                    .iter()
                    .filter(|r| own.contains(&r.index))
                    .map(|r| r.cpu)
                    .sum::<Duration>()
            })
            .sum(),
        Placement::Shared => mem::cpu::process_cpu_time(),
    };
    let (from, c0, t0) = (rtts.len(), cpu(), Instant::now());
    std::thread::sleep(window);
    let (c1, t1) = (cpu(), Instant::now());
    let mut got: Vec<f64> = rtts
        .since(from)
        .into_iter()
        .map(|ns| ns as f64 / 1e3)
        .collect();
    // The flood stops; what it sent drains before the far end is read.
    rate.store(1, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(100));
    let (mut dropped, mut paused) = (0, [0u64; 4]);
    for m in [clients, servers] {
        let c = m.stop().map_err(Error::other)?;
        dropped += super::device_drops(&c);
        let p = super::device_pauses(&c);
        paused = [
            paused[0] + p[0],
            paused[1] + p[1],
            paused[2].max(p[2]),
            paused[3] + p[3],
        ];
    }
    got.sort_by(f64::total_cmp);
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Ok(Point {
        rtts: got,
        cpu: (c1 - c0).as_secs_f64() / (t1 - t0).as_secs_f64(),
        probes_bad: l(&probes.lost) + l(&probes.corrupt),
        flood_sent: l(&sent),
        flood_received: l(&sink.received),
        flood_bad: l(&sink.corrupt) + l(&sink.out_of_sequence),
        dropped,
        paused,
    })
}

/// Adds the dynamic-partitioning rows and checks to `rep`.
pub fn dynamic(rep: &mut Report, cx: &crate::Context) -> Result<(), Error> {
    let mode = cx.mode;
    let (loads, window, gap_ms): (&[f64], f64, u64) = match mode {
        Mode::Full => (&[0.05, 0.3, 0.6, 0.95], 3.0, 5),
        Mode::Quick => (&[0.05, 0.95], 1.0, 2),
        Mode::Smoke => (&[0.3], 0.3, 1),
    };
    rep.setup.push_str(&format!(
        " Dynamic core partitioning (beyond the paper): the two hosts with two pairs each, \
         SV-NIC with the sidecore; pair 0 probes as in Figure 7 (0 to {gap_ms} ms apart), client \
         1 floods server 1 with 1514-byte frames at a fraction of the 1 Gbit/s link that server \
         1 checks byte for byte; the engines and the sidecore always polling, sleeping at once \
         when idle (interrupt-driven), or polling while there is work and sleeping after \
         {} µs without (dynamic); {window} s per point; CPU per second is {}.",
        SPIN.as_micros(),
        match Placement::of_host() {
            Placement::Own(_) =>
                "that of the devices' own cores (both hosts' engines and \
                                  sidecores, their pCPUs' thread CPU clocks; the guests' cores \
                                  idle alike in every design)",
            Placement::Shared =>
                "the whole process's (both hosts: the devices share the \
                                  cores with the guests)",
        }
    ));
    let mut pts: Vec<Vec<Point>> = Vec::new();
    for (name, idle) in POLICIES {
        let mut row = Vec::new();
        for &load in loads {
            crate::progress::step(format_args!(
                "dynamic cores: {name} · {:.0}% load",
                load * 100.0
            ));
            let p = measure(
                cx.idle,
                idle,
                load,
                Duration::from_secs_f64(window),
                Duration::from_millis(gap_ms),
            )?;
            let g = format!("dynamic cores: {:.0}% of the link", load * 100.0);
            rep.row(&g, &format!("{name}: round trip"), "µs", &p.rtts)
                .reference = Some(format!("{} probes", p.rtts.len()));
            rep.row(&g, &format!("{name}: CPU"), "cores", &[p.cpu]);
            rep.row(
                &g,
                &format!("{name}: frames the devices dropped"),
                "frames",
                &[p.dropped as f64],
            )
            .reference = Some(format!(
                "of {} flood frames; no device buffer, or the receiving VIF's queue full \
                 once its frame had waited {} ms; instead the cable was paused {} times \
                 ({:.1} ms in all, longest {:.1} ms) and {} frames waited for their VIF",
                p.flood_sent,
                dev::svnic::engine::VIF_HOLD.as_millis(),
                p.paused[0],
                p.paused[1] as f64 / 1e3,
                p.paused[2] as f64 / 1e3,
                p.paused[3],
            ));
            row.push(p);
        }
        pts.push(row);
    }
    for (k, &load) in loads.iter().enumerate() {
        let (poll, dynm, intr) = (&pts[0][k], &pts[1][k], &pts[2][k]);
        let x = quantile(&dynm.rtts, 0.5) / quantile(&poll.rtts, 0.5);
        rep.check(
            &format!(
                "{:.0}% load: dynamic median round trip within 10% of always polling's",
                load * 100.0
            ),
            x,
            "× polling",
            "≤ 1.10",
            x <= 1.10,
        );
        if load <= 0.3 {
            let y = dynm.cpu / intr.cpu;
            rep.check(
                &format!(
                    "{:.0}% load: dynamic CPU ≤ 1.2× the interrupt-driven design's",
                    load * 100.0
                ),
                y,
                "× interrupt-driven",
                "≤ 1.2",
                y <= 1.2,
            );
        }
    }
    let all = pts.iter().flatten();
    let (bad, sent, recv) = all.fold((0, 0, 0), |a, p| {
        (
            a.0 + p.probes_bad + p.flood_bad,
            a.1 + p.flood_sent,
            a.2 + p.flood_received,
        )
    });
    rep.check(
        "dynamic cores: probes lost or corrupt, flood frames lost, corrupt or out of sequence",
        (bad + sent.saturating_sub(recv)) as f64,
        "frames",
        &format!("0 (of {sent} flood frames)"),
        bad == 0 && sent == recv && sent > 0,
    );
    Ok(())
}

/// Steps this adds to the progress plan.
pub fn steps(mode: Mode) -> u64 {
    let n = match mode {
        Mode::Full => 4,
        Mode::Quick => 2,
        Mode::Smoke => 1,
    };
    (n * POLICIES.len()) as u64
}
