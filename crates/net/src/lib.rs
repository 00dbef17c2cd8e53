//! pvio's network layer.
//!
//! Today: the netif protocol of Xen's `io/netif.h` ([`netif`]): its ring entry layouts,
//! flags and status codes, and the validation of what crosses the rings — the TX slot
//! chains a front end posts (checked the way Linux netback checks them, with the same
//! split between a tolerated error, answered and counted, and a fatal one that disables
//! the interface) and the RX responses a back end returns (checked the way netfront
//! does). netfront, netback, the bridge, packet buffers and the guest stack build on it
//! (issue 3).
//!
//! What it trusts: nothing from a ring. Every entry arrives here as a copy (the ring
//! crate hands out values), is validated once, and only the validated description is
//! acted on.

pub mod bridge;
pub mod lro;
pub mod netback;
pub mod netfront;
pub mod netif;
pub mod offload;
pub mod rawfront;
pub mod reasm;
pub mod skb;
pub mod stack;
pub mod tcp;
pub mod toolstack;
pub mod wire;
pub mod xenbus;

#[cfg(test)]
mod tests {
    use hv::counters::check_reason_order;

    #[test]
    fn every_reason_enum_counts_in_its_declared_order() {
        check_reason_order::<crate::stack::RxDrop>();
        check_reason_order::<crate::reasm::ReasmDrop>();
        check_reason_order::<crate::bridge::BridgeDrop>();
        check_reason_order::<crate::netif::TxDrop>();
        check_reason_order::<crate::netif::TxFatal>();
        check_reason_order::<crate::netif::RxError>();
    }
}
