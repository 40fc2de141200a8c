//! Which of a model's weights go to the GPU under a memory limit: the matrices every token
//! reads first (attention, routers, shared experts, dense FFNs, the output head), then the
//! routed experts layer by layer — whole layers while they fit, then single experts of the
//! layer where the limit falls. Embedding rows are gathered on the CPU and stay there, as do
//! formats without a GPU kernel. When the device streams experts and some will stay on the
//! host, a buffer for copying them in comes out of the limit first, and the host's experts are
//! page-locked for those copies.

use std::sync::Arc;

use model::{Model, WeightSelection};

use crate::{CudaOffload, GpuError, supports};

/// What [`upload_model`] put on the device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OffloadReport {
    /// Bytes of non-expert matrices on the device, and of those this process reads.
    pub dense_on_gpu: u64,
    pub dense_total: u64,
    /// Bytes of routed experts on the device, and of those this process reads.
    pub experts_on_gpu: u64,
    pub experts_total: u64,
    /// Bytes this process reads in formats without a GPU kernel (they stay on the CPU).
    pub unsupported: u64,
    /// Device bytes set aside for routed experts copied in per call, and host bytes of routed
    /// experts page-locked for those copies.
    pub streaming_buffer: u64,
    pub host_locked: u64,
    /// With a routing profile: the share of its routes that reach routed experts on the
    /// device, as placed (hottest first) and as layer-by-layer placement would have placed them.
    pub routes_on_gpu: Option<(f64, f64)>,
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
        if self.streaming_buffer > 0 {
            write!(
                f,
                "; {} for experts copied in per prompt ({} of the host's page-locked)",
                size(self.streaming_buffer),
                size(self.host_locked)
            )?;
        }
        if let Some((placed, layered)) = self.routes_on_gpu {
            write!(
                f,
                "; placed hottest first by the routing profile: {:.1} % of its routes reach \
                 experts on the GPU ({:.1} % layer by layer)",
                100.0 * placed,
                100.0 * layered
            )?;
        }
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
    hot: Option<Hotness>,
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
    // A buffer for experts copied in per call, when some will stay on the host: the limit
    // given, or by default one layer's routed experts where what the dense weights leave holds
    // them and whole layers can run on the device (a prompt's step then copies each layer's
    // host experts in and stays on the device), else 256 MiB, half of what is left at most.
    // None when that could not hold one expert's three matrices (as `can_stream` counts
    // them): it would stream nothing.
    let experts_left: u64 = experts.iter().map(|c| c.bytes.len() as u64).sum();
    let largest_matrix = experts
        .iter()
        .map(|c| c.bytes.len() / c.n_expert.unwrap_or(1).max(1))
        .max()
        .unwrap_or(0);
    let smallest_useful = 3 * (largest_matrix as u64 + crate::streaming::STREAM_ALIGN as u64);
    if let Some(limit) = device.streaming_limit()
        && experts_left > left
    {
        let reserve = match limit {
            Some(limit) => (limit as u64).min(left),
            None => {
                let layer = layer_staging_bytes(&experts);
                if layer <= left && model.whole_model_plan().is_ok() {
                    layer
                } else {
                    DEFAULT_STREAMING_BUFFER.min(left / 2)
                }
            }
        };
        if reserve >= smallest_useful {
            device.set_streaming_capacity(reserve as usize);
            report.streaming_buffer = reserve;
            left -= reserve;
        }
    }
    let every = |_: usize, _: usize| true;
    let host_experts = upload_routed(device, &owner, &mut experts, left, &every, hot, &mut report)?;
    if report.streaming_buffer > 0 {
        report.host_locked = lock_host_experts(device, &owner, &host_experts);
    }
    Ok(report)
}

/// Uploads the routed experts `held` marks (layer, expert) of `model` to `device`, at most
/// `budget` bytes, layer by layer and in expert order, each run of consecutive held experts of a
/// stacked tensor in one piece: a tensor-parallel rank's share, whose partial sums the group
/// adds up, so the rank's GPU changes no value any other rank must compute the same way (its
/// attention, norms and routing stay on the CPU). Nothing else is uploaded and nothing is
/// streamed: the rank's held experts that do not fit run on its CPU.
pub fn upload_held_experts(
    device: &mut CudaOffload,
    model: &Arc<Model>,
    budget: u64,
    held: &dyn Fn(usize, usize) -> bool,
    hot: Option<Hotness>,
) -> Result<OffloadReport, GpuError> {
    let owner: Arc<dyn std::any::Any + Send + Sync> = model.clone();
    let mut report = OffloadReport::default();
    let mut stacks = Vec::new();
    for t in model.files().tensors() {
        let name = t.info.name.as_str();
        let dims = t.info.shape.dims();
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        let (Some(layer), true, Some(&n_expert)) = (layer, name.contains("_exps."), dims.get(2))
        else {
            continue;
        };
        let n_expert = (n_expert as usize).max(1);
        let per_expert = t.info.n_bytes as usize / n_expert;
        let held_bytes = (0..n_expert).filter(|&e| held(layer, e)).count() * per_expert;
        report.experts_total += held_bytes as u64;
        if !supports(t.info.dtype) {
            report.unsupported += held_bytes as u64;
            continue;
        }
        stacks.push(Candidate {
            layer: Some(layer),
            bytes: t.data(),
            n_expert: Some(n_expert),
        });
    }
    upload_routed(device, &owner, &mut stacks, budget, held, hot, &mut report)?;
    Ok(report)
}

