//! Event channels with the 2-level ABI, and virtual IRQs.
//!
//! Layout of the shared-info frame (gfn 0 of every domain), as Xen's `shared_info` on
//! x86-64: 32 vCPU-info blocks of 64 bytes, then `evtchn_pending[64]` and
//! `evtchn_mask[64]` (64-bit words: 4096 ports). In a vCPU-info block, the 16-bit word at
//! 0 holds `evtchn_upcall_pending` (low byte) and `evtchn_upcall_mask` (high byte); the
//! 64-bit word at 8 is `evtchn_pending_sel`, one bit per pending word.
//!
//! Delivery (`evtchn_set_pending`): set the port's pending bit; if it was clear and the
//! port is not masked, set the word's bit in the notified vCPU's selector, then set
//! `upcall_pending` and kick the vCPU if that was clear. A masked port stays pending and
//! is delivered by `unmask`, which redoes the selector and upcall steps. The guest
//! consumes with [`Domain::take_pending`]: clear `upcall_pending`, swap the selector to
//! zero, and for each selected word take the pending and unmasked bits.
//!
//! Every port number from a caller is checked against the table, and binding state is a
//! single atomic word per port, so `send` on the hot path takes no lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::domain::{Domain, SHARED_INFO_GFN};
use crate::profile::{enter, Class};
use crate::types::{DomId, Port, Vector};
use crate::Hypervisor;

/// Ports per domain in the 2-level ABI with 64-bit words: 64 × 64.
pub const NR_EVENT_CHANNELS: u32 = 4096;
/// Size of one vCPU-info block.
pub const VCPU_INFO_SIZE: usize = 64;
/// vCPU-info blocks in the shared-info frame.
pub const MAX_VIRT_CPUS: u32 = 32;
/// Offset of `evtchn_pending` in the shared-info frame.
pub const EVTCHN_PENDING: usize = VCPU_INFO_SIZE * MAX_VIRT_CPUS as usize;
/// Offset of `evtchn_mask`.
pub const EVTCHN_MASK: usize = EVTCHN_PENDING + 64 * 8;
const UPCALL_PENDING_SEL: usize = 8;

/// A vector's route goes to the hypervisor's own handler, not a port.
const IRQ_ROUTE_HANDLER: u64 = 1 << 62;

/// A handler of the hypervisor's own for a physical interrupt, run on the CPU the
/// vector is routed to.
pub type IrqHandler = Box<dyn Fn(&crate::Hypervisor) + Send + Sync>;

/// The handlers, one slot per vector, each set at most once.
pub(crate) struct IrqHandlers(pub(crate) Box<[std::sync::OnceLock<IrqHandler>]>);

impl IrqHandlers {
    pub(crate) fn new(n: usize) -> Self {
        Self((0..n).map(|_| std::sync::OnceLock::new()).collect())
    }
}

impl std::fmt::Debug for IrqHandlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bound = self.0.iter().filter(|h| h.get().is_some()).count();
        write!(f, "IrqHandlers({bound} bound)")
    }
}

/// A line's state at the interrupt controller: masked, because its last interrupt went
/// to the owner and the owner has not yet signalled the end of it (Xen's level-triggered
/// `ACKTYPE_UNMASK`: `do_IRQ` masks the pin, the guest's `PHYSDEVOP_eoi` unmasks it).
const IRQ_IN_FLIGHT: u8 = 1;
/// The device raised the line while it was masked: it fires again when unmasked, as a
/// level-triggered line still asserted does.
const IRQ_LATCHED: u8 = 2;

const ST_FREE: u64 = 0;
const ST_UNBOUND: u64 = 1;
const ST_INTERDOMAIN: u64 = 2;
const ST_PIRQ: u64 = 3;
const ST_VIRQ: u64 = 4;

/// Virtual interrupts that the hypervisor itself raises (`VIRQ_*` of `xen.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Virq {
    /// The vCPU's single-shot timer expired (`VIRQ_TIMER`).
    Timer = 0,
}

/// What an event channel is connected to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelState {
    /// Not allocated.
    Free,
    /// Allocated, waiting for `remote` to bind to it.
    Unbound { remote: DomId },
    /// Connected to `remote_port` of `remote`.
    Interdomain { remote: DomId, remote_port: Port },
    /// Receives a physical interrupt vector.
    Pirq { vector: Vector },
    /// Receives a virtual interrupt of the vCPU it notifies.
    Virq { virq: Virq },
}

