//! Dense SwiGLU feed-forward: `down(silu(gate(x)) ⊙ up(x))`. Also used for the shared expert.

use kernels::{Input, Weights};

use super::{Compute, swiglu};
use crate::error::Result;

/// `x` is `n × n_embd`; returns `n × down.rows`.
pub fn swiglu_ffn(
    cx: &Compute,
    x: &Input,
    gate: Weights,
    up: Weights,
    down: Weights,
) -> Result<Vec<f32>> {
    let mut gu = cx.project(x, &[gate, up])?;
    let up_out = gu.pop().expect("two outputs");
    let mut act = gu.pop().expect("two outputs");
    swiglu(&mut act, &up_out);
    let h = Input::new(&act, x.n(), gate.rows)?;
    Ok(cx.project(&h, &[down])?.pop().expect("one output"))
}
