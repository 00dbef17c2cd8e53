//! Paper 000, Santos et al. 2008, "Bridging the gap between software and hardware
//! techniques for I/O virtualization": the driver-domain network model, where its cost
//! goes, and the optimisations that take it back.

pub mod fig11;
pub mod fig2;
pub mod fig4;
pub mod fig8;
pub mod restart;
pub mod soak;
