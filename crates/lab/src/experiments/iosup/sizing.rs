//! Sizing the pool without hand-set factors (issue 14, item 6a).
//!
//! The paper's release rule has two factors, which it tuned per scenario. Each workload
//! here runs with every setting of a grid of those factors and with the adaptive rule
//! ([`kernel::mm::Sizing::Adaptive`]); the best hand-tuned setting for a workload is the
//! one with the fewest invalidations in its steady part, and among those the smallest
//! pool. The runs are driven by events, not a clock: what is counted (invalidations,
//! pages) does not depend on the rate, and the same sequence of forks and exits gives
//! the same counts on any machine.

use std::collections::VecDeque;

use kernel::mm::{FreePolicy, PoolMode, Process, RegionSpec, Sizing, SMALL_PROCESS};

use super::{guest, pt_flushes, DENSE, SETUPS};
use crate::{Error, Mode, Report};

/// A churn workload.
#[derive(Debug, Clone, Copy)]
pub(super) enum Workload {
    /// A browser: `tabs` opened one by one, then all closed; `cycles` times.
    Browser { tabs: usize, cycles: usize },
    /// A build (`make -jN`): `jobs` compilations, `n` at a time (the oldest exits
    /// when a new one starts), then a link (a larger image) alone; `cycles` times.
    Build {
        n: usize,
        jobs: usize,
        cycles: usize,
    },
    /// Demand that falls: a browser with `from` tabs, then with `to`.
    Falls {
        from: usize,
        to: usize,
        cycles: usize,
    },
}

impl Workload {
    fn name(self) -> String {
        match self {
            Workload::Browser { tabs, .. } => format!("browser, {tabs} tabs a cycle"),
            Workload::Build { n, jobs, .. } => format!("build, -j{n}, {jobs} jobs then a link"),
            Workload::Falls { from, to, .. } => format!("browser, {from} tabs, then {to}"),
        }
    }

    /// Cycles run, and the first counted as steady: the second half of the run, or
    /// of the fallen demand's part. The first half is the learning time that every
    /// setting gets alike; the whole run's counts are reported beside.
    fn cycles(self) -> (usize, usize) {
        match self {
            Workload::Browser { cycles, .. } | Workload::Build { cycles, .. } => {
                (cycles, cycles / 2)
            }
            Workload::Falls { cycles, .. } => (cycles, cycles * 2 / 3),
        }
    }
}

/// What one run counted over its steady part.
#[derive(Debug, Clone, Copy)]
pub(super) struct Outcome {
    /// IOTLB invalidations from page-table type changes.
    pub flushes: u64,
    /// The most pages pooled.
    pub pool_max: usize,
    /// Pages pooled, mean over every fork and exit.
    pub pool_mean: f64,
    /// Over the whole run, warm-up included.
    pub flushes_all: u64,
    /// Processes created in the steady part.
    pub processes: u64,
}

/// Runs `w` on a strict-IOMMU guest with per-level pools sized by `sizing`.
pub(super) fn run_workload(w: Workload, sizing: Sizing) -> Result<Outcome, Error> {
    let mut g = guest(&SETUPS[0])?;
    g.mm.set_pool(PoolMode::PerLevel, sizing)
        .map_err(Error::other)?;
    let mut parent = g.mm.spawn(&SMALL_PROCESS).map_err(Error::other)?;
    let (cycles, warm) = w.cycles();
    let (mut f0, mut p0) = (0, 0);
    let (mut pool_max, mut pool_sum, mut samples) = (0usize, 0f64, 0u64);
    let mut live: VecDeque<Process> = VecDeque::new();
    for cycle in 0..cycles {
        if cycle == warm {
            f0 = pt_flushes(&g);
            p0 = g.mm.stats.forks;
        }
        let steady = cycle >= warm;
        let mut sample = |pooled: usize| {
            if steady {
                pool_max = pool_max.max(pooled);
                pool_sum += pooled as f64;
                samples += 1;
            }
        };
        let mut start = |g: &mut super::Guest, image: &[RegionSpec]| {
            let mut c = g.mm.fork(&mut parent).map_err(Error::other)?;
            g.mm.exec(&mut c, image).map_err(Error::other)?;
            g.mm.run(&c).map_err(Error::other)?;
            Ok::<_, Error>(c)
        };
        let (tabs, jobs, n) = match w {
            Workload::Browser { tabs, .. } => (tabs, 0, 0),
            Workload::Falls { from, to, cycles } => {
                (if cycle < cycles / 3 { from } else { to }, 0, 0)
            }
            Workload::Build { n, jobs, .. } => (0, jobs, n),
        };
        for _ in 0..tabs {
            live.push_back(start(&mut g, &SMALL_PROCESS)?);
            sample(g.mm.pooled());
        }
        for _ in 0..jobs {
            if live.len() == n {
                if let Some(c) = live.pop_front() {
                    g.mm.exit(c).map_err(Error::other)?;
                    sample(g.mm.pooled());
                }
            }
            live.push_back(start(&mut g, &SMALL_PROCESS)?);
            sample(g.mm.pooled());
        }
        while let Some(c) = live.pop_front() {
            g.mm.exit(c).map_err(Error::other)?;
            sample(g.mm.pooled());
        }
        if jobs > 0 {
            let ld = start(&mut g, &DENSE)?;
            sample(g.mm.pooled());
            g.mm.exit(ld).map_err(Error::other)?;
            sample(g.mm.pooled());
        }
    }
    let flushes_all = pt_flushes(&g);
    let out = Outcome {
        flushes: flushes_all - f0,
        pool_max,
        pool_mean: pool_sum / samples.max(1) as f64,
        flushes_all,
        processes: g.mm.stats.forks - p0,
    };
    g.mm.exit(parent).map_err(Error::other)?;
    Ok(out)
}

