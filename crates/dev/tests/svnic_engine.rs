//! The SV-NIC's micro-engines: egress contexts serve disjoint sets of VIFs fairly,
//! one packet a step; ingress contexts place the wire's frames in the right VIF, in
//! order, once each, also with two engines on two threads sharing the VIFs.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dev::svnic::engine::{Demux, Egress, Ingress, IngressVifs, Stage, StageTimes};
use dev::svnic::vif::{VifDevice, VifFront, VifRegion, SLOTS, SLOT_BYTES};
use hv::OwnPage;
use mem::MappedPage;

mod common;
use common::{setup, vif};

fn mac(i: usize) -> [u8; 6] {
    [0x02, 0, 0, 0, 0x10, i as u8]
}

/// The source address of [`frame`]'s frames: egress tests give it to every VIF.
const SRC: [u8; 6] = [0x02, 0, 0, 0, 0x99, 0x99];

/// A frame to VIF `to`, numbered `k`, its payload derived from both.
fn frame(to: usize, k: u32) -> Vec<u8> {
    let mut f = mac(to).to_vec();
    f.extend_from_slice(&SRC);
    f.extend_from_slice(&[0x88, 0xb5]);
    f.extend_from_slice(&k.to_be_bytes());
    f.extend((0..64 + (k % 200) as usize).map(|i| (i as u32 ^ k) as u8));
    f
}

fn number(f: &[u8]) -> u32 {
    u32::from_be_bytes([f[14], f[15], f[16], f[17]])
}

#[test]
fn the_demux_finds_every_vif_by_mac_and_nothing_else() {
    let mut d = Demux::new(32);
    for i in 0..32 {
        assert!(d.insert(mac(i), i as u16));
    }
    for i in 0..32 {
        assert_eq!(d.lookup(&mac(i)), Some(i as u16));
    }
    assert_eq!(d.lookup(&mac(200)), None);
    assert_eq!(d.lookup(&[0xff; 6]), None);
    assert!(d.insert(mac(3), 7), "a MAC moves to another VIF");
    assert_eq!(d.lookup(&mac(3)), Some(7));
}

#[test]
fn egress_contexts_serve_disjoint_vifs_one_packet_a_step_so_a_flood_starves_no_one() {
    let s = setup(5);
    let times = Arc::new(StageTimes::default());
    let mut egress = Egress::new(2, Arc::clone(&times));
    let mut fronts = Vec::new();
    for i in 0..5 {
        let (dev, front) = vif(&s, i);
        egress.add(i as u16, SRC, dev.tx);
        fronts.push(front);
    }
    // Contexts: {0, 2, 4} and {1, 3}. VIF 0 floods its queue; VIF 2 sends 5.
    for k in 0..SLOTS {
        fronts[0].send(&frame(9, k)).expect("flood");
    }
    for k in 0..5 {
        fronts[2].send(&frame(9, 1000 + k)).expect("send");
    }
    let mut out: Vec<(u16, u32)> = Vec::new();
    for _ in 0..10 {
        let n = egress.step(usize::MAX, &mut |id, f| out.push((id, number(f))));
        assert!(n <= 2, "at most one packet per context per step");
    }
    // In ten steps the flooding VIF's context-mate sent all five, alternating.
    let two: Vec<u32> = out.iter().filter(|(v, _)| *v == 2).map(|x| x.1).collect();
    assert_eq!(two, (1000..1005).collect::<Vec<_>>());
    let zero = out.iter().filter(|(v, _)| *v == 0).count();
    assert!((5..=6).contains(&zero), "{out:?}");
    // The rest drains in order.
    while egress.step(usize::MAX, &mut |id, f| out.push((id, number(f)))) > 0 {}
    let zero: Vec<u32> = out.iter().filter(|(v, _)| *v == 0).map(|x| x.1).collect();
    assert_eq!(zero, (0..SLOTS).collect::<Vec<_>>());
    let (ticks, n) = times.get(Stage::MsgRcv);
    assert_eq!(n, u64::from(SLOTS) + 5);
    assert!(ticks > 0);
}

