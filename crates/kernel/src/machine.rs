//! The machine builder: a [`MachineSpec`] (domains, cores, the NIC and its cable, the
//! switches) becomes a running [`Machine`], each domain's kernel looping on a vCPU
//! pinned to its core.
//!
//! Layouts:
//! * [`Layout::Native`]: one domain drives the NIC (`pci-nommu` DMA through an identity
//!   IOMMU context) and runs the stack and application; the NIC's interrupt wakes its
//!   CPU directly, and it halts when idle, so no hypervisor code is on its path;
//! * [`Layout::Direct`]: the NIC is assigned to a guest: its DMA goes through the
//!   guest's IOMMU context, its interrupt arrives as an event, the guest kernel's DMA
//!   interface is `swiotlb` and it blocks in the hypervisor when idle;
//! * [`Layout::DriverDomain`]: a driver domain runs the NIC driver, the bridge and one
//!   netback vif per guest; each guest runs netfront and above it pvio's stack and the
//!   application, or a TAP. The driver domain is on core 0, guests from core 1 on.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::blkback::{self, Blkback, VBD_WINDOW_SLOTS};
use blk::blkfront::Blkfront;
use blk::disk::FileDisk;
use blk::initiator::InitiatorConfig;
use blk::remote::RemoteVbd;
use dev::driver::DmaApi;
use dev::irq::{IrqLine, NativeIrq};
use dev::nic::{Coalesce, Nic, NicRegs, RX_QUEUES};
use dev::tap::TapPort;
use dev::wire::{WireSink, WireSource};
use hv::sched::{CpuPlan, IdlePolicy, Scheduler, UnitJoin, UnitSpec};
use hv::store::XenStore;
use hv::{
    DeviceId, DomId, Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor, Port,
    Vector,
};
use net::netfront::FrontConfig;
use net::netfront::Netfront;
use net::skb::SkbPool;
use net::toolstack::{self, VifSpec};

use crate::app::AppSpec;
use crate::driver_domain::{DriverConfig, DriverDomain, Fault, FaultSwitch};
use crate::hostile::HostileGuest;
use crate::native::NicKernel;
use crate::pv_guest::{guest_pool, PvGuest, TapGuest};
use crate::vcpu::{self, Kernel, Platform};
use crate::counters::PortKind;
use crate::{other, BuildError, Counters};

/// The NIC's device id.
pub const NIC: DeviceId = DeviceId(1);
/// The NIC's interrupt vector.
pub const NIC_VECTOR: Vector = Vector(40);
/// Pages of memory each domain gets.
pub const DOMAIN_PAGES: u32 = 8192;

/// The NIC and what is at the far end of its cable.
#[allow(missing_debug_implementations)]
pub struct NicSpec {
    /// Its interrupt coalescing.
    pub coalesce: Coalesce,
    /// What it receives.
    pub source: Box<dyn WireSource>,
    /// Where what it sends goes.
    pub sink: Box<dyn WireSink>,
}

/// What runs above a PV guest's netfront.
#[derive(Debug)]
pub enum Above {
    /// pvio's stack and the receiving application.
    App(AppSpec),
    /// A TAP: the guest's stack is its network namespace's.
    Tap(Box<TapPort>),
    /// No netfront: a raw front end writing garbage into the rings
    /// ([`crate::hostile::HostileGuest`]), seeded.
    Hostile(u64),
    /// The same, deaf to its back end: it connects once and never follows the store
    /// again, so after a driver-domain restart it never reconnects.
    Deaf(u64),
    /// Raw frames handed to netfront: the probes' echo server or client
    /// ([`crate::probe`]).
    Raw(crate::svnic_guest::RawApp),
    /// No vif: a virtual disk (blkfront, served by the driver domain's blkback from a
    /// backing file) and a block job above it ([`crate::block`]). The guest's MAC and
    /// netfront settings are not used.
    Block(Box<BlockSpec>),
    /// No vif: a guest that computes ([`crate::compute`]), the neighbour of a
    /// consolidated machine. The guest's MAC and netfront settings are not used.
    Compute(crate::compute::ComputeSpec),
}

/// What stands behind a guest's virtual disk.
#[derive(Debug, Clone)]
pub enum Disk {
    /// A backing file the driver domain's blkback reads and writes.
    File(std::path::PathBuf),
    /// A remote disk the driver domain reaches over ATA over Ethernet through its NIC
    /// (the host-centric remote virtual block device): the AoE target at this
    /// major (shelf) and minor (slot) address.
    Aoe {
        /// Its shelf.
        major: u16,
        /// Its slot.
        minor: u8,
    },
}

/// The MAC the SV-NIC's block service sends from.
pub const SVNIC_AOE_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0xae, 0x02];

/// The MAC the driver domain's AoE initiators send from.
pub const DRIVER_AOE_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0xae, 0x01];

/// A guest's virtual disk and what runs on it.
#[derive(Debug)]
pub struct BlockSpec {
    /// What stands behind it.
    pub disk: Disk,
    /// The device is read-only (`mode = r`).
    pub read_only: bool,
    /// Both ends use persistent grants.
    pub persistent: bool,
    /// The guest's job on it.
    pub job: crate::block::BlockJobSpec,
}

/// The device id of a guest's disk (`xvda`'s `virtual-device`).
pub const XVDA: u32 = 51712;

/// One PV guest.
#[derive(Debug)]
pub struct GuestSpec {
    /// Its domain's name.
    pub name: String,
    /// Its vif's MAC.
    pub mac: [u8; 6],
    /// Its netfront's switches: what it posts, how it grants (grant reuse, paper 000
    /// §4.4, or the paper's unsafe stand-in), offloads (the TAP above it then takes
    /// large frames), the split ring layout.
    pub front: FrontConfig,
    /// What runs above netfront.
    pub above: Above,
    /// The core its vCPU is pinned to; by default the guests take the cores after the
    /// driver domain's, one each (core 1, 2, ...). A core the machine does not have
    /// leaves the vCPU floating.
    pub core: Option<usize>,
    /// Its vCPU's weight on its pCPU (Xen's credit weight, in steps a turn; 1 is the
    /// least, and what every other domain has).
    pub weight: u32,
}

/// A guest of the self-virtualized NIC: a VIF of its own, the stack and the
/// application above its VIF driver.
#[derive(Debug)]
pub struct SvnicGuestSpec {
    /// Its domain's name.
    pub name: String,
    /// Its VIF's MAC.
    pub mac: [u8; 6],
    /// What runs above the VIF driver.
    pub app: crate::svnic_guest::SvnicApp,
    /// Its VIF's priority, 1 to 100 (the device's default if none).
    pub priority: Option<u8>,
    /// Its vCPU's core (by default the guests take the cores after the controller
    /// domain's, one each).
    pub core: Option<usize>,
}

/// Which domains, and what each runs.
#[derive(Debug)]
pub enum Layout {
    /// Linux on the bare machine.
    Native(AppSpec),
    /// A guest with the NIC assigned.
    Direct(AppSpec),
    /// The domain with the NIC runs a raw application on it itself, at `mac`, through
    /// a bridge or not (paper 002's dotted lines: the driver domain using the NIC).
    DirectRaw {
        /// The application.
        app: crate::svnic_guest::RawApp,
        /// Its MAC.
        mac: [u8; 6],
        /// Through the driver domain's software bridge (netfilter hooks on).
        bridge: bool,
    },
    /// The domain with the NIC runs the stack and an application on it itself, through
    /// a bridge at the application's MAC or not (paper 002's dotted lines for TCP).
    DirectStack {
        /// The application.
        app: AppSpec,
        /// Its MAC (the bridge fixes it to the stack's port).
        mac: [u8; 6],
        /// Through a software bridge (netfilter hooks on).
        bridge: bool,
    },
    /// A driver domain and paravirtual guests.
    DriverDomain {
        /// The bridge's and netback's switches.
        driver: DriverConfig,
        /// The guests, one vif each.
        guests: Vec<GuestSpec>,
    },
    /// The self-virtualized NIC (paper 002): its engines on device cores multiplex the
    /// cable among the guests' VIFs, which the guests reach directly; a controller
    /// domain runs the host-side management (and, with the identifier register, takes
    /// the master interrupt on its core).
    Svnic {
        /// The device's engines, signalling and cores.
        config: dev::svnic::device::SvnicConfig,
        /// The guests, one VIF each.
        guests: Vec<SvnicGuestSpec>,
    },
}

