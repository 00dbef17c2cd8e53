//! The remote host of paper 002's block service, real: a network namespace behind a
//! TAP that becomes the far end of the machine's NIC cable (as `pvio up`'s outside
//! does), running Debian's servers on one backing file on tmpfs: `vblade` (ATA over
//! Ethernet, on the TAP's interface), `nbd-server` and `nbdkit` (NBD over TCP, on the
//! namespace's address). Nothing here is pvio's: these are the servers the remote
//! virtual block device and its NBD baseline are measured against.
//!
//! The servers are installed from Debian's packages if they are missing (as root); a
//! host that cannot install them says so. Everything started is stopped, and the
//! namespace removed, when the host is dropped.

use std::path::{Path, PathBuf};

use rig::tools::{self, ip, Tool};
use rig::Error;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The outside programs the remote host runs, installed through [`tools::ensure`] by
/// [`RemoteHost`]'s callers before the host starts.
pub const TOOLS: [Tool; 5] = [
    tools::IP,
    tools::VBLADE,
    tools::NBD_SERVER,
    tools::NBDKIT,
    tools::FIO,
];

/// The remote host's address on the cable, and its prefix.
pub const ADDR: &str = "10.78.0.1";
/// The vblade target's shelf.
pub const SHELF: u16 = 1;
/// The vblade target's slot.
pub const SLOT: u8 = 1;
/// The remote host's address on the veth pair to the host's own namespace (where the
/// floor's clients run, without any virtualization).
pub const VETH_ADDR: &str = "10.79.0.1";
/// The host's end of that pair.
pub const VETH_HOST_ADDR: &str = "10.79.0.2";
/// nbd-server's port.
pub const NBD_SERVER_PORT: u16 = 10809;
/// nbdkit's port.
pub const NBDKIT_PORT: u16 = 10810;

/// Installs the remote host's programs if they are missing.
pub fn ensure_tools() -> Result<(), Error> {
    tools::ensure(&TOOLS)
}

/// Which servers to start.
#[derive(Debug, Clone, Copy, Default)]
pub struct Servers {
    /// `vblade` on the cable's interface.
    pub vblade: bool,
    /// `nbd-server` on [`NBD_SERVER_PORT`].
    pub nbd_server: bool,
    /// `nbdkit` on [`NBDKIT_PORT`].
    pub nbdkit: bool,
}

/// A running remote host.
#[derive(Debug)]
pub struct RemoteHost {
    ns: String,
    /// The host's end of the veth pair, if made.
    veth: Option<String>,
    ifname: String,
    disk: PathBuf,
    children: Vec<(&'static str, Child)>,
}

impl RemoteHost {
    /// Makes namespace `pvio-rh<pid>`, with the cable's TAP interface `cable` (already
    /// open by the caller) in it at [`ADDR`] if given, and starts `servers` on `disk`.
    /// `vblade` needs the cable.
    pub fn start(cable: Option<&str>, disk: &Path, servers: Servers) -> Result<Self, Error> {
        let ns = format!("pvio-rh{}", std::process::id() % 100_000);
        let _ = ip(&["netns", "del", &ns]);
        ip(&["netns", "add", &ns])?;
        let mut h = Self {
            ns: ns.clone(),
            ifname: cable.unwrap_or_default().to_string(),
            disk: disk.to_path_buf(),
            children: Vec::new(),
            veth: None,
        };
        if let Some(ifname) = cable {
            ip(&["link", "set", "dev", ifname, "netns", &ns])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ADDR}/24"),
                "dev",
                ifname,
            ])?;
            ip(&["-n", &ns, "link", "set", "dev", ifname, "up"])?;
        }
        ip(&["-n", &ns, "link", "set", "dev", "lo", "up"])?;
        if servers.vblade {
            h.start_vblade()?;
        }
        if servers.nbd_server || servers.nbdkit {
            // The floor's clients reach the NBD servers from the host's namespace.
            let (a, b) = (format!("{ns}a"), format!("{ns}b"));
            let _ = ip(&["link", "del", &a]);
            ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
            h.veth = Some(a.clone());
            ip(&["link", "set", "dev", &b, "netns", &ns])?;
            ip(&["addr", "add", &format!("{VETH_HOST_ADDR}/24"), "dev", &a])?;
            ip(&["link", "set", "dev", &a, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{VETH_ADDR}/24"),
                "dev",
                &b,
            ])?;
            ip(&["-n", &ns, "link", "set", "dev", &b, "up"])?;
        }
        if servers.nbd_server {
            let conf = std::env::temp_dir().join(format!("pvio-nbd-{}.conf", std::process::id()));
            std::fs::write(
                &conf,
                format!(
                    "[generic]\nport = {NBD_SERVER_PORT}\nallowlist = true\n\n[disk]\nexportname = {}\n",
                    disk.display()
                ),
            )
            .map_err(|e| Error::other(format!("nbd-server config: {e}")))?;
            // It forks to serve each connection (with -d it would serve one and
            // exit); the parent returns, and the namespace's teardown ends the rest.
            let st = h
                .in_ns("nbd-server")
                .arg("-C")
                .arg(&conf)
                .status()
                .map_err(|e| Error::other(format!("nbd-server: {e}")))?;
            if !st.success() {
                return Err(Error::other(format!("nbd-server: {st}")));
            }
            wait_port(&ns, NBD_SERVER_PORT)?;
        }
        if servers.nbdkit {
            let c = h
                .in_ns("nbdkit")
                .args(["-f", "-p", &NBDKIT_PORT.to_string(), "file"])
                .arg(disk)
                .spawn()
                .map_err(|e| Error::other(format!("nbdkit: {e}")))?;
            h.children.push(("nbdkit", c));
            wait_port(&ns, NBDKIT_PORT)?;
        }
        Ok(h)
    }

    fn in_ns(&self, prog: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, prog])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    }

    /// Starts (or starts again) `vblade` exporting the disk as [`SHELF`].[`SLOT`].
    pub fn start_vblade(&mut self) -> Result<(), Error> {
        if self.ifname.is_empty() {
            return Err(Error::other("vblade needs the cable's interface"));
        }
        let c = self
            .in_ns("vblade")
            .args([&SHELF.to_string(), &SLOT.to_string(), &self.ifname])
            .arg(&self.disk)
            .spawn()
            .map_err(|e| Error::other(format!("vblade: {e}")))?;
        self.children.push(("vblade", c));
        Ok(())
    }

    /// Kills `vblade` (the fault test): frames sent meanwhile go unanswered.
    pub fn kill_vblade(&mut self) {
        self.children.retain_mut(|(name, c)| {
            if *name == "vblade" {
                let _ = c.kill();
                let _ = c.wait();
                false
            } else {
                true
            }
        });
    }

    /// The namespace's name (to run a client in it).
    pub fn namespace(&self) -> &str {
        &self.ns
    }
}

/// Waits until something listens on `port` in `ns` (a server's start), 5 s at most.
fn wait_port(ns: &str, port: u16) -> Result<(), Error> {
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "ss",
                "-Hltn",
                &format!("sport = :{port}"),
            ])
            .output()
            .map_err(|e| Error::other(format!("ss: {e}")))?;
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(Error::other(format!(
        "nothing listens on port {port} in {ns}"
    )))
}

impl Drop for RemoteHost {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Whatever else runs in the namespace (nbd-server's daemon and its children).
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.ns])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").arg(pid).status();
            }
        }
        if let Some(v) = &self.veth {
            let _ = ip(&["link", "del", v]);
        }
        let _ = ip(&["netns", "del", &self.ns]);
    }
}
