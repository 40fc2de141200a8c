//! Routed experts the device does not hold, in a whole-model step. A step of many rows (a
//! prompt's) copies each layer's from the host into the streaming buffer as the step reaches
//! the layer, on a stream of their own: the copy overlaps the layer's attention and routing,
//! the layer's expert launches wait for it, and the next layer's copy waits for those launches
//! (one buffer, reused by every layer). In the buffer a layer's host experts lie in host order,
//! so that the copies of a layer merge into one per contiguous run (three for a layer of
//! stacked experts).
//!
//! Copying every host expert of a layer pays only when the step's rows keep them busy: only
//! steps where the average routed expert serves at least `--gpu-stream-min` rows copy. In a
//! smaller step (decode) the host computes its experts instead: the device routes the layer,
//! its normed rows and routing come back, the CPU runs the host's experts the rows picked while
//! the device runs its own, and the CPU's weighted sums go in to meet the device's, all through
//! page-locked memory the device maps, each side waiting on a flag the other sets (handoff.rs:
//! no copy, event or launch of the host's between a layer's routing and its sum). In a one-row
//! step the device can also take a few of the row's host experts (`--gpu-host-read`):
//! once the routing is out the host copies their weights into their places in the buffer, and
//! the device computes them while the CPU computes the rest (the link and the CPU's memory
//! bandwidth add up; kernels reading them in mapped host memory instead were measured at
//! 15 GB/s, too slow: docs/perf.md).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use model::{Model, PlanFfn, PlanLayer};

use crate::cuda::CudaOffload;
use crate::streaming::STREAM_ALIGN;
use crate::{HostRead, HostReadPlan};

/// One copy of a layer's: `len` bytes from host address `host` to `offset` in the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Copy {
    pub(super) host: usize,
    pub(super) offset: usize,
    pub(super) len: usize,
}

/// Where a model's host experts go in the buffer, worked out before its tables are built.
pub(super) struct Layout {
    /// The buffer's device address, when the device streams experts.
    base: Option<u64>,
    /// (Layer, host address) of each host expert matrix → its device address in the buffer.
    at: HashMap<(usize, usize), u64>,
    /// Per layer, its copies.
    copies: Vec<Vec<Copy>>,
    /// Per layer, which of its experts are the host's (empty for a layer with none).
    on_host: Vec<Vec<bool>>,
    /// Per layer and expert, the copies of its host matrices to their places in the buffer.
    expert_copies: Vec<Vec<Vec<Copy>>>,
    /// The fewest rows of a step that copies (the most any copying layer needs).
    min_rows: usize,
    bytes: usize,
}

impl Layout {
    /// The layout of `layers`' host experts (those `dev` does not hold) in the streaming
    /// buffer `staging` (address, capacity, rows per expert from which experts are copied);
    /// without one, nothing is placed (and the model cannot run whole). `Err` when a layer's
    /// host experts do not fit the buffer, or are not in page-locked memory.
    pub(super) fn new(
        dev: &CudaOffload,
        staging: Option<(u64, usize, usize)>,
        layers: &[PlanLayer],
    ) -> Result<Layout, String> {
        let mut layout = Layout {
            base: staging.map(|s| s.0),
            at: HashMap::new(),
            copies: vec![Vec::new(); layers.len()],
            on_host: vec![Vec::new(); layers.len()],
            expert_copies: vec![Vec::new(); layers.len()],
            min_rows: 0,
            bytes: 0,
        };
        let Some((base, capacity, from)) = staging else {
            return Ok(layout);
        };
        for (il, l) in layers.iter().enumerate() {
            let PlanFfn::Moe { experts, k, .. } = &l.ffn else {
                continue;
            };
            let on_host: Vec<bool> = experts
                .iter()
                .map(|x| {
                    [x.gate.data, x.up.data, x.down.data]
                        .iter()
                        .any(|b| dev.device_address(b).is_none())
                })
                .collect();
            if !on_host.contains(&true) {
                continue;
            }
            let mut host: Vec<&[u8]> = experts
                .iter()
                .zip(&on_host)
                .filter(|(_, h)| **h)
                .flat_map(|(x, _)| [x.gate.data, x.up.data, x.down.data])
                .filter(|b| dev.device_address(b).is_none())
                .collect();
            host.sort_by_key(|b| b.as_ptr() as usize);
            // A copy from pageable memory waits for the stream before it starts: the host
            // would stall at every layer, and the step would lose to the per-matrix path.
            if let Some(b) = host.iter().find(|b| !dev.is_page_locked(b)) {
                return Err(format!(
                    "layer {il}'s routed experts on the host are not page-locked (a {}-byte \
                     matrix at {:p}): their copies would stall every layer",
                    b.len(),
                    b.as_ptr()
                ));
            }
            let (ranges, used) = place_in_order(&host);
            if used > capacity {
                return Err(format!(
                    "layer {il}'s routed experts on the host ({:.1} MiB) are more than the \
                     streaming buffer holds ({:.1} MiB)",
                    used as f64 / (1 << 20) as f64,
                    capacity as f64 / (1 << 20) as f64
                ));
            }
            for (b, &offset) in host.iter().zip(&ranges) {
                layout
                    .at
                    .insert((il, b.as_ptr() as usize), base + offset as u64);
            }
            layout.copies[il] = merge_copies(&host, &ranges);
            layout.expert_copies[il] = experts
                .iter()
                .zip(&on_host)
                .map(|(x, &h)| {
                    [x.gate.data, x.up.data, x.down.data]
                        .into_iter()
                        .filter(|b| h && dev.device_address(b).is_none())
                        .filter_map(|b| {
                            let at = layout.at.get(&(il, b.as_ptr() as usize))?;
                            Some(Copy {
                                host: b.as_ptr() as usize,
                                offset: (at - base) as usize,
                                len: b.len(),
                            })
                        })
                        .collect()
                })
                .collect();
            layout.on_host[il] = on_host;
            layout.bytes += host.iter().map(|b| b.len()).sum::<usize>();
            let n_expert = experts.len();
            layout.min_rows = layout.min_rows.max((from * n_expert).div_ceil((*k).max(1)));
        }
        Ok(layout)
    }

