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

use blk::blkback::VBD_WINDOW_SLOTS;
use dev::driver::DmaApi;
use dev::irq::{IrqLine, NativeIrq};
use dev::nic::{Nic, NicRegs};
use hv::sched::{Scheduler, UnitJoin, UnitSpec};
use hv::{DeviceId, DomId, Domain, DomainConfig, GrantVersion, HvConfig, Hypervisor, Vector};
use net::toolstack::{self};

use crate::app::AppSpec;
use crate::counters::PortKind;
use crate::driver_domain::{DriverConfig, DriverDomain, Fault, FaultSwitch};
use crate::native::NicKernel;
use crate::pv_guest::{PvGuest, TapGuest};
use crate::vcpu::{self, Kernel, Platform};
use crate::{other, BuildError, Counters};

mod cpu;
mod devices;
mod restart;
mod spec;
mod svnic;

use cpu::*;
pub use cpu::{CpuPool, CpuSet};
use devices::*;
use restart::{DiskPlan, DriverPlan, Served};
pub use restart::{DriverFault, Restarted};
pub use spec::*;
pub use svnic::{MGMT_WAIT, SVNIC_MAX_VIFS, SVNIC_VECTOR_BASE};

/// The NIC's device id.
pub const NIC: DeviceId = DeviceId(1);
/// The NIC's interrupt vector.
pub const NIC_VECTOR: Vector = Vector(40);
/// Pages of memory each domain gets.
pub const DOMAIN_PAGES: u32 = 8192;

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
        let pool = match spec.cpus {
            Some(set) => CpuPool::of(set)?,
            None => CpuPool::all(),
        };
        let (plan, device_pcpu) = cpu_plan(&spec.layout, &pool, spec.idle, spec.nic.core);
        let pcpu_cores = plan.cores.iter().flatten().copied().collect();
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
        m.plug_in(&ready);
        Ok(m)
    }

    /// Plugs the cable in once every kernel runs (`ready` counts those up): frames that
    /// reach a device before its kernels run have nowhere to go.
    fn plug_in(&self, ready: &AtomicUsize) {
        let t = Instant::now();
        while ready.load(Ordering::Acquire) < self.kernels.len()
            && t.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Some(nic) = &self.nic {
            nic.regs().plug();
        }
        if let Some((s, _)) = &self.svnic {
            s.link_up();
        }
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
        // A vCPU may run on another pCPU while the host holds its own, unless its kernel
        // is tied to its thread.
        let spec = if kernel.thread_bound() {
            UnitSpec::named(format!("{}-v0", dom.name()))
        } else {
            UnitSpec::vcpu(format!("{}-v0", dom.name()))
        };
        let unit = vcpu::KernelUnit::new(v, platform, kernel, stop, ready, Arc::clone(&door));
        let pcpu = self.pcpu_cores.iter().position(|&c| c == at).unwrap_or(0);
        let h = self
            .sched
            .place(
                pcpu,
                UnitSpec {
                    weight: weight.max(1),
                    ..spec
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
            // Whose the missed frames were: those in the host's holds of a pCPU.
            let held =
                dev::nic::misses::in_holds(&r.rx_missed_log.bursts(), &self.sched.host_holds());
            c.add("nic", "rx_missed_in_host_holds", held);
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
            c.add(&k, "wait_p99_us", us(u.wait_p99));
            c.add(&k, "longest_wait_us", us(u.longest_wait));
            c.add(&k, "wait_p99_net_us", us(u.wait_p99_net));
            c.add(&k, "longest_wait_net_us", us(u.longest_wait_net));
            c.add(&k, "long_steps", u.long_steps);
            c.add(&k, "stolen", u.stolen);
        }
        let holds = self.sched.host_holds();
        for r in self.sched.reports() {
            let k = format!("pcpu{}", r.index);
            // The longest hold the host made inside a step on it, since the start.
            let in_step = holds
                .iter()
                .filter(|h| h.pcpu == r.index && h.in_step)
                .map(|h| h.held)
                .max()
                .unwrap_or_default();
            c.add(&k, "longest_step_hold_us", us(in_step));
            c.add(&k, "idle_us", us(r.idle));
            c.add(&k, "slept_us", us(r.slept));
            c.add(&k, "host_wakes", r.host_wakes);
            c.add(&k, "rung_wakes", r.rung_wakes);
            c.add(&k, "rung_wake_us", us(r.rung_wake));
            c.add(&k, "longest_rung_wake_us", us(r.longest_rung_wake));
            c.add(&k, "timer_wakes", r.timer_wakes);
            c.add(&k, "timer_late_us", us(r.timer_late));
            c.add(&k, "longest_timer_late_us", us(r.longest_timer_late));
            c.add(&k, "stolen_us", us(r.stolen));
            c.add(&k, "longest_step_us", us(r.longest_step));
            c.add(&k, "longest_away_us", us(r.longest_away));
            c.add(&k, "host_queued_us", us(r.host_queued));
            c.add(&k, "line_fires", r.line_fires);
            c.add(&k, "covered", r.covered);
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
    use hv::sched::IdlePolicy;

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
