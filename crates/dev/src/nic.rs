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
//! it polls). A frame arriving with no descriptor free is dropped and counted
//! (`rx_missed`), as the hardware's missed-packet counter.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use hv::iommu::DmaContext;
use hv::{DeviceId, Iova};
use smoltcp::wire::{
    EthernetFrame, EthernetProtocol, IpAddress, IpProtocol, Ipv4Packet, UdpPacket,
};

use crate::irq::IrqLine;
use crate::wire::{WireSink, WireSource};

/// Descriptors per ring (four pages). Deeper than the paper's NIC's default 255: the
/// device thread is sometimes scheduled late by the host and then delivers the frames
/// that "arrived" meanwhile at once; the ring absorbs such a burst of ~12 ms at the
/// experiments' rate, as a NIC that is never descheduled would not need to.
pub const RING_DESCS: u32 = 1024;
/// Pages per ring.
pub const RING_PAGES: usize = RING_DESCS as usize * DESC_SIZE / 4096;
/// Bytes per descriptor.
pub const DESC_SIZE: usize = 16;
/// Largest frame the device accepts (no jumbo frames, as in the paper's setup).
pub use net::wire::MAX_TAGGED_FRAME as MAX_FRAME;

/// Descriptor status: done (written back by the device).
pub const DESC_DD: u16 = 1 << 0;
/// Descriptor status/flag: end of packet.
pub const DESC_EOP: u16 = 1 << 1;
/// RX status: the device verified the UDP checksum.
pub const DESC_L4_OK: u16 = 1 << 2;
/// RX status: the frame could not be written to the descriptor's buffer (the DMA
/// faulted); the descriptor is given back with no data, and the driver must drop it
/// (a NIC's RX error bit, as the `RXD_STAT`/`RDESC.ERRORS` fields of real devices).
pub const DESC_ERR: u16 = 1 << 3;

/// One descriptor, as it lies in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Desc {
    /// Buffer I/O address.
    pub addr: u64,
    /// RX: bytes written; TX: bytes to send.
    pub len: u16,
    /// `DESC_*` status bits (written by the device).
    pub status: u16,
    /// `DESC_EOP` on a packet's last TX descriptor.
    pub flags: u16,
    /// Reserved.
    pub pad: u16,
}

const _: () = assert!(std::mem::size_of::<Desc>() == DESC_SIZE);

/// Interrupt coalescing parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coalesce {
    /// Completions per interrupt (the driver may change it at run time through
    /// [`NicRegs::itr_pkts`]).
    pub pkts_per_irq: u32,
    /// Longest a completion waits for its interrupt, counted as `delay_from` says.
    pub max_delay: Duration,
    /// What the delay is counted from.
    pub delay_from: DelayFrom,
    /// The driver chooses the packets per interrupt from the rate it measures
    /// ([`crate::driver::NicDriver::set_adaptive`]; ethtool's `adaptive-rx`), starting
    /// from `pkts_per_irq`.
    pub adaptive: bool,
}

/// What a NIC's coalescing delay is counted from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DelayFrom {
    /// The oldest completion not yet signalled: no completion waits longer than the
    /// delay, whatever the rate.
    #[default]
    FirstPacket,
    /// The latest completion (paper 000 §5.2: "a maximum delay after the last received
    /// packet"): while packets keep arriving closer together than the delay, only the
    /// packet count raises the interrupt, so batches grow with the count.
    LastPacket,
}

impl Default for Coalesce {
    /// The paper's NIC: 6 packets or 18 µs, counted from the oldest completion.
    fn default() -> Self {
        Self {
            pkts_per_irq: 6,
            max_delay: Duration::from_micros(18),
            delay_from: DelayFrom::FirstPacket,
            adaptive: false,
        }
    }
}

