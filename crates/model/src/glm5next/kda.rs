//! KDA (Kimi delta attention) layers: per head, q, k and v through short causal depthwise
//! convolutions and SiLU, q and k L2-normalized, then a gated delta rule over a
//! `head_dim × head_dim` state `S` (per key channel log-decay `g`, write strength `β`):
//! `S ← diag(e^g)·S`, `S ← S + k ⊗ β(v − Sᵀk)`, `o = Sᵀq`; the output through a per-head RMSNorm
//! gated by `sigmoid(g_b·g_a·x)`, then `attn_output`. The cache keeps the convolutions' last
//! inputs and `S` (see `crate::kv::RecurrentState`), so each token costs the same whatever the
//! context.

use kernels::Input;

use super::sigmoid;
use crate::Model;
use crate::blocks::Compute;
use crate::error::{ModelError, Result};
use crate::kv::delta_rule_step;
use crate::pass::{Hooks, SeqInput};
use crate::profile::{Phase, span, timed};
use crate::weights::KdaWeights;

/// `x / √(Σx² + 1e-6)` in place (the L2 norm of q and k per head).
fn l2_normalize(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// One head's recurrence over a sequence's tokens, on the cache's memory in place.
struct HeadRun<'m> {
    /// `head_dim × head_dim`, key-major.
    state: &'m mut [f32],
    /// The head's base state, which the pass brings forward by the cache's pending steps.
    base: &'m mut [f32],
    /// `n × head_dim`.
    out: Vec<f32>,
    /// The state at the cache's capture point, when it falls in this chunk.
    captured: Option<Vec<f32>>,
}

