//! What the toolstack does to give a guest a network interface, and the two ends'
//! handshake run in order: the toolstack writes both store directories
//! ([`xenbus::create_vif`]), the back end publishes its features ([`netback::probe`]),
//! the front end sets up its rings and publishes them ([`Netfront::connect_with`]), and
//! the back end maps them ([`Vif::connect`]). pvio's kernels have no xenbus watch
//! threads, so whoever assembles a machine runs the steps in the order their watches
//! would fire.

use std::sync::Arc;

use hv::{Domain, Hypervisor};

use crate::netback::{self, Vif, VIF_WINDOW_SLOTS};
use crate::netfront::{Netfront, RxBuffers};
use crate::xenbus::{self, XenbusError};

/// One vif between a driver domain and a guest.
#[derive(Debug, Clone, Copy)]
pub struct VifSpec {
    /// The guest's device handle (`vif/<handle>`).
    pub handle: u32,
    /// The guest's MAC (the only source address the bridge lets the vif use).
    pub mac: [u8; 6],
    /// What netfront posts on its RX ring.
    pub rx_buffers: RxBuffers,
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
    xenbus::create_vif(hv.store(), driver.id(), guest.id(), spec.handle, spec.mac)?;
    netback::probe(hv.store(), driver.id(), guest.id(), spec.handle)?;
    let front = Netfront::connect_with(hv, guest, spec.handle, spec.rx_buffers)?;
    let vif = Vif::connect(
        hv,
        driver,
        guest.id(),
        spec.handle,
        spec.index,
        u32::from(spec.index) * VIF_WINDOW_SLOTS,
    )?;
    Ok((front, vif))
}
