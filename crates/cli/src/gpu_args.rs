//! `--gpu`, `--gpu-mem`: a CUDA GPU computes the matrix products whose weights fit in its
//! memory (the dense weights first, then routed experts layer by layer); the CPU computes the
//! rest, at the same time within a step, except a prompt's experts that serve enough rows
//! (`--gpu-stream-min`), which are copied in and run on the GPU too.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use model::{Compute, Model, WeightSelection};

/// Memory left on the GPU for activations, outputs and the driver when `--gpu-mem` is not given.
const GPU_HEADROOM: u64 = 2 << 30;

#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "GPU")]
pub struct GpuArgs {
    /// Compute on CUDA GPU N (bare `--gpu`: GPU 0): the weights that fit in its memory are
    /// copied there and their matrix products run there. Needs the CUDA driver and NVRTC
    /// (libnvrtc on the library path) at run time.
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "0")]
    pub gpu: Option<usize>,
    /// GPU memory for weights (8GiB, 512MiB). Default: its free memory less 2 GiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_gpu_mem, requires = "gpu")]
    pub gpu_mem: Option<u64>,
    /// Run each matrix product on the GPU on its own (activations to and from the CPU per
    /// product) even where whole layers could run there.
    #[arg(long, requires = "gpu")]
    pub gpu_piecewise: bool,
    /// Routed experts left on the host run on the GPU too when one serves at least this many
    /// rows of a step (a prompt's), their weights copied over the link for it; 0: never.
    #[arg(long, value_name = "TOKENS", default_value_t = DEFAULT_STREAM_MIN, requires = "gpu")]
    pub gpu_stream_min: usize,
    /// GPU memory, taken from --gpu-mem, for the routed experts copied in per prompt; set
    /// aside only when some routed experts stay on the host, so that fewer of them stay on the
    /// GPU. Default: one layer's routed experts, where what the dense weights leave holds them
    /// (a prompt's steps then run whole layers on the GPU, each layer's host experts copied in
    /// as it comes); else 256 MiB (half of what the dense weights leave at most), the experts
    /// copied in batches per matrix product; with --gpu-piecewise, 256 MiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_gpu_mem, requires = "gpu")]
    pub gpu_stream_mem: Option<u64>,
    /// In decode steps that run whole layers on the GPU, the GPU computes up to this many of a
    /// token's routed experts left on the host itself, their weights copied over the link
    /// while the CPU computes the others; 0: the CPU computes them all; auto: as many as
    /// balance the link (timed at load) against the CPU (timed over the first decode steps).
    #[arg(long, value_name = "EXPERTS|auto", default_value_t = gpu::HostRead::Auto, requires = "gpu")]
    pub gpu_host_read: gpu::HostRead,
}

/// The streaming buffer under --gpu-piecewise (whole layers never run, so a layer's worth
/// of buffer would only keep experts off the GPU).
const PIECEWISE_STREAM_MEM: usize = 256 << 20;

/// `--gpu-stream-min`'s default.
const DEFAULT_STREAM_MIN: usize = 16;

fn parse_gpu_mem(s: &str) -> Result<u64, String> {
    match experts::parse_size(s)? {
        experts::CacheSize::Bytes(b) => Ok(b),
        experts::CacheSize::Count(_) | experts::CacheSize::Auto => Err(format!(
            "{s:?}: give a size in bytes with a unit (8GiB, 512MiB)"
        )),
    }
}

/// What `--gpu-mem` allows on the device `info` describes: the size given, if it is free, or
/// the free memory less [`GPU_HEADROOM`].
fn weight_budget(gpu_mem: Option<u64>, info: &gpu::DeviceInfo) -> anyhow::Result<u64> {
    match gpu_mem {
        Some(b) => {
            anyhow::ensure!(
                b <= info.free_bytes,
                "--gpu-mem {:.2} GiB is more than the {:.2} GiB free on {info}",
                b as f64 / (1u64 << 30) as f64,
                info.free_bytes as f64 / (1u64 << 30) as f64
            );
            Ok(b)
        }
        None => Ok(info.free_bytes.saturating_sub(GPU_HEADROOM)),
    }
}

