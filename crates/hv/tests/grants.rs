//! Grant tables under attack: every bad input of issue 2 gets its own error, the rest of
//! the batch proceeds, and nothing else changes. Also the isolation properties of DESIGN
//! §3 that grants enforce. Each scenario runs on both layouts and both grant paths where
//! it applies.

use std::sync::Arc;

use hv::grant::{GNTST_BAD_COPY_ARG, GNTST_BAD_GNTREF, GNTST_BAD_HANDLE, GNTST_PERMISSION_DENIED};
use hv::*;

struct Machine {
    hv: Arc<Hypervisor>,
    /// Grants pages.
    a: Arc<Domain>,
    /// Uses A's grants.
    b: Arc<Domain>,
    /// A bystander.
    c: Arc<Domain>,
}

fn machine(version: GrantVersion, path: GrantPath) -> Machine {
    let hv = Hypervisor::new(HvConfig {
        frames: 2048,
        grant_path: path,
        ..HvConfig::default()
    })
    .expect("machine");
    let cfg = |name: &str| DomainConfig {
        name: name.into(),
        pages: 128,
        grant_version: version,
        map_slots: 16,
        ..Default::default()
    };
    let a = hv.create_domain(&cfg("a")).expect("a");
    let b = hv.create_domain(&cfg("b")).expect("b");
    let c = hv.create_domain(&cfg("c")).expect("c");
    Machine { hv, a, b, c }
}

fn all_configs() -> Vec<(GrantVersion, GrantPath)> {
    let mut v = Vec::new();
    for ver in [GrantVersion::V1, GrantVersion::V2] {
        for p in [GrantPath::Original, GrantPath::Optimised] {
            v.push((ver, p));
        }
    }
    v
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A page of `d` filled with a pattern.
fn page_with(d: &Domain, seed: u8) -> Gfn {
    let g = d.alloc_page().expect("page");
    d.write(g, 0, &pattern(seed)).expect("fill");
    g
}

fn read_page(d: &Domain, g: Gfn) -> Vec<u8> {
    let mut v = vec![0; PAGE_SIZE];
    d.read(g, 0, &mut v).expect("read");
    v
}

fn from_gref(dom: DomId, gref: GrantRef, offset: u16) -> CopyPtr {
    CopyPtr::Gref { dom, gref, offset }
}
fn local(gfn: Gfn, offset: u16) -> CopyPtr {
    CopyPtr::Local { gfn, offset }
}

fn copy1(m: &Machine, caller: &Domain, op: GrantCopy) -> GrantStatus {
    let mut st = [Ok(())];
    m.hv.grant_copy(caller, &[op], &mut st);
    st[0]
}

/// Nothing is left pinned or referenced: the grants are free and no frame of the
/// machine holds a reference.
fn assert_quiescent(m: &Machine, refs: &[GrantRef]) {
    for r in refs {
        assert_eq!(
            m.a.grant_table().in_use(*r),
            Ok(false),
            "grant {r:?} left in use"
        );
    }
    let ft = m.hv.frame_table();
    let total: u64 = (0..2048).map(|f| ft.refcount(Mfn(f))).sum();
    assert_eq!(total, 0, "frame references leaked");
}

#[test]
fn copy_moves_exactly_the_bytes_asked_in_every_configuration() {
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let src = page_with(&m.a, 1);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), src, true)
            .expect("grant");
        let dst = m.b.alloc_page().expect("page");
        let st = copy1(
            &m,
            &m.b,
            GrantCopy {
                source: from_gref(m.a.id(), r, 100),
                dest: local(dst, 7),
                len: 1500,
            },
        );
        assert_eq!(st, Ok(()), "{ver:?} {path:?}");
        let got = read_page(&m.b, dst);
        assert_eq!(&got[7..1507], &pattern(1)[100..1600]);
        assert!(
            got[..7].iter().all(|b| *b == 0) && got[1507..].iter().all(|b| *b == 0),
            "nothing else written"
        );
        assert_quiescent(&m, &[r]);
        // The grant is free again: revocation succeeds.
        assert_eq!(m.a.grant_table().end_access(r), Ok(()));
    }
}

