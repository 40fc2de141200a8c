//! The one sessioned runner around `Model::forward`: a layer range of the model, a KV cache and
//! token history per session, the expert source, and export/import of a session's KV for that
//! range. The local executor, every pipeline stage (the coordinator's first stage included)
//! and every tensor-parallel rank run the model through this type and nothing else, so a
//! session behaves the same in every topology.
//!
//! Each session keeps the rolling hash of its tokens ([`crate::prefix_hash`]): a work item
//! names the hash of the history it extends, so a stage that missed or repeated a chunk fails
//! loudly instead of producing wrong text.

use std::collections::HashMap;
use std::sync::Arc;

use model::{
    Compute, ExpertSource, Hooks, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts,
    SeqInput, StageInput, StageOutput,
};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::executor::{EvalRequest, EvalResult, SessionId};
use crate::layer_range::LayerRange;
use crate::prefix_hash;
use crate::snapshot::LayersKv;

/// Where routed experts come from when they are not simply the model's resident tensors
/// (SSD streaming, a tensor-parallel rank's share); shared with whoever reports statistics.
pub type SharedExperts = Arc<dyn ExpertSource + Send + Sync>;

/// One sequence of a work item.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeqWork {
    pub session: u64,
    /// Position of the first new token (earlier positions must already be cached).
    pub pos0: u32,
    pub n_tokens: u32,
    /// Drop whatever the runner holds for the session first (replay, restore).
    pub reset: bool,
    /// Hash of the session's tokens `0..pos0`.
    pub hash_before: u64,
    /// 0: no logits, 1: last token, 2: every token.
    pub logits: u8,
}

impl SeqWork {
    pub fn wanted(&self) -> LogitsWanted {
        match self.logits {
            0 => LogitsWanted::None,
            1 => LogitsWanted::Last,
            _ => LogitsWanted::All,
        }
    }

    pub fn code(w: LogitsWanted) -> u8 {
        match w {
            LogitsWanted::None => 0,
            LogitsWanted::Last => 1,
            LogitsWanted::All => 2,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(
        "layers {range}: session {session} token history differs from the coordinator's (hash mismatch at position {pos0})"
    )]
    HashMismatch {
        range: String,
        session: u64,
        pos0: u32,
    },
    #[error("layers {range}: {source}")]
    Model {
        range: String,
        source: Box<model::ModelError>,
    },
}

impl From<RunError> for EngineError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Model { source, .. } => EngineError::Model(*source),
            e @ RunError::HashMismatch { .. } => EngineError::Executor(e.to_string()),
        }
    }
}

struct RunnerSession {
    kv: KvCache,
    tokens: Vec<u32>,
    /// `prefix_hash::of(&tokens)`, kept up to date so that appending checks in O(1).
    hash: u64,
}

pub struct Runner {
    model: Arc<Model>,
    compute: Compute,
    range: LayerRange,
    kv_type: KvType,
    n_ctx: usize,
    experts: Option<SharedExperts>,
    /// Sliding-window layers keep every position too (`KvLayout::full_sliding`).
    full_sliding: bool,
    sessions: HashMap<SessionId, RunnerSession>,
}

impl Runner {
    /// Runs `range` of `model` (the embeddings when it starts at layer 0, the head when it
    /// holds it) with `n_ctx` positions of `kv_type` KV per session and resident experts.
    pub fn new(
        model: Arc<Model>,
        compute: Compute,
        range: LayerRange,
        kv_type: KvType,
        n_ctx: usize,
    ) -> Runner {
        Runner {
            model,
            compute,
            range,
            kv_type,
            n_ctx,
            experts: None,
            full_sliding: false,
            sessions: HashMap::new(),
        }
    }

    /// With `on`, sessions' sliding-window layers keep every position, as full layers do
    /// (llama.cpp's `--swa-full`): any rewind reuses the cache, at the memory of full attention.
    /// Every runner of a session must agree, since a coordinator answers rewinds for all
    /// (`can_rewind`); the command line offers it on a single node only.
    pub fn with_full_sliding(mut self, on: bool) -> Self {
        self.full_sliding = on;
        self
    }

