//! A guest whose network interface is a VIF of the self-virtualized NIC (paper 002):
//! its VIF driver reaches the VIF's queues in device memory directly, and pvio's stack
//! and the receiving application run above it.
//!
//! The VIF's receive signal arrives as a physical interrupt on a port of the guest's
//! (whichever design carried it: the device's own vector, the hypervisor's
//! demultiplexing of the shared identifier register, or the sidecore). It schedules the
//! driver's NAPI poll: the signal is switched off, frames are taken up to the budget,
//! and when the queue is empty the signal is switched on again and the queue looked at
//! once more, so a frame that came between the two is not left waiting. A signal that
//! finds the queue empty woke the guest for nothing (a VIF sharing an identifier bit
//! with another): counted.

use std::sync::Arc;
use std::time::Duration;

use dev::svnic::vif::{VifError, VifFront, MAX_FRAME};
use hv::{Domain, Hypervisor, Port, Vcpu};
use mem::MappedPage;
use net::skb::SkbPool;

use crate::app::{AppSpec, AppStack};
use crate::counters::PortKind;
use crate::vcpu::{Kernel, Work};
use crate::{other, BuildError, Counters, NAPI_BUDGET, POOL_BUFFERS};

/// Pages of an SV-NIC guest's pool (its buffers are 2 KiB heads; frames are copied in).
pub const POOL_PAGES: usize = 256;

/// The guest's VIF driver's counters.
#[derive(Debug, Default, Clone, Copy)]
pub struct VifDriverStats {
    /// Frames taken from the receive queue and handed to the stack.
    pub rx_frames: u64,
    /// Frames the stack sent that went on the send queue.
    pub tx_frames: u64,
    /// Frames the stack sent that found the send queue full (TCP keeps them queued).
    pub tx_full: u64,
    /// Receive signals.
    pub signals: u64,
    /// Receive signals that found nothing new (woken for another VIF's frame).
    pub empty_signals: u64,
    /// Frames dropped: no buffer in the guest's pool.
    pub rx_no_buffer: u64,
    /// Protocol errors from the device's side (the VIF is then unusable).
    pub errors: u64,
    /// Frames from a TAP too long for the VIF (dropped).
    pub tx_oversize: u64,
}

hv::counter_set!(VifDriverStats {
    rx_frames,
    tx_frames,
    tx_full,
    signals,
    empty_signals,
    rx_no_buffer,
    errors,
    tx_oversize
});

/// What runs above an SV-NIC guest's VIF driver.
#[derive(Debug)]
pub enum SvnicApp {
    /// pvio's stack and the receiving application.
    Stack(AppSpec),
    /// Raw frames: the probes' echo server or client ([`crate::probe`]).
    Raw(RawApp),
    /// A TAP: the guest's stack is its network namespace's (`pvio up`). Frames are at
    /// most an MTU: the TAP takes no offloads.
    Tap(Box<dev::tap::TapPort>),
    /// No VIF: a remote virtual disk the device serves itself (its block service, the
    /// device-centric RVBD; the disk must be [`crate::machine::Disk::Aoe`]) and a
    /// block job above blkfront.
    Block(Box<crate::machine::BlockSpec>),
}

/// A raw application's set-up.
#[derive(Debug, Clone)]
pub enum RawApp {
    /// Echoes every probe addressed to this MAC.
    Echo([u8; 6]),
    /// Sends probes and times their echoes.
    Ping(crate::probe::ProbeSpec),
    /// Sends frames one way, at an offered rate or as fast as the VIF takes them.
    Flood(crate::probe::FloodSpec),
    /// Receives a flood addressed to this MAC, checking every byte.
    Sink([u8; 6], Arc<crate::probe::SinkCounters>),
}

impl RawApp {
    /// The application, started.
    pub fn start(&self) -> crate::probe::Raw {
        match self {
            RawApp::Echo(me) => crate::probe::Raw::Echo { me: *me, echoed: 0 },
            RawApp::Ping(p) => crate::probe::Raw::ping(p.clone()),
            RawApp::Flood(f) => crate::probe::Raw::flood(f.clone()),
            RawApp::Sink(me, c) => crate::probe::Raw::Sink {
                me: *me,
                next: 0,
                counters: Arc::clone(c),
            },
        }
    }
}

/// What runs above the driver, built.
#[derive(Debug)]
enum Above {
    Stack(Box<(SkbPool, AppStack)>),
    Raw(crate::probe::Raw),
    Tap(Box<dev::tap::TapPort>),
}