/// The device's registers (what the driver's MMIO reaches) and counters.
#[derive(Debug)]
pub struct NicRegs {
    /// RX ring base (I/O address), set before enabling.
    pub rx_base: AtomicU64,
    /// TX ring base.
    pub tx_base: AtomicU64,
    /// RX tail: descriptors before it (mod ring) belong to the device.
    pub rx_tail: AtomicU32,
    /// Interrupt moderation: completions per interrupt, written by the driver (an
    /// adaptive driver rewrites it as the rate changes); [`Coalesce::pkts_per_irq`] at
    /// start.
    pub itr_pkts: AtomicU32,
    /// TX tail.
    pub tx_tail: AtomicU32,
    /// Interrupts enabled.
    pub irq_enabled: AtomicBool,
    /// Device running.
    pub enabled: AtomicBool,
    /// The cable is plugged in: the far end's frames arrive (set once the machine is
    /// up, so that start-up is not measured as loss).
    pub link_up: AtomicBool,
    /// Device loop iterations begun (to know the device has seen a register change).
    pub iterations: AtomicU64,
    /// Frames received into memory.
    pub rx_frames: AtomicU64,
    /// Frames dropped: no free descriptor.
    pub rx_missed: AtomicU64,
    /// Frames dropped: too long.
    pub rx_oversize: AtomicU64,
    /// DMA faults (a descriptor naming memory the device may not touch).
    pub dma_faults: AtomicU64,
    /// Frames lost because their data could not be written (their descriptor is
    /// completed with [`DESC_ERR`]).
    pub rx_dma_errors: AtomicU64,
    /// Frames sent.
    pub tx_frames: AtomicU64,
    /// Interrupts raised.
    pub irqs: AtomicU64,
    /// Of those, raised by the maximum-delay timer rather than the packet count.
    pub timer_irqs: AtomicU64,
    /// How late, in total, the timer's interrupts came after their deadline (ns): the
    /// device thread's timed wait is the host's, which may fire late where a NIC's
    /// timer would not.
    pub timer_late_ns: AtomicU64,

    /// Function-level resets requested; the device clears its own state when it sees
    /// the count move.
    resets: AtomicU64,
    stop: AtomicBool,
    parked: AtomicBool,
    thread: std::sync::OnceLock<Thread>,
}

impl NicRegs {
    fn new() -> Self {
        Self {
            rx_base: AtomicU64::new(0),
            tx_base: AtomicU64::new(0),
            rx_tail: AtomicU32::new(0),
            itr_pkts: AtomicU32::new(Coalesce::default().pkts_per_irq),
            tx_tail: AtomicU32::new(0),
            irq_enabled: AtomicBool::new(false),
            enabled: AtomicBool::new(false),
            link_up: AtomicBool::new(false),
            iterations: AtomicU64::new(0),
            rx_frames: AtomicU64::new(0),
            rx_missed: AtomicU64::new(0),
            rx_oversize: AtomicU64::new(0),
            dma_faults: AtomicU64::new(0),
            rx_dma_errors: AtomicU64::new(0),
            tx_frames: AtomicU64::new(0),
            irqs: AtomicU64::new(0),
            timer_irqs: AtomicU64::new(0),
            timer_late_ns: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            thread: std::sync::OnceLock::new(),
        }
    }

    /// A PCIe function-level reset, as the toolstack does before giving a device to a
    /// new owner: the device stops, forgets its rings and pending completions, and
    /// waits to be programmed again. Returns once the device has seen it.
    pub fn function_reset(&self) {
        self.enabled.store(false, Ordering::Release);
        self.irq_enabled.store(false, Ordering::Release);
        self.rx_base.store(0, Ordering::Release);
        self.tx_base.store(0, Ordering::Release);
        self.rx_tail.store(0, Ordering::Release);
        self.tx_tail.store(0, Ordering::Release);
        self.resets.fetch_add(1, Ordering::AcqRel);
        self.wait_seen();
    }

