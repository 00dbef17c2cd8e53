//! What several integration tests build: TCP/IPv4 frames with complete checksums, and
//! domains for a guest and its driver domain.

#![allow(dead_code)]

use std::sync::Arc;

use hv::{Domain, DomainConfig, GrantVersion, HvConfig, Hypervisor};
use net::netback::VIF_WINDOW_SLOTS;
use net::offload::{checksum_setup, fill_partial, set_pseudo, Csum, Offload, L4};
use net::skb::SkbPool;
use smoltcp::wire::checksum;

/// A domain of 2048 pages with v2 grants: a driver domain (window slots for one vif) if
/// `driver`, else a guest.
pub fn domain(hv: &Arc<Hypervisor>, name: &str, driver: bool) -> Arc<Domain> {
    hv.create_domain(&DomainConfig {
        name: name.into(),
        pages: 2048,
        grant_frames: 4,
        grant_version: GrantVersion::V2,
        vcpus: 1,
        map_slots: if driver { VIF_WINDOW_SLOTS } else { 4 },
        driver_domain: driver,
    })
    .expect("domain")
}

/// A hypervisor of 8192 frames with a guest and a driver domain ([`domain`]), and a
/// packet pool for each: `(buffers, pages)` of the guest's, then of the driver domain's.
pub fn pair(
    guest_pool: (usize, usize),
    driver_pool: (usize, usize),
) -> (Arc<Hypervisor>, Arc<Domain>, Arc<Domain>, SkbPool, SkbPool) {
    let hv = Hypervisor::new(HvConfig {
        frames: 8192,
        ..HvConfig::default()
    })
    .expect("hv");
    let guest = domain(&hv, "guest", false);
    let drv = domain(&hv, "driver", true);
    let gpool = SkbPool::new(Arc::clone(&guest), guest_pool.0, guest_pool.1).expect("pool");
    let dpool = SkbPool::new(Arc::clone(&drv), driver_pool.0, driver_pool.1).expect("pool");
    (hv, guest, drv, gpool, dpool)
}

/// Ethernet header.
const ETH: usize = 14;

/// A TCP/IPv4 frame from 10.0.0.1:5001 to 10.0.0.2:40000 (MACs `src` → `dst`) with
/// `payload` bytes (`(i * 7) ^ seed`), sequence number `seq`, `flags`, both checksums
/// complete.
pub fn tcp_frame(src: [u8; 6], dst: [u8; 6], payload: usize, seq: u32, seed: u8) -> Vec<u8> {
    let mut f = vec![0u8; ETH + 20 + 20 + payload];
    f[..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    let ip = ETH;
    f[ip] = 0x45;
    f[ip + 2..ip + 4].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
    f[ip + 6] = 0x40;
    f[ip + 8] = 64;
    f[ip + 9] = 6;
    f[ip + 12..ip + 16].copy_from_slice(&[10, 0, 0, 1]);
    f[ip + 16..ip + 20].copy_from_slice(&[10, 0, 0, 2]);
    let s = !checksum::data(&f[ip..ip + 20]);
    f[ip + 10..ip + 12].copy_from_slice(&s.to_be_bytes());
    let t = ip + 20;
    f[t..t + 2].copy_from_slice(&5001u16.to_be_bytes());
    f[t + 2..t + 4].copy_from_slice(&40000u16.to_be_bytes());
    f[t + 4..t + 8].copy_from_slice(&seq.to_be_bytes());
    f[t + 12] = 5 << 4;
    f[t + 13] = 0x18;
    for (i, b) in f[t + 20..].iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(7) ^ seed;
    }
    let l4 = l4_of(&f);
    set_pseudo(&mut f, &l4);
    fill_partial(&mut f, l4.l4, 16).expect("checksum");
    f
}

/// Where the frame's transport header lies.
pub fn l4_of(f: &[u8]) -> L4 {
    checksum_setup(f, f.len()).expect("a TCP/IPv4 frame")
}

/// The frame as a sender with checksum offload hands it on: the TCP checksum field
/// holds only the pseudo-header's sum. Returns it and its offload, with `gso` as the
/// segment size if any.
pub fn partial(mut f: Vec<u8>, gso: Option<u16>) -> (Vec<u8>, Offload) {
    let l4 = l4_of(&f);
    set_pseudo(&mut f, &l4);
    let off = Offload {
        csum: l4.partial(),
        gso: gso.map(|size| net::netif::Gso {
            size,
            ty: net::netif::XEN_NETIF_GSO_TYPE_TCPV4,
        }),
    };
    (f, off)
}

/// Whether `f` is a TCP/IPv4 frame whose checksum is complete and right.
pub fn checksum_ok(f: &[u8]) -> bool {
    checksum_setup(f, f.len()).is_ok_and(|l4| net::offload::verify(f, &l4))
}

/// Whether an offload says the checksum is left blank.
pub fn is_partial(o: &Offload) -> bool {
    matches!(o.csum, Csum::Partial { .. })
}