/// The VIF driver, the stack and the application.
#[derive(Debug)]
pub struct SvnicGuest {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    front: VifFront<MappedPage>,
    port: Port,
    above: Above,
    /// A raw application's receive buffer.
    scratch: Box<[u8]>,
    /// A signal came and NAPI has not yet found the queue empty.
    napi: bool,
    /// A send found the queue full: the transmit signal is on until room is made.
    tx_waiting: bool,
    stats: VifDriverStats,
}

impl SvnicGuest {
    /// The guest's kernel over its mapped VIF, whose receive signal comes on `port`.
    pub fn new(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        front: VifFront<MappedPage>,
        port: Port,
        app: SvnicApp,
    ) -> Result<Self, BuildError> {
        let above = match app {
            SvnicApp::Stack(spec) => {
                let pool =
                    SkbPool::new(Arc::clone(dom), POOL_BUFFERS, POOL_PAGES).map_err(other)?;
                Above::Stack(Box::new((
                    pool,
                    AppStack::bind(dom, &spec, Duration::ZERO)?,
                )))
            }
            SvnicApp::Raw(raw) => Above::Raw(raw.start()),
            // A frame from the namespace's stack wakes the guest: the TAP is its
            // vCPU's interrupt line once the vCPU is placed (`attach`).
            SvnicApp::Tap(tap) => Above::Tap(tap),
            SvnicApp::Block(_) => {
                return Err(other("a block guest has no VIF: the machine builds it"));
            }
        };
        front.set_rx_signal(true).map_err(other)?;
        Ok(Self {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
            front,
            port,
            above,
            scratch: vec![0u8; dev::svnic::vif::SLOT_BYTES].into_boxed_slice(),
            napi: true,
            tx_waiting: false,
            stats: VifDriverStats::default(),
        })
    }

    /// Takes up to the budget of frames: how many.
    fn poll_rx(&mut self, now: Duration) -> Result<usize, VifError> {
        let Self {
            front,
            above,
            scratch,
            stats,
            dom,
            ..
        } = self;
        let (pool, app) = match above {
            Above::Stack(b) => {
                let (pool, app) = &mut **b;
                (pool, app)
            }
            Above::Tap(tap) => {
                let mut n = 0;
                while n < NAPI_BUDGET {
                    let Some(len) = front.recv(scratch)? else {
                        break;
                    };
                    n += 1;
                    tap.send(&scratch[..len], net::offload::Offload::NONE);
                }
                stats.rx_frames += n as u64;
                return Ok(n);
            }
            Above::Raw(raw) => {
                let mut n = 0;
                while n < NAPI_BUDGET {
                    let Some(len) = front.recv(scratch)? else {
                        break;
                    };
                    n += 1;
                    raw.input(&scratch[..len], now, &mut |f| match front.send(f) {
                        Ok(()) => {
                            stats.tx_frames += 1;
                            true
                        }
                        Err(_) => {
                            stats.tx_full += 1;
                            false
                        }
                    });
                }
                stats.rx_frames += n as u64;
                return Ok(n);
            }
        };
        let mut n = 0;
        while n < NAPI_BUDGET {
            let Ok(skb) = pool.alloc(net::skb::NET_SKB_PAD) else {
                // No buffer: the frame stays in the queue until one is free.
                stats.rx_no_buffer += 1;
                break;
            };
            let (gfn, off) = pool.data_location(skb);
            let got = front.recv_with(|page: &MappedPage, offset, len| {
                dom.copy_from_window(page.slot(), offset, gfn, off, len.min(MAX_FRAME))
                    .map_err(|_| VifError::BadLength(len))?;
                Ok(len)
            })?;
            let Some(len) = got else {
                pool.free(skb);
                break;
            };
            if pool.extend_linear(skb, len).is_err() {
                pool.free(skb);
                continue;
            }
            app.input(pool, skb, now);
            n += 1;
        }
        stats.rx_frames += n as u64;
        Ok(n)
    }
}

impl Kernel for SvnicGuest {
    const CLOCK: bool = true;

    fn thread_bound(&self) -> bool {
        matches!(&self.above, Above::Tap(t) if dev::wire::WireSource::thread_bound(&**t))
    }

    fn attach(&mut self, waker: &hv::sched::Waker) {
        if let Above::Tap(tap) = &mut self.above {
            tap.bind_unit(waker);
        }
    }

