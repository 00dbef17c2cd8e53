//! pvio's block layer (issue 20, paper 002 §VI-B): Xen's split block protocol.
//!
//! * [`blkif`]: the `io/blkif.h` ABI, its entry layouts, and the validation a back end
//!   makes of every request it copies off the ring;
//! * [`disk`]: the disk behind a virtual block device, a backing file of sectors.

pub mod aoe;
pub mod blkback;
pub mod blkfront;
pub mod blkif;
pub mod disk;
pub mod initiator;
pub mod remote;
pub mod xenbus;
