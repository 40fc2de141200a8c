//! One step of [`super::ResidentModel`]: the sequences' KV mirrors brought up to date, the
//! step's input written and copied in, every layer's launches, the logits and new keys and
//! values copied out and stored into the host caches.

use cudarc::driver::{DevicePtr, LaunchConfig};
use kernels::ActKind;
use model::{DeviceStep, KvType, Model};

use super::handoff::{Handoff, HostLayer};
use super::launch::Launch;
use super::step_input::{StepInput, StepRows};
use super::{DevFfn, DevMat, GraphKey, ResidentModel};
use crate::cuda::ensure_pinned;
use crate::matmul_table::{
    Grids, ROWS_PER_BLOCK, THREADS_PER_BLOCK, TOKENS_PER_TILE, float_row_blocks, job_blocks,
    step_mma_min,
};

/// Rows from which a step's attention runs a block per kv head and row (its query heads
/// together) instead of a block per head and row; with one sequence, a block per kv head and
/// tile of rows.
const GROUPED_MIN_ROWS: usize = 16;
/// The arena's context (positions, a multiple of 1024) above which decode rows take the grouped
/// attention too. One H100's one-row steps of qwen3-30b-a3b (device µs, grouped against a block
/// per head): 3943 / 3789 at position 0, 4868 / 4446 at 1024, 5048 / 5275 at 2048, 5337 / 6127
/// at 4096, 5702 / 8201 at 8192 (docs/perf.md, "Decode attention split over the sequence").
const GROUPED_DECODE_MIN_CTX: usize = 2048;
/// The widest head the tiled attention holds (resident.cu `AT_DK`) and the query vectors of
/// its tiles (`AT_VEC`).
const TILE_MAX_DK: usize = 128;
const TILE_VECTORS: usize = 32;
/// Rows from which a step routes its rows (moe_topk) and counts its slots (moe_count) across
/// the device before moe_route builds the tables in one block.
const ROUTE_SPLIT_MIN_ROWS: usize = 8;

impl ResidentModel {
    /// Whether a step of `n` rows runs the tiled attention (which keeps no scores in the
    /// arena).
    fn tiled_attention(&self, n: usize, one_sequence: bool) -> bool {
        let group = self.nh / self.nkv;
        one_sequence
            && n >= GROUPED_MIN_ROWS
            && (1..=TILE_VECTORS / 4).contains(&group)
            && self.nh.is_multiple_of(self.nkv)
            && self.dk <= TILE_MAX_DK
            && self.dk.is_multiple_of(4)
    }
}

