//! Software prefetch for decode's weight streams.
//!
//! A decode step reads each weight row once, front to back, so its speed is how fast each
//! thread streams memory. On the 16-core Intel host (Xeon, family 6 model 207) the hardware
//! prefetchers left 16 threads at 92–106 GB/s on a 256 MiB Q4_K matvec; asking for the bytes
//! 1 KiB ahead raised that to 119–128 GB/s (docs/perf.md, "Decode at 16 threads: software
//! prefetch"). On Zen 4 the same prefetch made one thread slower (21.5–23.7 → 16.6–20.2
//! GB/s): its prefetchers already keep up, and the extra instructions cost. On Zen 3 (EPYC,
//! family 25 model 1) 2 KiB ahead made two threads' decode 10–15 % faster (olmoe-7b-a1b tg32
//! 27.1–28.3 → 33.2–33.4 t/s, qwen3-30b-a3b 10.4–10.8 → 12.1–12.4; 1 KiB gave 30–32 and
//! 10.8–11.0, 4 KiB 32.4 and 11.6–11.9). So the distance is chosen per microarchitecture, as
//! measured, and `MOESHARD_PREFETCH=BYTES` (0 = off) overrides it.

use std::ops::Range;
use std::sync::OnceLock;

/// How a decode stream prefetches: `distance` bytes ahead of the row being computed (0: not
/// at all), in tasks whose rows span at most `max_block` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPrefetch {
    pub distance: usize,
    pub max_block: usize,
}

/// Intel's: 512 B and 2 KiB measured slower at 16 threads; a 256 MiB matvec gained.
const INTEL: StreamPrefetch = StreamPrefetch {
    distance: 1024,
    max_block: usize::MAX,
};
/// Zen 3's: 1 KiB and 4 KiB measured slower at 2 threads. Only short streams gain (a decode
/// task of a small expert matrix, ~300 KiB, starts cold); long ones lose to it (a 512 MiB Q6_K
/// matvec 26.5 → 22–24 GB/s, deepseek-v3-4l's 1–1.5 MiB dense and head tasks 10.5 → 9.0 t/s).
const ZEN3: StreamPrefetch = StreamPrefetch {
    distance: 2048,
    max_block: 512 * 1024,
};
const OFF: StreamPrefetch = StreamPrefetch {
    distance: 0,
    max_block: 0,
};

/// This machine's decode prefetch: `MOESHARD_PREFETCH=BYTES` (0 = off; any task size), else
/// the measured default for its microarchitecture.
pub fn stream_prefetch() -> StreamPrefetch {
    static CHOSEN: OnceLock<StreamPrefetch> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        match std::env::var("MOESHARD_PREFETCH")
            .ok()
            .and_then(|v| v.trim().parse().ok())
        {
            Some(distance) => StreamPrefetch {
                distance,
                max_block: usize::MAX,
            },
            None => cpu_id().map_or(OFF, default_prefetch),
        }
    })
}

/// Who made this CPU, and its family and model as CPUID reports them (extended fields added).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CpuId {
    intel: bool,
    amd: bool,
    family: u32,
    model: u32,
}

