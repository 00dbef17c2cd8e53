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
//!
//! Several receive queues (paper 000 §4.3, Figure 9; Intel's VMDq, the `vmq` of the
//! paper's driver): [`RX_QUEUES`] descriptor rings, each with its own registers,
//! interrupt line and coalescing count. A filter table steers a frame by destination
//! MAC address and VLAN to a queue; what no filter claims (and every broadcast or
//! multicast frame) goes to queue 0, the default queue, which the driver domain owns.
//! A frame steered to a queue that is off or has no free descriptor is dropped and
//! counted on that queue: it never falls through to another queue's buffers. Transmit
//! completions count towards queue 0's interrupt.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hv::iommu::DmaContext;
use hv::{DeviceId, Iova};

use net::offload::{Csum, Offload, MAX_HEADERS};

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

/// RX status: the write-back's address field holds the frame's offload
/// ([`Offload::to_bits`]: its checksum state and GSO), as a NIC's extended write-back
/// format reuses the buffer address for what it found (packet type, hash, LRO count).
/// Set on a frame's last descriptor.
pub const DESC_OFFLOAD: u16 = 1 << 4;
/// TX flag: a context descriptor, no data: its address field holds the offload
/// ([`Offload::to_bits`]) of the packet whose descriptors follow (a NIC's TSO and
/// checksum context descriptor).
pub const DESC_CTX: u16 = 1 << 4;
/// Descriptors one received frame may take (a 64 KiB frame in 2 KiB buffers).
pub const MAX_RX_DESCS_PER_FRAME: usize = 40;

/// Receive queues (queue 0 the default).
pub const RX_QUEUES: usize = 8;
/// Entries of the filter table.
pub const FILTERS: usize = 32;

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

/// Starts a new cache line in a `#[repr(C)]` struct: the fields after it are on lines
/// the fields before it are not. A NIC's registers are MMIO, which no cache holds; in
/// pvio they are atomics in memory that the driver's core and the device's both
/// touch, so each side's words keep to lines of their own, and a driver's tail write
/// does not take the line the device counts its frames in (and the reverse).
#[derive(Debug, Default, Clone, Copy)]
#[repr(C, align(64))]
pub struct LineBreak;

/// One receive queue's registers and counters: the driver's registers on the first
/// line, the device's counters on the second.
#[derive(Debug, Default)]
#[repr(C, align(64))]
pub struct RxQueueRegs {
    /// Ring base (I/O address), set before enabling.
    pub base: AtomicU64,
    /// Tail: descriptors before it (mod ring) belong to the device.
    pub tail: AtomicU32,
    /// Interrupt moderation: completions per interrupt, written by the driver (an
    /// adaptive driver rewrites it as the rate changes); [`Coalesce::pkts_per_irq`] at
    /// start.
    pub itr_pkts: AtomicU32,
    /// The queue's interrupt enabled.
    pub irq_enabled: AtomicBool,
    /// The queue takes frames (queue 0: whenever the device is enabled).
    pub enabled: AtomicBool,
    /// The device's counters from here on.
    device: LineBreak,
    /// Frames received into its buffers.
    pub frames: AtomicU64,
    /// Frames steered to it and dropped: queue off, or no free descriptor.
    pub missed: AtomicU64,
    /// Interrupts raised on its line.
    pub irqs: AtomicU64,
}

impl RxQueueRegs {
    fn clear(&self) {
        self.enabled.store(false, Ordering::Release);
        self.irq_enabled.store(false, Ordering::Release);
        self.base.store(0, Ordering::Release);
        self.tail.store(0, Ordering::Release);
    }
}

/// One entry of the filter table: frames to `mac` (on VLAN `vlan`, or untagged)
/// go to queue `queue`.
#[derive(Debug, Default)]
pub struct FilterRegs {
    /// The MAC address in the low 48 bits; [`FILTER_VALID`] set while in use.
    pub mac: AtomicU64,
    /// The VLAN id, or [`FILTER_UNTAGGED`].
    pub vlan: AtomicU32,
    /// The queue.
    pub queue: AtomicU32,
}

/// Filter entry in use.
pub const FILTER_VALID: u64 = 1 << 63;
/// A filter for untagged frames.
pub const FILTER_UNTAGGED: u32 = u32::MAX;

/// What the driver asked of the filter table that it cannot do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    /// No such entry.
    #[error("no filter entry {0}")]
    NoEntry(usize),
    /// No such queue.
    #[error("no receive queue {0}")]
    NoQueue(usize),
    /// A multicast or broadcast address: those go to the default queue.
    #[error("a group address cannot be steered")]
    GroupAddress,
}

/// The device's registers (what the driver's MMIO reaches) and counters, each side's
/// on lines of its own ([`LineBreak`]): the driver's registers, then the one flag both
/// write, then what the device writes as it works.
#[derive(Debug)]
#[repr(C)]
pub struct NicRegs {
    /// The receive queues; queue 0 is the default.
    pub rxq: [RxQueueRegs; RX_QUEUES],
    /// The filter table.
    pub filters: [FilterRegs; FILTERS],
    /// TX ring base.
    pub tx_base: AtomicU64,
    /// TX tail.
    pub tx_tail: AtomicU32,
    /// Device running.
    pub enabled: AtomicBool,
    /// The cable is plugged in: the far end's frames arrive (set once the machine is
    /// up, so that start-up is not measured as loss).
    pub link_up: AtomicBool,
    /// Function-level resets requested; the device clears its own state when it sees
    /// the count move.
    resets: AtomicU64,
    stop: AtomicBool,
    /// The device thread's sleep and its wake-ups.
    doze: Arc<crate::wire::Doze>,
    /// Both sides write the pause flag: the device sets it, the driver's tail write
    /// clears it.
    paused_line: LineBreak,
    /// Set by the device when it left frames with a source that holds them (a TAP) for
    /// want of a free descriptor, as a link with flow control pauses its sender; the
    /// driver's next RX tail write clears it and wakes the device.
    pub rx_paused: AtomicBool,
    /// The device's registers and counters from here on.
    device: LineBreak,
    /// TX head: the next descriptor the device will fetch (a NIC's `TDH` register).
    pub tx_head: AtomicU32,
    /// Device loop iterations begun (to know the device has seen a register change).
    pub iterations: AtomicU64,
    /// Frames received into memory, all queues.
    pub rx_frames: AtomicU64,
    /// Bytes of those frames.
    pub rx_bytes: AtomicU64,
    /// Frames dropped for want of a queue or a free descriptor, all queues.
    pub rx_missed: AtomicU64,
    /// Times the device paused its source so.
    pub rx_pauses: AtomicU64,
    /// Frames dropped: too long.
    pub rx_oversize: AtomicU64,
    /// DMA faults (a descriptor naming memory the device may not touch).
    pub dma_faults: AtomicU64,
    /// Frames lost because their data could not be written (their descriptor is
    /// completed with [`DESC_ERR`]).
    pub rx_dma_errors: AtomicU64,
    /// Frames sent.
    pub tx_frames: AtomicU64,
    /// Bytes of those frames.
    pub tx_bytes: AtomicU64,
    /// Offloads: frames from the cable whose metadata the frame does not bear out,
    /// dropped.
    pub rx_bad_offload: AtomicU64,
    /// Offloads: large (GSO) frames received whole, over several descriptors.
    pub rx_gso: AtomicU64,
    /// Offloads: frames a guest queue got cut from a large or partially checksummed one
    /// (its completions carry no offload).
    pub rx_cut: AtomicU64,
    /// Offloads: packets whose context the frame does not bear out, not sent.
    pub tx_bad_offload: AtomicU64,
    /// Offloads: large (GSO) packets the driver handed over whole (to the cable whole
    /// if it takes them, else to the segmentation engine).
    pub tx_gso: AtomicU64,
    /// Offloads: frames the segmentation engine cut for a cable that takes no large
    /// frames (TSO).
    pub tx_tso_segments: AtomicU64,
    /// Interrupts raised, all lines.
    pub irqs: AtomicU64,
    /// Of those, raised by the maximum-delay timer rather than the packet count.
    pub timer_irqs: AtomicU64,
    /// How late, in total, the timer's interrupts came after their deadline (ns): the
    /// device thread's timed wait is the host's, which may fire late where a NIC's
    /// timer would not.
    pub timer_late_ns: AtomicU64,
    /// IOTLB lookups of the device's DMA that hit (published once per device-loop
    /// iteration from its DMA context's counts).
    pub iotlb_hits: AtomicU64,
    /// IOTLB lookups that missed and walked the I/O page tables.
    pub iotlb_misses: AtomicU64,
}