/// Uploads the routed expert stacks' experts that `candidate` marks, within `budget`, in
/// [`chosen_uploads`]' order, one device allocation per layer; counts them (and, with `hot`,
/// the profile's share of routes on the device) in `report`. Returns the pieces of the stacks
/// left on the host.
fn upload_routed<'m>(
    device: &mut CudaOffload,
    owner: &Arc<dyn std::any::Any + Send + Sync>,
    stacks: &mut [Candidate<'m>],
    budget: u64,
    candidate: &dyn Fn(usize, usize) -> bool,
    hot: Option<Hotness>,
    report: &mut OffloadReport,
) -> Result<Vec<&'m [u8]>, GpuError> {
    stacks.sort_by_key(|c| c.layer);
    let layers: Vec<&[Candidate<'m>]> = stacks.chunk_by(|a, b| a.layer == b.layer).collect();
    let shape: Vec<(usize, usize, u64)> = layers
        .iter()
        .map(|layer| {
            let n_expert = layer.iter().filter_map(|c| c.n_expert).min().unwrap_or(1);
            let n_expert = n_expert.max(1);
            let per_expert = layer.iter().map(|c| (c.bytes.len() / n_expert) as u64);
            (layer[0].layer.unwrap_or(0), n_expert, per_expert.sum())
        })
        .collect();
    let uploads = chosen_uploads(&shape, budget, candidate, hot);
    if let Some(hot) = hot {
        let layered = chosen_uploads(&shape, budget, candidate, None);
        report.routes_on_gpu = route_shares(&shape, candidate, &uploads, &layered, hot);
    }
    let mut on_gpu = vec![Vec::new(); layers.len()];
    for (i, run) in uploads {
        on_gpu[i].push(run);
    }
    let mut host = Vec::new();
    for ((layer, &(il, n_expert, per_expert)), runs) in layers.iter().zip(&shape).zip(&on_gpu) {
        device.upload_pieces(owner.clone(), &stack_pieces(layer, n_expert, runs))?;
        report.experts_on_gpu += per_expert * runs.iter().map(|r| r.len() as u64).sum::<u64>();
        let left = held_runs(n_expert, |e| {
            candidate(il, e) && !runs.iter().any(|r| r.contains(&e))
        });
        host.extend(stack_pieces(layer, n_expert, &left));
    }
    Ok(host)
}

/// How often the routing profile saw each (layer, expert) routed (`--expert-profile`).
pub type Hotness<'a> = &'a dyn Fn(usize, usize) -> u64;

/// Which experts `candidate` marks go up within `budget`, as runs per entry of `layers`
/// ((layer, experts, bytes of one expert's matrices) each). Without `hot`, layer by layer in
/// expert order: the run where the budget runs out is cut there and nothing after it goes
/// (whole layers then keep every expert on the device, and need no host at all in decode).
/// With `hot`, the hottest first wherever they lie (ties by layer, then expert; an expert too
/// big for what is left is passed over for a smaller one after it). Returns (index into
/// `layers`, experts), by layer and expert.
fn chosen_uploads(
    layers: &[(usize, usize, u64)],
    budget: u64,
    candidate: &dyn Fn(usize, usize) -> bool,
    hot: Option<Hotness>,
) -> Vec<(usize, std::ops::Range<usize>)> {
    let mut left = budget;
    let mut out = Vec::new();
    let Some(hot) = hot else {
        for (i, &(il, n_expert, per_expert)) in layers.iter().enumerate() {
            for run in held_runs(n_expert, |e| candidate(il, e)) {
                let fit = (left / per_expert.max(1)).min(run.len() as u64) as usize;
                if fit > 0 {
                    out.push((i, run.start..run.start + fit));
                    left -= per_expert * fit as u64;
                }
                if fit < run.len() {
                    return out;
                }
            }
        }
        return out;
    };
    let mut order: Vec<(u64, usize, usize)> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, &(il, n_expert, _))| {
            (0..n_expert)
                .filter(move |&e| candidate(il, e))
                .map(move |e| (hot(il, e), i, e))
        })
        .collect();
    order.sort_by_key(|&(count, i, e)| (std::cmp::Reverse(count), i, e));
    let mut chosen: Vec<Vec<bool>> = layers.iter().map(|l| vec![false; l.1]).collect();
    for (_, i, e) in order {
        let per_expert = layers[i].2;
        if per_expert <= left {
            chosen[i][e] = true;
            left -= per_expert;
        }
    }
    for (i, c) in chosen.iter().enumerate() {
        out.extend(held_runs(c.len(), |e| c[e]).into_iter().map(|r| (i, r)));
    }
    out
}

