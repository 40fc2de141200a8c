//! `moeshard shard`: writes the part of a model one machine of a cluster runs, so no machine
//! needs the whole file — a pipeline stage's layers (the embeddings with the first, the output
//! norm and head with the last), or a tensor-parallel rank's dense and attention weights with
//! only its routed experts, in the placement the group will use. `--all` writes every file of
//! a layout; `--plan` prints what each machine would store and writes nothing (the sizes are
//! those of the files written, computed by the same writer).
//!
//! Each file records its slice and the parent's fingerprint (`model::file_slice`), and uses
//! 4 KiB alignment, so every tensor — every expert stack, and each expert in it when its size
//! is a multiple of 4 KiB — starts where a direct read can.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use cluster::tp::placement::{Share, needed_experts, placement};
use engine::{LayerRange, RangeSpec};
use gguf::{
    GgufModel, GgufWriter, Metadata, SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY,
};
use model::{FileSlice, Model, RankPlacement};

/// Direct I/O's alignment (O_DIRECT needs the device's logical block size; 4 KiB covers
/// every common one).
const SHARD_ALIGNMENT: u32 = 4096;

#[derive(clap::Args)]
pub struct ShardArgs {
    /// The full model (any file of a split set).
    pub model: PathBuf,
    /// Pipeline stages to write: one layer range per file (`0:9`, `10:19`, `20:output`).
    #[arg(long, value_delimiter = ',')]
    pub layers: Vec<RangeSpec>,
    /// Write tensor-parallel rank files instead of stages.
    #[arg(long)]
    pub tensor_parallel: bool,
    /// Ranks in the group the files are for.
    #[arg(long, default_value_t = 2)]
    pub tp_size: usize,
    /// The rank to write (without --all).
    #[arg(long)]
    pub rank: Option<usize>,
    /// Relative expert shares per rank, as the group will be started with (default: equal).
    #[arg(long, value_delimiter = ',')]
    pub expert_weights: Vec<f32>,
    /// Write every file of the layout: every rank, or every stage of --layers (which must then
    /// cover the model); -o is then the prefix of the file names.
    #[arg(long)]
    pub all: bool,
    /// Print the bytes each machine stores for this layout; write nothing.
    #[arg(long)]
    pub plan: bool,
    /// The file to write (with --all: the prefix, `PREFIX.layers-0-9.gguf`,
    /// `PREFIX.rank-1-of-3.gguf`).
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
}

/// One file of a layout: the machine it is for, where it goes, what it holds.
struct Part {
    machine: String,
    path: PathBuf,
    slice: FileSlice,
}

pub fn run(args: &ShardArgs) -> anyhow::Result<()> {
    let files = Arc::new(
        GgufModel::open(&args.model)
            .with_context(|| format!("opening {}", args.model.display()))?,
    );
    ensure!(
        !files.is_shard(),
        "{} is already a shard file: make shards from the full model",
        args.model.display()
    );
    let model = Model::from_gguf(Arc::clone(&files))
        .with_context(|| format!("loading {}", args.model.display()))?;
    let parts = layout(args, &model)?;
    let writers = parts
        .iter()
        .map(|p| part_writer(&files, &p.slice))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if args.plan {
        print_plan(&files, &parts, &writers);
        return Ok(());
    }
    for (part, w) in parts.iter().zip(&writers) {
        let written = w
            .write_to_path(&part.path)
            .with_context(|| format!("writing {}", part.path.display()))?;
        println!("{}\t{}\t{written}", part.machine, part.path.display());
    }
    Ok(())
}

