//! Paper 000 §3.4.1, Figure 4: what the relative alignment of a copy's source and
//! destination costs, for the copies a received packet takes, and what netback's aligned
//! copies save on the PV path.
//!
//! Three measurements:
//! 1. **By relative offset** `r = (dst − src) mod 64`, 0..63, for the copies that matter:
//!    the grant copy of a 1514-byte frame (`GNTTABOP_copy` from a driver-domain frame
//!    into a guest's granted page, in batches of 32 as netback issues them), the guest
//!    kernel's copy of a 1472-byte payload to the application (`Domain::copy`, what
//!    `recv` does), warm and cold, and glibc's `memcpy` on ordinary memory as the
//!    reference. The source sits where the NIC driver puts a frame (offset 66:
//!    `NET_SKB_PAD + NET_IP_ALIGN`), the destination in the first cache line of its page,
//!    as netback's choice of offset places it. The paper's three bars are classes of `r`:
//!    different word alignment, same word but different cache-line alignment, same cache
//!    line.
//! 2. **4 KiB aliasing**: source and destination at the same offset modulo 4096 against
//!    the same cache-line offset 64 bytes and 2 KiB apart.
//! 3. **The PV path**: `pv` machines at the paper's load with netback's copies original
//!    and aligned, back to back in each round: the alignment the path's copies actually
//!    have (netback's and the guest stack's byte counts by class) and what the switch
//!    saves, as paired differences within each round.

use std::hint::black_box;
use std::sync::Arc;

use hv::counters::CopyAlign;
use hv::profile::GlobalClass;
use hv::{
    CopyPtr, Domain, DomainConfig, Gfn, GrantCopy, GrantRef, HvConfig, Hypervisor, PAGE_SIZE,
};
use mem::cpu::thread_cpu_time;
use net::netback::VifStats;
use net::stack::StackStats;

use crate::chart::{Bar, Lines, Series, StackedBars};
use crate::harness::{
    account_losses, alternate, durations, one_run, sign_test_p, Durations, RunCost,
};
use crate::{Error, Experiment, Report, Stats};
use rig::udp::{Config, Finish, Options};

/// The registry entry.
pub const EXPERIMENT: Experiment = Experiment {
    id: "santos08-fig4",
    title: "Copy cost by source/destination alignment, and aligned copies on the PV path",
    paper: "000 Santos et al. 2008, Fig. 4 (§3.4.1)",
    run,
};

/// Where the NIC driver's received frame starts in its page (`NET_SKB_PAD +
/// NET_IP_ALIGN`), the grant copy's source offset.
const SRC: usize = net::skb::NET_SKB_PAD + net::skb::NET_IP_ALIGN;
/// A full frame, what netback copies.
const FRAME: usize = 1514;
/// A full frame's UDP payload, what `recv` copies.
const PAYLOAD: usize = 1472;
/// Copies per grant-copy hypercall, as netback batches a burst of frames.
const BATCH: usize = 32;
/// Pages in the cold working set of each side: 4 MiB, beyond the L2 of this machine's
/// cores, so each copy reads and writes lines that are not in the core's caches.
const COLD_PAGES: usize = 1024;

/// The paper's classes of relative offset.
fn class(r: usize) -> CopyAlign {
    CopyAlign::of(0, r)
}

fn class_name(c: CopyAlign) -> &'static str {
    match c {
        CopyAlign::Unaligned => "different word alignment",
        CopyAlign::Word => "same word, different cache-line alignment",
        CopyAlign::Line => "same cache-line alignment",
    }
}

/// CPU time per call of `f`, in ns, over `n` calls.
fn per_call(n: u64, mut f: impl FnMut(u64)) -> f64 {
    let t0 = thread_cpu_time();
    for i in 0..n {
        f(i);
    }
    (thread_cpu_time() - t0).as_nanos() as f64 / n as f64
}

