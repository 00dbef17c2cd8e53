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

/// A component's counters, walked by name, and kept whole for code that reads them.
pub trait CounterSet {
    /// Calls `f` with each counter's name and value; a per-reason counter gives one
    /// entry per reason, named `<field> <Reason>`.
    fn visit(&self, f: &mut dyn FnMut(&str, u64));
    /// A copy of the set as it stands, for a reader that knows its type (a report
    /// reads `hits` off the grant cache's own stats, not a string). `None` for sets of
    /// live registers (atomics a device thread keeps counting), which are read by name.
    fn snapshot(&self) -> Option<std::sync::Arc<dyn std::any::Any + Send + Sync>> {
        None
    }
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

/// Implements [`CounterSet`] for a stats struct (`Clone`, plain counts) by listing its
/// counter fields.
#[macro_export]
macro_rules! counter_set {
    ($t:ty { $($field:ident),* $(,)? }) => {
        impl $crate::counters::CounterSet for $t {
            fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
                $( $crate::counters::CounterField::visit_field(&self.$field, stringify!($field), f); )*
            }
            fn snapshot(&self) -> Option<std::sync::Arc<dyn std::any::Any + Send + Sync>> {
                Some(std::sync::Arc::new(<$t as Clone>::clone(self)))
            }
        }
    };
}

/// Implements [`CounterSet`] for a struct of live registers (`AtomicU64` fields that a
/// device thread keeps counting) and declares `$snap`, the same counts as plain numbers:
/// `counts()` reads every register with a relaxed load, and that is the set's snapshot.
#[macro_export]
macro_rules! atomic_counter_set {
    ($t:ty => $snap:ident { $($field:ident),* $(,)? }) => {
        #[doc = concat!("The counts of [`", stringify!($t), "`], as they stood when read.")]
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[allow(missing_docs)]
        pub struct $snap {
            $( pub $field: u64, )*
        }
        impl $t {
            /// Every counter, as it stands now.
            pub fn counts(&self) -> $snap {
                $snap {
                    $( $field: self.$field.load(std::sync::atomic::Ordering::Relaxed), )*
                }
            }
        }
        impl $crate::counters::CounterSet for $t {
            fn visit(&self, f: &mut dyn FnMut(&str, u64)) {
                let s = self.counts();
                $( f(stringify!($field), s.$field); )*
            }
            fn snapshot(&self) -> Option<std::sync::Arc<dyn std::any::Any + Send + Sync>> {
                Some(std::sync::Arc::new(self.counts()))
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

    #[derive(Default, Clone)]
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
        // The snapshot is the set itself, by value: later counting does not move it.
        let snap = s.snapshot().expect("a plain set has a snapshot");
        s.packets += 1;
        let snap = snap.downcast_ref::<Stats>().expect("of its own type");
        assert_eq!((snap.packets, snap.drops.total()), (7, 3));
        assert_eq!(s.packets, 8);
    }

    #[derive(Debug, Default)]
    struct Regs {
        frames: std::sync::atomic::AtomicU64,
        drops: std::sync::atomic::AtomicU64,
    }
    crate::atomic_counter_set!(Regs => RegCounts { frames, drops });

    #[test]
    fn live_registers_are_walked_and_snapshot_as_plain_counts() {
        let r = Regs::default();
        r.frames.store(5, std::sync::atomic::Ordering::Relaxed);
        let mut seen = Vec::new();
        r.visit(&mut |n, v| seen.push((n.to_string(), v)));
        assert_eq!(seen, [("frames".to_string(), 5), ("drops".to_string(), 0)]);
        let snap = r.snapshot().expect("registers have a snapshot");
        r.frames.store(9, std::sync::atomic::Ordering::Relaxed);
        let c = snap
            .downcast_ref::<RegCounts>()
            .expect("of the counts' type");
        assert_eq!(
            *c,
            RegCounts {
                frames: 5,
                drops: 0
            }
        );
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
    fn copy_classes_count_in_their_declared_order() {
        check_reason_order::<CopyAlign>();
    }
}
