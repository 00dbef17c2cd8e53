//! The host's interference with a record: how much of the cores others took while it
//! ran. pvio's pCPUs own their cores only as far as the host lets them; a record taken
//! beside a busy process, or in a VM whose hypervisor took its CPUs away, measures that
//! too, and says so.
//!
//! Two readings bracket an experiment: the cores' times from `/proc/stat` (busy, and
//! *steal*, the time the VM's own hypervisor ran something else) and this process's
//! CPU time from `/proc/self/stat`. What the cores were busy with beyond this process
//! is the other processes' (and the kernel's for them); steal is the hypervisor's. A
//! record whose others and steal together took more than [`DISTURBED_SHARE`] of a core
//! is marked disturbed on its page.

use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// The share of one core, averaged over a record, that others may take before the
/// record is marked disturbed.
pub const DISTURBED_SHARE: f64 = 0.10;

/// One reading: the cores' summed times and this process's CPU time, in clock ticks
/// (`USER_HZ`), and when.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    at: Instant,
    busy: u64,
    steal: u64,
    own: u64,
}

/// The host's interference over a record.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HostLoad {
    /// The record's wall time, s.
    pub seconds: f64,
    /// Other processes' CPU on the machine's cores, in cores (1.0: one core's worth).
    pub others_cores: f64,
    /// The VM's steal time, in cores.
    pub steal_cores: f64,
    /// Whether others and steal together passed [`DISTURBED_SHARE`] of a core.
    pub disturbed: bool,
}

/// Clock ticks a second of `/proc`'s times (`USER_HZ`, 100 on Linux).
const TICKS: f64 = 100.0;

impl Reading {
    /// Reads the host now (`None` where `/proc` does not say).
    pub fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
        let f: Vec<u64> = cpu
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal ...
        let at = |i: usize| f.get(i).copied().unwrap_or(0);
        let busy = at(0) + at(1) + at(2) + at(5) + at(6);
        Some(Self {
            at: Instant::now(),
            busy,
            steal: at(7),
            own: own_ticks()?,
        })
    }

    /// The interference from `before` to this reading.
    pub fn since(&self, before: &Reading) -> HostLoad {
        let seconds = self.at.duration_since(before.at).as_secs_f64().max(1e-3);
        let cores = |ticks: u64| ticks as f64 / TICKS / seconds;
        let busy = self.busy.saturating_sub(before.busy);
        let own = self.own.saturating_sub(before.own);
        let others_cores = cores(busy.saturating_sub(own));
        let steal_cores = cores(self.steal.saturating_sub(before.steal));
        HostLoad {
            seconds,
            others_cores,
            steal_cores,
            disturbed: others_cores + steal_cores > DISTURBED_SHARE,
        }
    }
}

/// This process's user and system time, clock ticks (`/proc/self/stat` fields 14, 15).
fn own_ticks() -> Option<u64> {
    ticks_of("/proc/self/stat")
}

fn ticks_of(path: &str) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    // The command name may hold spaces: fields count from after its closing paren.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// The other processes using the cores now: each that took more than 2% of a core over
/// `window`, with its name and share, busiest first; and the whole machine's steal.
pub fn busy_others(window: Duration) -> (Vec<(String, f64)>, f64) {
    let me = std::process::id();
    let sample = || -> Vec<(u32, String, u64)> {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            if pid == me {
                return None;
            }
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let name = stat.split_once('(')?.1.rsplit_once(')')?.0.to_string();
            Some((pid, name, ticks_of(&format!("/proc/{pid}/stat"))?))
        })
        .collect()
    };
    let (a, ra) = (sample(), Reading::now());
    std::thread::sleep(window);
    let (b, rb) = (sample(), Reading::now());
    let secs = window.as_secs_f64().max(1e-3);
    let mut busy: Vec<(String, f64)> = b
        .iter()
        .filter_map(|(pid, name, t)| {
            let was = a.iter().find(|x| x.0 == *pid)?.2;
            let share = t.saturating_sub(was) as f64 / TICKS / secs;
            (share > 0.02).then(|| (format!("{name} ({pid})"), share))
        })
        .collect();
    busy.sort_by(|x, y| y.1.total_cmp(&x.1));
    let steal = match (ra, rb) {
        (Some(a), Some(b)) => b.since(&a).steal_cores,
        _ => 0.0,
    };
    (busy, steal)
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
    fn a_process_spinning_beside_the_reader_shows_as_others_and_disturbs_the_record() {
        let before = Reading::now().expect("/proc");
        // A child process spinning for 400 ms: others' CPU, not this process's.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "end=$(( $(date +%s%N) + 400000000 )); while [ $(date +%s%N) -lt $end ]; do :; done"])
            .spawn()
            .expect("sh");
        let _ = child.wait();
        let load = Reading::now().expect("/proc").since(&before);
        assert!(load.others_cores > 0.2, "{load:?}");
        assert!(load.disturbed, "{load:?}");
        assert!(load.line().contains("disturbed"));
    }

    #[test]
    fn this_processs_own_time_is_not_others_and_steal_is_counted_apart() {
        let t0 = Instant::now();
        let at = |busy, steal, own, s: u64| Reading {
            at: t0 + Duration::from_secs(s),
            busy,
            steal,
            own,
        };
        // 10 s: the cores busy 1500 ticks, 1200 of them this process's; steal 50.
        let load = at(2500, 60, 1300, 10).since(&at(1000, 10, 100, 0));
        assert!((load.others_cores - 0.3).abs() < 1e-9, "{load:?}");
        assert!((load.steal_cores - 0.05).abs() < 1e-9, "{load:?}");
        assert!(load.disturbed);
        let quiet = at(2300, 10, 1300, 10).since(&at(1000, 10, 100, 0));
        assert!(
            (quiet.others_cores - 0.1).abs() < 1e-9 && !quiet.disturbed,
            "{quiet:?}"
        );
    }
}
