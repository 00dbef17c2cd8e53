//! `pvio soak` (and `bench soak`): hostile and well-behaved guests side by side behind
//! one driver domain for a bounded time (issue 15).
//!
//! The machine is the `pv` machine of the other experiments — NIC, driver domain with
//! bridge and netback, the receiving guest with pvio's stack and an application that
//! checks every byte of every message, a paced UDP stream on the wire — plus hostile
//! guests ([`kernel::hostile::HostileGuest`]) whose vifs share the driver domain's vCPU,
//! pool and bridge and receive a burst of garbage every millisecond (bad grants of
//! every kind, impossible sizes and offsets, broken chains, producer indices moved back
//! or far ahead). The toolstack's watchdog runs throughout; the driver domain is also
//! restarted on a schedule, so that the hostile guests reconnect and start again on
//! fresh vifs (a protocol break disables a vif for good otherwise).
//!
//! Per period: messages delivered, the process's resident memory, the hypervisor's free
//! frames, the hostile guests' free pages. Checks: no unplanned restart (no hostile
//! guest stalled or crashed the driver domain), traffic in every period, no message
//! corrupt or partial, memory flat, nothing held once the machine stops, and the
//! hostile guests' garbage refused and counted by netback.

use std::time::{Duration, Instant};

use kernel::hostile::HostileStats;
use net::netback::VifStats;
use net::netif::TxCheckStats;

use crate::{Error, Experiment, Mode, Report};
use rig::udp::{Config, Options, Running};

/// The registry entry.
pub const EXPERIMENT: Experiment = Experiment {
    id: "soak",
    title: "Soak: hostile and well-behaved guests side by side",
    paper: "issue 15 (000 §5.1: isolation of faults)",
    run,
};

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct SoakPlan {
    /// How long.
    pub duration: Duration,
    /// Hostile guests beside the receiving one.
    pub hostile: usize,
    /// Planned driver-domain restarts this often (none: only the watchdog's).
    pub restart_every: Option<Duration>,
    /// One period of the table.
    pub period: Duration,
    /// How the machine's idle pCPUs wait.
    pub idle: hv::sched::IdlePolicy,
}

/// One period's figures.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Period {
    /// Seconds since the start, at the period's end.
    pub at_s: f64,
    /// Messages the application received during the period.
    pub messages: u64,
    /// Resident memory of the process, KiB.
    pub rss_kib: u64,
    /// The hypervisor's free frames (after reaping destroyed domains).
    pub free_frames: usize,
    /// The hostile guests' free pages, summed.
    pub hostile_free_pages: usize,
    /// Planned restarts so far.
    pub restarts: usize,
    /// Restarts the watchdog made so far.
    pub watchdog_restarts: usize,
}

/// The watchdog's stall limit in the soak: generous, so that only a real stall trips it.
const STALL: Duration = Duration::from_millis(500);
/// Offered load, frames per second of 1000-byte messages.
const RATE: f64 = 20_000.0;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4)
}

/// The soak's plan from the run's mode.
fn plan(cx: &crate::Context) -> SoakPlan {
    let (secs, every_ms, period_ms) = match cx.mode {
        Mode::Full => (60, 10_000, 1000),
        Mode::Quick => (12, 4000, 1000),
        Mode::Smoke => (3, 1500, 500),
    };
    SoakPlan {
        duration: Duration::from_secs(secs),
        hostile: 2,
        restart_every: Some(Duration::from_millis(every_ms)),
        period: Duration::from_millis(period_ms),
        idle: cx.idle,
    }
}

fn run(cx: &crate::Context) -> Result<Report, Error> {
    let plan = plan(cx);
    let secs = plan.duration.as_secs_f64();
    crate::progress::plan((secs / plan.period.as_secs_f64()).ceil() as u64);
    soak(plan, &mut |p| {
        crate::progress::step(format_args!("{:.0} s of {secs:.0}", p.at_s))
    })
}

