//! One virtual interface of the self-virtualized NIC (paper 002 §IV): a send queue and a
//! receive queue in the device's memory, which the guest reaches directly.
//!
//! The paper's board kept its VIF queues in memory it exported over PCI; the controller
//! domain granted each VIF's region to its guest once, at creation: the part holding the
//! ring structure read-only, the packet buffers read-write. pvio's device memory is the
//! pages of the SV-NIC's own domain (no vCPU: the board's SDRAM), granted the same way.
//! A VIF's region:
//!
//! | page | guest's access | written by | holds |
//! |---|---|---|---|
//! | device page | read-only | the device | `tx_cons`, `rx_prod`, each receive slot's length |
//! | guest page | read-write | the guest | `tx_prod`, `rx_cons`, the two signal enables, each send slot's length |
//! | send buffers | read-write | the guest | [`SLOTS`] slots of [`SLOT_BYTES`] |
//! | receive buffers | read-write | the device | [`SLOTS`] slots of [`SLOT_BYTES`] |
//!
//! A slot's buffer is at a fixed place, so no address crosses the interface: the device
//! takes from the guest only two indices and a length per frame. Each is loaded once and
//! checked before use, and a frame's bytes are copied out of the guest-writable buffer
//! before anything looks at them (a guest that rewrites a slot after publishing it
//! changes nothing the device already took). An index outside what the protocol allows
//! (a producer more than a queue ahead, or behind the device; a consumer past what was
//! produced, or moving back) breaks this VIF only: every later call on it returns
//! [`VifError::Broken`]. A bad length is one bad frame: counted, its slot consumed, the
//! next frame taken as usual.
//!
//! The paper's operations: [`VifFront::isfull`] and [`VifFront::send`] on the send queue,
//! [`VifFront::isempty`] and [`VifFront::recv`] on the receive queue, with a signal per
//! queue that the guest enables and disables at run time.
//!
//! Ingress runs on several device contexts at once (§IV-B): each takes a sequence number
//! for its frame under the VIF's short lock ([`VifRx::reserve`]), copies the frame into
//! that slot in parallel with the others ([`VifRx::fill`]), and publishes in sequence order
//! ([`VifRx::publish`], which a context retries, yielding, until its turn).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hv::{DomId, Domain, Gfn, GrantRef, Hypervisor, MapOp};
use mem::{MemError, PageAccess, PAGE_SIZE};

/// Slots per queue (a power of two; as many as netfront's rings have, so neither design
/// drops for want of room that the other has).
pub const SLOTS: u32 = 256;
/// Bytes per slot: a 1514-byte frame fits.
pub const SLOT_BYTES: usize = 2048;
/// The shortest frame: an Ethernet header.
pub const MIN_FRAME: usize = 14;
/// The longest frame: 1500 bytes of payload and the Ethernet header.
pub const MAX_FRAME: usize = 1514;
/// Pages of each direction's buffers.
pub const BUF_PAGES: usize = SLOTS as usize * SLOT_BYTES / PAGE_SIZE;
/// Pages of one VIF's region: the device page, the guest page, the buffers.
pub const VIF_PAGES: usize = 2 + 2 * BUF_PAGES;

// The device page.
const TX_CONS: usize = 0;
const RX_PROD: usize = 4;
const RX_LEN: usize = 64;
// The guest page.
const TX_PROD: usize = 0;
const RX_CONS: usize = 4;
const RX_SIGNAL: usize = 8;
const TX_SIGNAL: usize = 12;
const TX_LEN: usize = 64;

