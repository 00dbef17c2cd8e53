//! The self-virtualized NIC of paper 002 (SV-NIC): a NIC whose own cores multiplex the
//! wire among virtual interfaces that guests reach directly, the hypervisor and the
//! driver domain only on the control path.
//!
//! * [`vif`]: one virtual interface, its send and receive queues in the device's
//!   memory, granted to its guest once at creation; the device's side (an egress half
//!   for its one egress context, a receive half shared by the ingress contexts) and the
//!   guest's VIF driver.

pub mod vif;