    /// Which of layer `il`'s experts are the host's; `None` for a layer with none.
    pub(super) fn on_host(&self, il: usize) -> Option<&[bool]> {
        self.on_host
            .get(il)
            .filter(|h| !h.is_empty())
            .map(Vec::as_slice)
    }

    /// The device address of layer `il`'s host expert matrix in the buffer; `None` for
    /// matrices the device holds, and when nothing is streamed.
    pub(super) fn address(&self, il: usize, bytes: &[u8]) -> Option<u64> {
        self.at.get(&(il, bytes.as_ptr() as usize)).copied()
    }

    /// The copies and the stream and events they run with; `None` when the device holds every
    /// routed expert (or streams none).
    pub(super) fn finish(
        self,
        ctx: &Arc<CudaContext>,
        model: &Arc<Model>,
        read: HostRead,
    ) -> Result<Option<HostExperts>, String> {
        if self.on_host.iter().all(Vec::is_empty) {
            return Ok(None);
        }
        let err = |what: &str, e: cudarc::driver::DriverError| format!("{what}: {e}");
        let stream = ctx
            .new_stream()
            .map_err(|e| err("creating the copy stream", e))?;
        let copy_per_expert = match (read, self.base) {
            (HostRead::Auto, Some(base)) => time_expert_copies(&self.expert_copies, base, &stream)
                .map_err(|e| err("timing the link", e))?,
            _ => None,
        };
        let plan = HostReadPlan::new(read, copy_per_expert);
        Ok(Some(HostExperts {
            copies: self.copies,
            expert_copies: self.expert_copies,
            on_host: self.on_host,
            base: self.base.unwrap_or(0),
            min_rows: self.min_rows,
            bytes: self.bytes,
            read: Mutex::new(plan),
            stream,
            ready: ctx
                .new_event(None)
                .map_err(|e| err("creating an event", e))?,
            free: ctx
                .new_event(None)
                .map_err(|e| err("creating an event", e))?,
            _owner: model.clone(),
        }))
    }
}

/// Experts copied to time the link: a few megabytes, enough for its rate and not its latency.
const TIMED_EXPERTS: usize = 4;

