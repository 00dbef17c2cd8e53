//! The receive ring between the NIC and its driver under a driver that polls while the
//! device writes back: a done descriptor is never read with bytes from before the
//! device's write-back.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::driver::{DmaApi, NicDriver};
use dev::irq::{IrqLine, NativeIrq};
use dev::nic::{Coalesce, Nic};
use dev::wire::{CountingSink, PacedSender};
use hv::iommu::DmaLanding;
use hv::{DeviceId, DomainConfig, HvConfig, Hypervisor};
use net::skb::SkbPool;
use net::wire::{parse_ipv4, parse_udp, PayloadCheck, UdpFlow, DEFAULT_MTU};
use smoltcp::wire::Ipv4Address;

/// Frames the device receives in each run.
const FRAMES: u64 = 200_000;
/// A message's payload: one frame of 1042 bytes, shorter than the posted buffers.
const MESSAGE: usize = 1000;

/// Runs the device on its own thread against a driver that polls its ring without
/// pause (so that its reads of the next descriptor meet the device's write-backs), the
/// device's writes landing in memory or in the cache. Returns the frames taken and the
/// ones whose length or bytes were wrong.
fn poll_while_written_back(landing: DmaLanding) -> (u64, u64) {
    let hv = Hypervisor::new(HvConfig {
        frames: 8192,
        dma_landing: landing,
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
    let flow = UdpFlow {
        src_mac: [2, 0, 0, 0, 0, 1],
        dst_mac: [2, 0, 0, 0, 0, 2],
        src_ip: Ipv4Address::new(10, 0, 0, 1),
        dst_ip: Ipv4Address::new(10, 0, 0, 2),
        src_port: 1,
        dst_port: 2,
        mtu: DEFAULT_MTU,
    };
    // Faster than the driver takes them: the ring is full of fresh write-backs.
    let sender = PacedSender::new(flow, MESSAGE, 5_000_000.0, Some(FRAMES)).expect("sender");
    let line = Arc::new(NativeIrq::default());
    let nic = Nic::start(
        &hv,
        DeviceId(3),
        IrqLine::Native(Arc::clone(&line)),
        Coalesce::default(),
        Box::new(sender),
        Box::new(CountingSink::default()),
    )
    .expect("nic");
    let regs = Arc::clone(nic.regs());
    let mut pool = SkbPool::new(Arc::clone(&drv), 1100, 16).expect("pool");
    let mut driver = NicDriver::probe(&hv, &drv, &regs, &mut pool, DmaApi::Direct).expect("probe");
    regs.plug();
    let check = PayloadCheck::new(MESSAGE);
    let want = MESSAGE + 8 + 20 + 14;
    let (mut taken, mut wrong) = (0u64, 0u64);
    let mut frame = vec![0u8; 2048];
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        let _ = line.ack();
        driver.poll(&mut pool, 64, |pool, skb| {
            taken += 1;
            let len = pool.len(skb);
            let ok = len == want
                && pool.read(skb, 0, &mut frame[..len]).is_ok()
                && parse_ipv4(&frame[..len])
                    .ok()
                    .and_then(|(ip, body)| parse_udp(ip.src, ip.dst, body).ok())
                    .is_some_and(|(_, payload)| check.verify(payload));
            wrong += u64::from(!ok);
            pool.free(skb);
        });
        let missed = regs.rx_missed.load(Ordering::Relaxed);
        if taken + missed >= FRAMES {
            break;
        }
    }
    driver.shutdown(&mut pool);
    drop(nic);
    (taken, wrong)
}

/// The device's last store of a write-back is the word with the status and the
/// length, and the driver loads that word before the rest: a frame is never taken with
/// the posted buffer's length and the device's status, whichever way its writes land.
/// (With the descriptor written and read as one 16-byte copy, frames of the 200 000 in
/// memory landing came up wrong in every run on this project's AMD EPYC VM: 1 in each of
/// 2 debug runs, 3 to 5 in each of 5 release runs.)
#[test]
fn a_driver_polling_as_the_device_writes_back_takes_every_frame_at_the_length_written() {
    for landing in [DmaLanding::Memory, DmaLanding::Cache] {
        let (taken, wrong) = poll_while_written_back(landing);
        assert!(taken > FRAMES / 4, "{landing:?}: only {taken} frames taken");
        assert_eq!(wrong, 0, "{landing:?}: {wrong} of {taken} frames wrong");
    }
}
