//! The driver domain's kernel (paper 000 Figure 1): the NIC's driver, the software
//! bridge, and one netback vif per guest.
//!
//! One poll step, in the order Linux runs its softirqs:
//! 1. the NIC's NAPI poll: each received frame goes to [`Bridge::input`] on port 0 and
//!    from there to the vif it is addressed to ([`Vif::start_xmit`] queues it);
//! 2. each vif's RX action copies its queue into the guest's posted buffers;
//! 3. each vif whose guest signalled (or left requests) runs its TX action; each packet
//!    goes to the bridge on the vif's port and out through the NIC, or to another vif;
//! 4. transmit completions: the NIC's TX ring is cleaned, and the guest pages it had
//!    mapped are unmapped and answered ([`Vif::tx_release`]).
//!
//! Bridge port 0 is the NIC; vif `i` is port `i + 1` and names itself `i` in its
//! release tokens.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::time::Instant;

use blk::blkback::{Blkback, FrameAt};
use blk::initiator::Initiator;
use blk::remote::RemoteVbd;
use dev::driver::{DmaApi, NicDriver, VmqBuf};
use dev::nic::{NicRegs, RING_DESCS, RX_QUEUES};
use hv::{Domain, Hypervisor, Port, Vcpu, PAGE_SIZE};
use net::bridge::{Bridge, Forward};
use net::netback::Vif;
use net::skb::{SkbId, SkbPool, NET_SKB_PAD};

use crate::counters::PortKind;
use crate::vcpu::{xen_pirq, Kernel, Work};
use crate::{other, BuildError, Counters, NAPI_BUDGET, POOL_BUFFERS};

/// Pages of its pool (it posts 2 KiB heads to the NIC; pages only for copies).
pub const POOL_PAGES: usize = 640;
/// The bridge port of the NIC.
pub const NIC_PORT: u16 = 0;

/// The bridge port of vif `i`.
pub fn vif_port(i: usize) -> u16 {
    i as u16 + 1
}

/// A fault to inject into a running driver domain's kernel (for the watchdog and the
/// restart, paper 000 §5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// Runs normally.
    None = 0,
    /// The kernel panics in its next poll: its vCPU ends.
    Panic = 1,
    /// The kernel stops making progress in its next poll (as a deadlocked driver
    /// does): its vCPU stays in the kernel, takes no event, and leaves only when its
    /// domain is destroyed.
    Hang = 2,
}

/// Where a machine injects a [`Fault`] into its driver domain.
#[derive(Debug, Clone, Default)]
pub struct FaultSwitch(Arc<AtomicU8>);

impl FaultSwitch {
    /// Injects `f`.
    pub fn inject(&self, f: Fault) {
        self.0.store(f as u8, Ordering::Release);
    }
    fn get(&self) -> u8 {
        self.0.load(Ordering::Relaxed)
    }
}

/// NIC driver, bridge and vifs.
#[derive(Debug)]
pub struct DriverDomain {
    dom: Arc<Domain>,
    fault: FaultSwitch,
    nic: NicDriver,
    pool: SkbPool,
    bridge: Bridge,
    vifs: Vec<Vif>,
    /// The NIC's interrupt ports, by receive queue (queue 0 the default).
    pirqs: Vec<Port>,
    /// Vif `i`'s NIC receive queue, if it has one (direct placement).
    queues: Vec<Option<usize>>,
    /// Vif `i`'s guest signalled since its last TX action.
    signalled: Vec<bool>,
    /// Release tokens of freed foreign fragments, for the vifs to answer.
    tokens: Vec<u32>,
    /// Frames a vif's TX action sent to another vif, delivered after it.
    between_vifs: Vec<(SkbId, Forward)>,
    /// Frames for vifs with a NIC queue, sent into it through the NIC's loopback
    /// after the poll that found them (by queue).
    to_queues: Vec<(SkbId, usize)>,
    /// The large frames each vif's NIC queue was last told to take whole.
    queue_gso: Vec<u32>,
    /// Frames flooded to more than one port that could not be copied.
    flood_copy_failures: u64,
    /// The bridge copies aggregates (LRO without BO).
    lro_bridge_copy: bool,
    /// Aggregates the bridge copied, and those it could not (dropped).
    lro_copied: u64,
    lro_copy_failures: u64,
    /// The clock at the last poll (for LRO's hold limit).
    now: Duration,
    /// Virtual block devices served from backing files (blkback).
    vbds: Vec<Blkback>,
    /// Vbd `i`'s front end signalled since it was last served.
    vbd_signalled: Vec<bool>,
    /// Remote virtual block devices (AoE through the NIC; the host-centric RVBD), by
    /// their initiators' tag prefix.
    remote: Vec<RemoteVbd>,
    /// Remote device `i`'s front end signalled.
    remote_signalled: Vec<bool>,
    /// The MAC the remote devices' initiators send from.
    aoe_mac: [u8; 6],
    /// A received AoE frame's head, copied out to be judged.
    aoe_head: Box<[u8]>,
    /// AoE frames taken off the NIC for no remote device, or not whole in their
    /// buffer.
    aoe_unclaimed: u64,
    /// AoE frames the NIC had no room for (the initiator sends them again).
    aoe_tx_full: u64,
}