/// The files the flags ask for.
fn layout(args: &ShardArgs, model: &Model) -> anyhow::Result<Vec<Part>> {
    let n_layer = model.n_layer();
    let n_expert = model.hp.moe.as_ref().map_or(0, |m| m.n_expert);
    let base = FileSlice {
        parent: model.files().fingerprint(),
        layers: 0..=n_layer.saturating_sub(1),
        embeddings: true,
        head: true,
        experts: 0..n_expert,
        n_vocab: model.hp.n_vocab,
        attn_output_type: model.attn_output_type(),
        placement: None,
    };
    let output = |suffix: &str| -> anyhow::Result<PathBuf> {
        match (&args.output, args.all) {
            (Some(o), false) => Ok(o.clone()),
            (Some(prefix), true) => {
                let mut name = prefix.as_os_str().to_owned();
                name.push(format!(".{suffix}.gguf"));
                Ok(PathBuf::from(name))
            }
            (None, _) if args.plan => Ok(PathBuf::from(format!("{suffix}.gguf"))),
            (None, _) => bail!("-o OUT.gguf (with --all: -o PREFIX) is needed"),
        }
    };
    if args.tensor_parallel {
        ensure!(
            args.layers.is_empty(),
            "--layers and --tensor-parallel cannot be combined: every rank holds every layer"
        );
        ensure!(
            n_expert > 0,
            "the model has no routed experts: every rank holds all of it, copy the file instead"
        );
        ensure!(args.tp_size >= 2, "--tp-size must be at least 2");
        let ranks: Vec<usize> = match (args.all, args.rank) {
            (true, None) => (0..args.tp_size).collect(),
            (false, Some(r)) if r < args.tp_size => vec![r],
            (false, Some(r)) => bail!("--rank {r} is outside 0..{} (--tp-size)", args.tp_size),
            (true, Some(_)) => bail!("--rank and --all cannot be combined"),
            (false, None) => bail!("--tensor-parallel needs --rank R or --all"),
        };
        let owned = placement(n_expert, args.tp_size, &args.expert_weights);
        return ranks
            .into_iter()
            .map(|rank| {
                let experts = needed_experts(&Share::Owned(owned[rank].clone()), rank, n_expert);
                Ok(Part {
                    machine: format!("rank {rank} of {}", args.tp_size),
                    path: output(&format!("rank-{rank}-of-{}", args.tp_size))?,
                    slice: FileSlice {
                        experts,
                        placement: Some(RankPlacement {
                            rank,
                            n_ranks: args.tp_size,
                            expert_weights: args.expert_weights.clone(),
                        }),
                        ..base.clone()
                    },
                })
            })
            .collect();
    }
    ensure!(
        args.rank.is_none() && args.expert_weights.is_empty(),
        "--rank and --expert-weights are for --tensor-parallel rank files"
    );
    ensure!(
        !args.layers.is_empty(),
        "say what to write: --layers A:B[,C:D…] (pipeline stages) or --tensor-parallel"
    );
    ensure!(
        args.all || args.layers.len() == 1,
        "{} layer ranges are {} files: add --all (and -o PREFIX)",
        args.layers.len(),
        args.layers.len()
    );
    let ranges = args
        .layers
        .iter()
        .map(|r| r.resolve(n_layer).map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<Vec<LayerRange>>>()?;
    if args.all {
        check_covers(&ranges, n_layer)?;
    }
    ranges
        .iter()
        .map(|r| {
            let suffix = match r.head {
                true => format!("layers-{}-output", r.first),
                false => format!("layers-{}-{}", r.first, r.last),
            };
            Ok(Part {
                machine: format!("stage {r}"),
                path: output(&suffix)?,
                slice: FileSlice {
                    layers: r.layers(),
                    embeddings: r.first == 0,
                    head: r.head,
                    ..base.clone()
                },
            })
        })
        .collect()
}

/// Whether `ranges` are the stages of a whole pipeline: from layer 0 to the head, in order,
/// without gaps or overlaps.
fn check_covers(ranges: &[LayerRange], n_layer: usize) -> anyhow::Result<()> {
    let mut next = 0;
    for r in ranges {
        ensure!(
            r.first == next,
            "--all: stage {r} should start at layer {next} (the stages must cover 0:output in order)"
        );
        next = r.last + 1;
    }
    ensure!(
        next == n_layer && ranges.last().is_some_and(|r| r.head),
        "--all: the last stage must end with `output` (the model has {n_layer} layers)"
    );
    Ok(())
}

/// Which layer a tensor belongs to (`blk.N.…`), `None` for the model-wide ones.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The writer of one part: the parent's metadata (less its split keys) plus the slice, and the
/// tensors the slice holds, borrowed from the parent's map (routed expert stacks cut to the
/// slice's experts).
fn part_writer<'a>(files: &'a GgufModel, slice: &FileSlice) -> anyhow::Result<GgufWriter<'a>> {
    let mut meta = Metadata::new();
    for (key, value) in files.metadata().iter() {
        if ![SPLIT_NO_KEY, SPLIT_COUNT_KEY, SPLIT_TENSORS_COUNT_KEY].contains(&key) {
            meta.push(key, value.clone())?;
        }
    }
    let mut w = GgufWriter::with_metadata(meta)?;
    w.set_alignment(SHARD_ALIGNMENT)?;
    slice.write_metadata(&mut w)?;
    // A tied head computes with the token embeddings.
    let tied = files.tensor("output.weight").is_none();
    for t in files.tensors() {
        let name = t.info.name.as_str();
        let dims = t.info.shape.dims();
        let keep = match layer_of(name) {
            Some(il) => slice.layers.contains(&il),
            None if name.starts_with("token_embd") => slice.embeddings || (slice.head && tied),
            None if name.starts_with("output") => slice.head,
            None => true,
        };
        if !keep {
            continue;
        }
        let routed = name.ends_with("_exps.weight") && dims.len() == 3;
        let n_expert = dims.last().copied().unwrap_or(1) as usize;
        if routed && slice.experts != (0..n_expert) {
            let per = t.info.n_bytes / n_expert as u64;
            let (a, b) = (
                slice.experts.start as u64 * per,
                slice.experts.end as u64 * per,
            );
            let data = t.data().get(a as usize..b as usize).with_context(|| {
                format!("{name}: experts {:?} outside its {n_expert}", slice.experts)
            })?;
            let shape = [dims[0], dims[1], slice.experts.len() as u64];
            w.add_tensor(name, t.info.dtype, &shape, data)?;
        } else {
            w.add_tensor(name, t.info.dtype, dims, t.data())?;
        }
    }
    Ok(w)
}