/// Why a queue operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VifError {
    /// The peer broke the protocol earlier: the VIF is disconnected.
    #[error("the VIF is disconnected after a protocol break")]
    Broken,
    /// The send queue's producer ran more than a queue ahead of the device, or behind it.
    #[error("send producer {prod} is not within a queue of the consumer {cons}")]
    TxProducer {
        /// What the guest wrote.
        prod: u32,
        /// Where the device was.
        cons: u32,
    },
    /// The receive queue's consumer is past what was produced, or moved back.
    #[error("receive consumer {cons} is outside {from}..={to}")]
    RxConsumer {
        /// What the guest wrote.
        cons: u32,
        /// The last consumer the device saw.
        from: u32,
        /// What the device has published.
        to: u32,
    },
    /// A frame's length is outside [`MIN_FRAME`]..=[`MAX_FRAME`].
    #[error("frame length {0} is outside {MIN_FRAME}..={MAX_FRAME}")]
    BadLength(usize),
    /// The send queue is full (the guest's side).
    #[error("the send queue is full")]
    Full,
    /// Memory refused an access (an unmapped or read-only page).
    #[error("memory: {0}")]
    Mem(#[from] MemError),
}

/// One direction's pages and the two control pages, seen through `P` (the device's own
/// pages, or the guest's mappings of them).
#[derive(Debug)]
pub struct VifPages<P> {
    /// Written by the device (read-only to the guest).
    pub device: P,
    /// Written by the guest.
    pub guest: P,
    /// The send buffers.
    pub tx: Vec<P>,
    /// The receive buffers.
    pub rx: Vec<P>,
}

/// Where slot `i`'s buffer is: its page and the offset in it.
fn slot_at(i: u32) -> (usize, usize) {
    let byte = (i % SLOTS) as usize * SLOT_BYTES;
    (byte / PAGE_SIZE, byte % PAGE_SIZE)
}

/// Copies `len` bytes of slot `i` out of `bufs` into `out`.
fn read_slot<P: PageAccess>(bufs: &[P], i: u32, out: &mut [u8]) -> Result<(), VifError> {
    let (page, offset) = slot_at(i);
    let p = bufs.get(page).ok_or(MemError::NotMapped(page as u32))?;
    Ok(p.read(offset, out)?)
}

/// Copies `frame` into slot `i` of `bufs`.
fn write_slot<P: PageAccess>(bufs: &[P], i: u32, frame: &[u8]) -> Result<(), VifError> {
    let (page, offset) = slot_at(i);
    let p = bufs.get(page).ok_or(MemError::NotMapped(page as u32))?;
    Ok(p.write(offset, frame)?)
}

/// As [`write_slot`], by non-temporal stores: the guest's send is the paper's PCI write
/// into the board's memory, posted across the bus, so no line of the slot is read into
/// the guest's cache first (a cached store would fetch each line the device last read,
/// a cost the board's bus does not have).
fn post_slot<P: PageAccess>(bufs: &[P], i: u32, frame: &[u8]) -> Result<(), VifError> {
    let (page, offset) = slot_at(i);
    let p = bufs.get(page).ok_or(MemError::NotMapped(page as u32))?;
    Ok(p.write_nt(offset, frame)?)
}

/// A VIF's counters, as the device keeps them.
#[derive(Debug, Default)]
pub struct VifStats {
    /// Frames taken from the send queue and handed on.
    pub tx_frames: AtomicU64,
    /// Their bytes.
    pub tx_bytes: AtomicU64,
    /// Send slots with a length outside the frame sizes (dropped).
    pub tx_bad_length: AtomicU64,
    /// Frames placed in the receive queue and published.
    pub rx_frames: AtomicU64,
    /// Their bytes.
    pub rx_bytes: AtomicU64,
    /// Frames dropped because the guest had not drained its receive queue.
    pub rx_full: AtomicU64,
    /// Frames too long for a slot (dropped).
    pub rx_too_long: AtomicU64,
    /// Protocol breaks (the VIF was disconnected at the first).
    pub protocol_breaks: AtomicU64,
}

hv::atomic_counter_set!(VifStats => VifCounts {
    tx_frames,
    tx_bytes,
    tx_bad_length,
    rx_frames,
    rx_bytes,
    rx_full,
    rx_too_long,
    protocol_breaks,
});

