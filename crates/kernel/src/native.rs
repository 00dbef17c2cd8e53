//! The kernel that drives the NIC itself and runs the stack and the application in the
//! same domain: Linux on the bare machine (`native`: `pci-nommu` DMA, the interrupt
//! line wakes its CPU, it halts when idle) or a guest with the NIC assigned (`direct`:
//! DMA through its IOMMU context with a `swiotlb` DMA interface, the interrupt an event
//! it acknowledges as a physical IRQ, it blocks in the hypervisor when idle).

use std::sync::Arc;
use std::time::Duration;

use dev::driver::{DmaApi, NicDriver};
use dev::nic::NicRegs;
use hv::{Domain, Hypervisor, Port, Vcpu};
use net::bridge::Forward;
use net::skb::{SkbId, SkbPool};

use crate::app::{AppSpec, AppStack};
use crate::pv_guest::xmit_frame;
use crate::vcpu::{xen_pirq, Kernel, Work};
use crate::{other, BuildError, Counters, NAPI_BUDGET, POOL_BUFFERS};

/// Pages of the pool (page fragments and page-sized heads).
pub const POOL_PAGES: usize = 640;

/// The NIC driver, the stack and the receiving application of one domain.
#[derive(Debug)]
pub struct NicKernel {
    drv: NicDriver,
    pool: SkbPool,
    app: AppStack,
    /// The NIC's interrupt as an event (a guest with the NIC assigned); none natively.
    pirq: Option<Port>,
    /// A bridge between the NIC (port 0) and the stack (port 1), with its netfilter
    /// hooks, as a driver domain's own address sits on its bridge; none: the stack is
    /// straight on the driver.
    bridge: Option<net::bridge::Bridge>,
}

impl NicKernel {
    /// Probes the NIC behind `regs` with `dma` and binds the application. `pirq` is the
    /// port the NIC's interrupt arrives on under the hypervisor.
    pub fn new(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        regs: &Arc<NicRegs>,
        dma: DmaApi,
        pirq: Option<Port>,
        app: &AppSpec,
    ) -> Result<Self, BuildError> {
        let mut pool = SkbPool::new(Arc::clone(dom), POOL_BUFFERS, POOL_PAGES).map_err(other)?;
        let drv = NicDriver::probe(hv, dom, regs, &mut pool, dma).map_err(other)?;
        Ok(Self {
            drv,
            pool,
            app: AppStack::bind(dom, app, Duration::ZERO)?,
            pirq,
            bridge: None,
        })
    }

    /// Puts the stack, at `mac`, behind a bridge with its netfilter hooks: paper 002's
    /// driver domain using its NIC through the bridging that virtualization adds.
    pub fn bridged(mut self, mac: [u8; 6]) -> Self {
        let mut b = net::bridge::Bridge::new(2, true);
        b.attach_vif(LOCAL_PORT, mac);
        self.bridge = Some(b);
        self
    }
}

impl NicKernel {
    /// Adaptive interrupt moderation in the NIC driver, on or off.
    pub fn set_adaptive_coalescing(&mut self, on: bool) {
        self.drv.set_adaptive(on);
    }
}

impl Kernel for NicKernel {
    const CLOCK: bool = true;

    fn event(&mut self, v: &Vcpu, port: Port) {
        if Some(port) == self.pirq {
            xen_pirq(v, port, || self.drv.interrupt());
        }
    }

    fn interrupt(&mut self) {
        self.drv.interrupt();
    }

    fn tick(&mut self, now: Duration) {
        self.app.tick(&mut self.pool, now);
    }

    fn poll(&mut self, now: Duration) -> Work {
        let Self {
            drv,
            pool,
            app,
            bridge,
            ..
        } = self;
        let mut w = Work::default();
        if drv.napi_scheduled() {
            w.rx = drv.poll(pool, NAPI_BUDGET, |pool, skb| match bridge.as_mut() {
                // Bridged: only what the bridge sends the stack's way reaches it.
                Some(b) => match b.input(pool, skb, 0) {
                    Forward::Port(LOCAL_PORT) | Forward::Flood => app.input(pool, skb, now),
                    _ => pool.free(skb),
                },
                None => app.input(pool, skb, now),
            });
        }
        drv.clean_tx(pool);
        (w.app, w.tx) = app.run(pool, now, |pool, frame| {
            xmit_frame(pool, frame, |pool, skb| to_nic(pool, drv, bridge, skb))
        });
        w.more = drv.napi_scheduled();
        w
    }

    fn next_timer(&self) -> Option<Duration> {
        self.app.next_timer()
    }

    fn shutdown(mut self) -> Counters {
        let mut c = Counters::default();
        self.app.counters(&mut c);
        c.add_set("driver", self.drv.stats());
        if let Some(b) = &self.bridge {
            c.add_set("bridge", b.stats());
        }
        self.drv.shutdown(&mut self.pool);
        self.app.shutdown(&mut self.pool);
        c
    }
}

