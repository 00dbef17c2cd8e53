//! The NIC model's tests: registers, placement, moderation, offloads.

use super::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hv::{DeviceId, Iova};
use net::offload::{Csum, Offload};

use crate::irq::IrqLine;
use crate::wire::{WireSink, WireSource};

/// No false sharing between the driver's core and the device's: the registers the
/// driver writes, the flag both write and the counters the device writes are each
/// on lines of their own, in every receive queue too.
#[test]
fn the_drivers_registers_and_the_devices_counters_keep_to_lines_of_their_own() {
    use std::mem::{align_of, offset_of, size_of};
    let line = |off: usize| off / 64;
    let driver = [
        offset_of!(NicRegs, tx_base),
        offset_of!(NicRegs, tx_tail),
        offset_of!(NicRegs, enabled),
        offset_of!(NicRegs, link_up),
        offset_of!(NicRegs, resets),
        offset_of!(NicRegs, stop),
    ];
    let both = [offset_of!(NicRegs, rx_paused)];
    let device = [
        offset_of!(NicRegs, tx_head),
        offset_of!(NicRegs, iterations),
        offset_of!(NicRegs, rx_frames),
        offset_of!(NicRegs, rx_bytes),
        offset_of!(NicRegs, rx_missed),
        offset_of!(NicRegs, rx_pauses),
        offset_of!(NicRegs, rx_loop_held),
        offset_of!(NicRegs, rx_fifo_held),
        offset_of!(NicRegs, tx_frames),
        offset_of!(NicRegs, tx_bytes),
        offset_of!(NicRegs, irqs),
        offset_of!(NicRegs, timer_irqs),
        offset_of!(NicRegs, iotlb_hits),
        offset_of!(NicRegs, iotlb_misses),
    ];
    let apart = |a: &[usize], b: &[usize], what: &str| {
        for x in a {
            for y in b {
                assert_ne!(
                    line(*x),
                    line(*y),
                    "{what}: offsets {x} and {y} share a line"
                );
            }
        }
    };
    apart(&driver, &device, "driver and device");
    apart(&driver, &both, "driver and the pause flag");
    apart(&both, &device, "the pause flag and device");
    assert_eq!(align_of::<NicRegs>(), 64, "the registers start a line");
    // A queue: the driver's registers on one line, the device's counters on the
    // next, and each queue on lines no other queue's words are on.
    assert_eq!(size_of::<RxQueueRegs>() % 64, 0);
    let regs = [
        offset_of!(RxQueueRegs, base),
        offset_of!(RxQueueRegs, tail),
        offset_of!(RxQueueRegs, itr_pkts),
        offset_of!(RxQueueRegs, irq_enabled),
        offset_of!(RxQueueRegs, enabled),
    ];
    let counters = [
        offset_of!(RxQueueRegs, frames),
        offset_of!(RxQueueRegs, missed),
        offset_of!(RxQueueRegs, irqs),
    ];
    apart(&regs, &counters, "a queue's registers and counters");
    let queues = offset_of!(NicRegs, rxq);
    let all_queues = queues + RX_QUEUES * size_of::<RxQueueRegs>();
    let first_other = driver.iter().chain(&device).chain(&both).copied().min();
    assert!(
        first_other.is_some_and(|o| o >= all_queues),
        "the queues come first"
    );
}
use hv::{DomainConfig, Gfn, HvConfig, Hypervisor};

/// A hypervisor and the driver domain whose memory the NIC's rings live in.
fn driver_domain() -> (Arc<Hypervisor>, Arc<hv::Domain>) {
    let hv = Hypervisor::new(HvConfig {
        frames: 512,
        ..Default::default()
    })
    .expect("hv");
    let d = hv
        .create_domain(&DomainConfig {
            pages: 64,
            driver_domain: true,
            ..Default::default()
        })
        .expect("dom");
    (hv, d)
}

/// Frames that wait outside until the device takes them (a TAP's queue).
struct Holding(std::collections::VecDeque<Vec<u8>>);

impl WireSource for Holding {
    fn poll(&mut self, _now: Instant, _emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
        unreachable!("a holding source is polled with poll_held")
    }
    fn next_due(&self) -> Option<Instant> {
        None
    }
    fn ready(&self) -> bool {
        !self.0.is_empty()
    }
    fn holds(&self) -> bool {
        true
    }
    fn poll_held(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], Offload) -> bool) -> usize {
        let mut n = 0;
        while let Some(f) = self.0.front() {
            if !emit(f, Offload::NONE) {
                break;
            }
            self.0.pop_front();
            n += 1;
        }
        n
    }
}

#[test]
fn a_source_that_holds_keeps_what_the_ring_has_no_room_for_until_the_driver_refills() {
    let (hv, d) = driver_domain();
    let ring = d.alloc_page().expect("p");
    let ring_iova = 0x10_000u64;
    hv.iommu_map(&d, Iova(ring_iova), ring, true).expect("map");
    let mut bufs = Vec::new();
    for i in 0..4u64 {
        let b = d.alloc_page().expect("p");
        let at = 0x20_000 + i * 0x1000;
        hv.iommu_map(&d, Iova(at), b, true).expect("map");
        let desc = Desc {
            addr: at,
            ..Default::default()
        };
        d.write(ring, i as usize * DESC_SIZE, bytemuck::bytes_of(&desc))
            .expect("desc");
        bufs.push(b);
    }
    hv.iommu_attach(DeviceId(9), &d).expect("attach");
    let regs = Arc::new(NicRegs::new());
    regs.rxq[0].base.store(ring_iova, Ordering::Relaxed);
    regs.enabled.store(true, Ordering::Relaxed);
    regs.link_up.store(true, Ordering::Relaxed);
    let mut dev = Device::new(
        Arc::clone(&regs),
        hv.iommu().device(DeviceId(9)),
        Coalesce::default(),
        vec![IrqLine::Native(Arc::default())],
    );
    let frames: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 100]).collect();
    let mut src = Holding(frames.iter().cloned().collect());
    let mut sink = crate::wire::CountingSink::default();
    let mut resets = 0;
    // No descriptor posted: nothing is read, nothing is lost, the device pauses.
    dev.pass(&mut src, &mut sink, &mut resets);
    assert_eq!(src.0.len(), 6);
    assert_eq!(regs.rx_missed.load(Ordering::Relaxed), 0);
    assert!(regs.rx_paused.load(Ordering::Relaxed));
    assert_eq!(regs.rx_pauses.load(Ordering::Relaxed), 1);
    // Two buffers: two frames in, the rest wait; the refill lifted the pause.
    regs.set_rx_tail(0, 2);
    assert!(
        !regs.rx_paused.load(Ordering::Relaxed),
        "a refill lifts the pause"
    );
    dev.pass(&mut src, &mut sink, &mut resets);
    assert_eq!(src.0.len(), 4);
    assert_eq!(regs.rx_frames.load(Ordering::Relaxed), 2);
    // Two more: two more in, in order, and still nothing missed.
    regs.set_rx_tail(0, 4);
    dev.pass(&mut src, &mut sink, &mut resets);
    assert_eq!(src.0.len(), 2);
    assert_eq!(regs.rx_frames.load(Ordering::Relaxed), 4);
    assert_eq!(regs.rx_missed.load(Ordering::Relaxed), 0);
    for (b, f) in bufs.iter().zip(&frames) {
        let mut got = vec![0u8; f.len()];
        d.read(*b, 0, &mut got).expect("data");
        assert_eq!(&got, f);
    }
}

