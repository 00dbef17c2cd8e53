//! The machines of paper 000's receive experiments, assembled and running.
//!
//! Three configurations, chosen by name:
//! * `native`: one domain runs the NIC driver (`pci-nommu` DMA), the stack and the
//!   application; the NIC's interrupt wakes it directly and it idles by halting, so no
//!   hypervisor code is on its path;
//! * `direct`: the NIC is assigned to the guest — its DMA goes through the guest's IOMMU
//!   context, its interrupt arrives as an event from the hypervisor, the guest kernel's
//!   DMA interface is `swiotlb` and it idles by blocking in the hypervisor;
//! * `pv`: a driver domain runs the NIC driver, the bridge (with or without its netfilter
//!   hooks) and netback; the guest runs netfront, the stack and the application. The two
//!   domains' vCPUs are on different cores, as in the paper.
//!
//! The NIC's far end is the paced sender ([`dev::wire::PacedSender`]). Each domain's
//! kernel is a loop on its vCPU thread: take events, run the NAPI poll or netfront, run
//! netback, then the application's `recv` loop; idle, wait.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dev::driver::{DmaApi, NicDriver};
use dev::irq::{IrqLine, NativeIrq};
use dev::nic::{Coalesce, Nic};
use dev::tap::TapPort;
use dev::wire::{CountingSink, PacedSender, SenderCounters, WireSink, WireSource};
use hv::profile::{enter, Class, ClassSamples};
use hv::{
    DeviceId, Domain, DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor, Vcpu, VcpuStart,
    Vector, Virq, WaitMode,
};
use net::bridge::{Bridge, Forward};
use net::netback::{self, Vif, VIF_WINDOW_SLOTS};
use net::netfront::{Netfront, RxBuffers};
use net::skb::SkbPool;
use net::stack::{SocketId, Stack, UserBuf, DEFAULT_RCVBUF};
use net::wire::{UdpFlow, DEFAULT_MTU};
use smoltcp::wire::Ipv4Address;

use crate::LabError;

/// Which machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Config {
    /// Linux without a hypervisor.
    Native,
    /// A guest with the NIC assigned.
    Direct,
    /// Driver domain and paravirtual guest.
    Pv,
}

impl Config {
    /// Every configuration, in the paper's order.
    pub const ALL: [Config; 3] = [Config::Native, Config::Direct, Config::Pv];
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Config::Native => "native",
            Config::Direct => "direct",
            Config::Pv => "pv",
        }
    }
    /// By name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == s)
    }
}

/// How to build and drive the machine.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// The configuration.
    pub config: Config,
    /// UDP payload bytes per message.
    pub message: usize,
    /// Frames per second on the wire.
    pub rate: f64,
    /// The NIC's interrupt coalescing.
    pub coalesce: Coalesce,
    /// Bridge netfilter hooks on (pv only).
    pub netfilter: bool,
    /// Grant-table layout.
    pub grant_version: GrantVersion,
    /// Grant implementation.
    pub grant_path: GrantPath,
    /// Profiler sampling interval (none: no sampling).
    pub sample: Option<Duration>,
    /// What netfront posts (pv only): page fragments (the original) or linear buffers
    /// (the paper's netfront without fragments, §3.4.2).
    pub rx_buffers: RxBuffers,
}

/// The frame rate of a saturated 1 Gbit/s link with 1514-byte frames (plus preamble,
/// frame check and inter-frame gap: 1538 bytes on the wire).
pub const GIGABIT_FULL_FRAME_PPS: f64 = 1e9 / (1538.0 * 8.0);

impl Options {
    /// The paper's set-up for `config` and `message`: the original implementation
    /// (v1 grants, original grant path), netfilter hooks on, 6 packets / 18 µs.
    pub fn paper(config: Config, message: usize) -> Self {
        Self {
            config,
            message,
            rate: GIGABIT_FULL_FRAME_PPS,
            coalesce: Coalesce::default(),
            netfilter: true,
            grant_version: GrantVersion::V1,
            grant_path: GrantPath::Original,
            sample: Some(hv::profile::DEFAULT_SAMPLE_INTERVAL),
            rx_buffers: RxBuffers::Fragments,
        }
    }
}

