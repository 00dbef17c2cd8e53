//! The toolstack's watchdog and driver-domain restart (paper 000 §5.1): what it keeps
//! to rebuild a driver domain, how it tells a crash or a stall, and the restart itself,
//! every guest's vif and disk handed to the new driver domain.

use crate::driver_domain::{DriverConfig, DriverDomain, Fault, FaultSwitch};
use crate::vcpu::Platform;
use crate::{other, BuildError};
use blk::blkback::{self, Blkback};
use blk::disk::FileDisk;
use blk::initiator::InitiatorConfig;
use blk::remote::RemoteVbd;
use dev::nic::NicRegs;
use hv::store::XenStore;
use hv::{DomId, Domain, DomainConfig, Hypervisor};
use net::toolstack::{self, VifSpec};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

/// What the toolstack keeps to rebuild a driver domain (paper 000 §5.1): its
/// configuration, its guests' vifs, and the watchdog's last look at it.
#[derive(Debug)]
pub(super) struct DriverPlan {
    pub(super) dom: Arc<Domain>,
    pub(super) config: DriverConfig,
    pub(super) slots: u32,
    pub(super) guests: Vec<(Arc<Domain>, VifSpec)>,
    /// Each guest's disk, to be served again by a new driver domain.
    pub(super) disks: Vec<DiskPlan>,
    pub(super) fault: FaultSwitch,
    pub(super) regs: Arc<NicRegs>,
    /// The driver domain's event looks when the watchdog last saw them move, the NIC's
    /// frames (received and missed) then, and when.
    pub(super) seen: (u64, u64, Instant),
}

/// A guest's disk as the toolstack keeps it to hand to a new driver domain.
#[derive(Debug, Clone)]
pub(super) struct DiskPlan {
    pub(super) dom: Arc<Domain>,
    pub(super) disk: Disk,
    pub(super) read_only: bool,
    pub(super) persistent: bool,
    /// Its back end's first window slot.
    pub(super) slot: u32,
    /// A remote disk's initiator's tag prefix (its index among the remote disks).
    pub(super) tag: u8,
}

impl DiskPlan {
    /// The disk, for messages: its file, or its AoE target.
    pub(super) fn name(&self) -> String {
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
    pub(super) fn serve(
        &self,
        hv: &Arc<Hypervisor>,
        drv: &Arc<Domain>,
    ) -> Result<Served, BuildError> {
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
pub(super) enum Served {
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

impl Machine {
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
    pub(super) fn restart(&mut self) -> Result<(Duration, u32, u32), BuildError> {
        let t0 = Instant::now();
        let Some(mut d) = self.driver.take() else {
            return Err(other("no driver domain"));
        };
        let hv = Arc::clone(&self.hv);
        self.tear_down_driver(&d)?;
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
        // The guests reconnect on their own vCPUs; the back ends follow once each front
        // end is Connected (the back end's watch on it).
        let until = Instant::now() + Duration::from_secs(5);
        let (vifs, vifs_unserved) = reconnect_vifs(&hv, &drv, &d, until);
        let (vbds, remote, disks_unserved) = reconnect_disks(&hv, &drv, &d, served, until);
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

    /// The old driver domain gone: its NIC reset (so no DMA reaches a guest page after
    /// the hypervisor unmaps it), the domain destroyed, its back ends closed in the
    /// store, and its kernel's thread let go. That thread ends once it sees its domain
    /// dying; a hung one may take a moment, and is not waited for beyond that.
    fn tear_down_driver(&mut self, d: &DriverPlan) -> Result<(), BuildError> {
        let hv = &self.hv;
        d.regs.function_reset();
        let old = d.dom.id();
        hv.destroy_domain(old)?;
        for (g, vs) in &d.guests {
            toolstack::close_backend(hv, old, g.id(), vs.handle);
        }
        for disk in &d.disks {
            blk::xenbus::close_backend(hv.store(), old, disk.dom.id(), XVDA);
        }
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
        Ok(())
    }
}

/// Each guest's vif on the new driver domain `drv`, once its front end is Connected
/// again. A guest that does not reconnect by `until` (or answers the handshake wrongly)
/// loses its vif, not the restart: every other guest is served, and the plan keeps its
/// vif for the next restart. Returns the vifs and how many were left out.
fn reconnect_vifs(
    hv: &Arc<Hypervisor>,
    drv: &Arc<Domain>,
    d: &DriverPlan,
    until: Instant,
) -> (Vec<(net::netback::Vif, [u8; 6])>, u32) {
    let mut vifs = Vec::with_capacity(d.guests.len());
    let mut unserved = 0;
    for (g, vs) in &d.guests {
        while !toolstack::frontend_connected(hv, g.id(), vs.handle) && Instant::now() <= until {
            std::thread::yield_now();
        }
        match toolstack::frontend_connected(hv, g.id(), vs.handle)
            .then(|| toolstack::connect_backend(hv, drv, g, *vs).ok())
            .flatten()
        {
            Some(vif) => vifs.push((vif, vs.mac)),
            None => unserved += 1,
        }
    }
    (vifs, unserved)
}

/// Each disk's back end on the new driver domain: a file's once its guest's blkfront is
/// Connected again, a remote disk's as served. A disk that could not be served, or
/// whose guest does not reconnect by `until` (or answers the handshake wrongly), is
/// left out: its requests fail after their bound, and every other device is served.
/// Returns the back ends and how many disks were left out.
fn reconnect_disks(
    hv: &Arc<Hypervisor>,
    drv: &Arc<Domain>,
    d: &DriverPlan,
    served: Vec<Option<Served>>,
    until: Instant,
) -> (Vec<Blkback>, Vec<RemoteVbd>, u32) {
    let (mut vbds, mut remote, mut unserved) = (Vec::new(), Vec::new(), 0);
    for (disk, s) in d.disks.iter().zip(served) {
        let file = match s {
            None => {
                unserved += 1;
                continue;
            }
            Some(Served::Remote(r)) => {
                remote.push(r);
                continue;
            }
            Some(Served::File(file)) => file,
        };
        let fe = disk.dom.id();
        let fdir = blk::xenbus::frontend_dir(fe, XVDA);
        let mut connected = true;
        while hv.store().xenbus_state(DomId::DOM0, &fdir) != hv::store::XenbusState::Connected {
            if Instant::now() > until {
                connected = false;
                break;
            }
            std::thread::yield_now();
        }
        match connected
            .then(|| Blkback::connect(hv::Pvio::new(hv, drv), fe, XVDA, disk.slot, file).ok())
            .flatten()
        {
            Some(b) => vbds.push(b),
            None => unserved += 1,
        }
    }
    (vbds, remote, unserved)
}
