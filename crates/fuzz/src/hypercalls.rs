//! Grant and event-channel hypercalls with hostile arguments, and grant tables written
//! raw by their guest.
//!
//! Three domains: a hostile guest `evil`, a driver domain `drv` that maps, unmaps and
//! copies what the fuzzer names (as a back end driven by a hostile front end would), and
//! a bystander `calm` that has granted `drv` one page read-only and bound one event
//! channel to it. `evil` rewrites its own grant-table frames with arbitrary bytes,
//! grants and revokes through the API, calls the copy hypercall and every event-channel
//! operation with arbitrary domains, references, offsets, lengths and ports.
//!
//! Oracle: after the case `drv` releases what it still maps and `evil` is destroyed;
//! then `drv` holds no mapping, no frame of `evil` is still referenced (nothing left
//! for the reaper), `calm`'s page has its pattern, and `calm`'s channel still delivers.

use std::sync::Arc;

use hv::{
    CopyPtr, DomId, Domain, DomainConfig, GrantCopy, GrantHandle, GrantPath, GrantRef,
    GrantVersion, HvConfig, Hypervisor, MapOp, Port, PAGE_SIZE,
};

use crate::Input;

const SLOTS: u32 = 8;
const GRANT_FRAMES: u32 = 2;

fn pattern(i: usize) -> u8 {
    (i as u8).wrapping_mul(37).wrapping_add(11)
}

/// The machine, the driver domain and the bystander, which live for the thread: the
/// oracle brings them back to where they were after every case, so a case costs the
/// hypercalls' work rather than a machine's creation, and state one case leaves behind
/// fails a later case's oracle.
struct World {
    hv: Arc<Hypervisor>,
    drv: Arc<Domain>,
    calm: Arc<Domain>,
    calm_page: hv::Gfn,
    calm_ref: GrantRef,
    calm_port: Port,
    drv_port: Port,
    pat: Vec<u8>,
    /// Pages of drv's own that it copies to and from, and a frame number it does not have.
    drv_buffers: [hv::Gfn; 3],
}

fn cfg(name: &str, driver: bool, version: GrantVersion) -> DomainConfig {
    DomainConfig {
        name: name.into(),
        pages: 64,
        grant_frames: GRANT_FRAMES,
        grant_version: version,
        map_slots: SLOTS,
        driver_domain: driver,
        ..DomainConfig::default()
    }
}

impl World {
    fn new(version: GrantVersion, path: GrantPath) -> World {
        let hv = Hypervisor::new(HvConfig {
            frames: 1024,
            grant_path: path,
            ..HvConfig::default()
        })
        .expect("machine");
        let drv = hv.create_domain(&cfg("drv", true, version)).expect("drv");
        let calm = hv
            .create_domain(&cfg("calm", false, version))
            .expect("calm");
        // The bystander: a page granted read-only to drv, and a channel to it.
        let calm_page = calm.alloc_page().expect("page");
        let pat: Vec<u8> = (0..PAGE_SIZE).map(pattern).collect();
        calm.write(calm_page, 0, &pat).expect("fill");
        let calm_ref = calm.grant_table().alloc_ref().expect("ref");
        calm.grant_table()
            .grant_access(calm_ref, drv.id(), calm_page, true)
            .expect("grant");
        let drv_port = hv.evtchn_alloc_unbound(&drv, calm.id()).expect("unbound");
        let calm_port = hv
            .evtchn_bind_interdomain(&calm, drv.id(), drv_port)
            .expect("bind");
        let drv_buffers = [
            drv.alloc_page().expect("page"),
            drv.alloc_page().expect("page"),
            hv::Gfn(1 << 20),
        ];
        World {
            drv_buffers,
            hv,
            drv,
            calm,
            calm_page,
            calm_ref,
            calm_port,
            drv_port,
            pat,
        }
    }
}

/// One world per grant-table version and grant path.
type Worlds = Vec<((GrantVersion, GrantPath), Arc<World>)>;

