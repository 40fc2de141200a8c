//! The seam a compute device other than this CPU plugs into: it holds some weight matrices in
//! its own memory and computes the products with them. The forward path never sees it;
//! `model::Compute` asks it, per matrix product, whether it holds the weights, and hands the
//! products it holds to it (running the rest on the CPU at the same time).

use crate::matmul::{MatmulError, MatmulJob, Weights};

pub trait Offload: Send + Sync {
    /// The device, in words (for logs and `bench`).
    fn name(&self) -> &str;

    /// Whether all of `w`'s bytes are in the device's memory and it has a kernel for `w`'s
    /// format.
    fn holds(&self, w: &Weights) -> bool;

    /// Runs `jobs` (every one [held](Self::holds), activations already in the form the weight
    /// format pairs with, as for [`crate::Kernels::matmul_batch`]) and writes their outputs
    /// before returning. Results agree with the CPU's to rounding, not bit for bit.
    fn matmul_batch(&self, jobs: &mut [MatmulJob]) -> Result<(), MatmulError>;

    /// Runs whole SiLU-gated expert FFNs, `down(SiLU(gate·x) ⊙ up·x)`, and their weighted sum
    /// per token, `out[t] = Σ weight · FFN(row)` over the rows of every job serving token `t`,
    /// keeping the hidden activations and the per-row outputs on the device (one round trip;
    /// `out`, `n_tokens × down.rows` values, is all that comes back). Every matrix of every job
    /// is [held](Self::holds); `acts` are in the gate/up format's activation form, as for
    /// [`Self::matmul_batch`]. A device without this returns `false` (nothing run), and the
    /// caller runs the FFNs as matrix products.
    fn expert_ffn(&self, jobs: &[ExpertFfnJob], out: &mut [f32]) -> Result<bool, MatmulError> {
        let _ = (jobs, out);
        Ok(false)
    }
}

/// One expert's FFN over the `n` token rows it serves: row `i` is token `tokens[i]`'s, and
/// its output counts with `weights[i]`.
pub struct ExpertFfnJob<'a> {
    pub gate: Weights<'a>,
    pub up: Weights<'a>,
    pub down: Weights<'a>,
    pub acts: &'a [u8],
    pub n: usize,
    pub tokens: &'a [u32],
    pub weights: &'a [f32],
}
