//! Quantized CPU kernels: ggml block formats (dequantize, quantize), dot products of weight rows
//! with quantized activations (a scalar reference for every format, and AVX2/AVX-512 or
//! NEON/dotprod/i8mm paths chosen at run time), matrix-times-activations over a thread pool built for per-token work.

#[cfg(target_arch = "aarch64")]
mod aarch64;
pub mod activation;
pub mod attn;
pub mod blocks;
pub mod exp;
pub mod formats;
pub mod isa;
pub mod matmul;
pub mod offload;
pub mod panel;
pub mod pool;
pub mod pool_stats;
pub mod prefetch;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use formats::{ActKind, DotFn, Format, format};
pub use isa::{Isa, best_dot, row_kernel, simd_dot, simd_panel};
pub use matmul::{Input, Kernels, MatmulError, MatmulJob, Weights};
pub use offload::{ExpertFfnJob, Offload};
pub use panel::{Panel, PanelFn, RowKernel};
pub use pool::{Backend as PoolBackend, ThreadPool};