/// A driver domain and a guest: source frames of the driver domain filled with a
/// pattern, guest pages granted to it writable, and guest pages for the guest's own
/// copy.
struct Bench {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    guest: Arc<Domain>,
    src: Vec<Gfn>,
    refs: Vec<GrantRef>,
    gsrc: Vec<Gfn>,
    gdst: Vec<Gfn>,
}

impl Bench {
    fn new() -> Result<Self, Error> {
        let hv = Hypervisor::new(HvConfig {
            frames: 4 * COLD_PAGES as u32 + 2048,
            grant_path: hv::GrantPath::Optimised,
            ..HvConfig::default()
        })?;
        let dom = |name: &str, driver_domain| DomainConfig {
            name: name.into(),
            pages: 2 * COLD_PAGES as u32 + 256,
            grant_frames: 8,
            grant_version: hv::GrantVersion::V2,
            driver_domain,
            ..Default::default()
        };
        let drv = hv.create_domain(&dom("drv", true))?;
        let guest = hv.create_domain(&dom("guest", false))?;
        let mut b = Self {
            hv,
            drv,
            guest,
            src: Vec::new(),
            refs: Vec::new(),
            gsrc: Vec::new(),
            gdst: Vec::new(),
        };
        for i in 0..COLD_PAGES {
            let s = b.drv.alloc_page().map_err(Error::other)?;
            b.drv
                .fill(s, 0, PAGE_SIZE, i as u8 | 1)
                .map_err(Error::other)?;
            b.src.push(s);
            let g = b.guest.alloc_page().map_err(Error::other)?;
            let r = b
                .guest
                .grant_table()
                .alloc_ref()
                .ok_or_else(|| Error::other("no grant reference"))?;
            b.guest
                .grant_table()
                .grant_access(r, b.drv.id(), g, false)
                .map_err(Error::other)?;
            b.refs.push(r);
            b.gdst.push(g);
        }
        // Source pages for the guest's own copy (a received frame's page), apart from
        // the granted pages it copies into.
        for i in 0..COLD_PAGES / 2 {
            let g = b.guest.alloc_page().map_err(Error::other)?;
            b.guest
                .fill(g, 0, PAGE_SIZE, i as u8 | 3)
                .map_err(Error::other)?;
            b.gsrc.push(g);
        }
        Ok(b)
    }

    /// ns per grant copy of `len` bytes from offset `s` of driver-domain frames to
    /// offset `d` of granted guest pages, cycling over `pages` pairs in batches of
    /// [`BATCH`].
    fn grant_copy(&self, s: usize, d: usize, len: usize, pages: usize, calls: u64) -> f64 {
        let gid = self.guest.id();
        let lists: Vec<Vec<GrantCopy>> = (0..pages.div_ceil(BATCH))
            .map(|k| {
                (0..BATCH)
                    .map(|i| {
                        let p = (k * BATCH + i) % pages;
                        GrantCopy {
                            source: CopyPtr::Local {
                                gfn: self.src[p],
                                offset: s as u16,
                            },
                            dest: CopyPtr::Gref {
                                dom: gid,
                                gref: self.refs[p],
                                offset: d as u16,
                            },
                            len: len as u16,
                        }
                    })
                    .collect()
            })
            .collect();
        let mut st = vec![Ok(()); BATCH];
        let mut failed = 0;
        let ns = per_call(calls, |i| {
            let l = &lists[i as usize % lists.len()];
            failed += BATCH - self.hv.grant_copy(&self.drv, l, &mut st);
        });
        assert_eq!(failed, 0, "a grant copy failed in the benchmark");
        ns / BATCH as f64
    }

    /// ns per copy of `len` bytes between two of the guest's own pages (its kernel's
    /// copy to the application), cycling over `pages` pairs.
    fn guest_copy(&self, s: usize, d: usize, len: usize, pages: usize, n: u64) -> f64 {
        let pages = pages.min(self.gsrc.len());
        let mut failed = false;
        let ns = per_call(n, |i| {
            let p = i as usize % pages;
            failed |= self
                .guest
                .copy(self.gsrc[p], s, self.gdst[p], d, black_box(len))
                .is_err();
        });
        assert!(!failed, "a guest copy failed in the benchmark");
        ns
    }
}

