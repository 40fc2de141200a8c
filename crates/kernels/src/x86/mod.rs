//! x86-64 SIMD kernels. `avx2` and `avx512` expose the same functions; each is compiled with its
//! own `#[target_feature]` set and only handed out by `crate::isa` after run-time detection.
//! Neither imports from the other: what both use lives beside them — `simd256` (loads, f16
//! scales, horizontal sums), `scales` (K-quant scale unpacking), `kq256` (the K-quant loops),
//! `iq256` (the 256-element IQ formats' decoders, loops and tiles), `blocks32` (the 32-element
//! formats' reference-order sums and token packing), `tiles` (the panel loop) and `mxfp4` (the MXFP4 dot and panel, in an
//! AVX2 form for one level and a VNNI form for the other, with the same bits).
//!
//! `amx` adds the matrix unit of Sapphire Rapids and later Xeons for Q4_K batches, on top of the
//! AVX-512 set.
//!
//! Every kernel function carries the `#[target_feature]`s it needs, so the intrinsics without
//! pointer arguments are safe to call inside it; what stays `unsafe` is reading through raw
//! pointers (each block says why the bytes are in bounds) and entering a kernel from code
//! compiled without those features (only after `crate::isa` detected them).

pub(crate) mod act_quant;
pub mod amx;
pub mod avx2;
pub mod avx512;
mod blocks32;
mod float_kinds;
mod iq256;
mod kq256;
mod mxfp4;
mod q4k_octets;
mod scales;
mod simd256;
mod tiles;

/// Wraps a `#[target_feature]` kernel `fn(usize, &[u8], &[u8]) -> f32` into a plain `DotFn`.
/// The wrapper checks the slice lengths, because the kernels read through raw pointers.
macro_rules! dot_wrapper {
    ($vis:vis $name:ident => $imp:path, $wfmt:expr, $afmt:expr) => {
        $vis fn $name(n: usize, w: &[u8], a: &[u8]) -> f32 {
            assert!(
                w.len() >= $wfmt.row_bytes(n as u64).unwrap_or(u64::MAX) as usize
                    && a.len() >= $afmt.row_bytes(n as u64).unwrap_or(u64::MAX) as usize,
                "dot product of {} elements: weight row {} bytes, activations {} bytes",
                n,
                w.len(),
                a.len()
            );
            // SAFETY: `$imp` is compiled for its ISA module's features. This wrapper is private
            // to that module and handed out only by its `dot()`, which only
            // `crate::isa::simd_dot` calls, after `Isa::is_supported` found those features on
            // this CPU. The kernels that read the rows through raw pointers need `n` elements
            // of both, checked above.
            unsafe { $imp(n, w, a) }
        }
    };
}
pub(crate) use dot_wrapper;

/// `token_runs!(n, [k, …], |t0, T| body)`: runs `body` with `T` a constant for each run of up
/// to `TOKENS` (a constant where it is used) tokens `t0..t0 + T` of `n`; `[k, …]` are the run
/// lengths above 1 that can occur (those up to `TOKENS`), each its own instantiation. The row
/// lanes of both levels keep a run's sums in registers.
macro_rules! token_runs {
    ($n:expr, [$($k:literal),*], |$t0:ident, $T:ident| $body:expr) => {{
        let mut $t0 = 0;
        while $t0 < $n {
            let left = ($n - $t0).min(TOKENS);
            match left {
                $(
                    $k => {
                        const $T: usize = $k;
                        $body
                    }
                )*
                _ => {
                    const $T: usize = 1;
                    $body
                }
            }
            $t0 += left;
        }
    }};
}
pub(crate) use token_runs;

/// `2^(e-128)` for every E8M0 exponent byte: half the MXFP4 block scale, as
/// [`crate::blocks::e8m0_to_f32_half`] computes it (the table stores doubled E2M1 values). A
/// table lookup is one load, where the bit manipulation needs a branch for the subnormal cases.
pub(crate) static E8M0_HALF: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut e = 0;
    while e < 256 {
        let bits: u32 = if e < 2 {
            0x0020_0000 << e
        } else {
            ((e as u32) - 1) << 23
        };
        t[e] = f32::from_bits(bits);
        e += 1;
    }
    t
};
