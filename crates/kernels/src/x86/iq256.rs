//! The 256-element IQ formats (and the ternary TQ1_0, TQ2_0) against Q8_K on 256-bit
//! registers, shared by the AVX2 and AVX-512 kernel sets (each expands the macros here with its
//! way to scale and accumulate 16-bit pair sums: `vpmaddwd` + `vpaddd`, or one `vpdpwssd`).
//!
//! Each format has a decoder that turns one 32-element group of a block into a [`Group`]: the
//! unsigned magnitudes (grid entries gathered with scalar loads, or IQ4 levels by `vpshufb`),
//! the bytes whose signs the activations take (`vpsignb`: ±1 from the sign bits, or the signed
//! values themselves), the 16-bit scale of each pair lane and, for IQ1_S/IQ1_M, the ±1 of the
//! ±1/8 shift. A superblock's products are then exact integers (`vpmaddubsw` pair sums stay
//! below 2·127·127), reduced to one i32 and multiplied by `d·dy` in the order of the scalar
//! reference (`crate::formats::iquants`), so these kernels and their panels give its bits.

use std::arch::x86_64::*;

use crate::blocks::*;
use crate::formats::iq_grids::*;

/// One decoded 32-element group (see the module notes).
#[derive(Clone, Copy)]
pub(crate) struct Group {
    pub q: __m256i,
    pub sign: __m256i,
    pub scale: __m256i,
    pub shift: __m256i,
}

/// A sign byte spread over 8 bytes: 0xFF (-1) where bit j is set, else 0x01.
const fn sign_bytes(bits: u8) -> u64 {
    let mut v = 0u64;
    let mut j = 0;
    while j < 8 {
        let b: u64 = if bits & (1 << j) != 0 { 0xFF } else { 0x01 };
        v |= b << (8 * j);
        j += 1;
    }
    v
}

/// [`sign_bytes`] of every sign byte.
static SIGN_BYTES: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = sign_bytes(i as u8);
        i += 1;
    }
    t
};

/// [`sign_bytes`] of ggml's `ksigns_iq2xs[i]`: 7 sign bits and an eighth that makes the count of
/// negatives even.
static KSIGN_BYTES: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        let odd = (i as u32).count_ones() % 2 == 1;
        t[i] = sign_bytes(i as u8 | if odd { 0x80 } else { 0 });
        i += 1;
    }
    t
};

#[inline(always)]
fn ksign(bits: u32) -> i64 {
    KSIGN_BYTES[(bits & 127) as usize] as i64
}

// One bounds check and one load each (the byte-by-byte form compiled to four loads, shifts and
// ors per word: 12 instructions a group in IQ2_XXS's decoder).
#[inline(always)]
fn u32_at(b: &[u8], o: usize) -> u32 {
    let w: &[u8; 4] = b[o..o + 4].try_into().expect("a 4-byte range is 4 bytes");
    u32::from_le_bytes(*w)
}

#[inline(always)]
fn u16_at(b: &[u8], o: usize) -> u16 {
    let w: &[u8; 2] = b[o..o + 2].try_into().expect("a 2-byte range is 2 bytes");
    u16::from_le_bytes(*w)
}

