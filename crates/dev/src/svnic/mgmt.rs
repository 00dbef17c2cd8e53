//! VIF management through the store (paper 002 §III's management API): the toolstack
//! asks, the device-side management driver on the SV-NIC carries it out.
//!
//! The paper's host-side management driver in the controller domain passed requests to
//! a device-side one on the board; pvio's control plane is the store, as Xen's
//! toolstack drives netback. Under the device's directory (`/local/domain/<device>/svnic`,
//! owned by the device, no access for anyone else: a guest can neither read another's
//! VIF nor ask for anything, its own VIF included):
//!
//! | node | written by | holds |
//! |---|---|---|
//! | `schedule` | toolstack | `round-robin` (quality-unaware) or `quality-aware` |
//! | `vif/<id>/guest` | toolstack | the guest's domain id |
//! | `vif/<id>/mac` | toolstack | the VIF's MAC, `aa:bb:cc:dd:ee:ff` |
//! | `vif/<id>/vector` | toolstack | the vector bound to the guest's event port |
//! | `vif/<id>/priority` | toolstack | 1 (lowest) to 100, changeable while the VIF runs |
//! | `vif/<id>/request` | toolstack, last | `create` or `destroy` |
//! | `vif/<id>/state` | device | `connected`, `closed`, `busy` (destroy waits for the guest to unmap) or `error` |
//! | `vif/<id>/error` | device | why a request was refused |
//! | `vif/<id>/grefs` | device | the region's grant references, in [`VifRegion`] order |
//! | `vif/<id>/backend` | device | the domain whose memory holds the region (the device's, or the VIF's own with [`super::device::SvnicConfig::iommu`]) |
//!
//! A VIF's queue space is fixed at [`super::vif::SLOTS`] slots per queue (the region's
//! layout); its signalling design is the device's ([`super::device::SignalMode`]).
//!
//! The store is the control plane: this allocates and blocks freely, off the data path.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hv::store::StoreError;
use hv::{DomId, Domain, GrantRef, Hypervisor, OwnPage, Vector};

use super::device::{Control, VifSignal, MAX_VIFS};
use super::engine::Schedule;
use super::vif::{RegionError, VifDevice, VifRegion, VIF_PAGES};

/// The device's management directory.
pub fn root(device: DomId) -> String {
    format!("/local/domain/{}/svnic", device.0)
}

/// VIF `id`'s directory.
pub fn vif_dir(device: DomId, id: u16) -> String {
    format!("{}/vif/{id}", root(device))
}

/// Why a management request failed.
#[derive(Debug, thiserror::Error)]
pub enum MgmtError {
    /// The store refused (a guest asking, most often: `Denied`).
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// The device refused the request, saying why.
    #[error("device refused: {0}")]
    Refused(String),
    /// The device did not answer in time.
    #[error("no answer from the device")]
    Timeout,
    /// The driver's thread could not start.
    #[error("thread: {0}")]
    Thread(String),
}

/// What the toolstack asks for when it creates a VIF.
#[derive(Debug, Clone, Copy)]
pub struct VifRequest {
    /// The guest it is for.
    pub guest: DomId,
    /// Its MAC.
    pub mac: [u8; 6],
    /// Its priority (1 to 100).
    pub priority: u8,
    /// The vector bound to the guest's port for its signal.
    pub vector: Vector,
}

fn fmt_mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut m = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut m {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(m)
}

// ---- The host side: the toolstack's calls (as domain 0). ----

/// The toolstack gives the device its management directory: owned by the device,
/// readable and writable by no one else.
pub fn prepare(hv: &Hypervisor, device: DomId) -> Result<(), MgmtError> {
    let st = hv.store();
    let r = root(device);
    st.write(DomId::DOM0, &r, "")?;
    st.set_perms(DomId::DOM0, &r, device, &[])?;
    st.write(DomId::DOM0, &format!("{r}/vif"), "")?;
    Ok(())
}

