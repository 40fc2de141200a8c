//! Multi-head latent attention (DeepSeek V2/V3, Kimi K2). Keys and values of every head are
//! low-rank images of one shared latent per token, so the cache holds only that latent
//! (`kv_lora_rank` values, RMS-normalized) and one rotated rope key shared by all heads
//! (`n_rot` values): 576 values per token and layer for DeepSeek V3 where multi-head K/V would
//! take 128 heads × (192 + 128).
//!
//! Two forms compute the same attention:
//! * **absorbed** — each head's no-rope query is taken into latent space (`q_nope · W_kb`),
//!   the heads attend to the latent cache directly as one shared kv head of
//!   `kv_lora_rank + n_rot` (values: its first `kv_lora_rank`), and `W_vb` lifts each head's
//!   output back up. Nothing is decompressed; the cost per query is independent of the
//!   decompressed head sizes. Decode (and by default every step) uses it.
//! * **decompressed** — every cached latent is expanded into per-head keys
//!   `[latent · W_kbᵀ, k_rope]` and values `W_vb · latent` and plain multi-head attention runs
//!   over them: cheaper for long prompts processed at once, and the textbook form the absorbed
//!   one is checked against.

use std::ops::Range;

use gguf::GgufModel;
use half::f16;
use kernels::attn::{self, KvElem, Rows};
use kernels::{Input, MatmulJob, Weights};

use super::Compute;
use super::attention::{AttentionShape, SeqSpan, attend, head_groups};
use super::indexer::Selection;
use super::norm::{rms_norm, rms_norm_rows_inplace};
use super::rope::RopeTable;
use crate::error::Result;
use crate::hparams::{Hparams, MlaParams};
use crate::kv::{KvCache, KvLayout, KvType};
use crate::profile::{Phase, span, timed};
use crate::weights::MlaAttention;

/// Which form computes attention over the latent cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaForm {
    Absorbed,
    Decompressed,
}

/// A batch's queries (this rank's heads) and the cache rows its tokens add.
pub struct LatentProjection {
    pub n: usize,
    /// `n × heads × qk_nope`.
    pub q_nope: Vec<f32>,
    /// `n × heads × n_rot`, rotated.
    pub q_rope: Vec<f32>,
    /// `n × (kv_lora_rank + n_rot)`: the normalized latent, then the rotated rope key — the
    /// cache row of each token.
    pub cache_rows: Vec<f32>,
    /// The products of the caller's extra matrices with the block input and with the
    /// normalized query latent, in the order given (GLM-5's indexer rides along in the same
    /// dispatches).
    pub extra_input: Vec<Vec<f32>>,
    pub extra_latent: Vec<Vec<f32>>,
}

fn mla(hp: &Hparams) -> &MlaParams {
    hp.mla.as_ref().expect("MLA blocks run on MLA models")
}

/// Several matrices, each applied to its own input rows (`inputs[i]` is `n × mats[i].cols`),
/// in one parallel dispatch.
fn project_each(
    cx: &Compute,
    inputs: &[&[f32]],
    n: usize,
    mats: &[Weights],
) -> Result<Vec<Vec<f32>>> {
    let ins = inputs
        .iter()
        .zip(mats)
        .map(|(x, w)| Input::new(x, n, w.cols))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; n * w.rows]).collect();
    let mut jobs = Vec::with_capacity(mats.len());
    for ((x, w), out) in ins.iter().zip(mats).zip(outs.iter_mut()) {
        let act = kernels::format(w.dtype)
            .ok_or(kernels::MatmulError::UnsupportedType(w.dtype))?
            .act;
        jobs.push(MatmulJob {
            w: *w,
            acts: x.quantized(act, &cx.pool),
            n,
            out,
        });
    }
    cx.matmul_batch(&mut jobs)?;
    Ok(outs)
}

