//! `pvio up`: a running `pv` machine on real interfaces, for real traffic.
//!
//! Network namespaces are made: the *outside*, holding the TAP that is the far end of
//! the NIC model's cable, and one per guest, holding the TAP that the guest's netfront
//! frames are handed to, so that the guest's network stack is that namespace's Linux
//! stack. Anything run in the outside namespace (`ping`, `iperf3 -c`) reaches what runs
//! in a guest's namespace (`iperf3 -s`) through NIC model → driver → bridge → netback
//! → netfront, and the replies come back the other way; two guests reach each other
//! through the bridge, netback to netback.
//!
//! Each namespace is claimed for the run by a lock file in [`CLAIM_DIR`]: a second
//! `pvio up` naming one of them is refused while the first runs, and a namespace that a
//! run made and could not remove (it was killed) is found by the next one through its
//! file, removed and made afresh rather than reused half-configured. At the end the
//! namespaces made (and with them their TAPs and addresses) are removed, unless
//! [`Up::keep_namespaces`] was asked for.

pub mod machine_file;

/// A guest's netfront, and what it posts and how it grants, as its `front` names them.
pub use net::netfront::{FrontConfig, Grants, RxBuffers};
use std::process::Command;
use std::sync::atomic::Ordering;

use std::sync::Arc;

pub use kernel::driver_domain::DriverConfig;
use kernel::machine::{Above, GuestSpec};

/// How frames cross the TAPs (`UpConfig::edge_io`).
pub use dev::tap::EdgeIo;
pub use hv::iommu::DmaLanding;
use rig::tools::ip;
use rig::udp::{flow, Config, Options, Plumbing, Running};
use rig::Error;

/// Where and how to bring the machine up.
#[derive(Debug, Clone)]
pub struct UpConfig {
    /// The outside namespace (made if missing, removed at the end if made here).
    pub outside_ns: String,
    /// The outside interface's address, with its prefix length.
    pub outside_addr: String,
    /// The guests, each on a TAP in its own namespace (at least one).
    pub guests: Vec<UpGuest>,
    /// The driver domain's switches: the bridge's netfilter hooks, a NIC receive queue
    /// for each guest with the NIC writing its frames straight into netfront's buffers
    /// (paper 000 §4.3, `queues`), and Large Receive Offload on the NIC port (paper 001,
    /// with the bridge handing aggregates on whole; the cable then takes no large
    /// segments: the outside's TCP puts MTU-sized frames with complete checksums on it,
    /// as a real wire carries them, and the driver domain's LRO aggregates them for the
    /// guest).
    pub driver: DriverConfig,
    /// Capture every frame into pcap files in this directory: `wire.pcap` (the NIC's
    /// cable, both ways) and `<vif>.pcap` (each guest's frames, both ways, named as the
    /// live counters name its vif).
    pub pcap: Option<std::path::PathBuf>,
    /// The NIC's interrupt coalescing.
    pub coalesce: dev::nic::Coalesce,
    /// The hypervisor's grant implementation.
    pub grant_path: hv::GrantPath,
    /// Every domain's grant-table layout.
    pub grant_version: hv::GrantVersion,
    /// The cable carries MTU-sized frames only, as a real wire does: the outside's
    /// kernel segments its TCP before the cable's TAP (always so with LRO; without it,
    /// the path LRO is measured against). Otherwise the cable takes large segments.
    pub mtu_wire: bool,
    /// The self-virtualized NIC (paper 002) instead of the driver domain: the guests'
    /// VIF drivers reach their queues in the device directly. Frames are then at most
    /// an MTU everywhere (no offloads, the cable's frames MTU-sized).
    pub svnic: Option<dev::svnic::device::SvnicConfig>,
    /// Guests with a virtual disk and no network: each runs a block job on it.
    pub disks: Vec<UpDisk>,
    /// The host cores the machine owns (its CPU pool), its layout's cores taken from
    /// them in turn; none: every online core.
    pub cpus: Option<kernel::machine::CpuSet>,
    /// The NIC's cable on this existing interface of the host (a physical NIC, one end
    /// of a veth pair, in `pvio up`'s own namespace) through a packet socket with
    /// mapped rings, in place of a TAP in the outside namespace, which is then neither
    /// made nor used. It carries MTU-sized frames, as a wire does; pvio turns the
    /// interface's GRO and LRO off, since it takes nothing larger.
    pub cable: Option<String>,
    /// Where the NIC's DMA writes land. `pvio up` runs on a present-day host, whose
    /// processor puts a NIC's writes in its last-level cache (Data Direct I/O, since
    /// 2012): `Cache` by default. `Memory` is the papers' 2008 platform.
    pub dma_landing: hv::iommu::DmaLanding,
    /// How frames cross the TAPs: in batches through an io_uring (falling back to one
    /// frame a call where the kernel cannot), or one `read` or `write` a frame. Where the
    /// NIC's engine shares a guest's core the cable's TAP is never tied to one thread
    /// ([`wire_io`]).
    pub edge_io: dev::tap::EdgeIo,
    /// How the machine's idle pCPUs wait. Outside processes (iperf3, sockperf, the TAPs'
    /// far ends) share the cores, so never `poll`; by default KVM's adaptive
    /// halt-polling, whose window grows while wake-ups come soon after a pCPU idles and
    /// shrinks when they do not. On the 2-core VM, sockperf's p99 round trip over 4 s
    /// runs alternating the two: a median of 164 µs (8 runs, 113–258) against a fixed
    /// 200 µs window's 270 (5 runs, 131–286); medians of the round trip and TCP's rates
    /// unchanged within the noise.
    pub idle: hv::sched::IdlePolicy,
}

