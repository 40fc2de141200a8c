//! The one forward path: `forward(layer range, ExpertSource, input, kv, positions)`. A single
//! node calls it with every layer and the head; a pipeline stage with its range; a
//! tensor-parallel rank with an expert source that owns a shard and hooks that all-reduce the
//! partial sums. Streaming only swaps the expert source.

use std::ops::RangeInclusive;

use kernels::Input;

use crate::Model;
use crate::arch::QkNorm;
use crate::blocks::Compute;
use crate::blocks::attention::{AttentionShape, SeqSpan, attend};
use crate::blocks::ffn::glu_ffn;
use crate::blocks::indexer::{self, Selection};
use crate::blocks::mla;
use crate::blocks::moe::{ExpertFfn, moe_ffn, route, route_tokens};
use crate::blocks::norm;
use crate::blocks::rope::RopeTable;
use crate::error::{ModelError, Result};
use crate::experts::ExpertSource;
use crate::profile::{Phase, span, timed};
use crate::weights::{AttentionWeights, Ffn, Matrix, MlaAttention};

use crate::pass::{Hooks, Logits, LogitsWanted, ReducePoint, SeqInput, StageInput, StageOutput};

fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

fn add_into(x: &mut [f64], y: &[f64]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds a block's output (an exact, split-independent f64 sum) to the residual stream in f32,
/// as llama.cpp does.
fn add_residual(cx: &Compute, x: &mut [f32], y: &[f64], row_len: usize) {
    cx.par_rows(x, row_len, |first, rows| {
        for (a, b) in rows.iter_mut().zip(&y[first * row_len..]) {
            *a += *b as f32;
        }
    });
}

/// Splits stage-input rows of `stream + carried` values into the stream and the carried
/// sparse-attention selection (`None` when no layer before this stage made one).
fn split_carried(h: &[f32], stream: usize, carried: usize) -> (Vec<f32>, Option<Selection>) {
    let n = h.len() / (stream + carried);
    let mut x = Vec::with_capacity(n * stream);
    let mut rows = Vec::with_capacity(n * carried);
    for row in h.chunks_exact(stream + carried) {
        x.extend_from_slice(&row[..stream]);
        rows.extend(row[stream..].iter().map(|v| v.to_bits()));
    }
    let made = rows.first().is_some_and(|&p| p != indexer::NO_POSITION);
    (x, made.then_some(Selection { k: carried, rows }))
}

/// Stage-output rows: the stream, then the selection (bit patterns; unused slots when none).
fn join_carried(
    x: &[f32],
    stream: usize,
    carried: usize,
    selection: Option<&Selection>,
) -> Vec<f32> {
    let n = x.len() / stream;
    let mut out = Vec::with_capacity(n * (stream + carried));
    for (i, row) in x.chunks_exact(stream).enumerate() {
        out.extend_from_slice(row);
        match selection {
            Some(s) => out.extend(
                s.rows[i * carried..(i + 1) * carried]
                    .iter()
                    .map(|&p| f32::from_bits(p)),
            ),
            None => out.extend(std::iter::repeat_n(
                f32::from_bits(indexer::NO_POSITION),
                carried,
            )),
        }
    }
    out
}

/// Each sequence's rows of the batch and its cache.
fn seq_spans<'a>(seqs: &'a [SeqInput], pos0: &[usize]) -> Vec<SeqSpan<'a>> {
    let mut spans = Vec::with_capacity(seqs.len());
    let mut row0 = 0;
    for (s, &p0) in seqs.iter().zip(pos0) {
        spans.push(SeqSpan {
            kv: &*s.kv,
            row0,
            n_tokens: s.n_tokens,
            pos0: p0,
        });
        row0 += s.n_tokens;
    }
    spans
}

