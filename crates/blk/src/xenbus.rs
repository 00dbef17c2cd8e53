//! The store side of a virtual block device: where each end's keys live, what the
//! toolstack writes to create one, and what each end publishes.
//!
//! The handshake follows blkif's, in pvio's order (as for vifs, [`net::toolstack`]):
//! the toolstack creates both directories in `Initialising`, with the back end's `mode`
//! (`r` or `w`); the back end opens its disk and publishes the disk's size (`sectors`,
//! `sector-size`, `info`) and its features (`feature-flush-cache`, `feature-discard`,
//! `feature-persistent`, `feature-max-indirect-segments`) and moves to `InitWait`; the
//! front end reads them, sets up its ring and publishes `ring-ref`, `event-channel`,
//! `protocol` and its own `feature-persistent`, and moves to `Connected`; the back end
//! maps the ring, binds the channel and moves to `Connected`. Every value read from the
//! peer is untrusted text, parsed strictly ([`hv::store::xenbus::read_u32`]).

use hv::store::xenbus::{feature, read_u32, XenbusError};
use hv::store::{Store, XenStore, XenbusState};
use hv::DomId;

use crate::blkif::{Offer, SECTOR_SIZE};

/// `info`'s bit for a read-only disk (`VDISK_READONLY`).
pub const VDISK_READONLY: u32 = 4;
/// The only protocol pvio's back end speaks (`XEN_IO_PROTO_ABI_NATIVE` on x86-64).
pub const PROTOCOL: &str = "x86_64-abi";
/// `feature-persistent`: the back end keeps the front end's grants mapped across
/// requests; the front end, that it grants a fixed pool of pages and copies through
/// them.
pub const FEATURE_PERSISTENT: &str = "feature-persistent";
/// `feature-max-indirect-segments`.
pub const FEATURE_MAX_INDIRECT: &str = "feature-max-indirect-segments";
/// `feature-flush-cache`.
pub const FEATURE_FLUSH: &str = "feature-flush-cache";
/// `feature-discard`.
pub const FEATURE_DISCARD: &str = "feature-discard";
pub use hv::store::xenbus::{MULTI_QUEUE_MAX_QUEUES, MULTI_QUEUE_NUM_QUEUES};
/// `max-ring-page-order`: how many pages (a power of two) the front end's ring may span.
pub const MAX_RING_PAGE_ORDER: &str = "max-ring-page-order";
/// `discard-enable`: the toolstack's word in the back end's directory (xl's `discard` or
/// `no-discard`); `0` takes the feature away.
pub const DISCARD_ENABLE: &str = "discard-enable";

/// The front end's directory (`device/vbd/<devid>`).
pub fn frontend_dir(fe: DomId, devid: u32) -> String {
    format!("/local/domain/{}/device/vbd/{devid}", fe.0)
}

/// The back end's directory.
pub fn backend_dir(be: DomId, fe: DomId, devid: u32) -> String {
    format!("/local/domain/{}/backend/vbd/{}/{devid}", be.0, fe.0)
}

/// The toolstack's part: creates both directories with their owners and links them;
/// `read_only` writes the back end's `mode` as `r`.
pub fn create_vbd(
    store: &Store,
    be: DomId,
    fe: DomId,
    devid: u32,
    read_only: bool,
) -> Result<(), XenbusError> {
    let (f, b) = (frontend_dir(fe, devid), backend_dir(be, fe, devid));
    let t = DomId::DOM0;
    let init = (XenbusState::Initialising as u32).to_string();
    for (k, v) in [
        ("backend", b.as_str()),
        ("backend-id", &be.0.to_string()),
        ("virtual-device", &devid.to_string()),
        ("state", &init),
    ] {
        store.write(t, &format!("{f}/{k}"), v)?;
    }
    for (k, v) in [
        ("frontend", f.as_str()),
        ("frontend-id", &fe.0.to_string()),
        ("mode", if read_only { "r" } else { "w" }),
        ("state", &init),
    ] {
        store.write(t, &format!("{b}/{k}"), v)?;
    }
    hv::store::xenbus::share_dirs(store, &f, fe, &b, be)
}

/// Reads a decimal 64-bit key the peer wrote (`sectors`), refusing anything but a plain
/// number.
pub fn read_u64(store: &impl XenStore, caller: DomId, path: &str) -> Result<u64, XenbusError> {
    let v = store
        .read(caller, path)
        .map_err(|_| XenbusError::BadKey(path.into()))?;
    if v.is_empty() || v.len() > 20 || !v.bytes().all(|c| c.is_ascii_digit()) {
        return Err(XenbusError::BadKey(path.into()));
    }
    v.parse().map_err(|_| XenbusError::BadKey(path.into()))
}

/// Retires a back end (libxl's device removal): `Closing`, `Closed`, removed, so that
/// the front end's watch fires.
pub fn close_backend(store: &impl XenStore, be: DomId, fe: DomId, devid: u32) {
    let dir = backend_dir(be, fe, devid);
    let _ = store.switch_state(DomId::DOM0, &dir, XenbusState::Closing);
    let _ = store.switch_state(DomId::DOM0, &dir, XenbusState::Closed);
    let _ = store.rm(DomId::DOM0, &dir);
}

/// What a back end published about its device, as either end reads it from the back
/// end's directory (the front end as untrusted text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offered {
    /// The device and the operations offered.
    pub offer: Offer,
    /// `feature-persistent`.
    pub persistent: bool,
    /// `physical-sector-size`: the unit below which a write costs a read first (512
    /// when not written).
    pub physical_sector_size: u32,
    /// `max-ring-page-order`: the ring may span 2^this pages (0 when not written).
    pub max_ring_page_order: u32,
    /// `multi-queue-max-queues` (1 when not written).
    pub max_queues: u32,
}

impl Offered {
    /// Reads `bdir`'s keys: `sectors` and `sector-size` (only 512) must be there; a
    /// feature not written is not offered.
    pub fn read(store: &impl XenStore, caller: DomId, bdir: &str) -> Result<Self, XenbusError> {
        let sectors = read_u64(store, caller, &format!("{bdir}/sectors"))?;
        let size_key = format!("{bdir}/sector-size");
        if u64::from(read_u32(store, caller, &size_key)?) != SECTOR_SIZE {
            return Err(XenbusError::BadKey(size_key));
        }
        let info = read_u32(store, caller, &format!("{bdir}/info")).unwrap_or(0);
        let max_indirect = read_u32(store, caller, &format!("{bdir}/{FEATURE_MAX_INDIRECT}"))
            .unwrap_or(0)
            .min(u32::from(u16::MAX)) as u16;
        Ok(Self {
            offer: Offer {
                sectors,
                read_only: info & VDISK_READONLY != 0,
                flush: feature(store, caller, bdir, FEATURE_FLUSH),
                discard: feature(store, caller, bdir, FEATURE_DISCARD),
                max_indirect_segments: max_indirect,
            },
            persistent: feature(store, caller, bdir, FEATURE_PERSISTENT),
            physical_sector_size: read_u32(store, caller, &format!("{bdir}/physical-sector-size"))
                .unwrap_or(SECTOR_SIZE as u32),
            max_ring_page_order: read_u32(store, caller, &format!("{bdir}/{MAX_RING_PAGE_ORDER}"))
                .unwrap_or(0),
            max_queues: read_u32(store, caller, &format!("{bdir}/{MULTI_QUEUE_MAX_QUEUES}"))
                .unwrap_or(1)
                .max(1),
        })
    }
}