impl ChannelState {
    fn encode(self, notify_vcpu: u32) -> u64 {
        let v = (notify_vcpu as u64 & 0xff) << 8;
        v | match self {
            ChannelState::Free => ST_FREE,
            ChannelState::Unbound { remote } => ST_UNBOUND | (remote.0 as u64) << 16,
            ChannelState::Interdomain {
                remote,
                remote_port,
            } => ST_INTERDOMAIN | (remote.0 as u64) << 16 | (remote_port.0 as u64) << 32,
            ChannelState::Pirq { vector } => ST_PIRQ | (vector.0 as u64) << 32,
            ChannelState::Virq { virq } => ST_VIRQ | (virq as u64) << 32,
        }
    }
    fn decode(w: u64) -> (Self, u32) {
        let vcpu = ((w >> 8) & 0xff) as u32;
        let remote = DomId((w >> 16) as u16);
        let s = match w & 7 {
            ST_UNBOUND => ChannelState::Unbound { remote },
            ST_INTERDOMAIN => ChannelState::Interdomain {
                remote,
                remote_port: Port((w >> 32) as u32),
            },
            ST_PIRQ => ChannelState::Pirq {
                vector: Vector((w >> 32) as u8),
            },
            ST_VIRQ => ChannelState::Virq { virq: Virq::Timer },
            _ => ChannelState::Free,
        };
        (s, vcpu)
    }
}

/// Why an event-channel operation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EvtchnError {
    /// The port number is beyond the domain's table.
    #[error("port {0} out of range")]
    PortOutOfRange(u32),
    /// The port is not bound to anything that can be signalled.
    #[error("port {0} is not bound")]
    NotBound(u32),
    /// No free port left.
    #[error("no free event channel")]
    NoFreePort,
    /// The remote domain does not exist or is dying.
    #[error("remote domain {0} does not exist")]
    NoSuchDomain(DomId),
    /// The remote port is not an unbound port offered to the caller.
    #[error("remote port {0} is not offered to this domain")]
    NotOffered(u32),
    /// The vCPU does not exist.
    #[error("no such vcpu {0}")]
    BadVcpu(u32),
    /// The interrupt vector is already routed.
    #[error("vector {0} already bound")]
    VectorInUse(u8),
    /// The virtual interrupt already has a port on that vCPU.
    #[error("virq {0} already bound")]
    VirqInUse(u8),
    /// The interrupt vector is not routed to any domain.
    #[error("vector {0} is not bound")]
    VectorUnbound(u8),
    /// The port does not receive a physical interrupt of the caller's.
    #[error("port {0} is not bound to a physical interrupt")]
    NotPirq(u32),
    /// A real Xen's event-channel device refused the operation (its errno).
    #[error("event-channel device: errno {0}")]
    Os(i32),
}

/// A domain's event-channel table.
#[derive(Debug)]
pub struct EventChannels {
    ports: Box<[AtomicU64]>,
    /// Ports not free, kept as they change (a teardown check reads it, not a scan).
    open: std::sync::atomic::AtomicUsize,
    /// Serialises allocation and binding changes (Xen's per-domain event lock); `send`
    /// reads the port words without it.
    lock: Mutex<()>,
}

impl EventChannels {
    pub(crate) fn new() -> Self {
        Self {
            ports: (0..NR_EVENT_CHANNELS).map(|_| AtomicU64::new(0)).collect(),
            open: std::sync::atomic::AtomicUsize::new(0),
            lock: Mutex::new(()),
        }
    }

    /// The table lock; a poisoned lock is recovered (the port words are atomics and
    /// always consistent on their own).
    fn guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn word(&self, port: Port) -> Result<&AtomicU64, EvtchnError> {
        self.ports
            .get(port.0 as usize)
            .ok_or(EvtchnError::PortOutOfRange(port.0))
    }

