//! The NIC model's cable on a real Linux interface (a physical NIC, one end of a veth
//! pair) through an AF_PACKET socket with mapped rings ([`mem::packet`]), so that pvio
//! can be attached to a network that is not a TAP of its own.
//!
//! Frames in: the kernel copies each frame that reaches the interface into a slot of
//! the receive ring; the NIC's engine takes them from the slots in its own step, a
//! memory load per frame to see one waiting, where a TAP costs a `read` each. The
//! socket is the engine's interrupt line while the ring is empty. A frame the NIC has
//! no room for stays in its slot (the device's flow control); frames that then find
//! the ring full are dropped by the kernel and counted (`ring_full_in`), as a NIC's
//! FIFO overflows.
//!
//! Frames out: copied into slots of the transmit ring as the NIC puts them on the
//! cable, and sent together, one `send` per transmit pass ([`WireSink::flush`]).
//!
//! What a real wire carries, this cable carries: frames of at most an MTU with
//! complete checksums, nothing large. One exception is handled: a veth peer's stack
//! leaves the transport checksum of its frames partial (the socket says so per frame);
//! such a frame goes on with a partial-checksum offload its own headers are checked to
//! bear out, as a virtio-net cable's would. A frame longer than a slot (the interface's
//! GRO or LRO on, or a peer sending large segments) arrives truncated and is dropped
//! and counted (`oversize_in`): turn those off on the interface.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use hv::sched::IrqLine;
use mem::packet::{PacketRx, PacketTx, RxPoll, RxStats, TxRefused};
use net::offload::{Offload, MAX_HEADERS};

use crate::capture::{CaptureFile, CaptureTap};
use crate::tap::{TapCounters, RECV_BUDGET};
use crate::wire::{Doze, WireSink, WireSource};

/// Receive-ring slots: 8 MiB of 2 KiB slots, a few milliseconds of a 10 Gbit/s link.
pub const RX_SLOTS: usize = 4096;
/// Transmit-ring slots.
pub const TX_SLOTS: usize = 1024;

/// Attaches a cable to interface `name` (in the calling thread's network namespace):
/// the port the NIC reads and the sink it writes, sharing one set of counters.
pub fn open_cable(name: &str) -> std::io::Result<(PacketPort, PacketSink)> {
    let rx = PacketRx::open(name, RX_SLOTS)?;
    let tx = PacketTx::open(name, TX_SLOTS)?;
    let counters = Arc::new(TapCounters::default());
    // Mapped rings both ways: frames in without a call, out one send a pass.
    counters.batched.store(1, Ordering::Relaxed);
    Ok((
        PacketPort {
            line: None,
            rx,
            seen: RxStats::default(),
            more: false,
            doze: None,
            counters: Arc::clone(&counters),
            taken: None,
            for_sink: None,
        },
        PacketSink {
            tx,
            counters,
            capture: None,
        },
    ))
}

/// The receiving end of a cable on a real interface.
pub struct PacketPort {
    /// The socket as the consumer's interrupt line: dropped before the ring (and its
    /// socket), so that it is off its pCPU before the descriptor closes.
    line: Option<IrqLine>,
    rx: PacketRx,
    /// The ring's counts already added to `counters`.
    seen: RxStats,
    /// The last `recv` stopped at its budget with frames left.
    more: bool,
    doze: Option<Arc<Doze>>,
    counters: Arc<TapCounters>,
    taken: Option<CaptureTap>,
    for_sink: Option<CaptureTap>,
}

impl std::fmt::Debug for PacketPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketPort")
            .field("slots", &self.rx.slots())
            .field("counters", &self.counters)
            .finish()
    }
}

impl PacketPort {
    /// The counters (shared with the sink).
    pub fn counters(&self) -> &Arc<TapCounters> {
        &self.counters
    }

    /// Captures every frame this cable takes in, and (once the sink is made from
    /// [`PacketPort::sink_capture`]) every frame it sends, into `file`.
    pub fn capture(&mut self, file: &CaptureFile) {
        self.taken = Some(file.tap());
        self.for_sink = Some(file.tap());
    }

    /// Hands the sink its capture tap, if [`PacketPort::capture`] made one.
    pub fn sink_capture(&mut self, sink: &mut PacketSink) {
        sink.capture = self.for_sink.take();
    }

