//! Cores, clocks and the CPU-time sampling timer.
//!
//! The profiler follows OProfile's method as the papers used it: a sample is taken every
//! `interval` of *CPU time consumed by the thread* (a POSIX timer on the thread's own
//! CPU clock, delivered as `SIGPROF` to that thread), and attributed to the cost class the
//! thread has declared as current. Classes are small integers here; `hv` names them.
//!
//! The default sampler is that POSIX timer, not a perf `task-clock` event, because the
//! perf event is switched in and out with its thread: an hrtimer cancelled and armed on
//! every block and wake-up. On this VM that adds ~2.5 µs of CPU per block to the thread
//! (and ~0.75 µs of switch time that its samples never see), so a vCPU that blocks
//! 35 000 times a second is distorted by ~9% and sampled at 90–95% of its CPU time.
//! The POSIX timer costs nothing per switch; it is checked on scheduler ticks, and the
//! periods it overran before a tick count as samples of what runs at the tick (ticks do
//! not follow the workload, so the estimate is unbiased, only coarser). Measured with
//! `cargo run --release -p mem --example coverage`.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

/// Number of online cores of the machine. Not `available_parallelism`, which honours
/// the calling thread's affinity mask: after a thread pins itself to one core, its
/// children would see a one-core machine.
pub fn online_cores() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        1
    }
}

/// Pins the calling thread to one core.
pub fn pin_current_thread(core: usize) -> std::io::Result<()> {
    if core >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `core < CPU_SETSIZE`, checked above.
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the given size.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The cores the calling thread may run on (its affinity), lowest first.
pub fn allowed_cores() -> std::io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a valid, writable cpu_set_t of the
    // given size.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: every `c` is below CPU_SETSIZE, the set's size.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

fn timespec_to_duration(ts: libc::timespec) -> Duration {
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Sets the calling thread's timer slack (how late the kernel may fire its timed waits),
/// so that a device model's paced wake-ups come when asked and not up to 50 µs later.
pub fn set_timer_slack(ns: u64) -> std::io::Result<()> {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and touches no memory of ours.
    let r = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, ns.max(1) as libc::c_ulong, 0, 0, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The calling thread's id in the host.
pub fn current_tid() -> i32 {
    // SAFETY: gettid takes nothing and returns the caller's thread id.
    unsafe { libc::gettid() }
}

/// How long thread `tid` of this process has waited, runnable, on the host's run queue
/// for a core that other host threads held (`run_delay` of its `schedstat`). Time the
/// host's own hypervisor took the core away from the whole VM does not show here.
pub fn thread_run_delay(tid: i32) -> Option<Duration> {
    let s = std::fs::read(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    parse_run_delay(&s)
}

/// CPU time consumed so far by the calling thread.
pub fn thread_cpu_time() -> Duration {
    clock_read(libc::CLOCK_THREAD_CPUTIME_ID).unwrap_or_default()
}

/// CPU time consumed so far by the whole process, every thread.
pub fn process_cpu_time() -> Duration {
    clock_read(libc::CLOCK_PROCESS_CPUTIME_ID).unwrap_or_default()
}

fn clock_read(id: libc::clockid_t) -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter; an invalid clock id yields an error code.
    (unsafe { libc::clock_gettime(id, &mut ts) } == 0).then(|| timespec_to_duration(ts))
}

/// A handle on one thread's CPU clock, readable from any thread while that thread lives.
#[derive(Debug, Clone, Copy)]
pub struct ThreadClock(libc::clockid_t);

impl ThreadClock {
    /// The calling thread's CPU clock.
    pub fn current() -> std::io::Result<Self> {
        let mut id: libc::clockid_t = 0;
        // SAFETY: pthread_self is always valid for the caller; `id` is an out-parameter.
        let r = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) };
        if r == 0 {
            Ok(Self(id))
        } else {
            Err(std::io::Error::from_raw_os_error(r))
        }
    }
    /// CPU time of the thread, or `None` once it has exited.
    pub fn read(&self) -> Option<Duration> {
        clock_read(self.0)
    }
}

/// The calling thread's [`thread_run_delay`], through a file kept open: its time
/// runnable on the host's run queue, preempted by another thread or woken and not yet
/// run. Opened on the thread it measures; readable from any thread while it lives. A
/// read is one system call (a `pread` of a procfs file, a few µs).
#[derive(Debug)]
pub struct RunDelay(std::fs::File);

impl RunDelay {
    /// The calling thread's.
    pub fn current() -> std::io::Result<Self> {
        std::fs::File::open("/proc/thread-self/schedstat").map(Self)
    }

    /// Its time waiting for a core so far, or `None` if the kernel keeps no such
    /// statistic (or the thread has exited).
    pub fn read(&self) -> Option<Duration> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 96];
        let n = self.0.read_at(&mut buf, 0).ok()?;
        parse_run_delay(buf.get(..n)?)
    }
}