#[test]
fn a_guest_queue_without_buffers_holds_the_cable_for_a_bounded_time_then_drops_only_its_own() {
    let (hv, d) = driver_domain();
    let ring = d.alloc_page().expect("p");
    hv.iommu_map(&d, Iova(0x10_000), ring, true).expect("map");
    for i in 0..2u64 {
        let b = d.alloc_page().expect("p");
        hv.iommu_map(&d, Iova(0x20_000 + i * 0x1000), b, true)
            .expect("map");
        let desc = Desc {
            addr: 0x20_000 + i * 0x1000,
            ..Default::default()
        };
        d.write(ring, i as usize * DESC_SIZE, bytemuck::bytes_of(&desc))
            .expect("desc");
    }
    hv.iommu_attach(DeviceId(10), &d).expect("attach");
    let regs = Arc::new(NicRegs::new());
    regs.rxq[0].base.store(0x10_000, Ordering::Relaxed);
    regs.rxq[0].tail.store(2, Ordering::Relaxed);
    // Queue 1 is a guest's, steered to by its MAC, enabled, and given no buffer.
    let guest = [0x02, 0, 0, 0, 0, 0x42];
    regs.filters[0]
        .mac
        .store(mac_bits(guest) | FILTER_VALID, Ordering::Relaxed);
    regs.filters[0]
        .vlan
        .store(FILTER_UNTAGGED, Ordering::Relaxed);
    regs.filters[0].queue.store(1, Ordering::Relaxed);
    regs.rxq[1].enabled.store(true, Ordering::Relaxed);
    regs.enabled.store(true, Ordering::Relaxed);
    regs.link_up.store(true, Ordering::Relaxed);
    let mut dev = Device::new(
        Arc::clone(&regs),
        hv.iommu().device(DeviceId(10)),
        Coalesce::default(),
        vec![
            IrqLine::Native(Arc::default()),
            IrqLine::Native(Arc::default()),
        ],
    );
    let to = |mac: [u8; 6]| {
        let mut f = vec![0x11u8; 100];
        f[..6].copy_from_slice(&mac);
        f
    };
    let other = [0x02, 0, 0, 0, 0, 0x43];
    let mut src = Holding([to(guest), to(other), to(other)].into_iter().collect());
    let mut sink = crate::wire::CountingSink::default();
    // Flow control: the guest's frame waits with its source, nothing lost yet, and the
    // device sleeps no longer than the hold.
    let t0 = std::time::Instant::now();
    let until = dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!(src.0.len(), 3, "held with the source, first in line");
    assert_eq!(regs.rxq[1].missed.load(Ordering::Relaxed), 0);
    assert_eq!(regs.rx_pauses.load(Ordering::Relaxed), 1);
    let wake = until
        .flatten()
        .expect("a deadline while a guest queue holds the cable");
    assert!(wake <= t0 + super::GUEST_QUEUE_HOLD + std::time::Duration::from_millis(5));
    // The guest posts nothing for the whole hold: its frame is dropped, counted, and
    // the others' pass.
    while std::time::Instant::now() < t0 + super::GUEST_QUEUE_HOLD {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    dev.pass(&mut src, &mut sink, &mut 0);
    assert!(src.0.is_empty(), "nothing held back any more");
    assert_eq!(regs.rxq[1].missed.load(Ordering::Relaxed), 1);
    assert_eq!(regs.rx_frames.load(Ordering::Relaxed), 2);
    // Until it posts again, what comes for it is dropped at once: it holds nobody.
    src.0.push_back(to(guest));
    dev.pass(&mut src, &mut sink, &mut 0);
    assert!(src.0.is_empty());
    assert_eq!(regs.rxq[1].missed.load(Ordering::Relaxed), 2);
    assert_eq!(regs.rx_pauses.load(Ordering::Relaxed), 1);
}

#[test]
fn a_frame_whose_dma_faults_completes_its_descriptor_with_an_error_and_no_data() {
    let (hv, d) = driver_domain();
    let (ring, buf): (Gfn, Gfn) = (d.alloc_page().expect("p"), d.alloc_page().expect("p"));
    let (ring_iova, buf_iova) = (0x10_000u64, 0x20_000u64);
    hv.iommu_map(&d, Iova(ring_iova), ring, true).expect("map");
    hv.iommu_map(&d, Iova(buf_iova), buf, true).expect("map");
    hv.iommu_attach(DeviceId(7), &d).expect("attach");
    // Descriptor 0 names a buffer the IOMMU does not map; descriptor 1 a good one.
    d.fill(buf, 0, 4096, 0xee).expect("stale bytes");
    for (i, addr) in [(0usize, 0x90_000u64), (1, buf_iova)] {
        let desc = Desc {
            addr,
            ..Default::default()
        };
        d.write(ring, i * DESC_SIZE, bytemuck::bytes_of(&desc))
            .expect("desc");
    }
    let regs = Arc::new(NicRegs::new());
    regs.rxq[0].base.store(ring_iova, Ordering::Relaxed);
    regs.rxq[0].tail.store(2, Ordering::Relaxed);
    let mut dev = Device::new(
        Arc::clone(&regs),
        hv.iommu().device(DeviceId(7)),
        Coalesce::default(),
        vec![IrqLine::Native(Arc::default())],
    );
    let frame = [0x5au8; 200];
    dev.receive(&frame, Offload::NONE);
    dev.receive(&frame, Offload::NONE);
    let desc = |i: usize| -> Desc {
        let mut b = [0u8; DESC_SIZE];
        d.read(ring, i * DESC_SIZE, &mut b).expect("desc");
        bytemuck::pod_read_unaligned(&b)
    };
    let bad = desc(0);
    assert_eq!(bad.status & (DESC_DD | DESC_ERR), DESC_DD | DESC_ERR);
    assert_eq!(bad.len, 0, "no length the driver could hand up");
    let good = desc(1);
    assert_eq!((good.status & DESC_ERR, good.len), (0, 200));
    let mut got = [0u8; 200];
    d.read(buf, 0, &mut got).expect("data");
    assert_eq!(got, frame);
    assert_eq!(regs.rx_dma_errors.load(Ordering::Relaxed), 1);
    assert_eq!(
        regs.rx_frames.load(Ordering::Relaxed),
        2,
        "both descriptors used"
    );
}

#[test]
fn the_coalescing_delay_counts_from_the_first_or_the_last_packet_and_the_driver_sets_the_count() {
    let hv = Hypervisor::new(HvConfig {
        frames: 64,
        ..HvConfig::default()
    })
    .expect("hv");
    let device = |delay_from| {
        let regs = Arc::new(NicRegs::new());
        regs.rxq[0].irq_enabled.store(true, Ordering::Relaxed);
        regs.rxq[0].itr_pkts.store(64, Ordering::Relaxed);
        Device::new(
            regs,
            hv.iommu().device(DeviceId(8)),
            Coalesce {
                pkts_per_irq: 64,
                max_delay: Duration::from_micros(18),
                delay_from,
                adaptive: false,
            },
            vec![IrqLine::Native(Arc::default())],
        )
    };
    let irqs = |d: &Device| d.regs.irqs.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let us = |n: u64| t0 + Duration::from_micros(n);
    for from in [DelayFrom::FirstPacket, DelayFrom::LastPacket] {
        let mut d = device(from);
        // Ten packets 10 µs apart: closer together than the delay.
        for k in 0..10 {
            d.complete(0, us(10 * k));
            d.maybe_interrupt(0, us(10 * k));
        }
        match from {
            // An interrupt once the oldest has waited 18 µs: at 20, 50 and 80.
            DelayFrom::FirstPacket => assert_eq!(irqs(&d), 3),
            // Each packet restarted the delay: nothing yet.
            DelayFrom::LastPacket => assert_eq!(irqs(&d), 0),
        }
        // The timer is checked 5 µs after the last packet's deadline.
        d.maybe_interrupt(0, us(90 + 18 + 5));
        assert_eq!(
            d.rxq[0].pending, 0,
            "{from:?}: 18 µs after the last, all signalled"
        );
        // Every interrupt here was the timer's, and how late each came is kept.
        let timer = d.regs.timer_irqs.load(Ordering::Relaxed);
        assert_eq!(timer, irqs(&d));
        let late = d.regs.timer_late_ns.load(Ordering::Relaxed);
        match from {
            // At 20, 50 and 80 µs, 2 µs after each deadline; then 5 µs.
            DelayFrom::FirstPacket => assert_eq!(late, 3 * 2_000 + 5_000),
            DelayFrom::LastPacket => assert_eq!(late, 5_000),
        }
    }
    // The count is the driver's register, read at each completion.
    let mut d = device(DelayFrom::LastPacket);
    d.regs.rxq[0].itr_pkts.store(2, Ordering::Relaxed);
    d.complete(0, us(0));
    d.complete(0, us(1));
    assert_eq!(irqs(&d), 1);
    assert_eq!(d.regs.timer_irqs.load(Ordering::Relaxed), 0, "the count's");
    // Completions back to back, the device never resting between them (a ring of
    // large packets cut into frames for the cable): the delay is honoured at each
    // completion, as a NIC's moderation timer runs beside its DMA engine.
    let mut d = device(DelayFrom::FirstPacket);
    for k in 0..3 {
        d.complete(0, us(10 * k));
    }
    assert_eq!(irqs(&d), 1, "the oldest waited 20 µs of 18");
}

/// A device with a ring of four posted buffers on each queue it has a line for, in
/// one domain's memory, for the steering tests.
struct Rig {
    dom: Arc<hv::Domain>,
    regs: Arc<NicRegs>,
    dev: Device,
    lines: Vec<Arc<crate::irq::NativeIrq>>,
    bufs: Vec<Vec<Gfn>>,
    rings: Vec<Gfn>,
    _hv: Arc<Hypervisor>,
}

const POSTED: u32 = 4;
const MAC_A: [u8; 6] = [2, 0, 0, 0, 0, 0xa];
const MAC_B: [u8; 6] = [2, 0, 0, 0, 0, 0xb];

fn rig(queues: usize) -> Rig {
    let hv = Hypervisor::new(HvConfig {
        frames: 1024,
        ..Default::default()
    })
    .expect("hv");
    let dom = hv
        .create_domain(&DomainConfig {
            pages: 256,
            driver_domain: true,
            ..Default::default()
        })
        .expect("dom");
    hv.iommu_attach(DeviceId(9), &dom).expect("attach");
    let regs = Arc::new(NicRegs::new());
    let lines: Vec<Arc<crate::irq::NativeIrq>> = (0..queues).map(|_| Arc::default()).collect();
    let (mut rings, mut bufs) = (Vec::new(), Vec::new());
    for q in 0..queues {
        let ring = dom.alloc_page().expect("ring");
        let ring_iova = 0x100_000 + q as u64 * 0x10_000;
        hv.iommu_map(&dom, Iova(ring_iova), ring, true)
            .expect("map");
        let mut b = Vec::new();
        for k in 0..POSTED as usize {
            let g = dom.alloc_page().expect("buf");
            let iova = 0x200_000 + q as u64 * 0x10_000 + k as u64 * 0x1000;
            hv.iommu_map(&dom, Iova(iova), g, true).expect("map");
            let desc = Desc {
                addr: iova,
                ..Default::default()
            };
            dom.write(ring, k * DESC_SIZE, bytemuck::bytes_of(&desc))
                .expect("desc");
            b.push(g);
        }
        let r = &regs.rxq[q];
        r.base.store(ring_iova, Ordering::Relaxed);
        r.tail.store(POSTED, Ordering::Relaxed);
        r.itr_pkts.store(1, Ordering::Relaxed);
        r.irq_enabled.store(true, Ordering::Relaxed);
        r.enabled.store(true, Ordering::Relaxed);
        rings.push(ring);
        bufs.push(b);
    }
    let dev = Device::new(
        Arc::clone(&regs),
        hv.iommu().device(DeviceId(9)),
        Coalesce::default(),
        lines
            .iter()
            .map(|l| IrqLine::Native(Arc::clone(l)))
            .collect(),
    );
    Rig {
        dom,
        regs,
        dev,
        lines,
        bufs,
        rings,
        _hv: hv,
    }
}

/// A running device with the default queue and two guests' queues: frames to `MAC_A`
/// steered to queue 1, to `MAC_B` to queue 2, the cable plugged in.
fn two_guests() -> Rig {
    let r = rig(3);
    r.regs.enabled.store(true, Ordering::Relaxed);
    r.regs.link_up.store(true, Ordering::Relaxed);
    r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
    r.regs.set_filter(1, MAC_B, None, 2).expect("filter");
    r
}

/// A frame to `dst`, tagged with `vlan` if given, its payload `seed`.
fn frame_to(dst: [u8; 6], vlan: Option<u16>, seed: u8) -> Vec<u8> {
    let mut f = dst.to_vec();
    f.extend_from_slice(&[2, 0, 0, 0, 0, 1]);
    if let Some(v) = vlan {
        f.extend_from_slice(&[0x81, 0x00]);
        f.extend_from_slice(&v.to_be_bytes());
    }
    f.extend_from_slice(&[0x88, 0xb5]);
    f.extend((0..100).map(|i: u8| i ^ seed));
    f
}

impl Rig {
    /// Queue `q`'s driver posts its buffers `from..from + n` again, at the ring
    /// positions after its first [`POSTED`], and writes the tail past them.
    fn repost(&self, q: usize, from: u32, n: u32) {
        for k in from..from + n {
            let desc = Desc {
                addr: 0x200_000 + q as u64 * 0x10_000 + u64::from(k) * 0x1000,
                ..Default::default()
            };
            self.dom
                .write(
                    self.rings[q],
                    (POSTED + k) as usize * DESC_SIZE,
                    bytemuck::bytes_of(&desc),
                )
                .expect("desc");
        }
        self.regs.set_rx_tail(q, POSTED + from + n);
    }
    /// The bytes queue `q` wrote into its buffer `k` posted again ([`Self::repost`]).
    fn got_again(&self, q: usize, k: usize) -> Vec<u8> {
        let mut raw = [0u8; DESC_SIZE];
        self.dom
            .read(self.rings[q], (POSTED as usize + k) * DESC_SIZE, &mut raw)
            .expect("desc");
        let d: Desc = bytemuck::pod_read_unaligned(&raw);
        let mut b = vec![0u8; d.len as usize];
        self.dom.read(self.bufs[q][k], 0, &mut b).expect("data");
        b
    }
    fn frames(&self, q: usize) -> u64 {
        self.regs.rxq[q].frames.load(Ordering::Relaxed)
    }
    fn missed(&self, q: usize) -> u64 {
        self.regs.rxq[q].missed.load(Ordering::Relaxed)
    }
    /// The bytes in queue `q`'s `k`th buffer, as its descriptor's length says.
    fn got(&self, q: usize, k: usize) -> Vec<u8> {
        let mut raw = [0u8; DESC_SIZE];
        self.dom
            .read(self.rings[q], k * DESC_SIZE, &mut raw)
            .expect("desc");
        let d: Desc = bytemuck::pod_read_unaligned(&raw);
        let mut b = vec![0u8; d.len as usize];
        self.dom.read(self.bufs[q][k], 0, &mut b).expect("data");
        b
    }
}

/// A TCP/IPv4 frame to `dst` with `payload` bytes, its checksum left partial; and
/// its offload with GSO segment size `mss`.
fn tcp_to(dst: [u8; 6], payload: usize, mss: u16) -> (Vec<u8>, Offload) {
    let mut f = dst.to_vec();
    f.extend_from_slice(&[2, 0, 0, 0, 0, 1, 0x08, 0x00]);
    let total = (40 + payload) as u16;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&[10, 0, 0, 1]);
    ip[16..20].copy_from_slice(&[10, 0, 0, 2]);
    let sum = !smoltcp::wire::checksum::data(&ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    f.extend_from_slice(&ip);
    let mut tcp = [0u8; 20];
    tcp[12] = 5 << 4;
    tcp[13] = 0x18;
    f.extend_from_slice(&tcp);
    f.extend((0..payload).map(|i| (i % 251) as u8));
    let l4 = net::offload::checksum_setup(&f, f.len()).expect("tcp");
    net::offload::set_pseudo(&mut f, &l4);
    let off = Offload {
        csum: l4.partial(),
        gso: Some(net::netif::Gso {
            size: mss,
            ty: net::netif::XEN_NETIF_GSO_TYPE_TCPV4,
        }),
    };
    (f, off)
}

#[test]
fn a_large_frame_fills_several_descriptors_and_bad_cable_metadata_is_dropped() {
    let mut r = rig(2);
    r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
    let other = [2, 0, 0, 0, 0, 0xc];
    // 5000 bytes: four buffers of a full frame each (their length field is 0).
    let (big, off) = tcp_to(other, 4946, 1448);
    r.dev.receive(&big, off);
    assert_eq!(r.frames(0), 1);
    let descs: Vec<Desc> = (0..4)
        .map(|k| {
            let mut raw = [0u8; DESC_SIZE];
            r.dom
                .read(r.rings[0], k * DESC_SIZE, &mut raw)
                .expect("desc");
            bytemuck::pod_read_unaligned(&raw)
        })
        .collect();
    assert!(descs.iter().all(|d| d.status & DESC_DD != 0));
    assert!(descs[..3].iter().all(|d| d.status & DESC_EOP == 0));
    assert_eq!(
        descs[3].status & (DESC_EOP | DESC_OFFLOAD),
        DESC_EOP | DESC_OFFLOAD
    );
    assert_eq!(
        Offload::from_bits(descs[3].addr),
        Some(off),
        "the write-back"
    );
    let mut got = Vec::new();
    for (k, d) in descs.iter().enumerate() {
        let mut b = vec![0u8; d.len as usize];
        r.dom.read(r.bufs[0][k], 0, &mut b).expect("data");
        got.extend(b);
    }
    assert_eq!(got, big, "every byte, in order");
    assert_eq!(r.regs.rx_gso.load(Ordering::Relaxed), 1);
    // From the cable: a GSO size of 0, a checksum offset off the headers, a large
    // frame without GSO. Each dropped and counted; no descriptor used.
    let zero = Offload {
        gso: off.gso.map(|g| net::netif::Gso { size: 0, ..g }),
        ..off
    };
    let skewed = Offload {
        csum: Csum::Partial {
            start: 34,
            offset: 6,
        },
        ..off
    };
    r.dev.receive(&big, zero);
    r.dev.receive(&big, skewed);
    r.dev.receive(&big, Offload::NONE);
    assert_eq!(r.regs.rx_bad_offload.load(Ordering::Relaxed), 2);
    assert_eq!(r.regs.rx_oversize.load(Ordering::Relaxed), 1);
    assert_eq!(r.frames(0), 1);
    // A guest queue's completions carry no offload: it gets the frame cut to
    // frames with complete checksums (its four buffers hold the first four).
    let (to_a, aoff) = tcp_to(MAC_A, 4000, 1000);
    r.dev.receive(&to_a, aoff);
    assert_eq!(r.frames(1), 4);
    for k in 0..4 {
        let f = r.got(1, k);
        let l4 = net::offload::checksum_setup(&f, f.len()).expect("a frame");
        assert!(net::offload::verify(&f, &l4), "segment {k}");
        assert_eq!(f.len(), 54 + 1000);
    }
    assert_eq!(r.missed(1), 0);
    assert_eq!(r.regs.rx_cut.load(Ordering::Relaxed), 4);
}

#[test]
fn a_guest_queue_that_takes_large_frames_whole_gets_the_first_buffer_the_context_then_the_rest() {
    let mut r = rig(2);
    r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
    r.regs.rxq[1]
        .whole
        .store(1 << net::netif::XEN_NETIF_GSO_TYPE_TCPV4, Ordering::Relaxed);
    // 2000 bytes of payload: two buffers of data (a full frame each), and the
    // context's between them.
    let (big, off) = tcp_to(MAC_A, 2000, 1000);
    r.dev.receive(&big, off);
    let desc = |k: usize| -> Desc {
        let mut raw = [0u8; DESC_SIZE];
        r.dom
            .read(r.rings[1], k * DESC_SIZE, &mut raw)
            .expect("desc");
        bytemuck::pod_read_unaligned(&raw)
    };
    let d: Vec<Desc> = (0..3).map(desc).collect();
    assert_eq!(d[0].status, DESC_DD | DESC_CTX_NEXT, "first: {d:?}");
    assert_eq!(d[1].status, DESC_DD | DESC_OFFLOAD, "context: {d:?}");
    assert_eq!((d[1].len, Offload::from_bits(d[1].addr)), (0, Some(off)));
    assert_eq!(d[2].status, DESC_DD | DESC_EOP, "last: {d:?}");
    let mut untouched = [1u8; 64];
    r.dom.read(r.bufs[1][1], 0, &mut untouched).expect("data");
    assert_eq!(untouched, [0; 64], "the context's buffer is not written");
    let got = [r.got(1, 0), r.got(1, 2)].concat();
    assert_eq!(got, big, "every byte, in order, the checksum still partial");
    assert_eq!((r.frames(1), r.regs.rx_cut.load(Ordering::Relaxed)), (1, 0));
    // A second needs three descriptors; one is left: it waits whole (a source that
    // holds keeps it), nothing written.
    assert!(r.dev.take(&big, off).is_err());
    assert_eq!((r.frames(1), r.missed(1)), (1, 0));
    assert_eq!(desc(3).status, 0);
    // A queue that takes no type whole gets large frames cut.
    r.regs.rxq[1].whole.store(0, Ordering::Relaxed);
    let (small, soff) = tcp_to(MAC_A, 900, 1000);
    r.dev.receive(&small, soff);
    let f = r.got(1, 3);
    let l4 = net::offload::checksum_setup(&f, f.len()).expect("a frame");
    assert!(net::offload::verify(&f, &l4), "cut, its checksum complete");
}

#[test]
fn a_packet_the_driver_loops_back_lands_in_its_guest_queue_and_never_on_the_cable() {
    let mut r = rig(2);
    r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
    // A broadcast (ARP, say) the driver domain's bridge sends to queue 1's guest: the
    // queue takes it though its filter would send it to the default.
    let bcast = frame_to([0xff; 6], None, 7);
    r.dev.frame[..bcast.len()].copy_from_slice(&bcast);
    r.dev.loop_back(1, bcast.len(), Offload::NONE);
    assert_eq!((r.frames(1), r.frames(0)), (1, 0));
    assert_eq!(r.got(1, 0), bcast);
    assert_eq!(r.regs.tx_looped.load(Ordering::Relaxed), 1);
    assert_eq!(r.regs.tx_frames.load(Ordering::Relaxed), 0, "not sent");
    // Queue 0 is no guest queue: refused, counted, nothing received.
    r.dev.loop_back(0, bcast.len(), Offload::NONE);
    assert_eq!(r.frames(0), 0);
    assert_eq!(r.regs.tx_bad_offload.load(Ordering::Relaxed), 1);
    // Three more fill the queue's four buffers.
    for _ in 0..3 {
        r.dev.frame[..bcast.len()].copy_from_slice(&bcast);
        r.dev.loop_back(1, bcast.len(), Offload::NONE);
    }
    assert_eq!((r.frames(1), r.missed(1)), (4, 0));
}

#[test]
fn a_looped_back_frame_waits_in_the_device_for_its_full_queue_and_a_stuck_queue_loses_it() {
    let mut r = rig(3);
    r.regs.enabled.store(true, Ordering::Relaxed);
    r.regs.link_up.store(true, Ordering::Relaxed);
    let send = |r: &mut Rig, seed: u8| {
        let f = frame_to([0xff; 6], None, seed);
        r.dev.frame[..f.len()].copy_from_slice(&f);
        r.dev.loop_back(1, f.len(), Offload::NONE);
        f
    };
    for seed in 0..POSTED as u8 {
        send(&mut r, seed);
    }
    // The queue full: the next three wait in the device, the queue's source paused.
    let (a, b) = (send(&mut r, 10), send(&mut r, 11));
    let c = send(&mut r, 12);
    assert_eq!((r.frames(1), r.missed(1)), (4, 0));
    assert_eq!(r.regs.rx_loop_held.load(Ordering::Relaxed), 3);
    assert!(r.regs.rx_paused.load(Ordering::Relaxed));
    // Another guest's queue is not held up by them.
    assert!(send_to(&mut r, 2, 20).is_some());
    assert_eq!((r.frames(2), r.missed(2)), (1, 0));
    // The guest posts two buffers (the first two again): the refill lifts the pause,
    // and the next pass places both, in order, before anything from the cable.
    r.repost(1, 0, 2);
    assert!(
        !r.regs.rx_paused.load(Ordering::Relaxed),
        "the refill wakes it"
    );
    let (mut src, mut sink) = (crate::wire::Silence, crate::wire::CountingSink::default());
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!((r.frames(1), r.missed(1)), (6, 0));
    for (k, f) in [a, b].iter().enumerate() {
        assert_eq!(&r.got_again(1, k), f, "held frame {k}, in order");
    }
    // The third still waits; a guest that posts nothing more: it and the next wait out
    // the queue's hold, then are dropped and counted, and the FIFO is empty again.
    assert!(!r.dev.fifo.is_empty(), "{c:?} waits");
    send(&mut r, 13);
    assert_eq!(r.regs.rx_loop_held.load(Ordering::Relaxed), 4);
    let until = r.dev.pass(&mut src, &mut sink, &mut 0);
    assert!(
        matches!(until, Some(Some(_))),
        "the hold's end is the device's next wake-up: {until:?}"
    );
    std::thread::sleep(super::GUEST_QUEUE_HOLD + Duration::from_millis(5));
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!((r.frames(1), r.missed(1)), (6, 2));
    assert!(r.dev.fifo.is_empty());
    // The queue is stuck until its guest posts again: the next frame is dropped at
    // once, not kept.
    send(&mut r, 14);
    assert_eq!((r.frames(1), r.missed(1)), (6, 3));
    assert!(r.dev.fifo.is_empty());
    // It posts one buffer, which the next frame takes, and the one after waits again.
    r.repost(1, 2, 1);
    send(&mut r, 15);
    let d = send(&mut r, 16);
    assert_eq!((r.frames(1), r.missed(1)), (7, 3));
    assert_eq!(r.regs.rx_loop_held.load(Ordering::Relaxed), 5);
    // One whose queue is refilled after its hold ran out, but before the device looked
    // again, is placed: only a frame that still finds no room is dropped.
    std::thread::sleep(super::GUEST_QUEUE_HOLD + Duration::from_millis(5));
    r.repost(1, 3, 1);
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!((r.frames(1), r.missed(1)), (8, 3));
    assert_eq!(r.got_again(1, 3), d);
}

/// Loops a frame back to queue `q`; `None` if the device refused it as no guest's
/// queue.
fn send_to(r: &mut Rig, q: usize, seed: u8) -> Option<Vec<u8>> {
    let f = frame_to([0xff; 6], None, seed);
    r.dev.frame[..f.len()].copy_from_slice(&f);
    let bad = r.regs.tx_bad_offload.load(Ordering::Relaxed);
    r.dev.loop_back(q, f.len(), Offload::NONE);
    (r.regs.tx_bad_offload.load(Ordering::Relaxed) == bad).then_some(f)
}

/// A frame from the cable whose queue has no buffer waits in the device's packet
/// buffer, in order, and lands at the queue's refill; the queue's share of the buffer
/// full, the next is dropped on that queue only; other queues' frames flow meanwhile,
/// and one of them still finds the room kept for the others.
#[test]
fn a_cable_frame_for_a_full_queue_waits_in_the_device_in_order_and_holds_up_no_other_queue() {
    let mut r = two_guests();
    // Queue 1's four buffers, then frames that wait: every one of its share.
    let share = (RX_FIFO_BYTES - RX_FIFO_RESERVE) / RX_FIFO_CHUNK;
    let to_a: Vec<Vec<u8>> = (0..POSTED as usize + share + 1)
        .map(|k| {
            let mut f = frame_to(MAC_A, None, k as u8);
            f.extend_from_slice(&(k as u32).to_be_bytes());
            f
        })
        .collect();
    for f in &to_a {
        r.dev.receive(f, Offload::NONE);
    }
    assert_eq!((r.frames(1), r.missed(1)), (u64::from(POSTED), 1));
    assert_eq!(r.regs.rx_fifo_held.load(Ordering::Relaxed), share as u64);
    assert!(
        r.regs.rx_paused.load(Ordering::Relaxed),
        "the queue's refill wakes it"
    );
    // Queue 2 and the default take theirs at once; queue 2, full too, keeps its next
    // in the room no other queue may take.
    for k in 0..=POSTED as u8 {
        r.dev.receive(&frame_to(MAC_B, None, k), Offload::NONE);
    }
    r.dev.receive(&frame_to([0xff; 6], None, 9), Offload::NONE);
    assert_eq!(
        (r.frames(2), r.missed(2), r.frames(0)),
        (u64::from(POSTED), 0, 1)
    );
    assert_eq!(
        r.regs.rx_fifo_held.load(Ordering::Relaxed),
        share as u64 + 1
    );
    // Queue 1 posts its four buffers again: the next pass places the first four that
    // waited, in order, and a frame the cable brings meanwhile goes behind the rest.
    r.repost(1, 0, POSTED);
    assert!(
        !r.regs.rx_paused.load(Ordering::Relaxed),
        "the refill wakes it"
    );
    let (mut src, mut sink) = (crate::wire::Silence, crate::wire::CountingSink::default());
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!((r.frames(1), r.missed(1)), (2 * u64::from(POSTED), 1));
    for k in 0..POSTED as usize {
        assert_eq!(
            r.got_again(1, k),
            to_a[POSTED as usize + k],
            "waited frame {k}, in order"
        );
    }
    r.dev.receive(&frame_to(MAC_A, None, 0xee), Offload::NONE);
    assert_eq!(
        r.frames(1),
        2 * u64::from(POSTED),
        "behind those still waiting"
    );
    // A reset empties the buffer.
    r.regs.resets.fetch_add(1, Ordering::Relaxed);
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert!(r.dev.fifo.is_empty());
}

/// A far end that takes PAUSE frames: its frames wait in its line while the device
/// refuses them or has paused it, and it keeps what it was told.
#[derive(Default)]
struct Pausing {
    line: std::collections::VecDeque<Vec<u8>>,
    paused: bool,
    told: Vec<bool>,
}

impl WireSource for Pausing {
    fn poll(&mut self, _now: Instant, _emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
        unreachable!("a far end that pauses is polled with poll_held")
    }
    fn next_due(&self) -> Option<Instant> {
        (!self.paused && !self.line.is_empty()).then(Instant::now)
    }
    fn pauses(&self) -> bool {
        true
    }
    fn pause(&mut self, on: bool, _now: Instant) {
        self.paused = on;
        self.told.push(on);
    }
    fn poll_held(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], Offload) -> bool) -> usize {
        let mut n = 0;
        while let Some(f) = self.line.front().filter(|_| !self.paused) {
            if !emit(f, Offload::NONE) {
                break;
            }
            self.line.pop_front();
            n += 1;
        }
        n
    }
}

