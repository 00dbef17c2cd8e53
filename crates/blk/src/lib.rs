//! pvio's block layer (issue 20, paper 002 §VI-B): Xen's split block protocol, local
//! and remote.
//!
//! * [`blkif`]: the `io/blkif.h` ABI, its entry layouts, and the validation a back end
//!   makes of every request it copies off the ring;
//! * [`blkback`]: the back end, serving a backing file or a remote disk;
//! * [`blkfront`]: the front end and the small block layer above it;
//! * [`xenbus`]: the store side of a virtual block device;
//! * [`disk`]: the disk behind a virtual block device, a backing file of sectors;
//! * [`aoe`]: ATA over Ethernet's frames, built and judged;
//! * [`initiator`]: an AoE initiator: discovery, frames, tags, retransmission;
//! * [`remote`]: a remote disk's back end through its life;
//! * [`unit`]: a vbd queue served as a unit of pvio's scheduler.

pub mod aoe;
pub mod blkback;
pub mod blkfront;
pub mod blkif;
pub mod disk;
pub mod initiator;
pub mod remote;
pub mod unit;
pub mod xenbus;
