//! Domain kernels as components, and the machine builder that assembles them.
//!
//! Each kernel is a struct that owns what a real kernel of that kind owns (its drivers,
//! its pool of packet buffers, its stack and application) and has one explicit poll step:
//! [`Kernel::poll`] takes the time and returns the [`Work`] it did. The hand-offs inside a
//! kernel (driver → bridge → netback, netfront → stack → application) are plain calls in
//! that step, one file per kernel:
//!
//! * [`native`]: Linux without a hypervisor, and the guest with the NIC assigned (direct
//!   I/O): NIC driver, stack, application;
//! * [`driver_domain`]: the NIC driver, the bridge and one netback vif per guest;
//! * [`pv_guest`]: netfront, the stack and the application, or netfront and a TAP whose
//!   network namespace is the guest's stack (`pvio up`);
//! * [`hostile`]: a guest that writes garbage into its vif's rings (the soak).
//!
//! [`vcpu::KernelUnit`] is the loop every kernel shares, one pass a step on its pCPU:
//! take interrupts or events, run the timer, poll, and halt or block when a poll found
//! nothing. [`machine`] turns a
//! [`machine::MachineSpec`] (domains, cores, the NIC, switches) into a running
//! [`machine::Machine`]; every experiment, `pvio up` and the tests build machines with it.

pub mod app;
pub mod block;
pub mod compute;
pub mod counters;
pub mod driver_domain;
pub mod hostile;
pub mod machine;
pub mod mm;
pub mod native;
pub mod nbd;
pub mod probe;
pub mod pv_guest;
pub mod svnic_guest;
pub mod vcpu;

pub use counters::Counters;
pub use vcpu::{Kernel, Platform, Work};

/// Packet buffers of each kernel's pool (its pages differ by kernel).
pub const POOL_BUFFERS: usize = 3072;

/// Packets one NAPI poll may take (Linux's default weight).
pub const NAPI_BUDGET: usize = 64;

/// Why a machine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The hypervisor refused (out of frames, a bad configuration).
    #[error("hypervisor: {0}")]
    Hv(#[from] hv::HvError),
    /// Something else, named.
    #[error("{0}")]
    Other(String),
}

pub(crate) fn other(e: impl std::fmt::Display) -> BuildError {
    BuildError::Other(e.to_string())
}
