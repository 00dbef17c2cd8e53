//! One module per experiment.

pub mod core;