/// The device's side of a VIF: its memory, the halves each kind of device context
/// drives, and the counters.
#[derive(Debug)]
pub struct VifDevice<P> {
    /// The send queue (one egress context's).
    pub tx: VifTx<P>,
    /// The receive queue (shared by the ingress contexts).
    pub rx: Arc<VifRx<P>>,
}

/// Shared between a VIF's two halves: the control pages, the counters, and whether the
/// VIF is disconnected.
#[derive(Debug)]
struct Shared<P> {
    device: P,
    guest: P,
    stats: Arc<VifStats>,
    broken: std::sync::atomic::AtomicBool,
}

impl<P: PageAccess> Shared<P> {
    fn check(&self) -> Result<(), VifError> {
        if self.broken.load(Ordering::Acquire) {
            Err(VifError::Broken)
        } else {
            Ok(())
        }
    }
    fn do_break(&self, e: VifError) -> VifError {
        if !self.broken.swap(true, Ordering::AcqRel) {
            self.stats.protocol_breaks.fetch_add(1, Ordering::Relaxed);
        }
        e
    }
}

/// The send queue, as the egress context serving this VIF drives it (one context per
/// VIF, so it needs no lock).
#[derive(Debug)]
pub struct VifTx<P> {
    shared: Arc<Shared<P>>,
    bufs: Vec<P>,
    cons: u32,
}

impl<P: PageAccess> VifTx<P> {
    /// Frames the guest has published and the device not yet taken.
    pub fn pending(&self) -> Result<u32, VifError> {
        self.shared.check()?;
        let prod = self
            .shared
            .guest
            .atomic_u32(TX_PROD)?
            .load(Ordering::Acquire);
        let n = prod.wrapping_sub(self.cons);
        if n > SLOTS {
            return Err(self.shared.do_break(VifError::TxProducer {
                prod,
                cons: self.cons,
            }));
        }
        Ok(n)
    }

    /// Takes the next frame, copied into `out` (at least [`MAX_FRAME`] bytes): its
    /// length, or none when the queue is empty. A slot with a bad length is consumed and
    /// counted, and reported as [`VifError::BadLength`]; the queue goes on.
    pub fn take(&mut self, out: &mut [u8]) -> Result<Option<usize>, VifError> {
        if self.pending()? == 0 {
            return Ok(None);
        }
        let i = self.cons;
        // The length once, into a local; then the bytes, into the device's buffer.
        let len = self
            .shared
            .guest
            .read_obj::<u16>(TX_LEN + 2 * (i % SLOTS) as usize)? as usize;
        let ok = (MIN_FRAME..=MAX_FRAME).contains(&len) && len <= out.len();
        if ok {
            read_slot(&self.bufs, i, &mut out[..len])?;
        }
        self.cons = i.wrapping_add(1);
        self.shared
            .device
            .atomic_u32(TX_CONS)?
            .store(self.cons, Ordering::Release);
        let st = &self.shared.stats;
        if !ok {
            st.tx_bad_length.fetch_add(1, Ordering::Relaxed);
            return Err(VifError::BadLength(len));
        }
        st.tx_frames.fetch_add(1, Ordering::Relaxed);
        st.tx_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(Some(len))
    }

    /// Whether the guest asked for a signal when its send queue has room again.
    pub fn wants_signal(&self) -> bool {
        self.shared
            .guest
            .atomic_u32(TX_SIGNAL)
            .is_ok_and(|a| a.load(Ordering::Acquire) != 0)
    }

    /// The VIF's counters.
    pub fn stats(&self) -> &Arc<VifStats> {
        &self.shared.stats
    }
}

/// The receive queue's sequence state, under the VIF's short lock.
#[derive(Debug)]
struct RxSeq {
    /// The next sequence number to hand out.
    next: u32,
    /// The guest's consumer as last seen.
    cons: u32,
}

