//! The domain's event channels read on a pCPU of the back end's, as Linux's upcall
//! handler reads its pending ports on the CPU the interrupt came to and runs each port's
//! handler there.
//!
//! One descriptor (`/dev/xen/evtchn`) carries every port the process bound. The upcall
//! is a unit of pvio's scheduler whose interrupt line is that descriptor: a step reads
//! the ports that fired, wakes each one's device unit (a vif, a vbd queue) and unmasks
//! the port. On a pCPU shared with those units the wake is a bit set, and the device's
//! step follows on the same thread: a guest's notification reaches its ring's code
//! through one host thread's wake-up, not two. Before, the main thread read the ports
//! and woke the pCPU's thread, a second switch on a domain of one vCPU (dom0's under
//! the interop run), where every switch under TCG also changes address space.
//!
//! The main thread only watches the store. Whenever it places or takes back devices it
//! gives the upcall a fresh table ([`Upcall::reroute`]), and if the table changed it
//! wakes every routed unit once: a port that fired while its unit was not yet routed
//! was unmasked and dropped, and the unit's step then finds what the guest put on its
//! ring anyway.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hv::sched::{
    Cx, IrqLine, SchedError, Scheduler, Step, Unit, UnitJoin, UnitSpec, UnitStats, Waker,
};

use crate::vif::lock;

/// Ports read per step (a full read steps again: the device may hold more).
const PORTS_PER_STEP: usize = 64;

/// Where the ports that fired are read from: the event-channel device.
pub(crate) trait Ports: Send + Sync + 'static {
    /// The descriptor that is readable while a port is pending.
    fn fd(&self) -> RawFd;
    /// The ports that fired, without waiting (0 if none).
    fn pending(&self, ports: &mut [u32]) -> io::Result<usize>;
    /// Lets `port` fire again.
    fn unmask(&self, port: u32) -> io::Result<()>;
}

impl Ports for Arc<hv::xen::Dom0> {
    fn fd(&self) -> RawFd {
        self.evtchn().as_raw_fd()
    }

    fn pending(&self, ports: &mut [u32]) -> io::Result<usize> {
        match self.evtchn().pending(ports) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            r => r,
        }
    }

    fn unmask(&self, port: u32) -> io::Result<()> {
        self.evtchn().unmask(port)
    }
}

/// One port's device unit: what a notification on it wakes.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub port: u32,
    /// Set before the wake (a vif's "the guest notified"), if the unit has one.
    pub flag: Option<Arc<AtomicBool>>,
    pub waker: Waker,
    /// Which placement of a unit it is (its stats' address): a table that names the
    /// same ports for new units has changed.
    pub unit: usize,
}

impl Route {
    fn fire(&self) {
        if let Some(f) = &self.flag {
            f.store(true, Ordering::Release);
        }
        self.waker.wake();
    }

    /// Port `port` routed to the unit `waker` wakes, placed with `stats` (one `Arc` a
    /// placement, which names it), setting `flag` first if given.
    pub(crate) fn new(
        port: u32,
        flag: Option<Arc<AtomicBool>>,
        waker: &Waker,
        stats: &Arc<UnitStats>,
    ) -> Self {
        Self {
            port,
            flag,
            waker: waker.clone(),
            unit: Arc::as_ptr(stats) as usize,
        }
    }
}

/// What the upcall counted.
#[derive(Debug, Default)]
pub(crate) struct UpcallCounts {
    /// Ports read from the device.
    pub fired: AtomicU64,
    /// Ports that fired with no unit routed (a device being connected or taken back).
    pub unrouted: AtomicU64,
    /// Reads or unmasks the device refused.
    pub errors: AtomicU64,
}

struct Shared {
    routes: Mutex<Vec<Route>>,
    leave: AtomicBool,
    counts: UpcallCounts,
}

struct UpcallUnit<P: Ports> {
    ports: P,
    shared: Arc<Shared>,
    waker: Option<Waker>,
    line: Option<IrqLine>,
}

impl<P: Ports> Unit for UpcallUnit<P> {
    type Output = ();

    fn attach(&mut self, waker: &Waker, _stats: &Arc<UnitStats>) {
        self.waker = Some(waker.clone());
    }

