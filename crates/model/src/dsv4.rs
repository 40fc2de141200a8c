//! DeepSeek V4's layer (`deepseek4`): the residual is `hc` streams of `n_embd`; around each
//! block a hyper-connection mix collapses them into the block's input and spreads its output
//! back (Sinkhorn-normalized stream mixing). Attention has one shared key/value head (keys are
//! the values), rope on the trailing `n_rot` dims with the inverse rope on the output, a raw
//! sliding window on every layer plus the compressed rows of ratio-4 layers (those the
//! lightning indexer picks) or ratio-128 layers (all that are complete), learned sinks and a
//! grouped low-rank output projection. The FFN is sqrt-softplus routed experts (the first
//! layers hash-routed by token id) plus a shared expert, both with the clamped SwiGLU.
//!
//! Semantics follow DeepSeek's reference as transformers 5.24 computes it in float32 (the
//! simulated FP8/FP4 activation rounding of DeepSeek's own inference code is not applied; see
//! docs/models.md).

use kernels::Input;
use kernels::attn::{self, KvElem, Rows};

use crate::Model;
use crate::arch::Glu;
use crate::blocks::Compute;
use crate::blocks::moe::{ExpertFfn, Routing, moe_ffn, route_tokens, softplus};
use crate::blocks::norm;
use crate::blocks::rope::RopeTable;
use crate::error::{ModelError, Result};
use crate::experts::ExpertSource;
use crate::forward::{Hooks, ReducePoint, SeqInput};
use crate::hparams::{Dsv4Params, Hparams};
use crate::kv::{KvCache, KvType, Pool};
use crate::profile::{Phase, span, timed};
use crate::weights::{Compressor, Dsv4Attention, Ffn, HyperMix};

/// The rope tables of a batch: sliding layers rotate with the main base, compressed layers
/// (queries, keys, indexer queries) with the compressed one.
pub(crate) struct Dsv4Ropes {
    pub main: RopeTable,
    pub compress: RopeTable,
}

impl Dsv4Ropes {
    pub fn new(hp: &Hparams, positions: &[usize]) -> Dsv4Ropes {
        let p = hp.dsv4.as_ref().expect("deepseek4 hparams");
        Dsv4Ropes {
            main: RopeTable::new(&hp.rope, None, positions),
            compress: RopeTable::new(&p.compress_rope, None, positions),
        }
    }
}