/// Scale `lo` for the first 16 elements (pair lanes 0..8), `hi` for the last 16.
#[inline]
#[target_feature(enable = "avx2")]
fn halves(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

#[inline]
#[target_feature(enable = "avx2")]
fn unshifted(q: __m256i, sign: __m256i, scale: __m256i) -> Group {
    Group {
        q,
        sign,
        scale,
        shift: _mm256_setzero_si256(),
    }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_iq4_xs(x: &BlockIq4Xs, ib: usize) -> Group {
    let lo = (x.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    let hi = (u16::from_le_bytes(x.scales_h) >> (2 * ib)) & 3;
    let ls = (lo as i32 | (hi as i32) << 4) - 32;
    // SAFETY: bytes 16ib..16ib + 16 of the 128 in `x.qs` (ib < 8).
    let q = unsafe { crate::x86::simd256::load128(x.qs.as_ptr().add(16 * ib)) };
    let nib = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(q), q),
        _mm256_set1_epi8(0x0F),
    );
    let levels = _mm256_broadcastsi128_si256(crate::x86::simd256::load128_of(&KVALUES_IQ4NL));
    let v = _mm256_shuffle_epi8(levels, nib);
    unshifted(_mm256_abs_epi8(v), v, _mm256_set1_epi16(ls as i16))
}

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_iq2_xxs(x: &BlockIq2Xxs, ib: usize) -> Group {
    let (idx, aux) = (u32_at(&x.qs, 8 * ib), u32_at(&x.qs, 8 * ib + 4));
    let g = |l: u32| IQ2XXS_GRID[((idx >> (8 * l)) & 0xFF) as usize] as i64;
    let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
    let sign = _mm256_set_epi64x(
        ksign(aux >> 21),
        ksign(aux >> 14),
        ksign(aux >> 7),
        ksign(aux),
    );
    let ls = 2 * (aux >> 28) as i16 + 1;
    unshifted(q, sign, _mm256_set1_epi16(ls))
}

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_iq2_xs(x: &BlockIq2Xs, ib: usize) -> Group {
    let e = |l: usize| u16_at(&x.qs, 2 * (4 * ib + l)) as u32;
    let g = |l: usize| IQ2XS_GRID[(e(l) & 511) as usize] as i64;
    let s = |l: usize| ksign(e(l) >> 9);
    let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
    let sign = _mm256_set_epi64x(s(3), s(2), s(1), s(0));
    let sc = x.scales[ib];
    unshifted(
        q,
        sign,
        halves(2 * (sc & 0xF) as i32 + 1, 2 * (sc >> 4) as i32 + 1),
    )
}

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_iq2_s(x: &BlockIq2S, ib: usize) -> Group {
    let qh = x.qh[ib] as usize;
    let g = |l: usize| IQ2S_GRID[x.qs[4 * ib + l] as usize | ((qh << (8 - 2 * l)) & 0x300)] as i64;
    let s = |l: usize| SIGN_BYTES[x.qs[32 + 4 * ib + l] as usize] as i64;
    let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
    let sign = _mm256_set_epi64x(s(3), s(2), s(1), s(0));
    let sc = x.scales[ib];
    unshifted(
        q,
        sign,
        halves(2 * (sc & 0xF) as i32 + 1, 2 * (sc >> 4) as i32 + 1),
    )
}

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_iq3_xxs(x: &BlockIq3Xxs, ib: usize) -> Group {
    let g = |k: usize| IQ3XXS_GRID[x.qs[8 * ib + k] as usize] as i32;
    let q = _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
    let aux = u32_at(&x.qs, 64 + 4 * ib);
    let sign = _mm256_set_epi64x(
        ksign(aux >> 21),
        ksign(aux >> 14),
        ksign(aux >> 7),
        ksign(aux),
    );
    let ls = 2 * (aux >> 28) as i16 + 1;
    unshifted(q, sign, _mm256_set1_epi16(ls))
}

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_iq3_s(x: &BlockIq3S, ib: usize) -> Group {
    let qh = x.qh[ib] as usize;
    // Entry k takes bit k of qh as its ninth index bit.
    let g = |k: usize| IQ3S_GRID[x.qs[8 * ib + k] as usize | (((qh >> k) & 1) << 8)] as i32;
    let q = _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
    let s = |l: usize| SIGN_BYTES[x.signs[4 * ib + l] as usize] as i64;
    let sign = _mm256_set_epi64x(s(3), s(2), s(1), s(0));
    let ls = 2 * ((x.scales[ib / 2] >> (4 * (ib % 2))) & 0xF) as i16 + 1;
    unshifted(q, sign, _mm256_set1_epi16(ls))
}

/// TQ2_0: group ib holds bits 2(ib % 4).. of the 32 bytes `qs[32(ib / 4)..]`, stored as q + 1.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_tq2_0(x: &BlockTq2_0, ib: usize) -> Group {
    // SAFETY: bytes 32(ib / 4)..+32 of the 64 in `x.qs` (ib < 8).
    let q = unsafe { crate::x86::simd256::load256(x.qs.as_ptr().add(32 * (ib / 4))) };
    let shifted = _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (ib % 4) as i32));
    let w = _mm256_sub_epi8(
        _mm256_and_si256(shifted, _mm256_set1_epi8(3)),
        _mm256_set1_epi8(1),
    );
    unshifted(_mm256_abs_epi8(w), w, _mm256_set1_epi16(1))
}

