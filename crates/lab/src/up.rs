//! `pvio up`: a running `pv` machine on real interfaces, for real traffic.
//!
//! Two network namespaces are made: the *outside*, holding the TAP that is the far end
//! of the NIC model's cable, and the *guest*, holding the TAP that netfront's frames
//! are handed to, so that the guest's network stack is that namespace's Linux stack.
//! Anything run in the outside namespace (`ping`, `iperf3 -c`) reaches what runs in the
//! guest namespace (`iperf3 -s`) through NIC model → driver → bridge → netback →
//! netfront, and the replies come back the other way.

use net::netfront::RxBuffers;
use std::process::Command;
use std::sync::atomic::Ordering;

use crate::platform::{flow, Config, Options, Plumbing, Running};
use crate::LabError;

/// Where and how to bring the machine up.
#[derive(Debug, Clone)]
pub struct UpConfig {
    /// The outside namespace (made if missing, removed at the end if made here).
    pub outside_ns: String,
    /// The guest's namespace.
    pub guest_ns: String,
    /// The outside interface's address, with its prefix length.
    pub outside_addr: String,
    /// The guest's address, with its prefix length.
    pub guest_addr: String,
    /// The bridge's netfilter hooks.
    pub netfilter: bool,
    /// What netfront posts: page fragments (the original) or linear buffers (no
    /// fragments; frames up to 1518 bytes).
    pub rx_buffers: RxBuffers,
    /// Grant reuse (paper 000 §4.4): netfront binds its pages to references, netback
    /// reaches them through its cache of mappings, no map or unmap per packet.
    pub grant_reuse: bool,
    /// A NIC receive queue for the guest, the NIC writing its frames straight into
    /// netfront's buffers (paper 000 §4.3).
    pub multi_queue: bool,
    /// Capture every frame into pcap files in this directory: `wire.pcap` (the NIC's
    /// cable, both ways) and `<vif>.pcap` (the guest's frames, both ways, named as the
    /// live counters name the vif).
    pub pcap: Option<std::path::PathBuf>,
    /// The NIC's interrupt coalescing.
    pub coalesce: dev::nic::Coalesce,
    /// The hypervisor's grant implementation.
    pub grant_path: hv::GrantPath,
    /// Every domain's grant-table layout.
    pub grant_version: hv::GrantVersion,
    /// Checksum offload and GSO on the whole path: both TAPs opened with a virtio-net
    /// header and TCP/IPv4 segmentation taken, netfront offering `feature-gso-tcpv4`
    /// and blank checksums, so that a large TCP segment crosses as one packet.
    pub offloads: bool,
}

impl Default for UpConfig {
    fn default() -> Self {
        Self {
            outside_ns: "pvio-outside".into(),
            guest_ns: "pvio-guest".into(),
            outside_addr: "10.77.0.1/24".into(),
            guest_addr: "10.77.0.2/24".into(),
            netfilter: true,
            rx_buffers: RxBuffers::Fragments,
            grant_reuse: false,
            multi_queue: false,
            pcap: None,
            coalesce: pv().coalesce,
            grant_path: pv().grant_path,
            grant_version: pv().grant_version,
            offloads: true,
        }
    }
}

/// The `pv` machine of paper 000 that `pvio up` runs unless told otherwise.
fn pv() -> Options {
    Options::paper(Config::Pv, 52)
}

/// A machine that is up; brought down (and its namespaces removed) when dropped.
#[derive(Debug)]
pub struct Up {
    running: Option<Running>,
    /// The capture files, written until the machine is down.
    captures: Vec<(std::path::PathBuf, dev::capture::CaptureFile)>,
    made: Vec<String>,
    wire: std::sync::Arc<dev::tap::TapCounters>,
    guest: std::sync::Arc<dev::tap::TapCounters>,
}

/// What has crossed the machine so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpCounters {
    /// Frames from the outside into the NIC.
    pub wire_in: u64,
    /// Frames from the NIC to the outside.
    pub wire_out: u64,
    /// Frames handed to the guest's stack.
    pub guest_in: u64,
    /// Bytes of those frames (with offloads, a frame may be a 64 KiB TCP segment).
    pub guest_in_bytes: u64,
    /// Frames the guest's stack sent.
    pub guest_out: u64,
    /// Frames either side dropped as too long for a 1500-byte MTU.
    pub oversize: u64,
}