/// The receive queue, as the ingress contexts drive it together.
#[derive(Debug)]
pub struct VifRx<P> {
    shared: Arc<Shared<P>>,
    bufs: Vec<P>,
    seq: Mutex<RxSeq>,
    /// Published so far (`rx_prod`): sequence numbers below it are the guest's.
    published: AtomicU32,
}

impl<P: PageAccess> VifRx<P> {
    /// Takes the next slot's sequence number, under the VIF's lock: none if the guest
    /// has not drained its queue (the frame is dropped, counted against this VIF only).
    pub fn reserve(&self) -> Result<Option<u32>, VifError> {
        let seq = self.try_reserve()?;
        if seq.is_none() {
            self.refuse();
        }
        Ok(seq)
    }

    /// Counts a frame dropped because the guest had not drained its queue.
    pub fn refuse(&self) {
        self.shared.stats.rx_full.fetch_add(1, Ordering::Relaxed);
    }

    /// As [`Self::reserve`], counting nothing when the queue is full: for a device
    /// that keeps the frame and asks again ([`Self::refuse`] when it gives up).
    pub fn try_reserve(&self) -> Result<Option<u32>, VifError> {
        self.shared.check()?;
        let mut s = self.seq.lock().map_err(|_| VifError::Broken)?;
        // The guest's consumer is read under the lock: read before it, another
        // context's newer reading could be recorded first and this one look like the
        // consumer moving back.
        let cons = self
            .shared
            .guest
            .atomic_u32(RX_CONS)?
            .load(Ordering::Acquire);
        let published = self.published.load(Ordering::Acquire);
        // The consumer may only move forward, and not past what was published.
        if cons.wrapping_sub(s.cons) > published.wrapping_sub(s.cons) {
            let from = s.cons;
            drop(s);
            return Err(self.shared.do_break(VifError::RxConsumer {
                cons,
                from,
                to: published,
            }));
        }
        s.cons = cons;
        if s.next.wrapping_sub(cons) >= SLOTS {
            return Ok(None);
        }
        let seq = s.next;
        s.next = seq.wrapping_add(1);
        Ok(Some(seq))
    }

    /// Copies `frame` into slot `seq` (taken with [`Self::reserve`]) and writes its
    /// length; contexts do this in parallel. A frame too long for a slot is written as
    /// an empty slot of length 0 so that the sequence is kept; it is counted.
    pub fn fill(&self, seq: u32, frame: &[u8]) -> Result<(), VifError> {
        let placed = if frame.len() > SLOT_BYTES {
            self.shared
                .stats
                .rx_too_long
                .fetch_add(1, Ordering::Relaxed);
            Ok(0)
        } else {
            write_slot(&self.bufs, seq, frame).map(|()| frame.len())
        };
        // Whatever happened, the slot gets a length that is true of it, so that the
        // sequence can be published past it.
        let len = *placed.as_ref().unwrap_or(&0);
        self.shared
            .device
            .write_obj(RX_LEN + 2 * (seq % SLOTS) as usize, &(len as u16))?;
        placed.map(|_| ())
    }

    /// Where slot `seq`'s buffer starts, in bytes from the first receive buffer (what
    /// a device that reaches the buffers by DMA adds to their I/O address).
    pub fn slot_offset(seq: u32) -> usize {
        (seq % SLOTS) as usize * SLOT_BYTES
    }

    /// As [`Self::fill`], the frame's `len` bytes placed by `place` (a DMA through the
    /// VIF's IOMMU context): false from it leaves the slot empty, length 0, so that the
    /// sequence can still be published past it. Whether it was placed.
    pub fn fill_with(
        &self,
        seq: u32,
        len: usize,
        place: impl FnOnce() -> bool,
    ) -> Result<bool, VifError> {
        let placed = if len > SLOT_BYTES {
            self.shared
                .stats
                .rx_too_long
                .fetch_add(1, Ordering::Relaxed);
            false
        } else {
            place()
        };
        let l = if placed { len } else { 0 };
        self.shared
            .device
            .write_obj(RX_LEN + 2 * (seq % SLOTS) as usize, &(l as u16))?;
        Ok(placed)
    }