/// How late the sender's device thread may be before it skips whole messages instead
/// of bursting them: 2 ms is 163 full-size frames at the paper's rate, well inside the
/// NIC's 1024 descriptors, and far beyond the thread's usual wake-up jitter.
pub const STALL_HORIZON: Duration = Duration::from_millis(2);

/// The flow the sender sends.
pub fn flow() -> UdpFlow {
    UdpFlow {
        src_mac: [0x02, 0, 0, 0, 0, 0x01],
        dst_mac: [0x02, 0, 0, 0, 0, 0x10],
        src_ip: Ipv4Address::new(10, 0, 0, 1),
        dst_ip: Ipv4Address::new(10, 0, 0, 2),
        src_port: 5001,
        dst_port: 5002,
        mtu: DEFAULT_MTU,
    }
}

/// What the application saw.
#[derive(Debug, Default)]
pub struct AppCounters {
    /// Messages received.
    pub messages: AtomicU64,
    /// Bytes received.
    pub bytes: AtomicU64,
    /// Messages whose length or content was not what the sender sent.
    pub corrupt: AtomicU64,
}

/// A domain's CPU use at one instant.
#[derive(Debug, Clone)]
pub struct DomainSnapshot {
    /// Exact CPU time of its vCPUs.
    pub cpu: Duration,
    /// Profiler samples per class.
    pub samples: ClassSamples,
}

/// The machine's counters at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// When.
    pub at: Instant,
    /// Per domain: (name, driver domain?, use).
    pub domains: Vec<(String, bool, DomainSnapshot)>,
    /// Frames the sender put on the wire.
    pub frames_sent: u64,
    /// Messages the application received.
    pub messages: u64,
}

/// Final per-component counters, for the loss account.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Counters {
    /// (component, counter, value), nonzero drop counters and totals.
    pub entries: Vec<(String, String, u64)>,
}

impl Counters {
    fn add(&mut self, comp: &str, name: &str, v: u64) {
        self.entries.push((comp.into(), name.into(), v));
    }
    /// A counter's value (0 if absent).
    pub fn get(&self, comp: &str, name: &str) -> u64 {
        self.entries
            .iter()
            .filter(|(c, n, _)| c == comp && n == name)
            .map(|e| e.2)
            .sum()
    }
}

/// A running machine.
#[derive(Debug)]
pub struct Running {
    /// The hypervisor.
    pub hv: Arc<Hypervisor>,
    /// Options it was built with.
    pub opts: Options,
    domains: Vec<Arc<Domain>>,
    nic: Option<Nic>,
    sender: Arc<SenderCounters>,
    frames_per_message: usize,
    app: Arc<AppCounters>,
    stop: Arc<AtomicBool>,
    kernels: Vec<(Arc<Domain>, JoinHandle<Counters>)>,
    native_irq: Option<Arc<NativeIrq>>,
}

const NIC: DeviceId = DeviceId(1);
const NIC_VECTOR: Vector = Vector(40);
const POOL_BUFFERS: usize = 3072;
const POOL_PAGES: usize = 640;
const DOMAIN_PAGES: u32 = 8192;
const NAPI_BUDGET: usize = 64;

fn other(e: impl std::fmt::Display) -> LabError {
    LabError::Other(e.to_string())
}

/// The receiving application: `recv` until the socket is empty, checking each message
/// against what the sender sends (two bytes and the length).
struct App {
    sock: SocketId,
    buf: UserBuf,
    message: usize,
    counters: Arc<AppCounters>,
}

impl App {
    /// A kernel's stack for `dom` with the application's socket bound to the flow's
    /// destination, and the application with its user buffer.
    fn bind(
        dom: &Arc<Domain>,
        f: UdpFlow,
        message: usize,
        counters: &Arc<AppCounters>,
    ) -> Result<(Stack, Self), LabError> {
        let mut stack = Stack::new(f.dst_ip, f.dst_mac);
        let sock = stack
            .bind_udp(f.dst_port, DEFAULT_RCVBUF)
            .ok_or_else(|| other("bind"))?;
        let app = App {
            sock,
            buf: UserBuf::new(dom, 65536).map_err(other)?,
            message,
            counters: Arc::clone(counters),
        };
        Ok((stack, app))
    }

