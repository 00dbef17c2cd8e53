//! `pvio backend`: pvio's netback and blkback serving a real Xen's guests from a dom0
//! process, as QEMU's `xen_nic` and `xen_disk` serve them from dom0's user space.
//!
//! The back ends are the lab's own ([`net::netback::Vif`], [`blk::blkback::Blkback`]),
//! over [`hv::xen::Dom0`]: grants through `/dev/xen/gntdev`, event channels through
//! `/dev/xen/evtchn`, the store through xenstored. The main thread watches the store;
//! each connected vif (its queues and its interface, `vif`) and each vbd queue
//! ([`blk::unit`]) is a unit of pvio's own scheduler on pCPU threads of the back end's
//! ([`Options::cpus`]), woken by its port (a vif also by its interface), each step
//! bounded by its budgets. The ports that fired are read on pCPU 0 by a unit of its own
//! (`upcall`), which wakes each port's unit there. A disk's system calls hold only the
//! pCPU they run on: never the store, or a device on another pCPU.
//!
//! **How a device reaches it.** `xl` writes a vif's or a vbd's back-end directory under
//! `/local/domain/<this domain>/backend/{vif,vbd}/<guest>/<device>`, where Linux's
//! `xen-netback` and `xen-blkback` would find it; with those modules unloaded, nothing
//! but pvio watches there. For a vif, pvio creates the interface the kernel's netback
//! would have made, a TAP named `vif<guest>.<device>`, before it answers `InitWait`, so
//! `xl`'s own hotplug script (`vif-bridge`) adds it to the bridge unchanged. For a vbd,
//! the `block` script resolves the disk as usual and pvio opens `params` (a file or a
//! block device such as a loop device).
//!
//! **What it trusts.** Nothing a guest wrote: the back ends check every ring index,
//! grant reference and request as they do in the lab, and a protocol break disconnects
//! that device alone. A back-end directory whose `frontend-id` or `frontend` does not
//! name the guest and device of its own path, or that names this domain, is refused and
//! counted; a device this process was not handed (another domain's directory) is never
//! looked at.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::blkback::{self, Blkback, Bounce};
use blk::disk::FileDisk;
use blk::unit::Queue;
use dev::tap::TapPort;
use hv::sched::{CpuPlan, IdlePolicy, Scheduler, HALT_POLL_DEFAULT};
use hv::store::{StoreError, XenStore, XenbusState};
use hv::xen::{Dom0, Dom0Config};
use hv::{DomId, Xen};
use mem::poll::PollFd;
use net::netback::{self, Vif, VIF_WINDOW_SLOTS};
use net::skb::SkbPool;

mod upcall;
mod vif;
use upcall::{Route, Upcall};
use vif::{NetUnit, Pool};

/// vifs one process serves at once unless told otherwise ([`Options::max_vifs`]).
pub const MAX_VIFS: usize = 64;
/// vbds one process serves at once unless told otherwise ([`Options::max_vbds`]).
pub const MAX_VBDS: usize = 64;
/// Packet buffers and their pages (the process's own memory), shared out among the
/// pCPUs.
const BUFFERS: usize = 2048;
const POOL_PAGES: usize = 8192;
/// The longest wait for an event (the store is rescanned, the metrics written, at most
/// this late).
const IDLE_WAIT: Duration = Duration::from_millis(200);
/// Rescans of the store when no watch fired, in case one was lost.
const RESCAN: Duration = Duration::from_secs(2);

/// Who does a vif's hotplug work: putting its interface on the bridge its directory
/// names and bringing it up, then saying so (`hotplug-status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Hotplug {
    /// pvio in a driver domain, the toolstack's scripts in dom0.
    #[default]
    Auto,
    /// pvio itself, as `xl devd` would run `vif-bridge` in a driver domain: nothing else
    /// needs to run there.
    Pvio,
    /// The toolstack's hotplug scripts (`xl` runs `vif-bridge` in dom0; `xl devd` in a
    /// driver domain).
    Scripts,
}

/// Whether a vbd's disk is reached through this domain's page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DiskCache {
    /// Direct in a driver domain, cached in dom0. A driver domain's page cache dies with
    /// the domain (destroyed, crashed, created again): a write answered from it would be
    /// lost after the guest was told it was written. dom0's outlives every back end.
    #[default]
    Auto,
    /// `O_DIRECT`: a write answered has reached the disk's own queue.
    Direct,
    /// Through the page cache (a guest's flush writes it out).
    Cached,
}

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// This domain's id under Xen (0: dom0); `None` asks the store (`domid` under the
    /// domain's own directory), as a driver domain learns its id.
    pub domid: Option<u16>,
    /// Who puts a vif's interface on its bridge.
    pub hotplug: Hotplug,
    /// Where to write what happens to each device (stderr if none), appended to, at
    /// most [`LOG_LIMIT`] bytes a process.
    pub log: Option<std::path::PathBuf>,
    /// Write every device's counters to this file every [`METRICS_EVERY`], in
    /// Prometheus' text format (for node_exporter's textfile collector, or any scraper):
    /// one line per counter, labelled with the guest and device.
    pub metrics: Option<std::path::PathBuf>,
    /// vifs this process serves at once: each takes address space for its window slots
    /// (about 6 MiB, reserved, not backed), nothing else until it connects.
    pub max_vifs: usize,
    /// vbds this process serves at once (about 33 MiB of reserved address space each,
    /// four queues' slots).
    pub max_vbds: usize,
    /// Close every device when stopping. Without it a stop hands each vif and vbd over
    /// to the next `pvio backend` (its front end stays `Connected`, a vif's interface
    /// stays on its bridge; the journals under `/run` say where each ring was), as an
    /// upgrade or `systemctl restart` needs.
    pub close: bool,
    /// pCPUs (threads pinned to this domain's first cores) the devices run on, each vif
    /// and vbd queue a unit placed on the least loaded; 0: [`default_cpus`]. They
    /// halt-poll only if a core is left over for the main thread ([`idle_policy`]).
    pub cpus: usize,
    /// Move each vbd's bytes synchronously, one request after another on its pCPU,
    /// instead of through an io_uring of each queue's own ([`Blkback::disk_async`]):
    /// for a kernel that refuses io_uring, or to compare.
    pub sync_disk: bool,
    /// Whether each vbd's disk is opened `O_DIRECT` ([`DiskCache`]).
    pub disk_cache: DiskCache,
    /// Grants each vbd queue keeps mapped at most (Linux's blkback's
    /// `max_persistent_grants`; [`blkback::PERSISTENT_MAX`] by default, at most
    /// [`blkback::PERSISTENT_LIMIT`]). A segment whose grant is not kept is copied
    /// through the back end's pages, its request moved synchronously on its pCPU; each
    /// one kept costs a window slot (4 KiB of address space, reserved, not backed) and
    /// one of Xen's maptrack entries while mapped.
    pub persistent_grants: usize,
}

/// Grants a vbd queue keeps mapped unless told otherwise ([`Options::persistent_grants`]).
pub const PERSISTENT_GRANTS: usize = blkback::PERSISTENT_MAX;
/// The most it may be told.
pub const PERSISTENT_GRANTS_LIMIT: usize = blkback::PERSISTENT_LIMIT;

/// pCPUs the devices run on unless told otherwise: at most this many.
pub const MAX_CPUS: usize = 4;

/// pCPUs by default on a domain of `cores` cores: one per core but one, left to the main
/// thread that routes the event channels (at least one, at most [`MAX_CPUS`]).
pub fn default_cpus(cores: usize) -> usize {
    cores.saturating_sub(1).clamp(1, MAX_CPUS)
}

/// How an idle pCPU of the back end waits when the domain has a core to spare for the
/// main thread: adaptive halt-polling (KVM's rule), which spins only while wake-ups come
/// soon after it went idle and otherwise sleeps. With no core to spare (a domain of one
/// vCPU, dom0's under the interop run) it sleeps at once ([`idle_policy`]).
const HALT_POLL: IdlePolicy = IdlePolicy::AdaptiveHaltPoll(HALT_POLL_DEFAULT);

