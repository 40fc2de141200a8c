//! `moeshard worker`: serve a layer range of a pipeline, or a rank of a tensor-parallel group,
//! for a coordinator.

use std::time::Duration;

use cluster::membership::Membership;
use cluster::pipeline::{WorkerConfig, run_worker};
use cluster::tp::{TpWorkerConfig, run_tp_worker};
use cluster::wire::HeldExperts;

use crate::cluster_args::{ClusterArgs, LinkArgs};
use crate::common::{self, ModelArgs};
use crate::topology::{Side, Topology};

/// `moeshard worker --help`: the flags a worker takes, and only those (sampling, sessions and
/// the split itself belong to the coordinator).
pub const ABOUT: &str = "\
Serve a layer range of a pipeline, or a rank of a tensor-parallel group, for a coordinator.

Pipeline: the coordinator runs layers 0:K (`--layers 0:K --listen HOST:PORT`); each worker
serves the next range and registers at the coordinator's --listen address:
  moeshard worker -m model.gguf --layers 20:output --coordinator 10.0.0.1:7000 --cluster-key-file cluster.key

Tensor/expert parallel: the coordinator is rank 0 (`--tensor-parallel --tp-size N --listen
HOST:PORT`); each worker is one more rank, running every layer with its share of the experts
and attention heads (given by the coordinator when it joins):
  moeshard worker -m model.gguf --tensor-parallel --coordinator 10.0.0.1:7000 --cluster-key-file cluster.key

Workers start in any order and retry until the coordinator is up.";

#[derive(clap::Args)]
#[command(mut_arg("swa_full", |a| a.hide(true)))]
pub struct WorkerArgs {
    /// Pipeline: serve layers A:B (A > 0; `A:output` includes the last layer and the head).
    #[arg(long, value_name = "A:B|A:output", help_heading = "Cluster")]
    pub layers: Option<engine::RangeSpec>,
    /// Tensor parallel: serve one rank of the coordinator's group.
    #[arg(long, conflicts_with = "layers", help_heading = "Cluster")]
    pub tensor_parallel: bool,
    /// The coordinator to register with (host:port).
    #[arg(long, help_heading = "Cluster")]
    pub coordinator: String,
    /// Where to accept data links: the previous stage's, or the other ranks' (host:port; port 0
    /// picks one). Default: every interface of the coordinator's address family (loopback
    /// with --insecure).
    #[arg(long = "data-listen", help_heading = "Cluster")]
    pub data_listen: Option<String>,
    /// Address to announce for data links (default: this host's address on its link to the
    /// coordinator, with the bound port).
    #[arg(long, help_heading = "Cluster")]
    pub advertise: Option<String>,
    /// Stop trying to reach the coordinator after this many seconds (0: retry forever).
    #[arg(long, default_value_t = 0.0, help_heading = "Cluster")]
    pub give_up: f64,
    /// Tensor parallel: ask for this rank (default: the lowest free one).
    #[arg(long, requires = "tensor_parallel", help_heading = "Cluster")]
    pub rank: Option<u32>,
    /// Tensor parallel: seconds a peer rank may take to send a partial sum before the step
    /// fails.
    #[arg(long, default_value_t = 30.0, help_heading = "Cluster")]
    pub tp_timeout: f64,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub link: LinkArgs,
}

impl WorkerArgs {
    fn topology(&self) -> anyhow::Result<Topology> {
        let flags = ClusterArgs {
            layers: self.layers,
            tensor_parallel: self.tensor_parallel,
            ..ClusterArgs::default()
        };
        Topology::from_flags(&flags, Side::Worker)
    }
}

pub fn run(args: &WorkerArgs) -> anyhow::Result<()> {
    let topology = args.topology()?;
    let model = common::load_model(&args.model, &topology)?;
    let n_ctx = common::context_size(&args.model, &model);
    let membership = Membership {
        coordinator: args.coordinator.clone(),
        advertise: args.advertise.clone(),
        link: args.link.config()?,
        retry: Duration::from_millis(500),
        give_up_after: (args.give_up > 0.0).then(|| Duration::from_secs_f64(args.give_up)),
    };
    let data_listen = match &args.data_listen {
        Some(a) => a.clone(),
        None => default_data_listen(&args.coordinator, args.link.insecure),
    };
    let served = match topology {
        Topology::TensorParallel { .. } => {
            let slice = model.slice();
            let held = slice.map(|s| HeldExperts {
                first: s.experts.start as u32,
                end: s.experts.end as u32,
                file: format!("{} ({})", args.model.source(), s.describe()),
            });
            // A rank's file was written for one rank: ask for that one unless told otherwise.
            let file_rank = slice
                .and_then(|s| s.placement.as_ref())
                .map(|p| p.rank as u32);
            let cfg = TpWorkerConfig {
                membership,
                data_listen: data_listen.clone(),
                rank: args.rank.or(file_rank),
                expert_weight: 1.0,
                held,
                tp_timeout: Duration::from_secs_f64(args.tp_timeout.max(0.1)),
                threads: args.model.threads,
                kv_type: args.model.kv_type,
                n_ctx,
                experts: args
                    .model
                    .streaming
                    .expert_factory(n_ctx, args.model.kv_type),
                offload: crate::gpu_args::rank_offload(
                    &args.model.gpu,
                    args.model.streaming.ssd_streaming,
                    args.model.streaming.expert_profile.as_deref(),
                )?,
            };
            run_tp_worker(model.shared_files(), cfg)
        }
        _ => {
            let runner = common::runner(&args.model, &topology, model, n_ctx)?;
            let cfg = WorkerConfig {
                listen: data_listen.clone(),
                membership,
            };
            run_worker(runner, cfg)
        }
    };
    Ok(served?)
}

/// Where a worker takes data links by default: every interface of the family the coordinator
/// is reached by (so peers on other machines can connect), or loopback when keyless.
fn default_data_listen(coordinator: &str, insecure: bool) -> String {
    let v6 = std::net::ToSocketAddrs::to_socket_addrs(coordinator)
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| a.is_ipv6());
    match (insecure, v6) {
        (true, false) => "127.0.0.1:0",
        (true, true) => "[::1]:0",
        (false, false) => "0.0.0.0:0",
        (false, true) => "[::]:0",
    }
    .to_string()
}
