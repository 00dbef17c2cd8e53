//! Guest time, as Xen gives it to a paravirtualized guest.
//!
//! A PV guest does not ask the hypervisor for the time. Xen keeps, in each vCPU-info
//! block of the shared-info frame, a `vcpu_time_info`: a TSC stamp, the system time at
//! that stamp, and the scale from TSC ticks to nanoseconds. The guest reads the TSC and
//! extrapolates. Xen rewrites the block whenever it schedules the vCPU in
//! (`update_vcpu_system_time` in its context switch), under a version counter that is
//! odd while the block is being written, so the guest retries a torn read.
//!
//! Layout (x86-64 `vcpu_info`, offsets within the 64-byte block): `version` (u32) at 32,
//! `tsc_timestamp` (u64) at 40, `system_time` (u64, ns) at 48, `tsc_to_system_mul` (u32)
//! at 56 and `tsc_shift` (i8) at 60. The scale is `ns = ((ticks << shift) * mul) >> 32`
//! (a right shift for a negative `shift`).
//!
//! The frame is the guest's own: a guest that scribbles on it only corrupts its own
//! clock, and the reader gives up on a version that never settles.
//!
//! Xen also accounts each vCPU's time by run state (running, runnable, blocked,
//! offline) at every state change, which `VCPUOP_get_runstate_info` reports;
//! [`Runstate`] is that record.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::domain::{Domain, SHARED_INFO_GFN};
use crate::event::VCPU_INFO_SIZE;

/// Offset of `vcpu_time_info` in a vCPU-info block.
pub const VCPU_TIME_INFO: usize = 32;
const VERSION: usize = VCPU_TIME_INFO;
const TSC_TIMESTAMP: usize = VCPU_TIME_INFO + 8;
const SYSTEM_TIME: usize = VCPU_TIME_INFO + 16;
/// `tsc_to_system_mul` (low 32 bits) and `tsc_shift` (next byte), read as one word.
const SCALE: usize = VCPU_TIME_INFO + 24;
/// Reads of a block that keep finding it mid-update before the reader gives up.
const READ_TRIES: u32 = 1 << 16;

/// The TSC-to-nanoseconds scale, Xen's `set_time_scale`: `shift` brings the tick rate
/// into (1 GHz, 2 GHz], then `mul` is ns per shifted tick as a 0.32 fixed-point number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TscScale {
    /// Nanoseconds per shifted tick, times 2^32.
    pub mul: u32,
    /// Left shift applied to a tick count first (negative: right).
    pub shift: i8,
}

impl TscScale {
    /// The scale for a counter ticking at `hz`.
    pub fn for_hz(hz: u64) -> Self {
        let mut tps = hz.max(1);
        let mut shift = 0i8;
        while tps > 2_000_000_000 {
            tps >>= 1;
            shift -= 1;
        }
        while tps <= 1_000_000_000 {
            tps <<= 1;
            shift += 1;
        }
        let mul = ((1_000_000_000u128 << 32) / tps as u128).min(u32::MAX as u128) as u32;
        Self { mul, shift }
    }

    /// Nanoseconds in `ticks`. The scale may come from a guest-writable page, so any
    /// shift is taken (one of 64 bits or more gives 0) and nothing can overflow.
    #[inline]
    pub fn ns(self, ticks: u64) -> u64 {
        let by = u32::from(self.shift.unsigned_abs());
        let t = if self.shift >= 0 {
            ticks.checked_shl(by)
        } else {
            ticks.checked_shr(by)
        }
        .unwrap_or(0);
        ((t as u128 * self.mul as u128) >> 32) as u64
    }

    fn word(self) -> u64 {
        self.mul as u64 | (self.shift as u8 as u64) << 32
    }

    fn from_word(w: u64) -> Self {
        Self {
            mul: w as u32,
            shift: (w >> 32) as u8 as i8,
        }
    }
}

/// The machine's TSC scale, calibrated once per process against the monotonic clock
/// (Xen calibrates against its platform timer at boot).
pub fn tsc_scale() -> TscScale {
    static SCALE: OnceLock<TscScale> = OnceLock::new();
    *SCALE.get_or_init(|| {
        let base = Instant::now();
        let (t0, c0) = paired_read(base);
        std::thread::sleep(Duration::from_millis(20));
        let (t1, c1) = paired_read(base);
        let ns = t1.saturating_sub(t0).max(1) as u128;
        let hz = (c1.wrapping_sub(c0) as u128 * 1_000_000_000 / ns) as u64;
        TscScale::for_hz(hz)
    })
}

