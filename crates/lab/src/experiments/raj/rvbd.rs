//! Paper 002 (Raj & Schwan), §VI-B and Table I: the block virtualization service. A
//! guest's virtual disk is served locally (blkback on a backing file, the reference
//! row) or remotely, by a remote virtual block device that speaks ATA over Ethernet to
//! Debian's `vblade` on a real remote host (a namespace at the far end of the NIC's
//! cable). The floor is the host's own NBD client (fio's `nbd` engine, libnbd) against
//! Debian's `nbd-server` and `nbdkit` over a veth pair, with no virtualization at all.
//!
//! Measured for each path: the latency per response of sequential reads at response
//! sizes from 4 KiB to 128 KiB (74 sectors, 37,888 bytes, is the paper's 37,601-byte
//! response rounded up to whole sectors); random 4 KiB reads at queue depth 1 (median
//! and p99) and at 32 (IOPS); each domain's CPU time per request. Every byte read is
//! checked against the backing file's pattern.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::disk::{pattern_fill, write_patterned};
use dev::nic::Coalesce;
use dev::svnic::device::{Idle, SignalMode, SvnicConfig};
use dev::wire::{CountingSink, Samples, Silence};
use kernel::block::{BlockJobSpec, JobCounters, JobOp, Pattern};
use kernel::driver_domain::DriverConfig;
use kernel::machine::{
    Above, BlockSpec, Disk, GuestSpec, Layout, Machine, MachineSpec, NicSpec, Role, SvnicGuestSpec,
};
use kernel::svnic_guest::SvnicApp;
use net::netfront::FrontConfig;

use crate::remote_host::{
    self, RemoteHost, Servers, NBDKIT_PORT, NBD_SERVER_PORT, SHELF, SLOT, VETH_ADDR,
};
use crate::{Error, Experiment, Mode, Report};

/// The registry entry.
pub const EXPERIMENT: Experiment = Experiment {
    id: "raj-rvbd",
    title: "the block service: a remote virtual block device over ATA over Ethernet to a real vblade, beside the local disk and the host's own NBD client",
    paper: "002 Raj & Schwan, §VI-B, Table I",
    run,
};

/// The backing file's size: 64 MiB, on tmpfs.
const SECTORS: u64 = 131_072;
/// Response sizes of the sequential sweep (bytes).
const SIZES: [u32; 5] = [4096, 16384, 37_888, 65_536, 131_072];
/// The paper's response size, rounded up to whole sectors.
const PAPER_SIZE: u32 = 37_888;

/// Where a guest's disk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Where {
    /// blkback on a backing file in the driver domain.
    Local,
    /// The host-centric remote virtual block device: AoE from the driver domain.
    HostRvbd,
    /// The device-centric remote virtual block device (the paper's): AoE from the
    /// SV-NIC's block engine, the sectors placed straight into the guest's pages.
    SvnicRvbd,
    /// The same, the data going through a fixed pool of granted buffers that the
    /// guest's front end copies into its pages (persistent grants): the paper's bounce
    /// buffers and their copy, which its board needed.
    SvnicRvbdBounce,
    /// The guest's own NBD client over its TCP, through netfront and the driver
    /// domain (HV-NIC), to this server.
    NbdHv(Server),
    /// The same through its VIF of the SV-NIC.
    NbdSv(Server),
}

/// An NBD server on the remote host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Server {
    Nbdkit,
    NbdServer,
}

impl Server {
    fn port(self) -> u16 {
        match self {
            Server::Nbdkit => NBDKIT_PORT,
            Server::NbdServer => NBD_SERVER_PORT,
        }
    }
    fn export(self) -> &'static str {
        match self {
            Server::Nbdkit => "",
            Server::NbdServer => "disk",
        }
    }
}

