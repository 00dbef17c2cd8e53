//! A hostile guest's kernel: a raw front end that, every millisecond, writes a burst of
//! garbage into its vif's rings and kicks the back end — TX chains with grants of every
//! kind (its own read-only page, a writable one, a revoked one, references it never
//! issued) and sizes that do not add up, and now and then (one burst in 16384) a protocol
//! break: bad flags, slots across their page, a producer moved backwards or far ahead
//! (netback disables the vif); RX buffers with the same grants. It never reads an
//! answer.
//!
//! It does its half of the handshake honestly, so that the toolstack connects its vif
//! and its garbage reaches netback, and does it again when its back end is replaced
//! (a driver-domain restart): it follows the store as netfront does. What it wrote is
//! seeded, so a soak is repeatable up to the threads' timing.

use std::sync::Arc;
use std::time::Duration;

use hv::store::{XenStore, XenbusState};
use hv::{DomId, Domain, Hypervisor, Port, Vcpu};
use net::netif::{RxRequest, TxRequest, NETTXF_MORE_DATA};
use net::rawfront::RawFront;
use net::xenbus;

use crate::vcpu::{Kernel, Work};
use crate::Counters;

/// How often it writes a burst.
pub const BURST_EVERY: Duration = Duration::from_millis(1);

/// What it did.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct HostileStats {
    /// Bursts written.
    pub bursts: u64,
    /// TX requests written.
    pub tx_requests: u64,
    /// RX requests written.
    pub rx_requests: u64,
    /// Producer indices moved backwards or far ahead.
    pub breaks: u64,
    /// Handshakes done (the first, and one per back end that replaced the last).
    pub handshakes: u64,
    /// Grants a back end still held when it closed (given back later).
    pub held_at_close: u64,
}

hv::counter_set!(HostileStats {
    bursts,
    tx_requests,
    rx_requests,
    breaks,
    handshakes,
    held_at_close
});

/// The connection it has published.
#[derive(Debug)]
struct Conn {
    raw: RawFront,
    be: DomId,
    /// A writable grant and a revoked one, among its references.
    rw: u32,
    revoked: u32,
    tx_prod: u32,
    rx_prod: u32,
}

/// The hostile guest.
#[derive(Debug)]
pub struct HostileGuest {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    handle: u32,
    /// It never follows the store after connecting (it never reconnects).
    deaf: bool,
    conn: Option<Conn>,
    rng: u64,
    next: Duration,
    stats: HostileStats,
}

impl HostileGuest {
    /// A hostile guest on vif `handle`, publishing its rings to the back end the store
    /// names once it waits (`InitWait`); `seed` chooses its garbage.
    pub fn new(hv: &Arc<Hypervisor>, dom: &Arc<Domain>, handle: u32, seed: u64) -> Self {
        let mut g = Self {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
            handle,
            deaf: false,
            conn: None,
            rng: seed | 1,
            next: Duration::ZERO,
            stats: HostileStats::default(),
        };
        g.follow_store();
        g
    }

    /// The same guest, deaf to its back end: it connects now and never follows the
    /// store again (after a driver-domain restart it never reconnects).
    pub fn deaf(hv: &Arc<Hypervisor>, dom: &Arc<Domain>, handle: u32, seed: u64) -> Self {
        let mut g = Self::new(hv, dom, handle, seed);
        g.deaf = true;
        g
    }

    fn rand(&mut self) -> u64 {
        let s = &mut self.rng;
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        s.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.rand() % n.max(1)
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }

    /// Follows the store as a front end does: drops a connection whose back end
    /// closed or was replaced, and publishes to a back end that waits.
    fn follow_store(&mut self) {
        let store = self.hv.store();
        let me = self.dom.id();
        let fdir = xenbus::frontend_dir(me, self.handle);
        let named = xenbus::read_u32(store, me, &format!("{fdir}/backend-id"))
            .ok()
            .and_then(|v| u16::try_from(v).ok())
            .map(DomId);
        let Some(be) = named else { return };
        let bdir = xenbus::backend_dir(be, me, self.handle);
        let st = store.xenbus_state(me, &bdir);
        if let Some(c) = &self.conn {
            let gone = c.be != be
                || matches!(
                    st,
                    XenbusState::Closing | XenbusState::Closed | XenbusState::Unknown
                );
            if gone {
                if let Some(c) = self.conn.take() {
                    self.stats.held_at_close += c.raw.close(&self.hv, self.handle) as u64;
                }
            }
        }
        if self.conn.is_none() && st == XenbusState::InitWait {
            if let Ok(mut raw) = RawFront::publish(&self.hv, &self.dom, be, self.handle) {
                let rw = raw.rx_buffer(be).unwrap_or(raw.data_ref);
                let revoked = raw.rx_buffer(be).unwrap_or(raw.data_ref);
                let _ = self.dom.grant_table().end_access(hv::GrantRef(revoked));
                self.stats.handshakes += 1;
                self.conn = Some(Conn {
                    raw,
                    be,
                    rw,
                    revoked,
                    tx_prod: 0,
                    rx_prod: 0,
                });
            }
        }
    }

