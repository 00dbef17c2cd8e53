//! The DPDK reference, measured on this machine in the same run: two `dpdk-testpmd`
//! processes, vhost-user (the host's back end, core 0) and virtio-user (the guest's
//! front end, core 1), one forwarding core each, one sending (`txonly`) and the other
//! receiving (`rxonly`). The rate is the receiver's `Rx-pps`.
//!
//! Needs root (hugepages) and Debian's `dpdk-dev` package, which is installed if
//! missing; where either fails, the caller falls back to the figures and says so.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rig::tools;
use rig::Error;

/// 2 MiB hugepages each testpmd process takes (`-m 512`).
const MEM_MB: u32 = 512;
const HUGEPAGE_DIR: &str = "/dev/hugepages";

/// A usable `dpdk-testpmd`.
#[derive(Debug, Clone)]
pub struct TestPmd {
    bin: PathBuf,
}

fn meminfo(key: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().split(' ').next()?.parse().ok())
}

/// Makes sure `pages` free 2 MiB hugepages exist and hugetlbfs is mounted.
fn hugepages(pages: u64) -> Result<(), Error> {
    let free = meminfo("HugePages_Free:").unwrap_or(0);
    if free < pages {
        let total = meminfo("HugePages_Total:").unwrap_or(0);
        std::fs::write(
            "/proc/sys/vm/nr_hugepages",
            (total + pages - free).to_string(),
        )
        .map_err(|e| Error::other(format!("reserving hugepages: {e}")))?;
        if meminfo("HugePages_Free:").unwrap_or(0) < pages {
            return Err(Error::other(
                "the kernel would not reserve enough hugepages",
            ));
        }
    }
    let mounted = std::fs::read_to_string("/proc/mounts")
        .map(|m| m.lines().any(|l| l.contains(" hugetlbfs ")))
        .unwrap_or(false);
    if !mounted {
        std::fs::create_dir_all(HUGEPAGE_DIR).map_err(Error::other)?;
        let ok = Command::new("mount")
            .args(["-t", "hugetlbfs", "none", HUGEPAGE_DIR])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(Error::other("cannot mount hugetlbfs"));
        }
    }
    Ok(())
}

/// The median of the `Rx-pps:` lines of testpmd's periodic statistics, leaving out the
/// first (it covers the start).
fn rx_pps(out: &str) -> Option<f64> {
    let mut v: Vec<f64> = out
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("Rx-pps:")?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .skip(1)
        .filter(|&x: &f64| x > 0.0)
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

impl TestPmd {
    /// Finds `dpdk-testpmd` (installing `dpdk-dev` if it is missing) and reserves the
    /// hugepages both processes need.
    pub fn prepare() -> Result<Self, Error> {
        tools::ensure(&[tools::TESTPMD])?;
        let bin = tools::which(tools::TESTPMD.program)
            .ok_or_else(|| Error::other("dpdk-testpmd not found"))?;
        // Two processes of MEM_MB each, in 2 MiB pages, and a little slack.
        hugepages(2 * u64::from(MEM_MB / 2) + 16)?;
        Ok(Self { bin })
    }

    fn testpmd(&self, core: usize, prefix: &str, vdev: &str, args: &[&str], secs: u64) -> Command {
        let mut c = Command::new("timeout");
        c.args(["-s", "INT", &secs.to_string()])
            .arg(&self.bin)
            .arg("--lcores")
            .arg(format!("0@{core},1@{core}"))
            .args([
                "--file-prefix",
                prefix,
                "-m",
                &MEM_MB.to_string(),
                "--no-pci",
            ])
            .args(["--single-file-segments", "--vdev", vdev, "--"])
            .args(["--nb-cores=1", "--stats-period", "1"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        c
    }

    /// Packets per second received by the guest (`guest_rx`) or by the host, for
    /// `frame`-byte frames, over about `secs` seconds.
    pub fn rate(&self, guest_rx: bool, frame: usize, secs: u64) -> Result<f64, Error> {
        let sock = std::env::temp_dir().join(format!("pvio-vhost-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&sock);
        let txpkts = format!("--txpkts={frame}");
        let (host_mode, guest_mode) = if guest_rx {
            (
                vec!["--forward-mode=txonly", txpkts.as_str()],
                vec!["--forward-mode=rxonly"],
            )
        } else {
            (
                vec!["--forward-mode=rxonly"],
                vec!["--forward-mode=txonly", txpkts.as_str()],
            )
        };
        // The vhost-user side is the socket's server: it starts first and outlives the
        // guest's side.
        let host = self
            .testpmd(
                0,
                "pvio-vhost",
                &format!("net_vhost0,iface={},queues=1", sock.display()),
                &host_mode,
                secs + 6,
            )
            .spawn()
            .map_err(|e| Error::other(format!("testpmd: {e}")))?;
        let t0 = Instant::now();
        while !sock.exists() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let guest = self
            .testpmd(
                1,
                "pvio-virtio",
                &format!("net_virtio_user0,path={},queues=1", sock.display()),
                &guest_mode,
                // About a second and a half goes to starting up.
                secs + 2,
            )
            .output()
            .map_err(|e| Error::other(format!("testpmd: {e}")))?;
        let host = host.wait_with_output().map_err(Error::other)?;
        let _ = std::fs::remove_file(&sock);
        let receiver = if guest_rx {
            &guest.stdout
        } else {
            &host.stdout
        };
        rx_pps(&String::from_utf8_lossy(receiver))
            .ok_or_else(|| Error::other("testpmd reported no received packets"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_receivers_rate_is_the_median_after_the_first_period() {
        let out = "  Rx-pps:      1000    Rx-bps: 1\n  Tx-pps: 5\n  Rx-pps:  17000000  Rx-bps: 2\n\
                   Rx-pps: 16000000 Rx-bps: 3\n Rx-pps: 18000000 Rx-bps: 4\n";
        assert_eq!(rx_pps(out), Some(17_000_000.0));
        assert_eq!(rx_pps("nothing"), None);
    }
}
