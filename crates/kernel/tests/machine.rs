//! Machines the builder assembles: several guests behind one driver domain each get
//! their own traffic whole, and the application's check catches a single wrong byte.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::wire::{CountingSink, WireSource};
use kernel::app::{AppCounters, AppSpec};
use kernel::driver_domain::DriverConfig;
use kernel::machine::{Above, CpuSet, GuestSpec, Layout, Machine, MachineSpec, NicSpec, Role};
use net::netback::VifStats;
use net::netfront::FrontConfig;
use net::wire::{payload_byte, UdpFlow, UdpFramer, DEFAULT_MTU};
use smoltcp::wire::Ipv4Address;

/// Frames given once, all due at the start.
struct Frames(Vec<Vec<u8>>);

impl WireSource for Frames {
    fn poll(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], net::offload::Offload)) -> usize {
        let n = self.0.len();
        for f in self.0.drain(..) {
            emit(&f, net::offload::Offload::NONE);
        }
        n
    }
    fn next_due(&self) -> Option<Instant> {
        (!self.0.is_empty()).then(Instant::now)
    }
}

fn flow_to(host: u8) -> UdpFlow {
    UdpFlow {
        src_mac: [2, 0, 0, 0, 0, 1],
        dst_mac: [2, 0, 0, 0, 0, host],
        src_ip: Ipv4Address::new(10, 0, 0, 1),
        dst_ip: Ipv4Address::new(10, 0, 0, host),
        src_port: 5001,
        dst_port: 5002,
        mtu: DEFAULT_MTU,
    }
}

/// `count` messages of `len` bytes on `flow`, message `m` with the pattern of `m`;
/// `spoil` changes one byte of one message before it is framed (the UDP checksum
/// covers the spoiled byte, so only the application can tell).
fn messages(
    flow: UdpFlow,
    len: usize,
    count: usize,
    spoil: Option<(usize, usize)>,
) -> Vec<Vec<u8>> {
    let mut framer = UdpFramer::new(flow);
    let mut out = Vec::new();
    for m in 0..count {
        let mut p: Vec<u8> = (0..len).map(|i| payload_byte(m as u8, i)).collect();
        if let Some((sm, at)) = spoil {
            if sm == m {
                p[at] ^= 0x01;
            }
        }
        framer
            .frames(m as u16, &p, |f| out.push(f.to_vec()))
            .expect("frames");
    }
    out
}

/// A guest with the original netfront (page fragments, a grant per I/O, no offloads).
fn plain_guest(name: impl Into<String>, mac: [u8; 6], above: Above) -> GuestSpec {
    GuestSpec {
        weight: 1,
        name: name.into(),
        mac,
        above,
        core: None,
        front: FrontConfig::default(),
    }
}

fn spec(frames: Vec<Vec<u8>>, layout: Layout) -> MachineSpec {
    MachineSpec::new(
        NicSpec::new(Box::new(Frames(frames)), Box::new(CountingSink::default())),
        layout,
    )
}

fn app(flow: UdpFlow, len: usize) -> (AppSpec, Arc<AppCounters>) {
    let c = Arc::new(AppCounters::default());
    let s = AppSpec {
        flow,
        message: len,
        proto: kernel::app::Proto::Udp,
        counters: Arc::clone(&c),
        latency: None,
        nbd: None,
    };
    (s, c)
}

