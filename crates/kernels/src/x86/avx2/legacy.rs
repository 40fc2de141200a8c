//! 32-element formats (Q4_0 … Q8_0 and IQ4_NL) against Q8_0 activations: one block per 256-bit
//! register, in the scalar reference's arithmetic (`crate::x86::blocks32`: one exact integer per
//! block, the reference's float steps in block order).
//!
//! The 16 bytes of packed nibbles become 32 bytes, low nibbles first: the element order of the
//! Q8_0 block they pair with. Quants stay unsigned (0..16 or 0..32) for `vpmaddubsw`; the offset
//! of Q4_0/Q5_0 is removed as `offset·Σy` from the same pair sums, and the min of Q4_1/Q5_1
//! multiplies the exact `Σy`. Q8_0 is signed: the weight's magnitude times the activation with
//! the weight's sign (MXFP4 has its own kernel, `crate::x86::mxfp4`). No `vpmaddubsw` pair sum can
//! saturate: at most 2·31·127 for the unsigned quants, 2·128·127 = 32512 for signed weights
//! (activations from our quantizer never hold -128, whose negation would overflow).

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::mul_sum_i8_pairs;
use crate::blocks::*;
use crate::formats::iq_grids::KVALUES_IQ4NL;
use crate::x86::blocks32::dots_fns;
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
#[target_feature(enable = "avx2")]
pub(super) fn nibbles(qs: &[u8; 16], m4: __m256i) -> __m256i {
    let q = load128_of(qs);
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), m4)
}

/// Constants that spread the 32 fifth bits of a Q5 block over 32 bytes.
pub(super) struct FifthBits {
    /// `vpshufb` control: byte j takes byte j/8 of the broadcast `qh`.
    spread: __m256i,
    /// Every bit but bit j%8 in byte j.
    others: __m256i,
    ones: __m256i,
    k16: __m256i,
}

impl FifthBits {
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn new() -> FifthBits {
        let spread = _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        );
        FifthBits {
            spread,
            others: _mm256_set1_epi64x(!0x8040_2010_0804_0201u64 as i64),
            ones: _mm256_set1_epi8(-1),
            k16: _mm256_set1_epi8(16),
        }
    }

    /// The quants of a Q5 block, 0..32: `nibbles | 16·(bit j of qh)`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn quants(&self, qh: &[u8; 4], qs: &[u8; 16], m4: __m256i) -> __m256i {
        let h = _mm256_set1_epi32(i32::from_le_bytes(*qh));
        let h = _mm256_or_si256(_mm256_shuffle_epi8(h, self.spread), self.others);
        let h = _mm256_and_si256(_mm256_cmpeq_epi8(h, self.ones), self.k16);
        _mm256_or_si256(nibbles(qs, m4), h)
    }
}

/// `Σ q·y − k·Σy` over one block as 8 lanes, for unsigned quants `q` and `offset = [k; 32]`.
#[inline]
#[target_feature(enable = "avx2")]
fn offset_dot(q: __m256i, y: __m256i, offset: __m256i, ones: __m256i) -> __m256i {
    let p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, y), _mm256_maddubs_epi16(offset, y));
    _mm256_madd_epi16(p, ones)
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

/// `Σ q·y` over one block as 8 lanes, for unsigned quants `q`.
#[inline]
#[target_feature(enable = "avx2")]
fn unsigned_dot(q: __m256i, y: __m256i, ones: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones)
}

dots_fns!(
    "avx2,fma,f16c";
    dot_q4_0_impl, dots8_q4_0, BlockQ4_0, min: false,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let k8 = _mm256_set1_epi8(8);
        let k1 = _mm256_set1_epi8(1);
        let ones = _mm256_set1_epi16(1);
    },
    isum: |x, y| offset_dot(nibbles(&x.qs, m4), load256_of(&y.qs), k8, ones),
    ysum: |y| unsigned_dot(k1, load256_of(&y.qs), ones),
    d: |x| x.d,
    m: |x| x.d,
    nibbles: { offset: 8, map: |q| q, dot4: |acc, q, y| _mm256_add_epi32(acc, unsigned_dot(q, y, ones)) },
);

dots_fns!(
    "avx2,fma,f16c";
    dot_q4_1_impl, dots8_q4_1, BlockQ4_1, min: true,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let k1 = _mm256_set1_epi8(1);
        let ones = _mm256_set1_epi16(1);
    },
    isum: |x, y| unsigned_dot(nibbles(&x.qs, m4), load256_of(&y.qs), ones),
    ysum: |y| unsigned_dot(k1, load256_of(&y.qs), ones),
    d: |x| x.d,
    m: |x| x.m,
    nibbles: { offset: 0, map: |q| q, dot4: |acc, q, y| _mm256_add_epi32(acc, unsigned_dot(q, y, ones)) },
);

dots_fns!(
    "avx2,fma,f16c";
    dot_q5_0_impl, dots8_q5_0, BlockQ5_0, min: false,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let fifth = FifthBits::new();
    },
    isum: |x, y| {
        let q = fifth.quants(&x.qh, &x.qs, m4);
        offset_dot(q, load256_of(&y.qs), fifth.k16, ones)
    },
    ysum: |_y| _mm256_setzero_si256(),
    d: |x| x.d,
    m: |x| x.d,
);

dots_fns!(
    "avx2,fma,f16c";
    dot_q5_1_impl, dots8_q5_1, BlockQ5_1, min: true,
    setup: {
        let m4 = _mm256_set1_epi8(0x0F);
        let k1 = _mm256_set1_epi8(1);
        let ones = _mm256_set1_epi16(1);
        let fifth = FifthBits::new();
    },
    isum: |x, y| unsigned_dot(fifth.quants(&x.qh, &x.qs, m4), load256_of(&y.qs), ones),
    ysum: |y| unsigned_dot(k1, load256_of(&y.qs), ones),
    d: |x| x.d,
    m: |x| x.m,
);

dots_fns!(
    "avx2,fma,f16c";
    dot_q8_0_impl, dots8_q8_0, BlockQ8_0, min: false,
    setup: {
        let ones = _mm256_set1_epi16(1);
    },
    isum: |x, y| mul_sum_i8_pairs(load256_of(&x.qs), load256_of(&y.qs), ones),
    ysum: |_y| _mm256_setzero_si256(),
    d: |x| x.d,
    m: |x| x.d,
);

dots_fns!(
    "avx2,fma,f16c";
    /// IQ4_NL: Q4_0's nibbles mapped through the 16 levels with one `vpshufb`, then Q8_0's signed
    /// product (levels reach -127, whose magnitude still fits the unsigned operand).
    dot_iq4_nl_impl, dots8_iq4_nl, BlockIq4Nl, min: false,
    setup: {
        let ones = _mm256_set1_epi16(1);
        let m4 = _mm256_set1_epi8(0x0F);
        let levels = _mm256_broadcastsi128_si256(load128_of(&KVALUES_IQ4NL));
    },
    isum: |x, y| {
        let v = _mm256_shuffle_epi8(levels, nibbles(&x.qs, m4));
        mul_sum_i8_pairs(v, load256_of(&y.qs), ones)
    },
    ysum: |_y| _mm256_setzero_si256(),
    d: |x| x.d,
    m: |x| x.d,
    nibbles: {
        offset: 0,
        map: |q| _mm256_shuffle_epi8(levels, q),
        dot4: |acc, q, y| _mm256_add_epi32(acc, mul_sum_i8_pairs(q, y, ones)),
    },
);
