//! The SV-NIC's virtual interfaces: frames cross both queues intact and in order
//! through the guest's mappings of device memory, and whatever a guest writes into its
//! own region breaks that VIF only (paper 002's queues; issue 19's bad input).

use dev::svnic::vif::{VifDevice, VifError, VifRegion, MAX_FRAME, SLOTS, SLOT_BYTES, VIF_PAGES};
use hv::GrantError;
use mem::{MemError, PageAccess};

mod common;
use common::{setup, vif};

fn frame(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// Device → guest: reserve, fill, publish in order.
fn deliver(dev: &VifDevice<hv::OwnPage>, f: &[u8]) -> Result<bool, VifError> {
    match dev.rx.reserve()? {
        Some(seq) => {
            dev.rx.fill(seq, f)?;
            assert!(dev.rx.publish(seq, f.len())?);
            Ok(true)
        }
        None => Ok(false),
    }
}

#[test]
fn frames_cross_both_queues_intact_and_in_order() {
    let s = setup(1);
    let (mut dev, mut front) = vif(&s, 0);
    let mut out = [0u8; SLOT_BYTES];
    // Three times round each queue.
    for round in 0..3 * SLOTS as usize {
        let f = frame(60 + round % (MAX_FRAME - 60), round as u8);
        front.send(&f).expect("send");
        let n = dev.tx.take(&mut out).expect("take").expect("a frame");
        assert_eq!(&out[..n], &f[..], "send {round}");
        let g = frame(MAX_FRAME - round % 1000, !(round as u8));
        assert!(deliver(&dev, &g).expect("deliver"));
        assert!(!front.isempty().expect("isempty"));
        let n = front.recv(&mut out).expect("recv").expect("a frame");
        assert_eq!(&out[..n], &g[..], "recv {round}");
        assert!(front.isempty().expect("isempty"));
    }
    assert_eq!(dev.tx.take(&mut out), Ok(None));
    let st = dev.tx.stats();
    let l = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        (l(&st.tx_frames), l(&st.rx_frames)),
        (3 * SLOTS as u64, 3 * SLOTS as u64)
    );
    assert_eq!(l(&st.protocol_breaks), 0);
}

#[test]
fn the_send_queue_fills_at_its_size_and_drains_in_order() {
    let s = setup(1);
    let (mut dev, mut front) = vif(&s, 0);
    for i in 0..SLOTS as usize {
        assert!(!front.isfull().expect("isfull"));
        front.send(&frame(100, i as u8)).expect("send");
    }
    assert!(front.isfull().expect("isfull"));
    assert_eq!(front.send(&frame(100, 0)), Err(VifError::Full));
    let mut out = [0u8; SLOT_BYTES];
    for i in 0..SLOTS as usize {
        assert_eq!(dev.tx.take(&mut out), Ok(Some(100)));
        assert_eq!(&out[..100], &frame(100, i as u8)[..]);
    }
    assert!(!front.isfull().expect("isfull"));
}

#[test]
fn ingress_contexts_fill_in_parallel_and_publish_in_sequence_order() {
    let s = setup(1);
    let (dev, mut front) = vif(&s, 0);
    let seqs: Vec<u32> = (0..3)
        .map(|_| dev.rx.reserve().expect("reserve").expect("room"))
        .collect();
    assert_eq!(seqs, [0, 1, 2]);
    // Filled out of order; the later ones wait for their turn.
    dev.rx.fill(2, &frame(70, 2)).expect("fill");
    dev.rx.fill(0, &frame(70, 0)).expect("fill");
    assert_eq!(dev.rx.publish(2, 70), Ok(false));
    assert!(front.isempty().expect("empty"), "nothing published yet");
    assert_eq!(dev.rx.publish(0, 70), Ok(true));
    dev.rx.fill(1, &frame(70, 1)).expect("fill");
    assert_eq!(dev.rx.publish(2, 70), Ok(false));
    assert_eq!(dev.rx.publish(1, 70), Ok(true));
    assert_eq!(dev.rx.publish(2, 70), Ok(true));
    let mut out = [0u8; SLOT_BYTES];
    for i in 0..3u8 {
        assert_eq!(front.recv(&mut out), Ok(Some(70)));
        assert_eq!(&out[..70], &frame(70, i)[..]);
    }
}

#[test]
fn the_device_page_is_read_only_to_the_guest_and_another_guest_cannot_map_the_region() {
    let s = setup(2);
    let (_dev, front) = vif(&s, 0);
    // The guest cannot move the device's indices or lengths.
    assert_eq!(
        front.pages().device.write(0, &[0xff; 4]),
        Err(MemError::ReadOnly(0))
    );
    // Guest 1 maps none of guest 0's region: its grants name guest 0.
    let region = VifRegion::create(&s.device, s.guests[0].id()).expect("region");
    match region.map_in_guest(&s.hv, &s.guests[1], s.device.id(), VIF_PAGES as u32) {
        Err(dev::svnic::vif::RegionError::Map(e)) => assert_eq!(e, GrantError::NotForYou),
        other => panic!("guest 1 mapped guest 0's region: {other:?}"),
    }
}