/// A page-aligned page of ordinary memory.
#[repr(C, align(4096))]
struct AlignedPage([u8; PAGE_SIZE]);

/// ns per glibc `memcpy` of `len` bytes between two page-aligned pages of ordinary
/// memory, from offset `s` to offset `d`; both warm.
fn memcpy_ns(s: usize, d: usize, len: usize, n: u64) -> f64 {
    let src = Box::new(AlignedPage([7u8; PAGE_SIZE]));
    let mut dst = Box::new(AlignedPage([0u8; PAGE_SIZE]));
    per_call(n, |_| {
        dst.0[d..d + len].copy_from_slice(black_box(&src.0[s..s + len]));
        black_box(&mut dst);
    })
}

/// The kinds of copy swept over relative offsets.
#[derive(Clone, Copy)]
enum Kind {
    GrantWarm,
    GrantCold,
    GuestWarm,
    GuestCold,
    Memcpy,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::GrantWarm,
        Kind::GrantCold,
        Kind::GuestWarm,
        Kind::GuestCold,
        Kind::Memcpy,
    ];
    fn name(self) -> String {
        match self {
            Kind::GrantWarm => format!("grant copy {FRAME} B, warm"),
            Kind::GrantCold => format!("grant copy {FRAME} B, cold"),
            Kind::GuestWarm => format!("guest copy to user {PAYLOAD} B, warm"),
            Kind::GuestCold => format!("guest copy to user {PAYLOAD} B, cold"),
            Kind::Memcpy => format!("glibc memcpy {FRAME} B, warm (reference)"),
        }
    }
    fn measure(self, b: &Bench, s: usize, d: usize, ops: u64) -> f64 {
        match self {
            Kind::GrantWarm => b.grant_copy(s, d, FRAME, BATCH, ops / BATCH as u64),
            Kind::GrantCold => b.grant_copy(s, d, FRAME, COLD_PAGES, ops / BATCH as u64),
            Kind::GuestWarm => b.guest_copy(s, d, PAYLOAD, 1, ops),
            Kind::GuestCold => b.guest_copy(s, d, PAYLOAD, COLD_PAGES, ops),
            Kind::Memcpy => memcpy_ns(s, d, FRAME, ops),
        }
    }
}

/// The destination offset for relative offset `r` from [`SRC`]: in the first cache line
/// of the page, as an aligned netback would choose it.
fn dst_for(r: usize) -> usize {
    (SRC + r) % 64
}

/// What runs where, for the record.
fn setup(iters: usize, ops: u64, d: &Durations) -> String {
    format!(
        "Copies by relative offset r = (dst − src) mod 64, source at offset {SRC} (where the NIC \
         driver receives a frame), destination in the first cache line of its page. Grant copy: \
         GNTTABOP_copy of a {FRAME}-byte frame from a driver-domain frame into a granted guest \
         page, batches of {BATCH}, v2 grants, optimised path, warm (the batch's {BATCH} page \
         pairs) and cold (cycling over {COLD_PAGES} pairs, 8 MiB). Guest copy: the guest \
         kernel's copy of a {PAYLOAD}-byte payload between two of its pages (recv's), warm and \
         cold. Both move bytes with pvio's byte-wise atomic copy (one `rep movsb`); glibc \
         memcpy on ordinary memory is the reference. {iters} iterations of {ops} copies per \
         point, offsets interleaved within an iteration; values are CPU ns per copy. PV path: \
         pv machines (driver domain on core 0, guest on core 1, the paper's original set-up \
         otherwise) at {:.0} frames/s, netback's copies original then aligned (order swapped \
         every round), {} rounds of {} ms after {} ms warm-up.",
        Options::paper(Config::Pv, 0).rate,
        d.runs,
        d.window.as_millis(),
        d.warmup.as_millis()
    )
}

