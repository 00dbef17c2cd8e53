//! The paravirtual guest's kernel: netfront, and above it either pvio's stack with the
//! receiving application ([`PvGuest`]) or a TAP whose network namespace's Linux stack is
//! the guest's stack ([`TapGuest`], `pvio up`).
//!
//! netfront is polled, not driven by its event: the event only wakes the vCPU (as the
//! interrupt that schedules netfront's NAPI poll does), and the poll step then takes
//! what the back end answered on both rings.

use std::sync::Arc;
use std::time::Duration;

use dev::tap::TapPort;
use hv::{Domain, Port, Vcpu};
use net::netfront::{LinkChange, Netfront};
use net::skb::SkbPool;

use crate::app::{AppSpec, AppStack};
use crate::counters::PortKind;
use crate::vcpu::{Kernel, Work};
use crate::{other, BuildError, Counters, NAPI_BUDGET, POOL_BUFFERS};

/// Pages of a guest's pool: the 256 pages netfront posts, and TX heads of a page each.
pub const POOL_PAGES: usize = 640;

/// A guest's pool, with netfront's RX ring filled from it.
pub fn guest_pool(dom: &Arc<Domain>, front: &mut Netfront) -> Result<SkbPool, BuildError> {
    let mut pool = SkbPool::new(Arc::clone(dom), POOL_BUFFERS, POOL_PAGES).map_err(other)?;
    front.refill_rx(&mut pool);
    Ok(pool)
}

/// netfront, the stack and the receiving application.
#[derive(Debug)]
pub struct PvGuest {
    front: Netfront,
    pool: SkbPool,
    app: AppStack,
    /// Frames the stack sent that found no buffer or no room on the ring (TCP's
    /// frames stay queued in the stack and go on the next pass).
    tx_wait: u64,
}

impl PvGuest {
    /// The guest's kernel over a connected front end and its pool.
    pub fn new(
        dom: &Arc<Domain>,
        front: Netfront,
        pool: SkbPool,
        app: &AppSpec,
    ) -> Result<Self, BuildError> {
        Ok(Self {
            front,
            pool,
            app: AppStack::bind(dom, app, Duration::ZERO)?,
            tx_wait: 0,
        })
    }
}

impl Kernel for PvGuest {
    const CLOCK: bool = true;

    fn event(&mut self, _v: &Vcpu, _port: Port) {}

    fn tick(&mut self, now: Duration) {
        self.app.tick(&mut self.pool, now);
    }

    fn poll(&mut self, now: Duration) -> Work {
        let Self {
            front,
            pool,
            app,
            tx_wait,
        } = self;
        // The back end may have gone or come back (a store watch woke the vCPU).
        let link = front.check_backend(pool);
        // Buffers a back end held when they were revoked come back once it lets go.
        pool.retry_deferred();
        let mut w = Work {
            rx: front.poll_rx(pool, NAPI_BUDGET, |pool, skb| app.input(pool, skb, now)),
            tx: usize::from(link != LinkChange::None),
            ..Work::default()
        };
        // Completions free buffers but are not work that keeps the vCPU awake: a TX
        // response comes with an event of its own.
        front.poll_tx(pool);
        // The application's frames go as a burst, published once at its end.
        let (reads, sent) = app.run(pool, now, |pool, frame| {
            let ok = xmit_frame(pool, frame, |pool, skb| front.xmit_more(pool, skb));
            *tx_wait += u64::from(!ok);
            ok
        });
        front.xmit_flush();
        w.app = reads;
        w.tx += sent;
        w
    }

    fn next_timer(&self) -> Option<Duration> {
        self.app.next_timer()
    }

    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        self.app.counters(&mut c);
        c.add_set("netfront", self.front.stats());
        c.add("guest", "tx_wait", self.tx_wait);
        c
    }

    fn shutdown(mut self) -> Counters {
        let c = self.counters();
        self.app.shutdown(&mut self.pool);
        c
    }
}

