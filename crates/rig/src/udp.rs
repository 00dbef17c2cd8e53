//! The machines of paper 000's receive experiments, assembled and running.
//!
//! Three configurations, chosen by name:
//! * `native`: one domain runs the NIC driver (`pci-nommu` DMA), the stack and the
//!   application; the NIC's interrupt wakes it directly and it idles by halting, so no
//!   hypervisor code is on its path;
//! * `direct`: the NIC is assigned to the guest — its DMA goes through the guest's IOMMU
//!   context, its interrupt arrives as an event from the hypervisor, the guest kernel's
//!   DMA interface is `swiotlb` and it idles by blocking in the hypervisor;
//! * `pv`: a driver domain runs the NIC driver, the bridge (with or without its netfilter
//!   hooks) and netback; the guest runs netfront, the stack and the application. The two
//!   domains' vCPUs are on different cores, as in the paper.
//!
//! The NIC's far end is the paced sender ([`dev::wire::PacedSender`]). The machines are
//! built by [`kernel::machine`]; each domain's kernel, and its poll loop, is a component
//! of the `kernel` crate. This module turns the experiments' options into a machine spec
//! and keeps the experiments' accounting: CPU snapshots and the loss account.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::nic::Coalesce;
use dev::wire::{CountingSink, LatencyProbe, PacedSender, SenderCounters};
use hv::profile::ClassSamples;
use hv::{GrantPath, GrantVersion, Hypervisor};
use kernel::app::AppSpec;
use kernel::driver_domain::DriverConfig;
use kernel::machine::{
    Above, GuestSpec, Layout, Machine, MachineSpec, NicSpec, Role, SvnicGuestSpec,
};
use kernel::svnic_guest::SvnicApp;
use net::netfront::FrontConfig;
use net::netfront::{Grants, RxBuffers};
use net::wire::{UdpFlow, DEFAULT_MTU};
use smoltcp::wire::Ipv4Address;

use crate::Error;

/// Which machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Config {
    /// Linux without a hypervisor.
    Native,
    /// A guest with the NIC assigned.
    Direct,
    /// Driver domain and paravirtual guest.
    Pv,
}

impl Config {
    /// Every configuration, in the paper's order.
    pub const ALL: [Config; 3] = [Config::Native, Config::Direct, Config::Pv];
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Config::Native => "native",
            Config::Direct => "direct",
            Config::Pv => "pv",
        }
    }
    /// By name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == s)
    }
}

/// How to build and drive the machine.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// The configuration.
    pub config: Config,
    /// UDP payload bytes per message.
    pub message: usize,
    /// Frames per second on the wire.
    pub rate: f64,
    /// The NIC's interrupt coalescing.
    pub coalesce: Coalesce,
    /// The driver domain's switches (pv only): the bridge's netfilter hooks, netback's
    /// aligned copies, a NIC queue per guest with direct placement, LRO. The unsafe
    /// machine-frame switch follows [`Options::grants`].
    pub driver: DriverConfig,
    /// Grant-table layout.
    pub grant_version: GrantVersion,
    /// Grant implementation.
    pub grant_path: GrantPath,
    /// Profiler sampling interval (none: no sampling).
    pub sample: Option<Duration>,
    /// The receiving guest's netfront (pv only): what it posts (page fragments, the
    /// original, or linear buffers, the paper's netfront without fragments, §3.4.2),
    /// how it gives its pages to netback (a grant per I/O, grant reuse, paper 000 §4.4,
    /// or the paper's unsafe stand-in, machine frames on the ring), and checksum offload
    /// and GSO (with the TAPs of real interfaces, `pvio up`; the lab's own stack takes
    /// no large frames).
    pub front: FrontConfig,
    /// Hostile guests beside the receiving one (pv only), each writing garbage into its
    /// vif's rings ([`kernel::hostile::HostileGuest`]); the soak's.
    pub hostile: usize,
    /// Measure each message's one-way latency from the wire to the application
    /// ([`Running::latency`]); meant for low rates.
    pub latency: bool,
    /// How the machine's idle pCPUs wait.
    pub idle: hv::sched::IdlePolicy,
    /// Where the devices' DMA writes land: in memory (the papers' platforms, the
    /// default) or in the cache hierarchy (Data Direct I/O, `pvio up`'s).
    pub dma_landing: hv::iommu::DmaLanding,
    /// The host cores the machine owns (its CPU pool; none: every online core).
    pub cpus: Option<kernel::machine::CpuSet>,
}