thread_local! {
    static WORLDS: std::cell::RefCell<Worlds> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn world(version: GrantVersion, path: GrantPath) -> Arc<World> {
    WORLDS.with(|w| {
        let mut w = w.borrow_mut();
        if let Some((_, x)) = w.iter().find(|(k, _)| *k == (version, path)) {
            return Arc::clone(x);
        }
        let x = Arc::new(World::new(version, path));
        w.push(((version, path), Arc::clone(&x)));
        x
    })
}

/// One case.
pub fn case(inp: &mut Input<'_>) {
    let version = inp.pick(&[GrantVersion::V1, GrantVersion::V2]);
    let path = inp.pick(&[GrantPath::Original, GrantPath::Optimised]);
    let w = world(version, path);
    let (hv, drv, calm, calm_ref) = (&w.hv, &w.drv, &w.calm, w.calm_ref);
    let evil = hv
        .create_domain(&cfg("evil", false, version))
        .expect("evil");

    // evil's pages and some honest grants of them, to give the fuzzer valid starts.
    let pages: Vec<_> = (0..4).map(|_| evil.alloc_page().expect("page")).collect();
    let mut refs = Vec::new();
    for (i, &g) in pages.iter().enumerate() {
        if let Some(r) = evil.grant_table().alloc_ref() {
            let _ = evil.grant_table().grant_access(r, drv.id(), g, i % 2 == 0);
            refs.push(r.0);
        }
    }
    refs.extend([calm_ref.0, 0, 7, 511, 4096, u32::MAX]);
    let doms = [
        evil.id(),
        drv.id(),
        calm.id(),
        DomId(0),
        DomId(77),
        DomId(0x7ff0),
    ];
    let mut handles: Vec<GrantHandle> = Vec::new();

    let ops = 1 + inp.below(48);
    for _ in 0..ops {
        if inp.exhausted() {
            break;
        }
        match inp.below(10) {
            // evil writes its grant table directly, as a guest may.
            0 | 1 => {
                let frame = hv::Gfn(1 + inp.below(u64::from(GRANT_FRAMES)) as u32);
                let off = (inp.below(PAGE_SIZE as u64 / 8) * 8) as usize;
                let w = inp.u64().to_le_bytes();
                let n = inp.pick(&[2usize, 4, 8]);
                let _ = evil.write(frame, off, &w[..n]);
            }
            2 => {
                let r = GrantRef(inp.pick(&refs));
                let to = inp.pick(&doms);
                let g = hv::Gfn(inp.below(80) as u32);
                let _ = evil.grant_table().grant_access(r, to, g, inp.coin());
            }
            3 => {
                let _ = evil.grant_table().end_access(GrantRef(inp.pick(&refs)));
            }
            4 | 5 => {
                let n = 1 + inp.below(4) as usize;
                let ops: Vec<MapOp> = (0..n)
                    .map(|_| MapOp {
                        dom: inp.pick(&doms),
                        gref: GrantRef(inp.pick(&refs)),
                        readonly: inp.coin(),
                        slot: inp.below(u64::from(SLOTS) + 2) as u32,
                    })
                    .collect();
                let mut out = vec![Ok(GrantHandle(0)); n];
                hv.grant_map(drv, &ops, &mut out);
                handles.extend(out.into_iter().flatten());
            }
            6 => {
                let mut hs: Vec<GrantHandle> = (0..1 + inp.below(3))
                    .map(|_| {
                        if inp.coin() && !handles.is_empty() {
                            handles[inp.below(handles.len() as u64) as usize]
                        } else {
                            GrantHandle(inp.below(64) as u32)
                        }
                    })
                    .collect();
                hs.dedup();
                let mut st = vec![Ok(()); hs.len()];
                hv.grant_unmap(drv, &hs, &mut st);
                for (h, s) in hs.iter().zip(&st) {
                    if s.is_ok() {
                        handles.retain(|x| x != h);
                    }
                }
            }
            7 => {
                // evil copies to and from any of its own frames (its shared info and
                // grant table included: it only harms itself); drv, a back end acting
                // for evil, between evil's grants and its own buffers.
                let as_drv = inp.coin();
                let caller = if as_drv { drv } else { &evil };
                let n = 1 + inp.below(4) as usize;
                let ptr = |inp: &mut Input<'_>| {
                    let offset = inp.pick(&[0u16, 1, 100, 4095, 4096, u16::MAX]);
                    if inp.coin() {
                        CopyPtr::Gref {
                            dom: inp.pick(&doms),
                            gref: GrantRef(inp.pick(&refs)),
                            offset,
                        }
                    } else {
                        CopyPtr::Local {
                            gfn: if as_drv {
                                inp.pick(&w.drv_buffers)
                            } else {
                                hv::Gfn(inp.below(80) as u32)
                            },
                            offset,
                        }
                    }
                };
                let ops: Vec<GrantCopy> = (0..n)
                    .map(|_| GrantCopy {
                        source: ptr(inp),
                        dest: ptr(inp),
                        len: inp.pick(&[0u16, 1, 64, 1500, 4096, 4097, u16::MAX]),
                    })
                    .collect();
                let mut st = vec![Ok(()); n];
                hv.grant_copy(caller, &ops, &mut st);
            }
            8 => evtchn_op(inp, hv, &evil, &doms),
            _ => {
                // drv reads through its window, as a back end uses what it maps.
                let mut b = [0u8; 64];
                let _ = drv
                    .window()
                    .read(inp.below(u64::from(SLOTS) + 1) as u32, 0, &mut b);
            }
        }
    }
    finish(&w, evil, &handles);
}

