//! AVX2 + FMA + F16C kernels (256-bit). One block of 32 or one K-quant group per register. The
//! helpers shared with the AVX-512 set (loads, f16 scales, horizontal sums) are in
//! `crate::x86::simd256`.

mod float;
mod iquants;
mod kquants;
mod legacy;
/// The AVX-512 level decodes Q8_0 with this level's row lanes (see its `panel_q8_0`).
pub(crate) use legacy::dots8_q8_0;
mod panels;
mod row_lanes;

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::formats::DotFn;
use crate::panel::{ChunkDotsFn, ChunkPanelFn, PanelFn};

/// The AVX2 dot product for `dtype`, if there is one. Only for `crate::isa`, after it checked
/// that the CPU has AVX2, FMA and F16C: the functions returned run AVX2 code.
pub fn dot(dtype: GgmlType) -> Option<DotFn> {
    use GgmlType as T;
    Some(match dtype {
        T::F32 => float::dot_f32,
        T::F16 => float::dot_f16,
        T::Bf16 => float::dot_bf16,
        T::Q4_0 => legacy::dot_q4_0,
        T::Q4_1 => legacy::dot_q4_1,
        T::Q5_0 => legacy::dot_q5_0,
        T::Q5_1 => legacy::dot_q5_1,
        T::Q8_0 => legacy::dot_q8_0,
        T::Mxfp4 => crate::x86::mxfp4::dot_checked,
        T::Q2K => kquants::dot_q2_k,
        T::Q3K => kquants::dot_q3_k,
        T::Q4K => kquants::dot_q4_k,
        T::Q5K => kquants::dot_q5_k,
        T::Q6K => kquants::dot_q6_k,
        T::Q8K => kquants::dot_q8_k,
        T::Iq4Nl => legacy::dot_iq4_nl,
        T::Iq4Xs => iquants::dot_iq4_xs,
        T::Iq2Xxs => iquants::dot_iq2_xxs,
        T::Iq2Xs => iquants::dot_iq2_xs,
        T::Iq2S => iquants::dot_iq2_s,
        T::Iq3Xxs => iquants::dot_iq3_xxs,
        T::Iq3S => iquants::dot_iq3_s,
        T::Iq1S => iquants::dot_iq1_s,
        T::Iq1M => iquants::dot_iq1_m,
        T::Tq1_0 => iquants::dot_tq1_0,
        T::Tq2_0 => iquants::dot_tq2_0,
        _ => return None,
    })
}

/// The AVX2 chunk-rows kernel for `dtype`, if there is one (the 32-element formats: eight rows
/// a row per lane).
pub fn chunk_rows(dtype: GgmlType) -> Option<crate::panel::ChunkRowsFn> {
    use GgmlType as T;
    Some(match dtype {
        T::Q4_0 => panels::chunk_rows_q4_0,
        T::Q4_1 => panels::chunk_rows_q4_1,
        T::Q5_0 => panels::chunk_rows_q5_0,
        T::Q5_1 => panels::chunk_rows_q5_1,
        T::Q8_0 => panels::chunk_rows_q8_0,
        T::Iq4Nl => panels::chunk_rows_iq4_nl,
        _ => return None,
    })
}

/// The AVX2 chunk-dots kernel for `dtype`, if there is one (the K-quants; the 32-element formats
/// have [`chunk_rows`], others run a loop of [`dot`]).
pub fn chunk_dots(dtype: GgmlType) -> Option<ChunkDotsFn> {
    use GgmlType as T;
    Some(match dtype {
        T::Q2K => panels::chunks_q2_k,
        T::Q3K => panels::chunks_q3_k,
        T::Q4K => kquants::chunks_q4_k,
        T::Q5K => panels::chunks_q5_k,
        T::Q6K => panels::chunks_q6_k,
        _ => return None,
    })
}

/// The AVX2 panel kernel for `dtype`, if there is one (the same condition as [`dot`]).
pub fn panel(dtype: GgmlType) -> Option<PanelFn> {
    use GgmlType as T;
    Some(match dtype {
        T::F32 => float::panel_f32,
        T::F16 => float::panel_f16,
        T::Bf16 => float::panel_bf16,
        T::Q2K => panels::panel_q2_k,
        T::Q3K => panels::panel_q3_k,
        T::Q4K => row_lanes::panel_q4_k,
        T::Q5K => panels::panel_q5_k,
        T::Q6K => row_lanes::panel_q6_k,
        T::Q8_0 => panels::panel_q8_0,
        T::Q4_0 => panels::panel_q4_0,
        T::Q4_1 => panels::panel_q4_1,
        T::Q5_0 => panels::panel_q5_0,
        T::Q5_1 => panels::panel_q5_1,
        T::Iq4Nl => panels::panel_iq4_nl,
        T::Mxfp4 => crate::x86::mxfp4::panel,
        T::Iq4Xs => iquants::panel_iq4_xs,
        T::Iq2Xxs => iquants::panel_iq2_xxs,
        T::Iq2Xs => iquants::panel_iq2_xs,
        T::Iq2S => iquants::panel_iq2_s,
        T::Iq3Xxs => iquants::panel_iq3_xxs,
        T::Iq3S => iquants::panel_iq3_s,
        T::Iq1S => iquants::panel_iq1_s,
        T::Iq1M => iquants::panel_iq1_m,
        T::Tq1_0 => iquants::panel_tq1_0,
        T::Tq2_0 => iquants::panel_tq2_0,
        _ => return None,
    })
}

/// The AVX2 chunk-panel kernel for `dtype`, if there is one: those of the row lanes (Q4_K,
/// Q6_K). The register tiles run per chunk were slower than a panel call per chunk (sixteen
/// registers, measured 0.6–0.9×), so the other formats have none.
pub fn chunk_panel(dtype: GgmlType) -> Option<ChunkPanelFn> {
    match dtype {
        GgmlType::Q4K => Some(row_lanes::chunk_panel_q4_k),
        GgmlType::Q6K => Some(row_lanes::chunk_panel_q6_k),
        _ => None,
    }
}

/// Rows per block that the panel of `dtype` packs (its row granule), if it packs any.
pub fn packs_row_blocks(dtype: GgmlType) -> Option<usize> {
    matches!(dtype, GgmlType::Q4K | GgmlType::Q6K).then_some(row_lanes::ROWS)
}

/// 32 signed bytes times 32 signed bytes, summed in pairs of pairs: 8 lanes of i32. `x` may hold
/// -128 (its magnitude is read as unsigned); `y` must not (its sign is flipped).
#[inline]
#[target_feature(enable = "avx2")]
fn mul_sum_i8_pairs(x: __m256i, y: __m256i, ones: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones)
}