/// The trits `((b·p mod 256)·3) >> 8` of the bytes `b` with multipliers `p` (powers of three),
/// minus one. AVX2 has no byte multiply: even and odd bytes go through 16-bit lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn trits_minus_one(b: __m256i, p: __m256i) -> __m256i {
    let lo = _mm256_set1_epi16(0x00FF);
    let hi = _mm256_set1_epi16(0xFF00u16 as i16);
    let even = _mm256_and_si256(_mm256_mullo_epi16(b, p), lo);
    let odd = _mm256_slli_epi16::<8>(_mm256_mullo_epi16(
        _mm256_srli_epi16::<8>(b),
        _mm256_srli_epi16::<8>(p),
    ));
    let q = _mm256_or_si256(even, odd);
    // (q·3) >> 8 per byte: the high half of q·768 for even bytes, of (q·256)·3 for odd ones.
    let t_even = _mm256_mulhi_epu16(_mm256_and_si256(q, lo), _mm256_set1_epi16(0x0300));
    let t_odd = _mm256_mulhi_epu16(_mm256_and_si256(q, hi), _mm256_set1_epi16(3));
    let t = _mm256_or_si256(t_even, _mm256_slli_epi16::<8>(t_odd));
    _mm256_sub_epi8(t, _mm256_set1_epi8(1))
}

/// TQ1_0 (layout in `crate::formats::ternary`): groups 0..5 are trit n = ib of `qs[0..32]`;
/// groups 5 and 6 trits 2(ib − 5) and 2(ib − 5) + 1 of `qs[32..48]`; group 7 trit 4 of
/// `qs[32..48]`, then trits 0..4 of the four `qh` bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_tq1_0(x: &BlockTq1_0, ib: usize) -> Group {
    const POW3: [i8; 5] = [1, 3, 9, 27, 81];
    // SAFETY: bytes 32..48 of the 48 in `x.qs`.
    let tail = unsafe { crate::x86::simd256::load128(x.qs.as_ptr().add(32)) };
    let (b, p) = match ib {
        // SAFETY: the 32 bytes `qs[0..32]`.
        0..5 => (
            unsafe { crate::x86::simd256::load256(x.qs.as_ptr()) },
            _mm256_set1_epi8(POW3[ib]),
        ),
        5 | 6 => {
            let n = 2 * (ib - 5);
            (
                _mm256_set_m128i(tail, tail),
                _mm256_set_m128i(_mm_set1_epi8(POW3[n + 1]), _mm_set1_epi8(POW3[n])),
            )
        }
        _ => {
            let qh = _mm_set1_epi32(i32::from_le_bytes(x.qh));
            let p_qh = _mm_setr_epi8(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27);
            (
                _mm256_set_m128i(qh, tail),
                _mm256_set_m128i(p_qh, _mm_set1_epi8(POW3[4])),
            )
        }
    };
    let w = trits_minus_one(b, p);
    unshifted(_mm256_abs_epi8(w), w, _mm256_set1_epi16(1))
}

