//! The measurement the experiments share: a run's plan from its mode, one run of a
//! machine (warm-up, a measured window, the accounting of every frame at the end), each
//! domain's CPU per packet apportioned to classes by the profiler, the losses noted in a
//! report, and the sign test for paired rounds.
//!
//! Paper 000's method is the model: a fixed offered load and, per domain, CPU time per
//! packet from the vCPU threads' clocks over a window, apportioned to function classes by
//! the sampling profiler (`hv::profile`).

use std::collections::BTreeMap;
use std::time::Duration;

use hv::profile::{Class, GlobalClass};
use kernel::counters::Counters;

use crate::{Context, Error, IdlePolicy, Mode, Report};
use rig::udp::{DomainSnapshot, Finish, Options, Running, Snapshot};

/// The global classes of paper 000's Figure 2, in its order.
pub(crate) const GLOBALS: [GlobalClass; 7] = [
    GlobalClass::UserCopy,
    GlobalClass::Kernel,
    GlobalClass::Xen,
    GlobalClass::GrantCopy,
    GlobalClass::Kernel0,
    GlobalClass::Xen0,
    GlobalClass::User,
];

/// One domain's share of one run, per packet.
#[derive(Debug, Clone, Default)]
pub(crate) struct DomainCost {
    pub(crate) cpu_ns: f64,
    pub(crate) classes: BTreeMap<Class, f64>,
    /// Sampled CPU (samples × interval) over measured CPU.
    pub(crate) coverage: f64,
}

/// One run's cost per packet, by domain role.
#[derive(Debug, Clone, Default)]
pub(crate) struct RunCost {
    /// Per domain role: "native", "guest", "driver".
    pub(crate) domains: BTreeMap<&'static str, (bool, DomainCost)>,
    pub(crate) total_ns: f64,
    /// Every sample the machine's pCPUs took (its domains' and their own) × interval,
    /// over their threads' CPU time: whether the profiler sees all the CPU the machine
    /// used. (A domain's own share is exact only when it has its pCPU to itself: a
    /// sample near a switch between units may be charged to the unit on either side.)
    pub(crate) machine_coverage: f64,
    /// Time the host took the machine's pCPUs away, over the window (all pCPUs).
    pub(crate) stolen: Duration,
    /// Of it, the time other host threads had their cores (the pCPUs' threads waited
    /// on the host's run queue); the rest was the VM's own absence.
    pub(crate) host_queued: Duration,
}

impl RunCost {
    /// CPU time per packet of the domain in `role` ("native", "guest", "driver").
    pub(crate) fn cpu_ns(&self, role: &str) -> Option<f64> {
        self.domains.get(role).map(|(_, d)| d.cpu_ns)
    }

    pub(crate) fn global(&self, g: GlobalClass) -> f64 {
        self.domains
            .values()
            .flat_map(|(drv, d)| {
                d.classes
                    .iter()
                    .filter(move |(c, _)| c.global(*drv) == g)
                    .map(|(_, v)| *v)
            })
            .sum()
    }
}

/// A domain's role from its name.
fn role(name: &str) -> &'static str {
    match name {
        "native" => "native",
        "driver" => "driver",
        _ => "guest",
    }
}

