//! What a machine is made of, as code or a machine file states it: the NIC and its
//! cable, the domains' layout, the grant implementation, the idle policy, the cores.
//! `MachineSpec::new` takes what has no default (the NIC and the layout) and the
//! builder methods what differs from the defaults.

use crate::app::AppSpec;
use crate::driver_domain::DriverConfig;
use dev::nic::Coalesce;
use dev::tap::TapPort;
use dev::wire::{WireSink, WireSource};
use hv::sched::IdlePolicy;
use hv::{GrantPath, GrantVersion};
use net::netfront::FrontConfig;
use std::time::Duration;

use super::*;

/// The NIC and what is at the far end of its cable.
#[allow(missing_debug_implementations)]
pub struct NicSpec {
    /// Its interrupt coalescing.
    pub coalesce: Coalesce,
    /// What it receives.
    pub source: Box<dyn WireSource>,
    /// Where what it sends goes.
    pub sink: Box<dyn WireSink>,
    /// The layout core its engine runs on (an index into the machine's pool); `None`:
    /// a core of its own if the pool has one free, else the core of the domain that
    /// does not drive it ([`crate::machine`]'s rule for the papers' measurements).
    pub core: Option<usize>,
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

impl NicSpec {
    /// A NIC with the default interrupt coalescing, receiving what `source` sends and
    /// sending into `sink`.
    pub fn new(source: Box<dyn WireSource>, sink: Box<dyn WireSink>) -> Self {
        Self {
            coalesce: Coalesce::default(),
            source,
            sink,
            core: None,
        }
    }
}

impl MachineSpec {
    /// A machine of `layout` behind `nic`, with the settings every experiment starts
    /// from: v1 grant tables and the original grant path (paper 000's unoptimised Xen),
    /// no profiler, idle pCPUs halt-polling (the machine may share its cores), every
    /// online core, DMA into memory (the papers' platforms). A caller states only what
    /// differs: `MachineSpec { idle: IdlePolicy::Poll, ..MachineSpec::new(nic, layout) }`.
    pub fn new(nic: NicSpec, layout: Layout) -> Self {
        Self {
            grant_version: GrantVersion::V1,
            grant_path: GrantPath::Original,
            sample: None,
            idle: IdlePolicy::HALT_POLL,
            nic,
            layout,
            cpus: None,
            dma_landing: hv::iommu::DmaLanding::Memory,
        }
    }
}
