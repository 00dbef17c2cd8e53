//! `bench netif-ceiling`: how many packets per second the netif path itself can carry,
//! netback → netfront (guest RX) and netfront → netback (guest TX), with both peers
//! polling on their own cores and no NIC, bridge or stack in the way (issue 3).
//!
//! The path is the real one: netback grant-copies each RX packet into a page the guest
//! posted and granted, netfront checks every response, revokes the grant, builds a
//! packet buffer with the first bytes copied to its head and reposts a page; on TX,
//! netfront grants each page read-only, netback checks every request on a copy, copies
//! short packets and grant-maps long ones (an mmap), and answers once the buffer is
//! freed. The source side builds a fresh frame in a fresh buffer for every packet; the
//! sink frees what it receives (DPDK's `txonly` / `rxonly`).
//!
//! The reference is DPDK 22.11 vhost-user ↔ virtio-user on this machine, one core
//! each, as the issue gives it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hv::{DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
use mem::cpu::pin_current_thread;
use net::netback::{self, VIF_WINDOW_SLOTS};
use net::netfront::RxBuffers;
use net::skb::{SkbPool, NET_SKB_PAD};
use net::toolstack::{self, VifSpec};
use net::wire::UdpFramer;

use crate::platform::flow;
use crate::{Experiment, LabError, Mode, Report};

/// The registry entry.
pub const EXPERIMENT: Experiment = Experiment {
    id: "netif-ceiling",
    title: "netif data-path ceiling: packets/s netback ↔ netfront, peers polling",
    paper: "issue 3 (reference: DPDK 22.11 vhost-user ↔ virtio-user)",
    run,
};

/// Frame sizes (whole Ethernet frames).
const FRAMES: [usize; 2] = [64, 1500];
/// DPDK's rates on this machine, Mpps, per direction and frame size.
const DPDK: [(Dir, usize, f64); 4] = [
    (Dir::Rx, 64, 16.6),
    (Dir::Rx, 1500, 8.1),
    (Dir::Tx, 64, 19.7),
    (Dir::Tx, 1500, 10.6),
];
/// Packets the source keeps queued ahead of netback's RX action.
const RX_AHEAD: usize = 128;
/// The peers' per-poll budget (NAPI's 64).
const BUDGET: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// netback → netfront.
    Rx,
    /// netfront → netback.
    Tx,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Rx => "guest RX (netback → netfront)",
            Dir::Tx => "guest TX (netfront → netback)",
        }
    }
}

/// One run's outcome.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    /// Packets delivered per second of wall time.
    pps: f64,
    /// Busy (work-finding) time per packet on the driver domain's side and the guest's,
    /// ns: the side whose busy time fills its core is the bottleneck.
    busy_drv_ns: f64,
    busy_guest_ns: f64,
}

fn other(e: impl std::fmt::Display) -> LabError {
    LabError::Other(e.to_string())
}

/// A frame of exactly `len` bytes: Ethernet, IPv4 and UDP headers and a payload.
fn frame(len: usize) -> Result<Vec<u8>, LabError> {
    let payload = vec![0xa5u8; len - 42];
    let mut out = Vec::new();
    UdpFramer::new(flow())
        .frames(1, &payload, |fr| out = fr.to_vec())
        .map_err(other)?;
    if out.len() != len {
        return Err(other(format!("frame of {} bytes, wanted {len}", out.len())));
    }
    Ok(out)
}

fn pin(core: usize) {
    let _ = pin_current_thread(core % mem::cpu::online_cores().max(1));
}

/// Adds the time of one poll to `busy` if it found work.
fn timed(busy: &mut Duration, f: impl FnOnce() -> usize) -> usize {
    let t = Instant::now();
    let n = f();
    if n > 0 {
        *busy += t.elapsed();
    }
    n
}

