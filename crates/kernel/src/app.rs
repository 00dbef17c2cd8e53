//! The receiving application: a UDP socket read until it is empty, every message checked
//! whole against the sender's pattern ([`net::wire::payload_byte`]); or a TCP server
//! over smoltcp ([`net::tcp`]) that takes a stream (netperf's TCP_STREAM, every byte
//! checked against [`net::tcp::stream_byte`]) or answers requests (TCP_RR); or the
//! other end of a stream, a TCP client sending one (paper 002's iperf client).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hv::profile::{enter, Class};
use hv::Domain;
use net::skb::SkbId;
use net::skb::SkbPool;
use net::stack::{SocketId, Stack, UserBuf, DEFAULT_RCVBUF};
use net::tcp::{Open, StreamCheck, TcpHost};
use net::wire::{PayloadCheck, UdpFlow, MAX_UDP_PAYLOAD};

use crate::{other, BuildError, Counters};
use std::time::Duration;

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

/// The application's protocol and pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Proto {
    /// UDP messages, each checked whole (paper 000's workload).
    #[default]
    Udp,
    /// A TCP server taking one stream, every byte checked (netperf's TCP_STREAM).
    TcpStream,
    /// A TCP server answering each request of `message` bytes with the same bytes
    /// (netperf's TCP_RR).
    TcpRr,
    /// A TCP client at the flow's source that connects to its destination and sends
    /// one stream of [`net::tcp::stream_byte`]s as fast as the window allows (netperf's
    /// TCP_STREAM sender, iperf's client); its counters count what it wrote.
    TcpSend,
    /// The guest's NBD client at the flow's source, connecting to the server at its
    /// destination, with a block job above it ([`AppSpec::nbd`]).
    Nbd,
}

/// An NBD client's export and the block job that uses it.
#[derive(Debug, Clone)]
pub struct NbdSpec {
    /// The export's name (`nbd-server`'s section; `nbdkit`'s is empty).
    pub export: String,
    /// The block job above the client.
    pub job: crate::block::BlockJobSpec,
}

/// What the application is told to expect.
#[derive(Debug, Clone)]
pub struct AppSpec {
    /// The flow it receives (its address, MAC and port are the destination's: a TCP
    /// server listens there).
    pub flow: UdpFlow,
    /// Payload bytes per message (TCP_RR: per request).
    pub message: usize,
    /// UDP or TCP.
    pub proto: Proto,
    /// Where it counts.
    pub counters: Arc<AppCounters>,
    /// Where it reports each message's one-way latency from the wire, if measured.
    pub latency: Option<Arc<dev::wire::LatencyProbe>>,
    /// With [`Proto::Nbd`]: the export and the job.
    pub nbd: Option<NbdSpec>,
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

/// The guest's (or native kernel's) TCP and its application: a server, or a client
/// sending a stream.
#[derive(Debug)]
pub struct TcpApp {
    host: TcpHost,
    sock: smoltcp::iface::SocketHandle,
    proto: Proto,
    message: usize,
    port: u16,
    /// The application's buffer, which each read copies into (`copy_to_user`).
    buf: UserBuf,
    dom: Arc<Domain>,
    /// What arrived so far, checked.
    check: StreamCheck,
    scratch: Vec<u8>,
    counters: Arc<AppCounters>,
    /// The stack's next timer, as of the last poll.
    timer: Option<Duration>,
    /// A client's bytes written so far (the stream's offset).
    written: u64,
}

/// Bytes one read takes at most (netperf's receive size is the socket buffer's; a
/// 64 KiB read is what one large packet brings).
const READ_SIZE: usize = 65536;

impl TcpApp {
    /// A server: a host at the flow's destination with a socket listening on its port;
    /// a client ([`Proto::TcpSend`]): one at its source connecting to it.
    pub fn bind(dom: &Arc<Domain>, spec: &AppSpec, now: Duration) -> Result<Self, BuildError> {
        let f = spec.flow;
        let seed = u64::from(dom.id().0) << 16 | 0x7c9;
        let (mut host, open) = if spec.proto == Proto::TcpSend {
            (
                TcpHost::new(f.src_ip, f.src_mac, now, seed),
                Open::Connect {
                    from: f.src_port,
                    to: f.dst_ip,
                    port: f.dst_port,
                },
            )
        } else {
            (
                TcpHost::new(f.dst_ip, f.dst_mac, now, seed),
                Open::Listen(f.dst_port),
            )
        };
        let sock = host.open(open).map_err(other)?;
        if spec.proto == Proto::TcpRr {
            host.socket(sock).set_nagle_enabled(false);
        }
        Ok(Self {
            host,
            sock,
            proto: spec.proto,
            message: spec.message.max(1),
            port: f.dst_port,
            buf: UserBuf::new(dom, READ_SIZE).map_err(other)?,
            dom: Arc::clone(dom),
            check: StreamCheck::default(),
            scratch: vec![0; READ_SIZE],
            counters: Arc::clone(&spec.counters),
            timer: None,
            written: 0,
        })
    }

