//! The `pvio` command: runs the lab's experiments and writes their reports.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use lab::{Mode, RunEnv};

#[derive(Parser, Debug)]
#[command(
    name = "pvio",
    version,
    about = "A user-space paravirtualization platform and its lab"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs every registered experiment (or one) and writes its table, JSON and Markdown.
    Reproduce {
        /// Shorter runs: fewer iterations and operations.
        #[arg(long)]
        quick: bool,
        /// Only this experiment (see `pvio list`).
        #[arg(long, value_name = "ID")]
        only: Option<String>,
        /// Where to write `<id>.json` and `<id>.md`.
        #[arg(long, value_name = "DIR", default_value = "results")]
        out: PathBuf,
        /// How the machines' idle pCPUs wait: poll (all the load on the cores is
        /// pvio's), halt-poll or halt-poll:<n>us (other processes share them), adaptive
        /// or adaptive:<n>us (KVM's halt-poll window that grows and shrinks), block (a
        /// host wake-up per interrupt, the comparison).
        #[arg(long, value_name = "POLICY", default_value = "poll", value_parser = rig::IdlePolicy::parse)]
        idle: rig::IdlePolicy,
    },
    /// Runs one benchmark experiment (same as `reproduce --only ID`).
    Bench {
        /// Experiment id, e.g. `core`.
        id: String,
        /// Shorter runs.
        #[arg(long)]
        quick: bool,
        /// Output directory.
        #[arg(long, value_name = "DIR", default_value = "results")]
        out: PathBuf,
        /// How the machines' idle pCPUs wait (as for `reproduce`).
        #[arg(long, value_name = "POLICY", default_value = "poll", value_parser = rig::IdlePolicy::parse)]
        idle: rig::IdlePolicy,
    },
    /// Writes `index.html` over a results folder's records (every experiment on one
    /// page), or compares two folders: every check whose verdict changed or whose
    /// value moved, and every same-run ratio that moved.
    Report {
        /// The results folder.
        #[arg(value_name = "DIR", conflicts_with = "compare")]
        dir: Option<PathBuf>,
        /// Compare two results folders (a change's before and after); writes
        /// `NEW/compare.html` and prints the same list.
        #[arg(long, num_args = 2, value_names = ["OLD", "NEW"])]
        compare: Option<Vec<PathBuf>>,
        /// How far (percent) a value or a ratio must move to be listed.
        #[arg(long, value_name = "PERCENT", default_value_t = 10.0)]
        threshold: f64,
    },
    /// Serves a real Xen's guests from this dom0 (or driver domain): pvio's netback and
    /// blkback take every vif and vbd back-end directory the toolstack writes for this
    /// domain, with Linux's `xen-netback` and `xen-blkback` unloaded. A vif's interface
    /// is a TAP named `vif<domid>.<devid>`, which `xl`'s `vif-bridge` script bridges.
    /// See `scripts/xen-interop/` for a whole run under QEMU.
    Backend {
        /// This domain's id under Xen; by default the store's `domid` for this domain
        /// (0 in dom0).
        #[arg(long)]
        domid: Option<u16>,
        /// Who puts a vif's interface on the bridge its directory names: pvio itself
        /// (what `xl devd` would do in a driver domain), the toolstack's hotplug scripts,
        /// or auto (pvio outside dom0, the scripts in dom0).
        #[arg(long, value_enum, default_value_t = HotplugArg::Auto)]
        hotplug: HotplugArg,
        /// Where to log each device's connection and disconnection (stderr if none);
        /// appended to, so a restart keeps the lines before it.
        #[arg(long, value_name = "FILE")]
        log: Option<PathBuf>,
        /// Write every device's counters to this file every 5 s, in Prometheus' text
        /// format (for node_exporter's textfile collector, or any scraper).
        #[arg(long, value_name = "FILE")]
        metrics: Option<PathBuf>,
        /// vifs served at once (each reserves about 6 MiB of address space).
        #[arg(long, default_value_t = backend::MAX_VIFS)]
        max_vifs: usize,
        /// vbds served at once (each reserves about 33 MiB of address space).
        #[arg(long, default_value_t = backend::MAX_VBDS)]
        max_vbds: usize,
        /// Close every device when stopping. Without it, a stop (Ctrl-C, SIGTERM) hands
        /// each vif and vbd over to the next `pvio backend`, its guest's NIC and disk
        /// never leaving `Connected`.
        #[arg(long)]
        close: bool,
        /// pCPUs (threads pinned to this domain's first cores) the vbd queues run on,
        /// each queue a unit of pvio's scheduler; 0: one per core but one (left to the
        /// thread that routes the event channels), at least one, at most 4.
        #[arg(long, default_value_t = 0)]
        cpus: usize,
        /// Move each vbd's bytes synchronously, one request at a time on its pCPU,
        /// instead of through an io_uring of each queue's own (up to 32 in flight).
        #[arg(long)]
        sync_disk: bool,
        /// Whether each vbd's disk is reached through this domain's page cache: direct
        /// (O_DIRECT) in a driver domain, whose cache dies with it, cached in dom0.
        #[arg(long, value_enum, default_value_t = DiskCacheArg::Auto)]
        disk_cache: DiskCacheArg,
        /// Grants each vbd queue keeps mapped at most (Linux blkback's
        /// `max_persistent_grants`, whose default this is); a segment beyond them is
        /// copied, its request moved synchronously. Each costs 4 KiB of address space
        /// and, while mapped, one of Xen's maptrack entries.
        #[arg(long, default_value_t = backend::PERSISTENT_GRANTS as u32,
              value_parser = clap::value_parser!(u32).range(0..=backend::PERSISTENT_GRANTS_LIMIT as i64))]
        persistent_grants: u32,
    },
    /// Runs a pv machine on real interfaces until interrupted: the NIC's cable on a TAP
    /// in the outside network namespace, the guest's stack a TAP in the guest's. Try
    /// `ip netns exec pvio-guest iperf3 -s` and `ip netns exec pvio-outside iperf3 -c
    /// 10.77.0.2`.
    Up {
        /// Run the machine this TOML file describes (see `machines/`); the machine
        /// flags below are then refused, the run's own (`--seconds`, `--pcap`, ...) kept.
        #[arg(long, value_name = "FILE", conflicts_with_all = [
            "outside_ns", "guest_ns", "outside_addr", "guest_addr", "no_netfilter",
            "no_fragments", "grant_reuse", "multi_queue", "no_offloads", "lro", "mtu_wire",
            "cable", "dma", "split_ring", "lro_flush_every",
        ])]
        machine: Option<PathBuf>,
        /// The outside namespace (made if missing).
        #[arg(long, default_value = "pvio-outside")]
        outside_ns: String,
        /// The guest's namespace (made if missing).
        #[arg(long, default_value = "pvio-guest")]
        guest_ns: String,
        /// The outside interface's address.
        #[arg(long, default_value = "10.77.0.1/24")]
        outside_addr: String,
        /// The guest's address.
        #[arg(long, default_value = "10.77.0.2/24")]
        guest_addr: String,
        /// Turn the bridge's netfilter hooks off.
        #[arg(long)]
        no_netfilter: bool,
        /// netfront posts linear buffers instead of page fragments (paper 000 §3.4.2's
        /// modification; the guest's MTU stays 1500).
        #[arg(long)]
        no_fragments: bool,
        /// Grant reuse (paper 000 §4.4): netfront binds its pages to grant references,
        /// netback keeps them mapped in a per-guest cache; pages leave through the
        /// control ring.
        #[arg(long)]
        grant_reuse: bool,
        /// A NIC receive queue for the guest, frames placed straight into netfront's
        /// buffers (paper 000 §4.3).
        #[arg(long)]
        multi_queue: bool,
        /// No checksum offload or GSO: both TAPs carry plain MTU-sized frames and
        /// netfront offers neither (the path as paper 000 measured it).
        #[arg(long)]
        no_offloads: bool,
        /// Large Receive Offload in the driver domain's NIC driver (paper 001): the
        /// cable then carries MTU-sized frames, as a real wire does, and the guest's
        /// TAP receives the aggregates as large segments.
        #[arg(long, value_enum, default_value_t = LroArg::Off)]
        lro: LroArg,
        /// The cable carries MTU-sized frames only, as a real wire does (the outside's
        /// kernel segments its TCP); always so with `--lro`.
        #[arg(long)]
        mtu_wire: bool,
        /// Attach the NIC's cable to this interface of the host (a NIC, one end of a
        /// veth pair) through a packet socket with mapped rings, instead of a TAP in the
        /// outside namespace (which is then not made). It carries MTU-sized frames;
        /// pvio turns the interface's GRO off. Its peer must send no large segments
        /// (`ethtool -K PEER tso off gso off` on a veth).
        #[arg(long, value_name = "IFNAME")]
        cable: Option<String>,
        /// Where the NIC's DMA writes land: in the last-level cache, as on a present-day
        /// host with Data Direct I/O, or in memory, as on the papers' 2008 platforms.
        #[arg(long, value_enum, default_value_t = DmaArg::Cache)]
        dma: DmaArg,
        /// netfront asks for pvio's split ring layout, each end's ring indices on a cache
        /// line of their own, instead of ring.h's (netback offers it; a real Xen peer
        /// would not).
        #[arg(long)]
        split_ring: bool,
        /// How frames cross the TAPs: `batched` through an io_uring, many frames a
        /// system call, by reads that never wait (one frame a call where the kernel
        /// cannot); `armed`, the same by a multishot read that ties each port to one
        /// thread (but for the cable's TAP where the NIC shares a guest's core); or
        /// `plain`, one `read` or `write` a frame. Also with `--machine`.
        #[arg(long, value_enum, default_value_t = EdgeArg::Batched)]
        edge_io: EdgeArg,
        /// How idle pCPUs wait: adaptive (KVM's halt-polling window that grows and
        /// shrinks), halt-poll or halt-poll:<n>us (a fixed window), block (a host
        /// wake-up per interrupt); poll is taken as halt-poll, since outside programs
        /// share the cores. Also with `--machine`.
        #[arg(long, value_name = "POLICY", default_value = "adaptive",
              value_parser = |s: &str| rig::IdlePolicy::parse(s))]
        idle: rig::IdlePolicy,
        /// With `--lro delayed`: flush every this many polls (the paper's 2); refused
        /// with any other `--lro`.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
        lro_flush_every: Option<u32>,
        /// Stop after this many seconds (default: at Ctrl-C, SIGTERM or SIGHUP).
        #[arg(long, value_name = "SECS")]
        seconds: Option<u64>,
        /// Leave the namespaces made for the run in place when it stops (their TAPs go
        /// with the machine); the next `pvio up` naming them makes them afresh.
        #[arg(long)]
        keep_namespaces: bool,
        /// The toolstack's watchdog restarts a driver domain that crashed, or that left
        /// work waiting this long without looking at it (0: no watchdog).
        #[arg(long, value_name = "MS", default_value_t = 100)]
        watchdog_ms: u64,
        /// Make the driver domain fail (to watch the watchdog restart it and the
        /// guest's connections carry on).
        #[arg(long, value_enum)]
        fault: Option<FaultKind>,
        /// When to make it fail, in seconds after start.
        #[arg(long, value_name = "SECS", default_value_t = 5)]
        fault_after: u64,
        /// Also write the live counters, once a second, as JSON lines to this file (one
        /// object per second: the time and, per port, packets and bits per second each
        /// way, drops by reason, ring occupancy).
        #[arg(long, value_name = "FILE")]
        stats_json: Option<PathBuf>,
        /// Capture every frame into pcap files in this directory (made if missing):
        /// `wire.pcap`, the NIC's cable both ways, and `vif<domain>.<handle>.pcap`, the
        /// guest's frames both ways. Wireshark and tshark read them.
        #[arg(long, value_name = "DIR")]
        pcap: Option<PathBuf>,
    },
    /// Runs a soak: hostile guests beside a well-behaved one behind one driver domain,
    /// restarted on a schedule, for a bounded time; prints each period and the checks
    /// (memory flat, counters consistent, no stall) and writes `soak.json`/`soak.md`.
    Soak {
        /// How long, in seconds.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Hostile guests.
        #[arg(long, default_value_t = 2)]
        hostile: usize,
        /// Restart the driver domain every this many seconds (0: never).
        #[arg(long, value_name = "SECS", default_value_t = 10)]
        restart_every: u64,
        /// Output directory.
        #[arg(long, value_name = "DIR", default_value = "results")]
        out: PathBuf,
    },
    /// Lists the registered experiments.
    List,
    /// Sends `bytes` of a seeded pseudo-random stream over TCP to `to` and prints its
    /// length and digest (a byte-exact check of a path, with `tcp-sink`).
    #[command(hide = true)]
    TcpSource {
        /// address:port
        #[arg(long)]
        to: String,
        /// Bytes to send.
        #[arg(long)]
        bytes: u64,
    },
    /// Accepts one TCP connection on `port`, reads it to the end, and prints the length
    /// and digest of what arrived.
    #[command(hide = true)]
    TcpSink {
        /// Port to listen on.
        #[arg(long)]
        port: u16,
    },
}