/// A whole machine.
#[allow(missing_debug_implementations)]
pub struct MachineSpec {
    /// Grant-table layout of every domain.
    pub grant_version: GrantVersion,
    /// The hypervisor's grant implementation.
    pub grant_path: GrantPath,
    /// Profiler sampling interval (none: no sampling).
    pub sample: Option<Duration>,
    /// How the machine's idle pCPUs wait ([`IdlePolicy`]): `poll` when all the load on
    /// its cores is pvio's own, `halt-poll` when other processes share them (a test
    /// runner, iperf3), `block` as the comparison with a host wake-up per interrupt.
    pub idle: IdlePolicy,
    /// The NIC.
    pub nic: NicSpec,
    /// The domains.
    pub layout: Layout,
    /// The host cores the machine owns (its cpupool), which the layout's core numbers
    /// take in ascending order; `None`: every online core, shared with any other machine.
    pub cpus: Option<CpuSet>,
    /// Where its devices' DMA writes land: in memory, as on the papers' 2008 platforms,
    /// or in the cache hierarchy, as on a processor with Data Direct I/O.
    pub dma_landing: hv::iommu::DmaLanding,
}

/// What a domain is, for accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The only domain of a native machine.
    Native,
    /// A driver domain (its CPU is the I/O's cost, not the application's).
    DriverDomain,
    /// A guest.
    Guest,
}

/// What the toolstack keeps to rebuild a driver domain (paper 000 §5.1): its
/// configuration, its guests' vifs, and the watchdog's last look at it.
#[derive(Debug)]
struct DriverPlan {
    dom: Arc<Domain>,
    config: DriverConfig,
    slots: u32,
    guests: Vec<(Arc<Domain>, VifSpec)>,
    /// Each guest's disk, to be served again by a new driver domain.
    disks: Vec<DiskPlan>,
    fault: FaultSwitch,
    regs: Arc<NicRegs>,
    /// The driver domain's event looks when the watchdog last saw them move, the NIC's
    /// frames (received and missed) then, and when.
    seen: (u64, u64, Instant),
}

/// A guest's disk as the toolstack keeps it to hand to a new driver domain.
#[derive(Debug, Clone)]
struct DiskPlan {
    dom: Arc<Domain>,
    disk: Disk,
    read_only: bool,
    persistent: bool,
    /// Its back end's first window slot.
    slot: u32,
    /// A remote disk's initiator's tag prefix (its index among the remote disks).
    tag: u8,
}

impl DiskPlan {
    /// The disk, for messages: its file, or its AoE target.
    fn name(&self) -> String {
        match &self.disk {
            Disk::File(path) => path.display().to_string(),
            Disk::Aoe { major, minor } => format!("e{major}.{minor}"),
        }
    }

    /// The toolstack's and the new driver domain's part of serving the disk again:
    /// the device re-pointed at `drv` in the store (the guest's blkfront sees it, and
    /// connects once the back end waits), the backing file probed again and blkback
    /// connected once blkfront has; or, for a remote disk, a fresh initiator that finds
    /// the target again from the new driver domain. Returns the back end made.
    fn serve(&self, hv: &Arc<Hypervisor>, drv: &Arc<Domain>) -> Result<Served, BuildError> {
        let fe = self.dom.id();
        blk::xenbus::create_vbd(hv.store(), drv.id(), fe, XVDA, self.read_only).map_err(other)?;
        match &self.disk {
            Disk::File(path) => {
                let name = |e: &dyn std::fmt::Display| other(format!("disk {}: {e}", self.name()));
                let disk = FileDisk::open(path, self.read_only).map_err(|e| name(&e))?;
                blkback::probe(hv.store(), drv.id(), fe, XVDA, &disk, self.persistent)
                    .map_err(|e| name(&e))?;
                Ok(Served::File(disk))
            }
            Disk::Aoe { major, minor } => {
                let mut cfg = InitiatorConfig::new(DRIVER_AOE_MAC, *major, *minor);
                cfg.tag_prefix = self.tag;
                Ok(Served::Remote(RemoteVbd::new(
                    hv,
                    drv,
                    fe,
                    XVDA,
                    self.slot,
                    cfg,
                    self.persistent,
                )))
            }
        }
    }
}

/// A disk a new driver domain serves: a file whose back end connects once the guest
/// has, or a remote disk's device.
enum Served {
    File(FileDisk),
    Remote(RemoteVbd),
}

/// Why the watchdog restarted the driver domain, and what the restart took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restarted {
    /// What the watchdog saw.
    pub cause: DriverFault,
    /// From the watchdog's decision to the new driver domain running with every vif
    /// and disk connected.
    pub took: Duration,
    /// Disks the new driver domain could not serve (their backing file gone, say):
    /// their guests fail what they had in flight after their bound.
    pub disks_unserved: u32,
    /// Vifs whose guests did not reconnect in time: left out until the next restart.
    pub vifs_unserved: u32,
}

/// A driver domain's failure, as the watchdog tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverFault {
    /// Its kernel ended (a panic).
    Crashed,
    /// An event waited longer than the watchdog's limit and the kernel never looked.
    Stalled,
}

/// A running machine. Dropping it stops it.
#[derive(Debug)]
pub struct Machine {
    hv: Arc<Hypervisor>,
    /// The pCPUs every vCPU runs on.
    sched: Arc<Scheduler>,
    /// The host core of each pCPU, by index.
    pcpu_cores: Vec<usize>,
    /// The host cores the machine owns.
    pool: CpuPool,
    /// The pCPU the device engines run on.
    device_pcpu: usize,
    grant_version: GrantVersion,
    driver: Option<DriverPlan>,
    domains: Vec<(Arc<Domain>, Role)>,
    nic: Option<Nic>,
    /// The self-virtualized NIC, in its layout.
    /// The SV-NIC and its device domain.
    svnic: Option<(dev::svnic::device::Svnic<hv::OwnPage>, DomId)>,
    /// The SV-NIC's block service, if its guests have remote disks.
    block_engine: Option<dev::svnic::block::BlockEngine>,
    stop: Arc<AtomicBool>,
    kernels: Vec<(Arc<Domain>, UnitJoin<Counters>)>,
    /// Where each running kernel's counters are asked for.
    doors: Vec<(Arc<Domain>, Arc<vcpu::CounterDoor>)>,
    native_irq: Option<Arc<NativeIrq>>,
    /// The NIC driver chooses its interrupt moderation from the rate.
    adaptive_coalescing: bool,
}

/// How the builder makes a domain: name, whether it drives a device, window slots.
type MakeDomain<'a> =
    dyn Fn(&Arc<Hypervisor>, &str, bool, u32) -> Result<Arc<Domain>, hv::HvError> + 'a;

/// What every layout's builder is handed: the count of kernels up, the host core of
/// each of the layout's cores, and the factory of its domains.
struct Build<'a> {
    ready: &'a Arc<AtomicUsize>,
    start: &'a dyn Fn(usize) -> usize,
    mk: &'a MakeDomain<'a>,
}

/// VIFs of an SV-NIC machine (its vectors from [`SVNIC_VECTOR_BASE`] on).
pub const SVNIC_MAX_VIFS: usize = 64;
/// The first VIF's vector.
pub const SVNIC_VECTOR_BASE: u8 = 64;
/// How long the toolstack waits for the SV-NIC's management driver to answer.
pub const MGMT_WAIT: Duration = Duration::from_secs(5);

/// The controller domain's kernel in the SV-NIC layout: the host-side management runs
/// in the toolstack's thread; its vCPU is where the device's master interrupt is taken
/// (the hypervisor's handler runs on it), and it has nothing else to do.
#[derive(Debug)]
struct Controller;

impl Kernel for Controller {
    const CLOCK: bool = false;
    fn event(&mut self, _v: &hv::Vcpu, _port: Port) {}
    fn poll(&mut self, _now: Duration) -> vcpu::Work {
        vcpu::Work::default()
    }
    fn shutdown(self) -> Counters {
        Counters::default()
    }
}

/// A guest's front end while the machine is built.
enum Front {
    /// netfront and the guest's pool, RX ring filled.
    Net(Box<(Netfront, SkbPool)>),
    /// A hostile guest's kernel, its rings published.
    Hostile(HostileGuest),
    /// blkfront, connected.
    Block(Box<Blkfront>),
    /// blkfront, to connect once its remote back end has found its disk.
    BlockLater,
    /// No front end (a guest that computes).
    None,
}

/// What connecting the driver-domain layout's guests gave: netback's vifs with their
/// MACs, each guest's front end, the vifs' plan (for a restart), the disks' back ends
/// (local and remote) and their plan.
struct Connected {
    vifs: Vec<(net::netback::Vif, [u8; 6])>,
    fronts: Vec<Front>,
    plan: Vec<(Arc<Domain>, VifSpec)>,
    vbds: Vec<Blkback>,
    remote: Vec<RemoteVbd>,
    disks: Vec<DiskPlan>,
}

