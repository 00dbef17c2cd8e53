//! The machines of paper 001's experiments, assembled and running: a TCP receiver —
//! a native machine, or a PV guest behind the driver domain with or without LRO — and
//! the remote sender ([`dev::peer::TcpPeer`], smoltcp on its own thread) across the
//! cable, at the wire rate asked for.
//!
//! Where each thread runs is part of the set-up ([`Placement`]): the paper's receiving
//! machine had one core for the driver domain and the guest, the sender a machine of
//! its own. This module keeps the accounting the experiments share: per-domain CPU
//! time and profiler samples, bytes the application received (every one checked
//! against the stream), transactions and their round trips, and LRO's counters.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::peer::{PeerApp, PeerCounters, PeerSpec, TcpPeer, WireRate};
use hv::{GrantPath, GrantVersion};
use kernel::app::{AppCounters, AppSpec, Proto};
use kernel::driver_domain::DriverConfig;
use kernel::machine::{Above, GuestSpec, Layout, Machine, MachineSpec, NicSpec};
use kernel::Counters;
use net::netfront::FrontConfig;
use net::wire::UdpFlow;

use crate::udp::{domain_use, DomainSnapshot, SoftOpt};
use crate::Error;

/// The receiving machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receiver {
    /// The application in the domain that owns the NIC (the paper's "Linux").
    Native,
    /// A PV guest behind the driver domain (the paper's "Xen" and its LRO variants).
    Pv,
}

/// Where the threads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The paper's: the receiving machine's domains share core 0, the sender has core 1
    /// (a native receiver, which the machine builder puts on core 1, swaps the two).
    OneCore,
    /// Driver domain on core 0, guest on core 1; on a two-core machine the sender has
    /// no core of its own and floats.
    TwoCore,
}

/// How to build and drive the machine.
#[derive(Debug, Clone, Copy)]
pub struct TcpOptions {
    /// The receiver.
    pub receiver: Receiver,
    /// The driver domain's switches (pv only): LRO in its NIC driver, and whether the
    /// bridge linearizes each aggregate (the paper's first port; off is BO).
    pub driver: DriverConfig,
    /// Paper 000's software optimisations ([`SoftOpt`]) on top of `driver`, those that
    /// leave netfront's fragments in place, so the guest still takes GSO packets.
    pub soft: bool,
    /// The cable's rate.
    pub wire: WireRate,
    /// What the sender does.
    pub app: PeerApp,
    /// Where the threads run.
    pub placement: Placement,
    /// A consolidated machine (pv only): a guest that computes, of this weight, on the
    /// receiving guest's core (paper 001's future work; the other domains weigh 1).
    pub neighbour: Option<u32>,
    /// Profiler sampling interval.
    pub sample: Option<Duration>,
    /// How the machine's idle pCPUs wait (an experiment's context sets it).
    pub idle: hv::sched::IdlePolicy,
}

impl TcpOptions {
    /// A stream into `receiver` as fast as TCP goes, on the gigabit wire, placed as the
    /// paper's.
    pub fn stream(receiver: Receiver) -> Self {
        Self {
            receiver,
            driver: DriverConfig::default(),
            soft: false,
            wire: WireRate::GIGABIT,
            app: PeerApp::Stream {
                message: STREAM_MESSAGE,
                rate: None,
                total: None,
            },
            placement: Placement::OneCore,
            neighbour: None,
            sample: Some(hv::profile::DEFAULT_SAMPLE_INTERVAL),
            idle: hv::sched::IdlePolicy::HALT_POLL,
        }
    }
}

/// The consolidated machine's computing guest's domain.
pub const NEIGHBOUR: &str = "neighbour";

/// netperf's TCP_STREAM message, the paper's 1 KiB.
pub const STREAM_MESSAGE: usize = 1024;

/// The receiver's address and the sender's: paper 000's machines' ([`crate::udp::flow`]),
/// with the TCP peer's port and the server's.
pub fn flow() -> UdpFlow {
    UdpFlow {
        src_port: 49152,
        dst_port: 5001,
        ..crate::udp::flow()
    }
}

