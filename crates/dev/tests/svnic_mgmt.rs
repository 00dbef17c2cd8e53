//! VIF management through the store: the toolstack creates, re-prioritises and
//! destroys VIFs and the device-side driver carries it out; a guest can do none of it,
//! to its own VIF or another's, and cannot read what another VIF was given.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::svnic::device::{SignalMode, Svnic, SvnicConfig};
use dev::svnic::engine::Schedule;
use dev::svnic::mgmt::{self, MgmtError, VifRequest};
use dev::svnic::vif::{VifFront, VifRegion, SLOTS};
use dev::wire::{WireSink, WireSource};
use hv::store::StoreError;
use hv::{DomId, OwnPage, Vector};
use mem::PageAccess;
use net::offload::Offload;

mod common;
use common::setup;

const WAIT: Duration = Duration::from_secs(10);

fn mac(i: usize) -> [u8; 6] {
    [0x02, 0, 0, 0, 0x20, i as u8]
}

fn request(guest: DomId, i: usize, priority: u8) -> VifRequest {
    VifRequest {
        guest,
        mac: mac(i),
        priority,
        vector: Vector(70 + i as u8),
    }
}

/// Counts the frames on the cable by their source MAC's last byte.
#[derive(Clone, Default)]
struct BySource(Arc<[AtomicU64; 4]>);