/// Waits until VIF `id`'s state is one of `want`, or `error`.
fn await_state(
    hv: &Hypervisor,
    device: DomId,
    id: u16,
    want: &[&str],
    wait: Duration,
) -> Result<String, MgmtError> {
    let st = hv.store();
    let dir = vif_dir(device, id);
    let token = format!("toolstack-vif-{id}");
    let rx = st.watch(DomId::DOM0, &dir, &token)?;
    let deadline = Instant::now() + wait;
    let out = loop {
        let s = st.read(DomId::DOM0, &format!("{dir}/state")).ok();
        match s.as_deref() {
            Some("error") => {
                let why = st
                    .read(DomId::DOM0, &format!("{dir}/error"))
                    .unwrap_or_default();
                break Err(MgmtError::Refused(why));
            }
            Some(s) if want.contains(&s) => break Ok(s.to_string()),
            _ => {}
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || rx.recv_timeout(left).is_err() {
            break Err(MgmtError::Timeout);
        }
    };
    st.unwatch(DomId::DOM0, &dir, &token);
    out
}

/// What the guest is given to map its VIF ([`VifRegion::map_grefs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VifGrant {
    /// The domain granting the region.
    pub backend: DomId,
    /// The region's grant references, in [`VifRegion`] order.
    pub grefs: Vec<GrantRef>,
}

/// Creates VIF `id` and returns what its guest maps.
pub fn create_vif(
    hv: &Hypervisor,
    device: DomId,
    id: u16,
    req: &VifRequest,
    wait: Duration,
) -> Result<VifGrant, MgmtError> {
    let st = hv.store();
    let dir = vif_dir(device, id);
    // A fresh directory: no answer from an earlier VIF of this id is read as this one's.
    let _ = st.rm(DomId::DOM0, &dir);
    st.write(
        DomId::DOM0,
        &format!("{dir}/guest"),
        &req.guest.0.to_string(),
    )?;
    st.write(DomId::DOM0, &format!("{dir}/mac"), &fmt_mac(req.mac))?;
    st.write(
        DomId::DOM0,
        &format!("{dir}/vector"),
        &req.vector.0.to_string(),
    )?;
    st.write(
        DomId::DOM0,
        &format!("{dir}/priority"),
        &req.priority.to_string(),
    )?;
    st.write(DomId::DOM0, &format!("{dir}/request"), "create")?;
    await_state(hv, device, id, &["connected"], wait)?;
    let g = st.read(DomId::DOM0, &format!("{dir}/grefs"))?;
    let grefs = g
        .split(',')
        .map(|r| r.parse::<u32>().map(GrantRef))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| MgmtError::Refused(format!("grant references {g:?}")))?;
    let b = st.read(DomId::DOM0, &format!("{dir}/backend"))?;
    let backend = b
        .parse::<u16>()
        .map(DomId)
        .map_err(|_| MgmtError::Refused(format!("backend {b:?}")))?;
    Ok(VifGrant { backend, grefs })
}

/// Destroys VIF `id` once its guest has unmapped the region: returns once the device
/// let go of it and took its memory back.
pub fn destroy_vif(
    hv: &Hypervisor,
    device: DomId,
    id: u16,
    wait: Duration,
) -> Result<(), MgmtError> {
    let dir = vif_dir(device, id);
    hv.store()
        .write(DomId::DOM0, &format!("{dir}/request"), "destroy")?;
    await_state(hv, device, id, &["closed"], wait).map(|_| ())
}

/// Changes VIF `id`'s priority (1 to 100) while it runs.
pub fn set_priority(
    hv: &Hypervisor,
    device: DomId,
    id: u16,
    priority: u8,
) -> Result<(), MgmtError> {
    hv.store().write(
        DomId::DOM0,
        &format!("{}/priority", vif_dir(device, id)),
        &priority.to_string(),
    )?;
    Ok(())
}

/// Chooses the egress scheduler.
pub fn set_schedule(hv: &Hypervisor, device: DomId, s: Schedule) -> Result<(), MgmtError> {
    let v = match s {
        Schedule::RoundRobin => "round-robin",
        Schedule::Priority => "quality-aware",
    };
    hv.store()
        .write(DomId::DOM0, &format!("{}/schedule", root(device)), v)?;
    Ok(())
}

// ---- The device side. ----

