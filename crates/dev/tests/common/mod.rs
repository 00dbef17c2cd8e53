//! The SV-NIC tests' machine: a hypervisor, the device's memory, and guests that each
//! map a VIF.

#![allow(dead_code)]

use std::sync::Arc;

use dev::svnic::vif::{VifDevice, VifFront, VifRegion, VIF_PAGES};
use hv::{Domain, DomainConfig, HvConfig, Hypervisor, OwnPage};
use mem::MappedPage;

pub struct Setup {
    pub hv: Arc<Hypervisor>,
    pub device: Arc<Domain>,
    pub guests: Vec<Arc<Domain>>,
}

/// A machine with the device's memory for `n` VIFs and `n` guests, each with window
/// room for two VIFs' regions (one of its own, one it tries to map and must not).
pub fn setup(n: usize) -> Setup {
    let hv = Hypervisor::new(HvConfig {
        frames: (VIF_PAGES * n + 256) as u32 * 2,
        ..HvConfig::default()
    })
    .expect("machine");
    let device = hv
        .create_domain(&DomainConfig {
            name: "svnic".into(),
            pages: (VIF_PAGES * n + 8) as u32,
            ..Default::default()
        })
        .expect("device memory");
    let guests = (0..n)
        .map(|i| {
            hv.create_domain(&DomainConfig {
                name: format!("guest{i}"),
                pages: 64,
                map_slots: 2 * VIF_PAGES as u32,
                ..Default::default()
            })
            .expect("guest")
        })
        .collect();
    Setup { hv, device, guests }
}

/// A VIF for guest `i`, made and mapped.
pub fn vif(s: &Setup, i: usize) -> (VifDevice<OwnPage>, VifFront<MappedPage>) {
    let g = &s.guests[i];
    let region = VifRegion::create(&s.device, g.id()).expect("region");
    let dev = VifDevice::new(region.device_pages(&s.device).expect("pages")).expect("dev");
    let front = VifFront::new(
        region
            .map_in_guest(&s.hv, g, s.device.id(), 0)
            .expect("mapped")
            .0,
    );
    (dev, front)
}
