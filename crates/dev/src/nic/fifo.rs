//! The NIC's receive packet buffer: device memory in which a frame whose queue has no
//! free descriptor waits for the driver's next refill, rather than being dropped at
//! once. A NIC receives every frame into such a buffer first and DMAs it to the host
//! from there (the 82599, whose VMDq pools pvio's multi-queue NIC follows, has 512 KB),
//! so a ring that runs dry for a few milliseconds loses nothing while the buffer lasts.
//! With flow control on, the 82599's driver leaves a queue's drop-when-empty bit off
//! and frames wait there; pvio does the same, but keeps each queue's frames in order
//! on their own rather than in one line, so that a queue without buffers holds up no
//! other queue (a guest that posts nothing keeps at most its share, and its frames are
//! dropped once they have waited [`GUEST_QUEUE_HOLD`]).
//!
//! The memory is allocated once, with the device, in chunks a frame takes as many of
//! as it needs (an MTU-sized frame one), linked, so that frames leave in any order
//! without the memory fragmenting.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use net::offload::Offload;

use super::RX_QUEUES;

/// Bytes of the device's receive packet buffer: the 82599's.
pub const RX_FIFO_BYTES: usize = 512 * 1024;
/// Its unit: a frame takes as many as its length needs, an MTU-sized frame one.
pub const RX_FIFO_CHUNK: usize = 2048;
/// What no one queue may take: a largest frame's worth, kept for the others.
pub const RX_FIFO_RESERVE: usize = 64 * 1024;

/// The longest a frame waits in the device (or with a source that holds it) for its
/// queue's next refill before it is dropped on the queue, as a VMDq queue with drop
/// enabled does: a guest that posts nothing pauses the others behind the same cable
/// for this long at most, once, until it posts again (the vif's own bound,
/// `net::netback::RX_HOLD_LIMIT`).
pub const GUEST_QUEUE_HOLD: Duration = Duration::from_millis(20);

/// The room left, for the queue with the most waiting, under which the device pauses
/// a far end that takes PAUSE frames (the 82599's `FCRTH` high-water mark, set so that
/// what a 10 Gbit/s partner sends before it stops still fits).
pub const RX_FIFO_XOFF: usize = 32 * 1024;
/// The room at which it lets the far end go again (`FCRTL`, low water): far enough
/// from the high mark that the link is not paused and released at every frame.
pub const RX_FIFO_XON: usize = 128 * 1024;

const CHUNKS: usize = RX_FIFO_BYTES / RX_FIFO_CHUNK;
const QUEUE_CHUNKS: usize = (RX_FIFO_BYTES - RX_FIFO_RESERVE) / RX_FIFO_CHUNK;
const END: u16 = u16::MAX;

/// A frame waiting in the buffer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Held {
    /// Its queue.
    pub(super) q: usize,
    /// Its bytes.
    pub(super) len: usize,
    /// What rides beside it.
    pub(super) off: Offload,
    /// When it came.
    pub(super) since: Instant,
    first: u16,
    chunks: u16,
}

/// The receive packet buffer. [`Default`] is an empty one without memory (a stand-in
/// while the device works on the real one, taken out of it).
#[derive(Default)]
pub(super) struct RxFifo {
    mem: Vec<u8>,
    /// Each chunk's successor, in its frame or in the free list ([`END`]: none).
    next: Vec<u16>,
    free: u16,
    free_chunks: usize,
    per_queue: [usize; RX_QUEUES],
    /// Frames held, oldest first (kept so: a frame that stays goes back behind the
    /// later ones of the same pass, which came after it).
    order: VecDeque<Held>,
    /// A frame was kept while its queue was being refilled: look again at once.
    pub(super) again: bool,
}

impl RxFifo {
    pub(super) fn new() -> Self {
        let next = (0..CHUNKS)
            .map(|c| if c + 1 < CHUNKS { (c + 1) as u16 } else { END })
            .collect();
        Self {
            mem: vec![0; RX_FIFO_BYTES],
            next,
            free: 0,
            free_chunks: CHUNKS,
            per_queue: [0; RX_QUEUES],
            order: VecDeque::with_capacity(CHUNKS),
            again: false,
        }
    }

    /// Whether queue `q` has frames waiting (a frame for it goes behind them).
    pub(super) fn holds_for(&self, q: usize) -> bool {
        self.per_queue.get(q).is_some_and(|&n| n > 0)
    }

    /// Whether it holds anything.
    pub(super) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Frames it holds.
    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    /// The room the queue with the most frames waiting still finds (its share, or the
    /// whole buffer's, whichever is less), in bytes.
    pub(super) fn room(&self) -> usize {
        let fullest = self.per_queue.iter().copied().max().unwrap_or(0);
        self.free_chunks.min(QUEUE_CHUNKS - fullest) * RX_FIFO_CHUNK
    }

    /// When its oldest frame's wait runs out.
    pub(super) fn due(&self) -> Option<Instant> {
        self.order.front().map(|h| h.since + GUEST_QUEUE_HOLD)
    }

