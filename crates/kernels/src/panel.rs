//! Panels: one kernel call's share of a matrix product, `rows` weight rows against `n`
//! activation rows. A panel kernel register-tiles the product (a few rows × a few tokens per
//! step: each weight block is unpacked once for several tokens, each activation load serves
//! several rows, and horizontal reductions happen once per row and token), which is what both
//! decode (`n = 1`: several rows share the activation loads and the scale conversions) and prefill
//! (`n` up to hundreds: weights reused from L1 across tokens) need.
//!
//! **Bit identity.** Every value a panel kernel writes equals, bit for bit, the single-row
//! [`crate::DotFn`] of the same format and ISA on that row and token: the kernels keep the dot's
//! integer lane layout (exact, so any instruction sequence giving the same lane sums is
//! equivalent) and repeat its float operations in the same order per (row, token). So a value
//! does not depend on the tile shape, the position of the row or token in the panel, the thread
//! count, or on which other tokens share the batch (batched decode of several sessions gives each
//! session the bits it gets alone), and the column-chunk partials of
//! [`crate::Kernels::matmul_chunked`] stay pure functions of the chunk's bytes. Tests check this
//! for every kernel (`tests/panels.rs`).

use gguf::GgmlType;

use crate::formats::{self, DotFn};

/// `out[t * out_stride + r] = dot(W[r], A[t])` for `r < rows`, `t < n`, where `W[r]` starts at
/// `w + r * w_stride` and `A[t]` at `a + t * a_stride`, each `k` elements long.
#[derive(Clone, Copy, Debug)]
pub struct Panel {
    /// Elements per row: a multiple of the weight format's and the activation format's blocks.
    pub k: usize,
    pub w: *const u8,
    pub w_stride: usize,
    pub rows: usize,
    pub a: *const u8,
    pub a_stride: usize,
    pub n: usize,
    pub out: *mut f32,
    pub out_stride: usize,
}

/// A panel kernel.
///
/// # Safety
/// The caller guarantees that every weight row (`row_bytes(k)` bytes from `w + r * w_stride`),
/// every activation row and every output element named by the [`Panel`] is in bounds, that the
/// outputs do not alias the inputs, and that the CPU supports the kernel's ISA (guaranteed for
/// kernels handed out by [`crate::isa::simd_panel`]).
pub type PanelFn = unsafe fn(&Panel);

/// One weight row against one token, chunk by chunk: `out[c]` is the dot of the `k` elements
/// at `w + c * w_bytes` with those at `a + c * a_bytes`, for `c < chunks` — a decode row of
/// [`crate::Kernels::matmul_chunked`] in one call instead of one dot call per chunk (chunks are
/// often a single superblock, where a call's fixed work is as large as its arithmetic).
#[derive(Clone, Copy, Debug)]
pub struct ChunkDots {
    /// Elements per chunk: a multiple of the weight format's and the activation format's blocks.
    pub k: usize,
    pub chunks: usize,
    pub w: *const u8,
    pub w_bytes: usize,
    pub a: *const u8,
    pub a_bytes: usize,
    pub out: *mut f32,
}

/// A chunk-dots kernel: every value is the single-row [`crate::DotFn`]'s bits on that chunk.
///
/// # Safety
/// The caller guarantees that every chunk of weights and activations named by the
/// [`ChunkDots`] is readable, that the `chunks` outputs are writable and alias no input, and
/// that the CPU supports the kernel's ISA (guaranteed for kernels handed out by
/// [`crate::isa::chunk_dots`]).
pub type ChunkDotsFn = unsafe fn(&ChunkDots);

/// A chunk-rows kernel: [`ChunkDots`] for `rows` consecutive weight rows `w_stride` bytes apart
/// (the first at `w`), the same token's chunks, `out[r * chunks + c]` for row r and chunk c;
/// every value is the single-row [`crate::DotFn`]'s bits on that chunk of that row.
///
/// # Safety
/// As for [`ChunkDotsFn`], for each of the rows, and `rows · chunks` outputs writable.
pub type ChunkRowsFn = unsafe fn(&ChunkDots, usize, usize);

