//! What every model-running subcommand shares: the model flags, loading with a progress bar,
//! and building the engine (the executor behind it follows from the `Topology`, here and
//! nowhere else).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use engine::{Engine, LocalExecutor, Runner};
use indicatif::{ProgressBar, ProgressStyle};
use model::{Compute, KvType, Model};

use crate::cluster_args::ClusterArgs;
use crate::topology::{Side, Topology};

/// The demo model committed to the repository (`models/`), built into the binary so that an
/// installed `moeshard` runs without `-m` from any directory; 14 MiB.
static BUILT_IN_MODEL: &[u8] = include_bytes!("../../../models/shakespeare-moe.gguf");

/// What `-m` names, the built-in demo model standing in when it is not given.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    File(PathBuf),
    BuiltIn,
}

impl ModelSource {
    /// The file name (or, for the built-in model, the file it was built from).
    pub fn display_path(&self) -> PathBuf {
        match self {
            ModelSource::File(p) => p.clone(),
            ModelSource::BuiltIn => PathBuf::from("shakespeare-moe.gguf"),
        }
    }

    pub fn open(&self) -> anyhow::Result<gguf::GgufModel> {
        let opened = match self {
            ModelSource::File(p) => gguf::GgufModel::open(p),
            ModelSource::BuiltIn => {
                gguf::GgufFile::from_bytes(self.display_path(), BUILT_IN_MODEL.to_vec())
                    .and_then(|f| gguf::GgufModel::from_splits(vec![f]))
            }
        };
        opened.with_context(|| format!("loading {self}"))
    }
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::File(p) => write!(f, "{}", p.display()),
            ModelSource::BuiltIn => f.write_str("the built-in demo model shakespeare-moe"),
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// GGUF model (any file of a split set). Default: $MOESHARD_DEFAULT_MODEL, else the demo
    /// model built into the binary.
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
    /// Keep every position of sliding-window layers too (gpt-oss), as llama.cpp's --swa-full:
    /// any rewind of a session (prompt cache) reuses its KV, at the memory of full attention.
    /// Single node only.
    #[arg(long)]
    pub swa_full: bool,
    #[command(flatten)]
    pub streaming: crate::streaming_args::StreamingArgs,
    #[command(flatten)]
    pub gpu: crate::gpu_args::GpuArgs,
}

pub fn parse_kv_type(s: &str) -> Result<KvType, String> {
    KvType::from_name(s).ok_or_else(|| format!("unknown KV type {s:?} (f16, f32)"))
}

impl ModelArgs {
    pub fn source(&self) -> ModelSource {
        match (&self.model, std::env::var_os("MOESHARD_DEFAULT_MODEL")) {
            (Some(p), _) => ModelSource::File(p.clone()),
            (None, Some(p)) if !p.is_empty() => ModelSource::File(PathBuf::from(p)),
            (None, _) => ModelSource::BuiltIn,
        }
    }
}

/// Opens the model as `topology` says (the shard of a tensor-parallel rank is fixed here, once)
/// and faults in the weights this process will read, with a progress bar. A worker rank, whose
/// rank is not known yet, gets the whole model bound; it rebinds its shard when it registers.
pub fn load_model(args: &ModelArgs, topology: &Topology) -> anyhow::Result<Arc<Model>> {
    // A coordinator answers rewinds for every stage and rank from its own cache, so they would
    // all need the same cache; nothing carries the flag to them.
    anyhow::ensure!(
        !args.swa_full || *topology == Topology::Local,
        "--swa-full works on a single node only (not with a pipeline or tensor-parallel group)"
    );
    let source = args.source();
    // Streaming reads experts from the file itself, past the page cache.
    anyhow::ensure!(
        !(args.streaming.ssd_streaming && source == ModelSource::BuiltIn),
        "--ssd-streaming reads experts from a file: give -m MODEL"
    );
    anyhow::ensure!(
        args.streaming.expert_profile.is_none()
            || args.streaming.ssd_streaming
            || args.gpu.gpu.is_some(),
        "--expert-profile places routed experts for --ssd-streaming or --gpu: give one of them"
    );
    let t0 = Instant::now();
    let files = Arc::new(source.open()?);
    let (rank, n_ranks) = topology.shard().unwrap_or((0, 1));
    let model =
        Model::from_gguf_rank(files, rank, n_ranks).with_context(|| format!("loading {source}"))?;
    model
        .check_role(&topology.role(&model)?)
        .with_context(|| format!("{source} cannot run here"))?;
    let sel = topology.selection(&model, args.streaming.ssd_streaming)?;
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
            source
                .display_path()
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        model.warm(&ranges, |n| bar.inc(n));
        bar.finish_and_clear();
    }
    tracing::info!(
        "loaded {} ({}, {} layers, {:.2} GiB of weights for this process) in {:.2?}",
        source,
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
    experts::available_memory().is_none_or(|a| bytes < a / 10 * 9)
}

