//! The store: a xenstore-like tree of paths with per-node permissions and watches, and
//! the xenbus state machine front and back ends use to negotiate and connect.
//!
//! Domain 0 (the toolstack) may do anything. Another domain may read a node it owns or
//! that grants it read, and write one it owns or that grants it write; a new node needs
//! write permission on its nearest existing ancestor, inherits that ancestor's
//! permissions and is owned by its creator (as xenstored does). Paths, values and the
//! number of nodes a domain owns are bounded, so a hostile domain cannot grow the store
//! without limit. A watch fires once when set and then on every change at or below its
//! path that the watcher may read.
//!
//! The store is the control plane, off the data path: it allocates and locks freely.
//!
//! Transactions ([`transaction`]) are xenstored's: reads and writes inside one see the
//! transaction's own writes, and its end commits them all at once, or answers
//! [`StoreError::Again`] (`EAGAIN`) if a node it read or wrote was changed by anyone
//! else since, and the caller starts it over, as Linux's xenbus does.

use std::collections::BTreeMap;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Mutex;

use crate::types::DomId;

pub mod transaction;
pub mod wire;
pub mod xenbus;

/// The store as a back end uses it: pvio's [`Store`], or a connection to a real
/// xenstored. `caller` is the domain making the call; pvio's store serves every domain
/// and checks each call's permissions against it, while a connection to xenstored is
/// its own domain's and refuses to act as any other.
pub trait XenStore: Send + Sync {
    /// Reads a node.
    fn read(&self, caller: DomId, path: &str) -> Result<String, StoreError>;
    /// Writes a node, creating it and any missing ancestors.
    fn write(&self, caller: DomId, path: &str, value: &str) -> Result<(), StoreError>;
    /// Removes a node and everything below it.
    fn rm(&self, caller: DomId, path: &str) -> Result<(), StoreError>;
    /// Names of a node's children.
    fn directory(&self, caller: DomId, path: &str) -> Result<Vec<String>, StoreError>;

    /// Reads `<dir>/state` as a xenbus state (missing or garbage reads as `Unknown`).
    fn xenbus_state(&self, caller: DomId, dir: &str) -> XenbusState {
        self.read(caller, &format!("{dir}/state"))
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .map_or(XenbusState::Unknown, XenbusState::from_u32)
    }

    /// Moves `<dir>/state` to `to`, refusing transitions the xenbus protocol does not
    /// have (so a confused peer cannot, say, jump from Closed to Connected).
    fn switch_state(&self, caller: DomId, dir: &str, to: XenbusState) -> Result<(), StoreError> {
        let from = self.xenbus_state(caller, dir);
        if !from.may_become(to) {
            return Err(StoreError::Invalid);
        }
        self.write(caller, &format!("{dir}/state"), &(to as u32).to_string())
    }
}

impl XenStore for Store {
    fn read(&self, caller: DomId, path: &str) -> Result<String, StoreError> {
        Store::read(self, caller, path)
    }
    fn write(&self, caller: DomId, path: &str, value: &str) -> Result<(), StoreError> {
        Store::write(self, caller, path, value)
    }
    fn rm(&self, caller: DomId, path: &str) -> Result<(), StoreError> {
        Store::rm(self, caller, path)
    }
    fn directory(&self, caller: DomId, path: &str) -> Result<Vec<String>, StoreError> {
        Store::directory(self, caller, path)
    }
}

/// Longest path (`XENSTORE_ABS_PATH_MAX`).
pub const MAX_PATH: usize = 3072;
/// Longest value (`XENSTORE_PAYLOAD_MAX`).
pub const MAX_VALUE: usize = 4096;
/// Nodes one (unprivileged) domain may own (xenstored's default entry quota).
pub const MAX_NODES_PER_DOMAIN: usize = 1000;
/// Watches one (unprivileged) domain may hold (xenstored's default).
pub const MAX_WATCHES_PER_DOMAIN: usize = 128;
/// Entries in a node's permission list that an unprivileged domain may set
/// (xenstored's `quota-nb-perms-per-node` default).
pub const MAX_PERMS_PER_NODE: usize = 5;
/// Events queued on one watch for a watcher that has not read them; later ones are
/// dropped and counted ([`Store::watch_events_dropped`]), as oxenstored bounds a
/// connection's pending watch events. With [`MAX_WATCHES_PER_DOMAIN`] watches and an
/// event of at most [`MAX_VALUE`] bytes, a domain that never reads pins at most 32 MiB.
pub const MAX_WATCH_EVENTS: usize = 64;