/// Frames of the packet buffer's chunk each, to `dst`, numbered from `from`.
fn numbered(dst: [u8; 6], from: usize, n: usize) -> Vec<Vec<u8>> {
    (from..from + n)
        .map(|k| {
            let mut f = frame_to(dst, None, k as u8);
            f.extend_from_slice(&(k as u32).to_be_bytes());
            f
        })
        .collect()
}

impl Rig {
    /// Queue `q`'s driver posts `n` more buffers (its pages in turn) at ring positions
    /// `at..at + n`, and writes the tail past them.
    fn post_at(&self, q: usize, at: u32, n: u32) {
        for p in at..at + n {
            let desc = Desc {
                addr: 0x200_000 + q as u64 * 0x10_000 + u64::from(p % POSTED) * 0x1000,
                ..Default::default()
            };
            self.dom
                .write(
                    self.rings[q],
                    (p % RING_DESCS) as usize * DESC_SIZE,
                    bytemuck::bytes_of(&desc),
                )
                .expect("desc");
        }
        self.regs.set_rx_tail(q, (at + n) % RING_DESCS);
    }
    /// The bytes queue `q` wrote for ring position `at` ([`Self::post_at`]'s buffer).
    fn got_at(&self, q: usize, at: u32) -> Vec<u8> {
        let mut raw = [0u8; DESC_SIZE];
        self.dom
            .read(
                self.rings[q],
                (at % RING_DESCS) as usize * DESC_SIZE,
                &mut raw,
            )
            .expect("desc");
        let d: Desc = bytemuck::pod_read_unaligned(&raw);
        let mut b = vec![0u8; d.len as usize];
        self.dom
            .read(self.bufs[q][(at % POSTED) as usize], 0, &mut b)
            .expect("data");
        b
    }
    /// Frames the device kept in its packet buffer so far.
    fn kept(&self) -> u64 {
        self.regs.rx_fifo_held.load(Ordering::Relaxed)
    }
}

