//! The self-virtualized NIC of paper 002 (SV-NIC): a NIC whose own cores multiplex the
//! wire among virtual interfaces that guests reach directly, the hypervisor and the
//! driver domain only on the control path.
//!
//! * [`vif`]: one virtual interface, its send and receive queues in the device's
//!   memory, granted to its guest once at creation; the device's side (an egress half
//!   for its one egress context, a receive half shared by the ingress contexts) and the
//!   guest's VIF driver;
//! * [`engine`]: the micro-engines: egress contexts serving disjoint sets of send
//!   queues, ingress contexts placing the wire's frames in order, Figure 8's stage
//!   times;
//! * [`block`]: the block virtualization service: the remote virtual block device's
//!   local back end on a device core of its own, speaking ATA over Ethernet;
//! * [`device`]: the running device: its engines on device cores, its cable, its
//!   signals, VIFs added and removed while it runs;
//! * [`mgmt`]: the management API through the store: the toolstack's requests (create
//!   and destroy a VIF, its priority, the egress scheduler) and the device-side driver
//!   that carries them out; no guest can ask;
//! * [`signal`]: the signalling designs: the shared 8-bit identifier register and its
//!   hypervisor demultiplexing, the sidecore's message channel, a vector per VIF.
//!
//! The register and the channel live with the device and the hypervisor; no guest
//! holds a handle to either, so no guest can use them to signal another.

pub mod block;
pub mod device;
pub mod engine;
pub mod mgmt;
pub mod signal;
pub mod vif;