/// Context size: the flag, or the model's training context capped at 4096 (llama.cpp's default).
pub fn context_size(args: &ModelArgs, model: &Model) -> usize {
    if args.ctx > 0 {
        args.ctx
    } else {
        model.hp.n_ctx_train.min(4096)
    }
}

/// The runner of this process's layers (with its streamed experts, if any).
pub fn runner(
    args: &ModelArgs,
    topology: &Topology,
    model: Arc<Model>,
    n_ctx: usize,
) -> anyhow::Result<Runner> {
    let range = topology.layers(model.n_layer())?;
    let cx = crate::streaming_args::StreamingContext {
        layers: Some(range.layers()),
        n_ctx,
        kv_type: args.kv_type,
        owned: None,
    };
    let experts = args.streaming.expert_source_for(&model, cx)?;
    let sel = topology.selection(&model, args.streaming.ssd_streaming)?;
    let compute = crate::gpu_args::attach(
        &args.gpu,
        args.streaming.expert_profile.as_deref(),
        &model,
        &sel,
        Compute::new(args.threads),
    )?;
    Ok(Runner::new(model, compute, range, args.kv_type, n_ctx).with_experts(experts))
}

/// The engine for these flags: local, the coordinator of a pipeline, or rank 0 of a
/// tensor-parallel group.
pub fn build_engine(
    args: &ModelArgs,
    cluster: &ClusterArgs,
    topology: &Topology,
    model: Arc<Model>,
) -> anyhow::Result<Engine> {
    let n_ctx = context_size(args, &model);
    let exec: Box<dyn engine::Executor> = match topology {
        Topology::TensorParallel { .. } => {
            let mut cfg = cluster.tp_config()?;
            cfg.experts = args.streaming.expert_factory(n_ctx, args.kv_type);
            cfg.offload = crate::gpu_args::rank_offload(
                &args.gpu,
                args.streaming.ssd_streaming,
                args.streaming.expert_profile.as_deref(),
            )?;
            Box::new(cluster::tp::TpExecutor::new(
                model,
                args.threads,
                args.kv_type,
                n_ctx,
                cfg,
            )?)
        }
        Topology::Pipeline { .. } => Box::new(cluster::pipeline::PipelineExecutor::new(
            runner(args, topology, model, n_ctx)?,
            cluster.pipeline_config()?,
        )?),
        Topology::Local => Box::new(LocalExecutor::from_runner(
            runner(args, topology, model, n_ctx)?.with_full_sliding(args.swa_full),
        )),
    };
    Ok(Engine::new(exec))
}

/// Loads the model for these flags (only this process's share is warmed) and builds the engine.
pub fn open(args: &ModelArgs, cluster: &ClusterArgs) -> anyhow::Result<(Arc<Model>, Engine)> {
    let topology = Topology::from_flags(cluster, Side::Coordinator)?;
    let model = load_model(args, &topology)?;
    let engine = build_engine(args, cluster, &topology, Arc::clone(&model))?;
    Ok((model, engine))
}

/// The chat template: `--chat-template-file` when given (Jinja, the model's BOS/EOS texts),
/// else the model's own, else ChatML (said on stderr, since replies may then be poor).
pub fn chat_template(
    meta: &gguf::Metadata,
    tokenizer: &engine::tokenizer::Tokenizer,
    file: Option<&std::path::Path>,
) -> anyhow::Result<engine::chat_template::ChatTemplate> {
    use engine::chat_template::ChatTemplate;
    let text = |id: Option<u32>| {
        id.and_then(|i| tokenizer.token_text(i))
            .unwrap_or("")
            .to_string()
    };
    if let Some(path) = file {
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("reading --chat-template-file {}", path.display()))?;
        return ChatTemplate::new(source, text(tokenizer.bos()), text(tokenizer.eos()))
            .with_context(|| format!("--chat-template-file {}", path.display()));
    }
    match ChatTemplate::from_metadata(meta).context("reading the chat template")? {
        Some(t) => Ok(t),
        None => {
            eprintln!("(the model has no chat template; using ChatML)");
            Ok(ChatTemplate::chatml(
                text(tokenizer.bos()),
                text(tokenizer.eos()),
            ))
        }
    }
}
