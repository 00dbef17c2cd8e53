//! A real Xen, reached from a dom0 (or driver-domain) process through Linux's devices,
//! as QEMU's Xen back ends reach it: `/dev/xen/gntdev` for grant maps and copies,
//! `/dev/xen/evtchn` for event channels, and xenstored (its socket, or
//! `/dev/xen/xenbus`) for the store.
//!
//! The back end's own memory is a private pvio machine of one domain: its frames are
//! this process's memory (the packet buffers a back end copies into and out of), and
//! its window is filled by the grant device. A grant handle is the window slot the
//! grant is mapped at; a port is Xen's own port number.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use mem::xen::{CopyAt, Evtchn, Gntdev, GrantCopyOp, GRANT_COPY_BATCH};

use super::Xen;
use crate::store::wire::Client;
use crate::{
    CopyPtr, DomId, Domain, DomainConfig, EvtchnError, GrantCopy, GrantError, GrantHandle,
    GrantStatus, HvConfig, Hypervisor, MapOp, Port,
};

/// Where xenstored listens, newest layout first.
const XENSTORED_SOCKETS: [&str; 2] = ["/run/xenstored/socket", "/var/run/xenstored/socket"];

/// A connection to xenstored: its socket when this process may use it (dom0), else the
/// kernel's xenbus device (a driver domain).
#[derive(Debug)]
pub enum StoreConn {
    /// xenstored's Unix socket.
    Socket(UnixStream),
    /// `/dev/xen/xenbus`.
    Device(File),
}

impl StoreConn {
    /// Connects the way that works here.
    pub fn open() -> io::Result<Self> {
        for p in XENSTORED_SOCKETS {
            if let Ok(s) = UnixStream::connect(p) {
                return Ok(StoreConn::Socket(s));
            }
        }
        OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/xen/xenbus")
            .map(StoreConn::Device)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("xenstored's socket or /dev/xen/xenbus: {e}"),
                )
            })
    }

    /// The descriptor to poll for watch events.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            StoreConn::Socket(s) => s.as_raw_fd(),
            StoreConn::Device(f) => f.as_raw_fd(),
        }
    }
}

impl Read for StoreConn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            StoreConn::Socket(s) => s.read(buf),
            StoreConn::Device(f) => f.read(buf),
        }
    }
}

impl Write for StoreConn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            StoreConn::Socket(s) => s.write(buf),
            StoreConn::Device(f) => f.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A real Xen from a dom0 process; see the module's comment.
#[derive(Debug)]
pub struct Dom0 {
    id: DomId,
    /// The private machine whose one domain is this process's memory.
    local: Arc<Hypervisor>,
    dom: Arc<Domain>,
    evtchn: Evtchn,
    gntdev: Arc<Gntdev>,
    store: Client<StoreConn>,
    store_fd: std::os::fd::RawFd,
}

/// How a real Xen's back end is sized.
#[derive(Debug, Clone, Copy)]
pub struct Dom0Config {
    /// This domain's id under Xen (0 for dom0).
    pub id: DomId,
    /// Pages of its own memory (packet buffers).
    pub pages: u32,
    /// Window slots: how many grants it can map at once.
    pub map_slots: u32,
}

impl Dom0 {
    /// Opens the grant and event-channel devices and the store, and builds the process's
    /// own memory. Fails with the first device's error on a machine not running Xen.
    pub fn open(cfg: Dom0Config) -> io::Result<Self> {
        let gntdev = Arc::new(Gntdev::open()?);
        let evtchn = Evtchn::open()?;
        let conn = StoreConn::open()?;
        let store_fd = conn.raw_fd();
        let other = |e: crate::HvError| io::Error::other(e.to_string());
        let local = Hypervisor::new(HvConfig {
            frames: cfg.pages + 64,
            ..HvConfig::default()
        })
        .map_err(other)?;
        let dom = local
            .create_domain_in(
                &DomainConfig {
                    name: "dom0-process".into(),
                    pages: cfg.pages,
                    map_slots: cfg.map_slots,
                    driver_domain: true,
                    ..DomainConfig::default()
                },
                Some(Arc::clone(&gntdev)),
            )
            .map_err(other)?;
        Ok(Dom0 {
            id: cfg.id,
            local,
            dom,
            evtchn,
            gntdev,
            store: Client::new(conn, cfg.id),
            store_fd,
        })
    }

    /// This domain's id, as the store gives it: `domid` under the domain's own directory
    /// (a relative path, which the store resolves for the connection's domain). How a
    /// driver domain learns its id; dom0 when the store holds none (xenstored's socket
    /// is dom0's).
    pub fn own_id() -> io::Result<DomId> {
        let conn = StoreConn::open()?;
        let on_device = matches!(conn, StoreConn::Device(_));
        let client = Client::new(conn, DomId(0));
        match crate::store::XenStore::read(&client, DomId(0), "domid") {
            Ok(v) => v.trim().parse::<u16>().map(DomId).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("the store's domid {v:?} is not a domain id"),
                )
            }),
            Err(_) if !on_device => Ok(DomId(0)),
            Err(e) => Err(io::Error::other(format!(
                "this domain's id: the store has no domid ({e}); give --domid"
            ))),
        }
    }

    /// The event-channel device: poll it, read the ports that fired, unmask them.
    pub fn evtchn(&self) -> &Evtchn {
        &self.evtchn
    }

    /// The store connection's descriptor, to poll for watch events.
    pub fn store_fd(&self) -> std::os::fd::RawFd {
        self.store_fd
    }

    /// The store client (watches).
    pub fn client(&self) -> &Client<StoreConn> {
        &self.store
    }

    /// The private machine behind the process's memory.
    pub fn local(&self) -> &Arc<Hypervisor> {
        &self.local
    }

    fn copy_at(&self, p: CopyPtr) -> Result<CopyAt, GrantError> {
        Ok(match p {
            CopyPtr::Gref { dom, gref, offset } => CopyAt::Grant {
                dom: dom.0,
                gref: gref.0,
                offset,
            },
            CopyPtr::Local { gfn, offset } => CopyAt::Local {
                mfn: self
                    .local
                    .gfn_to_mfn(&self.dom, gfn)
                    .ok_or(GrantError::BadPage)?,
                offset,
            },
        })
    }
}