/// The driver domain's switches: paper 000's original driver domain by default, and
/// the software optimisations of its §3.4 and §4 one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverConfig {
    /// The bridge's netfilter hooks (§3.4.2: 1550 cycles a packet in the paper).
    pub netfilter: bool,
    /// netback's guest-RX copies start at the source's offset in its cache line
    /// (§3.4.1, Figure 4).
    pub aligned_copies: bool,
    /// A NIC receive queue per vif, as far as they go, with the NIC writing the guest's
    /// frames into the buffers its netfront posted (§4.3, direct placement).
    pub queues: bool,
    /// **Unsafe, for measurement only**: the paper's stand-in for grant reuse (§4.4).
    /// netback offers to take machine frames in RX requests, and the driver domain's
    /// IOMMU context maps all of machine memory. Never on in `pvio up`.
    pub unsafe_machine_frames: bool,
    /// Large Receive Offload in the NIC driver (paper 001), and its form and flush.
    pub lro: Option<dev::lro::LroSetup>,
    /// The bridge copies each aggregate into a fresh buffer before it goes on (paper
    /// 001's original port, its Figure 2b); off, it hands the chain on untouched and
    /// netback copies each piece into the guest's buffers (the paper's BO).
    pub lro_bridge_copy: bool,
}

impl Default for DriverConfig {
    /// The original: netfilter hooks on, copies to the start of the guest's page, one
    /// NIC queue.
    fn default() -> Self {
        Self {
            netfilter: true,
            aligned_copies: false,
            queues: false,
            unsafe_machine_frames: false,
            lro: None,
            lro_bridge_copy: false,
        }
    }
}

impl DriverDomain {
    /// Probes the NIC behind `regs` (its queues' interrupts on `pirqs`, by queue) and
    /// puts `vifs` on a bridge with the NIC, each vif with the MAC the toolstack gave it
    /// (the only one it may send from), with the bridge and netback set as `config`
    /// says; with `config.queues`, vif `i` gets NIC queue `i + 1` while there are
    /// queues (and interrupt ports) left, the rest share the default queue.
    /// An injected fault (`pvio up --fault`, the restart experiment): a panic now, or a
    /// hang, in which no event is taken and nothing moves until the toolstack destroys
    /// the domain. Returns whether the kernel hung.
    fn take_fault(&self) -> bool {
        match self.fault.get() {
            0 => false,
            1 => panic!("driver domain {}: injected fault", self.dom.id().0),
            _ => {
                while !self.dom.is_dying() && self.fault.get() == Fault::Hang as u8 {
                    std::thread::park_timeout(Duration::from_millis(5));
                }
                true
            }
        }
    }