/// `-1` or `1` in every byte.
#[inline(always)]
fn unit(negative: bool) -> i64 {
    if negative { -1 } else { 0x0101_0101_0101_0101 }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_iq1_s(x: &BlockIq1S, ib: usize) -> Group {
    let qh = u16_at(&x.qh, 2 * ib) as usize;
    let g = |l: usize| IQ1S_GRID[x.qs[4 * ib + l] as usize | (((qh >> (3 * l)) & 7) << 8)] as i64;
    // Grid values are -1, 0 or 1: their magnitudes, and the activations take their signs.
    let v = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
    let ls = 2 * ((qh >> 12) & 7) as i16 + 1;
    Group {
        q: _mm256_abs_epi8(v),
        sign: v,
        scale: _mm256_set1_epi16(ls),
        shift: _mm256_set1_epi64x(unit(qh & 0x8000 != 0)),
    }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn group_iq1_m(x: &BlockIq1M, ib: usize) -> Group {
    let (h0, h1) = (x.qh[2 * ib] as usize, x.qh[2 * ib + 1] as usize);
    let qs = &x.qs[4 * ib..4 * ib + 4];
    // Each qh byte: bits 0..3 and 4..7 are the high index bits of two 8-element groups, bits 3
    // and 7 their shift signs.
    let g = [
        IQ1S_GRID[qs[0] as usize | ((h0 << 8) & 0x700)],
        IQ1S_GRID[qs[1] as usize | ((h0 << 4) & 0x700)],
        IQ1S_GRID[qs[2] as usize | ((h1 << 8) & 0x700)],
        IQ1S_GRID[qs[3] as usize | ((h1 << 4) & 0x700)],
    ]
    .map(|e| e as i64);
    let v = _mm256_set_epi64x(g[3], g[2], g[1], g[0]);
    let sc = u16_at(&x.scales, 2 * (ib / 2));
    let s = |o: usize| 2 * ((sc >> (6 * (ib % 2) + o)) & 7) as i32 + 1;
    Group {
        q: _mm256_abs_epi8(v),
        sign: v,
        scale: halves(s(0), s(3)),
        shift: _mm256_set_epi64x(
            unit(h1 & 0x80 != 0),
            unit(h1 & 0x08 != 0),
            unit(h0 & 0x80 != 0),
            unit(h0 & 0x08 != 0),
        ),
    }
}

/// Defines `fn $name(&Block) -> f32`: the block's f16 `d`, converted with F16C.
macro_rules! f16_d {
    ($($name:ident: $blk:ty),+) => {$(
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        pub(crate) fn $name(x: &$blk) -> f32 {
            crate::x86::simd256::f16_scalar(&x.d)
        }
    )+};
}
f16_d!(d_iq4_xs: BlockIq4Xs, d_iq2_xxs: BlockIq2Xxs, d_iq2_xs: BlockIq2Xs, d_iq2_s: BlockIq2S,
    d_iq3_xxs: BlockIq3Xxs, d_iq3_s: BlockIq3S, d_iq1_s: BlockIq1S, d_tq1_0: BlockTq1_0,
    d_tq2_0: BlockTq2_0);

/// The f16 block scale of an IQ1_M block (as `crate::formats::iquants::iq1m_d`), converted
/// with F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn d_iq1_m(x: &BlockIq1M) -> f32 {
    let sc = |i: usize| u16_at(&x.scales, 2 * i);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00F0) | ((sc(2) >> 4) & 0x0F00) | (sc(3) & 0xF000);
    crate::x86::simd256::f16_scalar(&bits.to_le_bytes())
}

/// `iq_lanes!(groups, q8, shifted, accumulate)`: the exact integer dot of one superblock in 8
/// lanes (to be summed): `Σ scale·Σ w·a`, or for the IQ1 formats `8·that + Σ scale·Σ shift·a`
/// (the shift is ±1/8). `groups(ib)` gives group ib's [`Group`], `q8` points at the 256
/// activation bytes.
macro_rules! iq_lanes {
    ($groups:expr, $q8:expr, $shifted:expr, $acc:path) => {{
        let zero = _mm256_setzero_si256();
        let ones = _mm256_set1_epi8(1);
        // Two chains of accumulation (even and odd groups), each in a named register: an array
        // indexed by `ib % 2` stayed in memory, and its store-to-load latency bounded the loop.
        let (mut even, mut odd, mut shifted) = (zero, zero, zero);
        for pair in 0..4 {
            for ib in [2 * pair, 2 * pair + 1] {
                let g: $crate::x86::iq256::Group = $groups(ib);
                // SAFETY: bytes 32ib..32ib + 32 of the 256 activation bytes at `$q8` (ib < 8).
                let a8 = unsafe { $crate::x86::simd256::load256($q8.add(32 * ib)) };
                let p = _mm256_maddubs_epi16(g.q, _mm256_sign_epi8(a8, g.sign));
                if ib % 2 == 0 {
                    even = $acc(even, p, g.scale);
                } else {
                    odd = $acc(odd, p, g.scale);
                }
                if $shifted {
                    let p = _mm256_maddubs_epi16(ones, _mm256_sign_epi8(a8, g.shift));
                    shifted = $acc(shifted, p, g.scale);
                }
            }
        }
        let lanes = _mm256_add_epi32(even, odd);
        if $shifted {
            _mm256_add_epi32(_mm256_slli_epi32::<3>(lanes), shifted)
        } else {
            lanes
        }
    }};
}
pub(crate) use iq_lanes;

