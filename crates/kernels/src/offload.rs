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

    /// The fewest of a step's token rows a routed expert must serve for this device to run it
    /// without [holding](Self::holds) its weights, copying them in for the call
    /// ([`Self::expert_ffn`]): a prompt's batch pays for the copy where one token does not.
    /// `None` (the default): the device runs only what it holds.
    fn streams_experts_from(&self) -> Option<usize> {
        None
    }

    /// Whether `w` could be copied in for an [`Self::expert_ffn`] call (the device has a kernel
    /// for its format).
    fn can_stream(&self, w: &Weights) -> bool {
        let _ = w;
        false
    }

    /// Runs `jobs` (every one [held](Self::holds), activations already in the form the weight
    /// format pairs with, as for [`crate::Kernels::matmul_batch`]) and writes their outputs
    /// before returning. Results agree with the CPU's to rounding, not bit for bit.
    fn matmul_batch(&self, jobs: &mut [MatmulJob]) -> Result<(), MatmulError>;

    /// Runs whole SiLU-gated expert FFNs, `down(SiLU(gate·x) ⊙ up·x)`, and their weighted sum
    /// per token, `out[t] = Σ weight · FFN(row)` over the rows of every job serving token `t`,
    /// keeping the hidden activations and the per-row outputs on the device (one round trip;
    /// `out`, `n_tokens × down.rows` values, is all that comes back). Every matrix of every job
    /// is [held](Self::holds) or [streamable](Self::can_stream) (then copied in for the call);
    /// `acts` are in the gate/up format's activation form, as for
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
