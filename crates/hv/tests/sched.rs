//! pvio's scheduler: units on pCPUs, wake-ups through the IPI word, weights, caps,
//! deadlines, a panicking unit, a hung step rescued, and a clean stop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hv::sched::{live_units, CpuPlan, Cx, IdlePolicy, Scheduler, Step, Unit, UnitSpec, Waker};

/// Counts its steps; has `work` to do when woken, and ends when told.
struct Counter {
    work: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
    end: Arc<AtomicBool>,
    busy: bool,
}

impl Unit for Counter {
    type Output = u64;
    fn step(&mut self, _cx: &Cx) -> Step<u64> {
        if self.end.load(Ordering::Acquire) {
            return Step::Done(self.done.load(Ordering::Relaxed));
        }
        if self.busy {
            self.done.fetch_add(1, Ordering::Relaxed);
            return Step::More;
        }
        let w = self.work.swap(0, Ordering::Acquire);
        self.done.fetch_add(w, Ordering::Relaxed);
        Step::Idle(None)
    }
}

fn counter(busy: bool) -> (Counter, Arc<AtomicU64>, Arc<AtomicU64>, Arc<AtomicBool>) {
    let (work, done, end) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let c = Counter {
        work: Arc::clone(&work),
        done: Arc::clone(&done),
        end: Arc::clone(&end),
        busy,
    };
    (c, work, done, end)
}

