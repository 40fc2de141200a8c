//! `moeshard worker`: serve a layer range of a pipeline for a coordinator.

use std::time::Duration;

use cluster::pipeline::{WorkerConfig, run_worker};
use cluster::stage::{StageRuntime, parse_range};
use cluster::tp::{TpWorkerConfig, run_tp_worker};
use model::{Compute, WeightSelection};

use crate::cluster_args::auth_mode;
use crate::common::{self, ModelArgs};

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The coordinator to register with (host:port).
    #[arg(long)]
    pub coordinator: String,
    /// Where to accept the data link from the previous stage (host:port; port 0 picks one).
    #[arg(long = "data-listen", default_value = "127.0.0.1:0")]
    pub data_listen: String,
    /// Address to announce for the data link (default: as seen by the coordinator).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Stop trying to reach the coordinator after this many seconds (0: retry forever).
    #[arg(long, default_value_t = 0.0)]
    pub give_up: f64,
    /// Ask for this tensor-parallel rank (default: the lowest free one).
    #[arg(long)]
    pub rank: Option<u32>,
}

pub fn run(args: &WorkerArgs) -> anyhow::Result<()> {
    if args.model.cluster.tensor_parallel {
        return run_rank(args);
    }
    let Some(range) = args.model.cluster.layers.clone() else {
        anyhow::bail!("a worker needs --layers A:B or A:output");
    };
    let model = common::load_model(&args.model, |m| {
        let (layers, head) = parse_range(&range, m.n_layer()).ok()?;
        Some(WeightSelection {
            layers,
            embeddings: false,
            head,
            experts: !args.model.streaming.ssd_streaming,
        })
    })?;
    let (layers, head) = parse_range(&range, model.n_layer()).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        *layers.start() > 0,
        "--layers {range}: layer 0 belongs to the coordinator"
    );
    let n_ctx = common::context_size(&args.model, &model);
    let cx = crate::streaming_args::StreamingContext {
        layers: Some(layers.clone()),
        n_ctx,
        kv_type: args.model.kv_type,
        owned: None,
    };
    let experts = args.model.streaming.expert_source_for(&model, cx)?;
    let mut stage = StageRuntime::new(
        model,
        Compute::new(args.model.threads),
        layers,
        head,
        args.model.kv_type,
        n_ctx,
    );
    if let Some(e) = experts {
        stage = stage.with_experts(e);
    }
    let cfg = WorkerConfig {
        coordinator: args.coordinator.clone(),
        listen: args.data_listen.clone(),
        advertise: args.advertise.clone(),
        auth: auth_mode(
            args.model.cluster.cluster_key_file.as_deref(),
            args.model.cluster.insecure,
        )?,
        retry: Duration::from_millis(500),
        give_up_after: (args.give_up > 0.0).then(|| Duration::from_secs_f64(args.give_up)),
    };
    run_worker(stage, cfg)
}

/// A tensor-parallel rank.
fn run_rank(args: &WorkerArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.model.cluster.layers.is_none(),
        "--layers and --tensor-parallel cannot be combined"
    );
    let path = args.model.model_path();
    let probe = common::load_model(&args.model, |m| {
        Some(WeightSelection {
            layers: 0..=m.n_layer() - 1,
            embeddings: true,
            head: true,
            experts: false,
        })
    })?;
    let n_ctx = common::context_size(&args.model, &probe);
    drop(probe);
    let c = &args.model.cluster;
    let cfg = TpWorkerConfig {
        coordinator: args.coordinator.clone(),
        data_listen: args.data_listen.clone(),
        advertise: args.advertise.clone(),
        auth: auth_mode(c.cluster_key_file.as_deref(), c.insecure)?,
        rank: args.rank,
        expert_weight: 1.0,
        retry: Duration::from_millis(500),
        give_up_after: (args.give_up > 0.0).then(|| Duration::from_secs_f64(args.give_up)),
        tp_timeout: Duration::from_secs_f64(c.tp_timeout.max(0.1)),
        threads: args.model.threads,
        kv_type: args.model.kv_type,
        n_ctx,
        experts: args
            .model
            .streaming
            .expert_factory(n_ctx, args.model.kv_type),
    };
    run_tp_worker(|| Ok(model::Model::load(&path)?), cfg)
}