/// The domain that drives the NIC runs a raw application on it itself ([`crate::probe`]),
/// straight on the driver or through a software bridge with its netfilter hooks, as a
/// driver domain's own address sits on its bridge: paper 002's two dotted lines, the
/// driver domain using the NIC without and with the bridging that virtualization adds.
#[derive(Debug)]
pub struct RawNicKernel {
    drv: NicDriver,
    pool: SkbPool,
    raw: crate::probe::Raw,
    /// One frame's bytes for the application.
    scratch: Box<[u8]>,
    /// The bridge between the NIC (port 0) and the application (port 1), if any.
    bridge: Option<net::bridge::Bridge>,
    pirq: Option<Port>,
    /// Frames the application sent that found no buffer or no room on the ring.
    tx_wait: u64,
}

/// The application's bridge port.
const LOCAL_PORT: u16 = 1;

impl RawNicKernel {
    /// Probes the NIC behind `regs` with `dma`; the application at `mac` runs `raw`,
    /// behind a bridge (with its hooks) if `bridge`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        regs: &Arc<NicRegs>,
        dma: DmaApi,
        pirq: Option<Port>,
        raw: &crate::svnic_guest::RawApp,
        mac: [u8; 6],
        bridge: bool,
    ) -> Result<Self, BuildError> {
        let mut pool = SkbPool::new(Arc::clone(dom), POOL_BUFFERS, POOL_PAGES).map_err(other)?;
        let drv = NicDriver::probe(hv, dom, regs, &mut pool, dma).map_err(other)?;
        let bridge = bridge.then(|| {
            let mut b = net::bridge::Bridge::new(2, true);
            b.attach_vif(LOCAL_PORT, mac);
            b
        });
        Ok(Self {
            drv,
            pool,
            raw: raw.start(),
            scratch: vec![0u8; 2048].into_boxed_slice(),
            bridge,
            pirq,
            tx_wait: 0,
        })
    }
}

/// A frame of the domain's own out: through the bridge (if any) to the NIC; one the
/// bridge keeps from the NIC is freed.
fn to_nic(
    pool: &mut SkbPool,
    drv: &mut NicDriver,
    bridge: &mut Option<net::bridge::Bridge>,
    skb: SkbId,
) -> Result<(), SkbId> {
    match bridge.as_mut() {
        Some(b) => match b.input(pool, skb, LOCAL_PORT) {
            Forward::Port(0) | Forward::Flood => drv.xmit(pool, skb),
            _ => {
                pool.free(skb);
                Ok(())
            }
        },
        None => drv.xmit(pool, skb),
    }
}

impl RawNicKernel {
    /// The application's frame out: through the bridge (if any) to the NIC.
    fn send(
        pool: &mut SkbPool,
        drv: &mut NicDriver,
        bridge: &mut Option<net::bridge::Bridge>,
        tx_wait: &mut u64,
        frame: &[u8],
    ) -> bool {
        let ok = xmit_frame(pool, frame, |pool, skb| to_nic(pool, drv, bridge, skb));
        *tx_wait += u64::from(!ok);
        ok
    }
}

impl Kernel for RawNicKernel {
    const CLOCK: bool = true;

    fn event(&mut self, v: &Vcpu, port: Port) {
        if Some(port) == self.pirq {
            xen_pirq(v, port, || self.drv.interrupt());
        }
    }

    fn interrupt(&mut self) {
        self.drv.interrupt();
    }

    fn poll(&mut self, now: Duration) -> Work {
        let Self {
            drv,
            pool,
            raw,
            scratch,
            bridge,
            tx_wait,
            ..
        } = self;
        let mut w = Work::default();
        // One frame at a time out of the driver: the application's answer goes back
        // through the same driver.
        while w.rx < NAPI_BUDGET && drv.napi_scheduled() {
            let mut got = None;
            if drv.poll(pool, 1, |_, skb| got = Some(skb)) == 0 {
                break;
            }
            w.rx += 1;
            let Some(skb) = got else { continue };
            let len = pool.len(skb).min(scratch.len());
            let read = pool.read(skb, 0, &mut scratch[..len]).is_ok();
            // Bridged: only what the bridge sends the application's way reaches it.
            let mine = match bridge.as_mut() {
                Some(b) => matches!(
                    b.input(pool, skb, 0),
                    Forward::Port(LOCAL_PORT) | Forward::Flood
                ),
                None => true,
            };
            pool.free(skb);
            if read && mine {
                raw.input(&scratch[..len], now, &mut |f| {
                    Self::send(pool, drv, bridge, tx_wait, f)
                });
            }
        }
        drv.clean_tx(pool);
        w.tx += raw.run(now, &mut |f| Self::send(pool, drv, bridge, tx_wait, f));
        w.more = drv.napi_scheduled();
        w
    }

    fn next_timer(&self) -> Option<Duration> {
        self.raw.next_timer()
    }

    fn shutdown(mut self) -> Counters {
        let mut c = Counters::default();
        c.add_set("driver", self.drv.stats());
        c.add("raw", "tx_wait", self.tx_wait);
        if let Some(b) = &self.bridge {
            c.add_set("bridge", b.stats());
        }
        if let crate::probe::Raw::Echo { echoed, .. } = &self.raw {
            c.add("echo", "echoed", *echoed);
        }
        self.drv.shutdown(&mut self.pool);
        c
    }
}