/// Each head's matrix applied to that head's rows: `x` is `n × heads × cols` (token-major, as
/// projections leave it), `mats[h]` is head h's `rows × cols` (one shape and format for all,
/// the slices of one per-head tensor); the result is `heads × n × rows` (head-major, each
/// head's block as its matrix wrote it).
///
/// Every (token, head) row is quantized straight into its head's block in one parallel pass,
/// and every head's product runs in one dispatch. Quantizing each head's gathered rows on its
/// own cost a pool dispatch per head (128 for DeepSeek V3), and copied the f32 rows first:
/// on 16 threads that kept the two per-head products of V3's latent attention at a tenth of
/// the GEMM rate.
pub(crate) fn project_heads(
    cx: &Compute,
    x: &[f32],
    n: usize,
    mats: &[Weights],
) -> Result<Vec<f32>> {
    let Some(first) = mats.first().filter(|_| n > 0) else {
        return Ok(Vec::new());
    };
    let (dtype, rows, cols) = (first.dtype, first.rows, first.cols);
    if let Some(odd) = mats
        .iter()
        .find(|w| (w.dtype, w.rows, w.cols) != (dtype, rows, cols))
    {
        return Err(kernels::MatmulError::Shape {
            what: "per-head matrices",
            detail: format!(
                "head 0 is {rows}×{cols} {dtype:?}, another {}×{} {:?}",
                odd.rows, odd.cols, odd.dtype
            ),
        }
        .into());
    }
    let nh = mats.len();
    if x.len() != n * nh * cols {
        return Err(kernels::MatmulError::Shape {
            what: "per-head input",
            detail: format!(
                "{n} tokens × {nh} heads × {cols} need {} values, got {}",
                n * nh * cols,
                x.len()
            ),
        }
        .into());
    }
    let act = kernels::format(dtype)
        .ok_or(kernels::MatmulError::UnsupportedType(dtype))?
        .act;
    let rb = act.row_bytes(cols);
    let mut acts = cx.zeroed::<u8>(nh * n * rb);
    // Row i of `acts` is head i / n's token i % n.
    let quantize = |first: usize, block: &mut [u8]| {
        for (i, dst) in block.chunks_exact_mut(rb).enumerate() {
            let (h, t) = ((first + i) / n, (first + i) % n);
            let at = (t * nh + h) * cols;
            act.quantize_row(&x[at..at + cols], dst);
        }
    };
    if x.len() < PARALLEL_COPY_MIN {
        if rb > 0 {
            quantize(0, &mut acts);
        }
    } else {
        cx.par_rows(&mut acts, rb, quantize);
    }
    let mut out = cx.zeroed::<f32>(nh * n * rows);
    let mut jobs: Vec<MatmulJob> = mats
        .iter()
        .zip(acts.chunks_exact(n * rb))
        .zip(out.chunks_exact_mut(n * rows))
        .map(|((w, acts), out)| MatmulJob {
            w: *w,
            acts,
            n,
            out,
        })
        .collect();
    cx.matmul_batch(&mut jobs)?;
    Ok(out)
}

/// A head-major buffer (`heads × n × dim`, as [`project_heads`] returns) in token-major order
/// (`n × heads × dim`), tokens in parallel.
pub(crate) fn heads_to_tokens(
    cx: &Compute,
    by_head: &[f32],
    n: usize,
    n_heads: usize,
    dim: usize,
) -> Vec<f32> {
    let width = n_heads * dim;
    let mut out = cx.zeroed::<f32>(n * width);
    let scatter = |first: usize, rows: &mut [f32]| {
        for (i, row) in rows.chunks_exact_mut(width).enumerate() {
            let t = first + i;
            for (h, dst) in row.chunks_exact_mut(dim).enumerate() {
                let at = (h * n + t) * dim;
                dst.copy_from_slice(&by_head[at..at + dim]);
            }
        }
    };
    if out.len() < PARALLEL_COPY_MIN {
        if width > 0 {
            scatter(0, &mut out);
        }
    } else {
        cx.par_rows(&mut out, width, scatter);
    }
    out
}

/// Values below which a gather runs on the calling thread: a decode step's 128 heads of 128
/// values copy faster than the pool starts.
const PARALLEL_COPY_MIN: usize = 1 << 16;