/// Requests the device-side driver carried out and refused.
#[derive(Debug, Default)]
pub struct MgmtStats {
    /// VIFs created.
    pub created: AtomicU64,
    /// VIFs destroyed and their memory taken back.
    pub destroyed: AtomicU64,
    /// Requests refused (malformed, out of range, out of device memory).
    pub refused: AtomicU64,
    /// Priority changes applied.
    pub priorities: AtomicU64,
}

impl hv::counters::CounterSet for MgmtStats {
    fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
        f("vifs created", self.created.load(Ordering::Relaxed));
        f("vifs destroyed", self.destroyed.load(Ordering::Relaxed));
        f("requests refused", self.refused.load(Ordering::Relaxed));
        f("priority changes", self.priorities.load(Ordering::Relaxed));
    }
}

struct Live {
    region: VifRegion,
    /// The domain whose memory holds it: the device's, or the VIF's own.
    mem: Arc<Domain>,
    /// Its IOMMU requester id, when it has a context of its own.
    dev: Option<hv::DeviceId>,
    priority: u8,
    /// Destroy asked and the device let go; the region waits for the guest to unmap.
    closing: bool,
}

/// The device-side management driver: a thread that watches the device's directory
/// and carries out what the toolstack wrote there.
pub(super) struct DeviceDriver {
    hv: Arc<Hypervisor>,
    device: Arc<Domain>,
    ctl: Control<OwnPage>,
    live: BTreeMap<u16, Live>,
    schedule: Option<Schedule>,
    stats: Arc<MgmtStats>,
}

/// The first IOMMU requester id of the VIFs' contexts (the NICs' come before it).
pub const VIF_DEVICE_BASE: u16 = 128;
/// VIFs that can have an IOMMU context of their own.
pub const MAX_IOMMU_VIFS: u16 = hv::iommu::MAX_DEVICES as u16 - VIF_DEVICE_BASE;

/// How long the driver waits for the engines to let go of a VIF.
const LET_GO: Duration = Duration::from_secs(2);