    /// One burst of garbage, then a kick.
    fn burst(&mut self) {
        let Some(mut c) = self.conn.take() else {
            return;
        };
        // Mostly garbage netback answers and counts, so that the vif stays up and the
        // garbage keeps coming; now and then a protocol break (netback then disables
        // the vif until the guest reconnects to a new back end).
        let fatal = self.below(16384) == 0;
        let mut i = c.tx_prod;
        for _ in 0..self.below(8) {
            for r in self.chain(&c, fatal) {
                c.raw.put(i, r);
                i = i.wrapping_add(1);
                self.stats.tx_requests += 1;
            }
        }
        c.tx_prod = if fatal {
            self.stats.breaks += 1;
            match self.below(3) {
                0 => c.tx_prod.wrapping_sub(1 + self.below(8) as u32),
                1 => c.tx_prod.wrapping_add(1 << 31),
                _ => i,
            }
        } else {
            i
        };
        c.raw.publish_tx(c.tx_prod);
        for _ in 0..self.below(4) {
            let r = RxRequest {
                id: self.below(300) as u16,
                pad: 0,
                gref: self.pick(&[c.rw, c.rw, c.raw.data_ref, c.revoked, 9999]),
            };
            c.rx_prod = c.rx_prod.wrapping_add(1);
            c.raw.post_rx(c.rx_prod.wrapping_sub(1), r, c.rx_prod);
            self.stats.rx_requests += 1;
        }
        let _ = self.hv.evtchn_send(&self.dom, c.raw.port);
        self.stats.bursts += 1;
        self.conn = Some(c);
    }

    /// One chain of TX requests. Tolerated garbage: any grant (its own read-only page,
    /// a writable one, a revoked one, references never issued), slots inside their
    /// page but of sizes that do not add up, too short or too many slots; the packets
    /// that pass carry garbage from a MAC the vif was not given. `fatal` adds flags,
    /// offsets and sizes that break the protocol.
    fn chain(&mut self, c: &Conn, fatal: bool) -> Vec<TxRequest> {
        let grefs = [
            c.raw.data_ref,
            c.raw.data_ref,
            c.rw,
            c.revoked,
            9999,
            u32::MAX,
        ];
        let slots = self.pick(&[1u32, 1, 1, 2, 3, 19]);
        (0..slots)
            .map(|k| {
                let mut flags = if k + 1 < slots { NETTXF_MORE_DATA } else { 0 };
                let offset = self.pick(&[0u16, 64, 2000]);
                let mut size = self.pick(&[0u16, 10, 60, 1500, 4096 - offset]);
                let mut offset = offset;
                if fatal {
                    flags ^= 1 << self.below(4);
                    offset = self.pick(&[offset, 4095, u16::MAX]);
                    size = self.pick(&[size, 9000, u16::MAX]);
                }
                TxRequest {
                    gref: self.pick(&grefs),
                    offset,
                    flags,
                    id: self.below(300) as u16,
                    size,
                }
            })
            .collect()
    }
}

impl Kernel for HostileGuest {
    const CLOCK: bool = true;

    fn event(&mut self, _v: &Vcpu, _port: Port) {}

    fn poll(&mut self, now: Duration) -> Work {
        if now < self.next {
            return Work::default();
        }
        self.next = now + BURST_EVERY;
        if !self.deaf {
            self.follow_store();
        }
        self.burst();
        Work::default()
    }

    fn next_timer(&self) -> Option<Duration> {
        Some(self.next)
    }

    fn shutdown(mut self) -> Counters {
        if let Some(c) = self.conn.take() {
            self.stats.held_at_close += c.raw.close(&self.hv, self.handle) as u64;
        }
        let mut c = Counters::default();
        c.add_set("hostile guest", &self.stats);
        c
    }
}
