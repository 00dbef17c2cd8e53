//! Paper 002's Figure 9: the aggregate TCP throughput of n flows between n client
//! guests on one host and n server guests on another (the paper's iperf), HV-NIC
//! against SV-NIC with and without the sidecore.
//!
//! Each client's TCP (smoltcp, as the guests' TCP everywhere in pvio) sends one stream
//! as fast as its window allows; each server reads it and checks every byte. A
//! repetition is a fresh pair of hosts: connections set up, a warm-up, then the bytes
//! the servers read over the window. The aggregate is their sum. The paper's dotted
//! lines are one flow between the two hosts' driver domains themselves, the stack on
//! the NIC straight or through the bridge.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::peer::{crossover, WireRate};
use dev::svnic::device::{Idle, SignalMode};
use kernel::app::{AppCounters, AppSpec, Proto};
use kernel::machine::Layout;
use net::wire::UdpFlow;
use smoltcp::wire::Ipv4Address;

use super::{client_mac, dom0_host, host, server_mac, Design, GuestApp, Side, SPIN};
use crate::chart::{Lines, Series};
use crate::{Error, Mode, Report};

/// The designs Figure 9 compares.
const DESIGNS: [Design; 4] = [
    Design::HvNic,
    Design::SvNic(SignalMode::IdRegister, Idle::Poll),
    Design::SvNic(SignalMode::Sidecore, Idle::Poll),
    Design::SvNic(SignalMode::Sidecore, Idle::Block { spin: SPIN }),
];

/// How long a repetition waits for every connection to carry its first bytes.
const CONNECT: Duration = Duration::from_secs(5);

/// Flow `i`: client i to server i, both in 10.0.0.0/24.
fn flow(i: usize) -> UdpFlow {
    UdpFlow {
        src_mac: client_mac(i),
        dst_mac: server_mac(i),
        src_ip: Ipv4Address::new(10, 0, 0, 1 + i as u8),
        dst_ip: Ipv4Address::new(10, 0, 0, 101 + i as u8),
        src_port: 40000 + i as u16,
        dst_port: 5001,
        mtu: net::wire::DEFAULT_MTU,
    }
}

/// What one repetition measured.
struct Rep {
    /// Mbit/s the servers read over the window.
    mbit: f64,
    /// Bytes found corrupt.
    corrupt: u64,
    /// Flows that carried nothing in the window.
    idle: usize,
    /// Frames the devices dropped: no device buffer, a VIF's receive queue full, or
    /// (HV-NIC) the NIC's receive ring empty.
    dropped: u64,
    /// Both hosts' domains' CPU time over the window, ns per byte read.
    cpu_ns_per_byte: f64,
}

/// What carries the flows: guests behind a design, or the driver domains themselves.
#[derive(Debug, Clone, Copy)]
enum Line {
    /// `n` guests on each host behind the design.
    Guests(Design),
    /// One flow between the hosts' driver domains, the stack through the bridge or not
    /// (the paper's dotted lines).
    Dom0 { bridge: bool },
}

