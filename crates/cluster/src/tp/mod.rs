//! Tensor/expert parallelism across N ranks: every rank runs the same tokens; routed experts
//! are sharded, attention is split by heads where it divides (else replicated), dense FFNs and
//! shared experts by columns, the output head by vocabulary; partial sums are all-reduced in a
//! fixed rank order so every rank holds identical hidden states.
//!
//! Files: `protocol` (commands and replies), `admission` (which ranks the coordinator
//! takes), `placement` (which experts a rank computes), `expert_plan` (placements planned from
//! measured routing), `group` (joining a group and one
//! lockstep step; rank 0 and workers join through the same function), `snapshot` (a session's
//! KV split by kv heads and merged back), `mesh` (the all-reduce), `coordinator` (rank 0's
//! executor: formation, retries, replay), `worker` (every other rank).

use std::sync::Arc;

use engine::SharedExperts;
use model::Model;

pub mod admission;
pub mod coordinator;
pub mod expert_plan;
pub mod group;
pub mod mesh;
pub mod placement;
pub mod protocol;
pub mod snapshot;
pub mod worker;

pub use coordinator::{TpConfig, TpExecutor};
pub use expert_plan::ExpertPlacement;
pub use placement::placement;
pub use worker::{TpWorkerConfig, run_tp_worker};

/// Whether a rank holds expert `.1` of layer `.0`.
pub type HeldFn = Arc<dyn Fn(usize, usize) -> bool + Send + Sync>;

/// Makes the expert source of a rank from its model and the experts it holds (SSD streaming).
pub type ExpertFactory =
    Arc<dyn Fn(&Arc<Model>, HeldFn) -> Result<SharedExperts, crate::error::BoxError> + Send + Sync>;

/// Makes a rank's offload device (a GPU) from its model and the experts it holds, with those
/// experts' weights on it. Only a rank's routed experts may leave its CPU: their partial sums
/// are added up across the group in one order, while attention inputs, norms and routing are
/// computed by every rank alike and must come out the same bits everywhere.
pub type OffloadFactory = Arc<
    dyn Fn(&Arc<Model>, HeldFn) -> Result<Arc<dyn kernels::Offload>, crate::error::BoxError>
        + Send
        + Sync,
>;

pub(crate) const BALANCE_NEEDS_RESIDENT: &str = "--tp-balance-experts needs resident experts: with --ssd-streaming each rank streams only the experts it owns";
