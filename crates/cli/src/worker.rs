//! `moeshard worker`: serve a layer range of a pipeline, or a rank of a tensor-parallel group,
//! for a coordinator.

use std::time::Duration;

use cluster::membership::Membership;
use cluster::pipeline::{WorkerConfig, run_worker};
use cluster::tp::{TpWorkerConfig, run_tp_worker};

use crate::cluster_args::auth_mode;
use crate::common::{self, ModelArgs};
use crate::topology::{Side, Topology};

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
    let topology = Topology::from_flags(&args.model.cluster, Side::Worker)?;
    let model = common::load_model(&args.model, &topology)?;
    let n_ctx = common::context_size(&args.model, &model);
    let c = &args.model.cluster;
    let membership = Membership {
        coordinator: args.coordinator.clone(),
        advertise: args.advertise.clone(),
        auth: auth_mode(c.cluster_key_file.as_deref(), c.insecure)?,
        retry: Duration::from_millis(500),
        give_up_after: (args.give_up > 0.0).then(|| Duration::from_secs_f64(args.give_up)),
    };
    let served = match topology {
        Topology::TensorParallel { .. } => {
            let cfg = TpWorkerConfig {
                membership,
                data_listen: args.data_listen.clone(),
                rank: args.rank,
                expert_weight: 1.0,
                tp_timeout: Duration::from_secs_f64(c.tp_timeout.max(0.1)),
                threads: args.model.threads,
                kv_type: args.model.kv_type,
                n_ctx,
                experts: args
                    .model
                    .streaming
                    .expert_factory(n_ctx, args.model.kv_type),
            };
            run_tp_worker(model.shared_files(), cfg)
        }
        _ => {
            let runner = common::runner(&args.model, &topology, model, n_ctx)?;
            let cfg = WorkerConfig {
                listen: args.data_listen.clone(),
                membership,
            };
            run_worker(runner, cfg)
        }
    };
    Ok(served?)
}
