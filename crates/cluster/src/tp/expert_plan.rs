//! Expert placement planned from measured routing (`moeshard plan`, `--expert-placement`):
//! which ranks hold each routed expert of each layer. Experts are dealt to ranks so that each
//! rank's expected share of a layer's routed work matches its weight, each rank keeping its
//! proportional count of experts (memory stays about 1/N); then every rank takes replicas of
//! the hottest experts it lacks within a budget, and in each step a replicated expert is
//! computed by whichever holder is less loaded (`model::experts::assign_to_holders`, the same
//! rule on every rank, so results stay bit-identical). The default contiguous shares
//! (`placement`), whose per-rank counts the planner keeps, live here too.
//!
//! Saved as text, tied to the model by its fingerprint:
//!
//! ```text
//! moeshard-expert-placement 1
//! model <fingerprint>
//! shape <n_layer> <n_expert>
//! ranks <n_ranks>
//! weights <w_0> … <w_{n_ranks-1}>
//! <layer> <expert> <rank>[,<rank>…]   (every expert of every routed layer)
//! ```

use std::fmt::Write as _;
use std::path::Path;

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

const MAGIC: &str = "moeshard-expert-placement 1";

/// The most ranks a placement describes (holders are a bit mask).
pub const MAX_PLACED_RANKS: usize = 64;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertPlacement {
    pub fingerprint: String,
    pub n_ranks: usize,
    pub n_expert: usize,
    /// Relative speed of every rank (the dealing rule's weights).
    pub weights: Vec<f64>,
    /// `holders[layer][expert]`: bit `r` set when rank `r` holds the expert; empty for layers
    /// without routed experts.
    pub holders: Vec<Vec<u64>>,
}

/// The experts each rank owns: contiguous id ranges in proportion to `weights`.
pub fn placement(n_expert: usize, n_ranks: usize, weights: &[f32]) -> Vec<Vec<bool>> {
    let w = rank_weights(n_ranks, weights);
    let total: f64 = w.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let mut bounds = vec![0usize];
    let mut acc = 0.0;
    for wr in &w {
        acc += wr;
        bounds.push(((acc / total) * n_expert as f64).round() as usize);
    }
    if let Some(last) = bounds.last_mut() {
        *last = n_expert;
    }
    (0..n_ranks)
        .map(|r| {
            (0..n_expert)
                .map(|e| e >= bounds[r] && e < bounds[r + 1])
                .collect()
        })
        .collect()
}

/// Each rank's weight (1 where `weights` names none; negative counts as 0).
pub fn rank_weights(n_ranks: usize, weights: &[f32]) -> Vec<f64> {
    (0..n_ranks)
        .map(|r| weights.get(r).copied().unwrap_or(1.0).max(0.0) as f64)
        .collect()
}

/// How many experts each rank's contiguous share holds (what a planned placement keeps per
/// rank before replicas).
pub fn share_counts(n_expert: usize, n_ranks: usize, weights: &[f32]) -> Vec<usize> {
    placement(n_expert, n_ranks, weights)
        .iter()
        .map(|owned| owned.iter().filter(|&&o| o).count())
        .collect()
}

/// What a placement is planned from.
pub struct PlanInput<'a> {
    pub fingerprint: &'a str,
    pub n_expert: usize,
    /// Routed tokens per expert of every layer (`counts[layer]`, empty for layers without
    /// routed experts), from a routing profile.
    pub counts: &'a [Vec<u64>],
    /// Relative speed of every rank; `weights.len()` is the group size.
    pub weights: &'a [f64],
    /// Replicas every rank takes in each routed layer.
    pub replicas: &'a [usize],
}

impl ExpertPlacement {
    pub fn n_layer(&self) -> usize {
        self.holders.len()
    }

    /// The holders of `expert` in `layer` as a bit mask (0 outside the placement).
    pub fn holders_of(&self, layer: usize, expert: usize) -> u64 {
        self.holders
            .get(layer)
            .and_then(|l| l.get(expert))
            .copied()
            .unwrap_or(0)
    }

