//! Weights times activations: `out[t][r] = dot(W[r], x[t])` for a `rows × k` weight matrix in any
//! computable block format and `n` activation rows (n = 1 for decode). Activations are quantized
//! once per matrix input to the form the weight format pairs with, and rows are split over the
//! thread pool.

use std::ops::Range;
use std::sync::OnceLock;

use gguf::GgmlType;

use crate::Isa;
use crate::formats::{self, ActKind, DotFn};
use crate::panel::{ChunkDots, Panel, RowKernel};
use crate::pool::ThreadPool;

#[derive(Debug, thiserror::Error)]
pub enum MatmulError {
    #[error("weight type {0} has no compute kernel")]
    UnsupportedType(GgmlType),
    #[error("{what}: {detail}")]
    Shape { what: &'static str, detail: String },
    /// A compute device other than the CPU failed ([`crate::Offload`]).
    #[error("{device}: {detail}")]
    Device { device: String, detail: String },
}

/// A `rows × cols` weight matrix stored row-major in ggml blocks (GGUF `ne = [cols, rows]`).
#[derive(Clone, Copy, Debug)]
pub struct Weights<'a> {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    row_bytes: usize,
    /// Bytes from one row's start to the next (larger than `row_bytes` for a column slice).
    row_stride: usize,
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
            row_stride: row_bytes,
        })
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Checks that `data` holds every row as the fields describe them. The constructors make
    /// it so, but `dtype`, `rows` and `cols` are public fields of a `Copy` type; the panel
    /// kernels read the rows through raw pointers, so the matmuls check again first.
    fn check_rows(&self) -> Result<(), MatmulError> {
        let row_bytes = self.dtype.row_bytes(self.cols as u64).map(|b| b as usize);
        let end = match self.rows {
            0 => Some(0),
            r => (r - 1)
                .checked_mul(self.row_stride)
                .and_then(|s| s.checked_add(self.row_bytes)),
        };
        if row_bytes == Some(self.row_bytes) && end.is_some_and(|e| e <= self.data.len()) {
            return Ok(());
        }
        Err(MatmulError::Shape {
            what: "weights",
            detail: format!(
                "{}×{} {} with rows of {} bytes every {} bytes do not fit {} bytes",
                self.rows,
                self.cols,
                self.dtype,
                self.row_bytes,
                self.row_stride,
                self.data.len()
            ),
        })
    }

    pub fn row_stride(&self) -> usize {
        self.row_stride
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_stride..r * self.row_stride + self.row_bytes]
    }

    /// Rows `range` as a matrix of their own (an expert's slice of a fused tensor, a head split).
    pub fn rows_slice(&self, range: std::ops::Range<usize>) -> Weights<'a> {
        let end = if range.is_empty() {
            range.start * self.row_stride
        } else {
            (range.end - 1) * self.row_stride + self.row_bytes
        };
        Weights {
            dtype: self.dtype,
            rows: range.len(),
            cols: self.cols,
            data: &self.data[range.start * self.row_stride..end],
            row_bytes: self.row_bytes,
            row_stride: self.row_stride,
        }
    }

    /// Columns `range` of every row (a tensor-parallel split of an input dimension), or `None`
    /// when the bounds are not whole blocks of the format.
    pub fn cols_slice(&self, range: std::ops::Range<usize>) -> Option<Weights<'a>> {
        if range.end > self.cols || range.is_empty() {
            return None;
        }
        let start = self.dtype.row_bytes(range.start as u64)? as usize;
        let len = self.dtype.row_bytes(range.len() as u64)? as usize;
        let end = if self.rows == 0 {
            start
        } else {
            (self.rows - 1) * self.row_stride + start + len
        };
        Some(Weights {
            dtype: self.dtype,
            rows: self.rows,
            cols: range.len(),
            data: &self.data[start..end],
            row_bytes: len,
            row_stride: self.row_stride,
        })
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
                    // SAFETY: row t < n lies inside `out` (n·rb initialized bytes), which outlives
                    // `for_each_chunk`; each row belongs to exactly one chunk, so no other
                    // reference to these bytes exists while `dst` lives.
                    let dst = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(t * rb), rb) };
                    kind.quantize_row(&self.data[t * self.k..(t + 1) * self.k], dst);
                }
            });
            out
        })
    }
}

