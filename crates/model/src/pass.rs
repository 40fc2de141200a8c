//! What a forward pass exchanges with its caller: the batch's sequences and input, the stage's
//! output, and the hooks through which tensor-parallel ranks reduce partial sums. Kept apart
//! from `forward` so that architecture modules the forward path calls (DeepSeek V4's layer) can
//! name these types without importing the path that calls them.

use crate::error::Result;
use crate::kv::KvCache;

/// Which positions of a sequence need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    Last,
    All,
}

/// One sequence of a batch: its cache (new tokens are appended at `kv.len()`) and how many of
/// the batch's rows are its tokens (consecutive, in batch order).
pub struct SeqInput<'k> {
    pub kv: &'k mut KvCache,
    pub n_tokens: usize,
    pub logits: LogitsWanted,
}

/// What enters a stage: token ids (the stage holding layer 0) or hidden states from the
/// previous stage (`n_tokens × hidden_width`), with the batch's token ids where the stage has
/// them (DeepSeek V4's hash-routed layers pick experts by token id).
#[derive(Clone, Copy, Debug)]
pub enum StageInput<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a [f32]),
    HiddenWithTokens(&'a [f32], &'a [u32]),
}

/// Keeps only batch rows `rows` (ascending) of `x`'s `width`-wide rows, in place (the final
/// layer's rows that need logits, `forward::final_rows`).
pub(crate) fn keep_rows(x: &mut Vec<f32>, rows: &[usize], width: usize) {
    for (i, &r) in rows.iter().enumerate() {
        debug_assert!(i <= r, "rows ascend");
        if i != r {
            x.copy_within(r * width..(r + 1) * width, i * width);
        }
    }
    x.truncate(rows.len() * width);
}

/// Logits of selected batch rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Logits {
    /// Batch row of each logits row.
    pub rows: Vec<usize>,
    /// Values per row: the whole vocabulary, or a tensor-parallel rank's slice of it.
    pub n_vocab: usize,
    /// First vocabulary id of the rows' values (non-zero on tensor-parallel ranks but the first).
    pub vocab_offset: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.n_vocab..(i + 1) * self.n_vocab]
    }
}

/// What leaves a stage: logits when it holds the head, else the hidden states of every row.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    Hidden(Vec<f32>),
    Logits(Logits),
}

/// The points per layer where tensor-parallel ranks exchange partial sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReducePoint {
    AttentionOutput,
    FfnOutput,
    /// Per head sums of squares of q and k, for a q/k norm over the whole projection (OLMoE)
    /// when the heads are split.
    QkNormSums,
}

/// Observation and collective hooks. The defaults do nothing (a single node).
pub trait Hooks {
    /// A named intermediate activation (`layer` is `None` for the embedding and the head).
    /// When the stage computes the head, the final layer's activations after its attention
    /// hold only the rows that need logits (`forward::final_rows`).
    fn observe(&mut self, _layer: Option<usize>, _name: &'static str, _data: &[f32]) {}

    /// Whether [`Hooks::observe`] looks at what it is given. A device that runs whole layers
    /// keeps their intermediates to itself, so it runs only under hooks that do not.
    fn observes(&self) -> bool {
        true
    }

    /// Sums `data` across tensor-parallel ranks in place. Partial sums travel and add in f64,
    /// where adding a handful of f32-derived values is exact, so the result does not depend on
    /// how the work was split.
    fn all_reduce(&mut self, _layer: usize, _point: ReducePoint, _data: &mut [f64]) -> Result<()> {
        Ok(())
    }
}

/// No hooks.
pub struct NoHooks;
impl Hooks for NoHooks {
    fn observes(&self) -> bool {
        false
    }
}