#[test]
fn copy_into_a_writable_grant_and_frame_references_return_to_zero() {
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let dst = m.a.alloc_page().expect("page");
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), dst, false)
            .expect("grant");
        let src = page_with(&m.b, 9);
        let ops: Vec<GrantCopy> = (0..40u16)
            .map(|i| GrantCopy {
                source: local(src, i * 100),
                dest: from_gref(m.a.id(), r, i * 100),
                len: 100,
            })
            .collect();
        let mut st = vec![Err(GrantError::Unstable); ops.len()];
        assert_eq!(m.hv.grant_copy(&m.b, &ops, &mut st), 40, "{ver:?} {path:?}");
        assert_eq!(&read_page(&m.a, dst)[..4000], &pattern(9)[..4000]);
        assert_quiescent(&m, &[r]);
    }
}

#[test]
fn bad_grant_ref_fails_alone_and_the_batch_proceeds() {
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let src = page_with(&m.a, 2);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), src, true)
            .expect("grant");
        let dst = m.b.alloc_page().expect("page");
        let beyond = GrantRef(m.a.grant_table().entries());
        let ops = [
            GrantCopy {
                source: from_gref(m.a.id(), beyond, 0),
                dest: local(dst, 0),
                len: 8,
            },
            GrantCopy {
                source: from_gref(m.a.id(), r, 0),
                dest: local(dst, 0),
                len: 8,
            },
            GrantCopy {
                source: from_gref(m.a.id(), GrantRef(u32::MAX), 0),
                dest: local(dst, 0),
                len: 8,
            },
        ];
        let mut st = [Ok(()); 3];
        assert_eq!(m.hv.grant_copy(&m.b, &ops, &mut st), 1);
        assert_eq!(st[0], Err(GrantError::BadGntRef(beyond.0)));
        assert_eq!(st[0].map_err(|e| e.gntst()), Err(GNTST_BAD_GNTREF));
        assert_eq!(st[1], Ok(()));
        assert_eq!(st[2], Err(GrantError::BadGntRef(u32::MAX)));
        assert_eq!(&read_page(&m.b, dst)[..8], &pattern(2)[..8]);
        // Counted against the caller, per reason; nobody else's counters move.
        assert_eq!(m.b.grant_error_count(GrantError::BadGntRef(0)), 2);
        assert_eq!(m.b.grant_errors_total(), 2);
        assert_eq!(m.a.grant_errors_total() + m.c.grant_errors_total(), 0);
    }
}

#[test]
fn a_grant_for_another_domain_is_refused() {
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let src = page_with(&m.a, 3);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), src, false)
            .expect("grant to b");
        let dst = m.c.alloc_page().expect("page");
        // C names B's grant.
        let st = copy1(
            &m,
            &m.c,
            GrantCopy {
                source: from_gref(m.a.id(), r, 0),
                dest: local(dst, 0),
                len: 64,
            },
        );
        assert_eq!(st, Err(GrantError::NotForYou));
        assert_eq!(st.map_err(|e| e.gntst()), Err(GNTST_PERMISSION_DENIED));
        let mut out = [Ok(GrantHandle(0))];
        m.hv.grant_map(
            &m.c,
            &[MapOp {
                dom: m.a.id(),
                gref: r,
                readonly: true,
                slot: 0,
            }],
            &mut out,
        );
        assert_eq!(out[0], Err(GrantError::NotForYou));
        assert!(
            read_page(&m.c, dst).iter().all(|b| *b == 0),
            "C learned nothing"
        );
        assert_eq!(m.a.grant_table().in_use(r), Ok(false));
    }
}

