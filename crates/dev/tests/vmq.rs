//! Guest receive queues end to end: the device thread steers a guest's frames by its
//! MAC into buffers the driver posted on the guest's queue, raises that queue's own
//! interrupt, and the driver hands each buffer back by its owner's token; the default
//! queue sees none of them, and closing the queue gives back what was still posted.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::driver::{iova_of, DmaApi, NicDriver, VmqBuf, VmqDone, VmqError};
use dev::irq::{IrqLine, NativeIrq};
use dev::nic::{Coalesce, Nic};
use dev::wire::{CountingSink, PacedSender};
use hv::{DeviceId, DomainConfig, HvConfig, Hypervisor};
use net::netback::VIF_WINDOW_SLOTS;
use net::netfront::FrontConfig;
use net::netfront::RxBuffers;
use net::skb::SkbPool;
use net::toolstack::{self, VifSpec};
use net::wire::{parse_ipv4, parse_udp, PayloadCheck, UdpFlow, DEFAULT_MTU};
use smoltcp::wire::Ipv4Address;

const GUEST_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x21];
const FRAMES: u64 = 40;

fn flow(dst_mac: [u8; 6]) -> UdpFlow {
    UdpFlow {
        src_mac: [2, 0, 0, 0, 0, 1],
        dst_mac,
        src_ip: Ipv4Address::new(10, 0, 0, 1),
        dst_ip: Ipv4Address::new(10, 0, 0, 2),
        src_port: 1,
        dst_port: 2,
        mtu: DEFAULT_MTU,
    }
}

