//! Event channels, virtual IRQs and vCPU wake-ups.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hv::event::NR_EVENT_CHANNELS;
use hv::*;

fn two_domains() -> (Arc<Hypervisor>, Arc<Domain>, Arc<Domain>) {
    let hv = Hypervisor::new(HvConfig {
        frames: 1024,
        ..Default::default()
    })
    .expect("machine");
    let a = hv
        .create_domain(&DomainConfig {
            name: "a".into(),
            pages: 64,
            ..Default::default()
        })
        .expect("a");
    let b = hv
        .create_domain(&DomainConfig {
            name: "b".into(),
            pages: 64,
            ..Default::default()
        })
        .expect("b");
    (hv, a, b)
}

/// A port of `a` connected to a port of `b`: (a's port, b's port).
fn connect(hv: &Hypervisor, a: &Domain, b: &Domain) -> (Port, Port) {
    let pb = hv.evtchn_alloc_unbound(b, a.id()).expect("offer");
    let pa = hv.evtchn_bind_interdomain(a, b.id(), pb).expect("bind");
    (pa, pb)
}

fn drain(d: &Domain) -> Vec<Port> {
    let mut v = Vec::new();
    d.take_pending(0, |p| v.push(p));
    v
}

#[test]
fn send_sets_the_remote_port_pending_once() {
    let (hv, a, b) = two_domains();
    let (pa, pb) = connect(&hv, &a, &b);
    assert_eq!(
        b.evtchn_state(pb),
        Ok(ChannelState::Interdomain {
            remote: a.id(),
            remote_port: pa
        })
    );
    hv.evtchn_send(&a, pa).expect("send");
    hv.evtchn_send(&a, pa).expect("send again: coalesced");
    assert!(b.upcall_pending(0));
    assert_eq!(drain(&b), vec![pb]);
    assert_eq!(drain(&b), vec![], "consumed");
    assert!(!b.upcall_pending(0));
    // And back the other way.
    hv.evtchn_send(&b, pb).expect("send");
    assert_eq!(drain(&a), vec![pa]);
}

#[test]
fn an_event_that_arrives_while_masked_is_delivered_after_unmask() {
    let (hv, a, b) = two_domains();
    let (pa, pb) = connect(&hv, &a, &b);
    b.evtchn_mask(pb).expect("mask");
    hv.evtchn_send(&a, pa).expect("send");
    assert!(b.evtchn_is_pending(pb).expect("port"));
    assert!(!b.upcall_pending(0), "masked: no upcall");
    assert_eq!(drain(&b), vec![]);
    hv.evtchn_unmask(&b, pb).expect("unmask");
    assert!(b.upcall_pending(0), "unmask delivers");
    assert_eq!(drain(&b), vec![pb]);
}

#[test]
fn bad_ports_are_refused_and_touch_nothing() {
    let (hv, a, b) = two_domains();
    let (pa, pb) = connect(&hv, &a, &b);
    assert_eq!(
        hv.evtchn_send(&a, Port(NR_EVENT_CHANNELS)),
        Err(EvtchnError::PortOutOfRange(NR_EVENT_CHANNELS))
    );
    assert_eq!(
        hv.evtchn_send(&a, Port(u32::MAX)),
        Err(EvtchnError::PortOutOfRange(u32::MAX))
    );
    assert_eq!(
        hv.evtchn_send(&a, Port(pa.0 + 1)),
        Err(EvtchnError::NotBound(pa.0 + 1))
    );
    let unbound = hv.evtchn_alloc_unbound(&a, b.id()).expect("offer");
    assert_eq!(
        hv.evtchn_send(&a, unbound),
        Err(EvtchnError::NotBound(unbound.0))
    );
    assert_eq!(
        a.evtchn_mask(Port(NR_EVENT_CHANNELS)),
        Err(EvtchnError::PortOutOfRange(NR_EVENT_CHANNELS))
    );
    assert_eq!(
        hv.evtchn_unmask(&a, Port(NR_EVENT_CHANNELS + 5)),
        Err(EvtchnError::PortOutOfRange(NR_EVENT_CHANNELS + 5))
    );
    // Binding to a port not offered to the caller.
    let c = hv
        .create_domain(&DomainConfig {
            name: "c".into(),
            pages: 32,
            ..Default::default()
        })
        .expect("c");
    assert_eq!(
        hv.evtchn_bind_interdomain(&c, a.id(), unbound),
        Err(EvtchnError::NotOffered(unbound.0))
    );
    assert_eq!(
        hv.evtchn_bind_interdomain(&c, b.id(), pb),
        Err(EvtchnError::NotOffered(pb.0)),
        "already bound"
    );
    assert_eq!(
        hv.evtchn_bind_interdomain(&c, DomId(200), Port(1)),
        Err(EvtchnError::NoSuchDomain(DomId(200)))
    );
    // Nobody got an event out of all this.
    assert!(!a.upcall_pending(0) && !b.upcall_pending(0) && !c.upcall_pending(0));
    // The good channel still works.
    hv.evtchn_send(&a, pa).expect("send");
    assert_eq!(drain(&b), vec![pb]);
}