    /// Step 0, guest queues (direct placement): what the NIC placed goes back to
    /// netback, which answers the guest; the guest's new buffers are mapped and given to
    /// the queue. Returns the packets placed.
    fn poll_guest_queues(&mut self) -> usize {
        let Self {
            nic,
            vifs,
            queues,
            queue_gso,
            ..
        } = self;
        let mut n = 0;
        for ((vif, q), gso) in vifs.iter_mut().zip(queues.iter()).zip(queue_gso.iter_mut()) {
            let Some(q) = *q else {
                continue;
            };
            // The queue takes whole the large frames the guest's netfront takes whole
            // (known once it connects).
            let takes = vif.rx_gso_types();
            if takes != *gso {
                nic.vmq_set_whole(q, takes);
                *gso = takes;
            }
            if nic.vmq_scheduled(q) {
                n += nic.vmq_poll(q, NAPI_BUDGET, |d| vif.rx_direct_filled(d.token, d.fill()));
                vif.rx_direct_flush();
            }
            vif.rx_direct_refill();
            vif.rx_direct_give(|iova, len, token| {
                nic.vmq_post(q, VmqBuf { iova, len, token }).is_ok()
            });
        }
        n
    }

    /// Step 1, the NIC's NAPI poll, through the bridge to the vifs' queues (and what LRO
    /// held past its limit). AoE answers to the remote devices' initiators go to them,
    /// not the bridge (Linux's aoe driver takes its EtherType from the device the same
    /// way). Returns the frames the driver took.
    fn poll_nic(&mut self, at: Instant) -> usize {
        let Self {
            nic,
            pool,
            bridge,
            vifs,
            flood_copy_failures,
            lro_bridge_copy,
            lro_copied,
            lro_copy_failures,
            dom,
            remote,
            aoe_mac,
            aoe_head,
            aoe_unclaimed,
            now,
            queues,
            to_queues,
            ..
        } = self;
        // Flow control: no more descriptors than every vif's queue can take for
        // certain; a full one pauses the poll, and the NIC leaves frames with their
        // sender (`net::netback::flow`).
        let budget = nic_budget(vifs, *now);
        let mut up = |pool: &mut SkbPool, skb: SkbId| {
            if !remote.is_empty() {
                match aoe_input(pool, dom, skb, *aoe_mac, aoe_head, remote, at) {
                    AoeFrame::No => {}
                    AoeFrame::Taken => {
                        pool.free(skb);
                        return;
                    }
                    AoeFrame::Unclaimed => {
                        *aoe_unclaimed += 1;
                        pool.free(skb);
                        return;
                    }
                }
            }
            let skb = if *lro_bridge_copy && pool.offload(skb).gso.is_some() {
                let Some(c) = copy_aggregate(pool, skb) else {
                    *lro_copy_failures += 1;
                    return;
                };
                *lro_copied += 1;
                c
            } else {
                skb
            };
            let fwd = bridge.input(pool, skb, NIC_PORT);
            if !to_vifs(pool, vifs, queues, to_queues, skb, fwd, NIC_PORT) {
                *flood_copy_failures += 1;
            }
        };
        let mut n = 0;
        if nic.napi_scheduled() && budget > 0 {
            n += nic.poll(pool, budget, &mut up);
        }
        nic.lro_expire(pool, &mut up);
        loop_to_queues(nic, pool, to_queues);
        n
    }

    /// Whether the NIC has received frames the driver can take now: its poll is
    /// scheduled and no vif's full queue holds it.
    fn nic_ready(&mut self) -> bool {
        self.nic.napi_scheduled() && nic_budget(&mut self.vifs, self.now) > 0
    }

    /// Step 3, guest TX: each signalled vif's packets through the bridge to the NIC, or
    /// to another vif. Returns the packets taken.
    fn guest_tx(&mut self) -> usize {
        let Self {
            nic,
            pool,
            bridge,
            vifs,
            signalled,
            between_vifs,
            flood_copy_failures,
            queues,
            to_queues,
            ..
        } = self;
        let mut n = 0;
        for i in 0..vifs.len() {
            if !(std::mem::take(&mut signalled[i]) || vifs[i].tx_pending()) {
                continue;
            }
            let from = vif_port(i);
            n += vifs[i].tx_action(pool, NAPI_BUDGET, |pool, skb| {
                match bridge.input(pool, skb, from) {
                    Forward::Port(NIC_PORT) => to_nic(nic, pool, skb),
                    Forward::Drop(_) => pool.free(skb),
                    fwd => between_vifs.push((skb, fwd)),
                }
            });
            for (skb, fwd) in between_vifs.drain(..) {
                if fwd == Forward::Flood {
                    // The NIC takes a flooded frame too: itself when no other vif
                    // does, else a copy.
                    if vifs.len() == 1 {
                        to_nic(nic, pool, skb);
                        continue;
                    }
                    match copy_frame(pool, skb) {
                        Some(c) => to_nic(nic, pool, c),
                        None => *flood_copy_failures += 1,
                    }
                }
                if !to_vifs(pool, vifs, queues, to_queues, skb, fwd, from) {
                    *flood_copy_failures += 1;
                }
            }
            loop_to_queues(nic, pool, to_queues);
        }
        n
    }