/// One repetition: a fresh pair of hosts, `warm` after every connection carried its
/// first bytes, then `window`.
fn once(
    idle: rig::IdlePolicy,
    line: Line,
    n: usize,
    warm: Duration,
    window: Duration,
) -> Result<Rep, Error> {
    let (a, b) = crossover(WireRate::GIGABIT);
    let recv: Vec<Arc<AppCounters>> = (0..n).map(|_| Arc::default()).collect();
    let spec = |i: usize, proto: Proto, c: Arc<AppCounters>| AppSpec {
        flow: flow(i),
        message: 0,
        proto,
        counters: c,
        latency: None,
        nbd: None,
    };
    let server = |i: usize| spec(i, Proto::TcpStream, Arc::clone(&recv[i]));
    let client = |i: usize| spec(i, Proto::TcpSend, Arc::default());
    let (servers, clients) = match line {
        Line::Guests(d) => (
            host(idle, d, Side::Server, b, n, &|i| GuestApp::Stack(server(i)))?,
            host(idle, d, Side::Client, a, n, &|i| GuestApp::Stack(client(i)))?,
        ),
        Line::Dom0 { bridge } => {
            let stack = |side: Side, app: AppSpec| Layout::DirectStack {
                app,
                mac: side.mac(0),
                bridge,
            };
            (
                dom0_host(idle, Side::Server, b, stack(Side::Server, server(0)))?,
                dom0_host(idle, Side::Client, a, stack(Side::Client, client(0)))?,
            )
        }
    };
    let bytes = || -> Vec<u64> {
        recv.iter()
            .map(|c| c.bytes.load(Ordering::Relaxed))
            .collect()
    };
    // Every connection set up (ARP, then a SYN smoltcp retries after a second when
    // the first went before the address was resolved), then the warm-up.
    let setup = Instant::now();
    while bytes().contains(&0) && setup.elapsed() < CONNECT {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(warm);
    // Every domain's vCPU time on both hosts (the devices' engines are no domain's).
    let cpu = || -> Duration {
        [&servers, &clients]
            .iter()
            .flat_map(|m| rig::udp::domain_use(m))
            .map(|(_, _, d)| d.cpu)
            .sum()
    };
    let (b0, t0, c0) = (bytes(), Instant::now(), cpu());
    std::thread::sleep(window);
    let (b1, t1, c1) = (bytes(), Instant::now(), cpu());
    let mut dropped = 0;
    for m in [clients, servers] {
        let c = m.stop().map_err(Error::other)?;
        dropped += super::device_drops(&c);
    }
    let corrupt = recv.iter().map(|c| c.corrupt.load(Ordering::Relaxed)).sum();
    let idle = b0.iter().zip(&b1).filter(|(x, y)| y <= x).count();
    let total: u64 = b1.iter().zip(&b0).map(|(y, x)| y - x).sum();
    Ok(Rep {
        mbit: total as f64 * 8.0 / (t1 - t0).as_secs_f64() / 1e6,
        corrupt,
        idle,
        dropped,
        cpu_ns_per_byte: (c1 - c0).as_nanos() as f64 / total.max(1) as f64,
    })
}

/// Adds Figure 9 to `rep`.
pub fn figure9(rep: &mut Report, cx: &crate::Context) -> Result<(), Error> {
    let mode = cx.mode;
    let (ns, reps, warm, window): (&[usize], usize, f64, f64) = match mode {
        Mode::Full => (&[1, 2, 4, 8, 16, 32], 5, 0.5, 2.0),
        Mode::Quick => (&[4], 2, 0.3, 0.7),
        Mode::Smoke => (&[2], 1, 0.2, 0.3),
    };
    rep.setup.push_str(&format!(
        " Figure 9: the same two hosts; client guest i's TCP sends one stream to server guest \
         i as fast as its window allows (smoltcp, Reno, MTU-sized segments, no offloads on \
         either design), the server reads it and checks every byte; a repetition is a fresh \
         pair of hosts, {warm} s of warm-up, then the bytes read over {window} s; {reps} \
         repetitions. The paper used iperf between Linux guests."
    ));
    let mut fig9 = Vec::new();
    let mut means = Vec::new();
    let (mut corrupt, mut idle) = (0u64, 0usize);
    for d in DESIGNS {
        let mut series = Vec::new();
        let mut row_means = Vec::new();
        for &n in ns {
            crate::progress::step(format_args!("Fig. 9: {} · {n} flows", d.name()));
            let mut xs = Vec::new();
            let (mut drops, mut idle_here) = (0, 0);
            for _ in 0..reps {
                let r = once(
                    cx.idle,
                    Line::Guests(d),
                    n,
                    Duration::from_secs_f64(warm),
                    Duration::from_secs_f64(window),
                )?;
                xs.push(r.mbit);
                corrupt += r.corrupt;
                idle += r.idle;
                idle_here += r.idle;
                drops += r.dropped;
            }
            let mean = xs.iter().sum::<f64>() / xs.len() as f64;
            let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>()
                / (xs.len().max(2) - 1) as f64)
                .sqrt();
            rep.row(
                &format!("Fig. 9: aggregate TCP throughput, {n} flows"),
                d.name(),
                "Mbit/s",
                &xs,
            )
            .reference = Some(format!(
                "mean {mean:.0} ± {sd:.0} (sd); {drops} frames dropped by the devices; \
                 {idle_here} flows carried nothing"
            ));
            series.push((n as f64, mean));
            row_means.push(mean);
        }
        fig9.push(Series {
            label: d.name().into(),
            points: series,
        });
        means.push(row_means);
    }
    let dom0 = dom0_lines(cx, rep, ns, reps, (warm, window), &mut fig9)?;
    corrupt += dom0.corrupt;
    idle += dom0.idle;
    rep.lines.push(Lines {
        name: "fig9".into(),
        title: "Fig. 9: aggregate TCP throughput of n flows".into(),
        x_unit: "flows".into(),
        unit: "Mbit/s".into(),
        series: fig9,
    });
    for (k, &n) in ns.iter().enumerate() {
        let x = means[1][k] / means[0][k];
        rep.check(
            &format!("{n} flows: SV-NIC aggregate throughput ≥ 1.5× HV-NIC's (paper 1.77–2×)"),
            x,
            "× HV-NIC",
            "≥ 1.5",
            x >= 1.5,
        );
    }
    // Two checks, not one: a corrupt byte is a broken data path, a flow that carried
    // nothing in its window one starved on the host's cores.
    rep.check_none("Fig. 9 bytes corrupt at the servers", corrupt, "bytes");
    rep.check_none(
        "Fig. 9 flows that carried nothing in their window (every design, flow count and repetition)",
        idle as u64,
        "flows",
    );
    Ok(())
}

