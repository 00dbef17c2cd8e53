//! The host's interference with a record: how much of the cores others took while it
//! ran. pvio's pCPUs own their cores only as far as the host lets them; a record taken
//! beside a busy process, or in a VM whose hypervisor took its CPUs away, measures that
//! too, and says so.
//!
//! Two readings bracket an experiment: the VM's *steal* time from `/proc/stat` (the time
//! its own hypervisor ran something else on its CPUs), and the CPU time of every process
//! (and kernel thread) on the machine. The others' share is the CPU of the processes that
//! were already running when the record began, this one aside: an experiment's own helpers
//! (iperf3, a DPDK test program, an AoE target), started during the record, are its
//! workload, not interference. A record whose others and steal together took more than
//! [`DISTURBED_SHARE`] of a core is marked disturbed on its page.

use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// The share of one core, averaged over a record, that others may take before the
/// record is marked disturbed.
pub const DISTURBED_SHARE: f64 = 0.10;

/// One process as a reading saw it: its id, its start time (so that a reused id is not
/// taken for the same process), its name and its user and system time.
#[derive(Debug, Clone)]
struct Proc {
    pid: u32,
    start: u64,
    name: String,
    ticks: u64,
}

/// One reading: the VM's steal time and every other process's CPU time, in clock ticks
/// (`USER_HZ`), and when.
#[derive(Debug, Clone)]
pub struct Reading {
    at: Instant,
    steal: u64,
    procs: Vec<Proc>,
}

/// The host's interference over a record.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HostLoad {
    /// The record's wall time, s.
    pub seconds: f64,
    /// The CPU of the processes running before the record began (this one aside), in
    /// cores (1.0: one core's worth).
    pub others_cores: f64,
    /// The VM's steal time, in cores.
    pub steal_cores: f64,
    /// Whether others and steal together passed [`DISTURBED_SHARE`] of a core.
    pub disturbed: bool,
}

/// Clock ticks a second of `/proc`'s times (`USER_HZ`, 100 on Linux).
pub(crate) const TICKS: f64 = 100.0;

/// The machine's `cpu` line of `/proc/stat` (`stat`): its fields in clock ticks, in the
/// kernel's order (user nice system idle iowait irq softirq steal guest guest_nice).
pub(crate) fn cpu_fields(stat: &str) -> Option<Vec<u64>> {
    stat.lines()
        .find(|l| l.starts_with("cpu "))?
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect()
}

/// A process's times from its `stat` line (`/proc/<pid>/stat`), in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcTimes {
    pub user: u64,
    pub system: u64,
    /// When it started (field 22), so that a reused id is not taken for the same process.
    pub start: u64,
}

/// A `stat` line's name and times (fields 14, 15 and 22).
pub(crate) fn proc_times(s: &str) -> Option<(&str, ProcTimes)> {
    let (_, rest) = s.split_once('(')?;
    // The command name may hold spaces and parentheses: it ends at the last ')'.
    let (name, rest) = rest.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i)?.parse::<u64>().ok();
    Some((
        name,
        ProcTimes {
            user: n(11)?,
            system: n(12)?,
            start: n(19)?,
        },
    ))
}

impl Reading {
    /// Reads the host now (`None` where `/proc` does not say).
    pub fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        // user nice system idle iowait irq softirq steal ...
        let steal = *cpu_fields(&stat)?.get(7)?;
        Some(Self {
            at: Instant::now(),
            steal,
            procs: procs(),
        })
    }

    /// The ticks process `now` (as a later reading saw it) used since this reading, if
    /// this reading saw it already (the same id and start time).
    fn used_since(&self, now: &Proc) -> Option<u64> {
        let was = self
            .procs
            .iter()
            .find(|b| b.pid == now.pid && b.start == now.start)?;
        Some(now.ticks.saturating_sub(was.ticks))
    }

    /// The interference from `before` to this reading.
    pub fn since(&self, before: &Reading) -> HostLoad {
        let seconds = self.at.duration_since(before.at).as_secs_f64().max(1e-3);
        let cores = |ticks: u64| ticks as f64 / TICKS / seconds;
        let others: u64 = self.procs.iter().filter_map(|p| before.used_since(p)).sum();
        let others_cores = cores(others);
        let steal_cores = cores(self.steal.saturating_sub(before.steal));
        HostLoad {
            seconds,
            others_cores,
            steal_cores,
            disturbed: others_cores + steal_cores > DISTURBED_SHARE,
        }
    }
}

