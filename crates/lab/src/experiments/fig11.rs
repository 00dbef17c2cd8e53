//! Paper 000 §5.2, Figure 11: CPU per packet against interrupt coalescing, 6 to 64
//! packets per interrupt with the 18 µs maximum delay, for native, direct I/O and the PV
//! configurations — and, beyond the paper, adaptive moderation (the driver choosing the
//! packets per interrupt from the rate it measures) as its own line.
//!
//! The NIC counts the delay from the last received packet, as the paper describes its
//! NIC ("a maximum delay after the last received packet"): at the paper's load packets
//! arrive closer together than 18 µs, so the packet count decides the batch.

use std::collections::BTreeMap;

use dev::nic::{Coalesce, DelayFrom};

use crate::chart::{Lines, Series};
use crate::experiments::santos08::{account_losses, durations, one_run, RunCost};
use crate::platform::{Finish, Options};
use crate::{Experiment, LabError, Mode, Report, Stats};

/// The registry entry.
pub const EXPERIMENT: Experiment = Experiment {
    id: "santos08-fig11",
    title: "CPU per received packet against interrupt coalescing, and adaptive moderation",
    paper: "000 Santos et al. 2008, Fig. 11 (§5.2)",
    run,
};

/// Message size (the paper's Figure 8 and 11 size).
const SIZE: usize = 48000;
/// Packets per interrupt swept (the paper's range).
const SETTINGS: [u32; 5] = [6, 8, 16, 32, 64];
/// The configurations: every named one, in the paper's order of cost.
const CONFIGS: [&str; 5] = crate::platform::NAMED;
/// The PV configurations, whose saving is compared with native's.
const PV: [&str; 3] = ["pv", "pv-soft", "pv-guestcopy"];

/// Per configuration, per setting: each round's cost and interrupts per packet.
type Results<'a> = BTreeMap<&'a str, BTreeMap<String, Vec<(RunCost, f64)>>>;

/// A setting's label.
fn setting(s: Option<u32>) -> String {
    s.map_or("adaptive".into(), |n| format!("{n} pkt/int"))
}

fn options(config: &str, s: Option<u32>) -> Options {
    let mut o = Options::named(config, SIZE).unwrap_or_else(|| Options::pv_soft(SIZE));
    o.coalesce = Coalesce {
        pkts_per_irq: s.unwrap_or(SETTINGS[0]),
        max_delay: Coalesce::default().max_delay,
        delay_from: DelayFrom::LastPacket,
        adaptive: s.is_none(),
    };
    o
}