/// A run's cost per packet between two snapshots: each domain's CPU and classes, and
/// how much of the machine's CPU the profiler saw and the host took away.
pub(crate) fn cost(a: &Snapshot, b: &Snapshot, interval: Duration) -> RunCost {
    let packets = (b.frames_sent - a.frames_sent).max(1) as f64;
    let mut rc = cost_per(&a.domains, &b.domains, packets, interval);
    let domain_samples: u64 = a
        .domains
        .iter()
        .zip(&b.domains)
        .map(|((_, _, sa), (_, _, sb))| {
            Class::ALL
                .iter()
                .map(|&c| sb.samples.of(c) - sa.samples.of(c))
                .sum::<u64>()
        })
        .sum();
    let (mut own, mut cpu, mut stolen, mut queued) =
        (0u64, Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for (pa, pb) in a.pcpus.iter().zip(&b.pcpus) {
        own += pb.samples.saturating_sub(pa.samples);
        cpu += pb.cpu.saturating_sub(pa.cpu);
        stolen += pb.stolen.saturating_sub(pa.stolen);
        queued += pb.host_queued.saturating_sub(pa.host_queued);
    }
    rc.machine_coverage = if cpu > Duration::ZERO {
        (domain_samples + own) as f64 * interval.as_nanos() as f64 / cpu.as_nanos() as f64
    } else {
        1.0
    };
    rc.stolen = stolen;
    rc.host_queued = queued;
    rc
}

/// Each domain's CPU between two snapshots of its use, per one of `units` (packets,
/// bytes), apportioned to classes by its profiler samples.
pub(crate) fn cost_per(
    a: &[(String, bool, DomainSnapshot)],
    b: &[(String, bool, DomainSnapshot)],
    units: f64,
    interval: Duration,
) -> RunCost {
    let packets = units.max(1.0);
    let mut rc = RunCost::default();
    for ((name, drv, sa), (_, _, sb)) in a.iter().zip(b) {
        let cpu = (sb.cpu.saturating_sub(sa.cpu)).as_nanos() as f64;
        let total: u64 = Class::ALL
            .iter()
            .map(|&c| sb.samples.of(c) - sa.samples.of(c))
            .sum();
        let mut d = DomainCost {
            cpu_ns: cpu / packets,
            coverage: if cpu > 0.0 {
                total as f64 * interval.as_nanos() as f64 / cpu
            } else {
                1.0
            },
            ..Default::default()
        };
        if total > 0 {
            for c in Class::ALL {
                let n = sb.samples.of(c) - sa.samples.of(c);
                if n > 0 {
                    d.classes.insert(c, d.cpu_ns * n as f64 / total as f64);
                }
            }
        }
        rc.total_ns += d.cpu_ns;
        rc.domains.insert(role(name), (*drv, d));
    }
    rc
}

/// How long a run warms up and measures, how many runs a configuration gets, and how
/// its machines' idle pCPUs wait (the run's [`Context`]).
pub(crate) struct Durations {
    pub(crate) warmup: Duration,
    pub(crate) window: Duration,
    pub(crate) runs: usize,
    pub(crate) idle: IdlePolicy,
}

/// A run's plan as a record names it: its mode, the runs a configuration gets, and the
/// warm-up and measured window in milliseconds (flattened into an experiment's config).
#[derive(Debug, serde::Serialize)]
pub(crate) struct PlanRecord {
    mode: String,
    runs: usize,
    window_ms: u64,
    warmup_ms: u64,
}

impl Durations {
    /// As the record names it, for a run in `mode`.
    pub(crate) fn record(&self, mode: Mode) -> PlanRecord {
        PlanRecord {
            mode: format!("{mode:?}"),
            runs: self.runs,
            window_ms: self.window.as_millis() as u64,
            warmup_ms: self.warmup.as_millis() as u64,
        }
    }
}

/// The NIC's interrupt coalescing as a record names it.
#[derive(Debug, serde::Serialize)]
pub(crate) struct CoalesceRecord {
    packets: u32,
    delay_us: u64,
}

impl CoalesceRecord {
    pub(crate) fn of(c: dev::nic::Coalesce) -> Self {
        Self {
            packets: c.pkts_per_irq,
            delay_us: c.max_delay.as_micros() as u64,
        }
    }
}

/// The run's plan from its context.
pub(crate) fn durations(cx: &Context) -> Durations {
    let idle = cx.idle;
    match cx.mode {
        Mode::Full => Durations {
            warmup: Duration::from_millis(500),
            window: Duration::from_secs(3),
            runs: 5,
            idle,
        },
        Mode::Quick => Durations {
            warmup: Duration::from_millis(300),
            window: Duration::from_secs(1),
            runs: 2,
            idle,
        },
        Mode::Smoke => Durations {
            warmup: Duration::from_millis(50),
            window: Duration::from_millis(150),
            runs: 1,
            idle,
        },
    }
}

/// Starts a machine, lets it warm up, measures each domain's CPU over one window,
/// and stops it, accounting for every frame.
pub(crate) fn one_run(opts: Options, d: &Durations) -> Result<(RunCost, Finish), Error> {
    let opts = Options {
        idle: d.idle,
        ..opts
    };
    let m = Running::start(opts)?;
    std::thread::sleep(d.warmup);
    let start = m.begin_window();
    let a = m.snapshot();
    std::thread::sleep(d.window);
    let b = m.snapshot();
    let mut f = m.finish(Duration::from_secs(2))?;
    // The waits of the machine's start and warm-up, kept apart from the window's.
    for (comp, name, v) in &start.entries {
        if name == "longest_wait_net_us" && is_device_unit(comp) {
            f.counters.add(comp, "longest_wait_net_before_us", *v);
        }
    }
    let interval = opts.sample.unwrap_or(hv::profile::DEFAULT_SAMPLE_INTERVAL);
    Ok((cost(&a, &b, interval), f))
}

/// Notes every run that lost or corrupted messages, with its counters; returns the
/// messages lost or corrupted over all of them. The devices' waits to run in the same
/// runs go into the record's checks ([`device_waits`]), and so do the NIC's missed
/// frames that no hold of the host explains ([`missed_outside_holds`]).
pub(crate) fn account_losses<'a>(
    r: &mut Report,
    runs: impl Iterator<Item = (String, &'a Finish)>,
) -> u64 {
    let runs: Vec<(String, &Finish)> = runs.collect();
    let counters: Vec<(String, &Counters)> =
        runs.iter().map(|(l, f)| (l.clone(), &f.counters)).collect();
    device_waits(r, &counters);
    missed_outside_holds(r, &runs);
    link_pauses(r, &runs);
    let mut total = 0;
    for (label, f) in runs {
        let lost = f.messages_sent.saturating_sub(f.messages_received);
        total += lost + f.corrupt;
        if lost > 0 || f.corrupt > 0 {
            r.notes.push(format!(
                "{label}: {lost} of {} messages lost, {} corrupt ({}); counters {:?}",
                f.messages_sent,
                f.corrupt,
                loss_cause(f),
                f.counters.entries
            ));
        }
    }
    total
}

/// The stack of an experiment's own thread: the main thread's size (8 MiB) twice over.
const EXPERIMENT_STACK: usize = 16 << 20;

/// Runs `f` (one experiment) on a thread of its own and returns what it returned, or its
/// panic. What an experiment does to its thread ends with it: a pin to one core (`core`
/// and `iosup` measure on the thread they were called on), a timer slack. Every
/// process and thread an experiment starts takes its starter's affinity, so one run on
/// the caller's thread would leave every later experiment's helpers (iperf3, sockperf)
/// and unpinned device threads on the one core an earlier experiment pinned it to.
pub fn isolated<T: Send>(
    name: &str,
    f: impl FnOnce() -> T + Send,
) -> std::io::Result<std::thread::Result<T>> {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name(name.to_string())
            .stack_size(EXPERIMENT_STACK)
            .spawn_scoped(s, f)
            .map(|h| h.join())
    })
}