/// Packet-buffer chunks one queue may fill before the device pauses a far end that
/// takes PAUSE frames.
fn chunks_before_xoff() -> usize {
    (RX_FIFO_BYTES - RX_FIFO_RESERVE - RX_FIFO_XOFF) / RX_FIFO_CHUNK + 1
}

/// A far end with flow control is paused (XOFF) once a queue's frames fill the packet
/// buffer to its high-water mark, and what it would have sent stays in its line, in
/// order; the refills that drain the buffer to the low-water mark let it go (XON), and
/// nothing is lost. The pause is link-wide, as 802.3x is: another queue's frame behind
/// waits too.
#[test]
fn a_far_end_that_takes_pause_frames_is_paused_as_the_packet_buffer_fills_and_loses_nothing() {
    let mut r = two_guests();
    let high = chunks_before_xoff();
    let to_a = numbered(MAC_A, 0, POSTED as usize + high + 20);
    let mut src = Pausing::default();
    src.line.extend(to_a.iter().cloned());
    src.line.push_back(frame_to(MAC_B, None, 0xb0));
    let mut sink = crate::wire::CountingSink::default();
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!(src.told, vec![true], "paused once");
    assert_eq!((r.frames(1), r.missed(1)), (u64::from(POSTED), 0));
    assert_eq!(r.kept(), high as u64);
    assert_eq!(
        src.line.len(),
        21,
        "twenty frames for queue 1 and one for queue 2 wait"
    );
    assert_eq!(src.line.front(), Some(&to_a[POSTED as usize + high]));
    assert_eq!(r.regs.rx_xoffs.load(Ordering::Relaxed), 1);
    // Paused, a pass takes nothing more.
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!((src.line.len(), r.kept()), (21, high as u64));
    // Refills that leave the buffer just over the low-water mark do not let it go...
    let low = (RX_FIFO_BYTES - RX_FIFO_RESERVE - RX_FIFO_XON) / RX_FIFO_CHUNK;
    let first = (high - low - 1) as u32;
    r.post_at(1, POSTED, first);
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!(r.frames(1), u64::from(POSTED + first));
    assert_eq!(src.told, vec![true]);
    // ...one more does, and what waited comes in order, behind the packet buffer's.
    r.post_at(1, POSTED + first, 1);
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!(src.told, vec![true, false]);
    assert!(src.line.is_empty());
    assert_eq!(r.frames(2), 1, "queue 2's frame came after the pause");
    assert_eq!(r.kept(), high as u64 + 20);
    // Drained to the end: every frame for queue 1 placed, in order, none missed.
    let mut at = POSTED + first + 1;
    let total = to_a.len() as u64;
    while r.frames(1) < total {
        r.post_at(1, at, POSTED);
        r.dev.pass(&mut src, &mut sink, &mut 0);
        let placed = r.frames(1) as usize;
        for k in 0..POSTED {
            let n = placed - POSTED as usize + k as usize;
            assert_eq!(r.got_at(1, at + k), to_a[n], "frame {n}, in order");
        }
        at += POSTED;
    }
    assert_eq!(
        (
            r.frames(1),
            r.missed(1),
            r.regs.rx_missed.load(Ordering::Relaxed)
        ),
        (total, 0, 0)
    );
    assert!(r.dev.fifo.is_empty());
    assert_eq!(r.regs.rx_xoffs.load(Ordering::Relaxed), 1);
}