/// How long [`Running::finish`] waits without a message arriving before it takes the
/// rest as lost: far longer than a message takes to cross the machine.
pub const DRAIN_QUIET: Duration = Duration::from_millis(500);

/// The frame rate of a saturated 1 Gbit/s link with 1514-byte frames (plus preamble,
/// frame check and inter-frame gap: 1538 bytes on the wire).
pub const GIGABIT_FULL_FRAME_PPS: f64 = 1e9 / (1538.0 * 8.0);

impl Options {
    /// The paper's set-up for `config` and `message`: the original implementation
    /// (v1 grants, original grant path), netfilter hooks on, 6 packets / 18 µs.
    pub fn paper(config: Config, message: usize) -> Self {
        Self {
            config,
            message,
            rate: GIGABIT_FULL_FRAME_PPS,
            coalesce: Coalesce::default(),
            driver: DriverConfig::default(),
            grant_version: GrantVersion::V1,
            grant_path: GrantPath::Original,
            sample: Some(hv::profile::DEFAULT_SAMPLE_INTERVAL),
            front: FrontConfig::default(),
            hostile: 0,
            latency: false,
            idle: hv::sched::IdlePolicy::HALT_POLL,
            dma_landing: hv::iommu::DmaLanding::Memory,
            cpus: None,
        }
    }
}

/// One of paper 000's software optimisations of the PV path (§3.4, §4): each a switch
/// of the `pv` machine, together the `pv-soft` configuration (Figure 8's second bar).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SoftOpt {
    /// The bridge's netfilter hooks off (§3.4.2; the paper: 1550 cycles a packet).
    NoNetfilter,
    /// netback's copies aligned to the source's cache-line offset (§3.4.1; 1850 cycles).
    AlignedCopies,
    /// netfront posts linear buffers, no fragments (§3.4.2; 900 cycles).
    NoFragments,
    /// The grant fast paths: v2 tables and the optimised implementation (§3.4.3; 650
    /// cycles).
    GrantFastPaths,
}

impl SoftOpt {
    /// Every switch, in the paper's order.
    pub const ALL: [SoftOpt; 4] = [
        SoftOpt::NoNetfilter,
        SoftOpt::AlignedCopies,
        SoftOpt::NoFragments,
        SoftOpt::GrantFastPaths,
    ];
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            SoftOpt::NoNetfilter => "no netfilter",
            SoftOpt::AlignedCopies => "aligned copies",
            SoftOpt::NoFragments => "no fragments",
            SoftOpt::GrantFastPaths => "grant fast paths",
        }
    }
    /// The paper's saving, in cycles per packet at 3 GHz (§5, Figure 8).
    pub fn paper_cycles(self) -> f64 {
        match self {
            SoftOpt::NoNetfilter => 1550.0,
            SoftOpt::AlignedCopies => 1850.0,
            SoftOpt::NoFragments => 900.0,
            SoftOpt::GrantFastPaths => 650.0,
        }
    }
    /// Turns it on in `o`.
    pub fn apply(self, o: &mut Options) {
        self.apply_to(
            &mut o.driver,
            &mut o.front,
            (&mut o.grant_version, &mut o.grant_path),
        );
    }

    /// Turns it on where it lives: the driver domain's switches, the guest's netfront,
    /// or the machine's grant implementation.
    pub fn apply_to(
        self,
        driver: &mut DriverConfig,
        front: &mut FrontConfig,
        (version, path): (&mut GrantVersion, &mut GrantPath),
    ) {
        match self {
            SoftOpt::NoNetfilter => driver.netfilter = false,
            SoftOpt::AlignedCopies => driver.aligned_copies = true,
            SoftOpt::NoFragments => front.rx_buffers = RxBuffers::Linear,
            SoftOpt::GrantFastPaths => {
                *version = GrantVersion::V2;
                *path = GrantPath::Optimised;
            }
        }
    }
}

