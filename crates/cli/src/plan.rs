//! `moeshard plan`: an expert placement for a tensor-parallel group from a routing profile
//! (`--save-expert-profile`), with replicas of the hottest experts within a memory budget per
//! rank; prints what each rank holds and the balance a simulation of decode steps predicts for
//! it, next to contiguous shares and to every rank holding every expert, and writes the file
//! `--expert-placement` reads.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use cluster::tp::ExpertPlacement;
use cluster::tp::expert_plan::{PlanInput, share_counts, simulate};
use cluster::tp::placement::{placement, rank_weights};
use gguf::GgufModel;
use model::Model;
use model::weights::Ffn;

use crate::shard::human;

/// Simulated decode steps per layer for the forecast.
const FORECAST_STEPS: usize = 2000;

#[derive(clap::Args)]
pub struct PlanArgs {
    /// The model (any file of a split set).
    #[arg(short = 'm', long)]
    pub model: PathBuf,
    /// The routing profile to plan from (`--ssd-streaming --save-expert-profile FILE` on a run
    /// of representative prompts).
    #[arg(long, value_name = "FILE")]
    pub expert_profile: PathBuf,
    /// Ranks in the group.
    #[arg(long, default_value_t = 2)]
    pub tp_size: usize,
    /// Relative speed of each rank, e.g. `2,1` (default: equal): its share of experts and of
    /// the routed work.
    #[arg(long, value_delimiter = ',')]
    pub expert_weights: Vec<f32>,
    /// Extra expert memory per rank for replicas of the hottest experts: bytes (`2GiB`,
    /// `512MiB`) or a share of the rank's own experts (`25%`). Default: none.
    #[arg(long, value_name = "SIZE")]
    pub expert_replicas: Option<String>,
    /// Where to write the placement (for `--expert-placement`); without it, only the report.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
}

/// A replica budget: bytes per rank, or a fraction of the rank's own expert bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ReplicaBudget {
    Bytes(u64),
    Fraction(f64),
}