/// The pCPUs' idle policy for `cpus` pCPUs on a domain of `cores` cores. A pCPU that
/// spins on a core the domain has no other of holds off every thread its devices' work
/// passes through (the store's, the kernel's bridge and loop-device threads, the
/// guests' own traffic ends in dom0), until the host's scheduler preempts it, so it
/// halt-polls only when a core is left over. (Before the upcall ran on pCPU 0 it held
/// off its own wake-ups too: the main thread read the event channels.)
pub fn idle_policy(cpus: usize, cores: usize) -> IdlePolicy {
    if cores > cpus {
        HALT_POLL
    } else {
        IdlePolicy::Block
    }
}

/// Why the back end stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Xen device or the store could not be opened (not running on Xen?).
    #[error("opening Xen's devices: {0}")]
    Open(#[from] std::io::Error),
    /// The store connection failed.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// The packet buffers could not be made.
    #[error("packet buffers: {0}")]
    Pool(String),
    /// The event channels could no longer be read.
    #[error("event channels: {0}")]
    Events(String),
}

/// What happened, counted (printed to the log as it goes, and returned at the end).
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// Back-end directories refused (their keys do not match their path).
    pub refused_dirs: u64,
    /// Devices connected (each connection after a reconnection counts again).
    pub connected: u64,
    /// Connections refused by the back end's checks.
    pub connect_errors: u64,
    /// Devices disconnected for a protocol break.
    pub broken: u64,
    /// Frames written to a vif's interface.
    pub frames_out: u64,
    /// Frames read from a vif's interface and queued for its guest.
    pub frames_in: u64,
    /// Frames dropped for want of a buffer, or too long.
    pub frames_dropped: u64,
    /// Devices taken over from a back end that left them `Connected` (a restart).
    pub resumed: u64,
    /// Packet-buffer release tokens a vif's unit found that named another vif (none is
    /// expected: every packet is copied, no buffer holds a guest's page).
    pub stray_tokens: u64,
    /// Event-channel ports read as they fired (a guest's notifications).
    pub events: u64,
    /// Ports that fired while no unit was routed (a device connecting or going).
    pub events_unrouted: u64,
    /// Reads or unmasks of the event-channel device that failed.
    pub event_errors: u64,
}

type X = Arc<Dom0>;

struct NetDev {
    fe: DomId,
    handle: u32,
    index: u16,
    /// Found Connected both ends: taken over, not connected afresh.
    resume: bool,
    /// Its interface, while no unit moves its packets.
    tap: Option<TapPort>,
    ifname: String,
    /// Connected: its queues (one vif each, with its own rings and channels,
    /// [`Vif::connect_queues`]) and its interface, as a unit on a pCPU.
    unit: Option<NetUnit<X>>,
    seen: bool,
}

struct BlkDev {
    fe: DomId,
    devid: u32,
    index: u16,
    /// Found Connected both ends: taken over, not connected afresh.
    resume: bool,
    /// Its queues, connected (none while not), each a unit on a pCPU.
    queues: Vec<Queue<X>>,
    seen: bool,
}

/// How often `--metrics` rewrites its file.
pub const METRICS_EVERY: Duration = Duration::from_secs(5);

/// Appends one device's (or one queue's) counters to `out` in Prometheus' text format:
/// `pvio_backend_<kind>_<counter>{domid="<guest>",devid="<device>"[,queue="<n>"]} <value>`, every
/// counter of its set, zero or not, so that a scraper sees each from the first write.
pub fn metrics_lines(
    out: &mut String,
    kind: &str,
    fe: DomId,
    devid: u32,
    queue: Option<u32>,
    set: &impl hv::counters::CounterSet,
) {
    set.visit(&mut |name, v| {
        // A per-reason counter is `<field> <Reason>`: the reason becomes a label.
        let (name, reason) = match name.split_once(' ') {
            Some((n, r)) => (n, Some(r)),
            None => (name, None),
        };
        let _ = write!(
            out,
            "pvio_backend_{kind}_{name}{{domid=\"{}\",devid=\"{devid}\"",
            fe.0
        );
        if let Some(q) = queue {
            let _ = write!(out, ",queue=\"{q}\"");
        }
        if let Some(r) = reason {
            let _ = write!(out, ",reason=\"{r}\"");
        }
        let _ = writeln!(out, "}} {v}");
    });
}

/// Bytes the log takes before it drops further lines: a guest that reconnects in a loop
/// (each connection a few lines) cannot grow it without bound.
pub const LOG_LIMIT: u64 = 16 << 20;

/// What happens to each device, one timestamped line each, up to a bound in bytes.
struct Log {
    out: Box<dyn std::io::Write + Send>,
    start: Instant,
    limit: u64,
    written: u64,
    /// Lines dropped once the bound was reached.
    dropped: u64,
}

impl Log {
    fn new(out: Box<dyn std::io::Write + Send>, limit: u64) -> Self {
        Self {
            out,
            start: Instant::now(),
            limit,
            written: 0,
            dropped: 0,
        }
    }

    /// Writes one line, or, past the bound, counts it dropped (the first drop says so
    /// in one last line).
    fn line(&mut self, s: &str) {
        let line = format!("[{:>8.3}] {s}\n", self.start.elapsed().as_secs_f64());
        if self.written + line.len() as u64 > self.limit {
            if self.dropped == 0 {
                let _ = writeln!(
                    self.out,
                    "log limit of {} bytes reached: further lines are dropped and counted",
                    self.limit
                );
            }
            self.dropped += 1;
            return;
        }
        self.written += line.len() as u64;
        let _ = self.out.write_all(line.as_bytes());
        let _ = self.out.flush();
    }
}

