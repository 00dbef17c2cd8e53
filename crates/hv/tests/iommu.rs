//! The IOMMU: translation, faults, IOTLB behaviour and invalidation.

use std::sync::Arc;

use hv::iommu::{FaultReason, InvScope};
use hv::*;

fn setup() -> (Arc<Hypervisor>, Arc<Domain>) {
    let hv = Hypervisor::new(HvConfig {
        frames: 1024,
        ..Default::default()
    })
    .expect("machine");
    let d = hv
        .create_domain(&DomainConfig {
            name: "drv".into(),
            pages: 64,
            driver_domain: true,
            ..Default::default()
        })
        .expect("dom");
    (hv, d)
}

#[test]
fn dma_lands_in_the_domain_memory_through_the_tables() {
    let (hv, d) = setup();
    let g = d.alloc_page().expect("page");
    let g2 = d.alloc_page().expect("page");
    hv.iommu_map(&d, Iova(0x10_0000), g, true).expect("map");
    hv.iommu_map(&d, Iova(0x10_1000), g2, true).expect("map");
    hv.iommu_attach(DeviceId(3), &d).expect("attach");
    let mut dev = hv.iommu().device(DeviceId(3));
    // 6000 bytes from 0x10_0800 span both pages.
    let data: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
    dev.dma_write(Iova(0x10_0800), &data).expect("dma");
    let mut got = vec![0u8; 2048];
    d.read(g, 2048, &mut got).expect("read");
    assert_eq!(got, data[..2048]);
    let mut got2 = vec![0u8; 3952];
    d.read(g2, 0, &mut got2).expect("read");
    assert_eq!(got2, data[2048..]);
    assert_eq!(dev.misses, 2, "first touch of each page walks");
    let mut back = vec![0u8; 6000];
    dev.dma_read(Iova(0x10_0800), &mut back).expect("read back");
    assert_eq!(back, data);
    assert_eq!(dev.hits, 2, "second touch hits");
}

#[test]
fn unmapped_read_only_and_unassigned_accesses_fault_and_are_counted() {
    let (hv, d) = setup();
    let g = d.alloc_page().expect("page");
    hv.iommu_map(&d, Iova(0x2000), g, false).expect("ro map");
    hv.iommu_attach(DeviceId(1), &d).expect("attach");
    let mut dev = hv.iommu().device(DeviceId(1));
    let e = dev.dma_write(Iova(0x2000), b"x").expect_err("read-only");
    assert_eq!(e.reason, FaultReason::ReadOnly);
    let e = dev
        .dma_read(Iova(0x9000), &mut [0u8; 4])
        .expect_err("unmapped");
    assert_eq!(e.reason, FaultReason::NotPresent);
    let e = dev.translate(Iova(u64::MAX), false).expect_err("range");
    assert_eq!(e.reason, FaultReason::OutOfRange);
    let mut stranger = hv.iommu().device(DeviceId(2));
    let e = stranger
        .dma_read(Iova(0x2000), &mut [0u8; 4])
        .expect_err("no context");
    assert_eq!(e.reason, FaultReason::NoContext);
    assert_eq!(dev.faults, 3);
    assert_eq!(hv.iommu().fault_count(), 4);
    assert_eq!(hv.iommu().fault_log().len(), 4);
    let mut page = vec![0u8; PAGE_SIZE];
    d.read(g, 0, &mut page).expect("read");
    assert!(
        page.iter().all(|b| *b == 0),
        "the faulting write wrote nothing"
    );
    // The good read still works.
    dev.dma_read(Iova(0x2000), &mut [0u8; 4]).expect("readable");
}

