//! K-quants against Q8_K activations: 64 quants per 512-bit register, laid out to match 64
//! contiguous activation bytes, so activations are plain loads. Byte products are pair-summed
//! with `vpmaddubsw` (unsigned quants ≤ 63, so no i16 saturation), then scaled by the sub-block
//! scale and accumulated in one `vpdpwssd`.
//!
//! Packed fields are spread with a 256-bit broadcast and a variable 16-bit shift (`vpsrlvw`),
//! high bits are added under a `vptestmb` mask. Offsets (Q3_K's 4, Q6_K's 32) and mins (Q2_K,
//! Q4_K, Q5_K) are folded in once per superblock through the activation sums `bsums`; for
//! Q2_K/Q4_K/Q5_K the scale and min terms share one conversion and one FMA.

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::{bcast256, f16_scalar, load128, load256, load512};
use crate::blocks::*;
use crate::x86::dot_wrapper;
use crate::x86::scales::{unpack_k4, unpack_q3k};

dot_wrapper!(pub dot_q2_k => dot_q2_k_impl, GgmlType::Q2K, GgmlType::Q8K);
dot_wrapper!(pub dot_q3_k => dot_q3_k_impl, GgmlType::Q3K, GgmlType::Q8K);
dot_wrapper!(pub dot_q4_k => dot_q4_k_impl, GgmlType::Q4K, GgmlType::Q8K);
dot_wrapper!(pub dot_q5_k => dot_q5_k_impl, GgmlType::Q5K, GgmlType::Q8K);
dot_wrapper!(pub dot_q6_k => dot_q6_k_impl, GgmlType::Q6K, GgmlType::Q8K);
dot_wrapper!(pub dot_q8_k => dot_q8_k_impl, GgmlType::Q8K, GgmlType::Q8K);

/// 32 lanes of i16 in four runs of 8 taking source lanes `s, s+1, s+2, s+3` (`vpermw` index).
const fn quarters(s: i16) -> [i16; 32] {
    let mut out = [0i16; 32];
    let mut i = 0;
    while i < 32 {
        out[i] = s + (i / 8) as i16;
        i += 1;
    }
    out
}

/// Q3_K and Q6_K register j covers sub-blocks 4j..4j+4, one per 128-bit lane.
static SCALE_QUARTERS: [[i16; 32]; 4] = [quarters(0), quarters(4), quarters(8), quarters(12)];

/// `vpshufb` control making 16-bit lanes of source byte `b[l]` in 128-bit lane l (zero-extended).
const fn lane_bytes(b: [u8; 4]) -> [u8; 64] {
    let mut out = [0x80u8; 64];
    let mut i = 0;
    while i < 64 {
        out[i] = b[i / 16];
        i += 2;
    }
    out
}

/// Q2_K register j covers groups 4j..4j+4.
static Q2K_SCALE: [[u8; 64]; 4] = [
    lane_bytes([0, 1, 2, 3]),
    lane_bytes([4, 5, 6, 7]),
    lane_bytes([8, 9, 10, 11]),
    lane_bytes([12, 13, 14, 15]),
];

/// Q4_K/Q5_K register g holds sub-block 2g (low half) and 2g+1 (high half).
static K4_SCALE: [[u8; 64]; 4] = [
    lane_bytes([0, 0, 1, 1]),
    lane_bytes([2, 2, 3, 3]),
    lane_bytes([4, 4, 5, 5]),
    lane_bytes([6, 6, 7, 7]),
];

/// Q4_K/Q5_K mins (bytes 8..16 of the unpacked scales) each repeated over the two 16-bit bsums
/// of its 32 elements: `[m0, m0, m1, m1, m2, m2, m3, m3 | m4, m4, ... m7, m7]`.
static K4_MINS: [u8; 32] = {
    let mut t = [0x80u8; 32];
    let mut i = 0;
    while i < 16 {
        t[2 * i] = 8 + (i / 2) as u8;
        i += 1;
    }
    t
};

/// `[a as i16 ×16 | b as i16 ×16]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn halves_epi16(a: i16, b: i16) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi16(a), _mm256_set1_epi16(b))
}

/// `[a ×32 | b ×32]` bytes.
#[inline]
#[target_feature(enable = "avx512f")]
fn halves_epi8(a: u8, b: u8) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi8(a as i8), _mm256_set1_epi8(b as i8))
}