impl Model {
    /// KDA attention of layer `il` for the normed block input `h` (`n × d`): the block output
    /// (`n × d`, f64; a partial sum over this rank's heads when split).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kda_block(
        &self,
        cx: &Compute,
        il: usize,
        w: &KdaWeights,
        h: &[f32],
        seqs: &mut [SeqInput],
        pos0: &[usize],
        hooks: &mut dyn Hooks,
    ) -> Result<Vec<f64>> {
        let hp = &self.hp;
        let p = self.glm5_params();
        let files = self.files();
        let d = hp.n_embd;
        let n = h.len() / d;
        let hd = p.kda_head_dim;
        let heads = self.shard.heads.clone();
        let nh = heads.len();
        let width = nh * hd;
        let cols = heads.start * hd..heads.end * hd;
        let hin = Input::new(h, n, d)?;
        let mut outs = timed(Phase::AttnProject, || {
            cx.project(
                &hin,
                &[
                    w.q.weights(files).rows_slice(cols.clone()),
                    w.k.weights(files).rows_slice(cols.clone()),
                    w.v.weights(files).rows_slice(cols.clone()),
                    w.f_a.weights(files),
                    w.g_a.weights(files),
                    w.beta.weights(files).rows_slice(heads.clone()),
                ],
            )
        })?
        .into_iter();
        let mut next = || outs.next().expect("one output per matrix");
        let pre = [next(), next(), next()];
        let (f_low, g_low, beta) = (next(), next(), next());
        let f_in = Input::new(&f_low, n, w.f_a.rows)?;
        let g_in = Input::new(&g_low, n, w.g_a.rows)?;
        let mut f = timed(Phase::AttnProject, || {
            cx.project(&f_in, &[w.f_b.weights(files).rows_slice(cols.clone())])
        })?
        .pop()
        .expect("f_b");
        let gate = timed(Phase::AttnProject, || {
            cx.project(&g_in, &[w.g_b.weights(files).rows_slice(cols.clone())])
        })?
        .pop()
        .expect("g_b");
        hooks.observe(Some(il), "kda_q_pre", &pre[0]);
        // Per key channel, the decay factor e^g with g = lower_bound · sigmoid(rate · (f + dt)).
        let (dt, rate) = (&w.dt_bias[cols.clone()], &w.decay_rate[heads.clone()]);
        cx.par_rows(&mut f, width, |_, rows| {
            for row in rows.chunks_exact_mut(width) {
                for (c, v) in row.iter_mut().enumerate() {
                    let g = p.gate_lower_bound * sigmoid(rate[c / hd] * (*v + dt[c]));
                    *v = g.exp();
                }
            }
        });
        let beta: Vec<f32> = beta.iter().map(|&b| sigmoid(b)).collect();

        let prepare = span(Phase::AttnPrepare);
        let taps = p.conv_kernel - 1;
        let mut conv_out = [
            vec![0f32; n * width],
            vec![0f32; n * width],
            vec![0f32; n * width],
        ];
        let mut att = vec![0f32; n * width];
        let mut row0 = 0;
        for (s, &p0) in seqs.iter_mut().zip(pos0) {
            let nt = s.n_tokens;
            let rows = row0..row0 + nt;
            let mem = s.kv.recurrent_mut(il)?;
            if mem.at() != p0 || mem.n_head != nh || mem.head_dim != hd {
                return Err(ModelError::Input(format!(
                    "layer {il}: the recurrent state is after {} positions, the batch starts at {p0}",
                    mem.at()
                )));
            }
            let end = p0 + nt;
            let mv = mem.base_move(end);
            let capture = mv.capture;
            let before = mv.checkpoint.then(|| (mem.conv.clone(), mem.state.clone()));
            // The inputs each token's convolution reads: the kept history, then this chunk.
            let mut history: Vec<Vec<f32>> = Vec::with_capacity(3);
            for (j, pre_j) in pre.iter().enumerate() {
                let mut hist = mem.conv[j * taps * width..(j + 1) * taps * width].to_vec();
                hist.extend_from_slice(&pre_j[rows.start * width..rows.end * width]);
                let taps_w = &w.conv[j][..];
                let out = &mut conv_out[j][rows.start * width..rows.end * width];
                let k = p.conv_kernel;
                let cc = cols.clone();
                cx.par_rows(out, width, |first, out_rows| {
                    for (i, row) in out_rows.chunks_exact_mut(width).enumerate() {
                        let t = first + i;
                        for (c, o) in row.iter_mut().enumerate() {
                            let tw = &taps_w[(cc.start + c) * k..(cc.start + c + 1) * k];
                            let mut acc = 0f32;
                            for (tap, &wt) in tw.iter().enumerate() {
                                acc += wt * hist[(t + tap) * width + c];
                            }
                            *o = acc / (1.0 + (-acc).exp());
                        }
                        if j < 2 {
                            for head in row.chunks_exact_mut(hd) {
                                l2_normalize(head);
                            }
                        }
                    }
                });
                history.push(hist);
            }
            let q_scale = 1.0 / (hd as f32).sqrt();
            let step_len = mem.step_len();
            let (state, base, stored) = mem.heads_mut();
            let pending = &stored[..mv.replay * step_len];
            let mut runs: Vec<HeadRun> = state
                .chunks_exact_mut(hd * hd)
                .zip(base.chunks_exact_mut(hd * hd))
                .map(|(state, base)| HeadRun {
                    state,
                    base,
                    out: vec![0f32; nt * hd],
                    captured: None,
                })
                .collect();
            let (cq, ck, cv) = (&conv_out[0], &conv_out[1], &conv_out[2]);
            let (decay, beta) = (&f, &beta);
            cx.pool.for_each_mut(&mut runs, |hh, run| {
                // The base's pending steps, while this head's memory is in cache: a rewind
                // can then reach the latest positions without a serial replay per token.
                crate::kv::replay_head(run.base, pending, hh, width);
                for t in 0..nt {
                    if capture == Some(p0 + t) {
                        run.captured = Some(run.state.to_vec());
                    }
                    let r = rows.start + t;
                    let at = r * width + hh * hd;
                    let (q, k, v) = (&cq[at..at + hd], &ck[at..at + hd], &cv[at..at + hd]);
                    let s = &mut *run.state;
                    delta_rule_step(s, k, v, &decay[at..at + hd], beta[r * nh + hh]);
                    let o = &mut run.out[t * hd..(t + 1) * hd];
                    for (i, &qi) in q.iter().enumerate() {
                        let qi = qi * q_scale;
                        for (oj, &x) in o.iter_mut().zip(&s[i * hd..(i + 1) * hd]) {
                            *oj += x * qi;
                        }
                    }
                }
                if capture == Some(end) {
                    run.captured = Some(run.state.to_vec());
                }
            });
            // The convolutions' history after position m: the last `taps` inputs before it.
            let conv_after = |m: usize| -> Vec<f32> {
                let end = m - p0 + taps;
                let mut c = Vec::with_capacity(3 * taps * width);
                for hist in &history {
                    c.extend_from_slice(&hist[(end - taps) * width..end * width]);
                }
                c
            };
            let captured = capture.map(|c| {
                let state: Vec<f32> = runs
                    .iter()
                    .flat_map(|r| r.captured.iter().flatten().copied())
                    .collect();
                (conv_after(c), state)
            });
            // What a rewind replays: per position its convolution inputs, k, v, decay and β.
            let mut steps = Vec::with_capacity(nt * step_len);
            for r in rows.clone() {
                for src in [&pre[0], &pre[1], &pre[2], ck, cv, decay] {
                    steps.extend_from_slice(&src[r * width..(r + 1) * width]);
                }
                steps.extend_from_slice(&beta[r * nh..(r + 1) * nh]);
            }
            for (hh, r) in runs.iter().enumerate() {
                for t in 0..nt {
                    let at = (rows.start + t) * width + hh * hd;
                    att[at..at + hd].copy_from_slice(&r.out[t * hd..(t + 1) * hd]);
                }
            }
            drop(runs);
            mem.commit(end, &steps, conv_after(end), captured, before);
            row0 += nt;
        }
        hooks.observe(Some(il), "kda_core", &att);
        // The per-head RMSNorm, gated.
        let eps = hp.rms_eps;
        cx.par_rows(&mut att, width, |first, rows| {
            for (i, row) in rows.chunks_exact_mut(width).enumerate() {
                let g = &gate[(first + i) * width..(first + i + 1) * width];
                for (hh, head) in row.chunks_exact_mut(hd).enumerate() {
                    let ss: f64 = head.iter().map(|&v| v as f64 * v as f64).sum();
                    let scale = 1.0 / ((ss / hd as f64) as f32 + eps).sqrt();
                    for (c, v) in head.iter_mut().enumerate() {
                        *v = w.out_norm[c] * (*v * scale) * sigmoid(g[hh * hd + c]);
                    }
                }
            }
        });
        drop(prepare);
        hooks.observe(Some(il), "kqv_out", &att);
        let ain = Input::new(&att, n, width)?;
        let o_w = w.o.weights(files);
        let o_w = if self.shard.attention_split {
            o_w.cols_slice(cols)
                .expect("a head split is block-aligned (checked by Shard::new)")
        } else {
            o_w
        };
        let chunk = crate::shard::o_chunk(self.o_dtype, hd, 1);
        let mut out = vec![0f64; n * d];
        timed(Phase::AttnOutput, || {
            cx.matmul_chunked(&o_w, &ain, chunk, &mut out)
        })?;
        Ok(out)
    }
}
