//! A vif's counters: what each direction carried, refused and dropped, and how full
//! its rings are, for reports and `pvio up`'s live table.

use super::*;

/// Counters of one vif.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VifStats {
    /// Packets copied to the guest.
    pub rx_packets: u64,
    /// Bytes copied to the guest.
    pub rx_bytes: u64,
    /// Packets dropped because the receive queue was full (the guest is not posting).
    pub rx_queue_full: u64,
    /// Packets whose grant copy failed (bad gref from the guest), answered with an error.
    pub rx_copy_errors: u64,
    /// Packets copied (in part) straight from pages another guest granted: frames one
    /// guest sent to another, forwarded by the bridge without a local copy.
    pub rx_from_grants: u64,
    /// Times the RX action stopped for want of posted buffers.
    pub rx_stalls: u64,
    /// Times its queue had no room and held the NIC's receive poll (flow control: the
    /// NIC then leaves frames with its sender instead of this vif dropping them).
    pub rx_nic_held: u64,
    /// Times it held the poll for [`RX_HOLD_LIMIT`] with its guest taking nothing, and
    /// was let go (its packets then dropped at its queue until it drains to half).
    pub rx_hold_expired: u64,
    /// TX packets passed to the bridge.
    pub tx_packets: u64,
    /// Bytes of those packets.
    pub tx_bytes: u64,
    /// TX packets whose grant copy or map failed, answered with an error.
    pub tx_grant_errors: u64,
    /// TX packets dropped for want of a buffer.
    pub tx_no_buffer: u64,
    /// Packets dropped because they were longer than the front end can take (over
    /// [`MAX_TAGGED_FRAME`] to a front end without `feature-sg`).
    pub rx_oversize: u64,
    /// Packets dropped because the vif was disabled.
    pub dropped_disabled: u64,
    /// Notifications sent to the guest.
    pub notifies: u64,
    /// Bytes of the guest-RX copies built, by how source and destination line up.
    pub rx_copy_bytes: PerReason<CopyAlign>,
    /// Guest copy: buffers lent to the guest (a sub-page grant each).
    pub rx_lent: u64,
    /// Guest copy: lent buffers the guest gave back by posting their slot again.
    pub rx_returned: u64,
    /// Guest copy: lent buffers revoked because the guest held [`RX_LENT_MAX`].
    pub rx_revoked: u64,
    /// Guest copy: packets dropped because the oldest lent buffer was being copied and
    /// could not be revoked yet.
    pub rx_lent_full: u64,
    /// Guest copy: requests naming a slot out of range or already posted, answered
    /// with an error.
    pub rx_bad_requests: u64,
    /// Guest copy: packets whose bytes were in more pieces than a response chain
    /// carries, copied into one local buffer first.
    pub rx_linearized: u64,
    /// Guest copy: pieces lent through a windowed transitive grant of the sending
    /// guest's own grant (bytes of a frame another guest sent, not copied).
    pub rx_transitive: u64,
    /// Control-ring requests taken.
    pub ctrl_requests: u64,
    /// Control-ring requests answered with an error status (bad queue, length, list
    /// page or type).
    pub ctrl_errors: u64,
    /// Times the TX action stopped with requests waiting because a packet's worth of
    /// pending entries was not free (large packets hold many until sent).
    pub tx_pending_stalls: u64,
    /// Times the TX action stopped with a packet waiting for the vif's rate to allow it
    /// (the toolstack's `rate`).
    pub tx_rate_limited: u64,
    /// Offloads: large (GSO) packets taken from the guest.
    pub tx_gso_packets: u64,
    /// Offloads: GSO packets the guest sent without `NETTXF_csum_blank`, made partial
    /// here (Linux's `rx_gso_checksum_fixup`).
    pub tx_gso_csum_fixups: u64,
    /// Offloads: guest packets dropped for their metadata or the headers it describes,
    /// per [`OffloadError`] (a blank checksum on what is not TCP or UDP over IPv4, GSO
    /// of what is not TCP, segments longer than a frame).
    pub tx_offload_errors: PerReason<OffloadError>,
    /// Offloads: large packets given to the guest whole, with a GSO extra.
    pub rx_gso_packets: u64,
    /// Offloads: large packets cut into frames here because the front end (or this
    /// vif's receive path) takes none whole; and the frames they became.
    pub rx_gso_segmented: u64,
    /// Frames those packets were cut into.
    pub rx_gso_segments: u64,
    /// Offloads: partial checksums filled in here for a front end that takes none.
    pub rx_csum_filled: u64,
    /// Offloads: packets that could not be segmented or checksummed here (bad headers,
    /// no buffer), dropped.
    pub rx_offload_drops: u64,
    /// Direct placement: packets queued to the vif instead of sent through its NIC
    /// queue, dropped (its answers must keep ring order, so its frames come only
    /// through the queue).
    pub rx_unplaced: u64,
    /// Times this vif was taken over from a back end that left it `Connected`
    /// ([`Vif::resume`]).
    pub resumed: u64,
    /// Responses the back end before wrote and had not published, written again from
    /// its journals and published when this one took the vif over.
    pub resume_replayed: u64,
}

hv::counter_set!(VifStats {
    rx_packets,
    rx_bytes,
    rx_queue_full,
    rx_copy_errors,
    rx_from_grants,
    rx_stalls,
    rx_nic_held,
    rx_hold_expired,
    tx_packets,
    tx_bytes,
    tx_grant_errors,
    tx_no_buffer,
    rx_oversize,
    dropped_disabled,
    notifies,
    rx_copy_bytes,
    rx_lent,
    rx_returned,
    rx_revoked,
    rx_lent_full,
    rx_bad_requests,
    rx_linearized,
    rx_transitive,
    ctrl_requests,
    ctrl_errors,
    tx_pending_stalls,
    tx_rate_limited,
    tx_gso_packets,
    tx_gso_csum_fixups,
    tx_offload_errors,
    rx_gso_packets,
    rx_gso_segmented,
    rx_gso_segments,
    rx_csum_filled,
    rx_offload_drops,
    rx_unplaced,
    resumed,
    resume_replayed
});

impl VifStats {
    /// The counters that count packets dropped or refused, one per reason.
    pub const DROPS: &'static [&'static str] = &[
        "rx_queue_full",
        "rx_copy_errors",
        "rx_oversize",
        "rx_lent_full",
        "rx_bad_requests",
        "tx_grant_errors",
        "tx_no_buffer",
        "dropped_disabled",
        "tx_offload_errors",
        "rx_offload_drops",
        "rx_unplaced",
    ];
}

/// How full a vif's rings are: requests the front end has published (as netback last
/// read its index) that netback has not answered yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingOccupancy {
    /// TX ring: packets' slots waiting or in flight.
    pub tx: u32,
    /// RX ring: buffers (or credits) posted and not used yet.
    pub rx: u32,
    /// Slots in each ring.
    pub size: u32,
    /// TX requests published and not yet taken.
    pub tx_waiting: u32,
    /// Pending entries free (each slot of a packet in flight holds one).
    pub pending_free: u32,
}

impl hv::counters::CounterSet for RingOccupancy {
    fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
        f("tx_ring_used", u64::from(self.tx));
        f("rx_ring_used", u64::from(self.rx));
        f("ring_size", u64::from(self.size));
        f("tx_waiting", u64::from(self.tx_waiting));
        f("pending_free", u64::from(self.pending_free));
    }
}