impl model::LayerDevice for ResidentModel {
    fn steps(&self) -> u64 {
        self.steps.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn forward(&self, model: &Model, step: DeviceStep) -> model::Result<Option<Vec<f32>>> {
        let DeviceStep {
            x,
            seqs,
            pos0,
            rope,
            logit_rows,
            cx,
        } = step;
        let (d, nkv, dk) = (self.d, self.nkv, self.dk);
        let n_layers = self.layers.len();
        let n = x.len() / d;
        if n == 0 || model.n_layer() != n_layers {
            return Ok(None);
        }
        // With routed experts on the host, steps large enough to pay for copying them in do
        // so; smaller ones compute them on the host (host_experts.rs).
        let host_compute = self.host_experts.as_ref().is_some_and(|h| n < h.min_rows);
        // Of a decode row's host experts, how many the device computes (host_read.rs).
        let host_read = match &self.host_experts {
            Some(h) if host_compute && n == 1 => h.per_row(),
            _ => 0,
        };
        let kd = nkv * dk;
        let one_sequence = seqs.len() == 1;
        // Caches of the model's whole shape only.
        let Some(kv_type) = self.mirrorable_kv_type(seqs) else {
            return Ok(None);
        };
        // The step's raw copies and launches (`enqueue` below) name no context: this thread's
        // must be the device's (cudarc's own launches bound it on every call).
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(|e| self.error("binding the context to this thread", e))?;
        let mut guard = self
            .state
            .lock()
            .map_err(|_| self.error("resident state", "poisoned by an earlier panic"))?;
        let state = &mut *guard;
        // The streaming buffer is the device's: no expert FFN call may use it meanwhile.
        let _scratch = match &self.host_experts {
            Some(_) if !host_compute || host_read > 0 => {
                Some(self.dev.lock().map_err(model::ModelError::Matmul)?)
            }
            _ => None,
        };
        let t_start = std::time::Instant::now();
        state.clock += 1;
        let ctx_needed = seqs
            .iter()
            .zip(pos0)
            .map(|(s, &p)| p + s.n_tokens)
            .max()
            .unwrap_or(1);

        let mirror_of = self.sync_mirrors(state, seqs, pos0, kv_type)?;

        // Buffers for n rows and ctx_needed positions.
        let b = &mut state.buffers;
        let m_rows = logit_rows.len();
        let tiled = self.tiled_attention(n, one_sequence);
        // Rows whose attention keeps partial sums in the arena (a row, head and split each).
        let score_rows = if tiled { 0 } else { n };
        self.fit_buffers(b, n, ctx_needed, m_rows, score_rows, kv_type.bytes())?;
        let o = self.offsets(b.rows, b.ctx, b.logit_rows, b.score_rows);
        let ctx_cap = b.ctx;
        let base = b
            .arena
            .as_ref()
            .map(|a| a.device_ptr(&self.stream).0)
            .expect("allocated above");
        let at = |off: usize| base + off as u64;
        let out_floats = m_rows * self.n_vocab + n * n_layers * 2 * kd;
        let pin_in = ensure_pinned(&self.dev.ctx, &mut b.host_in, o.input_len)
            .map_err(|e| self.error("allocating page-locked memory", e))?;
        let pin_out = ensure_pinned(&self.dev.ctx, &mut b.host_out, out_floats.max(1))
            .map_err(|e| self.error("allocating page-locked memory", e))?;
        let handoff = if host_compute {
            Some(self.step_handoff(&mut b.host_xchg, n, n_layers)?)
        } else {
            None
        };
        let pin_xchg = handoff.as_ref().map_or(0, Handoff::host_address);
        // SAFETY: both hold at least these lengths (ensured above); nothing else refers to
        // them while the state lock is held, and every step ends by synchronizing the stream.
        let (host_in, host_out) = unsafe {
            (
                std::slice::from_raw_parts_mut(pin_in, o.input_len),
                std::slice::from_raw_parts_mut(pin_out, out_floats.max(1)),
            )
        };
        // The layers whose host experts this step computes, in order.
        let host_layers = if host_compute {
            self.host_layers(n, host_read)
        } else {
            Vec::new()
        };

        // The step's input: tables first, then the data they point at (step_input.rs).
        let il_in = self.input_layout(b.rows);
        let (cos_in, sin_in, pos_in) = (il_in.cos, il_in.sin, il_in.pos);
        let (rk_in, rv_in, rs_in, head_in) =
            (il_in.row_k, il_in.row_v, il_in.row_stride, il_in.head_rows);
        let offs_in = il_in.slot_offsets;
        // Every table of the step, and every launch reading one, has this tensor-core threshold.
        let mma_min = step_mma_min(n);
        let StepInput {
            layers: tables,
            head: head_table,
            x_dev,
        } = self.write_step_input(
            host_in,
            &il_in,
            &o,
            base,
            &StepRows {
                x,
                seqs,
                pos0,
                rope,
                logit_rows,
                mirrors: &state.mirrors,
                mirror_of: &mirror_of,
            },
            mma_min,
        )?;
        let input = |off: usize| at(o.input) + off as u64;

        // In, every layer, the head, out: the same operations on the same addresses for every
        // step of the same shape, so they are captured once into a CUDA graph and replayed
        // (decode would otherwise wait on hundreds of launches a token).
        let t_prepared = std::time::Instant::now();
        let cu = self.stream.cu_stream();
        let logits_len = m_rows * self.n_vocab;
        // The new rows come back in the host cache's element type (f16 is half a float).
        let fresh_len = n * n_layers * 2 * kd * kv_type.bytes() / 4;
        // The host's share of the device part: its experts' time in a step that computes them.
        let host_time = std::cell::Cell::new(std::time::Duration::ZERO);
        // The host's side of a layer whose experts it computes (host_side.rs).
        let serve = |hl: &HostLayer| -> model::Result<()> {
            if let Some(hand) = &handoff {
                let took = self.serve_host_layer(hand, hl, cx, model, cu)?;
                host_time.set(host_time.get() + took);
            }
            Ok(())
        };
        // Host layers served so far (while enqueueing directly, each once the next layer's
        // launches are in: the device never waits on a launch of the host's).
        let served = std::cell::Cell::new(0usize);
        let enqueue = |capturing: bool,
                       host_in: &[u8],
                       host_out: &mut [f32]|
         -> model::Result<()> {
            // SAFETY: host_in is page-locked and untouched until the synchronize below; the arena
            // holds the input region at o.input.
            unsafe { cudarc::driver::result::memcpy_htod_async(at(o.input), host_in, cu) }
                .map_err(|e| self.error("copying the step in", e))?;
            // The first kernel follows the copy in; each later one may overlap the kernel
            // before it (every kernel waits for its predecessor's memory: launch.rs).
            let after_kernel = std::cell::Cell::new(false);
            let overlap = || self.switches.overlap && after_kernel.replace(true);
            let prefetch = self.switches.prefetch;
            let cfg = |grid: (u32, u32), block: u32, shared: u32| LaunchConfig {
                grid_dim: (grid.0, grid.1, 1),
                block_dim: (block, 1, 1),
                shared_mem_bytes: shared,
            };
            let launch_err = |name: &str, e: cudarc::driver::DriverError| {
                self.error(&format!("launching {name}"), e)
            };
            // `copied_in`: the table came in with the step's input (not built by a kernel), so
            // a block may read it before waiting on the kernel ahead and fetch its weights.
            // `uniform`: every job of the table has that many blocks, numbered in job order
            // (matmul_one's `uniform`; 0: not known to be so).
            let matmul = |table: u64,
                          n_jobs: usize,
                          grids: Grids,
                          copied_in: bool,
                          uniform: usize|
             -> model::Result<()> {
                let (n_jobs, mma_min, uniform) = (n_jobs as i32, mma_min as i32, uniform as i32);
                let early = i32::from(copied_in && prefetch);
                // A one-row step's jobs have one token at most: matmul_one, which also takes
                // `uniform`.
                let (dp4a, one) = if n == 1 {
                    (&self.f.matmul_one, true)
                } else {
                    (&self.f.matmul, false)
                };
                for (f, grid, name, takes_uniform) in [
                    (dp4a, grids.dp4a, "matmul", one),
                    (&self.f.matmul_mma, grids.mma, "matmul_mma", false),
                ] {
                    if grid == 0 {
                        continue;
                    }
                    let mut l = Launch::new(f);
                    l.arg(&table).arg(&n_jobs).arg(&mma_min).arg(&early);
                    if takes_uniform {
                        l.arg(&uniform);
                    }
                    // SAFETY: matmul_grouped / matmul_one / matmul_mma read n_jobs records of a
                    // table in the arena (copied in or written by moe_route, in stream order);
                    // their weights lie in uploaded regions (checked when this model was built)
                    // and activations and outputs in the arena, sized by `offsets` for these
                    // rows; the blocks stride over the jobs' blocks (with `uniform`, n_jobs ·
                    // uniform of them, as moe_route numbered them).
                    unsafe { l.launch(cu, cfg((grid, 1), THREADS_PER_BLOCK, 0), overlap()) }
                        .map_err(|e| launch_err(name, e))?;
                }
                Ok(())
            };
            let null = 0u64;
            let form = |act_needed: bool, off: usize| if act_needed { at(off) } else { null };
            let (eps, d_i) = (self.eps, d as i32);
            // The handoff's copies of a layer's rows: about 8 floats a thread.
            let handoff_blocks = (n * d).div_ceil(2048).clamp(1, 128) as u32;
            let norm = |x_at: u64,
                        rows: u64,
                        w: u64,
                        out_rows: usize,
                        out: u64,
                        q8k: u64,
                        q80: u64|
             -> model::Result<()> {
                let mut l = Launch::new(&self.f.rms_norm_quant);
                l.arg(&x_at)
                    .arg(&rows)
                    .arg(&w)
                    .arg(&d_i)
                    .arg(&eps)
                    .arg(&out)
                    .arg(&q8k)
                    .arg(&q80);
                let chunks = (d as u32).div_ceil(256);
                // SAFETY: rms_norm_quant reads out_rows rows of d floats of x (or the rows named by
                // `rows`), d weights, and writes out_rows rows of each form asked for, all in the
                // arena or uploaded constants; a block per (row, 256 columns), 256 threads.
                unsafe { l.launch(cu, cfg((out_rows as u32, chunks), 256, 0), overlap()) }
                    .map(|_| ())
                    .map_err(|e| launch_err("rms_norm_quant", e))
            };
            let needs = |ms: &[&DevMat], kind: ActKind| ms.iter().any(|m| m.act == kind);
            let (nh_i, nkv_i, dk_i) = (self.nh as i32, nkv as i32, dk as i32);
            let (n_rot_i, neox_i) = (self.n_rot as i32, self.neox as i32);
            let (nl_i, round_i) = (n_layers as i32, (kv_type == KvType::F16) as i32);
            let (rows_k, rows_v, rows_s, rows_p) =
                (input(rk_in), input(rv_in), input(rs_in), input(pos_in));
            for (il, (l, t)) in self.layers.iter().zip(&tables).enumerate() {
                let il_i = il as i32;
                // The layer's host experts start coming in beside its attention, or the host
                // computes them.
                let copies = self
                    .host_experts
                    .as_ref()
                    .filter(|h| !host_compute && h.copies_layer(il));
                let on_host = self
                    .host_experts
                    .as_ref()
                    .filter(|_| host_compute)
                    .and_then(|h| h.on_host(il).map(|m| (h, m)));
                if let Some(h) = copies {
                    h.copy_in(il).map_err(|e| {
                        self.error(&format!("copying layer {il}'s host experts in"), e)
                    })?;
                }
                let qkv: [&DevMat; 3] = [&l.q, &l.k, &l.v];
                norm(
                    x_dev,
                    null,
                    l.attn_norm,
                    n,
                    form(needs(&qkv, ActKind::F32), o.hn),
                    form(needs(&qkv, ActKind::Q8K), o.hq8k),
                    form(needs(&qkv, ActKind::Q8_0), o.hq80),
                )?;
                matmul(input(t.qkv.0), 3, t.qkv.1, true, 0)?;
                {
                    let (qn, kn) = l.qk_norm.unwrap_or((0, 0));
                    let (q_at, k_at, v_at, fresh) = (at(o.q), at(o.k), at(o.v), at(o.fresh));
                    let (cos_at, sin_at) = (input(cos_in), input(sin_in));
                    let mut b = Launch::new(&self.f.qk_rope_store);
                    b.arg(&q_at)
                        .arg(&k_at)
                        .arg(&v_at)
                        .arg(&qn)
                        .arg(&kn)
                        .arg(&eps)
                        .arg(&cos_at)
                        .arg(&sin_at)
                        .arg(&n_rot_i)
                        .arg(&neox_i)
                        .arg(&nh_i)
                        .arg(&nkv_i)
                        .arg(&dk_i)
                        .arg(&dk_i)
                        .arg(&rows_k)
                        .arg(&rows_v)
                        .arg(&rows_s)
                        .arg(&rows_p)
                        .arg(&il_i)
                        .arg(&nl_i)
                        .arg(&round_i)
                        .arg(&fresh);
                    let block = (dk as u32).next_multiple_of(32);
                    // SAFETY: one block per (row, head) of q and k (n × heads × dk floats in the
                    // arena); each row's mirror (per-row addresses copied in) has room for its
                    // position (capacity checked above); `fresh` (last in the arena) holds
                    // n × layers × 2·kd elements of the cache's type (b.kv_bytes).
                    unsafe {
                        b.launch(
                            cu,
                            cfg((n as u32, (self.nh + nkv) as u32), block, 0),
                            overlap(),
                        )
                    }
                    .map_err(|e| launch_err("qk_rope_store", e))?;
                }
                {
                    let (q_at, att_at, sc_at) = (at(o.q), at(o.att), at(o.scores));
                    let splits = super::attention_splits(ctx_cap);
                    let (counts_at, splits_i) = (at(o.split_counts), splits as i32);
                    let scale = self.scale;
                    // Heads that share a kv head (up to 8, head dim up to 256) read its keys
                    // and values once per row and split, in one block: in steps of many rows,
                    // and in decode once the context is long. Near the start of a sequence a
                    // decode row's few blocks of it (nkv per split) lose to a block per head.
                    let group = self.nh / nkv;
                    // A prompt's rows (one sequence, so one mirror) read each key and value row
                    // once per tile of rows: a 512-row layer's attention took 715 µs on the
                    // H100 with a block per kv head and row (docs/perf.md).
                    let grouped = (2..=8).contains(&group)
                        && dk <= 256
                        && dk.is_multiple_of(4)
                        && (n >= GROUPED_MIN_ROWS
                            || self
                                .switches
                                .grouped_decode
                                .unwrap_or(ctx_cap > GROUPED_DECODE_MIN_CTX));
                    let (f, grid) = if tiled {
                        let tile_rows = TILE_VECTORS / group;
                        (
                            &self.f.attention_tile,
                            (nkv as u32, n.div_ceil(tile_rows) as u32),
                        )
                    } else if grouped {
                        (&self.f.attention_grouped, ((nkv * splits) as u32, n as u32))
                    } else {
                        (&self.f.attention, ((self.nh * splits) as u32, n as u32))
                    };
                    let n_i = n as i32;
                    let mut b = Launch::new(f);
                    b.arg(&q_at)
                        .arg(&att_at)
                        .arg(&rows_k)
                        .arg(&rows_v)
                        .arg(&rows_s)
                        .arg(&rows_p);
                    if tiled {
                        b.arg(&n_i)
                            .arg(&il_i)
                            .arg(&nh_i)
                            .arg(&nkv_i)
                            .arg(&dk_i)
                            .arg(&scale);
                    } else {
                        b.arg(&il_i)
                            .arg(&nh_i)
                            .arg(&nkv_i)
                            .arg(&dk_i)
                            .arg(&dk_i)
                            .arg(&scale)
                            .arg(&sc_at)
                            .arg(&counts_at)
                            .arg(&splits_i);
                    }
                    // SAFETY: attention_tile: one block per (kv head, tile of rows of the one
                    // sequence); each reads its rows' q (n × nh × dk floats in the arena) and
                    // the sequence's mirror up to the tile's last position (< capacity), and
                    // writes dk floats of `att` per row and head; dk ≤ AT_DK and a multiple of
                    // 4, so its 16-byte loads stay aligned (256-byte aligned bases).
                    // attention: one block per (head and split of ctx_cap, row);
                    // attention_grouped: one per (kv head and split, row), its group's heads
                    // (≤ 8 of dk ≤ 256, a multiple of 4: its 16-byte loads of q and of the
                    // mirror's rows stay aligned) in its shared arrays. splits · SPLIT_POSITIONS ≥
                    // ctx_cap; a block reads its split's positions of the row's mirror (below
                    // its position, < capacity), writes 2 + dk floats of partial sums per head
                    // in the scores region (sized for n rows × heads × splits of them) and
                    // counts itself in the row's and head's counter (n × heads u32, zeroed with
                    // the arena and by each last block; the grouped kernel's is its group's
                    // first head's); the last writes dk floats of `att` per head (dk ≤ MAX_DV,
                    // checked when the model was built).
                    unsafe { b.launch(cu, cfg(grid, 256, 0), overlap()) }
                        .map_err(|e| launch_err("attention", e))?;
                }
                if l.o.act != ActKind::F32 {
                    let width = (self.nh * dk) as i32;
                    let (src, q8k, q80) = (
                        at(o.att),
                        form(l.o.act == ActKind::Q8K, o.att_q8k),
                        form(l.o.act == ActKind::Q8_0, o.att_q80),
                    );
                    let mut b = Launch::new(&self.f.quantize_rows);
                    b.arg(&src).arg(&width).arg(&q8k).arg(&q80);
                    let chunks = (width as u32).div_ceil(256);
                    // SAFETY: n rows of `width` floats in, the asked form out, all in the arena;
                    // a block per (row, 256 columns), 256 threads.
                    unsafe { b.launch(cu, cfg((n as u32, chunks), 256, 0), overlap()) }
                        .map_err(|e| launch_err("quantize_rows", e))?;
                }
                matmul(input(t.o.0), 1, t.o.1, true, 0)?;
                match &l.ffn {
                    DevFfn::Dense { gate, up, .. } => {
                        let gu: [&DevMat; 2] = [gate, up];
                        norm(
                            x_dev,
                            null,
                            l.ffn_norm,
                            n,
                            form(needs(&gu, ActKind::F32), o.hn),
                            form(needs(&gu, ActKind::Q8K), o.hq8k),
                            form(needs(&gu, ActKind::Q8_0), o.hq80),
                        )?;
                        matmul(input(t.first.0), 2, t.first.1, true, 0)?;
                        let (table, one) = (input(t.glu), 1i32);
                        let mut b = Launch::new(&self.f.glu);
                        b.arg(&table).arg(&one);
                        // SAFETY: one job of n rows of the gate/up outputs into `hidden`, all in
                        // the arena (sized for the widest FFN).
                        unsafe { b.launch(cu, cfg((n as u32, 1), 256, 0), overlap()) }
                            .map_err(|e| launch_err("glu_quantize", e))?;
                        matmul(input(t.down.0), 1, t.down.1, true, 0)?;
                    }
                    DevFfn::Moe {
                        router,
                        desc,
                        n_expert,
                        k,
                        n_ff,
                        gate_act,
                        expert_types,
                        host_mask,
                        device_experts,
                    } => {
                        let kind_of = |a: ActKind, b: ActKind| router.act == a || *gate_act == b;
                        // The host's experts read the normed rows in f32.
                        norm(
                            x_dev,
                            null,
                            l.ffn_norm,
                            n,
                            form(
                                kind_of(ActKind::F32, ActKind::F32) || on_host.is_some(),
                                o.hn,
                            ),
                            form(kind_of(ActKind::Q8K, ActKind::Q8K), o.hq8k),
                            form(kind_of(ActKind::Q8_0, ActKind::Q8_0), o.hq80),
                        )?;
                        matmul(input(t.first.0), 1, t.first.1, true, 0)?;
                        let slots = n * k;
                        let max_jobs = slots.min(*n_expert);
                        let acts = match gate_act {
                            ActKind::F32 => at(o.hn),
                            ActKind::Q8K => at(o.hq8k),
                            ActKind::Q8_0 => at(o.hq80),
                        };
                        let (n_i, mj_i, mma_min_i) = (n as i32, max_jobs as i32, mma_min as i32);
                        // A one-row step's device takes the first of the row's host experts,
                        // copied into their places in the buffer once the routing is out (the
                        // tables point there).
                        let reading = host_layers
                            .iter()
                            .find(|hl| hl.il == il)
                            .map_or(0, |hl| hl.reading);
                        let reading_i = reading as i32;
                        let ptrs = [
                            at(o.router_logits),
                            *desc,
                            acts,
                            at(o.gate_out),
                            at(o.up_out),
                            at(o.hidden),
                            at(o.down_out),
                            at(o.ids),
                            at(o.wts),
                            at(o.slot_row),
                            at(o.gather),
                            at(o.gu_table),
                            at(o.glu_table),
                            at(o.down_table),
                            at(o.sum_rows),
                            at(o.sum_w),
                        ];
                        // Many rows: routed a warp per row and counted a warp per expert
                        // across the device first (one block did both in 273 µs of a 512-row
                        // layer on the H100); moe_route then only builds the tables.
                        let counted = if n >= ROUTE_SPLIT_MIN_ROWS {
                            let (ids, wts, slot_row, counted) =
                                (at(o.ids), at(o.wts), at(o.slot_row), at(o.counted));
                            let (slots_i, ne_i) = (slots as i32, *n_expert as i32);
                            let mut b = Launch::new(&self.f.moe_topk);
                            b.arg(&ptrs[0]).arg(&n_i).arg(desc).arg(&ids).arg(&wts);
                            // SAFETY: a warp per row (8 per block) reads its n_expert router
                            // logits and the descriptor and writes its k ids and weights, in
                            // the arena sized for n·k slots; n_expert ≤ MAX_EXPERTS (checked
                            // when the model was built).
                            unsafe {
                                b.launch(cu, cfg((n.div_ceil(8) as u32, 1), 256, 0), overlap())
                            }
                            .map_err(|e| launch_err("moe_topk", e))?;
                            let mut b = Launch::new(&self.f.moe_count);
                            b.arg(&ids)
                                .arg(&slots_i)
                                .arg(&ne_i)
                                .arg(&slot_row)
                                .arg(&counted);
                            // SAFETY: a warp per expert reads the n·k slot ids and writes the
                            // ranks of its slots and its count, all in the arena.
                            unsafe {
                                b.launch(
                                    cu,
                                    cfg((n_expert.div_ceil(8) as u32, 1), 256, 0),
                                    overlap(),
                                )
                            }
                            .map_err(|e| launch_err("moe_count", e))?;
                            counted
                        } else {
                            null
                        };
                        let mut b = Launch::new(&self.f.moe_route);
                        b.arg(&ptrs[0]).arg(&n_i);
                        for p in &ptrs[1..] {
                            b.arg(p);
                        }
                        let (mask, sums) = match on_host {
                            Some(_) => (*host_mask, at(o.host_sums)),
                            None => (null, null),
                        };
                        b.arg(&mj_i)
                            .arg(&counted)
                            .arg(&mma_min_i)
                            .arg(&mask)
                            .arg(&sums)
                            .arg(&reading_i);
                        // SAFETY: moe_route reads n rows of router logits, the layer's descriptor
                        // and host mask (uploaded constants, n_expert flags) and writes tables
                        // for max_jobs experts and n·k slots into the arena, sized for them.
                        unsafe { b.launch(cu, cfg((1, 1), 256, 0), overlap()) }
                            .map_err(|e| launch_err("moe_route", e))?;
                        let hand_over = handoff.as_ref().filter(|_| on_host.is_some());
                        if let Some(hand) = hand_over {
                            let (xchg_at, flag) = hand.out_addresses(il);
                            let (hn_at, ids_at, wts_at, done) =
                                (at(o.hn), at(o.ids), at(o.wts), at(o.handoff_done));
                            let (floats, slots_i, slots_max) =
                                ((n * d) as i32, slots as i32, (n * self.max_k) as i32);
                            let mut b = Launch::new(&self.f.handoff_out);
                            b.arg(&hn_at)
                                .arg(&ids_at)
                                .arg(&wts_at)
                                .arg(&floats)
                                .arg(&slots_i)
                                .arg(&slots_max)
                                .arg(&xchg_at)
                                .arg(&flag);
                            b.arg(&done);
                            // SAFETY: the arena holds n rows of d floats at o.hn, n·k slot
                            // experts and weights at o.ids and o.wts (k ≤ max_k) and a u32 at
                            // o.handoff_done; the exchange (device-mapped) holds n·d floats
                            // and n·max_k of each after them, and the layer's flag.
                            unsafe { b.launch(cu, cfg((handoff_blocks, 1), 256, 0), overlap()) }
                                .map_err(|e| launch_err("handoff_out", e))?;
                        }
                        // The tables are the device's: bound their blocks by every slot in
                        // tiles of the dp4a path (whose blocks are the smaller) plus a partial
                        // tile per job; a row picks an expert once, so only a step of
                        // mma_min+ rows can give an expert that many tokens (counting
                        // slots instead launched an idle tensor-core grid per expert matmul in
                        // decode under MOESHARD_GPU_MMA=8: tg64 236 -> 197 t/s on an H100).
                        // One-token jobs against float experts (any step's experts with one
                        // token) take a block per row (matmul.cu float_row_job), the others
                        // ROWS_PER_BLOCK rows a block; the grids stride, so a bound too large
                        // only adds blocks that find no job.
                        let tiles = slots.div_ceil(TOKENS_PER_TILE) + max_jobs;
                        let mma = n >= mma_min;
                        let rows_per_block = if *gate_act == ActKind::F32 && float_row_blocks() {
                            1
                        } else {
                            ROWS_PER_BLOCK
                        };
                        let grids =
                            |rows: usize| Grids::bound(rows.div_ceil(rows_per_block) * tiles, mma);
                        // moe_route's one-row path (one row, k ≤ 32 distinct experts, a job
                        // each) numbers job j's blocks from j times a job's blocks: the gate and
                        // up table is uniform where gate and up take as many blocks, the down
                        // table always.
                        let uniform =
                            if n == 1 && *k <= 32 && max_jobs == *k && self.switches.uniform_jobs {
                                let blocks = |rows: usize, t: u64| job_blocks(rows, 1, t, mma_min);
                                let (g, u) = (
                                    blocks(*n_ff, expert_types[0]),
                                    blocks(*n_ff, expert_types[1]),
                                );
                                (if g == u { g } else { 0 }, blocks(d, expert_types[2]))
                            } else {
                                (0, 0)
                            };
                        if let Some(h) = copies {
                            h.wait_for_layer(&self.stream).map_err(|e| {
                                self.error(&format!("waiting for layer {il}'s host experts"), e)
                            })?;
                            // After a wait on another stream, no launch overlaps the kernel
                            // ahead of it.
                            after_kernel.set(false);
                        }
                        let launch_experts = || -> model::Result<()> {
                            matmul(
                                at(o.gu_table),
                                2 * max_jobs,
                                grids(2 * *n_ff),
                                false,
                                uniform.0,
                            )?;
                            let (glu_at, mj) = (at(o.glu_table), max_jobs as i32);
                            let mut b = Launch::new(&self.f.glu);
                            b.arg(&glu_at).arg(&mj);
                            // SAFETY: one block per slot row; the table (written by moe_route)
                            // names gate/up/hidden rows in the arena.
                            unsafe { b.launch(cu, cfg((slots as u32, 1), 256, 0), overlap()) }
                                .map_err(|e| launch_err("glu_quantize", e))?;
                            matmul(at(o.down_table), max_jobs, grids(d), false, uniform.1)
                        };
                        if reading == 0 && (on_host.is_none() || *device_experts > 0) {
                            launch_experts()?;
                        }
                        if let Some(h) = copies {
                            h.release(&self.stream)
                                .map_err(|e| self.error("marking the streaming buffer free", e))?;
                        }
                        if let Some(hand) = hand_over {
                            // While the device runs its experts, the host runs its own; the
                            // device's share of them waits for their copies.
                            let failed = hand.failed_address();
                            let wait_in = |flag: u64,
                                           src: u64,
                                           dst: u64,
                                           floats: usize|
                             -> model::Result<()> {
                                let floats_i = floats as i32;
                                let mut b = Launch::new(&self.f.handoff_in);
                                b.arg(&flag).arg(&src).arg(&dst).arg(&floats_i).arg(&failed);
                                let blocks = if floats == 0 { 1 } else { handoff_blocks };
                                // SAFETY: handoff_in reads the flag and `floats` floats at src
                                // in the device-mapped exchange and writes as many at dst in
                                // the arena (o.host_sums: n rows of d floats).
                                unsafe { b.launch(cu, cfg((blocks, 1), 256, 0), overlap()) }
                                    .map_err(|e| launch_err("handoff_in", e))
                            };
                            if reading > 0 {
                                wait_in(hand.copied_address(il), null, null, 0)?;
                                // Not launched early: its blocks, waiting on every SM, could
                                // leave no room for the copy stream's signal that the wait
                                // ahead of them needs.
                                after_kernel.set(false);
                                launch_experts()?;
                            }
                            let (src, flag) = hand.sums_addresses(il);
                            wait_in(flag, src, at(o.host_sums), n * d)?;
                        }
                        let (offs, rows, wts, x_at, acc) =
                            (input(offs_in), at(o.sum_rows), at(o.sum_w), x_dev, 1i32);
                        let mut b = Launch::new(&self.f.weighted_sum);
                        b.arg(&offs)
                            .arg(&rows)
                            .arg(&wts)
                            .arg(&d_i)
                            .arg(&x_at)
                            .arg(&acc);
                        // SAFETY: n + 1 offsets over n·k slot rows (down outputs of d floats in
                        // the arena) and weights; adds n rows of d floats into x.
                        unsafe {
                            b.launch(
                                cu,
                                cfg((n as u32, (d as u32).div_ceil(256)), 256, 0),
                                overlap(),
                            )
                        }
                        .map_err(|e| launch_err("weighted_sum", e))?;
                    }
                }
                // The host's side of the layers before this one, now that this one's launches
                // are queued behind them (a capture runs nothing yet: the step serves every
                // layer once its graph is launched).
                if !capturing {
                    while let Some(hl) = host_layers.get(served.get()).filter(|hl| hl.il < il) {
                        serve(hl)?;
                        served.set(served.get() + 1);
                    }
                }
            }
            // The head on the rows that need logits.
            if m_rows > 0 {
                let out = [&self.output];
                norm(
                    x_dev,
                    input(head_in),
                    self.output_norm,
                    m_rows,
                    form(needs(&out, ActKind::F32), o.hn),
                    form(needs(&out, ActKind::Q8K), o.hq8k),
                    form(needs(&out, ActKind::Q8_0), o.hq80),
                )?;
                matmul(input(head_table.0), 1, head_table.1, true, 0)?;
            }
            // SAFETY: host_out is page-locked and read only after the synchronize; the arena
            // holds logits_len floats at o.logits and fresh_len at o.fresh.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host_out[..logits_len],
                    at(o.logits),
                    cu,
                )
                .map_err(|e| self.error("copying logits out", e))?;
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host_out[logits_len..logits_len + fresh_len],
                    at(o.fresh),
                    cu,
                )
                .map_err(|e| self.error("copying new keys and values out", e))?;
            }
            Ok(())
        };
        let key = GraphKey {
            rows: n,
            logit_rows: m_rows,
            arena: base,
            host_in: pin_in as usize,
            host_out: pin_out as usize,
            host_xchg: pin_xchg,
            host_read,
            input_len: o.input_len,
            ctx_cap,
            round_f16: kv_type == KvType::F16,
            arena_generation: state.buffers.generation,
            tiled,
        };
        if let Some(hand) = &handoff {
            hand.reset();
        }
        // A step that copies host experts in spans two streams: it runs directly.
        let graphable = self.host_experts.is_none() || host_compute;
        self.run_launches(state, key, graphable, |capturing| {
            let enqueued = enqueue(capturing, host_in, host_out);
            if let (Err(_), Some(hand)) = (&enqueued, &handoff) {
                // What was enqueued must drain before the error returns.
                hand.release_all();
            }
            enqueued
        })?;
        let rest = host_layers[served.get()..].iter().try_for_each(&serve);
        self.finish_launches(handoff.as_ref(), rest, host_compute)?;
        let t_done = std::time::Instant::now();
        let logits = host_out[..logits_len].to_vec();
        // Per layer, the step's key rows then its value rows (resident.cu `qk_rope_store`).
        let fresh: &[u8] = bytemuck::cast_slice(&host_out[logits_len..logits_len + fresh_len]);
        self.store_new_rows(state, seqs, pos0, &mirror_of, fresh, kv_type)?;
        self.steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.host_experts.as_ref().filter(|_| !host_compute) {
            self.dev
                .streamed
                .fetch_add(h.bytes as u64, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(t) = &self.timing {
            t.record(
                n,
                [
                    t_prepared - t_start,
                    (t_done - t_prepared).saturating_sub(host_time.get()),
                    host_time.get(),
                    t_done.elapsed(),
                ],
            );
        }
        Ok(Some(logits))
    }
}
