//! The k-pool lightning indexer of a full-indexer latent layer: per token a key
//! (`LayerNorm(attn_k·x)`) and pooling scores (`gate·x`); every complete pool of `kpool`
//! consecutive positions becomes one key, each channel a softmax over the members of
//! `score + ape[place]` weighting their keys. A query scores the complete pools it sees,
//! `Σ_h w_h · ReLU(q_h · P_j) / √(heads · dim)`, and attends to the members of the best
//! `index_topk / kpool` pools (all while there are no more) plus, when `select_tail`, the tail
//! of its own incomplete pool — itself only there or in a chosen pool.

use kernels::Input;
use kernels::attn::{self, KvElem, Rows};

use super::Selection;
use crate::Model;
use crate::blocks::Compute;
use crate::blocks::indexer::{f32_bytes, top_k};
use crate::blocks::norm::layer_norm_rows_inplace;
use crate::error::Result;
use crate::kv::PooledKeys;
use crate::pass::{Hooks, SeqInput};
use crate::profile::{Phase, timed};
use crate::weights::KpoolIndexer;

/// The keys of the pools that `keys` holds complete but has not pooled yet.
fn pool_complete(keys: &mut PooledKeys, ape: &[f32]) {
    let (width, pool) = (keys.width(), keys.pool());
    let mut pooled = vec![0f32; width];
    let mut weights = vec![0f32; pool];
    for j in keys.n_pooled()..keys.n_complete() {
        let (k, s) = keys.rows(j * pool..(j + 1) * pool);
        for (c, out) in pooled.iter_mut().enumerate() {
            let mut max = f32::NEG_INFINITY;
            for (i, wi) in weights.iter_mut().enumerate() {
                *wi = s[i * width + c] + ape[i * width + c];
                max = max.max(*wi);
            }
            let mut sum = 0f32;
            for wi in weights.iter_mut() {
                *wi = (*wi - max).exp();
                sum += *wi;
            }
            *out = weights
                .iter()
                .enumerate()
                .map(|(i, wi)| wi / sum * k[i * width + c])
                .sum();
        }
        keys.push_pooled(&pooled);
    }
}

impl Model {
    /// Stores the batch's indexer keys in layer `il`'s cache (pooling what completes) and
    /// returns each row's selection; `h` is the normed block input, `qr` the normed query
    /// compression.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kpool_select(
        &self,
        cx: &Compute,
        il: usize,
        ix: &KpoolIndexer,
        h: &[f32],
        qr: &[f32],
        seqs: &mut [SeqInput],
        pos0: &[usize],
        hooks: &mut dyn Hooks,
    ) -> Result<Selection> {
        let p = self.glm5_params();
        let files = self.files();
        let d = self.hp.n_embd;
        let n = h.len() / d;
        let (nhi, dhi) = (p.index_n_head, p.index_head_dim);
        let hin = Input::new(h, n, d)?;
        let mut outs = timed(Phase::AttnProject, || {
            cx.project(
                &hin,
                &[
                    ix.k.weights(files),
                    ix.gate.weights(files),
                    ix.proj.weights(files),
                ],
            )
        })?
        .into_iter();
        let mut next = || outs.next().expect("one output per matrix");
        let (mut ik, gate, mut head_w) = (next(), next(), next());
        let eps = p.layer_norm_eps;
        cx.par_rows(&mut ik, dhi, |_, rows| {
            for row in rows.chunks_exact_mut(dhi) {
                layer_norm_rows_inplace(row, &ix.k_norm, &ix.k_norm_bias, eps);
            }
        });
        hooks.observe(Some(il), "indexer_k", &ik);
        let q_lora = qr.len() / n.max(1);
        let qin = Input::new(qr, n, q_lora)?;
        let iq = timed(Phase::AttnProject, || {
            cx.project(&qin, &[ix.q_b.weights(files)])
        })?
        .pop()
        .expect("indexer q_b");
        let scale = 1.0 / ((dhi * nhi) as f32).sqrt();
        head_w.iter_mut().for_each(|v| *v *= scale);

        let mut selection: Selection = vec![Vec::new(); n];
        let mut row0 = 0;
        let isa = cx.kernels.isa;
        let (kpool, n_chosen) = (p.kpool, p.pools_chosen());
        for (s, &p0) in seqs.iter_mut().zip(pos0) {
            let nt = s.n_tokens;
            let keys = s.kv.pooled_keys_mut(il)?;
            for t in 0..nt {
                let r = row0 + t;
                keys.push(
                    p0 + t,
                    &ik[r * dhi..(r + 1) * dhi],
                    &gate[r * dhi..(r + 1) * dhi],
                )?;
            }
            pool_complete(keys, &ix.ape);
            let pooled = s.kv.pooled_keys(il)?.pooled();
            let rows = &mut selection[row0..row0 + nt];
            let (iq, head_w) = (&iq, &head_w);
            timed(Phase::Attention, || {
                cx.pool.for_each_mut(rows, |t, picked| {
                    let (r, pos) = (row0 + t, p0 + t);
                    let visible = (pos + 1) / kpool;
                    let chosen: Vec<usize> = if visible <= n_chosen {
                        (0..visible).collect()
                    } else {
                        let krows = Rows {
                            data: f32_bytes(&pooled[..visible * dhi]),
                            stride: dhi * 4,
                            n: visible,
                            d: dhi,
                            elem: KvElem::F32,
                        };
                        let mut total = vec![0f32; visible];
                        let mut per_head = vec![0f32; visible];
                        for hh in 0..nhi {
                            let q = &iq[(r * nhi + hh) * dhi..(r * nhi + hh + 1) * dhi];
                            attn::scores(isa, q, krows, 1.0, &mut per_head);
                            let wh = head_w[r * nhi + hh];
                            for (acc, &sc) in total.iter_mut().zip(&per_head) {
                                *acc += sc.max(0.0) * wh;
                            }
                        }
                        top_k(&total, n_chosen)
                    };
                    picked.clear();
                    for j in chosen {
                        picked.extend((j * kpool..(j + 1) * kpool).map(|q| q as u32));
                    }
                    if p.select_tail {
                        picked.extend((visible * kpool..=pos).map(|q| q as u32));
                    }
                });
            });
            row0 += nt;
        }
        Ok(selection)
    }
}