/// A guest puts another source address on its frames: egress drops each before the
/// wire, counted, under either schedule, and the VIF's own frames and the other VIFs'
/// still go out.
#[test]
fn egress_drops_frames_whose_source_is_not_their_vifs_own() {
    use dev::svnic::engine::Schedule;
    for schedule in [Schedule::RoundRobin, Schedule::Priority] {
        let s = setup(2);
        let mut egress = Egress::new(2, Arc::new(StageTimes::default()));
        egress.set_schedule(schedule);
        let (d0, mut f0) = vif(&s, 0);
        let (d1, mut f1) = vif(&s, 1);
        egress.add(0, SRC, d0.tx);
        egress.add(1, mac(1), d1.tx);
        // VIF 0 sends its own address and the victim's; VIF 1 claims SRC, which is
        // VIF 0's.
        let mut victim = frame(9, 2);
        victim[6..12].copy_from_slice(&mac(1));
        for f in [frame(9, 1), victim, frame(9, 3)] {
            f0.send(&f).expect("send");
        }
        f1.send(&frame(9, 4)).expect("send");
        let mut out = Vec::new();
        while egress.step(usize::MAX, &mut |id, f| out.push((id, number(f)))) > 0
            || egress.has_pending()
        {}
        assert_eq!(out, vec![(0, 1), (0, 3)], "{schedule:?}");
        assert_eq!(
            egress
                .stats()
                .spoofed
                .load(std::sync::atomic::Ordering::Relaxed),
            2,
            "{schedule:?}"
        );
    }
}

#[test]
fn ingress_places_each_frame_in_its_vif_in_order_and_counts_the_rest() {
    let s = setup(3);
    let times = Arc::new(StageTimes::default());
    let mut ingress = Ingress::new(8, Arc::clone(&times));
    let (vifs, mut fronts) = ingress_vifs(&s, 3);
    fronts[1].set_rx_signal(true).expect("signal on");
    // 3 × 40 frames interleaved, and 5 for a MAC no VIF has.
    let mut wire: VecDeque<Vec<u8>> = VecDeque::new();
    for k in 0..40 {
        for to in 0..3 {
            wire.push_back(frame(to, k));
        }
        if k % 8 == 0 {
            wire.push_back(frame(77, k));
        }
    }
    let mut signals = [0u32; 3];
    let mut take = |buf: &mut [u8]| from_wire(&mut wire, buf);
    let mut placed = 0;
    loop {
        let n = ingress.step(&vifs, Instant::now(), &mut take, &mut |v| {
            signals[v as usize] += 1
        });
        placed += n;
        if n == 0 && ingress.in_flight() == 0 {
            break;
        }
    }
    assert_eq!(placed, 120);
    assert_eq!(
        signals,
        [0, 40, 0],
        "only the guest that asked is signalled"
    );
    assert_eq!(
        ingress
            .stats()
            .no_vif
            .load(std::sync::atomic::Ordering::Relaxed),
        5
    );
    let mut buf = [0u8; SLOT_BYTES];
    for (to, front) in fronts.iter_mut().enumerate() {
        for k in 0..40 {
            let n = front.recv(&mut buf).expect("recv").expect("a frame");
            assert_eq!(&buf[..n], &frame(to, k)[..], "VIF {to}, frame {k}");
        }
        assert!(front.isempty().expect("empty"));
    }
    // Every frame was taken from the wire; those with a VIF went on through the rest.
    assert_eq!(times.get(Stage::PktRx).1, 125);
    for st in [Stage::ChnlDemux, Stage::MsgSend] {
        assert_eq!(times.get(st).1, 120, "{st:?}");
    }
}