fn one_pcpu(policy: IdlePolicy) -> Arc<Scheduler> {
    Scheduler::new(&CpuPlan::floating(1, policy), None).expect("scheduler")
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn a_woken_unit_runs_and_sees_the_work_published_before_the_wake_in_every_policy() {
    for policy in [IdlePolicy::Poll, IdlePolicy::HALT_POLL, IdlePolicy::Block] {
        let s = one_pcpu(policy);
        let (c, work, done, end) = counter(false);
        let j = s.place(0, UnitSpec::named("counter"), c).expect("place");
        for k in 1..=1000u64 {
            work.fetch_add(1, Ordering::Release);
            j.wake();
            wait_for("the unit to take its work", || {
                done.load(Ordering::Acquire) == k
            });
        }
        end.store(true, Ordering::Release);
        j.wake();
        let stats = Arc::clone(j.stats());
        assert_eq!(j.join(), Ok(1000), "{policy}");
        assert!(
            stats.report().wakeups >= 999,
            "{policy}: {:?}",
            stats.report()
        );
        assert_eq!(live_units(&s, 0), 0);
    }
}

#[test]
fn units_with_more_work_share_their_pcpu_by_weight() {
    let s = one_pcpu(IdlePolicy::Poll);
    let (a, _, da, ea) = counter(true);
    let (b, _, _, eb) = counter(true);
    let ja = s.place(0, UnitSpec::named("a"), a).expect("a");
    let mut heavy = UnitSpec::named("b");
    heavy.weight = 3;
    let jb = s.place(0, heavy, b).expect("b");
    wait_for("both to run a while", || {
        da.load(Ordering::Relaxed) > 30_000
    });
    ea.store(true, Ordering::Release);
    eb.store(true, Ordering::Release);
    let (na, nb) = (ja.join().expect("a"), jb.join().expect("b"));
    // Round-robin with weights is exact per round: b takes three steps to a's one.
    let ratio = nb as f64 / na as f64;
    assert!((2.9..3.1).contains(&ratio), "a {na}, b {nb}: {ratio}");
}

#[test]
fn a_capped_unit_takes_no_more_than_its_share_of_the_pcpu() {
    let s = one_pcpu(IdlePolicy::Poll);
    // A unit that burns its whole step (a guest flooding its pCPU).
    struct Burn(Arc<AtomicBool>);
    impl Unit for Burn {
        type Output = ();
        fn step(&mut self, _cx: &Cx) -> Step<()> {
            if self.0.load(Ordering::Acquire) {
                return Step::Done(());
            }
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(50) {
                std::hint::spin_loop();
            }
            Step::More
        }
    }
    let end = Arc::new(AtomicBool::new(false));
    let mut spec = UnitSpec::named("burn");
    spec.cap_percent = 25;
    let j = s.place(0, spec, Burn(Arc::clone(&end))).expect("burn");
    let stats = Arc::clone(j.stats());
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    let ran = stats.running();
    let wall = t0.elapsed();
    end.store(true, Ordering::Release);
    j.join().expect("join");
    let share = ran.as_secs_f64() / wall.as_secs_f64();
    // 25% of each 10 ms period, plus at most one step past the cap per period.
    assert!(share < 0.35, "capped at 25% it took {:.0}%", share * 100.0);
    assert!(share > 0.05, "it ran at all: {:.0}%", share * 100.0);
    assert!(stats.report().capped > 0);
}

#[test]
fn an_idle_unit_runs_again_at_its_deadline() {
    struct Timer {
        at: Option<Instant>,
        fired: u32,
    }
    impl Unit for Timer {
        type Output = Vec<Duration>;
        fn step(&mut self, cx: &Cx) -> Step<Vec<Duration>> {
            match self.at {
                None => {
                    self.at = Some(cx.now + Duration::from_millis(2));
                    Step::Idle(self.at)
                }
                Some(at) if cx.now >= at => {
                    self.fired += 1;
                    if self.fired == 5 {
                        return Step::Done(vec![cx.now - at]);
                    }
                    self.at = Some(cx.now + Duration::from_millis(2));
                    Step::Idle(self.at)
                }
                Some(at) => Step::Idle(Some(at)),
            }
        }
    }
    for policy in [IdlePolicy::Poll, IdlePolicy::Block] {
        let s = one_pcpu(policy);
        let t0 = Instant::now();
        let j = s
            .place(0, UnitSpec::named("timer"), Timer { at: None, fired: 0 })
            .expect("timer");
        let late = j.join().expect("join");
        assert!(t0.elapsed() >= Duration::from_millis(10), "{policy}");
        assert!(
            late[0] < Duration::from_millis(50),
            "{policy}: late by {late:?}"
        );
    }
}

/// A unit behind its schedule idles until a deadline already past (a device whose
/// timer was due while it ran): it runs again at once, and its wait counts from its own
/// step's end, not from the deadline.
#[test]
fn a_deadline_already_past_runs_at_once_and_its_wait_counts_from_the_steps_end() {
    struct Behind {
        steps: u32,
    }
    impl Unit for Behind {
        type Output = ();
        fn step(&mut self, cx: &Cx) -> Step<()> {
            self.steps += 1;
            if self.steps == 20 {
                return Step::Done(());
            }
            Step::Idle(Some(cx.now - Duration::from_millis(20)))
        }
    }
    for policy in [IdlePolicy::Poll, IdlePolicy::Block] {
        let s = one_pcpu(policy);
        let t0 = Instant::now();
        let j = s
            .place(0, UnitSpec::named("behind"), Behind { steps: 0 })
            .expect("behind");
        let stats = Arc::clone(j.stats());
        j.join().expect("join");
        let r = stats.report();
        assert!(
            r.wakeups >= 19,
            "{policy}: each past deadline woke it: {r:?}"
        );
        // Nineteen turns at once: nowhere near a deadline's 20 ms each.
        assert!(t0.elapsed() < Duration::from_millis(300), "{policy}");
        assert!(
            r.longest_wait < Duration::from_millis(10),
            "{policy}: a wait from the deadline, not from the step's end: {r:?}"
        );
    }
}

/// A device engine rung as its step begins (its waker saw it dozing a moment before)
/// runs that step at once: the ring is not a wait for a CPU. Its wait to run, if the
/// ring leaves it runnable once the step ends, counts from that end, not from the ring
/// with its own step inside.
#[test]
fn a_wake_up_that_comes_as_a_units_step_begins_is_not_counted_as_a_wait_through_that_step() {
    struct Rung {
        waker: Option<Waker>,
        steps: u32,
    }
    impl Unit for Rung {
        type Output = ();
        fn attach(&mut self, waker: &Waker, _stats: &Arc<hv::sched::UnitStats>) {
            self.waker = Some(waker.clone());
        }
        fn step(&mut self, _cx: &Cx) -> Step<()> {
            self.steps += 1;
            if self.steps > 10 {
                return Step::Done(());
            }
            // Rung as it begins, then a long step of its own.
            if let Some(w) = &self.waker {
                w.wake();
            }
            std::thread::sleep(Duration::from_millis(20));
            Step::Idle(None)
        }
    }
    for policy in [IdlePolicy::Poll, IdlePolicy::Block] {
        let s = one_pcpu(policy);
        let j = s
            .place(
                0,
                UnitSpec::device("nic"),
                Rung {
                    waker: None,
                    steps: 0,
                },
            )
            .expect("rung");
        let stats = Arc::clone(j.stats());
        j.join().expect("join");
        let r = stats.report();
        assert!(r.wakeups >= 10, "{policy}: each ring woke it again: {r:?}");
        assert!(
            r.longest_wait < Duration::from_millis(10),
            "{policy}: waits from the steps' ends, not through the 20 ms steps: {r:?}"
        );
    }
}

#[test]
fn a_unit_that_panics_fails_its_join_and_its_neighbours_run_on() {
    struct Bomb;
    impl Unit for Bomb {
        type Output = ();
        fn step(&mut self, _cx: &Cx) -> Step<()> {
            panic!("injected");
        }
    }
    let s = one_pcpu(IdlePolicy::HALT_POLL);
    let (c, work, done, end) = counter(false);
    let jc = s.place(0, UnitSpec::named("counter"), c).expect("counter");
    let jb = s.place(0, UnitSpec::named("bomb"), Bomb).expect("bomb");
    let e = jb.join().expect_err("a panicking unit has no result");
    assert!(e.contains("injected"), "{e}");
    work.store(7, Ordering::Release);
    jc.wake();
    wait_for("the neighbour to run", || done.load(Ordering::Acquire) == 7);
    end.store(true, Ordering::Release);
    jc.wake();
    assert_eq!(jc.join(), Ok(7));
}

#[test]
fn a_hung_step_keeps_only_its_own_unit_once_the_pcpu_is_rescued() {
    struct Hang(Arc<AtomicBool>);
    impl Unit for Hang {
        type Output = &'static str;
        fn step(&mut self, _cx: &Cx) -> Step<&'static str> {
            while !self.0.load(Ordering::Acquire) {
                std::thread::park_timeout(Duration::from_millis(1));
            }
            Step::Done("released")
        }
    }
    let s = one_pcpu(IdlePolicy::HALT_POLL);
    let (c, work, done, end) = counter(false);
    let jc = s.place(0, UnitSpec::named("counter"), c).expect("counter");
    let release = Arc::new(AtomicBool::new(false));
    let jh = s
        .place(0, UnitSpec::named("hang"), Hang(Arc::clone(&release)))
        .expect("hang");
    std::thread::sleep(Duration::from_millis(30));
    work.store(3, Ordering::Release);
    jc.wake();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        done.load(Ordering::Acquire),
        0,
        "the hung step holds the pCPU's thread"
    );
    assert_eq!(s.rescue(Duration::from_millis(10)), 1);
    wait_for("the neighbour to run on the new thread", || {
        done.load(Ordering::Acquire) == 3
    });
    release.store(true, Ordering::Release);
    assert_eq!(jh.join(), Ok("released"));
    end.store(true, Ordering::Release);
    jc.wake();
    assert_eq!(jc.join(), Ok(3));
    assert_eq!(s.reports()[0].rescues, 1);
}

#[test]
fn stopping_ends_every_pcpu_thread_and_answers_units_left_behind() {
    let s = one_pcpu(IdlePolicy::Poll);
    let (c, _, _, _) = counter(true);
    let j = s.place(0, UnitSpec::named("forever"), c).expect("place");
    let w: Waker = j.waker().clone();
    s.stop(Duration::from_millis(20));
    assert!(
        j.join().is_err(),
        "a unit the scheduler dropped has no result"
    );
    // The pCPU's thread has ended: its IPI word is never looked at again, and waking is
    // harmless.
    w.wake();
    assert!(s
        .place(0, UnitSpec::named("late"), counter(false).0)
        .is_err());
}