impl WireSink for BySource {
    fn transmit(&mut self, f: &[u8], _: Offload) {
        if let Some(c) = f.get(11).and_then(|&b| self.0.get(b as usize)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn device(s: &common::Setup, sink: BySource, link: dev::peer::WireRate) -> Svnic<OwnPage> {
    let cfg = SvnicConfig {
        signal: SignalMode::PerVif,
        link,
        ..SvnicConfig::default()
    };
    let svnic = managed(s, cfg, Box::new(dev::wire::Silence), Box::new(sink));
    svnic.link_up();
    svnic
}

/// A device on `s` with `cfg` and its cable, its management driver running.
fn managed(
    s: &common::Setup,
    cfg: SvnicConfig,
    source: Box<dyn WireSource>,
    sink: Box<dyn WireSink>,
) -> Svnic<OwnPage> {
    let mut svnic = Svnic::start(&s.hv, None, cfg, source, sink).expect("device");
    mgmt::prepare(&s.hv, s.device.id()).expect("prepare");
    svnic
        .manage(&s.hv, Arc::clone(&s.device))
        .expect("management driver");
    svnic
}

fn frame_from(i: usize) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0x99, 0x99];
    f.extend_from_slice(&mac(i));
    f.extend_from_slice(&[0x88, 0xb5]);
    f.resize(1000, i as u8);
    f
}

#[test]
fn a_guest_can_neither_manage_a_vif_nor_read_another_and_its_attempts_change_nothing() {
    let s = setup(2);
    let svnic = device(&s, BySource::default(), dev::peer::WireRate::Unlimited);
    let dev_id = s.device.id();
    let grefs0 =
        mgmt::create_vif(&s.hv, dev_id, 0, &request(s.guests[0].id(), 0, 50), WAIT).expect("VIF 0");
    mgmt::create_vif(&s.hv, dev_id, 1, &request(s.guests[1].id(), 1, 50), WAIT).expect("VIF 1");
    let st = s.hv.store();
    let me = s.guests[0].id();
    let root = mgmt::root(dev_id);
    let own = mgmt::vif_dir(dev_id, 0);
    let other = mgmt::vif_dir(dev_id, 1);
    let denied = |r: Result<(), StoreError>, what: &str| {
        assert!(matches!(r, Err(StoreError::Denied(_))), "{what}: {r:?}");
    };
    // Create a VIF for itself, re-prioritise or destroy its own or the other's.
    denied(
        st.write(me, &format!("{root}/vif/5/request"), "create"),
        "create",
    );
    denied(
        st.write(me, &format!("{own}/priority"), "100"),
        "own priority",
    );
    denied(
        st.write(me, &format!("{other}/priority"), "1"),
        "other's priority",
    );
    denied(
        st.write(me, &format!("{other}/request"), "destroy"),
        "destroy other",
    );
    denied(
        st.write(me, &format!("{own}/request"), "destroy"),
        "destroy own",
    );
    denied(st.rm(me, &other), "remove other");
    denied(
        st.write(me, &format!("{root}/schedule"), "quality-aware"),
        "schedule",
    );
    denied(st.set_perms(me, &root, me, &[]), "take the directory");
    // Nor learn what the other VIF was given.
    assert!(matches!(
        st.read(me, &format!("{other}/grefs")),
        Err(StoreError::Denied(_))
    ));
    assert!(matches!(
        st.directory(me, &root),
        Err(StoreError::Denied(_))
    ));
    // The same requests written where the guest may write reach no one.
    let mine = format!("/local/domain/{}/svnic/vif/5/request", me.0);
    let _ = st.write(me, &mine, "create");
    // The toolstack's own requests still go through: the device answered every one
    // and saw none of the guest's.
    mgmt::set_priority(&s.hv, dev_id, 0, 80).expect("toolstack's priority");
    let t = Instant::now();
    while svnic.mgmt_stats().priorities.load(Ordering::Relaxed) < 1 {
        assert!(t.elapsed() < WAIT, "priority change not taken");
        std::thread::sleep(Duration::from_millis(5));
    }
    let m = svnic.mgmt_stats();
    assert_eq!(m.created.load(Ordering::Relaxed), 2);
    assert_eq!(m.destroyed.load(Ordering::Relaxed), 0);
    assert_eq!(m.priorities.load(Ordering::Relaxed), 1);
    assert_eq!(
        st.read(DomId::DOM0, &format!("{own}/state")).as_deref(),
        Ok("connected")
    );
    // The other guest cannot map VIF 0's region from its grant references.
    assert!(VifRegion::map_grefs(&s.hv, &s.guests[1], grefs0.backend, &grefs0.grefs, 0).is_err());
    svnic.stop();
}

#[test]
fn the_toolstack_refuses_nothing_silently_and_a_destroy_waits_for_the_guest_to_unmap() {
    let s = setup(1);
    let svnic = device(&s, BySource::default(), dev::peer::WireRate::Unlimited);
    let dev_id = s.device.id();
    let g = &s.guests[0];
    let free = s.device.free_page_count();
    // Malformed requests: refused, said why, counted, nothing allocated.
    let no_guest = VifRequest {
        guest: DomId(999),
        ..request(g.id(), 0, 50)
    };
    for (req, why) in [(no_guest, "guest"), (request(g.id(), 0, 0), "priority")] {
        match mgmt::create_vif(&s.hv, dev_id, 0, &req, WAIT) {
            Err(MgmtError::Refused(e)) => assert!(e.starts_with(why), "{e}"),
            r => panic!("{why}: {r:?}"),
        }
    }
    assert_eq!(svnic.mgmt_stats().refused.load(Ordering::Relaxed), 2);
    assert_eq!(s.device.free_page_count(), free);
    // A good one; the guest maps it and uses it.
    let grefs = mgmt::create_vif(&s.hv, dev_id, 0, &request(g.id(), 0, 50), WAIT).expect("VIF");
    let (pages, handles) =
        VifRegion::map_grefs(&s.hv, g, grefs.backend, &grefs.grefs, 0).expect("mapped");
    let mut front = VifFront::new(pages);
    front.send(&frame_from(0)).expect("send");
    // Destroyed while the guest still maps it: the device lets go but keeps the memory
    // (busy) until the guest unmaps; then it is taken back and the grants are gone.
    match mgmt::destroy_vif(&s.hv, dev_id, 0, Duration::from_millis(300)) {
        Err(MgmtError::Timeout) => {}
        r => panic!("destroyed under a mapping: {r:?}"),
    }
    let dir = mgmt::vif_dir(dev_id, 0);
    assert_eq!(
        s.hv.store()
            .read(DomId::DOM0, &format!("{dir}/state"))
            .as_deref(),
        Ok("busy")
    );
    drop(front);
    VifRegion::unmap_in_guest(&s.hv, g, &handles).expect("unmap");
    mgmt::destroy_vif(&s.hv, dev_id, 0, WAIT).expect("destroyed once unmapped");
    assert_eq!(s.device.free_page_count(), free);
    assert!(VifRegion::map_grefs(&s.hv, g, grefs.backend, &grefs.grefs, 0).is_err());
    assert_eq!(svnic.mgmt_stats().destroyed.load(Ordering::Relaxed), 1);
    // The id can be used again.
    mgmt::create_vif(&s.hv, dev_id, 0, &request(g.id(), 0, 50), WAIT).expect("again");
    svnic.stop();
}

#[test]
fn priorities_and_the_scheduler_set_through_the_store_share_a_saturated_link() {
    let s = setup(2);
    let sink = BySource::default();
    // 1000-byte frames at 80 Mbit/s: some 10,000 a second, far fewer than two
    // flooding guests offer.
    let svnic = device(&s, sink.clone(), dev::peer::WireRate::Bits(80_000_000));
    let dev_id = s.device.id();
    mgmt::set_schedule(&s.hv, dev_id, Schedule::Priority).expect("schedule");
    let mut fronts = Vec::new();
    for i in 0..2 {
        let g = &s.guests[i];
        let grefs =
            mgmt::create_vif(&s.hv, dev_id, i as u16, &request(g.id(), i, 50), WAIT).expect("VIF");
        fronts.push(VifFront::new(
            VifRegion::map_grefs(&s.hv, g, grefs.backend, &grefs.grefs, 0)
                .expect("mapped")
                .0,
        ));
    }
    mgmt::set_priority(&s.hv, dev_id, 0, 90).expect("priority 0");
    mgmt::set_priority(&s.hv, dev_id, 1, 10).expect("priority 1");
    let t = Instant::now();
    while svnic.mgmt_stats().priorities.load(Ordering::Relaxed) < 2 {
        assert!(t.elapsed() < WAIT, "priorities not taken");
        std::thread::sleep(Duration::from_millis(5));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let floods: Vec<_> = fronts
        .into_iter()
        .enumerate()
        .map(|(i, mut f)| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let fr = frame_from(i);
                while !stop.load(Ordering::Relaxed) {
                    match f.isfull() {
                        Ok(false) => f.send(&fr).expect("send"),
                        _ => std::thread::yield_now(),
                    }
                }
            })
        })
        .collect();
    // Both send queues full: the link is saturated, shared 90:10.
    std::thread::sleep(Duration::from_millis(100));
    let before: Vec<u64> = sink.0.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    std::thread::sleep(Duration::from_millis(1000));
    let sent: Vec<u64> = sink
        .0
        .iter()
        .zip(&before)
        .map(|(c, b)| c.load(Ordering::Relaxed) - b)
        .collect();
    stop.store(true, Ordering::Relaxed);
    for f in floods {
        f.join().expect("flood");
    }
    svnic.stop();
    assert!(sent[0] + sent[1] > 2 * SLOTS as u64, "{sent:?}");
    // 9:1 as asked; well clear of the even split an ignored priority would give.
    let share = sent[0] as f64 / (sent[0] + sent[1]) as f64;
    assert!((0.8..=0.97).contains(&share), "{sent:?}: {share}");
}

