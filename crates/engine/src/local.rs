//! The local executor: the whole model in this process, one KV cache per session, batches run
//! through the single forward path.

use std::collections::HashMap;
use std::sync::Arc;

use model::{
    Compute, ExpertSource, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts,
    SeqInput, StageInput, StageOutput,
};

use crate::error::{EngineError, Result};
use crate::executor::{EvalRequest, EvalResult, Executor, ModelInfo, SessionId};
use crate::snapshot::Snapshot;

/// Builds the info a frontend sees from a loaded model.
pub fn model_info(model: &Model, n_ctx: usize) -> ModelInfo {
    model_info_kv(model, n_ctx, KvType::F16)
}

/// [`model_info`] with the KV type that sizes `kv_bytes_per_position`.
pub fn model_info_kv(model: &Model, n_ctx: usize, kv_type: KvType) -> ModelInfo {
    let meta = model.files().metadata();
    let name = meta
        .get_str("general.name")
        .ok()
        .flatten()
        .map(str::to_string)
        .unwrap_or_else(|| model.spec.name.to_string());
    ModelInfo {
        name,
        arch: model.spec.name.to_string(),
        n_vocab: model.hp.n_vocab,
        n_layer: model.hp.n_layer,
        n_embd: model.hp.n_embd,
        n_expert: model.hp.moe.as_ref().map_or(0, |m| m.n_expert),
        n_expert_used: model.hp.moe.as_ref().map_or(0, |m| m.n_expert_used),
        n_ctx,
        fingerprint: model.files().fingerprint().to_string(),
        weight_bytes: model.files().splits().iter().map(|s| s.file_len()).sum(),
        kv_bytes_per_position: model.hp.n_layer
            * model.hp.n_head_kv
            * (model.hp.head_dim_k + model.hp.head_dim_v)
            * kv_type.bytes(),
    }
}

/// Where routed experts come from for a local executor.
pub enum ExpertMode {
    Resident,
    /// Another source (SSD streaming), shared with whoever reports its statistics.
    Custom(Arc<dyn ExpertSource + Send + Sync>),
}

pub struct LocalExecutor {
    model: Arc<Model>,
    compute: Compute,
    kv_type: KvType,
    info: ModelInfo,
    experts: ExpertMode,
    sessions: HashMap<SessionId, KvCache>,
}

impl LocalExecutor {
    pub fn new(
        model: Arc<Model>,
        compute: Compute,
        kv_type: KvType,
        n_ctx: usize,
    ) -> LocalExecutor {
        let info = model_info_kv(&model, n_ctx, kv_type);
        LocalExecutor {
            model,
            compute,
            kv_type,
            info,
            experts: ExpertMode::Resident,
            sessions: HashMap::new(),
        }
    }