/// A guest that stops posting pauses a far end with flow control once, for the
/// queue's hold at most: its waiting frames are then dropped on its queue, the cable
/// goes on for the others, and what comes for the stuck queue is dropped at once
/// without filling the buffer or pausing the cable again, until its driver posts.
#[test]
fn a_guest_that_stops_posting_pauses_the_cable_once_and_then_loses_only_its_own_frames() {
    let mut r = two_guests();
    let high = chunks_before_xoff();
    let mut src = Pausing::default();
    src.line
        .extend(numbered(MAC_A, 0, POSTED as usize + high + 1));
    src.line.push_back(frame_to(MAC_B, None, 0xb0));
    let mut sink = crate::wire::CountingSink::default();
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!((src.told.clone(), src.line.len()), (vec![true], 2));
    let until = r.dev.pass(&mut src, &mut sink, &mut 0);
    assert!(
        matches!(until, Some(Some(_))),
        "the hold's end is the device's next wake-up: {until:?}"
    );
    std::thread::sleep(GUEST_QUEUE_HOLD + Duration::from_millis(5));
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!(
        src.told,
        vec![true, false],
        "let go once the queue's frames are dropped"
    );
    assert!(src.line.is_empty());
    assert_eq!(
        (r.frames(1), r.missed(1)),
        (u64::from(POSTED), high as u64 + 1)
    );
    assert_eq!((r.frames(2), r.missed(2)), (1, 0));
    assert!(r.dev.fifo.is_empty());
    // More for the stuck queue: dropped at once, no pause.
    src.line.extend(numbered(MAC_A, 1000, 2 * high));
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!(src.told, vec![true, false]);
    assert_eq!(r.missed(1), 3 * high as u64 + 1);
    assert!(r.dev.fifo.is_empty());
    assert_eq!(r.regs.rx_xoffs.load(Ordering::Relaxed), 1);
    // It posts again: its frames are placed, and kept when it is full, as before.
    r.post_at(1, POSTED, 1);
    src.line.extend(numbered(MAC_A, 2000, 2));
    r.dev.pass(&mut src, &mut sink, &mut 0);
    assert_eq!(
        (r.frames(1), r.missed(1)),
        (u64::from(POSTED) + 1, 3 * high as u64 + 1)
    );
    assert_eq!(r.kept(), high as u64 + 1);
}

