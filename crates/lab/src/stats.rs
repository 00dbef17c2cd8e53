//! Summaries of repeated measurements.

use serde::{Deserialize, Serialize};

/// Median, spread and tail of a set of samples.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Stats {
    /// Number of samples.
    pub n: usize,
    /// Median.
    #[serde(deserialize_with = "crate::report::nan::f64")]
    pub median: f64,
    /// Smallest.
    #[serde(deserialize_with = "crate::report::nan::f64")]
    pub min: f64,
    /// Largest.
    #[serde(deserialize_with = "crate::report::nan::f64")]
    pub max: f64,
    /// 99th percentile (nearest rank).
    #[serde(deserialize_with = "crate::report::nan::f64")]
    pub p99: f64,
}

impl Stats {
    /// Summarises `samples` (empty gives all zeros).
    pub fn of(samples: &[f64]) -> Self {
        if samples.is_empty() {
            return Self {
                n: 0,
                median: 0.0,
                min: 0.0,
                max: 0.0,
                p99: 0.0,
            };
        }
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        // Nearest-rank percentile: ceil(0.99 n)-th smallest.
        let rank = ((0.99 * n as f64).ceil() as usize).clamp(1, n);
        Self {
            n,
            median,
            min: v[0],
            max: v[n - 1],
            p99: v[rank - 1],
        }
    }
}

/// Median of per-iteration ratios `num[i] / den[i]` (ratios taken within one
/// iteration, so that machine noise common to both cancels).
pub fn ratio_median(num: &[f64], den: &[f64]) -> Option<f64> {
    let r: Vec<f64> = num
        .iter()
        .zip(den)
        .filter(|(_, d)| **d > 0.0)
        .map(|(n, d)| n / d)
        .collect();
    (!r.is_empty()).then(|| Stats::of(&r).median)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_min_max_and_p99() {
        let s = Stats::of(&[5.0, 1.0, 3.0]);
        assert_eq!((s.median, s.min, s.max, s.n), (3.0, 1.0, 5.0, 3));
        assert_eq!(Stats::of(&[1.0, 2.0, 3.0, 4.0]).median, 2.5);
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(Stats::of(&v).p99, 198.0);
        assert_eq!(ratio_median(&[2.0, 4.0, 9.0], &[1.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(ratio_median(&[1.0], &[0.0]), None);
    }
}