fn wait_for(c: &AppCounters, n: u64) {
    let t = Instant::now();
    while c.messages.load(Ordering::Relaxed) < n && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn three_guests_behind_one_driver_domain_each_get_their_own_messages_whole() {
    let (len, count) = (3000, 40);
    let mut frames = Vec::new();
    let mut apps = Vec::new();
    let mut guests = Vec::new();
    for host in [2u8, 3, 4] {
        let f = flow_to(host);
        frames.push(messages(f, len, count, None));
        let (a, c) = app(f, len);
        apps.push(c);
        let plain = plain_guest(format!("guest{host}"), f.dst_mac, Above::App(a));
        guests.push(GuestSpec {
            front: FrontConfig {
                // The second asks for the split ring layout; the others get ring.h's.
                split_ring: host == 3,
                ..plain.front
            },
            ..plain
        });
    }
    // Interleaved, so the bridge switches between vifs frame by frame.
    let mut wire = Vec::new();
    for i in 0..frames[0].len() {
        for g in &frames {
            wire.push(g[i].clone());
        }
    }
    let m = Machine::start(spec(
        wire,
        Layout::DriverDomain {
            driver: DriverConfig::default(),
            guests,
        },
    ))
    .expect("machine");
    assert_eq!(m.domains().len(), 4);
    // What each front end asked for, as it wrote it to the store.
    let asked: Vec<String> = m
        .domains()
        .iter()
        .filter(|d| d.1 != Role::DriverDomain)
        .map(|(d, _)| {
            let key = format!(
                "{}/{}",
                net::xenbus::frontend_dir(d.id(), 0),
                net::xenbus::REQUEST_SPLIT_INDICES
            );
            m.hv()
                .store()
                .read(d.id(), &key)
                .expect("the front end's key")
        })
        .collect();
    assert_eq!(asked, ["0", "1", "0"]);
    assert_eq!(
        m.domains()
            .iter()
            .filter(|d| d.1 == Role::DriverDomain)
            .count(),
        1
    );
    for c in &apps {
        wait_for(c, count as u64);
    }
    let counters = m.stop().expect("stop");
    for (i, c) in apps.iter().enumerate() {
        assert_eq!(
            c.messages.load(Ordering::Relaxed),
            count as u64,
            "guest {i}: {counters:?}"
        );
        assert_eq!(c.corrupt.load(Ordering::Relaxed), 0, "guest {i}");
    }
    assert_eq!(
        counters.sum(|v: &VifStats| v.rx_packets),
        3 * 3 * count as u64
    );
}

#[test]
fn one_wrong_byte_anywhere_in_a_message_is_counted_in_every_layout() {
    for layout in ["native", "direct", "pv"] {
        // 3000 bytes: three frames; the wrong byte is in the last one.
        let (len, count) = (3000, 10);
        let f = flow_to(2);
        let (a, c) = app(f, len);
        let frames = messages(f, len, count, Some((6, 2999)));
        let l = match layout {
            "native" => Layout::Native(a),
            "direct" => Layout::Direct(a),
            _ => Layout::DriverDomain {
                driver: DriverConfig {
                    netfilter: false,
                    ..DriverConfig::default()
                },
                guests: vec![plain_guest("guest", f.dst_mac, Above::App(a))],
            },
        };
        let m = Machine::start(spec(frames, l)).expect("machine");
        wait_for(&c, count as u64);
        drop(m);
        assert_eq!(c.messages.load(Ordering::Relaxed), count as u64, "{layout}");
        assert_eq!(c.corrupt.load(Ordering::Relaxed), 1, "{layout}");
    }
}

#[test]
fn a_broadcast_from_the_wire_reaches_every_guest_once() {
    let count = 20;
    let mut bcast = flow_to(2);
    bcast.dst_mac = [0xff; 6];
    let frames = messages(bcast, 100, count, None);
    let (spec2, seen2) = app(flow_to(2), 100);
    let mut guests = vec![plain_guest("guest2", flow_to(2).dst_mac, Above::App(spec2))];
    for h in [3u8, 4] {
        guests.push(plain_guest(
            format!("guest{h}"),
            flow_to(h).dst_mac,
            Above::App(app(flow_to(h), 100).0),
        ));
    }
    let m = Machine::start(spec(
        frames,
        Layout::DriverDomain {
            driver: DriverConfig {
                netfilter: false,
                ..DriverConfig::default()
            },
            guests,
        },
    ))
    .expect("machine");
    // The frames carry guest 2's IP address: its application takes them; the other
    // guests' stacks drop them as not theirs, after netfront took them in.
    wait_for(&seen2, count as u64);
    std::thread::sleep(Duration::from_millis(200));
    let c = m.stop().expect("stop");
    assert_eq!(c.get("bridge", "flooded"), count as u64, "{c:?}");
    assert_eq!(
        c.sum(|v: &VifStats| v.rx_packets),
        3 * count as u64,
        "{c:?}"
    );
    assert_eq!(c.get("netfront", "rx_packets"), 3 * count as u64, "{c:?}");
    assert_eq!(c.get("bridge", "flood_copy_failures"), 0);
}

/// Frames the test hands over while the machine runs: pushed from outside, which wake the device as a frame on a real cable does.
#[derive(Clone, Default)]
struct Feed(
    Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    Arc<std::sync::OnceLock<Arc<dev::wire::Doze>>>,
);

impl Feed {
    fn push(&self, frames: Vec<Vec<u8>>) {
        self.0.lock().expect("feed").extend(frames);
        if let Some(d) = self.1.get() {
            d.wake();
        }
    }
}

impl WireSource for Feed {
    fn poll(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], net::offload::Offload)) -> usize {
        let frames: Vec<_> = self.0.lock().expect("feed").drain(..).collect();
        for f in &frames {
            emit(f, net::offload::Offload::NONE);
        }
        frames.len()
    }
    fn next_due(&self) -> Option<Instant> {
        (!self.0.lock().expect("feed").is_empty()).then(Instant::now)
    }
    fn attach(&mut self, wake: &Arc<dev::wire::Doze>) {
        let _ = self.1.set(Arc::clone(wake));
    }
}