/// What a cable was given: each frame and its offload.
#[derive(Default)]
struct Cable {
    takes: bool,
    got: Vec<(Vec<u8>, Offload)>,
}
impl WireSink for Cable {
    fn transmit(&mut self, frame: &[u8], off: Offload) {
        self.got.push((frame.to_vec(), off));
    }
    fn takes_offload(&self) -> bool {
        self.takes
    }
}

#[test]
fn a_large_packet_goes_whole_to_a_cable_that_takes_it_and_cut_with_checksums_to_one_that_does_not()
{
    let mut r = rig(1);
    let (big, off) = tcp_to([2, 0, 0, 0, 0, 0xc], 4000, 1000);
    for takes in [true, false] {
        let mut cable = Cable {
            takes,
            ..Cable::default()
        };
        r.dev.frame[..big.len()].copy_from_slice(&big);
        r.dev.send(&mut cable, big.len(), off);
        if takes {
            assert_eq!(
                cable.got,
                vec![(big.clone(), off)],
                "whole, with its offload"
            );
            assert_eq!(r.regs.tx_tso_segments.load(Ordering::Relaxed), 0);
        } else {
            assert_eq!(cable.got.len(), 4);
            let mut payload = Vec::new();
            for (k, (f, o)) in cable.got.iter().enumerate() {
                assert_eq!(*o, Offload::NONE, "segment {k}");
                assert_eq!(f.len(), 54 + 1000, "segment {k}");
                let l4 = net::offload::checksum_setup(f, f.len()).expect("a frame");
                assert!(net::offload::verify(f, &l4), "segment {k}'s checksum");
                payload.extend_from_slice(&f[54..]);
            }
            assert_eq!(payload, big[54..], "every byte, in order");
            assert_eq!(r.regs.tx_tso_segments.load(Ordering::Relaxed), 4);
        }
    }
    assert_eq!(r.regs.tx_gso.load(Ordering::Relaxed), 2);
    assert_eq!(r.regs.tx_bad_offload.load(Ordering::Relaxed), 0);
}