impl Where {
    const ALL: [Where; 8] = [
        Where::Local,
        Where::HostRvbd,
        Where::SvnicRvbd,
        Where::SvnicRvbdBounce,
        Where::NbdHv(Server::Nbdkit),
        Where::NbdHv(Server::NbdServer),
        Where::NbdSv(Server::Nbdkit),
        Where::NbdSv(Server::NbdServer),
    ];
    fn name(self) -> &'static str {
        match self {
            Where::Local => "local VBD",
            Where::HostRvbd => "host-centric RVBD (driver domain)",
            Where::SvnicRvbd => "SV-NIC RVBD",
            Where::SvnicRvbdBounce => "SV-NIC RVBD + bounce copy",
            Where::NbdHv(Server::Nbdkit) => "guest NBD, HV-NIC → nbdkit",
            Where::NbdHv(Server::NbdServer) => "guest NBD, HV-NIC → nbd-server",
            Where::NbdSv(Server::Nbdkit) => "guest NBD, SV-NIC → nbdkit",
            Where::NbdSv(Server::NbdServer) => "guest NBD, SV-NIC → nbd-server",
        }
    }
    fn remote(self) -> bool {
        self != Where::Local
    }
    /// Whether the disk is reached over ATA over Ethernet.
    fn aoe(self) -> bool {
        matches!(
            self,
            Where::HostRvbd | Where::SvnicRvbd | Where::SvnicRvbdBounce
        )
    }
}

