//! `bench up`: real traffic through `pvio up` against a veth pair between two network
//! namespaces on the same machine, in the same run (issue 16, part 6).
//!
//! iperf3 runs TCP into the guest, TCP out of it (`-R`) and UDP into it, between the
//! outside namespace and the guest's, three times over: through `pvio up` (the NIC
//! model's cable on one TAP, netback and netfront, the guest's frames on another TAP),
//! through a veth pair with its offloads off (checksum, TSO, GSO, GRO: every segment
//! crosses as a frame of at most the MTU), through the same pair with its offloads on,
//! and through `pvio up --no-offloads` (the path without checksum offload and GSO, to
//! show what they bring). Ratios are taken per round. Before the iperf3 runs, an
//! 8 MiB seeded stream crosses pvio each way and is checked byte for byte (`pvio
//! tcp-source` / `tcp-sink`; iperf3 does not look at its bytes).
//!
//! Then LRO (issue 18, item 7): with a cable of MTU-sized frames, as a real wire
//! carries them, iperf3 TCP into the guest and sockperf's TCP ping-pong through `pvio
//! up` with LRO off, flushed every poll, every second poll (DA) and adaptively, beside
//! a veth pair whose sender segments (TSO off) and whose receiver has GRO off, on, and
//! on with a 20 µs `gro_flush_timeout` (`napi_defer_hard_irqs` = 2), in the same
//! rounds. Segments per packet up the receiving stack come from pvio's cable and guest
//! TAP counters, and from the veth receiver's IP counters (GRO's packets count their
//! segments there).

use std::path::{Path as FsPath, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::{Error, Experiment, Mode, Report};
use rig::tools;
use up::{up, DriverConfig, LroMode, UpConfig, UpGuest};

/// The registry entry.
pub const EXPERIMENT: Experiment = Experiment {
    id: "up",
    title: "real traffic: iperf3 through pvio up against a veth pair (offloads off and on)",
    paper: "issue 16 (reference: a veth pair between two namespaces, same run)",
    run,
};

/// The paths compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Pvio,
    VethOff,
    VethOn,
    PvioPlain,
}

impl Path {
    const ALL: [Path; 4] = [Path::Pvio, Path::VethOff, Path::VethOn, Path::PvioPlain];
    fn name(self) -> &'static str {
        match self {
            Path::Pvio => "pvio up",
            Path::VethOff => "veth, offloads off",
            Path::VethOn => "veth, offloads on",
            Path::PvioPlain => "pvio up --no-offloads",
        }
    }
}

/// The traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    TcpIn,
    TcpOut,
    UdpIn,
}

impl Flow {
    const ALL: [Flow; 3] = [Flow::TcpIn, Flow::TcpOut, Flow::UdpIn];
    fn name(self) -> &'static str {
        match self {
            Flow::TcpIn => "TCP into the guest",
            Flow::TcpOut => "TCP out of the guest",
            Flow::UdpIn => "UDP into the guest (1470 B datagrams, offered 2 Gbit/s)",
        }
    }
    fn args(self) -> &'static [&'static str] {
        match self {
            Flow::TcpIn => &[],
            Flow::TcpOut => &["-R"],
            Flow::UdpIn => &["-u", "-b", "2G", "-l", "1470"],
        }
    }
}

/// The veth receiver's GRO in the LRO rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gro {
    Off,
    On,
    /// On, with a 20 µs `gro_flush_timeout` and `napi_defer_hard_irqs` = 2: Linux's
    /// static form of the paper's delayed aggregation.
    OnTimeout,
}

/// A receive path of the LRO rows: MTU-sized frames arrive, and are aggregated (or
/// not) before the receiving stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rx {
    Pvio(LroMode),
    /// `pvio up --cable`: the cable a packet socket on a veth whose far end sends.
    Cable(LroMode),
    Veth(Gro),
}

impl Rx {
    const ALL: [Rx; 7] = [
        Rx::Pvio(LroMode::Off),
        Rx::Pvio(LroMode::EveryPoll),
        Rx::Pvio(LroMode::Delayed(2)),
        Rx::Pvio(LroMode::Adaptive),
        Rx::Veth(Gro::Off),
        Rx::Veth(Gro::On),
        Rx::Veth(Gro::OnTimeout),
    ];
    /// The paths a run of `mode` measures: the cable on a veth in full runs only.
    fn all(mode: Mode) -> Vec<Rx> {
        let mut v = Rx::ALL.to_vec();
        if mode == Mode::Full {
            v.extend([Rx::Cable(LroMode::Off), Rx::Cable(LroMode::Adaptive)]);
        }
        v
    }
    fn name(self) -> String {
        match self {
            Rx::Pvio(m) => format!("pvio up, LRO {}", m.name()),
            Rx::Cable(m) => format!("pvio up --cable (a veth), LRO {}", m.name()),
            Rx::Veth(Gro::Off) => "veth, GRO off".into(),
            Rx::Veth(Gro::On) => "veth, GRO on".into(),
            Rx::Veth(Gro::OnTimeout) => "veth, GRO on, gro_flush_timeout 20 µs".into(),
        }
    }
    /// What its ratios are taken against: the same path without aggregation.
    fn base(self) -> Rx {
        match self {
            Rx::Pvio(_) => Rx::Pvio(LroMode::Off),
            Rx::Cable(_) => Rx::Cable(LroMode::Off),
            Rx::Veth(_) => Rx::Veth(Gro::Off),
        }
    }
}

