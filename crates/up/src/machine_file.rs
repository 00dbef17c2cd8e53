//! Machines from files: the machine `pvio up` runs, written as TOML.
//!
//! ```toml
//! [hypervisor]
//! grant_path = "optimised"      # or "original" (paper 000's)
//! grant_version = 2             # or 1
//! cpus = [2, 3]                 # the host cores the machine owns (its CPU pool), its
//!                               # layout's cores taken from them in turn; all by default
//!
//! [nic]
//! coalesce_packets = 6          # completions per interrupt
//! coalesce_delay_us = 18        # longest a completion waits
//! adaptive = false              # the driver sets the packets per interrupt from the rate
//! multi_queue = false           # a receive queue per guest, frames placed in its buffers
//! lro = "off"                   # or "every-poll", "delayed", "adaptive" (paper 001)
//! lro_flush_every = 2           # with "delayed": flush every this many polls
//! mtu_wire = false              # the cable carries MTU-sized frames only (so with LRO)
//! cable = "veth1"               # the cable on this interface of the host (a packet
//!                               # socket), not a TAP in [outside]'s namespace
//! dma = "cache"                 # where its DMA writes land: "cache" (Data Direct I/O,
//!                               # a present-day host) or "memory" (the papers' 2008 one)
//!
//! [driver]
//! netfilter = true              # the bridge's netfilter hooks
//!
//! [svnic]                       # the self-virtualized NIC (paper 002) instead of the
//!                               # driver domain; no LRO, multi_queue or offloads with it
//! signal = "register"           # or "sidecore", "per-vif": how guests are signalled
//! idle = "poll"                 # or "dynamic", "interrupt": the device threads when idle
//! schedule = "round-robin"      # or "quality-aware": egress by the VIFs' priorities
//! iommu = false                 # each VIF in its own memory, by DMA through its own
//!                               # IOMMU context
//!
//! [outside]                     # the far end of the NIC's cable
//! namespace = "pvio-outside"
//! address = "10.77.0.1/24"
//!
//! [[guest]]                     # one table per guest, in the order they are made
//! name = "guest"                # its domain's name; "guest", "guest2", ... by default
//! rx_buffers = "fragments"      # or "linear", "guest-copy"
//! grants = "per-io"             # or "reuse"
//! offloads = true               # checksum offload and GSO (false: the plain path)
//! split_ring = false            # netfront asks for pvio's split ring layout (each
//!                               # end's indices on a line of its own), not ring.h's
//! core = 1                      # its vCPU's core; by default the guests take the cores
//!                               # after the driver domain's (core 0), one each
//! priority = 50                 # its VIF's priority on an SV-NIC, 1 to 100
//! tap = { namespace = "pvio-guest", address = "10.77.0.2/24" }
//!
//! [[disk]]                      # a guest with a virtual disk and no network, running
//!                               # a block job on it until the machine goes down
//! name = "disk1"                # its domain's name
//! file = "/dev/shm/disk.img"    # a backing file the driver domain's blkback serves,
//! # aoe = { shelf = 1, slot = 1 }   or an ATA-over-Ethernet target on the cable (a
//!                               # remote disk: the driver domain's, or on an SV-NIC the
//!                               # device's block service)
//! read_only = false
//! persistent = true             # persistent grants on both ends
//! job = { op = "read", pattern = "random", bytes = 4096, depth = 4 }
//! ```
//!
//! Every key is optional but `[[guest]]`: what a file leaves out is the built-in
//! machine's (`pvio up` with no flags), the nth guest's namespace and address
//! `pvio-guest<n>` and 10.77.0.<n+1>/24. A key the format does not have, a value of the
//! wrong type or out of range, or two guests (or a guest and the outside) sharing a
//! name, namespace or address, is refused before anything starts, with the key and its
//! line.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use crate::{LroMode, UpConfig, UpGuest};
use dev::svnic::engine::Schedule;
use kernel::block::JobOp;
use net::netfront::Grants;
use net::netfront::RxBuffers;