#[test]
fn a_guest_queue_gets_its_frames_in_its_own_buffers_and_its_own_interrupt() {
    let hv = Hypervisor::new(HvConfig {
        frames: 8192,
        ..HvConfig::default()
    })
    .expect("hv");
    let drv = hv
        .create_domain(&DomainConfig {
            name: "drv".into(),
            pages: 2048,
            driver_domain: true,
            ..DomainConfig::default()
        })
        .expect("drv");
    hv.iommu_attach(DeviceId(3), &drv).expect("attach");
    let lines: Vec<Arc<NativeIrq>> = (0..2).map(|_| Arc::default()).collect();
    let sender = PacedSender::new(flow(GUEST_MAC), 1000, 100_000.0, Some(FRAMES)).expect("sender");
    let nic = Nic::start_queues(
        &hv,
        DeviceId(3),
        lines
            .iter()
            .map(|l| IrqLine::Native(Arc::clone(l)))
            .collect(),
        Coalesce {
            pkts_per_irq: 8,
            ..Coalesce::default()
        },
        Box::new(sender),
        Box::new(CountingSink::default()),
    )
    .expect("nic");
    let regs = Arc::clone(nic.regs());
    let mut pool = SkbPool::new(Arc::clone(&drv), 1100, 16).expect("pool");
    let mut drv_nic = NicDriver::probe(&hv, &drv, &regs, &mut pool, DmaApi::Direct).expect("probe");
    // Queue 0 is the driver domain's; a queue past the last is none.
    assert!(matches!(
        drv_nic.vmq_open(0, GUEST_MAC, None),
        Err(VmqError::NoQueue(0))
    ));
    drv_nic.vmq_open(1, GUEST_MAC, None).expect("open");
    assert!(matches!(
        drv_nic.vmq_open(1, GUEST_MAC, None),
        Err(VmqError::InUse(1))
    ));
    // The guest's buffers: pages standing for the guest's posted, mapped pages.
    let pages: Vec<hv::Gfn> = (0..64)
        .map(|_| {
            let g = drv.alloc_page().expect("page");
            hv.iommu_map(&drv, iova_of(g, 0), g, true).expect("map");
            g
        })
        .collect();
    for (k, g) in pages.iter().enumerate() {
        let buf = VmqBuf {
            iova: iova_of(*g, 0),
            len: 2048,
            token: 1000 + k as u32,
        };
        drv_nic.vmq_post(1, buf).expect("room");
    }
    regs.plug();
    // Take what the device fills, as the driver domain's kernel would on the queue's
    // interrupt.
    let mut done: Vec<VmqDone> = Vec::new();
    let t0 = Instant::now();
    while (done.len() as u64) < FRAMES && t0.elapsed() < Duration::from_secs(10) {
        if lines[1].ack() {
            drv_nic.vmq_interrupt(1);
        }
        drv_nic.vmq_poll(1, 64, |d| done.push(d));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(done.len() as u64, FRAMES);
    // In order, each intact in the buffer it was given.
    let check = PayloadCheck::new(1000);
    for (k, d) in done.iter().enumerate() {
        assert_eq!(d.token, 1000 + k as u32);
        assert!(!d.error && d.csum_ok);
        let mut f = vec![0u8; d.len as usize];
        drv.read(pages[k], 0, &mut f).expect("read");
        let (ip, body) = parse_ipv4(&f).expect("ipv4");
        let (_, payload) = parse_udp(ip.src, ip.dst, body).expect("udp");
        assert!(check.verify(payload), "frame {k}");
    }
    // The queue's own line fired; the default queue got nothing.
    assert!(regs.rxq[1].irqs.load(Ordering::Relaxed) > 0);
    assert_eq!(regs.rxq[0].frames.load(Ordering::Relaxed), 0);
    assert_eq!(drv_nic.poll(&mut pool, 64, |p, s| p.free(s)), 0);
    // Closing gives back the buffers still posted, and the queue takes nothing more.
    let left = drv_nic.vmq_close(1);
    assert_eq!(left.len(), pages.len() - FRAMES as usize);
    assert_eq!(left[0], 1000 + FRAMES as u32);
    assert_eq!(drv_nic.vmq_room(1), 0);
    drv_nic.shutdown(&mut pool);
    drop(nic);
}

#[test]
fn with_direct_placement_the_nic_writes_a_guests_frames_into_the_buffers_its_netfront_posted() {
    let hv = Hypervisor::new(HvConfig {
        frames: 16384,
        ..HvConfig::default()
    })
    .expect("hv");
    let dom = |name: &str, driver: bool, slots: u32| {
        hv.create_domain(&DomainConfig {
            name: name.into(),
            pages: 2048,
            driver_domain: driver,
            map_slots: slots,
            ..DomainConfig::default()
        })
        .expect("domain")
    };
    let drv = dom("drv", true, VIF_WINDOW_SLOTS);
    let guest = dom("guest", false, 4);
    hv.iommu_attach(DeviceId(4), &drv).expect("attach");
    let lines: Vec<Arc<NativeIrq>> = (0..2).map(|_| Arc::default()).collect();
    let sender = PacedSender::new(flow(GUEST_MAC), 1472, 100_000.0, Some(FRAMES)).expect("sender");
    let nic = Nic::start_queues(
        &hv,
        DeviceId(4),
        lines
            .iter()
            .map(|l| IrqLine::Native(Arc::clone(l)))
            .collect(),
        Coalesce::default(),
        Box::new(sender),
        Box::new(CountingSink::default()),
    )
    .expect("nic");
    let regs = Arc::clone(nic.regs());
    let mut dpool = SkbPool::new(Arc::clone(&drv), 1100, 16).expect("pool");
    let mut driver = NicDriver::probe(&hv, &drv, &regs, &mut dpool, DmaApi::Direct).expect("probe");
    let spec = VifSpec {
        handle: 0,
        mac: GUEST_MAC,
        index: 0,
        front: FrontConfig {
            rx_buffers: RxBuffers::Linear,
            ..FrontConfig::default()
        },
    };
    let (mut front, mut vif) = toolstack::plug_vif(&hv, &drv, &guest, spec).expect("vif");
    vif.enable_direct();
    let mut gpool = SkbPool::new(Arc::clone(&guest), 512, 512).expect("pool");
    front.refill_rx(&mut gpool);
    driver.vmq_open(1, GUEST_MAC, None).expect("open");
    // The driver domain's kernel: map what the guest posted, give it to the queue, and
    // on the queue's interrupt hand what the NIC filled back to netback.
    let feed = |driver: &mut NicDriver, vif: &mut net::netback::Vif| {
        vif.rx_direct_refill();
        vif.rx_direct_give(|iova, len, token| {
            driver.vmq_post(1, VmqBuf { iova, len, token }).is_ok()
        });
    };
    feed(&mut driver, &mut vif);
    assert!(
        driver.vmq_room(1) < 1000,
        "the guest's buffers are on the queue"
    );
    regs.plug();
    let check = PayloadCheck::new(1472);
    let mut got = 0u64;
    let t0 = Instant::now();
    while got < FRAMES && t0.elapsed() < Duration::from_secs(10) {
        if lines[1].ack() {
            driver.vmq_interrupt(1);
        }
        let mut done = Vec::new();
        driver.vmq_poll(1, 64, |d| done.push(d));
        for d in done {
            vif.rx_direct_done(d.token, d.len, d.csum_ok, d.error);
        }
        vif.rx_direct_flush();
        front.poll_rx(&mut gpool, 64, |pool, skb| {
            let mut f = vec![0u8; pool.len(skb)];
            pool.read(skb, 0, &mut f).expect("read");
            let (ip, body) = parse_ipv4(&f).expect("ipv4");
            let (_, payload) = parse_udp(ip.src, ip.dst, body).expect("udp");
            assert!(check.verify(payload), "frame {got}");
            got += 1;
            pool.free(skb);
        });
        feed(&mut driver, &mut vif);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(got, FRAMES, "every frame placed and received intact");
    assert_eq!(vif.stats().rx_packets, FRAMES);
    // Nothing went through the default queue or was copied by netback.
    assert_eq!(regs.rxq[0].frames.load(Ordering::Relaxed), 0);
    assert_eq!(vif.stats().rx_copy_errors, 0);
    // Closing the queue gives back the buffers still posted; disconnecting unmaps them.
    let left = driver.vmq_close(1);
    assert!(!left.is_empty());
    vif.disconnect(&mut dpool);
    assert_eq!(hv.iommu().fault_count(), 0);
    driver.shutdown(&mut dpool);
    drop(nic);
}