fn run_cmd(args: &[&str]) -> Result<Output, Error> {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| Error::other(format!("{}: {e}", args.join(" "))))
}

fn ok(args: &[&str]) -> Result<(), Error> {
    let o = run_cmd(args)?;
    if o.status.success() {
        Ok(())
    } else {
        Err(Error::other(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        )))
    }
}

/// Namespaces made for the run, removed when dropped.
struct Namespaces(Vec<String>);

impl Namespaces {
    fn make(names: &[String]) -> Result<Self, Error> {
        let mut made = Self(Vec::new());
        for n in names {
            ok(&["ip", "netns", "add", n])?;
            made.0.push(n.clone());
        }
        Ok(made)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = run_cmd(&["ip", "netns", "del", n]);
        }
    }
}

/// Two namespaces joined by a veth pair, removed when dropped.
struct Veth {
    a: String,
    b: String,
}

impl Veth {
    fn new(offloads: bool) -> Result<Self, Error> {
        let on = if offloads { "on" } else { "off" };
        let all = ["tx", on, "rx", on, "tso", on, "gso", on, "gro", on];
        Self::with(&all, &all)
    }

    /// The LRO rows' reference: the sender segments its TCP (TSO off) so MTU-sized
    /// frames cross; the receiver's aggregation is set with [`Veth::set_gro`].
    fn segmenting() -> Result<Self, Error> {
        Self::with(&["tso", "off"], &["gro", "off"])
    }

    /// The receiver's GRO as `gro` says (one pair for every setting: namespaces made
    /// and removed are work the kernel finishes later, on the cores the next
    /// measurement wants).
    fn set_gro(&self, gro: Gro) -> Result<(), Error> {
        let on = if gro == Gro::Off { "off" } else { "on" };
        ok(&[
            "ip", "netns", "exec", &self.b, "ethtool", "-K", "vb", "gro", on,
        ])?;
        let (timeout, defer) = if gro == Gro::OnTimeout {
            (20000, 2)
        } else {
            (0, 0)
        };
        // sysfs as the receiver's namespace sees it (`ip netns exec` mounts it).
        ok(&[
            "ip",
            "netns",
            "exec",
            &self.b,
            "sh",
            "-c",
            &format!(
                "echo {timeout} > /sys/class/net/vb/gro_flush_timeout && \
                 echo {defer} > /sys/class/net/vb/napi_defer_hard_irqs"
            ),
        ])
    }

    /// `a`'s `va` and `b`'s `vb`, with these ethtool `-K` settings each.
    fn with(a_features: &[&str], b_features: &[&str]) -> Result<Self, Error> {
        let pid = std::process::id();
        let v = Self {
            a: format!("pvio-b{pid}-a"),
            b: format!("pvio-b{pid}-b"),
        };
        ok(&["ip", "netns", "add", &v.a])?;
        ok(&["ip", "netns", "add", &v.b])?;
        ok(&[
            "ip", "-n", &v.a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns",
            &v.b,
        ])?;
        for (ns, dev, addr, features) in [
            (&v.a, "va", "10.79.0.1/24", a_features),
            (&v.b, "vb", "10.79.0.2/24", b_features),
        ] {
            ok(&["ip", "-n", ns, "addr", "add", addr, "dev", dev])?;
            ok(&["ip", "-n", ns, "link", "set", dev, "up"])?;
            ok(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
            let mut args = vec!["ip", "netns", "exec", ns, "ethtool", "-K", dev];
            args.extend_from_slice(features);
            ok(&args)?;
        }
        Ok(v)
    }
}

impl Drop for Veth {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = run_cmd(&["ip", "netns", "del", ns]);
        }
    }
}

/// A veth for `pvio up --cable`: `dev` stays in this namespace for pvio's packet socket,
/// its peer goes into namespace `far` with `addr`, sending MTU-sized frames with their
/// checksums, as a wire carries them. Removed when dropped.
struct CableVeth {
    dev: String,
    far: String,
}

impl CableVeth {
    fn new(addr: &str) -> Result<Self, Error> {
        let pid = std::process::id() % 100_000;
        let v = Self {
            dev: format!("pvcb{pid}"),
            far: format!("pvio-b{pid}-far"),
        };
        ok(&["ip", "netns", "add", &v.far])?;
        ok(&[
            "ip", "link", "add", &v.dev, "type", "veth", "peer", "name", "vfar", "netns", &v.far,
        ])?;
        ok(&["ip", "-n", &v.far, "addr", "add", addr, "dev", "vfar"])?;
        ok(&["ip", "-n", &v.far, "link", "set", "vfar", "up"])?;
        ok(&["ip", "-n", &v.far, "link", "set", "lo", "up"])?;
        ok(&[
            "ip", "netns", "exec", &v.far, "ethtool", "-K", "vfar", "tx", "off", "tso", "off",
            "gso", "off",
        ])?;
        Ok(v)
    }
}

