//! One pipeline stage's compute: a layer range of the model, a KV cache per session, and the
//! rolling token hash that proves the stage has seen exactly the tokens the coordinator thinks
//! it has. Used by workers and by the coordinator's own first stage alike.

use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::sync::Arc;

use model::{
    Compute, ExpertSource, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts,
    SeqInput, StageInput, StageOutput,
};
use serde::{Deserialize, Serialize};

use crate::hash;

/// One sequence of a work item.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeqWork {
    pub session: u64,
    /// Position of the first new token (earlier positions must already be cached).
    pub pos0: u32,
    pub n_tokens: u32,
    /// Drop whatever the stage holds for the session first (replay, restore).
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
pub enum StageError {
    #[error(
        "stage {stage}: session {session} token history differs from the coordinator's (hash mismatch at position {pos0})"
    )]
    HashMismatch {
        stage: String,
        session: u64,
        pos0: u32,
    },
    #[error("stage {stage}: {source}")]
    Model {
        stage: String,
        source: Box<model::ModelError>,
    },
}

struct StageSession {
    kv: KvCache,
    tokens: Vec<u32>,
}

/// Where routed experts come from for a stage.
pub type SharedExperts = Arc<dyn ExpertSource + Send + Sync>;

pub struct StageRuntime {
    model: Arc<Model>,
    compute: Compute,
    pub layers: RangeInclusive<usize>,
    pub head: bool,
    kv_type: KvType,
    n_ctx: usize,
    experts: Option<SharedExperts>,
    sessions: HashMap<u64, StageSession>,
}

impl StageRuntime {
    pub fn new(
        model: Arc<Model>,
        compute: Compute,
        layers: RangeInclusive<usize>,
        head: bool,
        kv_type: KvType,
        n_ctx: usize,
    ) -> StageRuntime {
        StageRuntime {
            model,
            compute,
            layers,
            head,
            kv_type,
            n_ctx,
            experts: None,
            sessions: HashMap::new(),
        }
    }

    pub fn with_experts(mut self, experts: SharedExperts) -> Self {
        self.experts = Some(experts);
        self
    }

