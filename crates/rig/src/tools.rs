//! The outside programs pvio's experiments and tests run, and the one way they are
//! installed: every program that is not pvio's own (ping, iperf3, tshark, sockperf,
//! vblade, nbd-server, nbdkit, fio, ethtool, DPDK's testpmd, iproute2's `ip`) is named
//! here with the Debian package that provides it, and [`ensure`] installs the missing
//! ones before their first use.
//!
//! A fresh Debian 12 machine has none of them (it lacks even `ping`), and a machine that
//! earlier sessions installed them on by hand hides the missing step; so no experiment or
//! test runs an outside program without calling [`ensure`] for it first (a test of this
//! crate reads the sources and holds them to that).
//!
//! Installing needs root and the package registry. Concurrent callers (nextest runs each
//! test in a process of its own) are serialised by dpkg's own lock, which `apt-get` is
//! told to wait for rather than fail on.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// An outside program and the Debian package that provides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tool {
    /// The program's name, as found on `PATH` (or in `/usr/sbin`, `/sbin`).
    pub program: &'static str,
    /// Debian's package that installs it.
    pub package: &'static str,
}

/// iproute2's `ip`: namespaces, TAPs, veths, addresses.
pub const IP: Tool = Tool {
    program: "ip",
    package: "iproute2",
};
/// `ping` (Debian's `iputils-ping`).
pub const PING: Tool = Tool {
    program: "ping",
    package: "iputils-ping",
};
/// iperf3, TCP and UDP throughput.
pub const IPERF3: Tool = Tool {
    program: "iperf3",
    package: "iperf3",
};
/// tshark, to read back the capture files pvio writes.
pub const TSHARK: Tool = Tool {
    program: "tshark",
    package: "tshark",
};
/// sockperf, TCP ping-pong latency.
pub const SOCKPERF: Tool = Tool {
    program: "sockperf",
    package: "sockperf",
};
/// ethtool, a veth pair's offloads.
pub const ETHTOOL: Tool = Tool {
    program: "ethtool",
    package: "ethtool",
};
/// vblade, an ATA-over-Ethernet target.
pub const VBLADE: Tool = Tool {
    program: "vblade",
    package: "vblade",
};
/// nbd-server, the reference NBD server.
pub const NBD_SERVER: Tool = Tool {
    program: "nbd-server",
    package: "nbd-server",
};
/// nbdkit, the other NBD server.
pub const NBDKIT: Tool = Tool {
    program: "nbdkit",
    package: "nbdkit",
};
/// fio, with its `nbd` engine (the floor's NBD client).
pub const FIO: Tool = Tool {
    program: "fio",
    package: "fio",
};
/// DPDK's testpmd, the data path's reference (`dpdk-dev` brings the virtio-user and
/// vhost-user drivers with it).
pub const TESTPMD: Tool = Tool {
    program: "dpdk-testpmd",
    package: "dpdk-dev",
};

/// Debian's Chromium, headless: the test that renders the report page in a real
/// browser.
pub const CHROMIUM: Tool = Tool {
    program: "chromium",
    package: "chromium",
};
/// Not a program: the TrueType font the charts' text is drawn with
/// ([`the lab's `chart::FONT_PATHS``]' first), found by its path.
pub const FONTS: Tool = Tool {
    program: "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    package: "fonts-dejavu-core",
};

/// Every outside program pvio runs (and the charts' font), for a look at what a
/// machine lacks.
pub const ALL: [Tool; 13] = [
    IP, PING, IPERF3, TSHARK, SOCKPERF, ETHTOOL, VBLADE, NBD_SERVER, NBDKIT, FIO, TESTPMD,
    CHROMIUM, FONTS,
];

/// Where `program` is, on `PATH` or in the system directories a non-login root shell may
/// leave out of it (a program named by its absolute path, a file: whether it is there).
pub fn which(program: &str) -> Option<PathBuf> {
    if program.starts_with('/') {
        let p = PathBuf::from(program);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(program))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether every one of `tools` is installed.
pub fn have(tools: &[Tool]) -> bool {
    tools.iter().all(|t| which(t.program).is_some())
}

/// Installs each of `tools` whose program is missing, from Debian's packages; an error
/// names what could not be had and why.
pub fn ensure(tools: &[Tool]) -> Result<(), crate::Error> {
    let missing = |tools: &[Tool]| -> Vec<&'static str> {
        let mut pkgs: Vec<&'static str> = tools
            .iter()
            .filter(|t| which(t.program).is_none())
            .map(|t| t.package)
            .collect();
        pkgs.dedup();
        pkgs
    };
    let pkgs = missing(tools);
    if pkgs.is_empty() {
        return Ok(());
    }
    if !apt(&["install", "-y", "-q", "--no-install-recommends"], &pkgs) {
        // A fresh machine's package lists may be empty or out of date.
        apt(&["update", "-q"], &[]);
        apt(&["install", "-y", "-q", "--no-install-recommends"], &pkgs);
    }
    let still = missing(tools);
    if still.is_empty() {
        Ok(())
    } else {
        Err(crate::Error::Tool(format!(
            "Debian packages {} are missing and could not be installed \
             (pvio installs them as root with the package registry reachable)",
            still.join(", ")
        )))
    }
}

/// Runs `ip ARGS` (the caller has [`ensure`]d [`IP`]): an error names the command and
/// what `ip` said.
pub fn ip(args: &[&str]) -> Result<(), crate::Error> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| crate::Error::other(format!("ip {}: {e}", args.join(" "))))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(crate::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Runs `apt-get ARGS PKGS` without questions, waiting for dpkg's lock held by another
/// installer instead of failing on it; whether it succeeded.
fn apt(args: &[&str], pkgs: &[&str]) -> bool {
    Command::new("apt-get")
        .args(["-o", "DPkg::Lock::Timeout=300"])
        .args(args)
        .args(pkgs)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shell_is_found_and_a_made_up_program_is_not() {
        assert!(which("sh").is_some());
        assert!(which("pvio-no-such-program").is_none());
        assert!(have(&[]));
    }

    /// No source file of the workspace installs a package or runs an outside program
    /// by a path of its own: `apt-get` appears only here, and every file that spawns
    /// one of [`ALL`] calls [`ensure`] (through this module) too.
    #[test]
    fn every_outside_program_is_installed_through_this_module() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files = Vec::new();
        collect_rs(&root.join("crates"), &mut files);
        assert!(files.len() > 50, "the workspace's sources were found");
        let here = Path::new(file!()).file_name().expect("name");
        let mut offenders = Vec::new();
        for f in &files {
            let text = std::fs::read_to_string(f).expect("source");
            if f.file_name() == Some(here) && f.to_string_lossy().contains("rig/src") {
                continue;
            }
            if text.contains("Command::new(\"apt-get\")") {
                offenders.push(format!("{}: runs apt-get itself", f.display()));
            }
            // A file named by its path (the font) is read, not run.
            for t in ALL
                .iter()
                .filter(|t| t.program != "ip" && !t.program.starts_with('/'))
            {
                let spawns = text.contains(&format!("\"{}\",", t.program))
                    || text.contains(&format!("Command::new(\"{}\")", t.program));
                let ensures = text.contains("tools::ensure") || text.contains("ensure_tools()");
                if spawns && !ensures {
                    offenders.push(format!("{}: runs {} unensured", f.display(), t.program));
                }
            }
        }
        assert!(offenders.is_empty(), "{offenders:#?}");
    }

    fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() && !p.ends_with("target") {
                collect_rs(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
}
