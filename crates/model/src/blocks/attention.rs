//! Causal grouped-query attention over a sequence's KV cache. Each (token, kv head) is one task:
//! for every query head of the group, scores against every cached key up to the token's
//! position (or the latest `window` of them), a softmax (with the head's sink logit, where the
//! architecture has one), and the weighted sum of values (`kernels::attn`).

use std::cell::RefCell;

use kernels::attn::{self, KvElem, Rows};
use kernels::{Kernels, ThreadPool};

use crate::error::{ModelError, Result};
use crate::kv::{KvCache, KvType};

/// Where one sequence's new tokens sit in the batch and in its cache.
pub struct SeqSpan<'k> {
    pub kv: &'k KvCache,
    /// Index of the sequence's first token within the batch rows.
    pub row0: usize,
    pub n_tokens: usize,
    /// Cache position of the first token.
    pub pos0: usize,
}

pub struct AttentionShape<'s> {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub scale: f32,
    /// Values are the first `head_dim_v` elements of each key row (multi-head latent
    /// attention, whose cache row is the latent followed by the rope key); the cache then
    /// holds no separate values.
    pub values_in_keys: bool,
    /// A token attends to the `window` latest positions (its own included); `None`: all.
    pub window: Option<usize>,
    /// One sink logit per query head computed here (`n_head` values).
    pub sinks: Option<&'s [f32]>,
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The address of `attend`'s output, shared by its tasks.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: an `OutPtr` is only the address of `out`, which outlives the parallel region
// (`for_each_chunk` returns after every task); each task writes only the (row, head) slices of
// its own (token, kv head) pairs, which no other task touches (`attend` checks that the spans'
// rows are disjoint and inside `out`).
unsafe impl Send for OutPtr {}
// SAFETY: as for `Send`.
unsafe impl Sync for OutPtr {}
impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[row][head]` = softmax(q·Kᵀ·scale) · V for every token row of every span.
/// `q` is `rows × n_head × head_dim_k`, `out` is `rows × n_head × head_dim_v`. One task is a
/// (token, kv head) pair, so the query heads that share a kv head read its keys and values
/// while they are in cache.
pub fn attend(
    pool: &ThreadPool,
    kernels: &Kernels,
    layer: usize,
    shape: &AttentionShape,
    spans: &[SeqSpan],
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let isa = kernels.isa;
    let kv_type = spans
        .first()
        .map(|s| s.kv.layout().kv_type)
        .unwrap_or(KvType::F32);
    let elem = match kv_type {
        KvType::F32 => KvElem::F32,
        KvType::F16 => KvElem::F16,
    };
    let mut tasks = Vec::new();
    let mut caches = Vec::with_capacity(spans.len());
    for (si, s) in spans.iter().enumerate() {
        // A sliding layer's rows start at its first held position, not at 0.
        let held_from = s.kv.held_from(layer)?;
        let oldest = shape.window.map_or(0, |w| (s.pos0 + 1).saturating_sub(w));
        if oldest < held_from {
            return Err(ModelError::Input(format!(
                "layer {layer}: position {} attends from position {oldest}, the cache holds {held_from}.. only",
                s.pos0
            )));
        }
        caches.push((s.kv.keys(layer)?, s.kv.values(layer)?, held_from));
        for i in 0..s.n_tokens {
            tasks.push((si, i));
        }
    }
    let (n_head, n_kv) = (shape.n_head, shape.n_kv_head);
    let group = n_head / n_kv;
    let (dk, dv) = (shape.head_dim_k, shape.head_dim_v);
    // The tasks write `out` through a raw pointer: every span's rows must lie inside it, and no
    // two spans may share a row.
    let mut span_rows: Vec<(usize, usize)> = spans
        .iter()
        .map(|s| (s.row0, s.row0 + s.n_tokens))
        .collect();
    span_rows.sort_unstable();
    let end = span_rows.last().map_or(0, |r| r.1);
    assert!(
        span_rows.windows(2).all(|w| w[0].1 <= w[1].0)
            && end
                .checked_mul(n_head)
                .and_then(|x| x.checked_mul(dv))
                .is_some_and(|need| need <= out.len()),
        "attention spans {span_rows:?} overlap or do not fit an output of {} values",
        out.len()
    );
    if let Some(sinks) = shape.sinks {
        assert_eq!(sinks.len(), n_head, "one sink per query head");
    }
    let esz = kv_type.bytes();
    let k_row = n_kv * dk * esz;
    let (v_row, v_head_stride) = if shape.values_in_keys {
        (k_row, dk * esz)
    } else {
        (n_kv * dv * esz, dv * esz)
    };
    let out_ptr = OutPtr(out.as_mut_ptr());
    // Few (token, kv head) pairs — one token's decode with a single shared latent — would leave
    // threads idle: then each pair's query heads are dealt out in parts as well.
    let parts = if tasks.len() * n_kv < pool.n_threads() {
        group.min(pool.n_threads())
    } else {
        1
    };
    let per_part = group.div_ceil(parts);
    let n_work = tasks.len() * n_kv * parts;
    pool.for_each_chunk(n_work, 1, |work| {
        SCORES.with_borrow_mut(|scores| {
            for w in work {
                let part = w % parts;
                let w = w / parts;
                let (si, i) = tasks[w / n_kv];
                let g = w % n_kv;
                let s = &spans[si];
                let (keys, values, held_from) = caches[si];
                let values = if shape.values_in_keys { keys } else { values };
                let row = s.row0 + i;
                let end = s.pos0 + i + 1;
                let first = shape.window.map_or(0, |w| end.saturating_sub(w));
                let n_pos = end - first;
                let row_of_first = first - held_from;
                let krows = Rows {
                    data: &keys[row_of_first * k_row + g * dk * esz..],
                    stride: k_row,
                    n: n_pos,
                    d: dk,
                    elem,
                };
                let vrows = Rows {
                    data: &values[row_of_first * v_row + g * v_head_stride..],
                    stride: v_row,
                    n: n_pos,
                    d: dv,
                    elem,
                };
                let h_first = g * group + part * per_part;
                let h_last = (h_first + per_part).min((g + 1) * group);
                let at = row * n_head + h_first;
                let hb = h_last - h_first;
                // SAFETY: row < end and h_last <= n_head, so the slice lies inside `out`
                // (checked above); heads h_first..h_last of this row belong to this task's
                // (token, kv head, part) only, and the spans' rows are disjoint, so no other
                // reference to them exists.
                let o =
                    unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(at * dv), hb * dv) };
                attn::attend_heads(
                    isa,
                    &q[at * dk..(at + hb) * dk],
                    dk,
                    hb,
                    krows,
                    vrows,
                    shape.scale,
                    shape.sinks.map(|s| &s[h_first..h_last]),
                    scores,
                    o,
                    dv,
                );
            }
        })
    });
    Ok(())
}

/// Into how many equal groups to split `n_heads` so that `n_rows` queries give every thread
/// work: the largest divisor of `n_heads` up to threads per query (1 once rows fill the pool).
/// Each head is computed alone either way, so the split does not change a bit.
pub fn head_groups(n_heads: usize, n_threads: usize, n_rows: usize) -> usize {
    let want = (n_threads / n_rows.max(1)).clamp(1, n_heads.max(1));
    (1..=want)
        .rev()
        .find(|p| n_heads.is_multiple_of(*p))
        .unwrap_or(1)
}
