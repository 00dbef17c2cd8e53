//! Two smoltcp hosts joined back to back through `net::tcp`'s rings: a stream arrives
//! whole, and a segment spoiled on the way is dropped by the checksum, counted, and
//! retransmitted, so the reader still gets every byte right.

use std::time::Duration;

use net::tcp::{fill_stream, Open, StreamCheck, TcpHost};
use smoltcp::wire::Ipv4Address;

const A: [u8; 6] = [2, 0, 0, 0, 0, 1];
const B: [u8; 6] = [2, 0, 0, 0, 0, 2];

/// Streams `total` bytes from a to b, passing frames by hand; `spoil(i, frame)` may
/// change the `i`th frame a sends. Returns b's check and both hosts.
fn stream(
    total: u64,
    mut spoil: impl FnMut(usize, &mut [u8]),
    valid: bool,
) -> (StreamCheck, TcpHost, TcpHost) {
    let ip = |h| Ipv4Address::new(10, 0, 0, h);
    let mut a = TcpHost::new(ip(1), A, Duration::ZERO, 1);
    let mut b = TcpHost::new(ip(2), B, Duration::ZERO, 2);
    let sb = b.open(Open::Listen(5001)).expect("listen");
    let sa = a
        .open(Open::Connect {
            from: 40000,
            to: ip(2),
            port: 5001,
        })
        .expect("connect");
    let (mut written, mut check) = (0u64, StreamCheck::default());
    let mut buf = vec![0u8; 65536];
    let mut sent = 0usize;
    let mut now = Duration::ZERO;
    let mut frames: Vec<Vec<u8>> = Vec::new();
    for _ in 0..200_000 {
        if check.bytes >= total {
            break;
        }
        now += Duration::from_micros(10);
        a.poll(now);
        let s = a.socket(sa);
        while s.can_send() && written < total {
            let n = (total - written).min(1024) as usize;
            fill_stream(written, &mut buf[..n]);
            match s.send_slice(&buf[..n]) {
                Ok(k) if k > 0 => written += k as u64,
                _ => break,
            }
        }
        a.poll(now);
        a.output(|f| {
            frames.push(f.to_vec());
            true
        });
        for mut f in frames.drain(..) {
            spoil(sent, &mut f);
            sent += 1;
            b.input(f.len(), valid, |d| {
                d.copy_from_slice(&f);
                true
            });
        }
        b.poll(now);
        let s = b.socket(sb);
        while let Ok(n) = s.recv_slice(&mut buf) {
            if n == 0 {
                break;
            }
            check.check(&buf[..n]);
        }
        b.poll(now);
        b.output(|f| {
            frames.push(f.to_vec());
            true
        });
        for f in frames.drain(..) {
            a.input(f.len(), valid, |d| {
                d.copy_from_slice(&f);
                true
            });
        }
    }
    (check, a, b)
}

/// Frame 40 is well into the stream: its last payload byte is flipped.
fn flip_last_byte_of_frame_40(i: usize, f: &mut [u8]) {
    if i == 40 {
        let n = f.len();
        f[n - 1] ^= 0x20;
    }
}

#[test]
fn a_stream_crosses_whole() {
    let (check, a, b) = stream(1 << 20, |_, _| {}, false);
    assert_eq!((check.bytes, check.corrupt), (1 << 20, 0));
    assert_eq!(b.stats().rx_bad_checksum, 0);
    // b acknowledged every second segment or so: its frames are far fewer than a's.
    assert!(
        b.stats().tx_frames * 3 < a.stats().tx_frames * 2,
        "{:?} {:?}",
        a.stats(),
        b.stats()
    );
}

#[test]
fn a_spoiled_segment_is_dropped_counted_and_retransmitted() {
    let (check, _, b) = stream(256 << 10, flip_last_byte_of_frame_40, false);
    assert_eq!((check.bytes, check.corrupt), (256 << 10, 0));
    assert_eq!(b.stats().rx_bad_checksum, 1);
}

#[test]
fn a_spoiled_segment_a_device_claimed_valid_reaches_the_reader_and_is_caught_there() {
    // The same flip, but the frames are marked validated (a device that lies): the
    // stack trusts the mark, as Linux trusts CHECKSUM_UNNECESSARY, and the
    // application's check is what sees it.
    let (check, _, b) = stream(256 << 10, flip_last_byte_of_frame_40, true);
    assert_eq!(check.corrupt, 1);
    assert_eq!(b.stats().rx_bad_checksum, 0);
}

#[test]
fn a_frame_larger_than_a_slot_or_a_full_ring_is_refused_and_counted() {
    let mut h = TcpHost::new(Ipv4Address::new(10, 0, 0, 1), A, Duration::ZERO, 1);
    assert!(!h.input(net::tcp::RX_SLOT + 1, true, |_| true));
    assert_eq!(h.stats().rx_oversize, 1);
    for _ in 0..net::tcp::RX_FRAMES {
        assert!(h.input(60, true, |_| true));
    }
    assert!(!h.input(60, true, |_| true));
    assert_eq!(h.stats().rx_ring_full, 1);
    // The host drains the ring (garbage frames: smoltcp drops them) and takes more.
    h.poll(Duration::from_millis(1));
    assert!(h.input(60, true, |_| true));
}

#[test]
fn the_stream_is_filled_and_checked_byte_for_byte_in_pieces_of_any_size_at_any_offset() {
    // Offsets across message boundaries (every 1024 bytes) and the pattern's wraps
    // (every 256 messages), pieces from one byte to more than a message.
    for &(at, len) in &[
        (0u64, 1usize),
        (1023, 2),
        (1000, 3000),
        (255 * 1024 + 7, 70_000),
        (u64::from(u32::MAX) - 5, 4096),
        (12_345_678, 65_536),
    ] {
        let mut out = vec![0u8; len];
        fill_stream(at, &mut out);
        let want: Vec<u8> = (0..len as u64)
            .map(|i| net::tcp::stream_byte(at + i))
            .collect();
        assert_eq!(out, want, "fill from {at}, {len} bytes");

        // Checked in uneven pieces: nothing wrong; then with three bytes spoiled, in
        // one run and across runs, exactly three counted.
        let mut check = StreamCheck {
            bytes: at,
            corrupt: 0,
        };
        for piece in out.chunks(777) {
            check.check(piece);
        }
        assert_eq!((check.bytes, check.corrupt), (at + len as u64, 0));
        for i in [0, len / 2, len - 1] {
            out[i] ^= 0x40;
        }
        let spoiled = if len >= 3 { 3 } else { [0, 1, 1, 2][len] };
        let mut check = StreamCheck {
            bytes: at,
            corrupt: 0,
        };
        for piece in out.chunks(1000) {
            check.check(piece);
        }
        assert_eq!(check.corrupt, spoiled, "spoiled from {at}, {len} bytes");
    }
}