    pub fn full_sliding(&self) -> bool {
        self.full_sliding
    }

    /// Routed experts from `experts` instead of the model's resident tensors.
    pub fn with_experts(mut self, experts: Option<SharedExperts>) -> Self {
        self.experts = experts;
        self
    }

    /// The expert source's statistics (empty when resident).
    pub fn stats(&self) -> Vec<(String, f64)> {
        self.experts.as_ref().map(|e| e.stats()).unwrap_or_default()
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn compute(&self) -> &Compute {
        &self.compute
    }

    pub fn range(&self) -> &LayerRange {
        &self.range
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// `"first:last"` or `"first:output"`.
    pub fn label(&self) -> String {
        self.range.to_string()
    }

    pub fn session_len(&self, session: SessionId) -> usize {
        self.sessions.get(&session).map_or(0, |s| s.tokens.len())
    }

    pub fn contains(&self, session: SessionId) -> bool {
        self.sessions.contains_key(&session)
    }

    pub fn destroy(&mut self, session: SessionId) {
        self.sessions.remove(&session);
    }

    pub fn reset_all(&mut self) {
        self.sessions.clear();
    }

    /// Keeps the first `n` positions of `session`; refused ([`EngineError::CannotRewind`],
    /// nothing changed) when its sliding-window layers no longer hold what position `n`
    /// attends to.
    pub fn truncate(&mut self, session: SessionId, n: usize) -> Result<()> {
        if let Some(s) = self.sessions.get_mut(&session)
            && n < s.tokens.len()
        {
            s.kv.truncate(n).map_err(|e| EngineError::CannotRewind {
                session,
                n,
                why: e.to_string(),
            })?;
            s.tokens.truncate(n);
            s.hash = prefix_hash::of(&s.tokens);
        }
        Ok(())
    }

    /// Whether [`Runner::truncate`]`(session, n)` would succeed. Every stage and rank of a
    /// session answers the same (the cache tracks the sliding layers' start whether or not it
    /// holds one), so a coordinator asks its own runner for all of them.
    pub fn can_rewind(&self, session: SessionId, n: usize) -> bool {
        self.sessions
            .get(&session)
            .is_none_or(|s| n >= s.tokens.len() || s.kv.can_rewind(n))
    }

    /// The latest position at most `n` that [`Runner::truncate`] can keep (see
    /// [`KvCache::rewind_point`]); as [`Runner::can_rewind`], every stage and rank answers the
    /// same.
    pub fn rewind_point(&self, session: SessionId, n: usize) -> usize {
        self.sessions.get(&session).map_or(n, |s| {
            if n >= s.tokens.len() {
                n
            } else {
                s.kv.rewind_point(n)
            }
        })
    }

    fn new_session(&self) -> RunnerSession {
        let layout = self
            .model
            .kv_layout(self.kv_type, self.range.layers(), self.n_ctx);
        RunnerSession {
            kv: KvCache::new(if self.full_sliding {
                layout.full_sliding()
            } else {
                layout
            }),
            tokens: Vec::new(),
            hash: prefix_hash::EMPTY,
        }
    }

    fn model_error(&self, source: model::ModelError) -> RunError {
        RunError::Model {
            range: self.label(),
            source: Box::new(source),
        }
    }

    /// Runs a work item: checks each sequence's history hash, rewinds to `pos0`, runs the
    /// layers (and the head). On error nothing is left half-applied.
    pub fn run(
        &mut self,
        seqs: &[SeqWork],
        tokens: &[u32],
        input: StageInput,
    ) -> std::result::Result<StageOutput, RunError> {
        self.run_with_hooks(seqs, tokens, input, &mut NoHooks)
    }

    /// [`Runner::run`] with hooks (a tensor-parallel rank's all-reduce).
    pub fn run_with_hooks(
        &mut self,
        seqs: &[SeqWork],
        tokens: &[u32],
        input: StageInput,
        hooks: &mut dyn Hooks,
    ) -> std::result::Result<StageOutput, RunError> {
        let mut n_total = 0usize;
        let mut taken: Vec<(SessionId, RunnerSession)> = Vec::with_capacity(seqs.len());
        let mut fail: Option<RunError> = None;
        for s in seqs {
            let mut sess = match self.sessions.remove(&s.session) {
                Some(sess) if !s.reset => sess,
                _ => self.new_session(),
            };
            let pos0 = s.pos0 as usize;
            if fail.is_none() && !history_matches(&sess, pos0, s.hash_before) {
                fail = Some(RunError::HashMismatch {
                    range: self.label(),
                    session: s.session,
                    pos0: s.pos0,
                });
            }
            if fail.is_none() && pos0 < sess.tokens.len() {
                // Coordinators refuse such rewinds up front (`can_rewind`); a stage that still
                // gets one fails the item rather than attend to positions it dropped.
                match sess.kv.truncate(pos0) {
                    Ok(()) => {
                        sess.tokens.truncate(pos0);
                        sess.hash = s.hash_before;
                    }
                    Err(e) => fail = Some(self.model_error(e)),
                }
            }
            taken.push((s.session, sess));
            n_total += s.n_tokens as usize;
        }
        let result = match fail {
            Some(e) => Err(e),
            None if n_total != tokens.len() => Err(self.model_error(model::ModelError::Input(
                format!("{} tokens for sequences totalling {n_total}", tokens.len()),
            ))),
            None => {
                let mut inputs: Vec<SeqInput> = taken
                    .iter_mut()
                    .zip(seqs)
                    .map(|((_, sess), s)| SeqInput {
                        kv: &mut sess.kv,
                        n_tokens: s.n_tokens as usize,
                        logits: s.wanted(),
                    })
                    .collect();
                let resident;
                let source: &dyn ExpertSource = match &self.experts {
                    Some(e) => e.as_ref(),
                    None => {
                        resident = ResidentExperts::new(&self.model);
                        &resident
                    }
                };
                self.model
                    .forward(
                        &self.compute,
                        source,
                        self.range.layers(),
                        self.range.head,
                        input,
                        &mut inputs,
                        hooks,
                    )
                    .map_err(|e| self.model_error(e))
            }
        };
        let mut off = 0;
        for ((id, mut sess), s) in taken.into_iter().zip(seqs) {
            let n = s.n_tokens as usize;
            if result.is_ok() {
                let new = &tokens[off..off + n];
                sess.tokens.extend_from_slice(new);
                sess.hash = prefix_hash::extend(sess.hash, new);
            }
            off += n;
            self.sessions.insert(id, sess);
        }
        result
    }

    /// Evaluates a batch of requests on a runner that holds the whole model (embeddings to
    /// head): every request's tokens are appended to its session and its wanted logits
    /// returned in request order. On error no session keeps a partial result.
    pub fn eval(&mut self, batch: &[EvalRequest]) -> Result<Vec<EvalResult>> {
        let ids: Vec<SessionId> = batch.iter().map(|r| r.session).collect();
        if (1..ids.len()).any(|i| ids[..i].contains(&ids[i])) {
            return Err(EngineError::Executor(
                "a batch names the same session twice".into(),
            ));
        }
        let mut seqs = Vec::with_capacity(batch.len());
        for r in batch {
            let (have, hash) = self
                .sessions
                .get(&r.session)
                .map_or((0, prefix_hash::EMPTY), |s| (s.tokens.len(), s.hash));
            if have + r.tokens.len() > self.n_ctx {
                return Err(EngineError::ContextFull {
                    needed: have + r.tokens.len(),
                    n_ctx: self.n_ctx,
                });
            }
            seqs.push(SeqWork {
                session: r.session,
                pos0: have as u32,
                n_tokens: r.tokens.len() as u32,
                reset: false,
                hash_before: hash,
                logits: SeqWork::code(r.logits),
            });
        }
        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|r| r.tokens.iter().copied())
            .collect();
        match self.run(&seqs, &tokens, StageInput::Tokens(&tokens))? {
            StageOutput::Logits(l) => Ok(EvalResult::split(batch, &l.data, l.n_vocab)),
            StageOutput::Hidden(_) => Err(EngineError::Executor(format!(
                "layers {} do not end at the output head",
                self.label()
            ))),
        }
    }

    /// KV bytes of `layer` for a snapshot of the session's first `n` positions: all of them, or
    /// the latest `window - 1` of a sliding layer (`None` when the session or the layer is not
    /// here, or it holds fewer positions).
    pub fn export_layer(
        &self,
        session: SessionId,
        layer: usize,
        n: usize,
    ) -> Option<(Vec<u8>, Vec<u8>)> {
        let s = self.sessions.get(&session)?;
        s.kv.export(layer, n)
            .ok()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
    }

    /// Every layer of this runner's range for the session's first `n` positions, in order.
    pub fn export(&self, session: SessionId, n: usize) -> std::result::Result<LayersKv, RunError> {
        let s = self.sessions.get(&session).ok_or_else(|| {
            self.model_error(model::ModelError::Input(format!(
                "export of unknown session {session}"
            )))
        })?;
        self.range
            .layers()
            .map(|il| {
                s.kv.export(il, n)
                    .map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .map_err(|e| self.model_error(e))
            })
            .collect()
    }

    /// Replaces the session with restored tokens; layers are filled with
    /// [`Runner::import_layer`] (a pipeline receives them one at a time).
    pub fn begin_restore(
        &mut self,
        session: SessionId,
        tokens: &[u32],
    ) -> std::result::Result<(), RunError> {
        if tokens.len() > self.n_ctx {
            return Err(self.model_error(model::ModelError::Input(format!(
                "{} restored positions exceed the context of {}",
                tokens.len(),
                self.n_ctx
            ))));
        }
        let mut sess = self.new_session();
        sess.kv
            .begin_import(tokens.len())
            .map_err(|e| self.model_error(e))?;
        sess.tokens = tokens.to_vec();
        sess.hash = prefix_hash::of(tokens);
        self.sessions.insert(session, sess);
        Ok(())
    }

    pub fn import_layer(
        &mut self,
        session: SessionId,
        layer: usize,
        k: &[u8],
        v: &[u8],
    ) -> std::result::Result<(), RunError> {
        let Some(s) = self.sessions.get_mut(&session) else {
            return Err(self.model_error(model::ModelError::Input(format!(
                "restore of unknown session {session}"
            ))));
        };
        let n = s.tokens.len();
        let imported = s.kv.import(layer, n, k, v);
        imported.map_err(|e| self.model_error(e))
    }

    /// Replaces the session with `tokens` and this runner's layers (`layers[i]` is layer
    /// `range.first + i`). On error the session is gone rather than half restored.
    pub fn import(
        &mut self,
        session: SessionId,
        tokens: &[u32],
        layers: &[(Vec<u8>, Vec<u8>)],
    ) -> std::result::Result<(), RunError> {
        if layers.len() != self.range.n_layers() {
            return Err(self.model_error(model::ModelError::Input(format!(
                "{} layers of KV for a range of {}",
                layers.len(),
                self.range.n_layers()
            ))));
        }
        self.begin_restore(session, tokens)?;
        for (il, (k, v)) in self.range.layers().zip(layers) {
            if let Err(e) = self.import_layer(session, il, k, v) {
                self.sessions.remove(&session);
                return Err(e);
            }
        }
        Ok(())
    }
}

/// Whether a session's history up to `pos0` hashes to `hash_before`; hashing is needed only
/// on a rewind (appending compares the kept hash).
fn history_matches(sess: &RunnerSession, pos0: usize, hash_before: u64) -> bool {
    match pos0.cmp(&sess.tokens.len()) {
        std::cmp::Ordering::Equal => sess.hash == hash_before,
        std::cmp::Ordering::Less => prefix_hash::of(&sess.tokens[..pos0]) == hash_before,
        std::cmp::Ordering::Greater => false,
    }
}
