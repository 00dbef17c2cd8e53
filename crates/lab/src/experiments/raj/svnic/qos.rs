//! Paper 002's Figure 10: one high-priority and two low-priority VMs sending on a
//! saturated link through the SV-NIC, quality-aware (the egress scheduler serves VIFs
//! by priority) against quality-unaware (round robin), each VIF's throughput over time.
//!
//! The two low-priority guests send as fast as their VIFs take frames throughout; the
//! high-priority guest's offered load steps up phase by phase, to saturation. The
//! priorities are set, and the scheduler chosen, by the toolstack through the store.
//! The cable's far end checks every frame's every byte and each sender's sequence.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::peer::WireRate;
use dev::svnic::device::{SignalMode, SvnicConfig};
use dev::svnic::engine::Schedule;
use dev::wire::WireSink;
use kernel::machine::{Layout, Machine, MachineSpec, NicSpec, SvnicGuestSpec};
use kernel::probe::FloodSpec;
use kernel::svnic_guest::{RawApp, SvnicApp};
use net::offload::Offload;

use crate::chart::{Lines, Series};
use crate::{Error, Mode, Report};

/// The VMs: the high-priority one first.
const VMS: [(&str, u8); 3] = [("HP", 80), ("LP1", 10), ("LP2", 10)];
/// Frame length on the wire (bytes, without the FCS).
const FRAME: usize = 1514;
/// The link: the paper's board's gigabit port.
const LINK_BPS: u64 = 1_000_000_000;
/// Throughput sampling interval.
const SAMPLE: Duration = Duration::from_millis(100);

fn mac(i: usize) -> [u8; 6] {
    [0x02, 0, 0, 0x9a, 0, i as u8]
}

/// The far end of the cable: per sender, frames and bytes, and any frame that was not
/// exactly as sent or not the next in its sender's sequence.
#[derive(Debug, Default)]
struct Far {
    bytes: [AtomicU64; 3],
    frames: [AtomicU64; 3],
    next_seq: [AtomicU32; 3],
    corrupt: AtomicU64,
    out_of_sequence: AtomicU64,
}

#[derive(Debug, Clone)]
struct FarSink(Arc<Far>);