#[test]
fn idle_policies_are_named_and_parsed_alike() {
    for p in [
        IdlePolicy::Poll,
        IdlePolicy::HALT_POLL,
        IdlePolicy::HaltPoll(Duration::from_micros(50)),
        IdlePolicy::Block,
    ] {
        assert_eq!(IdlePolicy::parse(&p.name()), Ok(p));
    }
    assert!(IdlePolicy::parse("spin").is_err());
}

#[test]
fn a_unit_that_floods_its_neighbour_with_wake_ups_takes_no_more_than_its_turns() {
    // A hostile guest's vCPU that never idles and wakes its neighbour on every step (an
    // event flood), and the neighbour that has a fixed piece of work per wake-up: they
    // alternate, so the flood costs the neighbour's pCPU one step of the neighbour's own
    // per step of its own, and the neighbour is never starved.
    struct Flood {
        victim: Option<Waker>,
        end: Arc<AtomicBool>,
        steps: u64,
    }
    impl Unit for Flood {
        type Output = u64;
        fn step(&mut self, _cx: &Cx) -> Step<u64> {
            if self.end.load(Ordering::Acquire) {
                return Step::Done(self.steps);
            }
            self.steps += 1;
            if let Some(v) = &self.victim {
                v.wake();
            }
            Step::More
        }
    }
    let s = one_pcpu(IdlePolicy::Poll);
    let (victim, work, done, vend) = counter(false);
    let jv = s
        .place(0, UnitSpec::named("victim"), victim)
        .expect("victim");
    let end = Arc::new(AtomicBool::new(false));
    let jf = s
        .place(
            0,
            UnitSpec::named("flood"),
            Flood {
                victim: Some(jv.waker().clone()),
                end: Arc::clone(&end),
                steps: 0,
            },
        )
        .expect("flood");
    // The victim's own work arrives meanwhile, and is done.
    for k in 1..=200u64 {
        work.fetch_add(1, Ordering::Release);
        jv.wake();
        wait_for("the victim to do its work", || {
            done.load(Ordering::Acquire) == k
        });
    }
    end.store(true, Ordering::Release);
    let flood_steps = jf.join().expect("flood");
    vend.store(true, Ordering::Release);
    jv.wake();
    let vstats = Arc::clone(jv.stats());
    assert_eq!(jv.join(), Ok(200));
    // Round-robin: the victim took at most one step per flood step (plus its last).
    let vsteps = vstats.report().steps;
    assert!(
        vsteps <= flood_steps + 2,
        "victim {vsteps} steps, flood {flood_steps}"
    );
}

/// Reads datagrams from a socket that is its interrupt line, until told to stop
/// taking them; then it leaves the line unarmed.
struct Reader {
    sock: std::os::unix::net::UnixDatagram,
    line: Option<hv::sched::IrqLine>,
    got: Arc<AtomicU64>,
    steps: Arc<AtomicU64>,
    take: Arc<AtomicBool>,
    end: Arc<AtomicBool>,
}

