//! xenstore's wire protocol (`xs_wire.h`): the messages a domain exchanges with
//! xenstored over its ring, `/dev/xen/xenbus` or xenstored's socket.
//!
//! A message is a 16-byte header (`type`, `req_id`, `tx_id`, `len`, native-endian u32s)
//! and at most [`MAX_VALUE`] bytes of payload: NUL-separated strings. A reply carries
//! the request's type and `req_id`, or `XS_ERROR` with an errno name; a watch firing is
//! an unsolicited `XS_WATCH_EVENT` carrying the path and the token.
//!
//! Two ends are here. [`Client`] is a connection to a real xenstored (what a back end in
//! a real dom0 uses as its [`XenStore`]). [`serve`] answers that protocol from pvio's own
//! [`Store`] for one domain's connection, so that pvio's store can be reached by
//! anything that speaks it, and so that the client is tested against a known store.
//! Everything read from the other end is checked: a header whose length is over the
//! limit, a payload without its terminators or a reply to a request not made breaks
//! the connection with an error; nothing is trusted as a string until it is UTF-8.

use std::io::{self, Read, Write};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use super::{Store, StoreError, WatchEvent, XenStore, MAX_VALUE};
use crate::types::DomId;

/// `XS_DIRECTORY`.
pub const XS_DIRECTORY: u32 = 1;
/// `XS_READ`.
pub const XS_READ: u32 = 2;
/// `XS_WATCH`.
pub const XS_WATCH: u32 = 4;
/// `XS_UNWATCH`.
pub const XS_UNWATCH: u32 = 5;
/// `XS_TRANSACTION_START`.
pub const XS_TRANSACTION_START: u32 = 6;
/// `XS_TRANSACTION_END`.
pub const XS_TRANSACTION_END: u32 = 7;
/// `XS_GET_DOMAIN_PATH`.
pub const XS_GET_DOMAIN_PATH: u32 = 10;
/// `XS_WRITE`.
pub const XS_WRITE: u32 = 11;
/// `XS_MKDIR`.
pub const XS_MKDIR: u32 = 12;
/// `XS_RM`.
pub const XS_RM: u32 = 13;
/// `XS_WATCH_EVENT`.
pub const XS_WATCH_EVENT: u32 = 15;
/// `XS_ERROR`.
pub const XS_ERROR: u32 = 16;

/// Size of a message header.
pub const HEADER: usize = 16;

/// One message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Msg {
    /// `XS_*`.
    pub ty: u32,
    /// The requester's id, echoed in the reply.
    pub req_id: u32,
    /// The transaction (0: none).
    pub tx_id: u32,
    /// The payload.
    pub body: Vec<u8>,
}

impl Msg {
    /// A message of `ty` whose payload is `parts`, each followed by a NUL except the
    /// last when `last_nul` is false (`XS_WRITE`'s value has none).
    pub fn new(ty: u32, req_id: u32, tx_id: u32, parts: &[&[u8]], last_nul: bool) -> Self {
        let mut body = Vec::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
        for (i, p) in parts.iter().enumerate() {
            body.extend_from_slice(p);
            if last_nul || i + 1 < parts.len() {
                body.push(0);
            }
        }
        Msg {
            ty,
            req_id,
            tx_id,
            body,
        }
    }

    /// Writes the message.
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        if self.body.len() > MAX_VALUE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "xenstore payload over 4096 bytes",
            ));
        }
        let mut buf = Vec::with_capacity(HEADER + self.body.len());
        for v in [self.ty, self.req_id, self.tx_id, self.body.len() as u32] {
            buf.extend_from_slice(&v.to_ne_bytes());
        }
        buf.extend_from_slice(&self.body);
        // One write: `/dev/xen/xenbus` takes a message per write.
        w.write_all(&buf)
    }

    /// Reads one message, refusing a payload over the protocol's limit.
    pub fn recv(r: &mut impl Read) -> io::Result<Self> {
        let mut h = [0u8; HEADER];
        r.read_exact(&mut h)?;
        let word = |i: usize| u32::from_ne_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let len = word(12) as usize;
        if len > MAX_VALUE {
            return Err(bad(format!("xenstore message of {len} bytes")));
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body)?;
        Ok(Msg {
            ty: word(0),
            req_id: word(4),
            tx_id: word(8),
            body,
        })
    }

    /// The payload's NUL-terminated strings (a trailing unterminated piece counts as
    /// one too: `XS_WRITE`'s value).
    pub fn strings(&self) -> Result<Vec<&str>, StoreError> {
        let body = self.body.strip_suffix(&[0]).unwrap_or(&self.body);
        if body.is_empty() {
            return Ok(Vec::new());
        }
        body.split(|&b| b == 0)
            .map(|s| std::str::from_utf8(s).map_err(|_| StoreError::Invalid))
            .collect()
    }
}

