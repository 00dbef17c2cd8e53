//! The receiving application: a UDP socket read until it is empty, every message checked
//! whole against the sender's pattern ([`net::wire::payload_byte`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hv::profile::{enter, Class};
use hv::Domain;
use net::skb::SkbPool;
use net::stack::{SocketId, Stack, UserBuf, DEFAULT_RCVBUF};
use net::wire::{PayloadCheck, UdpFlow, MAX_UDP_PAYLOAD};

use crate::{other, BuildError};

/// What the application saw, readable while it runs.
#[derive(Debug, Default)]
pub struct AppCounters {
    /// Messages received.
    pub messages: AtomicU64,
    /// Bytes received.
    pub bytes: AtomicU64,
    /// Messages whose length or any byte was not what the sender sent.
    pub corrupt: AtomicU64,
}

/// What the application is told to expect.
#[derive(Debug, Clone)]
pub struct AppSpec {
    /// The flow it receives (its address, MAC and port are the destination's).
    pub flow: UdpFlow,
    /// Payload bytes per message.
    pub message: usize,
    /// Where it counts.
    pub counters: Arc<AppCounters>,
    /// Where it reports each message's one-way latency from the wire, if measured.
    pub latency: Option<Arc<dev::wire::LatencyProbe>>,
}

/// The application: its socket, its user buffer, and a scratch copy of each message
/// for the check (the application reads what it received, as netperf's receiver with
/// its check enabled does).
#[derive(Debug)]
pub struct UdpReceiver {
    sock: SocketId,
    buf: UserBuf,
    message: usize,
    check: PayloadCheck,
    scratch: Vec<u8>,
    counters: Arc<AppCounters>,
    latency: Option<Arc<dev::wire::LatencyProbe>>,
}

impl UdpReceiver {
    /// A stack for `dom` at the flow's destination, with the application's socket bound
    /// to its port, and the application with a user buffer of a whole datagram.
    pub fn bind(dom: &Arc<Domain>, spec: &AppSpec) -> Result<(Stack, Self), BuildError> {
        let f = spec.flow;
        let mut stack = Stack::new(f.dst_ip, f.dst_mac);
        let sock = stack
            .bind_udp(f.dst_port, DEFAULT_RCVBUF)
            .ok_or_else(|| other("bind: no free socket"))?;
        let app = Self {
            sock,
            buf: UserBuf::new(dom, 65536).map_err(other)?,
            message: spec.message,
            check: PayloadCheck::new(spec.message.min(MAX_UDP_PAYLOAD)),
            scratch: vec![0; 65536],
            counters: Arc::clone(&spec.counters),
            latency: spec.latency.clone(),
        };
        Ok((stack, app))
    }

    /// `recv` until the socket is empty; returns the messages taken.
    pub fn run(&mut self, stack: &mut Stack, pool: &mut SkbPool) -> usize {
        let mut n = 0;
        while let Ok(Some(r)) = stack.recv(pool, self.sock, &self.buf) {
            let _u = enter(Class::User);
            let data = &mut self.scratch[..r.len.min(65536)];
            let ok = r.len == self.message
                && self.buf.read(pool.domain(), 0, data).is_ok()
                && self.check.verify(data);
            if !ok {
                self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
            } else if let Some(p) = &self.latency {
                // The payload's first byte names the message (its pattern's sequence).
                p.received(data.first().copied().unwrap_or(0));
            }
            self.counters.messages.fetch_add(1, Ordering::Relaxed);
            self.counters
                .bytes
                .fetch_add(r.len as u64, Ordering::Relaxed);
            n += 1;
        }
        n
    }
}
