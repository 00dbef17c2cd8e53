//! The guest's NBD client against a server played in the test over a second smoltcp
//! host, back to back: negotiation with `NBD_OPT_GO`, reads placed in the bio's pages,
//! writes carried whole; and a hostile server (a wrong handle, a reply cut short by
//! the connection's end, an option reply longer than any real one, a wrong greeting)
//! breaks the connection and fails every request in flight, never hangs one.

use std::sync::Arc;
use std::time::Duration;

use blk::blkfront::{Bio, BioOp, BioSeg, Completion};
use blk::blkif::{BLKIF_RSP_ERROR, BLKIF_RSP_OKAY};
use hv::{Domain, DomainConfig, GrantVersion, HvConfig, Hypervisor};
use kernel::nbd::{
    NbdClient, NbdError, IHAVEOPT, NBDMAGIC, OPT_GO, OPT_REPLY_MAGIC, REP_ACK, REP_INFO,
    REQUEST_MAGIC, SIMPLE_REPLY_MAGIC,
};
use net::tcp::{Open, TcpHost};
use smoltcp::iface::SocketHandle;
use smoltcp::wire::Ipv4Address;

const DISK: usize = 1 << 20;

fn disk_byte(i: usize) -> u8 {
    (i.wrapping_mul(13) ^ (i >> 11)) as u8
}

struct Rig {
    _hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    client_host: TcpHost,
    server_host: TcpHost,
    c: SocketHandle,
    s: SocketHandle,
    client: NbdClient,
    now: Duration,
    /// What the server has read of the client's bytes.
    inbox: Vec<u8>,
}

impl Rig {
    fn new() -> Self {
        let hv = Hypervisor::new(HvConfig {
            frames: 4096,
            ..HvConfig::default()
        })
        .expect("hv");
        let dom = hv
            .create_domain(&DomainConfig {
                name: "guest".into(),
                pages: 1024,
                grant_frames: 2,
                grant_version: GrantVersion::V1,
                vcpus: 1,
                map_slots: 4,
                driver_domain: false,
            })
            .expect("guest");
        let now = Duration::ZERO;
        let mut client_host =
            TcpHost::new(Ipv4Address::new(10, 9, 0, 2), [2, 0, 0, 0, 0, 2], now, 1);
        let mut server_host =
            TcpHost::new(Ipv4Address::new(10, 9, 0, 1), [2, 0, 0, 0, 0, 1], now, 2);
        let s = server_host.open(Open::Listen(10809)).expect("listen");
        let c = client_host
            .open(Open::Connect {
                from: 40000,
                to: Ipv4Address::new(10, 9, 0, 1),
                port: 10809,
            })
            .expect("connect");
        Self {
            _hv: hv,
            dom,
            client_host,
            server_host,
            c,
            s,
            client: NbdClient::new("disk"),
            now,
            inbox: Vec::new(),
        }
    }

    /// Moves frames both ways, runs the client, and collects what reached the server.
    fn pump(&mut self) {
        for _ in 0..20 {
            self.now += Duration::from_millis(1);
            let now = self.now;
            self.client_host.poll(now);
            self.server_host.poll(now);
            let sh = &mut self.server_host;
            self.client_host.output(|f| {
                sh.input(f.len(), true, |b| {
                    b.copy_from_slice(f);
                    true
                });
                true
            });
            let ch = &mut self.client_host;
            self.server_host.output(|f| {
                ch.input(f.len(), true, |b| {
                    b.copy_from_slice(f);
                    true
                });
                true
            });
            self.client_host.poll(now);
            self.server_host.poll(now);
            let sock = self.client_host.socket(self.c);
            self.client.recv(sock, &self.dom);
            let ss = self.server_host.socket(self.s);
            let mut buf = [0u8; 8192];
            while let Ok(n) = ss.recv_slice(&mut buf) {
                if n == 0 {
                    break;
                }
                self.inbox.extend_from_slice(&buf[..n]);
            }
        }
    }