    /// Hands frames waiting in the ring, with their offload, to `f` in order, until
    /// `f` refuses one (it stays in its slot, first in line), the ring is empty (the
    /// line is armed), or [`RECV_BUDGET`] slots went. Returns how many were taken.
    pub fn recv(&mut self, mut f: impl FnMut(&[u8], Offload) -> bool) -> usize {
        if self.line.is_none() {
            if let Some(w) = self.doze.as_ref().and_then(|d| d.unit()) {
                self.line = w.irq_line(self.rx.as_raw_fd()).ok();
            }
        }
        let c = &self.counters;
        let (mut taken, mut looked) = (0, 0);
        self.more = false;
        let result = loop {
            if looked == RECV_BUDGET {
                self.more = true;
                break taken;
            }
            looked += 1;
            let taps = &self.taken;
            let r = self.rx.take(|frame, meta| {
                let off = if meta.csum_partial {
                    // The peer's stack left the checksum to a NIC: where the headers
                    // say it goes is checked, and the NIC or the guest completes it.
                    let head = &frame[..frame.len().min(MAX_HEADERS)];
                    match net::offload::checksum_setup(head, frame.len()) {
                        Ok(l4) => Offload {
                            csum: l4.partial(),
                            gso: None,
                        },
                        Err(_) => {
                            c.bad_offload_in.fetch_add(1, Ordering::Relaxed);
                            return true;
                        }
                    }
                } else {
                    Offload::NONE
                };
                if !f(frame, off) {
                    return false;
                }
                if let Some(t) = taps {
                    t.frame(frame);
                }
                if meta.csum_partial {
                    c.csum_partial_in.fetch_add(1, Ordering::Relaxed);
                }
                c.frames_in.fetch_add(1, Ordering::Relaxed);
                c.bytes_in.fetch_add(frame.len() as u64, Ordering::Relaxed);
                true
            });
            match r {
                RxPoll::Taken => taken += 1,
                RxPoll::Skipped => {}
                RxPoll::Refused => break taken,
                RxPoll::Empty => {
                    if let Some(l) = &self.line {
                        l.arm();
                    }
                    break taken;
                }
            }
        };
        self.sync();
        result
    }

    /// Adds what the ring counted since the last look to the port's counters.
    fn sync(&mut self) {
        let now = self.rx.stats();
        let c = &self.counters;
        let add = |a: &std::sync::atomic::AtomicU64, new: u64, old: u64| {
            if new != old {
                a.fetch_add(new - old, Ordering::Relaxed);
            }
        };
        add(&c.oversize_in, now.truncated, self.seen.truncated);
        add(&c.bad_slot_in, now.malformed, self.seen.malformed);
        add(&c.ring_full_in, now.ring_full, self.seen.ring_full);
        self.seen = now;
    }
}

impl WireSource for PacketPort {
    fn poll(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], Offload)) -> usize {
        self.recv(|f, off| {
            emit(f, off);
            true
        })
    }
    fn next_due(&self) -> Option<Instant> {
        None
    }
    fn ready(&self) -> bool {
        self.more || self.rx.ready()
    }
    fn attach(&mut self, wake: &Arc<Doze>) {
        self.doze = Some(Arc::clone(wake));
    }
    fn holds(&self) -> bool {
        true
    }
    fn poll_held(&mut self, _now: Instant, emit: &mut dyn FnMut(&[u8], Offload) -> bool) -> usize {
        self.recv(|f, off| emit(f, off))
    }
}

/// The sending end of a cable on a real interface.
#[derive(Debug)]
pub struct PacketSink {
    tx: PacketTx,
    counters: Arc<TapCounters>,
    capture: Option<CaptureTap>,
}

impl WireSink for PacketSink {
    /// Copies the frame into the transmit ring; a frame with offload metadata (which
    /// this cable does not take), one too long for a slot, or one that finds the ring
    /// full even after a send is refused and counted as a write error.
    fn transmit(&mut self, frame: &[u8], off: Offload) {
        let c = &self.counters;
        if off.gso.is_some() || matches!(off.csum, net::offload::Csum::Partial { .. }) {
            c.write_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match self.tx.push(frame) {
            Ok(()) => {
                if let Some(t) = &self.capture {
                    t.frame(frame);
                }
                c.frames_out.fetch_add(1, Ordering::Relaxed);
                c.bytes_out.fetch_add(frame.len() as u64, Ordering::Relaxed);
            }
            Err(TxRefused::RingFull | TxRefused::BadLength) => {
                c.write_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    fn flush(&mut self) {
        let before = self.tx.stats().sends;
        self.tx.flush();
        let sends = self.tx.stats().sends - before;
        self.counters.syscalls.fetch_add(sends, Ordering::Relaxed);
    }
}