/// Puts a frame the stack built in a buffer of its own page and hands it to `xmit`
/// (netfront grants a page as it is; a shared 2 KiB head would be copied to one
/// first). False if there was no buffer or `xmit` had no room.
pub(crate) fn xmit_frame(
    pool: &mut SkbPool,
    frame: &[u8],
    xmit: impl FnOnce(&mut SkbPool, net::skb::SkbId) -> Result<(), net::skb::SkbId>,
) -> bool {
    let Ok(skb) = pool.alloc_page_linear() else {
        return false;
    };
    if pool.append(skb, frame).is_err() {
        pool.free(skb);
        return false;
    }
    match xmit(pool, skb) {
        Ok(()) => true,
        Err(s) => {
            pool.free(s);
            false
        }
    }
}

/// netfront with a TAP above it: received frames are written to the TAP, frames the
/// TAP's stack sends go out through netfront.
#[derive(Debug)]
pub struct TapGuest {
    dom: Arc<Domain>,
    front: Netfront,
    pool: SkbPool,
    tap: TapPort,
    /// Frames from the TAP that did not fit a buffer.
    tx_dropped: u64,
    /// Times a frame from the TAP waited: no page for it, or netfront's ring full.
    tx_wait_pool: u64,
    tx_wait_ring: u64,
}

impl TapGuest {
    /// The guest's kernel over a connected front end, its pool and `tap`; a frame
    /// arriving on the TAP wakes the guest's vCPU (the TAP is its interrupt line).
    pub fn new(dom: &Arc<Domain>, front: Netfront, pool: SkbPool, tap: TapPort) -> Self {
        Self {
            dom: Arc::clone(dom),
            front,
            pool,
            tap,
            tx_dropped: 0,
            tx_wait_pool: 0,
            tx_wait_ring: 0,
        }
    }
}

impl Kernel for TapGuest {
    const CLOCK: bool = false;

    fn thread_bound(&self) -> bool {
        dev::wire::WireSource::thread_bound(&self.tap)
    }

    fn attach(&mut self, waker: &hv::sched::Waker) {
        self.tap.bind_unit(waker);
    }

    fn event(&mut self, _v: &Vcpu, _port: Port) {}

    fn poll(&mut self, _now: Duration) -> Work {
        let Self {
            front,
            pool,
            tap,
            tx_dropped,
            tx_wait_pool,
            tx_wait_ring,
            ..
        } = self;
        let link = front.check_backend(pool);
        // Buffers a back end held when they were revoked come back once it lets go.
        pool.retry_deferred();
        let mut w = Work {
            rx: front.poll_rx(pool, NAPI_BUDGET, |pool, skb| {
                // Read straight into where the frame leaves from; the frames of one
                // poll go to the TAP together.
                let len = pool.len(skb);
                tap.send_with(len, pool.offload(skb), |buf| pool.read(skb, 0, buf).is_ok());
                pool.free(skb);
            }),
            ..Work::default()
        };
        tap.flush();
        // A frame netfront cannot take yet (its ring or the pool is full) waits in the
        // TAP's queue: the stack behind it is held back, not dropped on.
        w.tx = tap.recv(|frame, off| {
            // A head of its own page, which netfront grants as it is (a shared 2 KiB
            // head would be copied to one first); a large frame goes on in whole pages.
            let Ok(skb) = pool.alloc_page_linear() else {
                *tx_wait_pool += 1;
                return false;
            };
            match pool.append(skb, frame) {
                Ok(()) => {}
                Err(net::skb::SkbError::Exhausted) => {
                    // Out of pages: wait for completions, as for a full ring.
                    pool.free(skb);
                    *tx_wait_pool += 1;
                    return false;
                }
                Err(_) => {
                    pool.free(skb);
                    *tx_dropped += 1;
                    return true;
                }
            }
            pool.set_offload(skb, off);
            // Published with the rest of what this read of the TAP found, below.
            match front.xmit_more(pool, skb) {
                Ok(()) => true,
                Err(s) => {
                    pool.free(s);
                    *tx_wait_ring += 1;
                    false
                }
            }
        });
        front.xmit_flush();
        w.tx += front.poll_tx(pool) + usize::from(link != LinkChange::None);
        w
    }

