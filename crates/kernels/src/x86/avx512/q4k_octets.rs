//! Q4_K at the AVX-512 level in the octet arithmetic (`crate::x86::q4k_octets`): the dot and
//! chunk-dots kernels, and register tiles for batches of up to eight tokens.

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::kquants::dpwssd;
use crate::blocks::{BlockQ4K, BlockQ8K, QK_K};
use crate::x86::q4k_octets::{q4k_octet_kernels, steps, tree};

q4k_octet_kernels!(
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    dpwssd
);
crate::x86::dot_wrapper!(pub dot_q4_k => dot_q4_k_impl, gguf::GgmlType::Q4K, gguf::GgmlType::Q8K);

crate::x86::tiles::panel_kernel!(pub panel_q4_k, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = tile(1, [2, 3, 4, 5, 6, 7, 8]), single = dots(1),
    chunk_panel = chunk_panel_tiles);

crate::x86::tiles::dot_tile!(
    dots,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    dot_q4_k_impl,
    BlockQ4K,
    BlockQ8K,
    QK_K
);

/// R rows × T tokens of Q4_K in the octet arithmetic: each weight block unpacked once for the
/// T tokens; per superblock and row the tokens' integer sums are reduced together (one token
/// per lane) and the reference's float step goes into the row's sums for that superblock's
/// lane (b mod 8), which hold the T tokens side by side; at the end `tree` gives each dot.
///
/// # Safety
/// Each `w[r]` points at `nb` readable Q4_K blocks and each `a[t]` at `nb` Q8_K blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
) -> [[f32; T]; R] {
    use crate::x86::simd256::lanes;
    let w = w.map(|p| p as *const BlockQ4K);
    let a = a.map(|p| p as *const BlockQ8K);
    let mut sums = [[_mm256_setzero_ps(); 8]; R];
    for b in 0..nb {
        // SAFETY: block b < nb of every row is readable (the contract above).
        let xs: [*const u8; R] = std::array::from_fn(|r| unsafe { w[r].add(b) } as *const u8);
        // SAFETY: block b < nb of every token is readable (the contract above); the blocks
        // have alignment 1 and are plain bytes, so a reference to one is valid.
        let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
        // SAFETY: the blocks of this superblock (readable, above).
        let (isum, msum) = unsafe { super::panels::q4k_superblock(&xs, &ys) };
        let dy: [f32; 8] = std::array::from_fn(|t| if t < T { ys[t].d() } else { 0.0 });
        // SAFETY: the load reads the 8 floats of `dy`.
        let dy = unsafe { _mm256_loadu_ps(dy.as_ptr()) };
        for r in 0..R {
            // SAFETY: the first 4 bytes of block `xs[r]`: [d, dmin], the same for every token.
            let [d0, d1, m0, m1] = unsafe { (xs[r] as *const [u8; 4]).read_unaligned() };
            let (d, dmin) = (
                [u16::from_le_bytes([d0, d1]); 8],
                [u16::from_le_bytes([m0, m1]); 8],
            );
            let j = b % 8;
            sums[r][j] = _mm256_add_ps(sums[r][j], steps(&isum[r], &msum[r], dy, &d, &dmin));
        }
    }
    std::array::from_fn(|r| lanes(tree(&sums[r])))
}

/// [`tree`] for sixteen lanes (one row per lane, `super::row_lanes`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) fn tree512(s: &[__m512; 8]) -> __m512 {
    let a = |i: usize| _mm512_add_ps(s[i], s[i + 4]);
    _mm512_add_ps(_mm512_add_ps(a(0), a(2)), _mm512_add_ps(a(1), a(3)))
}