/// Queries of `heads` and the cache rows for `h` (`n × n_embd`, attention-normed), and the
/// products of `extra_input` with `h` and of `extra_latent` with the query latent.
#[allow(clippy::too_many_arguments)]
pub fn project(
    cx: &Compute,
    files: &GgufModel,
    hp: &Hparams,
    w: &MlaAttention,
    heads: &Range<usize>,
    h: &[f32],
    rope: &RopeTable,
    extra_input: &[Weights],
    extra_latent: &[Weights],
) -> Result<LatentProjection> {
    let m = mla(hp);
    let (d, n_rot, r) = (hp.n_embd, hp.rope.n_rot, m.kv_lora_rank);
    let n = h.len() / d;
    let nh = heads.len();
    let q_head = m.qk_nope + n_rot;
    let q_rows = heads.start * q_head..heads.end * q_head;
    let hin = Input::new(h, n, d)?;
    let (q, mut kv, extra_input, extra_latent) = match &w.q_a {
        Some((q_a, q_a_norm)) => {
            let mut mats = vec![q_a.weights(files), w.kv_a.weights(files)];
            mats.extend_from_slice(extra_input);
            let mut outs = cx.project(&hin, &mats)?;
            let extra_input = outs.split_off(2);
            let kv = outs.pop().expect("kv_a");
            let mut cq = outs.pop().expect("q_a");
            rms_norm_rows_inplace(&mut cq, q_a_norm, hp.rms_eps);
            let cin = Input::new(&cq, n, q_a.rows)?;
            let mut mats = vec![w.q.weights(files).rows_slice(q_rows)];
            mats.extend_from_slice(extra_latent);
            let mut outs = cx.project(&cin, &mats)?;
            let extra_latent = outs.split_off(1);
            (outs.pop().expect("q_b"), kv, extra_input, extra_latent)
        }
        None => {
            if !extra_latent.is_empty() {
                return Err(crate::error::ModelError::Input(
                    "a projection of the query latent asked of a model without one".into(),
                ));
            }
            let mut mats = vec![w.q.weights(files).rows_slice(q_rows), w.kv_a.weights(files)];
            mats.extend_from_slice(extra_input);
            let mut outs = cx.project(&hin, &mats)?;
            let extra_input = outs.split_off(2);
            let kv = outs.pop().expect("kv_a");
            (outs.pop().expect("q"), kv, extra_input, Vec::new())
        }
    };
    let row = r + n_rot;
    let mut normed = vec![0f32; r];
    for (t, cache_row) in kv.chunks_exact_mut(row).enumerate() {
        rms_norm(&cache_row[..r], &w.kv_a_norm, hp.rms_eps, &mut normed);
        cache_row[..r].copy_from_slice(&normed);
        rope.apply(hp.rope.kind, t, &mut cache_row[r..], n_rot);
    }
    let mut q_nope = Vec::with_capacity(n * nh * m.qk_nope);
    let mut q_rope = Vec::with_capacity(n * nh * n_rot);
    for head in q.chunks_exact(q_head) {
        q_nope.extend_from_slice(&head[..m.qk_nope]);
        q_rope.extend_from_slice(&head[m.qk_nope..]);
    }
    for t in 0..n {
        rope.apply(
            hp.rope.kind,
            t,
            &mut q_rope[t * nh * n_rot..(t + 1) * nh * n_rot],
            n_rot,
        );
    }
    Ok(LatentProjection {
        n,
        q_nope,
        q_rope,
        cache_rows: kv,
        extra_input,
        extra_latent,
    })
}

/// Attention output of `heads` (`n × heads × v_head_dim`) for the projected batch, whose cache
/// rows are already stored in the spans' caches.
#[allow(clippy::too_many_arguments)]
pub fn attend_latent(
    cx: &Compute,
    files: &GgufModel,
    hp: &Hparams,
    w: &MlaAttention,
    heads: &Range<usize>,
    layer: usize,
    spans: &[SeqSpan],
    p: &LatentProjection,
    form: MlaForm,
) -> Result<Vec<f32>> {
    match form {
        MlaForm::Absorbed => absorbed(cx, files, hp, w, heads, layer, spans, p),
        MlaForm::Decompressed => timed(Phase::Attention, || {
            decompressed(cx, files, hp, w, heads, layer, spans, p)
        }),
    }
}