/// The device's counters as they stood when read (relaxed loads of the registers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct NicCounts {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub rx_missed: u64,
    pub rx_pauses: u64,
    pub rx_oversize: u64,
    pub dma_faults: u64,
    pub rx_dma_errors: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub rx_bad_offload: u64,
    pub rx_gso: u64,
    pub rx_cut: u64,
    pub tx_bad_offload: u64,
    pub tx_gso: u64,
    pub tx_tso_segments: u64,
    pub irqs: u64,
    pub default_queue_frames: u64,
    pub timer_irqs: u64,
    pub timer_late_ns: u64,
    pub iotlb_hits: u64,
    pub iotlb_misses: u64,
}

impl NicRegs {
    /// Every counter, as it stands now.
    pub fn counts(&self) -> NicCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NicCounts {
            rx_frames: l(&self.rx_frames),
            rx_bytes: l(&self.rx_bytes),
            rx_missed: l(&self.rx_missed),
            rx_pauses: l(&self.rx_pauses),
            rx_oversize: l(&self.rx_oversize),
            dma_faults: l(&self.dma_faults),
            rx_dma_errors: l(&self.rx_dma_errors),
            tx_frames: l(&self.tx_frames),
            tx_bytes: l(&self.tx_bytes),
            rx_bad_offload: l(&self.rx_bad_offload),
            rx_gso: l(&self.rx_gso),
            rx_cut: l(&self.rx_cut),
            tx_bad_offload: l(&self.tx_bad_offload),
            tx_gso: l(&self.tx_gso),
            tx_tso_segments: l(&self.tx_tso_segments),
            irqs: l(&self.irqs),
            default_queue_frames: l(&self.rxq[0].frames),
            timer_irqs: l(&self.timer_irqs),
            timer_late_ns: l(&self.timer_late_ns),
            iotlb_hits: l(&self.iotlb_hits),
            iotlb_misses: l(&self.iotlb_misses),
        }
    }
}

impl hv::counters::CounterSet for NicRegs {
    fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
        let c = self.counts();
        f("rx_frames", c.rx_frames);
        f("rx_bytes", c.rx_bytes);
        f("rx_missed", c.rx_missed);
        f("rx_pauses", c.rx_pauses);
        f("rx_oversize", c.rx_oversize);
        f("dma_faults", c.dma_faults);
        f("rx_dma_errors", c.rx_dma_errors);
        f("tx_frames", c.tx_frames);
        f("tx_bytes", c.tx_bytes);
        f("rx_bad_offload", c.rx_bad_offload);
        f("rx_gso", c.rx_gso);
        f("rx_cut", c.rx_cut);
        f("tx_bad_offload", c.tx_bad_offload);
        f("tx_gso", c.tx_gso);
        f("tx_tso_segments", c.tx_tso_segments);
        f("irqs", c.irqs);
        f("default_queue_frames", c.default_queue_frames);
        f("timer_irqs", c.timer_irqs);
        f("timer_late_ns", c.timer_late_ns);
        f("iotlb_hits", c.iotlb_hits);
        f("iotlb_misses", c.iotlb_misses);
    }
    fn snapshot(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        Some(Arc::new(self.counts()))
    }
}

impl NicRegs {
    /// The counters that count frames the device dropped, by reason.
    pub const DROPS: &'static [&'static str] = &[
        "rx_missed",
        "rx_oversize",
        "rx_dma_errors",
        "rx_bad_offload",
        "tx_bad_offload",
    ];

    fn new() -> Self {
        let rxq: [RxQueueRegs; RX_QUEUES] = std::array::from_fn(|_| RxQueueRegs::default());
        for q in &rxq {
            q.itr_pkts
                .store(Coalesce::default().pkts_per_irq, Ordering::Relaxed);
        }
        Self {
            rxq,
            filters: std::array::from_fn(|_| FilterRegs::default()),
            tx_base: AtomicU64::new(0),
            tx_tail: AtomicU32::new(0),
            tx_head: AtomicU32::new(0),
            enabled: AtomicBool::new(false),
            link_up: AtomicBool::new(false),
            iterations: AtomicU64::new(0),
            rx_frames: AtomicU64::new(0),
            rx_bytes: AtomicU64::new(0),
            rx_missed: AtomicU64::new(0),
            rx_paused: AtomicBool::new(false),
            rx_pauses: AtomicU64::new(0),
            rx_oversize: AtomicU64::new(0),
            dma_faults: AtomicU64::new(0),
            rx_dma_errors: AtomicU64::new(0),
            tx_frames: AtomicU64::new(0),
            tx_bytes: AtomicU64::new(0),
            rx_bad_offload: AtomicU64::new(0),
            rx_gso: AtomicU64::new(0),
            rx_cut: AtomicU64::new(0),
            tx_bad_offload: AtomicU64::new(0),
            tx_gso: AtomicU64::new(0),
            tx_tso_segments: AtomicU64::new(0),
            irqs: AtomicU64::new(0),
            timer_irqs: AtomicU64::new(0),
            timer_late_ns: AtomicU64::new(0),
            iotlb_hits: AtomicU64::new(0),
            iotlb_misses: AtomicU64::new(0),
            paused_line: LineBreak,
            device: LineBreak,
            resets: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            doze: Arc::default(),
        }
    }

    /// Steers frames to `mac` (tagged with VLAN `vlan`, or untagged if `None`) to
    /// queue `queue`, in filter entry `entry`.
    pub fn set_filter(
        &self,
        entry: usize,
        mac: [u8; 6],
        vlan: Option<u16>,
        queue: usize,
    ) -> Result<(), FilterError> {
        let f = self.filters.get(entry).ok_or(FilterError::NoEntry(entry))?;
        if queue >= RX_QUEUES {
            return Err(FilterError::NoQueue(queue));
        }
        if mac[0] & 1 != 0 {
            return Err(FilterError::GroupAddress);
        }
        // Invalid while it changes, so the device never matches half an entry.
        f.mac.store(0, Ordering::Release);
        f.vlan.store(
            vlan.map_or(FILTER_UNTAGGED, |v| u32::from(v & 0xfff)),
            Ordering::Relaxed,
        );
        f.queue.store(queue as u32, Ordering::Relaxed);
        f.mac.store(mac_bits(mac) | FILTER_VALID, Ordering::Release);
        Ok(())
    }

    /// Takes filter entry `entry` out of use; its frames go to the default queue.
    pub fn clear_filter(&self, entry: usize) -> Result<(), FilterError> {
        let f = self.filters.get(entry).ok_or(FilterError::NoEntry(entry))?;
        f.mac.store(0, Ordering::Release);
        Ok(())
    }

    /// The queue a frame goes to: the first valid filter that matches its destination
    /// and VLAN, else the default queue.
    fn classify(&self, frame: &[u8]) -> usize {
        let Some(dst) = frame.get(..6) else {
            return 0;
        };
        if dst[0] & 1 != 0 {
            return 0;
        }
        let mut mac = [0u8; 6];
        mac.copy_from_slice(dst);
        let want = mac_bits(mac) | FILTER_VALID;
        let vlan = match frame.get(12..16) {
            Some([0x81, 0x00, hi, lo]) => u32::from(u16::from_be_bytes([*hi, *lo]) & 0xfff),
            _ => FILTER_UNTAGGED,
        };
        self.filters
            .iter()
            .find(|f| {
                f.mac.load(Ordering::Acquire) == want && f.vlan.load(Ordering::Relaxed) == vlan
            })
            .map_or(0, |f| {
                (f.queue.load(Ordering::Relaxed) as usize).min(RX_QUEUES - 1)
            })
    }

    /// A PCIe function-level reset, as the toolstack does before giving a device to a
    /// new owner: the device stops, forgets its rings and pending completions, and
    /// waits to be programmed again. Returns once the device has seen it.
    pub fn function_reset(&self) {
        self.enabled.store(false, Ordering::Release);
        for q in &self.rxq {
            q.clear();
        }
        for f in &self.filters {
            f.mac.store(0, Ordering::Release);
        }
        self.tx_base.store(0, Ordering::Release);
        self.tx_tail.store(0, Ordering::Release);
        self.tx_head.store(0, Ordering::Release);
        self.resets.fetch_add(1, Ordering::AcqRel);
        self.wait_seen();
    }

    /// The TX doorbell: publishes descriptors up to `tail` and wakes an idle device.
    pub fn ring_tx_doorbell(&self, tail: u32) {
        self.tx_tail.store(tail, Ordering::SeqCst);
        self.doze.wake();
    }

    /// A frame arrived at the far end of the cable: wakes an idle device.
    pub fn wire_wake(&self) {
        self.doze.wake();
    }

    /// Publishes queue `q`'s RX descriptors up to `tail`, and wakes the device if it
    /// paused its source for want of them.
    pub fn set_rx_tail(&self, q: usize, tail: u32) {
        if let Some(r) = self.rxq.get(q) {
            // SeqCst, as the flag's: the tail before the flag is read here, the flag
            // before the tail is read again by the device, so one of the two sees the
            // other (a refill never sleeps through a pause).
            r.tail.store(tail, Ordering::SeqCst);
            if self.rx_paused.load(Ordering::SeqCst) && self.rx_paused.swap(false, Ordering::SeqCst)
            {
                self.doze.wake();
            }
        }
    }

    /// Returns once the device has begun a loop iteration after this call: a queue or
    /// filter turned off before it is not used again by the device.
    pub fn quiesce(&self) {
        self.wait_seen();
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
        // A stopped device uses nothing any more.
        while self.iterations.load(Ordering::Acquire) < seen + 2
            && !self.stop.load(Ordering::Acquire)
            && t0.elapsed() < Duration::from_secs(1)
        {
            self.doze.kick();
            std::thread::yield_now();
        }
    }

    /// Stops the device thread.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.doze.kick();
    }
}