/// The machine's state at one instant.
#[derive(Debug, Clone)]
pub struct TcpSnapshot {
    /// When.
    pub at: Instant,
    /// Per domain: (name, driver domain?, use).
    pub domains: Vec<(String, bool, DomainSnapshot)>,
    /// Stream bytes the application received and checked.
    pub bytes: u64,
    /// Transactions the sender completed.
    pub transactions: u64,
    /// Round trips the sender had timed (a mark into its samples).
    pub rtt_mark: usize,
    /// Every component's counters.
    pub counters: Counters,
}

/// A running machine and its sender.
#[derive(Debug)]
pub struct TcpRunning {
    /// Options it was built with.
    pub opts: TcpOptions,
    machine: Machine,
    peer: TcpPeer,
    peer_counters: Arc<PeerCounters>,
    app: Arc<AppCounters>,
}

/// What a finished run accounts for.
#[derive(Debug, Clone)]
pub struct TcpFinish {
    /// Stream bytes (or request bytes) the application received.
    pub bytes: u64,
    /// Of what it read, bytes (or messages) not as sent.
    pub corrupt: u64,
    /// Answer bytes the sender found not as asked for.
    pub answers_corrupt: u64,
    /// Stream bytes the sender wrote, and those acknowledged.
    pub written: u64,
    /// Acknowledged by the receiver.
    pub acked: u64,
    /// Every component's counters.
    pub counters: Counters,
}

/// Core `i` if the machine has it.
fn core(i: usize) -> Option<usize> {
    (mem::cpu::online_cores() > i).then_some(i)
}