/// A pointer into a buffer that the tasks of one parallel region share, each touching only its
/// own elements.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: a `SyncPtr` is only the address; every dereference is an `unsafe` block of its own
// that names its elements, which no other task touches (disjoint rows or (row, token) pairs),
// inside a buffer that outlives the parallel region (`for_each_chunk` returns after every task).
// `T: Send` because the tasks write `T` values from other threads.
unsafe impl<T: Send> Sync for SyncPtr<T> {}
// SAFETY: as for `Sync`.
unsafe impl<T: Send> Send for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// One matrix product of a batch: `out[t * w.rows + r] = W[r] · acts[t]`.
pub struct MatmulJob<'a> {
    pub w: Weights<'a>,
    /// `n` activation rows, already quantized for `w`'s format.
    pub acts: &'a [u8],
    pub n: usize,
    pub out: &'a mut [f32],
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

    /// The kernel matrix products of `dtype` use: a panel kernel or a loop of
    /// [`Kernels::dot_fn`], giving the same bits.
    pub fn row_kernel(&self, dtype: GgmlType) -> Result<RowKernel, MatmulError> {
        crate::isa::row_kernel(self.isa, dtype).ok_or(MatmulError::UnsupportedType(dtype))
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
        let fmt = formats::format(w.dtype).ok_or(MatmulError::UnsupportedType(w.dtype))?;
        let acts = x.quantized(fmt.act, pool);
        self.matmul_batch(
            pool,
            &mut [MatmulJob {
                w: *w,
                acts,
                n: x.n,
                out,
            }],
        )
    }

    /// The smallest column chunk at which a dot product of `w`'s format with its activations
    /// can be cut: a multiple of both block sizes and of `floor`.
    pub fn reduction_chunk(dtype: GgmlType, floor: usize) -> Option<usize> {
        let act = formats::format(dtype)?.act.ggml_type().block_size();
        let gcd = |mut a: usize, mut b: usize| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let lcm = |a: usize, b: usize| a / gcd(a, b) * b;
        Some(lcm(lcm(dtype.block_size(), act), floor.max(1)))
    }

    /// `out[t * w.rows + r] = Σ_c W[r, chunk c] · x[t, chunk c]`: each chunk's dot in f32, the
    /// chunks added in f64. Such a sum does not depend on how chunks are grouped, so a
    /// tensor-parallel rank computing some of the chunks and an all-reduce in f64 reproduce the
    /// single node's result bit for bit. `chunk` must be a multiple of
    /// [`Kernels::reduction_chunk`]`(w.dtype, 1)`.
    pub fn matmul_chunked(
        &self,
        pool: &ThreadPool,
        w: &Weights,
        x: &Input,
        chunk: usize,
        out: &mut [f64],
    ) -> Result<(), MatmulError> {
        let fmt = formats::format(w.dtype).ok_or(MatmulError::UnsupportedType(w.dtype))?;
        w.check_rows()?;
        let unit = Self::reduction_chunk(w.dtype, 1).expect("format known");
        if x.k != w.cols || chunk == 0 || !chunk.is_multiple_of(unit) || out.len() != x.n * w.rows {
            return Err(MatmulError::Shape {
                what: "chunked matmul",
                detail: format!(
                    "{}×{} weights, input of {} columns, chunk {chunk} (unit {unit}), output {}",
                    w.rows,
                    w.cols,
                    x.k,
                    out.len()
                ),
            });
        }
        let kernel = self.row_kernel(w.dtype)?;
        let acts = x.quantized(fmt.act, pool);
        let arb = fmt.act.row_bytes(x.k);
        // Each chunk's weight and activation byte ranges within a row, and its elements,
        // computed once: decode calls the dot once per chunk and row.
        let spans: Vec<(Range<usize>, Range<usize>, usize)> = (0..w.cols)
            .step_by(chunk)
            .map(|c0| {
                let len = chunk.min(w.cols - c0);
                let wo = w.dtype.row_bytes(c0 as u64).expect("aligned") as usize;
                let wl = w.dtype.row_bytes(len as u64).expect("aligned") as usize;
                let ao = fmt.act.row_bytes(c0);
                (wo..wo + wl, ao..ao + fmt.act.row_bytes(len), len)
            })
            .collect();
        let (rows, n) = (w.rows, x.n);
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let granule = crate::isa::panel_row_granule(self.isa, w.dtype);
        let row_chunk = rows_per_task(n, w.row_bytes, rows, pool.n_threads(), granule);
        if n <= ROWS_ONE_TILE {
            // Decode: each weight row is read once, so there is nothing for a panel to share,
            // and with chunks as short as one superblock the per-call overhead of a panel shows
            // (measured: a third slower decode on deepseek-v2-lite shapes with 4-row panel
            // calls). The single-row dot gives the same bits; each row is one sequential stream.
            // Where the format has a chunk-dots kernel, a row's whole chunks are one call.
            let dot = self.dot_fn(w.dtype)?;
            let ahead = crate::prefetch::stream_prefetch();
            let whole = w.cols / chunk;
            if let Some(kernel) = crate::isa::chunk_rows(self.isa, w.dtype).filter(|_| whole > 0) {
                // The formats with a min: a task's rows four at a time (see `chunk_rows`).
                let tail = &spans[whole..];
                pool.for_each_chunk(rows, row_chunk, |range| {
                    let mut part = vec![0f32; range.len() * whole];
                    for t in 0..n {
                        let a = &acts[t * arb..(t + 1) * arb];
                        let cd = ChunkDots {
                            k: chunk,
                            chunks: whole,
                            w: w.row(range.start).as_ptr(),
                            w_bytes: spans[0].0.len(),
                            a: a.as_ptr(),
                            a_bytes: spans[0].1.len(),
                            out: part.as_mut_ptr(),
                        };
                        // SAFETY: rows `range` are `row_stride` bytes apart inside `w.data`
                        // (`check_rows` above), each holding chunks 0..whole as the first
                        // `whole` spans, as `a` does; `part` holds range.len() · whole values
                        // and aliases neither; the kernel comes from `crate::isa`.
                        unsafe { kernel(&cd, range.len(), w.row_stride) };
                        for (i, r) in range.clone().enumerate() {
                            let row = w.row(r);
                            let mut acc = 0f64;
                            for &v in &part[i * whole..(i + 1) * whole] {
                                acc += v as f64;
                            }
                            for (wr, ar, len) in tail {
                                acc += dot(*len, &row[wr.clone()], &a[ar.clone()]) as f64;
                            }
                            // SAFETY: t < n and r < rows, inside `out` (n·rows values, checked
                            // above); row r belongs to this task only.
                            unsafe { *out_ptr.get().add(t * rows + r) = acc };
                        }
                    }
                });
                return Ok(());
            }
            let chunk_dots = crate::isa::chunk_dots(self.isa, w.dtype).filter(|_| whole > 0);
            let tail = &spans[if chunk_dots.is_some() { whole } else { 0 }..];
            pool.for_each_chunk(rows, row_chunk, |range| {
                let mut part = vec![0f32; if chunk_dots.is_some() { whole } else { 0 }];
                let first = w.data.as_ptr().wrapping_add(range.start * w.row_stride);
                for t in 0..n {
                    let a = &acts[t * arb..(t + 1) * arb];
                    for r in range.clone() {
                        let row = w.row(r);
                        if t == 0 {
                            // The task's rows are one stream: ask for its bytes ahead.
                            let (i, stride) = (r - range.start, w.row_stride);
                            crate::prefetch::rows_ahead(first, i, 1, stride, range.len(), ahead);
                        }
                        let mut acc = 0f64;
                        if let Some(kernel) = chunk_dots {
                            let cd = ChunkDots {
                                k: chunk,
                                chunks: whole,
                                w: row.as_ptr(),
                                w_bytes: spans[0].0.len(),
                                a: a.as_ptr(),
                                a_bytes: spans[0].1.len(),
                                out: part.as_mut_ptr(),
                            };
                            // SAFETY: chunks 0..whole of the row and of the token's activations
                            // are the first `whole` spans (each `w_bytes` / `a_bytes` long, in
                            // order, inside `row` and `a`); `part` holds `whole` values and
                            // aliases neither; the kernel comes from `crate::isa`.
                            unsafe { kernel(&cd) };
                            for &v in &part {
                                acc += v as f64;
                            }
                        }
                        for (wr, ar, len) in tail {
                            acc += dot(*len, &row[wr.clone()], &a[ar.clone()]) as f64;
                        }
                        // SAFETY: t < n and r < rows, inside `out` (n·rows values, checked above);
                        // row r belongs to this task only.
                        unsafe { *out_ptr.get().add(t * rows + r) = acc };
                    }
                }
            });
            return Ok(());
        }
        if let Some(kernel) = crate::isa::chunk_panel(self.isa, w.dtype) {
            // Batches in one call per block of rows, as `matmul_batch` runs them: the panel's
            // tiles go chunk by chunk with their f64 sums in registers.
            let whole = w.cols / chunk;
            let tail_k = w.cols - whole * chunk;
            pool.for_each_chunk(rows, row_chunk, |range| {
                let cp = crate::panel::ChunkPanel {
                    k: chunk,
                    chunks: whole,
                    tail_k,
                    w: w.data.as_ptr().wrapping_add(range.start * w.row_stride),
                    w_stride: w.row_stride,
                    w_chunk: spans[0].0.len(),
                    rows: range.len(),
                    a: acts.as_ptr(),
                    a_stride: arb,
                    a_chunk: spans[0].1.len(),
                    n,
                    out: out_ptr.get().wrapping_add(range.start),
                    out_stride: rows,
                };
                // SAFETY: the panel covers rows `range` of `w` (inside `w.data`: `check_rows`
                // above), whose `whole` chunks and tail are the spans in order, every token of
                // `acts` (n rows of `arb` bytes, chunked alike), and outputs (t, r) for r in
                // `range`, inside `out` (n·rows values, checked above) and written by this task
                // only; the kernel comes from `crate::isa` for this level.
                unsafe { kernel(&cp) };
            });
            return Ok(());
        }
        // Batches: an L1-sized block of rows against a block of tokens, chunk by chunk, the
        // chunk sums kept in a small contiguous f64 block (L1) and written out once. A token
        // block keeps its activations (all chunks) in L2 while the chunks pass. The AMX tiles
        // repack a panel's weight rows on every call, so they get longer token blocks.
        let token_block = if granule >= 16 { 128 } else { 32 };
        pool.for_each_chunk(rows, row_chunk, |range| {
            let m = range.len();
            let mut part = vec![0f32; token_block * m];
            let mut sums = vec![0f64; token_block * m];
            for t0 in (0..n).step_by(token_block) {
                let tn = token_block.min(n - t0);
                let sums = &mut sums[..tn * m];
                sums.fill(0.0);
                // Each chunk's dots for these rows and tokens, added in chunk order.
                for (wr, ar, len) in &spans {
                    let (wo, ao, len) = (wr.start, ar.start, *len);
                    let panel = Panel {
                        k: len,
                        w: w.data
                            .as_ptr()
                            .wrapping_add(range.start * w.row_stride + wo),
                        w_stride: w.row_stride,
                        rows: m,
                        a: acts.as_ptr().wrapping_add(t0 * arb + ao),
                        a_stride: arb,
                        n: tn,
                        out: part.as_mut_ptr(),
                        out_stride: m,
                    };
                    // SAFETY: the panel covers rows `range` and the columns of this chunk of `w`
                    // (inside `w.data`: `check_rows` above), this chunk of tokens t0..t0 + tn
                    // of `acts` (n rows of `arb` bytes), and `part`, which holds
                    // token_block × m ≥ tn × m values and aliases neither input; the kernel
                    // comes from `crate::isa` (`row_kernel`).
                    unsafe { kernel.run(w.dtype, &panel) };
                    for (s, &p) in sums.iter_mut().zip(&part[..tn * m]) {
                        *s += p as f64;
                    }
                }
                for t in 0..tn {
                    for (i, r) in range.clone().enumerate() {
                        // SAFETY: t0 + t < n and r < rows, inside `out` (n·rows values, checked
                        // above); the rows of `range` belong to this task only.
                        unsafe { *out_ptr.get().add((t0 + t) * rows + r) = sums[t * m + i] };
                    }
                }
            }
        });
        Ok(())
    }

    /// Runs independent matmuls as one parallel region, so small matrices (the experts of one
    /// decode step, or q/k/v) share a single dispatch and keep every thread busy.
    /// `acts` of each job must already be in the form its weight format pairs with
    /// ([`Input::quantized`] with [`crate::format`]`(dtype).act`).
    ///
    /// Each task is a contiguous block of rows of one job against all of its tokens, run as one
    /// panel (see [`crate::panel`]): for decode, enough blocks over all jobs for every thread to
    /// get several; for batches, blocks whose weights stay in L1 while every token passes.
    /// Every value is the format's single-row dot, bit for bit, so nothing depends on the
    /// thread count, the blocking, or the other tokens of the batch.
    pub fn matmul_batch(
        &self,
        pool: &ThreadPool,
        jobs: &mut [MatmulJob],
    ) -> Result<(), MatmulError> {
        struct Prepared {
            kernel: RowKernel,
            dtype: GgmlType,
            w_ptr: SyncPtr<u8>,
            w_stride: usize,
            rows: usize,
            k: usize,
            acts: SyncPtr<u8>,
            act_row_bytes: usize,
            n: usize,
            out: SyncPtr<f32>,
            chunk: usize,
            first_task: usize,
        }
        let n_threads = pool.n_threads();
        let total_rows: usize = jobs.iter().map(|j| j.w.rows).sum();
        let mut prepared = Vec::with_capacity(jobs.len());
        let mut n_tasks = 0;
        for job in jobs.iter_mut() {
            let fmt =
                formats::format(job.w.dtype).ok_or(MatmulError::UnsupportedType(job.w.dtype))?;
            job.w.check_rows()?;
            let act_row_bytes = fmt.act.row_bytes(job.w.cols);
            if job.acts.len() != act_row_bytes * job.n {
                return Err(MatmulError::Shape {
                    what: "matmul input",
                    detail: format!(
                        "{} rows of {} {:?} activations need {} bytes, got {}",
                        job.n,
                        job.w.cols,
                        fmt.act,
                        act_row_bytes * job.n,
                        job.acts.len()
                    ),
                });
            }
            if job.out.len() != job.n * job.w.rows {
                return Err(MatmulError::Shape {
                    what: "matmul output",
                    detail: format!(
                        "needs {}×{} values, got {}",
                        job.n,
                        job.w.rows,
                        job.out.len()
                    ),
                });
            }
            let granule = crate::isa::panel_row_granule(self.isa, job.w.dtype);
            let chunk = rows_per_task(job.n, job.w.row_bytes, total_rows, n_threads, granule);
            prepared.push(Prepared {
                kernel: self.row_kernel(job.w.dtype)?,
                dtype: job.w.dtype,
                w_ptr: SyncPtr(job.w.data.as_ptr() as *mut u8),
                w_stride: job.w.row_stride,
                rows: job.w.rows,
                k: job.w.cols,
                acts: SyncPtr(job.acts.as_ptr() as *mut u8),
                act_row_bytes,
                n: job.n,
                out: SyncPtr(job.out.as_mut_ptr()),
                chunk,
                first_task: n_tasks,
            });
            n_tasks += job.w.rows.div_ceil(chunk);
        }
        let run_task = |task: usize| {
            let j = prepared.partition_point(|p| p.first_task <= task) - 1;
            let p = &prepared[j];
            let start = (task - p.first_task) * p.chunk;
            let end = (start + p.chunk).min(p.rows);
            let panel = Panel {
                k: p.k,
                w: p.w_ptr.get().wrapping_add(start * p.w_stride),
                w_stride: p.w_stride,
                rows: end - start,
                a: p.acts.get(),
                a_stride: p.act_row_bytes,
                n: p.n,
                out: p.out.get().wrapping_add(start),
                out_stride: p.rows,
            };
            // SAFETY: the pointers come from the job's slices, whose lengths were checked above
            // (the weights' by `check_rows`); rows start..end ≤ rows of every token are
            // in bounds, and each (job, token, row) output is written by exactly one task and
            // aliases no input (`out` is a `&mut`); the kernel comes from `crate::isa`
            // (`row_kernel`).
            unsafe { p.kernel.run(p.dtype, &panel) };
        };
        if n_tasks == 1 || n_threads == 1 {
            (0..n_tasks).for_each(run_task);
        } else {
            pool.for_each_chunk(n_tasks, 1, |tasks| tasks.for_each(run_task));
        }
        Ok(())
    }
}