/// A NIC: its registers, and the device thread once started.
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

/// No free descriptor on queue `q` for a frame (its tail as the device read it).
#[derive(Debug, Clone, Copy)]
struct NoRoom {
    q: usize,
    tail: u32,
}

struct Device {
    regs: Arc<NicRegs>,
    dma: DmaContext,
    coalesce: Coalesce,
    rxq: Vec<RxQueue>,
    tx_head: u32,
    frame: Vec<u8>,
    /// The offload of the packet being sent (from its context descriptor).
    tx_off: Offload,
    /// A received frame being finished for a guest queue, and one frame cut from it
    /// (or from a packet being sent).
    scratch: Vec<u8>,
    seg: Vec<u8>,
    /// The descriptors one received frame takes and the bytes each gets (reused, not
    /// zeroed per frame).
    rx_descs: [(Iova, Desc); MAX_RX_DESCS_PER_FRAME],
    rx_lens: [u16; MAX_RX_DESCS_PER_FRAME],
    /// Frames wait with a holding source for want of a descriptor: its readiness is
    /// not work until the driver refills (which wakes the device).
    holding: bool,
}

/// The device's own state of one receive queue.
#[derive(Debug, Default)]
struct RxQueue {
    /// Its interrupt line (MSI-X vector); a queue without one cannot be enabled.
    irq: Option<IrqLine>,
    head: u32,
    pending: u32,
    first_pending: Option<Instant>,
    last_pending: Option<Instant>,
}

impl RxQueue {
    fn reset(&mut self) {
        self.head = 0;
        self.pending = 0;
        self.first_pending = None;
        self.last_pending = None;
    }
}

fn mac_bits(mac: [u8; 6]) -> u64 {
    let mut b = [0u8; 8];
    b[..6].copy_from_slice(&mac);
    u64::from_le_bytes(b)
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
        let unit = NicUnit {
            dev: d,
            source: Some(source),
            sink,
            resets,
        };
        let j = sched.place(
            pcpu,
            hv::sched::UnitSpec::named(format!("nic{}", dev.0)),
            unit,
        )?;
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
            let s = self
                .source
                .take()
                .unwrap_or_else(|| Box::new(crate::wire::Silence));
            return Step::Done(s);
        }
        match self
            .dev
            .pass(source.as_mut(), self.sink.as_mut(), &mut self.resets)
        {
            None => Step::More,
            Some(until) => Step::Idle(Some(until)),
        }
    }
}

fn desc_iova(base: u64, i: u32) -> Iova {
    Iova(base + (i % RING_DESCS) as u64 * DESC_SIZE as u64)
}

impl Device {
    /// Fresh registers (interrupt moderation as `coalesce` says) and the device on them.
    fn with_regs(
        hv: &Arc<hv::Hypervisor>,
        dev: DeviceId,
        coalesce: Coalesce,
        irqs: Vec<IrqLine>,
    ) -> (Arc<NicRegs>, Self) {
        let regs = Arc::new(NicRegs::new());
        for q in &regs.rxq {
            q.itr_pkts
                .store(coalesce.pkts_per_irq.max(1), Ordering::Relaxed);
        }
        let d = Device::new(Arc::clone(&regs), hv.iommu().device(dev), coalesce, irqs);
        (regs, d)
    }

    fn new(regs: Arc<NicRegs>, dma: DmaContext, coalesce: Coalesce, irqs: Vec<IrqLine>) -> Self {
        let mut rxq: Vec<RxQueue> = (0..RX_QUEUES).map(|_| RxQueue::default()).collect();
        for (q, irq) in rxq.iter_mut().zip(irqs) {
            q.irq = Some(irq);
        }
        Self {
            regs,
            dma,
            coalesce,
            rxq,
            tx_head: 0,
            frame: vec![0; 65536],
            tx_off: Offload::NONE,
            scratch: vec![0; 65536],
            seg: vec![0; 2048],
            rx_descs: [(Iova(0), Desc::default()); MAX_RX_DESCS_PER_FRAME],
            rx_lens: [0; MAX_RX_DESCS_PER_FRAME],
            holding: false,
        }
    }

