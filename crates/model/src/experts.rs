//! The `ExpertSource` seam: where the routed experts of a layer come from. Resident (slices of
//! the map) here; streamed from disk and sharded across ranks elsewhere. The forward path only
//! asks for the experts the router chose, and only for those the source owns.

use kernels::Weights;

use crate::Model;
use crate::error::Result;

/// One expert's three projections.
#[derive(Clone, Copy)]
pub struct ExpertMatrices<'a> {
    pub gate: Weights<'a>,
    pub up: Weights<'a>,
    pub down: Weights<'a>,
}

/// Called with experts as they become available: `(expert id, matrices)` pairs.
pub type ExpertSink<'s> = dyn FnMut(&[(usize, ExpertMatrices<'_>)]) -> Result<()> + 's;

pub trait ExpertSource: Sync {
    /// Whether this source computes `expert` of `layer` (false for experts owned by another
    /// rank of a tensor-parallel group).
    fn owns(&self, layer: usize, expert: usize) -> bool;

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
