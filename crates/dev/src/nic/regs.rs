//! The NIC's programming interface: the descriptor layout and its flags, interrupt
//! moderation, and the register file the driver and the device share (per receive
//! queue, per filter, and the device's counters). Everything here is what a driver
//! writes or reads; what the device does with it is in [`super::engine`].

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
/// RX status, on a large frame's first descriptor on a queue that takes large frames
/// whole ([`RxQueueRegs::whole`]): the next descriptor is the frame's context, its
/// buffer left unwritten and its address field holding the frame's offload
/// ([`net::offload::Offload::to_bits`]), with [`DESC_OFFLOAD`] (and [`DESC_EOP`] if no data
/// follows); the frame's other bytes are in the descriptors after it. A netback that
/// answers its guest's buffers in ring order thus has the request netif's extra-info
/// slot takes, at the slot's place.
pub const DESC_CTX_NEXT: u16 = 1 << 5;
/// TX flag, on a packet's last descriptor: loop the packet back into receive queue
/// [`Desc::pad`] instead of putting it on the cable (VMDq's loopback between pools: a
/// frame the driver domain's bridge sends to a guest whose buffers its queue holds
/// reaches them in the order of the queue's other frames).
pub const DESC_LOOP: u16 = 1 << 5;
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

impl Desc {
    /// Its bytes as they lie in the ring.
    pub fn to_bytes(&self) -> [u8; DESC_SIZE] {
        bytemuck::cast(*self)
    }

    /// The descriptor whose last 8 bytes (length, status, flags, reserved) are `last`
    /// and whose address is `addr`: read as a driver reads a write-back, the status
    /// word first.
    pub fn from_words(addr: u64, last: u64) -> Self {
        let mut b = [0u8; DESC_SIZE];
        b[..8].copy_from_slice(&addr.to_le_bytes());
        b[8..].copy_from_slice(&last.to_le_bytes());
        bytemuck::cast(b)
    }
}

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
    /// The large (GSO) frames a guest queue takes whole, in several buffers with a
    /// context descriptor after the first ([`DESC_CTX_NEXT`]): bit `1 << t` for netif
    /// GSO type `t`. The device cuts the others into frames with complete checksums,
    /// one a buffer.
    pub whole: AtomicU32,
    /// The device's counters from here on.
    pub(super) device: LineBreak,
    /// Frames received into its buffers.
    pub frames: AtomicU64,
    /// Frames steered to it and dropped: queue off, or no free descriptor.
    pub missed: AtomicU64,
    /// Interrupts raised on its line.
    pub irqs: AtomicU64,
}

