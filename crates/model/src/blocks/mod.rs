//! The shared blocks every architecture is composed of. Sharding-sensitive choices (which
//! heads, which experts) are made here once, not per model.

pub mod attention;
pub mod ffn;
pub mod mla;
pub mod moe;
pub mod norm;
pub mod rope;

use kernels::{Input, Kernels, MatmulJob, ThreadPool, Weights};

use crate::error::Result;

/// Threads and kernels of one process.
pub struct Compute {
    pub pool: ThreadPool,
    pub kernels: Kernels,
}

impl Compute {
    /// `n_threads` = 0: one per available core.
    pub fn new(n_threads: usize) -> Compute {
        Compute {
            pool: ThreadPool::new(n_threads),
            kernels: Kernels::default(),
        }
    }

    pub fn with_kernels(n_threads: usize, kernels: Kernels) -> Compute {
        Compute {
            pool: ThreadPool::new(n_threads),
            kernels,
        }
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Several matrices applied to the same input rows, in one parallel dispatch; the input is
    /// quantized once per activation form. Returns one output per matrix (`n × rows`).
    pub fn project(&self, x: &Input, mats: &[Weights]) -> Result<Vec<Vec<f32>>> {
        let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; x.n() * w.rows]).collect();
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
        self.kernels.matmul_batch(&self.pool, &mut jobs)?;
        Ok(outs)
    }
}

/// SiLU(gate) ⊙ up, in place into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}