/// Whether `pvio backend` reaches a vbd's disk through the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DiskCacheArg {
    /// Direct outside dom0, cached in dom0.
    Auto,
    /// O_DIRECT.
    Direct,
    /// Through the page cache.
    Cached,
}

/// Who does `pvio backend`'s vif hotplug work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum HotplugArg {
    /// pvio outside dom0, the toolstack's scripts in dom0.
    Auto,
    /// pvio itself.
    Pvio,
    /// The toolstack's hotplug scripts.
    Scripts,
}

/// When `pvio up`'s LRO flushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LroArg {
    /// No LRO.
    Off,
    /// At the end of every poll (the paper's LRO).
    EveryPoll,
    /// Every `--lro-flush-every` polls, each aggregate held at most 1 ms (the paper's DA).
    Delayed,
    /// From each flow's arrival interval and a 200 µs budget.
    Adaptive,
}

/// Where `pvio up`'s NIC writes what it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DmaArg {
    /// The last-level cache (Data Direct I/O, a present-day host).
    Cache,
    /// Memory (the papers' 2008 platforms).
    Memory,
}

/// How `pvio up` moves frames across its TAPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum EdgeArg {
    /// In batches through an io_uring, by reads that never wait, which any thread may
    /// make (one frame a call where the kernel cannot).
    Batched,
    /// In batches through an io_uring, by a multishot read that ties each port to one
    /// thread (on the cable's TAP where the NIC shares a guest's core, as `batched`).
    Armed,
    /// One `read` or `write` a frame.
    Plain,
}

