//! pvio's lab: the experiments that reproduce the papers' figures and tables, and the
//! measurement, statistics and report code they share.
//!
//! An experiment is data: an id, its paper reference, and a function that measures and
//! fills a [`Report`]. `pvio reproduce` runs them all (or one), prints each table and
//! writes `<out>/<id>.json` (with the git revision, date, host and full configuration)
//! and `<out>/<id>.md`. Measurements are CPU or wall time per operation, repeated over
//! several iterations; ratios are taken per iteration against a baseline measured in
//! the same run and summarised by their median, so the shared machine's noise cancels as
//! far as it can. `reproduce` then writes `<out>/index.html`, every record in the folder
//! on one page ([`site`]), and `pvio report --compare OLD NEW` shows what moved between
//! two runs.

pub mod chart;
pub mod dpdk;
pub mod experiments;
pub(crate) mod harness;
pub mod host;
pub mod progress;
pub mod remote_host;
pub mod report;
pub mod site;
pub mod stats;

pub use harness::isolated;
pub use report::{Report, Row, RunEnv, Written};
/// The one error type of the lab, its rigs and `pvio up`.
pub use rig::Error;
/// How idle pCPUs wait, as a [`Context`] names it.
pub use rig::IdlePolicy;
pub use stats::Stats;

/// How a run is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Full length (the numbers to quote).
    Full,
    /// Shorter runs for a quick look (the README's first command).
    Quick,
    /// Tiny runs that exercise every code path (tests); numbers mean nothing.
    Smoke,
}

impl Mode {
    /// Iterations of each measurement.
    pub fn iterations(self) -> usize {
        match self {
            Mode::Full => 9,
            Mode::Quick => 5,
            Mode::Smoke => 1,
        }
    }
    /// Scales an operation count.
    pub fn scale(self, full: u64) -> u64 {
        match self {
            Mode::Full => full,
            Mode::Quick => (full / 4).max(1),
            Mode::Smoke => (full / 1000).max(1),
        }
    }
}

/// What a run of the lab is asked for, as the command line builds it and hands it to
/// every experiment's `run`: no experiment reads a process-wide setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Context {
    /// How long and how often to measure.
    pub mode: Mode,
    /// How the machines' idle pCPUs wait (`--idle`): `poll` when all the load on the
    /// cores is pvio's own (the command's default), `halt-poll` where other processes
    /// share the cores, `block` for the comparison with a host wake-up per interrupt.
    /// Named in every record.
    pub idle: IdlePolicy,
}

impl Context {
    /// A run in `mode` whose machines idle by `idle`.
    pub fn new(mode: Mode, idle: IdlePolicy) -> Self {
        Self { mode, idle }
    }
    /// The tests' run: tiny, and halt-polling, since tests share the cores with each
    /// other and with the test runner.
    pub fn smoke() -> Self {
        Self::new(Mode::Smoke, IdlePolicy::HALT_POLL)
    }
    /// The policy for a machine that shares its cores with another machine of the same
    /// run ([`IdlePolicy::shared`]).
    pub fn shared_idle(&self) -> IdlePolicy {
        self.idle.shared()
    }
}

/// A registered experiment.
#[derive(Debug, Clone, Copy)]
pub struct Experiment {
    /// Short id (`--only`).
    pub id: &'static str,
    /// Title.
    pub title: &'static str,
    /// Paper and figure.
    pub paper: &'static str,
    /// Runs it.
    pub run: fn(&Context) -> Result<Report, Error>,
}

/// Every experiment, in the order `reproduce` runs them.
pub fn registry() -> Vec<Experiment> {
    vec![
        experiments::own::core::EXPERIMENT,
        experiments::santos08::fig2::EXPERIMENT,
        experiments::santos08::fig4::EXPERIMENT,
        experiments::santos08::fig8::EXPERIMENT,
        experiments::santos08::fig11::EXPERIMENT,
        experiments::own::ceiling::EXPERIMENT,
        experiments::santos08::restart::EXPERIMENT,
        experiments::santos08::soak::EXPERIMENT,
        experiments::own::up::EXPERIMENT,
        experiments::iosup::EXPERIMENT,
        experiments::nakajima::EXPERIMENT,
        experiments::raj::svnic::EXPERIMENT,
        experiments::raj::rvbd::EXPERIMENT,
    ]
}