fn parse_budget(s: &str) -> anyhow::Result<ReplicaBudget> {
    let bad = || format!("--expert-replicas {s:?}: use bytes (2GiB, 512MiB) or a percentage (25%)");
    if let Some(p) = s.trim().strip_suffix('%') {
        let v: f64 = p.trim().parse().with_context(bad)?;
        ensure!(v.is_finite() && v >= 0.0, bad());
        return Ok(ReplicaBudget::Fraction(v / 100.0));
    }
    match experts::parse_size(s) {
        Ok(experts::CacheSize::Bytes(b)) => Ok(ReplicaBudget::Bytes(b)),
        _ => bail!(bad()),
    }
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let files = Arc::new(
        GgufModel::open(&args.model)
            .with_context(|| format!("opening {}", args.model.display()))?,
    );
    let model = Model::from_gguf(Arc::clone(&files))
        .with_context(|| format!("loading {}", args.model.display()))?;
    let Some(moe) = model.hp.moe.as_ref() else {
        bail!("the model has no routed experts: there is nothing to place")
    };
    let (n_expert, top_k) = (moe.n_expert, moe.n_expert_used);
    ensure!(
        (2..=cluster::tp::expert_plan::MAX_PLACED_RANKS).contains(&args.tp_size),
        "--tp-size {}: a placement is for 2 to {} ranks",
        args.tp_size,
        cluster::tp::expert_plan::MAX_PLACED_RANKS
    );
    let fingerprint = files.fingerprint().to_string();
    let profile = crate::streaming_args::routing_profile(&args.expert_profile, &model)?;
    // Bytes of one expert per routed layer (0 for dense layers).
    let expert_bytes: Vec<u64> = (0..model.n_layer())
        .map(|l| match model.layer(l).map(|l| &l.ffn) {
            Some(Ffn::Moe { experts, .. }) => experts.bytes_per_expert(),
            _ => 0,
        })
        .collect();
    let routed: Vec<usize> = (0..model.n_layer())
        .filter(|&l| expert_bytes[l] > 0)
        .collect();
    let counts: Vec<Vec<u64>> = (0..model.n_layer())
        .map(|l| {
            if expert_bytes[l] == 0 {
                Vec::new()
            } else {
                (0..n_expert).map(|e| profile.count(l, e)).collect()
            }
        })
        .collect();
    let weights = rank_weights(args.tp_size, &args.expert_weights);
    ensure!(
        weights.iter().any(|&w| w > 0.0),
        "--expert-weights: every rank has weight 0"
    );
    let own = placement(n_expert, args.tp_size, &args.expert_weights);
    let own_counts = share_counts(n_expert, args.tp_size, &args.expert_weights);
    // Replica slots per rank in each routed layer, the budget spread evenly over the layers.
    let budget = args
        .expert_replicas
        .as_deref()
        .map(parse_budget)
        .transpose()?;
    let total_expert_bytes: u64 = routed.iter().map(|&l| expert_bytes[l]).sum();
    let slots_of = |rank_experts: usize| -> usize {
        let bytes = match budget {
            None => 0.0,
            Some(ReplicaBudget::Bytes(b)) => b as f64,
            Some(ReplicaBudget::Fraction(f)) => {
                f * (rank_experts * total_expert_bytes as usize) as f64
            }
        };
        ((bytes / total_expert_bytes.max(1) as f64).floor() as usize).min(n_expert)
    };
    // Ranks take replicas in turns, so every rank gets the smallest rank's slot count (its
    // weight is its compute share, not a larger memory budget).
    let slots = own_counts
        .iter()
        .zip(&weights)
        .filter(|&(_, &w)| w > 0.0)
        .map(|(&c, _)| slots_of(c))
        .min()
        .unwrap_or(0);
    let replicas: Vec<usize> = expert_bytes
        .iter()
        .map(|&b| if b > 0 { slots } else { 0 })
        .collect();
    let planned = ExpertPlacement::plan(&PlanInput {
        fingerprint: &fingerprint,
        n_expert,
        counts: &counts,
        weights: &weights,
        replicas: &replicas,
    })
    .map_err(|e| anyhow::anyhow!(e))?;

    println!(
        "model {} ({} routed layers × {n_expert} experts, top-{top_k}), profile of {} steps, {} ranks, weights {weights:?}",
        args.model.display(),
        routed.len(),
        profile.steps,
        args.tp_size
    );
    println!("rank\texperts/layer\treplicas/layer\texpert bytes\textra");
    for (r, &own_count) in own_counts.iter().enumerate() {
        let held = planned.held_by(r);
        let bytes: u64 = routed
            .iter()
            .map(|&l| {
                let n = (0..n_expert).filter(|&e| planned.holds(r, l, e)).count() as u64;
                n * expert_bytes[l]
            })
            .sum();
        let own_bytes = own_count as u64 * total_expert_bytes;
        println!(
            "{r}\t{:.1}\t{}\t{}\t{:+.1} %",
            held as f64 / routed.len().max(1) as f64,
            slots,
            human(bytes),
            if own_bytes == 0 {
                0.0
            } else {
                (bytes as f64 / own_bytes as f64 - 1.0) * 100.0
            }
        );
    }
    // The forecast: the busiest rank's routed work per decode step relative to a perfect split,
    // averaged over the routed layers (every layer ends in an all-reduce, so each waits for
    // its own busiest rank).
    let forecast = |holders: &dyn Fn(usize, usize) -> u64| -> (f64, Vec<f64>) {
        let mut busiest = 0.0;
        let mut share = vec![0.0; args.tp_size];
        for &l in &routed {
            let f = simulate(&counts[l], top_k, FORECAST_STEPS, &weights, |e| {
                holders(l, e)
            });
            busiest += f.busiest;
            for (s, x) in share.iter_mut().zip(&f.share) {
                *s += x;
            }
        }
        let n = routed.len().max(1) as f64;
        (busiest / n, share.into_iter().map(|s| s / n).collect())
    };
    let contiguous = |_: usize, e: usize| -> u64 {
        own.iter()
            .enumerate()
            .filter(|(_, o)| o[e])
            .fold(0, |m, (r, _)| m | (1 << r))
    };
    let total_w: f64 = weights.iter().sum();
    println!(
        "forecast over {FORECAST_STEPS} simulated decode steps per layer (busiest rank's routed work ÷ a perfect split; routed-work speed-up over one node = {total_w} ÷ that):"
    );
    for (name, f) in [
        ("contiguous shares (default)", forecast(&contiguous)),
        ("this placement", forecast(&|l, e| planned.holders_of(l, e))),
        (
            "every rank holds every expert (--tp-balance-experts)",
            forecast(&|_, _| u64::MAX),
        ),
    ] {
        let shares: Vec<String> = f.1.iter().map(|s| format!("{:.1} %", s * 100.0)).collect();
        println!(
            "  {name}: {:.3} (speed-up {:.2}×), mean shares {}",
            f.0,
            total_w / f.0,
            shares.join(" / ")
        );
    }
    if let Some(out) = &args.output {
        planned.save(out).map_err(|e| anyhow::anyhow!(e))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_as_bytes_or_shares() {
        assert_eq!(parse_budget("25%").unwrap(), ReplicaBudget::Fraction(0.25));
        assert_eq!(parse_budget("2GiB").unwrap(), ReplicaBudget::Bytes(2 << 30));
        assert!(parse_budget("-5%").is_err());
        assert!(
            parse_budget("300").is_err(),
            "a bare count is not a byte size"
        );
        assert!(parse_budget("lots").is_err());
    }
}
