//! Which routed experts each rank computes: a fixed contiguous share of the expert ids in
//! proportion to `--expert-weights` (a rank's memory then holds only its experts, and a
//! streaming rank reads only those), or, with `--tp-balance-experts`, each step's active
//! experts dealt out by the same weights.

use std::sync::Arc;

use engine::SharedExperts;
use model::{BalancedResidentExperts, Model, OwnedResidentExperts};

use super::{BALANCE_NEEDS_RESIDENT, ExpertFactory};
use crate::error::{ClusterError, Result};

/// Which routed experts one rank computes.
#[derive(Clone, Debug)]
pub enum Share {
    /// A fixed set (`owned[expert]`).
    Owned(Vec<bool>),
    /// Each step's experts dealt out by these per-rank weights.
    Balanced(Vec<f64>),
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

/// The expert ids a share needs in every MoE layer of `n_expert`: the owned ones (contiguous
/// by construction), or all of them when experts are dealt out per step.
pub fn needed_experts(share: &Share, n_expert: usize) -> std::ops::Range<usize> {
    match share {
        Share::Owned(owned) => {
            let first = owned.iter().position(|&o| o).unwrap_or(0);
            let end = owned
                .iter()
                .rposition(|&o| o)
                .map_or(first, |last| last + 1);
            first..end
        }
        Share::Balanced(_) => 0..n_expert,
    }
}

/// Every rank's share.
pub fn shares(n_expert: usize, n_ranks: usize, weights: &[f32], balance: bool) -> Vec<Share> {
    if balance {
        let w = rank_weights(n_ranks, weights);
        return vec![Share::Balanced(w); n_ranks];
    }
    placement(n_expert.max(1), n_ranks, weights)
        .into_iter()
        .map(Share::Owned)
        .collect()
}

impl Share {
    /// `12 experts`, `experts dealt out per step`.
    pub fn describe(&self) -> String {
        match self {
            Share::Owned(o) => format!("{} experts", o.iter().filter(|&&x| x).count()),
            Share::Balanced(_) => "experts dealt out per step".into(),
        }
    }

    /// The expert source of rank `rank` with this share: streamed through `factory` when
    /// there is one, else the model's resident tensors.
    pub fn source(
        &self,
        model: &Arc<Model>,
        rank: usize,
        factory: Option<&ExpertFactory>,
    ) -> Result<SharedExperts> {
        let n_expert = model.hp.moe.as_ref().map_or(0, |m| m.n_expert);
        let role = model::Role::Rank {
            rank,
            n_ranks: model.shard().n_ranks,
            experts: needed_experts(self, n_expert),
        };
        model
            .check_role(&role)
            .map_err(|e| ClusterError::Formation(e.to_string()))?;
        match (factory, self) {
            (Some(make), Share::Owned(owned)) => {
                make(model, owned.clone()).map_err(ClusterError::Experts)
            }
            (None, Share::Owned(owned)) => Ok(Arc::new(OwnedResidentExperts::new(
                Arc::clone(model),
                owned.clone(),
            ))),
            (None, Share::Balanced(weights)) => Ok(Arc::new(BalancedResidentExperts::new(
                Arc::clone(model),
                rank,
                weights.clone(),
            ))),
            (Some(_), Share::Balanced(_)) => {
                Err(ClusterError::Experts(BALANCE_NEEDS_RESIDENT.into()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::placement;

    #[test]
    fn placement_is_contiguous_proportional_and_complete() {
        let p = placement(64, 2, &[2.0, 1.0]);
        assert_eq!(p[0].iter().filter(|&&x| x).count(), 43);
        assert_eq!(p[1].iter().filter(|&&x| x).count(), 21);
        for e in 0..64 {
            assert_eq!(
                p.iter().filter(|r| r[e]).count(),
                1,
                "expert {e} owned exactly once"
            );
        }
        let p = placement(8, 3, &[]);
        assert_eq!(
            p.iter()
                .map(|r| r.iter().filter(|&&x| x).count())
                .collect::<Vec<_>>(),
            vec![3, 2, 3]
        );
    }
}