impl RxQueueRegs {
    pub(super) fn clear(&self) {
        self.enabled.store(false, Ordering::Release);
        self.irq_enabled.store(false, Ordering::Release);
        self.whole.store(0, Ordering::Release);
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
    pub(super) resets: AtomicU64,
    pub(super) stop: AtomicBool,
    /// The device thread's sleep and its wake-ups.
    pub(super) doze: Arc<crate::wire::Doze>,
    /// Both sides write the pause flag: the device sets it, the driver's tail write
    /// clears it.
    pub(super) paused_line: LineBreak,
    /// Set by the device when it left frames with a source that holds them (a TAP) for
    /// want of a free descriptor, as a link with flow control pauses its sender; the
    /// driver's next RX tail write clears it and wakes the device.
    pub rx_paused: AtomicBool,
    /// The device's registers and counters from here on.
    pub(super) device: LineBreak,
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
    /// Those dropped for want of a free descriptor, in bursts with their times.
    pub rx_missed_log: super::misses::MissLog,
    /// Times the device paused its source so.
    pub rx_pauses: AtomicU64,
    /// Frames the driver looped back to a guest queue without room, kept in the
    /// device's FIFO until the queue had room (or dropped from it, in `rx_missed`).
    pub rx_loop_held: AtomicU64,
    /// Frames from the cable kept in the device's packet buffer for want of a free
    /// descriptor on their queue, until it had room (or dropped from it, in
    /// `rx_missed`).
    pub rx_fifo_held: AtomicU64,
    /// Times the device paused the cable's far end (an 802.3x XOFF) as its packet
    /// buffer filled, for a far end that takes PAUSE frames.
    pub rx_xoffs: AtomicU64,
    /// How long those pauses lasted in all (µs).
    pub rx_xoff_us: AtomicU64,
    /// The longest of them (µs).
    pub rx_xoff_longest_us: AtomicU64,
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
    /// Packets the driver looped back into a guest queue ([`DESC_LOOP`]).
    pub tx_looped: AtomicU64,
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
    pub rx_loop_held: u64,
    pub rx_fifo_held: u64,
    pub rx_xoffs: u64,
    pub rx_xoff_us: u64,
    pub rx_xoff_longest_us: u64,
    pub rx_oversize: u64,
    pub dma_faults: u64,
    pub rx_dma_errors: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub rx_bad_offload: u64,
    pub rx_gso: u64,
    pub rx_cut: u64,
    pub tx_bad_offload: u64,
    pub tx_looped: u64,
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
            rx_loop_held: l(&self.rx_loop_held),
            rx_fifo_held: l(&self.rx_fifo_held),
            rx_xoffs: l(&self.rx_xoffs),
            rx_xoff_us: l(&self.rx_xoff_us),
            rx_xoff_longest_us: l(&self.rx_xoff_longest_us),
            rx_oversize: l(&self.rx_oversize),
            dma_faults: l(&self.dma_faults),
            rx_dma_errors: l(&self.rx_dma_errors),
            tx_frames: l(&self.tx_frames),
            tx_bytes: l(&self.tx_bytes),
            rx_bad_offload: l(&self.rx_bad_offload),
            rx_gso: l(&self.rx_gso),
            rx_cut: l(&self.rx_cut),
            tx_bad_offload: l(&self.tx_bad_offload),
            tx_looped: l(&self.tx_looped),
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
        f("rx_loop_held", c.rx_loop_held);
        f("rx_fifo_held", c.rx_fifo_held);
        f("rx_xoffs", c.rx_xoffs);
        f("rx_xoff_us", c.rx_xoff_us);
        f("rx_xoff_longest_us", c.rx_xoff_longest_us);
        f("rx_oversize", c.rx_oversize);
        f("dma_faults", c.dma_faults);
        f("rx_dma_errors", c.rx_dma_errors);
        f("tx_frames", c.tx_frames);
        f("tx_bytes", c.tx_bytes);
        f("rx_bad_offload", c.rx_bad_offload);
        f("rx_gso", c.rx_gso);
        f("rx_cut", c.rx_cut);
        f("tx_bad_offload", c.tx_bad_offload);
        f("tx_looped", c.tx_looped);
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

    pub(super) fn new() -> Self {
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
            rx_missed_log: Default::default(),
            rx_paused: AtomicBool::new(false),
            rx_pauses: AtomicU64::new(0),
            rx_loop_held: AtomicU64::new(0),
            rx_fifo_held: AtomicU64::new(0),
            rx_xoffs: AtomicU64::new(0),
            rx_xoff_us: AtomicU64::new(0),
            rx_xoff_longest_us: AtomicU64::new(0),
            rx_oversize: AtomicU64::new(0),
            dma_faults: AtomicU64::new(0),
            rx_dma_errors: AtomicU64::new(0),
            tx_frames: AtomicU64::new(0),
            tx_bytes: AtomicU64::new(0),
            rx_bad_offload: AtomicU64::new(0),
            rx_gso: AtomicU64::new(0),
            rx_cut: AtomicU64::new(0),
            tx_bad_offload: AtomicU64::new(0),
            tx_looped: AtomicU64::new(0),
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
    pub(super) fn classify(&self, frame: &[u8]) -> usize {
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

    /// Plugs the cable in and wakes the device, which may have frames waiting on it.
    pub fn plug(&self) {
        self.link_up.store(true, Ordering::Release);
        self.doze.wake();
    }

    /// Enables the device (its rings are set up) and wakes it: an idle device waits for
    /// a wake-up, not a timer.
    pub fn enable(&self) {
        self.enabled.store(true, Ordering::Release);
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
    pub(super) fn wait_seen(&self) {
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

/// A MAC address as the filter register holds it.
pub(super) fn mac_bits(mac: [u8; 6]) -> u64 {
    let mut b = [0u8; 8];
    b[..6].copy_from_slice(&mac);
    u64::from_le_bytes(b)
}