/// Runs one direction for `length`, the driver domain's side on core 0 and the guest's
/// on core 1.
fn run_once(
    dir: Dir,
    len: usize,
    length: Duration,
    rx_buffers: RxBuffers,
) -> Result<Run, LabError> {
    let hv = Hypervisor::new(HvConfig {
        frames: 16384,
        grant_path: GrantPath::Optimised,
        ..HvConfig::default()
    })?;
    let dom = |name: &str, driver: bool, slots| {
        hv.create_domain(&DomainConfig {
            name: name.into(),
            pages: 4096,
            grant_frames: 8,
            grant_version: GrantVersion::V2,
            vcpus: 1,
            map_slots: slots,
            driver_domain: driver,
        })
    };
    let drv = dom("drv", true, VIF_WINDOW_SLOTS)?;
    let guest = dom("guest", false, 4)?;
    let spec = VifSpec {
        handle: 0,
        mac: flow().dst_mac,
        rx_buffers,
        index: 0,
    };
    let (mut front, mut vif) = toolstack::plug_vif(&hv, &drv, &guest, spec).map_err(other)?;
    let mut dpool = SkbPool::new(Arc::clone(&drv), 1024, 64).map_err(other)?;
    // Pages for the 256 posted RX buffers and for TX heads of a page each.
    let mut gpool = SkbPool::new(Arc::clone(&guest), 1024, 640).map_err(other)?;
    let bytes = frame(len)?;

    let stop = Arc::new(AtomicBool::new(false));
    let delivered = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(3));
    let drv_side = {
        let (stop, delivered, start, bytes) = (
            Arc::clone(&stop),
            Arc::clone(&delivered),
            Arc::clone(&start),
            bytes.clone(),
        );
        std::thread::spawn(move || -> Result<Duration, LabError> {
            pin(0);
            let mut busy = Duration::ZERO;
            let mut tokens = Vec::with_capacity(netback::MAX_PENDING);
            start.wait();
            let mut got = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match dir {
                    Dir::Rx => {
                        timed(&mut busy, || {
                            let mut n = 0;
                            while vif.rx_queued() < RX_AHEAD {
                                let Ok(s) = dpool.alloc(NET_SKB_PAD) else {
                                    break;
                                };
                                if dpool.put(s, &bytes).is_err() {
                                    dpool.free(s);
                                    break;
                                }
                                vif.start_xmit(&mut dpool, s);
                                n += 1;
                            }
                            n + vif.rx_action(&mut dpool)
                        });
                    }
                    Dir::Tx => {
                        got += timed(&mut busy, || {
                            let n = vif.tx_action(&mut dpool, BUDGET, |p, s| p.free(s));
                            dpool.take_released(|r| tokens.push(r.token));
                            if !tokens.is_empty() {
                                vif.tx_release(tokens.drain(..));
                            }
                            n
                        }) as u64;
                    }
                }
            }
            if dir == Dir::Tx {
                delivered.store(got, Ordering::Relaxed);
            }
            if vif.disabled().is_some() {
                return Err(other(format!("vif disabled: {:?}", vif.disabled())));
            }
            Ok(busy)
        })
    };
    let guest_side = {
        let (stop, delivered, start) = (
            Arc::clone(&stop),
            Arc::clone(&delivered),
            Arc::clone(&start),
        );
        std::thread::spawn(move || -> Result<Duration, LabError> {
            pin(1);
            let mut busy = Duration::ZERO;
            front.refill_rx(&mut gpool);
            start.wait();
            let mut got = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match dir {
                    Dir::Rx => {
                        got += timed(&mut busy, || {
                            front.poll_rx(&mut gpool, BUDGET, |p, s| p.free(s))
                        }) as u64;
                    }
                    Dir::Tx => {
                        timed(&mut busy, || {
                            let mut n = front.poll_tx(&mut gpool);
                            // A frame of either size lies in at most two pages.
                            while n < BUDGET && front.tx_room() >= 2 {
                                // A head of its own page: granted as it is, no
                                // bounce (see `Netfront::xmit`).
                                let Ok(s) = gpool.alloc_page_linear() else {
                                    break;
                                };
                                if gpool.put(s, &bytes).is_err() {
                                    gpool.free(s);
                                    break;
                                }
                                if let Err(s) = front.xmit(&mut gpool, s) {
                                    gpool.free(s);
                                    break;
                                }
                                n += 1;
                            }
                            n
                        });
                    }
                }
            }
            if dir == Dir::Rx {
                delivered.store(got, Ordering::Relaxed);
            }
            if front.is_broken() {
                return Err(other("netfront broke"));
            }
            Ok(busy)
        })
    };
    start.wait();
    let t0 = Instant::now();
    std::thread::sleep(length);
    stop.store(true, Ordering::Relaxed);
    let wall = t0.elapsed();
    let busy_drv = drv_side
        .join()
        .map_err(|_| other("driver side panicked"))??;
    let busy_guest = guest_side
        .join()
        .map_err(|_| other("guest side panicked"))??;
    let n = delivered.load(Ordering::Relaxed).max(1) as f64;
    Ok(Run {
        pps: n / wall.as_secs_f64(),
        busy_drv_ns: busy_drv.as_nanos() as f64 / n,
        busy_guest_ns: busy_guest.as_nanos() as f64 / n,
    })
}

