//! Paper 002, Raj & Schwan, "High performance and scalable I/O virtualization via
//! self-virtualized devices": the self-virtualized NIC on device cores, and the remote
//! virtual block device.

pub mod rvbd;
pub mod svnic;