/// The grid of the paper's two factors.
fn grid(mode: Mode) -> Vec<FreePolicy> {
    let (ratios, totals): (&[f64], &[usize]) = match mode {
        Mode::Smoke => (&[1.0, 32.0], &[0, 1024]),
        Mode::Quick => (&[0.5, 1.0, 4.0, 16.0], &[0, 64, 128, 256, 1024]),
        Mode::Full => (
            &[0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            &[0, 32, 64, 128, 256, 512, 1024],
        ),
    };
    ratios
        .iter()
        .flat_map(|&ratio| totals.iter().map(move |&total| FreePolicy { ratio, total }))
        .collect()
}

/// The workloads.
fn workloads(mode: Mode) -> [Workload; 3] {
    let c = if mode == Mode::Smoke { 4 } else { 12 };
    [
        Workload::Browser {
            tabs: 16,
            cycles: 2 * c,
        },
        Workload::Build {
            n: 8,
            jobs: 40,
            cycles: c,
        },
        Workload::Falls {
            from: 16,
            to: 4,
            cycles: 3 * c,
        },
    ]
}

/// Progress steps [`section`] takes.
pub(super) fn steps(mode: Mode) -> u64 {
    (workloads(mode).len() * (grid(mode).len() + 1)) as u64
}

/// The sizing section of the report: per workload, the best hand-tuned setting and the
/// adaptive rule, with a check that the adaptive rule comes within 10% of it.
pub(super) fn section(r: &mut Report, mode: Mode) -> Result<(), Error> {
    let grid = grid(mode);
    let ws = workloads(mode);
    let mut best_of_first: Option<FreePolicy> = None;
    for &w in &ws {
        let name = w.name();
        let mut tuned = Vec::with_capacity(grid.len());
        for &p in &grid {
            crate::progress::step(format_args!(
                "pool sizing, {name}, ratio {} total {}",
                p.ratio, p.total
            ));
            tuned.push((p, run_workload(w, p.into())?));
        }
        crate::progress::step(format_args!("pool sizing, {name}, adaptive"));
        let ad = run_workload(w, Sizing::Adaptive)?;
        let (bp, best) = tuned
            .iter()
            .copied()
            .min_by_key(|(_, o)| (o.flushes, o.pool_max))
            .ok_or_else(|| Error::other("empty grid"))?;
        let worst = tuned.iter().map(|(_, o)| o.flushes).max().unwrap_or(0);
        let g = format!("pool sizing: {name}");
        r.row(
            &g,
            "processes in the steady part",
            "processes",
            &[ad.processes as f64],
        );
        for (what, o) in [
            (
                format!("best hand-tuned (ratio {}, total {})", bp.ratio, bp.total),
                best,
            ),
            ("adaptive".to_string(), ad),
        ] {
            r.row(
                &g,
                &format!("{what}: invalidations, steady"),
                "invalidations",
                &[o.flushes as f64],
            );
            r.row(
                &g,
                &format!("{what}: invalidations, whole run"),
                "invalidations",
                &[o.flushes_all as f64],
            );
            r.row(
                &g,
                &format!("{what}: pool, largest"),
                "pages",
                &[o.pool_max as f64],
            );
            r.row(&g, &format!("{what}: pool, mean"), "pages", &[o.pool_mean]);
        }
        r.row(
            &g,
            "worst setting of the grid: invalidations, steady",
            "invalidations",
            &[worst as f64],
        );
        if let Some(p0) = best_of_first {
            if let Some((_, o)) = tuned.iter().find(|(p, _)| *p == p0) {
                r.row(
                    &g,
                    &format!(
                        "the first workload's best (ratio {}, total {}): invalidations, steady",
                        p0.ratio, p0.total
                    ),
                    "invalidations",
                    &[o.flushes as f64],
                );
                r.row(
                    &g,
                    "the first workload's best: pool, mean",
                    "pages",
                    &[o.pool_mean],
                );
            }
        } else {
            best_of_first = Some(bp);
        }
        for (what, unit, got, best) in [
            (
                "invalidations",
                "invalidations",
                ad.flushes as f64,
                best.flushes as f64,
            ),
            (
                "largest pool",
                "pages",
                ad.pool_max as f64,
                best.pool_max as f64,
            ),
        ] {
            r.check(
                &format!("adaptive sizing against the best hand-tuned, {what} ({name})"),
                got,
                unit,
                &format!("≤ {:.0} (best {best}, +10%)", 1.1 * best),
                got <= 1.1 * best,
            );
        }
    }
    r.notes.push(format!(
        "Pool sizing: each workload ran with every one of {} settings of the paper's two factors (ratio × total) and with the adaptive rule, on a strict-IOMMU guest with per-level pools; the counts are exact and driven by the workload's events, not a clock. The adaptive rule measures time in the pool's own allocations (an epoch is one turnover of the tables in use), bounds the pool's footprint (tables in use plus pooled) by the peak in use of this epoch or the last, and learns peaks further apart from regret (pages given back and asked for again), with a patience that doubles when it gives back too early.",
        grid.len()
    ));
    Ok(())
}
