//! AVX-512 (F/BW/VL/DQ + VNNI) kernels: signed byte products with `vpdpbusd` (the weight's sign
//! moved onto the activation under a mask, or unsigned quants with the offset removed through
//! activation sums), 16-bit products scaled and accumulated with `vpdpwssd`, byte masks for
//! fifth bits and signs.
//!
//! Zen 4 runs a 512-bit operation as two 256-bit halves, so width itself gains nothing; what
//! gains is needing fewer instructions. Most quantized kernels here therefore work on 256-bit
//! registers with the AVX-512VL forms of VNNI and masks, which measured faster than assembling
//! 512-bit registers from two blocks or groups (see `legacy` and `kquants`); F32/F16/BF16 and
//! Q8_K, which need no assembly, use 512 bits. The 256-bit helpers shared with the AVX2 set are
//! in `crate::x86::simd256`.

mod float;
mod iquants;
mod kquants;
mod legacy;
mod panels;
mod q4k_octets;
mod row_lanes;

pub(crate) use kquants::{chunks_q4_k_exact, dot_q4_k_exact, dot_q6_k};
pub(crate) use panels::{chunks_q6_k, panel_q4_k_exact, panel_q6_k};

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::formats::DotFn;
use crate::panel::{ChunkDotsFn, ChunkPanelFn, PanelFn};

/// The AVX-512 dot product for `dtype`, if there is one. Only for `crate::isa`, after it
/// checked that the CPU has every feature of `Isa::Avx512` (which include AVX2, FMA and F16C):
/// the functions returned run AVX-512 code.
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
        // The VNNI form of the AVX2 kernel (same bits as it and as its panel); see `crate::x86::mxfp4`.
        T::Mxfp4 => crate::x86::mxfp4::dot_vnni_checked,
        T::Q2K => kquants::dot_q2_k,
        T::Q3K => kquants::dot_q3_k,
        T::Q4K => q4k_octets::dot_q4_k,
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

/// The AVX-512 chunk-rows kernel for `dtype`, if there is one (Q4_1, Q5_1).
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

/// The AVX-512 chunk-dots kernel for `dtype`, if there is one (the K-quants and the
/// 32-element formats; others run a loop of [`dot`]).
pub fn chunk_dots(dtype: GgmlType) -> Option<ChunkDotsFn> {
    use GgmlType as T;
    Some(match dtype {
        T::Q2K => panels::chunks_q2_k,
        T::Q3K => panels::chunks_q3_k,
        T::Q4K => q4k_octets::chunks_q4_k,
        T::Q5K => panels::chunks_q5_k,
        T::Q6K => panels::chunks_q6_k,
        _ => return None,
    })
}

/// The AVX-512 chunk-panel kernel for `dtype` (batches of `crate::Kernels::matmul_chunked`), if
/// it has one: the K-quants, whose chunks are often a single superblock (where a panel call
/// per chunk spends as much on its fixed work and reductions as on the arithmetic).
pub fn chunk_panel(dtype: GgmlType) -> Option<ChunkPanelFn> {
    use GgmlType as T;
    Some(match dtype {
        T::Q2K => panels::chunk_panel_q2_k,
        T::Q3K => panels::chunk_panel_q3_k,
        T::Q4K => row_lanes::chunk_panel_q4_k,
        T::Q5K => panels::chunk_panel_q5_k,
        T::Q6K => row_lanes::chunk_panel_q6_k,
        _ => return None,
    })
}

/// The AVX-512 panel kernel for `dtype`, if there is one (the same condition as [`dot`]).
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
        T::Mxfp4 => crate::x86::mxfp4::panel_vnni,
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

/// Whether the panel of `dtype` at this level packs blocks of [`row_lanes::ROWS`] weight rows
/// for batches (so panels should come in multiples of that many rows).
pub fn packs_row_blocks(dtype: GgmlType) -> Option<usize> {
    matches!(dtype, GgmlType::Q4K | GgmlType::Q6K).then_some(row_lanes::ROWS)
}

/// 64 bytes from `p` (any alignment).
///
/// # Safety
/// `p..p + 64` is readable and initialized, and the CPU supports AVX-512F (the caller is
/// compiled with it).
#[inline]
unsafe fn load512(p: *const u8) -> __m512i {
    // SAFETY: the caller's contract.
    unsafe { _mm512_loadu_si512(p as *const __m512i) }
}

/// The transpose of a 16×16 matrix of dwords (`r[m]` holds row m): `out[k]` holds column k.
/// This turns one plane chunk of 16 weight rows (64 bytes each) into the VNNI layout of a B
/// tile, or of [`row_lanes`] (row k: four consecutive K bytes of each of the 16 rows).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) fn transpose16(r: &[__m512i; 16]) -> [__m512i; 16] {
    // Within each 128-bit lane L: pairs of rows interleaved, then quads, so that u[4j + q]'s
    // lane L holds rows 4j..4j + 4 at column 4L + q.
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(r[i], r[i + 1])
        } else {
            _mm512_unpackhi_epi32(r[i - 1], r[i])
        }
    });
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (j, q) = (i / 4, i % 4);
        let (a, b) = (t[4 * j + q / 2], t[4 * j + 2 + q / 2]);
        if q % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // Then a 4×4 transpose of 128-bit lanes across u[q], u[4 + q], u[8 + q], u[12 + q].
    let mut out = [_mm512_setzero_si512(); 16];
    for q in 0..4 {
        let (a, b, c, d) = (u[q], u[4 + q], u[8 + q], u[12 + q]);
        let x0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(a, b);
        let x1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(a, b);
        let y0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(c, d);
        let y1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(c, d);
        out[q] = _mm512_shuffle_i32x4::<0b10_00_10_00>(x0, y0);
        out[4 + q] = _mm512_shuffle_i32x4::<0b11_01_11_01>(x0, y0);
        out[8 + q] = _mm512_shuffle_i32x4::<0b10_00_10_00>(x1, y1);
        out[12 + q] = _mm512_shuffle_i32x4::<0b11_01_11_01>(x1, y1);
    }
    out
}