    /// Step 4, completions: the NIC's TX ring, then the guests' mapped pages given back
    /// to their vifs. Returns whether a vif whose TX stopped for want of pending entries
    /// (large packets hold many) can go on: it does so without waiting for an event
    /// that may never come, since its front end, its ring full, has nothing new to
    /// signal (Linux's zero-copy callback reschedules the vif's NAPI the same way).
    fn completions(&mut self) -> bool {
        let Self {
            nic,
            pool,
            vifs,
            tokens,
            ..
        } = self;
        nic.clean_tx(pool);
        pool.take_released(|r| tokens.push(r.token));
        let released = !tokens.is_empty();
        if released {
            for vif in vifs.iter_mut() {
                vif.tx_release(tokens.iter().copied());
            }
            tokens.clear();
        }
        released && vifs.iter_mut().any(|v| v.tx_pending())
    }

    /// Step 5, block devices whose guests signalled: each ring's requests up to its
    /// budget; the remote ones' frames out through the NIC. Returns the requests served,
    /// the frames sent, and whether a disk has requests left for the next pass.
    fn serve_disks(&mut self, at: Instant) -> (usize, usize, bool) {
        let Self {
            nic,
            pool,
            vbds,
            vbd_signalled,
            remote,
            remote_signalled,
            aoe_tx_full,
            ..
        } = self;
        let (mut rx, mut tx, mut more) = (0, 0, false);
        // A disk whose serve stopped at its budget is served again at the next pass,
        // after the other devices: its guest's event was taken already.
        for (vbd, sig) in vbds.iter_mut().zip(vbd_signalled.iter_mut()) {
            if std::mem::take(sig) {
                rx += vbd.serve();
                *sig = vbd.pending();
                more |= *sig;
            }
        }
        for (r, sig) in remote.iter_mut().zip(remote_signalled.iter_mut()) {
            if std::mem::take(sig) {
                rx += r.serve();
                *sig = r.pending();
                more |= *sig;
            }
            tx += r.poll(at, |frame| aoe_output(nic, pool, frame, aoe_tx_full));
        }
        (rx, tx, more)
    }