    /// Ports that are not free (bound, or allocated unbound); port 0 is never used.
    pub(crate) fn open_ports(&self) -> impl Iterator<Item = Port> + '_ {
        (1..NR_EVENT_CHANNELS)
            .map(Port)
            .filter(|&p| !matches!(self.state(p), Ok(ChannelState::Free)))
    }

    /// State of a port.
    pub fn state(&self, port: Port) -> Result<ChannelState, EvtchnError> {
        Ok(ChannelState::decode(self.word(port)?.load(Ordering::Acquire)).0)
    }

    fn set(&self, port: Port, s: ChannelState, vcpu: u32) {
        if let Ok(w) = self.word(port) {
            let was_free = w.swap(s.encode(vcpu), Ordering::AcqRel) & 7 == ST_FREE;
            let is_free = matches!(s, ChannelState::Free);
            match (was_free, is_free) {
                (true, false) => self.open.fetch_add(1, Ordering::Relaxed),
                (false, true) => self.open.fetch_sub(1, Ordering::Relaxed),
                _ => 0,
            };
        }
    }

    /// How many ports are not free ([`Self::open_ports`] counted, without the scan).
    pub(crate) fn open_count(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// First free port (port 0 is never used, as in Xen). Caller holds `lock`.
    fn alloc(&self) -> Result<Port, EvtchnError> {
        (1..NR_EVENT_CHANNELS)
            .map(Port)
            .find(|p| self.ports[p.0 as usize].load(Ordering::Relaxed) & 7 == ST_FREE)
            .ok_or(EvtchnError::NoFreePort)
    }
}

fn bit(port: Port) -> (usize, u64) {
    ((port.0 / 64) as usize, 1u64 << (port.0 % 64))
}

impl Domain {
    fn evtchn_word(&self, base: usize, word: usize) -> Option<&AtomicU64> {
        self.atomic_u64(SHARED_INFO_GFN, base + word * 8).ok()
    }
    fn upcall_word(&self, vcpu: u32) -> Option<&std::sync::atomic::AtomicU16> {
        self.atomic_u16(SHARED_INFO_GFN, vcpu as usize * VCPU_INFO_SIZE)
            .ok()
    }
    fn pending_sel(&self, vcpu: u32) -> Option<&AtomicU64> {
        self.atomic_u64(
            SHARED_INFO_GFN,
            vcpu as usize * VCPU_INFO_SIZE + UPCALL_PENDING_SEL,
        )
        .ok()
    }

    /// The state of one of this domain's ports.
    pub fn evtchn_state(&self, port: Port) -> Result<ChannelState, EvtchnError> {
        self.evtchn.state(port)
    }