/// The aliasing cases: (label, source offset, destination offset).
const ALIAS_CASES: [(&str, usize, usize); 3] = [
    ("same offset mod 4096 (src 66 → dst 66)", SRC, SRC),
    ("same line offset, 64 B ahead (66 → 130)", SRC, SRC + 64),
    ("same line offset, 2 KiB apart (66 → 2114)", SRC, SRC + 2048),
];
/// The kinds that can express them.
const ALIAS_KINDS: [Kind; 3] = [Kind::GrantWarm, Kind::GuestWarm, Kind::Memcpy];

/// The offset sweep (`sweep[kind][r]`) and the aliasing cases (`alias[kind][case]`),
/// each a list of per-iteration ns.
type Sweeps = (Vec<Vec<Vec<f64>>>, Vec<Vec<Vec<f64>>>);

/// The configuration a record names: the copy sweeps' iterations, copies and layout
/// (source offset, frame and payload sizes, grant-copy batch, the cold working set),
/// and the PV path's runs.
#[derive(Debug, serde::Serialize)]
struct Recorded {
    mode: String,
    iterations: usize,
    ops: u64,
    src_offset: usize,
    frame: usize,
    payload: usize,
    batch: usize,
    cold_pages: usize,
    pv_runs: usize,
    pv_window_ms: u64,
}

fn run(cx: &crate::Context) -> Result<Report, Error> {
    let mode = cx.mode;
    let mut rep = Report::new(EXPERIMENT.id, EXPERIMENT.title, EXPERIMENT.paper);
    let iters = mode.iterations();
    let ops = mode.scale(8192).max(BATCH as u64 * 2);
    let d = durations(cx);
    rep.setup = setup(iters, ops, &d);
    rep.set_config(&Recorded {
        mode: format!("{mode:?}"),
        iterations: iters,
        ops,
        src_offset: SRC,
        frame: FRAME,
        payload: PAYLOAD,
        batch: BATCH,
        cold_pages: COLD_PAGES,
        pv_runs: d.runs,
        pv_window_ms: d.window.as_millis() as u64,
    });

    let (sweep, alias) = sweeps(iters, ops)?;
    sweep_rows(&mut rep, &sweep, iters);
    alias_rows(&mut rep, &alias);
    pv_path(&mut rep, cx)?;
    Ok(rep)
}

/// Every kind of copy at every relative offset, and the aliasing cases, offsets
/// interleaved within each iteration.
fn sweeps(iters: usize, ops: u64) -> Result<Sweeps, Error> {
    // 1. The sweep: sweep[kind][r] = per-iteration ns.
    let b = Bench::new()?;
    let mut sweep: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); 64]; Kind::ALL.len()];
    // 2. Aliasing: (label, src, dst) per kind that can express it.
    let mut alias: Vec<Vec<Vec<f64>>> =
        vec![vec![Vec::new(); ALIAS_CASES.len()]; ALIAS_KINDS.len()];
    for _ in 0..iters {
        // Offsets interleaved within the iteration, so slow drift is shared.
        for r in 0..64 {
            for (kind, per_r) in Kind::ALL.iter().zip(&mut sweep) {
                per_r[r].push(kind.measure(&b, SRC, dst_for(r), ops));
            }
        }
        for (k, kind) in ALIAS_KINDS.iter().enumerate() {
            for (c, &(_, s, dst)) in ALIAS_CASES.iter().enumerate() {
                alias[k][c].push(kind.measure(&b, s, dst, ops));
            }
        }
    }
    drop(b);

    Ok((sweep, alias))
}