/// The errno of a failed device call (`EIO` if it has none).
fn os(e: &io::Error) -> i32 {
    const EIO: i32 = 5;
    e.raw_os_error().unwrap_or(EIO)
}

fn evtchn_err(e: io::Error) -> EvtchnError {
    EvtchnError::Os(os(&e))
}

impl Xen for Dom0 {
    type Store = Client<StoreConn>;

    fn domain(&self) -> &Arc<Domain> {
        &self.dom
    }

    fn store(&self) -> &Client<StoreConn> {
        &self.store
    }

    fn id(&self) -> DomId {
        self.id
    }

    fn grant_map(&self, ops: &[MapOp], out: &mut [Result<GrantHandle, GrantError>]) -> usize {
        let mut ok = 0;
        for (op, o) in ops.iter().zip(out.iter_mut()) {
            *o = self
                .dom
                .window
                .map_grant(op.slot, op.dom.0, op.gref.0, !op.readonly)
                .map(|()| GrantHandle(op.slot))
                .map_err(|e| match e {
                    mem::MemError::Os(n) => GrantError::Os(n),
                    mem::MemError::AlreadyMapped(_) | mem::MemError::NoSuchSlot(_) => {
                        GrantError::BadVirtAddr
                    }
                    _ => GrantError::BadPage,
                });
            ok += usize::from(o.is_ok());
        }
        ok
    }

    fn grant_unmap(&self, handles: &[GrantHandle], out: &mut [GrantStatus]) -> usize {
        let mut ok = 0;
        for (chunk, outs) in handles.chunks(64).zip(out.chunks_mut(64)) {
            let mut slots = [0u32; 64];
            for (s, h) in slots.iter_mut().zip(chunk) {
                *s = h.0;
            }
            let mut res = [Ok(mem::Mfn(0)); 64];
            let n = chunk.len().min(outs.len());
            self.dom.window.unmap_batch(&slots[..n], &mut res[..n]);
            for ((o, r), h) in outs.iter_mut().zip(&res[..n]).zip(chunk) {
                *o = r.map(|_| ()).map_err(|e| match e {
                    mem::MemError::InUse(_) => GrantError::MappingInUse,
                    mem::MemError::Os(n) => GrantError::Os(n),
                    _ => GrantError::BadHandle(h.0),
                });
                ok += usize::from(o.is_ok());
            }
        }
        ok
    }

    fn grant_copy(&self, ops: &[GrantCopy], status: &mut [GrantStatus]) -> usize {
        let n = ops.len().min(status.len());
        let mut ok = 0;
        for (o, s) in ops[..n]
            .chunks(GRANT_COPY_BATCH)
            .zip(status[..n].chunks_mut(GRANT_COPY_BATCH))
        {
            let mut batch = [GrantCopyOp {
                source: CopyAt::Local {
                    mfn: mem::Mfn(0),
                    offset: 0,
                },
                dest: CopyAt::Local {
                    mfn: mem::Mfn(0),
                    offset: 0,
                },
                len: 0,
            }; GRANT_COPY_BATCH];
            let mut codes = [0i16; GRANT_COPY_BATCH];
            // A local page this domain does not have: refused with its own reason.
            let mut refused = [None; GRANT_COPY_BATCH];
            for (i, op) in o.iter().enumerate() {
                match (self.copy_at(op.source), self.copy_at(op.dest)) {
                    (Ok(source), Ok(dest)) => {
                        batch[i] = GrantCopyOp {
                            source,
                            dest,
                            len: op.len,
                        }
                    }
                    // Left local-to-local, which the device refuses without a call.
                    (Err(e), _) | (_, Err(e)) => refused[i] = Some(e),
                }
            }
            let r = self
                .gntdev
                .copy(self.local.machine_memory(), &batch[..o.len()], &mut codes);
            for (i, (op, st)) in o.iter().zip(s.iter_mut()).enumerate() {
                let (gref, dom) = match (op.source, op.dest) {
                    (CopyPtr::Gref { gref, dom, .. }, _) | (_, CopyPtr::Gref { gref, dom, .. }) => {
                        (gref.0, dom)
                    }
                    _ => (0, self.id),
                };
                *st = match (refused[i], &r, codes[i]) {
                    (Some(e), _, _) => Err(e),
                    (None, Err(e), _) => Err(GrantError::Os(os(e))),
                    (None, Ok(_), 0) => Ok(()),
                    (None, Ok(_), c) => Err(GrantError::from_gntst(c, gref, dom)),
                };
                ok += usize::from(st.is_ok());
            }
        }
        ok
    }

    fn evtchn_bind_interdomain(&self, remote: DomId, port: Port) -> Result<Port, EvtchnError> {
        let local = self
            .evtchn
            .bind_interdomain(remote.0, port.0)
            .map_err(evtchn_err)?;
        // A port bound here starts unmasked in Linux's device; nothing more to do.
        Ok(Port(local))
    }

    fn evtchn_send(&self, port: Port) -> Result<(), EvtchnError> {
        self.evtchn.notify(port.0).map_err(evtchn_err)
    }

    fn evtchn_close(&self, port: Port) -> Result<(), EvtchnError> {
        self.evtchn.unbind(port.0).map_err(evtchn_err)
    }
}