/// The named configurations, in Figure 8's order after the paper's two references.
pub const NAMED: [&str; 7] = [
    "native",
    "direct",
    "pv",
    "pv-soft",
    "pv-guestcopy",
    "pv-mq",
    "pv-mq-reuse",
];

impl Options {
    /// `pv` with one software optimisation on.
    pub fn pv_with(opt: SoftOpt, message: usize) -> Self {
        let mut o = Self::paper(Config::Pv, message);
        opt.apply(&mut o);
        o
    }

    /// The software-optimised PV configuration (`pv-soft`, paper 000 §4 and Figure 8's
    /// second bar): every [`SoftOpt`] on.
    pub fn pv_soft(message: usize) -> Self {
        let mut o = Self::paper(Config::Pv, message);
        for opt in SoftOpt::ALL {
            opt.apply(&mut o);
        }
        o
    }

    /// The copy moved to the guest (`pv-guestcopy`, paper 000 §4.1–4.2 and Figure 8's
    /// third bar): `pv-soft`, with netback lending its buffers through sub-page grants
    /// and netfront copying each packet into a buffer it allocates for it.
    pub fn pv_guestcopy(message: usize) -> Self {
        let o = Self::pv_soft(message);
        Self {
            front: FrontConfig {
                rx_buffers: RxBuffers::GuestCopy,
                ..o.front
            },
            ..o
        }
    }

    /// The multi-queue NIC with direct placement (`pv-mq`, paper 000 §4.3 and Figure
    /// 8's fourth bar): `pv-soft`, with the guest's own NIC receive queue, the NIC
    /// writing each frame into a buffer netfront posted (mapped by netback per packet;
    /// no copy anywhere).
    pub fn pv_mq(message: usize) -> Self {
        Self {
            driver: DriverConfig {
                queues: true,
                ..Self::pv_soft(message).driver
            },
            ..Self::pv_soft(message)
        }
    }

    /// Grant reuse on top of the multi-queue NIC (`pv-mq-reuse`, paper 000 §4.4 and
    /// Figure 8's fifth bar): `pv-mq`, with every posted buffer and TX slot reached
    /// through netback's cache of mapped grants (a map only on a miss, no unmap per
    /// packet).
    pub fn pv_mq_reuse(message: usize) -> Self {
        let o = Self::pv_mq(message);
        Self {
            front: FrontConfig {
                grants: Grants::Reuse,
                ..o.front
            },
            ..o
        }
    }

    /// **Unsafe, for measurement only** (`pv-mq-unsafe`): the paper's stand-in for
    /// grant reuse, `pv-mq` with netfront putting each RX buffer's machine frame on the
    /// ring and netback giving it to the NIC unchecked (nothing validated, mapped or
    /// pinned; the driver domain's IOMMU context maps all of machine memory). What the
    /// paper measured as Figure 8's fifth bar; not one of [`NAMED`].
    pub fn pv_mq_unsafe(message: usize) -> Self {
        let o = Self::pv_mq(message);
        Self {
            front: FrontConfig {
                grants: Grants::MachineFramesUnsafe,
                ..o.front
            },
            ..o
        }
    }

    /// A configuration by name (one of [`NAMED`]).
    pub fn named(name: &str, message: usize) -> Option<Self> {
        match name {
            "pv-soft" => Some(Self::pv_soft(message)),
            "pv-guestcopy" => Some(Self::pv_guestcopy(message)),
            "pv-mq" => Some(Self::pv_mq(message)),
            "pv-mq-reuse" => Some(Self::pv_mq_reuse(message)),
            _ => Config::parse(name).map(|c| Self::paper(c, message)),
        }
    }
}

/// How late the sender's device thread may be before it skips whole messages instead
/// of bursting them: 2 ms is 163 full-size frames at the paper's rate, well inside the
/// NIC's 1024 descriptors, and far beyond the thread's usual wake-up jitter.
pub const STALL_HORIZON: Duration = Duration::from_millis(2);

/// Latency samples a run keeps at most (65 s at 1000 messages a second).
pub const LATENCY_SAMPLES: usize = 1 << 16;

