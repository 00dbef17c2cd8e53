//! Paper 002 §VI-A's host-side times: what a guest's VIF driver spends to send one small
//! message (the paper's PCI write into the board's memory) and to receive one (its copy
//! out of the VIF's receive queue), timed on the TSC as the paper did.
//!
//! The VIF driver's calls are timed here outside a running machine, in batches, so that
//! no clock read sits on the data path of the machines Figures 7 to 10 measure: a device
//! memory domain holds `n` VIFs' regions, each granted to its own guest domain and mapped
//! there, as the controller domain sets them up. For each VIF in turn, the guest sends a
//! batch of 64-byte frames ([`VifFront::send`]: the frame into its send slot, the length,
//! the producer index, the doorbell) and the device side takes them; then the device
//! places a batch in the receive queue and the guest takes each ([`VifFront::recv`]: the
//! index, the length, the copy into the guest's buffer, the consumer index). Only the
//! guest's calls are inside the clock; every byte of every frame is checked after it.

use std::sync::Arc;

use dev::svnic::vif::{VifDevice, VifFront, VifRegion, MAX_FRAME, SLOTS, VIF_PAGES};
use dev::wire::Doze;
use hv::{Domain, DomainConfig, HvConfig, Hypervisor, OwnPage};
use mem::cpu::rdtsc;
use mem::MappedPage;

use crate::chart::{Lines, Series};
use crate::stats::Stats;
use crate::{Error, Mode, Report};

/// The paper's small message.
const FRAME: usize = 64;
/// Frames per timed batch: half a queue, so a batch never waits for room.
const BATCH: usize = SLOTS as usize / 2;
/// The paper's times at one VIF, in µs ("little variation" at 8 and 32).
const PAPER_RECV_US: f64 = 9.42;
const PAPER_SEND_US: f64 = 14.47;

/// `n` VIFs, each in the device's memory and mapped by a guest of its own: the device's
/// ends and the guests' ends.
type Ends = (Vec<VifDevice<OwnPage>>, Vec<VifFront<MappedPage>>);

fn vifs(n: usize, doorbell: &Arc<Doze>) -> Result<(Arc<Hypervisor>, Ends), Error> {
    let hv = Hypervisor::new(HvConfig {
        frames: 2 * (VIF_PAGES * n + 64 * n + 256) as u32,
        ..HvConfig::default()
    })?;
    // A grant for each page of each region, as the machine's SV-NIC has, the table's
    // frames out of the device's own memory.
    let grant_frames = (VIF_PAGES * n).div_ceil(512) as u32 + 1;
    let device = hv.create_domain(&DomainConfig {
        name: "svnic".into(),
        pages: (VIF_PAGES * n) as u32 + 2 * grant_frames + 64,
        grant_frames,
        ..Default::default()
    })?;
    let (mut devs, mut fronts) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        let guest: Arc<Domain> = hv.create_domain(&DomainConfig {
            name: format!("guest{i}"),
            pages: 64,
            map_slots: VIF_PAGES as u32,
            ..Default::default()
        })?;
        let region = VifRegion::create(&device, guest.id()).map_err(Error::other)?;
        let dev = VifDevice::new(region.device_pages(&device).map_err(Error::other)?)
            .map_err(Error::other)?;
        let (pages, _handles) = region
            .map_in_guest(&hv, &guest, device.id(), 0)
            .map_err(Error::other)?;
        devs.push(dev);
        fronts.push(VifFront::new(pages).with_doorbell(Some(Arc::clone(doorbell))));
    }
    Ok((hv, (devs, fronts)))
}

/// The `k`th message of a run: its number in the first bytes, then bytes that follow
/// from it, so a frame from another slot or a stale one shows.
fn message(k: u64) -> [u8; FRAME] {
    let mut out = [0u8; FRAME];
    out[..8].copy_from_slice(&k.to_le_bytes());
    for (j, b) in out[8..].iter_mut().enumerate() {
        *b = (k as usize).wrapping_mul(131).wrapping_add(j * 7) as u8;
    }
    out
}

