//! What a status page shows of where the model runs: the kind of split, every node with its
//! layers or rank and the address it takes data links at, and the time the last work item
//! spent in each hop. Executors fill it from what they already track (registered peers, the
//! timings stages report with each result); nothing here is measured for it.

use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterKind {
    /// The whole model in this process.
    #[default]
    Local,
    /// Layer ranges on a chain of processes.
    Pipeline,
    /// Every layer on every rank, experts and heads split between them.
    TensorParallel,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClusterView {
    pub kind: ClusterKind,
    /// Every node a step needs is connected (a pipeline's route, a tensor-parallel group).
    pub complete: bool,
    /// This process first, then its peers (pipeline stages in layer order, ranks in order).
    pub nodes: Vec<NodeView>,
    /// Pipeline: the last work item's time in each stage, in route order (this process first).
    pub hops: Vec<HopTiming>,
    /// Pipeline: the last work item's time from its send returning to its result arriving
    /// (the next stage may have started on it before the send returned, so this can be less
    /// than the stages' own times).
    pub round_trip_us: Option<u64>,
    /// Tensor parallel: the last step's time on rank 0.
    pub tp_step: Option<TpStepTiming>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NodeView {
    /// `coordinator`, `stage` or `rank`.
    pub role: String,
    /// Layers it runs: `0:3`, `4:output`.
    pub layers: String,
    /// Its rank in a tensor-parallel group.
    pub rank: Option<usize>,
    /// Where it is reached: a worker's data address, rank 0's mesh port, a pipeline
    /// coordinator's registration address (none for a single node).
    pub address: Option<String>,
}

/// One stage's share of a pipeline work item.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HopTiming {
    pub stage: String,
    /// Waiting in the stage's queue.
    pub wait_us: u64,
    pub compute_us: u64,
    /// Encoding and handing the output on.
    pub send_us: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// One tensor-parallel step as rank 0 saw it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TpStepTiming {
    pub tokens: usize,
    pub step_us: u64,
    pub compute_us: u64,
    /// Gathering the logits rows from the ranks.
    pub gather_us: u64,
    pub exchanges: u64,
    /// All-reduce exchanges, in total.
    pub exchange_us: u64,
    /// The slowest other rank's exchange wait.
    pub slowest_rank_us: u64,
}

impl ClusterView {
    /// A single process running all `n_layer` layers.
    pub fn local(n_layer: usize) -> ClusterView {
        ClusterView {
            kind: ClusterKind::Local,
            complete: true,
            nodes: vec![NodeView {
                role: "local".into(),
                layers: crate::LayerRange::whole(n_layer).to_string(),
                rank: None,
                address: None,
            }],
            ..ClusterView::default()
        }
    }
}
