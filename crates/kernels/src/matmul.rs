//! Weights times activations: `out[t][r] = dot(W[r], x[t])` for a `rows × k` weight matrix in any
//! computable block format and `n` activation rows (n = 1 for decode). Activations are quantized
//! once per matrix input to the form the weight format pairs with, and rows are split over the
//! thread pool.

use std::sync::OnceLock;

use gguf::GgmlType;

use crate::Isa;
use crate::formats::{self, ActKind, DotFn};
use crate::pool::ThreadPool;

#[derive(Debug, thiserror::Error)]
pub enum MatmulError {
    #[error("weight type {0} has no compute kernel")]
    UnsupportedType(GgmlType),
    #[error("{what}: {detail}")]
    Shape { what: &'static str, detail: String },
}

/// A `rows × cols` weight matrix stored row-major in ggml blocks (GGUF `ne = [cols, rows]`).
#[derive(Clone, Copy, Debug)]
pub struct Weights<'a> {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    row_bytes: usize,
}

impl<'a> Weights<'a> {
    pub fn new(
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, MatmulError> {
        let row_bytes = dtype
            .row_bytes(cols as u64)
            .ok_or_else(|| MatmulError::Shape {
                what: "weight row",
                detail: format!("{cols} columns is not a whole number of {dtype} blocks"),
            })? as usize;
        if rows.checked_mul(row_bytes) != Some(data.len()) {
            return Err(MatmulError::Shape {
                what: "weight data",
                detail: format!(
                    "{rows}×{cols} {dtype} needs {} bytes, got {}",
                    rows * row_bytes,
                    data.len()
                ),
            });
        }
        Ok(Weights {
            dtype,
            rows,
            cols,
            data,
            row_bytes,
        })
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Rows `range` as a matrix of their own (an expert's slice of a fused tensor, a head split).
    pub fn rows_slice(&self, range: std::ops::Range<usize>) -> Weights<'a> {
        Weights {
            dtype: self.dtype,
            rows: range.len(),
            cols: self.cols,
            data: &self.data[range.start * self.row_bytes..range.end * self.row_bytes],
            row_bytes: self.row_bytes,
        }
    }
}

/// `n` activation rows of `k` f32 values, with their quantized forms made on first use and then
/// shared by every matrix that reads the same input (q, k and v; gate and up).
pub struct Input<'a> {
    data: &'a [f32],
    n: usize,
    k: usize,
    q8_0: OnceLock<Vec<u8>>,
    q8k: OnceLock<Vec<u8>>,
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [f32], n: usize, k: usize) -> Result<Self, MatmulError> {
        if data.len() != n * k {
            return Err(MatmulError::Shape {
                what: "input",
                detail: format!("{n} rows of {k} need {} values, got {}", n * k, data.len()),
            });
        }
        Ok(Input {
            data,
            n,
            k,
            q8_0: OnceLock::new(),
            q8k: OnceLock::new(),
        })
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn f32(&self) -> &'a [f32] {
        self.data
    }

    /// The rows in the form `kind`, quantized (in parallel over rows) on first use.
    pub fn quantized(&self, kind: ActKind, pool: &ThreadPool) -> &[u8] {
        let cell = match kind {
            ActKind::F32 => return bytemuck::cast_slice(self.data),
            ActKind::Q8_0 => &self.q8_0,
            ActKind::Q8K => &self.q8k,
        };
        cell.get_or_init(|| {
            let rb = kind.row_bytes(self.k);
            let mut out = vec![0u8; rb * self.n];
            let ptr = SyncPtr(out.as_mut_ptr());
            pool.for_each_chunk(self.n, 4, |rows| {
                for t in rows {
                    // SAFETY: each row `t` is written by exactly one chunk.
                    let dst = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(t * rb), rb) };
                    kind.quantize_row(&self.data[t * self.k..(t + 1) * self.k], dst);
                }
            });
            out
        })
    }
}

#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
unsafe impl<T> Sync for SyncPtr<T> {}
unsafe impl<T> Send for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Picks kernels once: the dot product of every format at the chosen SIMD level.
#[derive(Clone, Copy, Debug)]
pub struct Kernels {
    pub isa: Isa,
}

impl Default for Kernels {
    fn default() -> Self {
        Kernels { isa: Isa::detect() }
    }
}

impl Kernels {
    pub fn with_isa(isa: Isa) -> Option<Kernels> {
        isa.is_supported().then_some(Kernels { isa })
    }

    pub fn dot_fn(&self, dtype: GgmlType) -> Result<DotFn, MatmulError> {
        crate::isa::best_dot(self.isa, dtype).ok_or(MatmulError::UnsupportedType(dtype))
    }

    /// `out[t * w.rows + r] = W[r] · x[t]` for every token `t` and row `r`.
    pub fn matmul(
        &self,
        pool: &ThreadPool,
        w: &Weights,
        x: &Input,
        out: &mut [f32],
    ) -> Result<(), MatmulError> {
        if x.k != w.cols {
            return Err(MatmulError::Shape {
                what: "matmul",
                detail: format!(
                    "weights have {} columns but input rows have {}",
                    w.cols, x.k
                ),
            });
        }
        if out.len() != x.n * w.rows {
            return Err(MatmulError::Shape {
                what: "matmul output",
                detail: format!("needs {}×{} values, got {}", x.n, w.rows, out.len()),
            });
        }
        let fmt = formats::format(w.dtype).ok_or(MatmulError::UnsupportedType(w.dtype))?;
        let dot = self.dot_fn(w.dtype)?;
        let acts = x.quantized(fmt.act, pool);
        let arb = fmt.act.row_bytes(x.k);
        let (rows, n, k) = (w.rows, x.n, w.cols);
        let out_ptr = SyncPtr(out.as_mut_ptr());
        // Rows per task: enough to amortize the hand-out, small enough to balance threads. Tokens
        // are the inner loop so a block of weight rows stays in cache while every token uses it.
        let chunk = if n == 1 {
            (rows / (pool.n_threads() * 8)).clamp(4, 64)
        } else {
            16
        };
        pool.for_each_chunk(rows, chunk, |range| {
            for t in 0..n {
                let a = &acts[t * arb..(t + 1) * arb];
                for r in range.clone() {
                    let v = dot(k, w.row(r), a);
                    // SAFETY: (t, r) pairs are disjoint across chunks.
                    unsafe { *out_ptr.get().add(t * rows + r) = v };
                }
            }
        });
        Ok(())
    }
}