/// One job's outcome on one path.
#[derive(Debug, Default)]
struct JobRun {
    lat_us: Vec<f64>,
    completed: u64,
    errors: u64,
    submitted: u64,
    retransmits: u64,
    corrupt: u64,
    /// Completions the job took for a request not in flight (answered twice), and
    /// responses blkfront refused (an id not in flight, or of another operation).
    doubled: u64,
    elapsed: Duration,
    guest_cpu_ns: f64,
    driver_cpu_ns: f64,
    /// The SV-NIC block engine's busy time per request (its steps that found work).
    engine_ns: f64,
    /// CPU per request by class (profiler samples apportioned over the exact CPU
    /// time), guest and driver domain, classes with any samples.
    classes: Vec<(&'static str, hv::profile::Class, f64)>,
}

/// The job's spec and its counters.
fn job(
    op: JobOp,
    pattern: Pattern,
    bytes: u32,
    depth: usize,
    limit: u64,
) -> (BlockJobSpec, Arc<JobCounters>, Arc<Samples>) {
    let counters = Arc::new(JobCounters::default());
    let lat = Arc::new(Samples::new(limit as usize));
    (
        BlockJobSpec {
            op,
            pattern,
            bytes,
            depth,
            span: (0, SECTORS),
            limit: Some(limit),
            expect: pattern_fill,
            verify: true,
            fill: pattern_fill,
            latencies: Arc::clone(&lat),
            counters: Arc::clone(&counters),
        },
        counters,
        lat,
    )
}

/// The machine of `path`: one guest, behind the driver domain or the SV-NIC (whose
/// micro-engines poll, as the paper's did), running what `path` puts above its device:
/// `block`'s job on its virtual disk, or a guest NBD client running it over TCP.
fn layout(path: Where, block: BlockSpec) -> Layout {
    // A guest NBD client's application: its TCP to the server's port on the cable.
    let nbd_app = |server: Server, job: kernel::block::BlockJobSpec| kernel::app::AppSpec {
        flow: net::wire::UdpFlow {
            src_mac: [2, 0, 0, 0, 0, 2],
            dst_mac: [0xff; 6],
            src_ip: smoltcp::wire::Ipv4Address::new(10, 78, 0, 2),
            dst_ip: smoltcp::wire::Ipv4Address::new(10, 78, 0, 1),
            src_port: 40_000,
            dst_port: server.port(),
            mtu: net::wire::DEFAULT_MTU,
        },
        message: 0,
        proto: kernel::app::Proto::Nbd,
        counters: Arc::new(kernel::app::AppCounters::default()),
        latency: None,
        nbd: Some(kernel::app::NbdSpec {
            export: server.export().into(),
            job,
        }),
    };
    let driver = |above: Above| Layout::DriverDomain {
        driver: DriverConfig {
            netfilter: false,
            ..DriverConfig::default()
        },
        guests: vec![GuestSpec {
            weight: 1,
            name: "guest".into(),
            mac: [2, 0, 0, 0, 0, 2],
            above,
            core: None,
            front: FrontConfig::default(),
        }],
    };
    let svnic = |app: SvnicApp| Layout::Svnic {
        config: SvnicConfig {
            signal: SignalMode::Sidecore,
            idle: Idle::Poll,
            ..SvnicConfig::default()
        },
        guests: vec![SvnicGuestSpec {
            name: "guest".into(),
            mac: [2, 0, 0, 0, 0, 2],
            app,
            priority: None,
            core: None,
        }],
    };
    match path {
        Where::NbdHv(server) => driver(Above::App(nbd_app(server, block.job))),
        Where::NbdSv(server) => svnic(SvnicApp::Stack(nbd_app(server, block.job))),
        Where::Local | Where::HostRvbd => driver(Above::Block(Box::new(block))),
        Where::SvnicRvbd | Where::SvnicRvbdBounce => svnic(SvnicApp::Block(Box::new(block))),
    }
}

/// The machine's cable for `path`: silence for a local disk; for a remote one, a TAP
/// to a remote host made for this machine, running the servers `path` reaches.
fn cable(path: Where, disk: &Path) -> Result<(NicSpec, Option<RemoteHost>), Error> {
    Ok(match path.remote() {
        false => (
            NicSpec {
                coalesce: Coalesce::default(),
                source: Box::new(Silence),
                sink: Box::new(CountingSink::default()),
                core: None,
            },
            None,
        ),
        true => {
            let (file, ifname) =
                mem::tap::open_tap(&format!("pvrb{}", std::process::id() % 10_000))
                    .map_err(|e| Error::Other(format!("tap: {e}")))?;
            let host = RemoteHost::start(
                Some(&ifname),
                disk,
                Servers {
                    vblade: !matches!(path, Where::NbdHv(_) | Where::NbdSv(_)),
                    nbdkit: matches!(
                        path,
                        Where::NbdHv(Server::Nbdkit) | Where::NbdSv(Server::Nbdkit)
                    ),
                    nbd_server: matches!(
                        path,
                        Where::NbdHv(Server::NbdServer) | Where::NbdSv(Server::NbdServer)
                    ),
                },
            )?;
            let mut wire =
                dev::tap::TapPort::start(file).map_err(|e| Error::Other(e.to_string()))?;
            let sink = wire.sink().map_err(|e| Error::Other(e.to_string()))?;
            (
                NicSpec {
                    coalesce: Coalesce::default(),
                    source: Box::new(wire),
                    sink: Box::new(sink),
                    core: None,
                },
                Some(host),
            )
        }
    })
}

/// What the machine's domains and its block engine had used at one instant.
struct Usage {
    guest: Duration,
    driver: Duration,
    guest_samples: Vec<u64>,
    driver_samples: Vec<u64>,
    engine_ns: u64,
}

impl Usage {
    fn of(m: &Machine) -> Self {
        let cpu = |role: Role| -> Duration {
            m.domains()
                .iter()
                .filter(|(_, r)| *r == role)
                .map(|(d, _)| d.cpu_time())
                .sum()
        };
        let samples = |role: Role| -> Vec<u64> {
            let mut v = vec![0u64; 64];
            for (d, _) in m.domains().iter().filter(|(_, r)| *r == role) {
                for (i, n) in d.class_samples().counts.iter().enumerate() {
                    if let Some(x) = v.get_mut(i) {
                        *x += n;
                    }
                }
            }
            v
        };
        Self {
            guest: cpu(Role::Guest),
            driver: cpu(Role::DriverDomain),
            guest_samples: samples(Role::Guest),
            driver_samples: samples(Role::DriverDomain),
            engine_ns: m
                .block_engine_stats()
                .map_or(0, |e| e.busy_ns.load(Ordering::Relaxed)),
        }
    }

