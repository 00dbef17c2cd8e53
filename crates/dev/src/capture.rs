//! Packet capture to pcap files, for Wireshark and tshark.
//!
//! A [`CaptureFile`] owns one file and a writer thread. Each place that sees frames
//! cross a port gets a [`CaptureTap`] from it. A tap copies each frame into one of its
//! own preallocated slots and hands the slot to the writer, which writes the record and
//! gives the slot back. The data path does no allocation and no system call.
//! AF_PACKET's mapped ring works the same way, with its reader in another process.
//! When the writer falls behind and a tap has no free slot, the frame is not
//! captured, and the tap counts it.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pcap_file::pcap::{PcapPacket, PcapWriter};

/// Bytes of each frame kept (longer frames are cut, their length kept in the record).
pub const SNAPLEN: usize = 2048;
/// Slots per tap: frames a tap can have on their way to the file at once.
pub const TAP_SLOTS: usize = 1024;

/// A capture's counters.
#[derive(Debug, Default)]
pub struct CaptureCounters {
    /// Frames written to the file.
    pub written: AtomicU64,
    /// Frames not captured: the tap had no free slot (the writer was behind).
    pub dropped: AtomicU64,
    /// Records the file refused.
    pub write_errors: AtomicU64,
}

/// One captured frame on its way to the file, and the way back to its tap.
struct Slot {
    data: Box<[u8]>,
    kept: usize,
    len: usize,
    at: Duration,
    back: SyncSender<Slot>,
}

/// A pcap file being written: frames from every tap made from it.
pub struct CaptureFile {
    to_writer: Option<SyncSender<Slot>>,
    writer: Option<JoinHandle<()>>,
    counters: Arc<CaptureCounters>,
}

impl std::fmt::Debug for CaptureFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureFile")
            .field("counters", &self.counters)
            .finish()
    }
}

impl CaptureFile {
    /// Creates `path` (Ethernet frames, microsecond timestamps) and starts its writer.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        let file = BufWriter::with_capacity(1 << 20, File::create(path)?);
        let out = PcapWriter::new(file).map_err(std::io::Error::other)?;
        // Room for every slot of a few taps.
        let (to_writer, from_taps) = sync_channel::<Slot>(4 * TAP_SLOTS);
        let counters = Arc::new(CaptureCounters::default());
        let c = Arc::clone(&counters);
        let writer = std::thread::Builder::new()
            .name("pvio-pcap".into())
            .spawn(move || write_all(&from_taps, out, &c))?;
        Ok(Self {
            to_writer: Some(to_writer),
            writer: Some(writer),
            counters,
        })
    }

    /// A new place to capture from, with its own slots.
    pub fn tap(&self) -> CaptureTap {
        let (back, free) = sync_channel::<Slot>(TAP_SLOTS);
        for _ in 0..TAP_SLOTS {
            let _ = back.try_send(Slot {
                data: vec![0u8; SNAPLEN].into_boxed_slice(),
                kept: 0,
                len: 0,
                at: Duration::ZERO,
                back: back.clone(),
            });
        }
        CaptureTap {
            free,
            to_writer: self.to_writer.clone(),
            counters: Arc::clone(&self.counters),
        }
    }

    /// Its counters.
    pub fn counters(&self) -> &Arc<CaptureCounters> {
        &self.counters
    }
}

/// The writer: each frame's record, until every tap and the file's owner are gone.
fn write_all(
    from_taps: &Receiver<Slot>,
    mut out: PcapWriter<BufWriter<File>>,
    c: &CaptureCounters,
) {
    while let Ok(slot) = from_taps.recv() {
        let packet = PcapPacket::new(
            slot.at,
            u32::try_from(slot.len).unwrap_or(u32::MAX),
            &slot.data[..slot.kept],
        );
        match out.write_packet(&packet) {
            Ok(_) => c.written.fetch_add(1, Ordering::Relaxed),
            Err(_) => c.write_errors.fetch_add(1, Ordering::Relaxed),
        };
        let back = slot.back.clone();
        let _ = back.try_send(slot);
    }
    if std::io::Write::flush(&mut out.into_writer()).is_err() {
        c.write_errors.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for CaptureFile {
    /// Waits for the writer to write what the taps sent and flush. Every tap must be
    /// gone first (dropped with the port it watched).
    fn drop(&mut self) {
        drop(self.to_writer.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Where frames crossing one point of a port are copied for the capture.
pub struct CaptureTap {
    free: Receiver<Slot>,
    to_writer: Option<SyncSender<Slot>>,
    counters: Arc<CaptureCounters>,
}

impl std::fmt::Debug for CaptureTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureTap").finish_non_exhaustive()
    }
}

impl CaptureTap {
    /// Copies `frame` for the file, stamped with the time now.
    pub fn frame(&self, frame: &[u8]) {
        let Some(to) = &self.to_writer else {
            return;
        };
        let Ok(mut slot) = self.free.try_recv() else {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        slot.kept = frame.len().min(SNAPLEN);
        slot.data[..slot.kept].copy_from_slice(&frame[..slot.kept]);
        slot.len = frame.len();
        slot.at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        if to.try_send(slot).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_frame_tapped_is_in_the_file_in_order_whole_or_cut_at_the_snap_length() {
        let dir = std::env::temp_dir().join(format!("pvio-capture-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("t.pcap");
        let file = CaptureFile::create(&path).expect("create");
        let frames: Vec<Vec<u8>> = (0..600u32)
            .map(|i| {
                (0..(60 + i as usize * 7))
                    .map(|b| (b as u32 ^ i) as u8)
                    .collect()
            })
            .collect();
        {
            let tap = file.tap();
            for (i, f) in frames.iter().enumerate() {
                // Within the tap's slots: this test is about content, not overload.
                while i as u64 >= file.counters().written.load(Ordering::Relaxed) + 128 {
                    std::thread::yield_now();
                }
                tap.frame(f);
            }
        }
        let counters = Arc::clone(file.counters());
        drop(file);
        assert_eq!(counters.dropped.load(Ordering::Relaxed), 0);
        assert_eq!(
            counters.written.load(Ordering::Relaxed),
            frames.len() as u64
        );
        let mut r = pcap_file::pcap::PcapReader::new(File::open(&path).expect("open"))
            .expect("a pcap header");
        let mut n = 0;
        while let Some(p) = r.next_packet() {
            let p = p.expect("a record");
            let f = &frames[n];
            assert_eq!(p.orig_len as usize, f.len());
            assert_eq!(&p.data[..], &f[..f.len().min(SNAPLEN)]);
            n += 1;
        }
        assert_eq!(n, frames.len());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_tap_whose_writer_is_behind_counts_what_it_could_not_keep() {
        let dir = std::env::temp_dir().join(format!("pvio-capture-full-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = CaptureFile::create(&dir.join("t.pcap")).expect("create");
        let tap = file.tap();
        // Take every free slot away, as a writer that has not returned them.
        let held: Vec<Slot> = std::iter::from_fn(|| tap.free.try_recv().ok()).collect();
        assert_eq!(held.len(), TAP_SLOTS);
        tap.frame(&[1, 2, 3]);
        assert_eq!(file.counters().dropped.load(Ordering::Relaxed), 1);
        drop(held);
        drop(tap);
        drop(file);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