/// The pieces of a layer's expert stacks that hold the experts of `runs`: each stack whole
/// when one run is all of its experts.
fn stack_pieces<'m>(
    layer: &[Candidate<'m>],
    n_expert: usize,
    runs: &[std::ops::Range<usize>],
) -> Vec<&'m [u8]> {
    let mut pieces = Vec::new();
    for c in layer {
        for run in runs {
            if run.start == 0 && run.end >= n_expert {
                pieces.push(c.bytes);
                continue;
            }
            let len = c.bytes.len() / n_expert.max(1);
            pieces.push(&c.bytes[run.start * len..run.end * len]);
        }
    }
    pieces
}

/// The share of the profile's routes to `candidate` experts (of `layers`) that reach experts
/// `uploads` put on the device, and that the layer-by-layer order's `layered` would have;
/// `None` for a profile without such routes.
fn route_shares(
    layers: &[(usize, usize, u64)],
    candidate: &dyn Fn(usize, usize) -> bool,
    uploads: &[(usize, std::ops::Range<usize>)],
    layered: &[(usize, std::ops::Range<usize>)],
    hot: Hotness,
) -> Option<(f64, f64)> {
    let routes = |runs: &[(usize, std::ops::Range<usize>)]| -> u64 {
        runs.iter()
            .flat_map(|(i, r)| r.clone().map(move |e| hot(layers[*i].0, e)))
            .sum()
    };
    let total: u64 = layers
        .iter()
        .flat_map(|&(il, n, _)| {
            (0..n)
                .filter(move |&e| candidate(il, e))
                .map(move |e| hot(il, e))
        })
        .sum();
    (total > 0).then(|| {
        (
            routes(uploads) as f64 / total as f64,
            routes(layered) as f64 / total as f64,
        )
    })
}

/// The runs of consecutive experts of `0..n_expert` that `held` marks.
fn held_runs(n_expert: usize, held: impl Fn(usize) -> bool) -> Vec<std::ops::Range<usize>> {
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for e in (0..n_expert).filter(|&e| held(e)) {
        match runs.last_mut() {
            Some(r) if r.end == e => r.end += 1,
            _ => runs.push(e..e + 1),
        }
    }
    runs
}

/// The streaming buffer when one layer's experts do not fit it or whole layers cannot run.
const DEFAULT_STREAMING_BUFFER: u64 = 256 << 20;

/// Bytes of the buffer that holds the largest layer's routed experts, each matrix of each
/// expert at its own [`crate::streaming::STREAM_ALIGN`]ed offset (as the whole-model step lays
/// them out; a fused gate/up stack is two matrices an expert, hence one alignment's slack more).
fn layer_staging_bytes(experts: &[Candidate]) -> u64 {
    let align = crate::streaming::STREAM_ALIGN;
    let mut per_layer = std::collections::BTreeMap::<Option<usize>, u64>::new();
    for c in experts {
        let n = c.n_expert.unwrap_or(1).max(1);
        let one = (c.bytes.len() / n).next_multiple_of(align) + align;
        *per_layer.entry(c.layer).or_default() += (one * n) as u64;
    }
    per_layer.into_values().max().unwrap_or(0)
}