#[test]
fn revoked_and_never_granted_entries_give_nothing() {
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let src = page_with(&m.a, 4);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        let never = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), src, true)
            .expect("grant");
        let dst = m.b.alloc_page().expect("page");
        let op = |g| GrantCopy {
            source: from_gref(m.a.id(), g, 0),
            dest: local(dst, 0),
            len: 64,
        };
        assert_eq!(copy1(&m, &m.b, op(r)), Ok(()));
        m.b.fill(dst, 0, PAGE_SIZE, 0).expect("clear");
        m.a.grant_table().end_access(r).expect("revoke");
        assert_eq!(
            copy1(&m, &m.b, op(r)),
            Err(GrantError::NotGranted),
            "after revoke"
        );
        assert_eq!(
            copy1(&m, &m.b, op(never)),
            Err(GrantError::NotGranted),
            "never granted"
        );
        let mut out = [Ok(GrantHandle(0))];
        m.hv.grant_map(
            &m.b,
            &[MapOp {
                dom: m.a.id(),
                gref: r,
                readonly: true,
                slot: 0,
            }],
            &mut out,
        );
        assert_eq!(out[0], Err(GrantError::NotGranted));
        assert!(read_page(&m.b, dst).iter().all(|b| *b == 0));
    }
}

#[test]
fn nothing_can_be_written_through_a_read_only_grant() {
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let page = page_with(&m.a, 5);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), page, true)
            .expect("ro grant");
        let src = page_with(&m.b, 99);
        let st = copy1(
            &m,
            &m.b,
            GrantCopy {
                source: local(src, 0),
                dest: from_gref(m.a.id(), r, 0),
                len: 64,
            },
        );
        assert_eq!(st, Err(GrantError::ReadOnly));
        // A writable map of a read-only grant is refused...
        let mut out = [Ok(GrantHandle(0))];
        m.hv.grant_map(
            &m.b,
            &[MapOp {
                dom: m.a.id(),
                gref: r,
                readonly: false,
                slot: 1,
            }],
            &mut out,
        );
        assert_eq!(out[0], Err(GrantError::ReadOnly));
        // ...and a read-only map is mapped PROT_READ: writes through it are refused.
        m.hv.grant_map(
            &m.b,
            &[MapOp {
                dom: m.a.id(),
                gref: r,
                readonly: true,
                slot: 1,
            }],
            &mut out,
        );
        let h = out[0].expect("ro map");
        assert_eq!(
            m.b.window().write(1, 0, b"evil"),
            Err(mem::MemError::ReadOnly(1))
        );
        let mut first = [0u8; 4];
        m.b.window().read(1, 0, &mut first).expect("readable");
        assert_eq!(&first, &pattern(5)[..4]);
        let mut us = [Ok(())];
        m.hv.grant_unmap(&m.b, &[h], &mut us);
        assert_eq!(us[0], Ok(()));
        assert_eq!(read_page(&m.a, page), pattern(5), "A's page is untouched");
    }
}

#[test]
fn copies_crossing_a_page_are_refused() {
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let page = page_with(&m.a, 6);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), page, true)
            .expect("grant");
        let dst = m.b.alloc_page().expect("page");
        let bad = [
            GrantCopy {
                source: from_gref(m.a.id(), r, 4000),
                dest: local(dst, 0),
                len: 200,
            },
            GrantCopy {
                source: from_gref(m.a.id(), r, 0),
                dest: local(dst, 4095),
                len: 2,
            },
            GrantCopy {
                source: from_gref(m.a.id(), r, u16::MAX),
                dest: local(dst, 0),
                len: 1,
            },
        ];
        for op in bad {
            let st = copy1(&m, &m.b, op);
            assert_eq!(st, Err(GrantError::BadCopyArg), "{op:?}");
            assert_eq!(st.map_err(|e| e.gntst()), Err(GNTST_BAD_COPY_ARG));
        }
        assert!(read_page(&m.b, dst).iter().all(|b| *b == 0));
        assert_eq!(m.a.grant_table().in_use(r), Ok(false));
    }
}