/// Rows × tokens, chunk by chunk, summed in f64: `out[t * out_stride + r]` is
/// `Σ_c dot(W[r] chunk c, A[t] chunk c)`, each chunk's dot in f32 (the single-row
/// [`crate::DotFn`]'s bits), added as f64 in chunk order — a batch of
/// [`crate::Kernels::matmul_chunked`] in one call, with no f32 partials stored between chunks.
/// Chunk `c < chunks` of a weight row starts `c * w_chunk` bytes into it and holds `k` elements;
/// when `tail_k > 0` a last, shorter chunk of `tail_k` elements follows at `chunks * w_chunk`
/// (likewise for the activations with `a_chunk`).
#[derive(Clone, Copy, Debug)]
pub struct ChunkPanel {
    pub k: usize,
    pub chunks: usize,
    pub tail_k: usize,
    pub w: *const u8,
    pub w_stride: usize,
    pub w_chunk: usize,
    pub rows: usize,
    pub a: *const u8,
    pub a_stride: usize,
    pub a_chunk: usize,
    pub n: usize,
    pub out: *mut f64,
    pub out_stride: usize,
}

/// A chunk-panel kernel: every value is the f64 sum, in chunk order, of the single-row
/// [`crate::DotFn`]'s bits on each chunk.
///
/// # Safety
/// The caller guarantees that every chunk of every weight row and token named by the
/// [`ChunkPanel`] is readable, that its outputs are writable and alias no input, and that the
/// CPU supports the kernel's ISA (guaranteed for kernels handed out by
/// [`crate::isa::chunk_panel`]).
pub type ChunkPanelFn = unsafe fn(&ChunkPanel);

/// How a matrix product computes its values: a panel kernel, or a loop of single-row dots for
/// formats (or ISA levels) that have none. Both give the same bits per value.
#[derive(Clone, Copy)]
pub enum RowKernel {
    Panel(PanelFn),
    Dot(DotFn),
}

impl RowKernel {
    /// Runs `p` through the kernel.
    ///
    /// # Safety
    /// As for [`PanelFn`].
    #[inline]
    pub unsafe fn run(self, dtype: GgmlType, p: &Panel) {
        match self {
            // SAFETY: our caller gives `PanelFn`'s guarantees (the contract of this function).
            RowKernel::Panel(f) => unsafe { f(p) },
            RowKernel::Dot(dot) => {
                let act = formats::format(dtype).expect("computable format").act;
                let wb = dtype.row_bytes(p.k as u64).expect("whole blocks") as usize;
                let ab = act.row_bytes(p.k);
                for t in 0..p.n {
                    // SAFETY: activation row t < n, `ab` bytes, is readable by the caller's
                    // contract, and not written while `a` lives (outputs alias no input).
                    let a = unsafe { std::slice::from_raw_parts(p.a.add(t * p.a_stride), ab) };
                    for r in 0..p.rows {
                        // SAFETY: weight row r < rows, `wb` bytes, likewise.
                        let w = unsafe { std::slice::from_raw_parts(p.w.add(r * p.w_stride), wb) };
                        // SAFETY: output (t, r) is inside the panel, writable by the contract.
                        unsafe { *p.out.add(t * p.out_stride + r) = dot(p.k, w, a) };
                    }
                }
            }
        }
    }
}

/// Runs `kernel` over `rows` rows of `w` (row `r` at byte `r * w_stride`) and `n` rows of
/// activations `a` (packed, `act.row_bytes(k)` each) into `out[t * out_stride + r]`, checking every
/// bound first. For tests and benchmarks; the matmul drivers build [`Panel`]s directly.
#[allow(clippy::too_many_arguments)]
pub fn run_checked(
    kernel: RowKernel,
    dtype: GgmlType,
    k: usize,
    w: &[u8],
    w_stride: usize,
    rows: usize,
    a: &[u8],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let f = formats::format(dtype).expect("computable format");
    let wb = dtype.row_bytes(k as u64).expect("whole blocks") as usize;
    let ab = f.act.row_bytes(k);
    assert!(
        k.is_multiple_of(f.act.ggml_type().block_size()),
        "k = {k} is not whole activation blocks"
    );
    assert!(
        rows == 0 || (rows - 1) * w_stride + wb <= w.len(),
        "weights out of bounds"
    );
    assert!(n * ab <= a.len(), "activations out of bounds");
    assert!(rows <= out_stride || n <= 1, "output rows overlap");
    assert!(
        n == 0 || rows == 0 || (n - 1) * out_stride + rows <= out.len(),
        "output out of bounds"
    );
    let p = Panel {
        k,
        w: w.as_ptr(),
        w_stride,
        rows,
        a: a.as_ptr(),
        a_stride: ab,
        n,
        out: out.as_mut_ptr(),
        out_stride,
    };
    if rows > 0 && n > 0 {
        // SAFETY: bounds and the overlap of output rows checked above; `out` is a `&mut`, so it
        // aliases neither input. The CPU features rest on where the kernel came from:
        // `crate::isa` hands out panel kernels only after detecting them (a convention of the
        // callers, since `RowKernel::Panel` is public, not something the types enforce).
        unsafe { kernel.run(dtype, &p) };
    }
}