    /// The TX doorbell: publishes descriptors up to `tail` and wakes an idle device.
    pub fn ring_tx_doorbell(&self, tail: u32) {
        self.tx_tail.store(tail, Ordering::Release);
        if self.parked.load(Ordering::Acquire) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    /// A frame arrived at the far end of the cable: wakes an idle device.
    pub fn wire_wake(&self) {
        if self.parked.load(Ordering::Acquire) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    /// Publishes RX descriptors up to `tail`.
    pub fn set_rx_tail(&self, tail: u32) {
        self.rx_tail.store(tail, Ordering::Release);
    }

    /// Unplugs the cable and returns once the device has finished every frame that was
    /// on it (its loop has begun an iteration since).
    pub fn unplug(&self) {
        self.link_up.store(false, Ordering::Release);
        self.wait_seen();
    }

    /// Returns once the device loop has begun an iteration after a register change
    /// (or after a second, for a device that has stopped).
    fn wait_seen(&self) {
        let seen = self.iterations.load(Ordering::Acquire);
        let t0 = Instant::now();
        while self.iterations.load(Ordering::Acquire) < seen + 2
            && t0.elapsed() < Duration::from_secs(1)
        {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
            std::thread::yield_now();
        }
    }

    /// Stops the device thread.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

/// A NIC: its registers, and the device thread once started.
#[derive(Debug)]
pub struct Nic {
    regs: Arc<NicRegs>,
    thread: Option<JoinHandle<Box<dyn WireSource>>>,
}

struct Device {
    regs: Arc<NicRegs>,
    dma: DmaContext,
    irq: IrqLine,
    coalesce: Coalesce,
    rx_head: u32,
    tx_head: u32,
    pending: u32,
    first_pending: Option<Instant>,
    last_pending: Option<Instant>,
    frame: Vec<u8>,
}

impl Nic {
    /// A NIC whose DMA goes through `dev`'s IOMMU context and whose interrupt goes to
    /// `irq`; its wire has `source` on the far end and `sink` for what it sends.
    /// Starts the device thread (unpinned: it is not a domain's CPU).
    pub fn start(
        hv: &Arc<hv::Hypervisor>,
        dev: DeviceId,
        irq: IrqLine,
        coalesce: Coalesce,
        source: Box<dyn WireSource>,
        sink: Box<dyn WireSink>,
    ) -> std::io::Result<Self> {
        let regs = Arc::new(NicRegs::new());
        regs.itr_pkts
            .store(coalesce.pkts_per_irq.max(1), Ordering::Relaxed);
        let mut d = Device {
            regs: Arc::clone(&regs),
            dma: hv.iommu().device(dev),
            irq,
            coalesce,
            rx_head: 0,
            tx_head: 0,
            pending: 0,
            first_pending: None,
            last_pending: None,
            frame: vec![0; 65536],
        };
        let thread = std::thread::Builder::new()
            .name(format!("nic{}", dev.0))
            .spawn(move || d.run(source, sink))?;
        let _ = regs.thread.set(thread.thread().clone());
        Ok(Self {
            regs,
            thread: Some(thread),
        })
    }

    /// The registers.
    pub fn regs(&self) -> &Arc<NicRegs> {
        &self.regs
    }

    /// Stops the device and gives back its wire source (to read what it sent).
    pub fn stop(mut self) -> Option<Box<dyn WireSource>> {
        self.regs.stop();
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        self.regs.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn desc_iova(base: u64, i: u32) -> Iova {
    Iova(base + (i % RING_DESCS) as u64 * DESC_SIZE as u64)
}

/// Whether a frame is an unfragmented IPv4/UDP datagram with a correct checksum (the
/// device's receive checksum offload).
fn l4_checksum_ok(frame: &[u8]) -> bool {
    let Ok(eth) = EthernetFrame::new_checked(frame) else {
        return false;
    };
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return false;
    }
    let Ok(ip) = Ipv4Packet::new_checked(eth.payload()) else {
        return false;
    };
    if ip.more_frags() || ip.frag_offset() != 0 || ip.next_header() != IpProtocol::Udp {
        return false;
    }
    let Ok(udp) = UdpPacket::new_checked(ip.payload()) else {
        return false;
    };
    udp.checksum() != 0
        && udp.verify_checksum(
            &IpAddress::Ipv4(ip.src_addr()),
            &IpAddress::Ipv4(ip.dst_addr()),
        )
}

impl Device {
    fn run(
        &mut self,
        mut source: Box<dyn WireSource>,
        mut sink: Box<dyn WireSink>,
    ) -> Box<dyn WireSource> {
        let _ = mem::cpu::set_timer_slack(1_000);
        let regs = Arc::clone(&self.regs);
        source.attach(&regs);
        let mut resets = regs.resets.load(Ordering::Acquire);

        while !regs.stop.load(Ordering::Acquire) {
            let r = regs.resets.load(Ordering::Acquire);
            if r != resets {
                resets = r;
                self.rx_head = 0;
                self.tx_head = 0;
                self.pending = 0;
                self.first_pending = None;
                self.last_pending = None;
            }
            regs.iterations.fetch_add(1, Ordering::AcqRel);
            let now = Instant::now();
            if regs.enabled.load(Ordering::Acquire) {
                if regs.link_up.load(Ordering::Acquire) {
                    source.poll(now, &mut |f| self.receive(f));
                }
                self.transmit(sink.as_mut());
            }
            let now = Instant::now();
            self.maybe_interrupt(now);
            // Sleep until the next frame is due or the oldest completion's interrupt,
            // or (idle) until a doorbell.
            let mut wake = if regs.link_up.load(Ordering::Acquire) {
                source.next_due()
            } else {
                None
            };
            if self.pending > 0 {
                // With interrupts off the driver is polling and will see the
                // completions anyway; look again after a coalescing period.
                let from = if regs.irq_enabled.load(Ordering::Acquire) {
                    self.delay_start().unwrap_or(now)
                } else {
                    now
                };
                let d = from + self.coalesce.max_delay;
                wake = Some(wake.map_or(d, |w| w.min(d)));
            }
            let now = Instant::now();
            match wake {
                Some(w) if w <= now => continue,
                Some(w) => std::thread::park_timeout(w - now),
                None => {
                    regs.parked.store(true, Ordering::Release);
                    // Re-check after announcing: a doorbell rung before the flag was
                    // seen must not be slept through.
                    if regs.tx_tail.load(Ordering::Acquire) == self.tx_head
                        && !regs.stop.load(Ordering::Acquire)
                        && !(source.ready() && regs.link_up.load(Ordering::Acquire))
                    {
                        std::thread::park_timeout(Duration::from_millis(1));
                    }
                    regs.parked.store(false, Ordering::Release);
                }
            }
        }
        source
    }

    /// Where the coalescing delay of the pending completions counts from.
    fn delay_start(&self) -> Option<Instant> {
        match self.coalesce.delay_from {
            DelayFrom::FirstPacket => self.first_pending,
            DelayFrom::LastPacket => self.last_pending,
        }
    }

    /// Completions per interrupt, as the driver last set them.
    fn itr(&self) -> u32 {
        self.regs.itr_pkts.load(Ordering::Relaxed).max(1)
    }

    fn complete(&mut self, now: Instant) {
        if self.pending == 0 {
            self.first_pending = Some(now);
        }
        self.last_pending = Some(now);
        self.pending += 1;
        if self.pending >= self.itr() {
            self.maybe_interrupt(now);
        }
    }

    fn maybe_interrupt(&mut self, now: Instant) {
        if self.pending == 0 || !self.regs.irq_enabled.load(Ordering::Acquire) {
            return;
        }
        let count = self.pending >= self.itr();
        let deadline = self.delay_start().map(|t| t + self.coalesce.max_delay);
        let timer = !count && deadline.is_some_and(|d| now >= d);
        if timer {
            let late = deadline.map_or(0, |d| now.duration_since(d).as_nanos() as u64);
            self.regs.timer_irqs.fetch_add(1, Ordering::Relaxed);
            self.regs.timer_late_ns.fetch_add(late, Ordering::Relaxed);
        }
        if count || timer {
            self.pending = 0;
            self.first_pending = None;
            self.last_pending = None;
            self.regs.irqs.fetch_add(1, Ordering::Relaxed);
            self.irq.raise();
        }
    }

    /// A frame from the wire: into the next free RX descriptor's buffer.
    fn receive(&mut self, frame: &[u8]) {
        let regs = &self.regs;
        if frame.len() > MAX_FRAME {
            regs.rx_oversize.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self.rx_head == regs.rx_tail.load(Ordering::Acquire) {
            regs.rx_missed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let base = regs.rx_base.load(Ordering::Relaxed);
        let at = desc_iova(base, self.rx_head);
        let mut raw = [0u8; DESC_SIZE];
        if self.dma.dma_read(at, &mut raw).is_err() {
            regs.dma_faults.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let d: Desc = bytemuck::pod_read_unaligned(&raw);
        // Data first (non-temporal, fenced), then the descriptor that announces it. A
        // write that faults (part of it may have landed) completes the descriptor with
        // the error bit and no length, so the driver drops it and recycles the buffer
        // instead of handing up whatever the buffer held before.
        let (status, len) = if self.dma.dma_write(Iova(d.addr), frame).is_err() {
            regs.dma_faults.fetch_add(1, Ordering::Relaxed);
            regs.rx_dma_errors.fetch_add(1, Ordering::Relaxed);
            (DESC_DD | DESC_EOP | DESC_ERR, 0)
        } else if l4_checksum_ok(frame) {
            (DESC_DD | DESC_EOP | DESC_L4_OK, frame.len() as u16)
        } else {
            (DESC_DD | DESC_EOP, frame.len() as u16)
        };
        let wb = Desc {
            addr: d.addr,
            len,
            status,
            flags: 0,
            pad: 0,
        };
        if self.dma.dma_write(at, bytemuck::bytes_of(&wb)).is_err() {
            regs.dma_faults.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.rx_head = self.rx_head.wrapping_add(1) % RING_DESCS;
        regs.rx_frames.fetch_add(1, Ordering::Relaxed);
        self.complete(Instant::now());
    }

    /// Sends every packet the driver queued.
    fn transmit(&mut self, sink: &mut dyn WireSink) {
        let regs = Arc::clone(&self.regs);
        let tail = regs.tx_tail.load(Ordering::Acquire) % RING_DESCS;
        let base = regs.tx_base.load(Ordering::Relaxed);
        let mut len = 0usize;
        let mut bad = false;
        while self.tx_head != tail {
            let at = desc_iova(base, self.tx_head);
            let mut raw = [0u8; DESC_SIZE];
            if self.dma.dma_read(at, &mut raw).is_err() {
                regs.dma_faults.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let mut d: Desc = bytemuck::pod_read_unaligned(&raw);
            let n = d.len as usize;
            if len + n > self.frame.len() {
                bad = true;
            } else if self
                .dma
                .dma_read(Iova(d.addr), &mut self.frame[len..len + n])
                .is_err()
            {
                regs.dma_faults.fetch_add(1, Ordering::Relaxed);
                bad = true;
            } else {
                len += n;
            }
            let eop = d.flags & DESC_EOP != 0;
            d.status = DESC_DD;
            let _ = self.dma.dma_write(at, bytemuck::bytes_of(&d));
            self.tx_head = (self.tx_head + 1) % RING_DESCS;
            if eop {
                if !bad {
                    sink.transmit(&self.frame[..len]);
                    regs.tx_frames.fetch_add(1, Ordering::Relaxed);
                }
                len = 0;
                bad = false;
                self.complete(Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hv::{DomainConfig, Gfn, HvConfig, Hypervisor};

    #[test]
    fn a_frame_whose_dma_faults_completes_its_descriptor_with_an_error_and_no_data() {
        let hv = Hypervisor::new(HvConfig {
            frames: 512,
            ..Default::default()
        })
        .expect("hv");
        let d = hv
            .create_domain(&DomainConfig {
                pages: 64,
                driver_domain: true,
                ..Default::default()
            })
            .expect("dom");
        let (ring, buf): (Gfn, Gfn) = (d.alloc_page().expect("p"), d.alloc_page().expect("p"));
        let (ring_iova, buf_iova) = (0x10_000u64, 0x20_000u64);
        hv.iommu_map(&d, Iova(ring_iova), ring, true).expect("map");
        hv.iommu_map(&d, Iova(buf_iova), buf, true).expect("map");
        hv.iommu_attach(DeviceId(7), &d).expect("attach");
        // Descriptor 0 names a buffer the IOMMU does not map; descriptor 1 a good one.
        d.fill(buf, 0, 4096, 0xee).expect("stale bytes");
        for (i, addr) in [(0usize, 0x90_000u64), (1, buf_iova)] {
            let desc = Desc {
                addr,
                ..Default::default()
            };
            d.write(ring, i * DESC_SIZE, bytemuck::bytes_of(&desc))
                .expect("desc");
        }
        let regs = Arc::new(NicRegs::new());
        regs.rx_base.store(ring_iova, Ordering::Relaxed);
        regs.rx_tail.store(2, Ordering::Relaxed);
        let mut dev = Device {
            regs: Arc::clone(&regs),
            dma: hv.iommu().device(DeviceId(7)),
            irq: IrqLine::Native(Arc::default()),
            coalesce: Coalesce::default(),
            rx_head: 0,
            tx_head: 0,
            pending: 0,
            first_pending: None,
            last_pending: None,
            frame: vec![0; 65536],
        };
        let frame = [0x5au8; 200];
        dev.receive(&frame);
        dev.receive(&frame);
        let desc = |i: usize| -> Desc {
            let mut b = [0u8; DESC_SIZE];
            d.read(ring, i * DESC_SIZE, &mut b).expect("desc");
            bytemuck::pod_read_unaligned(&b)
        };
        let bad = desc(0);
        assert_eq!(bad.status & (DESC_DD | DESC_ERR), DESC_DD | DESC_ERR);
        assert_eq!(bad.len, 0, "no length the driver could hand up");
        let good = desc(1);
        assert_eq!((good.status & DESC_ERR, good.len), (0, 200));
        let mut got = [0u8; 200];
        d.read(buf, 0, &mut got).expect("data");
        assert_eq!(got, frame);
        assert_eq!(regs.rx_dma_errors.load(Ordering::Relaxed), 1);
        assert_eq!(
            regs.rx_frames.load(Ordering::Relaxed),
            2,
            "both descriptors used"
        );
    }

    #[test]
    fn the_coalescing_delay_counts_from_the_first_or_the_last_packet_and_the_driver_sets_the_count()
    {
        let hv = Hypervisor::new(HvConfig {
            frames: 64,
            ..HvConfig::default()
        })
        .expect("hv");
        let device = |delay_from| {
            let regs = Arc::new(NicRegs::new());
            regs.irq_enabled.store(true, Ordering::Relaxed);
            regs.itr_pkts.store(64, Ordering::Relaxed);
            Device {
                regs,
                dma: hv.iommu().device(DeviceId(8)),
                irq: IrqLine::Native(Arc::default()),
                coalesce: Coalesce {
                    pkts_per_irq: 64,
                    max_delay: Duration::from_micros(18),
                    delay_from,
                    adaptive: false,
                },
                rx_head: 0,
                tx_head: 0,
                pending: 0,
                first_pending: None,
                last_pending: None,
                frame: Vec::new(),
            }
        };
        let irqs = |d: &Device| d.regs.irqs.load(Ordering::Relaxed);
        let t0 = Instant::now();
        let us = |n: u64| t0 + Duration::from_micros(n);
        for from in [DelayFrom::FirstPacket, DelayFrom::LastPacket] {
            let mut d = device(from);
            // Ten packets 10 µs apart: closer together than the delay.
            for k in 0..10 {
                d.complete(us(10 * k));
                d.maybe_interrupt(us(10 * k));
            }
            match from {
                // An interrupt once the oldest has waited 18 µs: at 20, 50 and 80.
                DelayFrom::FirstPacket => assert_eq!(irqs(&d), 3),
                // Each packet restarted the delay: nothing yet.
                DelayFrom::LastPacket => assert_eq!(irqs(&d), 0),
            }
            // The timer is checked 5 µs after the last packet's deadline.
            d.maybe_interrupt(us(90 + 18 + 5));
            assert_eq!(
                d.pending, 0,
                "{from:?}: 18 µs after the last, all signalled"
            );
            // Every interrupt here was the timer's, and how late each came is kept.
            let timer = d.regs.timer_irqs.load(Ordering::Relaxed);
            assert_eq!(timer, irqs(&d));
            let late = d.regs.timer_late_ns.load(Ordering::Relaxed);
            match from {
                // At 20, 50 and 80 µs, 2 µs after each deadline; then 5 µs.
                DelayFrom::FirstPacket => assert_eq!(late, 3 * 2_000 + 5_000),
                DelayFrom::LastPacket => assert_eq!(late, 5_000),
            }
        }
        // The count is the driver's register, read at each completion.
        let mut d = device(DelayFrom::LastPacket);
        d.regs.itr_pkts.store(2, Ordering::Relaxed);
        d.complete(us(0));
        d.complete(us(1));
        assert_eq!(irqs(&d), 1);
        assert_eq!(d.regs.timer_irqs.load(Ordering::Relaxed), 0, "the count's");
    }
}
