//! The `ExpertSource` seam: where the routed experts of a layer come from. Resident (slices of
//! the map) here; streamed from disk and sharded across ranks elsewhere. The forward path only
//! asks for the experts the router chose, and only for those the source owns.

use crate::Model;
use crate::error::Result;
pub use crate::weights::ExpertMatrices;

/// Called with experts as they become available: `(expert id, matrices)` pairs.
pub type ExpertSink<'s> = dyn FnMut(&[(usize, ExpertMatrices<'_>)]) -> Result<()> + 's;

pub trait ExpertSource: Sync {
    /// Whether this source computes `expert` of `layer` (false for experts owned by another
    /// rank of a tensor-parallel group).
    fn owns(&self, layer: usize, expert: usize) -> bool;

    /// Which of `active` (the distinct experts the router chose for this step, ascending, with
    /// `tokens[i]` tokens routed to `active[i]`) this source computes. Every rank of a group
    /// sees the same routing, so the ranks' choices must partition `active` by a rule they
    /// all compute alike. By default: the experts it owns.
    fn assign(&self, layer: usize, active: &[usize], tokens: &[usize]) -> Vec<usize> {
        let _ = tokens;
        active
            .iter()
            .copied()
            .filter(|&e| self.owns(layer, e))
            .collect()
    }

    /// Makes each of `experts` (owned, distinct) of `layer` available and hands them to `sink`,
    /// in one or more batches, each expert exactly once. A source may hand over those it has at
    /// hand first and the rest as they arrive.
    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> Result<()>;

    /// A hint that `experts` of `layer` will probably be needed soon.
    fn prefetch(&self, _layer: usize, _experts: &[usize]) {}

    /// Whether the forward path should run the next layer's router on the current hidden state
    /// and pass its choice to [`ExpertSource::prefetch`] (worth a small matmul when experts come
    /// from disk; not when they are resident).
    fn lookahead(&self) -> bool {
        false
    }

    /// Statistics as `(name, value)` pairs (a streamed source's hit rate, bytes read, ...).
    fn stats(&self) -> Vec<(String, f64)> {
        Vec::new()
    }
}

/// Every expert, straight from the model's map.
pub struct ResidentExperts<'m> {
    model: &'m Model,
}

impl<'m> ResidentExperts<'m> {
    pub fn new(model: &'m Model) -> Self {
        ResidentExperts { model }
    }
}

impl ExpertSource for ResidentExperts<'_> {
    fn owns(&self, _layer: usize, _expert: usize) -> bool {
        true
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> Result<()> {
        let batch: Vec<_> = experts
            .iter()
            .map(|&e| self.model.expert_weights(layer, e).map(|m| (e, m)))
            .collect::<Result<_>>()?;
        sink(&batch)
    }
}

/// Resident experts of which this process computes only `owned` (a tensor-parallel rank's
/// share); the other experts' pages are never touched, so they never count in its memory.
pub struct OwnedResidentExperts {
    model: std::sync::Arc<Model>,
    owned: Vec<bool>,
}

impl OwnedResidentExperts {
    pub fn new(model: std::sync::Arc<Model>, owned: Vec<bool>) -> Self {
        OwnedResidentExperts { model, owned }
    }
}

impl ExpertSource for OwnedResidentExperts {
    fn owns(&self, _layer: usize, expert: usize) -> bool {
        self.owned.get(expert).copied().unwrap_or(false)
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> Result<()> {
        ResidentExperts::new(&self.model).with_experts(layer, experts, sink)
    }
}

/// Resident experts dealt out afresh every step: the routed experts of a step go to the ranks
/// of a tensor-parallel group in proportion to their weights, largest token count first to the
/// least-loaded rank (ties to the lower rank), so every rank does about the same work whatever
/// the router picks. Each rank can compute any expert, so each touches every expert's pages
/// over time: this trades the memory saving of owned experts for balance.
pub struct BalancedResidentExperts {
    model: std::sync::Arc<Model>,
    rank: usize,
    /// Relative speed of every rank (its share of the work).
    weights: Vec<f64>,
}

impl BalancedResidentExperts {
    pub fn new(model: std::sync::Arc<Model>, rank: usize, weights: Vec<f64>) -> Self {
        BalancedResidentExperts {
            model,
            rank,
            weights,
        }
    }
}

/// The rank of every expert of `active` under the balanced rule (see [`BalancedResidentExperts`]).
pub fn balanced_assignment(active: &[usize], tokens: &[usize], weights: &[f64]) -> Vec<usize> {
    assign_to_holders(active, tokens, weights, |_| u64::MAX)
}

/// The experts of `active` that `rank_of` (the rank of each) gives to `rank`.
pub fn assigned_to(rank: usize, active: &[usize], rank_of: &[usize]) -> Vec<usize> {
    rank_of
        .iter()
        .zip(active)
        .filter(|&(&r, _)| r == rank)
        .map(|(_, &e)| e)
        .collect()
}

/// The rank of every expert of `active` (`tokens[i]` tokens routed to `active[i]`) when expert
/// `e` may be computed by the ranks whose bits are set in `holders(e)`: an expert with one
/// holder goes to it; the others, largest token count first (ties by id), to the holder that
/// would finish first at its weight (ties to the lower rank). Every rank of a group computes
/// this from the same routing, so they agree without exchanging a word; an expert with no
/// holder among the weighted ranks goes to its lowest holder (or rank 0).
pub fn assign_to_holders(
    active: &[usize],
    tokens: &[usize],
    weights: &[f64],
    holders: impl Fn(usize) -> u64,
) -> Vec<usize> {
    let n_ranks = weights.len().clamp(1, 64);
    let in_group = if n_ranks == 64 {
        u64::MAX
    } else {
        (1u64 << n_ranks) - 1
    };
    let weight = |r: usize| weights.get(r).copied().unwrap_or(1.0);
    let mask = |i: usize| holders(active[i]) & in_group;
    let cost = |i: usize| tokens[i].max(1) as f64;
    let mut load = vec![0f64; n_ranks];
    let mut rank_of = vec![0usize; active.len()];
    let mut shared = Vec::new();
    for (i, rank) in rank_of.iter_mut().enumerate() {
        let m = mask(i);
        if m.count_ones() == 1 {
            *rank = m.trailing_zeros() as usize;
            load[*rank] += cost(i);
        } else {
            shared.push(i);
        }
    }
    shared.sort_by(|&a, &b| tokens[b].cmp(&tokens[a]).then(active[a].cmp(&active[b])));
    for i in shared {
        let m = mask(i);
        let mut best = if m == 0 {
            0
        } else {
            m.trailing_zeros() as usize
        };
        let mut best_finish = f64::INFINITY;
        for (r, l) in load.iter().enumerate() {
            let w = weight(r);
            if m & (1 << r) == 0 || w <= 0.0 {
                continue;
            }
            let finish = (l + cost(i)) / w;
            if finish < best_finish {
                best = r;
                best_finish = finish;
            }
        }
        load[best] += cost(i);
        rank_of[i] = best;
    }
    rank_of
}

impl ExpertSource for BalancedResidentExperts {
    fn owns(&self, _layer: usize, _expert: usize) -> bool {
        true
    }