#[test]
fn a_stale_translation_lasts_until_invalidated_register_and_queued() {
    for queued in [false, true] {
        let (hv, d) = setup();
        let g = d.alloc_page().expect("page");
        hv.iommu_map(&d, Iova(0x4000), g, true).expect("map");
        hv.iommu_attach(DeviceId(5), &d).expect("attach");
        let mut dev = hv.iommu().device(DeviceId(5));
        dev.translate(Iova(0x4000), true).expect("fill the IOTLB");
        hv.iommu_unmap(&d, Iova(0x4000)).expect("unmap");
        // As on hardware: the page table changed, the IOTLB did not yet.
        assert!(
            dev.translate(Iova(0x4000), true).is_ok(),
            "cached until invalidated"
        );
        let scope = InvScope::Page(d.id(), Iova(0x4000));
        if queued {
            hv.iommu().invalidate_queued(&[scope]);
            assert_eq!(
                hv.iommu()
                    .stats
                    .waits
                    .load(std::sync::atomic::Ordering::Relaxed),
                1
            );
        } else {
            hv.iommu().invalidate_register(scope);
        }
        assert_eq!(
            dev.translate(Iova(0x4000), true).map_err(|f| f.reason),
            Err(FaultReason::NotPresent)
        );
        assert_eq!(
            hv.iommu_unmap(&d, Iova(0x4000)),
            Err(hv::iommu::IommuError::NotMapped)
        );
    }
}

#[test]
fn domain_and_global_invalidations_drop_exactly_their_entries() {
    let hv = Hypervisor::new(HvConfig {
        frames: 1024,
        ..Default::default()
    })
    .expect("machine");
    let d1 = hv
        .create_domain(&DomainConfig {
            pages: 32,
            ..Default::default()
        })
        .expect("d1");
    let d2 = hv
        .create_domain(&DomainConfig {
            pages: 32,
            ..Default::default()
        })
        .expect("d2");
    for (d, dev) in [(&d1, 1u16), (&d2, 2)] {
        let g = d.alloc_page().expect("page");
        hv.iommu_map(d, Iova(0x1000), g, true).expect("map");
        hv.iommu_attach(DeviceId(dev), d).expect("attach");
    }
    let mut a = hv.iommu().device(DeviceId(1));
    let mut b = hv.iommu().device(DeviceId(2));
    a.translate(Iova(0x1000), false).expect("fill");
    b.translate(Iova(0x1000), false).expect("fill");
    hv.iommu().invalidate_register(InvScope::Domain(d1.id()));
    a.translate(Iova(0x1000), false).expect("refill");
    b.translate(Iova(0x1000), false).expect("still cached");
    assert_eq!((a.misses, b.misses, b.hits), (2, 1, 1));
    hv.iommu().invalidate_queued(&[InvScope::Global]);
    a.translate(Iova(0x1000), false).expect("walk");
    b.translate(Iova(0x1000), false).expect("walk");
    assert_eq!((a.misses, b.misses), (3, 2));
    // Destroying a domain detaches its devices.
    hv.destroy_domain(d2.id()).expect("destroy");
    assert_eq!(
        b.translate(Iova(0x1000), false).map_err(|f| f.reason),
        Err(FaultReason::NoContext)
    );
}

#[test]
fn a_queued_batch_longer_than_the_queue_invalidates_every_page() {
    let (hv, d) = setup();
    let g = d.alloc_page().expect("page");
    hv.iommu_attach(DeviceId(5), &d).expect("attach");
    let mut dev = hv.iommu().device(DeviceId(5));
    // More pages than one submission holds, each cached, then all unmapped.
    let n = 3 * hv::iommu::IQ_ENTRIES + 7;
    let iova = |i: usize| Iova((i as u64) << 12);
    for i in 0..n {
        hv.iommu_map(&d, iova(i), g, true).expect("map");
        dev.translate(iova(i), false).expect("fill");
    }
    let scopes: Vec<InvScope> = (0..n)
        .map(|i| {
            hv.iommu_unmap(&d, iova(i)).expect("unmap");
            InvScope::Page(d.id(), iova(i))
        })
        .collect();
    hv.iommu().invalidate_queued(&scopes);
    for i in 0..n {
        assert_eq!(
            dev.translate(iova(i), false).map_err(|f| f.reason),
            Err(FaultReason::NotPresent),
            "page {i} of {n}"
        );
    }
    let waits = hv
        .iommu()
        .stats
        .waits
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(waits as usize, n.div_ceil(hv::iommu::IQ_ENTRIES - 2));
}
