//! One module per experiment.

pub mod core;
pub mod santos08;
