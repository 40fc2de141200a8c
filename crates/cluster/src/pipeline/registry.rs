//! Which workers a pipeline coordinator admits (stages of the same model whose layer ranges do
//! not overlap its own or each other's), and the route they form: a contiguous chain of ranges
//! from the coordinator's last layer to the head.

use std::sync::Arc;

use engine::LayerRange;

use crate::registry::{Admission, Member, Registry, check_peer};
use crate::wire::{Hello, Role, Welcome};

/// A registered worker: its layer range.
pub type Worker = Member<LayerRange>;

/// What the registry checks newcomers against.
#[derive(Clone)]
pub struct StageAdmission {
    pub fingerprint: String,
    pub n_layer: usize,
    /// Layers the coordinator itself runs: `0..=local_last`.
    pub local_last: usize,
    pub n_ctx: usize,
}

fn overlapping<'a>(r: &LayerRange, members: &'a [Arc<Worker>]) -> Option<&'a Arc<Worker>> {
    members
        .iter()
        .find(|w| r.first <= w.claim.last && w.claim.first <= r.last)
}

impl Admission for StageAdmission {
    type Claim = LayerRange;

    fn claim(&self, hello: &Hello, members: &[Arc<Worker>]) -> Result<LayerRange, String> {
        let Role::Stage { first, last, head } = hello.role.clone() else {
            return Err(
                "this coordinator runs a pipeline; the peer is not a pipeline stage".into(),
            );
        };
        check_peer(hello, &self.fingerprint, self.n_ctx)?;
        let first = first as usize;
        let last = if head {
            self.n_layer.saturating_sub(1)
        } else {
            last as usize
        };
        let range = LayerRange { first, last, head };
        if first > last || last >= self.n_layer {
            return Err(format!(
                "invalid layer range {range}: the model has layers 0..={}",
                self.n_layer.saturating_sub(1)
            ));
        }
        if first <= self.local_last {
            return Err(format!(
                "overlapping range {range}: the coordinator runs layers 0..={}",
                self.local_last
            ));
        }
        match self.conflict(&range, members) {
            Some(reason) => Err(reason),
            None => Ok(range),
        }
    }

    fn conflict(&self, range: &LayerRange, members: &[Arc<Worker>]) -> Option<String> {
        overlapping(range, members).map(|w| {
            format!(
                "overlapping range {range}: layers {} are already served by {}",
                w.claim, w.name
            )
        })
    }

    fn welcome(&self, range: &LayerRange) -> Welcome {
        Welcome {
            message: format!("serving layers {range}"),
            ..Default::default()
        }
    }

    fn describe(range: &LayerRange) -> String {
        format!("stage {range}")
    }
}

/// The chain of workers covering `local_last+1..` up to the head, or the first missing layer.
pub fn chain(registry: &Registry<StageAdmission>) -> Result<(Vec<Arc<Worker>>, u64), usize> {
    let (workers, generation) = registry.members();
    let expect = registry.admission();
    let mut next = expect.local_last + 1;
    let mut chain = Vec::new();
    loop {
        let Some(w) = workers.iter().find(|w| w.claim.first == next) else {
            return Err(next);
        };
        chain.push(Arc::clone(w));
        if w.claim.head {
            return Ok((chain, generation));
        }
        next = w.claim.last + 1;
        if next >= expect.n_layer {
            // Covers every layer but nobody holds the head.
            return Err(next);
        }
    }
}