/// The back end: its devices and what they share.
struct Backend {
    xen: X,
    me: DomId,
    /// Each pCPU's packet buffers, shared by the vifs placed there.
    pools: Vec<Pool>,
    vifs: BTreeMap<(u16, u32), NetDev>,
    vbds: BTreeMap<(u16, u32), BlkDev>,
    /// Directories refused or that could not be taken (kind, guest, device): not
    /// looked at again while they stay.
    refused: BTreeSet<(&'static str, u16, u32)>,
    /// What the loop waits on, made again in place each pass (no allocation).
    fds: Vec<PollFd>,
    counts: Counts,
    log: Log,
    /// Close devices on stop (`--close`), instead of handing them over.
    close: bool,
    /// Each vbd queue moves its disk's bytes synchronously (`--sync-disk`).
    sync_disk: bool,
    /// Each vbd's disk opened `O_DIRECT` (`--disk-cache`; by default outside dom0).
    direct_disk: bool,
    /// Grants each vbd queue keeps mapped at most (`--persistent-grants`).
    persistent: usize,
    /// The pCPUs the vbd queues run on.
    sched: Arc<Scheduler>,
    /// Reads the event channels on pCPU 0 and wakes each port's unit (taken at stop).
    upcall: Option<Upcall>,
    /// Each pCPU's pages its vbd queues copy segments through (none: they map them):
    /// one request at a time runs on a pCPU, so its queues never wait for them.
    bounces: Vec<Option<Bounce>>,
    /// Whether this process does a vif's hotplug work ([`Hotplug`]).
    hotplug: bool,
    /// Devices served at once.
    max_vifs: usize,
    max_vbds: usize,
    /// Where to write the devices' counters, and when it was last written.
    metrics: Option<(std::path::PathBuf, Instant)>,
}

/// Runs until `stop` is set or the store connection fails.
pub fn run(opts: &Options, stop: &AtomicBool) -> Result<Counts, Error> {
    let me = match opts.domid {
        Some(id) => DomId(id),
        None => hv::xen::Dom0::own_id()?,
    };
    let hotplug = match opts.hotplug {
        Hotplug::Auto => me != DomId(0),
        Hotplug::Pvio => true,
        Hotplug::Scripts => false,
    };
    let (max_vifs, max_vbds) = (
        opts.max_vifs.min(u16::MAX as usize),
        opts.max_vbds.min(u16::MAX as usize),
    );
    let persistent = opts.persistent_grants.min(blkback::PERSISTENT_LIMIT);
    let vbd_slots = blkback::vbd_window_slots(persistent);
    let slots = u32::try_from(
        max_vifs as u64 * u64::from(netback::MAX_QUEUES * VIF_WINDOW_SLOTS)
            + max_vbds as u64 * u64::from(blkback::MAX_QUEUES * vbd_slots),
    )
    .map_err(|_| {
        Error::Pool(format!(
            "{max_vifs} vifs and {max_vbds} vbds: too many window slots"
        ))
    })?;
    let cpus = match opts.cpus {
        0 => default_cpus(mem::cpu::online_cores()),
        n => n.min(hv::sched::MAX_UNITS),
    };
    let xen = Arc::new(Dom0::open(Dom0Config {
        id: me,
        // The packet buffers, and each pCPU's pages its vbds' segments are copied through.
        pages: POOL_PAGES as u32
            + BUFFERS as u32
            + 64
            + cpus as u32 * u32::from(blkback::MAX_INDIRECT_SEGMENTS),
        map_slots: slots,
    })?);
    let pools = (0..cpus)
        .map(|_| {
            SkbPool::new(Arc::clone(xen.domain()), BUFFERS / cpus, POOL_PAGES / cpus)
                .map(|p| Arc::new(std::sync::Mutex::new(p)))
                .map_err(|e| Error::Pool(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let idle = idle_policy(cpus, mem::cpu::online_cores());
    let sched = Scheduler::new(&CpuPlan::first(cpus, idle), None)?;
    // Read only when it is readable, by the upcall on a pCPU ([`upcall`]).
    xen.evtchn().set_nonblocking()?;
    let upcall = Upcall::place(&sched, 0, Arc::clone(&xen))
        .map_err(|e| Error::Events(format!("placing the upcall: {e}")))?;
    let bounces = (0..cpus).map(|_| Bounce::new(xen.domain())).collect();
    let out: Box<dyn std::io::Write + Send> = match &opts.log {
        // Appended to: the process before this one (a restart) keeps its lines.
        Some(p) => Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)?,
        ),
        None => Box::new(std::io::stderr()),
    };
    let direct_disk = match opts.disk_cache {
        DiskCache::Auto => me != DomId(0),
        DiskCache::Direct => true,
        DiskCache::Cached => false,
    };
    let mut b = Backend {
        xen,
        me,
        pools,
        vifs: BTreeMap::new(),
        vbds: BTreeMap::new(),
        refused: BTreeSet::new(),
        sched,
        upcall: Some(upcall),
        bounces,
        fds: Vec::with_capacity(1),
        max_vifs,
        max_vbds,
        counts: Counts::default(),
        log: Log::new(out, LOG_LIMIT),
        close: opts.close,
        sync_disk: opts.sync_disk,
        direct_disk,
        persistent,
        hotplug,
        metrics: opts
            .metrics
            .clone()
            .map(|p| (p, Instant::now() - METRICS_EVERY)),
    };
    let root = format!("/local/domain/{}/backend", me.0);
    b.xen.client().watch(&format!("{root}/vif"), "vif")?;
    b.xen.client().watch(&format!("{root}/vbd"), "vbd")?;
    b.log.line(&format!(
        "serving {root}/{{vif,vbd}} as domain {}; a vif's bridge joined by {}; devices on {cpus} pCPU(s) ({idle}); disk I/O {}, {}; up to {persistent} persistent grants a vbd queue",
        me.0,
        if hotplug {
            "pvio"
        } else {
            "the hotplug scripts"
        },
        if opts.sync_disk {
            "synchronous (--sync-disk)"
        } else {
            "through io_uring"
        },
        if direct_disk {
            "direct (O_DIRECT: no page cache here)"
        } else {
            "through this domain's page cache"
        }
    ));
    let mut last_scan = Instant::now() - RESCAN;
    while !stop.load(Ordering::Relaxed) {
        let mut changed = false;
        while b.xen.client().take_event().is_some() {
            changed = true;
        }
        if changed || last_scan.elapsed() >= RESCAN {
            b.scan()?;
            last_scan = Instant::now();
        }
        b.wait(IDLE_WAIT)?;
        b.write_metrics();
        if b.upcall.as_ref().is_some_and(Upcall::ended) {
            // No guest's notification would reach its device again.
            b.shutdown();
            return Err(Error::Events(
                "the upcall could not watch /dev/xen/evtchn".into(),
            ));
        }
    }
    b.shutdown();
    Ok(b.counts)
}

impl Backend {
    /// Waits for a store message (the event channels are the upcall's, on pCPU 0; a vif's
    /// interface is its unit's line, watched by its pCPU).
    fn wait(&mut self, timeout: Duration) -> Result<(), Error> {
        let fds = &mut self.fds;
        fds.clear();
        fds.push(PollFd::readable(self.xen.store_fd()));
        mem::poll::wait(fds, Some(timeout))?;
        if fds[0].ready() {
            self.xen.client().receive_event()?;
        }
        Ok(())
    }

    /// Gives the upcall every connected device's ports: each vif's channels and each
    /// vbd queue's, routed to its unit ([`Upcall::reroute`]).
    fn reroute(&mut self) {
        let Some(up) = &self.upcall else {
            return;
        };
        let mut routes: Vec<Route> = self
            .vifs
            .values()
            .filter_map(|d| d.unit.as_ref())
            .flat_map(NetUnit::routes)
            .collect();
        for q in self.vbds.values().flat_map(|d| d.queues.iter()) {
            routes.push(Route::new(q.port().0, None, q.waker(), q.unit_stats()));
        }
        up.reroute(routes);
    }

    /// Looks at every back-end directory handed to this domain: adopts new devices,
    /// connects those whose front end is ready, disconnects those closing, and lets go
    /// of those gone.
    fn scan(&mut self) -> Result<(), Error> {
        for d in self.vifs.values_mut() {
            d.seen = false;
        }
        for d in self.vbds.values_mut() {
            d.seen = false;
        }
        let mut listed = BTreeSet::new();
        for kind in ["vif", "vbd"] {
            let root = format!("/local/domain/{}/backend/{kind}", self.me.0);
            for (fe, id) in self.listed(&root)? {
                listed.insert((kind, fe.0, id));
                if !self.refused.contains(&(kind, fe.0, id)) {
                    self.adopt(kind, fe, id);
                }
            }
        }
        self.refused.retain(|k| listed.contains(k));
        let keys: Vec<_> = self.vifs.keys().copied().collect();
        for k in keys {
            self.step_vif(k);
        }
        let keys: Vec<_> = self.vbds.keys().copied().collect();
        for k in keys {
            self.step_vbd(k);
        }
        self.reroute();
        Ok(())
    }

    /// The (guest, device) pairs under `root`; names that are not numbers are skipped.
    fn listed(&mut self, root: &str) -> Result<Vec<(DomId, u32)>, Error> {
        let store = self.xen.store();
        let fes = match store.directory(self.me, root) {
            Ok(v) => v,
            Err(StoreError::NoEntry(_)) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let mut out = Vec::new();
        for fe in fes {
            let Ok(fe) = fe.parse::<u16>() else { continue };
            let ids = store
                .directory(self.me, &format!("{root}/{fe}"))
                .unwrap_or_default();
            out.extend(
                ids.iter()
                    .filter_map(|i| i.parse::<u32>().ok())
                    .map(|i| (DomId(fe), i)),
            );
        }
        Ok(out)
    }

    /// Takes a device that is new: checks its directory names itself, then offers the
    /// back end's features (a vif's interface first).
    fn adopt(&mut self, kind: &'static str, fe: DomId, id: u32) {
        let key = (fe.0, id);
        let known = match kind {
            "vif" => self.vifs.get_mut(&key).map(|d| d.seen = true).is_some(),
            _ => self.vbds.get_mut(&key).map(|d| d.seen = true).is_some(),
        };
        if known {
            return;
        }
        let (bdir, fdir) = match kind {
            "vif" => (
                net::xenbus::backend_dir(self.me, fe, id),
                net::xenbus::frontend_dir(fe, id),
            ),
            _ => (
                blk::xenbus::backend_dir(self.me, fe, id),
                blk::xenbus::frontend_dir(fe, id),
            ),
        };
        let store = self.xen.store();
        let named_fe = store.read(self.me, &format!("{bdir}/frontend-id")).ok();
        let named_dir = store.read(self.me, &format!("{bdir}/frontend")).ok();
        if let Err(why) = check_names(
            self.me,
            fe,
            &fdir,
            named_fe.as_deref(),
            named_dir.as_deref(),
        ) {
            self.counts.refused_dirs += 1;
            self.log
                .line(&format!("{kind} {}/{id}: refused: {why}", fe.0));
            self.refused.insert((kind, fe.0, id));
            return;
        }
        // A directory left Connected by a back end that is gone (this process, killed
        // and started again): closed first, so that the front end starts over.
        let bstate = store.xenbus_state(self.me, &bdir);
        let fstate = store.xenbus_state(self.me, &fdir);
        // A device both of whose ends are still Connected is taken over where the back
        // end before left it (`Blkback::resume`, `Vif::resume`): Linux's blkfront cannot
        // reconnect once closed, and a vif's guest would see its link go.
        let resume = bstate == XenbusState::Connected && fstate == XenbusState::Connected;
        if resume {
            self.log.line(&format!(
                "{kind} {}/{id}: found Connected both ends: resuming it",
                fe.0
            ));
        } else if !matches!(bstate, XenbusState::Initialising | XenbusState::Unknown) {
            self.log.line(&format!(
                "{kind} {}/{id}: found in state {bstate:?}: closing it first",
                fe.0
            ));
            let _ = store.switch_state(self.me, &bdir, XenbusState::Closing);
        }
        let _ = self.xen.client().watch(&format!("{fdir}/state"), "fe");
        let taken = match kind {
            "vif" => self.adopt_vif(fe, id, bstate, resume),
            _ => self.adopt_vbd(fe, id, bstate, resume),
        };
        if !taken {
            self.refused.insert((kind, fe.0, id));
        }
    }

    /// Whether the vif was taken.
    fn adopt_vif(&mut self, fe: DomId, handle: u32, bstate: XenbusState, resume: bool) -> bool {
        let max = self.max_vifs;
        let Some(index) = (0..max as u16).find(|i| self.vifs.values().all(|d| d.index != *i))
        else {
            self.log.line(&format!(
                "vif {}/{handle}: refused: {max} vifs already",
                fe.0
            ));
            return false;
        };
        let want = format!("vif{}.{handle}", fe.0);
        let tap = mem::tap::open_tap_offload(&want, mem::tap::TapOffload::CsumTso).and_then(
            |(f, name)| {
                // One frame a call until batched I/O has run under a real Xen.
                let io = dev::tap::EdgeIo::Plain;
                Ok((
                    TapPort::start_io(f, mem::tap::TapOffload::CsumTso, io)?,
                    name,
                ))
            },
        );
        let (tap, ifname) = match tap {
            Ok(t) => t,
            Err(e) => {
                self.log
                    .line(&format!("vif {}/{handle}: no interface {want}: {e}", fe.0));
                return false;
            }
        };
        // The interface outlives this process, so that it stays on its bridge (where the
        // hotplug script put it) for the next back end to take over; it goes when the
        // device does, or on a stop with `--close`.
        if let Err(e) = mem::tap::set_persist(&tap, true) {
            self.log.line(&format!(
                "vif {}/{handle}: {ifname} cannot outlive this process ({e}): a restart will drop it from its bridge",
                fe.0
            ));
        }
        if self.hotplug {
            self.hotplug_vif(fe, handle, &ifname);
        }
        if bstate == XenbusState::Initialising || bstate == XenbusState::Unknown {
            if let Err(e) =
                netback::probe_queues(self.xen.store(), self.me, fe, handle, netback::MAX_QUEUES)
            {
                self.log.line(&format!("vif {}/{handle}: probe: {e}", fe.0));
            }
        }
        self.log.line(&format!(
            "vif {}/{handle}: interface {ifname}, offered: {}",
            fe.0,
            offered(&net::xenbus::BACKEND_FEATURES)
        ));
        self.vifs.insert(
            (fe.0, handle),
            NetDev {
                fe,
                handle,
                index,
                resume,
                tap: Some(tap),
                ifname,
                unit: None,
                seen: true,
            },
        );
        true
    }

    /// What `vif-bridge` does for an interface a back end made, done here (where no
    /// script runs): the interface put on the bridge the toolstack named (`bridge`) and
    /// brought up, then `hotplug-status` written (`error`, with `hotplug-error`, if it
    /// could not be). A takeover finds the interface on its bridge already.
    fn hotplug_vif(&mut self, fe: DomId, handle: u32, ifname: &str) {
        let store = self.xen.store();
        let bdir = net::xenbus::backend_dir(self.me, fe, handle);
        let done = match store.read(self.me, &format!("{bdir}/bridge")) {
            Ok(bridge) => mem::tap::join_bridge(ifname, &bridge)
                .map(|()| format!("on bridge {bridge}"))
                .map_err(|e| format!("cannot join bridge {bridge:?}: {e}")),
            Err(_) => mem::tap::set_up(ifname)
                .map(|()| "up, on no bridge (none named)".to_string())
                .map_err(|e| format!("cannot bring it up: {e}")),
        };
        let status = match &done {
            Ok(_) => "connected",
            Err(e) => {
                let _ = store.write(self.me, &format!("{bdir}/hotplug-error"), e);
                "error"
            }
        };
        let _ = store.write(self.me, &format!("{bdir}/hotplug-status"), status);
        let (Ok(what) | Err(what)) = done;
        self.log
            .line(&format!("vif {}/{handle}: {ifname} {what}", fe.0));
    }

    /// Whether the vbd was taken.
    fn adopt_vbd(&mut self, fe: DomId, devid: u32, bstate: XenbusState, resume: bool) -> bool {
        let max = self.max_vbds;
        let Some(index) = (0..max as u16).find(|i| self.vbds.values().all(|d| d.index != *i))
        else {
            self.log.line(&format!(
                "vbd {}/{devid}: refused: {max} vbds already",
                fe.0
            ));
            return false;
        };
        if bstate == XenbusState::Initialising || bstate == XenbusState::Unknown {
            match self.open_disk(fe, devid) {
                Ok((disk, _)) => {
                    if let Err(e) =
                        blkback::probe(self.xen.store(), self.me, fe, devid, &disk, true)
                    {
                        self.log.line(&format!("vbd {}/{devid}: probe: {e}", fe.0));
                    } else {
                        self.log.line(&format!(
                            "vbd {}/{devid}: {} sectors offered",
                            fe.0,
                            disk.sectors()
                        ));
                    }
                }
                Err(e) => self.log.line(&format!("vbd {}/{devid}: {e}", fe.0)),
            }
        }
        self.vbds.insert(
            (fe.0, devid),
            BlkDev {
                fe,
                devid,
                index,
                resume,
                queues: Vec::new(),
                seen: true,
            },
        );
        true
    }

    /// The disk a vbd's directory names: the block device the toolstack's hotplug
    /// script resolved (`physical-device`, as Linux's blkback opens it: a `phy:` disk, or
    /// the loop device the `block` script set up for a file), else `params` (a file or a
    /// device); `mode` r opens it read-only.
    fn open_disk(&self, fe: DomId, devid: u32) -> Result<(FileDisk, String), String> {
        let bdir = blk::xenbus::backend_dir(self.me, fe, devid);
        let store = self.xen.store();
        let path = match store.read(self.me, &format!("{bdir}/physical-device")) {
            Ok(v) => physical_device_path(&v)
                .ok_or_else(|| format!("physical-device {v:?} is not major:minor in hex"))?,
            Err(_) => store
                .read(self.me, &format!("{bdir}/params"))
                .map_err(|e| format!("no params: {e}"))?,
        };
        let ro = store
            .read(self.me, &format!("{bdir}/mode"))
            .is_ok_and(|m| m == "r");
        let p = std::path::Path::new(&path);
        // A file system that refuses O_DIRECT (tmpfs): through the page cache, and said
        // by the caller (`FileDisk::direct`).
        let disk = if self.direct_disk {
            FileDisk::open_with(p, ro, true).or_else(|_| FileDisk::open_with(p, ro, false))
        } else {
            FileDisk::open_with(p, ro, false)
        };
        disk.map(|d| (d, path.clone()))
            .map_err(|e| format!("{path}: {e}"))
    }

    fn step_vif(&mut self, key: (u16, u32)) {
        // Where it would go if it connects now: the pCPU with the fewest units.
        let pcpu = least_loaded(&self.sched, &self.vifs, &self.vbds);
        let Some(d) = self.vifs.get_mut(&key) else {
            return;
        };
        let (me, fe, handle) = (self.me, d.fe, d.handle);
        let store = self.xen.store();
        let bdir = net::xenbus::backend_dir(me, fe, handle);
        let fdir = net::xenbus::frontend_dir(fe, handle);
        let fstate = store.xenbus_state(me, &fdir);
        let bstate = store.xenbus_state(me, &bdir);
        if !d.seen {
            if let Some((queues, tap, pool)) = d.unit.take().and_then(NetUnit::take) {
                let mut pool = vif::lock(&pool);
                for v in queues {
                    v.disconnect(&mut pool);
                }
                d.tap = Some(tap);
            }
            if let Some(tap) = &d.tap {
                let _ = mem::tap::set_persist(tap, false);
            }
            let name = d.ifname.clone();
            self.vifs.remove(&key);
            for q in 0..netback::MAX_QUEUES {
                for p in vif_journal_paths(fe, handle, q) {
                    let _ = std::fs::remove_file(p);
                }
            }
            self.log.line(&format!(
                "vif {}/{handle}: directory gone; {name} removed",
                fe.0
            ));
            return;
        }
        let fresh = bstate == XenbusState::InitWait
            && matches!(fstate, XenbusState::Initialised | XenbusState::Connected);
        let connected = d.unit.is_some();
        let broken = d.unit.as_ref().is_some_and(NetUnit::broken);
        match connected {
            false if fresh || d.resume => {
                let (resume, index, xen) = (d.resume, d.index, Arc::clone(&self.xen));
                d.resume = false;
                // Queue `q` of the vif at `index`: window slots and release tokens of
                // its own.
                let at = |q: u32| {
                    let i = u32::from(index) * netback::MAX_QUEUES + q;
                    (i as u16, i * VIF_WINDOW_SLOTS)
                };
                let mut recorded = true;
                let r = if resume {
                    Vif::resume_queues(xen, fe, handle, netback::MAX_QUEUES, at, |q| {
                        let j = vif_journals(fe, handle, q).ok();
                        recorded &= j.is_some();
                        j
                    })
                } else {
                    Vif::connect_queues(xen, fe, handle, netback::MAX_QUEUES, at).map(|mut vs| {
                        for (q, v) in vs.iter_mut().enumerate() {
                            // A map here is two system calls each way: TX copies instead.
                            v.set_tx_copy(true);
                            recorded &=
                                vif_journals(fe, handle, q as u32).is_ok_and(|j| v.record_in(j));
                        }
                        vs
                    })
                };
                // Its queues and interface as a unit.
                let placed = r.map_err(|e| e.to_string()).and_then(|vs| {
                    let line = vs.first().map(|v| describe_vif(v, vs.len()));
                    let replayed: u64 = vs.iter().map(|v| v.stats().resume_replayed).sum();
                    let tap = d.tap.take().expect("an interface while not connected");
                    let pool = Arc::clone(&self.pools[pcpu % self.pools.len()]);
                    let name = format!("vif{}.{handle}", fe.0);
                    match NetUnit::place(&self.sched, pcpu, name, vs, tap, pool) {
                        Ok(u) => Ok((u, line.unwrap_or_default(), replayed)),
                        Err(u) => {
                            let vif::Unplaced { why, queues, tap } = *u;
                            d.tap = Some(tap);
                            let mut pool = vif::lock(&self.pools[pcpu % self.pools.len()]);
                            for v in queues {
                                v.disconnect(&mut pool);
                            }
                            Err(format!("cannot be placed: {why}"))
                        }
                    }
                });
                match placed {
                    Ok((u, what, replayed)) => {
                        let line = format!(
                            "vif {}/{handle}: {} ({what} on pCPU {}): {}{}",
                            fe.0,
                            if resume { "resumed" } else { "connected" },
                            u.pcpu(),
                            negotiated(store, me, &fdir),
                            if recorded {
                                String::new()
                            } else {
                                "; no journal: a restart will not take it over".into()
                            }
                        );
                        if resume {
                            self.log.line(&format!(
                                "vif {}/{handle}: responses replayed from the journals: {replayed}",
                                fe.0,
                            ));
                        }
                        d.unit = Some(u);
                        self.counts.connected += 1;
                        self.counts.resumed += u64::from(resume);
                        self.log.line(&line);
                    }
                    Err(e) => {
                        self.counts.connect_errors += 1;
                        self.log.line(&format!(
                            "vif {}/{handle}: {} refused: {e}",
                            fe.0,
                            if resume { "takeover" } else { "connect" }
                        ));
                        let _ = store.switch_state(me, &bdir, XenbusState::Closing);
                    }
                }
            }
            true if broken
                || matches!(
                    fstate,
                    XenbusState::Closing | XenbusState::Closed | XenbusState::Unknown
                ) =>
            {
                // One queue broken by its front end closes the whole vif, as Linux's
                // netback does.
                let Some(u) = d.unit.take() else { return };
                add_counted(&mut self.counts, u.counted());
                if let Some((queues, tap, pool)) = u.take() {
                    d.tap = Some(tap);
                    let why = queues.iter().find_map(|v| v.disabled());
                    if matches!(
                        why,
                        Some(netback::Disabled::Fatal(_) | netback::Disabled::RingBroken)
                    ) || (broken && why.is_none())
                    {
                        self.counts.broken += 1;
                    }
                    let mut pool = vif::lock(&pool);
                    for (q, v) in queues.into_iter().enumerate() {
                        let stats = v.stats().clone();
                        v.disconnect(&mut pool);
                        self.log.line(&format!(
                            "vif {}/{handle}: queue {q} disconnected ({why:?}, front end {fstate:?}); {stats:?}",
                            fe.0
                        ));
                    }
                }
                let _ = store.switch_state(me, &bdir, XenbusState::Closed);
            }
            false
                if matches!(bstate, XenbusState::Closing)
                    && matches!(
                        fstate,
                        XenbusState::Closing
                            | XenbusState::Closed
                            | XenbusState::Initialising
                            | XenbusState::Unknown
                    ) =>
            {
                let _ = store.switch_state(me, &bdir, XenbusState::Closed);
            }
            // The front end starts over (a guest reconnecting after this back end
            // closed): offer again.
            false
                if matches!(bstate, XenbusState::Closed)
                    && fstate == XenbusState::Initialising
                    && netback::probe_queues(store, me, fe, handle, netback::MAX_QUEUES)
                        .is_ok() =>
            {
                self.log
                    .line(&format!("vif {}/{handle}: offered again", fe.0));
            }
            false => self.remove_if_offline("vif", fe, handle, &bdir, bstate),
            true => {}
        }
    }

    /// What `xl devd` does in a driver domain once the toolstack has taken a device away
    /// (its `online` 0) and this end has closed it: the device's directory removed, which
    /// the toolstack in dom0 waits for (it removes a dom0 back end's itself). Only when
    /// this process does the hotplug work ([`Hotplug`]).
    fn remove_if_offline(
        &mut self,
        kind: &str,
        fe: DomId,
        id: u32,
        bdir: &str,
        bstate: XenbusState,
    ) {
        let store = self.xen.store();
        if self.hotplug
            && bstate == XenbusState::Closed
            && store
                .read(self.me, &format!("{bdir}/online"))
                .is_ok_and(|v| v == "0")
            && store.rm(self.me, bdir).is_ok()
        {
            self.log.line(&format!(
                "{kind} {}/{id}: taken offline by the toolstack: its directory removed",
                fe.0
            ));
        }
    }

    fn step_vbd(&mut self, key: (u16, u32)) {
        let Some(d) = self.vbds.get(&key) else { return };
        let (me, fe, devid, seen, resume) = (self.me, d.fe, d.devid, d.seen, d.resume);
        let bdir = blk::xenbus::backend_dir(me, fe, devid);
        let fdir = blk::xenbus::frontend_dir(fe, devid);
        let fstate = self.xen.store().xenbus_state(me, &fdir);
        let bstate = self.xen.store().xenbus_state(me, &bdir);
        let connected = !d.queues.is_empty();
        if !seen {
            if let Some(d) = self.vbds.remove(&key) {
                for q in d.queues {
                    if let Some(b) = q.take() {
                        b.disconnect();
                    }
                }
            }
            for q in 0..blkback::MAX_QUEUES {
                let _ = std::fs::remove_file(journal_path(fe, devid, q));
            }
            self.log
                .line(&format!("vbd {}/{devid}: directory gone", fe.0));
            return;
        }
        let fresh = bstate == XenbusState::InitWait
            && matches!(fstate, XenbusState::Initialised | XenbusState::Connected);
        if !connected && (fresh || resume) {
            self.connect_vbd(key, resume);
            return;
        }
        let closing = matches!(
            fstate,
            XenbusState::Closing | XenbusState::Closed | XenbusState::Unknown
        );
        // A queue broken by its front end, or whose unit ended under it (a step that
        // panicked): the device is disconnected.
        let broken = self.vbds.get(&key).and_then(|d| {
            d.queues.iter().find_map(|q| {
                if q.broken() {
                    Some("its front end broke the protocol")
                } else if q.ended() {
                    Some("its unit ended")
                } else {
                    None
                }
            })
        });
        if connected && (closing || broken.is_some()) {
            if broken.is_some() {
                self.counts.broken += 1;
            }
            let queues = self
                .vbds
                .get_mut(&key)
                .map(|d| std::mem::take(&mut d.queues))
                .unwrap_or_default();
            for (n, q) in queues.into_iter().enumerate() {
                let Some(b) = q.take() else { continue };
                let stats = b.stats().clone();
                let why = b.broken();
                b.disconnect();
                self.log.line(&format!(
                    "vbd {}/{devid}: queue {n} disconnected ({}, front end {fstate:?}); {stats:?}",
                    fe.0,
                    why.map_or(broken.unwrap_or("closing").to_string(), |w| format!(
                        "{w:?}"
                    ))
                ));
            }
        } else if !connected && bstate == XenbusState::Closing && closing {
            let _ = self
                .xen
                .store()
                .switch_state(me, &bdir, XenbusState::Closed);
        } else if !connected && bstate == XenbusState::Closed && fstate == XenbusState::Initialising
        {
            if let Ok((disk, _)) = self.open_disk(fe, devid) {
                if blkback::probe(self.xen.store(), me, fe, devid, &disk, true).is_ok() {
                    self.log
                        .line(&format!("vbd {}/{devid}: offered again", fe.0));
                }
            }
        } else if !connected {
            self.remove_if_offline("vbd", fe, devid, &bdir, bstate);
        }
    }

    /// Connects every queue of a vbd whose front end is ready, or takes them over where
    /// the back end before left them (`resume`), each queue recording in its journal.
    fn connect_vbd(&mut self, key: (u16, u32), resume: bool) {
        let Some(d) = self.vbds.get(&key) else { return };
        let (me, fe, devid, index) = (self.me, d.fe, d.devid, d.index);
        let (bdir, fdir) = (
            blk::xenbus::backend_dir(me, fe, devid),
            blk::xenbus::frontend_dir(fe, devid),
        );
        let slot_base = self.max_vifs as u32 * netback::MAX_QUEUES * VIF_WINDOW_SLOTS
            + u32::from(index) * blkback::MAX_QUEUES * blkback::vbd_window_slots(self.persistent);
        let journal = |q: u32| {
            mem::journal::Journal::open(&journal_path(fe, devid, q), blkback::JOURNAL_LEN).ok()
        };
        let xen = Arc::clone(&self.xen);
        // The journals the back end before recorded in, if it left them.
        let journals = resume.then(|| (0..blkback::MAX_QUEUES).map(journal).collect());
        let direct = self.direct_disk;
        let mut cached = false;
        let r = self.open_disk(fe, devid).and_then(|(disk, path)| {
            cached = direct && !disk.direct();
            Blkback::connect_queues(xen, fe, devid, slot_base, self.persistent, disk, journals)
                .map(|b| (b, path))
                .map_err(|e| e.to_string())
        });
        if cached {
            self.log.line(&format!(
                "vbd {}/{devid}: its disk refuses O_DIRECT: through this domain's page cache",
                fe.0
            ));
        }
        let Some(d) = self.vbds.get_mut(&key) else {
            return;
        };
        d.resume = false;
        match r {
            Ok((backs, path)) => {
                let mut unrecorded = 0;
                let mut replayed = 0;
                let mut mapping = 0;
                let mut blocking = 0;
                let mut pcpus = Vec::new();
                for (q, mut b) in backs.into_iter().enumerate() {
                    replayed += b.replayed();
                    // The pCPU with the fewest units; its first step serves whatever
                    // the ring holds already.
                    let pcpu = least_loaded(&self.sched, &self.vifs, &self.vbds);
                    // A map from user space is two system calls and a page-table update
                    // each way: segments that are not persistent are copied instead.
                    let bounce = self.bounces.get(pcpu).cloned().flatten();
                    if !bounce.is_some_and(|p| b.copy_transient(p)) {
                        mapping += 1;
                    }
                    // The disk's bytes move while the pCPU serves other devices (or
                    // at once where io_uring is refused: said below).
                    if !self.sync_disk && !b.disk_async() {
                        blocking += 1;
                    }
                    if !resume && !journal(q as u32).is_some_and(|j| b.set_journal(j)) {
                        unrecorded += 1;
                    }
                    let name = format!("vbd{}.{devid}q{q}", fe.0);
                    match Queue::place(&self.sched, pcpu, name, b) {
                        Ok(placed) => {
                            pcpus.push(pcpu);
                            if let Some(d) = self.vbds.get_mut(&key) {
                                d.queues.push(placed);
                            }
                        }
                        Err(e) => {
                            // Not served: its front end's requests wait until the
                            // device is taken over or reconnected.
                            self.log.line(&format!(
                                "vbd {}/{devid}: queue {q} cannot be placed: {e}",
                                fe.0
                            ));
                        }
                    }
                }
                let Some(d) = self.vbds.get_mut(&key) else {
                    return;
                };
                let n = d.queues.len();
                if resume {
                    self.log.line(&format!(
                        "vbd {}/{devid}: responses replayed from the journals: {replayed}",
                        fe.0
                    ));
                }
                if mapping > 0 {
                    self.log.line(&format!(
                        "vbd {}/{devid}: {mapping} queue(s) map each request's segments: no pages to copy them through",
                        fe.0
                    ));
                }
                if blocking > 0 {
                    self.log.line(&format!(
                        "vbd {}/{devid}: {blocking} queue(s) move the disk's bytes synchronously: io_uring refused",
                        fe.0
                    ));
                }
                if unrecorded > 0 {
                    self.log.line(&format!(
                        "vbd {}/{devid}: {unrecorded} queue(s) without a journal under {JOURNAL_DIR}: a restart will not take them over",
                        fe.0
                    ));
                }
                self.counts.connected += 1;
                self.counts.resumed += u64::from(resume);
                let line = format!(
                    "vbd {}/{devid}: {} ({n} queue{} on pCPU {pcpus:?}, {path}): {}",
                    fe.0,
                    if resume { "resumed" } else { "connected" },
                    if n == 1 { "" } else { "s" },
                    negotiated(self.xen.store(), me, &fdir)
                );
                self.log.line(&line);
            }
            Err(e) => {
                self.counts.connect_errors += 1;
                self.log
                    .line(&format!("vbd {}/{devid}: connect refused: {e}", fe.0));
                let _ = self
                    .xen
                    .store()
                    .switch_state(me, &bdir, XenbusState::Closing);
            }
        }
    }

    /// Rewrites the metrics file (a new file renamed over the old, so a scraper never
    /// reads half of one) if `--metrics` asked and [`METRICS_EVERY`] has passed.
    fn write_metrics(&mut self) {
        let Some((path, last)) = self.metrics.as_mut() else {
            return;
        };
        if last.elapsed() < METRICS_EVERY {
            return;
        }
        *last = Instant::now();
        let mut text = String::new();
        for d in self.vifs.values_mut() {
            let Some(u) = d.unit.as_mut() else { continue };
            // A vif's counters are per queue when it has several, as last seen.
            let stats = u.stats();
            let several = stats.len() > 1;
            for (n, v) in stats.iter().enumerate() {
                let q = several.then_some(n as u32);
                metrics_lines(&mut text, "vif", d.fe, d.handle, q, v);
            }
        }
        for d in self.vbds.values_mut() {
            // As last seen: the network's thread never waits for a queue's step.
            for (n, q) in d.queues.iter_mut().enumerate() {
                metrics_lines(&mut text, "vbd", d.fe, d.devid, Some(n as u32), q.stats());
            }
        }
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &*path))
            .is_err()
        {
            self.log
                .line(&format!("metrics: cannot write {}", path.display()));
        }
    }

    fn shutdown(&mut self) {
        let close = self.close;
        for ((fe, handle), mut d) in std::mem::take(&mut self.vifs) {
            let mut n = 0;
            if let Some(u) = d.unit.take() {
                add_counted(&mut self.counts, u.counted());
                if let Some((queues, tap, pool)) = u.take() {
                    n = queues.len();
                    d.tap = Some(tap);
                    let mut pool = vif::lock(&pool);
                    for v in queues {
                        if close {
                            v.disconnect(&mut pool);
                        } else {
                            // Left `Connected` at both ends, its interface on its
                            // bridge, for the next back end to take over.
                            v.hand_over(&mut pool);
                        }
                    }
                }
            }
            if close {
                // The interface goes with this process.
                if let Some(tap) = &d.tap {
                    let _ = mem::tap::set_persist(tap, false);
                }
            } else if n > 0 {
                let s = if n == 1 { "" } else { "s" };
                self.log.line(&format!(
                    "vif {fe}/{handle}: handed over ({}, {n} queue{s})",
                    d.ifname
                ));
            }
        }
        for ((fe, devid), d) in std::mem::take(&mut self.vbds) {
            let n = d.queues.len();
            for b in d.queues.into_iter().filter_map(Queue::take) {
                if close {
                    b.disconnect();
                } else {
                    // Left `Connected` at both ends, for the next back end to resume.
                    b.hand_over();
                }
            }
            if n > 0 && !close {
                let s = if n == 1 { "" } else { "s" };
                self.log
                    .line(&format!("vbd {fe}/{devid}: handed over ({n} queue{s})"));
            }
        }
        if let Some(up) = self.upcall.take() {
            let c = up.counts();
            self.counts.events = c.fired.load(Ordering::Relaxed);
            self.counts.events_unrouted = c.unrouted.load(Ordering::Relaxed);
            self.counts.event_errors = c.errors.load(Ordering::Relaxed);
            up.stop();
        }
        self.sched.stop(Duration::from_secs(1));
        let stopped = format!(
            "stopped: {:?}; store watch events dropped: {}; log lines dropped: {}",
            self.counts,
            self.xen.client().events_dropped(),
            self.log.dropped
        );
        // The last line goes out even past the bound.
        let _ = writeln!(self.log.out, "{stopped}");
    }
}

/// The pCPU with the fewest units (vifs and vbd queues) placed on it.
fn least_loaded(
    sched: &Scheduler,
    vifs: &BTreeMap<(u16, u32), NetDev>,
    vbds: &BTreeMap<(u16, u32), BlkDev>,
) -> usize {
    let mut load = vec![0usize; sched.pcpus().max(1)];
    let placed = vifs
        .values()
        .filter_map(|d| d.unit.as_ref().map(NetUnit::pcpu))
        .chain(vbds.values().flat_map(|d| d.queues.iter().map(Queue::pcpu)));
    for p in placed {
        if let Some(l) = load.get_mut(p) {
            *l += 1;
        }
    }
    (0..load.len()).min_by_key(|&i| load[i]).unwrap_or(0)
}

/// A vif unit's packet counts, added to the process's.
fn add_counted(c: &mut Counts, u: &vif::Counted) {
    c.frames_in += u.frames_in.load(Ordering::Relaxed);
    c.frames_out += u.frames_out.load(Ordering::Relaxed);
    c.frames_dropped += u.frames_dropped.load(Ordering::Relaxed);
    c.stray_tokens += u.stray_tokens.load(Ordering::Relaxed);
}

/// What a connected vif is, for its log line: its queues and its rate.
fn describe_vif<X: Xen>(v: &Vif<X>, queues: usize) -> String {
    let rate = v.tx_rate().map_or(String::new(), |(b, t)| {
        format!(
            ", TX rate {b} bytes a {} µs ({:.1} Mbit/s)",
            t.as_micros(),
            b as f64 * 8.0 / t.as_secs_f64() / 1e6
        )
    });
    format!("{queues} queue{}{rate}", if queues == 1 { "" } else { "s" })
}

/// Whether a back-end directory found at `.../<fe>/<device>` names that guest and that
/// device's front-end directory `fdir` as its own (`frontend-id`, `frontend`): a
/// toolstack writes both, and a directory that says otherwise (or names this domain
/// itself) is not served.
pub fn check_names(
    me: DomId,
    fe: DomId,
    fdir: &str,
    frontend_id: Option<&str>,
    frontend: Option<&str>,
) -> Result<(), String> {
    if fe == me {
        return Err(format!("the guest named is this domain ({})", me.0));
    }
    if frontend_id != Some(fe.0.to_string().as_str()) {
        return Err(format!(
            "frontend-id is {frontend_id:?}, the path says {}",
            fe.0
        ));
    }
    if frontend != Some(fdir) {
        return Err(format!("frontend is {frontend:?}, the path says {fdir}"));
    }
    Ok(())
}

/// The device node of a hotplug script's `physical-device` (`major:minor`, each in hex,
/// as Linux's blkback reads it): `/dev/block/<major>:<minor>` in decimal, udev's name.
pub fn physical_device_path(v: &str) -> Option<String> {
    let (maj, min) = v.split_once(':')?;
    let hex = |s: &str, max: u32| {
        (!s.is_empty() && s.len() <= 5 && s.bytes().all(|c| c.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten()
            .filter(|n| *n <= max)
    };
    // Linux's dev_t: 12 bits of major, 20 of minor.
    Some(format!(
        "/dev/block/{}:{}",
        hex(maj, 0xfff)?,
        hex(min, 0xf_ffff)?
    ))
}

/// Where the journals live: in memory (`/run` is a tmpfs), kept across this process's
/// restarts and gone at the host's.
const JOURNAL_DIR: &str = "/run/pvio/backend";

/// Where a vbd's queue's back end records its responses before writing them, for the
/// back end started after this one.
fn journal_path(fe: DomId, devid: u32, queue: u32) -> std::path::PathBuf {
    let dir = std::path::Path::new(JOURNAL_DIR);
    let _ = std::fs::create_dir_all(dir);
    dir.join(format!("vbd-{}-{devid}-q{queue}", fe.0))
}

/// A vif's queue's two journals' paths (TX, RX).
fn vif_journal_paths(fe: DomId, handle: u32, queue: u32) -> [std::path::PathBuf; 2] {
    let dir = std::path::Path::new(JOURNAL_DIR);
    let _ = std::fs::create_dir_all(dir);
    let q = match queue {
        0 => String::new(),
        q => format!("-q{q}"),
    };
    ["tx", "rx"].map(|r| dir.join(format!("vif-{}-{handle}{q}-{r}", fe.0)))
}

/// A vif's queue's two journals, opened (made if missing).
fn vif_journals(fe: DomId, handle: u32, queue: u32) -> std::io::Result<netback::Journals> {
    let [tx, rx] = vif_journal_paths(fe, handle, queue);
    Ok(netback::Journals {
        tx: mem::journal::Journal::open(&tx, netback::JOURNAL_LEN_TX)?,
        rx: mem::journal::Journal::open(&rx, netback::JOURNAL_LEN_RX)?,
    })
}

fn offered(keys: &[(&str, &str)]) -> String {
    let mut s = String::new();
    for (k, v) in keys {
        let _ = write!(s, "{k}={v} ");
    }
    s.trim_end().to_string()
}

/// The front end's keys, as it wrote them: what it negotiated.
fn negotiated(store: &impl XenStore, me: DomId, fdir: &str) -> String {
    let mut s = String::new();
    for k in store.directory(me, fdir).unwrap_or_default() {
        if k == "state" {
            continue;
        }
        if let Ok(v) = store.read(me, &format!("{fdir}/{k}")) {
            let _ = write!(s, "{k}={v} ");
        }
    }
    s.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log written to memory, for tests.
    #[derive(Clone, Default)]
    struct Mem(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Mem {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Each counter of a device's set is one line, labelled with its guest, device and
    /// queue, a per-reason counter's reason a label of its own, zero counters included.
    #[test]
    fn metrics_are_one_labelled_line_per_counter() {
        let stats = blk::blkback::VbdStats {
            taken: 7,
            ..Default::default()
        };
        let mut text = String::new();
        metrics_lines(&mut text, "vbd", DomId(5), 51712, Some(1), &stats);
        assert!(
            text.lines()
                .any(|l| l == r#"pvio_backend_vbd_taken{domid="5",devid="51712",queue="1"} 7"#),
            "{text}"
        );
        assert!(text.lines().all(|l| l.starts_with("pvio_backend_vbd_")
            && l.contains(r#"domid="5",devid="51712",queue="1""#)
            && l.rsplit(' ')
                .next()
                .is_some_and(|v| v.parse::<u64>().is_ok())));
        let mut n = 0;
        hv::counters::CounterSet::visit(&stats, &mut |_, _| n += 1);
        assert_eq!(text.lines().count(), n, "every counter, zero or not");
        // A per-reason counter (`<field> <Reason>`) has its reason as a label.
        let mut reasons = 0;
        hv::counters::CounterSet::visit(&stats, &mut |name, _| {
            reasons += usize::from(name.contains(' '));
        });
        assert_eq!(text.matches(",reason=\"").count(), reasons);
    }

    /// A guest reconnecting in a loop writes lines for ever; the log stops at its bound,
    /// says so once, and counts what it dropped.
    #[test]
    fn the_log_stops_at_its_bound_and_counts_what_it_drops() {
        let mem = Mem::default();
        let mut log = Log::new(Box::new(mem.clone()), 1000);
        for i in 0..10_000 {
            log.line(&format!("vif 7/0: connected ({i})"));
        }
        let text = String::from_utf8(mem.0.lock().expect("log").clone()).expect("utf-8");
        let kept = text.lines().filter(|l| l.contains("connected")).count();
        assert!(text.len() < 1000 + 100, "{} bytes", text.len());
        assert_eq!(text.matches("log limit").count(), 1);
        assert_eq!(kept as u64 + log.dropped, 10_000);
        assert!(kept > 0 && log.dropped > 0);
    }

    #[test]
    fn a_physical_device_is_read_as_hex_major_minor_and_anything_else_refused() {
        assert_eq!(
            physical_device_path("7:0").as_deref(),
            Some("/dev/block/7:0")
        );
        assert_eq!(
            physical_device_path("fd:1a").as_deref(),
            Some("/dev/block/253:26")
        );
        for bad in [
            "", "7", "7:", ":0", "7:0:0", "g:0", "-1:0", "1000:0", "7:100000", " 7:0", "7:0/../x",
        ] {
            assert_eq!(physical_device_path(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_directory_is_served_only_if_it_names_its_own_guest_and_device() {
        let me = DomId(0);
        let fdir = net::xenbus::frontend_dir(DomId(3), 0);
        assert!(check_names(me, DomId(3), &fdir, Some("3"), Some(&fdir)).is_ok());
        // Another guest's id, another device's directory, this domain, nothing at all.
        assert!(check_names(me, DomId(3), &fdir, Some("4"), Some(&fdir)).is_err());
        let other = net::xenbus::frontend_dir(DomId(4), 0);
        assert!(check_names(me, DomId(3), &fdir, Some("3"), Some(&other)).is_err());
        let mine = net::xenbus::frontend_dir(me, 0);
        assert!(check_names(me, me, &mine, Some("0"), Some(&mine)).is_err());
        assert!(check_names(me, DomId(3), &fdir, None, None).is_err());
        assert!(check_names(me, DomId(3), &fdir, Some("03"), Some(&fdir)).is_err());
    }

    /// The pCPUs leave a core to the main thread, which routes every unit's wake-ups, and
    /// halt-poll only when it has one: on one core a spinning pCPU would hold off the
    /// wake-up it waits for.
    #[test]
    fn the_pcpus_leave_the_main_thread_a_core_and_spin_only_when_it_has_one() {
        assert_eq!(default_cpus(1), 1);
        assert_eq!(default_cpus(2), 1);
        assert_eq!(default_cpus(3), 2);
        assert_eq!(default_cpus(16), MAX_CPUS);
        assert_eq!(idle_policy(1, 1), IdlePolicy::Block);
        assert_eq!(idle_policy(2, 2), IdlePolicy::Block);
        assert!(matches!(idle_policy(1, 2), IdlePolicy::AdaptiveHaltPoll(_)));
        for cores in 1..=16 {
            let cpus = default_cpus(cores);
            assert_eq!(
                idle_policy(cpus, cores) == IdlePolicy::Block,
                cores == 1,
                "{cores} cores"
            );
        }
    }

    #[test]
    fn without_xen_it_stops_at_once_naming_the_missing_device() {
        if std::path::Path::new("/dev/xen/gntdev").exists() {
            return;
        }
        let stop = AtomicBool::new(false);
        let e = run(
            &Options {
                domid: Some(0),
                hotplug: Hotplug::Auto,
                log: None,
                metrics: None,
                max_vifs: MAX_VIFS,
                max_vbds: MAX_VBDS,
                close: false,
                cpus: 0,
                sync_disk: false,
                disk_cache: DiskCache::Auto,
                persistent_grants: blkback::PERSISTENT_MAX,
            },
            &stop,
        )
        .expect_err("no Xen here");
        assert!(matches!(e, Error::Open(_)), "{e}");
        assert!(e.to_string().contains("/dev/xen/gntdev"), "{e}");
    }
}