    /// Takes one received frame: copies it to the stack's receive ring, frees the
    /// buffer.
    pub fn input(&mut self, pool: &mut SkbPool, skb: SkbId) {
        let _c = enter(Class::Network);
        let len = pool.len(skb);
        let valid = pool.csum_valid(skb);
        self.host
            .input(len, valid, |b| pool.read(skb, 0, b).is_ok());
        pool.free(skb);
    }

    /// Runs the stack and the application at `now`; `send` puts each frame the stack
    /// sends on the wire (false: no room, it stays queued). Returns the reads the
    /// application made and the frames sent.
    pub fn run(&mut self, now: Duration, mut send: impl FnMut(&[u8]) -> bool) -> (usize, usize) {
        let c = enter(Class::Network);
        self.host.poll(now);
        drop(c);
        let reads = self.serve();
        let _c = enter(Class::Network);
        if reads > 0 {
            // What the application wrote, and the window its reads opened.
            self.host.poll(now);
        }
        let sent = self.host.output(&mut send);
        self.timer = self.host.poll_at(now);
        (reads, sent)
    }

    /// The application: reads what is there, checks it, answers requests. A closed
    /// connection is listened for again.
    fn serve(&mut self) -> usize {
        if self.proto == Proto::TcpSend {
            return self.send_stream();
        }
        let Self {
            host,
            sock,
            proto,
            message,
            buf,
            dom,
            check,
            scratch,
            counters,
            ..
        } = self;
        let s = host.socket(*sock);
        let mut reads = 0;
        while s.can_recv() {
            // TCP_RR answers whole requests: take no more than the room to answer.
            let room = match proto {
                Proto::TcpRr => (s.send_capacity() - s.send_queue()) / *message * *message,
                _ => READ_SIZE,
            };
            if room == 0 {
                break;
            }
            let n = {
                let _c = enter(Class::Network);
                match s.recv_slice(&mut scratch[..room.min(READ_SIZE)]) {
                    Ok(n) if n > 0 => n,
                    _ => break,
                }
            };
            let _u = enter(Class::User);
            let data = &scratch[..n];
            // The copy to the application's buffer, then its check of what it read.
            let _ = write_user(dom, buf, data);
            check.check(data);
            if *proto == Proto::TcpRr {
                let _ = s.send_slice(data);
            }
            reads += 1;
            counters.messages.fetch_add(1, Ordering::Relaxed);
            counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        counters.corrupt.store(check.corrupt, Ordering::Relaxed);
        if !s.is_open() {
            // The peer closed (or reset) the connection: serve the next one.
            s.abort();
            let _ = s.listen(self.port);
            self.check = StreamCheck::default();
        }
        reads
    }

    /// The client: writes the stream's next bytes while the socket has room (each
    /// write copied from the application's buffer, as `copy_from_user` does).
    fn send_stream(&mut self) -> usize {
        let s = self.host.socket(self.sock);
        let mut writes = 0;
        while s.can_send() {
            let room = (s.send_capacity() - s.send_queue()).min(READ_SIZE);
            if room == 0 {
                break;
            }
            let _u = enter(Class::User);
            let data = &mut self.scratch[..room];
            net::tcp::fill_stream(self.written, data);
            let _ = write_user(&self.dom, &self.buf, data);
            let n = {
                let _c = enter(Class::Network);
                match s.send_slice(data) {
                    Ok(n) if n > 0 => n,
                    _ => break,
                }
            };
            self.written += n as u64;
            writes += 1;
            self.counters.messages.fetch_add(1, Ordering::Relaxed);
            self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        writes
    }

    /// When the stack next needs its timer.
    pub fn next_timer(&self) -> Option<Duration> {
        self.timer
    }

    /// The stack's counters.
    pub fn stats(&self) -> &net::tcp::TcpStats {
        self.host.stats()
    }
}

/// Copies `data` into the application's buffer (from its start, as a read into one
/// user buffer does).
fn write_user(dom: &Domain, buf: &UserBuf, data: &[u8]) -> Result<(), hv::DomainError> {
    buf.write(dom, 0, &data[..data.len().min(buf.capacity())])
}

/// What a kernel runs above its network device: pvio's UDP stack with its receiver, or
/// smoltcp's TCP with a server.
#[derive(Debug)]
pub enum AppStack {
    /// UDP.
    Udp(Box<(Stack, UdpReceiver)>),
    /// TCP.
    Tcp(Box<TcpApp>),
    /// TCP carrying the NBD client under a block job.
    Nbd(Box<NbdApp>),
}

/// The guest's TCP, its NBD client and the block job above it.
#[derive(Debug)]
pub struct NbdApp {
    host: TcpHost,
    sock: smoltcp::iface::SocketHandle,
    client: crate::nbd::NbdClient,
    job: crate::block::BlockJob,
    dom: Arc<Domain>,
    timer: Option<Duration>,
    said_goodbye: bool,
}

/// The client and its socket as the job's queue.
struct NbdQueue<'a> {
    client: &'a mut crate::nbd::NbdClient,
    sock: &'a mut smoltcp::socket::tcp::Socket<'static>,
    dom: &'a Domain,
}

impl crate::block::BlockQueue for NbdQueue<'_> {
    fn submit(
        &mut self,
        tag: u64,
        bio: &blk::blkfront::Bio<'_>,
    ) -> Result<(), blk::blkfront::SubmitError> {
        self.client.submit(self.sock, self.dom, tag, bio)
    }
}

impl NbdApp {
    /// A client at the flow's source connecting to the server at its destination.
    pub fn bind(dom: &Arc<Domain>, spec: &AppSpec, now: Duration) -> Result<Self, BuildError> {
        let nbd = spec
            .nbd
            .as_ref()
            .ok_or_else(|| other("an NBD application needs its export and job"))?;
        let f = spec.flow;
        let seed = u64::from(dom.id().0) << 16 | 0xb0d;
        let mut host = TcpHost::new(f.src_ip, f.src_mac, now, seed);
        let sock = host
            .open(Open::Connect {
                from: f.src_port,
                to: f.dst_ip,
                port: f.dst_port,
            })
            .map_err(other)?;
        // Requests go as they come (each is a whole message).
        host.socket(sock).set_nagle_enabled(false);
        Ok(Self {
            host,
            sock,
            client: crate::nbd::NbdClient::new(&nbd.export),
            job: crate::block::BlockJob::new(dom, nbd.job.clone())?,
            dom: Arc::clone(dom),
            timer: None,
            said_goodbye: false,
        })
    }