/// The dotted lines: one flow between the two driver domains, the stack on the NIC
/// straight and through the bridge, each a flat line across the figure's flows.
/// Returns what the repetitions found wrong.
fn dom0_lines(
    cx: &crate::Context,
    rep: &mut Report,
    ns: &[usize],
    reps: usize,
    (warm, window): (f64, f64),
    fig9: &mut Vec<Series>,
) -> Result<Rep, Error> {
    let mut bad = Rep {
        mbit: 0.0,
        corrupt: 0,
        idle: 0,
        dropped: 0,
        cpu_ns_per_byte: 0.0,
    };
    let (mut medians, mut cpus) = (Vec::new(), Vec::new());
    for (bridge, name) in [
        (false, "driver domain on the NIC (dotted)"),
        (true, "driver domain through its bridge (dotted)"),
    ] {
        crate::progress::step(format_args!("Fig. 9: {name}"));
        let (mut xs, mut cpu) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let r = once(
                cx.idle,
                Line::Dom0 { bridge },
                1,
                Duration::from_secs_f64(warm),
                Duration::from_secs_f64(window),
            )?;
            xs.push(r.mbit);
            cpu.push(r.cpu_ns_per_byte * 1e3);
            bad.corrupt += r.corrupt;
            bad.idle += r.idle;
            bad.dropped += r.dropped;
        }
        let med = crate::Stats::of(&xs).median;
        let row = rep.row(
            "Fig. 9: both driver domains' CPU, no guest, 1 flow",
            name,
            "µs/MB",
            &cpu,
        );
        if let Some(&straight) = cpus.first() {
            row.ratio = Some((
                "on the NIC".into(),
                crate::Stats::of(&cpu).median / straight,
            ));
        }
        cpus.push(crate::Stats::of(&cpu).median);
        rep.row(
            "Fig. 9: TCP throughput, no guest, 1 flow",
            name,
            "Mbit/s",
            &xs,
        )
        .reference = Some("the paper's dotted lines".into());
        let (lo, hi) = (ns[0] as f64, ns[ns.len() - 1] as f64);
        fig9.push(Series {
            label: name.into(),
            points: vec![(lo, med), (hi, med)],
        });
        medians.push(med);
    }
    rep.notes.push(format!(
        "Fig. 9's dotted lines: the driver domain's own TCP flow through its bridge carried \
         {:.3}× what it carried straight on the NIC ({:.0} against {:.0} Mbit/s, medians of \
         {reps}); {} frames dropped by the NICs, {} runs whose flow carried nothing. Both \
         driver domains together were busy \
         {:.0}% of one core on the NIC and {:.0}% through the bridge: one flow's rate is set \
         by its window and the wire, not by either host's CPU, so the bridge's cost shows in \
         the CPU each byte takes rather than in the rate",
        medians[1] / medians[0],
        medians[1],
        medians[0],
        bad.dropped,
        bad.idle,
        cpus[0] * medians[0] / 8.0 / 1e4,
        cpus[1] * medians[1] / 8.0 / 1e4,
    ));
    let x = cpus[1] / cpus[0];
    rep.check(
        "Fig. 9's dotted lines: the bridge costs the driver domains CPU (both hosts, per byte \
         read; paper: the gap between the dotted lines is the bridging's overhead)",
        x,
        "× on the NIC",
        "> 1",
        x > 1.0,
    );
    Ok(bad)
}

/// Steps Figure 9 adds to the progress plan.
pub fn steps(mode: Mode) -> u64 {
    let n = match mode {
        Mode::Full => 6,
        Mode::Quick | Mode::Smoke => 1,
    };
    (n * DESIGNS.len() + 2) as u64
}