#[test]
fn frames_are_steered_by_destination_and_vlan_to_their_queue_and_the_rest_to_the_default() {
    let mut r = rig(RX_QUEUES);
    r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
    r.regs.set_filter(1, MAC_B, Some(5), 2).expect("filter");
    let to_a = frame_to(MAC_A, None, 1);
    let to_b5 = frame_to(MAC_B, Some(5), 2);
    let to_b = frame_to(MAC_B, None, 3);
    let to_b7 = frame_to(MAC_B, Some(7), 4);
    let bcast = frame_to([0xff; 6], None, 5);
    let other = frame_to([2, 0, 0, 0, 0, 0xc], None, 6);
    for f in [&to_a, &to_b5, &to_b, &to_b7, &bcast, &other] {
        r.dev.receive(f, Offload::NONE);
    }
    assert_eq!((r.frames(1), r.frames(2), r.frames(0)), (1, 1, 4));
    assert_eq!(r.got(1, 0), to_a);
    assert_eq!(r.got(2, 0), to_b5, "the tag is the guest's to see");
    // B untagged or on another VLAN, a broadcast, an unknown address: the default.
    assert_eq!(
        (0..4).map(|k| r.got(0, k)).collect::<Vec<_>>(),
        vec![to_b, to_b7, bcast, other]
    );
    // Each queue raised its own line, and only the queues that received.
    let pending: Vec<bool> = r.lines.iter().map(|l| l.pending()).collect();
    assert_eq!(pending[..4], [true, true, true, false]);
    assert!(pending[4..].iter().all(|p| !p));
    assert_eq!(r.regs.rxq[1].irqs.load(Ordering::Relaxed), 1);
    // A filter taken out of use sends its frames to the default queue (here full:
    // the frame waits in the device for it).
    r.regs.clear_filter(0).expect("clear");
    r.dev.receive(&to_a, Offload::NONE);
    assert_eq!((r.frames(1), r.missed(0)), (1, 0));
    assert_eq!(r.regs.rx_fifo_held.load(Ordering::Relaxed), 1);
}