/// `iq_dot!(n, w, a, Block, group, d, shifted, factor, accumulate)`: a whole dot kernel body.
macro_rules! iq_dot {
    ($n:expr, $w:expr, $a:expr, $blk:ty, $group:path, $d:path, $shifted:expr, $factor:expr,
     $acc:path) => {{
        use $crate::blocks::*;
        let nb = $n / QK_K;
        let (w, a): (&[$blk], &[BlockQ8K]) = (bytemuck::cast_slice($w), bytemuck::cast_slice($a));
        let mut sum = 0f32;
        for (x, y) in w[..nb].iter().zip(&a[..nb]) {
            let q8 = y.qs.as_ptr() as *const u8;
            let lanes = $crate::x86::iq256::iq_lanes!(|ib| $group(x, ib), q8, $shifted, $acc);
            let total = $crate::x86::simd256::hsum_epi32(lanes);
            sum += $d(x) * y.d() * total as f32;
        }
        $factor * sum
    }};
}
pub(crate) use iq_dot;

/// Defines `unsafe fn $name<R, T>`, a panel tile (see `crate::x86::tiles`) for one IQ format
/// (T ≤ 8): each row's groups are decoded once per superblock (the grid gathers are most of the
/// work) and used for every token; the T tokens' integer lanes are summed together (`hsums`)
/// and the single-row kernel's float steps run with one token per lane.
macro_rules! iq_tile {
    ($name:ident, $features:literal, $blk:ty, $group:path, $d:path, $shifted:expr, $factor:expr,
     $acc:path) => {
        /// # Safety
        /// Each `w[r]` points at `nb` readable weight blocks and each `a[t]` at `nb` Q8_K blocks.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            nb: usize,
            w: [*const u8; R],
            a: [*const u8; T],
        ) -> [[f32; T]; R] {
            use $crate::blocks::*;
            use $crate::x86::iq256::*;
            let w = w.map(|p| p as *const $blk);
            let a = a.map(|p| p as *const BlockQ8K);
            let zero = _mm256_setzero_si256();
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                // SAFETY: block b < nb of every token is readable (the contract above); the
                // blocks have alignment 1 and are plain bytes, so a reference to one is valid.
                let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
                let dy: [f32; 8] = std::array::from_fn(|t| if t < T { ys[t].d() } else { 0.0 });
                // SAFETY: the load reads the 8 floats of `dy`.
                let dy = unsafe { _mm256_loadu_ps(dy.as_ptr()) };
                for r in 0..R {
                    // SAFETY: as for `ys`, for the rows.
                    let x: &$blk = unsafe { &*w[r].add(b) };
                    let mut groups = [Group {
                        q: zero,
                        sign: zero,
                        scale: zero,
                        shift: zero,
                    }; 8];
                    for ib in 0..8 {
                        groups[ib] = $group(x, ib);
                    }
                    let mut tot = [zero; T];
                    for t in 0..T {
                        let q8 = ys[t].qs.as_ptr() as *const u8;
                        tot[t] = iq_lanes!(|ib: usize| groups[ib], q8, $shifted, $acc);
                    }
                    let tot = _mm256_cvtepi32_ps($crate::x86::simd256::hsums(&tot));
                    let dd = _mm256_mul_ps(_mm256_set1_ps($d(x)), dy);
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dd, tot));
                }
            }
            let factor = _mm256_set1_ps($factor);
            acc.map(|v| $crate::x86::simd256::lanes(_mm256_mul_ps(factor, v)))
        }
    };
}
pub(crate) use iq_tile;