/// The flow the sender sends.
pub fn flow() -> UdpFlow {
    UdpFlow {
        src_mac: [0x02, 0, 0, 0, 0, 0x01],
        dst_mac: [0x02, 0, 0, 0, 0, 0x10],
        src_ip: Ipv4Address::new(10, 0, 0, 1),
        dst_ip: Ipv4Address::new(10, 0, 0, 2),
        src_port: 5001,
        dst_port: 5002,
        mtu: DEFAULT_MTU,
    }
}

/// A domain's CPU use at one instant.
#[derive(Debug, Clone)]
pub struct DomainSnapshot {
    /// Exact CPU time of its vCPUs.
    pub cpu: Duration,
    /// Profiler samples per class.
    pub samples: ClassSamples,
}

/// The machine's counters at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// When.
    pub at: Instant,
    /// Per domain: (name, driver domain?, use).
    pub domains: Vec<(String, bool, DomainSnapshot)>,
    /// Frames the sender put on the wire.
    pub frames_sent: u64,
    /// Messages the application received.
    pub messages: u64,
    /// The machine's pCPUs as they stand (their accounting since the machine started).
    pub pcpus: Vec<hv::sched::PcpuReport>,
}

pub use kernel::app::AppCounters;
pub use kernel::driver_domain::Fault;
pub use kernel::machine::{DriverFault, Restarted};
pub use kernel::Counters;

/// A running machine.
#[derive(Debug)]
pub struct Running {
    /// The hypervisor.
    pub hv: Arc<Hypervisor>,
    /// Options it was built with.
    pub opts: Options,
    machine: Machine,
    sender: Arc<SenderCounters>,
    frames_per_message: usize,
    app: Arc<AppCounters>,
    latency: Option<Arc<LatencyProbe>>,
}

/// The guests of an SV-NIC machine from `pvio up`'s: each keeps its name, MAC and core,
/// takes its VIF's priority, and runs its TAP or its disk above the VIF driver (nothing
/// else runs on an SV-NIC's VIF).
fn svnic_guests(
    guests: Vec<GuestSpec>,
    priorities: Vec<Option<u8>>,
) -> Result<Vec<SvnicGuestSpec>, Error> {
    guests
        .into_iter()
        .zip(priorities)
        .map(|(g, priority)| {
            let app = match g.above {
                Above::Tap(t) => Ok(SvnicApp::Tap(t)),
                Above::Block(b) => Ok(SvnicApp::Block(b)),
                a => Err(Error::other(format!("{}: {a:?} on an SV-NIC", g.name))),
            }?;
            Ok(SvnicGuestSpec {
                name: g.name,
                mac: g.mac,
                app,
                priority,
                core: g.core,
            })
        })
        .collect()
}

/// Real interfaces for a `pv` machine (`pvio up`): the NIC's cable on a TAP or a
/// packet socket on a host interface instead of the paced sender, and the guests the machine builder runs, each (for `pvio up`)
/// with its received frames handed to a TAP of its own (`Above::Tap`, whose network
/// namespace's Linux stack is that guest's stack) instead of pvio's stack and
/// application. Frames a guest's stack sends go out through its netfront.
#[allow(missing_debug_implementations)]
pub struct Plumbing {
    /// The NIC's far end: what it receives from...
    pub wire: Box<dyn dev::wire::WireSource>,
    /// ...and what it transmits to.
    pub sink: Box<dyn dev::wire::WireSink>,
    /// The guests, in the order their domains are made.
    pub guests: Vec<GuestSpec>,
    /// The self-virtualized NIC (paper 002) in place of the driver domain: its
    /// configuration, and each guest's VIF priority. The guests' TAPs go above their VIF
    /// drivers.
    pub svnic: Option<(dev::svnic::device::SvnicConfig, Vec<Option<u8>>)>,
    /// The layout core the NIC's engine runs on (`NicSpec::core`; `None`: the rule).
    pub nic_core: Option<usize>,
}

impl Running {
    /// Builds the machine for `opts` and starts it: domains, NIC, drivers, vCPUs, and
    /// the sender.
    pub fn start(opts: Options) -> Result<Self, Error> {
        Self::start_with(opts, None)
    }