/// Frames to VIF 0's MAC, numbered, as many as asked, from the moment the link is up.
struct ToVif0 {
    left: u32,
    k: u32,
}

impl WireSource for ToVif0 {
    fn poll(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
        let n = self.left.min(8);
        for _ in 0..n {
            let mut f = mac(0).to_vec();
            f.extend_from_slice(&[0x02, 0, 0, 0, 0x99, 0x98, 0x88, 0xb5]);
            f.extend_from_slice(&self.k.to_be_bytes());
            f.resize(200, 0xa5);
            emit(&f, Offload::NONE);
            self.k += 1;
        }
        self.left -= n;
        n as usize
    }
    fn next_due(&self) -> Option<Instant> {
        (self.left > 0).then(Instant::now)
    }
}

/// Two VIFs; an ingress bug places every 4th frame for VIF 0 at VIF 1's address. What
/// VIF 0's guest took, what VIF 1's buffers hold afterwards, and the DMA faults.
fn misplaced(iommu: bool) -> (u32, bool, u64) {
    const FRAMES: u32 = 64;
    let s = setup(2);
    let mut svnic = Svnic::start(
        &s.hv,
        None,
        SvnicConfig {
            signal: SignalMode::PerVif,
            iommu,
            ..SvnicConfig::default()
        },
        Box::new(ToVif0 { left: FRAMES, k: 0 }),
        Box::new(BySource::default()),
    )
    .expect("device");
    mgmt::prepare(&s.hv, s.device.id()).expect("prepare");
    svnic
        .manage(&s.hv, Arc::clone(&s.device))
        .expect("management driver");
    let mut fronts = Vec::new();
    for i in 0..2 {
        let g = &s.guests[i];
        let v = mgmt::create_vif(
            &s.hv,
            s.device.id(),
            i as u16,
            &request(g.id(), i, 50),
            WAIT,
        )
        .expect("VIF");
        if iommu {
            assert_ne!(v.backend, s.device.id(), "a memory domain of its own");
        }
        fronts.push(VifFront::new(
            VifRegion::map_grefs(&s.hv, g, v.backend, &v.grefs, 0)
                .expect("mapped")
                .0,
        ));
    }
    svnic.inject_misplacement(4);
    svnic.link_up();
    // VIF 0's guest takes all its slots: the misplaced ones come empty.
    let mut buf = [0u8; 2048];
    let (mut slots, mut whole) = (0, 0);
    let t = Instant::now();
    while slots < FRAMES {
        assert!(t.elapsed() < WAIT, "{slots} slots");
        match fronts[0].recv(&mut buf).expect("recv") {
            Some(0) => slots += 1,
            Some(n) => {
                assert_eq!(n, 200);
                assert!(buf[18..200].iter().all(|&b| b == 0xa5), "intact");
                slots += 1;
                whole += 1;
            }
            None => std::thread::yield_now(),
        }
    }
    // VIF 1 was sent nothing; its receive buffers are what its guest would read.
    let mut rx1 = vec![0u8; 2048];
    let mut touched = false;
    for i in 0..SLOTS {
        let p = &fronts[1].pages().rx[(i as usize * 2048) / mem::PAGE_SIZE];
        p.read((i as usize * 2048) % mem::PAGE_SIZE, &mut rx1)
            .expect("read");
        touched |= rx1.iter().any(|&b| b != 0);
    }
    let (_, ingress) = svnic.engine_stats();
    let faults = ingress.expect("ingress").dma_faults.load(Ordering::Relaxed);
    svnic.stop();
    (whole, touched, faults)
}

