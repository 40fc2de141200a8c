//! Which routed experts each rank computes: a fixed contiguous share of the expert ids in
//! proportion to `--expert-weights` (a rank's memory then holds only its experts, and a
//! streaming rank reads only those), with `--tp-balance-experts` each step's active experts
//! dealt out by the same weights, or with `--expert-placement` the holders a placement planned
//! from measured routing names per layer (replicated experts dealt out per step among their
//! holders).

use std::sync::Arc;

use engine::SharedExperts;
use model::experts::{ExpertSink, assign_to_holders, assigned_to};
use model::{BalancedResidentExperts, ExpertSource, Model, OwnedResidentExperts};
use serde::{Deserialize, Serialize};

use super::expert_plan::ExpertPlacement;
pub use super::expert_plan::{placement, rank_weights};
use super::{BALANCE_NEEDS_RESIDENT, ExpertFactory};
use crate::error::{ClusterError, Result};

/// Which routed experts one rank computes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Share {
    /// A fixed set (`owned[expert]`).
    Owned(Vec<bool>),
    /// Each step's experts dealt out by these per-rank weights.
    Balanced(Vec<f64>),
    /// The experts a placement gives this rank in each layer; those it shares with other
    /// ranks are dealt out per step.
    Placed(ExpertPlacement),
}

/// The expert ids rank `rank` with `share` needs in every MoE layer: the owned ones
/// (contiguous by construction), all of them when experts are dealt out per step, or the span
/// of those a placement gives it in any layer.
pub fn needed_experts(share: &Share, rank: usize, n_expert: usize) -> std::ops::Range<usize> {
    let span = |held: &dyn Fn(usize) -> bool| {
        let first = (0..n_expert).position(held).unwrap_or(0);
        let end = (0..n_expert).rposition(held).map_or(first, |last| last + 1);
        first..end
    };
    match share {
        Share::Owned(owned) => span(&|e| owned.get(e).copied().unwrap_or(false)),
        Share::Balanced(_) => 0..n_expert,
        Share::Placed(p) => span(&|e| (0..p.n_layer()).any(|l| p.holds(rank, l, e))),
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
    /// `12 experts`, `experts dealt out per step`, `40 of 64 experts per layer (placed)`.
    pub fn describe(&self, rank: usize) -> String {
        match self {
            Share::Owned(o) => format!("{} experts", o.iter().filter(|&&x| x).count()),
            Share::Balanced(_) => "experts dealt out per step".into(),
            Share::Placed(p) => {
                let routed = p.holders.iter().filter(|l| !l.is_empty()).count().max(1);
                format!(
                    "{:.1} of {} experts per layer (placed)",
                    p.held_by(rank) as f64 / routed as f64,
                    p.n_expert
                )
            }
        }
    }

    /// Whether rank `rank` with this share may compute expert `.1` of layer `.0`: its owned
    /// experts, every expert when they are dealt out per step, or those a placement gives it.
    pub fn held(&self, rank: usize) -> super::HeldFn {
        match self {
            Share::Owned(owned) => {
                let owned = owned.clone();
                Arc::new(move |_, e| owned.get(e).copied().unwrap_or(false))
            }
            Share::Balanced(_) => Arc::new(|_, _| true),
            Share::Placed(p) => {
                let p = p.clone();
                Arc::new(move |l, e| p.holds(rank, l, e))
            }
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
            experts: needed_experts(self, rank, n_expert),
        };
        model
            .check_role(&role)
            .map_err(|e| ClusterError::Formation(e.to_string()))?;
        match (factory, self) {
            (Some(make), Share::Owned(owned)) => {
                let owned = owned.clone();
                make(
                    model,
                    Arc::new(move |_, e| owned.get(e).copied().unwrap_or(false)),
                )
                .map_err(ClusterError::Experts)
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
            (factory, Share::Placed(p)) => {
                let inner: SharedExperts = match factory {
                    Some(make) => {
                        let held = p.clone();
                        make(model, Arc::new(move |l, e| held.holds(rank, l, e)))
                            .map_err(ClusterError::Experts)?
                    }
                    None => Arc::new(OwnedResidentExperts::new(
                        Arc::clone(model),
                        vec![true; n_expert],
                    )),
                };
                Ok(Arc::new(PlacedExperts {
                    inner,
                    rank,
                    placement: p.clone(),
                }))
            }
        }
    }
}

/// A rank's experts under a placement: it computes, of each step's routed experts, those it
/// holds alone and those of its shared ones the dealing rule gives it; `inner` supplies the
/// weights (resident, or streamed for exactly the experts it holds).
struct PlacedExperts {
    inner: SharedExperts,
    rank: usize,
    placement: ExpertPlacement,
}

impl ExpertSource for PlacedExperts {
    fn owns(&self, layer: usize, expert: usize) -> bool {
        self.placement.holds(self.rank, layer, expert)
    }

    fn assign(&self, layer: usize, active: &[usize], tokens: &[usize]) -> Vec<usize> {
        let p = &self.placement;
        let rank_of = assign_to_holders(active, tokens, &p.weights, |e| p.holders_of(layer, e));
        assigned_to(self.rank, active, &rank_of)
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> model::Result<()> {
        self.inner.with_experts(layer, experts, sink)
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        let held: Vec<usize> = experts
            .iter()
            .copied()
            .filter(|&e| self.owns(layer, e))
            .collect();
        self.inner.prefetch(layer, &held);
    }

    fn lookahead(&self) -> bool {
        self.inner.lookahead()
    }

    fn stats(&self) -> Vec<(String, f64)> {
        self.inner.stats()
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