/// A run's NIC counter `what`, summed over its NICs.
fn nic_count(f: &Finish, what: &str) -> u64 {
    f.counters
        .entries
        .iter()
        .filter(|(comp, name, _)| comp == "nic" && name == what)
        .map(|e| e.2)
        .sum()
}

/// A run's NIC frames dropped for want of a buffer (`rx_missed`), and those of them
/// that fell while the host held one of the machine's pCPUs' threads at least
/// `hv::sched::HOLD_LOGGED` (`rx_missed_in_host_holds`, as the machine laid the NIC's
/// bursts of misses beside the holds).
fn missed(f: &Finish) -> (u64, u64) {
    let all = nic_count(f, "rx_missed");
    (all, nic_count(f, "rx_missed_in_host_holds").min(all))
}

/// The check that every frame the NIC missed over `runs` fell in a hold of the host
/// (issue 58: the host's holds are reported apart), with the split in a note; a later
/// call (another group of runs of the same record) adds to both.
fn missed_outside_holds(r: &mut Report, runs: &[(String, &Finish)]) {
    const WHAT: &str =
        "frames the NIC had no buffer for outside the host's holds of the machine's pCPUs \
         (all runs)";
    const NOTE: &str = "the NIC had no buffer for (frames over all runs, of them while the host held a pCPU's thread; frames that waited in its packet buffer for one)";
    let (mut all, mut held, mut waited) = (0, 0, 0);
    for (_, f) in runs {
        let (a, h) = missed(f);
        all += a;
        held += h;
        waited += nic_count(f, "rx_fifo_held");
    }
    if let [a, h, w, ..] = carried(r, NOTE)[..] {
        all += a;
        held += h;
        waited += w;
    }
    r.checks.retain(|c| c.what != WHAT);
    r.check_none(WHAT, all - held, "frames");
    r.notes.push(format!(
        "{NOTE}: {all}, {held}; {waited}; a hold counts if it lasted {} µs or more (a thread held in a \
         step: the step's unit could run nowhere else; the NIC's bursts of misses laid beside \
         each pCPU's holds, a burst counting within {} µs of a hold's end)",
        hv::sched::HOLD_LOGGED.as_micros(),
        dev::nic::misses::MISS_AFTER_HOLD.as_micros(),
    ));
}