    fn server_send(&mut self, b: &[u8]) {
        let ss = self.server_host.socket(self.s);
        assert_eq!(ss.send_slice(b).expect("send"), b.len());
    }

    /// The greeting and the answer to `NBD_OPT_GO`: INFO_EXPORT with `size`, then ACK.
    fn negotiate(&mut self, size: u64) {
        self.pump();
        let mut g = Vec::new();
        g.extend_from_slice(&NBDMAGIC.to_be_bytes());
        g.extend_from_slice(&IHAVEOPT.to_be_bytes());
        g.extend_from_slice(&3u16.to_be_bytes());
        self.server_send(&g);
        self.pump();
        // Client flags (4) + IHAVEOPT (8) + GO (4) + length (4) + name length (4) +
        // "disk" + no information requests (2).
        assert_eq!(
            self.inbox.len(),
            4 + 8 + 4 + 4 + 4 + 4 + 2,
            "{:?}",
            self.inbox
        );
        assert_eq!(&self.inbox[12..16], &OPT_GO.to_be_bytes());
        assert_eq!(&self.inbox[24..28], b"disk");
        self.inbox.clear();
        let mut r = opt_reply(REP_INFO, 12);
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&size.to_be_bytes());
        r.extend_from_slice(&(1u16 | 4).to_be_bytes());
        r.extend(opt_reply(REP_ACK, 0));
        self.server_send(&r);
        self.pump();
    }

    /// Serves the requests in the inbox from the disk, as a good server does.
    fn serve(&mut self, disk: &mut [u8]) {
        while self.inbox.len() >= 28 {
            let h: Vec<u8> = self.inbox.drain(..28).collect();
            assert_eq!(&h[..4], &REQUEST_MAGIC.to_be_bytes());
            let cmd = u16::from_be_bytes([h[6], h[7]]);
            let off = u64::from_be_bytes(h[16..24].try_into().expect("8")) as usize;
            let len = u32::from_be_bytes(h[24..28].try_into().expect("4")) as usize;
            let mut rep = reply(0, &h[8..16]);
            if cmd == 0 {
                rep.extend_from_slice(&disk[off..off + len]);
            } else if cmd == 1 {
                while self.inbox.len() < len {
                    self.pump();
                }
                let d: Vec<u8> = self.inbox.drain(..len).collect();
                disk[off..off + len].copy_from_slice(&d);
            }
            self.server_send(&rep);
            self.pump();
        }
    }

    fn completions(&mut self) -> Vec<Completion> {
        let mut v = Vec::new();
        self.client.take_completions(|c| v.push(c));
        v
    }

    fn pages(&self, n: usize) -> Vec<BioSeg> {
        (0..n)
            .map(|_| BioSeg {
                gfn: self.dom.alloc_page().expect("page"),
                offset: 0,
                len: 4096,
            })
            .collect()
    }

    fn submit(&mut self, tag: u64, op: BioOp, sector: u64, segs: &[BioSeg]) {
        let sock = self.client_host.socket(self.c);
        self.client
            .submit(sock, &self.dom, tag, &Bio { op, sector, segs })
            .expect("submit");
    }
}

fn opt_reply(kind: u32, len: u32) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    r.extend_from_slice(&OPT_GO.to_be_bytes());
    r.extend_from_slice(&kind.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    r
}

fn reply(error: u32, handle: &[u8]) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    r.extend_from_slice(&error.to_be_bytes());
    r.extend_from_slice(handle);
    r
}

