//! The SV-NIC layout's assembly (paper 002): the device's memory domain, the controller
//! domain that takes the master interrupt, each guest's VIF made through the store, and
//! the device's engines placed on their cores.

use crate::vcpu::{self, Kernel, Platform};
use crate::{other, BuildError, Counters};
use blk::blkback::VBD_WINDOW_SLOTS;
use blk::initiator::InitiatorConfig;
use blk::remote::RemoteVbd;
use hv::{Domain, DomainConfig, GrantVersion, Hypervisor, Port, Vector};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use super::*;

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
pub(super) struct Controller;

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

/// The SV-NIC's own memory domain (no vCPU): the VIF regions, a grant for each page of
/// each region (512 entries a frame, v1 or v2) with the table's frames out of the
/// device's own memory, and map slots for the block service. Block guests have no VIF
/// of their own; the block service has one queue pair.
fn device_domain(
    hv: &Arc<Hypervisor>,
    guests: &[SvnicGuestSpec],
    grant_version: GrantVersion,
) -> Result<Arc<Domain>, BuildError> {
    use dev::svnic::vif::VIF_PAGES;
    let is_block = |g: &SvnicGuestSpec| matches!(g.app, crate::svnic_guest::SvnicApp::Block(_));
    let n_disks = guests.iter().filter(|g| is_block(g)).count();
    let n_vifs = guests.len() - n_disks + usize::from(n_disks > 0);
    let region_pages = VIF_PAGES * n_vifs.max(1);
    let grant_frames = region_pages.div_ceil(512) as u32 + 1;
    Ok(hv.create_domain(&DomainConfig {
        name: "svnic".into(),
        pages: region_pages as u32 + 2 * grant_frames + 64,
        grant_frames,
        grant_version,
        vcpus: 1,
        // The block service maps its guests' rings and pages.
        map_slots: 4 + n_disks as u32 * VBD_WINDOW_SLOTS,
        driver_domain: false,
    })?)
}

/// A guest with a remote disk and no VIF: its domain, the remote disk's back end the
/// device's block service runs (the `nth` such disk, its window slots and its tags
/// after the others'), and its kernel, waiting for the disk.
fn disk_guest(
    hv: &Arc<Hypervisor>,
    device: &Arc<Domain>,
    name: &str,
    b: BlockSpec,
    nth: usize,
    mk: &MakeDomain<'_>,
) -> Result<(Arc<Domain>, RemoteVbd, crate::block::BlockGuest), BuildError> {
    let Disk::Aoe { major, minor } = b.disk else {
        return Err(other(
            "an SV-NIC serves remote disks only (ATA over Ethernet)",
        ));
    };
    let dom = mk(hv, name, false, 4)?;
    blk::xenbus::create_vbd(hv.store(), device.id(), dom.id(), XVDA, false).map_err(other)?;
    let mut cfg = InitiatorConfig::new(SVNIC_AOE_MAC, major, minor);
    cfg.tag_prefix = nth as u8;
    let slot = 4 + nth as u32 * VBD_WINDOW_SLOTS;
    let vbd = RemoteVbd::new(hv, device, dom.id(), XVDA, slot, cfg, b.persistent);
    let k = crate::block::BlockGuest::waiting(hv, &dom, XVDA, b.persistent, b.job)?;
    Ok((dom, vbd, k))
}

/// A guest's VIF `id`, made through the store (its vector bound to a port of the
/// guest's, the region mapped into its window), and the guest's kernel above it.
fn vif_guest(
    hv: &Arc<Hypervisor>,
    svnic: &dev::svnic::device::Svnic<hv::OwnPage>,
    device: &Arc<Domain>,
    dom: &Arc<Domain>,
    id: u16,
    g: SvnicGuestSpec,
) -> Result<crate::svnic_guest::SvnicGuest, BuildError> {
    use dev::svnic::mgmt::{self, VifRequest};
    use dev::svnic::vif::{VifFront, VifRegion};
    let vector = Vector(SVNIC_VECTOR_BASE + id as u8);
    let port = hv.bind_irq(dom, vector).map_err(other)?;
    let req = VifRequest {
        guest: dom.id(),
        mac: g.mac,
        priority: g.priority.unwrap_or(dev::svnic::engine::DEFAULT_PRIORITY),
        vector,
    };
    let v = mgmt::create_vif(hv, device.id(), id, &req, MGMT_WAIT)
        .map_err(|e| other(format!("VIF {id}: {e}")))?;
    let (pages, _handles) = VifRegion::map_grefs(hv, dom, v.backend, &v.grefs, 0).map_err(other)?;
    let front = VifFront::new(pages).with_doorbell(svnic.doorbell());
    crate::svnic_guest::SvnicGuest::new(hv, dom, front, port, g.app)
}