    fn run(&mut self, stack: &mut Stack, pool: &mut SkbPool) -> usize {
        let mut n = 0;
        while let Ok(Some(r)) = stack.recv(pool, self.sock, &self.buf) {
            let _u = enter(Class::User);
            let mut head = [0u8; 2];
            let ok = r.len == self.message
                && (self.message < 2
                    || (self.buf.read(pool.domain(), 0, &mut head).is_ok()
                        && head[1] == head[0].wrapping_add(31)));
            if !ok {
                self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
            }
            self.counters.messages.fetch_add(1, Ordering::Relaxed);
            self.counters
                .bytes
                .fetch_add(r.len as u64, Ordering::Relaxed);
            n += 1;
        }
        n
    }
}

/// The guest kernel of a plumbed machine: netfront's received frames go to the TAP
/// (the guest's stack), frames from the TAP go out through netfront.
#[allow(clippy::too_many_arguments)]
fn guest_on_tap(
    hv: &Arc<Hypervisor>,
    guest: &Arc<Domain>,
    start: VcpuStart,
    mut tap: TapPort,
    mut front: Netfront,
    mut gpool: SkbPool,
    stop: Arc<AtomicBool>,
    ready: Arc<std::sync::atomic::AtomicUsize>,
) -> Result<JoinHandle<Counters>, LabError> {
    let (h, g) = (Arc::clone(hv), Arc::clone(guest));
    tap.set_wake(move || h.kick_vcpu(&g, 0));
    hv.start_vcpu(guest, start, move |v: Vcpu| {
        // One frame's bytes on their way to the TAP: netfront's buffers are a head
        // and page fragments, a write wants one slice.
        let mut scratch = vec![0u8; 65536];
        let mut tx_dropped = 0u64;
        ready.fetch_add(1, Ordering::Release);
        while !stop.load(Ordering::Acquire) {
            v.handle_events(|_| {});
            let mut work = front.poll_rx(&mut gpool, NAPI_BUDGET, |pool, skb| {
                let len = pool.len(skb).min(scratch.len());
                if pool.read(skb, 0, &mut scratch[..len]).is_ok() {
                    tap.send(&scratch[..len]);
                }
                pool.free(skb);
            });
            // A frame netfront cannot take yet (its ring or the pool is full) waits in
            // the TAP's queue: the stack behind it is held back, not dropped on.
            work += tap.recv(|frame| {
                // A head of its own page, which netfront grants as it is (a shared
                // 2 KiB head would be copied to one first).
                let Ok(skb) = gpool.alloc_page_linear() else {
                    return false;
                };
                if gpool.put(skb, frame).is_err() {
                    gpool.free(skb);
                    tx_dropped += 1;
                    return true;
                }
                match front.xmit(&mut gpool, skb) {
                    Ok(()) => true,
                    Err(s) => {
                        gpool.free(s);
                        false
                    }
                }
            });
            work += front.poll_tx(&mut gpool);
            if work == 0 {
                v.wait();
            }
        }
        let mut c = Counters::default();
        let s = front.stats();
        c.add("netfront", "rx_packets", s.rx_packets);
        c.add("netfront", "rx_errors", s.rx_errors.iter().sum());
        c.add("guest", "tx_dropped", tx_dropped);
        let t = tap.counters();
        c.add(
            "guest tap",
            "frames_in",
            t.frames_in.load(Ordering::Relaxed),
        );
        c.add(
            "guest tap",
            "frames_out",
            t.frames_out.load(Ordering::Relaxed),
        );
        c.add(
            "guest tap",
            "oversize_in",
            t.oversize_in.load(Ordering::Relaxed),
        );
        c
    })
    .map_err(other)
}

