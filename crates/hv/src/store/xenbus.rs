//! The store side of any split device, whatever its class: the errors of a handshake,
//! the toolstack's sharing of the two ends' directories, and strict reading of what the
//! other end wrote. netif's and blkif's own keys live with their protocols (`net::xenbus`,
//! `blk::xenbus`); this is what both share.
//!
//! Every value read from the peer's directory is untrusted text: it is parsed strictly
//! and a bad one fails the connection, never a panic.

use super::{Perm, Store, StoreError, XenStore, XenbusState};
use crate::DomId;

/// Why a handshake step failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum XenbusError {
    /// The store refused an operation.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// A key the peer must write is missing or not a number.
    #[error("bad or missing key {0}")]
    BadKey(String),
    /// The peer is not in a state this step can follow.
    #[error("peer in state {0:?}")]
    PeerState(XenbusState),
    /// The peer lacks a feature this end needs.
    #[error("peer lacks {0}")]
    MissingFeature(&'static str),
}

/// The toolstack's last step for any split device: each end owns its directory and may
/// read the other's, every node in it, so that keys a front end wrote for an earlier
/// back end are readable by this one.
pub fn share_dirs(
    store: &Store,
    fdir: &str,
    fe: DomId,
    bdir: &str,
    be: DomId,
) -> Result<(), XenbusError> {
    let t = DomId::DOM0;
    for (dir, owner, peer) in [(fdir, fe, be), (bdir, be, fe)] {
        store.set_perms(t, dir, owner, &[(peer, Perm::Read)])?;
        for k in store.directory(t, dir)? {
            store.set_perms(t, &format!("{dir}/{k}"), owner, &[(peer, Perm::Read)])?;
        }
    }
    Ok(())
}

/// Reads a decimal key the peer wrote, refusing anything but a plain number.
pub fn read_u32(store: &impl XenStore, caller: DomId, path: &str) -> Result<u32, XenbusError> {
    let v = store
        .read(caller, path)
        .map_err(|_| XenbusError::BadKey(path.into()))?;
    if v.is_empty() || v.len() > 10 || !v.bytes().all(|c| c.is_ascii_digit()) {
        return Err(XenbusError::BadKey(path.into()));
    }
    v.parse().map_err(|_| XenbusError::BadKey(path.into()))
}

/// Whether the peer advertised a boolean feature (`1`); anything else is no.
pub fn feature(store: &impl XenStore, caller: DomId, dir: &str, key: &str) -> bool {
    store
        .read(caller, &format!("{dir}/{key}"))
        .is_ok_and(|v| v == "1")
}

/// `multi-queue-max-queues`: how many rings (each with its channel) a back end takes,
/// for netif and blkif alike.
pub const MULTI_QUEUE_MAX_QUEUES: &str = "multi-queue-max-queues";
/// `multi-queue-num-queues`: how many the front end set up, each under `queue-<n>/`.
pub const MULTI_QUEUE_NUM_QUEUES: &str = "multi-queue-num-queues";

/// The queues the front end set up: `multi-queue-num-queues` (from 1 to the `max` this
/// end offered), or `None` if it did not write it (one ring, its keys at the top).
pub fn front_queues(
    store: &impl XenStore,
    be: DomId,
    fdir: &str,
    max: u32,
) -> Result<Option<u32>, XenbusError> {
    let key = format!("{fdir}/{MULTI_QUEUE_NUM_QUEUES}");
    if store.read(be, &key).is_err() {
        return Ok(None);
    }
    match read_u32(store, be, &key)? {
        n @ 1.. if n <= max => Ok(Some(n)),
        _ => Err(XenbusError::BadKey(key)),
    }
}

/// Where queue `q`'s ring keys are: under `queue-<q>/` of the front end's directory
/// `fdir` when it set up queues (`Some(q)`), else at its top, as Linux's front ends
/// write them for one queue (with or without `multi-queue-num-queues` 1).
pub fn queue_dir(fdir: &str, queues: Option<u32>, q: u32) -> String {
    match queues {
        Some(n) if n > 1 => format!("{fdir}/queue-{q}"),
        _ => fdir.to_string(),
    }
}
