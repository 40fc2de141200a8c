//! Causal grouped-query attention over a sequence's KV cache. Each (token, kv head) is one task:
//! for every query head of the group, scores against every cached key up to the token's
//! position, a softmax, and the weighted sum of values (`kernels::attn`).

use std::cell::RefCell;

use kernels::attn::{self, KvElem, Rows};
use kernels::{Kernels, ThreadPool};

use crate::error::Result;
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

pub struct AttentionShape {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub scale: f32,
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
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
        caches.push((s.kv.keys(layer)?, s.kv.values(layer)?));
        for i in 0..s.n_tokens {
            tasks.push((si, i));
        }
    }
    let (n_head, n_kv) = (shape.n_head, shape.n_kv_head);
    let group = n_head / n_kv;
    let (dk, dv) = (shape.head_dim_k, shape.head_dim_v);
    let esz = kv_type.bytes();
    let k_row = n_kv * dk * esz;
    let v_row = n_kv * dv * esz;
    let out_ptr = OutPtr(out.as_mut_ptr());
    let n_work = tasks.len() * n_kv;
    pool.for_each_chunk(n_work, 1, |work| {
        SCORES.with_borrow_mut(|scores| {
            for w in work {
                let (si, i) = tasks[w / n_kv];
                let g = w % n_kv;
                let s = &spans[si];
                let (keys, values) = caches[si];
                let row = s.row0 + i;
                let n_pos = s.pos0 + i + 1;
                let krows = Rows {
                    data: &keys[g * dk * esz..],
                    stride: k_row,
                    n: n_pos,
                    d: dk,
                    elem,
                };
                let vrows = Rows {
                    data: &values[g * dv * esz..],
                    stride: v_row,
                    n: n_pos,
                    d: dv,
                    elem,
                };
                scores.resize(n_pos, 0.0);
                for h in g * group..(g + 1) * group {
                    let qh = &q[(row * n_head + h) * dk..(row * n_head + h + 1) * dk];
                    attn::scores(isa, qh, krows, shape.scale, scores);
                    attn::softmax(isa, scores);
                    // SAFETY: every (row, head) output slice is written by exactly one task.
                    let o = unsafe {
                        std::slice::from_raw_parts_mut(
                            out_ptr.get().add((row * n_head + h) * dv),
                            dv,
                        )
                    };
                    o.fill(0.0);
                    attn::weighted_sum(isa, scores, vrows, o);
                }
            }
        })
    });
    Ok(())
}