/// `x / sqrt(mean(x²) + eps)` (no weight).
fn unit_rms(x: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v * scale;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Rotates (or, `inverse`, rotates back) the trailing `n_rot` dims of every `head_dim` head of
/// `row` by row `t` of `table` (consecutive pairs).
fn rope_tail(
    table: &RopeTable,
    t: usize,
    row: &mut [f32],
    head_dim: usize,
    n_rot: usize,
    inverse: bool,
) {
    for head in row.chunks_exact_mut(head_dim) {
        let tail = &mut head[head_dim - n_rot..];
        if inverse {
            table.apply_inverse(t, tail);
        } else {
            table.apply(crate::arch::RopeKind::Norm, t, tail, n_rot);
        }
    }
}

/// The stream mix around a block: the collapsed block input (`n × d`) and, per token, the
/// `hc` post weights and the `hc × hc` combination (`comb[src·hc + dst]`).
struct Mix {
    collapsed: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
}

/// Hyper-connection pre-mix of `x` (`n × hc·d`).
fn hc_pre(
    cx: &Compute,
    model: &Model,
    x: &[f32],
    w: &HyperMix,
    p: &Dsv4Params,
    eps: f32,
) -> Result<Mix> {
    let hc = p.hc;
    let wide = w.fn_.cols;
    let d = wide / hc;
    let n = x.len() / wide;
    let mut flat = vec![0f32; x.len()];
    cx.par_rows(&mut flat, wide, |first, rows| {
        for (j, out) in rows.chunks_exact_mut(wide).enumerate() {
            let t = first + j;
            unit_rms(&x[t * wide..(t + 1) * wide], eps, out);
        }
    });
    let input = Input::new(&flat, n, wide)?;
    let mixes = cx
        .project(&input, &[w.fn_.weights(model.files())])?
        .pop()
        .expect("one output");
    let m = w.fn_.rows;
    let mut pre = vec![0f32; n * hc];
    let mut post = vec![0f32; n * hc];
    let mut comb = vec![0f32; n * hc * hc];
    for t in 0..n {
        let mx = &mixes[t * m..(t + 1) * m];
        for j in 0..hc {
            pre[t * hc + j] = sigmoid(mx[j] * w.scale[0] + w.base[j]) + p.hc_eps;
            post[t * hc + j] = 2.0 * sigmoid(mx[hc + j] * w.scale[1] + w.base[hc + j]);
        }
        let c = &mut comb[t * hc * hc..(t + 1) * hc * hc];
        for (i, v) in c.iter_mut().enumerate() {
            *v = mx[2 * hc + i] * w.scale[2] + w.base[2 * hc + i];
        }
        sinkhorn(c, hc, p.sinkhorn_iters, p.hc_eps);
    }
    // The streams' weighted sum, row by row on the pool (the same operations in the same
    // order per row whatever the split).
    let mut collapsed = vec![0f32; n * d];
    cx.par_rows(&mut collapsed, d, |first, rows| {
        for (k, out) in rows.chunks_exact_mut(d).enumerate() {
            let t = first + k;
            for (j, &pj) in pre[t * hc..(t + 1) * hc].iter().enumerate() {
                let stream = &x[t * wide + j * d..t * wide + (j + 1) * d];
                if j == 0 {
                    for (o, &v) in out.iter_mut().zip(stream) {
                        *o = pj * v;
                    }
                } else {
                    for (o, &v) in out.iter_mut().zip(stream) {
                        *o += pj * v;
                    }
                }
            }
        }
    });
    Ok(Mix {
        collapsed,
        post,
        comb,
    })
}

/// Softmax over each source's destinations, `+ eps`, then alternating normalization of the
/// destinations' columns and the sources' rows (columns first and last), every denominator
/// `sum + eps` (DeepSeek's reference).
fn sinkhorn(c: &mut [f32], hc: usize, iters: usize, eps: f32) {
    for row in c.chunks_exact_mut(hc) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v = *v / sum + eps;
        }
    }
    let norm_cols = |c: &mut [f32]| {
        for k in 0..hc {
            let s: f32 = (0..hc).map(|j| c[j * hc + k]).sum::<f32>() + eps;
            for j in 0..hc {
                c[j * hc + k] /= s;
            }
        }
    };
    norm_cols(c);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(hc) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
        norm_cols(c);
    }
}