    pub fn with_experts(mut self, experts: ExpertMode) -> Self {
        self.experts = experts;
        self
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    fn new_cache(&self) -> KvCache {
        let last = self.model.n_layer() - 1;
        KvCache::new(
            self.model
                .kv_layout(self.kv_type, 0..=last, self.info.n_ctx),
        )
    }
}

impl Executor for LocalExecutor {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn eval(&mut self, batch: &[EvalRequest]) -> Result<Vec<EvalResult>> {
        for r in batch {
            if !self.sessions.contains_key(&r.session) {
                let c = self.new_cache();
                self.sessions.insert(r.session, c);
            }
            let have = self.sessions[&r.session].len();
            if have + r.tokens.len() > self.info.n_ctx {
                return Err(EngineError::ContextFull {
                    needed: have + r.tokens.len(),
                    n_ctx: self.info.n_ctx,
                });
            }
        }
        let ids: Vec<SessionId> = batch.iter().map(|r| r.session).collect();
        if (1..ids.len()).any(|i| ids[..i].contains(&ids[i])) {
            return Err(EngineError::Executor(
                "a batch names the same session twice".into(),
            ));
        }
        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|r| r.tokens.iter().copied())
            .collect();
        // Borrow every session's cache mutably at once, in batch order.
        let mut caches: Vec<(SessionId, KvCache)> = ids
            .iter()
            .map(|id| (*id, self.sessions.remove(id).expect("inserted above")))
            .collect();
        let result = {
            let mut seqs: Vec<SeqInput> = caches
                .iter_mut()
                .zip(batch)
                .map(|((_, kv), r)| SeqInput {
                    kv,
                    n_tokens: r.tokens.len(),
                    logits: r.logits,
                })
                .collect();
            let last = self.model.n_layer() - 1;
            let resident;
            let source: &dyn ExpertSource = match &self.experts {
                ExpertMode::Resident => {
                    resident = ResidentExperts::new(&self.model);
                    &resident
                }
                ExpertMode::Custom(s) => s.as_ref(),
            };
            self.model.forward(
                &self.compute,
                source,
                0..=last,
                true,
                StageInput::Tokens(&tokens),
                &mut seqs,
                &mut NoHooks,
            )
        };
        for (id, kv) in caches {
            self.sessions.insert(id, kv);
        }
        let StageOutput::Logits(logits) = result? else {
            return Err(EngineError::Executor(
                "the local forward did not produce logits".into(),
            ));
        };
        let mut out = Vec::with_capacity(batch.len());
        let mut row_iter = 0;
        let mut row0 = 0;
        for r in batch {
            let n_rows = match r.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => usize::from(!r.tokens.is_empty()),
                LogitsWanted::All => r.tokens.len(),
            };
            let mut data = Vec::with_capacity(n_rows * logits.n_vocab);
            for i in 0..n_rows {
                debug_assert!(logits.rows[row_iter] >= row0);
                data.extend_from_slice(logits.row(row_iter + i));
            }
            row_iter += n_rows;
            row0 += r.tokens.len();
            out.push(EvalResult {
                n_rows,
                n_vocab: logits.n_vocab,
                logits: data,
            });
        }
        Ok(out)
    }

    fn truncate(&mut self, session: SessionId, n: usize) -> Result<()> {
        if let Some(kv) = self.sessions.get_mut(&session) {
            kv.truncate(n);
        } else if n > 0 {
            return Err(EngineError::Executor(format!(
                "session {session} does not exist"
            )));
        }
        Ok(())
    }

    fn session_len(&self, session: SessionId) -> usize {
        self.sessions.get(&session).map_or(0, |kv| kv.len())
    }

    fn destroy(&mut self, session: SessionId) {
        self.sessions.remove(&session);
    }

    fn snapshot(&mut self, session: SessionId) -> Result<Snapshot> {
        let kv = self
            .sessions
            .get(&session)
            .ok_or_else(|| EngineError::Executor(format!("session {session} does not exist")))?;
        let n = kv.len();
        let l = kv.layout();
        let layers = (0..self.model.n_layer())
            .map(|il| kv.export(il, n).map(|(k, v)| (k.to_vec(), v.to_vec())))
            .collect::<model::Result<Vec<_>>>()?;
        Ok(Snapshot {
            fingerprint: self.info.fingerprint.clone(),
            tokens: Vec::new(),
            kv_type: l.kv_type,
            n_kv_head: l.n_kv_head,
            head_dim_k: l.head_dim_k,
            head_dim_v: l.head_dim_v,
            layers,
            last_logits: Vec::new(),
        })
    }

    fn restore(&mut self, session: SessionId, s: &Snapshot) -> Result<()> {
        s.check_model(&self.info.fingerprint)?;
        let mut kv = self.new_cache();
        let l = kv.layout().clone();
        if (s.kv_type, s.n_kv_head, s.head_dim_k, s.head_dim_v)
            != (l.kv_type, l.n_kv_head, l.head_dim_k, l.head_dim_v)
            || s.layers.len() != self.model.n_layer()
        {
            return Err(EngineError::Snapshot(
                "snapshot KV layout differs from this executor's (kv type, heads or layers)".into(),
            ));
        }
        let n = s.tokens.len();
        if n > self.info.n_ctx {
            return Err(EngineError::ContextFull {
                needed: n,
                n_ctx: self.info.n_ctx,
            });
        }
        kv.reserve(0, n)?;
        for (il, (k, v)) in s.layers.iter().enumerate() {
            kv.import(il, n, k, v)?;
        }
        self.sessions.insert(session, kv);
        Ok(())
    }

    fn stats(&self) -> Vec<(String, f64)> {
        match &self.experts {
            ExpertMode::Resident => Vec::new(),
            ExpertMode::Custom(s) => s.stats(),
        }
    }

    fn describe(&self) -> String {
        format!(
            "local: {} layers, {} threads, kernels {}, KV {}",
            self.model.n_layer(),
            self.compute.n_threads(),
            self.compute.kernels.isa.name(),
            self.kv_type.name()
        )
    }
}