#[test]
fn a_sub_page_grant_gives_exactly_its_bytes() {
    for path in [GrantPath::Original, GrantPath::Optimised] {
        let m = machine(GrantVersion::V2, path);
        let page = page_with(&m.a, 7);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access_subpage(r, m.b.id(), page, 1000, 200, true)
            .expect("sub-page");
        let dst = m.b.alloc_page().expect("page");
        let op = |off, len| GrantCopy {
            source: from_gref(m.a.id(), r, off),
            dest: local(dst, off),
            len,
        };
        assert_eq!(copy1(&m, &m.b, op(1000, 200)), Ok(()));
        assert_eq!(copy1(&m, &m.b, op(999, 2)), Err(GrantError::OutsideSubPage));
        assert_eq!(
            copy1(&m, &m.b, op(1100, 101)),
            Err(GrantError::OutsideSubPage)
        );
        assert_eq!(
            copy1(&m, &m.b, op(0, 4096)),
            Err(GrantError::OutsideSubPage)
        );
        let got = read_page(&m.b, dst);
        assert_eq!(&got[1000..1200], &pattern(7)[1000..1200]);
        assert!(
            got[..1000].iter().chain(&got[1200..]).all(|b| *b == 0),
            "no byte outside the window"
        );
        // Sub-page grants cannot be mapped.
        let mut out = [Ok(GrantHandle(0))];
        m.hv.grant_map(
            &m.b,
            &[MapOp {
                dom: m.a.id(),
                gref: r,
                readonly: true,
                slot: 0,
            }],
            &mut out,
        );
        assert_eq!(out[0], Err(GrantError::NotMappable));
        // And they need a v2 table.
        let m1 = machine(GrantVersion::V1, path);
        let g = m1.a.alloc_page().expect("page");
        assert_eq!(
            m1.a.grant_table()
                .grant_access_subpage(GrantRef(9), m1.b.id(), g, 0, 8, true),
            Err(GrantError::WrongVersion)
        );
    }
}

#[test]
fn a_windowed_transitive_grant_gives_only_its_window_of_the_grant_it_names() {
    for path in [GrantPath::Original, GrantPath::Optimised] {
        let m = machine(GrantVersion::V2, path);
        // C grants A its whole page (as netfront grants a TX page); A passes 200 bytes
        // of it on to B.
        let page = page_with(&m.c, 8);
        let rc = m.c.grant_table().alloc_ref().expect("ref");
        m.c.grant_table()
            .grant_access(rc, m.a.id(), page, true)
            .expect("c->a");
        let ra = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access_transitive_window(ra, m.b.id(), (m.c.id(), rc), 1000, 200, true)
            .expect("a->b");
        let dst = m.b.alloc_page().expect("page");
        let read = |off: u16, len: u16| {
            copy1(
                &m,
                &m.b,
                GrantCopy {
                    source: from_gref(m.a.id(), ra, off),
                    dest: local(dst, 0),
                    len,
                },
            )
        };
        assert_eq!(read(1000, 200), Ok(()), "{path:?}");
        assert_eq!(&read_page(&m.b, dst)[..200], &pattern(8)[1000..1200]);
        // A byte before or after the window, or the whole page C granted: refused.
        assert_eq!(read(999, 2), Err(GrantError::OutsideSubPage));
        assert_eq!(read(1199, 2), Err(GrantError::OutsideSubPage));
        assert_eq!(read(0, 4096), Err(GrantError::OutsideSubPage));
        // Nor can B write through it.
        let st = copy1(
            &m,
            &m.b,
            GrantCopy {
                source: local(dst, 0),
                dest: from_gref(m.a.id(), ra, 1000),
                len: 10,
            },
        );
        assert_eq!(st, Err(GrantError::ReadOnly));
        assert_eq!(m.a.grant_table().in_use(ra), Ok(false));
        // A window past what the named grant gives is refused on use, and leaves
        // nothing pinned: C can revoke.
        let rc2 = m.c.grant_table().alloc_ref().expect("ref");
        m.c.grant_table()
            .grant_access_subpage(rc2, m.a.id(), page, 0, 512, true)
            .expect("c->a sub-page");
        m.a.grant_table()
            .grant_access_transitive_window(ra, m.b.id(), (m.c.id(), rc2), 500, 100, true)
            .expect("a->b");
        assert_eq!(read(500, 10), Err(GrantError::BadCopyArg));
        assert_eq!(m.c.grant_table().end_access(rc2), Ok(()));
        assert_eq!(m.c.grant_table().end_access(rc), Ok(()));
    }
}