/// Each head's query in latent space (`n × heads × (kv_lora_rank + n_rot)`): its no-rope part
/// through `W_kb[h]` (kv_lora_rank × qk_nope), then its rotated rope part.
fn absorb_queries(
    cx: &Compute,
    files: &GgufModel,
    hp: &Hparams,
    w: &MlaAttention,
    heads: &Range<usize>,
    p: &LatentProjection,
) -> Result<Vec<f32>> {
    let m = mla(hp);
    let (n, nh, n_rot, r) = (p.n, heads.len(), hp.rope.n_rot, m.kv_lora_rank);
    let k_b: Vec<Weights> = heads
        .clone()
        .map(|h| w.k_b.expert(h).weights(files))
        .collect();
    // heads × n × r
    let q_latent = project_heads(cx, &p.q_nope, n, &k_b)?;
    let dk = r + n_rot;
    let mut q = cx.zeroed::<f32>(n * nh * dk);
    cx.par_rows(&mut q, nh * dk, |first, rows| {
        for (i, row) in rows.chunks_exact_mut(nh * dk).enumerate() {
            let t = first + i;
            for (j, qh) in row.chunks_exact_mut(dk).enumerate() {
                let at = (j * n + t) * r;
                qh[..r].copy_from_slice(&q_latent[at..at + r]);
                let rp = (t * nh + j) * n_rot;
                qh[r..].copy_from_slice(&p.q_rope[rp..rp + n_rot]);
            }
        }
    });
    Ok(q)
}

/// Each head's latent-space output (`n × heads × kv_lora_rank`) up to its value space
/// through `W_vb[h]` (v_head_dim × kv_lora_rank): `n × heads × v_head_dim`.
fn lift_values(
    cx: &Compute,
    files: &GgufModel,
    hp: &Hparams,
    w: &MlaAttention,
    heads: &Range<usize>,
    n: usize,
    latent_out: &[f32],
) -> Result<Vec<f32>> {
    let m = mla(hp);
    let nh = heads.len();
    let v_b: Vec<Weights> = heads
        .clone()
        .map(|h| w.v_b.expert(h).weights(files))
        .collect();
    let outs = project_heads(cx, latent_out, n, &v_b)?;
    Ok(heads_to_tokens(cx, &outs, n, nh, m.v_head_dim))
}

#[allow(clippy::too_many_arguments)]
fn absorbed(
    cx: &Compute,
    files: &GgufModel,
    hp: &Hparams,
    w: &MlaAttention,
    heads: &Range<usize>,
    layer: usize,
    spans: &[SeqSpan],
    p: &LatentProjection,
) -> Result<Vec<f32>> {
    let m = mla(hp);
    let (n, nh, n_rot, r) = (p.n, heads.len(), hp.rope.n_rot, m.kv_lora_rank);
    let q = timed(Phase::LatentAbsorb, || {
        absorb_queries(cx, files, hp, w, heads, p)
    })?;
    let shape = AttentionShape {
        n_head: nh,
        n_kv_head: 1,
        head_dim_k: r + n_rot,
        head_dim_v: r,
        scale: hp.attn_scale(),
        values_in_keys: true,
        window: None,
        sinks: None,
    };
    let mut latent_out = cx.zeroed::<f32>(n * nh * r);
    timed(Phase::Attention, || {
        attend(
            &cx.pool,
            &cx.kernels,
            layer,
            &shape,
            spans,
            &q,
            &mut latent_out,
        )
    })?;
    timed(Phase::LatentLift, || {
        lift_values(cx, files, hp, w, heads, n, &latent_out)
    })
}