    /// Masks a port (the guest sets the bit in its own shared-info page).
    pub fn evtchn_mask(&self, port: Port) -> Result<(), EvtchnError> {
        self.evtchn.word(port)?;
        let (w, b) = bit(port);
        if let Some(m) = self.evtchn_word(EVTCHN_MASK, w) {
            m.fetch_or(b, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Whether a port's pending bit is set.
    pub fn evtchn_is_pending(&self, port: Port) -> Result<bool, EvtchnError> {
        self.evtchn.word(port)?;
        let (w, b) = bit(port);
        Ok(self
            .evtchn_word(EVTCHN_PENDING, w)
            .is_some_and(|p| p.load(Ordering::Acquire) & b != 0))
    }

    /// Whether vCPU `vcpu` has an upcall pending.
    #[inline]
    pub fn upcall_pending(&self, vcpu: u32) -> bool {
        self.upcall_word(vcpu)
            .is_some_and(|u| u.load(Ordering::Acquire) & 0xff != 0)
    }

    /// The guest's upcall handler: takes every pending, unmasked port notified to
    /// `vcpu`, clearing each pending bit before calling `f` (so an event that arrives
    /// during `f` is seen again). Returns how many ports were handled.
    pub fn take_pending(&self, vcpu: u32, mut f: impl FnMut(Port)) -> usize {
        let _c = enter(Class::Interrupt);
        let (Some(up), Some(sel)) = (self.upcall_word(vcpu), self.pending_sel(vcpu)) else {
            return 0;
        };
        // Clear upcall_pending first: an event set after this re-raises it.
        up.fetch_and(!0xff, Ordering::SeqCst);
        let mut sel_bits = sel.swap(0, Ordering::SeqCst);
        let mut n = 0;
        while sel_bits != 0 {
            let w = sel_bits.trailing_zeros() as usize;
            sel_bits &= sel_bits - 1;
            let (Some(pend), Some(mask)) = (
                self.evtchn_word(EVTCHN_PENDING, w),
                self.evtchn_word(EVTCHN_MASK, w),
            ) else {
                continue;
            };
            let mut ready = pend.load(Ordering::Acquire) & !mask.load(Ordering::Acquire);
            while ready != 0 {
                let b = ready.trailing_zeros();
                ready &= ready - 1;
                pend.fetch_and(!(1u64 << b), Ordering::SeqCst);
                f(Port(w as u32 * 64 + b));
                n += 1;
            }
        }
        n
    }
}

impl Hypervisor {
    /// `EVTCHNOP_alloc_unbound`: a new port of `dom` that `remote` may bind to.
    pub fn evtchn_alloc_unbound(&self, dom: &Domain, remote: DomId) -> Result<Port, EvtchnError> {
        let _c = enter(Class::XenEvent);
        let _g = dom.evtchn.guard();
        let p = dom.evtchn.alloc()?;
        dom.evtchn.set(p, ChannelState::Unbound { remote }, 0);
        Ok(p)
    }

    /// `EVTCHNOP_bind_interdomain`: connects a new port of `dom` to `remote_port` of
    /// `remote`, which must be unbound and offered to `dom`.
    pub fn evtchn_bind_interdomain(
        &self,
        dom: &Domain,
        remote: DomId,
        remote_port: Port,
    ) -> Result<Port, EvtchnError> {
        let _c = enter(Class::XenEvent);
        let rd = self
            .domain(remote)
            .ok_or(EvtchnError::NoSuchDomain(remote))?;
        // Lock both tables in domain-id order so two binds cannot deadlock.
        let (first, second) = if dom.id <= rd.id {
            (dom, &*rd)
        } else {
            (&*rd, dom)
        };
        let _g1 = first.evtchn.guard();
        let _g2 = if dom.id != rd.id {
            Some(second.evtchn.guard())
        } else {
            None
        };
        match rd.evtchn.state(remote_port)? {
            ChannelState::Unbound { remote: offered } if offered == dom.id => {}
            _ => return Err(EvtchnError::NotOffered(remote_port.0)),
        }
        let p = dom.evtchn.alloc()?;
        dom.evtchn.set(
            p,
            ChannelState::Interdomain {
                remote,
                remote_port,
            },
            0,
        );
        rd.evtchn.set(
            remote_port,
            ChannelState::Interdomain {
                remote: dom.id,
                remote_port: p,
            },
            0,
        );
        Ok(p)
    }

    /// `EVTCHNOP_send`: signals the other end of an interdomain channel.
    #[inline]
    pub fn evtchn_send(&self, dom: &Domain, port: Port) -> Result<(), EvtchnError> {
        let _c = enter(Class::XenEvent);
        let (state, _) = ChannelState::decode(dom.evtchn.word(port)?.load(Ordering::Acquire));
        let ChannelState::Interdomain {
            remote,
            remote_port,
        } = state
        else {
            return Err(EvtchnError::NotBound(port.0));
        };
        let rd = self
            .domain(remote)
            .ok_or(EvtchnError::NoSuchDomain(remote))?;
        self.set_pending(&rd, remote_port);
        Ok(())
    }

    /// Marks `port` of `dom` pending and notifies its vCPU (`evtchn_set_pending`).
    pub(crate) fn set_pending(&self, dom: &Domain, port: Port) {
        let Ok(w) = dom.evtchn.word(port) else { return };
        let (_, vcpu) = ChannelState::decode(w.load(Ordering::Relaxed));
        let (wi, b) = bit(port);
        let (Some(pend), Some(mask)) = (
            dom.evtchn_word(EVTCHN_PENDING, wi),
            dom.evtchn_word(EVTCHN_MASK, wi),
        ) else {
            return;
        };
        // SeqCst on the bitmap words: the guest's unmask (clear mask, then test pending)
        // and this path (set pending, then test mask) must not both miss each other.
        if pend.fetch_or(b, Ordering::SeqCst) & b != 0 {
            return; // already pending: the first setter notified
        }
        if mask.load(Ordering::SeqCst) & b != 0 {
            return; // delivered by unmask
        }
        self.raise_upcall(dom, vcpu, wi);
    }

    fn raise_upcall(&self, dom: &Domain, vcpu: u32, word: usize) {
        let (Some(sel), Some(up)) = (dom.pending_sel(vcpu), dom.upcall_word(vcpu)) else {
            return;
        };
        sel.fetch_or(1 << word, Ordering::SeqCst);
        if up.fetch_or(1, Ordering::SeqCst) & 0xff == 0 {
            if let Some(v) = dom.vcpus.get(vcpu as usize) {
                v.kick();
            }
        }
    }

    /// `EVTCHNOP_unmask`: clears the mask bit and delivers an event that arrived while
    /// masked.
    pub fn evtchn_unmask(&self, dom: &Domain, port: Port) -> Result<(), EvtchnError> {
        let _c = enter(Class::XenEvent);
        let (_, vcpu) = ChannelState::decode(dom.evtchn.word(port)?.load(Ordering::Acquire));
        let (wi, b) = bit(port);
        let (Some(pend), Some(mask)) = (
            dom.evtchn_word(EVTCHN_PENDING, wi),
            dom.evtchn_word(EVTCHN_MASK, wi),
        ) else {
            return Ok(());
        };
        if mask.fetch_and(!b, Ordering::SeqCst) & b != 0 && pend.load(Ordering::SeqCst) & b != 0 {
            self.raise_upcall(dom, vcpu, wi);
        }
        Ok(())
    }

    /// `EVTCHNOP_close`: frees a port; the peer's end of an interdomain channel goes back
    /// to unbound (offered to us again), as in Xen.
    pub fn evtchn_close(&self, dom: &Domain, port: Port) -> Result<(), EvtchnError> {
        let _c = enter(Class::XenEvent);
        let state = dom.evtchn.state(port)?;
        match state {
            ChannelState::Free => return Err(EvtchnError::NotBound(port.0)),
            ChannelState::Interdomain {
                remote,
                remote_port,
            } => {
                if let Some(rd) = self.domain(remote) {
                    let _g = rd.evtchn.guard();
                    if rd.evtchn.state(remote_port)
                        == Ok(ChannelState::Interdomain {
                            remote: dom.id,
                            remote_port: port,
                        })
                    {
                        rd.evtchn
                            .set(remote_port, ChannelState::Unbound { remote: dom.id }, 0);
                    }
                }
            }
            ChannelState::Pirq { vector } => self.irq_unbind(vector),
            ChannelState::Virq { virq: Virq::Timer } => {
                for v in dom.vcpus.iter() {
                    v.unbind_timer(port);
                }
            }
            ChannelState::Unbound { .. } => {}
        }
        let _g = dom.evtchn.guard();
        dom.evtchn.set(port, ChannelState::Free, 0);
        let (wi, b) = bit(port);
        if let Some(p) = dom.evtchn_word(EVTCHN_PENDING, wi) {
            p.fetch_and(!b, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Ports of `dom` that are not free (any binding, or allocated unbound): what a
    /// teardown must bring back to zero.
    pub fn evtchn_open_ports(&self, dom: &Domain) -> usize {
        dom.evtchn.open_count()
    }

    /// `EVTCHNOP_bind_vcpu`: which vCPU a port notifies.
    pub fn evtchn_bind_vcpu(&self, dom: &Domain, port: Port, vcpu: u32) -> Result<(), EvtchnError> {
        if vcpu >= dom.vcpu_count() {
            return Err(EvtchnError::BadVcpu(vcpu));
        }
        let _g = dom.evtchn.guard();
        let s = dom.evtchn.state(port)?;
        dom.evtchn.set(port, s, vcpu);
        Ok(())
    }

    /// Routes physical interrupt `vector` to a new port of `dom` (`PHYSDEVOP` +
    /// `EVTCHNOP_bind_pirq`): the device raises the vector, the hypervisor sets the port.
    pub fn bind_irq(&self, dom: &Domain, vector: Vector) -> Result<Port, EvtchnError> {
        let _g = dom.evtchn.guard();
        let p = dom.evtchn.alloc()?;
        let route = (1u64 << 63) | (dom.id.0 as u64) << 32 | p.0 as u64;
        self.irqs[vector.0 as usize]
            .compare_exchange(0, route, Ordering::AcqRel, Ordering::Relaxed)
            .map_err(|_| EvtchnError::VectorInUse(vector.0))?;
        dom.evtchn.set(p, ChannelState::Pirq { vector }, 0);
        Ok(p)
    }

    /// Routes `vector` to a handler of the hypervisor's own, which [`Hypervisor::do_irq`]
    /// runs on `dom`'s first vCPU when the device raises it: the host core that takes a
    /// device's master interrupt and demultiplexes it (paper 002's identifier register).
    /// Once per vector, for the machine's life.
    pub fn bind_irq_handler(
        &self,
        dom: &Domain,
        vector: Vector,
        handler: IrqHandler,
    ) -> Result<(), EvtchnError> {
        let slot = &self.irq_handlers.0[vector.0 as usize];
        slot.set(handler)
            .map_err(|_| EvtchnError::VectorInUse(vector.0))?;
        let route = (1u64 << 63) | IRQ_ROUTE_HANDLER | (dom.id.0 as u64) << 32;
        self.irqs[vector.0 as usize]
            .compare_exchange(0, route, Ordering::AcqRel, Ordering::Relaxed)
            .map_err(|_| EvtchnError::VectorInUse(vector.0))?;
        Ok(())
    }

    /// The hypervisor itself sends physical interrupt `vector`'s event to the domain it
    /// is routed to, on the caller's CPU: a handler forwarding a shared interrupt to each
    /// guest behind it, or a sidecore forwarding a device's message (paper 002). The work
    /// is `do_irq`'s for one vector: mask the line until the owner's end-of-interrupt,
    /// set the port pending and wake its vCPU (on this CPU an upcall, on another an IPI);
    /// a line already in flight latches the request, as [`Hypervisor::raise_irq`] does.
    pub fn send_pirq(&self, vector: Vector) -> Result<(), EvtchnError> {
        let _c = enter(Class::XenInterrupt);
        let route = self.irqs[vector.0 as usize].load(Ordering::Acquire);
        if route >> 63 == 0 || route & IRQ_ROUTE_HANDLER != 0 {
            self.irq_unbound.fetch_add(1, Ordering::Relaxed);
            return Err(EvtchnError::VectorUnbound(vector.0));
        }
        let line = &self.irq_lines[vector.0 as usize];
        let mut cur = line.load(Ordering::Acquire);
        loop {
            let (want, done) = if cur & IRQ_IN_FLIGHT != 0 {
                if cur & IRQ_LATCHED != 0 {
                    return Ok(());
                }
                (cur | IRQ_LATCHED, true)
            } else {
                (cur | IRQ_IN_FLIGHT, false)
            };
            match line.compare_exchange_weak(cur, want, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) if done => return Ok(()),
                Ok(_) => break,
                Err(c) => cur = c,
            }
        }
        let dom = DomId((route >> 32) as u16);
        let d = self.domain(dom).ok_or(EvtchnError::NoSuchDomain(dom))?;
        self.set_pending(&d, Port(route as u32));
        Ok(())
    }

    fn irq_unbind(&self, vector: Vector) {
        self.irqs[vector.0 as usize].store(0, Ordering::Release);
        self.irq_lines[vector.0 as usize].store(0, Ordering::Release);
    }

    /// Marks `vector` at the CPU of the vCPU that `port` of `d` notifies.
    fn irq_to_cpu(&self, d: &Domain, port: Port, vector: Vector) {
        if let Ok(w) = d.evtchn.word(port) {
            let (_, vcpu) = ChannelState::decode(w.load(Ordering::Relaxed));
            if let Some(v) = d.vcpus.get(vcpu as usize) {
                v.raise_vector(vector);
            }
        }
    }

    /// A device raises `vector`: the interrupt controller marks it in the request
    /// register of the CPU it is routed to (the owner's vCPU that the port notifies) and
    /// wakes that CPU. The hypervisor's handling, [`Hypervisor::do_irq`], then runs on
    /// that CPU, charged to the domain running there, as Xen's `do_IRQ` is. This part is
    /// hardware: it runs on the device's thread.
    #[inline]
    pub fn raise_irq(&self, vector: Vector) -> Result<(), EvtchnError> {
        let route = self.irqs[vector.0 as usize].load(Ordering::Acquire);
        if route >> 63 == 0 {
            self.irq_unbound.fetch_add(1, Ordering::Relaxed);
            return Err(EvtchnError::VectorUnbound(vector.0));
        }
        // A masked line holds the request until its owner's end-of-interrupt.
        let line = &self.irq_lines[vector.0 as usize];
        let mut cur = line.load(Ordering::Acquire);
        while cur & IRQ_IN_FLIGHT != 0 {
            if cur & IRQ_LATCHED != 0 {
                return Ok(());
            }
            match line.compare_exchange_weak(
                cur,
                cur | IRQ_LATCHED,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(c) => cur = c,
            }
        }
        let dom = DomId((route >> 32) as u16);
        let d = self.domain(dom).ok_or(EvtchnError::NoSuchDomain(dom))?;
        if route & IRQ_ROUTE_HANDLER != 0 {
            if let Some(v) = d.vcpus.first() {
                v.raise_vector(vector);
            }
        } else {
            self.irq_to_cpu(&d, Port(route as u32), vector);
        }
        Ok(())
    }

    /// `PHYSDEVOP_eoi`: the owner has handled the interrupt that arrived on `port`. The
    /// hypervisor unmasks the line and, if the device raised it meanwhile, sends it to
    /// the owner's CPU again. Until then the line stays masked, so an owner that never
    /// signals the end of an interrupt silences only its own device.
    pub fn pirq_eoi(&self, dom: &Domain, port: Port) -> Result<(), EvtchnError> {
        let _c = enter(Class::XenHypercall);
        let ChannelState::Pirq { vector } = dom.evtchn.state(port)? else {
            return Err(EvtchnError::NotPirq(port.0));
        };
        let route = self.irqs[vector.0 as usize].load(Ordering::Acquire);
        if route >> 63 == 0 || DomId((route >> 32) as u16) != dom.id || route as u32 != port.0 {
            return Err(EvtchnError::NotPirq(port.0));
        }
        let line = &self.irq_lines[vector.0 as usize];
        // Only the owner's end-of-interrupt clears the mask; a line not in flight is left
        // alone (a spurious EOI).
        if line.load(Ordering::Acquire) & IRQ_IN_FLIGHT == 0 {
            return Ok(());
        }
        if line.swap(0, Ordering::AcqRel) & IRQ_LATCHED != 0 {
            self.irq_to_cpu(dom, port, vector);
        }
        Ok(())
    }

    /// Whether `vector`'s line is masked awaiting its owner's end-of-interrupt.
    pub fn irq_in_flight(&self, vector: Vector) -> bool {
        self.irq_lines[vector.0 as usize].load(Ordering::Acquire) & IRQ_IN_FLIGHT != 0
    }

    /// The hypervisor's interrupt entry on a vCPU that has physical vectors pending:
    /// for each, finds its binding, masks the line until the owner's end-of-interrupt
    /// ([`Hypervisor::pirq_eoi`]) and sends the guest's event (`do_IRQ` →
    /// `send_guest_pirq`). Returns how many vectors were taken. A vector whose binding
    /// went away meanwhile is counted as unbound.
    pub fn do_irq(&self, dom: &Domain, vcpu: u32) -> usize {
        let _e = enter(Class::XenEntry);
        let Some(v) = dom.vcpus.get(vcpu as usize) else {
            return 0;
        };
        let mut n = 0;
        v.take_vectors(|vector| {
            let _c = enter(Class::XenInterrupt);
            n += 1;
            let route = self.irqs[vector.0 as usize].load(Ordering::Acquire);
            if route >> 63 == 0 || DomId((route >> 32) as u16) != dom.id {
                self.irq_unbound.fetch_add(1, Ordering::Relaxed);
                return;
            }
            // The hypervisor's own handler: no guest port, no mask (the device raises the
            // vector again only after the handler has cleared what it read).
            if route & IRQ_ROUTE_HANDLER != 0 {
                if let Some(h) = self.irq_handlers.0[vector.0 as usize].get() {
                    h(self);
                }
                return;
            }
            // Mask the line until the owner's `PHYSDEVOP_eoi`, then send the event.
            self.irq_lines[vector.0 as usize].fetch_or(IRQ_IN_FLIGHT, Ordering::AcqRel);
            self.set_pending(dom, Port(route as u32));
        });
        n
    }

    /// `EVTCHNOP_bind_virq`: a new port of `dom` that receives `virq` of `vcpu`.
    pub fn bind_virq(&self, dom: &Domain, virq: Virq, vcpu: u32) -> Result<Port, EvtchnError> {
        let v = dom
            .vcpus
            .get(vcpu as usize)
            .ok_or(EvtchnError::BadVcpu(vcpu))?;
        let _g = dom.evtchn.guard();
        if v.timer_port().is_some() {
            return Err(EvtchnError::VirqInUse(virq as u8));
        }
        let p = dom.evtchn.alloc()?;
        dom.evtchn.set(p, ChannelState::Virq { virq }, vcpu);
        v.bind_timer(p);
        Ok(p)
    }

    /// Interrupts raised on vectors routed nowhere.
    pub fn irq_unbound_count(&self) -> u64 {
        self.irq_unbound.load(Ordering::Relaxed)
    }
}
