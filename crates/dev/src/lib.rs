//! pvio's devices.
//!
//! * [`nic`]: a NIC model — a device thread with RX and TX descriptor rings in its
//!   owner's memory, DMA through the IOMMU with non-temporal stores, receive checksum
//!   offload, and interrupt coalescing (packets per interrupt, maximum delay), raising
//!   its interrupt through an [`irq::IrqLine`];
//! * [`driver`]: the NIC's driver in the owning domain: descriptor refill, a NAPI-style
//!   poll, transmit and completion, and the DMA interface of the owner's kind of kernel;
//! * [`wire`]: what is at the other end of the NIC's cable — a paced UDP sender (the
//!   papers' remote host) and sinks;
//! * [`svnic`]: the self-virtualized NIC of paper 002: virtual interfaces in device
//!   memory that guests reach directly;
//! * [`tap`]: TAP interfaces as ports for real traffic, and [`capture`]: the frames
//!   crossing a port, written to a pcap file.
//!
//! Device work runs on device threads, charged to no domain, as hardware is.

pub mod capture;
pub mod driver;
pub mod irq;
pub mod lro;
pub mod nic;
pub mod packet;
pub mod peer;
pub mod svnic;
pub mod tap;
pub mod wire;