fn evtchn_op(inp: &mut Input<'_>, hv: &Hypervisor, evil: &Domain, doms: &[DomId]) {
    let port = Port(inp.pick(&[0u32, 1, 2, 3, 5, 63, 64, 4095, 4096, u32::MAX]));
    let _ = match inp.below(6) {
        0 => hv.evtchn_alloc_unbound(evil, inp.pick(doms)).map(|_| ()),
        1 => hv
            .evtchn_bind_interdomain(evil, inp.pick(doms), port)
            .map(|_| ()),
        2 => hv.evtchn_send(evil, port),
        3 => hv.evtchn_close(evil, port),
        4 => hv.evtchn_unmask(evil, port),
        _ => hv.evtchn_bind_vcpu(evil, port, inp.below(4) as u32),
    };
}

fn finish(w: &World, evil: Arc<Domain>, handles: &[GrantHandle]) {
    let (hv, drv, calm) = (&w.hv, &w.drv, &w.calm);
    let mut st = vec![Ok(()); handles.len()];
    hv.grant_unmap(drv, handles, &mut st);
    assert_eq!(hv.mappings_held(drv), 0, "drv released every mapping");
    let id = evil.id();
    drop(evil);
    hv.destroy_domain(id).expect("destroy");
    assert_eq!(
        hv.reap(),
        0,
        "no frame of the destroyed guest is still held"
    );
    let mut got = vec![0u8; PAGE_SIZE];
    calm.read(w.calm_page, 0, &mut got).expect("read");
    assert!(got == w.pat, "the bystander's page is untouched");
    assert_eq!(hv.evtchn_open_ports(drv), 1, "drv's ports are its own");
    hv.evtchn_send(calm, w.calm_port)
        .expect("the bystander's channel still works");
    assert!(
        drv.evtchn_is_pending(w.drv_port).expect("port"),
        "and its event arrives"
    );
    // drv takes the event, leaving the world as the next case expects it.
    let mut seen = 0;
    drv.take_pending(0, |p| seen += usize::from(p == w.drv_port));
    assert_eq!(seen, 1, "the event is the bystander's alone");
}
