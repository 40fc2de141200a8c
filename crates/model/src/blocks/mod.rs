//! The shared blocks every architecture is composed of. Sharding-sensitive choices (which
//! heads, which experts) are made here once, not per model.

pub mod attention;
pub mod ffn;
pub mod indexer;
pub mod mla;
pub mod moe;
pub mod norm;
pub mod rope;

use std::sync::Arc;

use kernels::{Input, Kernels, MatmulJob, Offload, ThreadPool, Weights};

use crate::error::Result;

/// Elements below which [`Compute::zeroed`] clears on the calling thread (1 MiB of f32).
const PARALLEL_ZERO_MIN: usize = 1 << 18;

/// Threads and kernels of one process, and the compute device (a GPU) that holds some of its
/// weights, if any.
pub struct Compute {
    pub pool: ThreadPool,
    pub kernels: Kernels,
    offload: Option<Arc<dyn Offload>>,
    layer_device: Option<Arc<dyn crate::layer_device::LayerDevice>>,
}

impl Compute {
    /// `n_threads` = 0: one per available core.
    pub fn new(n_threads: usize) -> Compute {
        Compute::with_kernels(n_threads, Kernels::default())
    }

    pub fn with_kernels(n_threads: usize, kernels: Kernels) -> Compute {
        Compute {
            pool: ThreadPool::new(n_threads),
            kernels,
            offload: None,
            layer_device: None,
        }
    }

    /// Matrix products whose weights `device` holds run there from now on.
    pub fn with_offload(mut self, device: Arc<dyn Offload>) -> Compute {
        self.offload = Some(device);
        self
    }

    /// Whole steps run on `device` from now on, where it can run them (see
    /// [`crate::layer_device`]); the others as before.
    pub fn with_layer_device(
        mut self,
        device: Arc<dyn crate::layer_device::LayerDevice>,
    ) -> Compute {
        self.layer_device = Some(device);
        self
    }

    pub fn layer_device(&self) -> Option<&Arc<dyn crate::layer_device::LayerDevice>> {
        self.layer_device.as_ref()
    }

    pub fn offload(&self) -> Option<&Arc<dyn Offload>> {
        self.offload.as_ref()
    }