impl DeviceDriver {
    /// Starts the driver's thread; it stops with the device.
    pub(super) fn start(
        hv: &Arc<Hypervisor>,
        device: Arc<Domain>,
        ctl: Control<OwnPage>,
    ) -> Result<JoinHandle<()>, MgmtError> {
        let r = root(device.id());
        let rx = hv.store().watch(device.id(), &r, "svnic-mgmt")?;
        let mut d = Self {
            hv: Arc::clone(hv),
            device,
            stats: Arc::clone(ctl.mgmt_stats()),
            ctl,
            live: BTreeMap::new(),
            schedule: None,
        };
        std::thread::Builder::new()
            .name("svnic-mgmt".into())
            .spawn(move || {
                while !d.ctl.stopped() {
                    match rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(_) => d.reconcile(),
                        // A region still mapped is tried again now and then.
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => d.retry_closing(),
                        Err(_) => break,
                    }
                }
                d.hv.store().unwatch(d.device.id(), &r, "svnic-mgmt");
            })
            .map_err(|e| MgmtError::Thread(e.to_string()))
    }

    fn read(&self, path: &str) -> Option<String> {
        self.hv.store().read(self.device.id(), path).ok()
    }

    fn write(&self, path: &str, v: &str) {
        let _ = self.hv.store().write(self.device.id(), path, v);
    }

    fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn answer(&self, id: u16, state: &str) {
        let dir = vif_dir(self.device.id(), id);
        if self.read(&format!("{dir}/state")).as_deref() != Some(state) {
            self.write(&format!("{dir}/state"), state);
        }
    }

    fn refuse(&self, id: u16, why: &str) {
        // Counted before the answer: whoever reads the answer sees the count.
        Self::count(&self.stats.refused);
        let dir = vif_dir(self.device.id(), id);
        self.write(&format!("{dir}/error"), why);
        self.write(&format!("{dir}/state"), "error");
    }

    /// Brings the device in line with the directory.
    fn reconcile(&mut self) {
        let r = root(self.device.id());
        let sched = match self.read(&format!("{r}/schedule")).as_deref() {
            Some("quality-aware") => Some(Schedule::Priority),
            Some("round-robin") => Some(Schedule::RoundRobin),
            _ => None,
        };
        if sched.is_some() && sched != self.schedule {
            self.schedule = sched;
            if let Some(s) = sched {
                self.ctl.set_schedule(s);
            }
        }
        let ids = self
            .hv
            .store()
            .directory(self.device.id(), &format!("{r}/vif"))
            .unwrap_or_default();
        for name in ids {
            let Some(id) = name
                .parse::<u16>()
                .ok()
                .filter(|&i| (i as usize) < MAX_VIFS)
            else {
                continue;
            };
            let dir = vif_dir(self.device.id(), id);
            let request = self.read(&format!("{dir}/request"));
            let state = self.read(&format!("{dir}/state"));
            match (request.as_deref(), self.live.contains_key(&id)) {
                (Some("create"), false) if state.as_deref() != Some("error") => self.create(id),
                (Some("create"), true) => self.reprioritise(id),
                (Some("destroy"), true) => self.destroy(id),
                (Some("destroy"), false) => self.answer(id, "closed"),
                _ => {}
            }
        }
        self.retry_closing();
    }

    fn create(&mut self, id: u16) {
        let dir = vif_dir(self.device.id(), id);
        let field = |k: &str| self.read(&format!("{dir}/{k}")).unwrap_or_default();
        let Some(guest) = field("guest")
            .parse::<u16>()
            .ok()
            .map(DomId)
            .filter(|&g| g != self.device.id() && self.hv.domain(g).is_some())
        else {
            return self.refuse(id, "guest: no such domain");
        };
        let Some(mac) = parse_mac(&field("mac")) else {
            return self.refuse(id, "mac: not aa:bb:cc:dd:ee:ff");
        };
        let Some(vector) = field("vector").parse::<u8>().ok().map(Vector) else {
            return self.refuse(id, "vector: not 0 to 255");
        };
        let Some(priority) = field("priority")
            .parse::<u8>()
            .ok()
            .filter(|p| (1..=100).contains(p))
        else {
            return self.refuse(id, "priority: not 1 to 100");
        };
        let (mem, dev) = match self.vif_memory(id) {
            Ok(m) => m,
            Err(e) => return self.refuse(id, &e),
        };
        let made = VifRegion::create(&mem, guest).and_then(|region| {
            let pages = region.device_pages(&mem);
            match pages.and_then(|p| VifDevice::new(p).map_err(RegionError::from)) {
                Ok(d) => Ok((region, d)),
                Err(e) => {
                    let _ = region.destroy(&mem);
                    Err(e)
                }
            }
        });
        let (region, vdev) = match made {
            Ok(x) => x,
            Err(e) => {
                self.release_memory(&mem, dev);
                return self.refuse(id, &format!("device memory for {VIF_PAGES} pages: {e}"));
            }
        };
        if let Some(d) = dev {
            // Its context maps its receive buffers, writable, and nothing else.
            let b = super::vif::BUF_PAGES;
            let mapped = region.gfns[2 + b..]
                .iter()
                .enumerate()
                .try_for_each(|(i, &g)| {
                    let iova = hv::Iova(super::engine::rx_iova(id).0 + (i * mem::PAGE_SIZE) as u64);
                    self.hv.iommu_map(&mem, iova, g, true)
                });
            if let Err(e) = mapped.and_then(|()| self.hv.iommu_attach(d, &mem)) {
                let _ = region.destroy(&mem);
                self.release_memory(&mem, Some(d));
                return self.refuse(id, &format!("IOMMU context: {e:?}"));
            }
            self.ctl.set_vif_dma(
                id,
                super::engine::VifDma {
                    ctx: self.hv.iommu().device(d),
                    base: super::engine::rx_iova(id),
                },
            );
        }
        let dev_side = vdev;
        let signal = VifSignal {
            vector,
            bit: self.ctl.assign_bit(),
        };
        if !self.ctl.add_vif(id, mac, dev_side.tx, dev_side.rx, signal) {
            let _ = region.destroy(&mem);
            self.release_memory(&mem, dev);
            return self.refuse(id, "id beyond the device's VIFs");
        }
        self.ctl.set_priority(id, priority);
        let grefs = region
            .grefs
            .iter()
            .map(|r| r.0.to_string())
            .collect::<Vec<_>>()
            .join(",");
        self.write(&format!("{dir}/grefs"), &grefs);
        self.write(&format!("{dir}/backend"), &mem.id().0.to_string());
        self.live.insert(
            id,
            Live {
                region,
                mem,
                dev,
                priority,
                closing: false,
            },
        );
        Self::count(&self.stats.created);
        self.answer(id, "connected");
    }

    /// Where VIF `id`'s region goes: the device's memory, or (with the IOMMU) a memory
    /// domain of its own, the paper's device domain per VIF, with the VIF's requester
    /// id.
    fn vif_memory(&self, id: u16) -> Result<(Arc<Domain>, Option<hv::DeviceId>), String> {
        if !self.ctl.iommu() {
            return Ok((Arc::clone(&self.device), None));
        }
        if id >= MAX_IOMMU_VIFS {
            return Err(format!(
                "a VIF of its own IOMMU context has an id below {MAX_IOMMU_VIFS}"
            ));
        }
        let mem = self
            .hv
            .create_domain(&hv::DomainConfig {
                name: format!("svnic-vif{id}"),
                pages: VIF_PAGES as u32 + 8,
                grant_frames: 1,
                vcpus: 1,
                map_slots: 4,
                ..Default::default()
            })
            .map_err(|e| format!("the VIF's memory: {e:?}"))?;
        Ok((mem, Some(hv::DeviceId(VIF_DEVICE_BASE + id))))
    }

    /// Gives back a VIF's own memory domain and IOMMU context (nothing for the device's).
    fn release_memory(&self, mem: &Arc<Domain>, dev: Option<hv::DeviceId>) {
        if let Some(d) = dev {
            self.hv.iommu().detach(d);
            let _ = self.hv.destroy_domain(mem.id());
        }
    }

    fn reprioritise(&mut self, id: u16) {
        let dir = vif_dir(self.device.id(), id);
        let p = self
            .read(&format!("{dir}/priority"))
            .and_then(|v| v.parse::<u8>().ok())
            .filter(|p| (1..=100).contains(p));
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        if let Some(p) = p.filter(|&p| p != live.priority && !live.closing) {
            live.priority = p;
            self.ctl.set_priority(id, p);
            Self::count(&self.stats.priorities);
        }
    }

    fn destroy(&mut self, id: u16) {
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        if !live.closing {
            if !self.ctl.remove_vif(id, LET_GO) {
                // The engines did not answer: nothing is freed that one might still write.
                return self.refuse(id, "the engines did not let go of the VIF");
            }
            live.closing = true;
        }
        self.retry_closing();
    }

    /// Takes back the memory of each VIF the engines let go of, once its guest
    /// unmapped it (until then its state reads `busy`).
    fn retry_closing(&mut self) {
        let closing: Vec<u16> = self
            .live
            .iter()
            .filter(|(_, l)| l.closing)
            .map(|(&i, _)| i)
            .collect();
        for id in closing {
            let Some(live) = self.live.remove(&id) else {
                continue;
            };
            match live.region.destroy(&live.mem) {
                Ok(()) => {
                    self.release_memory(&live.mem, live.dev);
                    Self::count(&self.stats.destroyed);
                    self.write(&format!("{}/grefs", vif_dir(self.device.id(), id)), "");
                    self.answer(id, "closed");
                }
                Err((region, _)) => {
                    self.live.insert(id, Live { region, ..live });
                    self.answer(id, "busy");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_read_back_as_written_and_nothing_else_parses() {
        let m = [0x02, 0, 0xab, 0xcd, 0xef, 0x10];
        assert_eq!(parse_mac(&fmt_mac(m)), Some(m));
        for bad in [
            "",
            "02:00:ab:cd:ef",
            "02:00:ab:cd:ef:10:11",
            "2:00:ab:cd:ef:10",
            "zz:00:ab:cd:ef:10",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }
}
