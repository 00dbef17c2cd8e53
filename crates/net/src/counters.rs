//! Counters by reason, and a uniform way for every component to report its counters.
//!
//! A component that drops or refuses things for several reasons keeps a [`PerReason`]
//! indexed by its reason enum, never a bare array indexed by hand. Every stats type
//! implements [`CounterSet`], so a report walks any component's counters without copying
//! them by name.

use std::fmt;
use std::marker::PhantomData;

/// Reasons a counter set may have for one kind of drop.
pub const MAX_REASONS: usize = 16;

/// An enum of reasons, each with its counter.
pub trait Reason: Copy + fmt::Debug + 'static {
    /// Every reason, in counter order.
    const ALL: &'static [Self];
    /// Its position in [`Reason::ALL`].
    fn index(self) -> usize;
}

/// Implements [`Reason`] for a field-less enum with an inherent `ALL` list in
/// declaration order (checked by [`check_reason_order`] in its tests).
#[macro_export]
macro_rules! reason {
    ($t:ty) => {
        impl $crate::counters::Reason for $t {
            const ALL: &'static [Self] = &<$t>::ALL;
            #[inline]
            fn index(self) -> usize {
                self as usize
            }
        }
        const _: () = assert!(<$t>::ALL.len() <= $crate::counters::MAX_REASONS);
    };
}

/// Panics unless every reason's index is its place in `ALL` (the order the counters are
/// reported in).
pub fn check_reason_order<R: Reason>() {
    for (i, r) in R::ALL.iter().enumerate() {
        assert_eq!(r.index(), i, "{r:?}");
    }
}

/// One counter per reason.
#[derive(Clone, PartialEq, Eq)]
pub struct PerReason<R: Reason> {
    counts: [u64; MAX_REASONS],
    _reason: PhantomData<R>,
}

impl<R: Reason> Default for PerReason<R> {
    fn default() -> Self {
        Self {
            counts: [0; MAX_REASONS],
            _reason: PhantomData,
        }
    }
}

impl<R: Reason> PerReason<R> {
    /// Counts one.
    #[inline]
    pub fn add(&mut self, r: R) {
        self.add_n(r, 1);
    }
    /// Counts `n`.
    #[inline]
    pub fn add_n(&mut self, r: R, n: u64) {
        self.counts[r.index()] += n;
    }
    /// The count for `r`.
    #[inline]
    pub fn get(&self, r: R) -> u64 {
        self.counts[r.index()]
    }
    /// All reasons together.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }
    /// Each reason with its count, in counter order.
    pub fn iter(&self) -> impl Iterator<Item = (R, u64)> + '_ {
        R::ALL.iter().map(|&r| (r, self.get(r)))
    }
}

impl<R: Reason> fmt::Debug for PerReason<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.iter().filter(|e| e.1 > 0))
            .finish()
    }
}

/// A component's counters, walked by name.
pub trait CounterSet {
    /// Calls `f` with each counter's name and value; a per-reason counter gives one
    /// entry per reason, named `<field> <Reason>`.
    fn visit(&self, f: &mut dyn FnMut(&str, u64));
}

/// One field of a counter set: a plain count or counts by reason.
pub trait CounterField {
    /// Calls `f` for this field, named `name`.
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, u64));
}

impl CounterField for u64 {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, u64)) {
        f(name, *self);
    }
}

impl<R: Reason> CounterField for PerReason<R> {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, u64)) {
        for (r, n) in self.iter() {
            f(&format!("{name} {r:?}"), n);
        }
    }
}

/// Implements [`CounterSet`] for a stats struct by listing its counter fields.
#[macro_export]
macro_rules! counter_set {
    ($t:ty { $($field:ident),* $(,)? }) => {
        impl $crate::counters::CounterSet for $t {
            fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
                $( $crate::counters::CounterField::visit_field(&self.$field, stringify!($field), f); )*
            }
        }
    };
}

/// How a copy's source and destination line up, the classes of paper 000's Figure 4:
/// the same offset within a cache line, the same offset within a 64-bit word only, or
/// neither. Copies are counted in bytes per class, so a long misaligned copy weighs
/// more than a short one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyAlign {
    /// Source and destination at the same offset in a 64-byte cache line.
    Line,
    /// At the same offset in an 8-byte word, different ones in a cache line.
    Word,
    /// At different offsets in a word.
    Unaligned,
}

impl CopyAlign {
    /// Every class, in counter order.
    pub const ALL: [CopyAlign; 3] = [CopyAlign::Line, CopyAlign::Word, CopyAlign::Unaligned];

    /// The class of a copy from byte offset `src` to byte offset `dst` (in pages, or any
    /// frame of reference aligned to a cache line).
    #[inline]
    pub fn of(src: usize, dst: usize) -> Self {
        let rel = dst.wrapping_sub(src) & 63;
        if rel == 0 {
            CopyAlign::Line
        } else if rel & 7 == 0 {
            CopyAlign::Word
        } else {
            CopyAlign::Unaligned
        }
    }
}
crate::reason!(CopyAlign);

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Why {
        A,
        B,
        C,
    }
    impl Why {
        const ALL: [Why; 3] = [Why::A, Why::B, Why::C];
    }
    crate::reason!(Why);

    #[derive(Default)]
    struct Stats {
        packets: u64,
        drops: PerReason<Why>,
    }
    crate::counter_set!(Stats { packets, drops });

    #[test]
    fn counts_by_reason_and_walks_every_counter_by_name() {
        check_reason_order::<Why>();
        let mut s = Stats {
            packets: 7,
            ..Stats::default()
        };
        s.drops.add(Why::B);
        s.drops.add_n(Why::C, 2);
        assert_eq!((s.drops.get(Why::A), s.drops.get(Why::B)), (0, 1));
        assert_eq!(s.drops.total(), 3);
        let mut seen = Vec::new();
        s.visit(&mut |n, v| seen.push((n.to_string(), v)));
        let want = [
            ("packets", 7),
            ("drops A", 0),
            ("drops B", 1),
            ("drops C", 2),
        ];
        assert_eq!(seen, want.map(|(n, v)| (n.to_string(), v)).to_vec());
        assert_eq!(format!("{:?}", s.drops), "{B: 1, C: 2}");
    }

    #[test]
    fn a_copy_is_classed_by_its_relative_offset_within_a_cache_line() {
        // netback's original copy: a frame at 66 (NET_SKB_PAD + NET_IP_ALIGN) to 0.
        assert_eq!(CopyAlign::of(66, 0), CopyAlign::Unaligned);
        assert_eq!(CopyAlign::of(66, 2), CopyAlign::Line);
        assert_eq!(CopyAlign::of(2114, 2), CopyAlign::Line);
        assert_eq!(CopyAlign::of(64, 8), CopyAlign::Word);
        assert_eq!(CopyAlign::of(8, 64), CopyAlign::Word);
        assert_eq!(CopyAlign::of(0, 4096), CopyAlign::Line);
        assert_eq!(CopyAlign::of(1, 0), CopyAlign::Unaligned);
    }

    #[test]
    fn every_reason_enum_counts_in_its_declared_order() {
        check_reason_order::<crate::stack::RxDrop>();
        check_reason_order::<crate::reasm::ReasmDrop>();
        check_reason_order::<crate::bridge::BridgeDrop>();
        check_reason_order::<crate::netif::TxDrop>();
        check_reason_order::<crate::netif::TxFatal>();
        check_reason_order::<crate::netif::RxError>();
        check_reason_order::<CopyAlign>();
    }
}