    /// As [`Running::start`], with real interfaces on a `pv` machine.
    pub fn start_with(opts: Options, plumbing: Option<Plumbing>) -> Result<Self, Error> {
        if plumbing.is_some() && opts.config != Config::Pv {
            return Err(Error::other("real interfaces need the pv configuration"));
        }
        let f = flow();
        let latency = opts
            .latency
            .then(|| Arc::new(LatencyProbe::new(LATENCY_SAMPLES)));
        let mut sender = PacedSender::new(f, opts.message, opts.rate, None)
            .map_err(Error::other)?
            .skip_after_stall(STALL_HORIZON);
        if let Some(p) = &latency {
            sender = sender.with_probe(Arc::clone(p));
        }
        let sender_counters = Arc::clone(sender.counters());
        let frames_per_message = sender.frames_per_message();
        let app = Arc::new(AppCounters::default());
        let app_spec = AppSpec {
            flow: f,
            message: opts.message,
            proto: kernel::app::Proto::Udp,
            counters: Arc::clone(&app),
            latency: latency.clone(),
            nbd: None,
        };
        let mut svnic = None;
        let (nic, guests) = match plumbing {
            Some(mut p) => {
                let nic = NicSpec {
                    coalesce: opts.coalesce,
                    source: p.wire,
                    sink: p.sink,
                    core: p.nic_core,
                };
                svnic = p.svnic.take();
                (nic, p.guests)
            }
            None => {
                let nic = NicSpec {
                    coalesce: opts.coalesce,
                    source: Box::new(sender),
                    sink: Box::new(CountingSink::default()),
                    core: None,
                };
                let guests = std::iter::once(GuestSpec {
                    weight: 1,
                    name: "guest".into(),
                    mac: f.dst_mac,
                    above: Above::App(app_spec.clone()),
                    core: None,
                    front: opts.front,
                })
                .chain((0..opts.hostile).map(|i| GuestSpec {
                    weight: 1,
                    name: format!("hostile{i}"),
                    mac: [0x02, 0, 0, 0, 0xee, i as u8],
                    above: Above::Hostile(0x5eed_0000 + i as u64),
                    core: None,
                    front: FrontConfig::default(),
                }))
                .collect();
                (nic, guests)
            }
        };
        let layout = match (opts.config, svnic) {
            (Config::Pv, Some((config, priorities))) => Layout::Svnic {
                config,
                guests: svnic_guests(guests, priorities)?,
            },
            (Config::Native, _) => Layout::Native(app_spec),
            (Config::Direct, _) => Layout::Direct(app_spec),
            (Config::Pv, None) => Layout::DriverDomain {
                driver: DriverConfig {
                    unsafe_machine_frames: opts.front.grants == Grants::MachineFramesUnsafe,
                    ..opts.driver
                },
                guests,
            },
        };
        let machine = Machine::start(MachineSpec {
            cpus: opts.cpus,
            grant_version: opts.grant_version,
            grant_path: opts.grant_path,
            sample: opts.sample,
            idle: opts.idle,
            dma_landing: opts.dma_landing,
            ..MachineSpec::new(nic, layout)
        })
        .map_err(Error::other)?;
        Ok(Self {
            hv: Arc::clone(machine.hv()),
            opts,
            machine,
            sender: sender_counters,
            frames_per_message,
            app,
            latency,
        })
    }

    /// The one-way latency probe, if [`Options::latency`] asked for one.
    pub fn latency(&self) -> Option<&Arc<LatencyProbe>> {
        self.latency.as_ref()
    }

    /// The NIC's registers and counters.
    pub fn nic_regs(&self) -> Option<&Arc<dev::nic::NicRegs>> {
        self.machine.nic_regs()
    }

    /// Arms a fault in the driver domain's kernel (taken at its next poll).
    pub fn inject_fault(&self, f: Fault) {
        self.machine.inject_fault(f);
    }

    /// The toolstack's watchdog ([`Machine::watchdog`]): restarts a driver domain that
    /// crashed or left work waiting for `stall`.
    pub fn watchdog(&mut self, stall: Duration) -> Result<Option<Restarted>, Error> {
        self.machine.watchdog(stall).map_err(Error::other)
    }