/// Each kind's cost by alignment class, at netback's original placement and at the
/// dearest offset; Figure 4's bars and the offsets' lines.
fn sweep_rows(rep: &mut Report, sweep: &[Vec<Vec<f64>>], iters: usize) {
    // Per iteration, each class's median over its offsets.
    let class_series = |k: usize, c: CopyAlign| -> Vec<f64> {
        (0..iters)
            .map(|i| {
                let v: Vec<f64> = (0..64)
                    .filter(|&r| class(r) == c)
                    .map(|r| sweep[k][r][i])
                    .collect();
                Stats::of(&v).median
            })
            .collect()
    };
    let mut bars = Vec::new();
    for (k, kind) in Kind::ALL.iter().enumerate() {
        let group = format!("fig4 {}", kind.name());
        let line = class_series(k, CopyAlign::Line);
        for c in [CopyAlign::Unaligned, CopyAlign::Word, CopyAlign::Line] {
            let v = class_series(k, c);
            let row = rep.row(&group, class_name(c), "ns/copy", &v);
            if c != CopyAlign::Line {
                row.ratio =
                    crate::stats::ratio_median(&v, &line).map(|x| ("same cache line".into(), x));
            }
            if matches!(kind, Kind::GrantWarm | Kind::GrantCold) && c == CopyAlign::Unaligned {
                row.reference = Some("paper: about 2× the same-cache-line copy".into());
            }
        }
        let orig = &sweep[k][(64 - SRC % 64) % 64];
        let row = rep.row(
            &group,
            &format!(
                "netback's original placement (r = {})",
                (64 - SRC % 64) % 64
            ),
            "ns/copy",
            orig,
        );
        row.ratio = crate::stats::ratio_median(orig, &line).map(|x| ("same cache line".into(), x));
        let worst = (0..64)
            .max_by(|&a, &c| {
                Stats::of(&sweep[k][a])
                    .median
                    .total_cmp(&Stats::of(&sweep[k][c]).median)
            })
            .unwrap_or(0);
        let row = rep.row(
            &group,
            &format!("dearest offset (r = {worst})"),
            "ns/copy",
            &sweep[k][worst],
        );
        row.ratio = crate::stats::ratio_median(&sweep[k][worst], &line)
            .map(|x| ("same cache line".into(), x));
        if matches!(kind, Kind::GrantWarm | Kind::GrantCold) {
            bars.extend(
                [CopyAlign::Unaligned, CopyAlign::Word, CopyAlign::Line].map(|c| Bar {
                    label: format!(
                        "{} {}",
                        if matches!(kind, Kind::GrantWarm) {
                            "warm"
                        } else {
                            "cold"
                        },
                        match c {
                            CopyAlign::Unaligned => "diff. word",
                            CopyAlign::Word => "same word",
                            CopyAlign::Line => "same line",
                        }
                    ),
                    segments: vec![("grant copy".into(), Stats::of(&class_series(k, c)).median)],
                }),
            );
        }
    }
    rep.charts.push(StackedBars {
        name: "fig4".into(),
        title: format!("Figure 4: grant copy of a {FRAME}-byte frame by alignment class"),
        unit: "ns per copy".into(),
        bars,
    });
    rep.lines.push(Lines {
        name: "fig4-offsets".into(),
        title: "Copy cost by relative offset (dst − src) mod 64".into(),
        x_unit: "relative offset (bytes)".into(),
        unit: "ns per copy".into(),
        series: Kind::ALL
            .iter()
            .enumerate()
            .map(|(k, kind)| Series {
                label: kind.name(),
                points: (0..64)
                    .map(|r| (r as f64, Stats::of(&sweep[k][r]).median))
                    .collect(),
            })
            .collect(),
    });
    let worst_ratio = Kind::ALL
        .iter()
        .enumerate()
        .map(|(k, _)| {
            crate::stats::ratio_median(
                &class_series(k, CopyAlign::Unaligned),
                &class_series(k, CopyAlign::Line),
            )
            .unwrap_or(0.0)
        })
        .fold(0.0, f64::max);
    rep.notes.push(format!(
        "misalignment on this CPU: a copy with different word alignment costs at most {worst_ratio:.2}× \
         the same-cache-line copy (median over iterations, worst of the five kinds); the paper \
         measured about 2× on its 2007 Xeon"
    ));
}