    fn assign(&self, _layer: usize, active: &[usize], tokens: &[usize]) -> Vec<usize> {
        assigned_to(
            self.rank,
            active,
            &balanced_assignment(active, tokens, &self.weights),
        )
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> Result<()> {
        ResidentExperts::new(&self.model).with_experts(layer, experts, sink)
    }
}

#[cfg(test)]
mod tests {
    use super::balanced_assignment;

    #[test]
    fn balanced_assignment_evens_out_decode_and_respects_weights() {
        // Decode: 8 experts with one token each over 2 equal ranks → 4 and 4.
        let active = [3, 9, 17, 20, 33, 41, 50, 63];
        let ones = [1; 8];
        let r = balanced_assignment(&active, &ones, &[1.0, 1.0]);
        assert_eq!(r.iter().filter(|&&x| x == 0).count(), 4);
        // Same input, same answer (every rank computes it independently).
        assert_eq!(r, balanced_assignment(&active, &ones, &[1.0, 1.0]));
        // Weights 2:1 → 6 and 2 (rank 1 would finish at 3/1 with a third, rank 0 at 6/2).
        let r = balanced_assignment(&active, &ones, &[2.0, 1.0]);
        assert_eq!(r.iter().filter(|&&x| x == 0).count(), 6, "{r:?}");
        // Prefill: the heavy expert alone on one rank, the light ones on the other.
        let r = balanced_assignment(&[1, 2, 3, 4], &[12, 4, 4, 4], &[1.0, 1.0]);
        assert_eq!(r, vec![0, 1, 1, 1]);
        // A rank of weight 0 gets nothing.
        let r = balanced_assignment(&active, &ones, &[1.0, 0.0, 1.0]);
        assert!(r.iter().all(|&x| x != 1), "{r:?}");
    }

    #[test]
    fn replicated_experts_go_to_the_less_loaded_holder() {
        use super::assign_to_holders;
        // Experts 0..4 on rank 0 only, 4..8 on rank 1 only, 8 and 9 on both.
        let holders = |e: usize| match e {
            0..4 => 0b01,
            4..8 => 0b10,
            _ => 0b11,
        };
        // Three fixed experts on rank 0, one on rank 1: both replicated ones go to rank 1.
        let r = assign_to_holders(&[0, 1, 2, 5, 8, 9], &[1; 6], &[1.0, 1.0], holders);
        assert_eq!(r, vec![0, 0, 0, 1, 1, 1]);
        // Balanced fixed load: the replicated ones split, the first to the lower rank.
        let r = assign_to_holders(&[0, 5, 8, 9], &[1; 4], &[1.0, 1.0], holders);
        assert_eq!(r, vec![0, 1, 0, 1]);
        // A single holder always computes its expert, however loaded.
        let r = assign_to_holders(&[0, 1, 2, 3], &[1; 4], &[1.0, 1.0], holders);
        assert_eq!(r, vec![0; 4]);
        // Every holder of everything is the balanced rule.
        let active = [3, 9, 17, 20];
        assert_eq!(
            assign_to_holders(&active, &[2, 1, 1, 1], &[1.0, 1.0], |_| u64::MAX),
            super::balanced_assignment(&active, &[2, 1, 1, 1], &[1.0, 1.0])
        );
    }
}
