//! The store side of a virtual network interface: where each end's keys live, what the
//! toolstack writes to create a vif, and strict reading of what the other end wrote.
//!
//! The handshake is netif's: the toolstack creates both directories (each end owns its
//! own, the other may read it) in state `Initialising`; the back end publishes its
//! `feature-*` keys and moves to `InitWait`; the front end checks them, publishes
//! `tx-ring-ref`, `rx-ring-ref`, `event-channel` and `request-rx-copy`, and moves to
//! `Connected`; the back end reads and validates those, maps the rings, binds the
//! channel and moves to `Connected`. Every value read from the peer's directory is
//! untrusted text: it is parsed strictly and a bad one fails the connection.

use hv::store::{Store, XenbusState};
use hv::DomId;

pub use hv::store::xenbus::{feature, read_u32, share_dirs, XenbusError};

/// The front end's directory.
pub fn frontend_dir(fe: DomId, handle: u32) -> String {
    format!("/local/domain/{}/device/vif/{handle}", fe.0)
}

/// The back end's directory.
pub fn backend_dir(be: DomId, fe: DomId, handle: u32) -> String {
    format!("/local/domain/{}/backend/vif/{}/{handle}", be.0, fe.0)
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The toolstack's part: creates both directories with their owners and links them.
pub fn create_vif(
    store: &Store,
    be: DomId,
    fe: DomId,
    handle: u32,
    mac: [u8; 6],
) -> Result<(), XenbusError> {
    let (f, b) = (frontend_dir(fe, handle), backend_dir(be, fe, handle));
    let t = DomId::DOM0;
    let init = (XenbusState::Initialising as u32).to_string();
    for (k, v) in [
        ("backend", b.as_str()),
        ("backend-id", &be.0.to_string()),
        ("mac", &mac_text(mac)),
        ("handle", &handle.to_string()),
        ("state", &init),
    ] {
        store.write(t, &format!("{f}/{k}"), v)?;
    }
    for (k, v) in [
        ("frontend", f.as_str()),
        ("frontend-id", &fe.0.to_string()),
        ("mac", &mac_text(mac)),
        ("handle", &handle.to_string()),
        ("state", &init),
    ] {
        store.write(t, &format!("{b}/{k}"), v)?;
    }
    share_dirs(store, &f, fe, &b, be)
}

/// A back end's offer to lend received packets' buffers for the guest to copy (paper
/// 000 §4.1; pvio's own key: Xen has no such protocol). Needs grant tables v2, whose
/// sub-page grants limit the guest to each packet's bytes.
pub const FEATURE_GUEST_COPY: &str = "feature-rx-guest-copy";
/// A front end's request for it.
pub const REQUEST_GUEST_COPY: &str = "request-rx-guest-copy";
/// Where the back end says its per-slot grants start (`base + id` for slot `id`).
pub const RX_GRANT_BASE: &str = "rx-grant-base";

/// netif.h's control ring: the back end offers it; the front end publishes its page.
pub const FEATURE_CTRL_RING: &str = "feature-ctrl-ring";
/// The front end's control-ring grant.
pub const CTRL_RING_REF: &str = "ctrl-ring-ref";
/// A back end's offer to keep the grants it maps cached across I/O (paper 000 §4.4;
/// pvio's own key): mappings outlive their requests until evicted or dropped through
/// the control ring.
pub const FEATURE_GRANT_REUSE: &str = "feature-grant-reuse";
/// A front end's request for it (it must also publish a control ring, through which
/// it drops mappings before it repurposes a page).
pub const REQUEST_GRANT_REUSE: &str = "request-grant-reuse";

/// **Unsafe, for measurement only**: a back end's offer to take machine frames instead
/// of grants in RX requests (paper 000 §4.4's stand-in for grant reuse). Written only
/// by a toolstack measuring it, never by default.
pub const FEATURE_MACHINE_FRAMES: &str = "feature-rx-machine-frames-unsafe";
/// A front end's request for it.
pub const REQUEST_MACHINE_FRAMES: &str = "request-rx-machine-frames-unsafe";

/// A back end's offer of pvio's split ring layout (`ring::Layout::SPLIT`; pvio's own
/// key): each end's indices on a cache line of their own, the slots from byte 128. A
/// front end that does not ask gets ring.h's layout, as a real Xen peer does.
pub const FEATURE_SPLIT_INDICES: &str = "feature-split-ring-indices";
/// A front end's request for it, for both its data rings.
pub const REQUEST_SPLIT_INDICES: &str = "request-split-ring-indices";

/// The back end's features, as pvio's netback offers them.
/// `feature-split-event-channels`: the back end takes one event channel a ring (the
/// front end's `event-channel-tx` and `event-channel-rx`), so that a TX completion and a
/// received packet interrupt the guest apart (Linux's netback and netfront).
pub const FEATURE_SPLIT_EVENTS: &str = "feature-split-event-channels";
/// The toolstack's transmit rate for a vif, in the back end's directory:
/// `<bytes>,<microseconds>` ([`crate::netback::Credit`]).
pub const RATE: &str = "rate";

pub const BACKEND_FEATURES: [(&str, &str); 11] = [
    ("feature-sg", "1"),
    ("feature-rx-copy", "1"),
    ("feature-rx-flip", "0"),
    ("feature-gso-tcpv4", "1"),
    ("feature-gso-tcpv6", "1"),
    ("feature-ipv6-csum-offload", "1"),
    ("feature-multicast-control", "0"),
    (FEATURE_CTRL_RING, "1"),
    (FEATURE_GRANT_REUSE, "1"),
    (FEATURE_SPLIT_INDICES, "1"),
    (FEATURE_SPLIT_EVENTS, "1"),
];
