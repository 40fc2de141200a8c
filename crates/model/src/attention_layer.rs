//! A layer's attention block as the forward path runs it: grouped-query attention (its q/k
//! norms, the whole-projection one of OLMoE included), multi-head latent attention (dense or
//! over a GLM-5 selection), and the output projection whose partial sums tensor-parallel ranks
//! reduce. `forward` calls these per layer; the FFN side stays there.

use kernels::Input;

use crate::Model;
use crate::arch::QkNorm;
use crate::blocks::Compute;
use crate::blocks::attention::{AttentionShape, attend};
use crate::blocks::indexer::{self, Selection};
use crate::blocks::mla;
use crate::blocks::norm;
use crate::blocks::rope::RopeTable;
use crate::error::{ModelError, Result};
use crate::forward::{add_residual, add_rows, seq_spans};
use crate::pass::{Hooks, ReducePoint, SeqInput};
use crate::profile::{Phase, span, timed};
use crate::weights::{AttentionWeights, Matrix, MlaAttention};

impl Model {
    /// Attention: q/k/v of this rank's heads (all of them unless split), RoPE, KV append, causal
    /// attention, output projection (a partial sum over the heads when split).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_layer(
        &self,
        cx: &Compute,
        il: usize,
        x: &mut [f32],
        seqs: &mut [SeqInput],
        pos0: &[usize],
        rope: &RopeTable,
        selection: &mut Option<Selection>,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let a = match &self.held_layer(il)?.attn {
            AttentionWeights::Gqa(a) => a,
            AttentionWeights::Mla(m) => {
                return self.mla_attention_layer(cx, il, m, x, seqs, pos0, rope, selection, hooks);
            }
            AttentionWeights::Dsv4(_) | AttentionWeights::Glm5Next(_) => {
                return Err(ModelError::Input(format!(
                    "layer {il}: DeepSeek V4 and GLM-5.3 Flash layers run through their own paths"
                )));
            }
        };
        let hp = &self.hp;
        let files = self.files();
        let sh = &self.shard;
        let d = hp.n_embd;
        let n = x.len() / d;
        let (dk, dv) = (hp.head_dim_k, hp.head_dim_v);
        let (heads, kv_heads) = (sh.heads.clone(), sh.kv_heads.clone());
        let (nh, nkv) = (heads.len(), kv_heads.len());
        let q_rows = heads.start * dk..heads.end * dk;
        let k_rows = kv_heads.start * dk..kv_heads.end * dk;
        let v_rows = kv_heads.start * dv..kv_heads.end * dv;