    /// The toolstack restarts the driver domain (a planned restart: the watchdog's
    /// remedy without a fault). Returns how long it took.
    pub fn restart_driver_domain(&mut self) -> Result<Duration, Error> {
        self.machine.restart_driver_domain().map_err(Error::other)
    }

    /// A domain of the machine, by name (the current driver domain is `driver`).
    pub fn domain(&self, name: &str) -> Option<Arc<hv::Domain>> {
        self.machine
            .domains()
            .iter()
            .rev()
            .find(|(d, _)| d.name() == name)
            .map(|(d, _)| Arc::clone(d))
    }

    /// Frames per message.
    pub fn frames_per_message(&self) -> usize {
        self.frames_per_message
    }

    /// Every component's counters as they stand, each kernel answering between two
    /// polls (see `kernel::vcpu::CounterDoor`); a kernel that does not answer within
    /// 100 ms (a hung driver domain) is left out.
    pub fn live_counters(&self) -> Counters {
        self.machine.live_counters(Duration::from_millis(100))
    }

    /// [`Running::live_counters`], stamped, for [`crate::live::rates`].
    pub fn live_sample(&self) -> crate::live::Sample {
        crate::live::Sample {
            at: Instant::now(),
            counters: self.live_counters(),
        }
    }

    /// The measured window begins: the devices' and vCPUs' waits to run count from now
    /// ([`hv::sched::Scheduler::mark_waits`]), as the CPU per packet does, not from the
    /// machine's start. Returns the scheduler's account as it stood, with the waits of
    /// the start and warm-up.
    pub fn begin_window(&self) -> Counters {
        let before = self.machine.sched_counters();
        self.machine.scheduler().mark_waits();
        before
    }

    /// The machine's counters now.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            at: Instant::now(),
            domains: domain_use(&self.machine),
            frames_sent: self.sender.frames.load(Ordering::Relaxed),
            messages: self.app.messages.load(Ordering::Relaxed),
            pcpus: self.machine.scheduler().reports(),
        }
    }

    /// Stops the sender, waits up to `drain` for what is in flight to arrive, stops the
    /// machine and accounts for every frame. The wait also ends once nothing has arrived
    /// for [`DRAIN_QUIET`]: what is still missing then was lost (and is accounted for as
    /// such), and waiting out the whole `drain` for it only made runs that lost a frame
    /// two seconds longer.
    pub fn finish(self, drain: Duration) -> Result<Finish, Error> {
        self.machine.unplug();
        let sent = self.sender.frames.load(Ordering::Relaxed);
        let whole = sent / self.frames_per_message as u64;
        let t = Instant::now();
        let (mut seen, mut moved) = (self.app.messages.load(Ordering::Relaxed), Instant::now());
        while seen < whole && t.elapsed() < drain && moved.elapsed() < DRAIN_QUIET {
            std::thread::sleep(Duration::from_millis(2));
            let now = self.app.messages.load(Ordering::Relaxed);
            if now != seen {
                (seen, moved) = (now, Instant::now());
            }
        }
        let mut counters = self.machine.stop().map_err(Error::other)?;
        counters.add_set("sender", &*self.sender);
        Ok(Finish {
            frames_sent: sent,
            messages_sent: whole,
            messages_received: self.app.messages.load(Ordering::Relaxed),
            corrupt: self.app.corrupt.load(Ordering::Relaxed),
            counters,
        })
    }
}

/// Each domain of `machine` as it stands: (name, driver domain?, CPU time and profiler
/// samples).
pub fn domain_use(machine: &Machine) -> Vec<(String, bool, DomainSnapshot)> {
    machine
        .domains()
        .iter()
        .map(|(d, role)| {
            (
                d.name().to_string(),
                *role == Role::DriverDomain,
                DomainSnapshot {
                    cpu: d.cpu_time(),
                    samples: d.class_samples(),
                },
            )
        })
        .collect()
}

/// What a finished run accounts for.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finish {
    /// Frames the sender sent.
    pub frames_sent: u64,
    /// Whole messages among them.
    pub messages_sent: u64,
    /// Messages the application received.
    pub messages_received: u64,
    /// Of those, not as sent.
    pub corrupt: u64,
    /// Every component's counters.
    pub counters: Counters,
}
