//! Dense SwiGLU feed-forward: `down(silu(gate(x)) ⊙ up(x))`. Also used for the shared expert.
//! The down projection is summed in f64 over fixed column chunks, so a tensor-parallel split of
//! the FFN width at chunk boundaries reproduces the single node exactly.

use kernels::{Input, Weights};

use super::{Compute, swiglu};
use crate::arch::Glu;
use crate::error::Result;

/// `x` is `n × n_embd`; returns `n × down.rows` in f64. `chunk` is the down projection's
/// reduction chunk (see [`kernels::Kernels::matmul_chunked`]).
pub fn swiglu_ffn(
    cx: &Compute,
    x: &Input,
    gate: Weights,
    up: Weights,
    down: Weights,
    chunk: usize,
) -> Result<Vec<f64>> {
    glu_ffn(cx, x, gate, up, down, chunk, Glu::Silu)
}

/// [`swiglu_ffn`] with another gated activation (DeepSeek V4's clamped SwiGLU).
pub fn glu_ffn(
    cx: &Compute,
    x: &Input,
    gate: Weights,
    up: Weights,
    down: Weights,
    chunk: usize,
    glu: Glu,
) -> Result<Vec<f64>> {
    let mut gu = cx.project(x, &[gate, up])?;
    let up_out = gu.pop().expect("two outputs");
    let mut act = gu.pop().expect("two outputs");
    let width = gate.rows;
    cx.par_rows(&mut act, width, |first, rows| {
        let up = &up_out[first * width..first * width + rows.len()];
        match glu {
            Glu::Silu => swiglu(rows, up),
            Glu::ClampedSwiglu { alpha, limit } => {
                super::moe::clamped_swiglu(rows, up, alpha, limit)
            }
            Glu::ClampedSilu { limit } => super::moe::clamped_silu(rows, up, limit),
        }
    });
    let h = Input::new(&act, x.n(), gate.rows)?;
    let mut out = cx.zeroed::<f64>(x.n() * down.rows);
    cx.matmul_chunked(&down, &h, chunk, &mut out)?;
    Ok(out)
}