    /// Writes `frame` into slot `seq`'s buffer with no reservation and no length: only
    /// what [`super::engine::Ingress::inject_misplacement`]'s bug does, to show what an
    /// ingress bug does to another VIF's memory where no IOMMU stands in the way.
    pub(crate) fn misplaced_write(&self, seq: u32, frame: &[u8]) -> Result<(), VifError> {
        write_slot(&self.bufs, seq, &frame[..frame.len().min(SLOT_BYTES)])
    }

    /// Publishes slot `seq` if every earlier one is published: whether it was (a
    /// context whose turn has not come yields and calls again). Counts the frame.
    pub fn publish(&self, seq: u32, len: usize) -> Result<bool, VifError> {
        if self.published.load(Ordering::Acquire) != seq {
            return Ok(false);
        }
        let next = seq.wrapping_add(1);
        self.shared
            .device
            .atomic_u32(RX_PROD)?
            .store(next, Ordering::Release);
        self.published.store(next, Ordering::Release);
        let st = &self.shared.stats;
        st.rx_frames.fetch_add(1, Ordering::Relaxed);
        st.rx_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(true)
    }

    /// Whether the guest wants a signal for what arrives (its NAPI has it enabled).
    pub fn wants_signal(&self) -> bool {
        self.shared
            .guest
            .atomic_u32(RX_SIGNAL)
            .is_ok_and(|a| a.load(Ordering::Acquire) != 0)
    }

    /// The VIF's counters.
    pub fn stats(&self) -> &Arc<VifStats> {
        &self.shared.stats
    }
}

impl<P: PageAccess> VifDevice<P> {
    /// The device's side over its own pages (zeroed: every index starts at 0).
    pub fn new(pages: VifPages<P>) -> Result<Self, VifError> {
        for (p, len) in [
            (&pages.device, RX_LEN + 2 * SLOTS as usize),
            (&pages.guest, TX_LEN + 2 * SLOTS as usize),
        ] {
            p.write(0, &[0u8; TX_LEN + 2 * SLOTS as usize][..len])?;
        }
        let shared = Arc::new(Shared {
            device: pages.device,
            guest: pages.guest,
            stats: Arc::new(VifStats::default()),
            broken: std::sync::atomic::AtomicBool::new(false),
        });
        Ok(Self {
            tx: VifTx {
                shared: Arc::clone(&shared),
                bufs: pages.tx,
                cons: 0,
            },
            rx: Arc::new(VifRx {
                shared,
                bufs: pages.rx,
                seq: Mutex::new(RxSeq { next: 0, cons: 0 }),
                published: AtomicU32::new(0),
            }),
        })
    }

    /// Whether the VIF was disconnected after a protocol break.
    pub fn is_broken(&self) -> bool {
        self.tx.shared.broken.load(Ordering::Acquire)
    }
}

/// The guest's VIF driver over its mappings of the region: the paper's `isfull`,
/// `send`, `isempty` and `recv`, and the two signal switches. It checks the device's
/// indices as the device checks its own (the device is its peer).
#[derive(Debug)]
pub struct VifFront<P> {
    pages: VifPages<P>,
    tx_prod: u32,
    rx_cons: u32,
    /// The egress engine's doorbell, where it sleeps when idle.
    doorbell: Option<Arc<crate::wire::Doze>>,
}

impl<P: PageAccess> VifFront<P> {
    /// The driver over mapped pages, its indices at 0 (as the device's).
    pub fn new(pages: VifPages<P>) -> Self {
        Self {
            pages,
            tx_prod: 0,
            rx_cons: 0,
            doorbell: None,
        }
    }