/// Access a domain has to a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Perm {
    /// Read only.
    Read,
    /// Write only.
    Write,
    /// Read and write.
    Both,
}

/// Why a store operation failed (xenstore's errno names).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No such node (`ENOENT`).
    #[error("no such node {0}")]
    NoEntry(String),
    /// Not permitted (`EACCES`).
    #[error("permission denied on {0}")]
    Denied(String),
    /// Malformed path or oversized value (`EINVAL`).
    #[error("invalid path or value")]
    Invalid,
    /// Quota exceeded (`EQUOTA`).
    #[error("quota exceeded")]
    Quota,
    /// A transaction met a change made since it started (`EAGAIN`): nothing of it was
    /// applied, and the caller starts it again.
    #[error("the transaction conflicted with another change; start it again")]
    Again,
    /// The store could not be reached or answered outside the protocol (a connection
    /// to a real xenstored that failed; `EIO`).
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

#[derive(Debug, Clone)]
struct Node {
    value: String,
    owner: DomId,
    perms: Vec<(DomId, Perm)>,
    /// The store's generation when this node's value, permissions or list of children
    /// last changed: what a transaction's end compares.
    gen: u64,
}

/// A watch event: the path that changed and the token given when watching.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// Node that changed (or was removed).
    pub path: String,
    /// The watcher's token.
    pub token: String,
}

#[derive(Debug)]
struct Watch {
    dom: DomId,
    path: String,
    token: String,
    tx: SyncSender<WatchEvent>,
    /// Run after an event is queued: xenstored's notification on the watcher's store
    /// event channel, which wakes its vCPU.
    wake: Option<Wake>,
}

/// What a watch runs when it queues an event (a vCPU kick, as the store channel's
/// event does).
#[derive(Clone)]
pub struct Wake(pub std::sync::Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Wake")
    }
}

#[derive(Debug, Default)]
struct Inner {
    nodes: BTreeMap<String, Node>,
    /// Bumped by every change; a changed node takes the new value as its `gen`.
    generation: u64,
    watches: Vec<Watch>,
    /// Watch events dropped because their watcher's queue was full.
    events_dropped: u64,
    /// Open transactions, by id.
    transactions: BTreeMap<u32, transaction::Txn>,
    /// The next transaction id (never 0, which is "no transaction").
    next_tx: u32,
}

/// The store.
#[derive(Debug)]
pub struct Store {
    inner: Mutex<Inner>,
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

fn valid_path(p: &str) -> bool {
    p.len() <= MAX_PATH
        && p.starts_with('/')
        && (p == "/" || !p.ends_with('/'))
        && !p.contains("//")
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/-_@.".contains(&b))
}

fn parent(p: &str) -> Option<&str> {
    if p == "/" {
        return None;
    }
    Some(match p.rfind('/') {
        Some(0) => "/",
        Some(i) => &p[..i],
        None => "/",
    })
}

/// Whether `path` is `base` or below it.
fn is_at_or_below(path: &str, base: &str) -> bool {
    base == "/"
        || path == base
        || (path.starts_with(base) && path.as_bytes().get(base.len()) == Some(&b'/'))
}

impl Node {
    fn allows(&self, dom: DomId, write: bool) -> bool {
        if dom == DomId::DOM0 || dom == self.owner {
            return true;
        }
        self.perms.iter().any(|(d, p)| {
            *d == dom
                && matches!(
                    (p, write),
                    (Perm::Both, _) | (Perm::Read, false) | (Perm::Write, true)
                )
        })
    }
}

impl Inner {
    /// The node at `path`, if it exists and `caller` may read (or write) it.
    fn node(&self, caller: DomId, path: &str, write: bool) -> Result<&Node, StoreError> {
        let n = self
            .nodes
            .get(path)
            .ok_or_else(|| StoreError::NoEntry(path.into()))?;
        if !n.allows(caller, write) {
            return Err(StoreError::Denied(path.into()));
        }
        Ok(n)
    }