    /// One pass of the device: a reset taken, frames due from the wire received,
    /// descriptors the driver posted sent, interrupts raised; then what it waits for:
    /// `None` to run again at once, or the instant the next frame or interrupt is due
    /// (a millisecond from now when nothing is, or a doorbell comes first).
    fn pass(
        &mut self,
        source: &mut dyn WireSource,
        sink: &mut dyn WireSink,
        resets: &mut u64,
    ) -> Option<Instant> {
        let regs = Arc::clone(&self.regs);
        let r = regs.resets.load(Ordering::Acquire);
        if r != *resets {
            *resets = r;
            self.rxq.iter_mut().for_each(RxQueue::reset);
            self.tx_head = 0;
        }
        regs.iterations.fetch_add(1, Ordering::AcqRel);
        regs.iotlb_hits.store(self.dma.hits, Ordering::Relaxed);
        regs.iotlb_misses.store(self.dma.misses, Ordering::Relaxed);
        let now = Instant::now();
        if regs.enabled.load(Ordering::Acquire) {
            if regs.link_up.load(Ordering::Acquire) {
                if source.holds() {
                    self.receive_held(source, now);
                } else {
                    source.poll(now, &mut |f, off| self.receive(f, off));
                }
            }
            self.transmit(sink);
        }
        let now = Instant::now();
        // Until the next frame is due or the oldest completion's interrupt, or (idle)
        // until a doorbell.
        let mut wake = if regs.link_up.load(Ordering::Acquire) {
            source.next_due()
        } else {
            None
        };
        for q in 0..RX_QUEUES {
            self.maybe_interrupt(q, now);
            if self.rxq[q].pending > 0 {
                // With interrupts off the driver is polling and will see the
                // completions anyway; look again after a coalescing period.
                let from = if regs.rxq[q].irq_enabled.load(Ordering::Acquire) {
                    self.delay_start(q).unwrap_or(now)
                } else {
                    now
                };
                let d = from + self.coalesce.max_delay;
                wake = Some(wake.map_or(d, |w| w.min(d)));
            }
        }
        let now = Instant::now();
        if wake.is_some_and(|w| w <= now) {
            return None;
        }
        // Announce the sleep, then look once more: a doorbell or a frame that came
        // before the flag was seen must not be slept through. The fences pair with the
        // doorbell's and the wire's (store, fence, load on each side), so that one of
        // the two always sees the other.
        regs.doze.announce();
        let work = regs.tx_tail.load(Ordering::SeqCst) % RING_DESCS != self.tx_head
            || regs.stop.load(Ordering::Acquire)
            || (source.ready() && !self.holding && regs.link_up.load(Ordering::Acquire));
        if work {
            regs.doze.awake();
            return None;
        }
        // The wire is asked again: a frame put on it since the first look (its wake-up
        // found the device not yet asleep) is due in its serialization time, not at the
        // idle timeout.
        let due = if regs.link_up.load(Ordering::Acquire) {
            source.next_due()
        } else {
            None
        };
        let wake = match (wake, due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Some(wake.unwrap_or(now + Duration::from_millis(1)))
    }

    /// The device on a thread of its own: passes, parked between them.
    fn run(
        mut self,
        mut source: Box<dyn WireSource>,
        mut sink: Box<dyn WireSink>,
    ) -> Box<dyn WireSource> {
        let _ = mem::cpu::set_timer_slack(1_000);
        let regs = Arc::clone(&self.regs);
        source.attach(&regs.doze);
        let mut resets = regs.resets.load(Ordering::Acquire);
        while !regs.stop.load(Ordering::Acquire) {
            if let Some(until) = self.pass(source.as_mut(), sink.as_mut(), &mut resets) {
                std::thread::park_timeout(until.saturating_duration_since(Instant::now()));
                regs.doze.awake();
            }
        }
        source
    }

    /// Where the coalescing delay of queue `q`'s pending completions counts from.
    fn delay_start(&self, q: usize) -> Option<Instant> {
        match self.coalesce.delay_from {
            DelayFrom::FirstPacket => self.rxq[q].first_pending,
            DelayFrom::LastPacket => self.rxq[q].last_pending,
        }
    }

    /// Queue `q`'s completions per interrupt, as the driver last set them.
    fn itr(&self, q: usize) -> u32 {
        self.regs.rxq[q].itr_pkts.load(Ordering::Relaxed).max(1)
    }

    fn complete(&mut self, q: usize, now: Instant) {
        let st = &mut self.rxq[q];
        if st.pending == 0 {
            st.first_pending = Some(now);
        }
        st.last_pending = Some(now);
        st.pending += 1;
        // The count, and the delay too: the moderation timer runs on its own in a
        // NIC, so a long burst of work (a ring of large packets cut into frames) must
        // not hold back an interrupt that is due.
        self.maybe_interrupt(q, now);
    }

    fn maybe_interrupt(&mut self, q: usize, now: Instant) {
        if self.rxq[q].pending == 0 || !self.regs.rxq[q].irq_enabled.load(Ordering::Acquire) {
            return;
        }
        let count = self.rxq[q].pending >= self.itr(q);
        let deadline = self.delay_start(q).map(|t| t + self.coalesce.max_delay);
        let timer = !count && deadline.is_some_and(|d| now >= d);
        if timer {
            let late = deadline.map_or(0, |d| now.duration_since(d).as_nanos() as u64);
            self.regs.timer_irqs.fetch_add(1, Ordering::Relaxed);
            self.regs.timer_late_ns.fetch_add(late, Ordering::Relaxed);
        }
        if count || timer {
            let st = &mut self.rxq[q];
            st.pending = 0;
            st.first_pending = None;
            st.last_pending = None;
            self.regs.irqs.fetch_add(1, Ordering::Relaxed);
            self.regs.rxq[q].irqs.fetch_add(1, Ordering::Relaxed);
            if let Some(irq) = &st.irq {
                irq.raise();
            }
        }
    }

    /// Frames from a source that holds them (a TAP), as long as the default queue has
    /// room: the first refused stays with the source, and the device pauses it until
    /// the driver's next RX tail write (link-level flow control: what cannot be
    /// received is not read, rather than read and dropped).
    fn receive_held(&mut self, source: &mut dyn WireSource, now: Instant) {
        let mut refused = None;
        source.poll_held(now, &mut |f, off| match self.take(f, off) {
            Ok(()) => true,
            // A guest's own queue without room drops its frame, as a VMDq NIC's queue
            // with drop enabled does: one guest that posts no buffers must not pause
            // the cable for the others. Only the default queue pauses it.
            Err(e) if e.q != 0 => {
                self.missed(e);
                true
            }
            Err(e) => {
                refused = Some(e);
                false
            }
        });
        self.holding = false;
        let Some(e) = refused else {
            return;
        };
        // Pause, then look at the tail again: a refill that came before the flag was
        // up did not see it (SeqCst on both sides; see `NicRegs::set_rx_tail`).
        self.regs.rx_paused.store(true, Ordering::SeqCst);
        if self.regs.rxq[e.q].tail.load(Ordering::SeqCst) == e.tail {
            self.holding = true;
            self.regs.rx_pauses.fetch_add(1, Ordering::Relaxed);
        } else {
            self.regs.rx_paused.store(false, Ordering::Relaxed);
        }
    }

    /// A frame from the wire, with what rides beside it: into the free descriptors'
    /// buffers of the queue its destination is steered to. Metadata from the cable is
    /// checked against the frame first, like anything from outside.
    fn receive(&mut self, frame: &[u8], off: Offload) {
        if let Err(e) = self.take(frame, off) {
            self.missed(e);
        }
    }

    /// A frame from a source that holds what the device refuses (a TAP): taken
    /// (received, or dropped for a reason no refill cures), or refused for want of a
    /// free descriptor, to stay first in the source's line.
    fn take(&mut self, frame: &[u8], off: Offload) -> Result<(), NoRoom> {
        let regs = Arc::clone(&self.regs);
        let partial = matches!(off.csum, Csum::Partial { .. });
        if (partial || off.gso.is_some())
            && net::offload::validate(&off, &frame[..frame.len().min(MAX_HEADERS)], frame.len())
                .is_err()
        {
            regs.rx_bad_offload.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if frame.len() > MAX_FRAME && off.gso.is_none() {
            regs.rx_oversize.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.receive_or_refuse(frame, off)
    }

    /// A checked frame into its queue, or its queue's lack of room.
    fn receive_or_refuse(&mut self, frame: &[u8], off: Offload) -> Result<(), NoRoom> {
        let q = self.regs.classify(frame);
        let partial = matches!(off.csum, Csum::Partial { .. });
        if q != 0 && (partial || off.gso.is_some()) {
            // A guest queue's completions carry no offload: it gets what a cable of
            // MTU-sized frames would have brought, checksums complete. (Cut frames
            // that find no room are dropped as a cable's: their first parts are in.)
            self.receive_cut(q, frame, off);
            return Ok(());
        }
        self.receive_one(q, frame, off)
    }

    /// Counts a frame dropped for want of a descriptor on its queue.
    fn missed(&self, e: NoRoom) {
        self.regs.rxq[e.q].missed.fetch_add(1, Ordering::Relaxed);
        self.regs.rx_missed.fetch_add(1, Ordering::Relaxed);
    }

    /// Cuts a large or partially checksummed frame into complete frames for queue `q`.
    fn receive_cut(&mut self, q: usize, frame: &[u8], off: Offload) {
        let (mut scratch, mut seg) = (
            std::mem::take(&mut self.scratch),
            std::mem::take(&mut self.seg),
        );
        let f = &mut scratch[..frame.len()];
        f.copy_from_slice(frame);
        if let Ok(l4) = net::offload::checksum_setup(&f[..f.len().min(MAX_HEADERS)], f.len()) {
            let done = match off.gso {
                Some(g) => net::offload::segment_tcpv4(f, &l4, g.size.into(), &mut seg, |s| {
                    self.regs.rx_cut.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = self.receive_one(q, s, Offload::NONE) {
                        self.missed(e);
                    }
                })
                .is_ok(),
                None => {
                    let ok = net::offload::fill_partial(f, l4.l4, l4.csum_offset).is_ok();
                    if ok {
                        self.regs.rx_cut.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = self.receive_one(q, f, Offload::NONE) {
                            self.missed(e);
                        }
                    }
                    ok
                }
            };
            if !done {
                self.regs.rx_bad_offload.fetch_add(1, Ordering::Relaxed);
            }
        }
        (self.scratch, self.seg) = (scratch, seg);
    }

    /// One frame into queue `q`: as many descriptors as its length needs (each
    /// descriptor's buffer as long as its length field says; 0 means a full frame),
    /// data first (non-temporal, fenced), then the write-backs from the last to the
    /// first, so that the driver never sees the first done before the rest. The last
    /// carries end-of-packet and the offload. A frame without enough free descriptors
    /// is dropped whole, nothing written.
    fn receive_one(&mut self, q: usize, frame: &[u8], off: Offload) -> Result<(), NoRoom> {
        let regs = Arc::clone(&self.regs);
        let qr = &regs.rxq[q];
        // Queue 0 is on whenever the device is; another only once enabled, with a line.
        let on = q == 0 || (qr.enabled.load(Ordering::Acquire) && self.rxq[q].irq.is_some());
        let head = self.rxq[q].head;
        let tail = qr.tail.load(Ordering::Acquire);
        if !on {
            qr.missed.fetch_add(1, Ordering::Relaxed);
            regs.rx_missed.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if head == tail {
            return Err(NoRoom { q, tail });
        }
        let base = qr.base.load(Ordering::Relaxed);
        let (descs, lens) = (&mut self.rx_descs, &mut self.rx_lens);
        let (mut k, mut room, mut h) = (0, 0usize, head);
        while room < frame.len().max(1) {
            if h == tail {
                return Err(NoRoom { q, tail });
            }
            if k == MAX_RX_DESCS_PER_FRAME {
                // Descriptors too short for the frame: no refill makes room for it.
                qr.missed.fetch_add(1, Ordering::Relaxed);
                regs.rx_missed.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            let at = desc_iova(base, h);
            let mut raw = [0u8; DESC_SIZE];
            if self.dma.dma_read(at, &mut raw).is_err() {
                regs.dma_faults.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            let d: Desc = bytemuck::pod_read_unaligned(&raw);
            room += if d.len == 0 {
                MAX_FRAME
            } else {
                usize::from(d.len)
            };
            descs[k] = (at, d);
            k += 1;
            h = (h + 1) % RING_DESCS;
        }
        // Data first. A write that faults (part of it may have landed) completes every
        // descriptor of the frame with the error bit and no length, so the driver
        // drops it and recycles the buffers instead of handing up what they held.
        let mut done = 0;
        let mut failed = false;
        for (j, (_, d)) in descs[..k].iter().enumerate() {
            let cap = if d.len == 0 {
                MAX_FRAME
            } else {
                usize::from(d.len)
            };
            let n = (frame.len() - done).min(cap);
            if !failed
                && self
                    .dma
                    .dma_write(Iova(d.addr), &frame[done..done + n])
                    .is_err()
            {
                failed = true;
            }
            lens[j] = n as u16;
            done += n;
        }
        if failed {
            regs.dma_faults.fetch_add(1, Ordering::Relaxed);
            regs.rx_dma_errors.fetch_add(1, Ordering::Relaxed);
        }
        let offloaded = off != Offload::NONE;
        let last_status = if failed {
            DESC_DD | DESC_EOP | DESC_ERR
        } else if offloaded {
            DESC_DD | DESC_EOP | DESC_OFFLOAD
        } else if net::wire::l4_checksum(frame) == Some(true) {
            DESC_DD | DESC_EOP | DESC_L4_OK
        } else {
            DESC_DD | DESC_EOP
        };
        for j in (0..k).rev() {
            let (at, d) = descs[j];
            let last = j + 1 == k;
            let wb = Desc {
                addr: if last && offloaded && !failed {
                    off.to_bits()
                } else {
                    d.addr
                },
                len: if failed { 0 } else { lens[j] },
                status: if last {
                    last_status
                } else if failed {
                    DESC_DD | DESC_ERR
                } else {
                    DESC_DD
                },
                flags: 0,
                pad: 0,
            };
            if self.dma.dma_write(at, bytemuck::bytes_of(&wb)).is_err() {
                regs.dma_faults.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
        self.rxq[q].head = h;
        qr.frames.fetch_add(1, Ordering::Relaxed);
        regs.rx_frames.fetch_add(1, Ordering::Relaxed);
        if !failed {
            regs.rx_bytes
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            if off.gso.is_some() {
                regs.rx_gso.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.complete(q, Instant::now());
        Ok(())
    }

    /// Puts one packet on the cable. A large one is cut into MTU-sized frames by the
    /// segmentation engine (TSO), checksums complete, as a NIC puts it on a wire. A
    /// partial checksum goes as it is to a far end that takes it (a virtio-net
    /// cable), else the checksum engine fills it in. A context the packet's headers do
    /// not bear out is counted, and nothing sent.
    ///
    /// Large frames are not handed to the cable whole, though a TAP would take them: so
    /// written into the outside namespace, TCP through `pvio up` stalled for hundreds
    /// of milliseconds at a time (the sender's retransmission timer fired while the
    /// receiver's acknowledgements sat unread; see `docs/results/up.md`), where the
    /// same packets cut into frames flow steadily.
    fn send(&mut self, sink: &mut dyn WireSink, len: usize, off: Offload) {
        let regs = Arc::clone(&self.regs);
        let frame = &mut self.frame[..len];
        let partial = matches!(off.csum, Csum::Partial { .. });
        let count = |n: usize| {
            regs.tx_frames.fetch_add(1, Ordering::Relaxed);
            regs.tx_bytes.fetch_add(n as u64, Ordering::Relaxed);
        };
        if !partial && off.gso.is_none() {
            sink.transmit(frame, Offload::NONE);
            count(len);
            return;
        }
        let Ok(Some(l4)) = net::offload::validate(&off, &frame[..len.min(MAX_HEADERS)], len) else {
            regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // A cable whose far end takes offloads (a TAP with a virtio-net header: the
        // host's stack, which cuts or re-aggregates as it needs) gets the packet
        // whole, as a NIC's TSO output is re-aggregated by the receiver's GRO; any
        // other gets frames the segmentation and checksum engines finish.
        if sink.takes_offload() {
            regs.tx_gso
                .fetch_add(u64::from(off.gso.is_some()), Ordering::Relaxed);
            sink.transmit(frame, off);
            count(len);
            return;
        }
        match off.gso {
            Some(g) => {
                regs.tx_gso.fetch_add(1, Ordering::Relaxed);
                let r =
                    net::offload::segment_tcpv4(frame, &l4, g.size.into(), &mut self.seg, |f| {
                        regs.tx_tso_segments.fetch_add(1, Ordering::Relaxed);
                        sink.transmit(f, Offload::NONE);
                        count(f.len());
                    });
                if r.is_err() {
                    regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                if net::offload::fill_partial(frame, l4.l4, l4.csum_offset).is_ok() {
                    sink.transmit(frame, Offload::NONE);
                    count(len);
                } else {
                    regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Sends every packet the driver queued.
    fn transmit(&mut self, sink: &mut dyn WireSink) {
        self.transmit_ring(sink);
        sink.flush();
    }

    /// Hands every packet on the transmit ring to the cable.
    fn transmit_ring(&mut self, sink: &mut dyn WireSink) {
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
            if d.flags & DESC_CTX != 0 {
                // The next packet's offload; a context no encoder writes spoils it.
                match Offload::from_bits(d.addr) {
                    Some(o) => self.tx_off = o,
                    None => {
                        self.tx_off = Offload::NONE;
                        bad = true;
                        regs.tx_bad_offload.fetch_add(1, Ordering::Relaxed);
                    }
                }
                d.status = DESC_DD;
                let _ = self.dma.dma_write(at, bytemuck::bytes_of(&d));
                self.tx_head = (self.tx_head + 1) % RING_DESCS;
                regs.tx_head.store(self.tx_head, Ordering::Release);
                continue;
            }
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
            regs.tx_head.store(self.tx_head, Ordering::Release);
            if eop {
                let off = std::mem::take(&mut self.tx_off);
                if !bad {
                    self.send(sink, len, off);
                }
                len = 0;
                bad = false;
                self.complete(0, Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No false sharing between the driver's core and the device's: the registers the
    /// driver writes, the flag both write and the counters the device writes are each
    /// on lines of their own, in every receive queue too.
    #[test]
    fn the_drivers_registers_and_the_devices_counters_keep_to_lines_of_their_own() {
        use std::mem::{align_of, offset_of, size_of};
        let line = |off: usize| off / 64;
        let driver = [
            offset_of!(NicRegs, tx_base),
            offset_of!(NicRegs, tx_tail),
            offset_of!(NicRegs, enabled),
            offset_of!(NicRegs, link_up),
            offset_of!(NicRegs, resets),
            offset_of!(NicRegs, stop),
        ];
        let both = [offset_of!(NicRegs, rx_paused)];
        let device = [
            offset_of!(NicRegs, tx_head),
            offset_of!(NicRegs, iterations),
            offset_of!(NicRegs, rx_frames),
            offset_of!(NicRegs, rx_bytes),
            offset_of!(NicRegs, rx_missed),
            offset_of!(NicRegs, rx_pauses),
            offset_of!(NicRegs, tx_frames),
            offset_of!(NicRegs, tx_bytes),
            offset_of!(NicRegs, irqs),
            offset_of!(NicRegs, timer_irqs),
            offset_of!(NicRegs, iotlb_hits),
            offset_of!(NicRegs, iotlb_misses),
        ];
        let apart = |a: &[usize], b: &[usize], what: &str| {
            for x in a {
                for y in b {
                    assert_ne!(
                        line(*x),
                        line(*y),
                        "{what}: offsets {x} and {y} share a line"
                    );
                }
            }
        };
        apart(&driver, &device, "driver and device");
        apart(&driver, &both, "driver and the pause flag");
        apart(&both, &device, "the pause flag and device");
        assert_eq!(align_of::<NicRegs>(), 64, "the registers start a line");
        // A queue: the driver's registers on one line, the device's counters on the
        // next, and each queue on lines no other queue's words are on.
        assert_eq!(size_of::<RxQueueRegs>() % 64, 0);
        let regs = [
            offset_of!(RxQueueRegs, base),
            offset_of!(RxQueueRegs, tail),
            offset_of!(RxQueueRegs, itr_pkts),
            offset_of!(RxQueueRegs, irq_enabled),
            offset_of!(RxQueueRegs, enabled),
        ];
        let counters = [
            offset_of!(RxQueueRegs, frames),
            offset_of!(RxQueueRegs, missed),
            offset_of!(RxQueueRegs, irqs),
        ];
        apart(&regs, &counters, "a queue's registers and counters");
        let queues = offset_of!(NicRegs, rxq);
        let all_queues = queues + RX_QUEUES * size_of::<RxQueueRegs>();
        let first_other = driver.iter().chain(&device).chain(&both).copied().min();
        assert!(
            first_other.is_some_and(|o| o >= all_queues),
            "the queues come first"
        );
    }
    use hv::{DomainConfig, Gfn, HvConfig, Hypervisor};

    /// A hypervisor and the driver domain whose memory the NIC's rings live in.
    fn driver_domain() -> (Arc<Hypervisor>, Arc<hv::Domain>) {
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
        (hv, d)
    }

    /// Frames that wait outside until the device takes them (a TAP's queue).
    struct Holding(std::collections::VecDeque<Vec<u8>>);

    impl WireSource for Holding {
        fn poll(&mut self, _now: Instant, _emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
            unreachable!("a holding source is polled with poll_held")
        }
        fn next_due(&self) -> Option<Instant> {
            None
        }
        fn ready(&self) -> bool {
            !self.0.is_empty()
        }
        fn holds(&self) -> bool {
            true
        }
        fn poll_held(
            &mut self,
            _now: Instant,
            emit: &mut dyn FnMut(&[u8], Offload) -> bool,
        ) -> usize {
            let mut n = 0;
            while let Some(f) = self.0.front() {
                if !emit(f, Offload::NONE) {
                    break;
                }
                self.0.pop_front();
                n += 1;
            }
            n
        }
    }

    #[test]
    fn a_source_that_holds_keeps_what_the_ring_has_no_room_for_until_the_driver_refills() {
        let (hv, d) = driver_domain();
        let ring = d.alloc_page().expect("p");
        let ring_iova = 0x10_000u64;
        hv.iommu_map(&d, Iova(ring_iova), ring, true).expect("map");
        let mut bufs = Vec::new();
        for i in 0..4u64 {
            let b = d.alloc_page().expect("p");
            let at = 0x20_000 + i * 0x1000;
            hv.iommu_map(&d, Iova(at), b, true).expect("map");
            let desc = Desc {
                addr: at,
                ..Default::default()
            };
            d.write(ring, i as usize * DESC_SIZE, bytemuck::bytes_of(&desc))
                .expect("desc");
            bufs.push(b);
        }
        hv.iommu_attach(DeviceId(9), &d).expect("attach");
        let regs = Arc::new(NicRegs::new());
        regs.rxq[0].base.store(ring_iova, Ordering::Relaxed);
        regs.enabled.store(true, Ordering::Relaxed);
        regs.link_up.store(true, Ordering::Relaxed);
        let mut dev = Device::new(
            Arc::clone(&regs),
            hv.iommu().device(DeviceId(9)),
            Coalesce::default(),
            vec![IrqLine::Native(Arc::default())],
        );
        let frames: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 100]).collect();
        let mut src = Holding(frames.iter().cloned().collect());
        let mut sink = crate::wire::CountingSink::default();
        let mut resets = 0;
        // No descriptor posted: nothing is read, nothing is lost, the device pauses.
        dev.pass(&mut src, &mut sink, &mut resets);
        assert_eq!(src.0.len(), 6);
        assert_eq!(regs.rx_missed.load(Ordering::Relaxed), 0);
        assert!(regs.rx_paused.load(Ordering::Relaxed));
        assert_eq!(regs.rx_pauses.load(Ordering::Relaxed), 1);
        // Two buffers: two frames in, the rest wait; the refill lifted the pause.
        regs.set_rx_tail(0, 2);
        assert!(
            !regs.rx_paused.load(Ordering::Relaxed),
            "a refill lifts the pause"
        );
        dev.pass(&mut src, &mut sink, &mut resets);
        assert_eq!(src.0.len(), 4);
        assert_eq!(regs.rx_frames.load(Ordering::Relaxed), 2);
        // Two more: two more in, in order, and still nothing missed.
        regs.set_rx_tail(0, 4);
        dev.pass(&mut src, &mut sink, &mut resets);
        assert_eq!(src.0.len(), 2);
        assert_eq!(regs.rx_frames.load(Ordering::Relaxed), 4);
        assert_eq!(regs.rx_missed.load(Ordering::Relaxed), 0);
        for (b, f) in bufs.iter().zip(&frames) {
            let mut got = vec![0u8; f.len()];
            d.read(*b, 0, &mut got).expect("data");
            assert_eq!(&got, f);
        }
    }

    #[test]
    fn a_guest_queue_without_buffers_drops_its_own_frames_and_pauses_nobody() {
        let (hv, d) = driver_domain();
        let ring = d.alloc_page().expect("p");
        hv.iommu_map(&d, Iova(0x10_000), ring, true).expect("map");
        for i in 0..2u64 {
            let b = d.alloc_page().expect("p");
            hv.iommu_map(&d, Iova(0x20_000 + i * 0x1000), b, true)
                .expect("map");
            let desc = Desc {
                addr: 0x20_000 + i * 0x1000,
                ..Default::default()
            };
            d.write(ring, i as usize * DESC_SIZE, bytemuck::bytes_of(&desc))
                .expect("desc");
        }
        hv.iommu_attach(DeviceId(10), &d).expect("attach");
        let regs = Arc::new(NicRegs::new());
        regs.rxq[0].base.store(0x10_000, Ordering::Relaxed);
        regs.rxq[0].tail.store(2, Ordering::Relaxed);
        // Queue 1 is a guest's, steered to by its MAC, enabled, and given no buffer.
        let guest = [0x02, 0, 0, 0, 0, 0x42];
        regs.filters[0]
            .mac
            .store(mac_bits(guest) | FILTER_VALID, Ordering::Relaxed);
        regs.filters[0]
            .vlan
            .store(FILTER_UNTAGGED, Ordering::Relaxed);
        regs.filters[0].queue.store(1, Ordering::Relaxed);
        regs.rxq[1].enabled.store(true, Ordering::Relaxed);
        regs.enabled.store(true, Ordering::Relaxed);
        regs.link_up.store(true, Ordering::Relaxed);
        let mut dev = Device::new(
            Arc::clone(&regs),
            hv.iommu().device(DeviceId(10)),
            Coalesce::default(),
            vec![
                IrqLine::Native(Arc::default()),
                IrqLine::Native(Arc::default()),
            ],
        );
        let to = |mac: [u8; 6]| {
            let mut f = vec![0x11u8; 100];
            f[..6].copy_from_slice(&mac);
            f
        };
        let other = [0x02, 0, 0, 0, 0, 0x43];
        let mut src = Holding([to(guest), to(other), to(other)].into_iter().collect());
        let mut sink = crate::wire::CountingSink::default();
        dev.pass(&mut src, &mut sink, &mut 0);
        assert!(
            src.0.is_empty(),
            "nothing held back behind the guest's queue"
        );
        assert_eq!(regs.rxq[1].missed.load(Ordering::Relaxed), 1);
        assert_eq!(regs.rx_frames.load(Ordering::Relaxed), 2);
        assert_eq!(regs.rx_pauses.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_frame_whose_dma_faults_completes_its_descriptor_with_an_error_and_no_data() {
        let (hv, d) = driver_domain();
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
        regs.rxq[0].base.store(ring_iova, Ordering::Relaxed);
        regs.rxq[0].tail.store(2, Ordering::Relaxed);
        let mut dev = Device::new(
            Arc::clone(&regs),
            hv.iommu().device(DeviceId(7)),
            Coalesce::default(),
            vec![IrqLine::Native(Arc::default())],
        );
        let frame = [0x5au8; 200];
        dev.receive(&frame, Offload::NONE);
        dev.receive(&frame, Offload::NONE);
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
            regs.rxq[0].irq_enabled.store(true, Ordering::Relaxed);
            regs.rxq[0].itr_pkts.store(64, Ordering::Relaxed);
            Device::new(
                regs,
                hv.iommu().device(DeviceId(8)),
                Coalesce {
                    pkts_per_irq: 64,
                    max_delay: Duration::from_micros(18),
                    delay_from,
                    adaptive: false,
                },
                vec![IrqLine::Native(Arc::default())],
            )
        };
        let irqs = |d: &Device| d.regs.irqs.load(Ordering::Relaxed);
        let t0 = Instant::now();
        let us = |n: u64| t0 + Duration::from_micros(n);
        for from in [DelayFrom::FirstPacket, DelayFrom::LastPacket] {
            let mut d = device(from);
            // Ten packets 10 µs apart: closer together than the delay.
            for k in 0..10 {
                d.complete(0, us(10 * k));
                d.maybe_interrupt(0, us(10 * k));
            }
            match from {
                // An interrupt once the oldest has waited 18 µs: at 20, 50 and 80.
                DelayFrom::FirstPacket => assert_eq!(irqs(&d), 3),
                // Each packet restarted the delay: nothing yet.
                DelayFrom::LastPacket => assert_eq!(irqs(&d), 0),
            }
            // The timer is checked 5 µs after the last packet's deadline.
            d.maybe_interrupt(0, us(90 + 18 + 5));
            assert_eq!(
                d.rxq[0].pending, 0,
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
        d.regs.rxq[0].itr_pkts.store(2, Ordering::Relaxed);
        d.complete(0, us(0));
        d.complete(0, us(1));
        assert_eq!(irqs(&d), 1);
        assert_eq!(d.regs.timer_irqs.load(Ordering::Relaxed), 0, "the count's");
        // Completions back to back, the device never resting between them (a ring of
        // large packets cut into frames for the cable): the delay is honoured at each
        // completion, as a NIC's moderation timer runs beside its DMA engine.
        let mut d = device(DelayFrom::FirstPacket);
        for k in 0..3 {
            d.complete(0, us(10 * k));
        }
        assert_eq!(irqs(&d), 1, "the oldest waited 20 µs of 18");
    }

    /// A device with a ring of four posted buffers on each queue it has a line for, in
    /// one domain's memory, for the steering tests.
    struct Rig {
        dom: Arc<hv::Domain>,
        regs: Arc<NicRegs>,
        dev: Device,
        lines: Vec<Arc<crate::irq::NativeIrq>>,
        bufs: Vec<Vec<Gfn>>,
        rings: Vec<Gfn>,
        _hv: Arc<Hypervisor>,
    }

    const POSTED: u32 = 4;
    const MAC_A: [u8; 6] = [2, 0, 0, 0, 0, 0xa];
    const MAC_B: [u8; 6] = [2, 0, 0, 0, 0, 0xb];

    fn rig(queues: usize) -> Rig {
        let hv = Hypervisor::new(HvConfig {
            frames: 1024,
            ..Default::default()
        })
        .expect("hv");
        let dom = hv
            .create_domain(&DomainConfig {
                pages: 256,
                driver_domain: true,
                ..Default::default()
            })
            .expect("dom");
        hv.iommu_attach(DeviceId(9), &dom).expect("attach");
        let regs = Arc::new(NicRegs::new());
        let lines: Vec<Arc<crate::irq::NativeIrq>> = (0..queues).map(|_| Arc::default()).collect();
        let (mut rings, mut bufs) = (Vec::new(), Vec::new());
        for q in 0..queues {
            let ring = dom.alloc_page().expect("ring");
            let ring_iova = 0x100_000 + q as u64 * 0x10_000;
            hv.iommu_map(&dom, Iova(ring_iova), ring, true)
                .expect("map");
            let mut b = Vec::new();
            for k in 0..POSTED as usize {
                let g = dom.alloc_page().expect("buf");
                let iova = 0x200_000 + q as u64 * 0x10_000 + k as u64 * 0x1000;
                hv.iommu_map(&dom, Iova(iova), g, true).expect("map");
                let desc = Desc {
                    addr: iova,
                    ..Default::default()
                };
                dom.write(ring, k * DESC_SIZE, bytemuck::bytes_of(&desc))
                    .expect("desc");
                b.push(g);
            }
            let r = &regs.rxq[q];
            r.base.store(ring_iova, Ordering::Relaxed);
            r.tail.store(POSTED, Ordering::Relaxed);
            r.itr_pkts.store(1, Ordering::Relaxed);
            r.irq_enabled.store(true, Ordering::Relaxed);
            r.enabled.store(true, Ordering::Relaxed);
            rings.push(ring);
            bufs.push(b);
        }
        let dev = Device::new(
            Arc::clone(&regs),
            hv.iommu().device(DeviceId(9)),
            Coalesce::default(),
            lines
                .iter()
                .map(|l| IrqLine::Native(Arc::clone(l)))
                .collect(),
        );
        Rig {
            dom,
            regs,
            dev,
            lines,
            bufs,
            rings,
            _hv: hv,
        }
    }

    /// A frame to `dst`, tagged with `vlan` if given, its payload `seed`.
    fn frame_to(dst: [u8; 6], vlan: Option<u16>, seed: u8) -> Vec<u8> {
        let mut f = dst.to_vec();
        f.extend_from_slice(&[2, 0, 0, 0, 0, 1]);
        if let Some(v) = vlan {
            f.extend_from_slice(&[0x81, 0x00]);
            f.extend_from_slice(&v.to_be_bytes());
        }
        f.extend_from_slice(&[0x88, 0xb5]);
        f.extend((0..100).map(|i: u8| i ^ seed));
        f
    }

    impl Rig {
        fn frames(&self, q: usize) -> u64 {
            self.regs.rxq[q].frames.load(Ordering::Relaxed)
        }
        fn missed(&self, q: usize) -> u64 {
            self.regs.rxq[q].missed.load(Ordering::Relaxed)
        }
        /// The bytes in queue `q`'s `k`th buffer, as its descriptor's length says.
        fn got(&self, q: usize, k: usize) -> Vec<u8> {
            let mut raw = [0u8; DESC_SIZE];
            self.dom
                .read(self.rings[q], k * DESC_SIZE, &mut raw)
                .expect("desc");
            let d: Desc = bytemuck::pod_read_unaligned(&raw);
            let mut b = vec![0u8; d.len as usize];
            self.dom.read(self.bufs[q][k], 0, &mut b).expect("data");
            b
        }
    }

    /// A TCP/IPv4 frame to `dst` with `payload` bytes, its checksum left partial; and
    /// its offload with GSO segment size `mss`.
    fn tcp_to(dst: [u8; 6], payload: usize, mss: u16) -> (Vec<u8>, Offload) {
        let mut f = dst.to_vec();
        f.extend_from_slice(&[2, 0, 0, 0, 0, 1, 0x08, 0x00]);
        let total = (40 + payload) as u16;
        let mut ip = [0u8; 20];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        ip[8] = 64;
        ip[9] = 6;
        ip[12..16].copy_from_slice(&[10, 0, 0, 1]);
        ip[16..20].copy_from_slice(&[10, 0, 0, 2]);
        let sum = !smoltcp::wire::checksum::data(&ip);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        f.extend_from_slice(&ip);
        let mut tcp = [0u8; 20];
        tcp[12] = 5 << 4;
        tcp[13] = 0x18;
        f.extend_from_slice(&tcp);
        f.extend((0..payload).map(|i| (i % 251) as u8));
        let l4 = net::offload::checksum_setup(&f, f.len()).expect("tcp");
        net::offload::set_pseudo(&mut f, &l4);
        let off = Offload {
            csum: l4.partial(),
            gso: Some(net::netif::Gso {
                size: mss,
                ty: net::netif::XEN_NETIF_GSO_TYPE_TCPV4,
            }),
        };
        (f, off)
    }

    #[test]
    fn a_large_frame_fills_several_descriptors_and_bad_cable_metadata_is_dropped() {
        let mut r = rig(2);
        r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
        let other = [2, 0, 0, 0, 0, 0xc];
        // 5000 bytes: four buffers of a full frame each (their length field is 0).
        let (big, off) = tcp_to(other, 4946, 1448);
        r.dev.receive(&big, off);
        assert_eq!(r.frames(0), 1);
        let descs: Vec<Desc> = (0..4)
            .map(|k| {
                let mut raw = [0u8; DESC_SIZE];
                r.dom
                    .read(r.rings[0], k * DESC_SIZE, &mut raw)
                    .expect("desc");
                bytemuck::pod_read_unaligned(&raw)
            })
            .collect();
        assert!(descs.iter().all(|d| d.status & DESC_DD != 0));
        assert!(descs[..3].iter().all(|d| d.status & DESC_EOP == 0));
        assert_eq!(
            descs[3].status & (DESC_EOP | DESC_OFFLOAD),
            DESC_EOP | DESC_OFFLOAD
        );
        assert_eq!(
            Offload::from_bits(descs[3].addr),
            Some(off),
            "the write-back"
        );
        let mut got = Vec::new();
        for (k, d) in descs.iter().enumerate() {
            let mut b = vec![0u8; d.len as usize];
            r.dom.read(r.bufs[0][k], 0, &mut b).expect("data");
            got.extend(b);
        }
        assert_eq!(got, big, "every byte, in order");
        assert_eq!(r.regs.rx_gso.load(Ordering::Relaxed), 1);
        // From the cable: a GSO size of 0, a checksum offset off the headers, a large
        // frame without GSO. Each dropped and counted; no descriptor used.
        let zero = Offload {
            gso: off.gso.map(|g| net::netif::Gso { size: 0, ..g }),
            ..off
        };
        let skewed = Offload {
            csum: Csum::Partial {
                start: 34,
                offset: 6,
            },
            ..off
        };
        r.dev.receive(&big, zero);
        r.dev.receive(&big, skewed);
        r.dev.receive(&big, Offload::NONE);
        assert_eq!(r.regs.rx_bad_offload.load(Ordering::Relaxed), 2);
        assert_eq!(r.regs.rx_oversize.load(Ordering::Relaxed), 1);
        assert_eq!(r.frames(0), 1);
        // A guest queue's completions carry no offload: it gets the frame cut to
        // frames with complete checksums (its four buffers hold the first four).
        let (to_a, aoff) = tcp_to(MAC_A, 4000, 1000);
        r.dev.receive(&to_a, aoff);
        assert_eq!(r.frames(1), 4);
        for k in 0..4 {
            let f = r.got(1, k);
            let l4 = net::offload::checksum_setup(&f, f.len()).expect("a frame");
            assert!(net::offload::verify(&f, &l4), "segment {k}");
            assert_eq!(f.len(), 54 + 1000);
        }
        assert_eq!(r.missed(1), 0);
        assert_eq!(r.regs.rx_cut.load(Ordering::Relaxed), 4);
    }

    /// What a cable was given: each frame and its offload.
    #[derive(Default)]
    struct Cable {
        takes: bool,
        got: Vec<(Vec<u8>, Offload)>,
    }
    impl WireSink for Cable {
        fn transmit(&mut self, frame: &[u8], off: Offload) {
            self.got.push((frame.to_vec(), off));
        }
        fn takes_offload(&self) -> bool {
            self.takes
        }
    }

    #[test]
    fn a_large_packet_goes_whole_to_a_cable_that_takes_it_and_cut_with_checksums_to_one_that_does_not(
    ) {
        let mut r = rig(1);
        let (big, off) = tcp_to([2, 0, 0, 0, 0, 0xc], 4000, 1000);
        for takes in [true, false] {
            let mut cable = Cable {
                takes,
                ..Cable::default()
            };
            r.dev.frame[..big.len()].copy_from_slice(&big);
            r.dev.send(&mut cable, big.len(), off);
            if takes {
                assert_eq!(
                    cable.got,
                    vec![(big.clone(), off)],
                    "whole, with its offload"
                );
                assert_eq!(r.regs.tx_tso_segments.load(Ordering::Relaxed), 0);
            } else {
                assert_eq!(cable.got.len(), 4);
                let mut payload = Vec::new();
                for (k, (f, o)) in cable.got.iter().enumerate() {
                    assert_eq!(*o, Offload::NONE, "segment {k}");
                    assert_eq!(f.len(), 54 + 1000, "segment {k}");
                    let l4 = net::offload::checksum_setup(f, f.len()).expect("a frame");
                    assert!(net::offload::verify(f, &l4), "segment {k}'s checksum");
                    payload.extend_from_slice(&f[54..]);
                }
                assert_eq!(payload, big[54..], "every byte, in order");
                assert_eq!(r.regs.tx_tso_segments.load(Ordering::Relaxed), 4);
            }
        }
        assert_eq!(r.regs.tx_gso.load(Ordering::Relaxed), 2);
        assert_eq!(r.regs.tx_bad_offload.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn frames_are_steered_by_destination_and_vlan_to_their_queue_and_the_rest_to_the_default() {
        let mut r = rig(RX_QUEUES);
        r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
        r.regs.set_filter(1, MAC_B, Some(5), 2).expect("filter");
        let to_a = frame_to(MAC_A, None, 1);
        let to_b5 = frame_to(MAC_B, Some(5), 2);
        let to_b = frame_to(MAC_B, None, 3);
        let to_b7 = frame_to(MAC_B, Some(7), 4);
        let bcast = frame_to([0xff; 6], None, 5);
        let other = frame_to([2, 0, 0, 0, 0, 0xc], None, 6);
        for f in [&to_a, &to_b5, &to_b, &to_b7, &bcast, &other] {
            r.dev.receive(f, Offload::NONE);
        }
        assert_eq!((r.frames(1), r.frames(2), r.frames(0)), (1, 1, 4));
        assert_eq!(r.got(1, 0), to_a);
        assert_eq!(r.got(2, 0), to_b5, "the tag is the guest's to see");
        // B untagged or on another VLAN, a broadcast, an unknown address: the default.
        assert_eq!(
            (0..4).map(|k| r.got(0, k)).collect::<Vec<_>>(),
            vec![to_b, to_b7, bcast, other]
        );
        // Each queue raised its own line, and only the queues that received.
        let pending: Vec<bool> = r.lines.iter().map(|l| l.pending()).collect();
        assert_eq!(pending[..4], [true, true, true, false]);
        assert!(pending[4..].iter().all(|p| !p));
        assert_eq!(r.regs.rxq[1].irqs.load(Ordering::Relaxed), 1);
        // A filter taken out of use sends its frames to the default queue (here full:
        // dropped and counted there).
        r.regs.clear_filter(0).expect("clear");
        r.dev.receive(&to_a, Offload::NONE);
        assert_eq!((r.frames(1), r.missed(0)), (1, 1));
    }

    #[test]
    fn a_frame_steered_to_a_queue_that_is_off_or_full_is_dropped_on_that_queue_only() {
        // Lines for queues 0 and 1 only.
        let mut r = rig(2);
        r.regs.set_filter(0, MAC_A, None, 1).expect("filter");
        r.regs.set_filter(1, MAC_B, None, 4).expect("filter");
        let to_a = frame_to(MAC_A, None, 1);
        // Queue 1 off: dropped on queue 1, the default untouched.
        r.regs.rxq[1].enabled.store(false, Ordering::Relaxed);
        r.dev.receive(&to_a, Offload::NONE);
        assert_eq!((r.missed(1), r.frames(0), r.frames(1)), (1, 0, 0));
        // On, with its four buffers: four land, the fifth is dropped on queue 1.
        r.regs.rxq[1].enabled.store(true, Ordering::Relaxed);
        for _ in 0..5 {
            r.dev.receive(&to_a, Offload::NONE);
        }
        assert_eq!((r.frames(1), r.missed(1), r.frames(0)), (4, 2, 0));
        // Queue 4 has no interrupt line: it cannot take frames even when enabled.
        r.regs.rxq[4].enabled.store(true, Ordering::Relaxed);
        r.dev.receive(&frame_to(MAC_B, None, 2), Offload::NONE);
        assert_eq!((r.missed(4), r.frames(0)), (1, 0));
        assert_eq!(r.regs.rx_missed.load(Ordering::Relaxed), 3);
        // What the table refuses.
        assert_eq!(
            r.regs.set_filter(FILTERS, MAC_A, None, 1),
            Err(FilterError::NoEntry(FILTERS))
        );
        assert_eq!(
            r.regs.set_filter(2, MAC_A, None, RX_QUEUES),
            Err(FilterError::NoQueue(RX_QUEUES))
        );
        assert_eq!(
            r.regs.set_filter(2, [3, 0, 0, 0, 0, 1], None, 1),
            Err(FilterError::GroupAddress)
        );
    }
}