impl TcpRunning {
    /// Builds the machine and its sender and starts both; returns once the connection
    /// is up.
    pub fn start(o: TcpOptions) -> Result<Self, Error> {
        let f = flow();
        let app = Arc::new(AppCounters::default());
        let (proto, message) = match o.app {
            PeerApp::Stream { .. } => (Proto::TcpStream, STREAM_MESSAGE),
            PeerApp::Rr { size, .. } => (Proto::TcpRr, size),
        };
        let spec = AppSpec {
            flow: f,
            message,
            proto,
            counters: Arc::clone(&app),
            latency: None,
            nbd: None,
        };
        let (guest_core, peer_core) = match (o.receiver, o.placement) {
            (Receiver::Native, Placement::OneCore) => (None, core(0)),
            (Receiver::Pv, Placement::OneCore) => (Some(0), core(1)),
            (_, Placement::TwoCore) => (Some(1), core(2)),
        };
        // The peer runs as a device engine on the machine's pCPUs once it has started
        // (on its device pCPU: a core of its own where the host has one free).
        let (mut peer, source, sink) = TcpPeer::new(PeerSpec {
            ip: f.src_ip,
            mac: f.src_mac,
            to: f.dst_ip,
            port: f.dst_port,
            rate: o.wire,
            core: peer_core,
            app: o.app,
        });
        let peer_counters = Arc::clone(peer.counters());
        let mut driver = o.driver;
        // Checksum offload (netfront of the paper's day had it) and GSO packets from
        // netback.
        let mut front = FrontConfig {
            offloads: true,
            ..FrontConfig::default()
        };
        let (mut grant_version, mut grant_path) = (GrantVersion::V1, GrantPath::Original);
        if o.soft {
            // Every switch but netfront's linear buffers, which take no GSO packet.
            for opt in SoftOpt::ALL
                .into_iter()
                .filter(|&x| x != SoftOpt::NoFragments)
            {
                opt.apply_to(
                    &mut driver,
                    &mut front,
                    (&mut grant_version, &mut grant_path),
                );
            }
        }
        let layout = match o.receiver {
            Receiver::Native => Layout::Native(spec),
            Receiver::Pv => Layout::DriverDomain {
                driver,
                guests: [GuestSpec {
                    weight: 1,
                    name: "guest".into(),
                    mac: f.dst_mac,
                    above: Above::App(spec),
                    core: guest_core,
                    front,
                }]
                .into_iter()
                .chain(o.neighbour.map(|weight| GuestSpec {
                    weight,
                    name: NEIGHBOUR.into(),
                    mac: [0x02, 0, 0, 0, 0, 0xcc],
                    above: Above::Compute(kernel::compute::ComputeSpec {
                        heap_pages: 512,
                        passes: Arc::default(),
                    }),
                    core: guest_core,
                    front: FrontConfig::default(),
                }))
                .collect(),
            },
        };
        let machine = Machine::start(MachineSpec {
            grant_version,
            grant_path,
            sample: o.sample,
            idle: o.idle,
            ..MachineSpec::new(NicSpec::new(Box::new(source), Box::new(sink)), layout)
        })
        .map_err(Error::other)?;
        peer.run_on(machine.scheduler(), machine.device_pcpu())
            .map_err(Error::other)?;
        let t = Instant::now();
        while !peer_counters.connected.load(Ordering::Acquire) {
            if t.elapsed() > CONNECT_WITHIN {
                return Err(Error::other("the sender did not connect"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(Self {
            opts: o,
            machine,
            peer,
            peer_counters,
            app,
        })
    }

    /// The machine: its hypervisor and domains, for an experiment that acts on them
    /// while the stream runs.
    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// The measured window begins: the devices' and vCPUs' waits to run count from now
    /// ([`hv::sched::Scheduler::mark_waits`]), as the CPU per byte does, not from the
    /// machine's start.
    pub fn begin_window(&self) {
        self.machine.scheduler().mark_waits();
    }

    /// The machine's counters now.
    pub fn snapshot(&self) -> TcpSnapshot {
        let counters = self.machine.live_counters(Duration::from_millis(100));
        TcpSnapshot {
            at: Instant::now(),
            domains: domain_use(&self.machine),
            bytes: self.app.bytes.load(Ordering::Relaxed),
            transactions: self.peer_counters.transactions.load(Ordering::Relaxed),
            rtt_mark: self.peer_counters.rtt.len(),
            counters,
        }
    }

    /// Waits (up to `limit`) until a paced stream keeps its schedule: behind by no
    /// more than [`CAUGHT_UP`] bytes. A sender still catching up (its window grew slowly
    /// in slow start: smoltcp's Reno grows it per ACK, and LRO sends fewer ACKs) would
    /// put more than the offered load into a window. Returns whether it caught up.
    pub fn settle(&self, limit: Duration) -> bool {
        let t = Instant::now();
        loop {
            if self.peer_counters.lag.load(Ordering::Relaxed) <= CAUGHT_UP {
                return true;
            }
            if t.elapsed() >= limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Round trips timed since `mark`, in ns.
    pub fn rtts_since(&self, mark: usize) -> Vec<u64> {
        self.peer_counters.rtt.since(mark)
    }

    /// Stops the sender writing, waits (up to [`DRAIN`]) until the application has
    /// read every stream byte written, then stops the sender and the machine.
    pub fn finish(self) -> Result<TcpFinish, Error> {
        self.peer.quiesce();
        let t = Instant::now();
        let pc = &self.peer_counters;
        while t.elapsed() < DRAIN {
            // The sender's count is final once it has seen the request; the
            // application's catches up as the stream drains.
            let quiet = pc.quiet.load(Ordering::Acquire);
            let written = pc.written.load(Ordering::Relaxed);
            if quiet && self.app.bytes.load(Ordering::Relaxed) >= written {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let stats = self.peer.stop();
        let counters = self.machine.stop().map_err(Error::other)?;
        let pc = &self.peer_counters;
        let mut f = TcpFinish {
            bytes: self.app.bytes.load(Ordering::Relaxed),
            corrupt: self.app.corrupt.load(Ordering::Relaxed),
            answers_corrupt: pc.corrupt.load(Ordering::Relaxed),
            written: pc.written.load(Ordering::Relaxed),
            acked: pc.acked.load(Ordering::Relaxed),
            counters,
        };
        if let Some(s) = stats {
            f.counters.add_set("sender tcp", &s);
        }
        Ok(f)
    }
}

/// How far behind its schedule a paced stream may be and count as keeping it: two
/// full-size aggregates.
pub const CAUGHT_UP: u64 = 128 << 10;

/// How long a finishing run waits for the stream to drain: far longer than a
/// receiver's socket buffer takes to empty.
pub const DRAIN: Duration = Duration::from_secs(3);

/// How long the sender may take to connect.
const CONNECT_WITHIN: Duration = Duration::from_secs(10);
