//! The driver-domain layout's devices: each guest connected to the driver domain (a
//! vif, a disk, or nothing), and the NIC started, owned by a domain or assigned with
//! its queues.

use crate::hostile::HostileGuest;
use crate::pv_guest::guest_pool;
use crate::{other, BuildError};
use blk::blkback::{Blkback, VBD_WINDOW_SLOTS};
use blk::blkfront::Blkfront;
use blk::remote::RemoteVbd;
use dev::irq::IrqLine;
use dev::nic::{Nic, RX_QUEUES};
use hv::sched::Scheduler;
use hv::{Domain, Hypervisor, Port, Vector};
use net::netfront::Netfront;
use net::skb::SkbPool;
use net::toolstack::{self, VifSpec};
use std::sync::Arc;

use super::*;

/// A guest's front end while the machine is built.
pub(super) enum Front {
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
pub(super) struct Connected {
    pub(super) vifs: Vec<(net::netback::Vif, [u8; 6])>,
    pub(super) fronts: Vec<Front>,
    pub(super) plan: Vec<(Arc<Domain>, VifSpec)>,
    pub(super) vbds: Vec<Blkback>,
    pub(super) remote: Vec<RemoteVbd>,
    pub(super) disks: Vec<DiskPlan>,
}

/// The toolstack's part and each device's handshake, guest by guest: a vif (the
/// toolstack offers it, netfront connects, then netback; a hostile guest does its
/// half itself) with the guest's pool and netfront's RX ring filled, or a disk (its
/// back end served from its file now, or from a remote target once found), or nothing
/// for a guest that computes.
pub(super) fn connect_guests(
    hv: &Arc<Hypervisor>,
    drv: &Arc<Domain>,
    guests: &[GuestSpec],
    doms: &[Arc<Domain>],
    vbd_base: u32,
    unsafe_machine_frames: bool,
) -> Result<Connected, BuildError> {
    let mut c = Connected {
        vifs: Vec::with_capacity(guests.len()),
        fronts: Vec::with_capacity(guests.len()),
        plan: Vec::with_capacity(guests.len()),
        vbds: Vec::new(),
        remote: Vec::new(),
        disks: Vec::new(),
    };
    for (g, dom) in guests.iter().zip(doms) {
        match &g.above {
            Above::Compute(_) => c.fronts.push(Front::None),
            Above::Block(b) => c.connect_disk(hv, drv, dom, b, vbd_base)?,
            _ => c.connect_vif(hv, drv, dom, g, unsafe_machine_frames)?,
        }
    }
    Ok(c)
}

impl Connected {
    /// A guest's disk: the toolstack's part, as a restart does it; then, for a file,
    /// both ends connect now (a remote disk's blkfront waits for its back end to find
    /// the target).
    fn connect_disk(
        &mut self,
        hv: &Arc<Hypervisor>,
        drv: &Arc<Domain>,
        dom: &Arc<Domain>,
        b: &BlockSpec,
        vbd_base: u32,
    ) -> Result<(), BuildError> {
        let slot = vbd_base + (self.vbds.len() + self.remote.len()) as u32 * VBD_WINDOW_SLOTS;
        let plan = DiskPlan {
            dom: Arc::clone(dom),
            disk: b.disk.clone(),
            read_only: b.read_only,
            persistent: b.persistent,
            slot,
            tag: self.remote.len() as u8,
        };
        match plan.serve(hv, drv)? {
            Served::File(file) => {
                let name = |e: &dyn std::fmt::Display| other(format!("disk {}: {e}", plan.name()));
                let front = Blkfront::connect(hv, dom, XVDA, b.persistent).map_err(|e| name(&e))?;
                let back = Blkback::connect(hv::Pvio::new(hv, drv), dom.id(), XVDA, slot, file)
                    .map_err(|e| name(&e))?;
                self.vbds.push(back);
                self.fronts.push(Front::Block(Box::new(front)));
            }
            Served::Remote(r) => {
                self.remote.push(r);
                self.fronts.push(Front::BlockLater);
            }
        }
        self.disks.push(plan);
        Ok(())
    }

    /// A guest's vif: the toolstack offers it, the guest's front end connects (a
    /// hostile guest does its half of the handshake itself; a well-behaved one gets its
    /// pool and netfront's RX ring filled), then netback.
    fn connect_vif(
        &mut self,
        hv: &Arc<Hypervisor>,
        drv: &Arc<Domain>,
        dom: &Arc<Domain>,
        g: &GuestSpec,
        unsafe_machine_frames: bool,
    ) -> Result<(), BuildError> {
        let vs = VifSpec {
            handle: 0,
            mac: g.mac,
            index: self.vifs.len() as u16,
            front: g.front,
        };
        toolstack::offer_vif(hv, drv, dom, vs).map_err(other)?;
        let front = match g.above {
            Above::Hostile(seed) => Front::Hostile(HostileGuest::new(hv, dom, vs.handle, seed)),
            Above::Deaf(seed) => Front::Hostile(HostileGuest::deaf(hv, dom, vs.handle, seed)),
            _ => {
                if unsafe_machine_frames {
                    // The paper's unsafe stand-in, offered by the toolstack only when
                    // measuring it.
                    let dir = net::xenbus::backend_dir(drv.id(), dom.id(), vs.handle);
                    let key = format!("{dir}/{}", net::xenbus::FEATURE_MACHINE_FRAMES);
                    hv.store().write(drv.id(), &key, "1").map_err(other)?;
                }
                let mut front =
                    Netfront::connect_config(hv, dom, vs.handle, vs.front).map_err(other)?;
                let pool = guest_pool(dom, &mut front)?;
                Front::Net(Box::new((front, pool)))
            }
        };
        let vif = toolstack::connect_backend(hv, drv, dom, vs).map_err(other)?;
        self.vifs.push((vif, g.mac));
        self.fronts.push(front);
        self.plan.push((Arc::clone(dom), vs));
        Ok(())
    }
}

/// Starts the NIC of `spec` with its interrupt on `irq`.
pub(super) fn start_nic(
    hv: &Arc<Hypervisor>,
    at: Device<'_>,
    irq: IrqLine,
    spec: NicSpec,
) -> Result<Nic, BuildError> {
    start_nic_queues(hv, at, vec![irq], spec)
}

/// Where the machine's device engines run: a pCPU of its scheduler.
#[derive(Clone, Copy)]
pub(super) struct Device<'a> {
    pub(super) sched: &'a Scheduler,
    pub(super) pcpu: usize,
}

/// Starts the NIC with an interrupt line per receive queue, its engine a unit on `at`.
pub(super) fn start_nic_queues(
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
pub(super) fn assign_nic(
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
pub(super) fn queue_vector(q: usize) -> Vector {
    Vector(NIC_VECTOR.0 + q as u8)
}

/// Binds every receive queue's interrupt to one of `dom`'s ports (index: queue).
pub(super) fn bind_queue_irqs(
    hv: &Arc<Hypervisor>,
    dom: &Arc<Domain>,
) -> Result<Vec<Port>, BuildError> {
    (0..RX_QUEUES)
        .map(|q| hv.bind_irq(dom, queue_vector(q)).map_err(other))
        .collect()
}

/// As [`assign_nic`] for a driver domain: every receive queue's interrupt a physical
/// IRQ bound to one of `dom`'s ports (returned, by queue).
pub(super) fn assign_nic_queues(
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