#[test]
fn closing_one_end_unbinds_the_other() {
    let (hv, a, b) = two_domains();
    let (pa, pb) = connect(&hv, &a, &b);
    hv.evtchn_close(&a, pa).expect("close");
    assert_eq!(a.evtchn_state(pa), Ok(ChannelState::Free));
    assert_eq!(
        b.evtchn_state(pb),
        Ok(ChannelState::Unbound { remote: a.id() })
    );
    assert_eq!(hv.evtchn_send(&b, pb), Err(EvtchnError::NotBound(pb.0)));
    assert_eq!(hv.evtchn_send(&a, pa), Err(EvtchnError::NotBound(pa.0)));
    assert_eq!(hv.evtchn_close(&a, pa), Err(EvtchnError::NotBound(pa.0)));
    // The offered port can be bound again (a reconnecting front end).
    let pa2 = hv.evtchn_bind_interdomain(&a, b.id(), pb).expect("rebind");
    hv.evtchn_send(&a, pa2).expect("send");
    assert_eq!(drain(&b), vec![pb]);
}

#[test]
fn destroying_a_domain_unbinds_its_peers() {
    let (hv, a, b) = two_domains();
    let (_pa, pb) = connect(&hv, &a, &b);
    hv.destroy_domain(a.id()).expect("destroy");
    assert!(matches!(
        hv.evtchn_send(&b, pb),
        Err(EvtchnError::NotBound(_))
    ));
}

#[test]
fn a_device_interrupt_becomes_an_event_on_the_owner_port() {
    let (hv, a, _b) = two_domains();
    let v = Vector(33);
    let p = hv.bind_irq(&a, v).expect("bind");
    assert_eq!(hv.bind_irq(&a, v), Err(EvtchnError::VectorInUse(33)));
    hv.raise_irq(v).expect("raise");
    // The device only raised the vector at the owner's CPU; the hypervisor's handler,
    // running there, turns it into the event.
    assert!(drain(&a).is_empty(), "no event before the hypervisor ran");
    assert_eq!(hv.do_irq(&a, 0), 1);
    assert_eq!(drain(&a), vec![p]);
    assert_eq!(hv.do_irq(&a, 0), 0, "the request was taken");
    hv.pirq_eoi(&a, p).expect("eoi");
    assert_eq!(
        hv.raise_irq(Vector(34)),
        Err(EvtchnError::VectorUnbound(34))
    );
    assert_eq!(hv.irq_unbound_count(), 1);
    // A binding closed between the raise and the handler: counted, no event.
    hv.raise_irq(v).expect("raise");
    hv.evtchn_close(&a, p).expect("close");
    assert_eq!(hv.do_irq(&a, 0), 1);
    assert!(drain(&a).is_empty());
    assert_eq!(hv.irq_unbound_count(), 2);
    assert_eq!(hv.raise_irq(v), Err(EvtchnError::VectorUnbound(33)));
}