/// A Xen kernel's handling of a physical interrupt's event, as 2.6.18-xen's `ack_pirq`
/// and `end_pirq` do it: the port is masked while `handler` runs, then unmasked, and the
/// hypervisor is told that the interrupt has ended (`PHYSDEVOP_eoi`), which unmasks the
/// line it masked when it delivered the interrupt. The port is the kernel's own pirq,
/// so none of the calls can fail.
fn xen_pirq(v: &Vcpu, port: hv::Port, handler: impl FnOnce()) {
    {
        let _i = enter(Class::Interrupt);
        let _ = v.domain().evtchn_mask(port);
    }
    handler();
    let _h = enter(Class::Hypercall);
    let _ = v.hv().evtchn_unmask(v.domain(), port);
    let _ = v.hv().pirq_eoi(v.domain(), port);
}

/// A guest kernel's view of its one-shot timer: what it last asked for, so that it
/// programs the timer (a hypercall under Xen, the local APIC natively) only when the
/// deadline it needs changes.
#[derive(Debug, Default)]
struct KernelTimer {
    armed: Option<Duration>,
}

impl KernelTimer {
    /// Asks for `want`, calling `program` if it differs from what is armed.
    fn arm(&mut self, want: Option<Duration>, program: impl FnOnce(Option<Duration>)) {
        if want != self.armed {
            program(want);
            self.armed = want;
        }
    }
    /// A Xen kernel going idle, as 2.6.18-xen's `stop_hz_timer`: it programs the
    /// one-shot timer for its next timer event (`VCPUOP_set_singleshot_timer`, or stops
    /// it when there is none) at every idle entry, whether or not the deadline changed.
    fn xen_idle(&mut self, want: Option<Duration>, v: &Vcpu) {
        v.set_timer(want);
        self.armed = want;
    }
    /// A native kernel's check of its local timer at interrupt time; the clock is read
    /// only when the timer is armed.
    fn native_expired(&self, now: impl FnOnce() -> Duration) -> bool {
        self.armed.is_some_and(|d| now() >= d)
    }
}

/// Real interfaces for a `pv` machine (`pvio up`): the NIC's cable on one TAP instead
/// of the paced sender, and the guest's received frames handed to another TAP (whose
/// network namespace's Linux stack is the guest's stack) instead of pvio's stack and
/// application. Frames the guest's stack sends go out through netfront.
#[derive(Debug)]
pub struct Plumbing {
    /// The NIC's far end.
    pub wire: TapPort,
    /// The guest's stack.
    pub guest: TapPort,
}

impl Running {
    /// Builds the machine for `opts` and starts it: domains, NIC, drivers, vCPUs, and
    /// the sender.
    pub fn start(opts: Options) -> Result<Self, LabError> {
        Self::start_with(opts, None)
    }