#[test]
fn a_transitive_grant_gives_exactly_the_bytes_of_the_grant_it_names() {
    for path in [GrantPath::Original, GrantPath::Optimised] {
        let m = machine(GrantVersion::V2, path);
        // C grants A a sub-page; A passes it on to B transitively.
        let page = page_with(&m.c, 8);
        let rc = m.c.grant_table().alloc_ref().expect("ref");
        m.c.grant_table()
            .grant_access_subpage(rc, m.a.id(), page, 64, 1400, true)
            .expect("c->a");
        let ra = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access_transitive(ra, m.b.id(), m.c.id(), rc, true)
            .expect("a->b");
        let dst = m.b.alloc_page().expect("page");
        let st = copy1(
            &m,
            &m.b,
            GrantCopy {
                source: from_gref(m.a.id(), ra, 64),
                dest: local(dst, 0),
                len: 1400,
            },
        );
        assert_eq!(st, Ok(()), "{path:?}");
        assert_eq!(&read_page(&m.b, dst)[..1400], &pattern(8)[64..1464]);
        let st = copy1(
            &m,
            &m.b,
            GrantCopy {
                source: from_gref(m.a.id(), ra, 0),
                dest: local(dst, 0),
                len: 100,
            },
        );
        assert_eq!(st, Err(GrantError::OutsideSubPage));
        // Both grants are free afterwards; C's can be revoked.
        assert_eq!(m.a.grant_table().in_use(ra), Ok(false));
        assert_eq!(m.c.grant_table().end_access(rc), Ok(()));
        // Revoking the underlying grant kills the transitive one.
        let st = copy1(
            &m,
            &m.b,
            GrantCopy {
                source: from_gref(m.a.id(), ra, 64),
                dest: local(dst, 0),
                len: 10,
            },
        );
        assert_eq!(st, Err(GrantError::NotGranted));
        // B cannot use C's grant directly: it was for A.
        m.c.grant_table()
            .grant_access_subpage(rc, m.a.id(), page, 64, 1400, true)
            .expect("again");
        let st = copy1(
            &m,
            &m.b,
            GrantCopy {
                source: from_gref(m.c.id(), rc, 64),
                dest: local(dst, 0),
                len: 10,
            },
        );
        assert_eq!(st, Err(GrantError::NotForYou));
        // Transitive grants cannot be mapped.
        let mut out = [Ok(GrantHandle(0))];
        m.hv.grant_map(
            &m.b,
            &[MapOp {
                dom: m.a.id(),
                gref: ra,
                readonly: true,
                slot: 0,
            }],
            &mut out,
        );
        assert_eq!(out[0], Err(GrantError::NotMappable));
    }
}

