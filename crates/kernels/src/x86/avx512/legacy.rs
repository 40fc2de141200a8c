//! 32-element formats (Q4_0 … Q8_0 and IQ4_NL) against Q8_0 activations: one block per 256-bit
//! register (AVX-512VL), in the scalar reference's arithmetic (`crate::x86::blocks32`: one
//! exact integer per block, the reference's float steps in block order). Byte products go straight
//! to i32 with `vpdpbusd` (no i16 stage, so nothing can saturate); the fifth bits of Q5 and the
//! signs of Q8_0 and IQ4_NL are applied under byte masks. (MXFP4 runs the AVX2 kernel of
//! `crate::x86::mxfp4` at this level.)
//!
//! Packed nibbles become `[low | high]` per block, the element order of the Q8_0 block, with a
//! 128-bit broadcast and a masked shift. Signed weights get their sign moved onto the activation
//! (Q8_0 activations never hold -128, so the negation is exact); Q4_0's offset is removed as
//! `8·Σy`, Q4_1/Q5_1's min multiplies `Σy`.

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::blocks::*;
use crate::formats::iq_grids::KVALUES_IQ4NL;
use crate::x86::blocks32::{dots_fns, reference_sums};
use crate::x86::dot_wrapper;
use crate::x86::simd256::{load128_of, load256_of};

dot_wrapper!(pub dot_q4_0 => dot_q4_0_impl, GgmlType::Q4_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_q4_1 => dot_q4_1_impl, GgmlType::Q4_1, GgmlType::Q8_0);
dot_wrapper!(pub dot_q5_0 => dot_q5_0_impl, GgmlType::Q5_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_q5_1 => dot_q5_1_impl, GgmlType::Q5_1, GgmlType::Q8_0);
dot_wrapper!(pub dot_q8_0 => dot_q8_0_impl, GgmlType::Q8_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_iq4_nl => dot_iq4_nl_impl, GgmlType::Iq4Nl, GgmlType::Q8_0);

/// 16 bytes of packed nibbles as 32 bytes: the low nibbles, then the high nibbles.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn nibbles(qs: &[u8; 16], m4: __m256i) -> __m256i {
    let q = _mm256_broadcastsi128_si256(load128_of(qs));
    // Shift the high 128-bit lane (16-bit lanes 8..16).
    _mm256_and_si256(_mm256_mask_srli_epi16::<4>(q, 0xFF00, q), m4)
}

/// `Σ |x|·(±y)` over one block: `mag` unsigned magnitudes, `neg` the negative lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
fn signed_dot(mag: __m256i, neg: __mmask32, y: __m256i) -> __m256i {
    let zero = _mm256_setzero_si256();
    _mm256_dpbusd_epi32(zero, mag, _mm256_mask_sub_epi8(y, neg, zero, y))
}

/// `n / 32` blocks of weights `B` in each row and of Q8_0 activations.
#[inline(always)]
fn blocks<'a, B: bytemuck::Pod, const R: usize>(
    n: usize,
    w: [&'a [u8]; R],
    a: &'a [u8],
) -> ([&'a [B]; R], &'a [BlockQ8_0]) {
    let nb = n / 32;
    // A loop, not `w.map`: the map was an out-of-line call per eight-row dot (3 % of SmolLM2's
    // decode).
    let mut rows: [&[B]; R] = [&[]; R];
    for (row, w) in rows.iter_mut().zip(w) {
        *row = &bytemuck::cast_slice(w)[..nb];
    }
    (rows, &bytemuck::cast_slice(a)[..nb])
}

dots_fns!(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    dot_q4_0_impl, dots8_q4_0, BlockQ4_0, min: false,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let k8 = _mm256_set1_epi8(8);
        let k1 = _mm256_set1_epi8(1);
        let zero = _mm256_setzero_si256();
    },
    isum: |x, y| {
        let (q, y) = (nibbles(&x.qs, m4), load256_of(&y.qs));
        _mm256_sub_epi32(
            _mm256_dpbusd_epi32(zero, q, y),
            _mm256_dpbusd_epi32(zero, k8, y),
        )
    },
    ysum: |y| _mm256_dpbusd_epi32(zero, k1, load256_of(&y.qs)),
    d: |x| x.d,
    m: |x| x.d,
    nibbles: { offset: 8, map: |q| q, dot4: |acc, q, y| _mm256_dpbusd_epi32(acc, q, y) },
);

