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

/// How the machines' idle pCPUs wait, as `reproduce --idle` set it: `poll` when all the
/// load on the cores is pvio's own (the command's default), `halt-poll` where other
/// processes share the cores (the default here, so that tests that run machines side by
/// side do not starve each other or the test runner), `block` for the comparison with a
/// host wake-up per interrupt. Named in every record.
pub fn idle_policy() -> IdlePolicy {
    *IDLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The idle policy for a machine that shares its cores with another machine of the same
/// run (paper 002's two hosts on one cable): `poll` becomes `halt-poll`, so that the two
/// machines' pCPUs on one core take turns instead of spinning against each other.
pub fn shared_idle_policy() -> IdlePolicy {
    match idle_policy() {
        IdlePolicy::Poll => IdlePolicy::HALT_POLL,
        p => p,
    }
}

/// Sets [`idle_policy`] for the machines started from now on.
pub fn set_idle_policy(p: IdlePolicy) {
    *IDLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = p;
}

static IDLE: std::sync::Mutex<IdlePolicy> = std::sync::Mutex::new(IdlePolicy::HALT_POLL);