/// The 4 KiB aliasing cases against two copies 2 KiB apart.
fn alias_rows(rep: &mut Report, alias: &[Vec<Vec<f64>>]) {
    for (k, kind) in ALIAS_KINDS.iter().enumerate() {
        let group = format!("fig4 4 KiB aliasing, {}", kind.name());
        let base = alias[k][2].clone();
        for (c, &(label, _, _)) in ALIAS_CASES.iter().enumerate() {
            let row = rep.row(&group, label, "ns/copy", &alias[k][c]);
            if c != 2 {
                row.ratio = crate::stats::ratio_median(&alias[k][c], &base)
                    .map(|x| ("2 KiB apart".into(), x));
            }
        }
    }
}

/// One PV run's alignment census and costs.
struct PvRun {
    cost: RunCost,
    finish: Finish,
}

/// Whose copies a census counts: netback's grant copies into the guest, or the guest
/// stack's copies to the application.
#[derive(Debug, Clone, Copy)]
enum Copier {
    Netback,
    Stack,
}

impl PvRun {
    fn census(&self, who: Copier, c: CopyAlign) -> u64 {
        let counters = &self.finish.counters;
        match who {
            Copier::Netback => counters.sum(|v: &VifStats| v.rx_copy_bytes.get(c)),
            Copier::Stack => counters.sum(|s: &StackStats| s.usercopy_bytes.get(c)),
        }
    }
    fn share(&self, who: Copier, c: CopyAlign) -> f64 {
        let all: u64 = CopyAlign::ALL.iter().map(|&k| self.census(who, k)).sum();
        100.0 * self.census(who, c) as f64 / all.max(1) as f64
    }
}

