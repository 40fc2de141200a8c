//! Instruction-set selection. One binary serves a mixed cluster, so the SIMD level is detected at
//! run time (once) rather than fixed at compile time with `target-cpu=native`.

use std::sync::OnceLock;

use gguf::GgmlType;

use crate::formats::{self, DotFn};
use crate::panel::{ChunkDotsFn, ChunkPanelFn, PanelFn, RowKernel};

/// A SIMD level. Ordered: a higher level is preferred when supported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust: the reference every SIMD path is tested against.
    Scalar,
    /// AVX2 + FMA + F16C (Haswell, Zen 1 and later).
    Avx2,
    /// AVX-512 F/BW/VL/DQ with VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later). CPUs with
    /// AVX-512 but without VNNI use the AVX2 kernels.
    Avx512,
    /// AVX-512 plus the AMX int8 tile unit (Sapphire Rapids and later Xeons), where the OS grants
    /// the tile state: Q4_K and Q6_K batches on the tiles (`crate::x86::amx`), Q4_K in the
    /// scalar reference's arithmetic, everything else as `Avx512`.
    Amx,
    /// AArch64 Advanced SIMD, which every AArch64 CPU has.
    Neon,
    /// NEON with FEAT_DotProd (`sdot`: Cortex-A55/A76+, Neoverse N1, Apple M1 and later).
    NeonDotprod,
    /// NEON with FEAT_DotProd and FEAT_I8MM (`smmla`: Neoverse V1/N2/V2, Apple M2 and later).
    NeonI8mm,
}

impl Isa {
    /// Every level of every architecture, lowest first within each; a CPU supports only those of
    /// its own architecture (and `Scalar`).
    pub const ALL: [Isa; 7] = [
        Isa::Scalar,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Amx,
        Isa::Neon,
        Isa::NeonDotprod,
        Isa::NeonI8mm,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
            Isa::Neon => "neon",
            Isa::NeonDotprod => "dotprod",
            Isa::NeonI8mm => "i8mm",
        }
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(name))
    }

    /// Whether this CPU can run kernels of this level.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512.is_supported() && crate::x86::amx::available(),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm => crate::aarch64::is_supported(self),
            _ => false,
        }
    }

    /// The best supported level, or the one named by `MOESHARD_ISA` (`scalar`, `avx2`, `avx512`,
    /// `amx`, `neon`, `dotprod`, `i8mm`) when that is supported — useful to compare paths on one
    /// machine.
    pub fn detect() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Isa::ALL
                .into_iter()
                .rev()
                .find(|i| i.is_supported())
                .unwrap_or(Isa::Scalar);
            match std::env::var("MOESHARD_ISA")
                .ok()
                .as_deref()
                .and_then(Isa::from_name)
            {
                Some(forced) if forced.is_supported() => forced,
                _ => best,
            }
        })
    }

    /// Whether the kernels outside the per-format tables (activation quantizers, gated
    /// activations) take their AVX2 form at this level, so `MOESHARD_ISA=scalar` keeps them
    /// scalar too. [`Isa::detect`] returns only supported levels, so for its level this also
    /// says the CPU has AVX2 and FMA (their callers run per matvec: no feature checks here).
    pub fn allows_avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::Avx512 | Isa::Amx)
    }

    /// Every level this CPU supports, lowest first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }
}

/// The SIMD dot product of `dtype` at exactly this level, if this level has one and the CPU
/// supports it. Scalar always has one for every computable format.
pub fn simd_dot(isa: Isa, dtype: GgmlType) -> Option<DotFn> {
    if !isa.is_supported() {
        return None;
    }
    match isa {
        Isa::Scalar => formats::format(dtype).map(|f| f.dot_scalar),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::x86::avx2::dot(dtype),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => crate::x86::avx512::dot(dtype),
        #[cfg(target_arch = "x86_64")]
        Isa::Amx => crate::x86::amx::dot(dtype),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm => crate::aarch64::dot(isa, dtype),
        _ => None,
    }
}

/// The fastest dot product for `dtype` at level `isa` or below.
pub fn best_dot(isa: Isa, dtype: GgmlType) -> Option<DotFn> {
    Isa::ALL
        .into_iter()
        .rev()
        .filter(|&i| i <= isa)
        .find_map(|i| simd_dot(i, dtype))
}

/// The panel kernel of `dtype` at exactly this level, if this level has one and the CPU supports
/// it. It gives the same bits as [`simd_dot`] at the same level.
pub fn simd_panel(isa: Isa, dtype: GgmlType) -> Option<PanelFn> {
    if !isa.is_supported() {
        return None;
    }
    match isa {
        Isa::Scalar => None,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::x86::avx2::panel(dtype),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => crate::x86::avx512::panel(dtype),
        #[cfg(target_arch = "x86_64")]
        Isa::Amx => crate::x86::amx::panel(dtype),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm => crate::aarch64::panel(isa, dtype),
        _ => None,
    }
}

/// The level whose dot [`best_dot`] picks for `dtype` at `isa`: the highest one at or below
/// `isa` that has a dot; panels and chunk-dots come from that same level (the same bits).
fn dot_level(isa: Isa, dtype: GgmlType) -> Option<Isa> {
    Isa::ALL
        .into_iter()
        .rev()
        .filter(|&i| i <= isa)
        .find(|&i| simd_dot(i, dtype).is_some())
}