/// The toolstack's part and each device's handshake, guest by guest: a vif (the
/// toolstack offers it, netfront connects, then netback; a hostile guest does its
/// half itself) with the guest's pool and netfront's RX ring filled, or a disk (its
/// back end served from its file now, or from a remote target once found), or nothing
/// for a guest that computes.
fn connect_guests(
    hv: &Arc<Hypervisor>,
    drv: &Arc<Domain>,
    guests: &[GuestSpec],
    doms: &[Arc<Domain>],
    vbd_base: u32,
    unsafe_machine_frames: bool,
) -> Result<Connected, BuildError> {
    let mut vifs = Vec::with_capacity(guests.len());
    let mut fronts = Vec::with_capacity(guests.len());
    let mut plan = Vec::with_capacity(guests.len());
    let mut vbds = Vec::new();
    let mut remote = Vec::new();
    let mut disks = Vec::new();
    for (g, dom) in guests.iter().zip(doms) {
        if let Above::Compute(_) = &g.above {
            fronts.push(Front::None);
            continue;
        }
        if let Above::Block(b) = &g.above {
            let slot = vbd_base + (vbds.len() + remote.len()) as u32 * VBD_WINDOW_SLOTS;
            let plan = DiskPlan {
                dom: Arc::clone(dom),
                disk: b.disk.clone(),
                read_only: b.read_only,
                persistent: b.persistent,
                slot,
                tag: remote.len() as u8,
            };
            // The toolstack's part, as a restart does it; then, for a file,
            // both ends connect now (a remote disk's blkfront waits for its
            // back end to find the target).
            match plan.serve(hv, drv)? {
                Served::File(file) => {
                    let name =
                        |e: &dyn std::fmt::Display| other(format!("disk {}: {e}", plan.name()));
                    let front =
                        Blkfront::connect(hv, dom, XVDA, b.persistent).map_err(|e| name(&e))?;
                    let back = Blkback::connect(hv::Pvio::new(hv, drv), dom.id(), XVDA, slot, file)
                        .map_err(|e| name(&e))?;
                    vbds.push(back);
                    fronts.push(Front::Block(Box::new(front)));
                }
                Served::Remote(r) => {
                    remote.push(r);
                    fronts.push(Front::BlockLater);
                }
            }
            disks.push(plan);
            continue;
        }
        let vs = VifSpec {
            handle: 0,
            mac: g.mac,
            index: vifs.len() as u16,
            front: g.front,
        };
        // A hostile guest does its half of the handshake itself.
        let front = match g.above {
            Above::Hostile(seed) => {
                toolstack::offer_vif(hv, drv, dom, vs).map_err(other)?;
                Front::Hostile(HostileGuest::new(hv, dom, vs.handle, seed))
            }
            Above::Deaf(seed) => {
                toolstack::offer_vif(hv, drv, dom, vs).map_err(other)?;
                Front::Hostile(HostileGuest::deaf(hv, dom, vs.handle, seed))
            }
            _ => {
                toolstack::offer_vif(hv, drv, dom, vs).map_err(other)?;
                if unsafe_machine_frames {
                    // The paper's unsafe stand-in, offered by the toolstack
                    // only when measuring it.
                    let dir = net::xenbus::backend_dir(drv.id(), dom.id(), vs.handle);
                    hv.store()
                        .write(
                            drv.id(),
                            &format!("{dir}/{}", net::xenbus::FEATURE_MACHINE_FRAMES),
                            "1",
                        )
                        .map_err(other)?;
                }
                let mut front =
                    Netfront::connect_config(hv, dom, vs.handle, vs.front).map_err(other)?;
                let pool = guest_pool(dom, &mut front)?;
                Front::Net(Box::new((front, pool)))
            }
        };
        let vif = toolstack::connect_backend(hv, drv, dom, vs).map_err(other)?;
        vifs.push((vif, g.mac));
        fronts.push(front);
        plan.push((Arc::clone(dom), vs));
    }
    Ok(Connected {
        vifs,
        fronts,
        plan,
        vbds,
        remote,
        disks,
    })
}

/// Starts the NIC of `spec` with its interrupt on `irq`.
fn start_nic(
    hv: &Arc<Hypervisor>,
    at: Device<'_>,
    irq: IrqLine,
    spec: NicSpec,
) -> Result<Nic, BuildError> {
    start_nic_queues(hv, at, vec![irq], spec)
}

/// Where the machine's device engines run: a pCPU of its scheduler.
#[derive(Clone, Copy)]
struct Device<'a> {
    sched: &'a Scheduler,
    pcpu: usize,
}

/// Starts the NIC with an interrupt line per receive queue, its engine a unit on `at`.
fn start_nic_queues(
    hv: &Arc<Hypervisor>,
    at: Device<'_>,
    lines: Vec<IrqLine>,
    spec: NicSpec,
) -> Result<Nic, BuildError> {
    Nic::start_on(
        at.sched,
        at.pcpu,
        hv,
        NIC,
        lines,
        spec.coalesce,
        spec.source,
        spec.sink,
    )
    .map_err(other)
}

/// Assigns the NIC of `spec` to `dom` under the hypervisor: its DMA through `dom`'s IOMMU
/// context, its interrupt a physical IRQ bound to one of `dom`'s ports (returned).
fn assign_nic(
    hv: &Arc<Hypervisor>,
    at: Device<'_>,
    dom: &Arc<Domain>,
    spec: NicSpec,
) -> Result<(Nic, Port), BuildError> {
    hv.iommu_attach(NIC, dom).map_err(other)?;
    let pirq = hv.bind_irq(dom, NIC_VECTOR).map_err(other)?;
    let line = IrqLine::Hypervisor {
        hv: Arc::clone(hv),
        vector: NIC_VECTOR,
    };
    Ok((start_nic(hv, at, line, spec)?, pirq))
}

/// The vector of receive queue `q`'s interrupt (MSI-X vector `q`).
fn queue_vector(q: usize) -> Vector {
    Vector(NIC_VECTOR.0 + q as u8)
}

/// Binds every receive queue's interrupt to one of `dom`'s ports (index: queue).
fn bind_queue_irqs(hv: &Arc<Hypervisor>, dom: &Arc<Domain>) -> Result<Vec<Port>, BuildError> {
    (0..RX_QUEUES)
        .map(|q| hv.bind_irq(dom, queue_vector(q)).map_err(other))
        .collect()
}

/// As [`assign_nic`] for a driver domain: every receive queue's interrupt a physical
/// IRQ bound to one of `dom`'s ports (returned, by queue).
fn assign_nic_queues(
    hv: &Arc<Hypervisor>,
    at: Device<'_>,
    dom: &Arc<Domain>,
    spec: NicSpec,
) -> Result<(Nic, Vec<Port>), BuildError> {
    hv.iommu_attach(NIC, dom).map_err(other)?;
    let pirqs = bind_queue_irqs(hv, dom)?;
    let lines = (0..RX_QUEUES)
        .map(|q| IrqLine::Hypervisor {
            hv: Arc::clone(hv),
            vector: queue_vector(q),
        })
        .collect();
    Ok((start_nic_queues(hv, at, lines, spec)?, pirqs))
}

/// A set of host cores by number (below [`CpuSet::LIMIT`]), as a machine file or an
/// experiment names the cores a machine owns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuSet(u128);

impl CpuSet {
    /// Core numbers a set can hold: 0 to this, exclusive.
    pub const LIMIT: usize = 128;

    /// The cores `cores`; a core past [`Self::LIMIT`] or named twice is an error.
    pub fn of(cores: impl IntoIterator<Item = usize>) -> Result<Self, BuildError> {
        let mut bits = 0u128;
        for c in cores {
            if c >= Self::LIMIT {
                return Err(other(format!(
                    "core {c}: a CPU set holds cores 0 to {}",
                    Self::LIMIT - 1
                )));
            }
            if bits & 1 << c != 0 {
                return Err(other(format!("a CPU set names core {c} twice")));
            }
            bits |= 1 << c;
        }
        Ok(Self(bits))
    }

    /// The cores `from..to` (those past [`Self::LIMIT`] left out).
    pub fn range(r: std::ops::Range<usize>) -> Self {
        Self(
            r.filter(|&c| c < Self::LIMIT)
                .fold(0u128, |bits, c| bits | 1 << c),
        )
    }

    /// The cores, ascending.
    pub fn cores(&self) -> Vec<usize> {
        (0..Self::LIMIT).filter(|&c| self.0 & 1 << c != 0).collect()
    }

    /// Whether it names no core.
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }
}

/// The host cores a machine owns, Xen's cpupool: a layout names cores `0, 1, 2, ...`
/// (the papers' pinning) and core `i` is the `i`-th host core of the pool, the pool's
/// cores taken in turn when the layout names more than it has. By default the pool is
/// every online core, so two machines in one process share them; a machine given a pool
/// of its own shares no core with a machine given another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuPool(Vec<usize>);

impl CpuPool {
    /// Every online core of the host.
    pub fn all() -> Self {
        Self((0..mem::cpu::online_cores().max(1)).collect())
    }