/// Per-message ns of each timed batch, each way, and the frames that came out wrong.
#[derive(Debug, Default)]
struct Times {
    send: Vec<f64>,
    recv: Vec<f64>,
    bad: u64,
    messages: u64,
}

/// The device's side of a batch on VIF `vif`, messages from `k` on: take the guest's
/// sends and check each, then place the same messages in its receive queue. The frames
/// that came out wrong.
fn device_batch(dev: &mut VifDevice<OwnPage>, k: u64) -> Result<u64, Error> {
    let mut slot = [0u8; MAX_FRAME];
    let mut bad = 0;
    for m in k..k + BATCH as u64 {
        match dev.tx.take(&mut slot).map_err(Error::other)? {
            Some(len) if len == FRAME && slot[..FRAME] == message(m) => {}
            _ => bad += 1,
        }
    }
    for m in k..k + BATCH as u64 {
        let seq = dev.rx.reserve().map_err(Error::other)?;
        let seq = seq.ok_or_else(|| Error::other("a receive queue was full"))?;
        dev.rx.fill(seq, &message(m)).map_err(Error::other)?;
        while !dev.rx.publish(seq, FRAME).map_err(Error::other)? {
            std::hint::spin_loop();
        }
    }
    Ok(bad)
}

/// `rounds` rounds over `n` VIFs, each VIF a batch each way in turn (and a first round
/// not kept); every frame of every round is checked. The device's side runs on a thread
/// of its own, on another core where there is one, as the engines do: the lines of a
/// slot it read are in its core's cache, not the guest's, when the guest writes again.
fn measure(n: usize, rounds: usize) -> Result<Times, Error> {
    let doorbell = Arc::new(Doze::default());
    let (_hv, (mut devs, mut fronts)) = vifs(n, &doorbell)?;
    let scale = hv::time::tsc_scale();
    let cores = mem::cpu::online_cores();
    let (to_dev, work) = std::sync::mpsc::channel::<(usize, u64)>();
    let (to_guest, done) = std::sync::mpsc::channel::<Result<u64, Error>>();
    std::thread::scope(|sc| {
        sc.spawn(move || {
            if cores > 1 {
                let _ = mem::cpu::pin_current_thread(1);
            }
            for (vif, k) in work {
                if to_guest.send(device_batch(&mut devs[vif], k)).is_err() {
                    break;
                }
            }
        });
        // The guest's side on a thread of its own too, so that the caller's thread
        // keeps its affinity.
        let guest = sc.spawn(move || -> Result<Times, Error> {
            if cores > 1 {
                let _ = mem::cpu::pin_current_thread(0);
            }
            let mut t = Times::default();
            let mut got = vec![[0u8; FRAME]; BATCH];
            let mut k = 0u64;
            // The first round warms the caches, the TLB and the core's clock; not kept.
            for round in 0..=rounds {
                if round == 1 {
                    t.send.clear();
                    t.recv.clear();
                }
                for (vif, front) in fronts.iter_mut().enumerate() {
                    let frames: Vec<[u8; FRAME]> = (k..k + BATCH as u64).map(message).collect();
                    // Send: the guest's calls alone inside the clock.
                    let t0 = rdtsc();
                    for f in &frames {
                        front.send(f).map_err(Error::other)?;
                    }
                    let ticks = rdtsc().wrapping_sub(t0);
                    t.send.push(scale.ns(ticks) as f64 / BATCH as f64);
                    to_dev.send((vif, k)).map_err(Error::other)?;
                    t.bad += done.recv().map_err(Error::other)??;
                    // Receive: the device placed the batch; the guest's calls are timed.
                    let t0 = rdtsc();
                    for g in got.iter_mut() {
                        if front.recv(g).map_err(Error::other)? != Some(FRAME) {
                            t.bad += 1;
                        }
                    }
                    let ticks = rdtsc().wrapping_sub(t0);
                    t.recv.push(scale.ns(ticks) as f64 / BATCH as f64);
                    t.bad += frames.iter().zip(&got).filter(|(f, g)| f != g).count() as u64;
                    t.messages += 2 * BATCH as u64;
                    k += BATCH as u64;
                }
            }
            drop(to_dev);
            Ok(t)
        });
        guest
            .join()
            .map_err(|_| Error::other("the guest's side panicked"))?
    })
}