/// A tensor-parallel rank's GPU under these flags (`None` without `--gpu`), made each time the
/// rank joins a group: the routed experts the group gives the rank are copied to it (up to
/// `--gpu-mem`) and run there, everything else runs on the rank's CPU
/// (`cluster::tp::OffloadFactory` says why). Refused with `--ssd-streaming` (a rank's
/// streamed experts are read into its cache, which the GPU does not hold) and with the flags
/// of whole-layer and streamed GPU work, which a rank does not do.
pub fn rank_offload(
    args: &GpuArgs,
    ssd_streaming: bool,
    expert_profile: Option<&Path>,
) -> anyhow::Result<Option<cluster::tp::OffloadFactory>> {
    let Some(ordinal) = args.gpu else {
        return Ok(None);
    };
    anyhow::ensure!(
        !ssd_streaming,
        "--gpu on a tensor-parallel rank needs its experts resident, not --ssd-streaming"
    );
    anyhow::ensure!(
        !args.gpu_piecewise && args.gpu_stream_mem.is_none(),
        "--gpu-piecewise and --gpu-stream-mem do not apply to a tensor-parallel rank: only its \
         routed experts run on its GPU, one matrix product at a time"
    );
    // Opened now, so that a missing or broken GPU stops this process at once rather than
    // every attempt to form a group; the first group uses it, later ones open it again (a
    // device's uploads are for one share).
    let first = std::sync::Mutex::new(Some(
        gpu::open(ordinal).with_context(|| format!("--gpu {ordinal}"))?,
    ));
    let gpu_mem = args.gpu_mem;
    let expert_profile = expert_profile.map(Path::to_path_buf);
    let make = move |model: &Arc<Model>, held: &dyn Fn(usize, usize) -> bool| {
        let profile = expert_profile
            .as_deref()
            .map(|p| crate::streaming_args::routing_profile(p, model))
            .transpose()?;
        let opened = first.lock().ok().and_then(|mut d| d.take());
        let mut device = match opened {
            Some(d) => d,
            None => gpu::open(ordinal).with_context(|| format!("--gpu {ordinal}"))?,
        };
        let info = device.info()?;
        let budget = weight_budget(gpu_mem, &info)?;
        device.stream_experts(None, None);
        let hot = profile
            .as_ref()
            .map(|p| move |l: usize, e: usize| p.count(l, e));
        let hot = hot.as_ref().map(|h| h as gpu::Hotness);
        let report = gpu::upload_held_experts(&mut device, model, budget, held, hot)
            .with_context(|| format!("copying experts to {info}"))?;
        eprintln!(
            "{info}: tensor-parallel rank {}: {report}",
            model.shard().rank
        );
        let device: Arc<dyn kernels::Offload> = Arc::new(device);
        anyhow::Ok(device)
    };
    Ok(Some(Arc::new(
        move |model: &Arc<Model>, held: cluster::tp::HeldFn| {
            // The whole chain of causes, which a boxed anyhow error's Display would drop.
            make(model, &*held).map_err(|e| format!("{e:#}").into())
        },
    )))
}

/// `compute` with the GPU of these flags attached and `sel`'s weights copied to it, or
/// `compute` unchanged without `--gpu`.
pub fn attach(
    args: &GpuArgs,
    expert_profile: Option<&Path>,
    model: &Arc<Model>,
    sel: &WeightSelection,
    compute: Compute,
) -> anyhow::Result<Compute> {
    let Some(ordinal) = args.gpu else {
        return Ok(compute);
    };
    let profile = expert_profile
        .map(|p| crate::streaming_args::routing_profile(p, model))
        .transpose()?;
    let t0 = std::time::Instant::now();
    let mut device = gpu::open(ordinal).with_context(|| format!("--gpu {ordinal}"))?;
    let info = device.info()?;
    let budget = weight_budget(args.gpu_mem, &info)?;
    let stream_from = (args.gpu_stream_min > 0).then_some(args.gpu_stream_min);
    let stream_mem = match args.gpu_stream_mem {
        Some(b) => Some(usize::try_from(b).unwrap_or(usize::MAX)),
        None if args.gpu_piecewise => Some(PIECEWISE_STREAM_MEM),
        None => None,
    };
    device.stream_experts(stream_from, stream_mem);
    device.read_host_experts(args.gpu_host_read);
    let hot = profile
        .as_ref()
        .map(|p| move |l: usize, e: usize| p.count(l, e));
    let hot = hot.as_ref().map(|h| h as gpu::Hotness);
    let report = gpu::upload_model(&mut device, model, sel, budget, hot)
        .with_context(|| format!("copying weights to {info}"))?;
    tracing::info!("{info}: {report} in {:.2?}", t0.elapsed());
    eprintln!("{info}: {report}");
    let device = Arc::new(device);
    let compute = compute.with_offload(device.clone());
    if args.gpu_piecewise {
        eprintln!("{info}: matrix products one at a time (--gpu-piecewise)");
        return Ok(compute);
    }
    match gpu::whole_model(device, model) {
        Ok(whole) => {
            eprintln!("{info}: whole layers run on the GPU (activations stay in its memory)");
            Ok(compute.with_layer_device(whole))
        }
        Err(why) => {
            eprintln!(
                "{info}: matrix products one at a time; whole layers cannot run there: {why}"
            );
            Ok(compute)
        }
    }
}
