//! Causal grouped-query attention over a sequence's KV cache. Each (token, query head) is one
//! task: scores against every cached key up to the token's position, a softmax, and the
//! weighted sum of values. Keys are compared with the kernels' f32/f16 dot products.

use std::cell::RefCell;

use half::f16;
use kernels::{DotFn, Kernels, ThreadPool};

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
/// `q` is `rows × n_head × head_dim_k`, `out` is `rows × n_head × head_dim_v`.
pub fn attend(
    pool: &ThreadPool,
    kernels: &Kernels,
    layer: usize,
    shape: &AttentionShape,
    spans: &[SeqSpan],
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let kv_type = spans
        .first()
        .map(|s| s.kv.layout().kv_type)
        .unwrap_or(KvType::F32);
    let dot: DotFn = kernels.dot_fn(kv_type.ggml_type())?;
    let mut tasks = Vec::new();
    let mut caches = Vec::with_capacity(spans.len());
    for (si, s) in spans.iter().enumerate() {
        caches.push((s.kv.keys(layer)?, s.kv.values(layer)?));
        for i in 0..s.n_tokens {
            tasks.push((si, i));
        }
    }
    let n_head = shape.n_head;
    let group = shape.n_head / shape.n_kv_head;
    let (dk, dv) = (shape.head_dim_k, shape.head_dim_v);
    let esz = kv_type.bytes();
    let k_row = shape.n_kv_head * dk * esz;
    let v_row = shape.n_kv_head * dv * esz;
    let out_ptr = OutPtr(out.as_mut_ptr());
    let n_work = tasks.len() * n_head;
    pool.for_each_chunk(n_work, 1, |work| {
        SCORES.with_borrow_mut(|scores| {
            for w in work {
                let (si, i) = tasks[w / n_head];
                let h = w % n_head;
                let s = &spans[si];
                let (keys, values) = caches[si];
                let row = s.row0 + i;
                let pos = s.pos0 + i;
                let g = h / group;
                let qh = &q[(row * n_head + h) * dk..(row * n_head + h + 1) * dk];
                let qb: &[u8] = bytemuck_cast(qh);
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for j in 0..=pos {
                    let kb = &keys[j * k_row + g * dk * esz..j * k_row + (g + 1) * dk * esz];
                    let sc = dot(dk, kb, qb) * shape.scale;
                    max = max.max(sc);
                    scores.push(sc);
                }
                let mut sum = 0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let inv = 1.0 / sum;
                // SAFETY: every (row, head) output slice is written by exactly one task.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(out_ptr.get().add((row * n_head + h) * dv), dv)
                };
                o.fill(0.0);
                for (j, &p) in scores.iter().enumerate() {
                    let vb = &values[j * v_row + g * dv * esz..j * v_row + (g + 1) * dv * esz];
                    axpy(o, p * inv, vb, kv_type);
                }
            }
        })
    });
    Ok(())
}

fn bytemuck_cast(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; any byte pattern of the result is read only as f32 again.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// `y += a · x` where `x` holds values of `kv_type`.
fn axpy(y: &mut [f32], a: f32, x: &[u8], kv_type: KvType) {
    match kv_type {
        KvType::F32 => {
            for (yv, c) in y.iter_mut().zip(x.chunks_exact(4)) {
                *yv += a * f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        KvType::F16 => {
            for (yv, c) in y.iter_mut().zip(x.chunks_exact(2)) {
                *yv += a * f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}