/// Why a machine file was refused.
#[derive(Debug, thiserror::Error)]
pub enum MachineFileError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not TOML, or not this format; the parser's message names the key and line.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The parser's message, with its line.
        message: String,
    },
    /// A value the format takes but the machine cannot.
    #[error("{path}:{line}: `{key}`: {why}")]
    Value {
        /// The file.
        path: PathBuf,
        /// The line (from 1).
        line: usize,
        /// The key, dotted.
        key: String,
        /// Why.
        why: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    hypervisor: Hypervisor,
    #[serde(default)]
    nic: Nic,
    #[serde(default)]
    driver: Driver,
    svnic: Option<Spanned<Svnic>>,
    #[serde(default)]
    outside: Endpoint,
    guest: Spanned<Vec<Guest>>,
    #[serde(default)]
    disk: Vec<Spanned<DiskTable>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskTable {
    name: Option<Spanned<String>>,
    file: Option<String>,
    aoe: Option<AoeTarget>,
    read_only: Option<bool>,
    persistent: Option<bool>,
    core: Option<Spanned<u32>>,
    #[serde(default)]
    job: JobTable,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AoeTarget {
    shelf: u16,
    slot: u8,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobTable {
    op: Option<Spanned<String>>,
    pattern: Option<PatternKind>,
    bytes: Option<Spanned<u32>>,
    depth: Option<Spanned<u32>>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum PatternKind {
    Sequential,
    Random,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Svnic {
    signal: Option<Spanned<String>>,
    idle: Option<IdlePolicy>,
    schedule: Option<Spanned<String>>,
    iommu: Option<bool>,
}

/// The device threads' idle policy, in the file's words: each is an
/// [`Idle`] with a spin of the file's choosing, so the names are the file's own.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum IdlePolicy {
    Poll,
    Dynamic,
    Interrupt,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Hypervisor {
    grant_path: Option<Spanned<String>>,
    grant_version: Option<Spanned<u8>>,
    cpus: Option<Spanned<Vec<usize>>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Nic {
    coalesce_packets: Option<Spanned<u32>>,
    coalesce_delay_us: Option<Spanned<u64>>,
    adaptive: Option<bool>,
    multi_queue: Option<bool>,
    lro: Option<Spanned<Lro>>,
    lro_flush_every: Option<Spanned<u32>>,
    mtu_wire: Option<bool>,
    cable: Option<Spanned<String>>,
    dma: Option<Spanned<String>>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Lro {
    Off,
    EveryPoll,
    Delayed,
    Adaptive,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Driver {
    netfilter: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Endpoint {
    namespace: Option<Spanned<String>>,
    address: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Guest {
    name: Option<Spanned<String>>,
    rx_buffers: Option<Spanned<String>>,
    grants: Option<Spanned<String>>,
    offloads: Option<bool>,
    split_ring: Option<bool>,
    core: Option<Spanned<u32>>,
    priority: Option<Spanned<u8>>,
    #[serde(default)]
    tap: Endpoint,
}

/// Reads the machine in `path`.
pub fn load(path: &Path) -> Result<UpConfig, MachineFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| MachineFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &text)
}

/// Refusals name the file, the key and its line.
struct Refuse<'a> {
    path: &'a Path,
    text: &'a str,
}

impl Refuse<'_> {
    /// The value `v` names, in its type's own names (`hv::named_enum!`, beside the
    /// type's definition); refused with the names it takes.
    fn named<T>(
        &self,
        v: &Spanned<String>,
        key: &str,
        parse: fn(&str) -> Option<T>,
        names: &[&str],
    ) -> Result<T, MachineFileError> {
        parse(v.get_ref()).ok_or_else(|| {
            let why = format!("{:?}: one of {}", v.get_ref(), names.join(", "));
            self.at(v.span(), key, why)
        })
    }

    fn at(&self, span: Range<usize>, key: &str, why: String) -> MachineFileError {
        MachineFileError::Value {
            path: self.path.to_path_buf(),
            line: self.text[..span.start.min(self.text.len())]
                .matches('\n')
                .count()
                + 1,
            key: key.to_string(),
            why,
        }
    }
}

/// The machine in `text` (read from `path`, named in errors).
pub fn parse(path: &Path, text: &str) -> Result<UpConfig, MachineFileError> {
    let f: File = toml::from_str(text).map_err(|e| MachineFileError::Format {
        path: path.to_path_buf(),
        message: e.to_string().trim_end().to_string(),
    })?;
    let refuse = Refuse { path, text };
    let mut cfg = UpConfig::default();
    hypervisor_table(f.hypervisor, &mut cfg, &refuse)?;
    nic_table(f.nic, &mut cfg, &refuse)?;
    if let Some(n) = f.driver.netfilter {
        cfg.driver.netfilter = n;
    }
    let svnic = f.svnic.is_some();
    svnic_table(f.svnic.as_ref(), &mut cfg, &refuse)?;
    endpoint(
        &f.outside,
        "outside",
        &mut cfg.outside_ns,
        &mut cfg.outside_addr,
        &refuse,
    )?;
    guest_tables(&f.guest, svnic, &mut cfg, &refuse)?;
    disk_tables(&f.disk, svnic, &mut cfg, &refuse)?;
    Ok(cfg)
}

/// `[hypervisor]`: the grant path and table version, the host cores the machine owns.
fn hypervisor_table(
    hy: Hypervisor,
    cfg: &mut UpConfig,
    refuse: &Refuse<'_>,
) -> Result<(), MachineFileError> {
    let by_name = refuse;
    let refuse = |span, key: &str, why| refuse.at(span, key, why);
    if let Some(p) = &hy.grant_path {
        let (parse, names) = (hv::GrantPath::parse, hv::GrantPath::NAMES);
        cfg.grant_path = by_name.named(p, "hypervisor.grant_path", parse, names)?;
    }
    if let Some(c) = &hy.cpus {
        let online = mem::cpu::online_cores();
        let set = match c.get_ref().iter().find(|&&n| n >= online) {
            Some(n) => Err(format!("core {n}: this host has cores 0 to {}", online - 1)),
            None if c.get_ref().is_empty() => Err("a machine needs at least one core".into()),
            None => {
                kernel::machine::CpuSet::of(c.get_ref().iter().copied()).map_err(|e| e.to_string())
            }
        };
        cfg.cpus = Some(set.map_err(|why| refuse(c.span(), "hypervisor.cpus", why))?);
    }
    if let Some(v) = hy.grant_version {
        cfg.grant_version = match *v.get_ref() {
            1 => hv::GrantVersion::V1,
            2 => hv::GrantVersion::V2,
            n => {
                return Err(refuse(
                    v.span(),
                    "hypervisor.grant_version",
                    format!("{n}: grant tables come in versions 1 and 2"),
                ))
            }
        };
    }
    Ok(())
}

/// `[nic]`: coalescing, queues, the cable, the DMA's landing, LRO.
fn nic_table(nic: Nic, cfg: &mut UpConfig, refuse: &Refuse<'_>) -> Result<(), MachineFileError> {
    let refuse = |span, key: &str, why| refuse.at(span, key, why);
    if let Some(n) = nic.coalesce_packets {
        if !(1..=dev::nic::RING_DESCS).contains(n.get_ref()) {
            return Err(refuse(
                n.span(),
                "nic.coalesce_packets",
                format!(
                    "{}: from 1 to {} completions per interrupt",
                    n.get_ref(),
                    dev::nic::RING_DESCS
                ),
            ));
        }
        cfg.coalesce.pkts_per_irq = *n.get_ref();
    }
    if let Some(d) = nic.coalesce_delay_us {
        if *d.get_ref() > 1_000_000 {
            return Err(refuse(
                d.span(),
                "nic.coalesce_delay_us",
                format!("{} µs: at most a second", d.get_ref()),
            ));
        }
        cfg.coalesce.max_delay = Duration::from_micros(*d.get_ref());
    }
    if let Some(a) = nic.adaptive {
        cfg.coalesce.adaptive = a;
    }
    if let Some(q) = nic.multi_queue {
        cfg.driver.queues = q;
    }
    if let Some(m) = nic.mtu_wire {
        cfg.mtu_wire = m;
    }
    if let Some(c) = &nic.cable {
        let name = c.get_ref();
        // Linux's rule for an interface name (`dev_valid_name`).
        let valid = !name.is_empty()
            && name.len() < 16
            && name != "."
            && name != ".."
            && !name
                .chars()
                .any(|ch| ch == '/' || ch == ':' || ch.is_whitespace());
        if !valid {
            return Err(refuse(
                c.span(),
                "nic.cable",
                format!("{name:?}: an interface name of 1 to 15 characters, no '/', ':' or space"),
            ));
        }
        cfg.cable = Some(name.clone());
    }
    if let Some(d) = &nic.dma {
        cfg.dma_landing = hv::iommu::DmaLanding::parse(d.get_ref())
            .map_err(|e| refuse(d.span(), "nic.dma", e))?;
    }
    let every = match &nic.lro_flush_every {
        Some(n) if !(1..=64).contains(n.get_ref()) => {
            return Err(refuse(
                n.span(),
                "nic.lro_flush_every",
                format!("{}: from 1 to 64 polls", n.get_ref()),
            ))
        }
        Some(n) => *n.get_ref(),
        None => 2,
    };
    if let Some(l) = &nic.lro {
        cfg.driver.lro = match *l.get_ref() {
            Lro::Off => LroMode::Off,
            Lro::EveryPoll => LroMode::EveryPoll,
            Lro::Delayed => LroMode::Delayed(every),
            Lro::Adaptive => LroMode::Adaptive,
        }
        .setup();
        if cfg.driver.lro.is_some() && cfg.driver.queues {
            return Err(refuse(
                l.span(),
                "nic.lro",
                "LRO aggregates in the driver domain, and with multi_queue the NIC places \
                 the guests' frames in their buffers past it: choose one"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// `[svnic]`: paper 002's self-virtualized NIC in the driver domain's place.
fn svnic_table(
    svnic: Option<&Spanned<Svnic>>,
    cfg: &mut UpConfig,
    refuse: &Refuse<'_>,
) -> Result<(), MachineFileError> {
    let by_name = refuse;
    let refuse = |span, key: &str, why| refuse.at(span, key, why);
    if let Some(sv) = svnic {
        use dev::svnic::device::{Idle, SignalMode, SvnicConfig};
        let t = sv.get_ref();
        if cfg.driver.lro.is_some() || cfg.driver.queues {
            return Err(refuse(
                sv.span(),
                "svnic",
                "LRO and multi_queue are the driver domain's NIC's; an SV-NIC machine has \
                 neither"
                    .into(),
            ));
        }
        cfg.svnic = Some(SvnicConfig {
            signal: match &t.signal {
                Some(s) => {
                    by_name.named(s, "svnic.signal", SignalMode::parse, SignalMode::NAMES)?
                }
                None => SignalMode::IdRegister,
            },
            idle: match t.idle.unwrap_or(IdlePolicy::Poll) {
                IdlePolicy::Poll => Idle::Poll,
                IdlePolicy::Dynamic => Idle::Block { spin: SVNIC_SPIN },
                IdlePolicy::Interrupt => Idle::Block {
                    spin: Duration::ZERO,
                },
            },
            schedule: match &t.schedule {
                Some(s) => by_name.named(s, "svnic.schedule", Schedule::parse, Schedule::NAMES)?,
                None => Schedule::RoundRobin,
            },
            iommu: t.iommu.unwrap_or(false),
            // The wire is the outside's TAP: the device sends as fast as it takes.
            ..SvnicConfig::default()
        });
    }
    Ok(())
}

/// An `outside` or `[[guest]]` table's namespace and address, checked, into `ns` and
/// `addr`.
fn endpoint(
    e: &Endpoint,
    table: &str,
    ns: &mut String,
    addr: &mut String,
    refuse: &Refuse<'_>,
) -> Result<(), MachineFileError> {
    let refuse = |span, key: &str, why| refuse.at(span, key, why);
    if let Some(n) = &e.namespace {
        let name = n.get_ref();
        if name.is_empty() || name.len() > 200 || name.contains(['/', '\0', ' ']) {
            return Err(refuse(
                n.span(),
                &format!("{table}.namespace"),
                format!("{name:?} is not a namespace name"),
            ));
        }
        ns.clone_from(name);
    }
    if let Some(a) = &e.address {
        if !is_cidr(a.get_ref()) {
            return Err(refuse(
                a.span(),
                &format!("{table}.address"),
                format!(
                    "{:?}: an IPv4 address with its prefix, as 10.77.0.1/24",
                    a.get_ref()
                ),
            ));
        }
        addr.clone_from(a.get_ref());
    }
    Ok(())
}

/// The `[[guest]]` tables.
fn guest_tables(
    guest: &Spanned<Vec<Guest>>,
    svnic: bool,
    cfg: &mut UpConfig,
    refuse: &Refuse<'_>,
) -> Result<(), MachineFileError> {
    let refuse_at = refuse;
    let refuse = |span, key: &str, why| refuse_at.at(span, key, why);
    let guests = guest.get_ref();
    if guests.is_empty() || guests.len() > MAX_GUESTS {
        return Err(refuse(
            guest.span(),
            "guest",
            format!("{} guests: from 1 to {MAX_GUESTS}", guests.len()),
        ));
    }
    cfg.guests.clear();
    for (i, g) in guests.iter().enumerate() {
        let mut u = UpGuest::nth(i);
        if let Some(n) = &g.name {
            let name = n.get_ref();
            if name.is_empty()
                || name.len() > 64
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(refuse(
                    n.span(),
                    "guest.name",
                    format!("{name:?}: letters, digits, '-' and '_', at most 64"),
                ));
            }
            if name == "driver" {
                return Err(refuse(
                    n.span(),
                    "guest.name",
                    "\"driver\" is the driver domain's name".into(),
                ));
            }
            u.name.clone_from(name);
        }
        endpoint(&g.tap, "guest.tap", &mut u.ns, &mut u.addr, refuse_at)?;
        if let Some(b) = &g.rx_buffers {
            let (parse, names) = (RxBuffers::parse, RxBuffers::NAMES);
            u.front.rx_buffers = refuse_at.named(b, "guest.rx_buffers", parse, names)?;
        }
        if let Some(gr) = &g.grants {
            // The paper's unsafe stand-in has a name too; `check` refuses it below.
            let (parse, names) = (Grants::parse, Grants::NAMES);
            u.front.grants = refuse_at.named(gr, "guest.grants", parse, names)?;
        }
        if let Some(r) = g.split_ring {
            u.front.split_ring = r;
        }
        if let Some(o) = g.offloads {
            u.front.offloads = o;
        }
        if let Some(c) = &g.core {
            if *c.get_ref() as usize >= MAX_CORES {
                return Err(refuse(
                    c.span(),
                    "guest.core",
                    format!("{}: a core number below {MAX_CORES}", c.get_ref()),
                ));
            }
            u.core = Some(*c.get_ref() as usize);
        }
        if let Some(p) = &g.priority {
            if !(1..=100).contains(p.get_ref()) || !svnic {
                return Err(refuse(
                    p.span(),
                    "guest.priority",
                    format!(
                        "{}: a VIF's priority is from 1 to 100, on an SV-NIC ([svnic])",
                        p.get_ref()
                    ),
                ));
            }
            u.priority = Some(*p.get_ref());
        }
        cfg.guests.push(u);
        // What two guests, or a guest and the outside, cannot share; refused at this
        // guest's table, named by the key that clashes.
        let span = |key: Option<&Spanned<String>>| key.map_or(guest.span(), Spanned::span);
        if let Err(e) = crate::check(cfg) {
            let key = if e.to_string().contains("namespace") {
                ("guest.tap.namespace", span(g.tap.namespace.as_ref()))
            } else if e.to_string().contains("address") {
                ("guest.tap.address", span(g.tap.address.as_ref()))
            } else {
                ("guest.name", span(g.name.as_ref()))
            };
            return Err(refuse(key.1, key.0, e.to_string()));
        }
    }
    Ok(())
}

/// The `[[disk]]` tables.
fn disk_tables(
    disk: &[Spanned<DiskTable>],
    svnic: bool,
    cfg: &mut UpConfig,
    refuse: &Refuse<'_>,
) -> Result<(), MachineFileError> {
    let refuse_at = refuse;
    let refuse = |span, key: &str, why| refuse.at(span, key, why);
    for d in disk {
        let span = d.span();
        let d = d.get_ref();
        let name = match &d.name {
            Some(n) => {
                let name = n.get_ref();
                let taken = cfg.guests.iter().any(|g| g.name == *name)
                    || cfg.disks.iter().any(|x| x.name == *name);
                if name.is_empty()
                    || name.len() > 64
                    || name == "driver"
                    || taken
                    || !name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                {
                    return Err(refuse(
                        n.span(),
                        "disk.name",
                        format!("{name:?}: letters, digits, '-' and '_', at most 64, not a name already used"),
                    ));
                }
                name.clone()
            }
            None => format!("disk{}", cfg.disks.len() + 1),
        };
        let disk = match (&d.file, &d.aoe) {
            (Some(p), None) => kernel::machine::Disk::File(PathBuf::from(p)),
            (None, Some(a)) => kernel::machine::Disk::Aoe {
                major: a.shelf,
                minor: a.slot,
            },
            _ => {
                return Err(refuse(
                    span,
                    "disk",
                    "a disk is a backing `file` or an `aoe` target on the cable, one of them"
                        .into(),
                ))
            }
        };
        if svnic && matches!(disk, kernel::machine::Disk::File(_)) {
            return Err(refuse(
                span,
                "disk.file",
                "an SV-NIC serves remote disks only: give an `aoe` target".into(),
            ));
        }
        let bytes = d.job.bytes.as_ref().map_or(4096, |b| *b.get_ref());
        if bytes == 0 || bytes % 512 != 0 || bytes > 128 * 1024 {
            let s = d.job.bytes.as_ref().map_or(span.clone(), Spanned::span);
            return Err(refuse(
                s,
                "disk.job.bytes",
                format!("{bytes}: a multiple of 512 up to 131072"),
            ));
        }
        let depth = d.job.depth.as_ref().map_or(1, |x| *x.get_ref());
        if !(1..=32).contains(&depth) {
            let s = d.job.depth.as_ref().map_or(span.clone(), Spanned::span);
            return Err(refuse(s, "disk.job.depth", format!("{depth}: 1 to 32")));
        }
        let op = match &d.job.op {
            Some(o) => refuse_at.named(o, "disk.job.op", JobOp::parse, JobOp::NAMES)?,
            None => JobOp::Read,
        };
        let read_only = d.read_only.unwrap_or(false);
        if read_only && op == kernel::block::JobOp::Write {
            return Err(refuse(
                span,
                "disk.job.op",
                "a read-only disk takes no writes".into(),
            ));
        }
        let core = match &d.core {
            Some(c) if *c.get_ref() as usize >= MAX_CORES => {
                return Err(refuse(
                    c.span(),
                    "disk.core",
                    format!("{}: a core number below {MAX_CORES}", c.get_ref()),
                ))
            }
            Some(c) => Some(*c.get_ref() as usize),
            None => None,
        };
        cfg.disks.push(crate::UpDisk {
            name,
            disk,
            read_only,
            persistent: d.persistent.unwrap_or(true),
            op,
            random: matches!(d.job.pattern, Some(PatternKind::Random)),
            bytes,
            depth: depth as usize,
            core,
        });
    }
    Ok(())
}

/// The most guests a file may have (the driver domain's window has room for this
/// many vifs' mappings, and no example needs more).
pub const MAX_GUESTS: usize = 32;

/// How long a dynamic SV-NIC's threads poll without work before they sleep.
const SVNIC_SPIN: Duration = Duration::from_micros(50);

/// Core numbers a file may name (it may be written for a larger host; `pvio up` refuses
/// a core its own host lacks: `up::on_this_host`).
const MAX_CORES: usize = 1024;

/// `a.b.c.d/n`.
fn is_cidr(s: &str) -> bool {
    s.split_once('/').is_some_and(|(ip, n)| {
        ip.parse::<std::net::Ipv4Addr>().is_ok() && n.parse::<u8>().is_ok_and(|n| n <= 32)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<UpConfig, MachineFileError> {
        parse(Path::new("m.toml"), text)
    }

    #[test]
    fn a_file_sets_what_it_names_and_leaves_the_rest_to_the_built_in_machine() {
        let cfg = p(r#"
[hypervisor]
grant_path = "optimised"
grant_version = 2
cpus = [0]

[nic]
coalesce_packets = 32
adaptive = true
multi_queue = true

[driver]
netfilter = false

[[guest]]
rx_buffers = "linear"
grants = "reuse"
offloads = false
tap = { namespace = "g1", address = "10.9.0.2/24" }
"#)
        .expect("a good file");
        let d = UpConfig::default();
        assert_eq!(cfg.grant_path, hv::GrantPath::Optimised);
        assert_eq!(cfg.grant_version, hv::GrantVersion::V2);
        assert_eq!(cfg.cpus.map(|c| c.cores()), Some(vec![0]));
        assert_eq!(d.cpus, None);
        assert_eq!(cfg.coalesce.pkts_per_irq, 32);
        assert!(cfg.coalesce.adaptive);
        assert_eq!(cfg.coalesce.max_delay, d.coalesce.max_delay);
        assert!(
            cfg.driver.queues
                && (cfg.guest().front.grants == net::netfront::Grants::Reuse)
                && !cfg.driver.netfilter
        );
        assert!(d.guest().front.offloads && !cfg.guest().front.offloads);
        assert_eq!(cfg.guest().front.rx_buffers, RxBuffers::Linear);
        assert_eq!(
            (cfg.guest().ns.as_str(), cfg.guest().addr.as_str()),
            ("g1", "10.9.0.2/24")
        );
        assert_eq!(cfg.outside_ns, d.outside_ns, "the outside left as built in");
    }

    #[test]
    fn lro_on_the_nic_port_is_set_by_mode_and_the_wire_then_carries_mtu_sized_frames() {
        let d = p("[[guest]]\n").expect("no lro");
        assert!(d.driver.lro.is_none() && !d.mtu_wire);
        let cfg = p("[nic]\nlro = \"delayed\"\nlro_flush_every = 4\n[[guest]]\n").expect("DA");
        assert_eq!(cfg.driver.lro, LroMode::Delayed(4).setup());
        assert_eq!(
            cfg.driver.lro.map(|l| l.flushing),
            Some(dev::lro::LroSetup::delayed(4))
        );
        let cfg = p("[nic]\nlro = \"adaptive\"\nmtu_wire = true\n[[guest]]\n").expect("adaptive");
        assert_eq!(
            cfg.driver.lro.map(|l| l.flushing),
            Some(dev::lro::LroSetup::ADAPTIVE)
        );
        assert!(cfg.mtu_wire);
        let cfg = p("[nic]\nlro = \"off\"\nmulti_queue = true\n[[guest]]\n").expect("off");
        assert!(cfg.driver.lro.is_none() && cfg.driver.queues);
    }

    #[test]
    fn cable_dma_and_split_ring_keys_are_read_and_bad_values_refused() {
        assert_eq!(p("[[guest]]\n").expect("tap").cable, None);
        let cfg = p("[nic]\ncable = \"veth-pv0\"\n[[guest]]\n").expect("cable");
        assert_eq!(cfg.cable.as_deref(), Some("veth-pv0"));
        assert!(!cfg.guest().front.split_ring);
        let two = p("[[guest]]\nsplit_ring = true\n[[guest]]\n").expect("split ring");
        assert!(two.guests[0].front.split_ring && !two.guests[1].front.split_ring);
        assert_eq!(cfg.dma_landing, hv::iommu::DmaLanding::Cache);
        let cfg = p("[nic]\ndma = \"memory\"\n[[guest]]\n").expect("2008's NIC");
        assert_eq!(cfg.dma_landing, hv::iommu::DmaLanding::Memory);
        let e = p("[nic]\ndma = \"l3\"\n[[guest]]\n").expect_err("no such landing");
        assert!(e.to_string().contains("nic.dma"), "{e}");
        for bad in ["", "a/b", "has space", "sixteen-chars-xx", ".."] {
            let e = p(&format!("[nic]\ncable = {bad:?}\n[[guest]]\n"))
                .expect_err("a bad interface name");
            assert!(e.to_string().contains("nic.cable"), "{bad:?}: {e}");
        }
    }

    /// A named value is read by its type's own names; one it does not have is refused
    /// at its line with every name it takes, and the paper's unsafe stand-in, which
    /// has a name, is refused for `pvio up`.
    #[test]
    fn named_values_are_the_types_own_names_and_others_are_refused_with_the_choices() {
        let cfg = p(
            "[hypervisor]\ngrant_path = \"optimised\"\n[[guest]]\nrx_buffers = \"guest-copy\"\n",
        )
        .expect("named");
        assert_eq!(cfg.grant_path, hv::GrantPath::Optimised);
        assert_eq!(cfg.guest().front.rx_buffers, RxBuffers::GuestCopy);
        let e = p("[[guest]]\n\nrx_buffers = \"pages\"\n").expect_err("no such buffers");
        let e = e.to_string();
        assert!(e.contains(":3:") && e.contains("guest.rx_buffers"), "{e}");
        assert!(e.contains("fragments, linear, guest-copy"), "{e}");
        let e = p("[svnic]\nsignal = \"msi\"\n[[guest]]\n").expect_err("no such signal");
        assert!(e.to_string().contains("register, sidecore, per-vif"), "{e}");
        let e = p("[[guest]]\ngrants = \"machine-frames-unsafe\"\n").expect_err("unsafe");
        assert!(e.to_string().contains("unsafe stand-in"), "{e}");
    }

    #[test]
    fn an_svnic_table_puts_the_self_virtualized_nic_in_the_driver_domains_place() {
        use dev::svnic::device::{Idle, SignalMode};
        assert!(p("[[guest]]\n").expect("pv").svnic.is_none());
        let cfg = p(r#"
[svnic]
signal = "sidecore"
idle = "dynamic"
schedule = "quality-aware"
iommu = true
[[guest]]
priority = 90
[[guest]]
"#)
        .expect("svnic");
        let sv = cfg.svnic.expect("an SV-NIC");
        assert_eq!(sv.signal, SignalMode::Sidecore);
        assert_eq!(sv.idle, Idle::Block { spin: SVNIC_SPIN });
        assert_eq!(sv.schedule, dev::svnic::engine::Schedule::Priority);
        assert!(sv.iommu);
        assert_eq!(cfg.guests[0].priority, Some(90));
        assert_eq!(cfg.guests[1].priority, None);
        let d = p("[svnic]\n[[guest]]\n")
            .expect("defaults")
            .svnic
            .expect("SV-NIC");
        assert_eq!((d.signal, d.idle), (SignalMode::IdRegister, Idle::Poll));
    }

    #[test]
    fn each_guest_table_is_a_guest_with_its_own_defaults() {
        let cfg = p(r#"
[[guest]]
[[guest]]
name = "b"
grants = "reuse"
core = 3
"#)
        .expect("two guests");
        assert_eq!(cfg.guests.len(), 2);
        assert_eq!(cfg.guests[0], UpGuest::nth(0));
        let b = &cfg.guests[1];
        assert_eq!(
            (b.name.as_str(), b.ns.as_str(), b.addr.as_str()),
            ("b", "pvio-guest2", "10.77.0.3/24")
        );
        assert!(
            b.front.grants == net::netfront::Grants::Reuse && b.front.offloads && b.core == Some(3)
        );
    }

    #[test]
    fn a_bad_file_is_refused_with_the_key_and_its_line() {
        for (text, key, line) in [
            ("[[guest]]\nspeed = 3\n", "speed", 2),
            (
                "[nic]\ncoalesce_packets = \"six\"\n[[guest]]\n",
                "coalesce_packets",
                2,
            ),
            (
                "[nic]\n\ncoalesce_packets = 0\n[[guest]]\n",
                "nic.coalesce_packets",
                3,
            ),
            (
                "[hypervisor]\ngrant_version = 3\n[[guest]]\n",
                "hypervisor.grant_version",
                2,
            ),
            (
                "[hypervisor]\n\ncpus = [0, 0]\n[[guest]]\n",
                "hypervisor.cpus",
                3,
            ),
            ("[hypervisor]\ncpus = []\n[[guest]]\n", "hypervisor.cpus", 2),
            (
                "[hypervisor]\ncpus = [100000]\n[[guest]]\n",
                "hypervisor.cpus",
                2,
            ),
            (
                "[[guest]]\ntap = { address = \"10.1.0.300/24\" }\n",
                "guest.tap.address",
                2,
            ),
            (
                "[[guest]]\n[[guest]]\ntap = { namespace = \"pvio-guest\" }\n",
                "guest.tap.namespace",
                3,
            ),
            (
                "[[guest]]\n[[guest]]\ntap = { address = \"10.77.0.2/16\" }\n",
                "guest.tap.address",
                3,
            ),
            (
                "[[guest]]\nname = \"a\"\n[[guest]]\nname = \"a\"\n",
                "guest.name",
                4,
            ),
            ("[[guest]]\nname = \"driver\"\n", "guest.name", 2),
            ("[[guest]]\ncore = -1\n", "core", 2),
            ("[driver]\nnetfilter = true\n", "guest", 0),
            ("[[guest]]\ngrants = \"machine-frames\"\n", "grants", 2),
            ("[nic]\nlro = \"sometimes\"\n[[guest]]\n", "lro", 2),
            (
                "[nic]\nlro = \"delayed\"\nlro_flush_every = 0\n[[guest]]\n",
                "nic.lro_flush_every",
                3,
            ),
            (
                "[nic]\nmulti_queue = true\nlro = \"adaptive\"\n[[guest]]\n",
                "nic.lro",
                3,
            ),
            ("[svnic]\nsignal = \"smoke\"\n[[guest]]\n", "signal", 2),
            (
                "[nic]\nlro = \"adaptive\"\n[svnic]\n[[guest]]\n",
                "svnic",
                3,
            ),
            ("[svnic]\n[[guest]]\npriority = 0\n", "guest.priority", 3),
            ("[[guest]]\npriority = 50\n", "guest.priority", 2),
        ] {
            let e = p(text).expect_err(text).to_string();
            assert!(e.contains(key), "{text:?}: {e}");
            if line > 0 {
                assert!(
                    e.contains(&format!("m.toml:{line}:")) || e.contains(&format!("line {line}")),
                    "{text:?}: the line in {e}"
                );
            }
        }
    }

    #[test]
    fn a_disk_table_gives_a_block_guest_and_a_bad_one_is_refused_at_its_key() {
        let cfg = p(r#"
[[guest]]

[[disk]]
name = "db"
file = "/dev/shm/x.img"
persistent = false
job = { op = "write", pattern = "random", bytes = 8192, depth = 8 }

[[disk]]
aoe = { shelf = 1, slot = 2 }
"#)
        .expect("a good file");
        assert_eq!(cfg.disks.len(), 2);
        let (a, b) = (&cfg.disks[0], &cfg.disks[1]);
        assert_eq!(a.name, "db");
        assert!(
            matches!(&a.disk, kernel::machine::Disk::File(p) if p == Path::new("/dev/shm/x.img"))
        );
        assert!(!a.persistent && a.random && a.op == kernel::block::JobOp::Write);
        assert_eq!((a.bytes, a.depth), (8192, 8));
        assert_eq!(b.name, "disk2");
        assert!(matches!(
            b.disk,
            kernel::machine::Disk::Aoe { major: 1, minor: 2 }
        ));
        assert_eq!(
            (b.bytes, b.depth, b.op),
            (4096, 1, kernel::block::JobOp::Read)
        );
        for (text, key) in [
            ("[[guest]]\n[[disk]]\n", "`disk`"),
            (
                "[[guest]]\n[[disk]]\nfile = \"f\"\naoe = { shelf = 1, slot = 1 }\n",
                "`disk`",
            ),
            (
                "[[guest]]\n[[disk]]\nfile = \"f\"\njob = { bytes = 1000 }\n",
                "`disk.job.bytes`",
            ),
            (
                "[[guest]]\n[[disk]]\nfile = \"f\"\njob = { depth = 33 }\n",
                "`disk.job.depth`",
            ),
            (
                "[[guest]]\n[[disk]]\nname = \"guest\"\nfile = \"f\"\n",
                "`disk.name`",
            ),
            (
                "[[guest]]\n[[disk]]\nfile = \"f\"\nread_only = true\njob = { op = \"write\" }\n",
                "`disk.job.op`",
            ),
            (
                "[svnic]\n[[guest]]\n[[disk]]\nfile = \"f\"\n",
                "`disk.file`",
            ),
        ] {
            let e = p(text).expect_err(text).to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn the_example_machines_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../machines");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).expect("machines/") {
            let path = e.expect("entry").path();
            if path.extension().is_some_and(|x| x == "toml") {
                load(&path).unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n > 0, "no example in {}", dir.display());
    }
}