/// A guest whose one device is a virtual disk, and the job it runs on it until the
/// machine goes down.
#[derive(Debug, Clone)]
pub struct UpDisk {
    /// Its domain's name.
    pub name: String,
    /// What stands behind the disk: a backing file (served by the driver domain's
    /// blkback), or an AoE target on the cable (a remote disk, served by the driver
    /// domain or, on an SV-NIC machine, by the device's block service).
    pub disk: kernel::machine::Disk,
    /// The device is read-only.
    pub read_only: bool,
    /// Persistent grants on both ends.
    pub persistent: bool,
    /// Reads or writes.
    pub op: kernel::block::JobOp,
    /// Sequential, or random.
    pub random: bool,
    /// Bytes per request.
    pub bytes: u32,
    /// Requests in flight.
    pub depth: usize,
    /// Its vCPU's core.
    pub core: Option<usize>,
}

impl UpDisk {
    /// A line for people: the guest, its disk and its job.
    pub fn describe(&self) -> String {
        let what = match &self.disk {
            kernel::machine::Disk::File(p) => format!("backing file {}", p.display()),
            kernel::machine::Disk::Aoe { major, minor } => {
                format!("AoE target e{major}.{minor} on the cable")
            }
        };
        format!(
            "{} with a virtual disk on {what}: {} {} {} B, {} in flight",
            self.name,
            if self.random { "random" } else { "sequential" },
            if self.op == kernel::block::JobOp::Write {
                "writes"
            } else {
                "reads"
            },
            self.bytes,
            self.depth
        )
    }

    /// The guest's spec: the disk and a job over all of it that runs until the machine
    /// stops (reads not checked: a user's file holds what it holds; writes fill with
    /// the pattern of `blk::disk::pattern_fill`).
    pub fn guest(&self, sectors: u64) -> GuestSpec {
        use kernel::block::{BlockJobSpec, JobCounters, Pattern};
        let job = BlockJobSpec {
            op: self.op,
            pattern: if self.random {
                Pattern::Random(0x5eed)
            } else {
                Pattern::Sequential
            },
            bytes: self.bytes,
            depth: self.depth,
            span: (0, sectors),
            limit: None,
            expect: blk::disk::pattern_fill,
            verify: false,
            fill: blk::disk::pattern_fill,
            latencies: Arc::new(dev::wire::Samples::new(0)),
            counters: Arc::new(JobCounters::default()),
        };
        GuestSpec {
            weight: 1,
            name: self.name.clone(),
            mac: [0x02, 0, 0, 0, 0xd1, 0],
            front: FrontConfig::default(),
            above: Above::Block(Box::new(kernel::machine::BlockSpec {
                disk: self.disk.clone(),
                read_only: self.read_only,
                persistent: self.persistent,
                job,
            })),
            core: self.core,
        }
    }
}

/// When `pvio up`'s LRO flushes (the driver domain's NIC driver; paper 001).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LroMode {
    /// No LRO: every frame goes up as it came.
    Off,
    /// The paper's LRO: aggregates flushed at the end of every poll.
    EveryPoll,
    /// The paper's delayed aggregation: flushed every `n`th poll, each held at most
    /// 1 ms.
    Delayed(u32),
    /// Held while the flow's next segment is due within the latency budget, flushed
    /// at once for a pushed or request/response flow.
    Adaptive,
}

impl LroMode {
    /// The driver's LRO set-up (skb-mode, Linux's 32 flows), none when off.
    pub fn setup(self) -> Option<dev::lro::LroSetup> {
        let flushing = match self {
            LroMode::Off => return None,
            LroMode::EveryPoll => dev::lro::Flushing::EveryPoll,
            LroMode::Delayed(n) => dev::lro::LroSetup::delayed(n.max(1)),
            LroMode::Adaptive => dev::lro::LroSetup::ADAPTIVE,
        };
        Some(dev::lro::LroSetup {
            flushing,
            ..dev::lro::LroSetup::PAPER
        })
    }

    /// Its name in reports.
    pub fn name(self) -> String {
        match self {
            LroMode::Off => "off".into(),
            LroMode::EveryPoll => "every poll".into(),
            LroMode::Delayed(n) => format!("every {n} polls (DA)"),
            LroMode::Adaptive => "adaptive".into(),
        }
    }
}