/// Byte selectors for bits 2j (low half) and 2j+1 (high half): Q3_K's hmask bits of register j
/// and Q5_K's qh bits of group j.
#[inline]
#[target_feature(enable = "avx512f")]
fn bit_pairs() -> [__m512i; 4] {
    [
        halves_epi8(1, 2),
        halves_epi8(4, 8),
        halves_epi8(16, 32),
        halves_epi8(64, 128),
    ]
}

/// Constants to scale an integer sum and a min sum in one conversion and FMA.
struct DMin {
    /// `vpshufb` control: f16 `d` (bytes 0..2) in the low 128-bit lane, `dmin` in the high.
    spread: __m256i,
    /// Sign bit of the f16s in the high lane.
    neg: __m256i,
}

impl DMin {
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn new() -> DMin {
        DMin {
            spread: _mm256_setr_epi64x(
                0x0100_0100_0100_0100,
                0x0100_0100_0100_0100,
                0x0302_0302_0302_0302,
                0x0302_0302_0302_0302,
            ),
            neg: _mm256_setr_epi64x(0, 0, 0x8000_8000_8000_8000u64 as i64, 0x8000_8000_8000_8000u64 as i64),
        }
    }

    /// `acc + d·dy·Σisum − dmin·dy·Σmsum` lane-wise: lanes 0..8 convert the two halves of
    /// `isum` added, lanes 8..16 `msum`. `dm` points at the f16 pair `[d, dmin]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    unsafe fn fma(&self, acc: __m512, isum: __m512i, msum: __m256i, dm: *const u8, dy: f32) -> __m512 {
        let s = _mm256_add_epi32(
            _mm512_castsi512_si256(isum),
            _mm512_extracti64x4_epi64::<1>(isum),
        );
        let v = _mm512_cvtepi32_ps(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(s), msum));
        let dm = _mm256_set1_epi32(unsafe { (dm as *const i32).read_unaligned() });
        let dm = _mm256_xor_si256(_mm256_shuffle_epi8(dm, self.spread), self.neg);
        let scale = _mm512_mul_ps(_mm512_cvtph_ps(dm), _mm512_set1_ps(dy));
        _mm512_fmadd_ps(scale, v, acc)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q2_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ2K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let m3 = _mm512_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0F);
    // Register j = 2h + k holds shifts 2k (low half) and 2k+1 (high half) of qs half h, which
    // are groups 4j..4j+4 and activations 64j..64j+64.
    let shifts = [halves_epi16(0, 2), halves_epi16(4, 6)];
    let ctrl = unsafe { Q2K_SCALE.each_ref().map(|c| load512(c.as_ptr())) };
    let dmin = DMin::new();
    let mut acc = _mm512_setzero_ps();
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        let raw = unsafe { load128(x.scales.as_ptr()) };
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(raw), m4));
        let msum = _mm256_madd_epi16(mins, unsafe { load256(y.bsums.as_ptr()) });
        let sc = _mm512_broadcast_i32x4(_mm_and_si128(raw, m4));
        let q = unsafe { [bcast256(x.qs.as_ptr()), bcast256(x.qs.as_ptr().add(32))] };
        let q8 = y.qs.as_ptr() as *const u8;
        let mut sum = [_mm512_setzero_si512(); 2];
        for j in 0..4 {
            let u = _mm512_and_si512(_mm512_srlv_epi16(q[j / 2], shifts[j % 2]), m3);
            let p = _mm512_maddubs_epi16(u, unsafe { load512(q8.add(64 * j)) });
            let scale = _mm512_shuffle_epi8(sc, ctrl[j]);
            sum[j % 2] = _mm512_dpwssd_epi32(sum[j % 2], p, scale);
        }
        let isum = _mm512_add_epi32(sum[0], sum[1]);
        // d and dmin are adjacent at offset 80.
        let dm = unsafe { (x as *const BlockQ2K as *const u8).add(80) };
        acc = unsafe { dmin.fma(acc, isum, msum, dm, y.d()) };
    }
    _mm512_reduce_add_ps(acc)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q3_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ3K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let m3 = _mm512_set1_epi8(3);
    let k4 = _mm512_set1_epi8(4);
    // Same register layout as Q2_K; the high bit of register j's halves is hmask bit 2j, 2j+1.
    let shifts = [halves_epi16(0, 2), halves_epi16(4, 6)];
    let bits = bit_pairs();
    let idx = unsafe { SCALE_QUARTERS.each_ref().map(|i| load512(i.as_ptr() as *const u8)) };
    let mut acc = 0f32;
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        // The 16 bytes ending at the block's end: scales at 2..14.
        let tail = unsafe { load128((x as *const BlockQ3K as *const u8).add(94)) };
        let sc16 = _mm256_cvtepi8_epi16(unpack_q3k(tail));
        // Quants are `lo + 4·hbit − 4`: we multiply `lo + 4·hbit` and subtract
        // 4·Σ scale·(sum of the 16 activations).
        let bias = _mm256_madd_epi16(sc16, unsafe { load256(y.bsums.as_ptr()) });
        let sc = _mm512_castsi256_si512(sc16);
        let hm = unsafe { bcast256(x.hmask.as_ptr()) };
        let q = unsafe { [bcast256(x.qs.as_ptr()), bcast256(x.qs.as_ptr().add(32))] };
        let q8 = y.qs.as_ptr() as *const u8;
        let mut sum = [_mm512_setzero_si512(); 2];
        for j in 0..4 {
            let lo = _mm512_and_si512(_mm512_srlv_epi16(q[j / 2], shifts[j % 2]), m3);
            let u = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hm, bits[j]), lo, k4);
            let p = _mm512_maddubs_epi16(u, unsafe { load512(q8.add(64 * j)) });
            let scale = _mm512_permutexvar_epi16(idx[j], sc);
            sum[j % 2] = _mm512_dpwssd_epi32(sum[j % 2], p, scale);
        }
        let isum = _mm512_sub_epi32(
            _mm512_add_epi32(sum[0], sum[1]),
            _mm512_zextsi256_si512(_mm256_slli_epi32::<2>(bias)),
        );
        // Reduced in integers: the bias sits in other lanes than the products it cancels.
        let isum = _mm512_reduce_add_epi32(isum);
        acc += unsafe { f16_scalar(x.d.as_ptr()) } * y.d() * isum as f32;
    }
    acc
}