impl WireSink for FarSink {
    fn transmit(&mut self, f: &[u8], _: Offload) {
        let far = &self.0;
        let from = f.get(11).map(|&b| b as usize).filter(|&i| i < 3);
        let (Some(i), Some(seq)) = (from, kernel::probe::verify(f)) else {
            far.corrupt.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if f.len() != FRAME || f[6..12] != mac(i) {
            far.corrupt.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if far.next_seq[i].swap(seq.wrapping_add(1), Ordering::Relaxed) != seq {
            far.out_of_sequence.fetch_add(1, Ordering::Relaxed);
        }
        far.frames[i].fetch_add(1, Ordering::Relaxed);
        far.bytes[i].fetch_add(f.len() as u64, Ordering::Relaxed);
    }
}

/// What one scheduler's run measured.
struct Run {
    /// Per phase, per VM: throughput in Mbit/s (the phase's second half).
    phases: Vec<[f64; 3]>,
    /// Per phase, what HP's guest put into its VIF, Mbit/s (same half).
    hp_sent: Vec<f64>,
    /// Per VM, (seconds, Mbit/s) samples.
    series: [Vec<(f64, f64)>; 3],
    sent: u64,
    received: u64,
    corrupt: u64,
    out_of_sequence: u64,
}

fn measure(
    idle: rig::IdlePolicy,
    schedule: Schedule,
    offered: &[u64],
    phase: Duration,
) -> Result<Run, Error> {
    let far = Arc::new(Far::default());
    let rates: Vec<Arc<AtomicU64>> = (0..3).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let sent: Vec<Arc<AtomicU64>> = (0..3).map(|_| Arc::default()).collect();
    rates[0].store(offered[0], Ordering::Relaxed);
    let m = Machine::start(MachineSpec {
        idle,
        ..MachineSpec::new(
            NicSpec::new(
                Box::new(dev::wire::Silence),
                Box::new(FarSink(Arc::clone(&far))),
            ),
            Layout::Svnic {
                config: SvnicConfig {
                    signal: SignalMode::PerVif,
                    link: WireRate::Bits(LINK_BPS),
                    ..SvnicConfig::default()
                },
                guests: (0..3)
                    .map(|i| SvnicGuestSpec {
                        name: VMS[i].0.into(),
                        mac: mac(i),
                        app: SvnicApp::Raw(RawApp::Flood(FloodSpec {
                            me: mac(i),
                            peer: [0x02, 0, 0, 0x9a, 0xff, 0xff],
                            len: FRAME,
                            rate: Arc::clone(&rates[i]),
                            sent: Arc::clone(&sent[i]),
                        })),
                        priority: Some(VMS[i].1),
                        core: None,
                    })
                    .collect(),
            },
        )
    })
    .map_err(Error::other)?;
    m.set_vif_schedule(schedule).map_err(Error::other)?;
    let bytes =
        |far: &Far| -> [u64; 3] { std::array::from_fn(|i| far.bytes[i].load(Ordering::Relaxed)) };
    let mbit = |b: u64, d: Duration| b as f64 * 8.0 / d.as_secs_f64() / 1e6;
    let t0 = Instant::now();
    let mut series: [Vec<(f64, f64)>; 3] = Default::default();
    let mut phases = Vec::new();
    let mut hp_sent = Vec::new();
    let hp = || sent[0].load(Ordering::Relaxed) * FRAME as u64;
    let (mut last, mut last_at) = (bytes(&far), Instant::now());
    for &rate in offered {
        rates[0].store(rate, Ordering::Relaxed);
        let start = Instant::now();
        let mut half: Option<([u64; 3], Instant, u64)> = None;
        while start.elapsed() < phase {
            std::thread::sleep(SAMPLE.saturating_sub(last_at.elapsed()));
            let (now_b, now) = (bytes(&far), Instant::now());
            for i in 0..3 {
                series[i].push((
                    (now - t0).as_secs_f64(),
                    mbit(now_b[i] - last[i], now - last_at),
                ));
            }
            (last, last_at) = (now_b, now);
            if half.is_none() && start.elapsed() >= phase / 2 {
                half = Some((now_b, now, hp()));
            }
        }
        let (h, at, hp_at) = half.unwrap_or((last, last_at, hp()));
        phases.push(std::array::from_fn(|i| mbit(last[i] - h[i], last_at - at)));
        hp_sent.push(mbit(hp() - hp_at, last_at - at));
    }
    // The senders stop, then what they sent has drained before the far end is read.
    for r in &rates {
        r.store(1, Ordering::Relaxed);
    }
    std::thread::sleep(Duration::from_millis(100));
    let sent_total: u64 = sent.iter().map(|s| s.load(Ordering::Relaxed)).sum();
    let settle = Instant::now();
    let received = || -> u64 { far.frames.iter().map(|f| f.load(Ordering::Relaxed)).sum() };
    while received() + far.corrupt.load(Ordering::Relaxed) < sent_total
        && settle.elapsed() < Duration::from_secs(2)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    m.stop().map_err(Error::other)?;
    Ok(Run {
        phases,
        hp_sent,
        series,
        sent: sent_total,
        received: received(),
        corrupt: far.corrupt.load(Ordering::Relaxed),
        out_of_sequence: far.out_of_sequence.load(Ordering::Relaxed),
    })
}

/// Adds Figure 10 to `rep`.
/// An offered load's label (0: all it can).
fn label(r: u64) -> String {
    if r == 0 {
        "saturating".to_string()
    } else {
        format!("{} Mbit/s", r / 1_000_000)
    }
}

pub fn figure10(rep: &mut Report, cx: &crate::Context) -> Result<(), Error> {
    let mode = cx.mode;
    let phase = Duration::from_secs_f64(match mode {
        Mode::Full => 3.0,
        Mode::Quick => 0.6,
        Mode::Smoke => 0.4,
    });
    // The high-priority VM's offered load, phase by phase; 0: all it can.
    let offered: [u64; 4] = [200_000_000, 500_000_000, 800_000_000, 0];
    rep.setup.push_str(&format!(
        " Figure 10: one host, its SV-NIC's 1 Gbit/s link cabled to a far end that checks \
         every byte of every frame and each sender's sequence. Three guests, HP (priority 80) \
         and LP1 and LP2 (10 each), priorities and the scheduler set by the toolstack through \
         the store, send 1514-byte raw frames: the LPs as fast as their VIFs take them \
         throughout, HP at {} in turn, {} s a phase; throughput sampled every 100 ms, a \
         phase's figure its second half. Stride scheduling gives each backlogged VIF its \
         priority's share of what the link carries, so HP is due what it offers up to 80% of \
         it. The guests' vCPUs take the cores after the controller domain's in turn, beside \
         the device's engines.",
        offered.map(label).join(", "),
        phase.as_secs_f64()
    ));
    let runs = [
        (
            "quality-aware",
            measure(cx.idle, Schedule::Priority, &offered, phase)?,
        ),
        (
            "quality-unaware",
            measure(cx.idle, Schedule::RoundRobin, &offered, phase)?,
        ),
    ];
    rows(rep, &runs, &offered);
    checks(rep, &runs, &offered);
    Ok(())
}

/// Each VM's throughput in each phase under each schedule, and Figure 10's lines.
fn rows(rep: &mut Report, runs: &[(&str, Run)], offered: &[u64]) {
    for (name, run) in runs {
        for (k, &rate) in offered.iter().enumerate() {
            let p = run.phases[k];
            for (i, (vm, prio)) in VMS.iter().enumerate() {
                let r = rep.row(
                    &format!("Fig. 10: {name}, HP offering {}", label(rate)),
                    &format!("{vm} (priority {prio})"),
                    "Mbit/s",
                    &[p[i]],
                );
                if i == 0 {
                    r.reference = Some(format!("its guest sent {:.0} Mbit/s", run.hp_sent[k]));
                }
            }
        }
        rep.lines.push(Lines {
            name: format!(
                "fig10-{}",
                if name.starts_with("quality-a") {
                    "qa"
                } else {
                    "qu"
                }
            ),
            title: format!("Fig. 10: each VM's throughput over time, {name}"),
            x_unit: "s".into(),
            unit: "Mbit/s".into(),
            series: VMS
                .iter()
                .zip(&run.series)
                .map(|((vm, _), s)| Series {
                    label: (*vm).into(),
                    points: s.clone(),
                })
                .collect(),
        });
    }
}

/// The quality-aware schedule gives HP its due, the link stays full, the quality-unaware
/// one shares evenly, and every frame arrives whole and in sequence.
fn checks(rep: &mut Report, runs: &[(&str, Run)], offered: &[u64]) {
    let total_prio: u32 = VMS.iter().map(|v| u32::from(v.1)).sum();
    // Quality-aware: HP gets what it offers, up to its priority's share of the link's
    // rate. Both are fixed before the run (the link's rate is the wire's, in frame
    // bytes: 1514 of every 1538 it carries), so a link that carried less than it can
    // shows as a miss here, not as a smaller target.
    let link = LINK_BPS as f64 / 1e6 * FRAME as f64 / (FRAME + dev::peer::WIRE_OVERHEAD) as f64;
    let hp_share = link * f64::from(VMS[0].1) / f64::from(total_prio);
    let qa = &runs[0].1;
    for (k, &rate) in offered.iter().enumerate() {
        let p = qa.phases[k];
        let due = if rate == 0 {
            hp_share
        } else {
            (rate as f64 / 1e6).min(hp_share)
        };
        let x = p[0] / due;
        rep.check(
            &format!(
                "quality-aware, HP offering {}: HP's throughput against min(offered, 80% of the \
                 link's {link:.0} Mbit/s) = {due:.0} Mbit/s",
                label(rate),
            ),
            x,
            "× due",
            "≥ 0.95",
            x >= 0.95,
        );
    }
    // The LPs send as fast as their VIFs take frames in every phase, so the link is
    // full throughout, under either schedule: what it carried against its rate.
    let least = runs
        .iter()
        .flat_map(|(_, r)| r.phases.iter().map(|p| p.iter().sum::<f64>() / link))
        .fold(f64::INFINITY, f64::min);
    rep.check(
        &format!(
            "Fig. 10, every phase of both schedules: the link carried its rate ({link:.0} \
             Mbit/s of frames; the LPs never stop sending)"
        ),
        least,
        "× link rate (least phase)",
        "≥ 0.95",
        least >= 0.95,
    );
    // Quality-unaware, all saturating: even shares.
    let qu = &runs[1].1;
    let p = qu.phases[offered.len() - 1];
    let even = p.iter().sum::<f64>() / 3.0;
    let worst = p
        .iter()
        .map(|x| (x - even).abs() / even)
        .fold(0.0, f64::max);
    rep.check(
        "quality-unaware, all three saturating: each VM within 10% of an equal share",
        worst,
        "× equal share off",
        "≤ 0.10",
        worst <= 0.10,
    );
    let sum = |f: fn(&Run) -> u64| runs.iter().map(|(_, r)| f(r)).sum::<u64>();
    let (bad, oos, sent, recv) = (
        sum(|r| r.corrupt),
        sum(|r| r.out_of_sequence),
        sum(|r| r.sent),
        sum(|r| r.received),
    );
    rep.check(
        "Fig. 10 frames corrupt, out of sequence or lost at the far end",
        (bad + oos + sent.saturating_sub(recv)) as f64,
        "frames",
        &format!("0 (of {sent} sent)"),
        bad + oos == 0 && recv == sent && sent > 0,
    );
}
