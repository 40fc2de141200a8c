//! The lightning indexer (DeepSeek V4's compressed layers, GLM-5's sparse attention): a cheap
//! multi-head scorer choosing, per query, the cached keys that attention reads:
//! `score(s) = Σ_h w_h · ReLU(q_h · k_s)`, then the top-k positions.

use kernels::Isa;
use kernels::attn::{self, KvElem, Rows};

use super::Compute;
use super::norm::layer_norm_rows_inplace;
use super::rope::RopeTable;
use crate::error::{ModelError, Result};
use crate::hparams::{DsaParams, Hparams};
use crate::pass::SeqInput;
use crate::weights::DsaIndexer;

/// Marks an unused slot of a [`Selection`] row (a query with fewer visible tokens than k).
pub const NO_POSITION: u32 = u32::MAX;

/// `f32` values as raw bytes (attention rows read them as [`KvElem::F32`]).
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the length is the
    // slice's size in bytes and the lifetime is the slice's.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Indices of the `k` largest scores (ties to the lower index), ascending.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    if scores.len() > k {
        idx.select_nth_unstable_by(k, |&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// `out[s] = Σ_h w[h] · ReLU(q_h · k_s)` over the key rows (f32, `head_dim` wide) for the
/// query `q` of `w.len()` heads; `head` is scratch.
pub fn index_scores(
    isa: Isa,
    q: &[f32],
    w: &[f32],
    keys: &[f32],
    head_dim: usize,
    out: &mut Vec<f32>,
    head: &mut Vec<f32>,
) {
    let n = keys.len() / head_dim;
    let rows = Rows {
        data: f32_bytes(keys),
        stride: head_dim * 4,
        n,
        d: head_dim,
        elem: KvElem::F32,
    };
    out.clear();
    out.resize(n, 0.0);
    head.resize(n, 0.0);
    for (qh, &wh) in q.chunks_exact(head_dim).zip(w) {
        attn::scores(isa, qh, rows, 1.0, head);
        for (acc, &s) in out.iter_mut().zip(head.iter()) {
            *acc += s.max(0.0) * wh;
        }
    }
}

/// Per batch row, the cached positions its query attends to: ascending, padded with
/// [`NO_POSITION`]. Made by a full sparse-attention layer and reused by the shared layers
/// after it (and carried between pipeline stages with the hidden state).
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    pub k: usize,
    pub rows: Vec<u32>,
}

impl Selection {
    pub fn n_rows(&self) -> usize {
        self.rows.len() / self.k.max(1)
    }

    /// Rows of at most `k` positions each (padded here).
    pub fn from_lists(lists: &[Vec<u32>], k: usize) -> Result<Selection> {
        let mut rows = vec![NO_POSITION; lists.len() * k];
        for (slots, list) in rows.chunks_exact_mut(k.max(1)).zip(lists) {
            if list.len() > k {
                return Err(ModelError::Input(format!(
                    "a selection of {} positions exceeds the {k} a stage carries",
                    list.len()
                )));
            }
            slots[..list.len()].copy_from_slice(list);
        }
        Ok(Selection { k, rows })
    }

    /// Each row's positions.
    pub fn to_lists(&self) -> Vec<Vec<u32>> {
        (0..self.n_rows())
            .map(|i| self.row(i).map(|p| p as u32).collect())
            .collect()
    }

    /// Positions row `i` attends to.
    pub fn row(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.rows[i * self.k..(i + 1) * self.k]
            .iter()
            .take_while(|&&p| p != NO_POSITION)
            .map(|&p| p as usize)
    }
}

/// The indexer's projections of a batch: queries (`n × heads × head_dim`, roped) from the
/// query latent, head weights (`n × heads`, scaled) and keys (`n × head_dim`, normed, roped)
/// from the block input.
pub struct IndexerInputs {
    pub q: Vec<f32>,
    pub w: Vec<f32>,
    pub k: Vec<f32>,
}