/// Messages `from..from + n` on `flow`, each with its own pattern.
#[test]
fn a_machine_given_one_core_runs_every_unit_there_and_a_pool_the_host_lacks_is_refused() {
    let last = mem::cpu::online_cores() - 1;
    let f = flow_to(2);
    let layout = |a: AppSpec| Layout::DriverDomain {
        driver: DriverConfig::default(),
        guests: vec![plain_guest("guest", f.dst_mac, Above::App(a))],
    };
    let (a, c) = app(f, 1000);
    let mut s = spec(messages(f, 1000, 20, None), layout(a));
    s.cpus = Some(CpuSet::of([last]).expect("a set"));
    let m = Machine::start(s).expect("machine");
    // The driver domain, the guest and the NIC's engine: one pCPU, on the pool's core.
    assert_eq!(m.pcpu_cores(), &[last]);
    wait_for(&c, 20);
    m.stop().expect("stop");
    assert_eq!(c.corrupt.load(Ordering::Relaxed), 0);
    let twice = CpuSet::of([last, last]).expect_err("a core named twice");
    assert!(twice.to_string().contains("twice"), "{twice}");
    assert!(CpuSet::of([CpuSet::LIMIT]).is_err());
    for (cpus, why) in [
        (CpuSet::default(), "at least one core"),
        (CpuSet::range(last + 1..last + 2), "not online"),
    ] {
        let mut s = spec(Vec::new(), layout(app(f, 1000).0));
        s.cpus = Some(cpus);
        let Err(e) = Machine::start(s) else {
            panic!("a pool of {why:?} was taken");
        };
        let e = e.to_string();
        assert!(e.contains(why), "{e}");
    }
}

fn batch(flow: UdpFlow, len: usize, from: usize, n: usize) -> Vec<Vec<u8>> {
    let mut framer = UdpFramer::new(flow);
    let mut out = Vec::new();
    for m in from..from + n {
        let p: Vec<u8> = (0..len).map(|i| payload_byte(m as u8, i)).collect();
        framer
            .frames(m as u16, &p, |f| out.push(f.to_vec()))
            .expect("frames");
    }
    out
}

#[test]
fn a_driver_domain_that_panics_or_hangs_is_restarted_and_traffic_resumes() {
    use kernel::driver_domain::Fault;
    use kernel::machine::DriverFault;
    let f = flow_to(2);
    let len = 1000;
    let (a, c) = app(f, len);
    let feed = Feed::default();
    let mut m = Machine::start(MachineSpec {
        nic: NicSpec::new(Box::new(feed.clone()), Box::new(CountingSink::default())),
        ..spec(
            Vec::new(),
            Layout::DriverDomain {
                driver: DriverConfig {
                    netfilter: false,
                    ..DriverConfig::default()
                },
                guests: vec![plain_guest("guest", f.dst_mac, Above::App(a))],
            },
        )
    })
    .expect("machine");
    let mut next = 0;
    let delivered = |next: &mut usize, expect: u64| {
        feed.push(batch(f, len, *next, 40));
        *next += 40;
        wait_for(&c, expect);
        assert_eq!(c.messages.load(Ordering::Relaxed), expect);
    };
    delivered(&mut next, 40);
    for (fault, cause) in [
        (Fault::Panic, DriverFault::Crashed),
        (Fault::Hang, DriverFault::Stalled),
    ] {
        let before = c.messages.load(Ordering::Relaxed);
        m.inject_fault(fault);
        // The next frame wakes the driver domain into its fault; what it carried is lost
        // with the domain (UDP: nothing resends it).
        feed.push(batch(f, len, next, 1));
        next += 1;
        let t = Instant::now();
        let restarted = loop {
            if let Some(r) = m.watchdog(Duration::from_millis(200)).expect("restart") {
                break r;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no restart");
            // The stream goes on meanwhile.
            feed.push(batch(f, len, next, 1));
            next += 1;
            std::thread::sleep(Duration::from_millis(2));
        };
        // A panicking kernel that is still unwinding (printing its backtrace) when the
        // limit passes looks stalled, which it is.
        assert!(
            restarted.cause == cause || fault == Fault::Panic,
            "{:?} for {fault:?}",
            restarted.cause
        );
        eprintln!("restart after {cause:?} took {:?}", restarted.took);
        // Traffic flows again through the new driver domain, every byte intact.
        let now = c.messages.load(Ordering::Relaxed);
        assert!(
            now <= before + 1,
            "the faulty driver domain passed nothing on"
        );
        // Messages the stream sent during the outage that the NIC still held may reach
        // the guest through the new driver domain a moment after the restart: they are
        // let arrive before the next batch is counted.
        let mut settled = c.messages.load(Ordering::Relaxed);
        let t = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(50));
            let n = c.messages.load(Ordering::Relaxed);
            if n == settled || t.elapsed() > Duration::from_secs(2) {
                break;
            }
            settled = n;
        }
        assert!(
            settled <= next as u64,
            "no message twice: {settled} of {next} sent"
        );
        delivered(&mut next, settled + 40);
    }
    assert_eq!(c.corrupt.load(Ordering::Relaxed), 0);
    // Nothing of the two dead driver domains is left: every frame they had is free.
    assert_eq!(m.hv().reap(), 0, "no frame of a dead driver domain is held");
    m.stop().expect("stop");
}