    /// The expert source's statistics (empty when resident).
    pub fn stats(&self) -> Vec<(String, f64)> {
        self.experts.as_ref().map(|e| e.stats()).unwrap_or_default()
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// `"first:last"` or `"first:output"`.
    pub fn label(&self) -> String {
        range_label(&self.layers, self.head)
    }

    pub fn session_len(&self, session: u64) -> usize {
        self.sessions.get(&session).map_or(0, |s| s.tokens.len())
    }

    pub fn destroy(&mut self, session: u64) {
        self.sessions.remove(&session);
    }

    pub fn reset_all(&mut self) {
        self.sessions.clear();
    }

    fn new_session(&self) -> StageSession {
        StageSession {
            kv: KvCache::new(
                self.model
                    .kv_layout(self.kv_type, self.layers.clone(), self.n_ctx),
            ),
            tokens: Vec::new(),
        }
    }

    /// Runs a work item: checks each sequence's hash, rewinds to `pos0`, runs the layers (and
    /// the head). On error nothing is left half-applied.
    pub fn run(
        &mut self,
        seqs: &[SeqWork],
        tokens: &[u32],
        input: StageInput,
    ) -> Result<StageOutput, StageError> {
        self.run_with_hooks(seqs, tokens, input, &mut NoHooks)
    }

    /// [`StageRuntime::run`] with hooks (a tensor-parallel rank's all-reduce).
    pub fn run_with_hooks(
        &mut self,
        seqs: &[SeqWork],
        tokens: &[u32],
        input: StageInput,
        hooks: &mut dyn model::Hooks,
    ) -> Result<StageOutput, StageError> {
        let stage = self.label();
        let mut offset = 0usize;
        let mut taken: Vec<(u64, StageSession)> = Vec::with_capacity(seqs.len());
        let mut fail: Option<StageError> = None;
        for s in seqs {
            let mut sess = match self.sessions.remove(&s.session) {
                Some(sess) if !s.reset => sess,
                _ => self.new_session(),
            };
            let pos0 = s.pos0 as usize;
            if fail.is_none()
                && (pos0 > sess.tokens.len() || hash::of(&sess.tokens[..pos0]) != s.hash_before)
            {
                fail = Some(StageError::HashMismatch {
                    stage: stage.clone(),
                    session: s.session,
                    pos0: s.pos0,
                });
            }
            if fail.is_none() {
                sess.tokens.truncate(pos0);
                sess.kv.truncate(pos0);
            }
            taken.push((s.session, sess));
            offset += s.n_tokens as usize;
        }
        let result = match fail {
            Some(e) => Err(e),
            None if offset != tokens.len() => Err(StageError::Model {
                stage: stage.clone(),
                source: Box::new(model::ModelError::Input(format!(
                    "{} tokens for sequences totalling {offset}",
                    tokens.len()
                ))),
            }),
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
                        self.layers.clone(),
                        self.head,
                        input,
                        &mut inputs,
                        hooks,
                    )
                    .map_err(|source| StageError::Model {
                        stage: stage.clone(),
                        source: Box::new(source),
                    })
            }
        };
        let mut off = 0;
        for ((id, mut sess), s) in taken.into_iter().zip(seqs) {
            let n = s.n_tokens as usize;
            if result.is_ok() {
                sess.tokens.extend_from_slice(&tokens[off..off + n]);
            }
            off += n;
            self.sessions.insert(id, sess);
        }
        result
    }

    /// KV bytes of `layer` for the session's first `n` positions.
    pub fn export_layer(&self, session: u64, layer: usize, n: usize) -> Option<(Vec<u8>, Vec<u8>)> {
        let s = self.sessions.get(&session)?;
        s.kv.export(layer, n)
            .ok()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
    }

    /// Replaces the session with restored tokens; layers are filled with [`Self::import_layer`].
    pub fn begin_restore(&mut self, session: u64, tokens: &[u32]) -> Result<(), StageError> {
        let mut sess = self.new_session();
        sess.kv
            .reserve(0, tokens.len())
            .map_err(|source| StageError::Model {
                stage: self.label(),
                source: Box::new(source),
            })?;
        sess.tokens = tokens.to_vec();
        self.sessions.insert(session, sess);
        Ok(())
    }

    pub fn import_layer(
        &mut self,
        session: u64,
        layer: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), StageError> {
        let stage = self.label();
        let s = self
            .sessions
            .get_mut(&session)
            .ok_or_else(|| StageError::Model {
                stage: stage.clone(),
                source: Box::new(model::ModelError::Input(format!(
                    "restore of unknown session {session}"
                ))),
            })?;
        let n = s.tokens.len();
        s.kv.import(layer, n, k, v)
            .map_err(|source| StageError::Model {
                stage,
                source: Box::new(source),
            })
    }
}

pub fn range_label(layers: &RangeInclusive<usize>, head: bool) -> String {
    if head {
        format!("{}:output", layers.start())
    } else {
        format!("{}:{}", layers.start(), layers.end())
    }
}

/// Parses `A:B` or `A:output` against a model of `n_layer` layers: (layers, holds the head).
pub fn parse_range(s: &str, n_layer: usize) -> Result<(RangeInclusive<usize>, bool), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("layer range {s:?}: expected A:B or A:output"))?;
    let first: usize = a
        .trim()
        .parse()
        .map_err(|_| format!("layer range {s:?}: {a:?} is not a layer number"))?;
    let (last, head) = match b.trim() {
        "output" => (
            n_layer.checked_sub(1).ok_or("the model has no layers")?,
            true,
        ),
        x => (
            x.parse::<usize>().map_err(|_| {
                format!("layer range {s:?}: {x:?} is not a layer number or `output`")
            })?,
            false,
        ),
    };
    if first > last || last >= n_layer {
        return Err(format!(
            "layer range {s:?} is invalid for a model of {n_layer} layers (0..={})",
            n_layer - 1
        ));
    }
    Ok((first..=last, head))
}