    /// Named after its domain (`guest`, `guest netfront`, `guest pool`, `guest tap`),
    /// so that the guests of one machine each have their own.
    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        let name = self.dom.name();
        let part = |p: &str| format!("{name} {p}");
        c.add_set(&part("netfront"), self.front.stats());
        c.add(name, "tx_dropped", self.tx_dropped);
        c.add(name, "tx_wait_pool", self.tx_wait_pool);
        c.add(name, "tx_wait_ring", self.tx_wait_ring);
        let pool = part("pool");
        c.add_set(&pool, &self.pool.stats());
        c.add(&pool, "free_pages", self.pool.free_pages() as u64);
        c.add(&pool, "free_buffers", self.pool.free_buffers() as u64);
        c.add_port(
            &part("tap"),
            PortKind::HostInterface,
            &**self.tap.counters(),
        );
        c
    }

    fn shutdown(mut self) -> Counters {
        // On the vCPU's thread, which armed the TAP's reads.
        self.tap.close_io();
        self.counters()
    }
}

/// netfront with a raw application above it ([`crate::probe`]): the probes' echo
/// server or client, frames handed to netfront with no stack in the way (paper 002's
/// psapp on the host-centric path, the HV-NIC).
#[derive(Debug)]
pub struct RawGuest {
    front: Netfront,
    pool: SkbPool,
    raw: crate::probe::Raw,
    scratch: Vec<u8>,
    /// Frames the application sent that found no buffer or no room on the ring.
    tx_wait: u64,
}

impl RawGuest {
    /// The guest's kernel over a connected front end and its pool.
    pub fn new(front: Netfront, pool: SkbPool, raw: crate::probe::Raw) -> Self {
        Self {
            front,
            pool,
            raw,
            scratch: vec![0; 2048],
            tx_wait: 0,
        }
    }
}

impl Kernel for RawGuest {
    const CLOCK: bool = true;

    fn event(&mut self, _v: &Vcpu, _port: Port) {}

    fn poll(&mut self, now: Duration) -> Work {
        let Self {
            front,
            pool,
            raw,
            scratch,
            tx_wait,
        } = self;
        let link = front.check_backend(pool);
        pool.retry_deferred();
        // Received frames are read out of their buffers first (the ring's buffers go
        // back to netfront), then answered.
        let mut w = Work {
            tx: usize::from(link != LinkChange::None),
            ..Work::default()
        };
        let mut frames: [([u8; crate::probe::PROBE_LEN], usize); 8] =
            [([0; crate::probe::PROBE_LEN], 0); 8];
        let mut n = 0;
        w.rx = front.poll_rx(pool, frames.len(), |pool, skb| {
            let len = pool.len(skb).min(scratch.len());
            if pool.read(skb, 0, &mut scratch[..len]).is_ok() && n < frames.len() {
                let k = len.min(crate::probe::PROBE_LEN);
                frames[n].0[..k].copy_from_slice(&scratch[..k]);
                frames[n].1 = if len > crate::probe::PROBE_LEN {
                    0
                } else {
                    len
                };
                n += 1;
            }
            pool.free(skb);
        });
        front.poll_tx(pool);
        let mut send = |f: &[u8]| {
            let ok = xmit_frame(pool, f, |pool, skb| front.xmit_more(pool, skb));
            *tx_wait += u64::from(!ok);
            ok
        };
        for (f, len) in &frames[..n] {
            raw.input(&f[..*len], now, &mut send);
        }
        w.tx += raw.run(now, &mut send);
        front.xmit_flush();
        w.more |= w.rx == frames.len();
        w
    }

    fn next_timer(&self) -> Option<Duration> {
        self.raw.next_timer()
    }

    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        c.add_set("netfront", self.front.stats());
        c.add("guest", "tx_wait", self.tx_wait);
        if let crate::probe::Raw::Echo { echoed, .. } = &self.raw {
            c.add("echo", "echoed", *echoed);
        }
        c
    }

    fn shutdown(self) -> Counters {
        self.counters()
    }
}