        let mut h = vec![0f32; n * d];
        timed(Phase::Norm, || {
            cx.rms_norm_rows(x, &a.norm, hp.rms_eps, &mut h)
        });
        hooks.observe(Some(il), "attn_norm", &h);
        let hin = Input::new(&h, n, d)?;
        let project_span = span(Phase::AttnProject);
        let mut qkv = cx.project(
            &hin,
            &[
                a.q.weights(files).rows_slice(q_rows.clone()),
                a.k.weights(files).rows_slice(k_rows.clone()),
                a.v.weights(files).rows_slice(v_rows.clone()),
            ],
        )?;
        let mut v = qkv.pop().expect("v");
        let mut k = qkv.pop().expect("k");
        let mut q = qkv.pop().expect("q");
        drop(project_span);
        let prepare_span = span(Phase::AttnPrepare);
        let (q_row, k_row, v_row) = (nh * dk, nkv * dk, nkv * dv);
        // Bound per the architecture's `QkNorm` (both or neither).
        let (q_norm, k_norm) = match (&a.q_norm, &a.k_norm) {
            (Some(qn), Some(kn)) => (Some(qn), Some(kn)),
            _ => (None, None),
        };
        // Per row: bias, norm, RoPE (each row on its own, so the split does not matter).
        let prepare = |rows: &mut [f32],
                       first: usize,
                       width: usize,
                       bias: Option<&[f32]>,
                       norm_w: Option<&Vec<f32>>,
                       rotate: bool| {
            if let Some(b) = bias {
                add_rows(rows, b);
            }
            if let Some(w) = norm_w {
                norm::rms_norm_rows_inplace(rows, w, hp.rms_eps);
            }
            if rotate {
                for (i, row) in rows.chunks_exact_mut(width).enumerate() {
                    rope.apply(hp.rope.kind, first + i, row, dk);
                }
            }
        };
        let q_bias = a.q_bias.as_ref().map(|b| &b[q_rows.clone()]);
        let k_bias = a.k_bias.as_ref().map(|b| &b[k_rows.clone()]);
        let v_bias = a.v_bias.as_ref().map(|b| &b[v_rows]);
        if let (QkNorm::Whole, Some(qn), Some(kn)) = (self.spec.qk_norm, q_norm, k_norm) {
            // One norm over all heads: bias first, then the norm from every head's sum of
            // squares (all-reduced when the heads are split), then RoPE.
            cx.par_rows(&mut q, q_row, |_, rows| {
                prepare(rows, 0, q_row, q_bias, None, false)
            });
            cx.par_rows(&mut k, k_row, |_, rows| {
                prepare(rows, 0, k_row, k_bias, None, false)
            });
            self.whole_qk_norm(il, &mut q, &mut k, &qn[q_rows], &kn[k_rows], hooks)?;
            cx.par_rows(&mut q, q_row, |first, rows| {
                prepare(rows, first, q_row, None, None, true)
            });
            cx.par_rows(&mut k, k_row, |first, rows| {
                prepare(rows, first, k_row, None, None, true)
            });
        } else {
            cx.par_rows(&mut q, q_row, |first, rows| {
                prepare(rows, first, q_row, q_bias, q_norm, true)
            });
            cx.par_rows(&mut k, k_row, |first, rows| {
                prepare(rows, first, k_row, k_bias, k_norm, true)
            });
        }
        if v_bias.is_some() {
            cx.par_rows(&mut v, v_row, |first, rows| {
                prepare(rows, first, v_row, v_bias, None, false)
            });
        }
        hooks.observe(Some(il), "Qcur", &q);
        hooks.observe(Some(il), "Kcur", &k);
        hooks.observe(Some(il), "Vcur", &v);
        let mut row = 0;
        for (s, &p) in seqs.iter_mut().zip(pos0) {
            for i in 0..s.n_tokens {
                s.kv.store(
                    il,
                    p + i,
                    &k[row * k_row..(row + 1) * k_row],
                    &v[row * v_row..(row + 1) * v_row],
                )?;
                row += 1;
            }
        }
        drop(prepare_span);
        let spans = seq_spans(seqs, pos0);
        let shape = AttentionShape {
            n_head: nh,
            n_kv_head: nkv,
            head_dim_k: dk,
            head_dim_v: dv,
            scale: hp.attn_scale(),
            values_in_keys: false,
            window: hp.window(il),
            sinks: a.sinks.as_ref().map(|s| &s[heads.clone()]),
        };
        let mut att = cx.zeroed::<f32>(n * nh * dv);
        timed(Phase::Attention, || {
            attend(&cx.pool, &cx.kernels, il, &shape, &spans, &q, &mut att)
        })?;
        hooks.observe(Some(il), "kqv_out", &att);
        self.attention_output(cx, il, &a.o, a.o_bias.as_deref(), &att, x, hooks)
    }

    /// RMSNorm over the whole q and k projections (OLMoE) of rows holding this rank's heads:
    /// each head's sum of squares in f64, placed at its head's slot (zero elsewhere) and
    /// all-reduced, then summed in head order — the same additions whatever the split, so a
    /// rank's heads are normalized exactly as on a single node. `q_w`/`k_w` are this rank's
    /// slices of the norm weights.
    fn whole_qk_norm(
        &self,
        il: usize,
        q: &mut [f32],
        k: &mut [f32],
        q_w: &[f32],
        k_w: &[f32],
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let hp = &self.hp;
        let sh = &self.shard;
        let dk = hp.head_dim_k;
        let (q_row, k_row) = (sh.heads.len() * dk, sh.kv_heads.len() * dk);
        let n = q.len().checked_div(q_row).unwrap_or(0);
        let slots = hp.n_head + hp.n_head_kv;
        let mut sums = vec![0f64; n * slots];
        let head_sums = |rows: &[f32], first_slot: usize, sums: &mut [f64]| {
            for (h, head) in rows.chunks_exact(dk.max(1)).enumerate() {
                sums[first_slot + h] = head.iter().map(|&v| v as f64 * v as f64).sum();
            }
        };
        for t in 0..n {
            let row_sums = &mut sums[t * slots..(t + 1) * slots];
            head_sums(&q[t * q_row..(t + 1) * q_row], sh.heads.start, row_sums);
            head_sums(
                &k[t * k_row..(t + 1) * k_row],
                hp.n_head + sh.kv_heads.start,
                row_sums,
            );
        }
        if sh.attention_split {
            timed(Phase::AllReduce, || {
                hooks.all_reduce(il, ReducePoint::QkNormSums, &mut sums)
            })?;
        }
        let normalize = |rows: &mut [f32], ss: &[f64], w: &[f32]| {
            let len = (ss.len() * dk) as f64;
            let total: f64 = ss.iter().sum();
            let scale = 1.0 / ((total / len) as f32 + hp.rms_eps).sqrt();
            for (v, &g) in rows.iter_mut().zip(w) {
                *v = g * (*v * scale);
            }
        };
        for t in 0..n {
            let row_sums = &sums[t * slots..(t + 1) * slots];
            let (q_sums, k_sums) = row_sums.split_at(hp.n_head);
            normalize(&mut q[t * q_row..(t + 1) * q_row], q_sums, q_w);
            normalize(&mut k[t * k_row..(t + 1) * k_row], k_sums, k_w);
        }
        Ok(())
    }

    /// The output projection of this rank's heads' attention output `att` (`n × heads ×
    /// head_dim_out`), a partial sum over the heads when split, plus the output bias where the
    /// model has one, added to the residual stream.
    #[allow(clippy::too_many_arguments)]
    fn attention_output(
        &self,
        cx: &Compute,
        il: usize,
        o: &Matrix,
        o_bias: Option<&[f32]>,
        att: &[f32],
        x: &mut [f32],
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let sh = &self.shard;
        let d = self.hp.n_embd;
        let n = x.len() / d;
        let dv = self.hp.head_dim_out();
        let heads = &sh.heads;
        let ain = Input::new(att, n, heads.len() * dv)?;
        let o_w = o.weights(self.files());
        let o_w = if sh.attention_split {
            o_w.cols_slice(heads.start * dv..heads.end * dv)
                .expect("a head split is block-aligned (checked by Shard::new)")
        } else {
            o_w
        };
        let mut out = vec![0f64; n * d];
        timed(Phase::AttnOutput, || {
            cx.matmul_chunked(&o_w, &ain, self.o_chunk(), &mut out)
        })?;
        if sh.attention_split {
            timed(Phase::AllReduce, || {
                hooks.all_reduce(il, ReducePoint::AttentionOutput, &mut out)
            })?;
        }
        if let Some(b) = o_bias {
            // After the reduction, so it is added once whatever the split.
            for row in out.chunks_exact_mut(d) {
                for (v, &bv) in row.iter_mut().zip(b) {
                    *v += bv as f64;
                }
            }
        }
        timed(Phase::Residual, || add_residual(cx, x, &out, d));
        hooks.observe(Some(il), "ffn_inp", x);
        Ok(())
    }

    /// Multi-head latent attention: queries of this rank's heads, the latent + rope row of
    /// every new token into the cache (every rank keeps the whole latent cache: it is shared
    /// by all heads and small), attention in the model's form, output projection (a partial
    /// sum over the heads when split). GLM-5's sparse layers attend to the positions of a
    /// selection instead: their own indexer's (full layers, which leave it in `selection`)
    /// or the latest full layer's (shared ones). Every rank runs the whole indexer: splitting
    /// its heads would need the score of every visible position all-reduced per query, more
    /// traffic than the work it saves.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention_layer(
        &self,
        cx: &Compute,
        il: usize,
        w: &MlaAttention,
        x: &mut [f32],
        seqs: &mut [SeqInput],
        pos0: &[usize],
        rope: &RopeTable,
        selection: &mut Option<Selection>,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let hp = &self.hp;
        let files = self.files();
        let sh = &self.shard;
        let d = hp.n_embd;
        let n = x.len() / d;
        let heads = sh.heads.clone();
        let mut h = vec![0f32; n * d];
        timed(Phase::Norm, || {
            cx.rms_norm_rows(x, &w.norm, hp.rms_eps, &mut h)
        });
        hooks.observe(Some(il), "attn_norm", &h);
        let (from_input, from_latent) = match &w.indexer {
            Some(ix) => (
                vec![ix.k.weights(files), ix.proj.weights(files)],
                vec![ix.q_b.weights(files)],
            ),
            None => (Vec::new(), Vec::new()),
        };
        let mut p = timed(Phase::AttnProject, || {
            mla::project(
                cx,
                files,
                hp,
                w,
                &heads,
                &h,
                rope,
                &from_input,
                &from_latent,
            )
        })?;
        hooks.observe(Some(il), "kv_cmpr_pe", &p.cache_rows);
        let row = hp.head_dim_k;
        let mut t = 0;
        for (s, &p0) in seqs.iter_mut().zip(pos0) {
            for i in 0..s.n_tokens {
                s.kv.store(il, p0 + i, &p.cache_rows[t * row..(t + 1) * row], &[])?;
                t += 1;
            }
        }
        if let (Some(dsa), Some(ix), Some(q)) = (&hp.dsa, &w.indexer, p.extra_latent.pop()) {
            let mut from_input = std::mem::take(&mut p.extra_input).into_iter();
            let (Some(k), Some(weights)) = (from_input.next(), from_input.next()) else {
                unreachable!("two indexer projections of the block input were asked")
            };
            let raw = indexer::IndexerInputs { q, w: weights, k };
            let inputs = timed(Phase::AttnPrepare, || {
                indexer::finish_projections(cx, hp, dsa, ix, rope, raw)
            });
            let made = timed(Phase::Attention, || {
                indexer::select(cx, dsa, il, &inputs, seqs, pos0)
            })?;
            *selection = Some(made);
        }
        let spans = seq_spans(seqs, pos0);
        let att = match &hp.dsa {
            // Both time their own parts (queries absorbed, attention, outputs lifted).
            None => mla::attend_latent(cx, files, hp, w, &heads, il, &spans, &p, self.mla_form)?,
            Some(_) => {
                let chosen = indexer::reused(selection.as_ref(), il, n)?;
                mla::attend_selected(cx, files, hp, w, &heads, il, &spans, &p, chosen)?
            }
        };
        hooks.observe(Some(il), "kqv_out", &att);
        self.attention_output(cx, il, &w.o, None, &att, x, hooks)
    }

    /// Reduction chunk of the attention output projection: whole heads, whole blocks.
    fn o_chunk(&self) -> usize {
        // A rank gets whole kv heads' groups of query heads (latent attention: single heads).
        let heads_per_unit = match self.hp.mla {
            Some(_) => 1,
            None => self.hp.n_head / self.hp.n_head_kv.max(1),
        };
        crate::shard::o_chunk(self.o_dtype, self.hp.head_dim_out(), heads_per_unit)
    }
}