impl Unit for Reader {
    type Output = ();
    fn attach(&mut self, waker: &Waker, _stats: &Arc<hv::sched::UnitStats>) {
        use std::os::fd::AsRawFd;
        self.line = Some(waker.irq_line(self.sock.as_raw_fd()).expect("line"));
    }
    fn step(&mut self, _cx: &Cx) -> Step<()> {
        self.steps.fetch_add(1, Ordering::Relaxed);
        if self.end.load(Ordering::Acquire) {
            return Step::Done(());
        }
        if !self.take.load(Ordering::Acquire) {
            return Step::Idle(None);
        }
        let mut b = [0u8; 16];
        loop {
            match self.sock.recv(&mut b) {
                Ok(_) => {
                    self.got.fetch_add(1, Ordering::Release);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("recv: {e}"),
            }
        }
        if let Some(l) = &self.line {
            l.arm();
        }
        Step::Idle(None)
    }
}

#[test]
fn input_on_a_units_host_line_wakes_it_in_every_policy_and_an_unarmed_line_does_not() {
    for policy in [
        IdlePolicy::Poll,
        IdlePolicy::HaltPoll(Duration::from_micros(50)),
        IdlePolicy::Block,
    ] {
        let s = one_pcpu(policy);
        let (tx, rx) = std::os::unix::net::UnixDatagram::pair().expect("pair");
        rx.set_nonblocking(true).expect("nonblocking");
        let (got, steps) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (take, end) = (
            Arc::new(AtomicBool::new(true)),
            Arc::new(AtomicBool::new(false)),
        );
        let r = Reader {
            sock: rx,
            line: None,
            got: Arc::clone(&got),
            steps: Arc::clone(&steps),
            take: Arc::clone(&take),
            end: Arc::clone(&end),
        };
        let j = s.place(0, UnitSpec::named("reader"), r).expect("place");
        for k in 1..=200u64 {
            // Now and then the pCPU has gone to sleep before the datagram comes.
            if k % 50 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
            tx.send(&[k as u8]).expect("send");
            wait_for("the datagram to be read", || {
                got.load(Ordering::Acquire) == k
            });
        }
        // The unit stops taking input: its line stays unarmed after the next wake-up,
        // and input waiting on it does not run the unit again and again.
        take.store(false, Ordering::Release);
        tx.send(&[1]).expect("send");
        std::thread::sleep(Duration::from_millis(5));
        let before = steps.load(Ordering::Acquire);
        std::thread::sleep(Duration::from_millis(20));
        let after = steps.load(Ordering::Acquire);
        assert!(
            after - before <= 1,
            "{policy}: an unarmed line woke its unit {} times",
            after - before
        );
        assert!(
            s.reports()[0].line_fires >= 200,
            "{policy}: {:?}",
            s.reports()[0]
        );
        end.store(true, Ordering::Release);
        j.wake();
        j.join().expect("reader");
        s.stop(Duration::from_secs(1));
    }
}

#[test]
fn a_pcpu_with_a_policy_of_its_own_sleeps_while_its_polling_neighbour_spins() {
    let s = Scheduler::new(
        &CpuPlan {
            cores: vec![None, None],
            policy: IdlePolicy::Poll,
            own_policy: vec![(1, IdlePolicy::Block)],
        },
        None,
    )
    .expect("scheduler");
    assert_eq!(
        (s.policy_of(0), s.policy_of(1)),
        (IdlePolicy::Poll, IdlePolicy::Block)
    );
    // A woken unit on the sleeping pCPU still runs: the wake is a host wake-up there.
    let (c, work, done, end) = counter(false);
    let j = s.place(1, UnitSpec::named("counter"), c).expect("place");
    for k in 1..=50u64 {
        work.fetch_add(1, Ordering::Release);
        j.wake();
        wait_for("the unit to take its work", || {
            done.load(Ordering::Acquire) == k
        });
    }
    let r = s.reports();
    assert_eq!(r[0].sleeps, 0, "the polling pCPU slept: {:?}", r[0]);
    // Most of the 50 wake-ups find it asleep. Not all: on a loaded host the next wake
    // can come between the unit's step and the pCPU's sleep (the suite once saw 48).
    assert!(
        r[1].sleeps >= 25,
        "the blocking pCPU did not sleep: {:?}",
        r[1]
    );
    end.store(true, Ordering::Release);
    j.wake();
    assert_eq!(j.join(), Ok(50));
}

/// A halt-polling pCPU gives way to another thread of the host that wants its core, and
/// then sleeps instead of spinning out its window against it (KVM's halt-poll stops once
/// its core has another task to run): a user's programs beside `pvio up` get the core.
#[test]
fn a_halt_polling_pcpu_sleeps_once_another_thread_wants_its_core() {
    // A window far longer than the test: only giving way ends the spin.
    let s = Scheduler::new(
        &CpuPlan {
            cores: vec![Some(0)],
            policy: IdlePolicy::HaltPoll(Duration::from_secs(30)),
            own_policy: Vec::new(),
        },
        None,
    )
    .expect("scheduler");
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let _ = mem::cpu::pin_current_thread(0);
            while !stop.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        })
    };
    // A while beside it: long enough for many of the spin's looks at the core.
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    busy.join().expect("busy thread");
    // The pCPU sleeps now, though its window has most of 30 s to run: a unit woken on
    // it is a host wake-up, and still runs.
    let (c, work, done, end) = counter(false);
    let j = s.place(0, UnitSpec::named("counter"), c).expect("place");
    work.fetch_add(1, Ordering::Release);
    j.wake();
    wait_for("the unit to take its work", || {
        done.load(Ordering::Acquire) == 1
    });
    let r = &s.reports()[0];
    assert!(r.sleeps >= 1 && r.host_wakes >= 1, "it spun on: {r:?}");
    end.store(true, Ordering::Release);
    j.wake();
    assert_eq!(j.join(), Ok(1));
    s.stop(Duration::from_secs(1));
}

/// A sleeping pCPU rung by a waker counts the host's wake-up of it, from the ring to its
/// thread's running: the record's device waits are net of it and it is reported apart.
#[test]
fn a_sleeping_pcpus_wake_up_by_the_host_is_counted_from_the_ring_to_its_run() {
    let s = Scheduler::new(
        &CpuPlan {
            cores: vec![Some(0)],
            policy: IdlePolicy::Block,
            own_policy: Vec::new(),
        },
        None,
    )
    .expect("scheduler");
    let (c, work, done, end) = counter(false);
    let j = s.place(0, UnitSpec::named("counter"), c).expect("place");
    // It sleeps at once when idle: wake-ups that find it asleep are rung (one that comes
    // as it goes to sleep, before its sleep began, is not the host's wake-up).
    let mut k = 0;
    wait_for("three rung wake-ups", || {
        std::thread::sleep(Duration::from_millis(1));
        k += 1;
        work.fetch_add(1, Ordering::Release);
        j.wake();
        wait_for("the unit to take its work", || {
            done.load(Ordering::Acquire) == k
        });
        s.reports()[0].rung_wakes >= 3
    });
    let r = &s.reports()[0];
    assert!(
        r.rung_wakes <= r.host_wakes && r.rung_wakes <= r.sleeps,
        "{r:?}"
    );
    assert!(r.rung_wake > Duration::ZERO, "{r:?}");
    assert!(
        r.longest_rung_wake <= r.rung_wake
            && r.longest_rung_wake * r.rung_wakes as u32 >= r.rung_wake,
        "{r:?}"
    );
    end.store(true, Ordering::Release);
    j.wake();
    assert_eq!(j.join(), Ok(k));
    s.stop(Duration::from_secs(1));
}

/// A pCPU asleep until a unit's deadline counts the host's wake-up of it at its timer,
/// from the due time to its thread's running, apart from the rung ones: the record's
/// device waits are net of it (a unit due at a deadline is woken from there).
#[test]
fn a_sleeping_pcpus_wake_up_at_its_timer_is_counted_from_the_due_time_to_its_run() {
    struct Timed {
        left: u32,
    }
    impl Unit for Timed {
        type Output = ();
        fn step(&mut self, cx: &Cx) -> Step<()> {
            if self.left == 0 {
                return Step::Done(());
            }
            self.left -= 1;
            Step::Idle(Some(cx.now + Duration::from_millis(2)))
        }
    }
    let s = one_pcpu(IdlePolicy::Block);
    // Nobody rings it: every sleep ends at the unit's deadline.
    let j = s
        .place(0, UnitSpec::named("timed"), Timed { left: 10 })
        .expect("place");
    j.join().expect("join");
    let r = &s.reports()[0];
    assert_eq!(r.rung_wakes, 0, "{r:?}");
    assert!(r.timer_wakes >= 5 && r.timer_wakes <= r.sleeps, "{r:?}");
    assert!(r.timer_late > Duration::ZERO, "{r:?}");
    assert!(
        r.longest_timer_late <= r.timer_late
            && r.longest_timer_late * r.timer_wakes as u32 >= r.timer_late,
        "{r:?}"
    );
    s.stop(Duration::from_secs(1));
}

