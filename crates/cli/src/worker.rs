//! `moeshard worker`: serve a layer range of a pipeline for a coordinator.

use std::time::Duration;

use cluster::pipeline::{WorkerConfig, run_worker};
use cluster::stage::{StageRuntime, parse_range};
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
}

pub fn run(args: &WorkerArgs) -> anyhow::Result<()> {
    let Some(range) = args.model.cluster.layers.clone() else {
        anyhow::bail!("a worker needs --layers A:B or A:output");
    };
    let model = common::load_model(&args.model, |m| {
        let (layers, head) = parse_range(&range, m.n_layer()).ok()?;
        Some(WeightSelection { layers, embeddings: false, head, experts: true })
    })?;
    let (layers, head) = parse_range(&range, model.n_layer()).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(*layers.start() > 0, "--layers {range}: layer 0 belongs to the coordinator");
    let n_ctx = common::context_size(&args.model, &model);
    let stage = StageRuntime::new(model, Compute::new(args.model.threads), layers, head, args.model.kv_type, n_ctx);
    let cfg = WorkerConfig {
        coordinator: args.coordinator.clone(),
        listen: args.data_listen.clone(),
        advertise: args.advertise.clone(),
        auth: auth_mode(args.model.cluster.cluster_key_file.as_deref(), args.model.cluster.insecure)?,
        retry: Duration::from_millis(500),
        give_up_after: (args.give_up > 0.0).then(|| Duration::from_secs_f64(args.give_up)),
    };
    run_worker(stage, cfg)
}
