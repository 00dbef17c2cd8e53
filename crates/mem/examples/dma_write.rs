//! What the DMA stand-in's write costs on this machine, by frame and alignment:
//! `MachineMemory::write_nt` (non-temporal, data lands in memory, as the papers' NICs
//! wrote) against `write` (cached, as a NIC with Data Direct I/O), each followed by an
//! ordinary store elsewhere (the descriptor or ring write that publishes the frame).
//! `cargo run --release -p mem --example dma_write`
use std::time::Instant;

use mem::{MachineMemory, Mfn};

fn main() -> std::io::Result<()> {
    let m = MachineMemory::new(1024)?;
    let data = vec![7u8; 2048];
    let n = 2_000_000u32;
    for (off, len) in [(2usize, 64usize), (0, 64), (2, 1500), (0, 1536)] {
        for nt in [true, false] {
            let t = Instant::now();
            for i in 0..n {
                let f = Mfn(i % 512);
                let r = if nt {
                    m.write_nt(f, off, &data[..len])
                } else {
                    m.write(f, off, &data[..len])
                };
                let p = m.write(Mfn(600 + i % 4), (i as usize % 64) * 8, &[1u8; 8]);
                if r.is_err() || p.is_err() {
                    return Err(std::io::Error::other("write out of range"));
                }
            }
            let ns = t.elapsed().as_nanos() as f64 / f64::from(n);
            let how = if nt { "non-temporal" } else { "cached" };
            println!("{len:5} B at offset {off}: {how:13} {ns:7.1} ns a frame");
        }
    }
    Ok(())
}
