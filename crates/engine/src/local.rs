//! The local executor: the whole model in this process, run by one [`Runner`] (one KV cache
//! per session, batches through the single forward path).

use std::sync::Arc;

use model::{Compute, KvType, Model};

use crate::error::{EngineError, Result};
use crate::executor::{EvalRequest, EvalResult, Executor, ModelInfo, SessionId};
use crate::layer_range::LayerRange;
use crate::runner::{Runner, SharedExperts};
use crate::snapshot::{Snapshot, SnapshotLayout};

/// Builds the info a frontend sees from a loaded model.
pub fn model_info(model: &Model, n_ctx: usize) -> ModelInfo {
    model_info_kv(model, n_ctx, KvType::F16)
}

/// [`model_info`] with the KV type that sizes `kv_bytes_per_position`.
/// Bytes per position a cache keeps in f32 whatever its KV type, over the model's layers:
/// DeepSeek V4's compressed rows (a ratio-4 layer's attention and indexer rows, a ratio-128
/// layer's attention rows), GLM-5's indexer keys (full sparse-attention layers).
fn f32_side_bytes_per_position(model: &Model) -> usize {
    if let Some(p) = &model.hp.dsa {
        return (0..model.hp.n_layer).filter(|&il| p.is_full(il)).count() * p.head_dim * 4;
    }
    let Some(p) = &model.hp.dsv4 else { return 0 };
    (0..model.hp.n_layer)
        .map(|il| match p.ratio(il) {
            0 => 0.0,
            4 => (model.hp.head_dim_k + p.index_head_dim) as f64 * 4.0 / 4.0,
            r => model.hp.head_dim_k as f64 * 4.0 / r as f64,
        })
        .sum::<f64>()
        .ceil() as usize
}

/// GLM-5.3 Flash: bytes per position of its latent layers' rows (`layer_bytes` each), plus on
/// full-indexer layers the f32 key and pooling scores of every position and the pooled key of
/// every pool. Its KDA layers hold no rows: their recurrent state is a fixed size per session.
fn hybrid_bytes_per_position(model: &Model, layer_bytes: usize) -> Option<usize> {
    use model::hparams::Glm5LayerKind;
    let p = model.hp.glm5next.as_ref()?;
    let index_bytes = (2.0 + 1.0 / p.kpool as f64) * p.index_head_dim as f64 * 4.0;
    let bytes: f64 = (0..model.hp.n_layer)
        .map(|il| match p.kind(il) {
            Glm5LayerKind::Kda => 0.0,
            Glm5LayerKind::Mla { indexer: false } => layer_bytes as f64,
            Glm5LayerKind::Mla { indexer: true } => layer_bytes as f64 + index_bytes,
        })
        .sum();
    Some(bytes.ceil() as usize)
}

pub fn model_info_kv(model: &Model, n_ctx: usize, kv_type: KvType) -> ModelInfo {
    let meta = model.files().metadata();
    let name = meta
        .get_str("general.name")
        .ok()
        .flatten()
        .map(str::to_string)
        .unwrap_or_else(|| model.spec.name.to_string());
    let layer_bytes =
        model.hp.n_head_kv * (model.hp.head_dim_k + model.hp.head_dim_v) * kv_type.bytes();
    let n_sliding = (0..model.hp.n_layer)
        .filter(|&il| model.hp.window(il).is_some())
        .count();
    ModelInfo {
        name,
        arch: model.spec.name.to_string(),
        n_vocab: model.hp.n_vocab,
        n_layer: model.hp.n_layer,
        n_embd: model.hp.hidden_width(),
        n_expert: model.hp.moe.as_ref().map_or(0, |m| m.n_expert),
        n_expert_used: model.hp.moe.as_ref().map_or(0, |m| m.n_expert_used),
        n_ctx,
        fingerprint: model.files().fingerprint().to_string(),
        weight_bytes: model.files().splits().iter().map(|s| s.file_len()).sum(),
        kv_bytes_per_position: hybrid_bytes_per_position(model, layer_bytes)
            .unwrap_or(model.hp.n_layer * layer_bytes + f32_side_bytes_per_position(model)),
        kv_sliding_bytes_per_position: n_sliding * layer_bytes,
        kv_sliding_positions: model
            .hp
            .sliding_window
            .map_or(0, |w| model::kv::sliding_positions_held(w, 1)),
    }
}

/// Where routed experts come from for a local executor.
pub enum ExpertMode {
    Resident,
    /// Another source (SSD streaming), shared with whoever reports its statistics.
    Custom(SharedExperts),
}

pub struct LocalExecutor {
    runner: Runner,
    info: ModelInfo,
    layout: SnapshotLayout,
}

impl LocalExecutor {
    pub fn new(
        model: Arc<Model>,
        compute: Compute,
        kv_type: KvType,
        n_ctx: usize,
    ) -> LocalExecutor {
        let range = LayerRange::whole(model.n_layer());
        LocalExecutor::from_runner(Runner::new(model, compute, range, kv_type, n_ctx))
    }

    /// The executor of a runner that holds the whole model (embeddings to head).
    pub fn from_runner(runner: Runner) -> LocalExecutor {
        let (model, kv_type, n_ctx) = (runner.model(), runner.kv_type(), runner.n_ctx());
        let mut info = model_info_kv(model, n_ctx, kv_type);
        if runner.full_sliding() {
            info.kv_sliding_bytes_per_position = 0;
            info.kv_sliding_positions = 0;
        }
        LocalExecutor {
            info,
            layout: SnapshotLayout::of(model, kv_type, n_ctx),
            runner,
        }
    }

    pub fn with_experts(mut self, experts: ExpertMode) -> Self {
        self.runner = self.runner.with_experts(match experts {
            ExpertMode::Resident => None,
            ExpertMode::Custom(e) => Some(e),
        });
        self
    }

    pub fn model(&self) -> &Arc<Model> {
        self.runner.model()
    }
}

impl Executor for LocalExecutor {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn eval(&mut self, batch: &[EvalRequest]) -> Result<Vec<EvalResult>> {
        self.runner.eval(batch)
    }

    fn truncate(&mut self, session: SessionId, n: usize) -> Result<()> {
        if !self.runner.contains(session) && n > 0 {
            return Err(EngineError::Executor(format!(
                "session {session} does not exist"
            )));
        }
        self.runner.truncate(session, n)
    }

    fn rewind_point(&self, session: SessionId, n: usize) -> usize {
        self.runner.rewind_point(session, n)
    }

    fn session_len(&self, session: SessionId) -> usize {
        self.runner.session_len(session)
    }

    fn destroy(&mut self, session: SessionId) {
        self.runner.destroy(session);
    }

    fn snapshot(&mut self, session: SessionId) -> Result<Snapshot> {
        let n = self.runner.session_len(session);
        let layers = self.runner.export(session, n)?;
        Ok(self.layout.assemble(Vec::new(), layers))
    }

    fn restore(&mut self, session: SessionId, s: &Snapshot) -> Result<()> {
        s.check_layout(&self.layout)?;
        self.runner.import(session, &s.tokens, &s.layers)?;
        Ok(())
    }

    fn stats(&self) -> Vec<(String, f64)> {
        self.runner.stats()
    }

    fn describe(&self) -> String {
        let c = self.runner.compute();
        let gpu = c
            .offload()
            .map(|d| format!(" + {}", d.name()))
            .unwrap_or_default();
        format!(
            "local: {} layers, {} threads, kernels {}{gpu}, KV {}",
            self.runner.model().n_layer(),
            c.n_threads(),
            c.kernels.isa.name(),
            self.runner.kv_type().name()
        )
    }
}
