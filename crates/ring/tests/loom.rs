//! Model checks of the ring's index and event protocol with loom.
//!
//! Two properties, over every interleaving loom explores:
//! 1. no entry is read before it is written, and entries arrive in order. Slots are
//!    relaxed loom atomics: loom lets a relaxed load return any value the memory model
//!    allows, so a slot read without the index's acquire/release pairing would return a
//!    stale value and fail the order assertion;
//! 2. no lost wake-up: if the consumer goes idle (its final check found nothing) while
//!    entries are still to come, the producer's push-and-check asks for a notification
//!    after that point.
//!
//! A control model drops the full fences and must fail, showing the model can tell.

use std::sync::atomic::Ordering;

use loom::sync::atomic::{fence, AtomicU32, AtomicUsize};
use loom::sync::Arc;
use ring::{BackRing, FrontRing, RingMemory, RingProtocol, HEADER_SIZE};

/// A two-slot ring region of 4-byte entries, all words loom atomics.
struct LoomRegion {
    idx: [AtomicU32; 4],
    slots: [AtomicU32; 2],
    /// When false, `fence(SeqCst)` is dropped: the control case.
    full_fences: bool,
}

#[derive(Clone)]
struct Shared(Arc<LoomRegion>);

impl RingMemory for Shared {
    fn region_size(&self) -> usize {
        HEADER_SIZE + 2 * 4
    }
    fn load(&self, at: usize, order: Ordering) -> u32 {
        self.0.idx[at / 4].load(order)
    }
    fn store(&self, at: usize, v: u32, order: Ordering) {
        self.0.idx[at / 4].store(v, order)
    }
    fn fence(&self, order: Ordering) {
        if order == Ordering::SeqCst && !self.0.full_fences {
            return;
        }
        fence(order)
    }
    fn read_entry<T: bytemuck::Pod>(&self, slot: u32, _size: usize) -> T {
        let v = self.0.slots[slot as usize]
            .load(Ordering::Relaxed)
            .to_le_bytes();
        let mut t = T::zeroed();
        let b = bytemuck::bytes_of_mut(&mut t);
        let n = b.len().min(4);
        b[..n].copy_from_slice(&v[..n]);
        t
    }
    fn write_entry<T: bytemuck::Pod>(&self, slot: u32, _size: usize, v: &T) {
        let mut b = [0u8; 4];
        let src = bytemuck::bytes_of(v);
        let n = src.len().min(4);
        b[..n].copy_from_slice(&src[..n]);
        self.0.slots[slot as usize].store(u32::from_le_bytes(b), Ordering::Relaxed);
    }
}

struct Proto;
impl RingProtocol for Proto {
    type Req = u32;
    type Rsp = u32;
}

/// The producer pushes `N` requests one by one (N = ring size, so it never waits for
/// room: a spinning producer would only blow up the state space); the consumer
/// takes what it sees and answers, and when it finds nothing does the final check and
/// "blocks" (stops) unless a notification came meanwhile.
fn requests_model(full_fences: bool) {
    let builder = loom::model::Builder::new();
    builder.check(move || {
        const N: u32 = 2;
        let region = Shared(Arc::new(LoomRegion {
            idx: std::array::from_fn(|_| AtomicU32::new(0)),
            slots: std::array::from_fn(|_| AtomicU32::new(0)),
            full_fences,
        }));
        let notifies = Arc::new(AtomicUsize::new(0));
        let mut front = FrontRing::<Proto, _>::init(region.clone()).expect("init");
        let mut back = BackRing::<Proto, _>::attach(region.clone()).expect("attach");

        let n2 = notifies.clone();
        let producer = loom::thread::spawn(move || {
            let mut sent = 0;
            while sent < N {
                while front.take_response().expect("valid").is_some() {}
                if front.push_request(&(sent + 100)).is_ok() {
                    sent += 1;
                    if front.push_requests_and_check_notify() {
                        n2.fetch_add(1, Ordering::SeqCst);
                    }
                } else {
                    loom::thread::yield_now();
                }
            }
        });

        let mut got = 0u32;
        let mut seen_notifies = 0usize;
        let mut idle_at = None;
        loop {
            while let Some(v) = back.take_request().expect("valid") {
                assert_eq!(v, got + 100, "entries arrive in order and fully written");
                got += 1;
                back.push_response(&v).expect("answer");
                back.push_responses_and_check_notify();
            }
            if got == N {
                break;
            }
            if back.final_check_for_requests().expect("valid") {
                continue;
            }
            // Idle: a real back end blocks here until notified.
            let n = notifies.load(Ordering::SeqCst);
            if n > seen_notifies {
                seen_notifies = n;
                continue;
            }
            idle_at = Some((got, n));
            break;
        }
        producer.join().expect("producer");
        if let Some((got_then, n_then)) = idle_at {
            assert!(
                notifies.load(Ordering::SeqCst) > n_then,
                "lost wake-up: consumer idle after {got_then} of {N} with no notification to come"
            );
        }
    });
}

#[test]
fn request_path_has_no_lost_wakeup_and_no_torn_entry() {
    requests_model(true);
}

#[test]
#[should_panic(expected = "lost wake-up")]
fn without_the_full_fence_the_model_finds_the_lost_wakeup() {
    requests_model(false);
}