/// One line per machine: what it runs, the file, its bytes (tab-separated, so scripts and
/// tests can read the numbers), then the totals against the full model's size.
fn print_plan(files: &GgufModel, parts: &[Part], writers: &[GgufWriter]) {
    let full: u64 = files.splits().iter().map(|f| f.file_len()).sum();
    println!("machine\tfile\tbytes\tsize");
    let mut total = 0;
    for (part, w) in parts.iter().zip(writers) {
        let bytes = w.file_len();
        total += bytes;
        println!(
            "{}\t{}\t{bytes}\t{}",
            part.machine,
            part.path.display(),
            human(bytes)
        );
    }
    println!(
        "all machines\t\t{total}\t{} (the full model: {full} bytes, {})",
        human(total),
        human(full)
    );
}

/// `1.23 GiB`, `45.67 MiB`.
pub(crate) fn human(bytes: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes as f64 >= GIB {
        format!("{:.2} GiB", bytes as f64 / GIB)
    } else {
        format!("{:.2} MiB", bytes as f64 / MIB)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_layouts_must_cover_the_model_in_order() {
        let r = |s: &str| LayerRange::parse(s, 8).unwrap();
        assert!(check_covers(&[r("0:3"), r("4:output")], 8).is_ok());
        assert!(check_covers(&[r("0:3"), r("5:output")], 8).is_err());
        assert!(check_covers(&[r("0:3"), r("4:7")], 8).is_err());
        assert!(check_covers(&[r("1:output")], 8).is_err());
        assert_eq!(layer_of("blk.12.ffn_up_exps.weight"), Some(12));
        assert_eq!(layer_of("token_embd.weight"), None);
    }
}