/// The time to copy one host expert from page-locked memory into the buffer at `base`: the
/// copies of the first [`TIMED_EXPERTS`] host experts of the first layer that has them, timed
/// on the second of two rounds (the first pays for the driver's first use of the pages).
/// `None` when no layer has a host expert to copy. Nothing reads the buffer yet.
fn time_expert_copies(
    expert_copies: &[Vec<Vec<Copy>>],
    base: u64,
    stream: &CudaStream,
) -> Result<Option<Duration>, cudarc::driver::DriverError> {
    let Some(experts) = expert_copies
        .iter()
        .map(|layer| {
            layer
                .iter()
                .filter(|e| !e.is_empty())
                .take(TIMED_EXPERTS)
                .collect::<Vec<_>>()
        })
        .find(|e| !e.is_empty())
    else {
        return Ok(None);
    };
    let cu = stream.cu_stream();
    let mut took = Duration::ZERO;
    for _round in 0..2 {
        let t0 = std::time::Instant::now();
        for c in experts.iter().copied().flatten() {
            // SAFETY: as in `HostExperts::copy_in`: the range lies in the model's tensors,
            // kept mapped by the caller's model; the destination is the matrix's place in the
            // buffer (inside its capacity), which no kernel reads while the model is built.
            unsafe {
                let src = std::slice::from_raw_parts(c.host as *const u8, c.len);
                cudarc::driver::result::memcpy_htod_async(base + c.offset as u64, src, cu)?;
            }
        }
        stream.synchronize()?;
        took = t0.elapsed();
    }
    Ok(Some(took / experts.len() as u32))
}

/// Offsets for `host` (in host order) one after the other, each at a multiple of
/// [`STREAM_ALIGN`]; and the bytes they take.
fn place_in_order(host: &[&[u8]]) -> (Vec<usize>, usize) {
    let mut used = 0;
    let offsets = host
        .iter()
        .map(|b| {
            let at = used;
            used = (at + b.len()).next_multiple_of(STREAM_ALIGN);
            at
        })
        .collect();
    (offsets, used)
}

/// One copy per run of matrices contiguous both on the host and in the buffer.
fn merge_copies(host: &[&[u8]], offsets: &[usize]) -> Vec<Copy> {
    let mut copies: Vec<Copy> = Vec::new();
    for (b, &offset) in host.iter().zip(offsets) {
        let h = b.as_ptr() as usize;
        match copies.last_mut() {
            Some(c) if c.host + c.len == h && c.offset + c.len == offset => c.len += b.len(),
            _ => copies.push(Copy {
                host: h,
                offset,
                len: b.len(),
            }),
        }
    }
    copies
}

/// A model's host experts as its whole-model steps copy them.
pub(super) struct HostExperts {
    copies: Vec<Vec<Copy>>,
    expert_copies: Vec<Vec<Vec<Copy>>>,
    /// Per layer, which experts are the host's (empty for a layer with none).
    on_host: Vec<Vec<bool>>,
    base: u64,
    /// Steps of fewer rows compute the host's experts on the host; larger ones copy them in.
    pub(super) min_rows: usize,
    /// Bytes a step copies.
    pub(super) bytes: usize,
    /// In a one-row step that computes host experts, how many of the row's host slots (the
    /// first in slot order) the device computes itself, their weights copied into the buffer
    /// once the routing is back, while the CPU computes the others (host_read.rs).
    read: Mutex<HostReadPlan>,
    stream: Arc<CudaStream>,
    /// The layer's copies are in; the buffer's last readers are done.
    ready: CudaEvent,
    free: CudaEvent,
    /// Keeps the host pages the copies read mapped.
    _owner: Arc<Model>,
}

impl HostExperts {
    /// Which of layer `il`'s experts are the host's; `None` for a layer with none.
    pub(super) fn on_host(&self, il: usize) -> Option<&[bool]> {
        self.on_host
            .get(il)
            .filter(|h| !h.is_empty())
            .map(Vec::as_slice)
    }

    /// How many of a row's host experts the device computes in the next one-row step.
    pub(super) fn per_row(&self) -> usize {
        self.read.lock().map_or(0, |p| p.per_row())
    }

    /// The CPU computed a one-row step's layer of `experts` host experts alone in `took`
    /// (what `--gpu-host-read auto` measures before it chooses).
    pub(super) fn record_cpu_layer(&self, experts: usize, took: Duration) {
        let Ok(mut plan) = self.read.lock() else {
            return;
        };
        if let Some(n) = plan.record(experts, took) {
            tracing::info!(
                "--gpu-host-read auto: the GPU computes {n} of a decode row's host experts \
                 (an expert's copy over the link {:.0?}, the CPU's {:.0?})",
                plan.copy_per_expert().unwrap_or_default(),
                plan.cpu_per_expert().unwrap_or_default()
            );
        }
    }

    pub(super) fn copies_layer(&self, il: usize) -> bool {
        self.copies.get(il).is_some_and(|c| !c.is_empty())
    }

