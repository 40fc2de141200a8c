//! The executor seam: what a session needs from whatever runs the model — a local forward, a
//! pipeline of stages, or a tensor-parallel group. Frontends never see which one it is.

use model::LogitsWanted;

use crate::error::Result;
use crate::snapshot::Snapshot;

/// Identifies a session across the executor (and, for a cluster, across nodes).
pub type SessionId = u64;

/// What a frontend needs to know about the model behind an executor.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelInfo {
    pub name: String,
    pub arch: String,
    pub n_vocab: usize,
    pub n_layer: usize,
    /// Values per token of the stream between layers (`hc · n_embd` for DeepSeek V4).
    pub n_embd: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Context size each session may use.
    pub n_ctx: usize,
    /// Hex digest of the model fingerprint.
    pub fingerprint: String,
    /// Bytes of weights (all files).
    pub weight_bytes: u64,
    /// KV cache bytes per position for the whole model (all layers and heads), as a cache
    /// that keeps every position of every layer stores them.
    pub kv_bytes_per_position: usize,
    /// The part of `kv_bytes_per_position` that belongs to sliding-window layers, which keep
    /// only their latest `kv_sliding_positions` positions (0: no such layers).
    pub kv_sliding_bytes_per_position: usize,
    /// Positions a sliding-window layer holds at most while decoding (one token at a time).
    pub kv_sliding_positions: usize,
}

impl ModelInfo {
    /// KV cache bytes of a session of `n` positions while decoding: full layers all of them,
    /// sliding-window layers at most their bound.
    pub fn kv_bytes_at(&self, n: usize) -> usize {
        let full = self.kv_bytes_per_position - self.kv_sliding_bytes_per_position;
        full * n + self.kv_sliding_bytes_per_position * n.min(self.kv_sliding_positions)
    }
}

/// New tokens for one session, appended after its cached positions.
#[derive(Clone, Debug)]
pub struct EvalRequest<'a> {
    pub session: SessionId,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
}

/// Logits rows for one request: one row (`Last`), one per token (`All`) or none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EvalResult {
    pub n_rows: usize,
    pub n_vocab: usize,
    pub logits: Vec<f32>,
}

impl EvalResult {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.n_vocab..(i + 1) * self.n_vocab]
    }

    pub fn last(&self) -> Option<&[f32]> {
        self.n_rows.checked_sub(1).map(|i| self.row(i))
    }

    /// Hands out logits rows produced for `batch` as one item (in request order, each request
    /// the rows its `logits` asks for) to one result per request.
    pub fn split(batch: &[EvalRequest], rows: &[f32], n_vocab: usize) -> Vec<EvalResult> {
        let mut off = 0;
        batch
            .iter()
            .map(|r| {
                let n_rows = r.rows_wanted();
                let end = (off + n_rows * n_vocab).min(rows.len());
                let logits = rows[off.min(end)..end].to_vec();
                off = end;
                EvalResult {
                    n_rows: logits.len() / n_vocab.max(1),
                    n_vocab,
                    logits,
                }
            })
            .collect()
    }
}

impl EvalRequest<'_> {
    /// Logits rows this request asks for.
    pub fn rows_wanted(&self) -> usize {
        match self.logits {
            LogitsWanted::None => 0,
            LogitsWanted::Last => usize::from(!self.tokens.is_empty()),
            LogitsWanted::All => self.tokens.len(),
        }
    }
}

pub trait Executor: Send {
    fn info(&self) -> &ModelInfo;

    /// Evaluates a batch: every request's tokens are appended to its session (created empty on
    /// first use) and its wanted logits returned, in request order. On error no session keeps
    /// a partial result.
    fn eval(&mut self, batch: &[EvalRequest]) -> Result<Vec<EvalResult>>;

    /// Keeps the first `n` cached positions of `session` (rewind).
    fn truncate(&mut self, session: SessionId, n: usize) -> Result<()>;

    /// The most positions, at most `n`, that [`Executor::truncate`] can keep of `session`:
    /// `n` where the cache rewinds anywhere, less where sliding-window or recurrent layers
    /// reach only some positions (a recurrent layer's checkpoints), 0 at worst.
    fn rewind_point(&self, session: SessionId, n: usize) -> usize;

    /// Cached positions of `session` (0 when unknown).
    fn session_len(&self, session: SessionId) -> usize;

    fn destroy(&mut self, session: SessionId);

    /// The session's whole state in a form that does not depend on how the model is split.
    fn snapshot(&mut self, session: SessionId) -> Result<Snapshot>;

    /// Replaces the session's state with a snapshot (of the same model).
    fn restore(&mut self, session: SessionId, snapshot: &Snapshot) -> Result<()>;

    /// Human-readable description of where the model runs (printed by `bench`, `run --stats`).
    fn describe(&self) -> String;

    /// True when the executor cuts long evaluations into chunks itself and gains from seeing a
    /// whole prompt at once (a pipeline keeps several chunks in flight across its stages, so
    /// the engine's own prompt chunking would cap the overlap at one engine chunk).
    fn chunks_long_evals(&self) -> bool {
        false
    }

    /// Execution statistics as `(name, value)` pairs (expert-cache hits, bytes read, ...).
    fn stats(&self) -> Vec<(String, f64)> {
        Vec::new()
    }

    /// Where the model runs: nodes, their layers and addresses, the last step's time per hop.
    fn cluster_view(&self) -> crate::ClusterView {
        crate::ClusterView::local(self.info().n_layer)
    }
}
