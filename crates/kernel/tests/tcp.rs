//! TCP across whole machines: a remote peer (smoltcp's TCP on its own thread, across
//! the cable) streams to, and runs request/response with, a server on a native machine
//! and in a PV guest behind the driver domain; every byte the server reads is checked.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dev::lro::{Flushing, Form, LroSetup};
use dev::peer::{PeerApp, PeerSpec, TcpPeer, WireRate};
use kernel::app::{AppCounters, AppSpec, Proto};
use kernel::driver_domain::DriverConfig;
use kernel::machine::{Above, GuestSpec, Layout, Machine, MachineSpec, NicSpec};
use net::netback::VifStats;
use net::netfront::FrontConfig;
use net::wire::{UdpFlow, DEFAULT_MTU};
use smoltcp::wire::Ipv4Address;

const SERVER: u8 = 2;
const PEER: u8 = 1;

fn flow() -> UdpFlow {
    UdpFlow {
        src_mac: [2, 0, 0, 0, 0, PEER],
        dst_mac: [2, 0, 0, 0, 0, SERVER],
        src_ip: Ipv4Address::new(10, 0, 0, PEER),
        dst_ip: Ipv4Address::new(10, 0, 0, SERVER),
        src_port: 49152,
        dst_port: 5001,
        mtu: DEFAULT_MTU,
    }
}

/// A machine of `layout` ("native" or "pv") serving `proto`, and a peer running `app`
/// over a wire of `rate`.
fn start(
    layout: &str,
    proto: Proto,
    app: PeerApp,
    rate: WireRate,
) -> (Machine, TcpPeer, Arc<AppCounters>) {
    start_with(layout, proto, app, rate, DriverConfig::default(), false)
}

fn start_with(
    layout: &str,
    proto: Proto,
    app: PeerApp,
    rate: WireRate,
    driver: DriverConfig,
    offloads: bool,
) -> (Machine, TcpPeer, Arc<AppCounters>) {
    let f = flow();
    let counters = Arc::new(AppCounters::default());
    let spec = AppSpec {
        flow: f,
        message: 1,
        proto,
        counters: Arc::clone(&counters),
        latency: None,
        nbd: None,
    };
    let (peer, source, sink) = TcpPeer::start(PeerSpec {
        ip: f.src_ip,
        mac: f.src_mac,
        to: f.dst_ip,
        port: f.dst_port,
        rate,
        core: None,
        app,
    })
    .expect("peer");
    let layout = match layout {
        "native" => Layout::Native(spec),
        _ => Layout::DriverDomain {
            driver,
            guests: vec![GuestSpec {
                weight: 1,
                name: "guest".into(),
                mac: f.dst_mac,
                above: Above::App(spec),
                core: None,
                front: FrontConfig {
                    offloads,
                    ..FrontConfig::default()
                },
            }],
        },
    };
    let m = Machine::start(MachineSpec::new(
        NicSpec::new(Box::new(source), Box::new(sink)),
        layout,
    ))
    .expect("machine");
    (m, peer, counters)
}