    /// One received frame into the stack's ring.
    pub fn input(&mut self, pool: &mut SkbPool, skb: SkbId) {
        let _c = enter(Class::Network);
        let len = pool.len(skb);
        let valid = pool.csum_valid(skb);
        self.host
            .input(len, valid, |b| pool.read(skb, 0, b).is_ok());
        pool.free(skb);
    }

    /// Runs the stack, the client and the job: replies taken, completions to the job,
    /// its next requests sent. Returns the completions and the frames sent.
    pub fn run(&mut self, now: Duration, mut send: impl FnMut(&[u8]) -> bool) -> (usize, usize) {
        {
            let _c = enter(Class::Network);
            self.host.poll(now);
        }
        let s = self.host.socket(self.sock);
        self.client.recv(s, &self.dom);
        let job = &mut self.job;
        let done = self.client.take_completions(|c| job.done(c));
        let mut q = NbdQueue {
            client: &mut self.client,
            sock: self.host.socket(self.sock),
            dom: &self.dom,
        };
        let sent = self.job.submit(&mut q);
        if !self.said_goodbye && !self.job.busy() && self.job.finished() {
            self.client.disconnect(self.host.socket(self.sock));
            self.said_goodbye = true;
        }
        let _c = enter(Class::Network);
        if sent > 0 || done > 0 {
            self.host.poll(now);
        }
        let frames = self.host.output(&mut send);
        self.timer = self.host.poll_at(now);
        (done + sent, frames)
    }