impl Model {
    /// Runs `layers` (and the output head when `head`) over a batch of sequences.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        cx: &Compute,
        experts: &dyn ExpertSource,
        layers: RangeInclusive<usize>,
        head: bool,
        input: StageInput,
        seqs: &mut [SeqInput],
        hooks: &mut dyn Hooks,
    ) -> Result<StageOutput> {
        let n: usize = seqs.iter().map(|s| s.n_tokens).sum();
        let d = self.hp.n_embd;
        let wide = self.hp.stream_width();
        if *layers.end() >= self.hp.n_layer || layers.start() > layers.end() {
            return Err(ModelError::Input(format!(
                "layer range {layers:?} is outside 0..{}",
                self.hp.n_layer
            )));
        }
        if self.layer(*layers.start()).is_none() || self.layer(*layers.end()).is_none() {
            return Err(self.not_held(&format!("layers {}:{}", layers.start(), layers.end())));
        }
        let mut selection = None;
        let mut x = match input {
            StageInput::Tokens(t) => {
                if *layers.start() != 0 {
                    return Err(ModelError::Input(
                        "token input needs a range that starts at layer 0".into(),
                    ));
                }
                if t.len() != n {
                    return Err(ModelError::Input(format!(
                        "{} tokens for {n} batch rows",
                        t.len()
                    )));
                }
                let mut x = vec![0f32; n * d];
                timed(Phase::Embed, || self.embed(t, &mut x))?;
                hooks.observe(None, "inp_embd", &x);
                if wide != d {
                    // Every hyper-connection stream starts as the embedding.
                    let mut streams = vec![0f32; n * wide];
                    for (row, e) in streams.chunks_exact_mut(wide).zip(x.chunks_exact(d)) {
                        for s in row.chunks_exact_mut(d) {
                            s.copy_from_slice(e);
                        }
                    }
                    x = streams;
                }
                x
            }
            StageInput::Hidden(h) | StageInput::HiddenWithTokens(h, _) => {
                let row = self.hp.hidden_width();
                if h.len() != n * row {
                    return Err(ModelError::Input(format!(
                        "{} hidden values for {n} rows of {row}",
                        h.len()
                    )));
                }
                if row == wide {
                    h.to_vec()
                } else {
                    let (x, carried) = split_carried(h, wide, row - wide);
                    selection = carried;
                    x
                }
            }
        };
        let tokens = match input {
            StageInput::Tokens(t) => Some(t),
            StageInput::HiddenWithTokens(_, t) if t.len() == n => Some(t),
            StageInput::Hidden(_) | StageInput::HiddenWithTokens(..) => None,
        };
        let mut pos0 = Vec::with_capacity(seqs.len());
        for s in seqs.iter_mut() {
            let p = s.kv.len();
            s.kv.reserve(p, s.n_tokens)?;
            pos0.push(p);
        }
        let result = self.run_layers(
            cx, experts, layers, head, &mut x, tokens, seqs, &pos0, selection, hooks,
        );
        if result.is_err() {
            for (s, &p) in seqs.iter_mut().zip(&pos0) {
                // `reserve(p, ..)` kept what position `p` attends to, so this rewind holds.
                let rewound = s.kv.truncate(p);
                debug_assert!(rewound.is_ok(), "{rewound:?}");
            }
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn run_layers(
        &self,
        cx: &Compute,
        experts: &dyn ExpertSource,
        layers: RangeInclusive<usize>,
        head: bool,
        x: &mut Vec<f32>,
        tokens: Option<&[u32]>,
        seqs: &mut [SeqInput],
        pos0: &[usize],
        mut selection: Option<Selection>,
        hooks: &mut dyn Hooks,
    ) -> Result<StageOutput> {
        let positions: Vec<usize> = seqs
            .iter()
            .zip(pos0)
            .flat_map(|(s, &p)| p..p + s.n_tokens)
            .collect();
        if self.hp.glm5next.is_some() {
            let carried = selection.take().map(|s| s.to_lists());
            let handed_on =
                self.glm5next_layers(cx, layers, x, seqs, pos0, experts, carried, hooks)?;
            selection = handed_on
                .map(|l| Selection::from_lists(&l, self.hp.carried_width()))
                .transpose()?;
        } else if self.hp.dsv4.is_some() {
            let ropes = crate::dsv4::Dsv4Ropes::new(&self.hp, &positions);
            for il in layers {
                self.dsv4_layer(cx, il, x, tokens, seqs, pos0, &ropes, experts, hooks)?;
                hooks.observe(Some(il), "l_out", x);
            }
        } else {
            let rope = RopeTable::new(&self.hp.rope, self.rope_freqs.as_deref(), &positions);
            for il in layers {
                self.attention_layer(cx, il, x, seqs, pos0, &rope, &mut selection, hooks)?;
                self.ffn_layer(cx, il, x, experts, hooks)?;
                hooks.observe(Some(il), "l_out", x);
            }
        }
        if !head {
            let carried = self.hp.carried_width();
            if carried == 0 {
                return Ok(StageOutput::Hidden(std::mem::take(x)));
            }
            return Ok(StageOutput::Hidden(join_carried(
                x,
                self.hp.stream_width(),
                carried,
                selection.as_ref(),
            )));
        }
        let d = self.hp.n_embd;
        let mut rows = Vec::new();
        let mut row0 = 0;
        for s in seqs.iter() {
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last if s.n_tokens > 0 => rows.push(row0 + s.n_tokens - 1),
                LogitsWanted::Last => {}
                LogitsWanted::All => rows.extend(row0..row0 + s.n_tokens),
            }
            row0 += s.n_tokens;
        }
        let wide = self.hp.stream_width();
        let mut h = Vec::with_capacity(rows.len() * wide);
        for &r in &rows {
            h.extend_from_slice(&x[r * wide..(r + 1) * wide]);
        }
        let head_span = span(Phase::Head);
        if let Some(p) = &self.hp.glm5next {
            h = crate::glm5next::mean_of_streams(&h, p.hc, d);
        } else if wide != d {
            h = self.dsv4_head_collapse(cx, &h)?;
        }
        let (Some(output_norm), Some(output)) = (&self.output_norm, &self.output) else {
            return Err(self.not_held("the output norm and head"));
        };
        cx.rms_norm_rows_inplace(&mut h, output_norm, self.hp.rms_eps);
        hooks.observe(None, "result_norm", &h);
        let input = Input::new(&h, rows.len(), d)?;
        // A tensor-parallel rank computes its slice of the vocabulary.
        let vocab = self.shard.vocab.clone();
        let out_w = output.weights(self.files()).rows_slice(vocab.clone());
        let data = cx.project(&input, &[out_w])?.pop().expect("one output");
        drop(head_span);
        hooks.observe(None, "result_output", &data);
        Ok(StageOutput::Logits(Logits {
            rows,
            n_vocab: vocab.len(),
            vocab_offset: vocab.start,
            data,
        }))
    }

    /// Attention: q/k/v of this rank's heads (all of them unless split), RoPE, KV append, causal
    /// attention, output projection (a partial sum over the heads when split).
    #[allow(clippy::too_many_arguments)]
    fn attention_layer(
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
        let mut att = vec![0f32; n * nh * dv];
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
            cx.kernels
                .matmul_chunked(&cx.pool, &o_w, &ain, self.o_chunk(), &mut out)
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
            None => timed(Phase::Attention, || {
                mla::attend_latent(cx, files, hp, w, &heads, il, &spans, &p, self.mla_form)
            })?,
            Some(_) => {
                let chosen = indexer::reused(selection.as_ref(), il, n)?;
                timed(Phase::Attention, || {
                    mla::attend_selected(cx, files, hp, w, &heads, il, &spans, &p, chosen)
                })?
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

    /// A SwiGLU FFN, split by columns across tensor-parallel ranks (partial sums); when the
    /// split does not align, rank 0 computes it whole and the others contribute zeros.
    fn split_swiglu(
        &self,
        cx: &Compute,
        x: &Input,
        gate: &crate::weights::Matrix,
        up: &crate::weights::Matrix,
        down: &crate::weights::Matrix,
    ) -> Result<Vec<f64>> {
        self.split_glu(cx, x, gate, up, down, crate::arch::Glu::Silu)
    }

    /// [`Model::split_swiglu`] with another gated activation.
    pub(crate) fn split_glu(
        &self,
        cx: &Compute,
        x: &Input,
        gate: &crate::weights::Matrix,
        up: &crate::weights::Matrix,
        down: &crate::weights::Matrix,
        glu: crate::arch::Glu,
    ) -> Result<Vec<f64>> {
        let files = self.files();
        let (g, u, dn) = (gate.weights(files), up.weights(files), down.weights(files));
        let chunk = crate::shard::ffn_chunk(down.dtype, gate.rows);
        match self.shard.ffn_cols(gate.rows, chunk) {
            Some(cols) if cols.len() == gate.rows => glu_ffn(cx, x, g, u, dn, chunk, glu),
            Some(cols) if cols.is_empty() => Ok(vec![0f64; x.n() * down.rows]),
            Some(cols) => {
                let dn = dn
                    .cols_slice(cols.clone())
                    .expect("aligned by Shard::ffn_cols");
                glu_ffn(
                    cx,
                    x,
                    g.rows_slice(cols.clone()),
                    u.rows_slice(cols),
                    dn,
                    chunk,
                    glu,
                )
            }
            None if self.shard.rank == 0 => glu_ffn(cx, x, g, u, dn, chunk, glu),
            None => Ok(vec![0f64; x.n() * down.rows]),
        }
    }

    /// Runs layer `il + 1`'s router on the current residual stream and asks the expert source to
    /// prefetch what it picks, so reads overlap this layer's experts and the next attention.
    pub(crate) fn prefetch_next_layer(
        &self,
        cx: &Compute,
        il: usize,
        x: &[f32],
        experts: &dyn ExpertSource,
    ) -> Result<()> {
        let next = il + 1;
        let Some(Ffn::Moe {
            selection_bias,
            experts: tensors,
            ..
        }) = self.layer(next).map(|l| &l.ffn)
        else {
            return Ok(());
        };
        let (d, moe) = (
            self.hp.n_embd,
            self.hp.moe.as_ref().expect("MoE layers have MoE params"),
        );
        let n = x.len() / d;
        let mut h = vec![0f32; n * d];
        cx.rms_norm_rows(x, &self.held_layer(next)?.ffn_norm, self.hp.rms_eps, &mut h);
        let hin = Input::new(&h, n, d)?;
        let logits = self.router_logits(cx, next, &hin)?;
        let routing = route(
            &logits,
            tensors.gate.n_expert,
            moe,
            selection_bias.as_deref(),
        );
        let mut wanted: Vec<usize> = routing
            .experts
            .iter()
            .copied()
            .filter(|&e| experts.owns(next, e))
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        experts.prefetch(next, &wanted);
        Ok(())
    }

    /// Router logits of MoE layer `il` for the normed rows `x` (its bias added, if any).
    fn router_logits(&self, cx: &Compute, il: usize, x: &Input) -> Result<Vec<f32>> {
        let Ffn::Moe {
            router,
            router_bias,
            ..
        } = &self.held_layer(il)?.ffn
        else {
            return Err(ModelError::Input(format!("layer {il} has no router")));
        };
        let mut logits = timed(Phase::Router, || {
            cx.project(x, &[router.weights(self.files())])
        })?
        .pop()
        .expect("router");
        if let Some(b) = router_bias {
            add_rows(&mut logits, b);
        }
        Ok(logits)
    }

    /// The feed-forward block: dense SwiGLU, or routed experts (this rank's) plus the shared
    /// expert; one all-reduce of the combined partial sum when tensor-parallel.
    fn ffn_layer(
        &self,
        cx: &Compute,
        il: usize,
        x: &mut [f32],
        experts: &dyn ExpertSource,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let hp = &self.hp;
        let l = self.held_layer(il)?;
        let d = hp.n_embd;
        let n = x.len() / d;
        let mut h = vec![0f32; n * d];
        timed(Phase::Norm, || {
            cx.rms_norm_rows(x, &l.ffn_norm, hp.rms_eps, &mut h)
        });
        hooks.observe(Some(il), "ffn_norm", &h);
        let hin = Input::new(&h, n, d)?;
        let mut out = match &l.ffn {
            Ffn::Dense { gate, up, down } => timed(Phase::DenseFfn, || {
                self.split_swiglu(cx, &hin, gate, up, down)
            })?,
            Ffn::Moe {
                selection_bias,
                experts: tensors,
                expert_biases,
                shared,
                ..
            } => {
                let moe = hp.moe.as_ref().expect("MoE layers have MoE params");
                let logits = self.router_logits(cx, il, &hin)?;
                hooks.observe(Some(il), "ffn_moe_logits", &logits);
                let routing = timed(Phase::Route, || {
                    route_tokens(
                        cx,
                        &logits,
                        tensors.gate.n_expert,
                        moe,
                        selection_bias.as_deref(),
                    )
                });
                if experts.lookahead() {
                    self.prefetch_next_layer(cx, il, x, experts)?;
                }
                let kind = ExpertFfn {
                    glu: self.spec.glu,
                    biases: expert_biases.as_ref(),
                };
                let mut out = moe_ffn(
                    cx,
                    il,
                    &hin,
                    &routing,
                    tensors.gate.n_expert,
                    d,
                    &kind,
                    experts,
                )
                .map_err(|e| match e {
                    ModelError::Matmul(source) => ModelError::Kernel { layer: il, source },
                    other => other,
                })?;

                if let Some(sh) = shared {
                    let _shared_span = span(Phase::DenseFfn);
                    let mut s = self.split_swiglu(cx, &hin, &sh.gate, &sh.up, &sh.down)?;
                    if let Some(g) = &sh.gate_inp {
                        // The gate scales each token's whole output, so it distributes over
                        // the ranks' partial sums.
                        for (t, row) in s.chunks_exact_mut(d).enumerate() {
                            let z: f32 = h[t * d..(t + 1) * d]
                                .iter()
                                .zip(g)
                                .map(|(a, b)| a * b)
                                .sum();
                            let gate = (1.0 / (1.0 + (-z).exp())) as f64;
                            row.iter_mut().for_each(|v| *v *= gate);
                        }
                    }

                    add_into(&mut out, &s);
                }
                out
            }
        };
        if self.shard.is_split() {
            timed(Phase::AllReduce, || {
                hooks.all_reduce(il, ReducePoint::FfnOutput, &mut out)
            })?;
        }
        timed(Phase::Residual, || add_residual(cx, x, &out, d));
        Ok(())
    }
}