    /// As [`Running::start`], with real interfaces on a `pv` machine.
    pub fn start_with(opts: Options, plumbing: Option<Plumbing>) -> Result<Self, LabError> {
        if plumbing.is_some() && opts.config != Config::Pv {
            return Err(other("real interfaces need the pv configuration"));
        }
        let cores = mem::cpu::online_cores();
        let core = |i: usize| (cores > i).then_some(i);
        let hv = Hypervisor::new(HvConfig {
            frames: DOMAIN_PAGES * 3 + 1024,
            grant_path: opts.grant_path,
        })?;
        let mk = |name: &str, driver: bool, slots: u32| {
            hv.create_domain(&DomainConfig {
                name: name.into(),
                pages: DOMAIN_PAGES,
                grant_frames: 4,
                grant_version: opts.grant_version,
                vcpus: 1,
                map_slots: slots,
                driver_domain: driver,
            })
        };
        let stop = Arc::new(AtomicBool::new(false));
        let ready = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let app = Arc::new(AppCounters::default());
        let f = flow();
        let sender = PacedSender::new(f, opts.message, opts.rate, None)
            .map_err(other)?
            .skip_after_stall(STALL_HORIZON);
        let sender_counters = Arc::clone(sender.counters());
        let fpm = sender.frames_per_message();
        let sink = CountingSink::default();
        let start = |core: Option<usize>| VcpuStart {
            vcpu: 0,
            core,
            mode: WaitMode::Blocking,
            sample: opts.sample,
        };
        let mut kernels = Vec::new();
        let mut domains = Vec::new();
        let mut native_irq = None;

        let nic;
        match opts.config {
            Config::Native | Config::Direct => {
                let native = opts.config == Config::Native;
                let dom = mk(if native { "native" } else { "guest" }, native, 4)?;
                hv.iommu_attach(NIC, &dom).map_err(other)?;
                let (irq, port) = if native {
                    let n = Arc::new(NativeIrq::default());
                    native_irq = Some(Arc::clone(&n));
                    (IrqLine::Native(n), None)
                } else {
                    let p = hv.bind_irq(&dom, NIC_VECTOR).map_err(other)?;
                    (
                        IrqLine::Hypervisor {
                            hv: Arc::clone(&hv),
                            vector: NIC_VECTOR,
                        },
                        Some(p),
                    )
                };
                nic = Nic::start(
                    &hv,
                    NIC,
                    irq,
                    opts.coalesce,
                    Box::new(sender),
                    Box::new(sink),
                )
                .map_err(other)?;
                let mut pool =
                    SkbPool::new(Arc::clone(&dom), POOL_BUFFERS, POOL_PAGES).map_err(other)?;
                let dma = if native {
                    DmaApi::Direct
                } else {
                    DmaApi::Swiotlb
                };
                let mut drv =
                    NicDriver::probe(&hv, &dom, nic.regs(), &mut pool, dma).map_err(other)?;
                let (mut stack, mut app_) = App::bind(&dom, f, opts.message, &app)?;
                let (stop_, nirq, ready_) =
                    (Arc::clone(&stop), native_irq.clone(), Arc::clone(&ready));
                let h = hv
                    .start_vcpu(&dom, start(core(1)), move |v: Vcpu| {
                        let tport = if nirq.is_none() {
                            v.hv().bind_virq(v.domain(), Virq::Timer, v.id()).ok()
                        } else {
                            None
                        };
                        if let Some(n) = &nirq {
                            n.route_here();
                        }
                        let clock = |v: &Vcpu| {
                            let _t = enter(Class::Time);
                            nirq.as_ref().map_or_else(|| v.system_time(), |n| n.now())
                        };
                        let mut timer = KernelTimer::default();
                        ready_.fetch_add(1, Ordering::Release);
                        while !stop_.load(Ordering::Acquire) {
                            let mut expired = false;
                            match (&nirq, port) {
                                (Some(n), _) => {
                                    if n.ack() {
                                        drv.interrupt();
                                    }
                                    expired = timer.native_expired(|| clock(&v));
                                }
                                (None, Some(p)) => {
                                    v.handle_events(|q| {
                                        if q == p {
                                            xen_pirq(&v, p, || drv.interrupt());
                                        } else if Some(q) == tport {
                                            expired = true;
                                        }
                                    });
                                }
                                _ => {}
                            }
                            let now = clock(&v);
                            if expired {
                                timer.armed = None;
                                stack.tick(&mut pool, now);
                            }
                            let mut work = 0;
                            if drv.napi_scheduled() {
                                work += drv.poll(&mut pool, NAPI_BUDGET, |pool, skb| {
                                    stack.input(pool, skb, now)
                                });
                            }
                            work += app_.run(&mut stack, &mut pool);
                            if work == 0 && !drv.napi_scheduled() {
                                match &nirq {
                                    Some(n) => {
                                        timer.arm(stack.next_timer(), |_| {});
                                        let _s = enter(Class::Schedule);
                                        n.halt_until(&stop_, timer.armed);
                                    }
                                    None => {
                                        timer.xen_idle(stack.next_timer(), &v);
                                        v.wait();
                                    }
                                }
                            }
                        }
                        let mut c = Counters::default();
                        stack_counters(&mut c, &stack);
                        driver_counters(&mut c, &drv);
                        drv.shutdown(&mut pool);
                        stack.shutdown(&mut pool);
                        c
                    })
                    .map_err(other)?;
                kernels.push((Arc::clone(&dom), h));
                domains.push(dom);
            }
            Config::Pv => {
                let drv_dom = mk("driver", true, VIF_WINDOW_SLOTS + 4)?;
                let guest = mk("guest", false, 4)?;
                hv.iommu_attach(NIC, &drv_dom).map_err(other)?;
                let irq_port = hv.bind_irq(&drv_dom, NIC_VECTOR).map_err(other)?;
                let (source, wire_sink, guest_tap): (Box<dyn WireSource>, Box<dyn WireSink>, _) =
                    match plumbing {
                        Some(p) => {
                            let sink = p.wire.sink().map_err(other)?;
                            (Box::new(p.wire), Box::new(sink), Some(p.guest))
                        }
                        None => (Box::new(sender), Box::new(sink), None),
                    };
                nic = Nic::start(
                    &hv,
                    NIC,
                    IrqLine::Hypervisor {
                        hv: Arc::clone(&hv),
                        vector: NIC_VECTOR,
                    },
                    opts.coalesce,
                    source,
                    wire_sink,
                )
                .map_err(other)?;
                // The toolstack and the handshake.
                net::xenbus::create_vif(hv.store(), drv_dom.id(), guest.id(), 0, f.dst_mac)
                    .map_err(other)?;
                netback::probe(hv.store(), drv_dom.id(), guest.id(), 0).map_err(other)?;
                let mut front =
                    Netfront::connect_with(&hv, &guest, 0, opts.rx_buffers).map_err(other)?;
                let mut vif = Vif::connect(&hv, &drv_dom, guest.id(), 0, 0, 0).map_err(other)?;
                let mut dpool =
                    SkbPool::new(Arc::clone(&drv_dom), POOL_BUFFERS, 64).map_err(other)?;
                let mut gpool =
                    SkbPool::new(Arc::clone(&guest), POOL_BUFFERS, POOL_PAGES).map_err(other)?;
                front.refill_rx(&mut gpool);
                let mut nicdrv =
                    NicDriver::probe(&hv, &drv_dom, nic.regs(), &mut dpool, DmaApi::Swiotlb)
                        .map_err(other)?;
                let mut bridge = Bridge::new(2, opts.netfilter);
                bridge.attach_vif(1, f.dst_mac);

                let (stop_d, ready_d) = (Arc::clone(&stop), Arc::clone(&ready));
                let vif_port = vif.port();
                let hd = hv
                    .start_vcpu(&drv_dom, start(core(0)), move |v: Vcpu| {
                        let mut tokens: Vec<u32> = Vec::with_capacity(POOL_BUFFERS);
                        ready_d.fetch_add(1, Ordering::Release);
                        while !stop_d.load(Ordering::Acquire) {
                            let mut vif_ev = false;
                            v.handle_events(|q| {
                                if q == irq_port {
                                    xen_pirq(&v, irq_port, || nicdrv.interrupt());
                                } else if q == vif_port {
                                    vif_ev = true;
                                }
                            });
                            let mut work = 0;
                            if nicdrv.napi_scheduled() {
                                work +=
                                    nicdrv.poll(&mut dpool, NAPI_BUDGET, |pool, skb| match bridge
                                        .input(pool, skb, 0)
                                    {
                                        Forward::Port(1) | Forward::Flood => {
                                            vif.start_xmit(pool, skb)
                                        }
                                        _ => pool.free(skb),
                                    });
                            }
                            if vif.rx_pending() {
                                work += vif.rx_action(&mut dpool);
                            }
                            if vif_ev || vif.tx_pending() {
                                work +=
                                    vif.tx_action(
                                        &mut dpool,
                                        NAPI_BUDGET,
                                        |pool, skb| match bridge.input(pool, skb, 1) {
                                            Forward::Port(0) | Forward::Flood => {
                                                if let Err(s) = nicdrv.xmit(pool, skb) {
                                                    pool.free(s);
                                                }
                                            }
                                            _ => pool.free(skb),
                                        },
                                    );
                            }
                            nicdrv.clean_tx(&mut dpool);
                            dpool.take_released(|r| tokens.push(r.token));
                            if !tokens.is_empty() {
                                vif.tx_release(tokens.drain(..));
                            }
                            if work == 0 && !nicdrv.napi_scheduled() {
                                v.wait();
                            }
                        }
                        let mut c = Counters::default();
                        driver_counters(&mut c, &nicdrv);
                        let s = vif.stats();
                        c.add("netback", "rx_packets", s.rx_packets);
                        c.add("netback", "rx_queue_full", s.rx_queue_full);
                        c.add("netback", "rx_copy_errors", s.rx_copy_errors);
                        c.add("netback", "rx_stalls", s.rx_stalls);
                        c.add("netback", "rx_oversize", s.rx_oversize);
                        let b = bridge.stats();
                        c.add("bridge", "forwarded", b.forwarded);
                        c.add("bridge", "dropped", b.drops.iter().sum());
                        nicdrv.shutdown(&mut dpool);
                        vif.disconnect(&mut dpool);
                        c
                    })
                    .map_err(other)?;
                kernels.push((Arc::clone(&drv_dom), hd));

                let (stop_g, ready_g) = (Arc::clone(&stop), Arc::clone(&ready));
                let hg = if let Some(tap) = guest_tap {
                    guest_on_tap(
                        &hv,
                        &guest,
                        start(core(1)),
                        tap,
                        front,
                        gpool,
                        stop_g,
                        ready_g,
                    )?
                } else {
                    let (mut stack, mut app_) = App::bind(&guest, f, opts.message, &app)?;
                    hv.start_vcpu(&guest, start(core(1)), move |v: Vcpu| {
                        let tport = v.hv().bind_virq(v.domain(), Virq::Timer, v.id()).ok();
                        let mut timer = KernelTimer::default();
                        ready_g.fetch_add(1, Ordering::Release);
                        while !stop_g.load(Ordering::Acquire) {
                            let mut expired = false;
                            v.handle_events(|q| expired |= Some(q) == tport);
                            let now = {
                                let _t = enter(Class::Time);
                                v.system_time()
                            };
                            if expired {
                                timer.armed = None;
                                stack.tick(&mut gpool, now);
                            }
                            let mut work = front.poll_rx(&mut gpool, NAPI_BUDGET, |pool, skb| {
                                stack.input(pool, skb, now)
                            });
                            front.poll_tx(&mut gpool);
                            work += app_.run(&mut stack, &mut gpool);
                            if work == 0 {
                                timer.xen_idle(stack.next_timer(), &v);
                                v.wait();
                            }
                        }
                        let mut c = Counters::default();
                        stack_counters(&mut c, &stack);
                        let s = front.stats();
                        c.add("netfront", "rx_packets", s.rx_packets);
                        c.add("netfront", "rx_errors", s.rx_errors.iter().sum());
                        c.add("netfront", "rx_no_buffer", s.rx_no_buffer);
                        stack.shutdown(&mut gpool);
                        c
                    })
                    .map_err(other)?
                };
                kernels.push((Arc::clone(&guest), hg));
                domains.push(drv_dom);
                domains.push(guest);
            }
        }
        // Plug the cable in once every kernel runs.
        let t = Instant::now();
        while ready.load(Ordering::Acquire) < kernels.len() && t.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        nic.regs().link_up.store(true, Ordering::Release);
        Ok(Self {
            hv,
            opts,
            domains,
            nic: Some(nic),
            sender: sender_counters,
            frames_per_message: fpm,
            app,
            stop,
            kernels,
            native_irq,
        })
    }