#[test]
fn transitive_chains_longer_than_one_hop_and_loops_are_refused() {
    let m = machine(GrantVersion::V2, GrantPath::Optimised);
    let page = page_with(&m.c, 10);
    let dst = m.b.alloc_page().expect("page");
    let gt = |d: &Domain| d.grant_table().alloc_ref().expect("ref");
    // Two hops: B <- A (transitive) <- C (transitive) <- C's page.
    let rc_page = gt(&m.c);
    m.c.grant_table()
        .grant_access(rc_page, m.c.id(), page, true)
        .expect("c self");
    let rc = gt(&m.c);
    m.c.grant_table()
        .grant_access_transitive(rc, m.a.id(), m.c.id(), rc_page, true)
        .expect("c trans");
    let ra = gt(&m.a);
    m.a.grant_table()
        .grant_access_transitive(ra, m.b.id(), m.c.id(), rc, true)
        .expect("a trans");
    let st = copy1(
        &m,
        &m.b,
        GrantCopy {
            source: from_gref(m.a.id(), ra, 0),
            dest: local(dst, 0),
            len: 8,
        },
    );
    assert_eq!(st, Err(GrantError::TransitiveChain));
    // A loop: A's transitive grant names A's own table.
    let ra2 = gt(&m.a);
    m.a.grant_table()
        .grant_access_transitive(ra2, m.b.id(), m.a.id(), ra2, true)
        .expect("loop");
    let st = copy1(
        &m,
        &m.b,
        GrantCopy {
            source: from_gref(m.a.id(), ra2, 0),
            dest: local(dst, 0),
            len: 8,
        },
    );
    assert_eq!(st, Err(GrantError::TransitiveLoop));
    assert!(read_page(&m.b, dst).iter().all(|b| *b == 0));
    for r in [rc_page, rc] {
        assert_eq!(m.c.grant_table().in_use(r), Ok(false), "no pin left behind");
    }
}

#[test]
fn a_grant_in_use_cannot_be_revoked_and_unmap_frees_it() {
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let page = page_with(&m.a, 11);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), page, false)
            .expect("grant");
        let mut out = [Ok(GrantHandle(0))];
        m.hv.grant_map(
            &m.b,
            &[MapOp {
                dom: m.a.id(),
                gref: r,
                readonly: false,
                slot: 3,
            }],
            &mut out,
        );
        let h = out[0].expect("map");
        // The mapping is the real frame: B's writes appear in A's page.
        m.b.window().write(3, 10, b"hello").expect("rw map");
        assert_eq!(&read_page(&m.a, page)[10..15], b"hello");
        assert_eq!(m.a.grant_table().in_use(r), Ok(true));
        assert_eq!(
            m.a.grant_table().end_access(r),
            Err(GrantError::InUse),
            "{ver:?} {path:?}"
        );
        if ver == GrantVersion::V2 {
            // v2: the failed revoke already stops new users.
            let mut out2 = [Ok(GrantHandle(0))];
            m.hv.grant_map(
                &m.b,
                &[MapOp {
                    dom: m.a.id(),
                    gref: r,
                    readonly: false,
                    slot: 4,
                }],
                &mut out2,
            );
            assert_eq!(out2[0], Err(GrantError::NotGranted));
        }
        let mut us = [Ok(())];
        m.hv.grant_unmap(&m.b, &[h], &mut us);
        assert_eq!(us[0], Ok(()));
        assert_eq!(
            m.b.window().read(3, 0, &mut [0u8; 1]),
            Err(mem::MemError::NotMapped(3))
        );
        assert_eq!(m.a.grant_table().end_access(r), Ok(()));
        assert_eq!(
            m.hv.frame_table()
                .refcount(m.hv.gfn_to_mfn(&m.a, page).expect("own frame")),
            0
        );
    }
}