/// The VIF counts and rounds of a run.
fn plan(mode: Mode) -> (&'static [usize], usize) {
    match mode {
        Mode::Full => (&[1, 8, 32], 400),
        Mode::Quick => (&[1, 8, 32], 100),
        Mode::Smoke => (&[1, 8], 2),
    }
}

/// Steps this adds to the progress plan.
pub fn steps(mode: Mode) -> u64 {
    plan(mode).0.len() as u64
}

/// Adds the host-side send and receive times at 1, 8 and 32 VIFs to `rep`.
pub fn host_times(rep: &mut Report, mode: Mode) -> Result<(), Error> {
    let (ns, rounds) = plan(mode);
    rep.setup.push_str(&format!(
        " Host-side send and receive (§VI-A): a guest's VIF driver's calls for {FRAME}-byte \
         messages, timed on the TSC in batches of {BATCH} outside a running machine, over \
         {ns:?} VIFs taken in turn, {rounds} rounds."
    ));
    let group = "§VI-A: host-side time per 64-byte message, the guest's VIF driver";
    let (mut send_med, mut recv_med, mut bad, mut messages) = (vec![], vec![], 0, 0);
    let (mut send_line, mut recv_line) = (vec![], vec![]);
    for &n in ns {
        crate::progress::step(format_args!("host-side send and receive · {n} VIFs"));
        let t = measure(n, rounds)?;
        let paper = |us: f64| format!("paper: {us} µs at 1 VIF, little variation at 8 and 32");
        rep.row(group, &format!("send ({n} VIFs)"), "ns", &t.send)
            .reference = Some(paper(PAPER_SEND_US));
        rep.row(group, &format!("receive ({n} VIFs)"), "ns", &t.recv)
            .reference = Some(paper(PAPER_RECV_US));
        let (s, r) = (Stats::of(&t.send).median, Stats::of(&t.recv).median);
        send_med.push(s);
        recv_med.push(r);
        send_line.push((n as f64, s));
        recv_line.push((n as f64, r));
        bad += t.bad;
        messages += t.messages;
    }
    rep.check_none(
        &format!("host-side times: frames out wrong, of {messages} sent and received"),
        bad,
        "frames",
    );
    // The paper's point: unlike interrupt virtualization, which grows 5.8× from 1 to 32
    // VIFs without the sidecore, the guest's own send and receive do not grow.
    for (what, med) in [("send", &send_med), ("receive", &recv_med)] {
        let grows = med.last().copied().unwrap_or(f64::NAN) / med[0];
        rep.check(
            &format!(
                "host-side {what} per message does not grow with VIFs ({} VIFs' median ÷ 1 \
                 VIF's; paper: little variation)",
                ns.last().copied().unwrap_or(1)
            ),
            grows,
            "× 1 VIF's",
            "≤ 1.5",
            grows.is_finite() && grows <= 1.5,
        );
    }
    rep.notes.push(format!(
        "Host-side times (§VI-A): the paper's {PAPER_SEND_US} µs send is a PCI write across \
         the bus into the IXP2400's SDRAM and its {PAPER_RECV_US} µs receive a copy out of \
         host memory, both in Linux's driver. pvio's VIF queues are host memory granted to the \
         guest: a send is non-temporal stores into the slot (posted, as a bus write is, the \
         line not read first) and a receive a copy out of the slot the device just wrote, so \
         each takes tens to a couple of hundred nanoseconds; the absolute times cannot be had \
         without the board's bus. What is checked is the paper's shape, that they do not grow \
         with the VIFs. The send is dearest at one VIF: the device's core has just read the \
         slot's lines, and the stores must take them back from its cache; with more VIFs they \
         have left it."
    ));
    rep.lines.push(Lines {
        name: "host-side".into(),
        title: "§VI-A: the guest's send and receive per 64-byte message against VIFs".into(),
        x_unit: "VIFs".into(),
        unit: "ns".into(),
        series: vec![
            Series {
                label: "send".into(),
                points: send_line,
            },
            Series {
                label: "receive".into(),
                points: recv_line,
            },
        ],
    });
    Ok(())
}
