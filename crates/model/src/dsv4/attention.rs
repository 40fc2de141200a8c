//! DeepSeek V4's attention block: low-rank query, one shared key/value row, the raw window and
//! the compressed rows each query sees (all complete ones at ratio 128, the indexer's top-k at
//! ratio 4), sinks, the inverse rope, the grouped output projection.

use kernels::Input;
use kernels::attn::{self, KvElem, Rows};

use super::{Dsv4Ropes, rope_tail, unit_rms};
use crate::Model;
use crate::blocks::Compute;
use crate::blocks::attention::head_groups;
use crate::blocks::indexer::{self, f32_bytes, top_k};
use crate::blocks::norm;
use crate::error::Result;
use crate::kv::{KvCache, KvType, Pool};
use crate::pass::{Hooks, SeqInput};
use crate::profile::{Phase, span, timed};
use crate::weights::Dsv4Attention;

impl Model {
    /// Attention of layer `il` for the normed block input `h` (`n × d`): the block output
    /// (`n × d`, f64; a partial sum when heads are split).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dsv4_attention(
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
            let threads = cx.n_threads();
            // The compressed rows each query sees: every complete one (ratio 128), or the
            // indexer's top-k of them (ratio 4); none on window-only layers.
            let visible = |t: usize| (p0 + t + 1).checked_div(ratio);
            let mut chosen: Vec<Vec<u32>> = vec![Vec::new(); s.n_tokens];
            match index {
                Some((iq, iw)) => {
                    let (nhi, dhi) = (p.index_n_head, p.index_head_dim);
                    let query = |t: usize| {
                        let bt = rows.start + t;
                        (
                            &iq[bt * nhi * dhi..(bt + 1) * nhi * dhi],
                            &iw[bt * nhi..(bt + 1) * nhi],
                        )
                    };
                    let pick = |scores: &[f32]| -> Vec<u32> {
                        top_k(scores, p.index_topk)
                            .into_iter()
                            .map(|w| w as u32)
                            .collect()
                    };
                    if s.n_tokens * 2 <= threads {
                        // Few queries (decode): each one's rows are scored across the pool.
                        for (t, c) in chosen.iter_mut().enumerate() {
                            let Some(v) = visible(t) else { continue };
                            let (qi, wi) = query(t);
                            let mut scores = vec![0f32; v];
                            cx.par_rows(&mut scores, 1, |first, part| {
                                let (mut tmp, mut head) = (Vec::new(), Vec::new());
                                let keys = &index_rows[first * dhi..(first + part.len()) * dhi];
                                indexer::index_scores(isa, qi, wi, keys, dhi, &mut tmp, &mut head);
                                part.copy_from_slice(&tmp);
                            });
                            *c = pick(&scores);
                        }
                    } else {
                        cx.par_rows(&mut chosen, 1, |first, part| {
                            let (mut scores, mut head) = (Vec::new(), Vec::new());
                            for (j, c) in part.iter_mut().enumerate() {
                                let t = first + j;
                                let Some(v) = visible(t) else { continue };
                                let (qi, wi) = query(t);
                                let keys = &index_rows[..v * dhi];
                                indexer::index_scores(
                                    isa,
                                    qi,
                                    wi,
                                    keys,
                                    dhi,
                                    &mut scores,
                                    &mut head,
                                );
                                *c = pick(&scores);
                            }
                        });
                    }
                }
                None => {
                    for (t, c) in chosen.iter_mut().enumerate() {
                        if let Some(v) = visible(t) {
                            *c = (0..v as u32).collect();
                        }
                    }
                }
            }
            // Work items are (query, group of heads), so a decode step fills the pool too.
            let parts = head_groups(nh, threads, s.n_tokens);
            let per_part = nh / parts;
            cx.par_rows(att_seq, per_part * hd, |first, out_parts| {
                let mut picked: Vec<u8> = Vec::new();
                let mut scores: Vec<f32> = Vec::new();
                for (j, out) in out_parts.chunks_exact_mut(per_part * hd).enumerate() {
                    let (t, part) = ((first + j) / parts, (first + j) % parts);
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
                    for &w in &chosen[t] {
                        let w = w as usize;
                        picked.extend_from_slice(f32_bytes(&comp_rows[w * hd..(w + 1) * hd]));
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
                    for (k, o) in out.chunks_exact_mut(hd).enumerate() {
                        let hh = part * per_part + k;
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
            cx.matmul_batch(&mut jobs)?;
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
            cx.matmul_chunked(&o_b, &oin, chunk, &mut out)
        })?;
        Ok(out)
    }
}