    /// Fires the watches on `changed` and above it, and, for a removal, those below it
    /// too (their nodes went with it), as xenstored does.
    fn notify(&mut self, changed: &str) {
        self.notify_change(changed, false);
    }

    fn notify_change(&mut self, changed: &str, removed: bool) {
        let readable = |dom: DomId, nodes: &BTreeMap<String, Node>| {
            // A removed node: judge by its nearest existing ancestor.
            let mut p = Some(changed);
            while let Some(q) = p {
                if let Some(n) = nodes.get(q) {
                    return n.allows(dom, false);
                }
                p = parent(q);
            }
            dom == DomId::DOM0
        };
        let (nodes, dropped) = (&self.nodes, &mut self.events_dropped);
        self.watches.retain(|w| {
            let hit =
                is_at_or_below(changed, &w.path) || (removed && is_at_or_below(&w.path, changed));
            if !hit || !readable(w.dom, nodes) {
                return true;
            }
            let ev = WatchEvent {
                path: changed.to_string(),
                token: w.token.clone(),
            };
            match w.tx.try_send(ev) {
                Ok(()) => {
                    if let Some(Wake(f)) = &w.wake {
                        f();
                    }
                    true
                }
                // A watcher that does not read loses events, not the store's memory.
                Err(TrySendError::Full(_)) => {
                    *dropped += 1;
                    true
                }
                // A watcher that has gone away is dropped.
                Err(TrySendError::Disconnected(_)) => false,
            }
        });
    }