/// Q4_K and Q5_K: register g holds group g's low nibbles (sub-block 2g, activations 64g..+32)
/// then its high nibbles (sub-block 2g+1); `$fifth(g, v)` adds Q5_K's fifth bits.
macro_rules! q4k_q5k {
    ($bty:ty, $n:expr, $w:expr, $a:expr, |$x:ident, $g:ident, $v:ident| $fifth:expr) => {{
        let nb = $n / QK_K;
        let (w, a): (&[$bty], &[BlockQ8K]) = (bytemuck::cast_slice($w), bytemuck::cast_slice($a));
        let m4 = _mm512_set1_epi8(0x0F);
        let shift = halves_epi16(0, 4);
        let ctrl = unsafe { K4_SCALE.each_ref().map(|c| load512(c.as_ptr())) };
        let mins_ctrl = unsafe { load256(K4_MINS.as_ptr()) };
        let dmin = DMin::new();
        let mut acc = _mm512_setzero_ps();
        for ($x, y) in w[..nb].iter().zip(&a[..nb]) {
            // The first 16 bytes: d, dmin and the 12 scale bytes.
            let base = $x as *const $bty as *const u8;
            let u = _mm512_broadcast_i32x4(unpack_k4(unsafe { load128(base) }));
            let mins = _mm256_shuffle_epi8(_mm512_castsi512_si256(u), mins_ctrl);
            let msum = _mm256_madd_epi16(mins, unsafe { load256(y.bsums.as_ptr()) });
            let q8 = y.qs.as_ptr() as *const u8;
            let mut sum = [_mm512_setzero_si512(); 2];
            for $g in 0..4 {
                let q = unsafe { bcast256($x.qs.as_ptr().add(32 * $g)) };
                let $v = _mm512_and_si512(_mm512_srlv_epi16(q, shift), m4);
                let p = _mm512_maddubs_epi16($fifth, unsafe { load512(q8.add(64 * $g)) });
                let scale = _mm512_shuffle_epi8(u, ctrl[$g]);
                sum[$g % 2] = _mm512_dpwssd_epi32(sum[$g % 2], p, scale);
            }
            let isum = _mm512_add_epi32(sum[0], sum[1]);
            acc = unsafe { dmin.fma(acc, isum, msum, base, y.d()) };
        }
        _mm512_reduce_add_ps(acc)
    }};
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q4_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q4k_q5k!(BlockQ4K, n, w, a, |x, g, v| v)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q5_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let k16 = _mm512_set1_epi8(16);
    let bits = bit_pairs();
    q4k_q5k!(BlockQ5K, n, w, a, |x, g, v| {
        // Bits 2g and 2g+1 of qh[l] are the fifth bits of group g's low and high nibbles.
        let qh = unsafe { bcast256(x.qh.as_ptr()) };
        _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(qh, bits[g]), v, k16)
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q6_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ6K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    // Per 256-bit half: shift the high bits of k0|k1 left by 4|2 and of k2|k3 right by 0|2.
    let shl = halves_epi16(4, 2);
    let shr = halves_epi16(0, 2);
    let idx = unsafe { SCALE_QUARTERS.each_ref().map(|i| load512(i.as_ptr() as *const u8)) };
    let mut acc = 0f32;
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        let scales16 = _mm256_cvtepi8_epi16(unsafe { load128(x.scales.as_ptr() as *const u8) });
        let bsums = unsafe { load256(y.bsums.as_ptr()) };
        // The quants are stored biased by 32: subtract 32·Σ scale·(sum of the 16 activations).
        let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(scales16, bsums));
        let sc = _mm512_castsi256_si512(scales16);
        let q8 = y.qs.as_ptr() as *const u8;
        let mut sum = [_mm512_setzero_si512(); 2];
        for half in 0..2 {
            let ql = unsafe { load512(x.ql.as_ptr().add(64 * half)) };
            let qh = unsafe { bcast256(x.qh.as_ptr().add(32 * half)) };
            let k01 = _mm512_or_si512(
                _mm512_and_si512(ql, m4),
                _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30),
            );
            let k23 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30),
            );
            let (a01, a23) = unsafe {
                (
                    load512(q8.add(128 * half)),
                    load512(q8.add(128 * half + 64)),
                )
            };
            let s01 = _mm512_permutexvar_epi16(idx[2 * half], sc);
            let s23 = _mm512_permutexvar_epi16(idx[2 * half + 1], sc);
            sum[0] = _mm512_dpwssd_epi32(sum[0], _mm512_maddubs_epi16(k01, a01), s01);
            sum[1] = _mm512_dpwssd_epi32(sum[1], _mm512_maddubs_epi16(k23, a23), s23);
        }
        let isum = _mm512_sub_epi32(
            _mm512_add_epi32(sum[0], sum[1]),
            _mm512_zextsi256_si512(bias),
        );
        // Reduced in integers: the bias sits in other lanes than the products it cancels, and
        // converting lanes first would round terms much larger than the result.
        let isum = _mm512_reduce_add_epi32(isum);
        acc += unsafe { f16_scalar(x.d.as_ptr()) } * y.d() * isum as f32;
    }
    acc
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q8_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ8K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let zero = _mm512_setzero_si512();
    let mut acc = _mm512_setzero_ps();
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        let (xq, yq) = (x.qs.as_ptr() as *const u8, y.qs.as_ptr() as *const u8);
        let mut sum = [zero; 2];
        for j in 0..4 {
            // |x| read as unsigned is exact even for -128; the sign moves onto y (activations
            // never hold -128). Making x unsigned as x + 128 and removing 128·Σy through bsums
            // would save two operations but leave lanes much larger than the result.
            let (xv, yv) = unsafe { (load512(xq.add(64 * j)), load512(yq.add(64 * j))) };
            let yv = _mm512_mask_sub_epi8(yv, _mm512_movepi8_mask(xv), zero, yv);
            sum[j % 2] = _mm512_dpbusd_epi32(sum[j % 2], _mm512_abs_epi8(xv), yv);
        }
        let d = _mm512_set1_ps(x.d() * y.d());
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(sum[0], sum[1])), acc);
    }
    _mm512_reduce_add_ps(acc)
}