fn ip(args: &[&str]) -> Result<(), LabError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| LabError::Other(format!("ip {}: {e}", args.join(" "))))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(LabError::Other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

fn netns_exists(name: &str) -> bool {
    std::path::Path::new("/run/netns").join(name).exists()
}

/// Makes the namespaces and interfaces and starts the machine.
pub fn up(cfg: &UpConfig) -> Result<Up, LabError> {
    let mut made = Vec::new();
    let mut captures = Vec::new();
    let (running, wire, guest) = match bring_up(cfg, &mut made, &mut captures) {
        Ok(b) => b,
        Err(e) => {
            drop(captures);
            for ns in &made {
                let _ = ip(&["netns", "del", ns]);
            }
            return Err(e);
        }
    };
    let mut up = Up {
        running: Some(running),
        captures,
        made,
        wire,
        guest,
    };
    up.name_captures()?;
    Ok(up)
}

type Brought = (
    Running,
    std::sync::Arc<dev::tap::TapCounters>,
    std::sync::Arc<dev::tap::TapCounters>,
);

/// The capture file of the guest's frames, until the vif's name is known.
const VIF_PCAP: &str = "vif.pcap";

/// Opens `dir/name` for capture.
fn capture_file(
    dir: &std::path::Path,
    name: &str,
) -> Result<(std::path::PathBuf, dev::capture::CaptureFile), LabError> {
    let path = dir.join(name);
    let f = dev::capture::CaptureFile::create(&path)
        .map_err(|e| LabError::Other(format!("capture {}: {e}", path.display())))?;
    Ok((path, f))
}

fn bring_up(
    cfg: &UpConfig,
    made: &mut Vec<String>,
    captures: &mut Vec<(std::path::PathBuf, dev::capture::CaptureFile)>,
) -> Result<Brought, LabError> {
    for ns in [&cfg.outside_ns, &cfg.guest_ns] {
        if !netns_exists(ns) {
            ip(&["netns", "add", ns])?;
            made.push(ns.clone());
        }
    }
    let pid = std::process::id() % 100_000;
    // The guest's front end takes large segments only on the page-fragment path.
    let offloads = cfg.offloads && cfg.rx_buffers == RxBuffers::Fragments;
    let taps = if offloads {
        mem::tap::TapOffload::CsumTso
    } else {
        mem::tap::TapOffload::None
    };
    let (wire_file, wire_if) = mem::tap::open_tap_offload(&format!("pvw{pid}"), taps)
        .map_err(|e| LabError::Other(format!("tap: {e}")))?;
    let (guest_file, guest_if) = mem::tap::open_tap_offload(&format!("pvg{pid}"), taps)
        .map_err(|e| LabError::Other(format!("tap: {e}")))?;
    let mac = flow().dst_mac;
    let mac = format!(
        "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        mac[0], mac[1], mac[2], mac[3], mac[4], mac[5]
    );
    for (ifname, ns, addr, lladdr) in [
        (&wire_if, &cfg.outside_ns, &cfg.outside_addr, None),
        (
            &guest_if,
            &cfg.guest_ns,
            &cfg.guest_addr,
            Some(mac.as_str()),
        ),
    ] {
        ip(&["link", "set", "dev", ifname, "netns", ns])?;
        if let Some(a) = lladdr {
            ip(&["-n", ns, "link", "set", "dev", ifname, "address", a])?;
        }
        ip(&["-n", ns, "addr", "add", addr, "dev", ifname])?;
        ip(&["-n", ns, "link", "set", "dev", ifname, "up"])?;
        ip(&["-n", ns, "link", "set", "dev", "lo", "up"])?;
    }
    let mut wire = dev::tap::TapPort::start_with(wire_file, taps)
        .map_err(|e| LabError::Other(e.to_string()))?;
    let mut guest = dev::tap::TapPort::start_with(guest_file, taps)
        .map_err(|e| LabError::Other(e.to_string()))?;
    if let Some(dir) = &cfg.pcap {
        std::fs::create_dir_all(dir)
            .map_err(|e| LabError::Other(format!("capture directory {}: {e}", dir.display())))?;
        let w = capture_file(dir, "wire.pcap")?;
        wire.capture(&w.1);
        let g = capture_file(dir, VIF_PCAP)?;
        guest.capture(&g.1);
        captures.extend([w, g]);
    }
    let (wc, gc) = (
        std::sync::Arc::clone(wire.counters()),
        std::sync::Arc::clone(guest.counters()),
    );
    let opts = Options {
        netfilter: cfg.netfilter,
        rx_buffers: cfg.rx_buffers,
        // Never the unsafe stand-in here: only a grant per I/O or the safe cache.
        grants: if cfg.grant_reuse {
            net::netfront::Grants::Reuse
        } else {
            net::netfront::Grants::PerIo
        },
        queues: cfg.multi_queue,
        sample: None,
        coalesce: cfg.coalesce,
        grant_path: cfg.grant_path,
        grant_version: cfg.grant_version,
        offloads,
        ..pv()
    };
    let running = Running::start_with(opts, Some(Plumbing { wire, guest }))?;
    Ok((running, wc, gc))
}

impl Up {
    /// Traffic so far.
    pub fn counters(&self) -> UpCounters {
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        UpCounters {
            wire_in: l(&self.wire.frames_in),
            wire_out: l(&self.wire.frames_out),
            guest_in: l(&self.guest.frames_out),
            guest_in_bytes: l(&self.guest.bytes_out),
            guest_out: l(&self.guest.frames_in),
            oversize: l(&self.wire.oversize_in) + l(&self.guest.oversize_in),
        }
    }

    /// Renames the guest's capture after its vif, once the machine runs.
    fn name_captures(&mut self) -> Result<(), LabError> {
        let Some(vif) = self.live_sample().and_then(|s| {
            s.counters
                .entries
                .iter()
                .find(|(c, _, _)| c.starts_with("vif") && !c.contains(' '))
                .map(|(c, _, _)| c.clone())
        }) else {
            return Ok(());
        };
        for (path, _) in &mut self.captures {
            if path.file_name().is_some_and(|n| n == VIF_PCAP) {
                let named = path.with_file_name(format!("{vif}.pcap"));
                std::fs::rename(&*path, &named)
                    .map_err(|e| LabError::Other(format!("capture {}: {e}", named.display())))?;
                *path = named;
            }
        }
        Ok(())
    }

    /// The capture files (written until the machine is down).
    pub fn capture_paths(&self) -> Vec<std::path::PathBuf> {
        self.captures.iter().map(|(p, _)| p.clone()).collect()
    }

    /// Each capture file's counters (they outlive the machine).
    pub fn capture_counters(
        &self,
    ) -> Vec<(
        std::path::PathBuf,
        std::sync::Arc<dev::capture::CaptureCounters>,
    )> {
        self.captures
            .iter()
            .map(|(p, f)| (p.clone(), std::sync::Arc::clone(f.counters())))
            .collect()
    }

    /// Every component's counters as they stand, the outside TAP's (`wire tap`)
    /// with them, stamped: two of them give [`crate::live::rates`].
    pub fn live_sample(&self) -> Option<crate::live::Sample> {
        let mut s = self.running.as_ref()?.live_sample();
        s.counters.add_set("wire tap", &*self.wire);
        Some(s)
    }

    /// The running machine.
    pub fn machine(&self) -> Option<&Running> {
        self.running.as_ref()
    }

    /// Arms a fault in the driver domain (a panic or a hang at its next poll).
    pub fn inject_fault(&self, f: crate::platform::Fault) {
        if let Some(r) = &self.running {
            r.inject_fault(f);
        }
    }

    /// The toolstack's watchdog, run periodically: restarts a driver domain that
    /// crashed or stalled for `stall`; the guest's netfront reconnects to the new one.
    pub fn watchdog(
        &mut self,
        stall: std::time::Duration,
    ) -> Result<Option<crate::platform::Restarted>, LabError> {
        match &mut self.running {
            Some(r) => r.watchdog(stall),
            None => Ok(None),
        }
    }

    /// Stops the machine and removes the namespaces made for it.
    pub fn down(mut self) {
        self.stop();
    }

    /// Brings the machine down and returns every component's counters.
    pub fn down_with_counters(mut self) -> Result<kernel::Counters, LabError> {
        let f = match self.running.take() {
            Some(r) => r.finish(std::time::Duration::ZERO).map(|f| f.counters),
            None => Ok(kernel::Counters::default()),
        };
        self.stop();
        f
    }

    fn stop(&mut self) {
        drop(self.running.take());
        // The machine's ports are gone with it: the files get their last frames.
        self.captures.clear();
        for ns in self.made.drain(..) {
            let _ = ip(&["netns", "del", &ns]);
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.stop();
    }
}