#[test]
fn two_ingress_engines_on_two_threads_place_every_frame_once_and_intact_or_count_it() {
    const FRAMES: u32 = 20_000;
    let s = setup(2);
    let times = Arc::new(StageTimes::default());
    let (vifs, mut fronts) = ingress_vifs(&s, 2);
    let vifs = Arc::new(vifs);
    let wire: Arc<Mutex<VecDeque<Vec<u8>>>> = Arc::new(Mutex::new(
        (0..FRAMES).map(|k| frame((k % 2) as usize, k)).collect(),
    ));
    let engines: Vec<_> = (0..2)
        .map(|_| {
            let (vifs, wire, times) = (Arc::clone(&vifs), Arc::clone(&wire), Arc::clone(&times));
            std::thread::spawn(move || {
                let mut ingress = Ingress::new(4, times);
                let mut take = |buf: &mut [u8]| {
                    let f = wire.lock().expect("wire").pop_front()?;
                    buf[..f.len()].copy_from_slice(&f);
                    Some((f.len(), None))
                };
                loop {
                    let n = ingress.step(&vifs, Instant::now(), &mut take, &mut |_| {});
                    if n == 0 {
                        if ingress.in_flight() == 0 && wire.lock().expect("wire").is_empty() {
                            break;
                        }
                        std::thread::yield_now();
                    }
                }
                Arc::clone(ingress.stats())
            })
        })
        .collect();
    // The guests drain as frames come: every frame that arrives arrives once, with its
    // bytes; what a full queue could not take is counted.
    let mut seen = vec![false; FRAMES as usize];
    let mut got = 0u64;
    let mut buf = [0u8; SLOT_BYTES];
    let mut drain = |fronts: &mut Vec<VifFront<MappedPage>>, got: &mut u64| {
        let mut any = false;
        for (to, front) in fronts.iter_mut().enumerate() {
            while let Some(n) = front.recv(&mut buf).expect("recv") {
                let k = number(&buf[..n]);
                assert_eq!(&buf[..n], &frame(to, k)[..]);
                assert!(!seen[k as usize], "frame {k} twice");
                seen[k as usize] = true;
                *got += 1;
                any = true;
            }
        }
        any
    };
    while !engines.iter().all(|e| e.is_finished()) {
        if !drain(&mut fronts, &mut got) {
            std::thread::yield_now();
        }
    }
    let full: u64 = engines
        .into_iter()
        .map(|e| {
            e.join()
                .expect("engine")
                .vif_full
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    drain(&mut fronts, &mut got);
    assert_eq!(
        got + full,
        u64::from(FRAMES),
        "{got} placed, {full} counted full"
    );
    assert!(got > 0, "frames were placed");
}

#[test]
fn identifier_bits_are_shared_past_eight_vifs_as_the_papers_formula_says() {
    use dev::svnic::signal::{BitMap, Dir, IdRegister};
    for n in [1usize, 4, 8, 9, 16, 20, 32] {
        let reg = IdRegister::default();
        let mut map = BitMap::default();
        let bits: Vec<u8> = (0..n)
            .map(|v| {
                let b = reg.assign();
                map.add(b, v as u16);
                b
            })
            .collect();
        // A frame for any one VIF signals every VIF sharing its bit: ⌊n/8⌋ to ⌈n/8⌉.
        for (v, &b) in bits.iter().enumerate() {
            assert!(
                reg.raise(Dir::Rx, b),
                "the register was clear: a master interrupt"
            );
            let set = reg.take(Dir::Rx);
            let mut woken = Vec::new();
            let k = map.demux(set, &mut |x| woken.push(x));
            assert!(woken.contains(&(v as u16)));
            let (lo, hi) = (n / 8, n.div_ceil(8));
            assert!(lo.max(1) <= k && k <= hi, "n = {n}: {k} signalled");
        }
        // Two frames before the handler runs: one interrupt, both bits handled.
        if n >= 2 {
            assert!(reg.raise(Dir::Rx, bits[0]));
            assert!(!reg.raise(Dir::Rx, bits[1]));
            assert_eq!(reg.take(Dir::Rx), (1 << bits[0]) | (1 << bits[1]));
        }
        assert_eq!(reg.take(Dir::Tx), 0, "directions apart");
    }
}

#[test]
fn the_side_channel_carries_every_message_from_two_device_cores_once() {
    use dev::svnic::signal::{Dir, SideChannel};
    const EACH: u16 = 20_000;
    let ch = Arc::new(SideChannel::new(64));
    let producers: Vec<_> = (0..2u16)
        .map(|p| {
            let ch = Arc::clone(&ch);
            std::thread::spawn(move || {
                for i in 0..EACH {
                    let vif = (i % 16) * 2 + p;
                    while !ch.send(vif, if i % 3 == 0 { Dir::Tx } else { Dir::Rx }) {
                        std::thread::yield_now();
                    }
                }
            })
        })
        .collect();
    let mut counts = [0u32; 32];
    let mut got = 0u32;
    let start = std::time::Instant::now();
    while got < 2 * u32::from(EACH) {
        assert!(start.elapsed().as_secs() < 60, "{got}");
        match ch.recv() {
            Some((vif, _)) => {
                counts[vif as usize] += 1;
                got += 1;
            }
            None => std::thread::yield_now(),
        }
    }
    for p in producers {
        p.join().expect("producer");
    }
    assert_eq!(ch.recv(), None);
    assert!(
        counts.iter().all(|&c| c == u32::from(EACH) / 16),
        "{counts:?}"
    );
}

/// Three VIFs keep their send queues full; egress sends `frames` frames one at a time
/// (a saturated link takes one at a time): the bytes each VIF got.
fn share(schedule: dev::svnic::engine::Schedule, priorities: [u8; 3], frames: usize) -> [u64; 3] {
    let s = setup(3);
    let mut egress = Egress::new(8, Arc::new(StageTimes::default()));
    egress.set_schedule(schedule);
    let mut fronts = Vec::new();
    for (i, &p) in priorities.iter().enumerate() {
        let (dev, front) = vif(&s, i);
        egress.add(i as u16, SRC, dev.tx);
        assert!(egress.set_priority(i as u16, p));
        fronts.push(front);
    }
    let mut bytes = [0u64; 3];
    let mut k = 0u32;
    for _ in 0..frames {
        for f in &mut fronts {
            while !f.isfull().expect("isfull") {
                f.send(&frame(9, k)).expect("send");
                k += 1;
            }
        }
        let n = egress.step(1, &mut |id, f| bytes[id as usize] += f.len() as u64);
        assert_eq!(n, 1);
    }
    bytes
}

#[test]
fn a_saturated_link_is_shared_by_priority_when_quality_aware_and_evenly_when_not() {
    use dev::svnic::engine::Schedule;
    let total = |b: &[u64; 3]| b.iter().sum::<u64>() as f64;
    // Quality-aware: 100 against 10 and 10 gives the first 100/120 of the bytes.
    let b = share(Schedule::Priority, [100, 10, 10], 3000);
    let hp = b[0] as f64 / total(&b);
    assert!((hp - 100.0 / 120.0).abs() < 0.02, "{b:?}: {hp}");
    assert!((b[1] as f64 / b[2] as f64 - 1.0).abs() < 0.05, "{b:?}");
    // Quality-unaware: a third each, whatever the priorities.
    let b = share(Schedule::RoundRobin, [100, 10, 10], 3000);
    for x in b {
        assert!((x as f64 / total(&b) - 1.0 / 3.0).abs() < 0.02, "{b:?}");
    }
}

#[test]
fn an_idle_vif_leaves_its_share_to_the_others_and_saves_no_credit() {
    use dev::svnic::engine::Schedule;
    let s = setup(2);
    let mut egress = Egress::new(8, Arc::new(StageTimes::default()));
    egress.set_schedule(Schedule::Priority);
    let (d0, mut f0) = vif(&s, 0);
    let (d1, mut f1) = vif(&s, 1);
    egress.add(0, SRC, d0.tx);
    egress.add(1, SRC, d1.tx);
    egress.set_priority(0, 50);
    egress.set_priority(1, 50);
    // VIF 1 idle: VIF 0 gets every slot.
    let mut k = 0;
    let mut got = [0u32; 2];
    for _ in 0..500 {
        while !f0.isfull().expect("isfull") {
            f0.send(&frame(9, k)).expect("send");
            k += 1;
        }
        egress.step(1, &mut |id, _| got[id as usize] += 1);
    }
    assert_eq!(got, [500, 0]);
    // VIF 1 wakes up: from then on they share the link's bytes evenly, VIF 1 with no
    // backlog of credit (which would give it the link alone for a while).
    let mut bytes = [0usize; 2];
    for _ in 0..100 {
        for f in [&mut f0, &mut f1] {
            while !f.isfull().expect("isfull") {
                f.send(&frame(9, k)).expect("send");
                k += 1;
            }
        }
        egress.step(1, &mut |id, f| bytes[id as usize] += f.len());
    }
    // Within two of the longest frames (282 bytes).
    assert!(bytes[0].abs_diff(bytes[1]) <= 2 * 282, "{bytes:?}");
}

/// Frames for one MAC, a few every poll, for as long as it is polled.
struct Stream {
    to: usize,
    k: u32,
}

impl dev::wire::WireSource for Stream {
    fn poll(
        &mut self,
        _now: std::time::Instant,
        emit: &mut dyn FnMut(&[u8], net::offload::Offload),
    ) -> usize {
        for _ in 0..4 {
            emit(&frame(self.to, self.k), net::offload::Offload::NONE);
            self.k += 1;
        }
        4
    }
    fn next_due(&self) -> Option<std::time::Instant> {
        Some(std::time::Instant::now())
    }
}

#[test]
fn a_vif_destroyed_under_traffic_is_let_go_and_its_memory_taken_back_scrubbed() {
    use dev::svnic::device::{SignalMode, Svnic, SvnicConfig, VifSignal};
    use hv::Vector;
    let s = setup(1);
    let g = &s.guests[0];
    let region = VifRegion::create(&s.device, g.id()).expect("region");
    let dev = VifDevice::new(region.device_pages(&s.device).expect("pages")).expect("dev");
    let (pages, handles) = region
        .map_in_guest(&s.hv, g, s.device.id(), 0)
        .expect("mapped");
    let mut front = VifFront::new(pages);
    let svnic: Svnic<OwnPage> = Svnic::start(
        &s.hv,
        None,
        SvnicConfig {
            signal: SignalMode::PerVif,
            ..SvnicConfig::default()
        },
        Box::new(Stream { to: 0, k: 0 }),
        Box::new(dev::wire::CountingSink::default()),
    )
    .expect("device");
    let rx = Arc::clone(&dev.rx);
    assert!(svnic.add_vif(
        0,
        mac(0),
        dev.tx,
        dev.rx,
        VifSignal {
            vector: Vector(70),
            bit: svnic.assign_bit(),
        },
    ));
    svnic.link_up();
    // Traffic flows: the guest takes frames, intact.
    let mut buf = [0u8; SLOT_BYTES];
    let mut got = 0;
    let t = std::time::Instant::now();
    while got < 200 {
        assert!(t.elapsed().as_secs() < 30, "{got} frames");
        if let Some(n) = front.recv(&mut buf).expect("recv") {
            let k = number(&buf[..n]);
            assert_eq!(&buf[..n], &frame(0, k)[..]);
            got += 1;
        }
    }
    // Destroyed with the cable still busy: once remove_vif returns, the device holds
    // nothing of the VIF.
    assert!(svnic.remove_vif(0, std::time::Duration::from_secs(10)));
    assert_eq!(
        Arc::strong_count(&rx),
        1,
        "the device let go of the receive queue"
    );
    drop(rx);
    // The region cannot be taken back while the guest maps it...
    let region = match region.destroy(&s.device) {
        Err((r, e)) => {
            assert!(matches!(
                e,
                dev::svnic::vif::RegionError::Map(hv::GrantError::InUse)
            ));
            r
        }
        Ok(()) => panic!("taken back while mapped"),
    };
    // ...and can once the guest's driver is gone and its mappings with it.
    drop(front);
    VifRegion::unmap_in_guest(&s.hv, g, &handles).expect("unmap");
    let gfns = region.gfns.clone();
    region.destroy(&s.device).expect("destroy");
    // Scrubbed, and nothing writes into it afterwards, though frames for its MAC
    // still come (now for no VIF).
    std::thread::sleep(std::time::Duration::from_millis(50));
    let mut page = vec![0u8; mem::PAGE_SIZE];
    for &gfn in &gfns {
        s.device.read(gfn, 0, &mut page).expect("device page");
        assert!(
            page.iter().all(|&b| b == 0),
            "page {gfn:?} written after the VIF was gone"
        );
    }
    let (_, ingress) = svnic.engine_stats();
    assert!(
        ingress
            .expect("ingress")
            .no_vif
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    svnic.stop();
}

/// Frames given once, in order.
struct Once(VecDeque<Vec<u8>>);

impl dev::wire::WireSource for Once {
    fn poll(
        &mut self,
        _now: std::time::Instant,
        emit: &mut dyn FnMut(&[u8], net::offload::Offload),
    ) -> usize {
        let n = self.0.len();
        for f in self.0.drain(..) {
            emit(&f, net::offload::Offload::NONE);
        }
        n
    }
    fn next_due(&self) -> Option<std::time::Instant> {
        (!self.0.is_empty()).then(std::time::Instant::now)
    }
}

#[test]
fn a_broadcast_from_the_wire_reaches_every_vif_once_and_a_unicast_only_its_own() {
    use dev::svnic::device::{SignalMode, Svnic, SvnicConfig, VifSignal};
    use hv::Vector;
    let s = setup(3);
    let mut bcast = frame(0, 7);
    bcast[..6].copy_from_slice(&[0xff; 6]);
    let wire = Once(VecDeque::from([bcast.clone(), frame(1, 8)]));
    let svnic: Svnic<OwnPage> = Svnic::start(
        &s.hv,
        None,
        SvnicConfig {
            signal: SignalMode::PerVif,
            ..SvnicConfig::default()
        },
        Box::new(wire),
        Box::new(dev::wire::CountingSink::default()),
    )
    .expect("device");
    let mut fronts = Vec::new();
    for i in 0..3 {
        let (dev, front) = vif(&s, i);
        assert!(svnic.add_vif(
            i as u16,
            mac(i),
            dev.tx,
            dev.rx,
            VifSignal {
                vector: Vector(70 + i as u8),
                bit: svnic.assign_bit(),
            },
        ));
        fronts.push(front);
    }
    // The engine takes the VIFs before it first looks at the cable.
    svnic.link_up();
    let mut got: Vec<Vec<Vec<u8>>> = vec![Vec::new(); 3];
    let mut buf = [0u8; SLOT_BYTES];
    let t = std::time::Instant::now();
    while got.iter().map(Vec::len).sum::<usize>() < 4 {
        assert!(t.elapsed().as_secs() < 10, "{got:?}");
        for (i, f) in fronts.iter_mut().enumerate() {
            if let Some(n) = f.recv(&mut buf).expect("recv") {
                got[i].push(buf[..n].to_vec());
            }
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    for f in &mut fronts {
        assert_eq!(f.recv(&mut buf).expect("recv"), None, "one copy each");
    }
    assert_eq!(got[0], vec![bcast.clone()]);
    assert_eq!(got[1], vec![bcast.clone(), frame(1, 8)]);
    assert_eq!(got[2], vec![bcast]);
    let (_, ingress) = svnic.engine_stats();
    let broadcast = ingress
        .expect("ingress")
        .broadcast
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(broadcast, 3);
    svnic.stop();
}

/// The next frame on `wire` into `buf`, as the network I/O engine hands it to an
/// ingress context (no VIF chosen for it).
fn from_wire(wire: &mut VecDeque<Vec<u8>>, buf: &mut [u8]) -> Option<(usize, Option<u16>)> {
    let f = wire.pop_front()?;
    buf[..f.len()].copy_from_slice(&f);
    Some((f.len(), None))
}

/// `n` VIFs made and mapped, as ingress finds them (each by its MAC), and their
/// guests' ends.
fn ingress_vifs(s: &common::Setup, n: usize) -> (IngressVifs<OwnPage>, Vec<VifFront<MappedPage>>) {
    let mut vifs = IngressVifs {
        rx: Vec::new(),
        demux: Demux::new(n),
    };
    let mut fronts = Vec::new();
    for i in 0..n {
        let (dev, front) = vif(s, i);
        vifs.rx.push(Some(Arc::clone(&dev.rx)));
        vifs.demux.insert(mac(i), i as u16);
        fronts.push(front);
    }
    (vifs, fronts)
}

/// An engine of 8 contexts over two VIFs, the wire's frames in `wire`.
struct HeldRig {
    ingress: Ingress<OwnPage>,
    vifs: IngressVifs<OwnPage>,
    fronts: Vec<VifFront<MappedPage>>,
    wire: VecDeque<Vec<u8>>,
    _s: common::Setup,
}

impl HeldRig {
    fn new() -> Self {
        let s = setup(2);
        let (vifs, fronts) = ingress_vifs(&s, 2);
        Self {
            ingress: Ingress::new(8, Arc::new(StageTimes::default())),
            vifs,
            fronts,
            wire: VecDeque::new(),
            _s: s,
        }
    }

    /// VIF 0's guest drains nothing: its queue fills, and the next frame for it finds
    /// no room, with frames for both VIFs behind it (VIF 0's `SLOTS` and `SLOTS + 1`,
    /// VIF 1's 0 and 1, interleaved). Returns the rig once VIF 0 is full, and when.
    fn vif0_full() -> (Self, Instant) {
        let mut r = Self::new();
        r.wire.extend((0..SLOTS).map(|k| frame(0, k)));
        r.wire.extend([
            frame(0, SLOTS),
            frame(1, 0),
            frame(0, SLOTS + 1),
            frame(1, 1),
        ]);
        let t0 = Instant::now();
        assert_eq!(r.run(t0), SLOTS as usize);
        (r, t0)
    }

    /// Steps at `now` until a step publishes nothing; returns frames published.
    fn run(&mut self, now: Instant) -> usize {
        let wire = &mut self.wire;
        let mut take = |buf: &mut [u8]| from_wire(wire, buf);
        let mut placed = 0;
        loop {
            let n = self.ingress.step(&self.vifs, now, &mut take, &mut |_| {});
            if n == 0 {
                return placed;
            }
            placed += n;
        }
    }

    /// The numbers of the frames VIF `to`'s guest takes now, each checked byte for byte.
    fn drain(&mut self, to: usize, most: usize) -> Vec<u32> {
        let mut buf = [0u8; SLOT_BYTES];
        let mut got = Vec::new();
        while got.len() < most {
            let Some(n) = self.fronts[to].recv(&mut buf).expect("recv") else {
                break;
            };
            let k = number(&buf[..n]);
            assert_eq!(&buf[..n], &frame(to, k)[..], "VIF {to}, frame {k}");
            got.push(k);
        }
        got
    }

    fn stat(
        &self,
        f: impl Fn(&dev::svnic::engine::EngineStats) -> &std::sync::atomic::AtomicU64,
    ) -> u64 {
        f(self.ingress.stats()).load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[test]
fn a_frame_for_a_full_vif_waits_for_its_guest_and_the_frames_behind_it_wait_on_the_wire_in_order() {
    use dev::svnic::engine::VIF_HOLD;
    let (mut r, t0) = HeldRig::vif0_full();
    assert_eq!(r.stat(|s| &s.vif_held), 1, "one frame waits in its context");
    assert_eq!(r.ingress.in_flight(), 1);
    assert_eq!(r.wire.len(), 3, "nothing behind it is taken from the wire");
    assert!(r.drain(1, usize::MAX).is_empty(), "VIF 1's frame waits too");
    // Short of the hold, it still waits: nothing is dropped.
    assert_eq!(r.run(t0 + VIF_HOLD - Duration::from_millis(1)), 0);
    assert_eq!(r.stat(|s| &s.vif_full), 0);
    // The guest takes four: the waiting frame and everything behind it go through.
    assert_eq!(r.drain(0, 4), vec![0, 1, 2, 3]);
    assert_eq!(r.run(t0 + VIF_HOLD - Duration::from_millis(1)), 4);
    assert!(r.wire.is_empty());
    assert_eq!(r.ingress.in_flight(), 0);
    let want: Vec<u32> = (4..SLOTS + 2).collect();
    assert_eq!(r.drain(0, usize::MAX), want, "every frame, in order");
    assert_eq!(r.drain(1, usize::MAX), vec![0, 1]);
    assert_eq!(r.stat(|s| &s.vif_full), 0, "nothing lost");
}

#[test]
fn a_vif_whose_guest_stops_draining_holds_the_others_back_once_for_the_hold_then_loses_only_its_own(
) {
    use dev::svnic::engine::VIF_HOLD;
    let (mut r, t0) = HeldRig::vif0_full();
    // The hold runs out: that frame is dropped and VIF 0 is stuck; VIF 1's frames go
    // through, and VIF 0's next is dropped at once, with no second wait.
    assert_eq!(r.run(t0 + VIF_HOLD), 2);
    assert!(r.wire.is_empty());
    assert_eq!(r.stat(|s| &s.vif_full), 2);
    assert_eq!(r.stat(|s| &s.vif_held), 1);
    assert_eq!(r.drain(1, usize::MAX), vec![0, 1]);
    // Once its guest drains, VIF 0 takes frames again, and a frame that finds its
    // queue full waits again.
    assert_eq!(r.drain(0, usize::MAX).len(), SLOTS as usize);
    r.wire.extend((0..=SLOTS).map(|k| frame(0, 1000 + k)));
    let t1 = t0 + VIF_HOLD + Duration::from_millis(1);
    assert_eq!(r.run(t1), SLOTS as usize);
    assert_eq!(r.stat(|s| &s.vif_held), 2);
    assert_eq!(r.stat(|s| &s.vif_full), 2, "no new loss");
    assert_eq!(r.drain(0, 1), vec![1000]);
    assert_eq!(r.run(t1), 1);
    assert_eq!(r.ingress.in_flight(), 0);
}
