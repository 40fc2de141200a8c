//! What every model-running subcommand shares: the model flags, loading with a progress bar,
//! and building the engine (the executor behind it is chosen here and nowhere else).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use engine::{Engine, LocalExecutor};
use indicatif::{ProgressBar, ProgressStyle};
use model::{Compute, KvType, Model, WeightSelection};

/// The demo model committed to the repository, used when `-m` is not given.
pub fn default_model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("MOESHARD_DEFAULT_MODEL") {
        return PathBuf::from(p);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/shakespeare-moe.gguf")
}

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model (any file of a split set). Default: the committed demo model.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Compute threads (0: one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Context size per session (0: the model's training context, capped at 4096).
    #[arg(short = 'c', long = "ctx", default_value_t = 0)]
    pub ctx: usize,
    /// KV cache type: f16 or f32.
    #[arg(long, default_value = "f16", value_parser = parse_kv_type)]
    pub kv_type: KvType,
    /// Do not fault the weights in before the first token.
    #[arg(long)]
    pub no_warm: bool,
    #[command(flatten)]
    pub cluster: crate::cluster_args::ClusterArgs,
    #[command(flatten)]
    pub streaming: crate::streaming_args::StreamingArgs,
}

pub fn parse_kv_type(s: &str) -> Result<KvType, String> {
    KvType::from_name(s).ok_or_else(|| format!("unknown KV type {s:?} (f16, f32)"))
}

impl ModelArgs {
    pub fn model_path(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(default_model_path)
    }
}

/// Loads the model and faults in the weights this process will read, with a progress bar.
pub fn load_model(
    args: &ModelArgs,
    select: impl FnOnce(&Model) -> Option<WeightSelection>,
) -> anyhow::Result<Arc<Model>> {
    let path = args.model_path();
    let t0 = Instant::now();
    let model = Model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let sel = select(&model).unwrap_or(WeightSelection {
        layers: 0..=model.n_layer() - 1,
        embeddings: true,
        head: true,
        experts: true,
    });
    let ranges = model.weight_ranges(&sel);
    let total: u64 = ranges.iter().map(|r| r.len).sum();
    if !args.no_warm && fits_in_memory(total) {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "loading {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(
            path.file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        model.warm(&ranges, |n| bar.inc(n));
        bar.finish_and_clear();
    }
    tracing::info!(
        "loaded {} ({}, {} layers, {:.2} GiB of weights for this process) in {:.2?}",
        path.display(),
        model.spec.name,
        model.n_layer(),
        total as f64 / (1u64 << 30) as f64,
        t0.elapsed()
    );
    Ok(Arc::new(model))
}

/// Whether `bytes` fit comfortably in the memory available now (else warming would only evict
/// what it just read).
fn fits_in_memory(bytes: u64) -> bool {
    let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    });
    avail.is_none_or(|a| bytes < a / 10 * 9)
}

/// Context size: the flag, or the model's training context capped at 4096 (llama.cpp's default).
pub fn context_size(args: &ModelArgs, model: &Model) -> usize {
    if args.ctx > 0 {
        args.ctx
    } else {
        model.hp.n_ctx_train.min(4096)
    }
}

/// The layers this process runs and whether it holds the head.
pub fn local_layers(
    args: &ModelArgs,
    model: &Model,
) -> anyhow::Result<(std::ops::RangeInclusive<usize>, bool)> {
    match &args.cluster.layers {
        None => Ok((0..=model.n_layer() - 1, true)),
        Some(r) => {
            let (layers, head) =
                cluster::stage::parse_range(r, model.n_layer()).map_err(anyhow::Error::msg)?;
            anyhow::ensure!(
                *layers.start() == 0,
                "--layers {r}: the coordinator's range must start at layer 0"
            );
            Ok((layers, head))
        }
    }
}

/// What this process reads of the model, for warming.
pub fn selection(args: &ModelArgs, model_layers: usize) -> Option<WeightSelection> {
    if args.cluster.tensor_parallel {
        // Each rank faults in only its own experts, on first use.
        return Some(WeightSelection {
            layers: 0..=model_layers.checked_sub(1)?,
            embeddings: true,
            head: true,
            experts: false,
        });
    }
    let (layers, head) = match &args.cluster.layers {
        Some(r) => cluster::stage::parse_range(r, model_layers).ok()?,
        None => (0..=model_layers.checked_sub(1)?, true),
    };
    Some(WeightSelection {
        layers,
        embeddings: true,
        head,
        experts: !args.streaming.ssd_streaming,
    })
}

/// The engine for these flags: local, or the coordinator of a pipeline.
pub fn build_engine(args: &ModelArgs, model: Arc<Model>) -> anyhow::Result<Engine> {
    let n_ctx = context_size(args, &model);
    let compute = Compute::new(args.threads);
    if args.cluster.tensor_parallel {
        // Rank 0's share: a fresh instance (cheap: a map and the small vectors) to shard.
        let fresh = Model::load(args.model_path())
            .with_context(|| format!("loading {}", args.model_path().display()))?;
        let mut cfg = args.cluster.tp_config()?;
        cfg.experts = args.streaming.expert_factory(n_ctx, args.kv_type);
        let exec = cluster::tp::TpExecutor::new(fresh, args.threads, args.kv_type, n_ctx, cfg)?;
        return Ok(Engine::new(Box::new(exec)));
    }
    let (layers, head) = local_layers(args, &model)?;
    let cx = crate::streaming_args::StreamingContext {
        layers: Some(layers.clone()),
        n_ctx,
        kv_type: args.kv_type,
        owned: None,
    };
    let experts = args.streaming.expert_source_for(&model, cx)?;
    if args.cluster.is_pipeline() {
        let mut stage =
            cluster::stage::StageRuntime::new(model, compute, layers, head, args.kv_type, n_ctx);
        if let Some(e) = experts {
            stage = stage.with_experts(e);
        }
        let exec =
            cluster::pipeline::PipelineExecutor::new(stage, args.cluster.pipeline_config()?)?;
        return Ok(Engine::new(Box::new(exec)));
    }
    let mut exec = LocalExecutor::new(model, compute, args.kv_type, n_ctx);
    if let Some(e) = experts {
        exec = exec.with_experts(engine::ExpertMode::Custom(e));
    }
    Ok(Engine::new(Box::new(exec)))
}

/// Loads the model for these flags (only this process's share is warmed) and builds the engine.
pub fn open(args: &ModelArgs) -> anyhow::Result<(Arc<Model>, Engine)> {
    let model = load_model(args, |m| selection(args, m.n_layer()))?;
    let engine = build_engine(args, Arc::clone(&model))?;
    Ok((model, engine))
}