    pub fn holds(&self, rank: usize, layer: usize, expert: usize) -> bool {
        rank < MAX_PLACED_RANKS && self.holders_of(layer, expert) & (1 << rank) != 0
    }

    /// Experts `rank` holds over all layers.
    pub fn held_by(&self, rank: usize) -> usize {
        (0..self.n_layer())
            .map(|l| {
                (0..self.n_expert)
                    .filter(|&e| self.holds(rank, l, e))
                    .count()
            })
            .sum()
    }

    /// Plans a placement (see the module's description).
    pub fn plan(input: &PlanInput) -> Result<ExpertPlacement, String> {
        let n_ranks = input.weights.len();
        if n_ranks == 0 || n_ranks > MAX_PLACED_RANKS {
            return Err(format!(
                "a placement is for 1 to {MAX_PLACED_RANKS} ranks, not {n_ranks}"
            ));
        }
        if input.weights.iter().all(|&w| w <= 0.0) {
            return Err("every rank weight is 0".into());
        }
        let w32: Vec<f32> = input.weights.iter().map(|&w| w as f32).collect();
        let caps = share_counts(input.n_expert, n_ranks, &w32);
        let holders = input
            .counts
            .iter()
            .enumerate()
            .map(|(layer, counts)| {
                if counts.is_empty() {
                    return Ok(Vec::new());
                }
                if counts.len() != input.n_expert {
                    return Err(format!(
                        "layer {layer} has counts for {} experts, the model {}",
                        counts.len(),
                        input.n_expert
                    ));
                }
                let replicas = input.replicas.get(layer).copied().unwrap_or(0);
                Ok(plan_layer(counts, input.weights, &caps, replicas))
            })
            .collect::<Result<_, String>>()?;
        Ok(ExpertPlacement {
            fingerprint: input.fingerprint.to_string(),
            n_ranks,
            n_expert: input.n_expert,
            weights: input.weights.to_vec(),
            holders,
        })
    }

    /// Checks that this placement fits a model and a group: same fingerprint, shape and group
    /// size, every expert of every routed layer held by at least one rank of positive weight.
    pub fn check(
        &self,
        fingerprint: &str,
        routed_layers: &[bool],
        n_expert: usize,
        n_ranks: usize,
    ) -> Result<(), String> {
        if self.fingerprint != fingerprint {
            return Err(format!(
                "made for model {}, this is {fingerprint}",
                self.fingerprint
            ));
        }
        if self.n_ranks != n_ranks {
            return Err(format!(
                "made for {} ranks, the group has --tp-size {n_ranks}",
                self.n_ranks
            ));
        }
        if self.n_layer() != routed_layers.len() || self.n_expert != n_expert {
            return Err(format!(
                "shape {} layers × {} experts, the model has {} × {n_expert}",
                self.n_layer(),
                self.n_expert,
                routed_layers.len()
            ));
        }
        let live: u64 = (0..n_ranks)
            .filter(|&r| self.weights.get(r).copied().unwrap_or(0.0) > 0.0)
            .fold(0, |m, r| m | (1 << r));
        for (layer, &routed) in routed_layers.iter().enumerate() {
            if routed && self.holders[layer].len() != n_expert {
                return Err(format!("layer {layer} is routed but has no placement"));
            }
            if let Some(e) =
                (0..self.holders[layer].len()).find(|&e| self.holders[layer][e] & live == 0)
            {
                return Err(format!(
                    "layer {layer}: expert {e} is held by no rank of positive weight"
                ));
            }
        }
        Ok(())
    }

    pub fn to_text(&self) -> String {
        let weights: Vec<String> = self.weights.iter().map(f64::to_string).collect();
        let mut s = format!(
            "{MAGIC}\nmodel {}\nshape {} {}\nranks {}\nweights {}\n",
            self.fingerprint,
            self.n_layer(),
            self.n_expert,
            self.n_ranks,
            weights.join(" ")
        );
        for (layer, experts) in self.holders.iter().enumerate() {
            for (e, &mask) in experts.iter().enumerate() {
                let ranks: Vec<String> = (0..self.n_ranks)
                    .filter(|&r| mask & (1 << r) != 0)
                    .map(|r| r.to_string())
                    .collect();
                let _ = writeln!(s, "{layer} {e} {}", ranks.join(","));
            }
        }
        s
    }