    /// With the device's doorbell (a device whose egress engine sleeps when idle,
    /// [`super::device::Idle::Block`]): each send rings it, which wakes the engine if
    /// it sleeps and costs a load if not. The doorbell does nothing but wake the
    /// engine, which then polls every send queue as usual.
    pub fn with_doorbell(mut self, d: Option<Arc<crate::wire::Doze>>) -> Self {
        self.doorbell = d;
        self
    }

    /// Whether the send queue is full.
    pub fn isfull(&self) -> Result<bool, VifError> {
        let cons = self.pages.device.load_u32(TX_CONS, Ordering::Acquire)?;
        let n = self.tx_prod.wrapping_sub(cons);
        if n > SLOTS {
            return Err(VifError::TxProducer {
                prod: self.tx_prod,
                cons,
            });
        }
        Ok(n == SLOTS)
    }

    /// Queues `frame` for sending.
    pub fn send(&mut self, frame: &[u8]) -> Result<(), VifError> {
        if !(MIN_FRAME..=MAX_FRAME).contains(&frame.len()) {
            return Err(VifError::BadLength(frame.len()));
        }
        if self.isfull()? {
            return Err(VifError::Full);
        }
        let i = self.tx_prod;
        post_slot(&self.pages.tx, i, frame)?;
        self.pages
            .guest
            .write_obj(TX_LEN + 2 * (i % SLOTS) as usize, &(frame.len() as u16))?;
        self.tx_prod = i.wrapping_add(1);
        self.pages
            .guest
            .atomic_u32(TX_PROD)?
            .store(self.tx_prod, Ordering::Release);
        if let Some(d) = &self.doorbell {
            d.wake();
        }
        Ok(())
    }

    /// Frames waiting in the receive queue.
    fn rx_pending(&self) -> Result<u32, VifError> {
        let prod = self.pages.device.load_u32(RX_PROD, Ordering::Acquire)?;
        let n = prod.wrapping_sub(self.rx_cons);
        if n > SLOTS {
            return Err(VifError::RxConsumer {
                cons: self.rx_cons,
                from: self.rx_cons,
                to: prod,
            });
        }
        Ok(n)
    }

    /// Whether the receive queue is empty.
    pub fn isempty(&self) -> Result<bool, VifError> {
        Ok(self.rx_pending()? == 0)
    }

    /// Takes the next received frame into `out`: its length, or none if the queue is
    /// empty. A slot the device left empty (a frame it could not place) gives 0.
    pub fn recv(&mut self, out: &mut [u8]) -> Result<Option<usize>, VifError> {
        self.recv_with(|p, offset, len| {
            let dst = out.get_mut(..len).ok_or(VifError::BadLength(len))?;
            p.read(offset, dst)?;
            Ok(len)
        })
    }

    /// Takes the next received frame by handing `copy` the page that holds it, the
    /// frame's offset in that page and its length, so that the bytes go straight where
    /// the guest wants them (one copy, the paper's message receive): `copy`'s result, or
    /// none if the queue is empty. The slot is the guest's again once `copy` returns.
    pub fn recv_with<T>(
        &mut self,
        copy: impl FnOnce(&P, usize, usize) -> Result<T, VifError>,
    ) -> Result<Option<T>, VifError> {
        self.recv_at(|p, _page, offset, len| copy(p, offset, len))
    }

    /// As [`VifFront::recv_with`], also telling `copy` which of the region's receive
    /// pages holds the frame (its index among them), for a reader that reaches the
    /// page by its frame rather than through `P` (the device's own block service).
    pub fn recv_at<T>(
        &mut self,
        copy: impl FnOnce(&P, usize, usize, usize) -> Result<T, VifError>,
    ) -> Result<Option<T>, VifError> {
        if self.rx_pending()? == 0 {
            return Ok(None);
        }
        let i = self.rx_cons;
        let len = self
            .pages
            .device
            .read_obj::<u16>(RX_LEN + 2 * (i % SLOTS) as usize)? as usize;
        if len > SLOT_BYTES {
            return Err(VifError::BadLength(len));
        }
        let (page, offset) = slot_at(i);
        let p = self
            .pages
            .rx
            .get(page)
            .ok_or(MemError::NotMapped(page as u32))?;
        let r = copy(p, page, offset, len)?;
        self.rx_cons = i.wrapping_add(1);
        self.pages
            .guest
            .atomic_u32(RX_CONS)?
            .store(self.rx_cons, Ordering::Release);
        Ok(Some(r))
    }