/// The chunk-dots kernel of `dtype` for level `isa`: that of the level [`best_dot`] picks, if it
/// has one (the same bits as that dot per chunk).
pub fn chunk_dots(isa: Isa, dtype: GgmlType) -> Option<ChunkDotsFn> {
    match dot_level(isa, dtype)? {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::x86::avx2::chunk_dots(dtype),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => crate::x86::avx512::chunk_dots(dtype),
        #[cfg(target_arch = "x86_64")]
        Isa::Amx => crate::x86::amx::chunk_dots(dtype),
        _ => None,
    }
}

/// The chunk-rows kernel of `dtype` for level `isa` (the 32-element formats with a min, whose
/// rows run four at a time with the activation side computed once), if there is one.
pub fn chunk_rows(isa: Isa, dtype: GgmlType) -> Option<crate::panel::ChunkRowsFn> {
    match dot_level(isa, dtype)? {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::x86::avx2::chunk_rows(dtype),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => crate::x86::avx512::chunk_rows(dtype),
        _ => None,
    }
}

/// The chunk-panel kernel of `dtype` for level `isa`: that of the level [`best_dot`] picks, if
/// it has one (the same bits as that dot per chunk).
pub fn chunk_panel(isa: Isa, dtype: GgmlType) -> Option<ChunkPanelFn> {
    match dot_level(isa, dtype)? {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::x86::avx2::chunk_panel(dtype),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => crate::x86::avx512::chunk_panel(dtype),
        // Q6_K has the same arithmetic at the AMX level, and the AVX-512 row lanes beat the
        // tiles per chunk there by 31-39 % (7168x16384 at 64 and 256 tokens, 16 threads;
        // docs/measurements/2026-12-04-run24-*). Q4_K keeps its tiles per chunk: that level's
        // Q4_K arithmetic is the reference's, not the row lanes' octets, and its tiles per
        // chunk ran 2.0-2.3x the AVX-512 chunk panels in it (run 16).
        #[cfg(target_arch = "x86_64")]
        Isa::Amx if dtype == GgmlType::Q6K => crate::x86::avx512::chunk_panel(dtype),
        _ => None,
    }
}

/// How matrix products of `dtype` run at level `isa`: the panel kernel of the level that
/// [`best_dot`] picks, or else a loop of that dot (the same bits either way).
pub fn row_kernel(isa: Isa, dtype: GgmlType) -> Option<RowKernel> {
    let level = dot_level(isa, dtype)?;
    Some(match simd_panel(level, dtype) {
        Some(p) => RowKernel::Panel(p),
        None => RowKernel::Dot(simd_dot(level, dtype)?),
    })
}

/// The row count that the panel kernel of `dtype` at level `isa` wants its panels cut into
/// multiples of: the AMX tiles take 16 rows at a time (a partial block is padded with zero
/// rows, wasted work); the x86 panels of the 32-element formats transpose each group of tokens
/// once per panel, which 32 rows amortize; the AVX-512 Q4_K and Q6_K panels pack blocks of 16
/// rows for their row lanes (`crate::x86::avx512::packs_row_blocks`), the AVX2 Q4_K panel
/// blocks of 8 (`crate::x86::avx2::packs_row_blocks`); the other register-tiled panels
/// take any count (4 keeps blocks aligned).
pub fn panel_row_granule(isa: Isa, dtype: GgmlType) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if isa >= Isa::Amx && isa.is_supported() && crate::x86::amx::panel(dtype).is_some() {
            return crate::x86::amx::TILE;
        }
        if token_lane_panels(isa, dtype) {
            return 32;
        }
        if dot_level(isa, dtype) == Some(Isa::Avx512)
            && let Some(rows) = crate::x86::avx512::packs_row_blocks(dtype)
        {
            return rows;
        }
        if dot_level(isa, dtype) == Some(Isa::Avx2)
            && let Some(rows) = crate::x86::avx2::packs_row_blocks(dtype)
        {
            return rows;
        }
    }
    let _ = (isa, dtype);
    4
}

/// Whether the panel of `dtype` at level `isa` is one of the x86 panels of the 32-element
/// formats that put one token per lane (`crate::x86::blocks32`).
#[cfg(target_arch = "x86_64")]
fn token_lane_panels(isa: Isa, dtype: GgmlType) -> bool {
    use GgmlType as T;
    isa >= Isa::Avx2
        && matches!(
            dtype,
            T::Q4_0 | T::Q4_1 | T::Q5_0 | T::Q5_1 | T::Q8_0 | T::Iq4Nl
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_detected_level_allows_the_avx2_helpers_only_where_the_cpu_has_avx2() {
        assert!(!Isa::Scalar.allows_avx2());
        if Isa::detect().allows_avx2() {
            #[cfg(target_arch = "x86_64")]
            assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
            #[cfg(not(target_arch = "x86_64"))]
            panic!("{:?} allows AVX2 helpers off x86_64", Isa::detect());
        }
    }
}