    pub fn parse(text: &str) -> Result<ExpertPlacement, String> {
        let mut lines = text.lines().enumerate();
        let mut field = |key: &str| -> Result<String, String> {
            let (i, line) = lines
                .next()
                .ok_or_else(|| format!("missing the `{key}` line"))?;
            line.trim()
                .strip_prefix(key)
                .map(|v| v.trim().to_string())
                .ok_or_else(|| format!("line {}: expected `{key} …`, got {line:?}", i + 1))
        };
        let magic = field("moeshard-expert-placement")?;
        if magic != "1" {
            return Err(format!(
                "not a placement of format 1 (the first line must be {MAGIC:?})"
            ));
        }
        let fingerprint = field("model")?;
        let shape = field("shape")?;
        let num = |what: &str, v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{what} {v:?} is not a count"))
        };
        let dims: Vec<&str> = shape.split_whitespace().collect();
        let [n_layer, n_expert] = dims[..] else {
            return Err(format!("bad shape {shape:?}"));
        };
        let (n_layer, n_expert) = (num("layer count", n_layer)?, num("expert count", n_expert)?);
        let n_ranks = num("rank count", &field("ranks")?)?;
        if n_ranks == 0 || n_ranks > MAX_PLACED_RANKS {
            return Err(format!(
                "{n_ranks} ranks (a placement has 1 to {MAX_PLACED_RANKS})"
            ));
        }
        let weights: Vec<f64> = field("weights")?
            .split_whitespace()
            .map(|w| {
                w.parse::<f64>()
                    .ok()
                    .filter(|w| w.is_finite() && *w >= 0.0)
                    .ok_or_else(|| format!("rank weight {w:?} is not a number ≥ 0"))
            })
            .collect::<Result<_, _>>()?;
        if weights.len() != n_ranks {
            return Err(format!("{} weights for {n_ranks} ranks", weights.len()));
        }
        let mut holders = vec![Vec::new(); n_layer];
        for (i, line) in lines {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let at = |detail: String| format!("line {}: {detail}", i + 1);
            let parts: Vec<&str> = line.split_whitespace().collect();
            let [layer, expert, ranks] = parts[..] else {
                return Err(at(format!(
                    "expected `<layer> <expert> <ranks>`, got {line:?}"
                )));
            };
            let layer = num("layer", layer).map_err(at)?;
            let expert = num("expert", expert).map_err(at)?;
            if layer >= n_layer || expert >= n_expert {
                return Err(at(format!(
                    "layer {layer} expert {expert} is outside the shape {n_layer} × {n_expert}"
                )));
            }
            let mut mask = 0u64;
            for r in ranks.split(',') {
                let r = num("rank", r).map_err(at)?;
                if r >= n_ranks {
                    return Err(at(format!("rank {r} of a {n_ranks}-rank placement")));
                }
                mask |= 1 << r;
            }
            let row = &mut holders[layer];
            if row.is_empty() {
                *row = vec![0u64; n_expert];
            }
            if row[expert] != 0 {
                return Err(at(format!("layer {layer} expert {expert} is listed twice")));
            }
            row[expert] = mask;
        }
        for (layer, row) in holders.iter().enumerate() {
            if let Some(e) = row.iter().position(|&m| m == 0) {
                return Err(format!("layer {layer}: expert {e} has no line"));
            }
        }
        Ok(ExpertPlacement {
            fingerprint,
            n_ranks,
            n_expert,
            weights,
            holders,
        })
    }

    pub fn save(&self, path: &Path) -> Result<(), String> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, self.to_text())
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|e| format!("writing {}: {e}", path.display()))
    }

    pub fn load(path: &Path) -> Result<ExpertPlacement, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        ExpertPlacement::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Simulated decode steps of one layer: `top_k` distinct experts per token drawn in
    /// proportion to `counts` (without replacement), dealt by the group's rule. Returns each
    /// rank's mean share of the routed work and the busiest rank's mean finish time
    /// relative to a perfect split (1.0: every step splits exactly by weight).
    pub fn simulate_layer(
        &self,
        layer: usize,
        counts: &[u64],
        top_k: usize,
        steps: usize,
    ) -> LayerForecast {
        simulate(counts, top_k, steps, &self.weights, |e| {
            self.holders_of(layer, e)
        })
    }
}