fn pv_path(rep: &mut Report, cx: &crate::Context) -> Result<(), Error> {
    let d = durations(cx);
    let sizes = [(1472usize, "1500"), (48000, "48000")];
    // runs[size][aligned] = per-round runs.
    let groups: Vec<(usize, Vec<bool>)> = sizes
        .iter()
        .map(|&(size, _)| (size, vec![false, true]))
        .collect();
    let got = alternate(
        d.runs,
        &groups,
        |size, &aligned| {
            let copies = if aligned { "aligned" } else { "original" };
            format!("pv path · {size} B · {copies} copies")
        },
        |&size, &aligned| {
            let mut opts = Options::paper(Config::Pv, size);
            opts.driver.aligned_copies = aligned;
            one_run(opts, &d).map(|(cost, finish)| PvRun { cost, finish })
        },
    )?;
    let runs: Vec<[Vec<PvRun>; 2]> = got
        .into_iter()
        .map(|mut by| {
            let aligned = by.pop().unwrap_or_default();
            [by.pop().unwrap_or_default(), aligned]
        })
        .collect();
    let mut lost = 0u64;
    let mut all_line = true;
    for (s, &(_, label)) in sizes.iter().enumerate() {
        let group = format!("pv path, {label} B messages");
        let [orig, al] = &runs[s];
        for (name, v) in [("original", orig), ("aligned", al)] {
            for (who, what) in [
                (Copier::Netback, "netback grant copies"),
                (Copier::Stack, "guest copies to user"),
            ] {
                for c in CopyAlign::ALL {
                    let share: Vec<f64> = v.iter().map(|r| r.share(who, c)).collect();
                    if share.iter().any(|x| *x > 0.0) {
                        rep.row(
                            &group,
                            &format!("{name}: {what}, {}", class_name(c)),
                            "% of bytes",
                            &share,
                        );
                    }
                }
            }
            lost += account_losses(
                rep,
                v.iter().map(|r| (format!("{label} B {name}"), &r.finish)),
            );
        }
        all_line &= al
            .iter()
            .all(|r| r.share(Copier::Netback, CopyAlign::Line) == 100.0);
        for (what, f) in [
            (
                "grant copy (all domains)",
                &(|c: &RunCost| c.global(GlobalClass::GrantCopy)) as &dyn Fn(&RunCost) -> f64,
            ),
            ("guest usercopy", &|c: &RunCost| {
                c.global(GlobalClass::UserCopy)
            }),
            ("total CPU", &|c: &RunCost| c.total_ns),
        ] {
            let o: Vec<f64> = orig.iter().map(|r| f(&r.cost)).collect();
            let a: Vec<f64> = al.iter().map(|r| f(&r.cost)).collect();
            rep.row(&group, &format!("original: {what}"), "ns/pkt", &o);
            let row = rep.row(&group, &format!("aligned: {what}"), "ns/pkt", &a);
            row.ratio = crate::stats::ratio_median(&a, &o).map(|x| ("original".into(), x));
            let saved: Vec<f64> = o.iter().zip(&a).map(|(x, y)| x - y).collect();
            let row = rep.row(
                &group,
                &format!("saved by aligning: {what}"),
                "ns/pkt",
                &saved,
            );
            if what == "total CPU" {
                row.reference = Some("paper 1850 cycles = 617 ns".into());
                let cheaper = saved.iter().filter(|x| **x > 0.0).count();
                rep.notes.push(format!(
                    "{label} B: the aligned PV path cost less in {cheaper} of {} rounds (one-sided \
                     sign test p = {:.3}), median saving {:.0} ns per packet",
                    saved.len(),
                    sign_test_p(cheaper, saved.len()),
                    Stats::of(&saved).median
                ));
            }
        }
    }
    // The profiler's samples land on the scheduler's ticks (ARCHITECTURE §5): one tick's
    // sample is this many ns of a packet's cost over the window.
    let tick_ns = 4e6 / (Options::paper(Config::Pv, 0).rate * d.window.as_secs_f64());
    rep.notes.push(format!(
        "the per-class rows (grant copy, usercopy) are sampled: one 4 ms tick's sample is \
         {tick_ns:.0} ns per packet in a {} ms window, so class differences below that are \
         noise; the total CPU rows come from the vCPU threads' clocks and are exact",
        d.window.as_millis()
    ));
    rep.check(
        "with aligned copies on, every byte netback copies is cache-line aligned with its source",
        if all_line { 100.0 } else { 0.0 },
        "% of runs",
        "100",
        all_line,
    );
    rep.check_none("messages lost or corrupted (pv runs)", lost, "messages");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_covers_every_offset_and_aligned_copies_align_every_byte_on_the_pv_path() {
        let rep = run(&crate::Context::smoke()).expect("runs");
        for kind in Kind::ALL {
            let group = format!("fig4 {}", kind.name());
            for c in CopyAlign::ALL {
                assert!(
                    rep.rows.iter().any(|r| r.group == group
                        && r.name == class_name(c)
                        && r.stats.median > 0.0),
                    "{group}: {}",
                    class_name(c)
                );
            }
        }
        let lines = &rep.lines[0];
        assert_eq!(lines.series.len(), Kind::ALL.len());
        assert!(lines.series.iter().all(|s| s.points.len() == 64));
        // The census is exact: the original path copies every byte misaligned (a frame
        // at 66 to the start of a page), the aligned one none.
        let census = |name: &str| {
            rep.rows
                .iter()
                .find(|r| r.group == "pv path, 1500 B messages" && r.name == name)
                .map(|r| r.stats.median)
        };
        assert_eq!(
            census("original: netback grant copies, different word alignment"),
            Some(100.0)
        );
        assert_eq!(
            census("aligned: netback grant copies, same cache-line alignment"),
            Some(100.0)
        );
        assert!(rep
            .checks
            .iter()
            .any(|c| c.what.contains("cache-line aligned") && c.met));
    }
}