    fn step(&mut self, _cx: &Cx) -> Step<()> {
        if self.shared.leave.load(Ordering::Acquire) {
            return Step::Done(());
        }
        if self.line.is_none() {
            if let Some(w) = &self.waker {
                match w.irq_line(self.ports.fd()) {
                    Ok(l) => self.line = Some(l),
                    Err(_) => {
                        self.shared.counts.errors.fetch_add(1, Ordering::Relaxed);
                        return Step::Done(());
                    }
                }
            }
        }
        let c = &self.shared.counts;
        let mut fired = [0u32; PORTS_PER_STEP];
        let n = match self.ports.pending(&mut fired) {
            Ok(n) => n,
            Err(_) => {
                c.errors.fetch_add(1, Ordering::Relaxed);
                0
            }
        };
        if n > 0 {
            c.fired.fetch_add(n as u64, Ordering::Relaxed);
            let routes = lock(&self.shared.routes);
            for &p in &fired[..n] {
                let mut routed = false;
                for r in routes.iter().filter(|r| r.port == p) {
                    r.fire();
                    routed = true;
                }
                if !routed {
                    c.unrouted.fetch_add(1, Ordering::Relaxed);
                }
            }
            drop(routes);
            // After the wakes: a port that fires again meanwhile is read next step, and
            // its unit looks at its rings anyway.
            for &p in &fired[..n] {
                if self.ports.unmask(p).is_err() {
                    c.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if n == fired.len() {
            return Step::More;
        }
        if let Some(l) = &self.line {
            l.arm();
        }
        Step::Idle(None)
    }
}

/// The upcall placed on a pCPU, and its routing table.
pub(crate) struct Upcall {
    shared: Arc<Shared>,
    join: UnitJoin<()>,
}

impl Upcall {
    /// Places the upcall reading `ports` on pCPU `pcpu`.
    pub(crate) fn place<P: Ports>(
        sched: &Scheduler,
        pcpu: usize,
        ports: P,
    ) -> Result<Self, SchedError> {
        let shared = Arc::new(Shared {
            routes: Mutex::new(Vec::new()),
            leave: AtomicBool::new(false),
            counts: UpcallCounts::default(),
        });
        let join = sched.place(
            pcpu,
            UnitSpec::named("upcall"),
            UpcallUnit {
                ports,
                shared: Arc::clone(&shared),
                waker: None,
                line: None,
            },
        )?;
        Ok(Self { shared, join })
    }

    /// Routes the ports to `routes` from now on. If they changed (a port added, gone,
    /// or now another unit's), every unit in the new table is woken once, for what
    /// fired before it was routed. Returns whether they changed.
    pub(crate) fn reroute(&self, mut routes: Vec<Route>) -> bool {
        routes.sort_by_key(|r| (r.port, r.unit));
        let mut t = lock(&self.shared.routes);
        let same = t.len() == routes.len()
            && t.iter()
                .zip(&routes)
                .all(|(a, b)| a.port == b.port && a.unit == b.unit);
        if same {
            return false;
        }
        *t = routes;
        for r in t.iter() {
            r.fire();
        }
        true
    }

    /// Whether the unit ended on its own (it could not watch the device): no port is
    /// read any more.
    pub(crate) fn ended(&self) -> bool {
        self.join.is_finished()
    }

    /// What it counted.
    pub(crate) fn counts(&self) -> &UpcallCounts {
        &self.shared.counts
    }

    /// Ends the unit (its line off the pCPU) and waits for it.
    pub(crate) fn stop(self) {
        self.shared.leave.store(true, Ordering::Release);
        self.join.wake();
        let _ = self.join.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hv::sched::{CpuPlan, IdlePolicy};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;
    use std::time::Duration;

    /// An event-channel device stood in for by a socket: a test writes the ports that
    /// fire into one end; the upcall reads them from the other and unmasks into a list.
    struct FakePorts {
        rx: Mutex<UnixStream>,
        fd: RawFd,
        unmasked: Arc<Mutex<Vec<u32>>>,
    }

    impl Ports for FakePorts {
        fn fd(&self) -> RawFd {
            self.fd
        }
        fn pending(&self, ports: &mut [u32]) -> io::Result<usize> {
            let mut b = [0u8; 4 * PORTS_PER_STEP];
            let want = ports.len().min(PORTS_PER_STEP) * 4;
            let n = match lock(&self.rx).read(&mut b[..want]) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                Err(e) => return Err(e),
            };
            for (p, c) in ports.iter_mut().zip(b[..n].chunks_exact(4)) {
                *p = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
            }
            Ok(n / 4)
        }
        fn unmask(&self, port: u32) -> io::Result<()> {
            lock(&self.unmasked).push(port);
            Ok(())
        }
    }

    fn fake() -> (FakePorts, UnixStream, Arc<Mutex<Vec<u32>>>) {
        let (tx, rx) = UnixStream::pair().expect("socket pair");
        rx.set_nonblocking(true).expect("non-blocking");
        let unmasked = Arc::new(Mutex::new(Vec::new()));
        let fd = rx.as_raw_fd();
        (
            FakePorts {
                rx: Mutex::new(rx),
                fd,
                unmasked: Arc::clone(&unmasked),
            },
            tx,
            unmasked,
        )
    }

    /// A device unit that reports each step that finds its flag set.
    struct Device {
        flag: Arc<AtomicBool>,
        steps: mpsc::Sender<()>,
    }

    impl Unit for Device {
        type Output = ();
        fn step(&mut self, _cx: &Cx) -> Step<()> {
            if self.flag.swap(false, Ordering::AcqRel) {
                let _ = self.steps.send(());
            }
            Step::Idle(None)
        }
    }

    fn one_pcpu() -> Arc<Scheduler> {
        Scheduler::new(&CpuPlan::floating(1, IdlePolicy::Block), None).expect("scheduler")
    }

    fn device(s: &Scheduler, port: u32) -> (Route, UnitJoin<()>, mpsc::Receiver<()>) {
        let flag = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let join = s
            .place(
                0,
                UnitSpec::named(format!("dev{port}")),
                Device {
                    flag: Arc::clone(&flag),
                    steps: tx,
                },
            )
            .expect("placed");
        let r = Route::new(port, Some(flag), join.waker(), join.stats());
        (r, join, rx)
    }

    const WAIT: Duration = Duration::from_secs(10);

    /// The ports unmasked once there are `n` (or after [`WAIT`]).
    fn unmasked_when(unmasked: &Mutex<Vec<u32>>, n: usize) -> Vec<u32> {
        let t0 = std::time::Instant::now();
        while lock(unmasked).len() < n && t0.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        lock(unmasked).clone()
    }

    fn no_more(rx: &mpsc::Receiver<()>) -> bool {
        rx.recv_timeout(Duration::from_millis(50)).is_err()
    }

    #[test]
    fn a_port_that_fires_wakes_its_unit_on_the_same_pcpu_and_is_unmasked() {
        let s = one_pcpu();
        let (ports, mut tx, unmasked) = fake();
        let up = Upcall::place(&s, 0, ports).expect("upcall");
        let (r5, _j5, rx5) = device(&s, 5);
        let (r9, _j9, rx9) = device(&s, 9);
        assert!(up.reroute(vec![r9, r5]));
        // The reroute woke both once.
        rx5.recv_timeout(WAIT).expect("woken by the new table");
        rx9.recv_timeout(WAIT).expect("woken by the new table");
        tx.write_all(&5u32.to_ne_bytes()).expect("fire");
        rx5.recv_timeout(WAIT).expect("port 5 wakes its unit");
        assert!(no_more(&rx9), "port 9 did not fire");
        tx.write_all(&9u32.to_ne_bytes()).expect("fire");
        rx9.recv_timeout(WAIT).expect("port 9 wakes its unit");
        assert_eq!(unmasked_when(&unmasked, 2), vec![5, 9]);
        assert_eq!(up.counts().fired.load(Ordering::Relaxed), 2);
        assert_eq!(up.counts().unrouted.load(Ordering::Relaxed), 0);
        up.stop();
        s.stop(Duration::from_secs(1));
    }

    #[test]
    fn a_port_with_no_unit_is_counted_and_unmasked_and_the_same_table_wakes_no_one() {
        let s = one_pcpu();
        let (ports, mut tx, unmasked) = fake();
        let up = Upcall::place(&s, 0, ports).expect("upcall");
        let (r5, _j5, rx5) = device(&s, 5);
        assert!(up.reroute(vec![r5.clone()]));
        rx5.recv_timeout(WAIT).expect("woken by the new table");
        assert!(!up.reroute(vec![r5.clone()]), "the same table");
        assert!(no_more(&rx5), "an unchanged table wakes no one");
        // The same port now another placement's: changed, the new unit woken.
        let (r5b, _j5b, rx5b) = device(&s, 5);
        assert!(up.reroute(vec![r5b]));
        rx5b.recv_timeout(WAIT).expect("the port's new unit woken");
        tx.write_all(&77u32.to_ne_bytes()).expect("fire");
        assert_eq!(
            unmasked_when(&unmasked, 1),
            vec![77],
            "left masked, it would never fire again"
        );
        assert_eq!(up.counts().unrouted.load(Ordering::Relaxed), 1);
        assert!(no_more(&rx5b));
        up.stop();
        s.stop(Duration::from_secs(1));
    }

    #[test]
    fn more_ports_than_one_read_are_all_taken() {
        let s = one_pcpu();
        let (ports, mut tx, unmasked) = fake();
        let up = Upcall::place(&s, 0, ports).expect("upcall");
        let n = PORTS_PER_STEP as u32 * 2 + 3;
        let mut b = Vec::new();
        for p in 0..n {
            b.extend_from_slice(&(100 + p).to_ne_bytes());
        }
        tx.write_all(&b).expect("fire");
        assert_eq!(
            unmasked_when(&unmasked, n as usize),
            (100..100 + n).collect::<Vec<_>>()
        );
        up.stop();
        s.stop(Duration::from_secs(1));
    }
}
