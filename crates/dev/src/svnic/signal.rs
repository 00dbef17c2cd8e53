//! How the SV-NIC tells a guest that its queues have news (paper 002 §IV-C, §V), in
//! three designs:
//!
//! * [`IdRegister`]: the board's 8-bit interrupt identifier register, one per direction.
//!   Each VIF is given a bit, `ID = next++ mod 8`, shared beyond 8 VIFs. The device sets
//!   the bit and, if the register was clear, asserts the one master interrupt; the
//!   hypervisor's handler on a host core reads and clears the register and sends an event
//!   to every VIF that shares a set bit, so with more than 8 VIFs some are woken for
//!   nothing (counted by the guests that find no news).
//! * [`SideChannel`]: the sidecore's message channel: the device writes the VIF's id into
//!   a ring in host memory and the sidecore, a host core given to this alone, takes each
//!   id and signals exactly that VIF.
//! * A vector per VIF (MSI-X, the paper's suggested fix): the device raises the VIF's own
//!   interrupt; nothing is shared, nothing is demultiplexed.
//!
//! Guests enable and disable their signals in their VIF's guest page; the device asks
//! [`super::vif::VifRx::wants_signal`] before it raises anything.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

/// A signal's direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Frames arrived in the receive queue.
    Rx = 0,
    /// The send queue has room again.
    Tx = 1,
}

/// Bits in the identifier register, per direction.
pub const ID_BITS: u32 = 8;

/// The identifier registers (receive and send) and the bit each VIF was given.
#[derive(Debug, Default)]
pub struct IdRegister {
    reg: [AtomicU8; 2],
    next: AtomicU32,
    /// Master interrupts asserted (the register went from clear to set).
    pub interrupts: AtomicU64,
    /// Bits set by the device, all directions (a set bit already set counts too).
    pub raised: AtomicU64,
}

impl IdRegister {
    /// The bit for a new VIF: `next++ mod 8`.
    pub fn assign(&self) -> u8 {
        (self.next.fetch_add(1, Ordering::Relaxed) % ID_BITS) as u8
    }

    /// The device sets `bit` for `dir`: whether this asserted the master interrupt (the
    /// register was clear), in which case the caller raises it.
    pub fn raise(&self, dir: Dir, bit: u8) -> bool {
        self.raised.fetch_add(1, Ordering::Relaxed);
        let was = self.reg[dir as usize].fetch_or(1 << (bit % 8), Ordering::AcqRel);
        if was == 0 {
            self.interrupts.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }

    /// The hypervisor's handler reads and clears the register for `dir`.
    pub fn take(&self, dir: Dir) -> u8 {
        self.reg[dir as usize].swap(0, Ordering::AcqRel)
    }
}

/// Which VIFs share each identifier bit: what the handler signals for a set bit.
#[derive(Debug, Clone, Default)]
pub struct BitMap {
    vifs: [Vec<u16>; ID_BITS as usize],
}

impl BitMap {
    /// VIF `vif` was given `bit`.
    pub fn add(&mut self, bit: u8, vif: u16) {
        self.vifs[(bit % 8) as usize].push(vif);
    }
    /// VIF `vif` is gone.
    pub fn remove(&mut self, vif: u16) {
        for v in &mut self.vifs {
            v.retain(|&x| x != vif);
        }
    }
    /// Calls `signal` for every VIF sharing a bit set in `bits`: how many.
    pub fn demux(&self, bits: u8, signal: &mut dyn FnMut(u16)) -> usize {
        let mut n = 0;
        for b in 0..ID_BITS as usize {
            if bits & (1 << b) != 0 {
                for &v in &self.vifs[b] {
                    signal(v);
                    n += 1;
                }
            }
        }
        n
    }
    /// VIFs sharing `bit`.
    pub fn sharing(&self, bit: u8) -> usize {
        self.vifs[(bit % 8) as usize].len()
    }
}

/// The sidecore's message channel: a ring of VIF ids and directions in host memory,
/// written by the device cores, read by the sidecore. Single consumer; producers take a
/// slot with one atomic add and mark it written, so device cores need no lock.
#[derive(Debug)]
pub struct SideChannel {
    slots: Box<[AtomicU32]>,
    head: AtomicU64,
    tail: AtomicU64,
    /// Messages the device could not write because the ring was full: the signal is
    /// then merged into the VIF's next one (its queue keeps the frames).
    pub full: AtomicU64,
    /// Messages sent.
    pub sent: AtomicU64,
}

/// A slot holding no message yet.
const EMPTY: u32 = u32::MAX;

impl SideChannel {
    /// A channel of `slots` messages (a power of two).
    pub fn new(slots: usize) -> Self {
        let n = slots.max(2).next_power_of_two();
        Self {
            slots: (0..n).map(|_| AtomicU32::new(EMPTY)).collect(),
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            full: AtomicU64::new(0),
            sent: AtomicU64::new(0),
        }
    }

    fn encode(vif: u16, dir: Dir) -> u32 {
        (u32::from(vif) << 1) | dir as u32
    }

    /// The device posts a signal for `vif`: false if the ring was full.
    pub fn send(&self, vif: u16, dir: Dir) -> bool {
        let n = self.slots.len() as u64;
        let mut t = self.tail.load(Ordering::Acquire);
        loop {
            if t.wrapping_sub(self.head.load(Ordering::Acquire)) >= n {
                self.full.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            match self
                .tail
                .compare_exchange_weak(t, t + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => t = now,
            }
        }
        self.slots[(t % n) as usize].store(Self::encode(vif, dir), Ordering::Release);
        self.sent.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Whether no message is waiting or being written (the sidecore's last look before
    /// it sleeps).
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Acquire) == self.tail.load(Ordering::SeqCst)
    }

    /// The sidecore takes the next message, if one is written: the VIF and direction.
    pub fn recv(&self) -> Option<(u16, Dir)> {
        let h = self.head.load(Ordering::Relaxed);
        if h == self.tail.load(Ordering::Acquire) {
            return None;
        }
        let slot = &self.slots[(h % self.slots.len() as u64) as usize];
        // Taken but not yet written by its producer: come back.
        let m = slot.load(Ordering::Acquire);
        if m == EMPTY {
            return None;
        }
        slot.store(EMPTY, Ordering::Relaxed);
        self.head.store(h + 1, Ordering::Release);
        let dir = if m & 1 == 0 { Dir::Rx } else { Dir::Tx };
        Some(((m >> 1) as u16, dir))
    }
}