fn run(mode: Mode) -> Result<Report, LabError> {
    let length = match mode {
        Mode::Full => Duration::from_secs(2),
        Mode::Quick => Duration::from_millis(500),
        Mode::Smoke => Duration::from_millis(20),
    };
    let iters = mode.iterations();
    let mut rep = Report::new(EXPERIMENT.id, EXPERIMENT.title, EXPERIMENT.paper);
    rep.setup = format!(
        "One driver domain (netback, core 0) and one guest (netfront, core 1), both polling \
         with a budget of {BUDGET}; grant copy on the optimised path, grant table v2. RX: the \
         driver side builds each frame in a fresh buffer and queues it (≤ {RX_AHEAD} ahead), \
         netback copies it into a posted guest page, netfront checks, revokes, builds and \
         frees. TX: netfront grants and sends fresh buffers, netback checks, copies (≤ 128 B) \
         or maps, and answers when the buffer is freed. {iters} runs of {} ms each.",
        length.as_millis()
    );
    rep.config = serde_json::json!({
        "frames": FRAMES,
        "run_ms": length.as_millis() as u64,
        "iterations": iters,
        "budget": BUDGET,
        "rx_ahead": RX_AHEAD,
        "grant_path": "optimised",
        "cores": [0, 1],
    });
    // DPDK on this machine, measured between pvio's runs, so that each ratio is taken
    // in one run; the issue's figures where it cannot run (and always in smoke tests).
    let pmd = match mode {
        Mode::Smoke => Err("smoke run".to_string()),
        _ => crate::dpdk::TestPmd::prepare(),
    };
    let pmd_secs = if mode == Mode::Full { 3 } else { 2 };
    match &pmd {
        Ok(_) => rep.notes.push(
            "DPDK 22.11 (Debian's dpdk-testpmd) measured in this run: vhost-user on core 0, \
             virtio-user on core 1, one forwarding lcore each, txonly → rxonly; the rate is the \
             receiver's median Rx-pps, one run after each of pvio's."
                .into(),
        ),
        Err(e) => rep.notes.push(format!(
            "DPDK not measured here ({e}): pvio is compared with the issue's figures."
        )),
    }
    for dir in [Dir::Rx, Dir::Tx] {
        for len in FRAMES {
            let mut runs = Vec::with_capacity(iters);
            // Guest RX again with netfront posting linear buffers (no fragments, no
            // head copy), right after each run of the original.
            let mut linear = Vec::new();
            let mut dpdk_mpps = Vec::new();
            for _ in 0..iters {
                runs.push(run_once(dir, len, length, RxBuffers::Fragments)?);
                if dir == Dir::Rx {
                    linear.push(run_once(dir, len, length, RxBuffers::Linear)?);
                }
                if let Ok(p) = &pmd {
                    match p.rate(dir == Dir::Rx, len, pmd_secs) {
                        Ok(r) => dpdk_mpps.push(r / 1e6),
                        Err(e) => rep.notes.push(format!("DPDK {dir:?} {len} B: {e}")),
                    }
                }
            }
            let col = |f: fn(&Run) -> f64| runs.iter().map(f).collect::<Vec<_>>();
            let mpps = col(|r| r.pps / 1e6);
            let issue = DPDK
                .iter()
                .find(|d| d.0 == dir && d.1 == len)
                .map_or(f64::NAN, |d| d.2);
            let group = dir.name();
            let dpdk_name = format!("{len} B frames, DPDK vhost-user ↔ virtio-user");
            let measured = dpdk_mpps.len() == runs.len();
            if measured {
                rep.row(group, &dpdk_name, "Mpps", &dpdk_mpps).reference =
                    Some(format!("issue: {issue} Mpps"));
            }
            let ratio = if measured {
                crate::stats::ratio_median(&mpps, &dpdk_mpps).unwrap_or(f64::NAN)
            } else {
                crate::Stats::of(&mpps).median / issue
            };
            let row = rep.row(group, &format!("{len} B frames, pvio"), "Mpps", &mpps);
            if measured {
                row.ratio = Some((dpdk_name, ratio));
            } else {
                row.reference = Some(format!("DPDK vhost/virtio-user {issue} Mpps (issue)"));
            }
            rep.row(
                group,
                &format!("{len} B: driver-domain side busy per packet"),
                "ns",
                &col(|r| r.busy_drv_ns),
            );
            rep.row(
                group,
                &format!("{len} B: guest side busy per packet"),
                "ns",
                &col(|r| r.busy_guest_ns),
            );
            if !linear.is_empty() {
                let group = "guest RX, netfront without fragments";
                let lcol = |f: fn(&Run) -> f64| linear.iter().map(f).collect::<Vec<_>>();
                let row = rep.row(
                    group,
                    &format!("{len} B frames"),
                    "Mpps",
                    &lcol(|r| r.pps / 1e6),
                );
                row.ratio = crate::stats::ratio_median(&lcol(|r| r.pps), &col(|r| r.pps))
                    .map(|x| ("with fragments".to_string(), x));
                let row = rep.row(
                    group,
                    &format!("{len} B: guest side busy per packet"),
                    "ns",
                    &lcol(|r| r.busy_guest_ns),
                );
                row.ratio = crate::stats::ratio_median(
                    &lcol(|r| r.busy_guest_ns),
                    &col(|r| r.busy_guest_ns),
                )
                .map(|x| ("with fragments".to_string(), x));
            }
            rep.check(
                &format!(
                    "{} {len} B ≥ DPDK{}",
                    if dir == Dir::Rx { "RX" } else { "TX" },
                    if measured {
                        " (same run)"
                    } else {
                        " (issue's figure)"
                    }
                ),
                ratio,
                "× DPDK",
                "≥ 1",
                ratio >= 1.0,
            );
        }
    }
    rep.notes.push(
        "Busy time is the wall time of polls that found work, per packet delivered: the \
         side whose busy time is near 1/rate is the bottleneck; the other waits for it."
            .into(),
    );
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_direction_and_size_carries_packets_and_is_checked_against_dpdk() {
        let rep = run(Mode::Smoke).expect("runs");
        let rates: Vec<_> = rep
            .rows
            .iter()
            .filter(|r| r.name.ends_with("pvio"))
            .collect();
        assert_eq!(rates.len(), 4);
        let linear = rep
            .rows
            .iter()
            .filter(|r| r.group.contains("without fragments") && r.unit == "Mpps")
            .count();
        assert_eq!(linear, 2, "guest RX without fragments at both sizes");
        assert!(rates.iter().all(|r| r.stats.median > 0.0), "{rates:?}");
        assert_eq!(rep.checks.len(), 4);
    }

    #[test]
    fn frames_have_the_asked_length() {
        for len in FRAMES {
            assert_eq!(frame(len).expect("frame").len(), len);
        }
    }
}
