//! Fuzz targets for what a hostile peer reaches, each with an oracle that the case
//! checks at its end: every buffer, item, mapping, port and frame is accounted for, and
//! the state another domain relies on is untouched.
//!
//! A target is a function of an [`Input`]: the test suite (`tests/targets.rs`) gives it
//! seeded pseudo-random choices, a bounded number of cases per run (`PVIO_FUZZ_CASES`
//! for more, `PVIO_FUZZ_SEED` to start elsewhere); `cargo fuzz` (the `fuzz/` project,
//! nightly) gives it libFuzzer's bytes, so coverage guides every choice. A failing
//! case panics with its seed or is saved by libFuzzer; either replays exactly.

pub mod blkback;
pub mod connect;
pub mod hypercalls;
pub mod lro;
pub mod netback;
pub mod netfront;
#[cfg(test)]
mod tests {
    use super::Input;

    #[test]
    fn fuzzer_bytes_run_out_into_zeros_without_panicking() {
        let mut i = Input::from_bytes(&[1, 2, 3, 4]);
        assert_eq!(i.below(10), 1);
        assert_eq!(i.u64(), u64::from_le_bytes([2, 3, 4, 0, 0, 0, 0, 0]));
        assert!(i.exhausted());
        for _ in 0..10 {
            assert_eq!((i.u64(), i.below(7)), (0, 0));
        }
    }
}

pub mod reasm;
pub mod store;
pub mod store_wire;

/// Where a case's choices come from: fuzzer bytes, then nothing (a case ends when its
/// input does), or a seeded generator (xorshift64*) that never runs dry.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    bytes: &'a [u8],
    at: usize,
    rng: Option<u64>,
}

impl<'a> Input<'a> {
    /// Choices from fuzzer bytes.
    pub fn from_bytes(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            at: 0,
            rng: None,
        }
    }

    /// Endless choices from a seed.
    pub fn from_seed(seed: u64) -> Input<'static> {
        Input {
            bytes: &[],
            at: 0,
            rng: Some(seed | 1),
        }
    }

    /// Whether fuzzer bytes have run out (never, for a seed).
    pub fn exhausted(&self) -> bool {
        self.rng.is_none() && self.at >= self.bytes.len()
    }

    /// The next 64 bits of choice (zero once fuzzer bytes have run out).
    pub fn u64(&mut self) -> u64 {
        if let Some(s) = &mut self.rng {
            *s ^= *s >> 12;
            *s ^= *s << 25;
            *s ^= *s >> 27;
            return s.wrapping_mul(0x2545_f491_4f6c_dd1d);
        }
        let mut w = [0u8; 8];
        let from = self.at.min(self.bytes.len());
        let n = (self.bytes.len() - from).min(8);
        w[..n].copy_from_slice(&self.bytes[from..from + n]);
        self.at = from + n.max(1);
        u64::from_le_bytes(w)
    }

    /// A choice in `0..n` (0 for `n == 0`). Fuzzer bytes give one byte per small
    /// choice, so that libFuzzer's byte mutations map onto single decisions.
    pub fn below(&mut self, n: u64) -> u64 {
        if n <= 256 && self.rng.is_none() {
            let b = self.bytes.get(self.at).copied().unwrap_or(0);
            self.at += 1;
            return u64::from(b) % n.max(1);
        }
        self.u64() % n.max(1)
    }

    /// One of `xs`.
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }

    /// A coin.
    pub fn coin(&mut self) -> bool {
        self.below(2) == 1
    }
}