/// Page-locks the routed experts left on the host, so that copying them in for a prompt runs
/// at the link's speed: neighbouring tensors merged into whole-page ranges (a page may hold the
/// end of one and the start of the next). Skipped when they are more than half of the memory
/// the host has available (locking would crowd out the page cache that serves them), and
/// where the driver refuses (copies are then staged, slower), and with
/// `MOESHARD_GPU_LOCK_HOST=0` (how the staged copies are measured). Returns the bytes locked.
fn lock_host_experts(
    device: &mut CudaOffload,
    owner: &Arc<dyn std::any::Any + Send + Sync>,
    host_experts: &[&[u8]],
) -> u64 {
    if std::env::var("MOESHARD_GPU_LOCK_HOST").is_ok_and(|v| v == "0") {
        return 0;
    }
    let ranges: Vec<(usize, usize)> = host_experts
        .iter()
        .map(|b| (b.as_ptr() as usize, b.len()))
        .collect();
    let merged = crate::streaming::page_spans(&ranges, crate::streaming::host_page_size());
    let total: u64 = merged.iter().map(|r| r.len() as u64).sum();
    let gib = total as f64 / (1u64 << 30) as f64;
    match available_memory() {
        None => {
            eprintln!(
                "routed experts on the host ({gib:.2} GiB) not page-locked: the memory available \
                 is unknown here; copies to the GPU are staged"
            );
            return 0;
        }
        Some(avail) if total > avail / 2 => {
            eprintln!(
                "routed experts on the host ({gib:.2} GiB) not page-locked: more than half the \
                 memory available; copies to the GPU are staged"
            );
            return 0;
        }
        Some(_) => {}
    }
    let mut locked = 0u64;
    for pages in merged {
        // The pages hold the model's tensors (their files' maps or buffers, which `owner`
        // keeps), rounded out to whole pages.
        match device.lock_host(owner.clone(), pages) {
            Ok(n) => locked += n as u64,
            Err(e) => {
                eprintln!(
                    "routed experts on the host not page-locked ({e}); copies to the GPU are staged"
                );
                break;
            }
        }
    }
    locked
}

