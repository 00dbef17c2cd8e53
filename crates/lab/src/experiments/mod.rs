//! One module per experiment.

pub mod ceiling;
pub mod core;
pub mod fig11;
pub mod fig4;
pub mod fig8;
pub mod iosup;
pub mod nakajima;
pub mod raj;
pub mod restart;
pub mod rvbd;
pub mod santos08;
pub mod soak;
pub mod up_bench;