/// The second of `schedstat`'s fields (run time, run delay, time slices; ns).
fn parse_run_delay(text: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(text).ok()?;
    let ns = text.split_ascii_whitespace().nth(1)?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// The time-stamp counter (constant-rate on the machines pvio targets).
#[inline]
pub fn rdtsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no memory-safety preconditions.
        unsafe { std::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        use std::time::{SystemTime, UNIX_EPOCH};
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    }
}

/// Number of distinct classes a [`SampleSlot`] can count.
pub const MAX_CLASSES: usize = 64;

/// Where a thread's samples go: its current class and one counter per class.
///
/// The owning thread writes `current`; its own signal handler increments `counts`;
/// readers on other threads sum them. All accesses are atomics, so the handler needs
/// no lock (it must not take one).
#[derive(Debug)]
pub struct SampleSlot {
    current: AtomicU8,
    counts: [AtomicU64; MAX_CLASSES],
}

impl Default for SampleSlot {
    fn default() -> Self {
        Self {
            current: AtomicU8::new(0),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl SampleSlot {
    /// Samples counted so far for `class`.
    pub fn count(&self, class: u8) -> u64 {
        self.counts
            .get(class as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
    /// All counters, indexed by class.
    pub fn counts(&self) -> [u64; MAX_CLASSES] {
        std::array::from_fn(|i| self.counts[i].load(Ordering::Relaxed))
    }
    /// Zeroes the counters.
    pub fn reset(&self) {
        for c in &self.counts {
            c.store(0, Ordering::Relaxed);
        }
    }
    /// The class currently declared by the owning thread.
    pub fn current(&self) -> u8 {
        self.current.load(Ordering::Relaxed)
    }
    fn record(&self, weight: u64) {
        let c = self.current.load(Ordering::Relaxed) as usize % MAX_CLASSES;
        self.counts[c].fetch_add(weight, Ordering::Relaxed);
    }
}

thread_local! {
    // The slot of the calling thread, or null. Const-initialised and without a
    // destructor, so reading it from the signal handler touches no lazy state.
    static SLOT: Cell<*const SampleSlot> = const { Cell::new(std::ptr::null()) };
}

/// Declares `class` as the calling thread's current cost class and returns the previous
/// one (so that a guard can restore it). A no-op returning 0 on threads without a slot.
#[inline]
pub fn set_class(class: u8) -> u8 {
    SLOT.with(|s| {
        let p = s.get();
        if p.is_null() {
            return 0;
        }
        // SAFETY: a non-null SLOT points at the slot kept alive by this thread's
        // `SlotBinding`, which clears SLOT before releasing it.
        let slot = unsafe { &*p };
        // Relaxed: the only reader that matters is this thread's own signal handler,
        // which runs on this thread and so sees program order. A load and a store, not a
        // swap: only this thread writes the class, and a swap is a locked instruction
        // (`xchg`), which on a data path that declares a class per operation (a grant
        // copy enters and leaves one for each) cost more than the work it labelled.
        let old = slot.current.load(Ordering::Relaxed);
        slot.current.store(class, Ordering::Relaxed);
        old
    })
}

/// How samples are taken on a thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampler {
    /// No sampling (classes are still tracked).
    None,
    /// A perf software `task-clock` event: an hrtimer on the thread's running time, so
    /// the period is honoured down to microseconds, at a cost on every context switch
    /// (see the module comment). For threads that do not block.
    PerfTaskClock,
    /// A POSIX timer on the thread's CPU clock: the kernel checks it on scheduler ticks
    /// (every 4 ms at HZ=250), and each tick's sample weighs the periods that expired
    /// since the last. No cost per switch; the default.
    PosixCpuTimer,
}

/// Binds a [`SampleSlot`] to the calling thread until dropped; [`set_class`] writes to it
/// and the sampler counts into it. Not `Send`: it must be dropped on its thread.
#[derive(Debug)]
pub struct SlotBinding {
    slot: Arc<SampleSlot>,
    sampler: Sampler,
    timer: Option<libc::timer_t>,
    perf: Option<PerfSampler>,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// A running task-clock event and its mapped ring buffer.
#[derive(Debug)]
struct PerfSampler {
    fd: std::os::fd::OwnedFd,
    buf: *mut libc::c_void,
}

/// Pages of the perf ring buffer: the control page and one data page (records are
/// 8-byte headers, consumed at once by the handler).
const PERF_BUF_PAGES: usize = 2;

thread_local! {
    // The calling thread's perf control page, whose data_tail the handler advances;
    // null if none.
    static PERF_META: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

/// The head of `siginfo_t` for a POSIX timer signal (x86-64 and aarch64 Linux layout):
/// the libc crate does not expose `si_overrun`.
#[repr(C)]
struct TimerSiginfo {
    si_signo: libc::c_int,
    si_errno: libc::c_int,
    si_code: libc::c_int,
    _pad: libc::c_int,
    si_tid: libc::c_int,
    si_overrun: libc::c_int,
}
const SI_TIMER: libc::c_int = -2;

extern "C" fn on_sigprof(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // Async-signal-safe: TLS reads of plain values and a few atomics; no syscall.
    // A CPU-clock timer that expired more than once before its signal was delivered
    // (it is checked only on scheduler ticks) reports the extra periods as overruns;
    // each counts as a sample of what runs now.
    let weight = if info.is_null() {
        1
    } else {
        // SAFETY: the kernel passes a valid siginfo (SA_SIGINFO); its first 24 bytes have
        // this layout, and `si_overrun` is meaningful when `si_code` is SI_TIMER.
        let i = unsafe { &*info.cast::<TimerSiginfo>() };
        if i.si_code == SI_TIMER {
            1 + i.si_overrun.max(0) as u64
        } else {
            1
        }
    };
    let p = SLOT.with(|s| s.get());
    if !p.is_null() {
        // SAFETY: see `set_class`; the handler runs on the thread owning the binding, which
        // cannot be in the middle of dropping it (the sampler is stopped first).
        unsafe { &*p }.record(weight);
    }
    let meta = PERF_META.with(|m| m.get());
    if !meta.is_null() {
        // SAFETY: `meta` is this thread's mapped control page (cleared before unmapping);
        // data_head (offset 1024) and data_tail (1032) are 8-aligned u64 words that the
        // kernel and we access atomically. Marking everything consumed keeps the buffer
        // from filling, so every overflow keeps raising its wake-up signal.
        unsafe {
            let head = AtomicU64::from_ptr(meta.add(PERF_DATA_HEAD).cast()).load(Ordering::Acquire);
            AtomicU64::from_ptr(meta.add(PERF_DATA_TAIL).cast()).store(head, Ordering::Release);
        }
    }
}

static INSTALL: Once = Once::new();

fn install_handler() {
    INSTALL.call_once(|| {
        // SAFETY: sigaction is plain data; zeroed is a valid starting value.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = on_sigprof
            as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)
            as usize;
        // SA_RESTART: a sample never turns a blocking call into EINTR.
        sa.sa_flags = libc::SA_RESTART | libc::SA_SIGINFO;
        // SAFETY: `sa.sa_mask` is a valid sigset; installing a handler that only does
        // async-signal-safe work.
        unsafe {
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGPROF, &sa, std::ptr::null_mut());
        }
    });
}

// Linux UAPI (include/uapi/linux/perf_event.h, fcntl.h) values that the libc crate does
// not export for glibc targets.
const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_TASK_CLOCK: u64 = 1;
const PERF_ATTR_FLAG_DISABLED: u64 = 1 << 0;
const PERF_ATTR_FLAG_EXCLUDE_HV: u64 = 1 << 6;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400; // _IO('$', 0)
/// Offsets of `data_head` and `data_tail` in `struct perf_event_mmap_page`.
const PERF_DATA_HEAD: usize = 1024;
const PERF_DATA_TAIL: usize = 1032;
const F_SETSIG: libc::c_int = 10;
const F_SETOWN_EX: libc::c_int = 15;
const F_OWNER_TID: libc::c_int = 0;

/// `struct perf_event_attr` up to `config1`: the 64-byte `PERF_ATTR_SIZE_VER0` layout,
/// which every kernel since 2.6.31 accepts.
#[repr(C)]
struct PerfEventAttrV0 {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}
const _: () = assert!(std::mem::size_of::<PerfEventAttrV0>() == 64);

#[repr(C)]
struct FOwnerEx {
    type_: libc::c_int,
    pid: libc::pid_t,
}

fn gettid() -> libc::pid_t {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as libc::pid_t }
}

/// Opens a task-clock event on the calling thread that raises SIGPROF at this thread
/// once per `interval` of its running time. The event runs continuously (an hrtimer on
/// the thread's run time); each overflow writes a tiny record to the mapped buffer and
/// wakes the owner, which is the signal. (Re-arming with `PERF_EVENT_IOC_REFRESH` from
/// the handler instead costs a disable/enable, hence an hrtimer restart, per sample: ~20
/// µs on a VM, measured.)
fn start_perf_sampler(interval: Duration) -> std::io::Result<PerfSampler> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let attr = PerfEventAttrV0 {
        type_: PERF_TYPE_SOFTWARE,
        size: 64,
        config: PERF_COUNT_SW_TASK_CLOCK,
        sample_period: (interval.as_nanos() as u64).max(1_000),
        sample_type: 0,
        read_format: 0,
        flags: PERF_ATTR_FLAG_DISABLED | PERF_ATTR_FLAG_EXCLUDE_HV,
        wakeup_events: 1,
        bp_type: 0,
        config1: 0,
    };
    // SAFETY: `attr` is a valid VER0 attribute; pid 0 / cpu -1 is "this thread, any CPU".
    let raw = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttrV0,
            0,
            -1,
            -1,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    let len = PERF_BUF_PAGES * crate::PAGE_SIZE;
    // The event's ring buffer: its control page and data.
    let buf = crate::map_shared(&fd, len)?;
    let sampler = PerfSampler { fd, buf };
    let owner = FOwnerEx {
        type_: F_OWNER_TID,
        pid: gettid(),
    };
    let raw = sampler.fd.as_raw_fd();
    // SAFETY: fcntl on our own descriptor with valid arguments: asynchronous
    // notification, as SIGPROF, to this thread only.
    let ok = unsafe {
        libc::fcntl(raw, libc::F_SETFL, libc::O_ASYNC | libc::O_NONBLOCK) == 0
            && libc::fcntl(raw, F_SETSIG, libc::SIGPROF) == 0
            && libc::fcntl(raw, F_SETOWN_EX, &owner as *const FOwnerEx) == 0
    };
    if !ok {
        return Err(std::io::Error::last_os_error());
    }
    PERF_META.with(|m| m.set(sampler.buf.cast()));
    // SAFETY: enabling our own event.
    if unsafe { libc::ioctl(raw, PERF_EVENT_IOC_ENABLE, 0) } != 0 {
        PERF_META.with(|m| m.set(std::ptr::null_mut()));
        return Err(std::io::Error::last_os_error());
    }
    Ok(sampler)
}

impl Drop for PerfSampler {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the buffer mapped in `start_perf_sampler`; the handler no
        // longer sees it (PERF_META is cleared before the sampler is dropped). The fd
        // closes after, stopping the event.
        unsafe { libc::munmap(self.buf, PERF_BUF_PAGES * crate::PAGE_SIZE) };
    }
}

impl SlotBinding {
    /// Binds `slot` to the calling thread. With `interval`, also samples the thread once
    /// per `interval` of its CPU time with the default sampler (a POSIX CPU timer).
    pub fn bind(slot: Arc<SampleSlot>, interval: Option<Duration>) -> std::io::Result<Self> {
        Self::bind_with(slot, interval, Sampler::PosixCpuTimer)
    }