    /// Enables or disables the receive signal (NAPI turns it off while it polls).
    pub fn set_rx_signal(&self, on: bool) -> Result<(), VifError> {
        self.pages
            .guest
            .atomic_u32(RX_SIGNAL)?
            .store(u32::from(on), Ordering::Release);
        Ok(())
    }

    /// Enables or disables the send signal (on only while the send queue is full).
    pub fn set_tx_signal(&self, on: bool) -> Result<(), VifError> {
        self.pages
            .guest
            .atomic_u32(TX_SIGNAL)?
            .store(u32::from(on), Ordering::Release);
        Ok(())
    }

    /// The mapped pages (a hostile guest's tests write through them).
    pub fn pages(&self) -> &VifPages<P> {
        &self.pages
    }
}

/// A VIF's region in device memory and the grants that give it to its guest.
#[derive(Debug, Clone)]
pub struct VifRegion {
    /// The device page, the guest page, the send buffers, the receive buffers, in
    /// that order ([`VIF_PAGES`] pages of the device's domain).
    pub gfns: Vec<Gfn>,
    /// The grant of each to the guest, in the same order; the device page's read-only.
    pub grefs: Vec<GrantRef>,
    /// The guest it is granted to.
    pub guest: DomId,
}

/// Why a VIF's memory could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The device's memory or grant table is exhausted, or a page is not its own.
    #[error("device memory: {0}")]
    Device(String),
    /// The guest's mapping of a page was refused.
    #[error("map: {0:?}")]
    Map(hv::GrantError),
    /// A page could not be reached.
    #[error("{0}")]
    Vif(#[from] VifError),
}

impl VifRegion {
    /// Takes [`VIF_PAGES`] pages of the device's memory and grants them to `guest`: the
    /// device page read-only, the rest read-write (the host-side management driver's
    /// work at VIF creation).
    pub fn create(device: &Domain, guest: DomId) -> Result<Self, RegionError> {
        let d = |e: &dyn std::fmt::Debug| RegionError::Device(format!("{e:?}"));
        let mut gfns = Vec::with_capacity(VIF_PAGES);
        let mut grefs = Vec::with_capacity(VIF_PAGES);
        for i in 0..VIF_PAGES {
            let g = device.alloc_page().map_err(|e| d(&e))?;
            let r = device
                .grant_table()
                .alloc_ref()
                .ok_or_else(|| RegionError::Device("no free grant reference".into()))?;
            device
                .grant_table()
                .grant_access(r, guest, g, i == 0)
                .map_err(|e| d(&e))?;
            gfns.push(g);
            grefs.push(r);
        }
        Ok(Self { gfns, grefs, guest })
    }