#[test]
fn a_master_interrupt_runs_the_hypervisors_handler_which_sends_each_guest_its_event() {
    let (hv, ctl, guest) = two_domains();
    let (master, v1, v2) = (Vector(50), Vector(51), Vector(52));
    let p1 = hv.bind_irq(&guest, v1).expect("bind 1");
    let p2 = hv.bind_irq(&guest, v2).expect("bind 2");
    let ran = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&ran);
    hv.bind_irq_handler(
        &ctl,
        master,
        Box::new(move |hv: &Hypervisor| {
            r.fetch_add(1, Ordering::Relaxed);
            hv.send_pirq(Vector(51)).expect("forward 1");
            hv.send_pirq(Vector(52)).expect("forward 2");
        }),
    )
    .expect("handler");
    assert!(hv
        .bind_irq_handler(&ctl, master, Box::new(|_: &Hypervisor| {}))
        .is_err());
    assert_eq!(hv.bind_irq(&ctl, master), Err(EvtchnError::VectorInUse(50)));
    hv.raise_irq(master).expect("raise");
    assert_eq!(
        ran.load(Ordering::Relaxed),
        0,
        "hardware only marks the vector"
    );
    assert_eq!(hv.do_irq(&ctl, 0), 1);
    assert_eq!(ran.load(Ordering::Relaxed), 1);
    assert!(
        drain(&ctl).is_empty(),
        "the controller gets no event of its own"
    );
    let mut got = drain(&guest);
    got.sort_by_key(|p| p.0);
    assert_eq!(got, vec![p1, p2]);
    // Forwarded again before the guest's end-of-interrupt: latched, sent at the EOI.
    hv.send_pirq(v1).expect("latch");
    assert!(drain(&guest).is_empty());
    hv.pirq_eoi(&guest, p1).expect("eoi");
    assert_eq!(hv.do_irq(&guest, 0), 1);
    assert_eq!(drain(&guest), vec![p1]);
    // A handler's vector is nobody's port; an unbound one is nothing.
    assert_eq!(hv.send_pirq(master), Err(EvtchnError::VectorUnbound(50)));
    assert_eq!(
        hv.send_pirq(Vector(53)),
        Err(EvtchnError::VectorUnbound(53))
    );
}

#[test]
fn a_line_stays_masked_until_its_owner_signals_the_end_of_the_interrupt() {
    let (hv, a, b) = two_domains();
    let v = Vector(35);
    let p = hv.bind_irq(&a, v).expect("bind");
    hv.raise_irq(v).expect("raise");
    assert_eq!(hv.do_irq(&a, 0), 1);
    assert_eq!(drain(&a), vec![p]);
    assert!(hv.irq_in_flight(v));
    // Raised twice more while masked: held, not delivered.
    hv.raise_irq(v).expect("raise");
    hv.raise_irq(v).expect("raise");
    assert_eq!(hv.do_irq(&a, 0), 0, "a masked line delivers nothing");
    assert!(drain(&a).is_empty());
    // Nobody else can unmask it: not another domain (whatever its port), not a port of
    // the owner's that is no pirq.
    assert!(hv.pirq_eoi(&b, p).is_err());
    let other = hv.evtchn_alloc_unbound(&a, b.id()).expect("offer");
    assert_eq!(hv.pirq_eoi(&a, other), Err(EvtchnError::NotPirq(other.0)));
    assert_eq!(
        hv.pirq_eoi(&a, Port(NR_EVENT_CHANNELS)),
        Err(EvtchnError::PortOutOfRange(NR_EVENT_CHANNELS))
    );
    assert!(hv.irq_in_flight(v));
    // The owner's EOI unmasks the line and the held request fires once.
    hv.pirq_eoi(&a, p).expect("eoi");
    assert_eq!(hv.do_irq(&a, 0), 1);
    assert_eq!(drain(&a), vec![p]);
    hv.pirq_eoi(&a, p).expect("eoi");
    assert!(!hv.irq_in_flight(v));
    // A spurious EOI changes nothing; the line works as before.
    hv.pirq_eoi(&a, p).expect("spurious eoi");
    assert_eq!(hv.do_irq(&a, 0), 0);
    hv.raise_irq(v).expect("raise");
    assert_eq!(hv.do_irq(&a, 0), 1);
    assert_eq!(drain(&a), vec![p]);
    // Closing the port releases the line, masked or not.
    hv.evtchn_close(&a, p).expect("close");
    assert!(!hv.irq_in_flight(v));
}