#[test]
fn a_frame_steered_to_a_queue_that_is_off_is_dropped_on_that_queue_only() {
    // Lines for queues 0 and 1 only.
    let mut r = rig(2);
    r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
    r.regs.set_filter(1, MAC_B, None, 4).expect("filter");
    let to_a = frame_to(MAC_A, None, 1);
    // Queue 1 off: dropped on queue 1, the default untouched.
    r.regs.rxq[1].enabled.store(false, Ordering::Relaxed);
    r.dev.receive(&to_a, Offload::NONE);
    assert_eq!((r.missed(1), r.frames(0), r.frames(1)), (1, 0, 0));
    // On, with its four buffers: four land, the fifth waits in the device.
    r.regs.rxq[1].enabled.store(true, Ordering::Relaxed);
    for _ in 0..5 {
        r.dev.receive(&to_a, Offload::NONE);
    }
    assert_eq!((r.frames(1), r.missed(1), r.frames(0)), (4, 1, 0));
    assert_eq!(r.regs.rx_fifo_held.load(Ordering::Relaxed), 1);
    // Queue 4 has no interrupt line: it cannot take frames even when enabled.
    r.regs.rxq[4].enabled.store(true, Ordering::Relaxed);
    r.dev.receive(&frame_to(MAC_B, None, 2), Offload::NONE);
    assert_eq!((r.missed(4), r.frames(0)), (1, 0));
    assert_eq!(r.regs.rx_missed.load(Ordering::Relaxed), 2);
    // What the table refuses.
    assert_eq!(
        r.regs.set_filter(FILTERS, MAC_A, None, 1),
        Err(FilterError::NoEntry(FILTERS))
    );
    assert_eq!(
        r.regs.set_filter(2, MAC_A, None, RX_QUEUES),
        Err(FilterError::NoQueue(RX_QUEUES))
    );
    assert_eq!(
        r.regs.set_filter(2, [3, 0, 0, 0, 0, 1], None, 1),
        Err(FilterError::GroupAddress)
    );
}