#[test]
fn a_send_producer_more_than_a_queue_ahead_or_behind_breaks_that_vif_only() {
    for prod in [SLOTS + 1, u32::MAX] {
        let s = setup(2);
        let (mut bad, front) = vif(&s, 0);
        let (mut good, mut good_front) = vif(&s, 1);
        front
            .pages()
            .guest
            .write(0, &prod.to_ne_bytes())
            .expect("guest page");
        let mut out = [0u8; SLOT_BYTES];
        assert_eq!(
            bad.tx.take(&mut out),
            Err(VifError::TxProducer { prod, cons: 0 })
        );
        assert!(bad.is_broken());
        assert_eq!(bad.tx.take(&mut out), Err(VifError::Broken));
        assert_eq!(bad.rx.reserve(), Err(VifError::Broken), "the whole VIF");
        // The neighbour carries on.
        good_front.send(&frame(64, 9)).expect("send");
        assert_eq!(good.tx.take(&mut out), Ok(Some(64)));
        assert!(!good.is_broken());
    }
}

#[test]
fn a_bad_length_costs_one_frame_and_the_next_is_taken() {
    let s = setup(1);
    let (mut dev, mut front) = vif(&s, 0);
    front.send(&frame(64, 1)).expect("send");
    front.send(&frame(65, 2)).expect("send");
    // After publishing, the guest rewrites slot 0's length: too long for a frame.
    front
        .pages()
        .guest
        .write(64, &(SLOT_BYTES as u16 + 1).to_ne_bytes())
        .expect("guest page");
    let mut out = [0u8; SLOT_BYTES];
    assert_eq!(
        dev.tx.take(&mut out),
        Err(VifError::BadLength(SLOT_BYTES + 1))
    );
    assert_eq!(dev.tx.take(&mut out), Ok(Some(65)));
    assert_eq!(&out[..65], &frame(65, 2)[..]);
    assert!(!dev.is_broken());
    let st = dev.tx.stats();
    assert_eq!(
        st.tx_bad_length.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[test]
fn a_frame_rewritten_after_it_was_taken_leaves_the_device_copy_as_sent() {
    let s = setup(1);
    let (mut dev, mut front) = vif(&s, 0);
    let f = frame(200, 3);
    front.send(&f).expect("send");
    let mut out = [0u8; SLOT_BYTES];
    assert_eq!(dev.tx.take(&mut out), Ok(Some(200)));
    front.pages().tx[0].write(0, &[0xee; 200]).expect("rewrite");
    assert_eq!(&out[..200], &f[..]);
}

#[test]
fn a_receive_consumer_past_what_was_published_or_moving_back_breaks_that_vif() {
    for (published, cons) in [(0u32, 1u32), (2, 3), (2, u32::MAX)] {
        let s = setup(1);
        let (dev, mut front) = vif(&s, 0);
        for i in 0..published {
            assert!(deliver(&dev, &frame(60, i as u8)).expect("deliver"));
        }
        let mut out = [0u8; SLOT_BYTES];
        if published > 0 {
            assert_eq!(front.recv(&mut out), Ok(Some(60)));
        }
        front
            .pages()
            .guest
            .write(4, &cons.to_ne_bytes())
            .expect("guest page");
        assert!(
            matches!(dev.rx.reserve(), Err(VifError::RxConsumer { .. })),
            "published {published}, consumer {cons}"
        );
        assert!(dev.is_broken());
    }
}

#[test]
fn a_guest_that_never_drains_loses_its_own_frames_only() {
    let s = setup(2);
    let (slow, _never_reads) = vif(&s, 0);
    let (fast, mut reads) = vif(&s, 1);
    let mut out = [0u8; SLOT_BYTES];
    for i in 0..3 * SLOTS {
        let f = frame(128, i as u8);
        let placed = deliver(&slow, &f).expect("slow");
        assert_eq!(placed, i < SLOTS, "frame {i}");
        assert!(deliver(&fast, &f).expect("fast"));
        assert_eq!(reads.recv(&mut out), Ok(Some(128)));
        assert_eq!(&out[..128], &f[..]);
    }
    let l = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(l(&slow.rx.stats().rx_full), 2 * SLOTS as u64);
    assert_eq!(l(&fast.rx.stats().rx_full), 0);
    assert!(!slow.is_broken());
}

#[test]
fn the_signals_are_the_guests_to_switch() {
    let s = setup(1);
    let (dev, front) = vif(&s, 0);
    assert!(!dev.rx.wants_signal() && !dev.tx.wants_signal());
    front.set_rx_signal(true).expect("rx on");
    assert!(dev.rx.wants_signal() && !dev.tx.wants_signal());
    front.set_tx_signal(true).expect("tx on");
    front.set_rx_signal(false).expect("rx off");
    assert!(!dev.rx.wants_signal() && dev.tx.wants_signal());
}
