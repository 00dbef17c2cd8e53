//! The experiments, grouped by the paper they reproduce.
//!
//! Each module holds one experiment: its `EXPERIMENT` registry entry, a typed plan of
//! what it measures, the machines it builds, its rows and its checks, and a smoke test
//! of its `run`. The shortest to copy for a new one is [`santos08::fig4`].

pub mod iosup;
pub mod nakajima;
pub mod own;
pub mod raj;
pub mod santos08;
