//! The lab's machines, assembled from options and running, with their accounting.
//!
//! A rig is what an experiment or `pvio up` drives: it turns a few options into a
//! [`kernel::machine::MachineSpec`], starts the machine with its far end (a paced UDP
//! sender, or a TCP peer across the cable), and reads back what each domain spent and
//! what every frame became. Two rigs: [`udp`], the receive machines of paper 000 and of
//! `pvio up`, and [`tcp`], the TCP receivers of paper 001. [`live`] turns a running
//! machine's counters into rates, and [`tools`] installs the outside programs any of
//! them runs. The experiments themselves live in the `lab` crate, `pvio up`'s runtime
//! in `up`; both stand on this one, with its one error type, [`Error`].

pub mod live;
pub mod tcp;
pub mod tools;
pub mod udp;

/// How idle pCPUs wait, re-exported for the command line.
pub use hv::sched::IdlePolicy;

/// Why a rig, an experiment or `pvio up` could not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The hypervisor refused to build or run the machine.
    #[error("machine: {0}")]
    Hv(#[from] hv::HvError),
    /// An outside program is missing and could not be installed.
    #[error("outside program: {0}")]
    Tool(String),
    /// Anything else, by its message: a system call that failed, a set-up that cannot
    /// be had on this host, a measurement that found nothing to measure.
    #[error("{0}")]
    Other(String),
}

impl Error {
    /// Any failure that is not the hypervisor's or a tool's, by its message.
    pub fn other(e: impl std::fmt::Display) -> Self {
        Error::Other(e.to_string())
    }
}