/// `iq_kernel_set!("features", accumulate, [token tile sizes])`: for every 256-element IQ format,
/// its dot product `dot_<format>` (a `crate::formats::DotFn`) and its panel kernel
/// `panel_<format>` (a `crate::panel::PanelFn`), compiled for `features`.
macro_rules! iq_kernel_set {
    ($features:literal, $acc:path, [$($t:literal),+]) => {
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_iq4_xs, dot_iq4_xs_impl, panel_iq4_xs, iq4_xs_tile, iq4_xs_dots,
            Iq4Xs, BlockIq4Xs, group_iq4_xs, d_iq4_xs, false, 1.0);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_iq2_xxs, dot_iq2_xxs_impl, panel_iq2_xxs, iq2_xxs_tile, iq2_xxs_dots,
            Iq2Xxs, BlockIq2Xxs, group_iq2_xxs, d_iq2_xxs, false, 0.125);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_iq2_xs, dot_iq2_xs_impl, panel_iq2_xs, iq2_xs_tile, iq2_xs_dots,
            Iq2Xs, BlockIq2Xs, group_iq2_xs, d_iq2_xs, false, 0.125);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_iq2_s, dot_iq2_s_impl, panel_iq2_s, iq2_s_tile, iq2_s_dots,
            Iq2S, BlockIq2S, group_iq2_s, d_iq2_s, false, 0.125);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_iq3_xxs, dot_iq3_xxs_impl, panel_iq3_xxs, iq3_xxs_tile, iq3_xxs_dots,
            Iq3Xxs, BlockIq3Xxs, group_iq3_xxs, d_iq3_xxs, false, 0.25);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_iq3_s, dot_iq3_s_impl, panel_iq3_s, iq3_s_tile, iq3_s_dots,
            Iq3S, BlockIq3S, group_iq3_s, d_iq3_s, false, 1.0);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_iq1_s, dot_iq1_s_impl, panel_iq1_s, iq1_s_tile, iq1_s_dots,
            Iq1S, BlockIq1S, group_iq1_s, d_iq1_s, true, 0.125);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_iq1_m, dot_iq1_m_impl, panel_iq1_m, iq1_m_tile, iq1_m_dots,
            Iq1M, BlockIq1M, group_iq1_m, d_iq1_m, true, 0.125);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_tq1_0, dot_tq1_0_impl, panel_tq1_0, tq1_0_tile, tq1_0_dots,
            Tq1_0, BlockTq1_0, group_tq1_0, d_tq1_0, false, 1.0);
        $crate::x86::iq256::iq_kernel_set!(@one $features, $acc, [$($t),+],
            dot_tq2_0, dot_tq2_0_impl, panel_tq2_0, tq2_0_tile, tq2_0_dots,
            Tq2_0, BlockTq2_0, group_tq2_0, d_tq2_0, false, 1.0);
    };
    (@one $features:literal, $acc:path, [$($t:literal),+], $dot:ident, $imp:ident, $panel:ident,
     $tile:ident, $dots:ident, $ty:ident, $blk:ident, $group:ident, $d:ident, $shifted:expr,
     $factor:expr) => {
        $crate::x86::dot_wrapper!(pub $dot => $imp, gguf::GgmlType::$ty, gguf::GgmlType::Q8K);

        #[target_feature(enable = $features)]
        fn $imp(n: usize, w: &[u8], a: &[u8]) -> f32 {
            use $crate::x86::iq256::*;
            $crate::x86::iq256::iq_dot!(n, w, a, $blk, $group, $d, $shifted, $factor, $acc)
        }

        $crate::x86::iq256::iq_tile!($tile, $features, $blk, $group, $d,
            $shifted, $factor, $acc);
        $crate::x86::tiles::dot_tile!($dots, $features, $imp, $crate::blocks::$blk,
            $crate::blocks::BlockQ8K, $crate::blocks::QK_K);
        $crate::x86::tiles::panel_kernel!(pub $panel, $features, block = $crate::blocks::QK_K,
            batch = $tile(1, [$($t),+]), single = $dots(1));
    };
}
pub(crate) use iq_kernel_set;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_tables_match_ggml_ksigns() {
        for (i, &k) in KSIGNS_IQ2XS.iter().enumerate() {
            assert_eq!(KSIGN_BYTES[i], SIGN_BYTES[k as usize], "ksigns[{i}]");
        }
    }
}