/// A driver-domain failure `pvio up` can inject.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum FaultKind {
    /// Its kernel panics.
    Panic,
    /// Its kernel stops polling, interrupts off.
    Hang,
}

/// What `pvio up` runs besides the machine.
#[derive(Debug, Clone)]
struct UpRun {
    seconds: Option<u64>,
    keep_namespaces: bool,
    watchdog: Option<std::time::Duration>,
    fault: Option<(FaultKind, std::time::Duration)>,
    stats_json: Option<PathBuf>,
}

/// A stream anyone can regenerate: xorshift64 bytes.
fn stream_byte(x: &mut u64) -> u8 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x as u8
}

/// FNV-1a, 64 bits: enough to tell a changed, lost or reordered byte.
fn fnv(h: u64, data: &[u8]) -> u64 {
    data.iter()
        .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}
const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

fn tcp_source(to: &str, bytes: u64) -> ExitCode {
    use std::io::Write;
    let mut s = match std::net::TcpStream::connect(to) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("connect {to}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut x, mut h, mut left) = (0x9e37_79b9_7f4a_7c15u64, FNV_START, bytes);
    let mut buf = vec![0u8; 65536];
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        for b in &mut buf[..n] {
            *b = stream_byte(&mut x);
        }
        if let Err(e) = s.write_all(&buf[..n]) {
            eprintln!("send: {e}");
            return ExitCode::FAILURE;
        }
        h = fnv(h, &buf[..n]);
        left -= n as u64;
    }
    println!("{bytes} {h:016x}");
    ExitCode::SUCCESS
}

