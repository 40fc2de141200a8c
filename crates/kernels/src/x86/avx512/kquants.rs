//! K-quants against Q8_K activations. Q2_K to Q6_K use the 256-bit loops of
//! `crate::x86::kq256` with the sub-block scale applied and accumulated in one `vpdpwssd`
//! (VNNI on 256-bit registers, AVX-512VL); Q8_K uses 512-bit `vpdpbusd`.
//!
//! Measured on Zen 4 (one thread, L2-resident 768×2048): the 512-bit versions of Q2_K…Q6_K
//! (two groups per register, `vpsrlvw`/`vptestmb` unpacking) reached 13.3, 12.1, 19.7, 20.1
//! and 26.8 GB/s; these reach 15.4, 13.4, 25.7, 26.0 and 29.1.

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::load512;
use crate::blocks::*;
use crate::x86::dot_wrapper;
use crate::x86::kq256::{ChunkSums, SuperblockSums, q2k_256, q3k_256, q4k_256, q5k_256, q6k_256};

dot_wrapper!(pub dot_q2_k => dot_q2_k_impl, GgmlType::Q2K, GgmlType::Q8K);
dot_wrapper!(pub dot_q3_k => dot_q3_k_impl, GgmlType::Q3K, GgmlType::Q8K);
dot_wrapper!(pub dot_q4_k_exact => dot_q4_k_exact_impl, GgmlType::Q4K, GgmlType::Q8K);
dot_wrapper!(pub dot_q5_k => dot_q5_k_impl, GgmlType::Q5K, GgmlType::Q8K);
dot_wrapper!(pub dot_q6_k => dot_q6_k_impl, GgmlType::Q6K, GgmlType::Q8K);
dot_wrapper!(pub dot_q8_k => dot_q8_k_impl, GgmlType::Q8K, GgmlType::Q8K);

/// `acc + Σ pairs p·scale` in one `vpdpwssd` (256-bit). Inline assembly because LLVM rewrites
/// most `_mm256_dpwssd_epi32` calls here into `vpmaddwd` + `vpaddd` (seen in the generated code),
/// which measured ~8% slower for Q4_K on Zen 4.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2")]
pub(super) fn dpwssd(acc: __m256i, p: __m256i, scale: __m256i) -> __m256i {
    let mut acc = acc;
    // SAFETY: `vpdpwssd` on ymm registers needs AVX512-VNNI and AVX512VL, which this function
    // is compiled for; it only reads and writes the three registers named (no memory, stack or
    // flags, as the options say).
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {p}, {s}",
            acc = inout(ymm_reg) acc,
            p = in(ymm_reg) p,
            s = in(ymm_reg) scale,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) fn dot_q2_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q2k_256!(n, w, a, dpwssd)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) fn dot_q3_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q3k_256!(n, w, a, dpwssd)
}

/// Q4_K in the scalar reference's arithmetic (`kq256::SuperblockSums`): the AMX level's dot.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) fn dot_q4_k_exact_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q4k_256!(n, w, a, dpwssd, SuperblockSums)
}

/// The chunk-dots kernel of [`dot_q4_k_exact`] (`crate::panel::ChunkDotsFn`): a row's
/// superblocks in order through [`ChunkSums`], each chunk's value that dot's bits.
///
/// # Safety
/// As for [`crate::panel::ChunkDotsFn`]; the chunks are contiguous (`w_bytes` and `a_bytes` are
/// `k / 256` blocks, so chunk c starts at block c·k/256 of the row and of the activations).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn chunks_q4_k_exact(c: &crate::panel::ChunkDots) {
    use crate::x86::kq256::prelude::*;
    let per_chunk = c.k / QK_K;
    let total = per_chunk * c.chunks;
    let w = c.w as *const BlockQ4K;
    let a = c.a as *const BlockQ8K;
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: `out` holds `chunks` values (the contract above), as many as complete here.
    let mut sums = unsafe { ChunkSums::new(per_chunk, c.out) };
    for b in 0..total {
        // SAFETY: block b < total of the row and of the activations is readable (the chunks
        // are contiguous and readable by the contract); the blocks are plain bytes of
        // alignment 1.
        let (x, y) = unsafe { (&*w.add(b), &*a.add(b)) };
        let (isum, msum) = crate::x86::kq256::q4k_q5k_body!(x, y, m4, dpwssd, |g, lo, hi| (lo, hi));
        sums.push(isum, msum, y.d(), x.d, x.dmin);
    }
    sums.finish();
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) fn dot_q5_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q5k_256!(n, w, a, dpwssd)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) fn dot_q6_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q6k_256!(n, w, a, dpwssd)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn dot_q8_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
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
            // SAFETY: bytes 64j..64j + 64 of the 256 in `x.qs` and in `y.qs` (j < 4).
            let (xv, yv) = unsafe { (load512(xq.add(64 * j)), load512(yq.add(64 * j))) };
            let yv = _mm512_mask_sub_epi8(yv, _mm512_movepi8_mask(xv), zero, yv);
            sum[j % 2] = _mm512_dpbusd_epi32(sum[j % 2], _mm512_abs_epi8(xv), yv);
        }
        let d = _mm512_set1_ps(x.d() * y.d());
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(sum[0], sum[1])), acc);
    }
    _mm512_reduce_add_ps(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::panel::ChunkDots;

    /// The exact Q4_K chunk kernel gives each chunk the bits of the exact dot on that chunk:
    /// chunks of one to three superblocks, counts on both sides of a batch of eight.
    #[test]
    fn exact_q4_k_chunks_are_the_exact_dots_of_each_chunk() {
        if !crate::Isa::Avx512.is_supported() {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let mut seed = 0x9e37_79b9_u32;
        let mut byte = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed >> 8) as u8
        };
        for per_chunk in 1..=3usize {
            for chunks in [1usize, 7, 8, 9, 17] {
                let blocks = per_chunk * chunks;
                let mut w: Vec<u8> = (0..blocks * 144).map(|_| byte()).collect();
                for b in 0..blocks {
                    // Finite f16 scales: d and dmin in [2^-10, 2^-9).
                    for at in [0, 2] {
                        w[b * 144 + at + 1] = 0x18;
                    }
                }
                let x: Vec<f32> = (0..blocks * 256)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03)
                    .collect();
                let mut a = vec![0u8; crate::ActKind::Q8K.row_bytes(x.len())];
                crate::ActKind::Q8K.quantize_row(&x, &mut a);
                let (wb, ab) = (per_chunk * 144, a.len() / chunks);
                let mut out = vec![f32::NAN; chunks];
                let cd = ChunkDots {
                    k: per_chunk * 256,
                    chunks,
                    w: w.as_ptr(),
                    w_bytes: wb,
                    a: a.as_ptr(),
                    a_bytes: ab,
                    out: out.as_mut_ptr(),
                };
                // SAFETY: AVX-512 is present (checked); the buffers hold `chunks` chunks.
                unsafe { chunks_q4_k_exact(&cd) };
                for (i, &got) in out.iter().enumerate() {
                    let want = dot_q4_k_exact(
                        per_chunk * 256,
                        &w[i * wb..(i + 1) * wb],
                        &a[i * ab..(i + 1) * ab],
                    );
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{per_chunk}×{chunks}, chunk {i}"
                    );
                }
            }
        }
    }
}