fn wait(what: impl Fn() -> bool) -> bool {
    let t = Instant::now();
    while !what() {
        if t.elapsed() > Duration::from_secs(20) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

#[test]
fn a_stream_arrives_whole_and_acknowledged_on_native_and_pv_machines() {
    const TOTAL: u64 = 4 << 20;
    for layout in ["native", "pv"] {
        let (m, peer, app) = start(
            layout,
            Proto::TcpStream,
            PeerApp::Stream {
                message: 1024,
                rate: None,
                total: Some(TOTAL),
            },
            WireRate::GIGABIT,
        );
        let pc = Arc::clone(peer.counters());
        let done = wait(|| pc.acked.load(Ordering::Relaxed) >= TOTAL);
        let c = m.stop().expect("stop");
        let stats = peer.stop();
        assert!(
            done,
            "{layout}: acked {} of {TOTAL}; app {app:?}; {c:?}; peer {stats:?}",
            pc.acked.load(Ordering::Relaxed)
        );
        assert_eq!(app.bytes.load(Ordering::Relaxed), TOTAL, "{layout}");
        assert_eq!(app.corrupt.load(Ordering::Relaxed), 0, "{layout}");
        // ACKs came back through the whole path: fewer than one per segment (the
        // receiver acknowledges every second one at most), but some.
        let acks = c.get("tcp", "tx_frames");
        let segs = c.get("tcp", "rx_frames");
        assert!(
            acks > 0 && acks < segs,
            "{layout}: {acks} ACKs for {segs} segments"
        );
    }
}

#[test]
fn request_response_runs_one_byte_transactions_each_checked() {
    for layout in ["native", "pv"] {
        let (m, peer, app) = start(
            layout,
            Proto::TcpRr,
            PeerApp::Rr {
                size: 1,
                count: Some(300),
            },
            WireRate::Unlimited,
        );
        let pc = Arc::clone(peer.counters());
        let done = wait(|| pc.transactions.load(Ordering::Relaxed) >= 300);
        drop(m);
        drop(peer);
        assert!(
            done,
            "{layout}: {} transactions",
            pc.transactions.load(Ordering::Relaxed)
        );
        assert_eq!(pc.corrupt.load(Ordering::Relaxed), 0, "{layout}");
        assert_eq!(app.bytes.load(Ordering::Relaxed), 300, "{layout}");
        assert_eq!(app.corrupt.load(Ordering::Relaxed), 0, "{layout}");
        let rtt = pc.rtt.since(0);
        assert_eq!(rtt.len(), 300);
        assert!(rtt.iter().all(|&r| r > 0));
    }
}

/// Every LRO configuration: skb-mode and page-mode, flushed each poll, every second
/// poll (DA) and adaptively, with the bridge's copy (the paper's first port) and
/// without (BO), to a guest that takes GSO packets and to one that does not (netback
/// cuts the aggregates back into segments). The stream arrives whole in each.
#[test]
fn a_stream_crosses_every_lro_configuration_whole() {
    const TOTAL: u64 = 2 << 20;
    let configs = [
        (Form::Skb, Flushing::EveryPoll, true, true),
        (Form::Skb, Flushing::EveryPoll, false, true),
        (Form::Page, Flushing::EveryPoll, false, true),
        (Form::Skb, LroSetup::DELAYED, false, true),
        (Form::Page, LroSetup::ADAPTIVE, false, true),
        (Form::Skb, LroSetup::DELAYED, false, false),
    ];
    for (form, flushing, copy, gso) in configs {
        let what = format!("{form:?} {flushing:?} copy {copy} gso {gso}");
        let driver = DriverConfig {
            lro: Some(LroSetup {
                form,
                flushing,
                max_flows: 32,
            }),
            lro_bridge_copy: copy,
            ..DriverConfig::default()
        };
        let (m, peer, app) = start_with(
            "pv",
            Proto::TcpStream,
            PeerApp::Stream {
                message: 1024,
                rate: None,
                total: Some(TOTAL),
            },
            WireRate::Unlimited,
            driver,
            gso,
        );
        let pc = Arc::clone(peer.counters());
        let done = wait(|| pc.acked.load(Ordering::Relaxed) >= TOTAL);
        let c = m.stop().expect("stop");
        drop(peer);
        assert!(
            done,
            "{what}: acked {}; {c:?}",
            pc.acked.load(Ordering::Relaxed)
        );
        assert_eq!(app.bytes.load(Ordering::Relaxed), TOTAL, "{what}");
        assert_eq!(app.corrupt.load(Ordering::Relaxed), 0, "{what}");
        let (aggs, segs) = (c.get("lro", "aggregates"), c.get("lro", "segments"));
        assert!(aggs > 0 && segs >= aggs, "{what}: {c:?}");
        assert_eq!(c.get("lro", "build_failures"), 0, "{what}");
        assert_eq!(c.get("lro", "bridge_copy_failures"), 0, "{what}");
        if copy {
            assert!(c.get("lro", "bridge_copied") > 0 || segs == aggs, "{what}");
        }
        eprintln!(
            "{what}: {:.2} segments per aggregate, netback gso {} segmented {}",
            segs as f64 / aggs as f64,
            c.sum(|v: &VifStats| v.rx_gso_packets),
            c.sum(|v: &VifStats| v.rx_gso_segmented)
        );
    }
}

/// Request/response through LRO that holds aggregates: each request carries PSH (its
/// sender had sent all it had), so it is handed up at once in every schedule, and the
/// transactions run as without LRO.
#[test]
fn requests_are_not_held_by_any_lro_schedule() {
    for flushing in [Flushing::EveryPoll, LroSetup::DELAYED, LroSetup::ADAPTIVE] {
        let driver = DriverConfig {
            lro: Some(LroSetup {
                flushing,
                ..LroSetup::PAPER
            }),
            ..DriverConfig::default()
        };
        let (m, peer, app) = start_with(
            "pv",
            Proto::TcpRr,
            PeerApp::Rr {
                size: 1,
                count: Some(200),
            },
            WireRate::Unlimited,
            driver,
            true,
        );
        let pc = Arc::clone(peer.counters());
        let done = wait(|| pc.transactions.load(Ordering::Relaxed) >= 200);
        let c = m.stop().expect("stop");
        drop(peer);
        assert!(done, "{flushing:?}: {c:?}");
        assert_eq!(app.bytes.load(Ordering::Relaxed), 200, "{flushing:?}");
        assert_eq!(pc.corrupt.load(Ordering::Relaxed), 0, "{flushing:?}");
        // Every request went up alone, flushed by its PSH, never by a timer.
        assert!(
            c.get("lro engine", "flushed Push") >= 200,
            "{flushing:?}: {c:?}"
        );
        assert_eq!(c.get("lro", "timer_flushes"), 0, "{flushing:?}");
    }
}