#[test]
fn unknown_handles_are_refused_and_nothing_is_unmapped() {
    let m = machine(GrantVersion::V1, GrantPath::Optimised);
    let page = page_with(&m.a, 12);
    let r = m.a.grant_table().alloc_ref().expect("ref");
    m.a.grant_table()
        .grant_access(r, m.b.id(), page, true)
        .expect("grant");
    let mut out = [Ok(GrantHandle(0))];
    m.hv.grant_map(
        &m.b,
        &[MapOp {
            dom: m.a.id(),
            gref: r,
            readonly: true,
            slot: 0,
        }],
        &mut out,
    );
    let h = out[0].expect("map");
    let mut us = [Ok(()), Ok(()), Ok(())];
    m.hv.grant_unmap(&m.b, &[GrantHandle(h.0 + 1), GrantHandle(9999), h], &mut us);
    assert_eq!(us[0], Err(GrantError::BadHandle(h.0 + 1)));
    assert_eq!(us[0].map_err(|e| e.gntst()), Err(GNTST_BAD_HANDLE));
    assert_eq!(us[1], Err(GrantError::BadHandle(9999)));
    assert_eq!(us[2], Ok(()));
    // Another domain cannot unmap B's handle either, and a second unmap is refused.
    let mut again = [Ok(())];
    m.hv.grant_unmap(&m.c, &[h], &mut again);
    assert_eq!(again[0], Err(GrantError::BadHandle(h.0)));
    m.hv.grant_unmap(&m.b, &[h], &mut again);
    assert_eq!(again[0], Err(GrantError::BadHandle(h.0)));
    assert_eq!(m.b.grant_error_count(GrantError::BadHandle(0)), 3);
    assert_eq!(m.c.grant_error_count(GrantError::BadHandle(0)), 1);
}

#[test]
fn map_slots_are_checked() {
    let m = machine(GrantVersion::V1, GrantPath::Original);
    let page = page_with(&m.a, 13);
    let r = m.a.grant_table().alloc_ref().expect("ref");
    m.a.grant_table()
        .grant_access(r, m.b.id(), page, true)
        .expect("grant");
    let mut out = [Ok(GrantHandle(0)), Ok(GrantHandle(0)), Ok(GrantHandle(0))];
    let op = |slot| MapOp {
        dom: m.a.id(),
        gref: r,
        readonly: true,
        slot,
    };
    m.hv.grant_map(&m.b, &[op(0), op(0), op(16)], &mut out);
    assert!(out[0].is_ok());
    assert_eq!(out[1], Err(GrantError::BadVirtAddr), "slot already used");
    assert_eq!(
        out[2],
        Err(GrantError::BadVirtAddr),
        "slot beyond the window"
    );
}

#[test]
fn a_domain_reaches_only_its_own_frames() {
    let m = machine(GrantVersion::V1, GrantPath::Optimised);
    let secret = page_with(&m.a, 14);
    let mine = m.b.alloc_page().expect("page");
    // B names A's frame number as if it were its own: it gets its own frame of that
    // number, never A's.
    let dst = m.b.alloc_page().expect("page");
    let st = copy1(
        &m,
        &m.b,
        GrantCopy {
            source: local(secret, 0),
            dest: local(dst, 0),
            len: 64,
        },
    );
    assert_eq!(st, Ok(()));
    assert_ne!(&read_page(&m.b, dst)[..64], &pattern(14)[..64]);
    // A frame beyond B's memory does not exist for B.
    let st = copy1(
        &m,
        &m.b,
        GrantCopy {
            source: local(Gfn(m.b.pages()), 0),
            dest: local(mine, 0),
            len: 8,
        },
    );
    assert_eq!(st, Err(GrantError::BadPage));
    assert!(m.b.read(Gfn(m.b.pages()), 0, &mut [0u8; 8]).is_err());
    // A grant naming a frame beyond A's memory is caught at use.
    let r = m.a.grant_table().alloc_ref().expect("ref");
    assert_eq!(
        m.a.grant_table()
            .grant_access(r, m.b.id(), Gfn(1 << 30), true),
        Err(GrantError::BadPage)
    );
}