    /// The NIC's registers and counters.
    pub fn nic_regs(&self) -> Option<&Arc<dev::nic::NicRegs>> {
        self.nic.as_ref().map(|n| n.regs())
    }

    /// Frames per message.
    pub fn frames_per_message(&self) -> usize {
        self.frames_per_message
    }

    /// The machine's counters now.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            at: Instant::now(),
            domains: self
                .domains
                .iter()
                .map(|d| {
                    (
                        d.name().to_string(),
                        d.is_driver_domain() && self.opts.config == Config::Pv,
                        DomainSnapshot {
                            cpu: d.cpu_time(),
                            samples: d.class_samples(),
                        },
                    )
                })
                .collect(),
            frames_sent: self.sender.frames.load(Ordering::Relaxed),
            messages: self.app.messages.load(Ordering::Relaxed),
        }
    }

    /// Stops the sender, waits up to `drain` for what is in flight to arrive, stops the
    /// machine and accounts for every frame.
    pub fn finish(mut self, drain: Duration) -> Result<Finish, LabError> {
        let nic = self.nic.take().ok_or_else(|| other("no nic"))?;
        nic.regs().unplug();
        let sent = self.sender.frames.load(Ordering::Relaxed);
        let whole = sent / self.frames_per_message as u64;
        let t = Instant::now();
        while self.app.messages.load(Ordering::Relaxed) < whole && t.elapsed() < drain {
            std::thread::sleep(Duration::from_millis(2));
        }
        let regs = Arc::clone(nic.regs());
        drop(nic);
        self.stop.store(true, Ordering::Release);
        if let Some(n) = &self.native_irq {
            n.raise();
        }
        let mut counters = Counters::default();
        for (d, h) in self.kernels.drain(..) {
            self.hv.kick_vcpu(&d, 0);
            let c = h.join().map_err(|_| other("a vCPU panicked"))?;
            counters.entries.extend(c.entries);
        }
        counters.add("nic", "rx_frames", regs.rx_frames.load(Ordering::Relaxed));
        counters.add("nic", "rx_missed", regs.rx_missed.load(Ordering::Relaxed));
        counters.add("nic", "dma_faults", regs.dma_faults.load(Ordering::Relaxed));
        counters.add(
            "nic",
            "rx_dma_errors",
            regs.rx_dma_errors.load(Ordering::Relaxed),
        );
        counters.add("nic", "irqs", regs.irqs.load(Ordering::Relaxed));
        counters.add(
            "sender",
            "max_late_us",
            self.sender.max_late_us.load(Ordering::Relaxed),
        );
        counters.add(
            "sender",
            "skipped_frames",
            self.sender.skipped_frames.load(Ordering::Relaxed),
        );
        Ok(Finish {
            frames_sent: sent,
            messages_sent: whole,
            messages_received: self.app.messages.load(Ordering::Relaxed),
            corrupt: self.app.corrupt.load(Ordering::Relaxed),
            counters,
        })
    }
}