/// One guest of `pvio up`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpGuest {
    /// Its domain's name (its counters carry it).
    pub name: String,
    /// Its namespace (made if missing, removed at the end if made here).
    pub ns: String,
    /// Its address, with its prefix length.
    pub addr: String,
    /// Its netfront:
    /// * what it posts: page fragments (the original) or linear buffers (no fragments;
    ///   frames up to 1518 bytes);
    /// * its grants: one per I/O, or grant reuse (paper 000 §4.4: netfront binds its
    ///   pages to references, netback reaches them through its cache of mappings, no
    ///   map or unmap per packet); never the paper's unsafe stand-in, which [`check`]
    ///   refuses;
    /// * checksum offload and GSO on its whole path: its TAP (and the cable's) opened
    ///   with a virtio-net header and TCP/IPv4 segmentation taken, netfront offering
    ///   `feature-gso-tcpv4` and blank checksums, so that a large TCP segment crosses
    ///   as one packet;
    /// * pvio's split ring layout (each end's ring indices on a cache line of their
    ///   own; ring.h's layout otherwise, as a real Xen peer gets).
    pub front: FrontConfig,
    /// Its vCPU's core (by default, the guests take the cores after the driver
    /// domain's, one each).
    pub core: Option<usize>,
    /// Its VIF's priority on an SV-NIC (1 to 100; the device's default if none).
    pub priority: Option<u8>,
}

impl UpGuest {
    /// The `i`th guest as the built-in machine would make it: `guest` in `pvio-guest`
    /// at 10.77.0.2 for the first, `guest2` in `pvio-guest2` at 10.77.0.3 for the
    /// second, and so on.
    pub fn nth(i: usize) -> Self {
        let suffix = if i == 0 {
            String::new()
        } else {
            (i + 1).to_string()
        };
        Self {
            name: format!("guest{suffix}"),
            ns: format!("pvio-guest{suffix}"),
            addr: format!("10.77.0.{}/24", i + 2),
            front: FrontConfig {
                offloads: true,
                ..FrontConfig::default()
            },
            core: None,
            priority: None,
        }
    }

    /// Its MAC: the lab's guest address for the first (as the built-in machine has
    /// always had), then one more in the last byte for each.
    pub fn mac(i: usize) -> [u8; 6] {
        let mut m = flow().dst_mac;
        m[5] = m[5].wrapping_add(i as u8);
        m
    }

    /// Its address without the prefix.
    pub fn ip(&self) -> &str {
        self.addr.split('/').next().unwrap_or_default()
    }
}

impl Default for UpConfig {
    fn default() -> Self {
        Self {
            outside_ns: "pvio-outside".into(),
            outside_addr: "10.77.0.1/24".into(),
            guests: vec![UpGuest::nth(0)],
            driver: DriverConfig::default(),
            pcap: None,
            coalesce: pv().coalesce,
            grant_path: pv().grant_path,
            grant_version: pv().grant_version,
            mtu_wire: false,
            svnic: None,
            disks: Vec::new(),
            cpus: None,
            cable: None,
            dma_landing: hv::iommu::DmaLanding::Cache,
            edge_io: dev::tap::EdgeIo::Batched,
            idle: hv::sched::IdlePolicy::AdaptiveHaltPoll(hv::sched::HALT_POLL_DEFAULT),
        }
    }
}

impl UpConfig {
    /// The namespaces the machine runs in: the outside's, then each guest's.
    fn namespaces(&self) -> impl Iterator<Item = &String> {
        let outside = self.cable.is_none().then_some(&self.outside_ns);
        outside.into_iter().chain(self.guests.iter().map(|g| &g.ns))
    }

    /// The first guest (there is always one).
    pub fn guest(&self) -> &UpGuest {
        &self.guests[0]
    }
    /// The first guest, to change.
    pub fn guest_mut(&mut self) -> &mut UpGuest {
        &mut self.guests[0]
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
    /// Each namespace's claim, held until the machine is down.
    claims: Vec<Claim>,
    /// Leave the namespaces made in place at the end.
    keep: bool,
    wire: Arc<dev::tap::TapCounters>,
    /// The wire is a packet socket on a host interface, not a TAP.
    cable: bool,
    /// Each guest's TAP counters, and the guest's name.
    guests: Vec<(String, Arc<dev::tap::TapCounters>)>,
}

/// What has crossed the machine so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpCounters {
    /// Frames from the outside into the NIC.
    pub wire_in: u64,
    /// Frames from the NIC to the outside.
    pub wire_out: u64,
    /// Frames handed to the guests' stacks.
    pub guest_in: u64,
    /// Bytes of those frames (with offloads, a frame may be a 64 KiB TCP segment).
    pub guest_in_bytes: u64,
    /// Frames the guests' stacks sent.
    pub guest_out: u64,
    /// Frames any side dropped as too long for a 1500-byte MTU.
    pub oversize: u64,
    /// Frames the NIC had no posted buffer for (its missed-packet counter).
    pub rx_missed: u64,
    /// System calls the machine's ports made to move frames across the interfaces
    /// (the cable's and the guests': reads, writes, `io_uring_enter`s, packet-socket
    /// sends and polls).
    pub edge_syscalls: u64,
    /// Whether the cable moves its frames in batches (an io_uring, or a packet
    /// socket's mapped rings).
    pub wire_batched: bool,
    /// Whether every guest's TAP moves its frames in batches.
    pub guests_batched: bool,
}

fn netns_exists(name: &str) -> bool {
    std::path::Path::new("/run/netns").join(name).exists()
}

/// How long a guest whose disk a new driver domain could not serve waits before its
/// requests in flight fail.
pub use kernel::block::RECONNECT_BOUND as DISK_RECONNECT_BOUND;

/// Where `pvio up` keeps a lock file for each namespace it runs in.
pub const CLAIM_DIR: &str = "/run/pvio";