/// Every process and kernel thread but this one, as `/proc/<pid>/stat` gives it.
fn procs() -> Vec<Proc> {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        if pid == me {
            return None;
        }
        parse_stat(
            pid,
            &std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?,
        )
    })
    .collect()
}

/// A process's `stat` line: its name, user and system time (fields 14, 15) and start time
/// (field 22).
fn parse_stat(pid: u32, s: &str) -> Option<Proc> {
    let (name, t) = proc_times(s)?;
    Some(Proc {
        pid,
        start: t.start,
        name: name.to_string(),
        ticks: t.user + t.system,
    })
}

/// The other processes using the cores now: each that took more than 2% of a core over
/// `window`, with its name and share, busiest first; and the VM's steal, in cores.
pub fn busy_others(window: Duration) -> (Vec<(String, f64)>, f64) {
    let Some(a) = Reading::now() else {
        return (Vec::new(), 0.0);
    };
    std::thread::sleep(window);
    let Some(b) = Reading::now() else {
        return (Vec::new(), 0.0);
    };
    let secs = b.at.duration_since(a.at).as_secs_f64().max(1e-3);
    let mut busy: Vec<(String, f64)> = b
        .procs
        .iter()
        .filter_map(|p| {
            let share = a.used_since(p)? as f64 / TICKS / secs;
            (share > 0.02).then(|| (format!("{} ({})", p.name, p.pid), share))
        })
        .collect();
    busy.sort_by(|x, y| y.1.total_cmp(&x.1));
    (busy, b.since(&a).steal_cores)
}

impl HostLoad {
    /// One line for a record's page.
    pub fn line(&self) -> String {
        format!(
            "Host: other processes took {:.1}% of a core and the VM's hypervisor (steal) \
             {:.1}% over the {:.0} s of this record: {}.",
            100.0 * self.others_cores,
            100.0 * self.steal_cores,
            self.seconds,
            if self.disturbed {
                format!(
                    "**disturbed** (more than {:.0}% of a core)",
                    100.0 * DISTURBED_SHARE
                )
            } else {
                "quiet".into()
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_running_before_the_record_shows_as_others_and_one_started_during_it_does_not() {
        // A shell spinning in its own loop (no child per turn) for `ms`.
        let spin = |ms: u32| {
            std::process::Command::new("timeout")
                .args([
                    &format!("{}", f64::from(ms) / 1000.0),
                    "sh",
                    "-c",
                    "while :; do :; done",
                ])
                .spawn()
                .expect("timeout")
        };
        // Already running as the record begins, and still as it ends: the host's load.
        let mut before_it = spin(1500);
        std::thread::sleep(Duration::from_millis(100));
        let before = Reading::now().expect("/proc");
        // Started during the record: the experiment's own helper.
        let mut helper = spin(300);
        let _ = helper.wait();
        std::thread::sleep(Duration::from_millis(200));
        let load = Reading::now().expect("/proc").since(&before);
        let _ = before_it.wait();
        assert!(load.others_cores > 0.2, "{load:?}");
        assert!(
            load.disturbed && load.line().contains("disturbed"),
            "{load:?}"
        );
    }

    #[test]
    fn only_processes_older_than_the_record_count_and_steal_apart() {
        let t0 = Instant::now();
        let p = |pid, start, ticks| Proc {
            pid,
            start,
            name: format!("p{pid}"),
            ticks,
        };
        let before = Reading {
            at: t0,
            steal: 10,
            procs: vec![p(1, 5, 100), p(2, 6, 40), p(3, 7, 0)],
        };
        // 10 s on: 1 took 200 ticks, 2 ended, 3's id was reused by a new process, 4 is
        // new (a helper the experiment started): only 1's count.
        let after = Reading {
            at: t0 + Duration::from_secs(10),
            steal: 60,
            procs: vec![p(1, 5, 300), p(3, 99, 500), p(4, 100, 900)],
        };
        let load = after.since(&before);
        assert!((load.others_cores - 0.2).abs() < 1e-9, "{load:?}");
        assert!((load.steal_cores - 0.05).abs() < 1e-9, "{load:?}");
        assert!(load.disturbed);
    }

    #[test]
    fn a_stat_line_is_read_past_a_name_with_spaces_and_parentheses() {
        let line = "42 (a (b) c) S 1 42 42 0 -1 4194304 100 0 0 0 7 5 0 0 20 0 1 0 777 0 0";
        let p = parse_stat(42, line).expect("parsed");
        assert_eq!((p.name.as_str(), p.ticks, p.start), ("a (b) c", 12, 777));
    }
}
