//! The expert FFN call ([`Offload::expert_ffn`]): whole SiLU-gated expert FFNs and their
//! weighted sum per token in one round trip, the experts the device does not hold copied into
//! the streaming buffer in passes (`crate::streaming` plans them).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernels::{ActKind, ExpertFfnJob, MatmulError};

use super::{CudaOffload, Layout, act_row_bytes, shape_error, weights_key};
use crate::matmul_table::{GLU_FIELDS, JOB_FIELDS, MatRecord, step_mma_min, write_matmul_table};
use crate::streaming::plan_passes;
use crate::supports;

impl CudaOffload {
    pub(super) fn run_expert_ffn(
        &self,
        jobs: &[ExpertFfnJob],
        out: &mut [f32],
    ) -> Result<(), MatmulError> {
        let jobs: Vec<&ExpertFfnJob> = jobs.iter().filter(|j| j.n > 0).collect();
        let Some(first) = jobs.first() else {
            out.fill(0.0);
            return Ok(());
        };
        let width = first.down.rows;
        if width == 0 || !out.len().is_multiple_of(width) {
            return Err(self.device_error("expert FFN", "output is not whole rows"));
        }
        let n_tokens = out.len() / width;
        let mut guard = self.lock()?;
        struct At {
            acts: usize,
            gate: usize,
            up: usize,
            hidden: usize,
            down: usize,
            down_act: ActKind,
            /// Device addresses of gate, up and down: held, or (None) copied into the streaming
            /// buffer at `streamed` offsets for the job's pass.
            held: [Option<u64>; 3],
            streamed: [usize; 3],
        }
        let mut l = Layout::default();
        let mut at = Vec::with_capacity(jobs.len());
        let mut copies = Vec::with_capacity(jobs.len());
        for j in &jobs {
            let arb = act_row_bytes(&j.gate)?;
            let hidden = j.gate.rows;
            if j.acts.len() != arb * j.n
                || act_row_bytes(&j.up)? != arb
                || j.up.rows != hidden
                || j.down.cols != hidden
                || j.down.rows != width
                || j.tokens.len() != j.n
                || j.weights.len() != j.n
                || j.tokens.iter().any(|&t| t as usize >= n_tokens)
            {
                return Err(shape_error(
                    "GPU expert FFN",
                    &j.gate,
                    j.n,
                    j.acts.len(),
                    arb * j.n,
                    out.len(),
                ));
            }
            let mut held = [None; 3];
            let mut copy = [None; 3];
            for (k, w) in [&j.gate, &j.up, &j.down].iter().enumerate() {
                if !supports(w.dtype) {
                    return Err(MatmulError::UnsupportedType(w.dtype));
                }
                held[k] = self.device_address(w.data);
                copy[k] = held[k].is_none().then_some(w.data.len());
            }
            copies.push((held, copy));
        }
        // Jobs in order, split into passes whose copied-in matrices fit the streaming buffer.
        let copy_lens: Vec<[Option<usize>; 3]> = copies.iter().map(|&(_, c)| c).collect();
        let plan = plan_passes(&copy_lens, self.streaming.capacity).map_err(|(j, need)| {
            self.device_error(
                "expert FFN",
                format!(
                    "an expert's {need} bytes not on the device (job {j} of those with rows) \
                     exceed the {}-byte streaming buffer",
                    self.streaming.capacity
                ),
            )
        })?;
        let passes = plan.passes;
        for ((j, &(held, _)), streamed) in jobs.iter().zip(&copies).zip(plan.offsets) {
            let hidden = j.gate.rows;
            let down_act = kernels::format(j.down.dtype)
                .ok_or(MatmulError::UnsupportedType(j.down.dtype))?
                .act;
            at.push(At {
                acts: l.input(j.acts.len()),
                gate: l.device(4 * j.n * hidden),
                up: l.device(4 * j.n * hidden),
                hidden: l.device(down_act.row_bytes(hidden) * j.n),
                down: l.device(4 * j.n * width),
                down_act,
                held,
                streamed,
            });
        }
        // Each pass's tables and weighted-sum index.
        struct PassAt {
            gu_table: usize,
            down_table: usize,
            glu_table: usize,
            sum_offsets: usize,
            sum_rows: usize,
            sum_weights: usize,
        }
        let pass_at: Vec<PassAt> = passes
            .iter()
            .map(|r| {
                let e = r.len();
                let rows: usize = jobs[r.clone()].iter().map(|j| j.n).sum();
                PassAt {
                    gu_table: l.input(2 * e * JOB_FIELDS * 8),
                    down_table: l.input(e * JOB_FIELDS * 8),
                    glu_table: l.input(e * GLU_FIELDS * 8),
                    sum_offsets: l.input(4 * (n_tokens + 1)),
                    sum_rows: l.input(8 * rows),
                    sum_weights: l.input(4 * rows),
                }
            })
            .collect();
        let sum_out = l.output(out.len());
        let stream_base = if at.iter().any(|a| a.held.contains(&None)) {
            self.streaming_buffer(&mut guard)?
        } else {
            0
        };
        let mut st = self.staged(&mut guard, &l)?;
        let mma_min = step_mma_min(n_tokens);
        let mut grids = Vec::with_capacity(passes.len());
        let mut glu_rows = Vec::with_capacity(passes.len());
        for (r, pa) in passes.iter().zip(&pass_at) {
            let pj = &jobs[r.clone()];
            let pat = &at[r.clone()];
            let mut gate_up = Vec::with_capacity(2 * pj.len());
            let mut down = Vec::with_capacity(pj.len());
            for (j, a) in pj.iter().zip(pat) {
                let hidden = j.gate.rows;
                let acts = st.in_base + a.acts as u64;
                let arb = act_row_bytes(&j.gate)?;
                let addr = |k: usize| a.held[k].unwrap_or(stream_base + a.streamed[k] as u64);
                for (k, w, out) in [(0, &j.gate, a.gate), (1, &j.up, a.up)] {
                    gate_up.push(MatRecord {
                        w: addr(k),
                        acts,
                        out: st.tmp_base + out as u64,
                        weights: weights_key(w),
                        act_stride: arb,
                        n: j.n,
                        accumulate: false,
                    });
                }
                down.push(MatRecord {
                    w: addr(2),
                    acts: st.tmp_base + a.hidden as u64,
                    out: st.tmp_base + a.down as u64,
                    weights: weights_key(&j.down),
                    act_stride: a.down_act.row_bytes(hidden),
                    n: j.n,
                    accumulate: false,
                });
            }
            let g = (
                write_matmul_table(&mut st.host_in[pa.gu_table..], &gate_up, mma_min),
                write_matmul_table(&mut st.host_in[pa.down_table..], &down, mma_min),
            );
            let (Some(gu_grid), Some(down_grid)) = g else {
                return Err(
                    self.device_error("expert FFN", "too many rows or tokens for one launch")
                );
            };
            grids.push((gu_grid, down_grid));
            // The sum's index: each token's rows (device addresses of down outputs) and
            // weights, grouped by token in job order.
            let mut per_token = vec![0u32; n_tokens + 1];
            for j in pj {
                for &t in j.tokens {
                    per_token[t as usize + 1] += 1;
                }
            }
            for t in 0..n_tokens {
                per_token[t + 1] += per_token[t];
            }
            let mut next = per_token.clone();
            let mut first_row = 0usize;
            for (i, (j, a)) in pj.iter().zip(pat).enumerate() {
                let fields: [u64; GLU_FIELDS] = [
                    st.tmp_base + a.gate as u64,
                    st.tmp_base + a.up as u64,
                    st.tmp_base + a.hidden as u64,
                    j.gate.rows as u64,
                    a.down_act.ggml_type() as u64,
                    first_row as u64,
                    j.n as u64,
                ];
                for (k, v) in fields.iter().enumerate() {
                    let o = pa.glu_table + (i * GLU_FIELDS + k) * 8;
                    st.host_in[o..o + 8].copy_from_slice(&v.to_le_bytes());
                }
                first_row += j.n;
                st.host_in[a.acts..a.acts + j.acts.len()].copy_from_slice(j.acts);
                for (row, (&t, &w)) in j.tokens.iter().zip(j.weights).enumerate() {
                    let slot = next[t as usize] as usize;
                    next[t as usize] += 1;
                    let addr = st.tmp_base + (a.down + 4 * row * width) as u64;
                    let (ro, wo) = (pa.sum_rows + 8 * slot, pa.sum_weights + 4 * slot);
                    st.host_in[ro..ro + 8].copy_from_slice(&addr.to_le_bytes());
                    st.host_in[wo..wo + 4].copy_from_slice(&w.to_le_bytes());
                }
            }
            for (t, &v) in per_token.iter().enumerate() {
                let o = pa.sum_offsets + 4 * t;
                st.host_in[o..o + 4].copy_from_slice(&v.to_le_bytes());
            }
            glu_rows
                .push(u32::try_from(first_row).map_err(|_| {
                    self.device_error("expert FFN", "too many rows for one launch")
                })?);
        }
        let tokens = u32::try_from(n_tokens)
            .map_err(|_| self.device_error("expert FFN", "too many tokens for one launch"))?;
        let base = st.in_base;
        let out_base = st.out_base;
        let cu_stream = self.stream.cu_stream();
        let mut copied = 0u64;
        self.round_trip(&mut st, || {
            for (p, (r, pa)) in passes.iter().zip(&pass_at).enumerate() {
                // The pass's streamed matrices, in stream order after the pass before has read
                // the buffer.
                for (j, a) in jobs[r.clone()].iter().zip(&at[r.clone()]) {
                    for (k, w) in [&j.gate, &j.up, &j.down].iter().enumerate() {
                        if a.held[k].is_some() {
                            continue;
                        }
                        // SAFETY: the destination lies inside the streaming buffer (the pass's
                        // offsets plus lengths stay within its capacity: plan_passes); the
                        // source is the job's weights, borrowed for this whole call, which ends
                        // by synchronizing the stream (round_trip) before they can go.
                        unsafe {
                            cudarc::driver::result::memcpy_htod_async(
                                stream_base + a.streamed[k] as u64,
                                w.data,
                                cu_stream,
                            )
                        }
                        .map_err(|e| self.device_error("copying expert weights in", e))?;
                        copied += w.data.len() as u64;
                    }
                }
                let e = r.len();
                let (gu_grid, down_grid) = grids[p];
                self.launch_matmul(base + pa.gu_table as u64, 2 * e, gu_grid, mma_min)?;
                let table = base + pa.glu_table as u64;
                let n_jobs = e as i32;
                let mut launch = self.stream.launch_builder(&self.glu);
                launch.arg(&table).arg(&n_jobs);
                let cfg = LaunchConfig {
                    grid_dim: (glu_rows[p], 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: glu_quantize(const u64* table, int n_jobs) reads e records (copied in
                // before, in stream order) whose gate/up/hidden addresses lie in this call's
                // device buffer, sized for n rows of each expert's width; one block per row of
                // the pass's jobs.
                unsafe { launch.launch(cfg) }.map_err(|e| self.device_error("launching glu", e))?;
                self.launch_matmul(base + pa.down_table as u64, e, down_grid, mma_min)?;
                let (offsets, rows, weights) = (
                    base + pa.sum_offsets as u64,
                    base + pa.sum_rows as u64,
                    base + pa.sum_weights as u64,
                );
                // The first pass writes the sums, the others add to them.
                let (width_arg, sum_dst, accumulate) = (
                    width as i32,
                    out_base + 4 * sum_out as u64,
                    i32::from(p > 0),
                );
                let mut launch = self.stream.launch_builder(&self.weighted_sum);
                launch
                    .arg(&offsets)
                    .arg(&rows)
                    .arg(&weights)
                    .arg(&width_arg)
                    .arg(&sum_dst)
                    .arg(&accumulate);
                let cfg = LaunchConfig {
                    grid_dim: (tokens, (width as u32).div_ceil(256), 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: weighted_sum(offsets, rows, weights, width, out, accumulate) reads
                // n_tokens + 1 offsets and, below the last, row addresses and weights (all
                // copied in before, in stream order); every row address is a down output of
                // `width` floats in this call's device buffer; it writes (or adds to)
                // n_tokens × width floats at sum_dst, inside dev_out.
                unsafe { launch.launch(cfg) }
                    .map_err(|e| self.device_error("launching weighted_sum", e))?;
            }
            Ok(())
        })?;
        self.streamed
            .fetch_add(copied, std::sync::atomic::Ordering::Relaxed);
        out.copy_from_slice(&st.host_out[sum_out..sum_out + out.len()]);
        Ok(())
    }
}