    pub fn new(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        regs: &Arc<NicRegs>,
        pirqs: Vec<Port>,
        config: DriverConfig,
        mut vifs: Vec<(Vif, [u8; 6])>,
        fault: FaultSwitch,
    ) -> Result<Self, BuildError> {
        // Page-mode LRO posts a whole page in every receive descriptor.
        let page_mode = config.lro.is_some_and(|l| l.form == dev::lro::Form::Page);
        let pages = POOL_PAGES + if page_mode { RING_DESCS as usize } else { 0 };
        let mut pool = SkbPool::new(Arc::clone(dom), POOL_BUFFERS, pages).map_err(other)?;
        let mut nic = NicDriver::probe(hv, dom, regs, &mut pool, DmaApi::Swiotlb).map_err(other)?;
        if config.lro.is_some() {
            nic.set_lro(&mut pool, config.lro).map_err(other)?;
        }
        let mut queues = vec![None; vifs.len()];
        if config.queues {
            for (i, (vif, mac)) in vifs.iter_mut().enumerate() {
                let q = i + 1;
                if q >= RX_QUEUES.min(pirqs.len()) {
                    break;
                }
                nic.vmq_open(q, *mac, None).map_err(other)?;
                vif.enable_direct();
                queues[i] = Some(q);
            }
        }
        let mut bridge = Bridge::new(vifs.len() as u16 + 1, config.netfilter);
        for (vif, _) in &mut vifs {
            vif.set_aligned_copies(config.aligned_copies);
        }
        for (i, (_, mac)) in vifs.iter().enumerate() {
            bridge.attach_vif(vif_port(i), *mac);
        }
        let n = vifs.len();
        Ok(Self {
            dom: Arc::clone(dom),
            fault,
            nic,
            pool,
            bridge,
            vifs: vifs.into_iter().map(|v| v.0).collect(),
            pirqs,
            queues,
            signalled: vec![false; n],
            tokens: Vec::with_capacity(POOL_BUFFERS),
            between_vifs: Vec::with_capacity(NAPI_BUDGET),
            to_queues: Vec::with_capacity(NAPI_BUDGET),
            queue_gso: vec![0; n],
            flood_copy_failures: 0,
            lro_bridge_copy: config.lro_bridge_copy,
            lro_copied: 0,
            lro_copy_failures: 0,
            now: Duration::ZERO,
            vbds: Vec::new(),
            vbd_signalled: Vec::new(),
            remote: Vec::new(),
            remote_signalled: Vec::new(),
            aoe_mac: [0; 6],
            aoe_head: vec![0u8; blk::aoe::HEAD].into_boxed_slice(),
            aoe_unclaimed: 0,
            aoe_tx_full: 0,
        })
    }

    /// Serves these remote devices too, their initiators sending from `mac` through
    /// the NIC; device `i`'s initiator must have tag prefix `i`.
    pub fn attach_remote(&mut self, remote: Vec<RemoteVbd>, mac: [u8; 6]) {
        self.remote_signalled = vec![true; remote.len()];
        self.remote = remote;
        self.aoe_mac = mac;
    }

    /// Serves these block devices too (each already connected to its guest).
    pub fn attach_vbds(&mut self, vbds: Vec<Blkback>) {
        self.vbd_signalled = vec![true; vbds.len()];
        self.vbds = vbds;
    }

    /// Adaptive interrupt moderation in the NIC driver, on or off.
    pub fn set_adaptive_coalescing(&mut self, on: bool) {
        self.nic.set_adaptive(on);
    }

    fn lro_counters(&self, c: &mut Counters) {
        if let Some(l) = self.nic.lro() {
            c.add_set("lro", l.stats());
            c.add_set("lro engine", l.engine_stats());
            c.add_set("lro wait us", l.seg_wait());
            c.add("lro", "bridge_copied", self.lro_copied);
            c.add("lro", "bridge_copy_failures", self.lro_copy_failures);
        }
    }

    /// The vifs, in port order.
    pub fn vifs(&self) -> &[Vif] {
        &self.vifs
    }
}

/// A copy of `skb` in a fresh buffer of the pool (for a flood to more than one port).
fn copy_frame(pool: &mut SkbPool, skb: SkbId) -> Option<SkbId> {
    let mut frame = [0u8; net::wire::MAX_TAGGED_FRAME];
    let len = pool.len(skb);
    if len > frame.len() || pool.read(skb, 0, &mut frame[..len]).is_err() {
        return None;
    }
    let c = pool.alloc(NET_SKB_PAD).ok()?;
    if pool.put(c, &frame[..len]).is_err() {
        pool.free(c);
        return None;
    }
    pool.set_csum_valid(c, pool.csum_valid(skb));
    Some(c)
}