dots_fns!(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    dot_q4_1_impl, dots8_q4_1, BlockQ4_1, min: true,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let k1 = _mm256_set1_epi8(1);
        let zero = _mm256_setzero_si256();
    },
    isum: |x, y| {
        _mm256_dpbusd_epi32(zero, nibbles(&x.qs, m4), load256_of(&y.qs))
    },
    ysum: |y| _mm256_dpbusd_epi32(zero, k1, load256_of(&y.qs)),
    d: |x| x.d,
    m: |x| x.m,
    nibbles: { offset: 0, map: |q| q, dot4: |acc, q, y| _mm256_dpbusd_epi32(acc, q, y) },
);

dots_fns!(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    dot_q5_0_impl, dots8_q5_0, BlockQ5_0, min: false,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let k16 = _mm256_set1_epi8(16);
    },
    isum: |x, y| {
        let q = nibbles(&x.qs, m4);
        // A weight is q - 16 where its fifth bit (bit j of qh for element j) is clear:
        // negative, magnitude 16 - q. Where the bit is set it is q.
        let neg = _cvtu32_mask32(!u32::from_le_bytes(x.qh));
        signed_dot(_mm256_mask_sub_epi8(q, neg, k16, q), neg, load256_of(&y.qs))
    },
    ysum: |_y| _mm256_setzero_si256(),
    d: |x| x.d,
    m: |x| x.d,
);

dots_fns!(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    dot_q5_1_impl, dots8_q5_1, BlockQ5_1, min: true,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let k1 = _mm256_set1_epi8(1);
        let k16 = _mm256_set1_epi8(16);
        let zero = _mm256_setzero_si256();
    },
    isum: |x, y| {
        let q = nibbles(&x.qs, m4);
        let q = _mm256_mask_add_epi8(q, _cvtu32_mask32(u32::from_le_bytes(x.qh)), q, k16);
        _mm256_dpbusd_epi32(zero, q, load256_of(&y.qs))
    },
    ysum: |y| _mm256_dpbusd_epi32(zero, k1, load256_of(&y.qs)),
    d: |x| x.d,
    m: |x| x.m,
);

/// Q8_0: the weight's magnitude against the activation with the weight's sign. (No eight-row
/// form at this level: the panels take the AVX2 level's, `crate::x86::avx2::dots8_q8_0`, which
/// measured faster.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) fn dot_q8_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = blocks::<BlockQ8_0, 1>(n, [w], a);
    let [s] = reference_sums!(1, w, a, min: false,
        isum: |x, y| {
            // |x| read as unsigned is exact even for -128.
            let x = load256_of(&x.qs);
            signed_dot(_mm256_abs_epi8(x), _mm256_movepi8_mask(x), load256_of(&y.qs))
        },
        ysum: |_y| _mm256_setzero_si256(),
        d: |x| x.d,
        m: |x| x.d,
    );
    s
}

dots_fns!(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    /// IQ4_NL: Q4_0's nibbles mapped through the 16 levels with one `vpshufb`, then Q8_0's signed
    /// product. The eight-row form maps them to the levels + 128 (1..=241, unsigned), so that
    /// one `vpdpbusd` takes them as they are, and subtracts `128·Σy`.
    dot_iq4_nl_impl, dots8_iq4_nl, BlockIq4Nl, min: false,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let levels = _mm256_broadcastsi128_si256(load128_of(&KVALUES_IQ4NL));
    },
    isum: |x, y| {
        let v = _mm256_shuffle_epi8(levels, nibbles(&x.qs, m4));
        signed_dot(
            _mm256_abs_epi8(v),
            _mm256_movepi8_mask(v),
            load256_of(&y.qs),
        )
    },
    ysum: |_y| _mm256_setzero_si256(),
    d: |x| x.d,
    m: |x| x.d,
    nibbles: {
        offset: 128,
        map: |q| _mm256_shuffle_epi8(_mm256_xor_si256(levels, _mm256_set1_epi8(0x80u8 as i8)), q),
        dot4: |acc, q, y| _mm256_dpbusd_epi32(acc, q, y),
    },
);