    /// [`Kernels::matmul_batch`], except that the jobs whose weights the offload device holds
    /// run there, while the CPU runs the others on the pool at the same time.
    pub fn matmul_batch(&self, jobs: &mut [MatmulJob]) -> Result<()> {
        let Some(device) = &self.offload else {
            return Ok(self.kernels.matmul_batch(&self.pool, jobs)?);
        };
        let (mut there, mut here): (Vec<MatmulJob>, Vec<MatmulJob>) = jobs
            .iter_mut()
            .map(|j| MatmulJob {
                w: j.w,
                acts: j.acts,
                n: j.n,
                out: &mut *j.out,
            })
            .partition(|j| device.holds(&j.w));
        if there.is_empty() {
            return Ok(self.kernels.matmul_batch(&self.pool, &mut here)?);
        }
        if here.is_empty() {
            return Ok(device.matmul_batch(&mut there)?);
        }
        // The device's thread mostly waits for its copies and kernels.
        let (on_device, on_cpu) = std::thread::scope(|s| {
            let gpu = s.spawn(|| device.matmul_batch(&mut there));
            let cpu = self.kernels.matmul_batch(&self.pool, &mut here);
            (gpu.join(), cpu)
        });
        on_cpu?;
        match on_device {
            Ok(r) => Ok(r?),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// [`Kernels::matmul_chunked`]; on the offload device when it holds `w` (its sum is then
    /// the device's f32 sum, not the chunked f64 one: equal to rounding).
    pub fn matmul_chunked(
        &self,
        w: &Weights,
        x: &Input,
        chunk: usize,
        out: &mut [f64],
    ) -> Result<()> {
        if let Some(device) = self.offload.as_ref().filter(|d| d.holds(w)) {
            let act = kernels::format(w.dtype)
                .ok_or(kernels::MatmulError::UnsupportedType(w.dtype))?
                .act;
            let mut part = vec![0f32; out.len()];
            device.matmul_batch(&mut [MatmulJob {
                w: *w,
                acts: x.quantized(act, &self.pool),
                n: x.n(),
                out: &mut part,
            }])?;
            for (o, p) in out.iter_mut().zip(&part) {
                *o = *p as f64;
            }
            return Ok(());
        }
        Ok(self.kernels.matmul_chunked(&self.pool, w, x, chunk, out)?)
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// `len` zeros, written in parallel when the buffer is large. A prefill's per-layer
    /// buffers (tens of MB at 256 tokens) come back from the heap already mapped (see the
    /// binary's allocator settings), and `vec![0; len]` then clears them on one thread: about
    /// 3 ms per 70 MB on the device host, serial time that sixteen threads wait through.
    pub fn zeroed<T: Default + Copy + Send>(&self, len: usize) -> Vec<T> {
        if len < PARALLEL_ZERO_MIN || self.n_threads() == 1 {
            return vec![T::default(); len];
        }
        let mut v = Vec::with_capacity(len);
        self.par_rows(&mut v.spare_capacity_mut()[..len], 1, |_, part| {
            for x in part {
                x.write(T::default());
            }
        });
        // SAFETY: the capacity is at least `len`, and every element of 0..len was written
        // above (`par_rows` hands each element to exactly one task and returns after all).
        unsafe { v.set_len(len) };
        v
    }

    /// Rows per task for per-row work over `n_rows` rows: a few tasks per thread, for balance.
    pub fn rows_per_task(&self, n_rows: usize) -> usize {
        n_rows.div_ceil(self.n_threads() * 4).max(1)
    }

    /// `f(first_row, rows)` over `data` in rows of `row_len`, in parallel (see
    /// [`ThreadPool::for_each_rows_mut`]).
    pub fn par_rows<T: Send>(
        &self,
        data: &mut [T],
        row_len: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        if row_len == 0 {
            return;
        }
        let per_task = self.rows_per_task(data.len() / row_len);
        self.pool.for_each_rows_mut(data, row_len, per_task, f);
    }

    /// [`norm::rms_norm_rows`] with the rows spread over the pool (same bits: each row is
    /// normalized on its own).
    pub fn rms_norm_rows(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let d = w.len();
        self.par_rows(out, d, |first, rows| {
            norm::rms_norm_rows(&x[first * d..first * d + rows.len()], w, eps, rows)
        });
    }

    /// [`norm::rms_norm_rows_inplace`] with the rows spread over the pool.
    pub fn rms_norm_rows_inplace(&self, x: &mut [f32], w: &[f32], eps: f32) {
        self.par_rows(x, w.len(), |_, rows| {
            norm::rms_norm_rows_inplace(rows, w, eps)
        });
    }

    /// Several matrices applied to the same input rows, in one parallel dispatch; the input is
    /// quantized once per activation form. Returns one output per matrix (`n × rows`).
    pub fn project(&self, x: &Input, mats: &[Weights]) -> Result<Vec<Vec<f32>>> {
        let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| self.zeroed(x.n() * w.rows)).collect();
        let mut jobs = Vec::with_capacity(mats.len());
        for (w, out) in mats.iter().zip(outs.iter_mut()) {
            let act = kernels::format(w.dtype)
                .ok_or(kernels::MatmulError::UnsupportedType(w.dtype))?
                .act;
            jobs.push(MatmulJob {
                w: *w,
                acts: x.quantized(act, &self.pool),
                n: x.n(),
                out,
            });
        }
        self.matmul_batch(&mut jobs)?;
        Ok(outs)
    }
}

/// SiLU(gate) ⊙ up, in place into `gate` (the kernels' SIMD form, one polynomial e^x on
/// every path).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    kernels::activation::silu_mul(gate, up);
}