/// One layer's predicted balance (see [`ExpertPlacement::simulate_layer`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerForecast {
    pub share: Vec<f64>,
    pub busiest: f64,
}

/// The forecast of a layer under any holder rule (also used to compare with contiguous
/// ownership and with every rank holding every expert).
pub fn simulate(
    counts: &[u64],
    top_k: usize,
    steps: usize,
    weights: &[f64],
    holders: impl Fn(usize) -> u64,
) -> LayerForecast {
    let n = counts.len();
    let n_ranks = weights.len().max(1);
    let k = top_k.min(n);
    let total_w: f64 = weights.iter().filter(|&&w| w > 0.0).sum();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    // Half a route for an expert never seen, so a short profile does not rule it out.
    let log_p: Vec<f64> = counts.iter().map(|&c| (c as f64 + 0.5).ln()).collect();
    let mut share = vec![0f64; n_ranks];
    let mut busiest = 0f64;
    let mut keyed: Vec<(f64, usize)> = Vec::with_capacity(n);
    for _ in 0..steps.max(1) {
        // Gumbel top-k: the k largest of log p + Gumbel noise are a draw without replacement.
        keyed.clear();
        for (e, lp) in log_p.iter().enumerate() {
            let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
            keyed.push((lp - (-u.ln()).ln(), e));
        }
        keyed.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut active: Vec<usize> = keyed[..k].iter().map(|&(_, e)| e).collect();
        active.sort_unstable();
        let ranks = model::experts::assign_to_holders(&active, &vec![1; k], weights, &holders);
        let mut load = vec![0f64; n_ranks];
        for r in ranks {
            load[r] += 1.0;
        }
        let finish = (0..n_ranks)
            .filter(|&r| weights.get(r).copied().unwrap_or(1.0) > 0.0)
            .map(|r| load[r] / weights.get(r).copied().unwrap_or(1.0))
            .fold(0f64, f64::max);
        busiest += finish * total_w / k.max(1) as f64;
        for (s, l) in share.iter_mut().zip(&load) {
            *s += l / k.max(1) as f64;
        }
    }
    let steps = steps.max(1) as f64;
    LayerForecast {
        share: share.into_iter().map(|s| s / steps).collect(),
        busiest: busiest / steps,
    }
}