/// Finishes the raw projections (`q = q_b · qr`, `w = proj · h`, `k = attn_k · h`): LayerNorm
/// of the key, rope on the first rotary dims of keys and every query head (the indexer's
/// layout is `[rope | nope]`, the opposite of the attention heads'), `w` scaled by
/// `1/√(heads · head_dim)`.
pub fn finish_projections(
    cx: &Compute,
    hp: &Hparams,
    p: &DsaParams,
    ix: &DsaIndexer,
    rope: &RopeTable,
    mut raw: IndexerInputs,
) -> IndexerInputs {
    let (nh, dh) = (p.n_head, p.head_dim);
    let kind = hp.rope.kind;
    layer_norm_rows_inplace(&mut raw.k, &ix.k_norm, &ix.k_norm_bias, p.k_norm_eps);
    cx.par_rows(&mut raw.k, dh, |first, rows| {
        for (j, row) in rows.chunks_exact_mut(dh).enumerate() {
            rope.apply(kind, first + j, row, dh);
        }
    });
    cx.par_rows(&mut raw.q, nh * dh, |first, rows| {
        for (j, row) in rows.chunks_exact_mut(nh * dh).enumerate() {
            rope.apply(kind, first + j, row, dh);
        }
    });
    let scale = 1.0 / ((nh * dh) as f32).sqrt();
    raw.w.iter_mut().for_each(|v| *v *= scale);
    raw
}

/// Stores the batch's keys in the caches of `layer` and selects, for every query, its top-k
/// visible positions (all of them while there are at most k).
pub fn select(
    cx: &Compute,
    p: &DsaParams,
    layer: usize,
    inputs: &IndexerInputs,
    seqs: &mut [SeqInput],
    pos0: &[usize],
) -> Result<Selection> {
    let (nh, dh, k) = (p.n_head, p.head_dim, p.top_k);
    let mut row = 0;
    for (s, &p0) in seqs.iter_mut().zip(pos0) {
        for i in 0..s.n_tokens {
            s.kv.store_index_key(layer, p0 + i, &inputs.k[row * dh..(row + 1) * dh])?;
            row += 1;
        }
    }
    let n: usize = seqs.iter().map(|s| s.n_tokens).sum();
    let mut rows = vec![NO_POSITION; n * k];
    let isa = cx.kernels.isa;
    let threads = cx.n_threads();
    let mut row0 = 0;
    for (s, &p0) in seqs.iter().zip(pos0) {
        let keys = s.kv.index_keys(layer)?;
        let seq_rows = row0..row0 + s.n_tokens;
        let query = |bt: usize| {
            (
                &inputs.q[bt * nh * dh..(bt + 1) * nh * dh],
                &inputs.w[bt * nh..(bt + 1) * nh],
            )
        };
        let out = &mut rows[seq_rows.start * k..seq_rows.end * k];
        if s.n_tokens * 2 <= threads {
            // Few queries (decode): each one's positions are scored across the pool (every
            // score is its own sum over the heads, so the split does not change a bit).
            for (t, slots) in out.chunks_exact_mut(k).enumerate() {
                let visible = p0 + t + 1;
                let mut scores = vec![0f32; visible];
                if visible > k {
                    let (q, w) = query(seq_rows.start + t);
                    cx.par_rows(&mut scores, 1, |first, part| {
                        let (mut tmp, mut head) = (Vec::new(), Vec::new());
                        let span = &keys[first * dh..(first + part.len()) * dh];
                        index_scores(isa, q, w, span, dh, &mut tmp, &mut head);
                        part.copy_from_slice(&tmp);
                    });
                }
                fill_slots(slots, &scores, k);
            }
        } else {
            cx.par_rows(out, k, |first, out| {
                let (mut scores, mut head) = (Vec::new(), Vec::new());
                for (j, slots) in out.chunks_exact_mut(k).enumerate() {
                    let t = first + j;
                    let visible = p0 + t + 1;
                    scores.clear();
                    if visible > k {
                        let (q, w) = query(seq_rows.start + t);
                        let span = &keys[..visible * dh];
                        index_scores(isa, q, w, span, dh, &mut scores, &mut head);
                    } else {
                        scores.resize(visible, 0.0);
                    }
                    fill_slots(slots, &scores, k);
                }
            });
        }
        row0 += s.n_tokens;
    }
    Ok(Selection { k, rows })
}

/// A query's slots: every position while at most `k` are visible, else the top k by score.
fn fill_slots(slots: &mut [u32], scores: &[f32], k: usize) {
    let chosen: Vec<usize> = if scores.len() <= k {
        (0..scores.len()).collect()
    } else {
        top_k(scores, k)
    };
    for (slot, pos) in slots.iter_mut().zip(chosen) {
        *slot = pos as u32;
    }
}

/// The selection a shared layer attends through: the one the latest full layer made for this
/// batch (in this stage or carried in from the previous one).
pub fn reused(selection: Option<&Selection>, layer: usize, n_rows: usize) -> Result<&Selection> {
    match selection {
        Some(s) if s.n_rows() == n_rows => Ok(s),
        _ => Err(ModelError::Input(format!(
            "layer {layer} reuses the sparse-attention selection of an earlier layer, but none was made for these {n_rows} rows"
        ))),
    }
}
