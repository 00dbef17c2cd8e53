//! pvio's own measurements, asked for by its issues rather than a paper's figure: the
//! mechanisms' unit costs (`core`), the data path against DPDK (`netif-ceiling`) and
//! `pvio up` against a veth pair (`up`).

pub mod ceiling;
pub mod core;
pub mod up;