#[test]
fn with_an_iommu_context_per_vif_an_ingress_bug_faults_instead_of_writing_into_another_vif() {
    // Through each VIF's own context: every misplaced write faults, counted, and VIF
    // 1's memory is untouched.
    let (whole, touched, faults) = misplaced(true);
    assert_eq!((whole, faults), (48, 16));
    assert!(!touched, "VIF 1's buffers were written");
    // The same bug with the buffers written directly: the frames land in VIF 1.
    let (whole, touched, faults) = misplaced(false);
    assert_eq!((whole, faults), (48, 0));
    assert!(
        touched,
        "the bug is real: without the IOMMU it writes into VIF 1"
    );
}

/// A device on `s` cabled to `end`, serving one VIF (number `i`'s MAC) for its first
/// guest: the device and that guest's end of the VIF.
fn cabled(
    s: &common::Setup,
    end: dev::peer::CrossEnd,
    i: usize,
) -> (Svnic<OwnPage>, VifFront<mem::MappedPage>) {
    let sink = end.sink();
    let cfg = SvnicConfig {
        signal: SignalMode::PerVif,
        link: dev::peer::WireRate::GIGABIT,
        // Longer than the test: the frames wait for the guest however slow the
        // machine, so what is checked is the flow control, not a race.
        vif_hold: Duration::from_secs(60),
        ..SvnicConfig::default()
    };
    let svnic = managed(s, cfg, Box::new(end), Box::new(sink));
    let g = &s.guests[0];
    let v = mgmt::create_vif(&s.hv, s.device.id(), 0, &request(g.id(), i, 50), WAIT).expect("VIF");
    let front = VifFront::new(
        VifRegion::map_grefs(&s.hv, g, v.backend, &v.grefs, 0)
            .expect("mapped")
            .0,
    );
    svnic.link_up();
    (svnic, front)
}