#[test]
fn destroying_a_domain_releases_its_mappings_and_scrubs_its_frames() {
    let m = machine(GrantVersion::V1, GrantPath::Optimised);
    let page = page_with(&m.a, 15);
    let r = m.a.grant_table().alloc_ref().expect("ref");
    m.a.grant_table()
        .grant_access(r, m.b.id(), page, false)
        .expect("grant");
    let mut out = [Ok(GrantHandle(0))];
    m.hv.grant_map(
        &m.b,
        &[MapOp {
            dom: m.a.id(),
            gref: r,
            readonly: false,
            slot: 0,
        }],
        &mut out,
    );
    out[0].expect("map");
    assert_eq!(m.a.grant_table().end_access(r), Err(GrantError::InUse));
    m.hv.destroy_domain(m.b.id()).expect("destroy b");
    assert_eq!(
        m.a.grant_table().end_access(r),
        Ok(()),
        "B's mapping was released"
    );
    // B's id is gone for everyone.
    let mut st = [Ok(())];
    m.hv.grant_copy(
        &m.a,
        &[GrantCopy {
            source: from_gref(m.b.id(), GrantRef(8), 0),
            dest: local(page, 0),
            len: 1,
        }],
        &mut st,
    );
    assert_eq!(st[0], Err(GrantError::BadDomain(m.b.id())));
    // A's secret does not survive into the next owner of its frames.
    let a_id = m.a.id();
    drop(m.a);
    m.hv.destroy_domain(a_id).expect("destroy a");
    // B's frames wait while this test still holds a handle of B.
    assert_eq!(
        m.hv.reap(),
        m.b.pages() as usize,
        "only B's frames held back"
    );
    drop(m.b);
    assert_eq!(m.hv.reap(), 0, "no frame still held");
    let d =
        m.hv.create_domain(&DomainConfig {
            pages: 1500,
            ..Default::default()
        })
        .expect("big");
    let leaked = (0..d.pages()).any(|g| {
        let mut v = vec![0u8; PAGE_SIZE];
        d.read(Gfn(g), 0, &mut v).expect("own");
        v == pattern(15)
    });
    assert!(!leaked, "a previous owner's data survived");
}

#[test]
fn a_guest_rewriting_its_entry_during_use_gets_clean_outcomes_and_leaks_nothing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    for (ver, path) in all_configs() {
        let m = machine(ver, path);
        let page = page_with(&m.a, 16);
        let r = m.a.grant_table().alloc_ref().expect("ref");
        m.a.grant_table()
            .grant_access(r, m.b.id(), page, true)
            .expect("grant");
        let dst = m.b.alloc_page().expect("page");
        let stop = Arc::new(AtomicBool::new(false));
        // The guest keeps rewriting the entry: read-only / writable / revoked / again.
        let writer = {
            let (a, stop, b_id) = (Arc::clone(&m.a), Arc::clone(&stop), m.b.id());
            std::thread::spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let _ = match i % 3 {
                        0 => a.grant_table().grant_access(r, b_id, page, true),
                        1 => a.grant_table().grant_access(r, b_id, page, false),
                        _ => a.grant_table().end_access(r),
                    };
                    i = i.wrapping_add(1);
                }
            })
        };
        let mut seen_ok = 0;
        for _ in 0..20_000 {
            let st = copy1(
                &m,
                &m.b,
                GrantCopy {
                    source: from_gref(m.a.id(), r, 0),
                    dest: local(dst, 0),
                    len: 64,
                },
            );
            match st {
                Ok(()) => seen_ok += 1,
                Err(GrantError::NotGranted | GrantError::Unstable) => {}
                Err(e) => panic!("{ver:?} {path:?}: unexpected outcome {e:?}"),
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().expect("writer");
        // Whatever interleavings happened: nothing is left pinned or referenced, and the
        // bytes copied were always the page's.
        let _ = m.a.grant_table().end_access(r);
        assert_eq!(m.a.grant_table().in_use(r), Ok(false), "{ver:?} {path:?}");
        assert_quiescent(&m, &[r]);
        if seen_ok > 0 {
            assert_eq!(&read_page(&m.b, dst)[..64], &pattern(16)[..64]);
        }
    }
}