#[test]
fn a_device_interrupt_wakes_the_blocked_owner_vcpu() {
    let (hv, a, _b) = two_domains();
    let v = Vector(40);
    let p = hv.bind_irq(&a, v).expect("bind");
    let (h, seen) = run_receiver(&hv, &a, WaitMode::Blocking, 3);
    for i in 1..=3 {
        hv.raise_irq(v).expect("raise");
        let t0 = Instant::now();
        while seen.load(Ordering::Relaxed) < i {
            assert!(t0.elapsed() < Duration::from_secs(10), "irq {i} lost");
            std::thread::yield_now();
        }
    }
    assert_eq!(h.join().expect("vcpu"), 3);
    assert!(!a.evtchn_is_pending(p).expect("port"));
}

#[test]
fn the_single_shot_timer_wakes_a_blocked_vcpu_with_virq_timer() {
    let (hv, a, _b) = two_domains();
    let h = hv
        .start_vcpu(
            &a,
            VcpuStart {
                vcpu: 0,
                core: None,
                mode: WaitMode::Blocking,
                sample: None,
            },
            move |v| {
                let t = v.hv().bind_virq(v.domain(), Virq::Timer, 0).expect("virq");
                assert_eq!(
                    v.hv().bind_virq(v.domain(), Virq::Timer, 0),
                    Err(EvtchnError::VirqInUse(0))
                );
                let mut fired = Vec::new();
                // A deadline already past fires at once.
                v.set_timer(Some(v.hv().now()));
                v.handle_events(|p| fired.push(p));
                assert_eq!(fired, vec![t]);
                // A cancelled timer never fires.
                v.set_timer(Some(v.hv().now() + Duration::from_millis(5)));
                v.set_timer(None);
                std::thread::sleep(Duration::from_millis(10));
                fired.clear();
                v.handle_events(|p| fired.push(p));
                assert!(fired.is_empty());
                // Blocking with a timer set: the timer wakes us, no earlier.
                let deadline = v.hv().now() + Duration::from_millis(20);
                v.set_timer(Some(deadline));
                v.wait();
                let woke = v.hv().now();
                v.handle_events(|p| fired.push(p));
                (fired, woke >= deadline, v.domain().vcpus()[0].timer_fires())
            },
        )
        .expect("vcpu");
    let (fired, late_enough, fires) = h.join().expect("vcpu");
    assert_eq!(fired.len(), 1, "{fired:?}");
    assert!(late_enough, "the timer fired before its deadline");
    assert_eq!(fires, 2);
}

/// A vCPU that handles `n` events on `port`, waiting in `mode` between them.
fn run_receiver(
    hv: &Arc<Hypervisor>,
    d: &Arc<Domain>,
    mode: WaitMode,
    n: u32,
) -> (std::thread::JoinHandle<u32>, Arc<AtomicU32>) {
    let seen = Arc::new(AtomicU32::new(0));
    let s2 = Arc::clone(&seen);
    let h = hv
        .start_vcpu(
            d,
            VcpuStart {
                vcpu: 0,
                core: None,
                mode,
                sample: None,
            },
            move |v| {
                while s2.load(Ordering::Relaxed) < n {
                    v.wait();
                    v.handle_events(|p| {
                        s2.fetch_add(1, Ordering::Relaxed);
                        // A physical interrupt's line stays masked until its EOI.
                        let _ = v.hv().pirq_eoi(v.domain(), p);
                    });
                }
                s2.load(Ordering::Relaxed)
            },
        )
        .expect("vcpu");
    (h, seen)
}

#[test]
fn blocked_and_polling_vcpus_wake_on_events() {
    let halt_poll = WaitMode::HaltPoll(Duration::from_millis(1));
    for mode in [WaitMode::Blocking, WaitMode::Polling, halt_poll] {
        let (hv, a, b) = two_domains();
        let (pa, _pb) = connect(&hv, &a, &b);
        let (h, seen) = run_receiver(&hv, &b, mode, 5);
        for i in 1..=5 {
            hv.evtchn_send(&a, pa).expect("send");
            let t0 = Instant::now();
            while seen.load(Ordering::Relaxed) < i {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "{mode:?}: event {i} never handled"
                );
                std::thread::yield_now();
            }
        }
        assert_eq!(h.join().expect("vcpu"), 5);
        if mode == WaitMode::Blocking {
            let (blocks, wakes) = b.vcpus()[0].block_wake_counts();
            assert!(
                blocks >= 1 && wakes >= 1,
                "it really blocked: {blocks} {wakes}"
            );
        }
        assert!(b.vcpus()[0].cpu_time() > Duration::ZERO);
    }
}