/// A copy of an aggregate (a packet in several buffers) in fresh buffers: a whole page
/// as its head and further pages as fragments, each byte copied once from page to page
/// (Linux's `skb_linearize` before the bridge, paper 001's Figure 2b; pvio's pages are
/// not contiguous with each other, and the copy is what costs). `skb` is freed.
fn copy_aggregate(pool: &mut SkbPool, skb: SkbId) -> Option<SkbId> {
    let len = pool.len(skb);
    let npages = len.div_ceil(PAGE_SIZE).max(1);
    if npages > net::skb::MAX_SKB_FRAGS + 1 {
        pool.free(skb);
        return None;
    }
    let mut pages = [hv::Gfn(0); net::skb::MAX_SKB_FRAGS + 1];
    let Ok(c) = pool.alloc_page_linear() else {
        pool.free(skb);
        return None;
    };
    pages[0] = pool.data_location(c).0;
    let mut got = 1;
    while got < npages {
        match pool.alloc_page() {
            Ok(g) => pages[got] = g,
            Err(_) => break,
        }
        got += 1;
    }
    let dom = Arc::clone(pool.domain());
    let copied = got == npages
        && pool
            .walk(skb, 0, len, |seg, at| {
                let net::skb::SegPage::Own(src) = seg.page else {
                    return Err(net::skb::SkbError::OutOfBounds);
                };
                let mut done = 0;
                while done < seg.len {
                    let to = at + done;
                    let n = (seg.len - done).min(PAGE_SIZE - to % PAGE_SIZE);
                    dom.copy(
                        src,
                        seg.offset + done,
                        pages[to / PAGE_SIZE],
                        to % PAGE_SIZE,
                        n,
                    )?;
                    done += n;
                }
                Ok(())
            })
            .is_ok();
    let off = pool.offload(skb);
    pool.free(skb);
    let mut ok = copied && pool.extend_linear(c, len.min(PAGE_SIZE)).is_ok();
    for (k, &g) in pages.iter().enumerate().take(got).skip(1) {
        let frag = net::skb::Frag {
            page: net::skb::FragPage::Local(g),
            offset: 0,
            len: (len - k * PAGE_SIZE).min(PAGE_SIZE) as u16,
        };
        if !ok || pool.add_frag(c, frag).is_err() {
            pool.free_page(g);
            ok = false;
        }
    }
    if !ok {
        pool.free(c);
        return None;
    }
    pool.set_offload(c, off);
    Some(c)
}

/// What became of a received frame offered to the remote devices.
enum AoeFrame {
    /// Not an AoE frame for their MAC: the bridge's.
    No,
    /// Handed to the device its tag names.
    Taken,
    /// For their MAC but for no device, or not whole in its buffer: dropped.
    Unclaimed,
}

/// Offers `skb` to the remote devices: an AoE frame for their MAC goes to the device
/// its tag names (its head copied out, its sectors placed from the buffer); the caller
/// frees it unless it is [`AoeFrame::No`].
fn aoe_input(
    pool: &SkbPool,
    dom: &Domain,
    skb: SkbId,
    mac: [u8; 6],
    head: &mut [u8],
    remote: &mut [RemoteVbd],
    now: Instant,
) -> AoeFrame {
    let len = pool.len(skb);
    let (gfn, off) = pool.data_location(skb);
    let n = len.min(head.len()).min(pool.linear_len(skb));
    if n < blk::aoe::AOE_HEADER_END || dom.read(gfn, off, &mut head[..n]).is_err() {
        return AoeFrame::No;
    }
    if head[12..14] != blk::aoe::ETHERTYPE.to_be_bytes() || head[..6] != mac {
        return AoeFrame::No;
    }
    // Not whole in its head buffer: not a frame the NIC wrote for us.
    if pool.linear_len(skb) != len {
        return AoeFrame::Unclaimed;
    }
    let i = Initiator::tag_prefix_of(&head[..n]).map_or(usize::MAX, usize::from);
    let Some(r) = remote.get_mut(i) else {
        return AoeFrame::Unclaimed;
    };
    let at = FrameAt::Page { gfn, offset: off };
    // Answers never send; a send asked for now goes with the next poll.
    let _ = r.input(&head[..n], len, at, now, |_| false);
    AoeFrame::Taken
}

/// Sends an initiator's frame through the NIC: a fresh buffer, the frame copied in;
/// false if there was no buffer or no room on the ring (it is sent again later).
fn aoe_output(nic: &mut NicDriver, pool: &mut SkbPool, frame: &[u8], full: &mut u64) -> bool {
    let Ok(skb) = pool.alloc(NET_SKB_PAD) else {
        *full += 1;
        return false;
    };
    if pool.put(skb, frame).is_err() {
        pool.free(skb);
        *full += 1;
        return false;
    }
    match nic.xmit(pool, skb) {
        Ok(()) => true,
        Err(s) => {
            pool.free(s);
            *full += 1;
            false
        }
    }
}

