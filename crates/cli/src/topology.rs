//! Where this process sits in a deployment, decided once from the flags: alone, a pipeline
//! stage (the coordinator's range starts at layer 0, a worker's later), or a rank of a
//! tensor-parallel group. The share of the model it loads, the weights it warms and the
//! executor it runs all follow from this value.

use anyhow::{Context, bail};
use engine::{LayerRange, RangeSpec};
use model::{Model, Role, WeightSelection};

use crate::cluster_args::ClusterArgs;

/// Which side of a cluster the command is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// `run`, `chat`, `serve`, …: owns the sessions (layer 0, rank 0).
    Coordinator,
    /// `worker`: serves a later layer range or a rank above 0.
    Worker,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Topology {
    /// The whole model in this process.
    Local,
    /// A pipeline stage running `range`.
    Pipeline { range: RangeSpec },
    /// A rank of a group of `n_ranks`: rank 0 for the coordinator; a worker learns its rank when
    /// it registers.
    TensorParallel { n_ranks: usize, rank: Option<usize> },
}

impl Topology {
    /// The topology the flags ask for, refusing combinations that cannot work.
    pub fn from_flags(c: &ClusterArgs, side: Side) -> anyhow::Result<Topology> {
        if c.tensor_parallel {
            if c.layers.is_some() {
                bail!(
                    "--layers and --tensor-parallel cannot be combined: every rank runs every layer"
                );
            }
            if side == Side::Coordinator && c.listen.is_none() {
                bail!("--tensor-parallel needs --listen HOST:PORT for the ranks");
            }
            return Ok(Topology::TensorParallel {
                n_ranks: c.tp_size.max(1),
                rank: (side == Side::Coordinator).then_some(0),
            });
        }
        if side == Side::Coordinator {
            let group_only = [
                ("--expert-placement", c.expert_placement.is_some()),
                ("--tp-balance-experts", c.tp_balance_experts),
                ("--expert-weights", !c.expert_weights.is_empty()),
            ];
            if let Some((flag, _)) = group_only.iter().find(|(_, set)| *set) {
                bail!(
                    "{flag} places the experts of a tensor-parallel group: add --tensor-parallel"
                );
            }
        }
        match (side, c.layers, &c.listen) {
            (Side::Coordinator, None, None) => Ok(Topology::Local),
            (Side::Coordinator, Some(range), None) => {
                bail!(
                    "--layers {} needs --listen HOST:PORT for the workers",
                    show(&range)
                )
            }
            (Side::Coordinator, range, Some(_)) => {
                let range = range.unwrap_or(RangeSpec {
                    first: 0,
                    last: None,
                });
                if range.first != 0 {
                    bail!(
                        "--layers {}: the coordinator's range must start at layer 0",
                        show(&range)
                    );
                }
                Ok(Topology::Pipeline { range })
            }
            (Side::Worker, None, _) => {
                bail!("a worker needs --layers A:B or A:output (or --tensor-parallel)")
            }
            (Side::Worker, Some(range), _) => {
                if range.first == 0 {
                    bail!(
                        "--layers {}: layer 0 belongs to the coordinator",
                        show(&range)
                    );
                }
                Ok(Topology::Pipeline { range })
            }
        }
    }

    /// The rank and group size the model is loaded as (`None` for a worker rank before it
    /// registers).
    pub fn shard(&self) -> Option<(usize, usize)> {
        match self {
            Topology::TensorParallel { n_ranks, rank } => rank.map(|r| (r, *n_ranks)),
            _ => Some((0, 1)),
        }
    }

    /// The layers this process runs in a model of `n_layer` layers.
    pub fn layers(&self, n_layer: usize) -> anyhow::Result<LayerRange> {
        match self {
            Topology::Pipeline { range } => range
                .resolve(n_layer)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("--layers {}", show(range))),
            _ => Ok(LayerRange::whole(n_layer)),
        }
    }

    /// What this process runs, for checking a shard file against it. A rank's experts are
    /// known once the group is formed (the coordinator checks them then), so this asks only
    /// for every layer, the embeddings and the head.
    pub fn role(&self, model: &Model) -> anyhow::Result<Role> {
        Ok(match self {
            Topology::Local => Role::Whole,
            Topology::Pipeline { .. } => {
                let range = self.layers(model.n_layer())?;
                Role::Stage {
                    layers: range.layers(),
                    head: range.head,
                }
            }
            Topology::TensorParallel { n_ranks, rank } => Role::Rank {
                rank: rank.unwrap_or(0),
                n_ranks: *n_ranks,
                experts: 0..0,
            },
        })
    }

    /// What this process reads of `model`, for warming. Routed experts are left to fault in
    /// on first use when they are streamed or when a rank computes only its own.
    pub fn selection(&self, model: &Model, streaming: bool) -> anyhow::Result<WeightSelection> {
        let range = self.layers(model.n_layer())?;
        Ok(WeightSelection {
            embeddings: range.first == 0,
            head: range.head,
            layers: range.layers(),
            experts: !streaming && !matches!(self, Topology::TensorParallel { .. }),
        })
    }
}

fn show(r: &RangeSpec) -> String {
    match r.last {
        Some(l) => format!("{}:{l}", r.first),
        None => format!("{}:output", r.first),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(layers: Option<&str>, listen: bool, tp: bool) -> ClusterArgs {
        ClusterArgs {
            layers: layers.map(|l| l.parse().unwrap()),
            listen: listen.then(|| "127.0.0.1:0".to_string()),
            tensor_parallel: tp,
            tp_size: 3,
            ..ClusterArgs::default()
        }
    }

    #[test]
    fn expert_placement_flags_need_a_group() {
        let mut c = flags(None, false, false);
        c.expert_placement = Some("placement.txt".into());
        let err = Topology::from_flags(&c, Side::Coordinator)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--expert-placement") && err.contains("--tensor-parallel"),
            "{err}"
        );
        c.tensor_parallel = true;
        c.listen = Some("127.0.0.1:0".into());
        assert!(Topology::from_flags(&c, Side::Coordinator).is_ok());
    }

    #[test]
    fn flags_decide_the_topology_once() {
        use Side::*;
        let t = |l, listen, tp, side| Topology::from_flags(&flags(l, listen, tp), side);
        assert_eq!(t(None, false, false, Coordinator).unwrap(), Topology::Local);
        let p = t(Some("0:3"), true, false, Coordinator).unwrap();
        assert_eq!(p.layers(8).unwrap().to_string(), "0:3");
        assert_eq!(
            t(None, true, true, Coordinator).unwrap().shard(),
            Some((0, 3))
        );
        assert_eq!(t(None, false, true, Worker).unwrap().shard(), None);
        let w = t(Some("4:output"), false, false, Worker).unwrap();
        let sel = w.selection_for_layers(8);
        assert_eq!((sel.0, sel.1), (false, true));
        for (l, listen, tp, side) in [
            (Some("0:3"), false, false, Coordinator),
            (Some("2:3"), true, false, Coordinator),
            (Some("0:3"), true, true, Coordinator),
            (None, false, true, Coordinator),
            (None, false, false, Worker),
            (Some("0:output"), false, false, Worker),
        ] {
            assert!(
                t(l, listen, tp, side).is_err(),
                "{l:?} {listen} {tp} {side:?}"
            );
        }
        assert!(p.layers(2).is_err());
    }

    impl Topology {
        /// (embeddings, head) of the selection in a model of `n_layer` layers.
        fn selection_for_layers(&self, n_layer: usize) -> (bool, bool) {
            let r = self.layers(n_layer).unwrap();
            (r.first == 0, r.head)
        }
    }
}