/// A halt-polling vCPU left idle past its bound parks (it gives its core back), and an
/// event then wakes it as it wakes a blocked one.
#[test]
fn a_halt_polling_vcpu_parks_past_its_bound_and_an_event_wakes_it() {
    let (hv, a, b) = two_domains();
    let (pa, _pb) = connect(&hv, &a, &b);
    let (h, seen) = run_receiver(&hv, &b, WaitMode::HaltPoll(Duration::from_millis(1)), 2);
    for i in 1..=2u32 {
        // Idle past its bound, the vCPU parks: its run state says blocked.
        let t0 = Instant::now();
        while b.vcpus()[0].runstate().state != hv::time::RunstateKind::Blocked {
            assert!(t0.elapsed() < Duration::from_secs(10), "never parked");
            std::thread::sleep(Duration::from_millis(1));
        }
        hv.evtchn_send(&a, pa).expect("send");
        let t0 = Instant::now();
        while seen.load(Ordering::Relaxed) < i {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "event {i} never handled"
            );
            std::thread::yield_now();
        }
    }
    assert_eq!(h.join().expect("vcpu"), 2);
    let (blocks, wakes) = b.vcpus()[0].block_wake_counts();
    assert!(
        blocks >= 2 && wakes >= 2,
        "it parked each time: {blocks} {wakes}"
    );
}

/// A kick (the toolstack's, to ask a vCPU for its counters) wakes a blocked vCPU that
/// has no event pending: it leaves its wait within a bound, and its counts show it
/// really blocked and was woken.
#[test]
fn a_kick_wakes_a_blocked_vcpu_without_an_event() {
    let (hv, _a, b) = two_domains();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = Arc::clone(&stop);
    let h = hv
        .start_vcpu(
            &b,
            VcpuStart {
                vcpu: 0,
                core: None,
                mode: WaitMode::Blocking,
                sample: None,
            },
            move |v| {
                while !s2.load(Ordering::Acquire) {
                    v.wait();
                }
            },
        )
        .expect("vcpu");
    let t0 = Instant::now();
    while b.vcpus()[0].runstate().state != hv::time::RunstateKind::Blocked {
        assert!(t0.elapsed() < Duration::from_secs(10), "never blocked");
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Release);
    hv.kick_vcpu(&b, 0);
    let t0 = Instant::now();
    while !h.is_finished() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the kick did not wake the blocked vCPU"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    h.join().expect("stopped");
    assert!(!b.upcall_pending(0), "woken without an event");
    let (blocks, wakes) = b.vcpus()[0].block_wake_counts();
    assert!(
        blocks >= 1 && wakes >= 1,
        "it blocked and was woken: {blocks} {wakes}"
    );
}

/// The count of open ports a teardown check reads follows every way a port opens and
/// closes, on both ends: offered, bound, closed from either side, a virtual interrupt.
#[test]
fn the_open_port_count_follows_every_binding_and_close() {
    let (hv, a, b) = two_domains();
    let scan = |d: &Domain| {
        (1..NR_EVENT_CHANNELS)
            .filter(|&p| !matches!(d.evtchn_state(Port(p)), Ok(ChannelState::Free)))
            .count()
    };
    let check = |what: &str| {
        for d in [&a, &b] {
            assert_eq!(hv.evtchn_open_ports(d), scan(d), "{what}");
        }
    };
    check("none");
    let (pa, pb) = connect(&hv, &a, &b);
    check("bound");
    let (qa, _qb) = connect(&hv, &a, &b);
    let offered = hv.evtchn_alloc_unbound(&a, b.id()).expect("offer");
    check("offered");
    hv.evtchn_close(&a, pa).expect("close");
    check("closed at one end (the other goes unbound)");
    hv.evtchn_close(&b, pb).expect("close");
    check("closed at the other");
    hv.evtchn_close(&b, qa).ok();
    hv.evtchn_close(&a, qa).expect("close");
    hv.evtchn_close(&a, offered).expect("close");
    check("closed");
    hv.bind_virq(&a, Virq::Timer, 0).expect("virq");
    check("virq");
    assert_eq!(hv.evtchn_open_ports(&a), 1);
}