#[test]
fn the_adaptive_window_grows_for_wake_ups_it_just_missed_and_drops_for_long_sleeps() {
    use hv::sched::{next_poll_window, ADAPTIVE_GROW_START};
    let us = Duration::from_micros;
    let max = us(200);
    // Woken within the window: it stays.
    assert_eq!(next_poll_window(us(40), us(30), max), us(40));
    // Woken after it but within the bound: it grows, from the start value, doubling.
    assert_eq!(
        next_poll_window(Duration::ZERO, us(50), max),
        ADAPTIVE_GROW_START
    );
    assert_eq!(next_poll_window(us(40), us(60), max), us(80));
    assert_eq!(next_poll_window(us(160), us(190), max), max);
    // Slept past the bound: no spin would have helped, so none next time.
    assert_eq!(next_poll_window(us(80), us(500), max), Duration::ZERO);
    // The policy's names read back.
    for p in [
        IdlePolicy::AdaptiveHaltPoll(hv::sched::HALT_POLL_DEFAULT),
        IdlePolicy::AdaptiveHaltPoll(us(50)),
    ] {
        assert_eq!(IdlePolicy::parse(&p.name()), Ok(p));
    }
}

/// A vCPU whose steps hold its pCPU for `step` at a time, as a guest's long poll does;
/// with `steps`, only that many, then it idles (its pCPU with it) until the end. It
/// counts the steps it took in `took`.
struct Hog {
    step: Duration,
    steps: Option<u32>,
    end: Arc<AtomicBool>,
    took: Arc<AtomicU64>,
}

impl Unit for Hog {
    type Output = ();
    fn step(&mut self, _cx: &Cx) -> Step<()> {
        if self.end.load(Ordering::Acquire) {
            return Step::Done(());
        }
        if self.steps == Some(0) {
            return Step::Idle(None);
        }
        if let Some(n) = self.steps.as_mut() {
            *n -= 1;
        }
        let t = Instant::now();
        while t.elapsed() < self.step {
            std::hint::spin_loop();
        }
        self.took.fetch_add(1, Ordering::Relaxed);
        Step::More
    }
}

/// A [`Hog`] on pCPU 0 of `s`; and the flag that ends it.
fn place_hog(
    s: &Scheduler,
    step: Duration,
    steps: Option<u32>,
) -> (hv::sched::UnitJoin<()>, Arc<AtomicBool>) {
    let end = Arc::new(AtomicBool::new(false));
    let hog = Hog {
        step,
        steps,
        end: Arc::clone(&end),
        took: Arc::default(),
    };
    (s.place(0, UnitSpec::named("vcpu"), hog).expect("hog"), end)
}

/// A device's engine: takes the work published before each wake-up, and notes any step
/// that began while another of its steps was under way.
struct Engine {
    work: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
    inside: Arc<AtomicBool>,
    overlaps: Arc<AtomicU64>,
    end: Arc<AtomicBool>,
}

impl Unit for Engine {
    type Output = u64;
    fn step(&mut self, _cx: &Cx) -> Step<u64> {
        if self.inside.swap(true, Ordering::AcqRel) {
            self.overlaps.fetch_add(1, Ordering::Relaxed);
        }
        let w = self.work.swap(0, Ordering::Acquire);
        self.done.fetch_add(w, Ordering::Relaxed);
        self.inside.store(false, Ordering::Release);
        if self.end.load(Ordering::Acquire) {
            return Step::Done(self.done.load(Ordering::Relaxed));
        }
        Step::Idle(None)
    }
}

