//! What the toolstack does to give a guest a network interface, and the two ends'
//! handshake run in order: the toolstack writes both store directories
//! ([`xenbus::create_vif`]), the back end publishes its features ([`netback::probe`]),
//! the front end sets up its rings and publishes them ([`Netfront::connect_with`]), and
//! the back end maps them ([`Vif::connect`]). pvio's kernels have no xenbus watch
//! threads, so whoever assembles a machine runs the steps in the order their watches
//! would fire.

use std::sync::Arc;

use hv::store::{XenStore, XenbusState};
use hv::{DomId, Domain, Hypervisor};

use crate::netback::{self, Vif, VIF_WINDOW_SLOTS};
use crate::netfront::{FrontConfig, Netfront};
use crate::xenbus::{self, XenbusError};

/// One vif between a driver domain and a guest.
#[derive(Debug, Clone, Copy)]
pub struct VifSpec {
    /// The guest's device handle (`vif/<handle>`).
    pub handle: u32,
    /// The guest's MAC (the only source address the bridge lets the vif use).
    pub mac: [u8; 6],
    /// The guest's netfront: what it posts, how it grants, what it asks for.
    pub front: FrontConfig,
    /// The vif's index in the driver domain (its release tokens' high half); it maps
    /// at window slots from `index · VIF_WINDOW_SLOTS`.
    pub index: u16,
}

/// Window slots a driver domain needs for `vifs` vifs.
pub fn window_slots(vifs: usize) -> u32 {
    VIF_WINDOW_SLOTS * vifs as u32
}

/// Creates the vif and runs the handshake: returns the guest's front end and the driver
/// domain's back end, both connected.
pub fn plug_vif(
    hv: &Arc<Hypervisor>,
    driver: &Arc<Domain>,
    guest: &Arc<Domain>,
    spec: VifSpec,
) -> Result<(Netfront, Vif), XenbusError> {
    offer_vif(hv, driver, guest, spec)?;
    let front = Netfront::connect_config(hv, guest, spec.handle, spec.front)?;
    let vif = connect_backend(hv, driver, guest, spec)?;
    Ok((front, vif))
}

/// The toolstack's part of giving `guest` a vif on `driver`: both directories (the
/// front end's now naming `driver`) and the back end's probe (`InitWait`). A front end
/// already running follows through its watch and reconnects.
pub fn offer_vif(
    hv: &Arc<Hypervisor>,
    driver: &Arc<Domain>,
    guest: &Arc<Domain>,
    spec: VifSpec,
) -> Result<(), XenbusError> {
    xenbus::create_vif(hv.store(), driver.id(), guest.id(), spec.handle, spec.mac)?;
    // netback lends buffers for the guest to copy where it can grant sub-pages.
    if driver.grant_table().version() == hv::GrantVersion::V2 {
        let dir = xenbus::backend_dir(driver.id(), guest.id(), spec.handle);
        hv.store().write(
            driver.id(),
            &format!("{dir}/{}", xenbus::FEATURE_GUEST_COPY),
            "1",
        )?;
    }
    netback::probe(hv.store(), driver.id(), guest.id(), spec.handle)
}

/// The back end's last step once the front end has published its rings: maps them and
/// connects.
pub fn connect_backend(
    hv: &Arc<Hypervisor>,
    driver: &Arc<Domain>,
    guest: &Arc<Domain>,
    spec: VifSpec,
) -> Result<Vif, XenbusError> {
    Vif::connect(
        hv::Pvio::new(hv, driver),
        guest.id(),
        spec.handle,
        spec.index,
        u32::from(spec.index) * VIF_WINDOW_SLOTS,
    )
}

/// Whether the guest's front end of vif `handle` has published its rings and is
/// `Connected` (what the back end's watch on it waits for).
pub fn frontend_connected(hv: &Hypervisor, guest: DomId, handle: u32) -> bool {
    let dir = xenbus::frontend_dir(guest, handle);
    hv.store().xenbus_state(DomId::DOM0, &dir) == XenbusState::Connected
}

/// Retires a back end whose driver domain died or is being replaced (libxl's device
/// removal): its directory goes to `Closing` and `Closed`, so the front end's watch
/// fires and it disconnects, and is then removed.
pub fn close_backend(hv: &Hypervisor, driver: DomId, guest: DomId, handle: u32) {
    let store = hv.store();
    let dir = xenbus::backend_dir(driver, guest, handle);
    let _ = store.switch_state(DomId::DOM0, &dir, XenbusState::Closing);
    let _ = store.switch_state(DomId::DOM0, &dir, XenbusState::Closed);
    let _ = store.rm(DomId::DOM0, &dir);
}
