//! Dense SwiGLU feed-forward: `down(silu(gate(x)) ⊙ up(x))`. Also used for the shared expert.
//! The down projection is summed in f64 over fixed column chunks, so a tensor-parallel split of
//! the FFN width at chunk boundaries reproduces the single node exactly.

use kernels::{Input, Weights};

use super::{Compute, swiglu};
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
    let mut gu = cx.project(x, &[gate, up])?;
    let up_out = gu.pop().expect("two outputs");
    let mut act = gu.pop().expect("two outputs");
    let width = gate.rows;
    cx.par_rows(&mut act, width, |first, rows| {
        swiglu(rows, &up_out[first * width..first * width + rows.len()])
    });
    let h = Input::new(&act, x.n(), gate.rows)?;
    let mut out = vec![0f64; x.n() * down.rows];
    cx.kernels
        .matmul_chunked(&cx.pool, &down, &h, chunk, &mut out)?;
    Ok(out)
}
