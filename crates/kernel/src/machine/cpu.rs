//! The machine's CPU plan: the host cores it owns (its pool, Xen's cpupool), which of
//! them each domain's vCPU and each device engine runs on, and the idle policy of each
//! pCPU.

use crate::{other, BuildError};
use hv::sched::{CpuPlan, IdlePolicy};

use super::*;

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
pub struct CpuPool(pub(super) Vec<usize>);

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
pub(super) fn device_core(layout: &Layout, used: &[usize], pool: &CpuPool) -> usize {
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
pub(super) fn layout_cores(layout: &Layout, pool: &CpuPool) -> Vec<usize> {
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
pub(super) fn domain_cores(layout: &Layout, pool: &CpuPool) -> Vec<usize> {
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
pub(super) fn svnic_cores(config: &dev::svnic::device::SvnicConfig, pool: &CpuPool) -> Vec<usize> {
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
pub(super) fn device_policies(
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

/// The machine's pCPUs: one on each core of `pool` the layout uses, its device engines'
/// included, idling by `idle` (a sleeping device's own cores by its own policy).
/// Returns the plan and the index of the pCPU the device engines run on.
pub(super) fn cpu_plan(
    layout: &Layout,
    pool: &CpuPool,
    idle: IdlePolicy,
    nic_core: Option<usize>,
) -> (CpuPlan, usize) {
    let mut cores = layout_cores(layout, pool);
    let dev_core = nic_core.map_or_else(|| device_core(layout, &cores, pool), |c| pool.core(c));
    if !cores.contains(&dev_core) {
        cores.push(dev_core);
        cores.sort_unstable();
    }
    let device_pcpu = cores.iter().position(|&c| c == dev_core).unwrap_or(0);
    let plan = CpuPlan {
        cores: cores.iter().map(|&c| Some(c)).collect(),
        policy: idle,
        own_policy: device_policies(layout, pool, &cores),
    };
    (plan, device_pcpu)
}
