//! Each configuration carries the sender's messages to the application intact at a
//! modest rate, losing none on the path itself (a message may be missing only where the
//! NIC counted its frame as missed, its ring empty, and those rare), and its CPU lands
//! in the right domains.

use std::time::Duration;

use dev::nic::NicCounts;
use net::netback::{CacheStats, VifStats};
use net::netfront::RxBuffers;
use rig::udp::{Options, Running, NAMED};

/// What this asserts: no message is corrupted; none is lost by netback, netfront, the
/// bridge or the stacks; and a message that did not arrive is one whose frame the NIC
/// counted as missed (`rx_missed`), at most one frame in 200.
///
/// Why a frame can be missed at all: the driver domain's NIC driver reposts a buffer
/// for every descriptor it takes in the same poll (`dev::driver::Driver::poll`), so its
/// 256-descriptor ring is full after every poll, and a miss needs the driver domain's
/// vCPU to go 256 frames without a poll (51 ms at this rate). A vCPU is a host thread
/// parked on a futex; it runs when the host's scheduler runs it, and on two shared cores
/// late in a suite run it sometimes does not for that long. The driver domain does not
/// refill late; the host runs it late. pvio's own pCPUs (issue 40) take the host's
/// scheduler off that path; until then the bound below is what can honestly be asserted.
#[test]
fn every_configuration_delivers_every_message_intact_but_for_frames_the_nic_missed() {
    // Every named configuration, and pv without netfront's page fragments.
    let variants = NAMED
        .iter()
        .map(|n| (n.to_string(), None))
        .chain([("pv".to_string(), Some(RxBuffers::Linear))]);
    for (name, rx) in variants {
        for message in [52usize, 1472, 48000] {
            let mut o = Options::named(&name, message).expect("a named configuration");
            // Modest for an unoptimised build on a loaded two-core machine: at 20 000
            // frames a second the 48000-byte messages of the linear front end began to
            // overrun the NIC ring there (a debug build's driver domain too slow), and at
            // 10 000 the linear front end still lost a frame or two to the ring in one
            // full-suite run of three on this machine (the host held the device thread
            // up to 12 ms). What this asserts is that nothing is lost when the path
            // keeps up, not how fast it keeps up: the experiments measure that.
            o.rate = 5_000.0;
            if let Some(rx) = rx {
                o.front.rx_buffers = rx;
            }
            let (config, rx_buffers) = (o.config, o.front.rx_buffers);
            let m = Running::start(o).expect("machine");
            std::thread::sleep(Duration::from_millis(150));
            let s = m.snapshot();
            let f = m.finish(Duration::from_secs(2)).expect("finish");
            assert!(
                f.messages_sent > 10,
                "{config:?} {rx_buffers:?} {message}: sent {}",
                f.messages_sent
            );
            // Nothing is lost on the path itself. The one loss this machine shows now
            // and then (about one suite run in five, early or late in it, never when
            // the test runs alone: eight runs of eight) is a frame the NIC found no
            // buffer for, counted as `rx_missed`: the driver domain's vCPU did not run
            // for long enough to refill the ring (256 buffers, 50 ms at this rate).
            // Each message that did not arrive must be one of those, and they must
            // stay rare (one frame in 200 at most).
            let lost = f.messages_sent - f.messages_received;
            let missed = f.counters.get("nic", "rx_missed");
            assert!(
                lost <= missed && missed * 200 <= f.frames_sent.max(1),
                "{config:?} {rx_buffers:?} {message}: every message arrives but for \
                 frames the NIC counted as missed, and those rare: {lost} lost, {missed} \
                 missed of {} frames ({:?})",
                f.frames_sent,
                f.counters
            );
            assert_eq!(f.corrupt, 0);
            if name == "pv-mq-reuse" {
                // Every buffer and TX slot went through the grant cache; after the
                // first use of each page, no map.
                let hits = f.counters.sum(|s: &CacheStats| s.hits);
                let misses = f.counters.sum(|s: &CacheStats| s.misses);
                let cold = f.counters.sum(|s: &CacheStats| s.cold_misses);
                assert!(hits > 0, "{message}: {:?}", f.counters);
                assert_eq!(misses, cold, "{message}: only compulsory misses");
                assert_eq!(f.counters.sum(|s: &CacheStats| s.unmaps), 0, "{message}");
            }
            if name.starts_with("pv-mq") {
                // Every frame went to the guest's own queue, none through the default.
                let nic = |n: fn(&NicCounts) -> u64| f.counters.sum(n);
                assert_eq!(nic(|n| n.default_queue_frames), 0, "{message}");
                assert!(nic(|n| n.rx_frames) > 0);
            }
            assert!(s.domains.iter().all(|d| d.2.cpu > Duration::ZERO));
        }
    }
}

#[test]
fn live_counters_show_each_port_while_the_machine_runs() {
    let mut o = Options::named("pv", 1472).expect("pv");
    o.rate = 20_000.0;
    let m = Running::start(o).expect("machine");
    std::thread::sleep(Duration::from_millis(100));
    let a = m.live_sample();
    std::thread::sleep(Duration::from_millis(300));
    let b = m.live_sample();
    let f = m.finish(Duration::from_secs(2)).expect("finish");
    let rates = rig::live::rates(&a, &b);
    let port = |p: &str| {
        rates
            .iter()
            .find(|r| r.port.starts_with(p))
            .unwrap_or_else(|| panic!("no {p} port in {rates:?}"))
    };
    let (nic, vif) = (port("nic"), port("vif"));
    // 20 000 frames a second reach the NIC and the guest; the samples are taken by
    // asking the running kernels, so both moved between them.
    assert!(nic.rx_pps > 5_000.0, "{nic:?}");
    assert!(vif.rx_pps > 5_000.0, "{vif:?}");
    assert!(
        vif.rx_bps > vif.rx_pps * 8.0 * 1000.0,
        "frames over 1000 bytes: {vif:?}"
    );
    assert!(nic.drops.is_empty() && vif.drops.is_empty(), "{rates:?}");
    let rings = vif.rings.expect("a vif has rings");
    assert_eq!(rings.size, 256);
    assert!(rings.rx > 0, "netfront keeps buffers posted: {rings:?}");
    // The live counters are the components' own, named as at the end: the vif's live
    // count is at most its final one.
    assert!(b.counters.get(&vif.port, "rx_packets") <= f.counters.get(&vif.port, "rx_packets"));
    assert_eq!(
        f.counters.get(&vif.port, "rx_packets"),
        f.counters.sum(|v: &VifStats| v.rx_packets),
        "one vif: its count by name is its stats' own"
    );
    assert!(b.counters.get(&vif.port, "rx_packets") > 0);
}