    /// When the stack next needs its timer.
    pub fn next_timer(&self) -> Option<Duration> {
        self.timer
    }

    /// The client's and the stack's counters.
    pub fn counters(&self, c: &mut Counters) {
        c.add_set("tcp", self.host.stats());
        c.add_set("nbd", self.client.stats());
        c.add("nbd", "broken", u64::from(self.client.broken().is_some()));
    }
}

impl AppStack {
    /// The stack and application `spec` asks for, in `dom`, at `now`.
    pub fn bind(dom: &Arc<Domain>, spec: &AppSpec, now: Duration) -> Result<Self, BuildError> {
        Ok(match spec.proto {
            Proto::Udp => Self::Udp(Box::new(UdpReceiver::bind(dom, spec)?)),
            Proto::TcpStream | Proto::TcpRr | Proto::TcpSend => {
                Self::Tcp(Box::new(TcpApp::bind(dom, spec, now)?))
            }
            Proto::Nbd => Self::Nbd(Box::new(NbdApp::bind(dom, spec, now)?)),
        })
    }

    /// One received frame.
    pub fn input(&mut self, pool: &mut SkbPool, skb: SkbId, now: Duration) {
        match self {
            Self::Udp(u) => u.0.input(pool, skb, now),
            Self::Tcp(t) => t.input(pool, skb),
            Self::Nbd(n) => n.input(pool, skb),
        }
    }

    /// Runs the application (and TCP); `send` puts a frame on the wire. Returns what
    /// the application took and the frames sent.
    pub fn run(
        &mut self,
        pool: &mut SkbPool,
        now: Duration,
        mut send: impl FnMut(&mut SkbPool, &[u8]) -> bool,
    ) -> (usize, usize) {
        match self {
            Self::Udp(u) => {
                let (stack, app) = &mut **u;
                (app.run(stack, pool), 0)
            }
            Self::Tcp(t) => t.run(now, |f| send(pool, f)),
            Self::Nbd(n) => n.run(now, |f| send(pool, f)),
        }
    }

    /// The stack's timer expired.
    pub fn tick(&mut self, pool: &mut SkbPool, now: Duration) {
        if let Self::Udp(u) = self {
            u.0.tick(pool, now);
        }
    }

    /// When the stack next needs its timer.
    pub fn next_timer(&self) -> Option<Duration> {
        match self {
            Self::Udp(u) => u.0.next_timer(),
            Self::Tcp(t) => t.next_timer(),
            Self::Nbd(n) => n.next_timer(),
        }
    }

    /// The stack's counters.
    pub fn counters(&self, c: &mut Counters) {
        match self {
            Self::Udp(u) => {
                c.add_set("stack", u.0.stats());
                c.add_set("reassembly", u.0.reasm_stats());
            }
            Self::Tcp(t) => c.add_set("tcp", t.stats()),
            Self::Nbd(n) => n.counters(c),
        }
    }

    /// Gives back every buffer the stack holds.
    pub fn shutdown(&mut self, pool: &mut SkbPool) {
        if let Self::Udp(u) = self {
            u.0.shutdown(pool);
        }
    }
}