fn bad(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// The errno name xenstored answers for an error.
pub fn errno_name(e: &StoreError) -> &'static str {
    match e {
        StoreError::NoEntry(_) => "ENOENT",
        StoreError::Denied(_) => "EACCES",
        StoreError::Invalid => "EINVAL",
        StoreError::Quota => "EQUOTA",
        StoreError::Again => "EAGAIN",
        StoreError::Unavailable(_) => "EIO",
    }
}

fn from_errno(name: &str, path: &str) -> StoreError {
    match name {
        "ENOENT" => StoreError::NoEntry(path.into()),
        "EACCES" | "EPERM" | "EROFS" => StoreError::Denied(path.into()),
        "EQUOTA" | "E2BIG" | "ENOSPC" => StoreError::Quota,
        "EAGAIN" => StoreError::Again,
        "EINVAL" | "EISDIR" | "EEXIST" => StoreError::Invalid,
        other => StoreError::Unavailable(format!("xenstored answered {other} for {path}")),
    }
}

struct Conn<S> {
    stream: S,
    next_req: u32,
}

/// A connection to a real xenstored, as domain `dom` (its own domain: xenstored knows a
/// connection's domain, so `caller` must be `dom`). Requests are answered in order;
/// watch events that arrive meanwhile are kept for [`Client::take_event`].
pub struct Client<S> {
    dom: DomId,
    conn: Mutex<Conn<S>>,
    events: Mutex<std::collections::VecDeque<WatchEvent>>,
    /// Watch events dropped because [`MAX_KEPT_EVENTS`] were kept untaken.
    events_dropped: std::sync::atomic::AtomicU64,
}

/// Watch events kept for a caller that has not taken them; later ones are dropped.
const MAX_KEPT_EVENTS: usize = 1024;

impl<S> std::fmt::Debug for Client<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("dom", &self.dom).finish()
    }
}