    /// The host cores of `set`, ascending; an empty set or a core the host does not
    /// have is an error.
    pub fn of(set: CpuSet) -> Result<Self, BuildError> {
        let online = mem::cpu::online_cores().max(1);
        let cores = set.cores();
        if cores.is_empty() {
            return Err(other("a CPU pool needs at least one core"));
        }
        if let Some(c) = cores.iter().find(|&&c| c >= online) {
            return Err(other(format!(
                "core {c} is not online (the host has {online})"
            )));
        }
        Ok(Self(cores))
    }

    /// The host core a placement on the layout's core `i` gets.
    pub fn core(&self, i: usize) -> usize {
        self.0[i % self.0.len()]
    }

    /// The pool's host cores.
    pub fn cores(&self) -> &[usize] {
        &self.0
    }
}

/// The core a layout's device engines (the NIC and what is at the far end of its
/// cable) run on: a core of their own if the host has one the domains leave free, as a
/// NIC is hardware beside the CPUs; otherwise the core of the domain that does not
/// drive the device (a native or direct-I/O kernel is on core 1, so the NIC takes core
/// 0; a driver domain is on core 0, so the NIC shares core 1 with the first guest).
fn device_core(layout: &Layout, used: &[usize], pool: &CpuPool) -> usize {
    if let Some(&free) = pool.cores().iter().find(|c| !used.contains(c)) {
        return free;
    }
    match layout {
        Layout::Native(_) | Layout::Direct(_) => pool.core(0),
        _ => pool.core(1),
    }
}