/// The numbers of the note that starts with `prefix`, written by an earlier call for
/// another group of runs of the same record, in order; the note is taken out, for the
/// caller to write again with its own runs added. Empty if there is none.
fn carried(r: &mut Report, prefix: &str) -> Vec<u64> {
    let Some(k) = r.notes.iter().position(|n| n.starts_with(prefix)) else {
        return Vec::new();
    };
    let old = r.notes.remove(k);
    old[prefix.len()..]
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// How often and how long the NIC paused the cable's far end (802.3x) over `runs`, as
/// a note (the frames a pause kept with the sender are not lost, but came late); a later
/// call (another group of runs of the same record) adds to it.
fn link_pauses(r: &mut Report, runs: &[(String, &Finish)]) {
    const NOTE: &str = "the NIC paused the sender at the cable's far end (802.3x flow control, \
        as its packet buffer filled; pauses over all runs, µs paused in all, the longest \
        pause in µs, runs paused)";
    let mut n = [0u64; 4];
    for (_, f) in runs {
        let xoffs = nic_count(f, "rx_xoffs");
        n[0] += xoffs;
        n[1] += nic_count(f, "rx_xoff_us");
        n[2] = n[2].max(nic_count(f, "rx_xoff_longest_us"));
        n[3] += u64::from(xoffs > 0);
    }
    if let [a, b, c, d, ..] = carried(r, NOTE)[..] {
        n = [n[0] + a, n[1] + b, n[2].max(c), n[3] + d];
    }
    r.notes
        .push(format!("{NOTE}: {}, {}, {}, {}", n[0], n[1], n[2], n[3]));
}

/// Whose a run's losses were, as its counters tell: the NIC's frames dropped for want
/// of a buffer (`rx_missed`), how many of them fell in the host's holds of a pCPU's
/// thread, the longest such hold (in a step, or between the idle loop's looks), and the
/// longest a device's engine waited to run.
fn loss_cause(f: &Finish) -> String {
    let mut away = (0u64, "");
    let mut in_step = (0u64, "");
    let mut wait = 0u64;
    for (comp, name, v) in &f.counters.entries {
        match name.as_str() {
            "longest_away_us" if *v > away.0 => away = (*v, comp),
            "longest_step_hold_us" if *v > in_step.0 => in_step = (*v, comp),
            "longest_wait_us" if is_device_unit(comp) => wait = wait.max(*v),
            _ => {}
        }
    }
    let (all, held) = missed(f);
    let waited = nic_count(f, "rx_fifo_held");
    let (xoffs, longest_xoff) = (nic_count(f, "rx_xoffs"), nic_count(f, "rx_xoff_longest_us"));
    let hold = |(us, on): (u64, &str)| match us {
        0 => "none".to_string(),
        _ => format!("{us} µs ({on})"),
    };
    format!(
        "the NIC had no buffer for {all} frames, {held} of them while the host held a pCPU, \
         and {waited} waited in its packet buffer until one came or their wait ran out; it \
         paused the sender {xoffs} times, the longest {longest_xoff} µs; the host's longest hold \
         in a step: {}, between steps: {}; a device's engine waited {wait} µs at most",
        hold(in_step),
        hold(away)
    )
}

/// The most a device's engine may wait to run once woken, at the 99th percentile and
/// at most (issue 58): a NIC's 1024 descriptors at the papers' frame rates last a few
/// milliseconds, and hardware does not wait for a CPU at all.
pub(crate) const DEVICE_WAIT_P99_US: u64 = 50;
pub(crate) const DEVICE_WAIT_MAX_US: u64 = 1000;

/// Whether a unit the scheduler accounts (`pcpu<n> <name>`) is a device's engine: the
/// NIC's, the far end of a TCP cable, the SV-NIC's engines and block service.
fn is_device_unit(comp: &str) -> bool {
    comp.split_once(' ').is_some_and(|(p, name)| {
        p.starts_with("pcpu")
            && (name.starts_with("nic") || name == "tcp-peer" || name.starts_with("svnic"))
    })
}

/// The scheduler's part of a machine's counters (each pCPU's and each unit's, `pcpu<n>
/// ...`): what [`device_waits`] reads, kept per run without the rest.
pub(crate) fn sched_part(c: &Counters) -> Counters {
    let mut part = Counters::default();
    for (comp, name, v) in c.entries.iter().filter(|e| e.0.starts_with("pcpu")) {
        part.add(comp, name, *v);
    }
    part
}

/// The worst wait to run of any device's engine over `runs`: its 99th percentile (as
/// the scheduler's histogram bounds it) and its longest, net of the time the host held
/// the pCPU that ran it off its core meanwhile (the measure: the host's time is
/// reported apart), as checks of the record (each worst value replaces a check of the
/// same claim from an earlier call); the same waits with the host's time in, and how
/// often an idle pCPU ran an engine while its own pCPU was busy, as a note. The net
/// waits keep a hold the host made in another unit's step (the idle loop alone sees a
/// hold as it happens); the records' pCPU counters (`stolen_us`, `longest_away_us`) say
/// how much the host took.
pub(crate) fn device_waits(r: &mut Report, runs: &[(String, &Counters)]) {
    let mut p99 = (0u64, String::new());
    let mut max = (0u64, String::new());
    let (mut gross_p99, mut gross_max) = (0u64, 0u64);
    let (mut stolen, mut steps, mut covered, mut any) = (0u64, 0u64, 0u64, false);
    let (mut rung, mut rung_us, mut longest_rung) = (0u64, 0u64, 0u64);
    let (mut timer, mut timer_us, mut longest_timer) = (0u64, 0u64, 0u64);
    let mut before = (0u64, String::new());
    let mut worst_run = None;
    for (k, (label, c)) in runs.iter().enumerate() {
        for (comp, name, v) in &c.entries {
            if comp.starts_with("pcpu") && !comp.contains(' ') {
                match name.as_str() {
                    "covered" => covered += v,
                    "rung_wakes" => rung += v,
                    "rung_wake_us" => rung_us += v,
                    "longest_rung_wake_us" => longest_rung = longest_rung.max(*v),
                    "timer_wakes" => timer += v,
                    "timer_late_us" => timer_us += v,
                    "longest_timer_late_us" => longest_timer = longest_timer.max(*v),
                    _ => {}
                }
            }
            if !is_device_unit(comp) {
                continue;
            }
            any = true;
            let at = || format!("{label}, {comp}");
            match name.as_str() {
                "wait_p99_net_us" if *v > p99.0 => p99 = (*v, at()),
                "longest_wait_net_us" if *v > max.0 => {
                    max = (*v, at());
                    worst_run = Some(k);
                }
                "longest_wait_net_before_us" if *v > before.0 => before = (*v, at()),
                "wait_p99_us" => gross_p99 = gross_p99.max(*v),
                "longest_wait_us" => gross_max = gross_max.max(*v),
                "stolen" => stolen += v,
                "steps" => steps += v,
                _ => {}
            }
        }
    }
    if !any {
        return;
    }
    let mut put = |what: &str, (v, at): (u64, String), limit: u64| {
        let what = format!("{what} (worst run: {at})");
        let prefix = what
            .split(" (worst run")
            .next()
            .unwrap_or_default()
            .to_string();
        let old = r.checks.iter().position(|c| c.what.starts_with(&prefix));
        if let Some(k) = old {
            if r.checks[k].value >= v as f64 {
                return;
            }
            r.checks.remove(k);
        }
        r.check(&what, v as f64, "µs", &format!("≤ {limit}"), v <= limit);
    };
    put(
        "a device engine's wait to run once woken, net of the host's holds, 99th percentile",
        p99,
        DEVICE_WAIT_P99_US,
    );
    put(
        "a device engine's longest wait to run once woken, net of the host's holds",
        max,
        DEVICE_WAIT_MAX_US,
    );
    let window = if before.1.is_empty() {
        // Runs that kept no waits from before their window (not the harness's).
        "waits counted from each run's measured window on".to_string()
    } else {
        format!(
            "waits counted over each run's measured window and the drain after it, as the \
             CPU per packet is: before it, through the machine's start and warm-up (the \
             lab's thread building and booting it on the same cores), the longest net wait \
             was {} µs ({})",
            before.0, before.1
        )
    };
    long_steps(r, runs);
    if let Some(k) = worst_run {
        r.notes.push(beside_longest_wait(&runs[k].0, runs[k].1));
    }
    r.notes.push(format!(
        "devices' engines: {stolen} of {steps} steps run by an idle pCPU while their own was \
         busy (work stealing); their waits with the host's holds in: 99th percentile \
         {gross_p99} µs, longest {gross_max} µs (worst run); {covered} turns of vCPUs and \
         engines run by an idle pCPU while the host held their own off its core; {rung} \
         wake-ups of a sleeping pCPU by the host, {rung_us} µs from ring to run in all, the \
         longest {longest_rung} µs, and {timer} at its timer, {timer_us} µs late in all, the \
         longest {longest_timer} µs (each a hold of the host's, past {gap} µs kept apart \
         from the net waits); {window}",
        gap = hv::sched::HOST_GAP.as_micros()
    ));
}

/// What a device's longest wait could have waited behind, in the run it came from: the
/// longest steps of that run's units (a wait lasts at least until a step on its pCPU
/// ends, unless an idle one takes it) and the longest host holds each pCPU saw in a step
/// and off its idle loop. The counters keep no time line, so this bounds rather than
/// traces the wait.
fn beside_longest_wait(label: &str, c: &Counters) -> String {
    let mut steps: Vec<(u64, &str)> = c
        .entries
        .iter()
        .filter(|(comp, name, _)| comp.contains(' ') && name == "longest_step_us")
        .map(|(comp, _, v)| (*v, comp.as_str()))
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    let steps: Vec<String> = steps
        .iter()
        .take(3)
        .map(|(v, comp)| format!("{comp} {v} µs"))
        .collect();
    let holds: Vec<String> = c
        .entries
        .iter()
        .filter(|(comp, name, _)| {
            comp.starts_with("pcpu")
                && !comp.contains(' ')
                && (name == "longest_step_hold_us" || name == "longest_away_us")
        })
        .map(|(comp, name, v)| {
            let what = if name == "longest_step_hold_us" {
                "in a step"
            } else {
                "off its idle loop"
            };
            format!("{comp} {v} µs {what}")
        })
        .collect();
    format!(
        "beside the longest net wait (run {label}): that run's longest steps {}; the host's \
         longest holds {} (a wait is net of the holds its own accounting saw; these bound \
         what else it could have waited behind)",
        steps.join(", "),
        holds.join(", ")
    )
}

/// The steps over `runs` that ran past [`hv::sched::LONG_STEP`], as a note: a step is
/// the scheduling latency its unit imposes on its pCPU's others (a device's engine
/// among them), bounded by the unit's budget (a kernel's poll takes at most a NAPI
/// budget of frames from a ring, a device's engine one batch); one past it is work past
/// the budget or a hold of the thread, which the thread's clock shows as the host's
/// unless the VM's hypervisor made it (a paused vCPU's thread's clock runs on).
fn long_steps(r: &mut Report, runs: &[(String, &Counters)]) {
    let (mut long, mut all, mut dev_long, mut dev_all) = (0u64, 0u64, 0u64, 0u64);
    let mut longest = (0u64, String::new());
    let mut held = 0u64;
    for (label, c) in runs {
        for (comp, name, v) in &c.entries {
            let unit = comp
                .split_once(' ')
                .is_some_and(|(p, _)| p.starts_with("pcpu"));
            match name.as_str() {
                "longest_step_hold_us" => held = held.max(*v),
                _ if !unit => {}
                "steps" if is_device_unit(comp) => dev_all += v,
                "long_steps" if is_device_unit(comp) => dev_long += v,
                "steps" => all += v,
                "long_steps" => long += v,
                "longest_step_us" if *v > longest.0 => longest = (*v, format!("{label}, {comp}")),
                _ => {}
            }
        }
    }
    if all + dev_all == 0 {
        return;
    }
    let ms = hv::sched::LONG_STEP.as_millis();
    r.notes.push(format!(
        "steps longer than {ms} ms: vCPUs' {long} of {all}, devices' engines' {dev_long} of \
         {dev_all}; the longest {} µs ({}); the longest hold of a pCPU's thread its clock \
         showed in a step {held} µs. A vCPU's step is one poll of its kernel, an engine's \
         one batch, each with a budget of frames: a longer one is work past the budget or a \
         hold of its thread, which the thread's clock does not show when the VM's \
         hypervisor paused the vCPU under it",
        longest.0, longest.1
    ));
}

/// Whether `c` is one of [`device_waits`]' checks: a scheduling bound, judged in the
/// records (quiet machine, several rounds), which a test run beside other tests on a
/// shared host cannot hold to.
#[cfg(test)]
pub(crate) fn is_device_wait_check(c: &crate::report::Check) -> bool {
    c.what.starts_with("a device engine's") && c.what.contains("wait to run")
}

/// P(X ≥ k) for X ~ Binomial(n, ½): the chance of `k` or more wins in `n` fair tosses.
pub(crate) fn sign_test_p(k: usize, n: usize) -> f64 {
    let mut c = 1.0f64; // C(n, 0)
    let mut tail = 0.0;
    for i in 0..=n {
        if i >= k {
            tail += c;
        }
        c = c * (n - i) as f64 / (i + 1) as f64;
    }
    tail / 2f64.powi(n as i32)
}

/// How many runs [`alternate`] makes over `groups` in `runs` rounds (the progress line's
/// plan).
pub(crate) fn steps<G, C>(runs: usize, groups: &[(G, Vec<C>)]) -> u64 {
    (runs * groups.iter().map(|(_, cs)| cs.len()).sum::<usize>()) as u64
}

/// Rounds that alternate configurations, the papers' way of taking ratios on a noisy
/// machine: in each of `runs` rounds, every group (a message size, a phase) runs each
/// of its configurations once, back to back, in the order given, and the order is
/// reversed every other round, so that no configuration always follows the same one.
/// The progress line names the round and `label(group, configuration)`.
///
/// Returns what `one` gave, by group, then configuration, one per round in order: the
/// per-round pairs that ratios and sign tests are taken over.
pub(crate) fn alternate<G, C, T>(
    runs: usize,
    groups: &[(G, Vec<C>)],
    label: impl Fn(&G, &C) -> String,
    one: impl FnMut(&G, &C) -> Result<T, Error>,
) -> Result<Vec<Vec<Vec<T>>>, Error> {
    let reversed = |round: usize, n: usize| -> Vec<usize> {
        if round % 2 == 1 {
            (0..n).rev().collect()
        } else {
            (0..n).collect()
        }
    };
    alternate_by(runs, groups, reversed, label, one)
}

/// [`alternate`], the order of a group's `n` configurations in round `round` given by
/// `order` (a permutation of `0..n`): for an experiment whose method keeps one
/// configuration in place (paper 000's pv machine last in every round).
pub(crate) fn alternate_by<G, C, T>(
    runs: usize,
    groups: &[(G, Vec<C>)],
    order: impl Fn(usize, usize) -> Vec<usize>,
    label: impl Fn(&G, &C) -> String,
    mut one: impl FnMut(&G, &C) -> Result<T, Error>,
) -> Result<Vec<Vec<Vec<T>>>, Error> {
    let mut out: Vec<Vec<Vec<T>>> = groups
        .iter()
        .map(|(_, cs)| cs.iter().map(|_| Vec::with_capacity(runs)).collect())
        .collect();
    for round in 0..runs {
        for ((g, cs), got) in groups.iter().zip(out.iter_mut()) {
            for c in order(round, cs.len()) {
                crate::progress::step(format_args!(
                    "{} · {}",
                    crate::progress::round(round, runs),
                    label(g, &cs[c])
                ));
                got[c].push(one(g, &cs[c])?);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_that_missed(all: u64, held: u64) -> Finish {
        let mut counters = Counters::default();
        counters.add("nic", "rx_missed", all);
        counters.add("nic", "rx_missed_in_host_holds", held);
        counters.add("nic", "rx_fifo_held", 100 + all);
        Finish {
            frames_sent: 100,
            messages_sent: 100,
            messages_received: 100 - all,
            corrupt: 0,
            counters,
        }
    }

    /// The record names, beside the longest device wait, the run it came from, that
    /// run's longest steps (longest first) and each pCPU's longest host holds, so that a
    /// reader sees what the wait could have been behind.
    #[test]
    fn the_longest_device_wait_is_shown_beside_its_runs_longest_steps_and_holds() {
        let mut quiet = Counters::default();
        quiet.add("pcpu1 nic1", "longest_wait_net_us", 40);
        quiet.add("pcpu1 guest-v0", "longest_step_us", 9000);
        let mut worst = Counters::default();
        worst.add("pcpu1 nic1", "longest_wait_net_us", 2500);
        worst.add("pcpu1 guest-v0", "longest_step_us", 2400);
        worst.add("pcpu0 xen0-v0", "longest_step_us", 300);
        worst.add("pcpu1 nic1", "longest_step_us", 20);
        worst.add("pcpu0 tcp-peer", "longest_step_us", 5);
        worst.add("pcpu1", "longest_step_hold_us", 70);
        worst.add("pcpu1", "longest_away_us", 11);
        let mut r = Report::new("t", "t", "t");
        device_waits(
            &mut r,
            &[("quiet".into(), &quiet), ("pv 32".into(), &worst)],
        );
        let note = r
            .notes
            .iter()
            .find(|n| n.starts_with("beside the longest net wait"))
            .expect("note");
        assert!(note.contains("(run pv 32)"), "{note}");
        assert!(
            note.contains("pcpu1 guest-v0 2400 µs, pcpu0 xen0-v0 300 µs, pcpu1 nic1 20 µs;"),
            "{note}"
        );
        assert!(
            !note.contains("9000") && !note.contains("tcp-peer"),
            "{note}"
        );
        assert!(
            note.contains("pcpu1 70 µs in a step")
                && note.contains("pcpu1 11 µs off its idle loop"),
            "{note}"
        );
    }

    /// An experiment that pins its thread to one core leaves the caller's thread, and so
    /// every later experiment and the processes it starts, on the cores it had.
    #[test]
    fn an_experiment_that_pins_its_thread_leaves_the_callers_cores_as_they_were() {
        let before = mem::cpu::allowed_cores().expect("affinity");
        assert!(!before.is_empty());
        let seen = isolated("pins", || {
            mem::cpu::pin_current_thread(before[0]).expect("pin");
            mem::cpu::allowed_cores().expect("affinity")
        })
        .expect("spawned")
        .expect("returned");
        assert_eq!(
            seen,
            vec![before[0]],
            "the experiment's own thread was pinned"
        );
        assert_eq!(mem::cpu::allowed_cores().expect("affinity"), before);
        // A panic comes back as the experiment's failure, not the caller's.
        assert!(isolated("panics", || panic!("an experiment's bug"))
            .expect("spawned")
            .is_err());
    }

    /// Frames the NIC missed while the host held a pCPU are reported apart; the check
    /// fails on any other, and a second group of runs of the same record adds to it.
    #[test]
    fn missed_frames_outside_the_hosts_holds_fail_the_record_and_add_up() {
        let mut r = Report::new("t", "t", "t");
        let (a, b) = (run_that_missed(30, 30), run_that_missed(5, 2));
        let lost = account_losses(&mut r, [("a".to_string(), &a)].into_iter());
        assert_eq!(lost, 30);
        let what = |r: &Report| {
            let c: Vec<_> = r
                .checks
                .iter()
                .filter(|c| c.what.starts_with("frames the NIC had no buffer"))
                .collect();
            assert_eq!(c.len(), 1);
            (c[0].value, c[0].met)
        };
        assert_eq!(what(&r), (0.0, true));
        account_losses(&mut r, [("b".to_string(), &b)].into_iter());
        assert_eq!(what(&r), (3.0, false));
        let note: Vec<_> = r
            .notes
            .iter()
            .filter(|n| n.starts_with("the NIC had no buffer for (frames"))
            .collect();
        assert_eq!(note.len(), 1);
        assert!(note[0].contains(": 35, 32; 235;"), "{}", note[0]);
    }

    /// The NIC's pauses of the sender add up over the groups of runs of one record, in
    /// one note: counts and time in all, the longest pause the longest of any run.
    #[test]
    fn the_pauses_of_the_sender_add_up_over_every_group_of_runs() {
        let paused = |xoffs: u64, us: u64, longest: u64| {
            let mut f = run_that_missed(0, 0);
            f.counters.add("nic", "rx_xoffs", xoffs);
            f.counters.add("nic", "rx_xoff_us", us);
            f.counters.add("nic", "rx_xoff_longest_us", longest);
            f
        };
        let mut r = Report::new("t", "t", "t");
        let (a, b, c) = (
            paused(3, 9000, 5000),
            paused(0, 0, 0),
            paused(1, 7000, 7000),
        );
        account_losses(
            &mut r,
            [("a".to_string(), &a), ("b".to_string(), &b)].into_iter(),
        );
        account_losses(&mut r, [("c".to_string(), &c)].into_iter());
        let note: Vec<_> = r
            .notes
            .iter()
            .filter(|n| n.starts_with("the NIC paused the sender"))
            .collect();
        assert_eq!(note.len(), 1);
        assert!(note[0].ends_with("): 4, 16000, 7000, 2"), "{}", note[0]);
    }

    /// Every configuration runs once a round, in the given order and then reversed, and
    /// its results come back under it in round order; an error stops the rounds.
    #[test]
    fn rounds_alternate_the_order_and_keep_each_configurations_results_apart() {
        let groups = [("small", vec!['a', 'b', 'c']), ("big", vec!['d', 'e'])];
        let mut seen = Vec::new();
        let got = alternate(
            3,
            &groups,
            |g, c| format!("{g} {c}"),
            |g, c| {
                seen.push(*c);
                Ok(format!("{g}{c}{}", seen.len()))
            },
        )
        .expect("runs");
        assert_eq!(steps(3, &groups), 15);
        assert_eq!(seen.iter().collect::<String>(), "abcdecbaedabcde");
        assert_eq!(got[0][1], ["smallb2", "smallb7", "smallb12"]);
        assert_eq!(got[1][0], ["bigd4", "bigd10", "bigd14"]);
        // An order of the experiment's own: the first two swap, the rest keep their place.
        let mut seen = String::new();
        let swap = |round: usize, n: usize| -> Vec<usize> {
            let mut o: Vec<usize> = (0..n).collect();
            if round % 2 == 1 {
                o.swap(0, 1);
            }
            o
        };
        alternate_by(
            2,
            &groups[..1],
            swap,
            |_, _| String::new(),
            |_, c| {
                seen.push(*c);
                Ok(())
            },
        )
        .expect("runs");
        assert_eq!(seen, "abcbac");
        let mut n = 0;
        let stopped = alternate(
            2,
            &groups,
            |_, _| String::new(),
            |_, c| {
                n += 1;
                if *c == 'b' {
                    Err(Error::other("no machine"))
                } else {
                    Ok(())
                }
            },
        );
        assert!(stopped.is_err());
        assert_eq!(n, 2, "nothing runs after the failure");
    }

    #[test]
    fn the_sign_test_is_the_binomial_tail() {
        assert_eq!(sign_test_p(0, 10), 1.0);
        assert!((sign_test_p(10, 10) - 1.0 / 1024.0).abs() < 1e-12);
        // P(X ≥ 12 | n = 15) = (455 + 105 + 15 + 1) / 32768.
        assert!((sign_test_p(12, 15) - 576.0 / 32768.0).abs() < 1e-12);
        assert_eq!(sign_test_p(1, 0), 0.0);
    }
}