impl<S: Read + Write + Send> Client<S> {
    /// A client over `stream` (xenstored's socket, or `/dev/xen/xenbus`) for domain
    /// `dom`.
    pub fn new(stream: S, dom: DomId) -> Self {
        Client {
            dom,
            conn: Mutex::new(Conn {
                stream,
                next_req: 1,
            }),
            events: Mutex::new(std::collections::VecDeque::new()),
            events_dropped: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The domain this connection is.
    pub fn dom(&self) -> DomId {
        self.dom
    }

    fn keep(&self, m: &Msg) {
        let Ok(s) = m.strings() else { return };
        if let [path, token, ..] = s[..] {
            let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
            if q.len() < MAX_KEPT_EVENTS {
                q.push_back(WatchEvent {
                    path: path.to_string(),
                    token: token.to_string(),
                });
            } else {
                self.events_dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Sends one request and waits for its reply (an error reply becomes its error).
    pub fn request(
        &self,
        ty: u32,
        tx: u32,
        parts: &[&[u8]],
        last_nul: bool,
        path: &str,
    ) -> Result<Msg, StoreError> {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let id = c.next_req;
        c.next_req = c.next_req.wrapping_add(1).max(1);
        let io = |e: io::Error| StoreError::Unavailable(format!("xenstore connection: {e}"));
        Msg::new(ty, id, tx, parts, last_nul)
            .send(&mut c.stream)
            .map_err(io)?;
        loop {
            let m = Msg::recv(&mut c.stream).map_err(io)?;
            if m.ty == XS_WATCH_EVENT {
                self.keep(&m);
                continue;
            }
            if m.req_id != id {
                return Err(StoreError::Unavailable(format!(
                    "xenstored answered request {} while {id} was outstanding",
                    m.req_id
                )));
            }
            if m.ty == XS_ERROR {
                let s = m.strings()?;
                return Err(from_errno(s.first().copied().unwrap_or(""), path));
            }
            if m.ty != ty {
                return Err(StoreError::Unavailable(format!(
                    "xenstored answered type {} to a request of type {ty}",
                    m.ty
                )));
            }
            return Ok(m);
        }
    }

    fn check_caller(&self, caller: DomId, path: &str) -> Result<(), StoreError> {
        if caller == self.dom {
            Ok(())
        } else {
            Err(StoreError::Denied(path.into()))
        }
    }

    /// `XS_WATCH`: events for `path` and below arrive with `token`, the first at once.
    pub fn watch(&self, path: &str, token: &str) -> Result<(), StoreError> {
        self.request(
            XS_WATCH,
            0,
            &[path.as_bytes(), token.as_bytes()],
            true,
            path,
        )
        .map(|_| ())
    }

    /// `XS_UNWATCH`.
    pub fn unwatch(&self, path: &str, token: &str) -> Result<(), StoreError> {
        self.request(
            XS_UNWATCH,
            0,
            &[path.as_bytes(), token.as_bytes()],
            true,
            path,
        )
        .map(|_| ())
    }

    /// Watch events dropped so far because too many were kept untaken.
    pub fn events_dropped(&self) -> u64 {
        self.events_dropped
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A watch event that has arrived, if any (without waiting).
    pub fn take_event(&self) -> Option<WatchEvent> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
    }

    /// Reads one message off the connection, which must have one ready (its descriptor
    /// polled readable) and is keeping no request waiting: an event is kept.
    pub fn receive_event(&self) -> Result<(), StoreError> {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let m = Msg::recv(&mut c.stream)
            .map_err(|e| StoreError::Unavailable(format!("xenstore connection: {e}")))?;
        if m.ty == XS_WATCH_EVENT {
            self.keep(&m);
            Ok(())
        } else {
            Err(StoreError::Unavailable(format!(
                "xenstored sent type {} unasked",
                m.ty
            )))
        }
    }

    /// `XS_GET_DOMAIN_PATH` of `dom`.
    pub fn domain_path(&self, dom: DomId) -> Result<String, StoreError> {
        let id = dom.0.to_string();
        let m = self.request(XS_GET_DOMAIN_PATH, 0, &[id.as_bytes()], true, "")?;
        Ok(m.strings()?.first().copied().unwrap_or("").to_string())
    }
}

impl<S: Read + Write + Send> XenStore for Client<S> {
    fn read(&self, caller: DomId, path: &str) -> Result<String, StoreError> {
        self.check_caller(caller, path)?;
        let m = self.request(XS_READ, 0, &[path.as_bytes()], true, path)?;
        // A value is its bytes, NUL-free; xenstored sends no terminator.
        String::from_utf8(m.body).map_err(|_| StoreError::Invalid)
    }

    fn write(&self, caller: DomId, path: &str, value: &str) -> Result<(), StoreError> {
        self.check_caller(caller, path)?;
        self.request(
            XS_WRITE,
            0,
            &[path.as_bytes(), value.as_bytes()],
            false,
            path,
        )
        .map(|_| ())
    }

    fn rm(&self, caller: DomId, path: &str) -> Result<(), StoreError> {
        self.check_caller(caller, path)?;
        self.request(XS_RM, 0, &[path.as_bytes()], true, path)
            .map(|_| ())
    }

    fn directory(&self, caller: DomId, path: &str) -> Result<Vec<String>, StoreError> {
        self.check_caller(caller, path)?;
        let m = self.request(XS_DIRECTORY, 0, &[path.as_bytes()], true, path)?;
        Ok(m.strings()?.into_iter().map(str::to_string).collect())
    }
}

/// Answers xenstore's protocol on `stream` from `store`, as domain `dom`'s connection,
/// until the other end closes it or breaks the protocol (that error is returned). Watch
/// events are written by a thread per watch, through the same stream (`writer`, a
/// second handle on it).
pub fn serve<R, W>(store: &Store, dom: DomId, mut reader: R, writer: W) -> io::Result<()>
where
    R: Read,
    W: Write + Send + 'static,
{
    let writer = Arc::new(Mutex::new(writer));
    let mut watches: Vec<(String, String)> = Vec::new();
    let r = serve_loop(store, dom, &mut reader, &writer, &mut watches);
    // The connection's watches end with it (and so do their forwarding threads).
    for (path, token) in watches {
        store.unwatch(dom, &path, &token);
    }
    r
}

fn serve_loop<R: Read, W: Write + Send + 'static>(
    store: &Store,
    dom: DomId,
    reader: &mut R,
    writer: &Arc<Mutex<W>>,
    watches: &mut Vec<(String, String)>,
) -> io::Result<()> {
    let send = |m: &Msg| m.send(&mut *writer.lock().unwrap_or_else(|p| p.into_inner()));
    loop {
        let m = match Msg::recv(reader) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let error = |name: &str| Msg::new(XS_ERROR, m.req_id, m.tx_id, &[name.as_bytes()], true);
        let reply = match answer(store, dom, &m, watches) {
            Ok(Answer::Body(parts, last_nul)) => {
                let parts: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
                let r = Msg::new(m.ty, m.req_id, m.tx_id, &parts, last_nul);
                // An answer longer than a message may be (a directory whose children's
                // names add up to more) is refused as xenstored refuses it, and the
                // connection goes on.
                if r.body.len() > MAX_VALUE {
                    error("E2BIG")
                } else {
                    r
                }
            }
            Ok(Answer::Watch(rx)) => {
                let w = Arc::clone(writer);
                std::thread::spawn(move || forward(rx, w));
                Msg::new(m.ty, m.req_id, m.tx_id, &[b"OK"], true)
            }
            Err(e) => error(errno_name(&e)),
        };
        send(&reply)?;
    }
}

/// Watches one connection may hold at once (xenstored's default `quota-nr-watches`
/// per domain is 128).
pub const MAX_WATCHES_PER_CONNECTION: usize = 128;

enum Answer {
    Body(Vec<String>, bool),
    Watch(Receiver<WatchEvent>),
}

/// The answer to request `m` from domain `dom`'s connection, whose watches are
/// `watches` (a watch set or removed here is added to or taken from it).
fn answer(
    store: &Store,
    dom: DomId,
    m: &Msg,
    watches: &mut Vec<(String, String)>,
) -> Result<Answer, StoreError> {
    let s = m.strings()?;
    let arg = |i: usize| s.get(i).copied().ok_or(StoreError::Invalid);
    let ok = || Answer::Body(vec!["OK".into()], true);
    let tx = super::transaction::TxId(m.tx_id);
    let in_tx = m.tx_id != 0;
    Ok(match m.ty {
        XS_READ if in_tx => Answer::Body(vec![store.tx_read(dom, tx, arg(0)?)?], false),
        XS_READ => Answer::Body(vec![store.read(dom, arg(0)?)?], false),
        XS_WRITE => {
            // The value is everything after the path's NUL, NULs and all refused.
            let (path, value) = (arg(0)?, s.get(1).copied().unwrap_or(""));
            if s.len() > 2 {
                return Err(StoreError::Invalid);
            }
            if in_tx {
                store.tx_write(dom, tx, path, value)?;
            } else {
                store.write(dom, path, value)?;
            }
            ok()
        }
        XS_MKDIR => {
            // Inside a transaction, done inside it (seen by others at its end, gone
            // with an abort); an id that names no transaction of this domain's is
            // refused, as for any other request.
            let path = arg(0)?;
            let found = if in_tx {
                store.tx_read(dom, tx, path)
            } else {
                store.read(dom, path)
            };
            match found {
                Ok(_) => {}
                Err(StoreError::NoEntry(_)) if in_tx => store.tx_write(dom, tx, path, "")?,
                Err(StoreError::NoEntry(_)) => store.write(dom, path, "")?,
                Err(e) => return Err(e),
            }
            ok()
        }
        XS_RM if in_tx => {
            store.tx_rm(dom, tx, arg(0)?)?;
            ok()
        }
        XS_RM => {
            store.rm(dom, arg(0)?)?;
            ok()
        }
        XS_DIRECTORY => {
            let names = if in_tx {
                store.tx_directory(dom, tx, arg(0)?)?
            } else {
                store.directory(dom, arg(0)?)?
            };
            Answer::Body(names, true)
        }
        XS_WATCH => {
            let (path, token) = (arg(0)?, arg(1)?);
            // One watch per path and token, as xenstored (`EEXIST`); a connection holds
            // at most as many as a domain may.
            if watches.iter().any(|(p, t)| p == path && t == token) {
                return Err(StoreError::Invalid);
            }
            if watches.len() >= MAX_WATCHES_PER_CONNECTION {
                return Err(StoreError::Quota);
            }
            let rx = store.watch(dom, path, token)?;
            watches.push((path.to_string(), token.to_string()));
            Answer::Watch(rx)
        }
        XS_UNWATCH => {
            let (path, token) = (arg(0)?, arg(1)?);
            let Some(i) = watches.iter().position(|(p, t)| p == path && t == token) else {
                return Err(StoreError::NoEntry(path.into()));
            };
            watches.swap_remove(i);
            store.unwatch(dom, path, token);
            ok()
        }
        XS_TRANSACTION_START => {
            let t = store.transaction_start(dom)?;
            Answer::Body(vec![t.0.to_string()], true)
        }
        XS_TRANSACTION_END => {
            let commit = match arg(0)? {
                "T" => true,
                "F" => false,
                _ => return Err(StoreError::Invalid),
            };
            store.transaction_end(dom, tx, commit)?;
            ok()
        }
        XS_GET_DOMAIN_PATH => {
            let d: u16 = arg(0)?.parse().map_err(|_| StoreError::Invalid)?;
            Answer::Body(vec![format!("/local/domain/{d}")], true)
        }
        _ => return Err(StoreError::Invalid),
    })
}

fn forward<W: Write>(rx: Receiver<WatchEvent>, writer: Arc<Mutex<W>>) {
    while let Ok(ev) = rx.recv() {
        let m = Msg::new(
            XS_WATCH_EVENT,
            0,
            0,
            &[ev.path.as_bytes(), ev.token.as_bytes()],
            true,
        );
        if m.send(&mut *writer.lock().unwrap_or_else(|p| p.into_inner()))
            .is_err()
        {
            return;
        }
    }
}
