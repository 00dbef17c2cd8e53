//! Moving bytes to and from memory that another domain may be writing at the same
//! moment.
//!
//! Every frame in [`crate::MachineMemory`] can be shared: a grant, a ring, a buffer the
//! NIC writes by DMA, or a page a hostile guest rewrites while the hypervisor copies
//! it. In Rust's memory model (C++'s) two accesses to the same bytes from two threads,
//! one of them a write, not ordered by synchronisation, are a data race, and a data
//! race between non-atomic accesses is undefined behaviour, whatever the bytes are used
//! for afterwards. A plain `memcpy` of guest memory is such an access.
//!
//! pvio therefore moves shared bytes with *byte-wise atomic* copies (C++'s proposed
//! `atomic_load_per_byte_memcpy`, P1478): each byte is a relaxed atomic load and a
//! relaxed atomic store. A racing writer makes the copy return some mix of old and new
//! bytes (torn, which copy-then-validate already expects), never undefined behaviour.
//! On x86-64 the copy is a string move in inline assembly: x86 loads and stores never
//! tear a byte (and are single-copy atomic whole when aligned), and an `asm!` block is
//! defined as the machine operations it performs, so it is exactly the per-byte atomic
//! copy, at `memcpy` speed for the sizes that matter. On a processor with ERMS (enhanced
//! `rep movsb`) it is one `rep movsb`, which such a processor moves in wide chunks at
//! any length. Without ERMS, a copy of [`WORDS_FROM`] bytes or more moves its 8-byte
//! words with `rep movsq` and the rest with `rep movsb`, as Linux's and glibc's copies
//! choose there: `rep movsb` is then a byte a step (as it is under an emulator such as
//! QEMU's TCG told not to offer ERMS). See `docs/ARCHITECTURE.md` for the cost and the alternatives measured
//! (volatile words as in rust-vmm's `vm-memory`, relaxed `AtomicU64` words). Elsewhere
//! it is a loop of relaxed `AtomicU8` operations.
//!
//! What remains outside the model: an access by these copies and an `AtomicU16/32/64`
//! operation (a ring index) that race on the same bytes are a mixed-size race, which
//! Rust leaves undefined. pvio's own code never does this (ring indices are only ever
//! touched as atomics of their size); only a guest that grants its ring page for data
//! could provoke it, and the machine operations involved are the same well-defined
//! byte and word moves either way.

use bytemuck::Pod;

