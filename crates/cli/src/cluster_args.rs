//! Cluster flags (pipeline and tensor parallel) and the configurations they give: the
//! coordinator's ([`ClusterArgs`]) and the link flags every node shares ([`LinkArgs`]; the
//! worker's own flags are in `worker.rs`). Which topology applies is decided once by
//! `topology::Topology`; the executor is built in `common::build_engine`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use cluster::activation::ActFormat;
use cluster::pipeline::PipelineConfig;
use cluster::wire::{AuthMode, ClusterKey, LinkConfig};

/// How a node's links are protected and watched: the same on the coordinator and every worker.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Cluster")]
pub struct LinkArgs {
    /// File holding the cluster key (or set MOESHARD_CLUSTER_KEY).
    #[arg(long)]
    pub cluster_key_file: Option<PathBuf>,
    /// Allow links without a key (loopback only).
    #[arg(long)]
    pub insecure: bool,
    /// Seconds a peer may stay silent (no frame, not even a heartbeat) before its link counts
    /// as dead; heartbeats go out at a quarter of this.
    #[arg(long, default_value_t = 10.0)]
    pub peer_timeout: f64,
}

impl Default for LinkArgs {
    fn default() -> Self {
        LinkArgs {
            cluster_key_file: None,
            insecure: false,
            peer_timeout: 10.0,
        }
    }
}

/// The coordinator's cluster flags (`run`, `chat`, `serve`, `bench`, ...): which split it
/// drives and how.
#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "Cluster")]
pub struct ClusterArgs {
    /// Run only layers A:B here as the coordinator of a pipeline (A must be 0); workers serve
    /// the rest and register at --listen.
    #[arg(long, value_name = "A:B|A:output")]
    pub layers: Option<engine::RangeSpec>,
    /// Where pipeline workers register (host:port).
    #[arg(long)]
    pub listen: Option<String>,
    /// Seconds to wait for a complete route (at start and after a failure).
    #[arg(long, default_value_t = 60.0)]
    pub route_wait: f64,
    /// Prompt tokens per pipelined prefill chunk.
    #[arg(long, default_value_t = 256)]
    pub dist_prefill_chunk: usize,
    /// Prefill chunks in flight at once (1 disables overlap).
    #[arg(long, default_value_t = 4)]
    pub dist_prefill_window: usize,
    /// Bits per activation on the wire: 32 (exact), 16 (bf16) or 8 (e4m3 + row scale).
    #[arg(long, default_value_t = 32)]
    pub dist_activation_bits: u32,
    /// Replay every prefill and require bit-identical logits.
    #[arg(long)]
    pub dist_replay_check: bool,
    #[command(flatten)]
    pub link: LinkArgs,
    /// Print per-hop timing of every chunk and token (pipeline) or step (tensor parallel).
    #[arg(long)]
    pub debug: bool,
    /// Run as a tensor-parallel group (this process is rank 0; workers join at --listen).
    #[arg(long)]
    pub tensor_parallel: bool,
    /// Ranks in the tensor-parallel group, this one included.
    #[arg(long, default_value_t = 2)]
    pub tp_size: usize,
    /// Relative expert shares per rank, e.g. `2,1` (default: equal).
    #[arg(long, value_delimiter = ',')]
    pub expert_weights: Vec<f32>,
    /// Deal each step's routed experts out evenly over the ranks (weighted by
    /// --expert-weights) instead of giving every rank a fixed set: balanced work per token, but
    /// every rank touches every expert, so each needs memory for the whole model. Resident
    /// experts only (not with --ssd-streaming).
    #[arg(long)]
    pub tp_balance_experts: bool,
    /// Which ranks hold each routed expert of each layer, as `moeshard plan` wrote it from a
    /// routing profile: work per rank balanced by measured routing, the hottest experts
    /// replicated within a budget (each step, a replicated expert is computed by its less
    /// loaded holder). Replaces --expert-weights (the file has the ranks' weights).
    #[arg(long, value_name = "FILE")]
    pub expert_placement: Option<std::path::PathBuf>,
    /// Seconds a rank may take to send a partial sum before the step fails.
    #[arg(long, default_value_t = 30.0)]
    pub tp_timeout: f64,
}

impl LinkArgs {
    /// How this process's links are protected and how long a peer may stay silent.
    pub fn config(&self) -> anyhow::Result<LinkConfig> {
        let key = ClusterKey::from_flag_or_env(self.cluster_key_file.as_deref())?;
        let auth = AuthMode::from_flags(key, self.insecure)?;
        if !(self.peer_timeout > 0.0 && self.peer_timeout.is_finite()) {
            bail!(
                "--peer-timeout {}: must be a positive number of seconds",
                self.peer_timeout
            );
        }
        Ok(LinkConfig::new(auth).with_peer_timeout(Duration::from_secs_f64(self.peer_timeout)))
    }
}

impl ClusterArgs {
    pub fn tp_config(&self) -> anyhow::Result<cluster::tp::TpConfig> {
        let Some(listen) = self.listen.clone() else {
            bail!("--tensor-parallel needs --listen HOST:PORT for the ranks")
        };
        let host = listen
            .rsplit_once(':')
            .map(|(h, _)| h.to_string())
            .unwrap_or_else(|| "127.0.0.1".into());
        Ok(cluster::tp::TpConfig {
            listen,
            data_listen: format!("{host}:0"),
            link: self.link.config()?,
            n_ranks: self.tp_size.max(1),
            expert_weights: self.expert_weights.clone(),
            route_wait: Duration::from_secs_f64(self.route_wait.max(0.0)),
            tp_timeout: Duration::from_secs_f64(self.tp_timeout.max(0.1)),
            chunk: self.dist_prefill_chunk.max(1),
            debug: self.debug,
            experts: None,
            offload: None,
            balance_experts: self.tp_balance_experts,
            placement: self
                .expert_placement
                .as_deref()
                .map(cluster::tp::ExpertPlacement::load)
                .transpose()
                .map_err(|e| anyhow::anyhow!("--expert-placement: {e}"))?,
        })
    }

    pub fn pipeline_config(&self) -> anyhow::Result<PipelineConfig> {
        let Some(listen) = self.listen.clone() else {
            bail!("--layers needs --listen HOST:PORT for the workers")
        };
        let act = ActFormat::from_bits(self.dist_activation_bits).with_context(|| {
            format!(
                "--dist-activation-bits {}: use 32, 16 or 8",
                self.dist_activation_bits
            )
        })?;
        if self.dist_prefill_chunk == 0 || self.dist_prefill_window == 0 {
            bail!("--dist-prefill-chunk and --dist-prefill-window must be at least 1");
        }
        Ok(PipelineConfig {
            listen,
            link: self.link.config()?,
            route_wait: Duration::from_secs_f64(self.route_wait.max(0.0)),
            chunk: self.dist_prefill_chunk,
            window: self.dist_prefill_window,
            act,
            replay_check: self.dist_replay_check,
            debug: self.debug,
        })
    }
}