/// The largest token tile of the panel kernels: up to this many tokens, a panel reads each
/// weight row once.
const ROWS_ONE_TILE: usize = 8;

/// Rows per task of a matmul. When all tokens fit one token tile of the panel kernels (decode,
/// or a few sessions decoding together), each weight row is read once: enough tasks over all jobs
/// (`total_rows`) for each thread to get about eight, for balance, each a long contiguous stream.
/// Larger batches reuse a task's weight rows for every token tile, so a task's rows should stay
/// in L1 (about 16 KiB of weights next to a tile of activation rows; 8 and 32 KiB measured the
/// same on Zen 4). Multiples of 4, and for batches of the panel's row granule (16 for the AMX
/// tiles, [`crate::isa::panel_row_granule`]), so that only a matrix's last task has rows the
/// tiles leave to the dot.
fn rows_per_task(
    n: usize,
    row_bytes: usize,
    total_rows: usize,
    n_threads: usize,
    granule: usize,
) -> usize {
    if n <= ROWS_ONE_TILE {
        return (total_rows / (n_threads * 8))
            .clamp(8, 256)
            .next_multiple_of(4);
    }
    let granule = granule.max(4);
    (16 * 1024 / row_bytes.max(1))
        .clamp(granule, 64.max(granule))
        .next_multiple_of(granule)
}
