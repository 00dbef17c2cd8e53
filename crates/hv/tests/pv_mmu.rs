//! The PV memory manager: page tables built by the guest, pinned and validated by the
//! hypervisor, walked as the MMU would, and kept out of the IOMMU (paper 004). Each bad
//! input here is one of Xen's PV advisories' shapes; each has a row in THREAT_MODEL.md.

use std::sync::Arc;
use std::time::Duration;

use hv::frame::PageType;
use hv::mmu::*;
use hv::*;

const DEV: DeviceId = DeviceId(3);

fn machine() -> (Arc<Hypervisor>, Arc<Domain>, Arc<Domain>) {
    let hv = Hypervisor::new(HvConfig {
        frames: 1024,
        ..Default::default()
    })
    .expect("machine");
    let mk = |name: &str| {
        hv.create_domain(&DomainConfig {
            name: name.into(),
            pages: 128,
            ..Default::default()
        })
        .expect("domain")
    };
    let (a, b) = (mk("a"), mk("b"));
    (hv, a, b)
}

/// A fresh page of `d`, zeroed: (guest frame, machine frame).
fn page(d: &Domain) -> (Gfn, Mfn) {
    let g = d.alloc_page().expect("page");
    d.fill(g, 0, PAGE_SIZE, 0).expect("zero");
    (g, d.pv_machine_frame(g).expect("mfn"))
}

/// A pin of one table, its refusal reason if refused.
fn pin(hv: &Hypervisor, d: &Domain, level: u8, mfn: Mfn) -> Result<(), MmuError> {
    hv.mmuext(d, &[MmuExtOp::Pin { level, mfn }])
        .map_err(|e| e.error)
}

/// Pins a level-4 table and makes it vCPU 0's address space.
fn pin_as_base(hv: &Hypervisor, d: &Domain, l4: Mfn) -> Result<(), BatchError> {
    hv.mmuext(
        d,
        &[
            MmuExtOp::Pin { level: 4, mfn: l4 },
            MmuExtOp::NewBaseptr {
                vcpu: 0,
                mfn: Some(l4),
            },
        ],
    )
}

fn set(d: &Domain, table: Gfn, index: usize, e: u64) {
    d.write(table, index * 8, &e.to_le_bytes())
        .expect("guest write");
}

/// An address space for `va` built with the guest's own writes, not yet pinned:
/// [L4, L3, L2, L1] and the data page, mapped writable.
struct Space {
    tables: [(Gfn, Mfn); 4],
    data: (Gfn, Mfn),
}

const VA: u64 = 0x0000_7f12_3456_7000;

fn build(d: &Domain) -> Space {
    let tables = [page(d), page(d), page(d), page(d)];
    let data = page(d);
    for l in 0..3 {
        let level = 4 - l as u8;
        set(
            d,
            tables[l].0,
            va_index(VA, level),
            pte(tables[l + 1].1, PTE_P | PTE_RW | PTE_US),
        );
    }
    set(
        d,
        tables[3].0,
        va_index(VA, 1),
        pte(data.1, PTE_P | PTE_RW | PTE_US),
    );
    Space { tables, data }
}

fn types(hv: &Hypervisor, ms: &[Mfn]) -> Vec<((PageType, u64), u64)> {
    let ft = hv.frame_table();
    ms.iter()
        .map(|&m| (ft.page_type(m), ft.refcount(m)))
        .collect()
}

