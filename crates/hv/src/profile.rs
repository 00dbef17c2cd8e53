//! Cost classes (paper 000, Tables 1–3) and the sampling profiler.
//!
//! Every vCPU thread carries its current class in a [`mem::cpu::SampleSlot`]. Code
//! declares what it is doing with a [`ClassGuard`] (`let _g = enter(Class::Bridge)`),
//! which restores the previous class when dropped; hypervisor paths do the same with the
//! Xen classes, so a hypercall's time is charged to Xen in the caller's context, as
//! OProfile saw it. A timer on each vCPU thread's own CPU clock takes a sample every
//! `interval` of CPU time and counts it against the current class. Exact CPU time per
//! vCPU (hence per domain) comes from the thread CPU clocks; samples only apportion it.

use std::sync::Arc;
use std::time::Duration;

use mem::cpu::{set_class, SampleSlot, MAX_CLASSES};

/// A function class. The first group is Table 1 (a domain's kernel), the second Table 2
/// (the hypervisor), the last the data copies and the application that Table 3 singles
/// out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Class {
    /// Network device driver and netfront.
    Driver = 0,
    /// General network functions.
    Network = 1,
    /// Network bridge.
    Bridge = 2,
    /// Network filter.
    Netfilter = 3,
    /// Netback.
    Netback = 4,
    /// Memory management.
    Mem = 5,
    /// Interrupts, softirqs and event upcalls.
    Interrupt = 6,
    /// Process scheduling and the idle loop.
    Schedule = 7,
    /// System calls.
    Syscall = 8,
    /// Time functions.
    Time = 9,
    /// The DMA interface.
    Dma = 10,
    /// Calling into the hypervisor (the guest side of a hypercall).
    Hypercall = 11,
    /// Issuing and revoking grants.
    Grant = 12,
    /// Block layer and blkfront (the guest's), blkback (the driver domain's).
    Block = 13,
    /// Data moved between a disk and memory (a controller's DMA; here the backing
    /// file's `preadv`/`pwritev` into the frames).
    Disk = 14,
    /// Hypervisor: grant map, unmap or copy (bookkeeping, not the data copy).
    XenGrant = 16,
    /// Hypervisor: domain scheduling (block, wake).
    XenSchedule = 17,
    /// Hypervisor: hypercall handling.
    XenHypercall = 18,
    /// Hypervisor: time.
    XenTime = 19,
    /// Hypervisor: event channels.
    XenEvent = 20,
    /// Hypervisor: memory (frame references, page types).
    XenMem = 21,
    /// Hypervisor: interrupts (virtual IRQ routing).
    XenInterrupt = 22,
    /// Hypervisor: entering and leaving (hypercall, interrupt, fault).
    XenEntry = 23,
    /// Hypervisor: fault handling.
    XenTraps = 24,
    /// The data copy inside a grant copy (Table 3 `grantcopy`).
    GrantCopy = 32,
    /// Copy from kernel to user buffer (Table 3 `usercopy`).
    UserCopy = 33,
    /// Application code other than the copy.
    User = 34,
}

impl Class {
    /// Every class, in table order.
    pub const ALL: [Class; 27] = [
        Class::Driver,
        Class::Network,
        Class::Bridge,
        Class::Netfilter,
        Class::Netback,
        Class::Mem,
        Class::Interrupt,
        Class::Schedule,
        Class::Syscall,
        Class::Time,
        Class::Dma,
        Class::Hypercall,
        Class::Grant,
        Class::Block,
        Class::Disk,
        Class::XenGrant,
        Class::XenSchedule,
        Class::XenHypercall,
        Class::XenTime,
        Class::XenEvent,
        Class::XenMem,
        Class::XenInterrupt,
        Class::XenEntry,
        Class::XenTraps,
        Class::GrantCopy,
        Class::UserCopy,
        Class::User,
    ];

    /// The class with this index, if any.
    pub fn from_index(i: u8) -> Option<Class> {
        Self::ALL.iter().copied().find(|c| *c as u8 == i)
    }

    /// Whether this is the block path's (no network experiment has it).
    pub fn is_block(self) -> bool {
        matches!(self, Class::Block | Class::Disk)
    }

    /// Whether this is hypervisor code (Table 2, or the grant copy inside it).
    pub fn is_xen(self) -> bool {
        (16..32).contains(&(self as u8))
    }