    /// Keeps `frame` for queue `q`, copied into the buffer, last in line; false (and
    /// nothing kept) if the buffer or the queue's share of it has no room, or the frame
    /// is longer than any a cable brings (64 KiB).
    pub(super) fn put(&mut self, q: usize, frame: &[u8], off: Offload, now: Instant) -> bool {
        let need = frame.len().div_ceil(RX_FIFO_CHUNK).max(1);
        if q >= RX_QUEUES
            || frame.len() > RX_FIFO_RESERVE
            || need > self.free_chunks
            || self.per_queue[q] + need > QUEUE_CHUNKS
        {
            return false;
        }
        let first = self.free;
        let mut c = first;
        let mut last = c;
        for k in 0..need {
            let at = usize::from(c) * RX_FIFO_CHUNK;
            let piece = &frame
                [(k * RX_FIFO_CHUNK).min(frame.len())..((k + 1) * RX_FIFO_CHUNK).min(frame.len())];
            self.mem[at..at + piece.len()].copy_from_slice(piece);
            last = c;
            c = self.next[usize::from(c)];
        }
        self.free = c;
        self.next[usize::from(last)] = END;
        self.free_chunks -= need;
        self.per_queue[q] += need;
        self.order.push_back(Held {
            q,
            len: frame.len(),
            off,
            since: now,
            first,
            chunks: need as u16,
        });
        true
    }

    /// The oldest frame, out of line (its bytes stay until [`Self::release`], or it
    /// goes back with [`Self::keep`]).
    pub(super) fn pop(&mut self) -> Option<Held> {
        self.order.pop_front()
    }

    /// Puts `h`, taken by [`Self::pop`], back in line, last.
    pub(super) fn keep(&mut self, h: Held) {
        self.order.push_back(h);
    }

    /// The bytes of `h`: where they lie, if in one chunk; else copied into `buf` (at
    /// least `h.len` long), and there.
    pub(super) fn bytes<'a>(&'a self, h: &Held, buf: &'a mut [u8]) -> &'a [u8] {
        let at = usize::from(h.first) * RX_FIFO_CHUNK;
        if h.chunks == 1 {
            return &self.mem[at..at + h.len];
        }
        let mut c = h.first;
        let mut done = 0;
        while done < h.len && c != END {
            let at = usize::from(c) * RX_FIFO_CHUNK;
            let n = (h.len - done).min(RX_FIFO_CHUNK);
            buf[done..done + n].copy_from_slice(&self.mem[at..at + n]);
            done += n;
            c = self.next[usize::from(c)];
        }
        &buf[..h.len]
    }

    /// Gives `h`'s chunks back, taken by [`Self::pop`] and not kept.
    pub(super) fn release(&mut self, h: Held) {
        let mut last = h.first;
        while self.next[usize::from(last)] != END {
            last = self.next[usize::from(last)];
        }
        self.next[usize::from(last)] = self.free;
        self.free = h.first;
        self.free_chunks += usize::from(h.chunks);
        self.per_queue[h.q] -= usize::from(h.chunks);
    }

    /// Empties it (a reset).
    pub(super) fn clear(&mut self) {
        while let Some(h) = self.order.pop_front() {
            self.release(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    /// Frames of any length come back byte for byte, in any order of release, and
    /// the memory they took is whole again after: nothing leaks, nothing overlaps.
    #[test]
    fn frames_come_back_whole_in_any_order_and_their_memory_is_reused() {
        let mut f = RxFifo::new();
        let now = Instant::now();
        let lens = [0, 1, 60, 1514, 2048, 2049, 9000, 65535];
        for round in 0..3u8 {
            for (k, &len) in lens.iter().enumerate() {
                assert!(f.put(k % 2 + 1, &frame(len, k as u8 ^ round), Offload::NONE, now));
            }
            let mut buf = vec![0u8; 65536];
            // Every other frame leaves first; the rest go back in line, then leave, in
            // their order, still whole after the others' memory was given back.
            for (k, &len) in lens.iter().enumerate() {
                let h = f.pop().expect("a frame");
                assert_eq!(
                    f.bytes(&h, &mut buf),
                    frame(len, k as u8 ^ round),
                    "frame {k}"
                );
                if k % 2 == 0 {
                    f.release(h);
                } else {
                    f.keep(h);
                }
            }
            for (k, &len) in lens.iter().enumerate().filter(|(k, _)| k % 2 == 1) {
                let h = f.pop().expect("a kept frame");
                assert_eq!(
                    f.bytes(&h, &mut buf),
                    frame(len, k as u8 ^ round),
                    "kept {k}"
                );
                f.release(h);
            }
            assert!(f.is_empty());
            assert_eq!((f.free_chunks, f.per_queue), (CHUNKS, [0; RX_QUEUES]));
        }
    }

    /// One queue fills all but the reserve; another queue still has it; the buffer
    /// full, nothing more is kept.
    #[test]
    fn one_queue_never_takes_the_reserve_kept_for_the_others() {
        let mut f = RxFifo::new();
        let now = Instant::now();
        let mtu = frame(1514, 0);
        let mut kept = 0;
        while f.put(1, &mtu, Offload::NONE, now) {
            kept += 1;
        }
        assert_eq!(kept, QUEUE_CHUNKS);
        assert!(f.holds_for(1) && !f.holds_for(2));
        let big = frame(65536, 1);
        assert!(
            f.put(2, &big, Offload::NONE, now),
            "the reserve is another queue's"
        );
        assert!(!f.put(3, &mtu, Offload::NONE, now), "full");
        assert_eq!(f.len(), QUEUE_CHUNKS + 1);
        assert!(!f.put(RX_QUEUES, &mtu, Offload::NONE, now), "no such queue");
        f.clear();
        assert!(
            !f.put(1, &frame(65537, 2), Offload::NONE, now),
            "longer than any frame"
        );
        f.clear();
        assert_eq!(f.free_chunks, CHUNKS);
    }
}
