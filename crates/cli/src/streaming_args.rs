//! SSD expert streaming flags (`--ssd-streaming`, cache size, preload, profiles), the
//! streamed expert source they build, and the routing profiles `--gpu` and `plan` place by.

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use experts::{CacheSize, StreamedExperts, StreamingOptions};
use model::experts::ExpertSink;
use model::{ExpertSource, KvType, Model};

#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "Streaming")]
pub struct StreamingArgs {
    /// Keep routed experts on disk and stream them into a bounded cache.
    #[arg(long)]
    pub ssd_streaming: bool,
    /// Expert cache size: bytes (6GiB, 512MiB, 1.5GB) or a number of experts (300). Default:
    /// what fits in available memory (cgroup-aware) after the resident weights and KV cache.
    #[arg(long, value_name = "SIZE|COUNT", value_parser = experts::parse_size, requires = "ssd_streaming")]
    pub expert_cache: Option<CacheSize>,
    /// Start with an empty expert cache (default: fill it at start).
    #[arg(long, requires = "ssd_streaming")]
    pub expert_cache_cold: bool,
    /// Experts to read at start: the hottest of --expert-profile, else spread evenly over the
    /// layers (default: as many as the cache holds).
    #[arg(
        long,
        value_name = "N",
        requires = "ssd_streaming",
        conflicts_with = "expert_cache_cold"
    )]
    pub preload_experts: Option<usize>,
    /// Keep the first N MoE layers fully resident (outside the cache).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        requires = "ssd_streaming"
    )]
    pub resident_layers: usize,
    /// A routing profile saved by --save-expert-profile: with --ssd-streaming, preload order
    /// and initial hotness; with --gpu, which routed experts the GPU holds (the hottest first,
    /// instead of layer by layer).
    #[arg(long, value_name = "FILE")]
    pub expert_profile: Option<PathBuf>,
    /// Save the routing counts of this run (added to --expert-profile's) at exit.
    #[arg(long, value_name = "FILE", requires = "ssd_streaming")]
    pub save_expert_profile: Option<PathBuf>,
    /// Reader threads (expert reads in flight).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4,
        requires = "ssd_streaming"
    )]
    pub expert_readers: usize,
    /// Read experts through the page cache instead of past it (O_DIRECT, F_NOCACHE on macOS).
    #[arg(long, requires = "ssd_streaming")]
    pub no_direct_io: bool,
    /// Do not ask the forward path for router look-ahead prefetches.
    #[arg(long, requires = "ssd_streaming")]
    pub no_expert_lookahead: bool,
    /// Print the expert cache statistics to stderr at exit.
    #[arg(long, requires = "ssd_streaming")]
    pub expert_stats: bool,
}

/// What the caller knows about the process the source serves.
pub struct StreamingContext {
    /// The layers this process runs (`None`: all).
    pub layers: Option<RangeInclusive<usize>>,
    pub n_ctx: usize,
    pub kv_type: KvType,
    /// The experts this process computes (`None`: all), for a node of an expert-parallel group.
    pub owned: Option<experts::OwnedFn>,
}

impl StreamingArgs {
    /// The expert source for a process that runs `cx.layers` with `cx.n_ctx` positions of KV.
    pub fn expert_source_for(
        &self,
        model: &Arc<Model>,
        cx: StreamingContext,
    ) -> anyhow::Result<Option<engine::SharedExperts>> {
        if !self.ssd_streaming {
            return Ok(None);
        }
        let opts = self.options(model, cx);
        let source = StreamedExperts::new(Arc::clone(model), opts)?;
        if self.expert_stats {
            return Ok(Some(Arc::new(ReportAtExit(source))));
        }
        Ok(Some(Arc::new(source)))
    }

    /// For a tensor-parallel rank (`TpConfig::experts`): builds the streamed source of the
    /// experts the rank holds (`owned(layer, expert)`), or `None` when streaming is off.
    pub fn expert_factory(
        &self,
        n_ctx: usize,
        kv_type: KvType,
    ) -> Option<cluster::tp::ExpertFactory> {
        if !self.ssd_streaming {
            return None;
        }
        let args = self.clone();
        Some(Arc::new(
            move |model: &Arc<Model>, owned: cluster::tp::HeldFn| {
                let cx = StreamingContext {
                    layers: None,
                    n_ctx,
                    kv_type,
                    owned: Some(owned),
                };
                match args.expert_source_for(model, cx) {
                    Ok(Some(source)) => Ok(source),
                    Ok(None) => Err("streaming is off".into()),
                    Err(e) => Err(format!("{e:#}").into()),
                }
            },
        ))
    }

    pub fn options(&self, model: &Model, cx: StreamingContext) -> StreamingOptions {
        let last = model.n_layer() - 1;
        let kv = model.kv_layout(cx.kv_type, cx.layers.clone().unwrap_or(0..=last), cx.n_ctx);
        // A session at full context, its sliding-window layers holding at most their bound
        // for prompt chunks of the engine's size (pipeline and server chunks are smaller).
        let kv_bytes = kv.bytes_at_most(cx.n_ctx, engine::DEFAULT_PREFILL_CHUNK);
        StreamingOptions {
            cache: self.expert_cache.unwrap_or_default(),
            cold: self.expert_cache_cold,
            preload: self.preload_experts,
            resident_layers: self.resident_layers,
            profile: self.expert_profile.clone(),
            save_profile: self.save_expert_profile.clone(),
            readers: self.expert_readers.max(1),
            direct_io: !self.no_direct_io,
            lookahead: !self.no_expert_lookahead,
            layers: cx.layers,
            owned: cx.owned,
            reserve_bytes: kv_bytes as u64,
            ..StreamingOptions::default()
        }
    }
}

/// A streamed source that prints its statistics when the engine lets go of it.
struct ReportAtExit(StreamedExperts);

impl ExpertSource for ReportAtExit {
    fn owns(&self, layer: usize, expert: usize) -> bool {
        self.0.owns(layer, expert)
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> model::Result<()> {
        self.0.with_experts(layer, experts, sink)
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.0.prefetch(layer, experts)
    }

    fn lookahead(&self) -> bool {
        self.0.lookahead()
    }

    fn stats(&self) -> Vec<(String, f64)> {
        self.0.stats()
    }
}

impl Drop for ReportAtExit {
    fn drop(&mut self) {
        eprintln!("expert streaming statistics:");
        for (k, v) in self.0.stats() {
            eprintln!("  {k}: {v:.4}");
        }
    }
}

/// The routing profile at `path` (`--expert-profile`), checked to be of `model`'s file and
/// shape, so that its counts name this model's (layer, expert) pairs.
pub fn routing_profile(path: &std::path::Path, model: &Model) -> anyhow::Result<experts::Profile> {
    let fingerprint = model.files().fingerprint().to_string();
    let profile = experts::Profile::load(path, &fingerprint)
        .with_context(|| format!("--expert-profile {}", path.display()))?;
    let n_expert = model.hp.moe.as_ref().map_or(0, |m| m.n_expert);
    anyhow::ensure!(
        profile.n_layer == model.n_layer() && profile.n_expert == n_expert,
        "--expert-profile {}: shape {} × {}, the model has {} layers × {n_expert} routed experts",
        path.display(),
        profile.n_layer,
        profile.n_expert,
        model.n_layer()
    );
    Ok(profile)
}