impl Drop for CableVeth {
    fn drop(&mut self) {
        let _ = run_cmd(&["ip", "link", "del", &self.dev]);
        let _ = run_cmd(&["ip", "netns", "del", &self.far]);
    }
}

/// What one iperf3 run gave.
struct Iperf {
    /// The receiver's bits per second.
    bps: f64,
    /// UDP: the datagrams lost, of those sent.
    udp: Option<(u64, u64)>,
    /// TCP: the sender's retransmitted segments.
    retransmits: u64,
}

/// iperf3 from `client_ns` to the server in `server_ns` at `addr`, for `secs`.
fn iperf(
    client_ns: &str,
    server_ns: &str,
    addr: &str,
    flow: Flow,
    secs: u64,
) -> Result<Iperf, Error> {
    let mut server = Command::new("ip")
        .args([
            "netns", "exec", server_ns, "iperf3", "-s", "-1", "-p", "5299",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(Error::other)?;
    std::thread::sleep(Duration::from_millis(300));
    let secs = secs.to_string();
    let mut args = vec![
        "ip", "netns", "exec", client_ns, "iperf3", "-c", addr, "-p", "5299", "-J", "-t", &secs,
    ];
    args.extend_from_slice(flow.args());
    let o = run_cmd(&args);
    let _ = server.kill();
    let _ = server.wait();
    let o = o?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .map_err(|e| Error::other(format!("iperf3 {}: {e}", flow.name())))?;
    if let Some(e) = v.get("error") {
        return Err(Error::other(format!("iperf3 {}: {e}", flow.name())));
    }
    let sum = &v["end"]["sum_received"];
    let bps = sum["bits_per_second"]
        .as_f64()
        .ok_or_else(|| Error::other(format!("iperf3 {}: no rate", flow.name())))?;
    let udp = (flow == Flow::UdpIn).then(|| {
        (
            sum["lost_packets"].as_u64().unwrap_or(0),
            sum["packets"].as_u64().unwrap_or(0),
        )
    });
    let retransmits = v["end"]["sum_sent"]["retransmits"].as_u64().unwrap_or(0);
    Ok(Iperf {
        bps,
        udp,
        retransmits,
    })
}

/// IP packets received in namespace `ns`, and the segments they carried (Linux counts
/// a GRO packet's segments in its ECN counters, one per packet in `InReceives`).
fn ip_segments(ns: &str) -> Result<(u64, u64), Error> {
    let o = run_cmd(&[
        "ip",
        "netns",
        "exec",
        ns,
        "cat",
        "/proc/net/snmp",
        "/proc/net/netstat",
    ])?;
    let text = String::from_utf8_lossy(&o.stdout);
    let mut get = std::collections::HashMap::new();
    let lines: Vec<&str> = text.lines().collect();
    for pair in lines.chunks(2) {
        if let [names, values] = pair {
            let mut n = names.split_whitespace();
            let table = n.next().unwrap_or_default();
            for (k, v) in n.zip(values.split_whitespace().skip(1)) {
                get.insert(format!("{table}{k}"), v.parse::<u64>().unwrap_or(0));
            }
        }
    }
    let v = |k: &str| get.get(k).copied();
    let packets =
        v("Ip:InReceives").ok_or_else(|| Error::other(format!("{ns}: no Ip InReceives")))?;
    let segments = ["NoECT", "ECT0", "ECT1", "CE"]
        .iter()
        .map(|e| v(&format!("IpExt:In{e}Pkts")))
        .sum::<Option<u64>>()
        .ok_or_else(|| Error::other(format!("{ns}: no IpExt ECN counters")))?;
    Ok((packets, segments))
}

/// sockperf's TCP ping-pong from `client_ns` to the server in `server_ns` at `addr`
/// for `secs`: round-trip median and p99, µs.
fn sockperf(client_ns: &str, server_ns: &str, addr: &str, secs: u64) -> Result<(f64, f64), Error> {
    let mut server = Command::new("ip")
        .args([
            "netns", "exec", server_ns, "sockperf", "server", "--tcp", "-i", addr, "-p", "11111",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(Error::other)?;
    std::thread::sleep(Duration::from_millis(300));
    let secs = secs.to_string();
    let o = run_cmd(&[
        "ip",
        "netns",
        "exec",
        client_ns,
        "sockperf",
        "ping-pong",
        "--tcp",
        "-i",
        addr,
        "-p",
        "11111",
        "-t",
        &secs,
        "--full-rtt",
    ]);
    let _ = server.kill();
    let _ = server.wait();
    let o = o?;
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    let pct = |p: &str| {
        text.lines()
            .find_map(|l| l.split_once(&format!("percentile {p} =")))
            .and_then(|(_, v)| v.trim().parse::<f64>().ok())
    };
    match (pct("50.000"), pct("99.000")) {
        (Some(m), Some(p)) => Ok((m, p)),
        _ => Err(Error::other(format!(
            "sockperf ping-pong to {addr}: no percentiles in its output: {}",
            text.lines().last().unwrap_or_default()
        ))),
    }
}

/// This program, if it is `pvio` (its `tcp-source` and `tcp-sink` check a stream).
fn pvio_exe() -> Option<PathBuf> {
    std::env::current_exe()
        .ok()
        .filter(|p| p.file_name().is_some_and(|n| n == "pvio"))
}

/// An 8 MiB seeded stream from `source_ns` to `to` in `sink_ns`: whether it arrived
/// byte for byte (the digests of both ends agree).
fn stream_intact(exe: &FsPath, sink_ns: &str, source_ns: &str, to: &str) -> Result<bool, Error> {
    let exe = exe.to_str().ok_or_else(|| Error::other("exe path"))?;
    let port = to.rsplit(':').next().unwrap_or("5300");
    let sink = Command::new("ip")
        .args(["netns", "exec", sink_ns, exe, "tcp-sink", "--port", port])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(Error::other)?;
    std::thread::sleep(Duration::from_millis(300));
    let sent = run_cmd(&[
        "ip",
        "netns",
        "exec",
        source_ns,
        exe,
        "tcp-source",
        "--to",
        to,
        "--bytes",
        "8388608",
    ])?;
    let got = sink.wait_with_output().map_err(Error::other)?;
    let (sent, got) = (
        String::from_utf8_lossy(&sent.stdout).trim().to_string(),
        String::from_utf8_lossy(&got.stdout).trim().to_string(),
    );
    Ok(sent.starts_with("8388608 ") && sent == got)
}

/// The configuration a record names: the rounds and each iperf3's seconds, the flows
/// and paths, and the LRO rows' own plan.
#[derive(Debug, serde::Serialize)]
struct Recorded {
    mode: String,
    rounds: usize,
    seconds: u64,
    flows: Vec<&'static str>,
    paths: Vec<&'static str>,
    lro: LroRecord,
}

/// The LRO rows: rounds, iperf3's and sockperf's seconds, the receive paths.
#[derive(Debug, serde::Serialize)]
struct LroRecord {
    rounds: usize,
    iperf3_seconds: u64,
    sockperf_seconds: u64,
    paths: Vec<String>,
}

fn run(cx: &crate::Context) -> Result<Report, Error> {
    let mode = cx.mode;
    let mut rep = Report::new(EXPERIMENT.id, EXPERIMENT.title, EXPERIMENT.paper);
    // `pvio up` always halt-polls: iperf3, sockperf and the TAPs' far ends share its cores.
    rep.idle = Some(hv::sched::IdlePolicy::HALT_POLL.name());
    let plan = Plan::of(mode);
    rep.setup = setup(&plan);
    rep.set_config(&Recorded {
        mode: format!("{mode:?}"),
        rounds: plan.rounds,
        seconds: plan.secs,
        flows: Flow::ALL.map(Flow::name).to_vec(),
        paths: Path::ALL.map(Path::name).to_vec(),
        lro: LroRecord {
            rounds: plan.lro_rounds,
            iperf3_seconds: plan.lro_secs,
            sockperf_seconds: plan.ping_secs,
            paths: Rx::ALL.map(Rx::name).to_vec(),
        },
    });
    if let Err(e) = tools::ensure(&[tools::IP, tools::IPERF3, tools::ETHTOOL]) {
        rep.notes.push(format!("not measured: {e}"));
        return Ok(rep);
    }
    let probe = format!("pvio-b{}-probe", std::process::id());
    if let Err(e) = ok(&["ip", "netns", "add", &probe]) {
        rep.notes.push(format!(
            "not measured: network namespaces cannot be made here (it needs root): {e}"
        ));
        return Ok(rep);
    }
    let _ = run_cmd(&["ip", "netns", "del", &probe]);
    let cfg = UpConfig {
        outside_ns: format!("pvio-b{}-o", std::process::id()),
        outside_addr: "10.80.0.1/24".into(),
        guests: vec![UpGuest {
            ns: format!("pvio-b{}-g", std::process::id()),
            addr: "10.80.0.2/24".into(),
            ..UpGuest::nth(0)
        }],
        ..UpConfig::default()
    };
    // pvio's namespaces live for the whole run: `up` finds them and leaves them, so
    // that each machine brought up does not make and remove namespaces again.
    let _namespaces = Namespaces::make(&[cfg.outside_ns.clone(), cfg.guest().ns.clone()])?;
    crate::progress::plan(
        (plan.rounds * Path::ALL.len() * Flow::ALL.len() + plan.lro_rounds * Rx::ALL.len()) as u64,
    );
    let t = tcp_rounds(&cfg, &plan)?;
    tcp_rows(&mut rep, &t.rates);
    loss_checks(&mut rep, &t);
    let intact = t.intact;
    match tools::ensure(&[tools::SOCKPERF]) {
        Ok(()) => lro_rows(
            &mut rep,
            &cfg,
            &Rx::all(mode),
            plan.lro_rounds,
            plan.lro_secs,
            plan.ping_secs,
        )?,
        Err(e) => rep.notes.push(format!("LRO rows not measured: {e}")),
    }
    stream_check(&mut rep, intact, "");
    Ok(rep)
}

/// The check that the seeded streams crossed pvio (`through`: and what) byte for byte,
/// or the note that they ran only from the `pvio` binary.
fn stream_check(rep: &mut Report, intact: Option<bool>, through: &str) {
    match intact {
        Some(ok) => rep.check(
            &format!("an 8 MiB seeded stream each way through pvio{through} arrives byte for byte"),
            if ok { 0.0 } else { 1.0 },
            "streams corrupt",
            "0",
            ok,
        ),
        None => rep.notes.push(format!(
            "the byte-for-byte stream check{through} runs from the `pvio` binary only (not here)"
        )),
    }
}

/// Rounds and seconds: the TCP and UDP rounds, and the LRO rows' (iperf3 and sockperf).
#[derive(Debug, Clone, Copy)]
struct Plan {
    rounds: usize,
    secs: u64,
    lro_rounds: usize,
    lro_secs: u64,
    ping_secs: u64,
}

impl Plan {
    fn of(mode: Mode) -> Self {
        let (rounds, secs) = match mode {
            Mode::Full => (5, 5),
            Mode::Quick => (1, 2),
            Mode::Smoke => (1, 1),
        };
        // The LRO rows: rounds, iperf3 seconds, sockperf seconds.
        let (lro_rounds, lro_secs, ping_secs) = match mode {
            Mode::Full => (5, 5, 3),
            Mode::Quick => (1, 2, 1),
            Mode::Smoke => (1, 1, 1),
        };
        Self {
            rounds,
            secs,
            lro_rounds,
            lro_secs,
            ping_secs,
        }
    }
}

/// What runs where, for the record.
fn setup(plan: &Plan) -> String {
    let Plan {
        rounds,
        secs,
        lro_rounds,
        lro_secs,
        ping_secs,
    } = *plan;
    format!(
        "iperf3 (-J, {secs} s a run, one stream) between two network namespaces: through `pvio \
         up` (outside namespace → TAP → NIC model → driver domain's bridge and netback → \
         netfront → TAP in the guest's namespace; its defaults: page fragments, a grant per \
         I/O, netfilter hooks on, checksum offload and GSO: TAPs with a virtio-net header, \
         large TCP segments whole over the rings and through the NIC to the cable's TAP, \
         which takes them with their segment size; the NIC's DMA writes land in the cache, as \
         on a present-day host with Data Direct I/O), through the same with --no-offloads, and through a veth pair with \
         ethtool's tx, rx, tso, gso and gro offloads off, then on. {rounds} rounds; in each, every path carries every \
         flow once and ratios are taken within the round. Before the rounds an 8 MiB seeded \
         stream crosses pvio each way, checked byte for byte. LRO rows ({lro_rounds} rounds of \
         {lro_secs} s iperf3 and {ping_secs} s sockperf each): the cable takes no large segments \
         (the outside's kernel segments its TCP, as for a real wire), pvio's driver domain runs \
         LRO off, every poll, every 2nd poll (DA, held at most 1 ms) and adaptive (200 µs \
         budget), the bridge handing aggregates to netback whole and the guest's TAP taking \
         them as large segments; beside them a veth pair whose sender has TSO off and whose \
         receiver has GRO off, on, and on with gro_flush_timeout 20 µs and \
         napi_defer_hard_irqs 2. In full runs, also `pvio up --cable` (LRO off and adaptive): \
         the cable a packet socket with mapped rings on a veth whose far end sends MTU-sized \
         frames with complete checksums (tx, tso and gso off), in place of the TAP. Segments \
         per packet: for pvio, frames in from the cable over \
         packets handed to the guest's TAP; for veth, the receiver's IpExt In*Pkts (a GRO \
         packet counts its segments) over Ip InReceives. sockperf: TCP ping-pong, default \
         message size, --full-rtt. An 8 MiB seeded stream crosses pvio with adaptive LRO each \
         way, checked byte for byte."
    )
}

/// The TCP and UDP rounds' results.
struct TcpRuns {
    /// Gbit/s by path, flow and round.
    rates: Vec<Vec<Vec<f64>>>,
    /// pvio's UDP runs: (lost, sent) datagrams.
    udp_loss: Vec<(u64, u64)>,
    /// Per path, over its TCP runs: the senders' retransmissions, and the frames the NIC
    /// had no buffer for (pvio's paths).
    tcp_losses: Vec<(u64, u64)>,
    /// Whether the seeded streams crossed pvio intact (None: not run).
    intact: Option<bool>,
}

/// Every path carries every flow once a round.
fn tcp_rounds(cfg: &UpConfig, plan: &Plan) -> Result<TcpRuns, Error> {
    let (rounds, secs) = (plan.rounds, plan.secs);
    let mut rates = vec![vec![Vec::new(); Flow::ALL.len()]; Path::ALL.len()];
    let mut udp_loss: Vec<(u64, u64)> = Vec::new();
    let mut tcp_losses = vec![(0u64, 0u64); Path::ALL.len()];
    let mut intact = None;
    for round in 0..rounds {
        for (pi, path) in Path::ALL.into_iter().enumerate() {
            // Up for this path's flows, down at the end of them.
            let mut machine = None;
            let veth;
            // The path's namespaces and addresses: (outside, guest, the guest's address).
            let (o, g, addr) = match path {
                Path::Pvio | Path::PvioPlain => {
                    let mut c = cfg.clone();
                    c.guest_mut().front.offloads = path == Path::Pvio;
                    machine = Some(up(&c)?);
                    if intact.is_none() && path == Path::Pvio {
                        if let Some(exe) = pvio_exe() {
                            let (o, g) = (cfg.outside_ns.as_str(), cfg.guest().ns.as_str());
                            intact = Some(
                                stream_intact(&exe, g, o, "10.80.0.2:5300")?
                                    && stream_intact(&exe, o, g, "10.80.0.1:5300")?,
                            );
                        }
                    }
                    (cfg.outside_ns.clone(), cfg.guest().ns.clone(), "10.80.0.2")
                }
                Path::VethOff | Path::VethOn => {
                    veth = Veth::new(path == Path::VethOn)?;
                    (veth.a.clone(), veth.b.clone(), "10.79.0.2")
                }
            };
            for (fi, flow) in Flow::ALL.into_iter().enumerate() {
                crate::progress::step(format_args!(
                    "{} · {} · {}",
                    crate::progress::round(round, rounds),
                    path.name(),
                    flow.name()
                ));
                let missed = || machine.as_ref().map_or(0, |m| m.counters().rx_missed);
                let before = missed();
                let r = iperf(&o, &g, addr, flow, secs)?;
                rates[pi][fi].push(r.bps / 1e9);
                if flow != Flow::UdpIn {
                    tcp_losses[pi].0 += r.retransmits;
                    tcp_losses[pi].1 += missed().saturating_sub(before);
                }
                if path == Path::Pvio {
                    udp_loss.extend(r.udp);
                }
            }
        }
    }
    Ok(TcpRuns {
        rates,
        udp_loss,
        tcp_losses,
        intact,
    })
}

/// Each flow's rates on every path, pvio's against the veth pair's in the same round.
fn tcp_rows(rep: &mut Report, rates: &[Vec<Vec<f64>>]) {
    for (fi, flow) in Flow::ALL.into_iter().enumerate() {
        let off = rates[1][fi].clone();
        let on = rates[2][fi].clone();
        rep.row(flow.name(), Path::VethOff.name(), "Gbit/s", &off);
        rep.row(flow.name(), Path::VethOn.name(), "Gbit/s", &on);
        let x_off = crate::stats::ratio_median(&rates[0][fi], &off).unwrap_or(f64::NAN);
        let x_on = crate::stats::ratio_median(&rates[0][fi], &on).unwrap_or(f64::NAN);
        rep.row(flow.name(), Path::Pvio.name(), "Gbit/s", &rates[0][fi])
            .ratio = Some((Path::VethOff.name().into(), x_off));
        let x_plain = crate::stats::ratio_median(&rates[0][fi], &rates[3][fi]).unwrap_or(f64::NAN);
        let x_plain_off = crate::stats::ratio_median(&rates[3][fi], &off).unwrap_or(f64::NAN);
        rep.row(flow.name(), Path::PvioPlain.name(), "Gbit/s", &rates[3][fi])
            .ratio = Some((Path::VethOff.name().into(), x_plain_off));
        rep.notes.push(format!(
            "{}: offloads take pvio to {x_plain:.2}× its own path without them (median of \
             per-round ratios).",
            flow.name()
        ));
        if flow != Flow::UdpIn {
            rep.check(
                &format!(
                    "{}: pvio ≥ 1.0× the veth pair with offloads off",
                    flow.name()
                ),
                x_off,
                "× veth, offloads off",
                "≥ 1",
                x_off >= 1.0,
            );
            rep.check(
                &format!(
                    "{}: pvio ≥ 0.5× the veth pair with offloads on",
                    flow.name()
                ),
                x_on,
                "× veth, offloads on",
                "≥ 0.5",
                x_on >= 0.5,
            );
        }
    }
}

/// What pvio's two paths lost on TCP, against the veth pair's two in the same rounds,
/// and UDP's losses.
fn loss_checks(rep: &mut Report, t: &TcpRuns) {
    let (tcp_losses, udp_loss) = (&t.tcp_losses, &t.udp_loss);
    let at = |p: Path| Path::ALL.iter().position(|&q| q == p).unwrap_or(0);
    let both = |a: Path, b: Path| {
        let (x, y) = (tcp_losses[at(a)], tcp_losses[at(b)]);
        (x.0 + y.0, x.1 + y.1)
    };
    let (pvio_re, missed) = both(Path::Pvio, Path::PvioPlain);
    let (veth_re, _) = both(Path::VethOff, Path::VethOn);
    rep.check(
        "TCP through pvio up: frames the NIC had no buffer for (rx_missed, every TCP run both \
         ways)",
        missed as f64,
        "frames",
        "0",
        missed == 0,
    );
    // The veth pair's are the host kernel's own (its backlog overflowing under a fast
    // sender), beside pvio's for scale: pvio's path is to lose nothing at all.
    rep.check(
        "TCP through pvio up: the senders' retransmissions (every TCP run both ways)",
        pvio_re as f64,
        "segments",
        &format!("0 (the veth pair's in the same rounds: {veth_re})"),
        pvio_re == 0,
    );
    let (lost, sent) = udp_loss
        .iter()
        .fold((0, 0), |(l, s), &(a, b)| (l + a, s + b));
    rep.notes.push(format!(
        "UDP through pvio: {lost} of {sent} datagrams lost over all rounds (iperf3's count; \
         offered above what the path carries, so loss measures the excess)."
    ));
}

/// Per-round samples of one receive path of the LRO rows.
#[derive(Debug, Clone, Default)]
struct RxSamples {
    gbps: Vec<f64>,
    segs_per_packet: Vec<f64>,
    rtt_median: Vec<f64>,
    rtt_p99: Vec<f64>,
}

/// The LRO rows: every receive path in every round, ratios within the round.
fn lro_rows(
    rep: &mut Report,
    cfg: &UpConfig,
    paths: &[Rx],
    rounds: usize,
    secs: u64,
    ping_secs: u64,
) -> Result<(), Error> {
    let (s, intact) = lro_measure(cfg, paths, rounds, secs, ping_secs)?;
    let at = |rx: Rx| paths.iter().position(|&r| r == rx).unwrap_or(0);
    let group = |what: &str| format!("LRO and GRO, MTU-sized frames on the wire: {what}");
    for (what, unit, get) in [
        (
            "iperf3 TCP into the receiver",
            "Gbit/s",
            (|x: &RxSamples| &x.gbps) as fn(&RxSamples) -> &Vec<f64>,
        ),
        (
            "segments per packet up the receiving stack",
            "segments",
            |x: &RxSamples| &x.segs_per_packet,
        ),
        (
            "sockperf TCP ping-pong round trip, median",
            "µs",
            |x: &RxSamples| &x.rtt_median,
        ),
        (
            "sockperf TCP ping-pong round trip, p99",
            "µs",
            |x: &RxSamples| &x.rtt_p99,
        ),
    ] {
        for (i, &rx) in paths.iter().enumerate() {
            let base = rx.base();
            let row = rep.row(&group(what), &rx.name(), unit, get(&s[i]));
            if base != rx {
                row.ratio = crate::stats::ratio_median(get(&s[i]), get(&s[at(base)]))
                    .map(|x| (base.name(), x));
            }
        }
    }
    lro_checks(rep, &s, &at, intact);
    Ok(())
}

/// The LRO rounds: each receive path carries an iperf3 stream and a sockperf
/// ping-pong; its rate, segments per packet and round trips, and whether the seeded
/// streams crossed pvio's adaptive LRO intact.
fn lro_measure(
    cfg: &UpConfig,
    paths: &[Rx],
    rounds: usize,
    secs: u64,
    ping_secs: u64,
) -> Result<(Vec<RxSamples>, Option<bool>), Error> {
    let mut s = vec![RxSamples::default(); paths.len()];
    let mut intact = None;
    let pair = Veth::segmenting()?;
    let cable = if paths.iter().any(|r| matches!(r, Rx::Cable(_))) {
        Some(CableVeth::new(&cfg.outside_addr)?)
    } else {
        None
    };
    for round in 0..rounds {
        for (i, &rx) in paths.iter().enumerate() {
            crate::progress::step(format_args!(
                "{} · {} · iperf3 and sockperf",
                crate::progress::round(round, rounds),
                rx.name()
            ));
            let mut machine = None;
            let (o, g, addr) = match rx {
                Rx::Pvio(m) => {
                    let c = UpConfig {
                        driver: DriverConfig {
                            lro: m.setup(),
                            ..cfg.driver
                        },
                        mtu_wire: true,
                        ..cfg.clone()
                    };
                    machine = Some(up(&c)?);
                    let (o, g) = (cfg.outside_ns.clone(), cfg.guest().ns.clone());
                    if intact.is_none() && m == LroMode::Adaptive {
                        if let Some(exe) = pvio_exe() {
                            intact = Some(
                                stream_intact(&exe, &g, &o, "10.80.0.2:5300")?
                                    && stream_intact(&exe, &o, &g, "10.80.0.1:5300")?,
                            );
                        }
                    }
                    (o, g, "10.80.0.2")
                }
                Rx::Cable(m) => {
                    let far = cable
                        .as_ref()
                        .ok_or_else(|| Error::other("no cable veth"))?;
                    let c = UpConfig {
                        driver: DriverConfig {
                            lro: m.setup(),
                            ..cfg.driver
                        },
                        mtu_wire: true,
                        cable: Some(far.dev.clone()),
                        ..cfg.clone()
                    };
                    machine = Some(up(&c)?);
                    (far.far.clone(), cfg.guest().ns.clone(), "10.80.0.2")
                }
                Rx::Veth(gro) => {
                    pair.set_gro(gro)?;
                    (pair.a.clone(), pair.b.clone(), "10.79.0.2")
                }
            };
            // Segments arrived and packets handed up: the cable's frames and the guest
            // TAP's for pvio, the receiver's IP counters for the veth pair.
            let count = |m: &Option<up::Up>| -> Result<(u64, u64), Error> {
                match m {
                    Some(m) => {
                        let c = m.counters();
                        Ok((c.guest_in, c.wire_in))
                    }
                    None => ip_segments(&g),
                }
            };
            let before = count(&machine)?;
            let bps = iperf(&o, &g, addr, Flow::TcpIn, secs)?.bps;
            let after = count(&machine)?;
            let packets = after.0.saturating_sub(before.0).max(1);
            let segments = after.1.saturating_sub(before.1);
            let (median, p99) = sockperf(&o, &g, addr, ping_secs)?;
            s[i].gbps.push(bps / 1e9);
            s[i].segs_per_packet.push(segments as f64 / packets as f64);
            s[i].rtt_median.push(median);
            s[i].rtt_p99.push(p99);
            drop(machine);
        }
    }
    Ok((s, intact))
}

/// The LRO rows' targets: adaptive LRO against no LRO and against the veth pair's GRO,
/// the round trip, segments per packet, and the seeded streams.
fn lro_checks(rep: &mut Report, s: &[RxSamples], at: &dyn Fn(Rx) -> usize, intact: Option<bool>) {
    let adaptive = &s[at(Rx::Pvio(LroMode::Adaptive))];
    let x = crate::stats::ratio_median(&adaptive.gbps, &s[at(Rx::Pvio(LroMode::Off))].gbps)
        .unwrap_or(f64::NAN);
    rep.check(
        "iperf3 TCP into the guest, MTU-sized frames on the wire: adaptive LRO ≥ 1.3× the same path without LRO",
        x,
        "× LRO off",
        "≥ 1.3",
        x >= 1.3,
    );
    // Issue 41's target: with a real wire's frames, pvio's LRO at half of what a veth
    // pair's GRO gets the same receiver.
    let gro = crate::stats::ratio_median(&adaptive.gbps, &s[at(Rx::Veth(Gro::On))].gbps)
        .unwrap_or(f64::NAN);
    rep.check(
        "iperf3 TCP into the guest, MTU-sized frames on the wire: adaptive LRO ≥ 0.5× the veth \
         pair with GRO on",
        gro,
        "× veth, GRO on",
        "≥ 0.5",
        gro >= 0.5,
    );
    // Issue 40's target: a round trip through the platform within 3× the veth pair's,
    // now that a wake-up is an IPI's order rather than a host wake-up per hop.
    let rtt = crate::stats::ratio_median(
        &s[at(Rx::Pvio(LroMode::Off))].rtt_median,
        &s[at(Rx::Veth(Gro::Off))].rtt_median,
    )
    .unwrap_or(f64::NAN);
    rep.check(
        "sockperf TCP ping-pong round trip through pvio up (LRO off) ≤ 3× the veth pair's (GRO off)",
        rtt,
        "× veth, GRO off",
        "≤ 3",
        rtt <= 3.0,
    );
    let median = |v: &[f64]| crate::stats::Stats::of(v).median;
    let (a, v) = (
        median(&adaptive.segs_per_packet),
        median(&s[at(Rx::Veth(Gro::On))].segs_per_packet),
    );
    rep.check(
        "segments per packet up the stack: pvio's adaptive LRO ≥ the veth pair's GRO",
        a,
        "segments",
        &format!("≥ {v:.1} (veth, GRO on, same rounds)"),
        a >= v,
    );
    stream_check(rep, intact, " with adaptive LRO");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The experiment makes network namespaces: ignored by default (shown as
    /// skipped), run by `.ci/run` as root, where every row must be there.
    #[test]
    #[ignore = "needs root: network namespaces (.ci/run runs it as root)"]
    fn every_path_carries_every_flow_and_each_tcp_target_is_a_check() {
        let r = run(&crate::Context::smoke()).expect("runs");
        assert!(!r.rows.is_empty(), "nothing measured: {:?}", r.notes);
        // Every path carried every flow; every LRO path its stream and its ping-pong,
        // and LRO made packets of more than one segment where it ran.
        let lro = |row: &crate::report::Row| row.group.starts_with("LRO and GRO");
        assert_eq!(
            r.rows.iter().filter(|row| !lro(row)).count(),
            Path::ALL.len() * Flow::ALL.len()
        );
        if tools::have(&[tools::SOCKPERF]) {
            assert_eq!(
                r.rows.iter().filter(|row| lro(row)).count(),
                4 * Rx::ALL.len()
            );
            let segs = |name: &str| {
                r.rows
                    .iter()
                    .find(|row| row.group.contains("segments per packet") && row.name == name)
                    .map(|row| row.stats.median)
            };
            assert!(
                segs("pvio up, LRO adaptive").is_some_and(|x| x > 2.0),
                "{:?}",
                r.rows
            );
            assert!(
                segs("pvio up, LRO off").is_some_and(|x| x < 1.1),
                "{:?}",
                r.rows
            );
        }
        assert!(
            r.rows.iter().all(|row| row.stats.median > 0.0),
            "every path carried every flow: {:?}",
            r.rows
        );
        let tcp_checks = r
            .checks
            .iter()
            .filter(|c| c.what.contains("the veth pair with offloads"))
            .count();
        assert_eq!(tcp_checks, 4, "{:?}", r.checks);
        // The streams through pvio, with and without LRO, arrive intact where checked.
        assert!(
            r.checks
                .iter()
                .filter(|c| c.what.contains("byte for byte"))
                .all(|c| c.met),
            "{:?}",
            r.checks
        );
        assert!(r.checks.iter().all(|c| c.value.is_finite()));
    }
}