fn tcp_sink(port: u16) -> ExitCode {
    use std::io::Read;
    let l = match std::net::TcpListener::bind(("0.0.0.0", port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("listen {port}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok((mut s, _)) = l.accept() else {
        return ExitCode::FAILURE;
    };
    let (mut h, mut total) = (FNV_START, 0u64);
    let mut buf = vec![0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                h = fnv(h, &buf[..n]);
                total += n as u64;
            }
            Err(e) => {
                eprintln!("recv: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("{total} {h:016x}");
    ExitCode::SUCCESS
}

fn backend(opts: &backend::Options) -> ExitCode {
    use std::sync::atomic::Ordering;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = std::sync::Arc::clone(&stop);
    if let Err(e) = ctrlc::set_handler(move || s.store(true, Ordering::Release)) {
        eprintln!("cannot catch Ctrl-C: {e}");
    }
    match backend::run(opts, &stop) {
        Ok(c) => {
            eprintln!("pvio backend: stopped: {c:?}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("pvio backend: {e}");
            ExitCode::FAILURE
        }
    }
}

fn up(cfg: &up::UpConfig, run: UpRun) -> ExitCode {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = std::sync::Arc::clone(&stop);
    // The loop below sleeps until its next duty (a redraw, a fault, the end) or a
    // signal: an idle machine's own process takes no timer of its own beyond those.
    let (signalled, signal) = std::sync::mpsc::channel::<()>();
    // SIGINT, SIGTERM and SIGHUP alike (ctrlc's `termination`): what `kill`, systemd and
    // test harnesses send stops the machine and removes what was made for it.
    if let Err(e) = ctrlc::set_handler(move || {
        s.store(true, Ordering::Release);
        let _ = signalled.send(());
    }) {
        eprintln!("cannot catch Ctrl-C: {e}");
    }
    let mut machine = match up::up(cfg) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("pvio up: {e}");
            return ExitCode::FAILURE;
        }
    };
    if run.keep_namespaces {
        machine.keep_namespaces();
    }
    let o = &cfg.outside_ns;
    match &cfg.cable {
        Some(i) => println!("up: the cable on interface {i} (a packet socket)"),
        None => println!("up: outside namespace {o} ({})", cfg.outside_addr),
    }
    for g in &cfg.guests {
        println!("    {} in namespace {} ({})", g.name, g.ns, g.addr);
    }
    for d in &cfg.disks {
        println!("    {}", d.describe());
    }
    let (g, guest_ip) = (&cfg.guest().ns, cfg.guest().ip());
    let client = match &cfg.cable {
        Some(i) => format!("iperf3 -c {guest_ip}   (from the far end of {i})"),
        None => format!("ip netns exec {o} iperf3 -c {guest_ip}"),
    };
    println!(
        "  ip netns exec {g} iperf3 -s\n  {client}\n\
         Ctrl-C (or SIGTERM, SIGHUP) stops it."
    );
    let mut json = match run
        .stats_json
        .as_deref()
        .map(std::fs::File::create)
        .transpose()
    {
        Ok(f) => f.map(std::io::BufWriter::new),
        Err(e) => {
            eprintln!("--stats-json: {e}");
            return ExitCode::FAILURE;
        }
    };
    for p in machine.capture_paths() {
        println!("capturing into {}", p.display());
    }
    let mut live = LiveView::new(std::io::stdout().is_terminal());
    let t0 = Instant::now();
    let mut fault = run.fault;
    let (mut last, mut shown) = (up::UpCounters::default(), t0);
    // The live table is sampled (every kernel asked for its counters) only where it is
    // drawn or written.
    let sampled = live.on_terminal || json.is_some();
    let end = run.seconds.map(|s| t0 + Duration::from_secs(s));
    while !stop.load(Ordering::Acquire) && end.is_none_or(|e| Instant::now() < e) {
        // Until the next duty: a second's redraw or counter line, the fault, the end; a
        // watchdog looks four times in its limit (at least 10 ms apart), so that a
        // stall is seen within 1.25 limits.
        let mut next = Instant::now() + Duration::from_secs(1);
        if let Some(limit) = run.watchdog {
            next = next.min(Instant::now() + (limit / 4).max(Duration::from_millis(10)));
        }
        if let Some((_, at)) = fault {
            next = next.min(t0 + at);
        }
        if let Some(e) = end {
            next = next.min(e);
        }
        let _ = signal.recv_timeout(next.saturating_duration_since(Instant::now()));
        if let Some((kind, at)) = fault.filter(|&(_, at)| t0.elapsed() >= at) {
            println!("fault: the driver domain's kernel is made to {kind:?} at {at:?}");
            live.printed();
            machine.inject_fault(match kind {
                FaultKind::Panic => rig::udp::Fault::Panic,
                FaultKind::Hang => rig::udp::Fault::Hang,
            });
            fault = None;
        }
        if let Some(limit) = run.watchdog {
            match machine.watchdog(limit) {
                Ok(Some(r)) => {
                    println!(
                        "watchdog: driver domain {:?}; a new one was running with its vifs \
                         and disks connected {:.1} ms later",
                        r.cause,
                        r.took.as_secs_f64() * 1e3
                    );
                    if r.vifs_unserved > 0 {
                        println!(
                            "watchdog: {} vif(s) left out: their guests did not reconnect in time",
                            r.vifs_unserved
                        );
                    }
                    if r.disks_unserved > 0 {
                        println!(
                            "watchdog: {} disk(s) could not be served again; their guests fail \
                             what they had in flight after {} s",
                            r.disks_unserved,
                            up::DISK_RECONNECT_BOUND.as_secs()
                        );
                    }
                    live.printed();
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("watchdog: the driver domain could not be restarted: {e}");
                    break;
                }
            }
        }
        if let Some(rows) = sampled.then(|| live.tick(&machine)).flatten() {
            if let Some(j) = json.as_mut() {
                use std::io::Write;
                let line = rig::live::json_line(t0.elapsed().as_secs_f64(), &rows);
                if writeln!(j, "{line}").and_then(|()| j.flush()).is_err() {
                    eprintln!("--stats-json: write failed; no more lines");
                    json = None;
                }
            }
        }
        let c = machine.counters();
        if !live.on_terminal && c != last && shown.elapsed() >= Duration::from_secs(5) {
            println!(
                "wire in {} out {}, guest in {} out {}, oversize {}",
                c.wire_in, c.wire_out, c.guest_in, c.guest_out, c.oversize
            );
            (last, shown) = (c, Instant::now());
        }
    }
    let c = machine.counters();
    println!(
        "down: wire in {} out {}, guest in {} out {}, oversize {}",
        c.wire_in, c.wire_out, c.guest_in, c.guest_out, c.oversize
    );
    let frames = c.wire_in + c.wire_out + c.guest_in + c.guest_out;
    let way = |batched: bool| {
        if batched {
            "batched"
        } else {
            "one frame a call"
        }
    };
    println!(
        "edge: {} system calls for {frames} frames across the interfaces ({:.3} a frame; \
         the cable {}, the guests {})",
        c.edge_syscalls,
        c.edge_syscalls as f64 / frames.max(1) as f64,
        way(c.wire_batched),
        way(c.guests_batched),
    );
    if !cfg.disks.is_empty() {
        // A kernel that did not answer in time leaves its counters out: no line then
        // (`get` would panic on the absent component).
        if let Some(s) = machine
            .live_sample()
            .filter(|s| s.counters.try_get("block job", "completed").is_some())
        {
            let get = |name: &str| s.counters.get("block job", name);
            println!(
                "disks: {} requests done, {} MB, {} failed",
                get("completed"),
                get("bytes") / 1_000_000,
                get("errors")
            );
        }
    }
    if cfg.driver.lro.is_some() {
        if let Some(s) = machine
            .live_sample()
            .filter(|s| s.counters.try_get("lro engine", "segments").is_some())
        {
            let get = |name: &str| s.counters.get("lro engine", name);
            let (aggs, segs) = (get("aggregates"), get("segments"));
            println!(
                "lro: {segs} segments in {aggs} aggregates ({:.1} a packet up)",
                segs as f64 / aggs.max(1) as f64
            );
        }
    }
    let captures = machine.capture_counters();
    machine.down();
    for (path, c) in captures {
        println!(
            "captured into {}: {} frames, {} not kept (the writer was behind)",
            path.display(),
            c.written.load(Ordering::Relaxed),
            c.dropped.load(Ordering::Relaxed)
        );
    }
    ExitCode::SUCCESS
}

/// `pvio up`'s live counters: a sample of every component's counters each second,
/// the rates between the last two as a table redrawn in place on a terminal.
struct LiveView {
    on_terminal: bool,
    last: Option<rig::live::Sample>,
    drawn_lines: usize,
}

impl LiveView {
    fn new(on_terminal: bool) -> Self {
        Self {
            on_terminal,
            last: None,
            drawn_lines: 0,
        }
    }

    /// Once a second: the rates since the last sample (drawn on a terminal).
    fn tick(&mut self, machine: &up::Up) -> Option<Vec<rig::live::PortRates>> {
        let due = self
            .last
            .as_ref()
            .is_none_or(|s| s.at.elapsed() >= std::time::Duration::from_secs(1));
        if !due {
            return None;
        }
        let now = machine.live_sample()?;
        let rows = self
            .last
            .replace(now.clone())
            .map(|before| rig::live::rates(&before, &now))?;
        if self.on_terminal {
            let t = rig::live::table(&rows);
            // Back over the last table, then the new one over it.
            if self.drawn_lines > 0 {
                print!("\x1b[{}A\x1b[J", self.drawn_lines);
            }
            print!("{t}");
            self.drawn_lines = t.lines().count();
        }
        Some(rows)
    }

    /// Something else was printed: the next table goes below it.
    fn printed(&mut self) {
        self.drawn_lines = 0;
    }
}

fn soak(seconds: u64, hostile: usize, restart_every: u64, out: &std::path::Path) -> ExitCode {
    use lab::experiments::santos08::soak::{soak, SoakPlan};
    let plan = SoakPlan {
        duration: std::time::Duration::from_secs(seconds),
        hostile,
        restart_every: (restart_every > 0).then(|| std::time::Duration::from_secs(restart_every)),
        period: std::time::Duration::from_secs(1),
        idle: rig::IdlePolicy::HALT_POLL,
    };
    let cx = lab::Context::new(Mode::Full, plan.idle);
    println!("   time  messages   rss KiB  free frames  hostile pages  restarts  watchdog");
    let report = soak(plan, &mut |p| {
        println!(
            "{:6.1}s {:9} {:9} {:12} {:14} {:9} {:9}",
            p.at_s,
            p.messages,
            p.rss_kib,
            p.free_frames,
            p.hostile_free_pages,
            p.restarts,
            p.watchdog_restarts
        );
    });
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("soak: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", report.table());
    if let Err(e) = report.write(out, &RunEnv::capture(&cx)) {
        eprintln!("could not write the report: {e}");
    }
    if report.checks.iter().all(|c| c.met) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn reproduce(cx: &lab::Context, only: Option<&str>, out: &std::path::Path) -> ExitCode {
    let all = lab::registry();
    let chosen: Vec<_> = all
        .iter()
        .filter(|e| only.is_none_or(|id| e.id == id))
        .collect();
    if chosen.is_empty() {
        eprintln!(
            "no experiment named {:?}; `pvio list` shows them",
            only.unwrap_or_default()
        );
        return ExitCode::from(2);
    }
    let env = RunEnv::capture(cx);
    warn_if_cores_busy();
    let mut failed = 0;
    let count = chosen.len();
    for (i, e) in chosen.into_iter().enumerate() {
        eprintln!("running {} ({}) ...", e.id, e.paper);
        let line = lab::progress::experiment(e.id, i + 1, count);
        let before = lab::host::Reading::now();
        // On a thread of its own, so that a pin or a panic stays with this experiment.
        let result = match lab::isolated(e.id, || (e.run)(cx)) {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(lab::Error::other(format!("{} panicked", e.id))),
            Err(err) => Err(lab::Error::other(format!("no thread for {}: {err}", e.id))),
        };
        let host = before.and_then(|b| Some(lab::host::Reading::now()?.since(&b)));
        drop(line);
        match result {
            Ok(mut report) => {
                report.host = host;
                if let Some(h) = host.filter(|h| h.disturbed) {
                    eprintln!("{}: {}", e.id, h.line());
                }
                println!("{}", report.table());
                match report.write(out, &env) {
                    Ok(w) => {
                        println!("wrote {} and {}", w.json.display(), w.md.display());
                        for c in &w.charts {
                            println!("wrote {}", c.display());
                        }
                        for e in &w.chart_errors {
                            eprintln!("chart not drawn: {e}");
                        }
                        println!();
                    }
                    Err(err) => {
                        eprintln!("could not write the report of {}: {err}", e.id);
                        failed += 1;
                    }
                }
            }
            Err(err) => {
                eprintln!("experiment {} failed: {err}", e.id);
                failed += 1;
            }
        }
    }
    match lab::site::write_index(out) {
        Ok(p) => println!("wrote {} (every record in {})", p.display(), out.display()),
        Err(err) => {
            eprintln!("could not write {}/index.html: {err}", out.display());
            failed += 1;
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Warns when other processes use the cores as the lab starts (as pyperf's `system
/// show` does): the records measure what pvio's pCPUs get, and a busy host takes it.
fn warn_if_cores_busy() {
    let (busy, steal) = lab::host::busy_others(std::time::Duration::from_millis(500));
    let total: f64 = busy.iter().map(|b| b.1).sum();
    if total + steal > lab::host::DISTURBED_SHARE {
        eprintln!(
            "warning: other processes are using the cores ({:.0}% of a core{}): {}; \
             records taken now will be marked disturbed if it lasts",
            100.0 * total,
            if steal > 0.0 {
                format!(", the hypervisor {:.0}%", 100.0 * steal)
            } else {
                String::new()
            },
            busy.iter()
                .take(5)
                .map(|(n, s)| format!("{n} {:.0}%", 100.0 * s))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// `pvio report`: the page over one folder, or what moved between two.
fn report(dir: Option<PathBuf>, compare: Option<Vec<PathBuf>>, threshold: f64) -> ExitCode {
    use lab::site::{compare_html, compare_text, write_index, Folder};
    let read = |d: &std::path::Path| {
        Folder::read(d).map_err(|e| eprintln!("cannot read {}: {e}", d.display()))
    };
    let Some(pair) = compare else {
        let dir = dir.unwrap_or_else(|| PathBuf::from("results"));
        return match write_index(&dir) {
            Ok(p) => {
                println!("wrote {}", p.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cannot write {}/index.html: {e}", dir.display());
                ExitCode::FAILURE
            }
        };
    };
    let (Ok(old), Ok(new)) = (read(&pair[0]), read(&pair[1])) else {
        return ExitCode::FAILURE;
    };
    let t = threshold / 100.0;
    let changes = lab::site::compare(&old, &new, t);
    print!("{}", compare_text(&old, &new, &changes, t));
    let page = pair[1].join("compare.html");
    match std::fs::write(&page, compare_html(&old, &new, &changes, t)) {
        Ok(()) => {
            println!("wrote {}", page.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cannot write {}: {e}", page.display());
            ExitCode::FAILURE
        }
    }
}

/// `pvio list`: one experiment a line, the ids padded to the longest so that the titles
/// line up.
fn list(all: &[lab::Experiment]) -> String {
    let w = all.iter().map(|e| e.id.len()).max().unwrap_or(0);
    all.iter()
        .map(|e| format!("{:<w$}  {}  [{}]\n", e.id, e.title, e.paper))
        .collect()
}

/// The lab's context for a run the command line asked for.
fn context(quick: bool, idle: rig::IdlePolicy) -> lab::Context {
    let mode = if quick { Mode::Quick } else { Mode::Full };
    lab::Context::new(mode, idle)
}

/// Parses the command line, refusing flags that contradict each other beyond what
/// clap's attributes say.
fn parse<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::CommandFactory;
    let cli = Cli::try_parse_from(args)?;
    if let Command::Up {
        lro,
        lro_flush_every: Some(_),
        ..
    } = &cli.command
    {
        if *lro != LroArg::Delayed {
            return Err(Cli::command().error(
                clap::error::ErrorKind::ArgumentConflict,
                "--lro-flush-every is for --lro delayed only",
            ));
        }
    }
    Ok(cli)
}

fn main() -> ExitCode {
    let cli = parse(std::env::args_os()).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Reproduce {
            quick,
            only,
            out,
            idle,
        } => reproduce(&context(quick, idle), only.as_deref(), &out),
        Command::Bench {
            id,
            quick,
            out,
            idle,
        } => reproduce(&context(quick, idle), Some(&id), &out),
        Command::Report {
            dir,
            compare,
            threshold,
        } => report(dir, compare, threshold),
        Command::Backend {
            domid,
            hotplug,
            log,
            metrics,
            max_vifs,
            max_vbds,
            close,
            cpus,
            sync_disk,
            disk_cache,
            persistent_grants,
        } => backend(&backend::Options {
            domid,
            hotplug: match hotplug {
                HotplugArg::Auto => backend::Hotplug::Auto,
                HotplugArg::Pvio => backend::Hotplug::Pvio,
                HotplugArg::Scripts => backend::Hotplug::Scripts,
            },
            log,
            metrics,
            max_vifs,
            max_vbds,
            close,
            cpus,
            sync_disk,
            disk_cache: match disk_cache {
                DiskCacheArg::Auto => backend::DiskCache::Auto,
                DiskCacheArg::Direct => backend::DiskCache::Direct,
                DiskCacheArg::Cached => backend::DiskCache::Cached,
            },
            persistent_grants: persistent_grants as usize,
        }),
        Command::Up {
            outside_ns,
            guest_ns,
            outside_addr,
            guest_addr,
            no_netfilter,
            no_fragments,
            grant_reuse,
            multi_queue,
            no_offloads,
            lro,
            lro_flush_every,
            mtu_wire,
            cable,
            dma,
            split_ring,
            edge_io,
            idle,
            seconds,
            keep_namespaces,
            watchdog_ms,
            fault,
            fault_after,
            stats_json,
            pcap,
            machine,
        } => {
            let edge_io = match edge_io {
                EdgeArg::Batched => up::EdgeIo::Batched,
                EdgeArg::Armed => up::EdgeIo::Armed,
                EdgeArg::Plain => up::EdgeIo::Plain,
            };
            let cfg = match machine {
                Some(file) => match up::machine_file::load(&file) {
                    Ok(c) => up::UpConfig {
                        pcap,
                        edge_io,
                        idle,
                        ..c
                    },
                    Err(e) => {
                        eprintln!("pvio up: {e}");
                        return ExitCode::from(2);
                    }
                },
                None => up::UpConfig {
                    outside_ns,
                    outside_addr,
                    guests: vec![up::UpGuest {
                        ns: guest_ns,
                        addr: guest_addr,
                        front: up::FrontConfig {
                            rx_buffers: if no_fragments {
                                up::RxBuffers::Linear
                            } else {
                                up::RxBuffers::Fragments
                            },
                            grants: if grant_reuse {
                                up::Grants::Reuse
                            } else {
                                up::Grants::PerIo
                            },
                            offloads: !no_offloads,
                            split_ring,
                        },
                        ..up::UpGuest::nth(0)
                    }],
                    driver: up::DriverConfig {
                        netfilter: !no_netfilter,
                        queues: multi_queue,
                        lro: match lro {
                            LroArg::Off => up::LroMode::Off,
                            LroArg::EveryPoll => up::LroMode::EveryPoll,
                            LroArg::Delayed => up::LroMode::Delayed(lro_flush_every.unwrap_or(2)),
                            LroArg::Adaptive => up::LroMode::Adaptive,
                        }
                        .setup(),
                        ..Default::default()
                    },
                    pcap,
                    mtu_wire,
                    cable,
                    dma_landing: match dma {
                        DmaArg::Cache => up::DmaLanding::Cache,
                        DmaArg::Memory => up::DmaLanding::Memory,
                    },
                    edge_io,
                    idle,
                    ..up::UpConfig::default()
                },
            };
            up(
                &cfg,
                UpRun {
                    seconds,
                    keep_namespaces,
                    watchdog: (watchdog_ms > 0)
                        .then(|| std::time::Duration::from_millis(watchdog_ms)),
                    fault: fault.map(|f| (f, std::time::Duration::from_secs(fault_after))),
                    stats_json,
                },
            )
        }
        Command::Soak {
            seconds,
            hostile,
            restart_every,
            out,
        } => soak(seconds, hostile, restart_every, &out),
        Command::TcpSource { to, bytes } => tcp_source(&to, bytes),
        Command::TcpSink { port } => tcp_sink(port),
        Command::List => {
            print!("{}", list(&lab::registry()));
            ExitCode::SUCCESS
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Each command's help says what that command does, and only that: no command
    /// without a description, none with another's.
    #[test]
    fn every_command_has_its_own_help() {
        Cli::command().debug_assert();
        let cmd = Cli::command();
        let about = |name: &str| {
            cmd.find_subcommand(name)
                .and_then(|c| c.get_about())
                .map(|a| a.to_string())
                .unwrap_or_default()
        };
        let want = [
            ("reproduce", "Runs every registered experiment"),
            ("bench", "Runs one benchmark experiment"),
            ("report", "Writes `index.html`"),
            ("backend", "Serves a real Xen's guests"),
            ("up", "Runs a pv machine on real interfaces"),
            ("soak", "Runs a soak"),
            ("list", "Lists the registered experiments"),
        ];
        for (name, start) in want {
            let a = about(name);
            assert!(a.starts_with(start), "{name}: {a:?}");
            for (other, other_start) in want {
                if other != name {
                    assert!(
                        !a.contains(other_start),
                        "{name}'s help holds {other}'s: {a:?}"
                    );
                }
            }
        }
        let mut out = Vec::new();
        cmd.clone().write_long_help(&mut out).expect("help");
        let help = String::from_utf8(out).expect("utf-8");
        for (name, _) in want {
            assert!(
                help.contains(&format!("  {name} ")),
                "pvio --help lists {name}: {help}"
            );
        }
    }

    /// Flags that cannot act together are refused, not silently ignored.
    #[test]
    fn conflicting_flags_are_refused() {
        let refused = |args: &[&str]| {
            let e = parse(std::iter::once("pvio").chain(args.iter().copied()))
                .expect_err(&format!("{args:?} refused"));
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ArgumentConflict,
                "{args:?}: {e}"
            );
        };
        refused(&["up", "--machine", "m.toml", "--lro-flush-every", "3"]);
        refused(&["up", "--machine", "m.toml", "--multi-queue"]);
        refused(&["up", "--lro-flush-every", "3"]);
        refused(&["up", "--lro", "every-poll", "--lro-flush-every", "3"]);
        refused(&["report", "results", "--compare", "a", "b"]);
        let ok = |args: &[&str]| {
            parse(std::iter::once("pvio").chain(args.iter().copied()))
                .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        };
        ok(&["up", "--lro", "delayed", "--lro-flush-every", "3"]);
        ok(&["up", "--machine", "m.toml", "--seconds", "5"]);
    }

    /// `pvio list` lines its titles up however long the ids are.
    #[test]
    fn list_aligns_every_title() {
        let all = lab::registry();
        let text = list(&all);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), all.len());
        let longest = all.iter().map(|e| e.id.len()).max().expect("experiments");
        for (line, e) in lines.iter().zip(&all) {
            assert_eq!(line.find(e.title), Some(longest + 2), "{line}");
        }
    }
}