/// A guest that never reconnects after a driver-domain restart (deaf to its back end)
/// loses its own vif, not the restart: the new driver domain serves the other guest,
/// whose traffic flows again intact, and the restart says which vif it left out.
#[test]
fn a_guest_that_never_reconnects_does_not_stop_the_restart_for_the_others() {
    use kernel::driver_domain::Fault;
    let f = flow_to(2);
    let len = 1000;
    let (a, c) = app(f, len);
    let feed = Feed::default();
    let mut m = Machine::start(MachineSpec {
        nic: NicSpec::new(Box::new(feed.clone()), Box::new(CountingSink::default())),
        ..spec(
            Vec::new(),
            Layout::DriverDomain {
                driver: DriverConfig {
                    netfilter: false,
                    ..DriverConfig::default()
                },
                guests: vec![
                    plain_guest("deaf", [2, 0, 0, 0, 0, 0x0e], Above::Deaf(7)),
                    plain_guest("guest", f.dst_mac, Above::App(a)),
                ],
            },
        )
    })
    .expect("machine");
    feed.push(batch(f, len, 0, 40));
    wait_for(&c, 40);
    m.inject_fault(Fault::Panic);
    feed.push(batch(f, len, 40, 1));
    let t = Instant::now();
    let r = loop {
        if let Some(r) = m
            .watchdog(Duration::from_millis(200))
            .expect("the restart goes on")
        {
            break r;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no restart");
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(r.vifs_unserved, 1, "{r:?}");
    // The good guest's traffic flows again through the new driver domain.
    let settled = c.messages.load(Ordering::Relaxed);
    feed.push(batch(f, len, 41, 40));
    wait_for(&c, settled + 40);
    assert!(c.messages.load(Ordering::Relaxed) >= settled + 40);
    assert_eq!(c.corrupt.load(Ordering::Relaxed), 0);
    m.stop().expect("stop");
}

/// The threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim_end().starts_with(prefix))
                })
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn stopping_a_machine_whose_pcpus_poll_leaves_no_pcpu_thread_behind() {
    let (len, count) = (3000, 20);
    let f = flow_to(2);
    let (a, c) = app(f, len);
    let mut s = spec(messages(f, len, count, None), Layout::Native(a));
    s.idle = hv::sched::IdlePolicy::Poll;
    let m = Machine::start(s).expect("start");
    assert!(threads_named("pcpu") > 0, "the machine runs on pCPUs");
    wait_for(&c, count as u64);
    m.stop().expect("stop");
    assert_eq!(c.messages.load(Ordering::Relaxed), count as u64);
    // (nextest runs each test in a process of its own; under `cargo test` another
    // test's machine may still be stopping.)
    let t = std::time::Instant::now();
    while threads_named("pcpu") > 0 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        threads_named("pcpu"),
        0,
        "a pCPU thread outlived its machine"
    );
}