#[test]
fn a_pinned_space_translates_through_its_tables_and_its_tables_are_read_only_to_the_guest() {
    let (hv, a, _) = machine();
    let s = build(&a);
    let l4 = s.tables[0].1;
    pin(&hv, &a, 4, l4).expect("pin");
    // Pinning the top validated every level below it and typed each.
    for (i, &(_, m)) in s.tables.iter().enumerate() {
        assert_eq!(
            hv.frame_table().page_type(m),
            (PageType::PageTable(4 - i as u8), 1)
        );
    }
    assert_eq!(
        hv.frame_table().page_type(s.data.1),
        (PageType::Writable, 1)
    );
    hv.mmuext(
        &a,
        &[MmuExtOp::NewBaseptr {
            vcpu: 0,
            mfn: Some(l4),
        }],
    )
    .expect("base");

    hv.pv_write(&a, 0, VA + 100, b"through the walk")
        .expect("write");
    let mut back = [0u8; 16];
    a.read(s.data.0, 100, &mut back).expect("read");
    assert_eq!(&back, b"through the walk");
    let err = hv
        .pv_read(&a, 0, VA + 4096, &mut back)
        .expect_err("unmapped");
    assert_eq!(err.kind, FaultKind::NotPresent);

    // The guest's own writes to any level are refused now; reads are not.
    for &(g, _) in &s.tables {
        assert_eq!(a.write(g, 0, &[1]), Err(DomainError::PageTable(g.0)));
        assert!(a.atomic_u64(g, 0).is_err());
        a.read(g, 0, &mut back).expect("tables stay readable");
    }
    // A change goes through mmu_update: read-only from now on.
    let l1 = s.tables[3].1;
    hv.mmu_update(
        &a,
        &[MmuUpdate::new(
            l1,
            va_index(VA, 1),
            pte(s.data.1, PTE_P | PTE_US),
        )],
    )
    .expect("update");
    assert_eq!(
        hv.pv_write(&a, 0, VA, b"x").expect_err("read-only").kind,
        FaultKind::Protection
    );
    hv.pv_read(&a, 0, VA + 100, &mut back)
        .expect("still readable");
    assert_eq!(&back, b"through the walk");
    // The read-only entry dropped the data page's writable type; its reference stays.
    assert_eq!(hv.frame_table().page_type(s.data.1).1, 0);
    assert_eq!(
        hv.mmu_stats(&a)
            .walk_guard
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[test]
fn teardown_returns_every_count_and_the_pages_become_writable_again() {
    let (hv, a, _) = machine();
    let s = build(&a);
    let all: Vec<Mfn> = s.tables.iter().map(|t| t.1).chain([s.data.1]).collect();
    let before = types(&hv, &all);
    let l4 = s.tables[0].1;
    pin_as_base(&hv, &a, l4).expect("pin and switch");
    assert_eq!(
        hv.mmuext(&a, &[MmuExtOp::Unpin(l4)]),
        Err(BatchError {
            done: 0,
            error: MmuError::Busy
        }),
        "the current base cannot be unpinned"
    );
    hv.mmuext(
        &a,
        &[
            MmuExtOp::NewBaseptr { vcpu: 0, mfn: None },
            MmuExtOp::Unpin(l4),
        ],
    )
    .expect("switch away, unpin");
    assert_eq!(
        hv.mmuext(&a, &[MmuExtOp::Unpin(l4)]).map_err(|e| e.error),
        Err(MmuError::NotPinned),
        "a second unpin is refused, not an underflow"
    );
    // Counts are back; the recorded types stay until the guest asks for the pages.
    for (i, &m) in all.iter().enumerate() {
        assert_eq!(types(&hv, &[m])[0].1, before[i].1);
        assert_eq!(hv.frame_table().page_type(m).1, 0);
    }
    assert!(a.write(s.tables[2].0, 0, &[1]).is_err());
    let back: Vec<MmuExtOp> = s
        .tables
        .iter()
        .map(|t| MmuExtOp::MakeWritable(t.1))
        .collect();
    hv.mmuext(&a, &back).expect("make writable");
    a.write(s.tables[2].0, 0, &[1]).expect("writable again");
}

#[test]
fn no_entry_may_map_a_page_table_writable_or_a_frame_that_is_not_the_domains() {
    let (hv, a, b) = machine();
    let s = build(&a);
    let l1 = s.tables[3];
    let l2 = s.tables[2];
    pin(&hv, &a, 1, l1.1).expect("pin l1");

    // A second L1, fresh, whose entry 5 maps the pinned L1 writable.
    let (g, m) = page(&a);
    set(&a, g, 5, pte(l1.1, PTE_P | PTE_RW));
    assert_eq!(pin(&hv, &a, 1, m), Err(MmuError::TypeConflict));
    // Read-only is allowed: a guest may read its page tables.
    set(&a, g, 5, pte(l1.1, PTE_P));
    pin(&hv, &a, 1, m).expect("read-only view");
    // And the same through mmu_update, including the L1 mapping itself writable.
    for target in [l1.1, m] {
        assert_eq!(
            hv.mmu_update(&a, &[MmuUpdate::new(m, 6, pte(target, PTE_P | PTE_RW))])
                .map_err(|e| e.error),
            Err(MmuError::TypeConflict)
        );
    }
    // Another domain's frame, and the hypervisor's (the IOMMU's invalidation queue).
    let other = b.pv_machine_frame(Gfn(100)).expect("b's frame");
    let xen = (0..hv.frame_table().total())
        .map(Mfn)
        .find(|&f| hv.frame_table().owner(f) == Some(DomId::XEN))
        .expect("a hypervisor frame");
    for target in [other, xen] {
        for flags in [PTE_P, PTE_P | PTE_RW] {
            assert_eq!(
                hv.mmu_update(&a, &[MmuUpdate::new(m, 7, pte(target, flags))])
                    .map_err(|e| e.error),
                Err(MmuError::NotOwner)
            );
        }
    }
    assert_eq!(
        hv.mmu_update(&a, &[MmuUpdate::new(m, 7, pte(Mfn(1 << 30), PTE_P))])
            .map_err(|e| e.error),
        Err(MmuError::NoSuchFrame)
    );
    // A table of another domain cannot be updated, nor pinned.
    let (_, bm) = page(&b);
    assert_eq!(
        hv.mmu_update(&a, &[MmuUpdate::new(bm, 0, 0)])
            .map_err(|e| e.error),
        Err(MmuError::NotOwner)
    );
    assert_eq!(pin(&hv, &a, 1, bm), Err(MmuError::NotOwner));
    // Superpages and reserved bits.
    set(&a, l2.0, 9, pte(l1.1, PTE_P | PTE_PS));
    assert_eq!(pin(&hv, &a, 2, l2.1), Err(MmuError::BadFlags));
    assert_eq!(
        hv.mmu_update(&a, &[MmuUpdate::new(m, 8, pte(s.data.1, PTE_P | 1 << 52))])
            .map_err(|e| e.error),
        Err(MmuError::BadFlags)
    );
    assert_eq!(
        hv.mmu_update(
            &a,
            &[MmuUpdate {
                ptr: m.byte_offset() + 3,
                val: 0
            }]
        )
        .map_err(|e| e.error),
        Err(MmuError::Misaligned)
    );
    assert!(hv.mmu_stats(&a).errors(MmuError::TypeConflict) >= 3);
    assert!(hv.mmu_stats(&a).errors(MmuError::NotOwner) >= 6);
}

#[test]
fn a_table_has_one_level_and_cannot_refer_to_itself() {
    let (hv, a, _) = machine();
    let s = build(&a);
    let (l3, l2, l1) = (s.tables[1], s.tables[2], s.tables[3]);
    pin(&hv, &a, 2, l2.1).expect("l2 and its l1");
    // The L1 below it has L1's type: not pinnable as L2, and an L2 naming an L2 fails.
    assert_eq!(pin(&hv, &a, 2, l1.1), Err(MmuError::TypeConflict));
    assert_eq!(pin(&hv, &a, 2, l2.1), Err(MmuError::AlreadyPinned));
    assert_eq!(
        hv.mmu_update(&a, &[MmuUpdate::new(l2.1, 3, pte(l2.1, PTE_P))])
            .map_err(|e| e.error),
        Err(MmuError::TypeConflict),
        "an L2 naming itself"
    );
    assert_eq!(pin(&hv, &a, 5, l3.1), Err(MmuError::BadLevel));
    // A linear page table: the L4 naming itself in one of its slots.
    let l4 = s.tables[0];
    set(&a, l4.0, 10, pte(l4.1, PTE_P));
    assert_eq!(pin(&hv, &a, 4, l4.1), Err(MmuError::TypeConflict));
    set(&a, l4.0, 10, 0);
    // The hypervisor's slots.
    set(&a, l4.0, XEN_L4_SLOTS.start, pte(l3.1, PTE_P));
    assert_eq!(pin(&hv, &a, 4, l4.1), Err(MmuError::HypervisorSlot));
    set(&a, l4.0, XEN_L4_SLOTS.start, 0);
    pin(&hv, &a, 4, l4.1).expect("clean L4");
    assert_eq!(
        hv.mmu_update(
            &a,
            &[MmuUpdate::new(
                l4.1,
                XEN_L4_SLOTS.start + 1,
                pte(l3.1, PTE_P)
            )]
        )
        .map_err(|e| e.error),
        Err(MmuError::HypervisorSlot)
    );
    // A table in use cannot be handed back as writable.
    assert_eq!(
        hv.mmuext(&a, &[MmuExtOp::MakeWritable(l1.1)])
            .map_err(|e| e.error),
        Err(MmuError::Busy)
    );
}

#[test]
fn a_validation_that_fails_halfway_leaves_every_count_as_it_was() {
    let (hv, a, b) = machine();
    // An L2 whose first entries name good L1s (each mapping pages), whose last names
    // a foreign frame inside an otherwise good L1.
    let (l2g, l2m) = page(&a);
    let mut touched = vec![l2m];
    let mut good_l1s = Vec::new();
    for i in 0..4 {
        let (g, m) = page(&a);
        for j in 0..8 {
            let (_, d) = page(&a);
            set(&a, g, j, pte(d, PTE_P | PTE_RW));
            touched.push(d);
        }
        set(&a, l2g, i, pte(m, PTE_P | PTE_RW));
        touched.push(m);
        good_l1s.push(m);
    }
    let (bad_g, bad_m) = page(&a);
    let (_, d) = page(&a);
    set(&a, bad_g, 0, pte(d, PTE_P | PTE_RW));
    set(
        &a,
        bad_g,
        1,
        pte(b.pv_machine_frame(Gfn(90)).expect("b"), PTE_P),
    );
    set(&a, l2g, 4, pte(bad_m, PTE_P));
    touched.extend([bad_m, d]);
    let before = types(&hv, &touched);
    assert_eq!(pin(&hv, &a, 2, l2m), Err(MmuError::NotOwner));
    let after = types(&hv, &touched);
    for (i, (x, y)) in before.iter().zip(&after).enumerate() {
        assert_eq!(x.1, y.1, "reference count of frame {i}");
        assert_eq!(x.0 .1, y.0 .1, "type count of frame {i}");
    }
    // The L2 itself and the failing L1 keep their old types; the good L1s validated
    // before the failure keep theirs at count zero, as in Xen.
    assert_eq!(hv.frame_table().page_type(l2m), before[0].0);
    assert_eq!(hv.mmu_snapshot(&a).pinned, 0);
    a.write(l2g, 0, &[0])
        .expect("the L2 is still the guest's to write");
}

fn synced(policy: FlushPolicy) -> (Arc<Hypervisor>, Arc<Domain>) {
    let (hv, a, _) = machine();
    hv.iommu_attach(DEV, &a).expect("attach");
    hv.mmu_configure(
        &a,
        MmuConfig {
            iommu_sync: true,
            flush: policy,
            remap_on_level_change: false,
        },
    )
    .expect("sync");
    (hv, a)
}

fn iova(g: Gfn) -> Iova {
    Iova((g.0 as u64) << 12)
}

#[test]
fn a_device_cannot_write_a_page_table_live_or_unpinned_and_gets_the_page_back_when_writable() {
    let (hv, a) = synced(FlushPolicy::Strict);
    let s = build(&a);
    let l1 = s.tables[3];
    let mut dma = hv.iommu().device(DEV);
    dma.dma_write(iova(l1.0), &[0xee; 8])
        .expect("an ordinary page is the device's");
    a.write(l1.0, 0, &[0; 8]).expect("guest rewrites it");
    let flushes = hv
        .mmu_stats(&a)
        .pt_invalidations
        .load(std::sync::atomic::Ordering::Relaxed);
    pin(&hv, &a, 1, l1.1).expect("pin");
    assert_eq!(
        hv.mmu_stats(&a)
            .pt_invalidations
            .load(std::sync::atomic::Ordering::Relaxed),
        flushes + 1
    );
    let faults = hv.iommu().fault_count();
    let e = dma
        .dma_write(iova(l1.0), &[0xee; 8])
        .expect_err("a live table");
    assert_eq!(e.reason, hv::iommu::FaultReason::NotPresent);
    hv.mmuext(&a, &[MmuExtOp::Unpin(l1.1)]).expect("unpin");
    dma.dma_write(iova(l1.0), &[0xee; 8])
        .expect_err("unpinned, still a table's type");
    assert_eq!(hv.iommu().fault_count(), faults + 2);
    let mut entry = [0u8; 8];
    a.read(l1.0, va_index(VA, 1) * 8, &mut entry).expect("read");
    assert_eq!(
        u64::from_le_bytes(entry),
        pte(s.data.1, PTE_P | PTE_RW | PTE_US),
        "nothing written"
    );
    hv.mmuext(&a, &[MmuExtOp::MakeWritable(l1.1)])
        .expect("writable");
    dma.dma_write(iova(l1.0), &[0xee; 8])
        .expect("the device has it back");
    let st = hv.mmu_stats(&a);
    assert_eq!(
        st.iommu_unmaps.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(st.iommu_maps.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[test]
fn strict_flushes_once_per_table_batched_once_per_hypercall() {
    for (policy, waits) in [(FlushPolicy::Strict, 4), (FlushPolicy::Batched, 1)] {
        let (hv, a) = synced(policy);
        let s = build(&a);
        pin(&hv, &a, 4, s.tables[0].1).expect("pin");
        let st = hv.mmu_stats(&a);
        assert_eq!(
            st.pt_invalidations
                .load(std::sync::atomic::Ordering::Relaxed),
            4,
            "{policy:?}"
        );
        assert_eq!(
            st.pt_flush_waits.load(std::sync::atomic::Ordering::Relaxed),
            waits,
            "{policy:?}"
        );
    }
}

#[test]
fn lazy_flushing_leaves_a_window_in_which_a_device_writes_a_live_page_table() {
    let (hv, a) = synced(FlushPolicy::Lazy {
        entries: 256,
        timeout: Duration::from_secs(3600),
    });
    let s = build(&a);
    let l1 = s.tables[3];
    let mut dma = hv.iommu().device(DEV);
    // The device has used the page: its translation is in the IOTLB.
    dma.dma_write(iova(l1.0), &[0; 8]).expect("ordinary page");
    pin(&hv, &a, 1, l1.1).expect("pin");
    assert_eq!(hv.mmu_snapshot(&a).lazy_queued, 1);
    // Unmapped, not yet invalidated: the stale translation still writes the table.
    dma.dma_write(iova(l1.0), &[0xee; 8]).expect("the window");
    let mut e = [0u8; 8];
    a.read(l1.0, 0, &mut e).expect("read");
    assert_eq!(e, [0xee; 8], "a device wrote a validated page table");
    // The drain closes it.
    hv.mmu_configure(
        &a,
        MmuConfig {
            iommu_sync: true,
            flush: FlushPolicy::Strict,
            remap_on_level_change: false,
        },
    )
    .expect("drain");
    assert_eq!(hv.mmu_snapshot(&a).lazy_queued, 0);
    dma.dma_write(iova(l1.0), &[0; 8]).expect_err("closed");
    assert!(
        hv.mmu_stats(&a)
            .lazy_window_max_ns
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
}

#[test]
fn destroying_a_domain_with_pinned_tables_frees_every_frame() {
    let (hv, a, _) = machine();
    let free = hv.frame_table().free_frames();
    let s = build(&a);
    let l4 = s.tables[0].1;
    pin_as_base(&hv, &a, l4).expect("pin");
    let id = a.id();
    drop(a);
    hv.destroy_domain(id).expect("destroy");
    assert_eq!(hv.reap(), 0, "no frame held back");
    assert_eq!(hv.frame_table().free_frames(), free + 128);
}