#[test]
fn a_guest_that_drains_late_pauses_the_cable_back_to_the_sending_guest_and_loses_nothing() {
    // Four queues' worth: more than the receiving VIF, the receiving device's buffer
    // and the sending VIF's queue hold together, so the sender must wait.
    const FRAMES: u32 = 4 * SLOTS;
    let numbered = |k: u32| {
        let mut f = mac(1).to_vec();
        f.extend_from_slice(&mac(0));
        f.extend_from_slice(&[0x88, 0xb5]);
        f.extend_from_slice(&k.to_be_bytes());
        f.extend((0..1000).map(|i| (i as u32 ^ k) as u8));
        f
    };
    let (sa, sb) = (setup(1), setup(1));
    let (a, b) = dev::peer::crossover(dev::peer::WireRate::GIGABIT);
    let lost = a.sink();
    let (tx_dev, mut tx) = cabled(&sa, a, 0);
    let (rx_dev, mut rx) = cabled(&sb, b, 1);
    let (mut sent, mut got, mut waited) = (0u32, 0u32, false);
    let mut buf = [0u8; 2048];
    let t = Instant::now();
    while got < FRAMES {
        assert!(t.elapsed() < WAIT, "{sent} sent, {got} received");
        while sent < FRAMES {
            match tx.send(&numbered(sent)) {
                Ok(()) => sent += 1,
                Err(dev::svnic::vif::VifError::Full) => {
                    waited = true;
                    break;
                }
                Err(e) => panic!("send: {e:?}"),
            }
        }
        // The receiving guest takes nothing until its device has paused the cable.
        if rx_dev.drops().rx_xoffs == 0 {
            std::thread::yield_now();
            continue;
        }
        while let Some(n) = rx.recv(&mut buf).expect("recv") {
            assert_eq!(
                &buf[..n],
                &numbered(got)[..],
                "frame {got}, in order and whole"
            );
            got += 1;
        }
    }
    let drops = rx_dev.drops();
    let (_, ingress) = rx_dev.engine_stats();
    let ingress = ingress.expect("ingress");
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    assert!(
        waited,
        "the sending guest found its queue full: the pause reached it"
    );
    assert_eq!(drops.rx_fifo_full, 0, "{drops:?}");
    assert_eq!(l(&ingress.vif_full), 0, "nothing dropped for want of room");
    assert!(l(&ingress.vif_held) >= 1, "a frame waited for the guest");
    assert_eq!(lost.dropped(), 0, "nothing lost on the cable");
    assert!(drops.rx_xoffs >= 1, "{drops:?}");
    rx_dev.stop();
    tx_dev.stop();
}
