//! x86-64 SIMD kernels. `avx2` and `avx512` expose the same functions; each is compiled with its
//! own `#[target_feature]` set and only handed out by `crate::isa` after run-time detection.

pub mod avx2;
pub mod avx512;

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
            // SAFETY: this wrapper is only reachable through `dot()` of its ISA module, which
            // `crate::isa::simd_dot` calls after checking that the CPU supports the features the
            // kernel was compiled for; lengths are checked above.
            unsafe { $imp(n, w, a) }
        }
    };
}
pub(crate) use dot_wrapper;
