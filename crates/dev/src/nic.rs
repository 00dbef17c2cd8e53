//! The NIC model: a device thread with RX and TX descriptor rings in its owner's memory.
//!
//! Descriptors are 16 bytes (buffer I/O address, length, status, flags), 256 to a
//! page-sized ring. The driver owns descriptors up to a tail register it writes; the
//! device owns those from its head. All the device's memory accesses — descriptor
//! fetches and write-backs, packet data — go through the IOMMU ([`hv::iommu::DmaContext`]);
//! packet data is written with non-temporal stores, so it arrives cold as from a real
//! NIC, and is fenced before the descriptor that announces it.
//!
//! Receive checksum offload: the device checks the UDP checksum of unfragmented IPv4
//! datagrams (as NICs do) and says so in the descriptor. Interrupts are coalesced: one
//! is raised when `pkts_per_irq` completions are pending or the oldest has waited
//! `max_delay`, and only while the driver has them enabled (NAPI turns them off while
//! it polls). A frame arriving with no descriptor free waits in the device's receive
//! packet buffer (`fifo`) for the queue's refill; a far end that takes PAUSE frames is
//! paused as that buffer fills (802.3x flow control); a frame that finds no room, or
//! waits too long, is dropped and counted (`rx_missed`), as the hardware's
//! missed-packet counter.
//!
//! Several receive queues (paper 000 §4.3, Figure 9; Intel's VMDq, the `vmq` of the
//! paper's driver): [`RX_QUEUES`] descriptor rings, each with its own registers,
//! interrupt line and coalescing count. A filter table steers a frame by destination
//! MAC address and VLAN to a queue; what no filter claims (and every broadcast or
//! multicast frame) goes to queue 0, the default queue, which the driver domain owns.
//! A frame steered to a queue that is off or has no free descriptor is dropped and
//! counted on that queue: it never falls through to another queue's buffers. Transmit
//! completions count towards queue 0's interrupt.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use hv::DeviceId;

use crate::irq::IrqLine;
use crate::wire::{WireSink, WireSource};

mod engine;
mod fifo;
pub mod misses;
mod regs;

use engine::Device;
pub use fifo::{
    GUEST_QUEUE_HOLD, RX_FIFO_BYTES, RX_FIFO_CHUNK, RX_FIFO_RESERVE, RX_FIFO_XOFF, RX_FIFO_XON,
};
pub use regs::*;

#[derive(Debug)]
pub struct Nic {
    regs: Arc<NicRegs>,
    engine: Option<Engine>,
}

/// Where the device's engine runs.
#[derive(Debug)]
enum Engine {
    Thread(JoinHandle<Box<dyn WireSource>>),
    Unit(hv::sched::UnitJoin<Box<dyn WireSource>>),
}

impl Engine {
    fn join(self) -> Option<Box<dyn WireSource>> {
        match self {
            Engine::Thread(t) => t.join().ok(),
            Engine::Unit(u) => u.join().ok(),
        }
    }
}

impl Nic {
    /// A NIC whose DMA goes through `dev`'s IOMMU context and whose interrupt goes to
    /// `irq`; its wire has `source` on the far end and `sink` for what it sends.
    /// Starts the device thread (unpinned: it is not a domain's CPU). Only the default
    /// queue has a line.
    pub fn start(
        hv: &Arc<hv::Hypervisor>,
        dev: DeviceId,
        irq: IrqLine,
        coalesce: Coalesce,
        source: Box<dyn WireSource>,
        sink: Box<dyn WireSink>,
    ) -> std::io::Result<Self> {
        Self::start_queues(hv, dev, vec![irq], coalesce, source, sink)
    }

    /// As [`Nic::start`], with an interrupt line per receive queue: `irqs[q]` is queue
    /// `q`'s (at most [`RX_QUEUES`]; queues beyond them cannot be enabled).
    pub fn start_queues(
        hv: &Arc<hv::Hypervisor>,
        dev: DeviceId,
        irqs: Vec<IrqLine>,
        coalesce: Coalesce,
        source: Box<dyn WireSource>,
        sink: Box<dyn WireSink>,
    ) -> std::io::Result<Self> {
        let (regs, d) = Device::with_regs(hv, dev, coalesce, irqs);
        let thread = std::thread::Builder::new()
            .name(format!("nic{}", dev.0))
            .spawn(move || d.run(source, sink))?;
        regs.doze.bind(thread.thread().clone());
        Ok(Self {
            regs,
            engine: Some(Engine::Thread(thread)),
        })
    }

    /// As [`Nic::start_queues`], with the device's engine a unit on pCPU `pcpu` of
    /// `sched` instead of a thread of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn start_on(
        sched: &hv::sched::Scheduler,
        pcpu: usize,
        hv: &Arc<hv::Hypervisor>,
        dev: DeviceId,
        irqs: Vec<IrqLine>,
        coalesce: Coalesce,
        source: Box<dyn WireSource>,
        sink: Box<dyn WireSink>,
    ) -> Result<Self, hv::sched::SchedError> {
        let (regs, d) = Device::with_regs(hv, dev, coalesce, irqs);
        let resets = regs.resets.load(Ordering::Acquire);
        // Hardware beside the CPUs: an idle pCPU runs its steps while its own is busy,
        // unless its cable's I/O is tied to one thread.
        let name = format!("nic{}", dev.0);
        let spec = if source.thread_bound() || sink.thread_bound() {
            hv::sched::UnitSpec::named(name)
        } else {
            hv::sched::UnitSpec::device(name)
        };
        let unit = NicUnit {
            dev: d,
            source: Some(source),
            sink,
            resets,
        };
        let j = sched.place(pcpu, spec, unit)?;
        Ok(Self {
            regs,
            engine: Some(Engine::Unit(j)),
        })
    }

    /// The registers.
    pub fn regs(&self) -> &Arc<NicRegs> {
        &self.regs
    }

    /// Stops the device and gives back its wire source (to read what it sent).
    pub fn stop(mut self) -> Option<Box<dyn WireSource>> {
        self.regs.stop();
        self.engine.take().and_then(Engine::join)
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        self.regs.stop();
        if let Some(t) = self.engine.take() {
            let _ = t.join();
        }
    }
}

/// The NIC's engine as a unit on one of pvio's pCPUs: a step is one pass of the device.
struct NicUnit {
    dev: Device,
    source: Option<Box<dyn WireSource>>,
    sink: Box<dyn WireSink>,
    resets: u64,
}

impl hv::sched::Unit for NicUnit {
    type Output = Box<dyn WireSource>;
    fn attach(&mut self, waker: &hv::sched::Waker, _stats: &Arc<hv::sched::UnitStats>) {
        self.dev.regs.doze.bind_unit(waker);
        if let Some(s) = self.source.as_mut() {
            s.attach(&self.dev.regs.doze);
        }
    }
    fn step(&mut self, _cx: &hv::sched::Cx) -> hv::sched::Step<Box<dyn WireSource>> {
        use hv::sched::Step;
        let regs = &self.dev.regs;
        regs.doze.awake();
        let Some(source) = self.source.as_mut() else {
            return Step::Done(Box::new(crate::wire::Silence));
        };
        if regs.stop.load(Ordering::Acquire) {
            let mut s = self
                .source
                .take()
                .unwrap_or_else(|| Box::new(crate::wire::Silence));
            s.close();
            return Step::Done(s);
        }
        match self
            .dev
            .pass(source.as_mut(), self.sink.as_mut(), &mut self.resets)
        {
            None => Step::More,
            Some(until) => Step::Idle(until),
        }
    }
}

#[cfg(test)]
mod tests;