/// Sparse attention in the absorbed form: each query attends to the cached positions its
/// selection names (GLM-5), in the order of the selection (ascending).
#[allow(clippy::too_many_arguments)]
pub fn attend_selected(
    cx: &Compute,
    files: &GgufModel,
    hp: &Hparams,
    w: &MlaAttention,
    heads: &Range<usize>,
    layer: usize,
    spans: &[SeqSpan],
    p: &LatentProjection,
    selection: &Selection,
) -> Result<Vec<f32>> {
    let m = mla(hp);
    let (n, nh, n_rot, r) = (p.n, heads.len(), hp.rope.n_rot, m.kv_lora_rank);
    let dk = r + n_rot;
    let q = timed(Phase::LatentAbsorb, || {
        absorb_queries(cx, files, hp, w, heads, p)
    })?;
    let scale = hp.attn_scale();
    let isa = cx.kernels.isa;
    let mut latent_out = cx.zeroed::<f32>(n * nh * r);
    let attending = span(Phase::Attention);
    for s in spans {
        let keys = s.kv.keys(layer)?;
        let elem = match s.kv.layout().kv_type {
            KvType::F32 => KvElem::F32,
            KvType::F16 => KvElem::F16,
        };
        let row_bytes = dk * elem.bytes();
        // Work items are (query, group of heads): few queries (decode) still fill the pool.
        let parts = head_groups(nh, cx.n_threads(), s.n_tokens);
        let per_part = nh / parts;
        let out = &mut latent_out[s.row0 * nh * r..(s.row0 + s.n_tokens) * nh * r];
        cx.par_rows(out, per_part * r, |first, out_parts| {
            let mut picked: Vec<u8> = Vec::new();
            let mut scores: Vec<f32> = Vec::new();
            for (j, out_part) in out_parts.chunks_exact_mut(per_part * r).enumerate() {
                let (t, part) = ((first + j) / parts, (first + j) % parts);
                let bt = s.row0 + t;
                // A selection of every position up to its own (a query that sees at most k)
                // reads the cache in place; others gather their rows.
                let n_keys = selection.row(bt).count();
                let whole_prefix = selection.row(bt).enumerate().all(|(i, pos)| i == pos);
                let data = if whole_prefix {
                    &keys[..n_keys * row_bytes]
                } else {
                    picked.clear();
                    for pos in selection.row(bt) {
                        picked.extend_from_slice(&keys[pos * row_bytes..(pos + 1) * row_bytes]);
                    }
                    &picked[..]
                };
                let rows = Rows {
                    data,
                    stride: row_bytes,
                    n: n_keys,
                    d: dk,
                    elem,
                };
                // Values are the latent part of each row.
                let values = Rows { d: r, ..rows };
                let h0 = part * per_part;
                let qb = &q[(bt * nh + h0) * dk..(bt * nh + h0 + per_part) * dk];
                attn::attend_heads(
                    isa,
                    qb,
                    dk,
                    per_part,
                    rows,
                    values,
                    scale,
                    None,
                    &mut scores,
                    out_part,
                    r,
                );
            }
        });
    }
    drop(attending);
    timed(Phase::LatentLift, || {
        lift_values(cx, files, hp, w, heads, n, &latent_out)
    })
}

/// A cache's rows (positions `0..len`) as f32.
fn cache_rows_f32(kv: &KvCache, layer: usize) -> Result<Vec<f32>> {
    let bytes = kv.keys(layer)?;
    Ok(match kv.layout().kv_type {
        KvType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        KvType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    })
}

/// `W_kb[h]ᵀ` as an f32 matrix (`qk_nope × kv_lora_rank`): decompresses a latent into the
/// head's no-rope key.
fn transposed_f32(w: Weights) -> Result<Vec<u8>> {
    let mut dense = vec![0f32; w.rows * w.cols];
    for (i, row) in dense.chunks_exact_mut(w.cols).enumerate() {
        kernels::formats::dequantize_row(w.dtype, w.row(i), row)
            .ok_or(kernels::MatmulError::UnsupportedType(w.dtype))?;
    }
    let mut t = Vec::with_capacity(dense.len() * 4);
    for c in 0..w.cols {
        for r in 0..w.rows {
            t.extend_from_slice(&dense[r * w.cols + c].to_le_bytes());
        }
    }
    Ok(t)
}