/// One layer's holders: each expert, hottest first, to the rank with room whose weighted load
/// would grow least; then `replicas` of the hottest experts it lacks added to every rank in
/// turn (the hottest by routes per holder, so a very hot expert spreads further).
fn plan_layer(counts: &[u64], weights: &[f64], caps: &[usize], replicas: usize) -> Vec<u64> {
    let n = counts.len();
    let n_ranks = weights.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
    let mut holders = vec![0u64; n];
    let mut load = vec![0f64; n_ranks];
    let mut room = caps.to_vec();
    for &e in &order {
        let c = counts[e] as f64 + 0.5;
        let best = (0..n_ranks)
            .filter(|&r| room[r] > 0)
            .min_by(|&a, &b| {
                let f = |r: usize| (load[r] + c) / weights[r].max(f64::MIN_POSITIVE);
                f(a).total_cmp(&f(b)).then(a.cmp(&b))
            })
            .unwrap_or(0);
        holders[e] |= 1 << best;
        load[best] += c;
        room[best] = room[best].saturating_sub(1);
    }
    for _ in 0..replicas {
        for r in (0..n_ranks).filter(|&r| weights[r] > 0.0) {
            let pick = (0..n)
                .filter(|&e| holders[e] & (1 << r) == 0)
                .max_by(|&a, &b| {
                    let per_holder = |e: usize| counts[e] as f64 / holders[e].count_ones() as f64;
                    per_holder(a).total_cmp(&per_holder(b)).then(b.cmp(&a))
                });
            if let Some(e) = pick {
                holders[e] |= 1 << r;
            }
        }
    }
    holders
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skewed(n: usize) -> Vec<u64> {
        (0..n).map(|e| 1000 / (e as u64 + 1)).collect()
    }

    fn input<'a>(
        counts: &'a [Vec<u64>],
        weights: &'a [f64],
        replicas: &'a [usize],
    ) -> PlanInput<'a> {
        PlanInput {
            fingerprint: "fp",
            n_expert: 16,
            counts,
            weights,
            replicas,
        }
    }

    #[test]
    fn every_expert_is_held_and_memory_stays_proportional() {
        let counts = vec![Vec::new(), skewed(16), skewed(16)];
        let p = ExpertPlacement::plan(&input(&counts, &[1.0, 1.0, 2.0], &[0, 0, 0])).unwrap();
        assert!(p.holders[0].is_empty());
        for l in 1..3 {
            assert!(p.holders[l].iter().all(|&m| m.count_ones() == 1));
        }
        // 16 experts by weights 1:1:2 → 4, 4 and 8 per layer.
        assert_eq!(
            (0..3).map(|r| p.held_by(r)).collect::<Vec<_>>(),
            vec![8, 8, 16]
        );
        // The two hottest experts (a third of the routes) do not share a rank.
        assert_ne!(p.holders[1][0], p.holders[1][1]);
        p.check("fp", &[false, true, true], 16, 3).unwrap();
    }

    #[test]
    fn replicas_are_the_hottest_and_improve_the_forecast() {
        let counts = vec![skewed(16)];
        let base = ExpertPlacement::plan(&input(&counts, &[1.0, 1.0], &[0])).unwrap();
        let rep = ExpertPlacement::plan(&input(&counts, &[1.0, 1.0], &[2])).unwrap();
        assert_eq!(rep.held_by(0), 10);
        assert_eq!(rep.held_by(1), 10);
        // Expert 0 and 1 are the hottest: both now on both ranks.
        assert_eq!(rep.holders[0][0].count_ones(), 2);
        assert_eq!(rep.holders[0][1].count_ones(), 2);
        let f_base = base.simulate_layer(0, &counts[0], 4, 2000);
        let f_rep = rep.simulate_layer(0, &counts[0], 4, 2000);
        assert!(f_rep.busiest < f_base.busiest, "{f_rep:?} vs {f_base:?}");
        assert!(f_rep.busiest >= 1.0);
        // Same input, same forecast (fixed seed).
        assert_eq!(f_rep, rep.simulate_layer(0, &counts[0], 4, 2000));
    }

    #[test]
    fn text_round_trips_and_bad_files_are_named() {
        let counts = vec![Vec::new(), skewed(16)];
        let p = ExpertPlacement::plan(&input(&counts, &[1.0, 1.5], &[0, 3])).unwrap();
        assert_eq!(ExpertPlacement::parse(&p.to_text()).unwrap(), p);
        let text = p.to_text();
        let cut: String = text
            .lines()
            .filter(|l| !l.starts_with("1 5 "))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(
            ExpertPlacement::parse(&cut)
                .unwrap_err()
                .contains("expert 5 has no line")
        );
        let bad = text.replace("1 5 ", "1 5 7,");
        assert!(
            ExpertPlacement::parse(&bad).unwrap_err().contains("rank 7"),
            "{bad}"
        );
        assert!(ExpertPlacement::parse("hello").is_err());
        let err = p.check("other", &[false, true], 16, 2).unwrap_err();
        assert!(err.contains("made for model fp"), "{err}");
        let err = p.check("fp", &[false, true], 16, 3).unwrap_err();
        assert!(err.contains("--tp-size 3"), "{err}");
    }
}