/// A namespace held for this run: its lock file, locked while the file is open. The
/// file says whether this run made the namespace (`made`), so that a run killed before
/// it could remove it leaves word for the next.
#[derive(Debug)]
struct Claim {
    path: std::path::PathBuf,
    file: std::fs::File,
}

impl Claim {
    /// Claims namespace `ns`: refused if another `pvio up` holds it. A namespace an
    /// earlier run made and left behind is removed here, to be made afresh.
    fn take(ns: &str) -> Result<Self, Error> {
        use std::io::Read;
        let err = |e: std::io::Error| Error::Other(format!("claim on namespace {ns}: {e}"));
        std::fs::create_dir_all(CLAIM_DIR).map_err(err)?;
        let path = std::path::Path::new(CLAIM_DIR).join(format!("netns-{ns}.lock"));
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(err)?;
        let mut was = String::new();
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let _ = file.read_to_string(&mut was);
                return Err(Error::Other(format!(
                    "namespace {ns} belongs to a pvio up that is running ({}); stop it first, \
                     or name other namespaces",
                    was.trim()
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(err(e)),
        }
        let _ = file.read_to_string(&mut was);
        if was.contains("made") && netns_exists(ns) {
            ip(&["netns", "del", ns])?;
        }
        let mut c = Self { path, file };
        c.record(false)?;
        Ok(c)
    }

    /// Writes who holds the namespace and whether this run made it.
    fn record(&mut self, made: bool) -> Result<(), Error> {
        use std::io::{Seek, Write};
        let line = format!(
            "pid {}{}\n",
            std::process::id(),
            if made { ", made" } else { "" }
        );
        let f = &mut self.file;
        f.set_len(0)
            .and_then(|()| f.seek(std::io::SeekFrom::Start(0)))
            .and_then(|_| f.write_all(line.as_bytes()))
            .map_err(|e| Error::Other(format!("{}: {e}", self.path.display())))
    }

    /// The namespace is gone (or kept on purpose): the file goes, the lock with it.
    fn release(self, kept: bool) {
        if !kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Why a machine that [`check`] allows cannot run on this host: a guest or disk placed on
/// a core the host does not have (its vCPU would float, unpinned, and say nothing).
/// Kept apart from `check`, since a machine file may be written for a larger host.
pub fn on_this_host(cfg: &UpConfig) -> Result<(), Error> {
    let cores = mem::cpu::online_cores();
    let placed = cfg
        .guests
        .iter()
        .map(|g| (&g.name, g.core))
        .chain(cfg.disks.iter().map(|d| (&d.name, d.core)));
    for (name, core) in placed {
        if let Some(c) = core.filter(|&c| c >= cores) {
            return Err(Error::Other(format!(
                "{name}: core {c}, but this host has {cores} (0 to {})",
                cores.saturating_sub(1)
            )));
        }
    }
    Ok(())
}

/// Why a machine cannot be brought up as configured, before anything is made: no
/// guest, or two that would share a namespace, an address or a name.
pub fn check(cfg: &UpConfig) -> Result<(), Error> {
    if cfg.guests.is_empty() {
        return Err(Error::Other("a machine needs a guest".into()));
    }
    if cfg.svnic.is_some() && (cfg.driver.lro.is_some() || cfg.driver.queues) {
        return Err(Error::Other(
            "LRO and a receive queue per guest are the driver domain's NIC's; an SV-NIC \
             machine has neither"
                .into(),
        ));
    }
    if cfg.driver.lro.is_some() && cfg.driver.queues {
        return Err(Error::Other(
            "LRO aggregates in the driver domain, and with a receive queue per guest the NIC \
             places the guests' frames in their buffers past it: choose one"
                .into(),
        ));
    }
    for (i, g) in cfg.guests.iter().enumerate() {
        if g.front.grants == net::netfront::Grants::MachineFramesUnsafe {
            return Err(Error::Other(format!(
                "guest {}: machine frames on the ring are the paper's unsafe stand-in, for \
                 measurement only; pvio up grants per I/O or reuses its grants",
                g.name
            )));
        }
        if g.ns == cfg.outside_ns {
            return Err(Error::Other(format!(
                "guest {}: namespace {:?} is the outside's too",
                g.name, g.ns
            )));
        }
        if g.ip() == cfg.outside_addr.split('/').next().unwrap_or_default() {
            return Err(Error::Other(format!(
                "guest {}: address {} is the outside's too",
                g.name, g.addr
            )));
        }
        for h in &cfg.guests[..i] {
            let clash = if h.name == g.name {
                Some("name")
            } else if h.ns == g.ns {
                Some("namespace")
            } else if h.ip() == g.ip() {
                Some("address")
            } else {
                None
            };
            if let Some(what) = clash {
                return Err(Error::Other(format!(
                    "guests {} and {} have the same {what}",
                    h.name, g.name
                )));
            }
        }
    }
    Ok(())
}

/// How the cable's TAP moves frames: as `cfg` asks, except that where the NIC's engine
/// shares a guest's core ([`nic_beside_guest`]) a multishot read (`EdgeIo::Armed`) gives
/// way to reads that never wait (`EdgeIo::Batched`). The multishot read runs as work of
/// the thread that armed it, which ties the port, and with it the engine, to that
/// pCPU's thread (`WireSource::thread_bound`); without the tie an idle pCPU runs the
/// engine's steps whenever the guest keeps its own busy. Out of the guest with offloads
/// each frame the NIC writes to the outside's TAP runs the outside's TCP receive on the
/// writing thread, and into it with LRO the guest's TAP writes run the guest's
/// (ARCHITECTURE §6, "The TAPs' I/O"). An engine beside the driver domain (MTU-sized
/// frames end to end) or on a core of its own moves frames as asked.
pub fn wire_io(cfg: &UpConfig, beside_guest: bool) -> dev::tap::EdgeIo {
    match cfg.edge_io {
        dev::tap::EdgeIo::Armed if beside_guest => dev::tap::EdgeIo::Batched,
        io => io,
    }
}

/// Makes the namespaces and interfaces and starts the machine.
pub fn up(cfg: &UpConfig) -> Result<Up, Error> {
    check(cfg)?;
    on_this_host(cfg)?;
    rig::tools::ensure(&[rig::tools::IP])?;
    let mut claims = Vec::new();
    for ns in cfg.namespaces() {
        claims.push(Claim::take(ns)?);
    }
    let mut made = Vec::new();
    let mut captures = Vec::new();
    let (running, wire, guests) = match bring_up(cfg, &mut claims, &mut made, &mut captures) {
        Ok(b) => b,
        Err(e) => {
            drop(captures);
            for ns in &made {
                let _ = ip(&["netns", "del", ns]);
            }
            for c in claims {
                c.release(false);
            }
            return Err(e);
        }
    };
    let mut up = Up {
        running: Some(running),
        captures,
        made,
        claims,
        keep: false,
        wire,
        cable: cfg.cable.is_some(),
        guests,
    };
    up.name_captures()?;
    Ok(up)
}

type Brought = (
    Running,
    Arc<dev::tap::TapCounters>,
    Vec<(String, Arc<dev::tap::TapCounters>)>,
);

/// The NIC's cable: what it receives from, what it transmits to, and their counters.
type Wire = (
    Box<dyn dev::wire::WireSource>,
    Box<dyn dev::wire::WireSink>,
    Arc<dev::tap::TapCounters>,
);

/// The NIC's cable on interface `ifname` of the host: brought up, its GRO and LRO off
/// (the cable's slots hold an MTU-sized frame, and a real wire carries nothing larger),
/// and a packet socket with mapped rings on it.
fn attach_cable(ifname: &str, capture: Option<&dev::capture::CaptureFile>) -> Result<Wire, Error> {
    rig::tools::ensure(&[rig::tools::ETHTOOL])?;
    mem::packet::ifindex(ifname)
        .map_err(|e| Error::Other(format!("cable interface {ifname}: {e}")))?;
    ip(&["link", "set", ifname, "up"])?;
    let ethtool = |feature: &str| {
        Command::new("ethtool")
            .args(["-K", ifname, feature, "off"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !ethtool("gro") {
        return Err(Error::Other(format!(
            "cable interface {ifname}: cannot turn its GRO off (ethtool -K {ifname} gro off)"
        )));
    }
    // Most interfaces have no LRO to turn off; where one is on and stays on, its
    // aggregates are counted as oversize and dropped.
    let _ = ethtool("lro");
    let (mut port, mut sink) = dev::packet::open_cable(ifname)
        .map_err(|e| Error::Other(format!("cable interface {ifname}: {e}")))?;
    if let Some(c) = capture {
        port.capture(c);
        port.sink_capture(&mut sink);
    }
    let wc = Arc::clone(port.counters());
    Ok((Box::new(port), Box::new(sink), wc))
}

/// The capture file of a guest's frames, until its vif's name is known.
fn guest_pcap(name: &str) -> String {
    format!("{name}.pcap")
}

/// Opens `dir/name` for capture.
fn capture_file(
    dir: &std::path::Path,
    name: &str,
) -> Result<(std::path::PathBuf, dev::capture::CaptureFile), Error> {
    let path = dir.join(name);
    let f = dev::capture::CaptureFile::create(&path)
        .map_err(|e| Error::Other(format!("capture {}: {e}", path.display())))?;
    Ok((path, f))
}

/// `ip`'s spelling of a MAC address.
fn mac_text(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Moves `ifname` into `ns` with `addr` (and `lladdr`), and brings it and the
/// namespace's loopback up.
fn place(ifname: &str, ns: &str, addr: &str, lladdr: Option<&str>) -> Result<(), Error> {
    ip(&["link", "set", "dev", ifname, "netns", ns])?;
    if let Some(a) = lladdr {
        ip(&["-n", ns, "link", "set", "dev", ifname, "address", a])?;
    }
    // The frames the kernel queues for pvio to read: a TAP drops what its queue cannot
    // hold (it does not stop its sender's queueing discipline), and a TCP sender that
    // pvio keeps waiting fills whatever its receiver's window allows.
    let qlen = TAP_QUEUE_FRAMES.to_string();
    ip(&["-n", ns, "link", "set", "dev", ifname, "txqueuelen", &qlen])?;
    ip(&["-n", ns, "addr", "add", addr, "dev", ifname])?;
    ip(&["-n", ns, "link", "set", "dev", ifname, "up"])?;
    ip(&["-n", ns, "link", "set", "dev", "lo", "up"])
}

/// Frames a TAP of `pvio up`'s queues toward pvio (its `txqueuelen`; Linux's default is
/// 1000). A TAP drops what its queue cannot hold, and a TCP sender that pvio holds back
/// (flow control) fills what its receiver's window allows: Linux's largest default
/// window (`tcp_rmem`'s 6 MiB) is about 4150 MTU-sized frames, so the queue holds twice
/// that, for a flow's whole window with room for a second.
pub const TAP_QUEUE_FRAMES: u32 = 8192;

/// A guest with a disk and no network, its block job kept to the disk's size (the
/// first 64 MiB of a remote one, whose size it learns only once found).
fn disk_guest(d: &UpDisk) -> Result<GuestSpec, Error> {
    let sectors = match &d.disk {
        kernel::machine::Disk::File(p) => {
            std::fs::metadata(p)
                .map_err(|e| Error::Other(format!("disk {}: {e}", p.display())))?
                .len()
                / blk::blkif::SECTOR_SIZE
        }
        kernel::machine::Disk::Aoe { .. } => 131_072,
    };
    if sectors < u64::from(d.bytes) / blk::blkif::SECTOR_SIZE {
        return Err(Error::Other(format!(
            "disk {}: smaller than one request",
            d.name
        )));
    }
    Ok(d.guest(sectors))
}

fn bring_up(
    cfg: &UpConfig,
    claims: &mut [Claim],
    made: &mut Vec<String>,
    captures: &mut Vec<(std::path::PathBuf, dev::capture::CaptureFile)>,
) -> Result<Brought, Error> {
    for (ns, claim) in cfg.namespaces().zip(claims.iter_mut()) {
        if !netns_exists(ns) {
            // Recorded first: a run killed between the two still leaves word.
            claim.record(true)?;
            ip(&["netns", "add", ns])?;
            made.push(ns.clone());
        }
    }
    if let Some(dir) = &cfg.pcap {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::Other(format!("capture directory {}: {e}", dir.display())))?;
    }
    let pid = std::process::id() % 100_000;
    // A guest's front end takes large segments only on the page-fragment path; the
    // cable carries them if any guest does.
    let offloads = |g: &UpGuest| {
        g.front.offloads && g.front.rx_buffers == RxBuffers::Fragments && cfg.svnic.is_none()
    };
    let tap_offload = |on: bool| {
        if on {
            mem::tap::TapOffload::CsumTso
        } else {
            mem::tap::TapOffload::None
        }
    };
    let mtu_wire = cfg.mtu_wire || cfg.driver.lro.is_some() || cfg.svnic.is_some();
    let wire_capture = match &cfg.pcap {
        Some(dir) => Some(capture_file(dir, "wire.pcap")?),
        None => None,
    };
    let (source, sink, wc): Wire = match &cfg.cable {
        Some(ifname) => attach_cable(ifname, wire_capture.as_ref().map(|c| &c.1))?,
        None => {
            let wire_taps = tap_offload(!mtu_wire && cfg.guests.iter().any(offloads));
            let beside_guest = nic_beside_guest(cfg, cfg.guests.iter().any(offloads));
            let (wire_file, wire_if) = mem::tap::open_tap_offload(&format!("pvw{pid}"), wire_taps)
                .map_err(|e| Error::Other(format!("tap: {e}")))?;
            place(&wire_if, &cfg.outside_ns, &cfg.outside_addr, None)?;
            let mut wire =
                dev::tap::TapPort::start_io(wire_file, wire_taps, wire_io(cfg, beside_guest))
                    .map_err(|e| Error::Other(e.to_string()))?;
            if let Some(w) = &wire_capture {
                wire.capture(&w.1);
            }
            let sink = wire.sink().map_err(|e| Error::Other(e.to_string()))?;
            let wc = Arc::clone(wire.counters());
            (Box::new(wire), Box::new(sink), wc)
        }
    };
    captures.extend(wire_capture);
    let mut guests = Vec::with_capacity(cfg.guests.len());
    let mut counters = Vec::with_capacity(cfg.guests.len());
    for (i, g) in cfg.guests.iter().enumerate() {
        let on = offloads(g);
        let (file, ifname) = mem::tap::open_tap_offload(&format!("pvg{pid}.{i}"), tap_offload(on))
            .map_err(|e| Error::Other(format!("tap: {e}")))?;
        let mac = UpGuest::mac(i);
        place(&ifname, &g.ns, &g.addr, Some(&mac_text(mac)))?;
        let mut tap = dev::tap::TapPort::start_io(file, tap_offload(on), cfg.edge_io)
            .map_err(|e| Error::Other(e.to_string()))?;
        if let Some(dir) = &cfg.pcap {
            let c = capture_file(dir, &guest_pcap(&g.name))?;
            tap.capture(&c.1);
            captures.push(c);
        }
        counters.push((g.name.clone(), Arc::clone(tap.counters())));
        guests.push(GuestSpec {
            weight: 1,
            name: g.name.clone(),
            mac,
            above: Above::Tap(Box::new(tap)),
            core: g.core,
            front: FrontConfig {
                offloads: on,
                ..g.front
            },
        });
    }
    // Guests with disks, after the guests with networks.
    for d in &cfg.disks {
        guests.push(disk_guest(d)?);
    }
    let first = cfg.guest();
    let opts = Options {
        driver: cfg.driver,
        front: FrontConfig {
            offloads: offloads(first),
            ..first.front
        },
        sample: None,
        coalesce: cfg.coalesce,
        grant_path: cfg.grant_path,
        grant_version: cfg.grant_version,
        // Outside processes (iperf3, ping, the TAPs' readers) share the cores.
        idle: cfg.idle.shared(),
        cpus: cfg.cpus,
        dma_landing: cfg.dma_landing,
        ..pv()
    };
    let svnic = cfg.svnic.map(|c| {
        let prio = cfg.guests.iter().map(|g| g.priority);
        (c, prio.chain(cfg.disks.iter().map(|_| None)).collect())
    });
    let running = Running::start_with(
        opts,
        Some(Plumbing {
            wire: source,
            sink,
            guests,
            svnic,
            nic_core: nic_core(cfg, cfg.guests.iter().any(offloads)),
        }),
    )?;
    Ok((running, wc, counters))
}

/// Where `pvio up`'s NIC engine runs: on a core of its own where the machine's pool has
/// one the domains leave free (as the papers' machines place it). Otherwise it shares a
/// core, and which one was measured on a 2-core host: with MTU-sized frames end to end
/// (no guest takes offloads, no LRO) the guest's core is the busiest, since each frame
/// written to its TAP runs the namespace's TCP receive, and the engine beside the
/// driver domain moved 20–40% more TCP; with 64 KiB segments (offloads, or LRO's
/// aggregates) the copies of the driver domain and the engine dominate and the papers'
/// place beside the first guest did better (8.1–9.4 against 7.6–8.3 Gbit/s; LRO 4.0–4.2
/// against 3.7). See `docs/ARCHITECTURE.md`.
fn nic_core(cfg: &UpConfig, offloads: bool) -> Option<usize> {
    (cfg.svnic.is_none() && mtu_frames(cfg, offloads) && !spare_core(cfg)).then_some(0)
}

/// Whether MTU-sized frames go end to end: no guest takes offloads and there is no LRO.
fn mtu_frames(cfg: &UpConfig, offloads: bool) -> bool {
    !offloads && cfg.driver.lro.is_none()
}

/// Whether the machine's pool has a core the domains leave free (the NIC's engine then
/// runs there).
fn spare_core(cfg: &UpConfig) -> bool {
    let pool = cfg
        .cpus
        .map_or_else(mem::cpu::online_cores, |c| c.cores().len());
    pool > 1 + cfg.guests.len() + cfg.disks.len()
}

/// Whether the NIC's engine shares the first guest's core: no core to spare, and
/// frames large enough that the papers' place is taken ([`nic_core`]).
fn nic_beside_guest(cfg: &UpConfig, offloads: bool) -> bool {
    cfg.svnic.is_none() && !spare_core(cfg) && !mtu_frames(cfg, offloads)
}

impl Up {
    /// Traffic so far, every guest's together.
    pub fn counters(&self) -> UpCounters {
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let sum = |f: &dyn Fn(&dev::tap::TapCounters) -> u64| -> u64 {
            self.guests.iter().map(|(_, c)| f(c)).sum()
        };
        UpCounters {
            wire_in: l(&self.wire.frames_in),
            wire_out: l(&self.wire.frames_out),
            guest_in: sum(&|c| l(&c.frames_out)),
            guest_in_bytes: sum(&|c| l(&c.bytes_out)),
            guest_out: sum(&|c| l(&c.frames_in)),
            oversize: l(&self.wire.oversize_in) + sum(&|c| l(&c.oversize_in)),
            edge_syscalls: l(&self.wire.syscalls) + sum(&|c| l(&c.syscalls)),
            wire_batched: self.cable || l(&self.wire.batched) == 1,
            guests_batched: self.guests.iter().all(|(_, c)| l(&c.batched) == 1),
            rx_missed: self
                .running
                .as_ref()
                .and_then(|r| r.nic_regs())
                .map_or(0, |n| l(&n.rx_missed)),
        }
    }

    /// Packets pvio's ports dropped or refused so far, every reason together: the
    /// NIC's (`rx_missed` among them), the driver domain's vifs' (a receive queue full,
    /// a bad request, ...) and the TAP ports' own (a write that failed, a frame whose
    /// header lied, ...), as the live table's drops column counts them. It reads the
    /// driver domain's state as the live table does, so it waits for a driver domain in
    /// its step: not for a loop that must go on while one hangs (the watchdog's);
    /// [`Up::counters`] reads only atomics.
    pub fn port_drops(&self) -> u64 {
        self.live_sample()
            .map_or(0, |s| rig::live::drops(&s.counters))
    }

    /// Renames each guest's capture after its vif (`vif<domain>.0`), once the machine
    /// runs.
    fn name_captures(&mut self) -> Result<(), Error> {
        let Some(running) = &self.running else {
            return Ok(());
        };
        for (name, _) in &self.guests {
            let Some(dom) = running.domain(name) else {
                continue;
            };
            let vif = format!("vif{}.0", dom.id().0);
            for (path, _) in &mut self.captures {
                if path.file_name().is_some_and(|n| *n == *guest_pcap(name)) {
                    let named = path.with_file_name(format!("{vif}.pcap"));
                    std::fs::rename(&*path, &named)
                        .map_err(|e| Error::Other(format!("capture {}: {e}", named.display())))?;
                    *path = named;
                }
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

    /// Every component's counters as they stand, the outside TAP's (`wire tap`, or
    /// `wire cable` for a packet socket on a host interface)
    /// with them, stamped: two of them give [`rig::live::rates`].
    pub fn live_sample(&self) -> Option<rig::live::Sample> {
        let mut s = self.running.as_ref()?.live_sample();
        let wire = if self.cable { "wire cable" } else { "wire tap" };
        s.counters
            .add_port(wire, kernel::counters::PortKind::HostInterface, &*self.wire);
        Some(s)
    }

    /// The running machine.
    pub fn machine(&self) -> Option<&Running> {
        self.running.as_ref()
    }

    /// Arms a fault in the driver domain (a panic or a hang at its next poll).
    pub fn inject_fault(&self, f: rig::udp::Fault) {
        if let Some(r) = &self.running {
            r.inject_fault(f);
        }
    }

    /// The toolstack's watchdog, run periodically: restarts a driver domain that
    /// crashed or stalled for `stall`; the guest's netfront reconnects to the new one.
    pub fn watchdog(
        &mut self,
        stall: std::time::Duration,
    ) -> Result<Option<rig::udp::Restarted>, Error> {
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
    pub fn down_with_counters(mut self) -> Result<kernel::Counters, Error> {
        let f = match self.running.take() {
            Some(r) => r.finish(std::time::Duration::ZERO).map(|f| f.counters),
            None => Ok(kernel::Counters::default()),
        };
        self.stop();
        f
    }

    /// Leaves the namespaces this run made in place when it goes down (their TAPs go
    /// with the machine); the next `pvio up` naming them removes and makes them afresh.
    pub fn keep_namespaces(&mut self) {
        self.keep = true;
    }

    fn stop(&mut self) {
        drop(self.running.take());
        // The machine's ports are gone with it: the files get their last frames.
        self.captures.clear();
        let kept = self.keep && !self.made.is_empty();
        for ns in self.made.drain(..).filter(|_| !self.keep) {
            let _ = ip(&["netns", "del", &ns]);
        }
        for c in self.claims.drain(..) {
            c.release(kept);
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod host_tests {
    use super::*;

    /// Where the NIC's engine shares a guest's core (offloads or LRO, no core to
    /// spare) the cable's TAP is never read by a multishot read, which would tie the
    /// engine to one thread; beside the driver domain or on a core of its own it moves
    /// as asked.
    #[test]
    fn the_cable_is_never_tied_to_one_thread_where_the_nic_shares_a_guests_core() {
        use dev::tap::EdgeIo;
        let on = |cores: usize, offloads: bool, lro: LroMode| {
            let mut cfg = UpConfig {
                cpus: Some(kernel::machine::CpuSet::range(0..cores)),
                ..UpConfig::default()
            };
            cfg.driver.lro = lro.setup();
            nic_beside_guest(&cfg, offloads)
        };
        assert!(
            on(2, true, LroMode::Off),
            "offloads on two cores: beside the guest"
        );
        assert!(on(2, false, LroMode::Adaptive), "LRO: beside the guest");
        assert!(
            !on(2, false, LroMode::Off),
            "MTU frames: beside the driver domain"
        );
        assert!(!on(3, true, LroMode::Off), "a core to spare: its own");
        for asked in [EdgeIo::Batched, EdgeIo::Armed, EdgeIo::Plain] {
            let cfg = UpConfig {
                edge_io: asked,
                ..UpConfig::default()
            };
            let beside = if asked == EdgeIo::Armed {
                EdgeIo::Batched
            } else {
                asked
            };
            assert_eq!(wire_io(&cfg, true), beside, "beside a guest");
            assert_eq!(wire_io(&cfg, false), asked, "elsewhere");
        }
    }

    /// A guest on a core this host lacks is refused, naming it; one on core 0 runs.
    #[test]
    fn a_core_the_host_does_not_have_is_refused() {
        let mut cfg = UpConfig {
            guests: vec![UpGuest::nth(0)],
            ..UpConfig::default()
        };
        cfg.guests[0].core = Some(0);
        assert!(on_this_host(&cfg).is_ok());
        cfg.guests[0].core = Some(mem::cpu::online_cores());
        let e = on_this_host(&cfg).expect_err("refused").to_string();
        assert!(e.contains("guest: core"), "{e}");
    }

    /// Grant reuse is a guest's to ask for; the paper's unsafe stand-in (machine frames
    /// on the ring, unchecked) never runs with real traffic.
    #[test]
    fn a_guest_asking_for_machine_frames_on_the_ring_is_refused() {
        let mut cfg = UpConfig {
            guests: vec![UpGuest::nth(0)],
            ..UpConfig::default()
        };
        cfg.guests[0].front.grants = Grants::Reuse;
        assert!(check(&cfg).is_ok());
        cfg.guests[0].front.grants = Grants::MachineFramesUnsafe;
        let e = check(&cfg).expect_err("refused").to_string();
        assert!(e.contains("unsafe stand-in"), "{e}");
    }
}
