//! Software prefetch for decode's weight streams.
//!
//! A decode step reads each weight row once, front to back, so its speed is how fast each
//! thread streams memory. On the 16-core Intel host (Xeon, family 6 model 207) the hardware
//! prefetchers left 16 threads at 92–106 GB/s on a 256 MiB Q4_K matvec; asking for the bytes
//! 1 KiB ahead raised that to 119–128 GB/s (docs/perf.md, "Decode at 16 threads: software
//! prefetch"). On Zen 4 the same prefetch made one thread slower (21.5–23.7 → 16.6–20.2
//! GB/s): its prefetchers already keep up, and the extra instructions cost. So the distance is
//! chosen per CPU vendor, and `MOESHARD_PREFETCH=BYTES` (0 = off) overrides it.

use std::ops::Range;
use std::sync::OnceLock;

/// Intel's default distance: 512 B and 2 KiB measured slower at 16 threads.
const INTEL_DISTANCE: usize = 1024;

/// Bytes ahead of the row being computed that a decode stream prefetches; 0 means none.
pub fn stream_distance() -> usize {
    static DISTANCE: OnceLock<usize> = OnceLock::new();
    *DISTANCE.get_or_init(|| {
        match std::env::var("MOESHARD_PREFETCH")
            .ok()
            .and_then(|v| v.trim().parse().ok())
        {
            Some(d) => d,
            None if is_intel() => INTEL_DISTANCE,
            None => 0,
        }
    })
}

#[cfg(target_arch = "x86_64")]
fn is_intel() -> bool {
    // CPUID leaf 0 exists on every x86-64 processor.
    let id = std::arch::x86_64::__cpuid(0);
    // "GenuineIntel" spread over EBX, EDX, ECX.
    (id.ebx, id.edx, id.ecx) == (0x756e_6547, 0x4965_6e69, 0x6c65_746e)
}

#[cfg(not(target_arch = "x86_64"))]
fn is_intel() -> bool {
    false
}

/// The distance a panel call over `n` tokens prefetches with: only decode (one token) streams
/// its rows once; batches reuse them from cache. (Only the x86 panels prefetch.)
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn decode_distance(n: usize) -> usize {
    if n == 1 { stream_distance() } else { 0 }
}

/// Asks for the cache lines of `bytes` bytes from `start` into L1. Addresses need not be
/// valid: a prefetch never faults, and the pointer is only formed with wrapping arithmetic.
#[inline]
pub fn prefetch(start: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let mut offset = 0;
        while offset < bytes {
            // SAFETY: `prefetch` is a hint; it reads nothing architecturally and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset) as *const i8) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, bytes);
}

/// The bytes to ask for before computing rows `r0..r0 + rows` of a block of `total_rows` rows
/// (`stride` bytes apart, offsets from the block's first row): the rows' bytes `distance`
/// ahead, and at `r0 == 0` also the block's first `distance` bytes, the head of the stream.
/// Never past the block's last row: the rest of a matrix belongs to other threads' tasks.
fn ranges_ahead(
    r0: usize,
    rows: usize,
    stride: usize,
    total_rows: usize,
    distance: usize,
) -> [Range<usize>; 2] {
    let end = total_rows * stride;
    let clip = |from: usize, to: usize| from.min(end)..to.min(end);
    if distance == 0 {
        return [0..0, 0..0];
    }
    let at = r0 * stride;
    let head = if r0 == 0 { clip(0, distance) } else { 0..0 };
    [head, clip(at + distance, at + distance + rows * stride)]
}

/// Prefetches what [`ranges_ahead`] names, for a block of rows starting at `base`.
#[inline(always)]
pub(crate) fn rows_ahead(
    base: *const u8,
    r0: usize,
    rows: usize,
    stride: usize,
    total_rows: usize,
    distance: usize,
) {
    if distance == 0 {
        return;
    }
    for r in ranges_ahead(r0, rows, stride, total_rows, distance) {
        prefetch(base.wrapping_add(r.start), r.len());
    }
}

/// [`rows_ahead`] for a panel kernel's single-token row loop: the panel's rows are one task's.
/// (The x86 panels call it; the NEON ones do not prefetch.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn panel_rows_ahead(p: &crate::panel::Panel, r0: usize, rows: usize, distance: usize) {
    rows_ahead(p.w, r0, rows, p.w_stride, p.rows, distance);
}

#[cfg(test)]
mod tests {
    use super::ranges_ahead;

    #[test]
    fn the_stream_is_asked_for_ahead_and_never_past_its_block() {
        // Q4_K rows of 2048 columns, 128 rows, 1 KiB ahead.
        assert_eq!(ranges_ahead(0, 1, 1152, 128, 1024), [0..1024, 1024..2176]);
        assert_eq!(ranges_ahead(5, 1, 1152, 128, 1024), [0..0, 6784..7936]);
        // The last rows: nothing beyond row 128 (which ends at byte 147456).
        assert_eq!(
            ranges_ahead(126, 1, 1152, 128, 1024),
            [0..0, 146176..147328]
        );
        assert_eq!(
            ranges_ahead(127, 1, 1152, 128, 1024),
            [0..0, 147328..147456]
        );
        assert_eq!(
            ranges_ahead(127, 4, 1152, 128, 1024),
            [0..0, 147328..147456]
        );
        // A block shorter than the distance.
        assert_eq!(ranges_ahead(0, 1, 288, 2, 1024), [0..576, 576..576]);
        // Off.
        assert_eq!(ranges_ahead(3, 1, 1152, 128, 0), [0..0, 0..0]);
    }
}