    /// Enqueues layer `il`'s copies on the copy stream after the buffer's last readers
    /// (`release`), and marks them for `wait_for_layer`.
    pub(super) fn copy_in(&self, il: usize) -> Result<(), cudarc::driver::DriverError> {
        self.stream.wait(&self.free)?;
        let cu = self.stream.cu_stream();
        for c in &self.copies[il] {
            // SAFETY: the range lies in the model's tensors, which `_owner` keeps mapped; the
            // destination lies in the streaming buffer (`Layout::new` checked the layer fits
            // its capacity), which no kernel reads until `wait_for_layer`, and whose previous
            // readers `free` waits for.
            unsafe {
                let src = std::slice::from_raw_parts(c.host as *const u8, c.len);
                cudarc::driver::result::memcpy_htod_async(self.base + c.offset as u64, src, cu)?;
            }
        }
        self.ready.record(&self.stream)
    }

    /// Enqueues the copies of layer `il`'s host experts `experts` to their places in the
    /// buffer, then `signal` (resident.cu `handoff_signal`) setting the device-mapped `flag`
    /// that the step's expert launches wait on (handoff.rs). No event orders them after the
    /// buffer's last readers: the layer's routing, which the host has seen before it calls
    /// this, comes out after the previous layer's expert launches are done.
    pub(super) fn copy_experts_in_then_signal(
        &self,
        il: usize,
        experts: &[u32],
        signal: &cudarc::driver::CudaFunction,
        flag: u64,
    ) -> Result<(), cudarc::driver::DriverError> {
        let cu = self.stream.cu_stream();
        let per_expert = &self.expert_copies[il];
        for c in experts
            .iter()
            .filter_map(|&e| per_expert.get(e as usize))
            .flatten()
        {
            // SAFETY: as in `copy_in`: the range lies in the model's tensors, which `_owner`
            // keeps mapped; the destination is the matrix's place in the buffer (inside its
            // capacity), which no kernel reads before the signal, and whose previous readers
            // are done (the routing the host has seen follows them).
            unsafe {
                let src = std::slice::from_raw_parts(c.host as *const u8, c.len);
                cudarc::driver::result::memcpy_htod_async(self.base + c.offset as u64, src, cu)?;
            }
        }
        let mut l = super::launch::Launch::new(signal);
        l.arg(&flag);
        let one = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: handoff_signal writes one u32 at `flag`, in device-mapped page-locked memory
        // the step's handoff keeps.
        unsafe { l.launch(cu, one, false) }
    }

    /// Makes `stream`'s next work wait for the last `copy_in`.
    pub(super) fn wait_for_layer(
        &self,
        stream: &CudaStream,
    ) -> Result<(), cudarc::driver::DriverError> {
        stream.wait(&self.ready)
    }

    /// Waits for every copy enqueued so far.
    pub(super) fn synchronize(&self) -> Result<(), cudarc::driver::DriverError> {
        self.stream.synchronize()
    }

    /// Marks the buffer free once `stream`'s work so far (the layer's expert launches) is done.
    pub(super) fn release(&self, stream: &CudaStream) -> Result<(), cudarc::driver::DriverError> {
        self.free.record(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stack_of_experts_is_one_copy_per_matrix_kind() {
        // Three stacks of 4 experts, each matrix 512 bytes, the stacks apart on the host.
        let host = vec![0u8; 3 * 4096];
        let mats: Vec<&[u8]> = (0..3)
            .flat_map(|s| (0..4).map(move |e| (s, e)))
            .map(|(s, e)| &host[s * 4096 + e * 512..s * 4096 + (e + 1) * 512])
            .collect();
        let (offsets, used) = place_in_order(&mats);
        assert_eq!(used, 12 * 512);
        let copies = merge_copies(&mats, &offsets);
        assert_eq!(copies.len(), 3);
        assert!(copies.iter().all(|c| c.len == 4 * 512));
        assert_eq!(copies[1].offset, 4 * 512);
    }

    #[test]
    fn unaligned_matrices_are_copied_apart() {
        // 300-byte matrices next to each other on the host: each at its own 256-byte multiple
        // in the buffer, so no two merge.
        let host = vec![0u8; 900];
        let mats: Vec<&[u8]> = host.chunks(300).collect();
        let (offsets, used) = place_in_order(&mats);
        assert_eq!(offsets, vec![0, 512, 1024]);
        assert_eq!(used, 1536);
        let copies = merge_copies(&mats, &offsets);
        assert_eq!(copies.len(), 3);
        assert_eq!(copies.iter().map(|c| c.len).sum::<usize>(), 900);
    }
}