/// Hands a frame to the NIC (a full TX ring drops it).
/// The NAPI budget a poll of the NIC may use: [`NAPI_BUDGET`] descriptors, or fewer
/// where a vif's queue has room for fewer (0: a full one holds the poll).
fn nic_budget(vifs: &mut [Vif], now: Duration) -> usize {
    vifs.iter_mut()
        .filter_map(|v| v.rx_room(now))
        .fold(NAPI_BUDGET, usize::min)
}

fn to_nic(nic: &mut NicDriver, pool: &mut SkbPool, skb: SkbId) {
    if let Err(s) = nic.xmit(pool, skb) {
        pool.free(s);
    }
}

/// Sends the frames gathered for vifs with a NIC queue into their queues through the
/// NIC's loopback (a frame the ring has no room for is dropped, as the NIC drops one
/// its queue has no room for).
fn loop_to_queues(nic: &mut NicDriver, pool: &mut SkbPool, to_queues: &mut Vec<(SkbId, usize)>) {
    for (skb, q) in to_queues.drain(..) {
        if let Err(s) = nic.xmit_to_queue(pool, skb, q) {
            pool.free(s);
        }
    }
}

/// Delivers a frame the bridge decided on to the vifs: to one, or (a flood) to every
/// vif but the one it came from, copied for all but the last; a vif with a NIC queue
/// gets it through the queue (gathered in `to_queues`), so that its netback answers in
/// ring order. Frames for the NIC are the caller's. Returns false if some copy failed.
fn to_vifs(
    pool: &mut SkbPool,
    vifs: &mut [Vif],
    queues: &[Option<usize>],
    to_queues: &mut Vec<(SkbId, usize)>,
    skb: SkbId,
    fwd: Forward,
    from: u16,
) -> bool {
    let mut give = |pool: &mut SkbPool, i: usize, skb: SkbId| match queues[i] {
        Some(q) => to_queues.push((skb, q)),
        None => vifs[i].start_xmit(pool, skb),
    };
    let n = queues.len();
    match fwd {
        Forward::Port(p) if p != NIC_PORT && usize::from(p) <= n => {
            give(pool, usize::from(p) - 1, skb);
            true
        }
        Forward::Flood => {
            let mut ok = true;
            let mut last = None;
            for i in (0..n).filter(|&i| vif_port(i) != from) {
                if let Some(prev) = last.replace(i) {
                    match copy_frame(pool, skb) {
                        Some(c) => give(pool, prev, c),
                        None => ok = false,
                    }
                }
            }
            match last {
                Some(i) => give(pool, i, skb),
                None => pool.free(skb),
            }
            ok
        }
        _ => {
            pool.free(skb);
            true
        }
    }
}

impl Kernel for DriverDomain {
    const CLOCK: bool = false;

    fn event(&mut self, v: &Vcpu, port: Port) {
        if let Some(q) = self.pirqs.iter().position(|&p| p == port) {
            let nic = &mut self.nic;
            xen_pirq(v, port, || {
                if q == 0 {
                    nic.interrupt();
                } else {
                    nic.vmq_interrupt(q);
                }
            });
        } else if let Some(i) = self.vifs.iter().position(|x| x.port() == port) {
            self.signalled[i] = true;
        } else if let Some(i) = self.vbds.iter().position(|x| x.port() == port) {
            self.vbd_signalled[i] = true;
        } else if let Some(i) = self.remote.iter().position(|x| x.port() == Some(port)) {
            self.remote_signalled[i] = true;
        }
    }

    /// Always: a vif's hold on the NIC's poll runs out on the kernel's timer, and LRO
    /// and remote disks keep time too.
    fn wants_clock(&self) -> bool {
        true
    }

    fn next_timer(&self) -> Option<Duration> {
        let lro = self.nic.lro_due_in().map(|d| self.now + d);
        let held = self.vifs.iter().filter_map(|v| v.rx_hold_until()).min();
        let lro = lro.into_iter().chain(held).min();
        // The initiators keep their own clock; their next deadline in the kernel's.
        let at = Instant::now();
        let remote = self
            .remote
            .iter()
            .filter_map(|r| r.next_due())
            .min()
            .map(|due| self.now + due.saturating_duration_since(at));
        lro.into_iter().chain(remote).min()
    }