/// MemAvailable of /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(layer: usize, bytes: &[u8], n_expert: usize) -> Candidate<'_> {
        Candidate {
            layer: Some(layer),
            bytes,
            n_expert: Some(n_expert),
        }
    }

    #[test]
    fn held_experts_go_up_layer_by_layer_while_the_budget_lasts() {
        // Two layers of 8 experts of 10 bytes; the rank holds experts 0-2 and 5 of each.
        let layers = [(0, 8, 10), (1, 8, 10)];
        let held = |_: usize, e: usize| e < 3 || e == 5;
        assert_eq!(
            chosen_uploads(&layers, 1000, &held, None),
            vec![(0, 0..3), (0, 5..6), (1, 0..3), (1, 5..6)]
        );
        // 55 bytes: layer 0's four, then one of layer 1's first run, and nothing after it.
        assert_eq!(
            chosen_uploads(&layers, 55, &held, None),
            vec![(0, 0..3), (0, 5..6), (1, 0..1)]
        );
        // Too little for one expert.
        assert!(chosen_uploads(&layers, 9, &held, None).is_empty());
        // Placements differ per layer.
        let placed = |l: usize, e: usize| if l == 0 { e == 7 } else { e.is_multiple_of(2) };
        assert_eq!(
            chosen_uploads(&layers, 1000, &placed, None),
            vec![(0, 7..8), (1, 0..1), (1, 2..3), (1, 4..5), (1, 6..7)]
        );
    }

    #[test]
    fn with_a_profile_the_hottest_experts_go_up_first_wherever_they_lie() {
        // Three layers of 4 experts of 10 bytes; layer 1's expert 2 is the hottest, then
        // layer 2's 0 and 3, then layer 0's 1; the rest were never routed.
        let layers = [(0, 4, 10), (1, 4, 10), (2, 4, 10)];
        let counts = |l: usize, e: usize| match (l, e) {
            (1, 2) => 50,
            (2, 0) | (2, 3) => 20,
            (0, 1) => 5,
            _ => 0,
        };
        let every = |_: usize, _: usize| true;
        assert_eq!(
            chosen_uploads(&layers, 35, &every, Some(&counts)),
            vec![(1, 2..3), (2, 0..1), (2, 3..4)]
        );
        // Past the routed ones, the cold in layer and expert order; runs merge.
        assert_eq!(
            chosen_uploads(&layers, 60, &every, Some(&counts)),
            vec![(0, 0..3), (1, 2..3), (2, 0..1), (2, 3..4)]
        );
        // Without a profile, the same budget fills layer 0 and half of layer 1.
        assert_eq!(
            chosen_uploads(&layers, 60, &every, None),
            vec![(0, 0..4), (1, 0..2)]
        );
        // A rank's held experts only, hottest first.
        let held = |_: usize, e: usize| e.is_multiple_of(2);
        assert_eq!(
            chosen_uploads(&layers, 20, &held, Some(&counts)),
            vec![(1, 2..3), (2, 0..1)]
        );
        // An expert too big for what is left is passed over for a smaller one.
        let mixed = [(0, 2, 30), (1, 2, 10)];
        let hot_first = |l: usize, e: usize| if l == 0 { 9 - e as u64 } else { 1 };
        assert_eq!(
            chosen_uploads(&mixed, 45, &every, Some(&hot_first)),
            vec![(0, 0..1), (1, 0..1)]
        );
    }

    #[test]
    fn route_shares_count_the_profile_s_routes_on_the_device() {
        let layers = [(0, 4, 10), (1, 4, 10)];
        let counts = |l: usize, e: usize| if l == 1 && e == 3 { 60 } else { 5 };
        let every = |_: usize, _: usize| true;
        let placed = chosen_uploads(&layers, 40, &every, Some(&counts));
        let layered = chosen_uploads(&layers, 40, &every, None);
        // 95 routes: 60 on (1, 3), 5 on each other; placed takes (1, 3) and three of the
        // fives, layered takes layer 0's four.
        let (p, l) = route_shares(&layers, &every, &placed, &layered, &counts).unwrap();
        assert!((p - 75.0 / 95.0).abs() < 1e-12, "{p}");
        assert!((l - 20.0 / 95.0).abs() < 1e-12, "{l}");
        assert_eq!(
            route_shares(&layers, &every, &placed, &layered, &|_, _| 0),
            None
        );
        // A rank's share counts the routes to the experts it holds only: of layer 1's odd
        // experts (5 + 60), (1, 3) is on the device.
        let odd_of_1 = |l: usize, e: usize| l == 1 && e % 2 == 1;
        let placed = chosen_uploads(&layers, 10, &odd_of_1, Some(&counts));
        let layered = chosen_uploads(&layers, 10, &odd_of_1, None);
        let (p, l) = route_shares(&layers, &odd_of_1, &placed, &layered, &counts).unwrap();
        assert!((p - 60.0 / 65.0).abs() < 1e-12, "{p}");
        assert!((l - 5.0 / 65.0).abs() < 1e-12, "{l}");
    }

    #[test]
    fn a_layer_s_pieces_are_its_runs_in_every_stack() {
        let gate: Vec<u8> = (0..40).collect();
        let down: Vec<u8> = (100..140).collect();
        let layer = [stack(0, &gate, 4), stack(0, &down, 4)];
        let pieces = stack_pieces(&layer, 4, &[0..1, 2..4]);
        let want: [&[u8]; 4] = [&gate[0..10], &gate[20..40], &down[0..10], &down[20..40]];
        assert_eq!(pieces, want);
        let whole = stack_pieces(&layer, 4, std::slice::from_ref(&(0..4)));
        assert_eq!(whole, [&gate[..], &down[..]]);
        assert!(stack_pieces(&layer, 4, &[]).is_empty());
    }

    #[test]
    fn held_experts_go_up_in_runs() {
        assert_eq!(held_runs(8, |e| e < 4), vec![0..4]);
        assert_eq!(held_runs(8, |e| e % 3 != 1), vec![0..1, 2..4, 5..7]);
        assert_eq!(
            held_runs(4, |_| false),
            Vec::<std::ops::Range<usize>>::new()
        );
        assert_eq!(held_runs(5, |_| true), vec![0..5]);
    }

    #[test]
    fn the_staging_buffer_holds_the_largest_layer_with_each_matrix_aligned() {
        // Layer 0: gate, up and down stacks of 4 experts of 512 bytes (aligned already);
        // layer 1: 4 experts of 300 bytes each (rounded to 512, plus the slack a fused gate/up
        // stack would need).
        let aligned = vec![0u8; 4 * 512];
        let odd = vec![0u8; 4 * 300];
        let align = crate::streaming::STREAM_ALIGN as u64;
        let experts = [
            stack(0, &aligned, 4),
            stack(0, &aligned, 4),
            stack(0, &aligned, 4),
            stack(1, &odd, 4),
            stack(1, &odd, 4),
            stack(1, &odd, 4),
        ];
        let layer0 = 3 * 4 * (512 + align);
        let layer1 = 3 * 4 * (512 + align);
        assert_eq!(layer_staging_bytes(&experts), layer0.max(layer1));
        // Every layout the whole-model step makes fits: matrices one after the other, each at
        // an aligned offset, a fused gate/up stack as two matrices an expert.
        for half in [1u64, 100, 256, 300, 1000, 4608] {
            let laid_out = 2 * half.next_multiple_of(align);
            assert!(
                laid_out <= (2 * half).next_multiple_of(align) + align,
                "{half}"
            );
        }
        assert_eq!(layer_staging_bytes(&[]), 0);
    }
}