impl Machine {
    /// Builds the SV-NIC layout: the device's memory, the controller domain (whose
    /// vCPU takes the master interrupt), the device with its management driver, and
    /// each guest with its VIF: asked for through the store (the toolstack's side of
    /// [`dev::svnic::mgmt`]), its region mapped once by the guest from the grant
    /// references the device answered with, its signal a vector bound to a port of
    /// the guest's.
    pub(super) fn start_svnic(
        &mut self,
        nic: NicSpec,
        config: dev::svnic::device::SvnicConfig,
        guests: Vec<SvnicGuestSpec>,
        ready: &Arc<AtomicUsize>,
        start: &dyn Fn(usize) -> usize,
        mk: &MakeDomain<'_>,
    ) -> Result<(), BuildError> {
        use dev::svnic::device::Svnic;
        use dev::svnic::mgmt::{self};
        use dev::svnic::vif::VIF_PAGES;
        let hv = Arc::clone(&self.hv);
        if guests.len() > SVNIC_MAX_VIFS {
            return Err(other(format!(
                "{} guests: an SV-NIC here has at most {SVNIC_MAX_VIFS} VIFs",
                guests.len()
            )));
        }
        let device = device_domain(&hv, &guests, self.grant_version)?;
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
            let at = start(g.core.unwrap_or(1 + i));
            let dom = match g.app {
                crate::svnic_guest::SvnicApp::Block(b) => {
                    let (dom, vbd, k) = disk_guest(&hv, &device, &g.name, *b, vbds.len(), mk)?;
                    vbds.push(vbd);
                    self.boot(&dom, Role::Guest, at, Platform::Xen, k, ready)?;
                    continue;
                }
                _ => mk(&hv, &g.name, false, VIF_PAGES as u32 + 4)?,
            };
            let id = vif_ids;
            vif_ids += 1;
            let k = vif_guest(&hv, &svnic, &device, &dom, id, g)?;
            self.boot(&dom, Role::Guest, at, Platform::Xen, k, ready)?;
        }
        if !vbds.is_empty() {
            self.start_block_service(&mut svnic, &device, vbds, vif_ids, &config)?;
        }
        self.svnic = Some((svnic, device.id()));
        Ok(())
    }

    /// The block service's engine, with its queue pair: a VIF of the device's own, id
    /// `id` after the guests', whose MAC the ingress contexts demultiplex to it.
    fn start_block_service(
        &mut self,
        svnic: &mut dev::svnic::device::Svnic<hv::OwnPage>,
        device: &Arc<Domain>,
        vbds: Vec<RemoteVbd>,
        id: u16,
        config: &dev::svnic::device::SvnicConfig,
    ) -> Result<(), BuildError> {
        use dev::svnic::vif::{VifDevice, VifFront, VifRegion, BUF_PAGES};
        let region = VifRegion::create(device, device.id()).map_err(other)?;
        let d = VifDevice::new(region.device_pages(device).map_err(other)?).map_err(other)?;
        let signal = dev::svnic::device::VifSignal {
            vector: Vector(SVNIC_VECTOR_BASE + id as u8),
            bit: svnic.assign_bit(),
        };
        if !svnic.add_vif(id, SVNIC_AOE_MAC, d.tx, d.rx, signal) {
            return Err(other("no VIF id left for the block service"));
        }
        let front = VifFront::new(region.device_pages(device).map_err(other)?)
            .with_doorbell(svnic.doorbell());
        let svc = dev::svnic::block::BlockService {
            vbds,
            front,
            rx_gfns: region.gfns[2 + BUF_PAGES..].to_vec(),
            device: Arc::clone(device),
            idle: config.idle,
        };
        let pcpu = self.pcpu_of_core(config.cores.block);
        let engine =
            dev::svnic::block::BlockEngine::start_on(svc, &self.sched, pcpu).map_err(other)?;
        self.block_engine = Some(engine);
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
}
