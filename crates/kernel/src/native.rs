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
use net::skb::SkbPool;

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
        })
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
        let Self { drv, pool, app, .. } = self;
        let mut w = Work::default();
        if drv.napi_scheduled() {
            w.rx = drv.poll(pool, NAPI_BUDGET, |pool, skb| app.input(pool, skb, now));
        }
        drv.clean_tx(pool);
        (w.app, w.tx) = app.run(pool, now, |pool, frame| {
            xmit_frame(pool, frame, |pool, skb| drv.xmit(pool, skb))
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
        self.drv.shutdown(&mut self.pool);
        self.app.shutdown(&mut self.pool);
        c
    }
}