    /// Per request of `completed` from `a` to `b`: each domain's CPU (ns), and its
    /// classes apportioned by the profiler's samples.
    fn per_request(
        a: &Usage,
        b: &Usage,
        completed: u64,
    ) -> (f64, f64, Vec<(&'static str, hv::profile::Class, f64)>) {
        let per = |x: Duration, y: Duration| {
            (y.saturating_sub(x)).as_nanos() as f64 / completed.max(1) as f64
        };
        let (guest, driver) = (per(a.guest, b.guest), per(a.driver, b.driver));
        let mut classes = Vec::new();
        for (who, s0, s1, cpu_ns) in [
            ("guest", &a.guest_samples, &b.guest_samples, guest),
            (
                "driver domain",
                &a.driver_samples,
                &b.driver_samples,
                driver,
            ),
        ] {
            let delta: Vec<u64> = s1.iter().zip(s0).map(|(y, x)| y - x).collect();
            let total: u64 = delta.iter().sum();
            if total == 0 {
                continue;
            }
            for c in hv::profile::Class::ALL {
                let n = delta.get(c as usize).copied().unwrap_or(0);
                if n > 0 {
                    classes.push((who, c, cpu_ns * n as f64 / total as f64));
                }
            }
        }
        (guest, driver, classes)
    }
}

/// Runs one job on a fresh machine whose guest's disk is on `path`.
#[allow(clippy::too_many_arguments)]
fn run_job(
    path: Where,
    disk: &Path,
    outage: Option<Duration>,
    op: JobOp,
    pattern: Pattern,
    bytes: u32,
    depth: usize,
    limit: u64,
) -> Result<JobRun, Error> {
    let (spec, counters, lat) = job(op, pattern, bytes, depth, limit);
    let block = BlockSpec {
        disk: match path {
            Where::Local | Where::NbdHv(_) | Where::NbdSv(_) => Disk::File(disk.to_path_buf()),
            _ => Disk::Aoe {
                major: SHELF,
                minor: SLOT,
            },
        },
        read_only: false,
        persistent: path == Where::SvnicRvbdBounce,
        job: spec,
    };
    let (nic, mut host) = cable(path, disk)?;
    let m = Machine::start(MachineSpec {
        sample: Some(hv::profile::DEFAULT_SAMPLE_INTERVAL),
        ..MachineSpec::new(nic, layout(path, block))
    })
    .map_err(|e| Error::Other(e.to_string()))?;
    let u0 = Usage::of(&m);
    let t0 = Instant::now();
    let bound = Duration::from_secs(120);
    let mut outage = outage;
    while counters.completed.load(Ordering::Relaxed) < limit && t0.elapsed() < bound {
        // The fault run: vblade killed a quarter of the way in, started again after
        // the outage.
        if let (Some(o), Some(h)) = (outage, host.as_mut()) {
            if counters.completed.load(Ordering::Relaxed) >= limit / 4 {
                h.kill_vblade();
                std::thread::sleep(o);
                h.start_vblade()?;
                outage = None;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let elapsed = t0.elapsed();
    let u1 = Usage::of(&m);
    let c = m.stop().map_err(|e| Error::Other(e.to_string()))?;
    drop(host);
    let completed = counters.completed.load(Ordering::Relaxed);
    let (guest_cpu_ns, driver_cpu_ns, classes) = Usage::per_request(&u0, &u1, completed);
    Ok(JobRun {
        lat_us: lat.since(0).iter().map(|&ns| ns as f64 / 1000.0).collect(),
        completed,
        errors: counters.errors.load(Ordering::Relaxed),
        submitted: counters.submitted.load(Ordering::Relaxed),
        retransmits: c.sum(|a: &blk::initiator::AoeStats| a.retransmits),
        corrupt: counters.corrupt.load(Ordering::Relaxed),
        doubled: counters.unexpected.load(Ordering::Relaxed)
            + c.sum(|f: &blk::blkfront::FrontStats| f.bad_responses),
        elapsed,
        guest_cpu_ns,
        driver_cpu_ns,
        engine_ns: (u1.engine_ns - u0.engine_ns) as f64 / completed.max(1) as f64,
        classes,
    })
}

/// What fio's `nbd` engine measured: completion latencies (µs) and IOPS.
#[derive(Debug, Default)]
struct FioRun {
    median_us: f64,
    p99_us: f64,
    iops: f64,
    ios: u64,
    errors: u64,
}

/// fio's `nbd` engine (libnbd) from the host's namespace, pinned to `core`, against
/// `uri`, for `secs` seconds.
fn fio(
    uri: &str,
    rw: &str,
    bytes: u32,
    depth: usize,
    secs: u64,
    core: usize,
) -> Result<FioRun, Error> {
    let out = Command::new("fio")
        .args([
            "--name=floor",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            &format!("--rw={rw}"),
            &format!("--bs={bytes}"),
            &format!("--iodepth={depth}"),
            &format!("--runtime={secs}"),
            "--time_based",
            &format!("--cpus_allowed={core}"),
            "--output-format=json",
        ])
        .output()
        .map_err(|e| Error::Other(format!("fio: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // libnbd's engine prints a line before the JSON.
    let json = text.find('{').map(|i| &text[i..]).unwrap_or_default();
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| Error::Other(format!("fio's output: {e}")))?;
    let r = &v["jobs"][0]["read"];
    let pct = |p: &str| r["clat_ns"]["percentile"][p].as_f64().unwrap_or(f64::NAN) / 1000.0;
    Ok(FioRun {
        median_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        iops: r["iops"].as_f64().unwrap_or(0.0),
        ios: r["total_ios"].as_u64().unwrap_or(0),
        errors: v["jobs"][0]["error"].as_u64().unwrap_or(1),
    })
}

fn run(cx: &crate::Context) -> Result<Report, Error> {
    let mode = cx.mode;
    let mut r = Report::new(EXPERIMENT.id, EXPERIMENT.title, EXPERIMENT.paper);
    // vblade and nbd-server share the cores: every machine here halt-polls.
    r.idle = Some(hv::sched::IdlePolicy::HALT_POLL.name());
    remote_host::ensure_tools()?;
    let disk = PathBuf::from(format!("/dev/shm/pvio-rvbd-{}", std::process::id()));
    write_patterned(&disk, SECTORS).map_err(|e| Error::Other(format!("backing file: {e}")))?;
    let res = measure(mode, &mut r, &disk);
    let _ = std::fs::remove_file(&disk);
    res?;
    Ok(r)
}

/// Requests per point and fio's seconds, from the run's mode.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    seq_n: u64,
    qd1_n: u64,
    qd32_n: u64,
    fio_secs: u64,
}

/// What every path's jobs add up: bytes wrong, requests failed or never completed, and
/// the medians Table I's checks compare.
#[derive(Default)]
struct Tally {
    corrupt: u64,
    errors: u64,
    medians: std::collections::HashMap<(Where, &'static str), f64>,
}

/// The configuration a record names: the disk, the response sizes, each job's
/// requests, fio's seconds, blkback's persistent grants, and the AoE target.
#[derive(Debug, serde::Serialize)]
struct Recorded {
    sectors: u64,
    sizes: [u32; 5],
    sequential_requests: u64,
    random_qd1_requests: u64,
    random_qd32_requests: u64,
    fio_seconds: u64,
    persistent_grants: bool,
    aoe_target: AoeTarget,
}

/// The AoE target's shelf and slot.
#[derive(Debug, serde::Serialize)]
struct AoeTarget {
    shelf: u16,
    slot: u8,
}

fn measure(mode: Mode, r: &mut Report, disk: &Path) -> Result<(), Error> {
    let (seq_n, qd1_n, qd32_n, fio_secs) = match mode {
        Mode::Full => (1000, 3000, 20_000, 5),
        Mode::Quick => (80, 300, 2000, 1),
        Mode::Smoke => (20, 40, 200, 1),
    };
    r.setup = format!(
        "One guest on core 1 runs the block job above blkfront. Local VBD: the driver \
         domain on core 0 runs blkback on a {} MiB backing file on tmpfs. Host-centric RVBD: \
         the driver domain runs the AoE initiator beside the NIC driver, whose cable is a TAP \
         into a namespace where Debian's vblade serves the same file (floating). SV-NIC RVBD: \
         the guest has no VIF; the SV-NIC's block engine (a device thread) serves its ring and \
         speaks AoE through the device's own queue pair on the same cable, the engines and the \
         sidecore polling and floating, the controller domain on core 0; without the bounce \
         copy the sectors go straight into the guest's pages (grants mapped per request), with \
         it through a pool of persistent grants the front end copies out of. The floor: fio's \
         nbd engine (libnbd) pinned to core 1 in the host's namespace, against nbd-server and \
         nbdkit (floating) in the remote namespace over a veth pair. Requests per point: \
         sequential {seq_n}, random QD1 {qd1_n}, random QD32 {qd32_n}; fio {fio_secs} s.",
        SECTORS / 2048
    );
    r.set_config(&Recorded {
        sectors: SECTORS,
        sizes: SIZES,
        sequential_requests: seq_n,
        random_qd1_requests: qd1_n,
        random_qd32_requests: qd32_n,
        fio_seconds: fio_secs,
        persistent_grants: true,
        aoe_target: AoeTarget {
            shelf: SHELF,
            slot: SLOT,
        },
    });
    let z = Sizes {
        seq_n,
        qd1_n,
        qd32_n,
        fio_secs,
    };
    let mut t = Tally::default();
    sequential(r, disk, mode, &z, &mut t)?;
    random(r, disk, &z, &mut t)?;
    fault(r, disk, &z, &mut t)?;
    let floor_qd1 = floor(r, disk, &z, &mut t)?;
    totals(r, &t, floor_qd1);
    Ok(())
}

/// Table I: sequential reads, one in flight, by response size.
fn sequential(
    r: &mut Report,
    disk: &Path,
    mode: Mode,
    z: &Sizes,
    t: &mut Tally,
) -> Result<(), Error> {
    let seq_n = z.seq_n;
    // Table I: sequential reads, one in flight, by response size.
    for path in Where::ALL {
        // Quick mode: the ends of the sweep and the paper's size.
        let sizes: &[u32] = if mode == Mode::Full {
            &SIZES
        } else {
            &[4096, PAPER_SIZE, 131_072]
        };
        for &bytes in sizes {
            let j = run_job(
                path,
                disk,
                None,
                JobOp::Read,
                Pattern::Sequential,
                bytes,
                1,
                seq_n,
            )?;
            t.corrupt += j.corrupt;
            t.errors += j.errors + (seq_n - j.completed);
            let row = r.row(
                "Table I: sequential reads, latency per response",
                &format!("{} {} B", path.name(), bytes),
                "µs",
                &j.lat_us,
            );
            if bytes == PAPER_SIZE {
                row.reference = Some(match path {
                    Where::SvnicRvbdBounce => "323 µs (37,601 B)".into(),
                    Where::NbdSv(_) => "890 µs (interpolated to 37,601 B)".into(),
                    _ => "—".into(),
                });
                t.medians.insert((path, "seq"), row.stats.median);
            }
        }
    }
    Ok(())
}

/// Random 4 KiB reads at queue depths 1 and 32: latency, CPU per request by domain and
/// class, retransmissions, IOPS.
fn random(r: &mut Report, disk: &Path, z: &Sizes, t: &mut Tally) -> Result<(), Error> {
    let (qd1_n, qd32_n) = (z.qd1_n, z.qd32_n);
    // Random 4 KiB reads: queue depth 1 and 32.
    for path in Where::ALL {
        let j = run_job(
            path,
            disk,
            None,
            JobOp::Read,
            Pattern::Random(11),
            4096,
            1,
            qd1_n,
        )?;
        t.corrupt += j.corrupt;
        t.errors += j.errors + (qd1_n - j.completed);
        let row = r.row(
            "random 4 KiB reads, QD1",
            &format!("{} latency", path.name()),
            "µs",
            &j.lat_us,
        );
        t.medians.insert((path, "qd1"), row.stats.median);
        r.row(
            "CPU per request, QD1",
            &format!("{} guest", path.name()),
            "µs",
            &[j.guest_cpu_ns / 1000.0],
        );
        r.row(
            "CPU per request, QD1",
            &format!("{} driver (controller) domain", path.name()),
            "µs",
            &[j.driver_cpu_ns / 1000.0],
        );
        if matches!(path, Where::SvnicRvbd | Where::SvnicRvbdBounce) {
            r.row(
                "CPU per request, QD1",
                &format!("{} device: the block engine's busy steps", path.name()),
                "µs",
                &[j.engine_ns / 1000.0],
            );
        }
        for (who, c, ns) in &j.classes {
            // The guest's and the driver domain's kernel time by class (the profiler's
            // samples over each domain's exact CPU time); hypervisor classes show as
            // `xen`.
            let class = if c.is_xen() {
                format!("xen {}", c.name())
            } else {
                c.name().to_string()
            };
            r.row(
                "CPU per request by class, QD1",
                &format!("{} {who}: {class}", path.name()),
                "µs",
                &[ns / 1000.0],
            );
        }
        if path.aoe() {
            r.row(
                "frames sent again (retransmissions), QD1",
                path.name(),
                "frames",
                &[j.retransmits as f64],
            );
        }
        let j = run_job(
            path,
            disk,
            None,
            JobOp::Read,
            Pattern::Random(12),
            4096,
            32,
            qd32_n,
        )?;
        t.corrupt += j.corrupt;
        t.errors += j.errors + (qd32_n - j.completed);
        let iops = j.completed as f64 / j.elapsed.as_secs_f64();
        r.row(
            "random 4 KiB reads, QD32",
            &format!("{} IOPS", path.name()),
            "IOPS",
            &[iops],
        );
    }
    Ok(())
}

/// The fault: vblade killed under random reads on the SV-NIC RVBD and started again,
/// every request answered once.
fn fault(r: &mut Report, disk: &Path, z: &Sizes, t: &mut Tally) -> Result<(), Error> {
    let qd1_n = z.qd1_n;
    // The fault: vblade killed a quarter of the way through a run of random reads on
    // the SV-NIC RVBD and started again 300 ms later.
    let fault_n = qd1_n.max(400);
    let j = run_job(
        Where::SvnicRvbd,
        disk,
        Some(Duration::from_millis(300)),
        JobOp::Read,
        Pattern::Random(13),
        16 * 1024,
        4,
        fault_n,
    )?;
    t.corrupt += j.corrupt;
    r.row(
        "fault: vblade killed for 300 ms",
        "SV-NIC RVBD, 16 KiB random reads, 4 in flight: longest response",
        "ms",
        &[j.lat_us.iter().copied().fold(0.0, f64::max) / 1000.0],
    );
    r.row(
        "fault: vblade killed for 300 ms",
        "frames sent again",
        "frames",
        &[j.retransmits as f64],
    );
    // Lost: asked for and never answered; doubled: answered twice (the job's and
    // blkfront's own counts of answers to nothing in flight); failed: answered with an
    // error.
    let lost_or_doubled =
        fault_n.abs_diff(j.completed) + j.submitted.abs_diff(j.completed) + j.doubled + j.errors;
    r.check_none(
        "requests lost, doubled or failed across the fault (vblade killed and started again)",
        lost_or_doubled,
        "requests",
    );
    Ok(())
}

/// The floor: the host's own NBD client, no virtualization, against both servers;
/// returns the faster one's QD1 median.
fn floor(r: &mut Report, disk: &Path, z: &Sizes, t: &mut Tally) -> Result<f64, Error> {
    let fio_secs = z.fio_secs;
    let host = RemoteHost::start(
        None,
        disk,
        Servers {
            vblade: false,
            nbd_server: true,
            nbdkit: true,
        },
    )?;
    let mut floor_qd1 = f64::INFINITY;
    for (server, uri) in [
        (
            "nbd-server",
            format!("nbd://{VETH_ADDR}:{NBD_SERVER_PORT}/disk"),
        ),
        ("nbdkit", format!("nbd://{VETH_ADDR}:{NBDKIT_PORT}")),
    ] {
        let q1 = fio(&uri, "randread", 4096, 1, fio_secs, 1)?;
        let sq = fio(&uri, "read", PAPER_SIZE, 1, fio_secs, 1)?;
        let q32 = fio(&uri, "randread", 4096, 32, fio_secs, 1)?;
        t.errors += q1.errors + sq.errors + q32.errors;
        t.errors += [&q1, &sq, &q32].iter().filter(|f| f.ios == 0).count() as u64;
        let name = format!("host NBD client → {server}");
        r.row(
            "floor: the host's own NBD client (fio, libnbd)",
            &format!("{name}, random 4 KiB QD1 median"),
            "µs",
            &[q1.median_us],
        );
        r.row(
            "floor: the host's own NBD client (fio, libnbd)",
            &format!("{name}, random 4 KiB QD1 p99"),
            "µs",
            &[q1.p99_us],
        );
        r.row(
            "floor: the host's own NBD client (fio, libnbd)",
            &format!("{name}, sequential {PAPER_SIZE} B median"),
            "µs",
            &[sq.median_us],
        );
        r.row(
            "floor: the host's own NBD client (fio, libnbd)",
            &format!("{name}, random 4 KiB QD32"),
            "IOPS",
            &[q32.iops],
        );
        floor_qd1 = floor_qd1.min(q1.median_us);
    }
    drop(host);

    Ok(floor_qd1)
}

/// Every path's bytes and requests, and Table I's comparisons.
fn totals(r: &mut Report, t: &Tally, floor_qd1: f64) {
    r.check_none(
        "bytes read that differ from the backing file's (every path)",
        t.corrupt,
        "requests",
    );
    r.check_none("requests failed or not completed", t.errors, "requests");
    // Table I: the paper's RVBD (with its bounce copy) against the guest's NBD through
    // the SV-NIC's VIF to the faster server.
    let nbd_sv = [Server::Nbdkit, Server::NbdServer]
        .iter()
        .filter_map(|&s| t.medians.get(&(Where::NbdSv(s), "seq")).copied())
        .fold(f64::INFINITY, f64::min);
    if let Some(&rv) = t.medians.get(&(Where::SvnicRvbdBounce, "seq")) {
        r.check(
            "Table I: SV-NIC RVBD (bounce copy) latency per 37,888-byte response ≤ 0.36× the guest's NBD through its SV-NIC VIF (the faster server)",
            rv / nbd_sv,
            "×",
            "≤ 0.36 (paper 0.323 / 0.89)",
            rv <= 0.36 * nbd_sv,
        );
    }
    if let Some(&rv) = t.medians.get(&(Where::SvnicRvbd, "qd1")) {
        r.check(
            "SV-NIC RVBD random 4 KiB QD1 median ≤ the host's own NBD client's (the faster server; client on the guest's core)",
            rv / floor_qd1,
            "×",
            "≤ 1.0",
            rv <= floor_qd1,
        );
    }
    r.notes.push(
        "The SV-NIC's engines (egress, ingress, block) and its sidecore poll, as the \
         paper's micro-engines do: they keep their cores busy whatever the load. What is given \
         per request is the block engine's time in steps that found work. On this 2-core \
         machine they share the cores with \
         the guest, the controller domain, the TAP's reader and vblade."
            .into(),
    );
    r.notes.push(
        "AoE frames carry 2 sectors each: pvio's cable takes 1500-byte frames, and vblade sizes \
         its answers to the interface's MTU. A 37,888-byte read is 37 frames; vblade's 16 \
         buffers keep 16 on the wire."
            .into(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_smoke_run_reads_every_byte_right_on_each_path_and_the_floor_answers() {
        let r = run(&crate::Context::smoke()).expect("runs");
        for c in &r.checks[..2] {
            assert!(c.met, "{}: {}", c.what, c.value);
        }
        for row in &r.rows {
            assert!(
                row.stats.median.is_finite() && row.stats.median >= 0.0,
                "{}",
                row.name
            );
            if row.unit == "µs" && !row.group.starts_with("CPU") {
                assert!(row.stats.median > 0.0, "{}", row.name);
            }
        }
        assert!(
            r.checks
                .iter()
                .any(|c| c.what.starts_with("requests lost, doubled") && c.met),
            "the fault run loses and doubles nothing"
        );
    }
}