/// The cores a layout places its vCPUs on (by the papers' pinning: the driver domain
/// or the only domain's on core 0 or 1, guests from core 1 on), as host cores.
fn layout_cores(layout: &Layout, pool: &CpuPool) -> Vec<usize> {
    let mut v = domain_cores(layout, pool);
    if let Layout::Svnic { config, .. } = layout {
        // The device's engines and sidecore on the cores its configuration names.
        v.extend(svnic_cores(config, pool));
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// The host cores of a layout's domains' vCPUs.
fn domain_cores(layout: &Layout, pool: &CpuPool) -> Vec<usize> {
    let core = |i: usize| pool.core(i);
    let guests = |cores: Vec<Option<usize>>| {
        let mut v = vec![core(0)];
        v.extend(
            cores
                .iter()
                .enumerate()
                .map(|(i, c)| core(c.unwrap_or(1 + i))),
        );
        v
    };
    match layout {
        Layout::Native(_) | Layout::Direct(_) => vec![core(1)],
        Layout::DirectRaw { .. } | Layout::DirectStack { .. } => vec![core(0)],
        Layout::DriverDomain { guests: g, .. } => guests(g.iter().map(|g| g.core).collect()),
        Layout::Svnic { guests: g, .. } => guests(g.iter().map(|g| g.core).collect()),
    }
}

/// The host cores an SV-NIC's configuration names for its engines and sidecore.
fn svnic_cores(config: &dev::svnic::device::SvnicConfig, pool: &CpuPool) -> Vec<usize> {
    let c = config.cores;
    [c.egress, c.ingress, c.sidecore, c.block]
        .into_iter()
        .flatten()
        .map(|i| pool.core(i))
        .collect()
}

/// The pCPUs that idle their own way: an SV-NIC's engines' and sidecore's, where they
/// have cores no domain shares and the device sleeps when idle (dynamic core
/// partitioning, its future work): a halt-poll of the device's spin, or sleeping at
/// once. A device that polls on never idles, and a core a domain shares idles as the
/// machine says.
fn device_policies(
    layout: &Layout,
    pool: &CpuPool,
    pcpu_cores: &[usize],
) -> Vec<(usize, IdlePolicy)> {
    let Layout::Svnic { config, .. } = layout else {
        return Vec::new();
    };
    let dev::svnic::device::Idle::Block { spin } = config.idle else {
        return Vec::new();
    };
    let policy = if spin.is_zero() {
        IdlePolicy::Block
    } else {
        IdlePolicy::HaltPoll(spin)
    };
    let domains = domain_cores(layout, pool);
    let mut v: Vec<(usize, IdlePolicy)> = svnic_cores(config, pool)
        .into_iter()
        .filter(|c| !domains.contains(c))
        .filter_map(|c| pcpu_cores.iter().position(|&x| x == c))
        .map(|p| (p, policy))
        .collect();
    v.sort_unstable_by_key(|&(p, _)| p);
    v.dedup_by_key(|&mut (p, _)| p);
    v
}

impl Machine {
    /// Builds the machine and starts it: hypervisor, domains, NIC, the toolstack's vifs
    /// and their handshakes, drivers, vCPUs; the cable is plugged in once every kernel
    /// runs.
    pub fn start(spec: MachineSpec) -> Result<Self, BuildError> {
        let ndomains = match &spec.layout {
            Layout::DriverDomain { guests, .. } => guests.len() + 1,
            // The guests, the controller domain, and the device's memory.
            Layout::Svnic { guests, .. } => guests.len() + 2,
            _ => 1,
        };
        let hv = Hypervisor::new(HvConfig {
            frames: DOMAIN_PAGES * (ndomains.max(2) as u32 + 1) + 1024,
            grant_path: spec.grant_path,
            dma_landing: spec.dma_landing,
            ..HvConfig::default()
        })?;
        // One pCPU on each core the layout uses, its device engines' included.
        let pool = match spec.cpus {
            Some(set) => CpuPool::of(set)?,
            None => CpuPool::all(),
        };
        let mut pcpu_cores = layout_cores(&spec.layout, &pool);
        let dev_core = device_core(&spec.layout, &pcpu_cores, &pool);
        if !pcpu_cores.contains(&dev_core) {
            pcpu_cores.push(dev_core);
            pcpu_cores.sort_unstable();
        }
        let device_pcpu = pcpu_cores.iter().position(|&c| c == dev_core).unwrap_or(0);
        let plan = CpuPlan {
            cores: pcpu_cores.iter().map(|&c| Some(c)).collect(),
            policy: spec.idle,
            own_policy: device_policies(&spec.layout, &pool, &pcpu_cores),
        };
        let sched = Scheduler::new(&plan, spec.sample).map_err(other)?;
        let mut m = Machine {
            hv,
            sched,
            pcpu_cores,
            pool,
            device_pcpu,
            grant_version: spec.grant_version,
            driver: None,
            domains: Vec::new(),
            nic: None,
            svnic: None,
            block_engine: None,
            stop: Arc::new(AtomicBool::new(false)),
            kernels: Vec::new(),
            doors: Vec::new(),
            native_irq: None,
            adaptive_coalescing: spec.nic.coalesce.adaptive,
        };
        let ready = Arc::new(AtomicUsize::new(0));
        let mk = |hv: &Arc<Hypervisor>, name: &str, driver: bool, slots: u32| {
            hv.create_domain(&DomainConfig {
                name: name.into(),
                pages: DOMAIN_PAGES,
                // Room for netfront's per-slot references and, with grant reuse, a
                // reference bound to each page of its pool.
                grant_frames: 8,
                grant_version: spec.grant_version,
                vcpus: 1,
                map_slots: slots,
                driver_domain: driver,
            })
        };
        let pool = m.pool.clone();
        let start = move |i: usize| pool.core(i);
        let n = spec.nic;
        let b = Build {
            ready: &ready,
            start: &start,
            mk: &mk,
        };
        match spec.layout {
            Layout::Svnic { config, guests } => {
                m.start_svnic(n, config, guests, b.ready, b.start, b.mk)?;
            }
            Layout::Native(app) => m.start_native(n, app, &b)?,
            Layout::Direct(app) => m.start_direct(n, app, &b)?,
            Layout::DirectRaw { app, mac, bridge } => {
                m.start_direct_raw(n, app, mac, bridge, &b)?
            }
            Layout::DirectStack { app, mac, bridge } => {
                m.start_direct_stack(n, app, mac, bridge, &b)?
            }
            Layout::DriverDomain { driver, guests } => {
                m.start_driver_domain(n, driver, guests, &b)?
            }
        }
        // Plug the cable in once every kernel runs.
        let t = Instant::now();
        while ready.load(Ordering::Acquire) < m.kernels.len()
            && t.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Some(nic) = &m.nic {
            nic.regs().link_up.store(true, Ordering::Release);
        }
        if let Some((s, _)) = &m.svnic {
            s.link_up();
        }
        Ok(m)
    }

    /// Where the device engines run.
    fn device(&self) -> Device<'_> {
        Device {
            sched: &self.sched,
            pcpu: self.device_pcpu,
        }
    }

    /// Starts `kernel` on `dom`'s vCPU.
    fn boot<K: Kernel>(
        &mut self,
        dom: &Arc<Domain>,
        role: Role,
        at: usize,
        platform: Platform,
        kernel: K,
        ready: &Arc<AtomicUsize>,
    ) -> Result<(), BuildError> {
        self.boot_as(dom, role, at, platform, kernel, ready, 1)
    }

    /// [`Machine::boot`] for a Xen guest whose vCPU has `weight` on its pCPU.
    fn boot_guest<K: Kernel>(
        &mut self,
        dom: &Arc<Domain>,
        at: usize,
        kernel: K,
        ready: &Arc<AtomicUsize>,
        weight: u32,
    ) -> Result<(), BuildError> {
        self.boot_as(dom, Role::Guest, at, Platform::Xen, kernel, ready, weight)
    }

    #[allow(clippy::too_many_arguments)]
    fn boot_as<K: Kernel>(
        &mut self,
        dom: &Arc<Domain>,
        role: Role,
        at: usize,
        platform: Platform,
        kernel: K,
        ready: &Arc<AtomicUsize>,
        weight: u32,
    ) -> Result<(), BuildError> {
        let (stop, ready) = (Arc::clone(&self.stop), Arc::clone(ready));
        let door = Arc::new(vcpu::CounterDoor::default());
        let v = self
            .hv
            .vcpu(dom, 0)
            .ok_or_else(|| other(format!("{}: no vCPU 0", dom.name())))?;
        let unit = vcpu::KernelUnit::new(v, platform, kernel, stop, ready, Arc::clone(&door));
        let pcpu = self.pcpu_cores.iter().position(|&c| c == at).unwrap_or(0);
        let h = self
            .sched
            .place(
                pcpu,
                UnitSpec {
                    weight: weight.max(1),
                    ..UnitSpec::named(format!("{}-v0", dom.name()))
                },
                unit,
            )
            .map_err(other)?;
        self.kernels.push((Arc::clone(dom), h));
        self.doors.push((Arc::clone(dom), door));
        self.domains.push((Arc::clone(dom), role));
        Ok(())
    }

    /// Builds the native layout: one domain drives the NIC (`pci-nommu` DMA, the
    /// interrupt line wakes its CPU) and runs the stack and the application.
    fn start_native(&mut self, n: NicSpec, app: AppSpec, b: &Build<'_>) -> Result<(), BuildError> {
        let hv = Arc::clone(&self.hv);
        let dom = (b.mk)(&hv, "native", true, 4)?;
        hv.iommu_attach(NIC, &dom).map_err(other)?;
        let irq = Arc::new(NativeIrq::default());
        self.native_irq = Some(Arc::clone(&irq));
        let nic = start_nic(&hv, self.device(), IrqLine::Native(Arc::clone(&irq)), n)?;
        let mut k = NicKernel::new(&hv, &dom, nic.regs(), DmaApi::Direct, None, &app)?;
        k.set_adaptive_coalescing(self.adaptive_coalescing);
        self.nic = Some(nic);
        self.boot(
            &dom,
            Role::Native,
            (b.start)(1),
            Platform::Native(irq),
            k,
            b.ready,
        )?;
        Ok(())
    }

    /// Builds the direct layout: a guest with the NIC assigned (its DMA through the
    /// IOMMU, `swiotlb`, its interrupt an event) runs the stack and the application.
    fn start_direct(&mut self, n: NicSpec, app: AppSpec, b: &Build<'_>) -> Result<(), BuildError> {
        let hv = Arc::clone(&self.hv);
        let dom = (b.mk)(&hv, "guest", false, 4)?;
        let (nic, pirq) = assign_nic(&hv, self.device(), &dom, n)?;
        let mut k = NicKernel::new(&hv, &dom, nic.regs(), DmaApi::Swiotlb, Some(pirq), &app)?;
        k.set_adaptive_coalescing(self.adaptive_coalescing);
        self.nic = Some(nic);
        self.boot(&dom, Role::Guest, (b.start)(1), Platform::Xen, k, b.ready)?;
        Ok(())
    }

    /// Plugs the NIC in and boots `k`, the kernel of the driver domain that owns it and
    /// runs its application itself, on core 0.
    fn boot_nic_owner<K: Kernel>(
        &mut self,
        dom: &Arc<Domain>,
        nic: Nic,
        k: K,
        b: &Build<'_>,
    ) -> Result<(), BuildError> {
        self.nic = Some(nic);
        let at = (b.start)(0);
        self.boot(dom, Role::DriverDomain, at, Platform::Xen, k, b.ready)
    }

    /// Builds the layout where the domain with the NIC runs a raw application on it,
    /// through its bridge or not (paper 002's dotted lines).
    fn start_direct_raw(
        &mut self,
        n: NicSpec,
        app: crate::svnic_guest::RawApp,
        mac: [u8; 6],
        bridge: bool,
        b: &Build<'_>,
    ) -> Result<(), BuildError> {
        let hv = Arc::clone(&self.hv);
        let dom = (b.mk)(&hv, "driver", true, 4)?;
        let (nic, pirq) = assign_nic(&hv, self.device(), &dom, n)?;
        let k = crate::native::RawNicKernel::new(
            &hv,
            &dom,
            nic.regs(),
            DmaApi::Swiotlb,
            Some(pirq),
            &app,
            mac,
            bridge,
        )?;
        self.boot_nic_owner(&dom, nic, k, b)
    }

    /// Builds the layout where the domain with the NIC runs the stack and an
    /// application on it, through its bridge or not (paper 002's dotted lines for TCP).
    fn start_direct_stack(
        &mut self,
        n: NicSpec,
        app: AppSpec,
        mac: [u8; 6],
        bridge: bool,
        b: &Build<'_>,
    ) -> Result<(), BuildError> {
        let hv = Arc::clone(&self.hv);
        let dom = (b.mk)(&hv, "driver", true, 4)?;
        let (nic, pirq) = assign_nic(&hv, self.device(), &dom, n)?;
        let mut k = NicKernel::new(&hv, &dom, nic.regs(), DmaApi::Swiotlb, Some(pirq), &app)?;
        if bridge {
            k = k.bridged(mac);
        }
        self.boot_nic_owner(&dom, nic, k, b)
    }

    /// Builds the driver-domain layout: the driver domain with the NIC, the bridge
    /// and a back end per guest, and each guest with its front end and what runs above
    /// it.
    fn start_driver_domain(
        &mut self,
        n: NicSpec,
        driver: DriverConfig,
        guests: Vec<GuestSpec>,
        b: &Build<'_>,
    ) -> Result<(), BuildError> {
        let hv = Arc::clone(&self.hv);
        // Vifs' window slots first, then each disk's.
        let is_block = |g: &GuestSpec| matches!(g.above, Above::Block(_));
        let n_disks = guests.iter().filter(|g| is_block(g)).count() as u32;
        let vbd_base = toolstack::window_slots(guests.len() - n_disks as usize) + 4;
        let slots = vbd_base + n_disks * VBD_WINDOW_SLOTS;
        let drv = (b.mk)(&hv, "driver", true, slots)?;
        let doms = guests
            .iter()
            .map(|g| (b.mk)(&hv, &g.name, false, 4))
            .collect::<Result<Vec<_>, _>>()?;
        let (nic, pirqs) = assign_nic_queues(&hv, self.device(), &drv, n)?;
        if driver.unsafe_machine_frames {
            hv.iommu_map_machine_unchecked(&drv).map_err(other)?;
        }
        let Connected {
            vifs,
            fronts,
            plan,
            vbds,
            remote,
            disks,
        } = connect_guests(
            &hv,
            &drv,
            &guests,
            &doms,
            vbd_base,
            driver.unsafe_machine_frames,
        )?;
        let fault = FaultSwitch::default();
        let mut k = DriverDomain::new(&hv, &drv, nic.regs(), pirqs, driver, vifs, fault.clone())?;
        k.set_adaptive_coalescing(self.adaptive_coalescing);
        k.attach_vbds(vbds);
        k.attach_remote(remote, DRIVER_AOE_MAC);
        self.driver = Some(DriverPlan {
            dom: Arc::clone(&drv),
            config: driver,
            slots,
            guests: plan,
            disks,
            fault,
            regs: Arc::clone(nic.regs()),
            seen: (0, 0, Instant::now()),
        });
        self.nic = Some(nic);
        self.boot(
            &drv,
            Role::DriverDomain,
            (b.start)(0),
            Platform::Xen,
            k,
            b.ready,
        )?;
        self.boot_guests(guests, doms, fronts, b.ready, b.start)
    }

    /// Boots each guest of the driver-domain layout on its core, at its weight, with
    /// the kernel that fits what runs above its front end.
    fn boot_guests(
        &mut self,
        guests: Vec<GuestSpec>,
        doms: Vec<Arc<Domain>>,
        fronts: Vec<Front>,
        ready: &Arc<AtomicUsize>,
        start: &dyn Fn(usize) -> usize,
    ) -> Result<(), BuildError> {
        let hv = Arc::clone(&self.hv);
        let each = guests.into_iter().zip(doms).zip(fronts);
        for (i, ((g, dom), front)) in each.enumerate() {
            let (at, weight) = (start(g.core.unwrap_or(1 + i)), g.weight);
            match (g.above, front) {
                (Above::App(app), Front::Net(b)) => {
                    let (front, pool) = *b;
                    let k = PvGuest::new(&dom, front, pool, &app)?;
                    self.boot_guest(&dom, at, k, ready, weight)?;
                }
                (Above::Raw(raw), Front::Net(b)) => {
                    let (front, pool) = *b;
                    let k = crate::pv_guest::RawGuest::new(front, pool, raw.start());
                    self.boot_guest(&dom, at, k, ready, weight)?;
                }
                (Above::Tap(tap), Front::Net(b)) => {
                    let (front, pool) = *b;
                    let k = TapGuest::new(&dom, front, pool, *tap);
                    self.boot_guest(&dom, at, k, ready, weight)?;
                }
                (Above::Block(b), Front::Block(front)) => {
                    let k = crate::block::BlockGuest::new(&hv, &dom, *front, b.job)?;
                    self.boot_guest(&dom, at, k, ready, weight)?;
                }
                (Above::Block(b), Front::BlockLater) => {
                    let k =
                        crate::block::BlockGuest::waiting(&hv, &dom, XVDA, b.persistent, b.job)?;
                    self.boot_guest(&dom, at, k, ready, weight)?;
                }
                (_, Front::Hostile(k)) => {
                    self.boot_guest(&dom, at, k, ready, weight)?;
                }
                (Above::Compute(c), Front::None) => {
                    let k = crate::compute::ComputeGuest::new(&hv, &dom, &c)?;
                    self.boot_guest(&dom, at, k, ready, weight)?;
                }
                _ => unreachable!("a guest's front end follows what runs above it"),
            }
        }
        Ok(())
    }

    /// Builds the SV-NIC layout: the device's memory, the controller domain (whose
    /// vCPU takes the master interrupt), the device with its management driver, and
    /// each guest with its VIF: asked for through the store (the toolstack's side of
    /// [`dev::svnic::mgmt`]), its region mapped once by the guest from the grant
    /// references the device answered with, its signal a vector bound to a port of
    /// the guest's.
    fn start_svnic(
        &mut self,
        nic: NicSpec,
        config: dev::svnic::device::SvnicConfig,
        guests: Vec<SvnicGuestSpec>,
        ready: &Arc<AtomicUsize>,
        start: &dyn Fn(usize) -> usize,
        mk: &MakeDomain<'_>,
    ) -> Result<(), BuildError> {
        use dev::svnic::device::Svnic;
        use dev::svnic::mgmt::{self, VifRequest};
        use dev::svnic::vif::{VifFront, VifRegion, VIF_PAGES};
        let hv = Arc::clone(&self.hv);
        if guests.len() > SVNIC_MAX_VIFS {
            return Err(other(format!(
                "{} guests: an SV-NIC here has at most {SVNIC_MAX_VIFS} VIFs",
                guests.len()
            )));
        }
        // A grant for each page of each region (512 entries a frame, v1 or v2), the
        // table's frames out of the device's own memory.
        // Block guests have no VIF of their own; the block service has one queue pair.
        let is_block = |g: &SvnicGuestSpec| matches!(g.app, crate::svnic_guest::SvnicApp::Block(_));
        let n_disks = guests.iter().filter(|g| is_block(g)).count();
        let n_vifs = guests.len() - n_disks + usize::from(n_disks > 0);
        let region_pages = VIF_PAGES * n_vifs.max(1);
        let grant_frames = region_pages.div_ceil(512) as u32 + 1;
        let device = hv.create_domain(&DomainConfig {
            name: "svnic".into(),
            pages: region_pages as u32 + 2 * grant_frames + 64,
            grant_frames,
            grant_version: self.grant_version,
            vcpus: 1,
            // The block service maps its guests' rings and pages.
            map_slots: 4 + n_disks as u32 * VBD_WINDOW_SLOTS,
            driver_domain: false,
        })?;
        let ctl = mk(&hv, "controller", false, 4)?;
        // The engines and the sidecore are units on the pCPUs of their cores (those it
        // leaves unnamed on the device pCPU).
        let pcpu_of = |c: Option<usize>| self.pcpu_of_core(c);
        let mut svnic = Svnic::start_on(
            &hv,
            Some(&ctl),
            config,
            nic.source,
            nic.sink,
            &self.sched,
            &pcpu_of,
        )
        .map_err(other)?;
        mgmt::prepare(&hv, device.id()).map_err(other)?;
        svnic.manage(&hv, Arc::clone(&device)).map_err(other)?;
        mgmt::set_schedule(&hv, device.id(), config.schedule).map_err(other)?;
        self.boot(
            &ctl,
            Role::DriverDomain,
            start(0),
            Platform::Xen,
            Controller,
            ready,
        )?;
        let mut vbds = Vec::new();
        let mut vif_ids = 0u16;
        for (i, g) in guests.into_iter().enumerate() {
            if let crate::svnic_guest::SvnicApp::Block(b) = g.app {
                let Disk::Aoe { major, minor } = b.disk else {
                    return Err(other(
                        "an SV-NIC serves remote disks only (ATA over Ethernet)",
                    ));
                };
                let dom = mk(&hv, &g.name, false, 4)?;
                blk::xenbus::create_vbd(hv.store(), device.id(), dom.id(), XVDA, false)
                    .map_err(other)?;
                let mut cfg = InitiatorConfig::new(SVNIC_AOE_MAC, major, minor);
                cfg.tag_prefix = vbds.len() as u8;
                let slot = 4 + vbds.len() as u32 * VBD_WINDOW_SLOTS;
                vbds.push(RemoteVbd::new(
                    &hv,
                    &device,
                    dom.id(),
                    XVDA,
                    slot,
                    cfg,
                    b.persistent,
                ));
                let k = crate::block::BlockGuest::waiting(&hv, &dom, XVDA, b.persistent, b.job)?;
                let at = start(g.core.unwrap_or(1 + i));
                self.boot(&dom, Role::Guest, at, Platform::Xen, k, ready)?;
                continue;
            }
            let i = usize::from(vif_ids);
            vif_ids += 1;
            let dom = mk(&hv, &g.name, false, VIF_PAGES as u32 + 4)?;
            let vector = Vector(SVNIC_VECTOR_BASE + i as u8);
            let port = hv.bind_irq(&dom, vector).map_err(other)?;
            let req = VifRequest {
                guest: dom.id(),
                mac: g.mac,
                priority: g.priority.unwrap_or(dev::svnic::engine::DEFAULT_PRIORITY),
                vector,
            };
            let v = mgmt::create_vif(&hv, device.id(), i as u16, &req, MGMT_WAIT)
                .map_err(|e| other(format!("VIF {i}: {e}")))?;
            let (pages, _handles) =
                VifRegion::map_grefs(&hv, &dom, v.backend, &v.grefs, 0).map_err(other)?;
            let front = VifFront::new(pages).with_doorbell(svnic.doorbell());
            let k = crate::svnic_guest::SvnicGuest::new(&hv, &dom, front, port, g.app)?;
            let at = start(g.core.unwrap_or(1 + i));
            self.boot(&dom, Role::Guest, at, Platform::Xen, k, ready)?;
        }
        if !vbds.is_empty() {
            // The block service's queue pair: a VIF of the device's own, after the
            // guests', whose MAC the ingress contexts demultiplex to it.
            use dev::svnic::vif::{VifDevice, VifRegion, BUF_PAGES};
            let id = vif_ids;
            let region = VifRegion::create(&device, device.id()).map_err(other)?;
            let d = VifDevice::new(region.device_pages(&device).map_err(other)?).map_err(other)?;
            let signal = dev::svnic::device::VifSignal {
                vector: Vector(SVNIC_VECTOR_BASE + id as u8),
                bit: svnic.assign_bit(),
            };
            if !svnic.add_vif(id, SVNIC_AOE_MAC, d.tx, d.rx, signal) {
                return Err(other("no VIF id left for the block service"));
            }
            let front = VifFront::new(region.device_pages(&device).map_err(other)?)
                .with_doorbell(svnic.doorbell());
            let svc = dev::svnic::block::BlockService {
                vbds,
                front,
                rx_gfns: region.gfns[2 + BUF_PAGES..].to_vec(),
                device: Arc::clone(&device),
                idle: config.idle,
            };
            let pcpu = self.pcpu_of_core(config.cores.block);
            let engine =
                dev::svnic::block::BlockEngine::start_on(svc, &self.sched, pcpu).map_err(other)?;
            self.block_engine = Some(engine);
        }
        self.svnic = Some((svnic, device.id()));
        Ok(())
    }

    /// The toolstack changes guest `i`'s VIF priority (1 to 100) through the store.
    pub fn set_vif_priority(&self, i: usize, priority: u8) -> Result<(), BuildError> {
        let Some((_, device)) = &self.svnic else {
            return Err(other("no SV-NIC in this layout"));
        };
        dev::svnic::mgmt::set_priority(&self.hv, *device, i as u16, priority).map_err(other)
    }

    /// The toolstack chooses the SV-NIC's egress scheduler through the store.
    pub fn set_vif_schedule(&self, s: dev::svnic::engine::Schedule) -> Result<(), BuildError> {
        let Some((_, device)) = &self.svnic else {
            return Err(other("no SV-NIC in this layout"));
        };
        dev::svnic::mgmt::set_schedule(&self.hv, *device, s).map_err(other)
    }

    /// The SV-NIC's block service's counters, if it runs one.
    pub fn block_engine_stats(&self) -> Option<Arc<dev::svnic::block::BlockEngineStats>> {
        self.block_engine.as_ref().map(|b| Arc::clone(b.stats()))
    }

    /// The SV-NIC, in its layout.
    pub fn svnic(&self) -> Option<&dev::svnic::device::Svnic<hv::OwnPage>> {
        self.svnic.as_ref().map(|(s, _)| s)
    }

    /// Injects a fault into the driver domain's kernel (none without one).
    pub fn inject_fault(&self, f: Fault) {
        if let Some(d) = &self.driver {
            d.fault.inject(f);
        }
    }

    /// The toolstack's watchdog over the driver domain, run periodically: a kernel
    /// that ended, or one that left an event pending for `stall` without looking, is
    /// destroyed and a fresh driver domain started in its place
    /// ([`Machine::restart_driver_domain`]). Returns what it did.
    pub fn watchdog(&mut self, stall: Duration) -> Result<Option<Restarted>, BuildError> {
        // The toolstack's periodic work includes finishing off destroyed domains.
        self.hv.reap();
        // A step that holds its pCPU past the limit (a hung kernel) keeps only itself:
        // the pCPU's other units move to a fresh thread on the same core.
        self.sched.rescue(stall);
        let Some(d) = &mut self.driver else {
            return Ok(None);
        };
        let crashed = self
            .kernels
            .iter()
            .any(|(k, h)| Arc::ptr_eq(k, &d.dom) && h.is_finished());
        let cause = if crashed {
            Some(DriverFault::Crashed)
        } else {
            // Work waits for the kernel: an event, or frames the NIC took (or had to
            // drop) since the kernel last looked — a driver that hangs with its
            // interrupts off leaves no event, only frames.
            let looks = d.dom.vcpus()[0].event_looks();
            let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            let frames = l(&d.regs.rx_frames) + l(&d.regs.rx_missed);
            let now = Instant::now();
            // A kernel whose vCPU stays running without looking at its events is stuck
            // in one pass (a soft lockup): work may wait for it that no new event
            // announces (a guest's block requests, taken from their event before the
            // hang, whose front end kicks no more).
            let stuck = d.dom.vcpus()[0].runstate().state == hv::time::RunstateKind::Running;
            let waiting = d.dom.upcall_pending(0)
                || d.dom.vcpus()[0].irq_pending()
                || frames != d.seen.1
                || stuck;
            if looks != d.seen.0 {
                d.seen = (looks, frames, now);
                None
            } else if !waiting {
                d.seen.2 = now;
                None
            } else {
                (now - d.seen.2 >= stall).then_some(DriverFault::Stalled)
            }
        };
        let Some(cause) = cause else {
            return Ok(None);
        };
        let (took, disks_unserved, vifs_unserved) = self.restart()?;
        Ok(Some(Restarted {
            cause,
            took,
            disks_unserved,
            vifs_unserved,
        }))
    }

    /// Destroys the driver domain and starts a fresh one (paper 000 §5.1): the NIC is
    /// reset, the old domain destroyed (the hypervisor takes back every mapping of guest
    /// pages and closes its channels), its back ends are closed in the store — the
    /// guests' netfronts see it and take back their grants, keeping unanswered packets —
    /// a new domain gets the NIC and offers each vif again, the guests reconnect, and
    /// the new kernel starts once every vif is connected. Returns the time it took.
    pub fn restart_driver_domain(&mut self) -> Result<Duration, BuildError> {
        self.restart().map(|(took, ..)| took)
    }

    /// [`Machine::restart_driver_domain`], and how many disks and vifs the new driver
    /// domain could not serve.
    fn restart(&mut self) -> Result<(Duration, u32, u32), BuildError> {
        let t0 = Instant::now();
        let Some(mut d) = self.driver.take() else {
            return Err(other("no driver domain"));
        };
        let hv = Arc::clone(&self.hv);
        d.regs.function_reset();
        let old = d.dom.id();
        hv.destroy_domain(old)?;
        for (g, vs) in &d.guests {
            toolstack::close_backend(&hv, old, g.id(), vs.handle);
        }
        for disk in &d.disks {
            blk::xenbus::close_backend(hv.store(), old, disk.dom.id(), XVDA);
        }
        // The old kernel's thread ends once it sees its domain dying; a hung one may
        // take a moment, and is not waited for beyond that.
        if let Some(i) = self
            .kernels
            .iter()
            .position(|(k, _)| Arc::ptr_eq(k, &d.dom))
        {
            let (_, h) = self.kernels.remove(i);
            let until = Instant::now() + Duration::from_millis(200);
            while !h.is_finished() && Instant::now() < until {
                std::thread::yield_now();
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
        self.domains.retain(|(k, _)| !Arc::ptr_eq(k, &d.dom));
        self.doors.retain(|(k, _)| !Arc::ptr_eq(k, &d.dom));
        let drv = hv.create_domain(&DomainConfig {
            name: "driver".into(),
            pages: DOMAIN_PAGES,
            grant_frames: 4,
            grant_version: self.grant_version,
            vcpus: 1,
            map_slots: d.slots,
            driver_domain: true,
        })?;
        hv.iommu_attach(NIC, &drv).map_err(other)?;
        let pirqs = bind_queue_irqs(&hv, &drv)?;
        for (g, vs) in &d.guests {
            toolstack::offer_vif(&hv, &drv, g, *vs).map_err(other)?;
        }
        // A disk that cannot be served again is left out, not the machine: its guest
        // fails what it had in flight after its bound.
        let served: Vec<Option<Served>> = d
            .disks
            .iter()
            .map(|disk| disk.serve(&hv, &drv).ok())
            .collect();
        let mut disks_unserved = served.iter().filter(|s| s.is_none()).count() as u32;
        // The guests reconnect on their own vCPUs; the back ends follow once each front
        // end is Connected (the back end's watch on it).
        let until = Instant::now() + Duration::from_secs(5);
        let mut vifs = Vec::with_capacity(d.guests.len());
        // A guest that does not reconnect within the bound (or answers the handshake
        // wrongly) loses its vif, not the restart: every other guest is served, and the
        // plan keeps its vif for the next restart.
        let mut vifs_unserved = 0;
        for (g, vs) in &d.guests {
            while !toolstack::frontend_connected(&hv, g.id(), vs.handle) && Instant::now() <= until
            {
                std::thread::yield_now();
            }
            match toolstack::frontend_connected(&hv, g.id(), vs.handle)
                .then(|| toolstack::connect_backend(&hv, &drv, g, *vs).ok())
                .flatten()
            {
                Some(vif) => vifs.push((vif, vs.mac)),
                None => vifs_unserved += 1,
            }
        }
        let (mut vbds, mut remote) = (Vec::new(), Vec::new());
        for (disk, s) in d.disks.iter().zip(served) {
            match s {
                None => {}
                Some(Served::File(file)) => {
                    // A guest that does not reconnect its disk (or answers the handshake
                    // wrongly) loses that disk, not the restart: its requests fail after
                    // their bound, and every other device is served.
                    let fe = disk.dom.id();
                    let fdir = blk::xenbus::frontend_dir(fe, XVDA);
                    let mut connected = true;
                    while hv.store().xenbus_state(DomId::DOM0, &fdir)
                        != hv::store::XenbusState::Connected
                    {
                        if Instant::now() > until {
                            connected = false;
                            break;
                        }
                        std::thread::yield_now();
                    }
                    match connected
                        .then(|| {
                            Blkback::connect(hv::Pvio::new(&hv, &drv), fe, XVDA, disk.slot, file)
                                .ok()
                        })
                        .flatten()
                    {
                        Some(b) => vbds.push(b),
                        None => disks_unserved += 1,
                    }
                }
                Some(Served::Remote(r)) => remote.push(r),
            }
        }
        d.fault.inject(Fault::None);
        let mut k = DriverDomain::new(&hv, &drv, &d.regs, pirqs, d.config, vifs, d.fault.clone())?;
        k.set_adaptive_coalescing(self.adaptive_coalescing);
        k.attach_vbds(vbds);
        k.attach_remote(remote, DRIVER_AOE_MAC);
        let at = self.pool.core(0);
        let ready = Arc::new(AtomicUsize::new(0));
        self.boot(&drv, Role::DriverDomain, at, Platform::Xen, k, &ready)?;
        d.dom = drv;
        d.seen = (0, 0, Instant::now());
        self.driver = Some(d);
        Ok((t0.elapsed(), disks_unserved, vifs_unserved))
    }

    /// The pCPU its device engines run on (the NIC's, and whatever is at the far end of
    /// its cable).
    pub fn device_pcpu(&self) -> usize {
        self.device_pcpu
    }

    /// The pCPU on core `c` (as the layout names it), or the device pCPU when it names
    /// none.
    fn pcpu_of_core(&self, c: Option<usize>) -> usize {
        c.and_then(|c| self.pcpu_cores.iter().position(|&x| x == self.pool.core(c)))
            .unwrap_or(self.device_pcpu)
    }

    /// The host core of each of the machine's pCPUs, by pCPU index.
    pub fn pcpu_cores(&self) -> &[usize] {
        &self.pcpu_cores
    }

    /// The pCPUs the machine's vCPUs run on.
    pub fn scheduler(&self) -> &Arc<Scheduler> {
        &self.sched
    }

    /// The hypervisor.
    pub fn hv(&self) -> &Arc<Hypervisor> {
        &self.hv
    }

    /// The domains, in the order they were started.
    pub fn domains(&self) -> &[(Arc<Domain>, Role)] {
        &self.domains
    }

    /// The NIC's registers and counters (none once stopped).
    pub fn nic_regs(&self) -> Option<&Arc<NicRegs>> {
        self.nic.as_ref().map(|n| n.regs())
    }

    /// Every running kernel's counters and the NIC's, as they stand: each kernel is
    /// asked and kicked, and answers between two polls; one that has not answered
    /// within `wait` (a hung driver domain) is left out.
    pub fn live_counters(&self, wait: Duration) -> Counters {
        for (d, door) in &self.doors {
            door.ask();
            self.hv.kick_vcpu(d, 0);
        }
        let mut c = Counters::default();
        if let Some(n) = &self.nic {
            c.add_port("nic", PortKind::Nic, &**n.regs());
        }
        let t = Instant::now();
        let mut waiting: Vec<&vcpu::CounterDoor> = self.doors.iter().map(|(_, d)| &**d).collect();
        while !waiting.is_empty() {
            waiting.retain(|door| match door.take() {
                Some(k) => {
                    c.extend(k);
                    false
                }
                None => true,
            });
            if waiting.is_empty() || t.elapsed() >= wait {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        c
    }

    /// Pulls the cable: the NIC takes nothing more from its source.
    pub fn unplug(&self) {
        if let Some(n) = &self.nic {
            n.regs().unplug();
        }
    }

    /// Stops the NIC and every kernel, and returns every component's counters, the
    /// NIC's last, and the scheduler's account of each unit and pCPU (as it stood just
    /// before the stop).
    pub fn stop(mut self) -> Result<Counters, BuildError> {
        let sched = self.sched_counters();
        let regs = self.nic.take().map(|n| {
            let r = Arc::clone(n.regs());
            drop(n);
            r
        });
        let mut c = self.halt()?;
        if let Some(r) = regs {
            c.add_port("nic", PortKind::Nic, &*r);
        }
        if let Some(b) = self.block_engine.take() {
            c.add_set("svnic block engine", &**b.stats());
            for v in b.stop() {
                let name = format!("rvbd{}", v.frontend().0);
                if let Some(bk) = v.backend() {
                    c.add_port(&name, PortKind::Vbd, bk.stats());
                }
                if let Some(a) = v.aoe_stats() {
                    c.add_set(&format!("{name} aoe"), a);
                }
                c.add(&name, "connect_failed", u64::from(v.failed().is_some()));
                v.disconnect();
            }
        }
        if let Some((dev, _)) = self.svnic.take() {
            // Stopped first: what its threads did last is in the counters.
            let s = (*dev).clone();
            dev.stop();
            let (e, i) = s.engine_stats();
            if let Some(e) = e {
                c.add_set("svnic egress", &*e);
            }
            if let Some(i) = i {
                c.add_set("svnic ingress", &*i);
            }
            c.add_set("svnic signals", s.signal_stats());
            c.add_set("svnic management", &**s.mgmt_stats());
            c.add_set("svnic", &s.drops());
        }
        c.extend(sched);
        Ok(c)
    }

    /// The scheduler's account of each unit (its running time, steps, longest step,
    /// wake-ups, time waiting for its pCPU) and each pCPU (idle, slept, host wakes, time
    /// the host took).
    pub fn sched_counters(&self) -> Counters {
        let mut c = Counters::default();
        let us = |d: Duration| d.as_micros() as u64;
        for (p, u) in self.sched.unit_reports() {
            let k = format!("pcpu{p} {}", u.name);
            c.add(&k, "running_us", us(u.running));
            c.add(&k, "runnable_us", us(u.runnable));
            c.add(&k, "steps", u.steps);
            c.add(&k, "wakeups", u.wakeups);
            c.add(&k, "longest_step_us", us(u.longest_step));
        }
        for r in self.sched.reports() {
            let k = format!("pcpu{}", r.index);
            c.add(&k, "idle_us", us(r.idle));
            c.add(&k, "slept_us", us(r.slept));
            c.add(&k, "host_wakes", r.host_wakes);
            c.add(&k, "stolen_us", us(r.stolen));
            c.add(&k, "longest_step_us", us(r.longest_step));
            c.add(&k, "longest_away_us", us(r.longest_away));
            c.add(&k, "host_queued_us", us(r.host_queued));
            c.add(&k, "line_fires", r.line_fires);
        }
        c
    }

    /// Stops every kernel and collects their counters.
    fn halt(&mut self) -> Result<Counters, BuildError> {
        self.stop.store(true, Ordering::Release);
        // A hung driver domain's kernel is let go, so that it can stop.
        self.inject_fault(Fault::None);
        if let Some(n) = &self.native_irq {
            n.raise();
        }
        let mut c = Counters::default();
        let mut panicked = false;
        for (d, _) in &self.kernels {
            self.hv.kick_vcpu(d, 0);
        }
        for (_, h) in self.kernels.drain(..) {
            match h.join() {
                Ok(k) => c.extend(k),
                Err(_) => panicked = true,
            }
        }
        if panicked {
            return Err(other("a vCPU panicked"));
        }
        Ok(c)
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        drop(self.nic.take());
        drop(self.block_engine.take());
        drop(self.svnic.take());
        let _ = self.halt();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dev::svnic::device::{DeviceCores, Idle, SvnicConfig};

    fn svnic(idle: Idle, guest_core: Option<usize>) -> Layout {
        Layout::Svnic {
            config: SvnicConfig {
                idle,
                cores: DeviceCores {
                    egress: Some(2),
                    ingress: Some(3),
                    sidecore: Some(3),
                    block: None,
                },
                ..SvnicConfig::default()
            },
            guests: vec![SvnicGuestSpec {
                name: "g".into(),
                mac: [2, 0, 0, 0, 0, 1],
                app: crate::svnic_guest::SvnicApp::Raw(crate::svnic_guest::RawApp::Echo([
                    2, 0, 0, 0, 0, 1,
                ])),
                priority: None,
                core: guest_core,
            }],
        }
    }

    #[test]
    fn a_sleeping_devices_own_cores_idle_its_way_and_a_core_a_domain_shares_the_machines() {
        // A pool of five host cores: layout core i is host core 10 + i.
        let pool = CpuPool((10..15).collect());
        let spin = Duration::from_micros(50);
        let own = |layout: &Layout| {
            let cores = layout_cores(layout, &pool);
            device_policies(layout, &pool, &cores)
                .into_iter()
                .map(|(p, policy)| (cores[p], policy))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            own(&svnic(Idle::Block { spin }, None)),
            vec![
                (12, IdlePolicy::HaltPoll(spin)),
                (13, IdlePolicy::HaltPoll(spin))
            ]
        );
        assert_eq!(
            own(&svnic(
                Idle::Block {
                    spin: Duration::ZERO
                },
                None
            )),
            vec![(12, IdlePolicy::Block), (13, IdlePolicy::Block)]
        );
        // The guest on the egress engine's core: that pCPU idles as the machine says.
        assert_eq!(
            own(&svnic(Idle::Block { spin }, Some(2))),
            vec![(13, IdlePolicy::HaltPoll(spin))]
        );
        // A device that polls on never idles: nothing of its own.
        assert!(own(&svnic(Idle::Poll, None)).is_empty());
    }
}