#[test]
fn reads_land_in_the_bios_pages_and_writes_reach_the_server_whole() {
    let mut r = Rig::new();
    r.negotiate(DISK as u64);
    assert!(r.client.is_ready());
    assert_eq!(r.client.sectors(), (DISK / 512) as u64);
    let mut disk: Vec<u8> = (0..DISK).map(disk_byte).collect();
    let rd = r.pages(3);
    let wr = r.pages(2);
    for p in &wr {
        r.dom.fill(p.gfn, 0, 4096, 0x77).expect("fill");
    }
    r.submit(1, BioOp::Read, 16, &rd);
    r.submit(2, BioOp::Write, 64, &wr);
    r.pump();
    r.serve(&mut disk);
    r.pump();
    let mut c = r.completions();
    c.sort_by_key(|c| c.tag);
    assert_eq!(
        c,
        vec![
            Completion {
                tag: 1,
                status: BLKIF_RSP_OKAY
            },
            Completion {
                tag: 2,
                status: BLKIF_RSP_OKAY
            }
        ]
    );
    for (k, p) in rd.iter().enumerate() {
        let mut b = vec![0u8; 4096];
        r.dom.read(p.gfn, 0, &mut b).expect("read");
        let at = 16 * 512 + k * 4096;
        assert_eq!(b, disk[at..at + 4096].to_vec());
    }
    assert!(disk[64 * 512..64 * 512 + 8192].iter().all(|&b| b == 0x77));
    assert_eq!(r.client.stats().read_bytes, 3 * 4096);
}

#[test]
fn a_reply_naming_no_request_in_flight_breaks_the_connection_and_fails_the_rest() {
    let mut r = Rig::new();
    r.negotiate(DISK as u64);
    let p = r.pages(1);
    r.submit(5, BioOp::Read, 0, &p);
    r.submit(6, BioOp::Read, 8, &p);
    r.pump();
    r.inbox.clear();
    // A handle never given out.
    r.server_send(&reply(0, &0xdead_beef_0000_0007u64.to_be_bytes()));
    r.pump();
    assert_eq!(r.client.broken(), Some(NbdError::UnknownHandle));
    let mut c = r.completions();
    c.sort_by_key(|c| c.tag);
    assert_eq!(
        c,
        vec![
            Completion {
                tag: 5,
                status: BLKIF_RSP_ERROR
            },
            Completion {
                tag: 6,
                status: BLKIF_RSP_ERROR
            }
        ]
    );
    let mut b = vec![0u8; 4096];
    r.dom.read(p[0].gfn, 0, &mut b).expect("read");
    assert!(b.iter().all(|&x| x == 0), "nothing was placed");
}

#[test]
fn a_reply_cut_short_by_the_connections_end_fails_the_request_not_hangs_it() {
    let mut r = Rig::new();
    r.negotiate(DISK as u64);
    let p = r.pages(1);
    r.submit(9, BioOp::Read, 0, &p);
    r.pump();
    let h: Vec<u8> = r.inbox[8..16].to_vec();
    // The header, half the data, and the end of the connection.
    let mut rep = reply(0, &h);
    rep.extend_from_slice(&[0x55; 2048]);
    r.server_send(&rep);
    r.server_host.socket(r.s).close();
    r.pump();
    r.pump();
    assert_eq!(r.client.broken(), Some(NbdError::Closed));
    assert_eq!(
        r.completions(),
        vec![Completion {
            tag: 9,
            status: BLKIF_RSP_ERROR
        }]
    );
}

#[test]
fn an_option_reply_longer_than_any_real_one_or_a_wrong_greeting_is_refused() {
    let mut r = Rig::new();
    r.pump();
    let mut g = Vec::new();
    g.extend_from_slice(&NBDMAGIC.to_be_bytes());
    g.extend_from_slice(&IHAVEOPT.to_be_bytes());
    g.extend_from_slice(&1u16.to_be_bytes());
    r.server_send(&g);
    r.pump();
    r.server_send(&opt_reply(REP_INFO, 1 << 20));
    r.pump();
    assert_eq!(r.client.broken(), Some(NbdError::BadOptionReply));

    let mut r = Rig::new();
    r.pump();
    r.server_send(b"NBDMAGIXIHAVEOPT\x00\x01");
    r.pump();
    assert_eq!(r.client.broken(), Some(NbdError::BadMagic));
}
