//! Messages of the pipeline's data path and control links. Work items travel downstream with
//! their hidden states as raw bytes after a small postcard header; results, snapshot parts and
//! stage errors travel back upstream, each stage adding its timing on the way.

use serde::{Deserialize, Serialize};

use engine::SeqWork;

use crate::activation::ActFormat;

/// Header of a `Work` frame; the activations (`n_rows × n_embd` in `act`) follow it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkHeader {
    pub seqs: Vec<SeqWork>,
    pub tokens: Vec<u32>,
    pub act: ActFormat,
    pub n_embd: u32,
    /// GLM-5.3 Flash: the indexer selection the next stage's first latent layer reuses (per
    /// row, the positions it attends to); empty for every other model and boundary.
    pub selection: model::IndexSelection,
}

/// One stage's share of a work item's time, reported back with the result.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HopTiming {
    pub stage: String,
    /// Time the item waited in the stage's queue.
    pub wait_us: u64,
    pub compute_us: u64,
    /// Time to encode and hand the output to the next hop (or the result upstream).
    pub send_us: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// Header of a `WorkResult` frame; `n_rows × n_vocab` f32 logits follow (none for an ack).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ResultHeader {
    pub n_rows: u32,
    pub n_vocab: u32,
    /// Batch row of each logits row.
    pub rows: Vec<u32>,
    /// Stages in route order.
    pub timings: Vec<HopTiming>,
}

impl ResultHeader {
    /// The header and raw rows of a work item's logits, before any stage adds its timing.
    pub fn of(l: &model::Logits) -> (ResultHeader, Vec<u8>) {
        let h = ResultHeader {
            n_rows: l.rows.len() as u32,
            n_vocab: l.n_vocab as u32,
            rows: l.rows.iter().map(|&r| r as u32).collect(),
            timings: Vec::new(),
        };
        (h, crate::wire::f32_bytes(&l.data))
    }
}

/// Why a stage could not complete a work item (sent upstream as a `WorkResult` with an error).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum StageFailure {
    /// The stage's history of a session differs: the coordinator replays it.
    Desync { stage: String, session: u64 },
    /// The next hop is gone: the coordinator rebuilds the route and replays.
    LinkLost { stage: String, detail: String },
    /// Anything else (bad input, a failing expert read): fails the request.
    Failed { stage: String, detail: String },
}

/// Session operations, in order with work on the data path.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum SessionOp {
    Destroy {
        session: u64,
    },
    /// Every stage sends `SnapshotPart`s for its layers (first `n` positions), then passes on.
    Snapshot {
        session: u64,
        n: u32,
    },
    /// Replace the session with `tokens`; the layers follow as `RestoreLayer` ops.
    Restore {
        session: u64,
        tokens: Vec<u32>,
    },
    RestoreLayer {
        session: u64,
        layer: u32,
        k: Vec<u8>,
        v: Vec<u8>,
    },
    /// Passes through every stage in order; the last one acknowledges it.
    Barrier,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SnapshotPart {
    pub session: u64,
    pub layer: u32,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

/// Coordinator → worker on the control link: where to send results of this stage.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Control {
    /// Route epoch `epoch`: forward to `next` (`None` for the last stage).
    Route {
        epoch: u64,
        next: Option<String>,
        act: ActFormat,
    },
    /// Drop every session (the route changed; the coordinator will replay).
    ResetSessions,
    Shutdown,
}

/// Worker → coordinator on the control link.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ControlReply {
    RouteReady { epoch: u64 },
    RouteFailed { epoch: u64, detail: String },
}

/// Flag on a `WorkResult` frame whose header is a [`StageFailure`] instead of a result.
pub const FLAG_FAILURE: u32 = 1;
