//! Architectures, weight binding, the KV cache, the `ExpertSource` seam, and the one forward
//! path every execution mode (single node, pipeline stage, tensor-parallel rank, streaming)
//! runs.

pub mod arch;
mod attention_layer;
pub mod blocks;
mod dsv4;
pub mod error;
pub mod experts;
pub mod file_slice;
pub mod forward;
mod glm5next;
pub mod hparams;
pub mod kv;
pub mod layer_device;
mod model;
pub mod names;
pub mod pass;
pub mod profile;
pub mod shard;
pub mod weights;

pub use blocks::Compute;
pub use error::{ModelError, Result};
pub use experts::{
    BalancedResidentExperts, ExpertMatrices, ExpertSource, OwnedResidentExperts, ResidentExperts,
};
pub use file_slice::{FileSlice, RankPlacement, Role};
pub use hparams::Hparams;
pub use kv::{KvCache, KvLayout, KvType, SlidingLayers};
pub use layer_device::{DeviceStep, LayerDevice, PlanFfn, PlanLayer, WholeModelPlan};
pub use model::{Model, WeightSelection};
pub use pass::{
    Hooks, Logits, LogitsWanted, NoHooks, ReducePoint, SeqInput, StageInput, StageOutput,
};
pub use shard::Shard;