    fn poll(&mut self, now: Duration) -> Work {
        self.now = now;
        if self.take_fault() {
            return Work::default();
        }
        let mut w = Work::default();
        let at = Instant::now();
        // 0. Guest queues (direct placement).
        w.rx += self.poll_guest_queues();
        // 1. The NIC's NAPI poll, through the bridge to the vifs' queues.
        w.rx += self.poll_nic(at);
        // Control rings (grant reuse): drops the guests asked for, and answers to drops
        // whose I/O has now completed.
        for vif in self.vifs.iter_mut() {
            if vif.ctrl_pending() {
                vif.ctrl_action();
            }
        }
        // 2. Guest RX: each vif's queue into its guest's buffers.
        for vif in self.vifs.iter_mut() {
            if vif.rx_pending() {
                w.tx += vif.rx_action(&mut self.pool);
            }
        }
        // 3. Guest TX: through the bridge to the NIC, or to another vif.
        w.rx += self.guest_tx();
        // 4. Completions: the NIC's TX ring, then the guests' mapped pages.
        let tx_waiting = self.completions();
        // 5. Block devices: local disks, and remote ones' frames out through the NIC.
        let (rx, tx, disks_waiting) = self.serve_disks(at);
        w.rx += rx;
        w.tx += tx;
        w.more = tx_waiting
            || disks_waiting
            || self.nic_ready()
            || self
                .queues
                .iter()
                .flatten()
                .any(|&q| self.nic.vmq_scheduled(q));
        w
    }

    /// The NIC driver's, each vif's by its name (with its rings' occupancy and its
    /// grant cache), the bridge's, each disk's by its guest: the same names live and at
    /// the end.
    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        c.add_set("driver", self.nic.stats());
        c.add("driver", "tx_ring_used", u64::from(self.nic.tx_ring_used()));
        for vif in &self.vifs {
            let name = vif.name();
            c.add_port(&name, PortKind::Vif, vif.stats());
            c.add_set(&name, &vif.ring_occupancy());
            if let Some(cs) = vif.cache_stats() {
                c.add_set(&format!("{name} grant cache"), cs);
            }
        }
        c.add_set("bridge", self.bridge.stats());
        self.lro_counters(&mut c);
        for vbd in &self.vbds {
            c.add_port(
                &format!("vbd{}", vbd.frontend().0),
                PortKind::Vbd,
                vbd.stats(),
            );
        }
        for r in &self.remote {
            let name = format!("rvbd{}", r.frontend().0);
            if let Some(b) = r.backend() {
                c.add_port(&name, PortKind::Vbd, b.stats());
            }
            if let Some(a) = r.aoe_stats() {
                c.add_set(&format!("{name} aoe"), a);
            }
            c.add(&name, "connect_failed", u64::from(r.failed().is_some()));
        }
        c.add("driver", "aoe_unclaimed", self.aoe_unclaimed);
        c.add("driver", "aoe_tx_full", self.aoe_tx_full);
        c
    }

    fn shutdown(mut self) -> Counters {
        if self.dom.is_dying() {
            // Destroyed under it: the hypervisor took back its mappings and ports, and
            // the NIC has been reset for its next owner, whose registers these now are.
            return Counters::default();
        }
        // Named as they were live, with what only the end adds.
        let mut c = self.counters();
        for vif in &self.vifs {
            c.add_set(&format!("{} tx checks", vif.name()), vif.tx_check_stats());
        }
        c.add("bridge", "flood_copy_failures", self.flood_copy_failures);
        for q in self.queues.iter().flatten() {
            // The buffers still posted are unmapped with their vif.
            let _ = self.nic.vmq_close(*q);
        }
        self.nic.shutdown(&mut self.pool);
        for vif in self.vifs.drain(..) {
            vif.disconnect(&mut self.pool);
        }
        for vbd in self.vbds.drain(..) {
            vbd.disconnect();
        }
        for r in self.remote.drain(..) {
            r.disconnect();
        }
        c
    }
}