/// A TSC value and the monotonic time (ns since `base`) at which it was read: the TSC
/// read is bracketed by two clock reads, and a bracket the thread was preempted in is
/// retried, so the pair is good to about a microsecond.
fn paired_read(base: Instant) -> (u64, u64) {
    let mut best = (u64::MAX, 0, 0);
    for _ in 0..100 {
        let a = base.elapsed().as_nanos() as u64;
        let c = mem::cpu::rdtsc();
        let b = base.elapsed().as_nanos() as u64;
        if b - a < best.0 {
            best = (b - a, a + (b - a) / 2, c);
        }
        if b - a < 1_000 {
            break;
        }
    }
    (best.1, best.2)
}

fn word(dom: &Domain, vcpu: u32, offset: usize) -> Option<&AtomicU64> {
    dom.atomic_u64(SHARED_INFO_GFN, vcpu as usize * VCPU_INFO_SIZE + offset)
        .ok()
}

/// `update_vcpu_system_time`: stamps `vcpu`'s time-info block with the TSC value `tsc`
/// taken at system time `now`.
pub(crate) fn update_vcpu_system_time(dom: &Domain, vcpu: u32, tsc: u64, now: Duration) {
    let (Some(ver), Some(stamp), Some(sys), Some(scale)) = (
        dom.atomic_u32(SHARED_INFO_GFN, vcpu as usize * VCPU_INFO_SIZE + VERSION)
            .ok(),
        word(dom, vcpu, TSC_TIMESTAMP),
        word(dom, vcpu, SYSTEM_TIME),
        word(dom, vcpu, SCALE),
    ) else {
        return;
    };
    // Odd while writing; the fences order the fields between the two version stores.
    let v = ver.load(Ordering::Relaxed) | 1;
    ver.store(v, Ordering::Relaxed);
    fence(Ordering::Release);
    stamp.store(tsc, Ordering::Relaxed);
    sys.store(now.as_nanos() as u64, Ordering::Relaxed);
    scale.store(tsc_scale().word(), Ordering::Relaxed);
    fence(Ordering::Release);
    ver.store(v.wrapping_add(1), Ordering::Release);
}

/// The guest's clock read (Linux's `pvclock_clocksource_read`): the system time
/// extrapolated from `vcpu`'s time-info block with the TSC. `None` if the hypervisor has
/// never stamped the block, or the version never settles.
pub fn read_system_time(dom: &Domain, vcpu: u32) -> Option<Duration> {
    let ver = dom
        .atomic_u32(SHARED_INFO_GFN, vcpu as usize * VCPU_INFO_SIZE + VERSION)
        .ok()?;
    let (stamp, sys, scale) = (
        word(dom, vcpu, TSC_TIMESTAMP)?,
        word(dom, vcpu, SYSTEM_TIME)?,
        word(dom, vcpu, SCALE)?,
    );
    for _ in 0..READ_TRIES {
        let v1 = ver.load(Ordering::Acquire);
        if v1 & 1 != 0 {
            std::hint::spin_loop();
            continue;
        }
        let (t, s, k) = (
            stamp.load(Ordering::Relaxed),
            sys.load(Ordering::Relaxed),
            scale.load(Ordering::Relaxed),
        );
        let tsc = mem::cpu::rdtsc();
        fence(Ordering::Acquire);
        if ver.load(Ordering::Relaxed) != v1 {
            continue;
        }
        if v1 == 0 {
            return None;
        }
        let ns = s.wrapping_add(TscScale::from_word(k).ns(tsc.saturating_sub(t)));
        return Some(Duration::from_nanos(ns));
    }
    None
}

/// A vCPU's run state (`RUNSTATE_*` of Xen's `vcpu.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RunstateKind {
    /// On a CPU.
    Running = 0,
    /// Ready, waiting for a CPU.
    Runnable = 1,
    /// Waiting for an event.
    Blocked = 2,
    /// Not started, or stopped.
    Offline = 3,
}

/// `vcpu_runstate_info`: the current state, when it began, and the time spent in each
/// state so far (ns on the hypervisor clock; the current state's time is counted up to
/// its last change).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Runstate {
    /// The state now.
    pub state: RunstateKind,
    /// When it began.
    pub state_entry_time: Duration,
    /// Time in each state, indexed by [`RunstateKind`].
    pub time: [Duration; 4],
}