    fn event(&mut self, _v: &Vcpu, port: Port) {
        if port != self.port {
            return;
        }
        self.stats.signals += 1;
        if self.front.isempty().unwrap_or(true) {
            self.stats.empty_signals += 1;
        }
        // NAPI: the signal off while polling; the line unmasked for the next one. A
        // guest waiting for room in its send queue is woken by the same line: its
        // transmit signal goes off too, and the poll sends what it can.
        let _ = self.front.set_rx_signal(false);
        if self.tx_waiting {
            let _ = self.front.set_tx_signal(false);
            self.tx_waiting = false;
        }
        let _ = self.hv.pirq_eoi(&self.dom, port);
        self.napi = true;
    }

    fn tick(&mut self, now: Duration) {
        if let Above::Stack(b) = &mut self.above {
            let (pool, app) = &mut **b;
            app.tick(pool, now);
        }
    }

    fn poll(&mut self, now: Duration) -> Work {
        let mut w = Work::default();
        if self.napi {
            match self.poll_rx(now) {
                Ok(n) if n == NAPI_BUDGET => {
                    w.rx = n;
                    w.more = true;
                }
                Ok(n) => {
                    w.rx = n;
                    // Empty: the signal on again, then one more look.
                    let _ = self.front.set_rx_signal(true);
                    if self.front.isempty().unwrap_or(true) {
                        self.napi = false;
                    } else {
                        let _ = self.front.set_rx_signal(false);
                        w.more = true;
                    }
                }
                Err(_) => {
                    self.stats.errors += 1;
                    self.napi = false;
                }
            }
        }
        let full_before = self.stats.tx_full;
        let Self {
            front,
            above,
            stats,
            ..
        } = self;
        let mut send = |frame: &[u8]| match front.send(frame) {
            Ok(()) => {
                stats.tx_frames += 1;
                true
            }
            Err(_) => {
                stats.tx_full += 1;
                false
            }
        };
        match above {
            Above::Stack(b) => {
                let (pool, app) = &mut **b;
                let (reads, sent) = app.run(pool, now, |_pool, frame| send(frame));
                w.app = reads;
                w.tx += sent;
            }
            Above::Raw(raw) => w.tx += raw.run(now, &mut send),
            // A frame the send queue has no room for stays in the TAP's queue: the
            // namespace's stack is held back, not dropped on.
            Above::Tap(tap) => {
                w.tx += tap.recv(|frame, _off| {
                    if frame.len() > MAX_FRAME {
                        // Cannot be sent whole (the TAP takes no large segments).
                        stats.tx_oversize += 1;
                        return true;
                    }
                    send(frame)
                })
            }
        }
        if self.stats.tx_full > full_before && !self.tx_waiting {
            // The send queue filled: ask for a signal when the device makes room, then
            // look once more, so room made between the two is not missed.
            let _ = self.front.set_tx_signal(true);
            self.tx_waiting = true;
            if !self.front.isfull().unwrap_or(true) {
                let _ = self.front.set_tx_signal(false);
                self.tx_waiting = false;
                w.more = true;
            }
        }
        w
    }

    fn next_timer(&self) -> Option<Duration> {
        match &self.above {
            Above::Stack(b) => b.1.next_timer(),
            // A paced flood whose send queue is full waits for the transmit signal, not
            // its pacing timer: the timer of a sender behind its schedule is always due,
            // and its vCPU would spin on a full queue, taking the cores the device and
            // the other guests need (Fig. 10's link carried 1% of its rate so).
            Above::Raw(crate::probe::Raw::Flood(_)) if self.tx_waiting => None,
            Above::Raw(raw) => raw.next_timer(),
            Above::Tap(_) => None,
        }
    }

    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        match &self.above {
            Above::Stack(b) => b.1.counters(&mut c),
            Above::Raw(crate::probe::Raw::Echo { echoed, .. }) => c.add("echo", "echoed", *echoed),
            Above::Raw(_) => {}
            Above::Tap(t) => c.add_port(
                &format!("{} tap", self.dom.name()),
                PortKind::HostInterface,
                &**t.counters(),
            ),
        }
        c.add_set("vif driver", &self.stats);
        c
    }

    fn shutdown(mut self) -> Counters {
        let c = self.counters();
        match &mut self.above {
            Above::Stack(b) => {
                let (pool, app) = &mut **b;
                app.shutdown(pool);
            }
            // On the vCPU's thread, which armed the TAP's reads.
            Above::Tap(tap) => tap.close_io(),
            _ => {}
        }
        c
    }
}