/// What a finished run accounts for.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finish {
    /// Frames the sender sent.
    pub frames_sent: u64,
    /// Whole messages among them.
    pub messages_sent: u64,
    /// Messages the application received.
    pub messages_received: u64,
    /// Of those, not as sent.
    pub corrupt: u64,
    /// Every component's counters.
    pub counters: Counters,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(n) = &self.native_irq {
            n.raise();
        }
        for (d, h) in self.kernels.drain(..) {
            self.hv.kick_vcpu(&d, 0);
            let _ = h.join();
        }
    }
}

fn stack_counters(c: &mut Counters, s: &Stack) {
    let st = s.stats();
    c.add("stack", "frames", st.frames);
    c.add("stack", "datagrams", st.datagrams);
    for r in net::stack::RxDrop::ALL {
        let n = st.drop_count(r);
        if n > 0 {
            c.add("stack", &format!("drop {r:?}"), n);
        }
    }
    c.add("stack", "soft_csums", st.soft_csums);
}

fn driver_counters(c: &mut Counters, d: &NicDriver) {
    let s = d.stats();
    c.add("driver", "rx_packets", s.rx_packets);
    c.add("driver", "rx_no_buffer", s.rx_no_buffer);
    c.add("driver", "rx_errors", s.rx_errors);
    c.add("driver", "irqs", s.irqs);
}