fn run(mode: Mode) -> Result<Report, LabError> {
    let d = durations(mode);
    let mut r = Report::new(EXPERIMENT.id, EXPERIMENT.title, EXPERIMENT.paper);
    let rate = Options::named("pv", SIZE).map_or(0.0, |o| o.rate);
    r.setup = format!(
        "UDP messages of {SIZE} bytes at a fixed {rate:.0} frames/s (Figure 2's load). Coalescing \
         at 6, 8, 16, 32 and 64 packets per interrupt with an 18 µs maximum delay counted from the \
         last received packet (the paper's NIC), and adaptive: the NIC driver sets the packets \
         per interrupt each {} ms from the rate it measured, aiming at {:.0} interrupts a second \
         (1 to {}). Configurations: native, direct, pv (original), pv-soft, pv-guestcopy (see \
         santos08-fig8). In each of {} rounds every configuration runs at every setting once ({} \
         ms after {} ms warm-up); ratios are taken within a round.",
        dev::driver::ADAPTIVE_WINDOW.as_millis(),
        dev::driver::ADAPTIVE_IRQ_RATE,
        dev::driver::ADAPTIVE_MAX_PKTS,
        d.runs,
        d.window.as_millis(),
        d.warmup.as_millis()
    );
    r.config = serde_json::json!({
        "mode": format!("{mode:?}"), "runs": d.runs, "window_ms": d.window.as_millis() as u64,
        "size": SIZE, "rate_fps": rate, "settings": SETTINGS, "max_delay_us": 18,
        "delay_from": "last packet", "configs": CONFIGS,
        "adaptive_irq_rate": dev::driver::ADAPTIVE_IRQ_RATE,
    });
    // A smoke run (the tests) takes the sweep's ends only.
    let swept: &[u32] = if mode == Mode::Smoke {
        &[6, 64]
    } else {
        &SETTINGS
    };
    let all: Vec<Option<u32>> = swept.iter().map(|&n| Some(n)).chain([None]).collect();
    // results[config][setting] = per-round (cost, interrupts per packet).
    let mut results: Results<'_> = BTreeMap::new();
    let mut finishes: Vec<(String, Finish)> = Vec::new();
    for round in 0..d.runs {
        for config in CONFIGS {
            let mut order = all.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            for s in order {
                let (c, f) = one_run(options(config, s), &d)?;
                let ipp = f.counters.get("nic", "irqs") as f64 / f.frames_sent.max(1) as f64;
                results
                    .entry(config)
                    .or_default()
                    .entry(setting(s))
                    .or_default()
                    .push((c, ipp));
                finishes.push((format!("{config} {}", setting(s)), f));
            }
        }
    }
    let total = |config: &str, s: Option<u32>| -> Vec<f64> {
        results[config][&setting(s)]
            .iter()
            .map(|(c, _)| c.total_ns)
            .collect()
    };
    let mut series = Vec::new();
    for config in CONFIGS {
        let group = format!("fig11 {config}");
        let six = total(config, Some(6));
        for &s in &all {
            let t = total(config, s);
            let row = r.row(&group, &format!("{} total", setting(s)), "ns/pkt", &t);
            if s != Some(6) {
                row.ratio = crate::stats::ratio_median(&t, &six).map(|x| ("6 pkt/int".into(), x));
            }
            let ipp: Vec<f64> = results[config][&setting(s)]
                .iter()
                .map(|(_, i)| *i)
                .collect();
            r.row(
                &group,
                &format!("{} interrupts per packet", setting(s)),
                "irq/pkt",
                &ipp,
            );
        }
        series.push(Series {
            label: config.to_string(),
            points: swept
                .iter()
                .map(|&n| (f64::from(n), Stats::of(&total(config, Some(n))).median))
                .collect(),
        });
        let a = Stats::of(&total(config, None)).median;
        series.push(Series {
            label: format!("{config}, adaptive"),
            points: vec![(f64::from(SETTINGS[0]), a), (f64::from(SETTINGS[4]), a)],
        });
    }
    r.lines.push(Lines {
        name: "fig11".into(),
        title: format!(
            "Figure 11: CPU per packet against packets per interrupt, {SIZE}-byte messages"
        ),
        x_unit: "packets per interrupt (18 µs maximum delay)".into(),
        unit: "ns per packet".into(),
        series,
    });

    // The paper's point: what is left of the PV cost is proportional to the interrupt
    // rate, so batching saves the PV paths at least twice what it saves native.
    let saving = |config: &str| -> f64 {
        1.0 - crate::stats::ratio_median(&total(config, Some(64)), &total(config, Some(6)))
            .unwrap_or(1.0)
    };
    let native = saving("native");
    for config in PV {
        let s = saving(config);
        r.check(
            &format!(
                "{config}: relative saving from 6 to 64 pkt/int at least twice native's \
                 ({:.1}% against native's {:.1}%)",
                100.0 * s,
                100.0 * native
            ),
            if native > 0.0 {
                s / native
            } else {
                f64::INFINITY
            },
            "× native's saving",
            "≥ 2",
            s >= 2.0 * native && s > 0.0,
        );
    }
    let gc =
        crate::stats::ratio_median(&total("pv-guestcopy", Some(64)), &total("native", Some(64)))
            .unwrap_or(f64::NAN);
    r.check(
        "pv-guestcopy at 64 pkt/int against native at 64 pkt/int (per-round ratio, median; the \
         paper: 1.97×)",
        gc,
        "× native",
        "≤ 2.0",
        gc <= 2.0,
    );
    for config in CONFIGS {
        let best = swept
            .iter()
            .map(|&n| (n, Stats::of(&total(config, Some(n))).median))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(6, |b| b.0);
        let x = crate::stats::ratio_median(&total(config, None), &total(config, Some(best)))
            .unwrap_or(f64::NAN);
        r.check(
            &format!("{config}: adaptive within 5% of the best static setting ({best} pkt/int)"),
            x,
            "× best static",
            "≤ 1.05",
            x <= 1.05,
        );
    }
    r.notes.push(
        "one-way latency at a low rate (the issue's second half of Figure 11) is not measured \
         yet"
        .into(),
    );
    let lost = account_losses(&mut r, finishes.iter().map(|(l, f)| (l.clone(), f)));
    r.check_none("messages lost or corrupted (all runs)", lost, "messages");
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_configuration_runs_at_every_setting_and_adaptive() {
        let rep = run(Mode::Smoke).expect("runs");
        for config in CONFIGS {
            for s in [Some(6), Some(64), None] {
                let name = format!("{} total", setting(s));
                assert!(
                    rep.rows.iter().any(|r| r.group == format!("fig11 {config}")
                        && r.name == name
                        && r.stats.median > 0.0),
                    "{config} {name}"
                );
            }
        }
        assert_eq!(rep.lines[0].series.len(), 2 * CONFIGS.len());
        // Three PV savings, pv-guestcopy against native, adaptive per configuration, loss.
        assert_eq!(rep.checks.len(), PV.len() + 1 + CONFIGS.len() + 1);
    }
}
