//! Which of a model's weights go to the GPU under a memory limit: the matrices every token
//! reads first (attention, routers, shared experts, dense FFNs, the output head), then the
//! routed experts layer by layer — whole layers while they fit, then single experts of the
//! layer where the limit falls. Embedding rows are gathered on the CPU and stay there, as do
//! formats without a GPU kernel.

use std::sync::Arc;

use model::{Model, WeightSelection};

use crate::{CudaOffload, GpuError, supports};

/// What [`upload_model`] put on the device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OffloadReport {
    /// Bytes of non-expert matrices on the device, and of those this process reads.
    pub dense_on_gpu: u64,
    pub dense_total: u64,
    /// Bytes of routed experts on the device, and of those this process reads.
    pub experts_on_gpu: u64,
    pub experts_total: u64,
    /// Bytes this process reads in formats without a GPU kernel (they stay on the CPU).
    pub unsupported: u64,
}

impl std::fmt::Display for OffloadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dense {} of {}, routed experts {} of {} on the GPU",
            size(self.dense_on_gpu),
            size(self.dense_total),
            size(self.experts_on_gpu),
            size(self.experts_total)
        )?;
        if self.unsupported > 0 {
            write!(
                f,
                " ({} in formats without a GPU kernel stay on the CPU)",
                size(self.unsupported)
            )?;
        }
        Ok(())
    }
}

/// GiB with two decimals, MiB below one GiB.
fn size(bytes: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (MIB * 1024.0))
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

struct Candidate<'m> {
    layer: Option<usize>,
    bytes: &'m [u8],
    /// Routed expert stacks: how many experts are stacked.
    n_expert: Option<usize>,
}

/// Uploads `sel`'s matrices of `model` to `device`, at most `budget` bytes, in the order the
/// module doc gives.
pub fn upload_model(
    device: &mut CudaOffload,
    model: &Arc<Model>,
    sel: &WeightSelection,
    budget: u64,
) -> Result<OffloadReport, GpuError> {
    let owner: Arc<dyn std::any::Any + Send + Sync> = model.clone();
    let mut report = OffloadReport::default();
    let tied = !model
        .files()
        .tensors()
        .any(|t| t.info.name.starts_with("output.weight"));
    let mut dense = Vec::new();
    let mut experts = Vec::new();
    for t in model.files().tensors() {
        let name = t.info.name.as_str();
        let dims = t.info.shape.dims();
        if dims.len() < 2 || dims[1] < 2 {
            continue; // vectors are dequantized to f32 at load
        }
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        let routed = name.contains("_exps.");
        let wanted = match layer {
            Some(il) => sel.layers.contains(&il) && (sel.experts || !routed),
            None => {
                sel.head
                    && (name.starts_with("output.") || (tied && name.starts_with("token_embd.")))
            }
        };
        if !wanted {
            continue;
        }
        let n = t.info.n_bytes;
        if !supports(t.info.dtype) {
            report.unsupported += n;
            continue;
        }
        let c = Candidate {
            layer,
            bytes: t.data(),
            n_expert: routed.then(|| dims.get(2).copied().unwrap_or(1) as usize),
        };
        if routed {
            report.experts_total += n;
            experts.push(c);
        } else {
            report.dense_total += n;
            dense.push(c);
        }
    }
    let mut left = budget;
    for c in &dense {
        let n = c.bytes.len() as u64;
        if n <= left {
            device.upload(owner.clone(), c.bytes)?;
            report.dense_on_gpu += n;
            left -= n;
        }
    }
    experts.sort_by_key(|c| c.layer);
    for layer in experts.chunk_by(|a, b| a.layer == b.layer) {
        let whole: u64 = layer.iter().map(|c| c.bytes.len() as u64).sum();
        if whole <= left {
            for c in layer {
                device.upload(owner.clone(), c.bytes)?;
            }
            report.experts_on_gpu += whole;
            left -= whole;
            continue;
        }
        // The limit falls inside this layer: as many whole experts (all their matrices) as fit.
        let n_expert = layer.iter().filter_map(|c| c.n_expert).min().unwrap_or(1);
        let per_expert: u64 = layer
            .iter()
            .map(|c| c.bytes.len() as u64 / n_expert as u64)
            .sum();
        for e in 0..n_expert {
            if per_expert > left {
                break;
            }
            for c in layer {
                let len = c.bytes.len() / n_expert;
                device.upload(owner.clone(), &c.bytes[e * len..(e + 1) * len])?;
            }
            report.experts_on_gpu += per_expert;
            left -= per_expert;
        }
        break;
    }
    Ok(report)
}