    /// The device's own view of the region.
    pub fn device_pages(&self, device: &Arc<Domain>) -> Result<VifPages<hv::OwnPage>, RegionError> {
        let page = |g: Gfn| {
            device
                .page(g)
                .map_err(|e| RegionError::Device(format!("{e:?}")))
        };
        let b = BUF_PAGES;
        Ok(VifPages {
            device: page(self.gfns[0])?,
            guest: page(self.gfns[1])?,
            tx: self.gfns[2..2 + b]
                .iter()
                .map(|&g| page(g))
                .collect::<Result<_, _>>()?,
            rx: self.gfns[2 + b..]
                .iter()
                .map(|&g| page(g))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The guest maps the region into its window from `first_slot` on (once, for the
    /// VIF's life), the device page read-only: the pages, and the handles that unmap
    /// them ([`VifRegion::unmap_in_guest`]).
    pub fn map_in_guest(
        &self,
        hv: &Hypervisor,
        guest: &Arc<Domain>,
        device: DomId,
        first_slot: u32,
    ) -> Result<(VifPages<mem::MappedPage>, Vec<hv::GrantHandle>), RegionError> {
        Self::map_grefs(hv, guest, device, &self.grefs, first_slot)
    }

    /// As [`VifRegion::map_in_guest`], from the grant references alone (what the guest
    /// is told: [`super::mgmt::create_vif`]). Anything but [`VIF_PAGES`] of them is
    /// refused.
    pub fn map_grefs(
        hv: &Hypervisor,
        guest: &Arc<Domain>,
        device: DomId,
        grefs: &[GrantRef],
        first_slot: u32,
    ) -> Result<(VifPages<mem::MappedPage>, Vec<hv::GrantHandle>), RegionError> {
        if grefs.len() != VIF_PAGES {
            return Err(RegionError::Device(format!(
                "{} grant references for a region of {VIF_PAGES} pages",
                grefs.len()
            )));
        }
        let ops: Vec<MapOp> = grefs
            .iter()
            .enumerate()
            .map(|(i, &gref)| MapOp {
                dom: device,
                gref,
                readonly: i == 0,
                slot: first_slot + i as u32,
            })
            .collect();
        let mut out = vec![Ok(hv::GrantHandle(0)); ops.len()];
        hv.grant_map(guest, &ops, &mut out);
        let mut handles = Vec::with_capacity(out.len());
        let mut refused = None;
        for r in &out {
            match r {
                Ok(h) => handles.push(*h),
                Err(e) => refused = refused.or(Some(*e)),
            }
        }
        if let Some(e) = refused {
            // Whatever was mapped goes again: nothing half-mapped is left behind.
            let _ = Self::unmap_in_guest(hv, guest, &handles);
            return Err(RegionError::Map(e));
        }
        let page = |i: usize| -> Result<mem::MappedPage, RegionError> {
            Ok(guest
                .window()
                .page(first_slot + i as u32)
                .map_err(VifError::from)?)
        };
        let b = BUF_PAGES;
        let pages = VifPages {
            device: page(0)?,
            guest: page(1)?,
            tx: (2..2 + b).map(page).collect::<Result<_, _>>()?,
            rx: (2 + b..2 + 2 * b).map(page).collect::<Result<_, _>>()?,
        };
        Ok((pages, handles))
    }

    /// The guest unmaps the region (its VIF driver, which holds the pages, gone first).
    pub fn unmap_in_guest(
        hv: &Hypervisor,
        guest: &Domain,
        handles: &[hv::GrantHandle],
    ) -> Result<(), RegionError> {
        let mut st = vec![Ok(()); handles.len()];
        hv.grant_unmap(guest, handles, &mut st);
        st.into_iter()
            .find_map(Result::err)
            .map_or(Ok(()), |e| Err(RegionError::Map(e)))
    }

    /// The host-side management takes the region back once the device has let go of
    /// the VIF ([`super::device::Svnic::remove_vif`]): each grant is ended, which is
    /// refused while the guest still maps a page (`InUse`: the region is handed back,
    /// nothing freed, to try again), then the pages go back to the device's memory.
    pub fn destroy(self, device: &Domain) -> Result<(), (Self, RegionError)> {
        let gt = device.grant_table();
        for &r in &self.grefs {
            if let Err(e) = gt.end_access(r) {
                if e == hv::GrantError::InUse {
                    return Err((self, RegionError::Map(e)));
                }
            }
        }
        // Scrubbed before reuse: the next VIF's guest must not read this one's frames.
        for (&r, &g) in self.grefs.iter().zip(&self.gfns) {
            gt.free_ref(r);
            let _ = device.fill(g, 0, PAGE_SIZE, 0);
            let _ = device.free_page(g);
        }
        Ok(())
    }
}
