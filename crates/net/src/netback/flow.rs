//! Flow control from a vif's receive queue back to the NIC that feeds it.
//!
//! Linux's netback stops its device's queue when the packets waiting for the guest pass
//! `rx_queue_max`, and the stack in front of it holds what comes meanwhile; a queue
//! that stays stopped because the guest posts nothing is woken again after
//! `rx_drain_timeout_msecs` and drained by dropping. pvio's driver domain has no
//! queueing discipline in front of a vif: what it would hold is left on the NIC. Before
//! each NAPI poll the driver domain asks every vif how many of the NIC's receive
//! descriptors its queue can take for certain ([`Vif::rx_room`]), and polls at most
//! that many; a vif with no room pauses the poll, the NIC's ring fills, and the NIC
//! leaves frames with the interface that feeds it (a TAP's queue, whose sender's stack
//! slows down, as a real NIC's flow control pauses its link partner). No frame is lost
//! for a slow guest.
//!
//! A guest that stops posting buffers must not pause everyone behind the same NIC: a
//! vif that has held the poll for [`RX_HOLD_LIMIT`] is let go ([`VifStats::rx_hold_expired`])
//! and holds nothing until its queue has drained to half; its packets meanwhile are
//! dropped at its queue and counted, as netback's drain does.

use super::*;
use std::time::Duration;

/// The longest a vif holds the NIC's poll while its guest takes nothing from its queue
/// (Linux's `rx_drain_timeout_msecs` is 10 s for a queue in front of which the stack
/// waits; here the whole NIC waits, so the bound is a scheduling delay's, not a
/// toolstack's).
pub const RX_HOLD_LIMIT: Duration = Duration::from_millis(20);

/// What one NIC receive descriptor can add to a vif's queue at most: a page of frame,
/// and its share of the headers that cutting a large segment into frames adds for a
/// front end without GSO (a 66-byte header on every 1448 bytes, under an eighth).
pub const RX_DESC_COST: usize = PAGE_SIZE + PAGE_SIZE / 8;

/// A vif's flow-control state.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RxHold {
    /// Since when its queue has had no room (kernel time).
    since: Option<Duration>,
    /// It held the poll for [`RX_HOLD_LIMIT`] and was let go; it holds nothing until
    /// its queue has drained to half.
    expired: bool,
}

impl<X: Xen> Vif<X> {
    /// How many NIC receive descriptors this vif's queue can take now without dropping
    /// (each at most [`RX_DESC_COST`] bytes), or `None` if it limits nothing: it is
    /// down, or it held the poll past [`RX_HOLD_LIMIT`] and its queue has not drained
    /// since. `now` is the driver domain's clock: a vif with no room starts (or keeps)
    /// its hold, and one whose hold ran out is let go here.
    pub fn rx_room(&mut self, now: Duration) -> Option<usize> {
        if self.disabled.is_some() {
            return None;
        }
        let bytes = self.rx_queue.bytes();
        if self.rx_hold.expired {
            if bytes > RX_QUEUE_BYTES / 2 {
                return None;
            }
            self.rx_hold.expired = false;
        }
        let room = RX_QUEUE_BYTES.saturating_sub(bytes) / RX_DESC_COST;
        if room > 0 {
            self.rx_hold.since = None;
            return Some(room);
        }
        match self.rx_hold.since {
            None => {
                self.rx_hold.since = Some(now);
                self.stats.rx_nic_held += 1;
                Some(0)
            }
            Some(t) if now.saturating_sub(t) >= RX_HOLD_LIMIT => {
                self.rx_hold = RxHold {
                    since: None,
                    expired: true,
                };
                self.stats.rx_hold_expired += 1;
                None
            }
            Some(_) => Some(0),
        }
    }

    /// When this vif's hold on the NIC's poll runs out, if it holds it.
    pub fn rx_hold_until(&self) -> Option<Duration> {
        self.rx_hold.since.map(|t| t + RX_HOLD_LIMIT)
    }
}