    /// The class's name as the paper's tables print it.
    pub fn name(self) -> &'static str {
        match self {
            Class::Driver => "driver",
            Class::Network => "network",
            Class::Bridge => "bridge",
            Class::Netfilter => "netfilter",
            Class::Netback => "netback",
            Class::Mem => "mem",
            Class::Interrupt => "interrupt",
            Class::Schedule => "schedule",
            Class::Syscall => "syscall",
            Class::Time => "time",
            Class::Dma => "dma",
            Class::Hypercall => "hypercall",
            Class::Grant => "grant",
            Class::Block => "block",
            Class::Disk => "disk",
            Class::XenGrant => "grant",
            Class::XenSchedule => "schedule",
            Class::XenHypercall => "hypercall",
            Class::XenTime => "time",
            Class::XenEvent => "event",
            Class::XenMem => "mem",
            Class::XenInterrupt => "interrupt",
            Class::XenEntry => "entry",
            Class::XenTraps => "traps",
            Class::GrantCopy => "grantcopy",
            Class::UserCopy => "usercopy",
            Class::User => "user",
        }
    }

    /// The global class of Table 3, given whether the code ran in the driver domain's
    /// context (`xen0`, `kernel0`) or a guest's (`xen`, `kernel`).
    pub fn global(self, in_driver_domain: bool) -> GlobalClass {
        match (self, in_driver_domain) {
            (Class::GrantCopy, _) => GlobalClass::GrantCopy,
            (Class::UserCopy, _) => GlobalClass::UserCopy,
            (Class::User, _) => GlobalClass::User,
            (c, true) if c.is_xen() => GlobalClass::Xen0,
            (c, false) if c.is_xen() => GlobalClass::Xen,
            (_, true) => GlobalClass::Kernel0,
            (_, false) => GlobalClass::Kernel,
        }
    }
}

const _: () = assert!(
    (Class::User as usize) < MAX_CLASSES,
    "classes must fit a sample slot"
);

/// The global classes of Table 3 (plus `user`, the application outside its copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GlobalClass {
    /// Hypervisor in driver-domain context.
    Xen0,
    /// Driver-domain kernel.
    Kernel0,
    /// Data copy in grant code.
    GrantCopy,
    /// Hypervisor in guest context.
    Xen,
    /// Guest kernel.
    Kernel,
    /// Copy from kernel to user buffer.
    UserCopy,
    /// Application code.
    User,
}

impl GlobalClass {
    /// Table 3's name.
    pub fn name(self) -> &'static str {
        match self {
            GlobalClass::Xen0 => "xen0",
            GlobalClass::Kernel0 => "kernel0",
            GlobalClass::GrantCopy => "grantcopy",
            GlobalClass::Xen => "xen",
            GlobalClass::Kernel => "kernel",
            GlobalClass::UserCopy => "usercopy",
            GlobalClass::User => "user",
        }
    }
}

/// Declares a class for the current thread until dropped. Cheap (one thread-local
/// store each way); a no-op on threads that are not vCPUs.
#[derive(Debug)]
#[must_use = "the class is restored when the guard is dropped"]
pub struct ClassGuard {
    prev: u8,
}

/// Enters `class`; the previous class comes back when the guard drops.
#[inline]
pub fn enter(class: Class) -> ClassGuard {
    ClassGuard {
        prev: set_class(class as u8),
    }
}

impl Drop for ClassGuard {
    #[inline]
    fn drop(&mut self) {
        set_class(self.prev);
    }
}

/// The sampling period used unless a run asks otherwise: one sample per 1 ms of a
/// thread's CPU time. The default sampler (a POSIX CPU-clock timer, see `mem::cpu`)
/// looks at ticks, 4 ms apart at HZ=250, and weighs each by the periods that expired
/// since the last, so a shorter period adds no resolution.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_millis(1);

/// Samples per class, summed over a set of vCPUs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClassSamples {
    /// Count per class index.
    pub counts: Vec<u64>,
}

impl ClassSamples {
    /// Sums the counters of `slots`.
    pub fn collect<'a>(slots: impl IntoIterator<Item = &'a Arc<SampleSlot>>) -> Self {
        let mut counts = vec![0u64; MAX_CLASSES];
        for s in slots {
            for (c, v) in counts.iter_mut().zip(s.counts()) {
                *c += v;
            }
        }
        Self { counts }
    }
    /// Samples of one class.
    pub fn of(&self, c: Class) -> u64 {
        self.counts.get(c as usize).copied().unwrap_or(0)
    }
    /// All samples.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }
    /// The classes with samples, largest first.
    pub fn nonzero(&self) -> Vec<(Class, u64)> {
        let mut v: Vec<_> = Class::ALL
            .iter()
            .map(|c| (*c, self.of(*c)))
            .filter(|(_, n)| *n > 0)
            .collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_classes_follow_table_3() {
        assert_eq!(Class::XenGrant.global(true), GlobalClass::Xen0);
        assert_eq!(Class::XenGrant.global(false), GlobalClass::Xen);
        assert_eq!(Class::Bridge.global(true), GlobalClass::Kernel0);
        assert_eq!(Class::Driver.global(false), GlobalClass::Kernel);
        assert_eq!(Class::GrantCopy.global(true), GlobalClass::GrantCopy);
        assert_eq!(Class::UserCopy.global(false), GlobalClass::UserCopy);
        for c in Class::ALL {
            assert_eq!(Class::from_index(c as u8), Some(c));
        }
    }
}