    fn owned_by(&self, dom: DomId) -> usize {
        owned_by(&self.nodes, dom)
    }
}

fn owned_by(nodes: &BTreeMap<String, Node>, dom: DomId) -> usize {
    nodes.values().filter(|n| n.owner == dom).count()
}

/// Writes `path` in `nodes` as [`Store::write`] does, creating it and any missing
/// ancestors (each new node bumps its parent's generation: its children changed).
fn put(
    nodes: &mut BTreeMap<String, Node>,
    generation: &mut u64,
    caller: DomId,
    path: &str,
    value: &str,
) -> Result<(), StoreError> {
    *generation += 1;
    let gen = *generation;
    if let Some(n) = nodes.get_mut(path) {
        if !n.allows(caller, true) {
            return Err(StoreError::Denied(path.into()));
        }
        n.value = value.to_string();
        n.gen = gen;
        return Ok(());
    }
    // Nearest existing ancestor decides, and gives its permissions.
    let mut missing = vec![path.to_string()];
    let mut p = parent(path);
    let anc = loop {
        let Some(q) = p else {
            return Err(StoreError::Invalid);
        };
        if let Some(n) = nodes.get(q) {
            break n.clone();
        }
        missing.push(q.to_string());
        p = parent(q);
    };
    if !anc.allows(caller, true) {
        return Err(StoreError::Denied(path.into()));
    }
    if caller != DomId::DOM0 && owned_by(nodes, caller) + missing.len() > MAX_NODES_PER_DOMAIN {
        return Err(StoreError::Quota);
    }
    let owner = if caller == DomId::DOM0 {
        anc.owner
    } else {
        caller
    };
    for (i, m) in missing.iter().rev().enumerate() {
        let v = if i + 1 == missing.len() {
            value.to_string()
        } else {
            String::new()
        };
        nodes.insert(
            m.clone(),
            Node {
                value: v,
                owner,
                perms: anc.perms.clone(),
                gen,
            },
        );
    }
    if let Some(n) = p.and_then(|q| nodes.get_mut(q)) {
        n.gen = gen;
    }
    Ok(())
}

/// Removes `path` and everything below it from `nodes`, as [`Store::rm`] does (the
/// parent's generation bumped: its children changed).
fn remove(
    nodes: &mut BTreeMap<String, Node>,
    generation: &mut u64,
    caller: DomId,
    path: &str,
) -> Result<(), StoreError> {
    let n = nodes
        .get(path)
        .ok_or_else(|| StoreError::NoEntry(path.into()))?;
    if !n.allows(caller, true) {
        return Err(StoreError::Denied(path.into()));
    }
    let doomed: Vec<String> = nodes
        .keys()
        .filter(|k| is_at_or_below(k, path))
        .cloned()
        .collect();
    for k in &doomed {
        nodes.remove(k);
    }
    *generation += 1;
    if let Some(n) = parent(path).and_then(|q| nodes.get_mut(q)) {
        n.gen = *generation;
    }
    Ok(())
}

/// The names of `path`'s children in `nodes`.
fn children(nodes: &BTreeMap<String, Node>, path: &str) -> Vec<String> {
    let prefix = if path == "/" {
        "/".to_string()
    } else {
        format!("{path}/")
    };
    nodes
        .range(prefix.clone()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .filter_map(|(k, _)| {
            let rest = &k[prefix.len()..];
            (!rest.is_empty() && !rest.contains('/')).then(|| rest.to_string())
        })
        .collect()
}

impl Store {
    /// An empty store with the root owned by domain 0.
    pub fn new() -> Self {
        let mut nodes = BTreeMap::new();
        nodes.insert(
            "/".to_string(),
            Node {
                value: String::new(),
                owner: DomId::DOM0,
                perms: Vec::new(),
                gen: 0,
            },
        );
        Self {
            inner: Mutex::new(Inner {
                nodes,
                next_tx: 1,
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Nodes `dom` owns (what its quota counts).
    pub fn nodes_owned(&self, dom: DomId) -> usize {
        self.lock().owned_by(dom)
    }

    /// Reads a node.
    pub fn read(&self, caller: DomId, path: &str) -> Result<String, StoreError> {
        if !valid_path(path) {
            return Err(StoreError::Invalid);
        }
        let g = self.lock();
        let n = g.node(caller, path, false)?;
        Ok(n.value.clone())
    }

    /// Writes a node, creating it and any missing ancestors.
    pub fn write(&self, caller: DomId, path: &str, value: &str) -> Result<(), StoreError> {
        if !valid_path(path) || value.len() > MAX_VALUE {
            return Err(StoreError::Invalid);
        }
        let mut g = self.lock();
        let g = &mut *g;
        put(&mut g.nodes, &mut g.generation, caller, path, value)?;
        g.notify(path);
        Ok(())
    }

    /// Removes a node and everything below it.
    pub fn rm(&self, caller: DomId, path: &str) -> Result<(), StoreError> {
        if !valid_path(path) || path == "/" {
            return Err(StoreError::Invalid);
        }
        let mut g = self.lock();
        let g = &mut *g;
        remove(&mut g.nodes, &mut g.generation, caller, path)?;
        g.notify_change(path, true);
        Ok(())
    }

    /// Names of a node's children.
    pub fn directory(&self, caller: DomId, path: &str) -> Result<Vec<String>, StoreError> {
        if !valid_path(path) {
            return Err(StoreError::Invalid);
        }
        let g = self.lock();
        g.node(caller, path, false)?;
        Ok(children(&g.nodes, path))
    }

    /// Sets a node's owner and permissions. Domain 0 may set anything; the owner may
    /// change the permission list (at most [`MAX_PERMS_PER_NODE`] entries) but not give
    /// the node to another domain, which would move it out of its own quota and into
    /// the other's (xenstored refuses the same).
    pub fn set_perms(
        &self,
        caller: DomId,
        path: &str,
        owner: DomId,
        perms: &[(DomId, Perm)],
    ) -> Result<(), StoreError> {
        if !valid_path(path) {
            return Err(StoreError::Invalid);
        }
        let mut g = self.lock();
        let n = g
            .nodes
            .get_mut(path)
            .ok_or_else(|| StoreError::NoEntry(path.into()))?;
        if caller != DomId::DOM0 {
            if caller != n.owner || owner != n.owner {
                return Err(StoreError::Denied(path.into()));
            }
            if perms.len() > MAX_PERMS_PER_NODE {
                return Err(StoreError::Quota);
            }
        }
        n.owner = owner;
        n.perms = perms.to_vec();
        g.generation += 1;
        let gen = g.generation;
        if let Some(n) = g.nodes.get_mut(path) {
            n.gen = gen;
        }
        g.notify(path);
        Ok(())
    }

    /// Watches `path` and below; the returned receiver gets one event at once (as
    /// xenstore fires a new watch) and one per later change, at most
    /// [`MAX_WATCH_EVENTS`] of them waiting. The path and token must fit one watch-event
    /// message (`XENSTORE_PAYLOAD_MAX`).
    pub fn watch(
        &self,
        caller: DomId,
        path: &str,
        token: &str,
    ) -> Result<Receiver<WatchEvent>, StoreError> {
        self.watch_waking(caller, path, token, None)
    }

    /// As [`Store::watch`], running `wake` each time an event is queued (the store's
    /// event channel to the watcher, so that a blocked vCPU sees the change).
    pub fn watch_waking(
        &self,
        caller: DomId,
        path: &str,
        token: &str,
        wake: Option<Wake>,
    ) -> Result<Receiver<WatchEvent>, StoreError> {
        // The event message carries both, each NUL-terminated.
        if !valid_path(path) || path.len() + token.len() + 2 > MAX_VALUE {
            return Err(StoreError::Invalid);
        }
        let (tx, rx) = sync_channel(MAX_WATCH_EVENTS);
        let mut g = self.lock();
        if caller != DomId::DOM0
            && g.watches.iter().filter(|w| w.dom == caller).count() >= MAX_WATCHES_PER_DOMAIN
        {
            return Err(StoreError::Quota);
        }
        let _ = tx.try_send(WatchEvent {
            path: path.to_string(),
            token: token.to_string(),
        });
        g.watches.push(Watch {
            dom: caller,
            path: path.to_string(),
            token: token.to_string(),
            tx,
            wake,
        });
        Ok(rx)
    }

    /// Watch events dropped so far because a watcher's queue was full.
    pub fn watch_events_dropped(&self) -> u64 {
        self.lock().events_dropped
    }

    /// Watches set now (every domain's): what a connection that watches and unwatches in
    /// a loop must not grow.
    pub fn watches_open(&self) -> usize {
        self.lock().watches.len()
    }

    /// Removes a domain's watch.
    pub fn unwatch(&self, caller: DomId, path: &str, token: &str) {
        self.lock()
            .watches
            .retain(|w| !(w.dom == caller && w.path == path && w.token == token));
    }
}

/// `enum xenbus_state` of Xen's `io/xenbus.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u32)]
pub enum XenbusState {
    /// Not yet written.
    Unknown = 0,
    /// Setting up.
    Initialising = 1,
    /// Waiting for the peer's information (back ends, after publishing features).
    InitWait = 2,
    /// Information published (front ends, after writing ring refs and ports).
    Initialised = 3,
    /// Running.
    Connected = 4,
    /// Shutting down.
    Closing = 5,
    /// Shut down.
    Closed = 6,
    /// Reconfiguring (not used by network devices).
    Reconfiguring = 7,
    /// Reconfigured.
    Reconfigured = 8,
}

impl XenbusState {
    /// From the store's number; unknown numbers read as `Unknown`.
    pub fn from_u32(v: u32) -> Self {
        match v {
            1 => Self::Initialising,
            2 => Self::InitWait,
            3 => Self::Initialised,
            4 => Self::Connected,
            5 => Self::Closing,
            6 => Self::Closed,
            7 => Self::Reconfiguring,
            8 => Self::Reconfigured,
            _ => Self::Unknown,
        }
    }

    /// Whether an end may move from `self` to `to`: forward through set-up, to Closing
    /// from anywhere, Closing to Closed, and Closed back to Initialising (reconnect after
    /// a back end restarts).
    pub fn may_become(self, to: Self) -> bool {
        use XenbusState::*;
        match (self, to) {
            (a, b) if a == b => true,
            (_, Closing) => true,
            (Closing, Closed) => true,
            (Closed | Unknown, Initialising) => true,
            // A back end whose front end starts over after both closed offers again
            // (Linux's blkback: "prepare for reconnect").
            (Closed, InitWait) => true,
            (Unknown | Initialising, InitWait | Initialised) => true,
            (InitWait, Initialised) => true,
            (Initialising | InitWait | Initialised, Connected) => true,
            (Connected, Reconfiguring)
            | (Reconfiguring, Reconfigured)
            | (Reconfigured, Connected) => true,
            (Unknown, Closed) => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_and_watches() {
        let s = Store::new();
        let (d1, d2) = (DomId(1), DomId(2));
        s.write(DomId::DOM0, "/local/domain/1", "")
            .expect("toolstack");
        s.set_perms(DomId::DOM0, "/local/domain/1", d1, &[])
            .expect("perms");
        s.write(d1, "/local/domain/1/device/vif/0/state", "1")
            .expect("own subtree");
        assert_eq!(
            s.read(d2, "/local/domain/1/device/vif/0/state"),
            Err(StoreError::Denied(
                "/local/domain/1/device/vif/0/state".into()
            ))
        );
        assert!(matches!(
            s.write(d2, "/local/domain/1/x", "y"),
            Err(StoreError::Denied(_))
        ));
        s.set_perms(
            d1,
            "/local/domain/1/device/vif/0/state",
            d1,
            &[(d2, Perm::Read)],
        )
        .expect("share");
        let w = s
            .watch(d2, "/local/domain/1/device/vif/0/state", "tok")
            .expect("watch");
        assert_eq!(
            w.try_recv().map(|e| e.token),
            Ok("tok".to_string()),
            "fires once when set"
        );
        s.write(d1, "/local/domain/1/device/vif/0/state", "2")
            .expect("write");
        assert_eq!(
            w.try_recv().map(|e| e.path),
            Ok("/local/domain/1/device/vif/0/state".to_string())
        );
        assert_eq!(
            s.directory(d1, "/local/domain/1/device/vif"),
            Ok(vec!["0".to_string()])
        );
        assert_eq!(s.write(d1, "bad//path", "x"), Err(StoreError::Invalid));
        assert_eq!(
            s.write(d1, "/local/domain/1/v", &"x".repeat(MAX_VALUE + 1)),
            Err(StoreError::Invalid)
        );
        s.rm(d1, "/local/domain/1/device").expect("rm");
        assert!(matches!(
            s.read(d1, "/local/domain/1/device/vif/0/state"),
            Err(StoreError::NoEntry(_))
        ));
    }

    #[test]
    fn a_domain_cannot_exceed_its_node_quota() {
        let s = Store::new();
        s.write(DomId::DOM0, "/q", "").expect("mk");
        s.set_perms(DomId::DOM0, "/q", DomId(3), &[]).expect("own");
        // It already owns /q.
        for i in 0..MAX_NODES_PER_DOMAIN - 1 {
            s.write(DomId(3), &format!("/q/n{i}"), "v")
                .expect("under quota");
        }
        assert_eq!(
            s.write(DomId(3), "/q/one-too-many", "v"),
            Err(StoreError::Quota)
        );
    }

    #[test]
    fn an_unprivileged_domain_cannot_give_its_nodes_away_or_grow_their_acls() {
        // Finding 7: handing nodes to a victim moved them out of the giver's quota and
        // into the victim's, until the victim's own writes failed.
        let s = Store::new();
        let (evil, victim) = (DomId(3), DomId(4));
        for d in [evil, victim] {
            let dir = format!("/local/domain/{}", d.0);
            s.write(DomId::DOM0, &dir, "").expect("toolstack");
            s.set_perms(DomId::DOM0, &dir, d, &[]).expect("own");
        }
        s.write(evil, "/local/domain/3/junk", "x")
            .expect("own node");
        assert_eq!(
            s.set_perms(evil, "/local/domain/3/junk", victim, &[]),
            Err(StoreError::Denied("/local/domain/3/junk".into())),
            "the owner stays"
        );
        let acl: Vec<(DomId, Perm)> = (0..MAX_PERMS_PER_NODE as u16 + 1)
            .map(|i| (DomId(100 + i), Perm::Read))
            .collect();
        assert_eq!(
            s.set_perms(evil, "/local/domain/3/junk", evil, &acl),
            Err(StoreError::Quota),
            "permission lists are bounded"
        );
        s.set_perms(
            evil,
            "/local/domain/3/junk",
            evil,
            &acl[..MAX_PERMS_PER_NODE],
        )
        .expect("sharing within the bound");
        // The victim still writes up to its whole quota (it owns its directory).
        for i in 0..MAX_NODES_PER_DOMAIN - 1 {
            s.write(victim, &format!("/local/domain/4/n{i}"), "v")
                .expect("the victim's quota is its own");
        }
        // The toolstack may still hand a node to anyone.
        s.set_perms(DomId::DOM0, "/local/domain/3/junk", victim, &[])
            .expect("dom0 sets owners");
    }

    #[test]
    fn watch_events_and_tokens_are_bounded() {
        // Finding 8: a watcher that never reads, and tokens of any length.
        let s = Store::new();
        let d = DomId(5);
        s.write(DomId::DOM0, "/w", "").expect("mk");
        s.set_perms(DomId::DOM0, "/w", d, &[]).expect("own");
        assert_eq!(
            s.watch(d, "/w", &"t".repeat(MAX_VALUE)).err(),
            Some(StoreError::Invalid),
            "a token that cannot fit a watch event is refused"
        );
        let w = s.watch(d, "/w", "tok").expect("watch");
        for i in 0..10 * MAX_WATCH_EVENTS {
            s.write(d, "/w/x", &i.to_string()).expect("write");
        }
        assert_eq!(
            w.try_iter().count(),
            MAX_WATCH_EVENTS,
            "queued events bounded"
        );
        assert!(s.watch_events_dropped() >= (9 * MAX_WATCH_EVENTS) as u64);
        // Read, the watch works again.
        s.write(d, "/w/x", "again").expect("write");
        assert_eq!(w.try_recv().map(|e| e.path), Ok("/w/x".to_string()));
    }

    #[test]
    fn xenbus_transitions() {
        let s = Store::new();
        let d = "/local/domain/0/backend/vif/1/0";
        s.switch_state(DomId::DOM0, d, XenbusState::Initialising)
            .expect("start");
        s.switch_state(DomId::DOM0, d, XenbusState::InitWait)
            .expect("features");
        s.switch_state(DomId::DOM0, d, XenbusState::Connected)
            .expect("connect");
        assert_eq!(s.xenbus_state(DomId::DOM0, d), XenbusState::Connected);
        assert_eq!(
            s.switch_state(DomId::DOM0, d, XenbusState::Initialised),
            Err(StoreError::Invalid)
        );
        s.switch_state(DomId::DOM0, d, XenbusState::Closing)
            .expect("close");
        s.switch_state(DomId::DOM0, d, XenbusState::Closed)
            .expect("closed");
        assert_eq!(
            s.switch_state(DomId::DOM0, d, XenbusState::Connected),
            Err(StoreError::Invalid)
        );
        // Closed, a back end offers again for a front end that starts over.
        s.switch_state(DomId::DOM0, d, XenbusState::InitWait)
            .expect("offered again");
        s.write(DomId::DOM0, &format!("{d}/state"), "garbage")
            .expect("hostile write");
        assert_eq!(s.xenbus_state(DomId::DOM0, d), XenbusState::Unknown);
    }
}