#[allow(clippy::too_many_arguments)]
fn decompressed(
    cx: &Compute,
    files: &GgufModel,
    hp: &Hparams,
    w: &MlaAttention,
    heads: &Range<usize>,
    layer: usize,
    spans: &[SeqSpan],
    p: &LatentProjection,
) -> Result<Vec<f32>> {
    let m = mla(hp);
    let (nh, n_rot, r) = (heads.len(), hp.rope.n_rot, m.kv_lora_rank);
    let (dk, dv) = (m.qk_nope + n_rot, m.v_head_dim);
    let k_b_t: Vec<Vec<u8>> = heads
        .clone()
        .map(|h| transposed_f32(w.k_b.expert(h).weights(files)))
        .collect::<Result<_>>()?;
    let mut decompress: Vec<Weights> = k_b_t
        .iter()
        .map(|b| Weights::new(gguf::GgmlType::F32, m.qk_nope, r, b))
        .collect::<std::result::Result<_, _>>()?;
    decompress.extend(heads.clone().map(|h| w.v_b.expert(h).weights(files)));
    let mut att = vec![0f32; p.n * nh * dv];
    for s in spans {
        let rows = cache_rows_f32(s.kv, layer)?;
        let n_pos = s.pos0 + s.n_tokens;
        let rows = &rows[..n_pos * (r + n_rot)];
        let latent: Vec<f32> = rows
            .chunks_exact(r + n_rot)
            .flat_map(|row| row[..r].iter().copied())
            .collect();
        let inputs = vec![&latent[..]; 2 * nh];
        let kv = project_each(cx, &inputs, n_pos, &decompress)?;
        let (k_nope, v) = kv.split_at(nh);
        let mut cache = KvCache::new(KvLayout {
            kv_type: KvType::F32,
            layers: layer..=layer,
            n_kv_head: nh,
            head_dim_k: dk,
            head_dim_v: dv,
            n_ctx: n_pos,
            sliding: None,
            compression: None,
            index_keys: None,
            hybrid: None,
        });
        cache.reserve(0, n_pos)?;
        let mut k_row = vec![0f32; nh * dk];
        let mut v_row = vec![0f32; nh * dv];
        for (pos, cache_row) in rows.chunks_exact(r + n_rot).enumerate() {
            for j in 0..nh {
                let kh = &mut k_row[j * dk..(j + 1) * dk];
                kh[..m.qk_nope].copy_from_slice(&k_nope[j][pos * m.qk_nope..(pos + 1) * m.qk_nope]);
                kh[m.qk_nope..].copy_from_slice(&cache_row[r..]);
                v_row[j * dv..(j + 1) * dv].copy_from_slice(&v[j][pos * dv..(pos + 1) * dv]);
            }
            cache.store(layer, pos, &k_row, &v_row)?;
        }
        let mut q = Vec::with_capacity(s.n_tokens * nh * dk);
        for t in s.row0..s.row0 + s.n_tokens {
            for j in 0..nh {
                let a = (t * nh + j) * m.qk_nope;
                q.extend_from_slice(&p.q_nope[a..a + m.qk_nope]);
                let b = (t * nh + j) * n_rot;
                q.extend_from_slice(&p.q_rope[b..b + n_rot]);
            }
        }
        let shape = AttentionShape {
            n_head: nh,
            n_kv_head: nh,
            head_dim_k: dk,
            head_dim_v: dv,
            scale: hp.attn_scale(),
            values_in_keys: false,
            window: None,
            sinks: None,
        };
        let span = SeqSpan {
            kv: &cache,
            row0: 0,
            n_tokens: s.n_tokens,
            pos0: s.pos0,
        };
        let out = &mut att[s.row0 * nh * dv..(s.row0 + s.n_tokens) * nh * dv];
        attend(&cx.pool, &cx.kernels, layer, &shape, &[span], &q, out)?;
    }
    Ok(att)
}