/// The measured default for a CPU: Intel's on Intel, Zen 3's on AMD family 25 models
/// 0x00–0x0F and 0x20–0x5F (Milan, Vermeer, Rembrandt, Cezanne), none elsewhere (Zen 4 measured
/// slower; the others unmeasured).
fn default_prefetch(cpu: CpuId) -> StreamPrefetch {
    let zen3 = cpu.amd && cpu.family == 0x19 && matches!(cpu.model, 0x00..=0x0F | 0x20..=0x5F);
    if cpu.intel {
        INTEL
    } else if zen3 {
        ZEN3
    } else {
        OFF
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_id() -> Option<CpuId> {
    use std::arch::x86_64::__cpuid;
    // CPUID leaves 0 and 1 exist on every x86-64 processor. The vendor string is spread over
    // EBX, EDX, ECX: "GenuineIntel", "AuthenticAMD".
    let id = __cpuid(0);
    let vendor = (id.ebx, id.edx, id.ecx);
    let eax = __cpuid(1).eax;
    let base_family = (eax >> 8) & 0xF;
    let (family, model) = if base_family == 0xF {
        (
            base_family + ((eax >> 20) & 0xFF),
            ((eax >> 4) & 0xF) | (((eax >> 16) & 0xF) << 4),
        )
    } else {
        (base_family, ((eax >> 4) & 0xF) | (((eax >> 16) & 0xF) << 4))
    };
    Some(CpuId {
        intel: vendor == (0x756e_6547, 0x4965_6e69, 0x6c65_746e),
        amd: vendor == (0x6874_7541, 0x6974_6e65, 0x444d_4163),
        family,
        model,
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_id() -> Option<CpuId> {
    None
}

/// How a panel call over `n` tokens prefetches: only decode (one token) streams its rows once;
/// batches reuse them from cache. (Only the x86 panels prefetch.)
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn decode_prefetch(n: usize) -> StreamPrefetch {
    single_pass_prefetch(n, 1)
}

/// [`decode_prefetch`] for a register-tiled panel whose token tiles take up to `max_tokens`
/// tokens: a call of that many or fewer (a batched decode step's, a few sessions' tokens) also
/// streams each row once, in one pass over the rows, so it prefetches as decode does.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn single_pass_prefetch(n: usize, max_tokens: usize) -> StreamPrefetch {
    if n == 1 || (n <= max_tokens && small_batch_prefetch()) {
        stream_prefetch()
    } else {
        OFF
    }
}

/// Whether panels of a few tokens prefetch (unless `MOESHARD_BATCH_PREFETCH=0`).
#[cfg(target_arch = "x86_64")]
fn small_batch_prefetch() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOESHARD_BATCH_PREFETCH").map_or(true, |v| v != "0"))
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
    p: StreamPrefetch,
) -> [Range<usize>; 2] {
    let end = total_rows * stride;
    let clip = |from: usize, to: usize| from.min(end)..to.min(end);
    let distance = p.distance;
    if distance == 0 || end > p.max_block {
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
    p: StreamPrefetch,
) {
    if p.distance == 0 {
        return;
    }
    for r in ranges_ahead(r0, rows, stride, total_rows, p) {
        prefetch(base.wrapping_add(r.start), r.len());
    }
}

/// [`rows_ahead`] for a panel kernel's single-token row loop: the panel's rows are one task's.
/// (The x86 panels call it; the NEON ones do not prefetch.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn panel_rows_ahead(
    p: &crate::panel::Panel,
    r0: usize,
    rows: usize,
    ahead: StreamPrefetch,
) {
    rows_ahead(p.w, r0, rows, p.w_stride, p.rows, ahead);
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_follows_the_measured_microarchitectures() {
        use super::{CpuId, INTEL, OFF, ZEN3, default_prefetch};
        let cpu = |intel, amd, family, model| CpuId {
            intel,
            amd,
            family,
            model,
        };
        // The device host's Xeon, this box's EPYC (Milan), a Zen 4 EPYC (Genoa) and desktop
        // (Raphael), a Zen 2 (family 0x17): only the measured ones prefetch.
        assert_eq!(default_prefetch(cpu(true, false, 6, 207)), INTEL);
        assert_eq!(default_prefetch(cpu(false, true, 0x19, 0x01)), ZEN3);
        assert_eq!(default_prefetch(cpu(false, true, 0x19, 0x21)), ZEN3);
        assert_eq!(default_prefetch(cpu(false, true, 0x19, 0x11)), OFF);
        assert_eq!(default_prefetch(cpu(false, true, 0x19, 0x61)), OFF);
        assert_eq!(default_prefetch(cpu(false, true, 0x17, 0x31)), OFF);
        assert_eq!(default_prefetch(cpu(false, false, 0x19, 0x01)), OFF);
    }

    /// What this machine's CPUID decodes to, where it is an x86-64 (the vendor string and the
    /// family arithmetic against /proc/cpuinfo's own decoding, on Linux).
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn cpuid_decodes_as_the_kernel_does() {
        let Some(id) = super::cpu_id() else { return };
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().map(str::trim) == Some(name))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        };
        let (Some(vendor), Some(family), Some(model)) =
            (field("vendor_id"), field("cpu family"), field("model"))
        else {
            return;
        };
        assert_eq!(id.intel, vendor == "GenuineIntel", "{vendor}");
        assert_eq!(id.amd, vendor == "AuthenticAMD", "{vendor}");
        assert_eq!(id.family.to_string(), family);
        assert_eq!(id.model.to_string(), model);
    }

    use super::{StreamPrefetch, ranges_ahead};

    #[test]
    fn the_stream_is_asked_for_ahead_and_never_past_its_block() {
        let ahead = |distance| StreamPrefetch {
            distance,
            max_block: usize::MAX,
        };
        let short = StreamPrefetch {
            distance: 1024,
            max_block: 147455,
        };
        // (first row, rows, row bytes, block rows, prefetch) → [head of the block, ahead].
        // Q4_K rows of 2048 columns (1152 B), 128 rows (the block ends at byte 147456).
        let cases = [
            ((0, 1, 1152, 128, ahead(1024)), [0..1024, 1024..2176]),
            ((5, 1, 1152, 128, ahead(1024)), [0..0, 6784..7936]),
            // The last rows: nothing beyond the block.
            ((126, 1, 1152, 128, ahead(1024)), [0..0, 146176..147328]),
            ((127, 1, 1152, 128, ahead(1024)), [0..0, 147328..147456]),
            ((127, 4, 1152, 128, ahead(1024)), [0..0, 147328..147456]),
            // A block shorter than the distance.
            ((0, 1, 288, 2, ahead(1024)), [0..576, 576..576]),
            // A block longer than streams are prefetched in, and one row shorter.
            ((0, 1, 1152, 128, short), [0..0, 0..0]),
            ((0, 1, 1152, 127, short), [0..1024, 1024..2176]),
            // Off.
            ((3, 1, 1152, 128, ahead(0)), [0..0, 0..0]),
        ];
        for ((r0, rows, stride, total, p), want) in cases {
            assert_eq!(
                ranges_ahead(r0, rows, stride, total, p),
                want,
                "row {r0} of {total}"
            );
        }
    }
}