    /// Binds `slot` with the chosen sampler; a perf event the kernel refuses falls back
    /// to the POSIX timer, and [`SlotBinding::sampler`] says which runs.
    pub fn bind_with(
        slot: Arc<SampleSlot>,
        interval: Option<Duration>,
        sampler: Sampler,
    ) -> std::io::Result<Self> {
        SLOT.with(|s| s.set(Arc::as_ptr(&slot)));
        let mut b = Self {
            slot,
            sampler: Sampler::None,
            timer: None,
            perf: None,
            _not_send: std::marker::PhantomData,
        };
        let Some(iv) = interval else {
            return Ok(b);
        };
        if sampler == Sampler::None {
            return Ok(b);
        }
        install_handler();
        if sampler == Sampler::PerfTaskClock {
            if let Ok(p) = start_perf_sampler(iv) {
                b.perf = Some(p);
                b.sampler = Sampler::PerfTaskClock;
                return Ok(b);
            }
        }
        b.timer = Some(start_thread_timer(iv)?);
        b.sampler = Sampler::PosixCpuTimer;
        Ok(b)
    }
    /// The bound slot.
    pub fn slot(&self) -> &Arc<SampleSlot> {
        &self.slot
    }
    /// Binds `slot` in place of the bound one, which it returns; the sampler keeps
    /// running and counts into `slot` from now on. A scheduler does this when it switches
    /// the unit a thread runs, so that samples are charged to the unit running.
    pub fn switch(&mut self, slot: Arc<SampleSlot>) -> Arc<SampleSlot> {
        // The binding owns the new slot before the thread-local points at it, and the old
        // one is released only once it no longer does.
        let old = std::mem::replace(&mut self.slot, slot);
        SLOT.with(|s| s.set(Arc::as_ptr(&self.slot)));
        old
    }
    /// Which sampler runs.
    pub fn sampler(&self) -> Sampler {
        self.sampler
    }
}

fn start_thread_timer(interval: Duration) -> std::io::Result<libc::timer_t> {
    // SAFETY: sigevent is plain data; zeroed is valid before we fill it.
    let mut sev: libc::sigevent = unsafe { std::mem::zeroed() };
    sev.sigev_notify = libc::SIGEV_THREAD_ID;
    sev.sigev_signo = libc::SIGPROF;
    sev.sigev_notify_thread_id = gettid();
    let mut timer: libc::timer_t = std::ptr::null_mut();
    // SAFETY: valid clock id, sigevent and out-parameter.
    if unsafe { libc::timer_create(libc::CLOCK_THREAD_CPUTIME_ID, &mut sev, &mut timer) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let ts = libc::timespec {
        tv_sec: interval.as_secs() as libc::time_t,
        tv_nsec: interval.subsec_nanos() as libc::c_long,
    };
    let spec = libc::itimerspec {
        it_interval: ts,
        it_value: ts,
    };
    // SAFETY: `timer` was just created; `spec` is valid.
    if unsafe { libc::timer_settime(timer, 0, &spec, std::ptr::null_mut()) } != 0 {
        let e = std::io::Error::last_os_error();
        // SAFETY: deleting the timer we created.
        unsafe { libc::timer_delete(timer) };
        return Err(e);
    }
    Ok(timer)
}

impl Drop for SlotBinding {
    fn drop(&mut self) {
        // Stop the sampler before the slot goes: hide the buffer from the handler, then
        // unmap it and close the event.
        PERF_META.with(|m| m.set(std::ptr::null_mut()));
        self.perf.take();
        if let Some(t) = self.timer.take() {
            // SAFETY: deleting our own timer; no further signal is generated after this.
            unsafe { libc::timer_delete(t) };
        }
        SLOT.with(|s| s.set(std::ptr::null()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_does_not_shrink_the_core_count_seen_by_children() {
        let n = online_cores();
        std::thread::spawn(move || {
            pin_current_thread(0).expect("pin");
            let seen = std::thread::spawn(online_cores).join().expect("child");
            assert_eq!(seen, n);
        })
        .join()
        .expect("pinned thread");
    }

    #[test]
    fn a_threads_wait_for_its_core_is_read_from_its_schedstat_and_grows_while_another_has_the_core()
    {
        assert_eq!(
            parse_run_delay(b"81234 5678 9\n"),
            Some(Duration::from_nanos(5678))
        );
        assert_eq!(parse_run_delay(b"81234\n"), None);
        // A thread that gives its core to another runnable thread waits for it to come
        // back, and the wait shows.
        use std::sync::atomic::AtomicBool;
        let (stop, spinning) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let busy = {
            let (stop, spinning) = (Arc::clone(&stop), Arc::clone(&spinning));
            std::thread::spawn(move || {
                pin_current_thread(0).expect("pin");
                spinning.store(true, Ordering::Release);
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        while !spinning.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        let (before, after) = std::thread::spawn(|| {
            pin_current_thread(0).expect("pin");
            let d = RunDelay::current().expect("schedstat");
            let before = d.read().expect("run_delay");
            for _ in 0..5 {
                std::thread::yield_now();
            }
            (before, d.read().expect("run_delay"))
        })
        .join()
        .expect("measured thread");
        stop.store(true, Ordering::Relaxed);
        busy.join().expect("busy thread");
        assert!(after > before, "{before:?} then {after:?}");
    }

    #[test]
    fn samples_follow_the_current_class() {
        for sampler in [Sampler::PosixCpuTimer, Sampler::PerfTaskClock] {
            samples_follow_the_current_class_with(sampler);
        }
    }

    fn samples_follow_the_current_class_with(sampler: Sampler) {
        let slot = Arc::new(SampleSlot::default());
        let iv = Duration::from_micros(200);
        let b = SlotBinding::bind_with(Arc::clone(&slot), Some(iv), sampler).expect("timer");
        let t0 = thread_cpu_time();
        let burn = |d: Duration| {
            let t0 = thread_cpu_time();
            let mut x = 0u64;
            while thread_cpu_time() - t0 < d {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
            }
        };
        // A POSIX timer's overruns are weighed when the next tick's signal arrives, and
        // on a loaded machine that tick can come late. So each class burns its time and
        // then keeps burning until one more sample has arrived: every period burnt in a
        // class is then weighed while the class is still current, and the clock is
        // read after the last weighing (reading it at once made this test fail under
        // load).
        let total_now = || slot.counts().iter().sum::<u64>();
        let burn_in = |class: u8, d: Duration| {
            let t = thread_cpu_time();
            set_class(class);
            burn(d);
            let (before, waited) = (total_now(), thread_cpu_time());
            while total_now() == before && thread_cpu_time() - waited < Duration::from_secs(1) {
                std::hint::black_box(0u64);
            }
            thread_cpu_time() - t
        };
        // Long enough for tens of scheduler ticks in each class.
        let cpu3 = burn_in(3, Duration::from_millis(150));
        let cpu5 = burn_in(5, Duration::from_millis(50));
        set_class(0);
        let cpu = thread_cpu_time() - t0;
        drop(b);
        // Each class has the samples of the CPU time spent in it (a tick at a class
        // boundary may land on either side).
        for (class, spent) in [(3, cpu3), (5, cpu5)] {
            let want = spent.as_nanos() as f64 / iv.as_nanos() as f64;
            let got = slot.count(class) as f64;
            assert!(
                (got / want - 1.0).abs() < 0.25,
                "{sampler:?}: class {class} has {got} samples for {spent:?} of CPU at {iv:?}"
            );
        }
        // Every period of CPU time is one sample, whether taken at once (perf) or
        // weighed at the next tick (POSIX overruns): the total matches the CPU clock.
        let expect = cpu.as_nanos() as f64 / iv.as_nanos() as f64;
        let total = slot.counts().iter().sum::<u64>() as f64;
        assert!(
            (total / expect - 1.0).abs() < 0.1,
            "{sampler:?}: {total} samples for {cpu:?} of CPU at {iv:?}"
        );
        assert_eq!(set_class(1), 0, "unbound thread has no slot");
    }
}