/// Asks the processor to start fetching the cache line at `p` into this core's cache,
/// for reading or, with `write`, for writing (`prefetchw`: the line arrives owned, so
/// a store to it later does not wait for the other core's copy to be invalidated).
/// A hint only: it reads and writes nothing and cannot fault, whatever `p` is.
#[inline]
pub(crate) fn prefetch(p: *const u8, write: bool) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 and PREFETCHW only hint the cache hierarchy: they access no
    // memory architecturally, never fault (even on an unmapped address) and change no
    // register or flag. PREFETCHW executes as a NOP on a processor without it.
    unsafe {
        if write {
            std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
        } else {
            std::arch::asm!("prefetcht0 [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, write);
}

/// On a processor without ERMS, forward copies of at least this many bytes move 8-byte
/// words (`rep movsq`), then the last bytes; shorter ones, and overlapping backward
/// ones, move bytes.
pub(crate) const WORDS_FROM: usize = 256;

/// Whether `rep movsb` is the fast way to move many bytes here (ERMS, `cpuid` leaf 7).
/// Measured on a processor with it (`bench core`, quick, with a build that always took
/// the words; no command here forces them): words then bytes cost 1.20× (1500 B) and
/// 1.14× (4096 B) one `rep movsb`.
#[cfg(target_arch = "x86_64")]
#[inline]
fn bytes_are_fast() -> bool {
    std::arch::is_x86_feature_detected!("ermsb")
}

/// Copies `len` bytes from `src` to `dst` as byte-wise relaxed atomics. Overlapping
/// ranges (a grant copy inside one frame) are copied as `memmove` does.
///
/// # Safety
/// `src..src+len` must be valid for reads and `dst..dst+len` for writes, for the whole
/// call; other threads may read and write them meanwhile.
#[inline]
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    let words = len >= WORDS_FROM && !bytes_are_fast();
    #[cfg(not(target_arch = "x86_64"))]
    let words = false;
    // SAFETY: the caller's guarantee, passed on.
    unsafe { copy_as(src, dst, len, words) }
}

/// [`copy`], moving 8-byte words first if `words` (and the copy runs forward).
///
/// # Safety
/// As [`copy`].
#[inline]
unsafe fn copy_as(src: *const u8, dst: *mut u8, len: usize, words: bool) {
    let backward = (dst as usize) > (src as usize) && (dst as usize) < (src as usize) + len;
    #[cfg(target_arch = "x86_64")]
    {
        if backward {
            // SAFETY: the caller guarantees both ranges. The copy runs from the last
            // byte down with the direction flag set, and clears it again, as the
            // `asm!` rules require on exit.
            unsafe {
                std::arch::asm!(
                    "std",
                    "rep movsb",
                    "cld",
                    inout("rcx") len => _,
                    inout("rsi") src.add(len).wrapping_sub(1) => _,
                    inout("rdi") dst.add(len).wrapping_sub(1) => _,
                    options(nostack),
                );
            }
        } else if words {
            // SAFETY: the caller guarantees both ranges; the direction flag is clear
            // on entry (an `asm!` rule), so both moves run forward: `len / 8` words,
            // then, from where they left `rsi` and `rdi`, the `len % 8` bytes left. A
            // forward move reads each byte before any later byte is written, so an
            // overlap with `dst` below `src` is moved as `memmove` moves it, by words
            // as by bytes.
            unsafe {
                std::arch::asm!(
                    "rep movsq",
                    "mov rcx, {tail}",
                    "rep movsb",
                    tail = in(reg) len % 8,
                    inout("rcx") len / 8 => _,
                    inout("rsi") src => _,
                    inout("rdi") dst => _,
                    options(nostack, preserves_flags),
                );
            }
        } else {
            // SAFETY: the caller guarantees both ranges; the direction flag is clear
            // on entry (an `asm!` rule), so the copy runs forward.
            unsafe {
                std::arch::asm!(
                    "rep movsb",
                    inout("rcx") len => _,
                    inout("rsi") src => _,
                    inout("rdi") dst => _,
                    options(nostack, preserves_flags),
                );
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
        let one = |i: usize| {
            // SAFETY: `i < len`, inside both ranges the caller guarantees; `AtomicU8`
            // has alignment 1.
            unsafe {
                let b = AtomicU8::from_ptr(src.add(i).cast_mut()).load(Relaxed);
                AtomicU8::from_ptr(dst.add(i)).store(b, Relaxed);
            }
        };
        if backward {
            (0..len).rev().for_each(one);
        } else {
            (0..len).for_each(one);
        }
    }
}

/// Sets `len` bytes at `dst` to `byte` as byte-wise relaxed atomic stores.
///
/// # Safety
/// `dst..dst+len` must be valid for writes for the whole call.
#[inline]
pub(crate) unsafe fn fill(dst: *mut u8, byte: u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller guarantees the range; the direction flag is clear on entry.
    unsafe {
        std::arch::asm!(
            "rep stosb",
            inout("rcx") len => _,
            inout("rdi") dst => _,
            in("al") byte,
            options(nostack, preserves_flags),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    for i in 0..len {
        // SAFETY: `i < len`, inside the caller's range.
        unsafe { std::sync::atomic::AtomicU8::from_ptr(dst.add(i)) }
            .store(byte, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Reads a plain-old-data value out of shared memory as relaxed atomic loads of one
/// width: the widest of 8, 4, 2, 1 bytes that divides both the address and the size.
/// The width depends only on the address and the type, so a reader and a writer of the
/// same object (a ring slot) make accesses of equal size to the same bytes, as the model
/// requires; a 12-byte slot costs three loads and an 8-byte aligned one a single load.
///
/// # Safety
/// `src..src+size_of::<T>()` must be valid for reads.
#[inline]
pub(crate) unsafe fn read_obj<T: Pod>(src: *const u8) -> T {
    let mut v = T::zeroed();
    let out = (&mut v as *mut T).cast::<u8>();
    let n = size_of::<T>();
    // SAFETY: the caller guarantees the source range, `width` divides the
    // address and the size, and `out` is `v`'s bytes, private to this call.
    unsafe {
        match width(src as usize, n) {
            8 => gather::<8>(src, out, n),
            4 => gather::<4>(src, out, n),
            2 => gather::<2>(src, out, n),
            _ => gather::<1>(src, out, n),
        }
    }
    v
}

/// Writes a plain-old-data value into shared memory, in the accesses [`read_obj`] uses.
///
/// # Safety
/// `dst..dst+size_of::<T>()` must be valid for writes.
#[inline]
pub(crate) unsafe fn write_obj<T: Pod>(dst: *mut u8, v: &T) {
    let b = (v as *const T).cast::<u8>();
    let n = size_of::<T>();
    // SAFETY: as in `read_obj`, with the direction reversed; `b` is the
    // caller's value.
    unsafe {
        match width(dst as usize, n) {
            8 => scatter::<8>(b, dst, n),
            4 => scatter::<4>(b, dst, n),
            2 => scatter::<2>(b, dst, n),
            _ => scatter::<1>(b, dst, n),
        }
    }
}

/// The widest of 8, 4, 2, 1 that divides both `addr` and `len`.
#[inline(always)]
fn width(addr: usize, len: usize) -> usize {
    let m = addr | len | 8;
    // The lowest set bit of `m`: the largest power of two (at most 8) dividing both.
    m & m.wrapping_neg()
}

/// Loads `n` bytes at `src` as relaxed atomics of `K` bytes, gathering them into 8-byte
/// words in registers and storing each word to `out` whole: storing the pieces one by
/// one and reading the value back as wider words defeated store forwarding (3.6 ns
/// against 0.8 ns for a 12-byte slot).
///
/// # Safety
/// `src..src+n` valid for reads and `K`-aligned, `K` divides `n`, `out..out+n` valid
/// for writes and not shared.
#[inline(always)]
unsafe fn gather<const K: usize>(src: *const u8, out: *mut u8, n: usize) {
    for at in (0..n).step_by(8) {
        let m = (n - at).min(8);
        let mut word = 0u64;
        for j in (0..m).step_by(K) {
            // SAFETY: inside the caller's range, `K`-aligned.
            word |= unsafe { load(src.add(at + j), K) } << (8 * j);
        }
        // SAFETY: `out + at .. + m` is inside the caller's private range.
        unsafe { std::ptr::copy_nonoverlapping(word.to_le_bytes().as_ptr(), out.add(at), m) };
    }
}

/// Stores `n` bytes from `b` to `dst` as relaxed atomics of `K` bytes; the mirror of
/// [`gather`].
///
/// # Safety
/// `dst..dst+n` valid for writes and `K`-aligned, `K` divides `n`, `b..b+n` valid for
/// reads.
#[inline(always)]
unsafe fn scatter<const K: usize>(b: *const u8, dst: *mut u8, n: usize) {
    for at in (0..n).step_by(8) {
        let m = (n - at).min(8);
        let mut x = [0u8; 8];
        // SAFETY: `b + at .. + m` is inside the caller's value.
        unsafe { std::ptr::copy_nonoverlapping(b.add(at), x.as_mut_ptr(), m) };
        let word = u64::from_le_bytes(x);
        for j in (0..m).step_by(K) {
            // SAFETY: inside the caller's range, `K`-aligned.
            unsafe { store(dst.add(at + j), K, word >> (8 * j)) };
        }
    }
}

/// One relaxed atomic load of `k` (8, 4, 2 or 1) bytes at `p`, zero-extended.
///
/// # Safety
/// `p..p+k` must be valid for reads and `k`-aligned.
#[inline(always)]
unsafe fn load(p: *const u8, k: usize) -> u64 {
    use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
    let p = p.cast_mut();
    match k {
        // SAFETY: the caller guarantees `p..p+8` valid and 8-aligned, as `from_ptr` needs.
        8 => unsafe { AtomicU64::from_ptr(p.cast()) }.load(Relaxed),
        // SAFETY: as above, 4 bytes.
        4 => unsafe { AtomicU32::from_ptr(p.cast()) }
            .load(Relaxed)
            .into(),
        // SAFETY: as above, 2 bytes.
        2 => unsafe { AtomicU16::from_ptr(p.cast()) }
            .load(Relaxed)
            .into(),
        // SAFETY: as above, 1 byte.
        _ => unsafe { AtomicU8::from_ptr(p) }.load(Relaxed).into(),
    }
}

/// One relaxed atomic store of the low `k` (8, 4, 2 or 1) bytes of `w` to `p`.
///
/// # Safety
/// `p..p+k` must be valid for writes and `k`-aligned.
#[inline(always)]
unsafe fn store(p: *mut u8, k: usize, w: u64) {
    use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
    match k {
        // SAFETY: the caller guarantees `p..p+8` valid and 8-aligned, as `from_ptr` needs.
        8 => unsafe { AtomicU64::from_ptr(p.cast()) }.store(w, Relaxed),
        // SAFETY: as above, 4 bytes.
        4 => unsafe { AtomicU32::from_ptr(p.cast()) }.store(w as u32, Relaxed),
        // SAFETY: as above, 2 bytes.
        2 => unsafe { AtomicU16::from_ptr(p.cast()) }.store(w as u16, Relaxed),
        // SAFETY: as above, 1 byte.
        _ => unsafe { AtomicU8::from_ptr(p) }.store(w as u8, Relaxed),
    }
}

/// Copies `data` to `dst` with non-temporal stores only, then a store fence, so that the
/// data is globally visible before whatever the caller publishes next: a NIC's DMA
/// write, which lands in memory and not in this core's cache.
///
/// Whole 8-byte words go by `movnti`; the unaligned head and tail go by one masked
/// 16-byte non-temporal store each (`maskmovdqu`, the byte enables of a partial DMA
/// write). No line gets both cached and non-temporal stores: on this machine a frame
/// written so at an offset of 2 cost four times one written with a cached head.
///
/// # Safety
/// `dst..dst+data.len()` must be valid for writes.
pub(crate) unsafe fn stream(dst: *mut u8, data: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        let len = data.len();
        let mut i = 0;
        let lane = dst as usize & 15;
        if lane != 0 && len > 0 {
            i = (16 - lane).min(len);
            // SAFETY: the bytes written are `dst..dst+i`, inside the caller's range.
            unsafe { stream_masked(dst, &data[..i]) };
        }
        while i + 8 <= len {
            let word = u64::from_le_bytes(data[i..i + 8].try_into().unwrap_or([0; 8]));
            // SAFETY: `dst + i` is 8-aligned (past the head) and `i + 8 <= len`.
            unsafe {
                std::arch::asm!(
                    "movnti [{p}], {w}",
                    p = in(reg) dst.add(i),
                    w = in(reg) word,
                    options(nostack, preserves_flags),
                );
            }
            i += 8;
        }
        if i < len {
            // SAFETY: the bytes written are `dst+i..dst+len`, inside the caller's range.
            unsafe { stream_masked(dst.add(i), &data[i..]) };
        }
        // SAFETY: sfence has no memory-safety preconditions; it orders the streaming
        // stores before later stores (the descriptor write-back that publishes them).
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller guarantees the destination range.
    unsafe {
        copy(data.as_ptr(), dst, data.len())
    }
}

/// Stores the 8-byte word `v` at `dst` with one non-temporal store (`movnti`), fenced on
/// both sides: the stores before it, streaming or not, are globally visible first, and
/// it is before whatever comes after. A NIC's last write of a descriptor, whose status
/// announces the writes before it.
///
/// # Safety
/// `dst..dst+8` must be valid for writes and 8-aligned.
pub(crate) unsafe fn stream_word(dst: *mut u8, v: u64) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller guarantees `dst..dst+8` valid and 8-aligned, so the one
    // `movnti` writes exactly those bytes, whole (an aligned 8-byte store is
    // single-copy atomic); `sfence` has no memory-safety preconditions.
    unsafe {
        std::arch::asm!(
            "sfence",
            "movnti [{p}], {w}",
            "sfence",
            p = in(reg) dst,
            w = in(reg) v,
            options(nostack, preserves_flags),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: as above; the word is 8-aligned as `AtomicU64` needs.
    unsafe {
        std::sync::atomic::AtomicU64::from_ptr(dst.cast())
            .store(v, std::sync::atomic::Ordering::Release)
    }
}

/// Writes `bytes` (at most up to the next 16-byte boundary) at `dst` with one masked
/// non-temporal store of the 16-byte block that holds them.
///
/// # Safety
/// `dst..dst+bytes.len()` must be valid for writes and inside one 16-byte block.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn stream_masked(dst: *mut u8, bytes: &[u8]) {
    use std::arch::x86_64::{_mm_loadu_si128, _mm_maskmoveu_si128};
    let lane = dst as usize & 15;
    debug_assert!(lane + bytes.len() <= 16);
    let (mut v, mut m) = ([0u8; 16], [0u8; 16]);
    v[lane..lane + bytes.len()].copy_from_slice(bytes);
    m[lane..lane + bytes.len()].fill(0x80);
    // SAFETY: SSE2 is part of x86_64. The store writes only the bytes whose mask bit is
    // set, `dst..dst+len`, which the caller guarantees; the block's other bytes are not
    // accessed, and the block lies in the same page as them, so it cannot fault.
    unsafe {
        _mm_maskmoveu_si128(
            _mm_loadu_si128(v.as_ptr().cast()),
            _mm_loadu_si128(m.as_ptr().cast()),
            dst.sub(lane).cast(),
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_match_memmove_for_every_overlap() {
        // Both sides of `WORDS_FROM`, and word moves with every tail length.
        let lens = [
            0usize, 1, 7, 8, 63, 64, 255, 256, 257, 263, 1500, 4096, 4099,
        ];
        for len in lens {
            for shift in [-9isize, -8, -7, -1, 0, 1, 7, 8, 9, 2000, 5000] {
                let mut a: Vec<u8> = (0..16384u32).map(|i| (i * 7 + 3) as u8).collect();
                let mut b = a.clone();
                let (s, d) = (1024usize, (1024 + shift) as usize);
                b.copy_within(s..s + len, d);
                let p = a.as_mut_ptr();
                // SAFETY: both ranges are inside `a`.
                unsafe { copy(p.add(s), p.add(d), len) };
                assert_eq!(a, b, "len {len} shift {shift}");
                // The other way too: words then bytes, or bytes alone, whichever this
                // processor's copy did not take.
                let mut w: Vec<u8> = (0..16384u32).map(|i| (i * 7 + 3) as u8).collect();
                let p = w.as_mut_ptr();
                // SAFETY: as above.
                unsafe {
                    copy_as(
                        p.add(s),
                        p.add(d),
                        len,
                        len >= WORDS_FROM && bytes_are_fast(),
                    )
                };
                assert_eq!(w, b, "len {len} shift {shift}, the other way");
            }
        }
    }

    #[test]
    fn objects_round_trip_at_every_alignment() {
        #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(C)]
        struct Slot([u8; 12]);
        let v = Slot(*b"abcdefghijkl");
        for off in 0..16 {
            let mut a = [0u8; 64];
            // SAFETY: `off + 12 <= 64`, inside `a`.
            unsafe { write_obj(a.as_mut_ptr().add(off), &v) };
            assert_eq!(&a[off..off + 12], b"abcdefghijkl");
            assert!(a[..off].iter().chain(&a[off + 12..]).all(|&b| b == 0));
            // SAFETY: as above.
            assert_eq!(unsafe { read_obj::<Slot>(a.as_ptr().add(off)) }, v);
        }
    }

    #[test]
    fn fill_and_stream_write_exactly_their_range() {
        let mut a = vec![0xaau8; 256];
        // SAFETY: inside `a`.
        unsafe { fill(a.as_mut_ptr().add(3), 0x55, 100) };
        assert!(a[..3].iter().all(|&b| b == 0xaa));
        assert!(a[3..103].iter().all(|&b| b == 0x55));
        assert!(a[103..].iter().all(|&b| b == 0xaa));
        let data: Vec<u8> = (0..77u8).collect();
        // SAFETY: inside `a`.
        unsafe { stream(a.as_mut_ptr().add(5), &data) };
        assert_eq!(&a[5..82], &data[..]);
        assert_eq!(a[4], 0x55);
        assert_eq!(a[82], 0x55);
    }

    #[test]
    fn streaming_writes_every_byte_of_its_range_and_no_other_at_any_alignment() {
        let data: Vec<u8> = (0..200u32).map(|i| (i * 13 + 1) as u8).collect();
        for off in 0..32 {
            for len in [0usize, 1, 2, 7, 8, 9, 15, 16, 17, 30, 64, 66, 127, 200] {
                let mut a = vec![0xeeu8; 256];
                // SAFETY: `off + len <= 232`, inside `a`.
                unsafe { stream(a.as_mut_ptr().add(off), &data[..len]) };
                assert_eq!(&a[off..off + len], &data[..len], "off {off} len {len}");
                assert!(
                    a[..off].iter().chain(&a[off + len..]).all(|&b| b == 0xee),
                    "off {off} len {len}: a byte outside the range changed"
                );
            }
        }
    }
}