/// `x ← post ⊗ y + combᵀ · x` per token (`y` is the block output, `n × d`).
fn hc_post(cx: &Compute, x: &mut [f32], y: &[f64], mix: &Mix, hc: usize) {
    let n = mix.post.len() / hc;
    let wide = x.len() / n.max(1);
    let d = wide / hc;
    cx.par_rows(x, wide, |first, rows| {
        let mut old = vec![0f32; wide];
        for (j, row) in rows.chunks_exact_mut(wide).enumerate() {
            let t = first + j;
            old.copy_from_slice(row);
            let post = &mix.post[t * hc..(t + 1) * hc];
            let comb = &mix.comb[t * hc * hc..(t + 1) * hc * hc];
            let yt = &y[t * d..(t + 1) * d];
            for k in 0..hc {
                let out = &mut row[k * d..(k + 1) * d];
                for (i, o) in out.iter_mut().enumerate() {
                    let mut v = post[k] * yt[i] as f32;
                    for src in 0..hc {
                        v += comb[src * hc + k] * old[src * d + i];
                    }
                    *o = v;
                }
            }
        }
    });
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the length is the
    // slice's size in bytes and the lifetime is the slice's.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Indices of the `k` largest scores (ties to the lower index), ascending.
fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    if scores.len() > k {
        idx.select_nth_unstable_by(k, |&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

impl Model {
    /// The glu of the routed (`shared` false) or shared experts.
    fn dsv4_glu(&self, shared: bool) -> Glu {
        let p = self.hp.dsv4.as_ref().expect("deepseek4 hparams");
        let limit = if shared {
            p.swiglu_limit_shexp
        } else {
            p.swiglu_limit
        };
        if limit > 1e-6 {
            Glu::ClampedSilu { limit }
        } else {
            Glu::Silu
        }
    }

    /// One DeepSeek V4 layer over the streams `x` (`n × hc·n_embd`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dsv4_layer(
        &self,
        cx: &Compute,
        il: usize,
        x: &mut [f32],
        tokens: Option<&[u32]>,
        seqs: &mut [SeqInput],
        pos0: &[usize],
        ropes: &Dsv4Ropes,
        experts: &dyn ExpertSource,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let hp = &self.hp;
        let p = hp.dsv4.as_ref().expect("deepseek4 hparams");
        let l = self.held_layer(il)?;
        let crate::weights::AttentionWeights::Dsv4(a) = &l.attn else {
            return Err(ModelError::Input(format!(
                "layer {il} is not a DeepSeek V4 layer"
            )));
        };
        let d = hp.n_embd;
        let mix = timed(Phase::HyperMix, || {
            hc_pre(cx, self, x, &a.hc_attn, p, hp.rms_eps)
        })?;
        let n = mix.collapsed.len() / d;
        let mut h = vec![0f32; n * d];
        cx.rms_norm_rows(&mix.collapsed, &a.norm, hp.rms_eps, &mut h);
        hooks.observe(Some(il), "attn_norm", &h);
        let mut att = self.dsv4_attention(cx, il, a, &h, seqs, pos0, ropes, hooks)?;
        if self.shard.attention_split {
            timed(Phase::AllReduce, || {
                hooks.all_reduce(il, ReducePoint::AttentionOutput, &mut att)
            })?;
        }
        timed(Phase::HyperMix, || hc_post(cx, x, &att, &mix, p.hc));
        hooks.observe(Some(il), "hc_attn_post", x);

        let mix = timed(Phase::HyperMix, || {
            hc_pre(cx, self, x, &a.hc_ffn, p, hp.rms_eps)
        })?;
        cx.rms_norm_rows(&mix.collapsed, &l.ffn_norm, hp.rms_eps, &mut h);
        hooks.observe(Some(il), "ffn_norm", &h);
        if experts.lookahead() {
            // The next layer's experts, guessed from this layer's collapsed FFN input (its
            // own input is one stream mix away), so reads overlap this layer's work.
            self.prefetch_next_layer(cx, il, &mix.collapsed, experts)?;
        }
        let mut out = self.dsv4_ffn(cx, il, &h, tokens, experts, hooks)?;
        if self.shard.is_split() {
            timed(Phase::AllReduce, || {
                hooks.all_reduce(il, ReducePoint::FfnOutput, &mut out)
            })?;
        }
        timed(Phase::HyperMix, || hc_post(cx, x, &out, &mix, p.hc));
        Ok(())
    }

    /// Routed experts (hash- or score-selected) plus the shared expert, as a partial sum of
    /// this rank's experts.
    fn dsv4_ffn(
        &self,
        cx: &Compute,
        il: usize,
        h: &[f32],
        tokens: Option<&[u32]>,
        experts: &dyn ExpertSource,
        hooks: &mut dyn Hooks,
    ) -> Result<Vec<f64>> {
        let hp = &self.hp;
        let d = hp.n_embd;
        let n = h.len() / d;
        let Ffn::Moe {
            router,
            selection_bias,
            experts: tensors,
            shared,
            hash_routes,
            ..
        } = &self.held_layer(il)?.ffn
        else {
            return Err(ModelError::Input(format!("layer {il} has no experts")));
        };
        let moe = hp.moe.as_ref().expect("MoE layers have MoE params");
        let hin = Input::new(h, n, d)?;
        let logits = timed(Phase::Router, || {
            cx.project(&hin, &[router.weights(self.files())])
        })?
        .pop()
        .expect("router");
        hooks.observe(Some(il), "ffn_moe_logits", &logits);
        let n_expert = tensors.gate.n_expert;
        let routing = match hash_routes {
            Some(table) => {
                let tokens = tokens.ok_or_else(|| {
                    ModelError::Input(format!(
                        "layer {il} routes by token id and the hidden-state input came without \
                         the batch's token ids"
                    ))
                })?;
                let k = moe.n_expert_used;
                let mut r = Routing {
                    k,
                    experts: Vec::with_capacity(n * k),
                    weights: Vec::with_capacity(n * k),
                };
                for (t, &tok) in tokens.iter().enumerate() {
                    let ids = table
                        .get(tok as usize * k..(tok as usize + 1) * k)
                        .ok_or_else(|| {
                            ModelError::Input(format!("token id {tok} outside the hash table"))
                        })?;
                    let scores: Vec<f32> = ids
                        .iter()
                        .map(|&e| softplus(logits[t * n_expert + e as usize]).sqrt())
                        .collect();
                    let sum: f32 = scores.iter().sum();
                    for (&e, &s) in ids.iter().zip(&scores) {
                        r.experts.push(e as usize);
                        let w = if moe.norm_topk { s / sum } else { s };
                        r.weights.push(w * moe.weights_scale);
                    }
                }
                r
            }
            None => timed(Phase::Route, || {
                route_tokens(cx, &logits, n_expert, moe, selection_bias.as_deref())
            }),
        };
        let kind = ExpertFfn {
            glu: self.dsv4_glu(false),
            biases: None,
        };
        let mut out =
            moe_ffn(cx, il, &hin, &routing, n_expert, d, &kind, experts).map_err(|e| match e {
                ModelError::Matmul(source) => ModelError::Kernel { layer: il, source },
                other => other,
            })?;
        if let Some(sh) = shared {
            let _shared = span(Phase::DenseFfn);
            let s = self.split_glu(cx, &hin, &sh.gate, &sh.up, &sh.down, self.dsv4_glu(true))?;
            for (a, b) in out.iter_mut().zip(&s) {
                *a += b;
            }
        }
        Ok(out)
    }

    /// Attention of layer `il` for the normed block input `h` (`n × d`): the block output
    /// (`n × d`, f64; a partial sum when heads are split).
    #[allow(clippy::too_many_arguments)]
    fn dsv4_attention(
        &self,
        cx: &Compute,
        il: usize,
        a: &Dsv4Attention,
        h: &[f32],
        seqs: &mut [SeqInput],
        pos0: &[usize],
        ropes: &Dsv4Ropes,
        hooks: &mut dyn Hooks,
    ) -> Result<Vec<f64>> {
        let hp = &self.hp;
        let p = hp.dsv4.as_ref().expect("deepseek4 hparams");
        let files = self.files();
        let (d, hd, n_rot) = (hp.n_embd, hp.head_dim_k, hp.rope.n_rot);
        let n = h.len() / d;
        let eps = hp.rms_eps;
        let ratio = p.ratio(il);
        let rope = if ratio > 0 {
            &ropes.compress
        } else {
            &ropes.main
        };
        let heads = self.shard.heads.clone();
        let nh = heads.len();
        let hin = Input::new(h, n, d)?;
        // Everything that reads the block input in one dispatch: the query's first half, the
        // key/value row, the compressors' values and scores, the indexer's head weights.
        let mut mats = vec![a.q_a.weights(files), a.kv.weights(files)];
        if let Some(c) = &a.compressor {
            mats.extend([c.kv.weights(files), c.gate.weights(files)]);
        }
        if let Some(ix) = &a.indexer {
            let c = &ix.compressor;
            mats.extend([
                c.kv.weights(files),
                c.gate.weights(files),
                ix.proj.weights(files),
            ]);
        }
        let mut outs = timed(Phase::AttnProject, || cx.project(&hin, &mats))?.into_iter();
        let mut next = || outs.next().expect("one output per matrix");
        let mut qr = next();
        let mut kv = next();
        let comp_in = a.compressor.as_ref().map(|_| (next(), next()));
        let index_in = a.indexer.as_ref().map(|_| (next(), next(), next()));
        cx.rms_norm_rows_inplace(&mut qr, &a.q_a_norm, eps);
        let qrin = Input::new(&qr, n, p.q_lora_rank)?;
        let q_w = a
            .q_b
            .weights(files)
            .rows_slice(heads.start * hd..heads.end * hd);
        let mut mats = vec![q_w];
        if let Some(ix) = &a.indexer {
            mats.push(ix.q_b.weights(files));
        }
        let mut outs = timed(Phase::AttnProject, || cx.project(&qrin, &mats))?.into_iter();
        let mut q = outs.next().expect("q_b");
        let iq = outs.next();
        let q_row = nh * hd;
        let prepare = span(Phase::AttnPrepare);
        cx.par_rows(&mut q, q_row, |first, rows| {
            let mut tmp = vec![0f32; hd];
            for (j, row) in rows.chunks_exact_mut(q_row).enumerate() {
                for head in row.chunks_exact_mut(hd) {
                    unit_rms(head, eps, &mut tmp);
                    head.copy_from_slice(&tmp);
                }
                rope_tail(rope, first + j, row, hd, n_rot, false);
            }
        });
        cx.par_rows(&mut kv, hd, |first, rows| {
            let mut tmp = vec![0f32; hd];
            for (j, row) in rows.chunks_exact_mut(hd).enumerate() {
                norm::rms_norm(row, &a.kv_norm, eps, &mut tmp);
                row.copy_from_slice(&tmp);
                rope_tail(rope, first + j, row, hd, n_rot, false);
            }
        });
        hooks.observe(Some(il), "q", &q);
        hooks.observe(Some(il), "kv", &kv);
        let mut row = 0;
        for (s, &p0) in seqs.iter_mut().zip(pos0) {
            for i in 0..s.n_tokens {
                s.kv.store(il, p0 + i, &kv[row * hd..(row + 1) * hd], &[])?;
                row += 1;
            }
        }
        drop(prepare);
        // Compressed rows of the windows this batch completes.
        if let (Some(c), Some((ckv, cscore))) = (&a.compressor, comp_in) {
            timed(Phase::Compress, || {
                self.dsv4_compress(c, il, Pool::Attention, ckv, cscore, seqs, pos0)
            })?;
        }
        // The indexer's queries and head weights, and its compressed keys.
        let index = match (&a.indexer, index_in, iq) {
            (Some(ix), Some((ikv, iscore, mut iw)), Some(mut iq)) => {
                timed(Phase::Compress, || {
                    self.dsv4_compress(&ix.compressor, il, Pool::Indexer, ikv, iscore, seqs, pos0)
                })?;
                let (nhi, dhi) = (p.index_n_head, p.index_head_dim);
                cx.par_rows(&mut iq, nhi * dhi, |first, rows| {
                    for (j, row) in rows.chunks_exact_mut(nhi * dhi).enumerate() {
                        rope_tail(&ropes.compress, first + j, row, dhi, n_rot, false);
                    }
                });
                let scale = 1.0 / ((dhi * nhi) as f32).sqrt();
                iw.iter_mut().for_each(|v| *v *= scale);
                Some((iq, iw))
            }
            _ => None,
        };
        // Attention per sequence and token.
        let attention = span(Phase::Attention);
        let scale = 1.0 / (hd as f32).sqrt();
        let window = hp.sliding_window.unwrap_or(usize::MAX);
        let mut att = vec![0f32; n * q_row];
        let sinks = &a.sinks[heads.clone()];
        let mut row0 = 0;
        for (s, &p0) in seqs.iter().zip(pos0) {
            let kv_cache: &KvCache = s.kv;
            let keys = kv_cache.keys(il)?;
            let held = kv_cache.held_from(il)?;
            let kt = kv_cache.layout().kv_type;
            let comp_rows = match &a.compressor {
                Some(_) => kv_cache.pool_rows(il, Pool::Attention)?,
                None => &[][..],
            };
            let index_rows = match &a.indexer {
                Some(_) => kv_cache.pool_rows(il, Pool::Indexer)?,
                None => &[][..],
            };
            let rows = row0..row0 + s.n_tokens;
            let att_seq = &mut att[rows.start * q_row..rows.end * q_row];
            let q_seq = &q[rows.start * q_row..rows.end * q_row];
            let index = index.as_ref();
            let isa = cx.kernels.isa;
            let raw_elem = match kt {
                KvType::F32 => KvElem::F32,
                KvType::F16 => KvElem::F16,
            };
            let row_bytes = hd * raw_elem.bytes();
            cx.par_rows(att_seq, q_row, |first, out_rows| {
                let mut picked: Vec<u8> = Vec::new();
                let mut scores: Vec<f32> = Vec::new();
                let mut index_scores: Vec<f32> = Vec::new();
                let mut head_scores: Vec<f32> = Vec::new();
                for (j, out) in out_rows.chunks_exact_mut(q_row).enumerate() {
                    let t = first + j;
                    let pos = p0 + t;
                    // Raw rows of the window (in the cache as stored), then the compressed
                    // rows this token sees (as f32).
                    let lo = pos.saturating_sub(window - 1).max(held);
                    let raw = Rows {
                        data: &keys[(lo - held) * row_bytes..(pos + 1 - held) * row_bytes],
                        stride: row_bytes,
                        n: pos + 1 - lo,
                        d: hd,
                        elem: raw_elem,
                    };
                    picked.clear();
                    if let Some(visible) = (pos + 1).checked_div(ratio) {
                        let chosen: Vec<usize> = match index {
                            Some((iq, iw)) => {
                                let (nhi, dhi) = (p.index_n_head, p.index_head_dim);
                                let bt = rows.start + t;
                                let qi = &iq[bt * nhi * dhi..(bt + 1) * nhi * dhi];
                                let wi = &iw[bt * nhi..(bt + 1) * nhi];
                                let krows = Rows {
                                    data: f32_bytes(&index_rows[..visible * dhi]),
                                    stride: dhi * 4,
                                    n: visible,
                                    d: dhi,
                                    elem: KvElem::F32,
                                };
                                index_scores.clear();
                                index_scores.resize(visible, 0.0);
                                head_scores.resize(visible, 0.0);
                                for hh in 0..nhi {
                                    attn::scores(
                                        isa,
                                        &qi[hh * dhi..(hh + 1) * dhi],
                                        krows,
                                        1.0,
                                        &mut head_scores,
                                    );
                                    for (acc, &sc) in index_scores.iter_mut().zip(&head_scores) {
                                        *acc += sc.max(0.0) * wi[hh];
                                    }
                                }
                                top_k(&index_scores, p.index_topk)
                            }
                            None => (0..visible).collect(),
                        };
                        for w in chosen {
                            picked.extend_from_slice(f32_bytes(&comp_rows[w * hd..(w + 1) * hd]));
                        }
                    }
                    let comp = Rows {
                        data: &picked,
                        stride: hd * 4,
                        n: picked.len() / (hd * 4),
                        d: hd,
                        elem: KvElem::F32,
                    };
                    let n_keys = raw.n + comp.n;
                    scores.resize(n_keys, 0.0);
                    for (hh, o) in out.chunks_exact_mut(hd).enumerate() {
                        let qh = &q_seq[t * q_row + hh * hd..t * q_row + (hh + 1) * hd];
                        let (sr, sc) = scores.split_at_mut(raw.n);
                        attn::scores(isa, qh, raw, scale, sr);
                        if comp.n > 0 {
                            attn::scores(isa, qh, comp, scale, sc);
                        }
                        attn::softmax_with_sink(isa, &mut scores, Some(sinks[hh]));
                        o.fill(0.0);
                        attn::weighted_sum(isa, &scores[..raw.n], raw, o);
                        if comp.n > 0 {
                            attn::weighted_sum(isa, &scores[raw.n..], comp, o);
                        }
                    }
                    rope_tail(rope, rows.start + t, out, hd, n_rot, true);
                }
            });
            row0 += s.n_tokens;
        }
        drop(attention);
        hooks.observe(Some(il), "kqv_out", &att);
        // Grouped output projection: each group of heads through its own low-rank block, then
        // the mix of this rank's groups (a partial sum when groups are split across ranks).
        let per_group = hp.n_head / p.o_groups;
        let group_cols = per_group * hd;
        let (g0, g1) = (heads.start / per_group, heads.end / per_group);
        let r = p.o_lora_rank;
        let ng = g1 - g0;
        // Each group's heads as its own input rows, all groups' blocks in one dispatch.
        let output_span = span(Phase::AttnOutput);
        let group_inputs: Vec<Vec<f32>> = (g0..g1)
            .map(|g| {
                let off = (g - g0) * group_cols;
                let mut gin = Vec::with_capacity(n * group_cols);
                for t in 0..n {
                    gin.extend_from_slice(&att[t * q_row + off..t * q_row + off + group_cols]);
                }
                gin
            })
            .collect();
        let inputs = group_inputs
            .iter()
            .map(|gin| Input::new(gin, n, group_cols))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut group_out: Vec<Vec<f32>> = vec![vec![0f32; n * r]; ng];
        {
            let mut jobs = Vec::with_capacity(ng);
            for ((g, input), out) in (g0..g1).zip(&inputs).zip(group_out.iter_mut()) {
                let w = a.o_a.weights(files).rows_slice(g * r..(g + 1) * r);
                let act = kernels::format(w.dtype)
                    .ok_or(kernels::MatmulError::UnsupportedType(w.dtype))?
                    .act;
                jobs.push(kernels::MatmulJob {
                    w,
                    acts: input.quantized(act, &cx.pool),
                    n,
                    out,
                });
            }
            cx.kernels.matmul_batch(&cx.pool, &mut jobs)?;
        }
        let mut oa = vec![0f32; n * ng * r];
        for (k, y) in group_out.iter().enumerate() {
            for t in 0..n {
                oa[t * ng * r + k * r..t * ng * r + (k + 1) * r]
                    .copy_from_slice(&y[t * r..(t + 1) * r]);
            }
        }
        drop(output_span);
        let oin = Input::new(&oa, n, ng * r)?;
        let mut out = vec![0f64; n * d];
        let o_b = a.o_b.weights(files);
        let o_b = if self.shard.attention_split {
            o_b.cols_slice(g0 * r..g1 * r)
                .expect("a group split is block-aligned (checked by Shard::new)")
        } else {
            o_b
        };
        // One group's columns per reduction chunk, so a split by groups sums the same chunks.
        let chunk = if a.o_b.dtype.row_bytes(r as u64).is_some() {
            r
        } else {
            ng * r
        };
        timed(Phase::AttnOutput, || {
            cx.kernels
                .matmul_chunked(&cx.pool, &o_b, &oin, chunk, &mut out)
        })?;
        Ok(out)
    }

    /// Appends compressor `c`'s inputs (`kv` and `score` rows of the batch's new positions,
    /// the score before `ape`) and makes the rows of the windows they complete.
    #[allow(clippy::too_many_arguments)]
    fn dsv4_compress(
        &self,
        c: &Compressor,
        il: usize,
        pool: Pool,
        kv: Vec<f32>,
        mut score: Vec<f32>,
        seqs: &mut [SeqInput],
        pos0: &[usize],
    ) -> Result<()> {
        let p = self.hp.dsv4.as_ref().expect("deepseek4 hparams");
        let w_in = c.kv.rows;
        let mut row0 = 0;
        for (s, &p0) in seqs.iter_mut().zip(pos0) {
            for i in 0..s.n_tokens {
                let ape = &c.ape[((p0 + i) % c.ratio) * w_in..((p0 + i) % c.ratio + 1) * w_in];
                let r = &mut score[(row0 + i) * w_in..(row0 + i + 1) * w_in];
                for (v, &b) in r.iter_mut().zip(ape) {
                    *v += b;
                }
            }
            let rows = row0 * w_in..(row0 + s.n_tokens) * w_in;
            s.kv.push_pool_inputs(il, pool, p0, &kv[rows.clone()], &score[rows])?;
            // Windows complete at the end of this batch and not yet made.
            let end = p0 + s.n_tokens;
            let made = s.kv.pool_rows(il, pool)?.len() / c.width;
            for w in made..end / c.ratio {
                let row = self.dsv4_pool_row(c, s.kv, il, pool, w, &p.compress_rope)?;
                s.kv.push_pool_row(il, pool, &row)?;
            }
            row0 += s.n_tokens;
        }
        Ok(())
    }

    /// The compressed row of window `w`: per value a softmax over the window's scores (ratio
    /// 4: the previous window's first halves and this window's second halves), the weighted
    /// sum, RMSNorm, RoPE at the window's first position.
    fn dsv4_pool_row(
        &self,
        c: &Compressor,
        kv: &KvCache,
        il: usize,
        pool: Pool,
        w: usize,
        rope: &crate::hparams::RopeParams,
    ) -> Result<Vec<f32>> {
        let (ratio, width) = (c.ratio, c.width);
        let w_in = c.kv.rows;
        // (kv, score, offset into the input row) of every slot.
        let mut slots: Vec<(&[f32], &[f32])> = Vec::with_capacity(2 * ratio);
        let cur = kv.pool_inputs(il, pool, w * ratio..(w + 1) * ratio)?;
        let prev = if c.overlap && w > 0 {
            Some(kv.pool_inputs(il, pool, (w - 1) * ratio..w * ratio)?)
        } else {
            None
        };
        if let Some((pk, ps)) = prev {
            for j in 0..ratio {
                slots.push((
                    &pk[j * w_in..j * w_in + width],
                    &ps[j * w_in..j * w_in + width],
                ));
            }
        }
        let half = if c.overlap { width } else { 0 };
        for j in 0..ratio {
            slots.push((
                &cur.0[j * w_in + half..j * w_in + half + width],
                &cur.1[j * w_in + half..j * w_in + half + width],
            ));
        }
        let mut pooled = vec![0f32; width];
        for (i, o) in pooled.iter_mut().enumerate() {
            let max = slots
                .iter()
                .map(|(_, s)| s[i])
                .fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            let mut acc = 0f32;
            for (k, s) in &slots {
                let e = (s[i] - max).exp();
                sum += e;
                acc += e * k[i];
            }
            *o = acc / sum;
        }
        let mut row = vec![0f32; width];
        norm::rms_norm(&pooled, &c.norm, self.hp.rms_eps, &mut row);
        let table = RopeTable::new(rope, None, &[w * ratio]);
        let n_rot = self.hp.rope.n_rot;
        rope_tail(&table, 0, &mut row, width, n_rot, false);
        Ok(row)
    }

    /// Collapses the streams of each head row (`rows × hc·d`) into `rows × d` (the head's
    /// hyper-connection), for the output norm.
    pub(crate) fn dsv4_head_collapse(&self, cx: &Compute, x: &[f32]) -> Result<Vec<f32>> {
        let _span = span(Phase::HyperMix);
        let hp = &self.hp;
        let p = hp.dsv4.as_ref().expect("deepseek4 hparams");
        let w = self
            .hc_head
            .as_ref()
            .ok_or_else(|| self.not_held("the output hyper-connection"))?;
        let (hc, d) = (p.hc, hp.n_embd);
        let wide = hc * d;
        let n = x.len() / wide;
        let mut flat = vec![0f32; x.len()];
        for t in 0..n {
            unit_rms(
                &x[t * wide..(t + 1) * wide],
                hp.rms_eps,
                &mut flat[t * wide..(t + 1) * wide],
            );
        }
        let input = Input::new(&flat, n, wide)?;
        let mixes = cx
            .project(&input, &[w.fn_.weights(self.files())])?
            .pop()
            .expect("one output");
        let mut out = vec![0f32; n * d];
        for t in 0..n {
            let o = &mut out[t * d..(t + 1) * d];
            for j in 0..hc {
                let pre = sigmoid(mixes[t * hc + j] * w.scale[0] + w.base[j]) + p.hc_eps;
                for (ov, &v) in o
                    .iter_mut()
                    .zip(&x[t * wide + j * d..t * wide + (j + 1) * d])
                {
                    *ov += pre * v;
                }
            }
        }
        Ok(out)
    }
}