/// An [`Engine`] placed as a device on pCPU 0 of `s`: its join, the work counter its
/// wakers publish to, the work it took, and the flag that ends it.
fn place_engine(
    s: &Scheduler,
) -> (
    hv::sched::UnitJoin<u64>,
    Arc<AtomicU64>,
    Arc<AtomicU64>,
    Arc<AtomicBool>,
) {
    let (work, done, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let engine = Engine {
        work: Arc::clone(&work),
        done: Arc::clone(&done),
        inside: Arc::new(AtomicBool::new(false)),
        overlaps: Arc::new(AtomicU64::new(0)),
        end: Arc::clone(&stop),
    };
    let j = s.place(0, UnitSpec::device("nic"), engine).expect("engine");
    (j, work, done, stop)
}

/// Idle pCPUs run a device's engine while its own pCPU is held by a vCPU's long steps:
/// every wake-up's work is taken, no two of its steps ever overlap though two thieves
/// race for it, and the engine's turns elsewhere are counted. A unit not placed as a
/// device stays on its pCPU.
#[test]
fn idle_pcpus_run_a_device_engine_whose_pcpu_is_busy_and_never_two_of_its_steps_at_once() {
    for stealable in [true, false] {
        let s = Scheduler::new(&CpuPlan::floating(3, IdlePolicy::Poll), None).expect("sched");
        let (hog, end) = place_hog(&s, Duration::from_millis(5), None);
        let (work, done, inside, overlaps, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let spec = if stealable {
            UnitSpec::device("nic")
        } else {
            UnitSpec::named("nic")
        };
        let j = s
            .place(
                0,
                spec,
                Engine {
                    work: Arc::clone(&work),
                    done: Arc::clone(&done),
                    inside,
                    overlaps: Arc::clone(&overlaps),
                    end: Arc::clone(&stop),
                },
            )
            .expect("engine");
        const N: u64 = 2000;
        for k in 1..=N {
            work.fetch_add(1, Ordering::Release);
            j.wake();
            if k % 200 == 0 {
                std::thread::sleep(Duration::from_micros(300));
            }
        }
        wait_for("every wake-up's work taken", || {
            done.load(Ordering::Acquire) == N
        });
        stop.store(true, Ordering::Release);
        j.wake();
        let stats = Arc::clone(j.stats());
        assert_eq!(j.join(), Ok(N));
        end.store(true, Ordering::Release);
        hog.join().expect("hog");
        let r = stats.report();
        assert_eq!(overlaps.load(Ordering::Relaxed), 0, "{r:?}");
        if stealable {
            assert!(r.stolen > 0, "idle pCPUs ran it: {r:?}");
        } else {
            assert_eq!(r.stolen, 0, "{r:?}");
        }
        assert!(
            r.wait_p99 > Duration::ZERO && r.longest_wait > Duration::ZERO,
            "its waits are counted: {r:?}"
        );
    }
}

/// A device's engine idle until a deadline is run at its deadline by an idle pCPU while
/// its own pCPU is in a long step; once its own pCPU goes idle, it keeps the deadlines a
/// thief handed back.
#[test]
fn a_device_engines_deadline_is_kept_by_an_idle_pcpu_while_its_own_is_busy() {
    struct Ticker {
        next: Option<Instant>,
        late: Vec<Duration>,
    }
    impl Unit for Ticker {
        type Output = Vec<Duration>;
        fn step(&mut self, cx: &Cx) -> Step<Vec<Duration>> {
            if let Some(at) = self.next.filter(|&at| cx.now >= at) {
                self.late.push(cx.now - at);
                if self.late.len() == 50 {
                    return Step::Done(std::mem::take(&mut self.late));
                }
            }
            if self.next.is_none_or(|at| cx.now >= at) {
                self.next = Some(cx.now + Duration::from_millis(1));
            }
            Step::Idle(self.next)
        }
    }
    let s = Scheduler::new(&CpuPlan::floating(2, IdlePolicy::Poll), None).expect("sched");
    let (hog, end) = place_hog(&s, Duration::from_millis(20), Some(2));
    let j = s
        .place(
            0,
            UnitSpec::device("timer"),
            Ticker {
                next: None,
                late: Vec::new(),
            },
        )
        .expect("timer");
    let stats = Arc::clone(j.stats());
    wait_for("the 50 ticks, on either pCPU", || j.is_finished());
    let late = j.join().expect("ticks");
    end.store(true, Ordering::Release);
    hog.wake();
    hog.join().expect("hog");
    let r = stats.report();
    assert!(r.stolen > 0, "{r:?}");
    // Behind the vCPU's 20 ms steps, the ticks would come 20 ms apart: most run on the
    // idle pCPU instead, at their time (the host may take a thread away now and then).
    let mut late = late;
    late.sort_unstable();
    assert!(late[late.len() / 2] < Duration::from_millis(10), "{late:?}");
}

/// A device's engine that panics in a step an idle pCPU took from its busy own pCPU fails
/// its own join only: the vCPU beside it and the thief's pCPU run on.
#[test]
fn a_device_engine_that_panics_on_a_thief_fails_its_own_join_only() {
    struct Fragile(u32);
    impl Unit for Fragile {
        type Output = ();
        fn step(&mut self, cx: &Cx) -> Step<()> {
            self.0 += 1;
            assert!(self.0 < 200, "engine fault");
            Step::Idle(Some(cx.now + Duration::from_micros(200)))
        }
    }
    let s = Scheduler::new(&CpuPlan::floating(2, IdlePolicy::Poll), None).expect("sched");
    let (hog, end) = place_hog(&s, Duration::from_millis(2), None);
    let j = s
        .place(0, UnitSpec::device("fragile"), Fragile(0))
        .expect("engine");
    let stats = Arc::clone(j.stats());
    let r = j.join();
    assert!(
        r.is_err_and(|e| e.contains("engine fault")),
        "{:?}",
        stats.report()
    );
    // The scheduler goes on: a fresh unit on the thief's side runs.
    let (c, work, done, stop) = counter(false);
    let k = s.place(1, UnitSpec::named("after"), c).expect("place");
    work.store(1, Ordering::Release);
    k.wake();
    wait_for("the next unit to run", || done.load(Ordering::Acquire) == 1);
    stop.store(true, Ordering::Release);
    k.wake();
    assert_eq!(k.join(), Ok(1));
    end.store(true, Ordering::Release);
    hog.join().expect("the vCPU ran on");
}

/// A device's engine whose step never returns is handled as a hung vCPU's is, wherever
/// the step runs (its own pCPU, or an idle one that took it while its own was in a
/// vCPU's step): the rescue gives that pCPU's thread a successor, every other unit on
/// both pCPUs runs on, and the engine's join answers once its step returns.
#[test]
fn a_device_engine_hung_in_a_step_is_rescued_on_whichever_pcpu_ran_it() {
    struct Hang {
        entered: Arc<AtomicBool>,
        release: Arc<AtomicBool>,
    }
    impl Unit for Hang {
        type Output = &'static str;
        fn step(&mut self, _cx: &Cx) -> Step<&'static str> {
            self.entered.store(true, Ordering::Release);
            while !self.release.load(Ordering::Acquire) {
                std::thread::park_timeout(Duration::from_millis(1));
            }
            Step::Done("released")
        }
    }
    let s = Scheduler::new(&CpuPlan::floating(2, IdlePolicy::Poll), None).expect("sched");
    let (hog, end) = place_hog(&s, Duration::from_millis(2), None);
    let counters: Vec<_> = (0..2)
        .map(|p| {
            let (c, work, done, stop) = counter(false);
            let j = s
                .place(p, UnitSpec::named(format!("c{p}")), c)
                .expect("counter");
            (j, work, done, stop)
        })
        .collect();
    let (entered, release) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let jh = s
        .place(
            0,
            UnitSpec::device("hang"),
            Hang {
                entered: Arc::clone(&entered),
                release: Arc::clone(&release),
            },
        )
        .expect("engine");
    wait_for("the engine's step to begin", || {
        entered.load(Ordering::Acquire)
    });
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(s.rescue(Duration::from_millis(20)), 1, "{:?}", s.reports());
    for (j, work, done, _) in &counters {
        work.store(1, Ordering::Release);
        j.wake();
        wait_for("each pCPU's neighbour to run", || {
            done.load(Ordering::Acquire) == 1
        });
    }
    release.store(true, Ordering::Release);
    assert_eq!(jh.join(), Ok("released"));
    for (j, _, _, stop) in counters {
        stop.store(true, Ordering::Release);
        j.wake();
        assert_eq!(j.join(), Ok(1));
    }
    end.store(true, Ordering::Release);
    hog.join().expect("the vCPU ran on");
    assert_eq!(s.reports().iter().map(|r| r.rescues).sum::<u64>(), 1);
}

/// A device's engine woken while an idle pCPU runs it, in a step the host then holds
/// off its core (here the thief's step sleeps, which the thread's clock tells as the
/// host would), runs again on its own pCPU once the thief puts it back. The engine was
/// in its step all along, held with the thief's thread, not waiting for a CPU: its wait
/// to run counts from the step's end, and the hold is nobody's wait.
#[test]
fn a_device_engine_woken_in_a_step_held_on_a_thiefs_thread_waits_only_from_its_end() {
    /// Spins its first step until the engine's first step has begun (on the idle pCPU,
    /// since this one is in the step), then idles until the end.
    struct Vcpu {
        engine: Arc<AtomicBool>,
        end: Arc<AtomicBool>,
    }
    impl Unit for Vcpu {
        type Output = ();
        fn step(&mut self, _cx: &Cx) -> Step<()> {
            if self.end.load(Ordering::Acquire) {
                return Step::Done(());
            }
            let t = Instant::now();
            while !self.engine.load(Ordering::Acquire) && t.elapsed() < Duration::from_secs(5) {
                std::hint::spin_loop();
            }
            Step::Idle(None)
        }
    }
    /// Its first step is woken again (new work arrives) and is then held 10 ms; its
    /// second ends it.
    struct Engine {
        waker: Option<Waker>,
        began: Arc<AtomicBool>,
        steps: u32,
    }
    impl Unit for Engine {
        type Output = u32;
        fn attach(&mut self, waker: &Waker, _stats: &Arc<hv::sched::UnitStats>) {
            self.waker = Some(waker.clone());
        }
        fn step(&mut self, _cx: &Cx) -> Step<u32> {
            self.steps += 1;
            if self.steps == 1 {
                self.began.store(true, Ordering::Release);
                self.waker.as_ref().expect("attached").wake();
                std::thread::sleep(Duration::from_millis(10));
                return Step::Idle(None);
            }
            Step::Done(self.steps)
        }
    }
    let s = Scheduler::new(&CpuPlan::floating(2, IdlePolicy::Poll), None).expect("sched");
    let (began, end) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let vcpu = s
        .place(
            0,
            // Pinned: a peer that finds the pCPU held does not take it instead.
            UnitSpec::named("vcpu"),
            Vcpu {
                engine: Arc::clone(&began),
                end: Arc::clone(&end),
            },
        )
        .expect("vcpu");
    let j = s
        .place(
            0,
            UnitSpec::device("nic"),
            Engine {
                waker: None,
                began,
                steps: 0,
            },
        )
        .expect("engine");
    let stats = Arc::clone(j.stats());
    assert_eq!(j.join(), Ok(2));
    end.store(true, Ordering::Release);
    vcpu.wake();
    vcpu.join().expect("vcpu");
    let r = stats.report();
    assert!(r.stolen >= 1, "the idle pCPU ran its first step: {r:?}");
    assert!(
        r.wakeups >= 1,
        "the wake-up in the step ran it again: {r:?}"
    );
    assert!(
        r.longest_wait < Duration::from_millis(3),
        "its wait counts from the held step's end, not through it: {r:?}"
    );
}

/// A pCPU whose thread the host holds off its core has its movable units (vCPUs) run by
/// an idle peer, and nothing else: two pCPUs pinned to one host core take the core in
/// turn (the host's time slices), so each is held while the other spins. The vCPU's
/// every wake-up is served, no two of its steps overlap, its turns elsewhere are
/// counted on both sides; of two woken at once, the one the peer leaves is not lost; the
/// unit placed as neither device nor vCPU stays home.
#[test]
fn a_vcpu_whose_pcpu_the_host_holds_runs_on_an_idle_peer_and_a_pinned_unit_does_not() {
    let plan = CpuPlan {
        cores: vec![Some(0), Some(0)],
        policy: IdlePolicy::Poll,
        own_policy: Vec::new(),
    };
    let s = Scheduler::new(&plan, None).expect("sched");
    let mut units = Vec::new();
    for spec in [
        UnitSpec::vcpu("guest-v0"),
        UnitSpec::vcpu("guest-v1"),
        UnitSpec::named("bound"),
    ] {
        let (work, done, overlaps, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let j = s
            .place(
                1,
                spec,
                Engine {
                    work: Arc::clone(&work),
                    done: Arc::clone(&done),
                    inside: Arc::new(AtomicBool::new(false)),
                    overlaps: Arc::clone(&overlaps),
                    end: Arc::clone(&stop),
                },
            )
            .expect("place");
        units.push((j, work, done, overlaps, stop));
    }
    // Wake-ups spread over many of the host's time slices (a few ms each).
    const N: u64 = 1500;
    for _ in 0..N {
        for (j, work, ..) in &units {
            work.fetch_add(1, Ordering::Release);
            j.wake();
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // Both vCPUs woken at once, once: whichever the peer does not run is seen by its own
    // pCPU (or the peer's next look), though no later wake-up comes to point at it.
    for round in 1..=20 {
        for (j, work, ..) in &units[..2] {
            work.fetch_add(1, Ordering::Release);
            j.wake();
        }
        wait_for("both vCPUs' single wake-up served", || {
            units[..2]
                .iter()
                .all(|(_, _, done, ..)| done.load(Ordering::Acquire) == N + round)
        });
    }
    for (j, work, ..) in &units[2..] {
        work.fetch_add(20, Ordering::Release);
        j.wake();
    }
    let covered = s.reports()[1].covered;
    for (k, (j, _, done, overlaps, stop)) in units.into_iter().enumerate() {
        wait_for("every wake-up's work taken", || {
            done.load(Ordering::Acquire) == N + 20
        });
        stop.store(true, Ordering::Release);
        j.wake();
        let stats = Arc::clone(j.stats());
        assert_eq!(j.join(), Ok(N + 20));
        let r = stats.report();
        assert_eq!(overlaps.load(Ordering::Relaxed), 0, "{r:?}");
        if k < 2 {
            assert!(r.stolen > 0, "the idle peer ran the vCPU: {r:?}");
        } else {
            assert_eq!(r.stolen, 0, "a unit that may not move stays: {r:?}");
        }
    }
    assert!(covered > 0, "pCPU 1 counts the turns its peer ran for it");
}

/// A unit whose one step spins for `wall`, then ends.
struct Spinner {
    wall: Duration,
}

impl Unit for Spinner {
    type Output = ();
    fn step(&mut self, _cx: &Cx) -> Step<()> {
        let t = Instant::now();
        while t.elapsed() < self.wall {
            std::hint::spin_loop();
        }
        Step::Done(())
    }
}

/// The host's long holds of a pCPU's thread are kept with their times, in a step and
/// between the idle loop's looks: two pCPUs pinned to one host core share it, so that
/// while one spins in a 60 ms step the host's time slices hold it for the other's idle
/// spin, and that one for the step.
#[test]
fn the_hosts_long_holds_of_a_pcpu_are_kept_with_their_times_in_a_step_and_idle() {
    let plan = CpuPlan {
        cores: vec![Some(0), Some(0)],
        policy: IdlePolicy::Poll,
        own_policy: Vec::new(),
    };
    let s = Scheduler::new(&plan, None).expect("sched");
    // Both threads spinning on the core first, so that the step below shares it.
    std::thread::sleep(Duration::from_millis(20));
    let wall = Duration::from_millis(60);
    let t0 = Instant::now();
    let j = s
        .place(1, UnitSpec::named("spinner"), Spinner { wall })
        .expect("place");
    assert_eq!(j.join(), Ok(()));
    let t1 = Instant::now();
    let holds = s.host_holds();
    let in_step: Vec<_> = holds.iter().filter(|h| h.pcpu == 1 && h.in_step).collect();
    assert_eq!(in_step.len(), 1, "{holds:?}");
    let h = in_step[0];
    assert!(t0 <= h.from && h.to <= t1, "{h:?}");
    assert!(h.to - h.from >= wall, "{h:?}");
    // The idle pCPU had its share of the core meanwhile, so the step had at most the
    // rest; the host held it for the remainder, which is no more than its span.
    assert!(h.held >= Duration::from_millis(10), "{h:?}");
    assert!(h.held <= h.to - h.from, "{h:?}");
    assert!(
        holds
            .iter()
            .any(|h| h.pcpu == 0 && !h.in_step && h.from >= t0 && h.to <= t1),
        "the idle pCPU's gaps while the step had the core: {holds:?}"
    );
}

/// A device's engine woken on a pCPU whose only other unit is a vCPU of weight 4 (four
/// steps a turn) waits for the vCPU's step to end, not for the rest of its turn: its
/// waits stay within about one step, where the turn is four. The vCPU's turn resumes
/// after the engine's step, so it keeps running.
#[test]
fn a_device_engine_waits_for_a_weighted_vcpus_step_not_its_whole_turn() {
    const STEP: Duration = Duration::from_micros(400);
    let s = one_pcpu(IdlePolicy::Poll);
    let (steps, end) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let vcpu = Hog {
        step: STEP,
        steps: None,
        end: Arc::clone(&end),
        took: Arc::clone(&steps),
    };
    let spec = UnitSpec {
        weight: 4,
        ..UnitSpec::named("vcpu")
    };
    let v = s.place(0, spec, vcpu).expect("vcpu");
    let (j, work, done, stop) = place_engine(&s);
    const N: u64 = 200;
    for k in 1..=N {
        work.fetch_add(1, Ordering::Release);
        j.wake();
        // Wake-ups at every point of the vCPU's turn (1.6 ms): 0.5 to 2.6 ms apart.
        std::thread::sleep(Duration::from_micros(500 + (k * 700) % 2100));
    }
    wait_for("every wake-up's work taken", || {
        done.load(Ordering::Acquire) == N
    });
    stop.store(true, Ordering::Release);
    j.wake();
    let stats = Arc::clone(j.stats());
    assert_eq!(j.join(), Ok(N));
    end.store(true, Ordering::Release);
    v.join().expect("vcpu");
    let r = stats.report();
    // Run to the end of its turn, the engine's waits would spread over 0-1.6 ms.
    assert!(
        r.wait_p99_net < STEP * 2,
        "the engine waits for a step, not a turn: {r:?}"
    );
    assert!(
        steps.load(Ordering::Relaxed) > N,
        "the vCPU ran meanwhile: {} steps",
        steps.load(Ordering::Relaxed)
    );
}

/// An engine woken again and again goes ahead of the round only every other pick: a
/// vCPU on its pCPU keeps taking steps.
#[test]
fn an_engine_woken_without_pause_does_not_keep_a_vcpu_off_its_pcpu() {
    let s = one_pcpu(IdlePolicy::Poll);
    let (steps, end) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let vcpu = Hog {
        step: Duration::from_micros(20),
        steps: None,
        end: Arc::clone(&end),
        took: Arc::clone(&steps),
    };
    let v = s.place(0, UnitSpec::named("vcpu"), vcpu).expect("vcpu");
    let (j, work, _done, stop) = place_engine(&s);
    let t = Instant::now();
    let before = steps.load(Ordering::Relaxed);
    while t.elapsed() < Duration::from_millis(100) {
        work.fetch_add(1, Ordering::Release);
        j.wake();
    }
    let during = steps.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Release);
    j.wake();
    let _ = j.join();
    end.store(true, Ordering::Release);
    v.join().expect("vcpu");
    // 100 ms of 20 µs steps, each turn of the vCPU beside at most one of the engine's.
    assert!(during >= 500, "the vCPU took {during} steps in 100 ms");
}