/// Runs the soak, calling `each` at the end of every period.
pub fn soak(plan: SoakPlan, each: &mut dyn FnMut(&Period)) -> Result<Report, Error> {
    let opts = Options {
        rate: RATE,
        sample: None,
        hostile: plan.hostile,
        idle: plan.idle,
        ..Options::paper(Config::Pv, 1000)
    };
    let mut r = Running::start(opts)?;
    let hv = std::sync::Arc::clone(&r.hv);
    let hostile_pages = |r: &Running| -> usize {
        (0..plan.hostile)
            .filter_map(|i| r.domain(&format!("hostile{i}")))
            .map(|d| d.free_page_count())
            .sum()
    };
    // Warm up: the good guest's traffic flows.
    let t = Instant::now();
    while r.snapshot().messages < 200 {
        if t.elapsed() > Duration::from_secs(10) {
            return Err(Error::Other("no traffic reached the guest".into()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let t0 = Instant::now();
    let mut next_restart = plan.restart_every.map(|d| t0 + d);
    let (mut planned, mut unplanned) = (0usize, Vec::new());
    let mut periods: Vec<Period> = Vec::new();
    let mut last = r.snapshot().messages;
    let mut end = t0;
    while end < t0 + plan.duration {
        end += plan.period;
        while Instant::now() < end {
            if let Some(x) = r.watchdog(STALL)? {
                unplanned.push(x);
            }
            if next_restart.is_some_and(|at| Instant::now() >= at) {
                r.restart_driver_domain()?;
                planned += 1;
                next_restart = next_restart.zip(plan.restart_every).map(|(a, e)| a + e);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        hv.reap();
        let now = r.snapshot().messages;
        let p = Period {
            at_s: t0.elapsed().as_secs_f64(),
            messages: now - last,
            rss_kib: rss_kib(),
            free_frames: hv.frame_table().free_frames(),
            hostile_free_pages: hostile_pages(&r),
            restarts: planned,
            watchdog_restarts: unplanned.len(),
        };
        last = now;
        each(&p);
        periods.push(p);
    }
    let finish = r.finish(Duration::from_secs(1))?;
    let held = hv.reap();
    report(plan, &periods, &unplanned, &finish, held)
}

/// The configuration a record names: the soak's length, its hostile guests and planned
/// restarts, the good guest's stream, and every period's figures.
#[derive(Debug, serde::Serialize)]
struct Recorded<'a> {
    seconds: f64,
    hostile: usize,
    restart_every_s: Option<f64>,
    rate_fps: f64,
    message: usize,
    periods: &'a [Period],
}

fn report(
    plan: SoakPlan,
    periods: &[Period],
    unplanned: &[rig::udp::Restarted],
    finish: &rig::udp::Finish,
    held: usize,
) -> Result<Report, Error> {
    let (Some(first), Some(last)) = (periods.first(), periods.last()) else {
        return Err(Error::Other("the soak ran no period".into()));
    };
    let mut r = Report::new(EXPERIMENT.id, EXPERIMENT.title, EXPERIMENT.paper);
    r.setup = format!(
        "pv machine: one guest receiving {RATE} frames/s of 1000-byte UDP messages (every \
         byte checked) and {} hostile guests writing a burst of garbage into their vifs' \
         rings every {:?}, for {:?}; the driver domain restarted {}; the watchdog \
         running with a stall limit of {STALL:?}.",
        plan.hostile,
        kernel::hostile::BURST_EVERY,
        plan.duration,
        plan.restart_every
            .map_or("only by the watchdog".into(), |d| format!("every {d:?}"))
    );
    r.set_config(&Recorded {
        seconds: plan.duration.as_secs_f64(),
        hostile: plan.hostile,
        restart_every_s: plan.restart_every.map(|d| d.as_secs_f64()),
        rate_fps: RATE,
        message: 1000,
        periods,
    });
    let col = |f: fn(&Period) -> f64| periods.iter().map(f).collect::<Vec<_>>();
    r.row(
        "per period",
        "messages delivered",
        "messages",
        &col(|p| p.messages as f64),
    );
    r.row(
        "per period",
        "resident memory",
        "KiB",
        &col(|p| p.rss_kib as f64),
    );
    r.row(
        "per period",
        "free frames",
        "frames",
        &col(|p| p.free_frames as f64),
    );
    r.row(
        "per period",
        "hostile guests' free pages",
        "pages",
        &col(|p| p.hostile_free_pages as f64),
    );
    flow_checks(&mut r, periods, unplanned, finish);
    memory_checks(&mut r, &plan, first, last, periods, held);
    hostile_checks(&mut r, &plan, last, finish);
    Ok(r)
}

/// The good guest's traffic: no restart the watchdog had to make, no quiet period,
/// every message as sent.
fn flow_checks(
    r: &mut Report,
    periods: &[Period],
    unplanned: &[rig::udp::Restarted],
    finish: &rig::udp::Finish,
) {
    r.check(
        "restarts the watchdog had to make (a hostile guest stalled or crashed the driver domain)",
        unplanned.len() as f64,
        "restarts",
        "= 0",
        unplanned.is_empty(),
    );
    let quiet = periods.iter().filter(|p| p.messages == 0).count();
    r.check_none(
        "periods in which the good guest received nothing",
        quiet as u64,
        "periods",
    );
    r.check_none("messages delivered not as sent", finish.corrupt, "messages");
}

/// Memory flat: the process's, the machine's frames, the hostile guests' pages, and
/// nothing of destroyed domains held.
fn memory_checks(
    r: &mut Report,
    plan: &SoakPlan,
    first: &Period,
    last: &Period,
    periods: &[Period],
    held: usize,
) {
    // Memory: the first period already holds every pool; later ones may not grow.
    let growth = last.rss_kib as f64 - first.rss_kib as f64;
    r.check(
        "resident memory growth, first period to last",
        growth,
        "KiB",
        "< 4096",
        growth < 4096.0,
    );
    let frames_moved = periods
        .iter()
        .filter(|p| p.free_frames != first.free_frames)
        .count();
    r.check_none(
        "periods whose free frames differ from the first's",
        frames_moved as u64,
        "periods",
    );
    // A hostile guest's pages: one connection's worth (5) may be in flight at a look.
    let lost = first.hostile_free_pages as f64 - last.hostile_free_pages as f64;
    let slack = 5.0 * plan.hostile as f64;
    r.check(
        "hostile guests' free pages lost, first period to last",
        lost,
        "pages",
        &format!("≤ {slack}"),
        lost <= slack,
    );
    r.check_none(
        "frames of destroyed domains still held after the machine stopped",
        held as u64,
        "frames",
    );
}

/// The hostile guests' chains refused and counted, and every chain that passed
/// accounted for.
fn hostile_checks(r: &mut Report, plan: &SoakPlan, last: &Period, finish: &rig::udp::Finish) {
    let c = &finish.counters;
    let hostile = |f: fn(&HostileStats) -> u64| c.sum(f);
    let refused = c.sum(|t: &TxCheckStats| t.drops.total() + t.fatals.total());
    r.check(
        "hostile chains refused and counted by the last driver domain's netback",
        refused as f64,
        "chains",
        "> 0",
        plan.hostile == 0 || refused > 0,
    );
    // Every chain that passed the checks was either sent on or answered with an error.
    let passed = c.sum(|t: &TxCheckStats| t.packets);
    let (sent_on, grant_err, no_buf) = (
        c.sum(|v: &VifStats| v.tx_packets),
        c.sum(|v: &VifStats| v.tx_grant_errors),
        c.sum(|v: &VifStats| v.tx_no_buffer),
    );
    let off = passed.abs_diff(sent_on + grant_err + no_buf);
    r.check_none(
        "netback: chains passed − (sent on + grant errors + no buffer), last driver domain",
        off,
        "chains",
    );
    r.notes.push(format!(
        "{} planned restarts; the hostile guests wrote {} bursts ({} TX and {} RX \
         requests, {} producer breaks) and did {} handshakes. The good guest received {} \
         of {} messages; those lost were on the wire or in a driver domain while it \
         restarted (UDP).",
        last.restarts,
        hostile(|h| h.bursts),
        hostile(|h| h.tx_requests),
        hostile(|h| h.rx_requests),
        hostile(|h| h.breaks),
        hostile(|h| h.handshakes),
        finish.messages_received,
        finish.messages_sent
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_soak_keeps_the_good_guest_whole_and_memory_flat() {
        let rep = run(&crate::Context::smoke()).expect("runs");
        assert!(!rep.checks.is_empty());
        for c in &rep.checks {
            assert!(c.met, "{c:?}\n{}", rep.table());
        }
    }
}
