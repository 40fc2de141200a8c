//! Whole steps on the GPU ([`model::LayerDevice`]): when the device holds every weight of a
//! model whose layers it has kernels for, a step's activations never leave it. The host sends
//! the embedded rows, the RoPE table and the step's tables in one copy, the device runs every
//! layer and the head, and one copy brings back the logits and the step's new keys and values,
//! which go into the host cache (so the CPU path, snapshots and rewinds see what they always
//! did). Each sequence's keys and values are mirrored in device memory, kept while the host
//! cache holds the same rows ([`model::KvCache::content_version`]) and copied again otherwise.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use kernels::{ActKind, Weights};
use model::{Model, ModelError, PlanFfn, WholeModelPlan};

use crate::cuda::{CudaOffload, act_row_bytes, weights_key};
use crate::matmul_table::{GLU_FIELDS, JOB_FIELDS};
use crate::supports;

/// As in resident.cu.
const DESC_FIELDS: usize = 18;
/// As in resident.cu: the most routed experts of a layer.
const MAX_EXPERTS: usize = 512;

/// The splits of `attention` over a mirror of `ctx` positions.
pub(super) fn attention_splits(ctx: usize) -> usize {
    ctx.div_ceil(crate::matmul_table::attention_split_positions())
        .max(1)
}
/// Sequences whose caches stay mirrored on the device.
const MIRRORS: usize = 8;

/// A weight matrix on the device.
#[derive(Clone, Copy)]
struct DevMat {
    addr: u64,
    key: (usize, usize, usize, u64),
    act: ActKind,
    act_bytes: usize,
    rows: usize,
}

enum DevFfn {
    Dense {
        gate: DevMat,
        up: DevMat,
        down: DevMat,
    },
    Moe {
        router: DevMat,
        /// The layer's routing descriptor (resident.cu's `moe_route`).
        desc: u64,
        n_expert: usize,
        k: usize,
        n_ff: usize,
        gate_act: ActKind,
        /// The experts' gate, up and down ggml types.
        expert_types: [u64; 3],
        /// The experts the host holds (a u32 flag per expert on the device; 0 for none), and
        /// how many the device holds.
        host_mask: u64,
        device_experts: usize,
    },
}

struct DevLayer {
    attn_norm: u64,
    q: DevMat,
    k: DevMat,
    v: DevMat,
    o: DevMat,
    qk_norm: Option<(u64, u64)>,
    ffn_norm: u64,
    ffn: DevFfn,
}

struct Kernels {
    matmul: CudaFunction,
    /// matmul_grouped compiled for one token per job: steps of one row (decode).
    matmul_one: CudaFunction,
    matmul_mma: CudaFunction,
    glu: CudaFunction,
    weighted_sum: CudaFunction,
    rms_norm_quant: CudaFunction,
    quantize_rows: CudaFunction,
    qk_rope_store: CudaFunction,
    attention: CudaFunction,
    attention_grouped: CudaFunction,
    /// Steps of many rows from one sequence: a block per tile of rows and kv head.
    attention_tile: CudaFunction,
    moe_route: CudaFunction,
    /// Steps of many rows: the rows routed and the slots counted before `moe_route`.
    moe_topk: CudaFunction,
    moe_count: CudaFunction,
    /// A step whose host computes experts: each layer's routing out to the host, the wait for
    /// the host's sums (or copies), and the copy stream's signal (handoff.rs).
    handoff_out: CudaFunction,
    handoff_in: CudaFunction,
    handoff_signal: CudaFunction,
}

/// One sequence's keys and values on the device: `[layer][position][kv dim]` f32.
struct Mirror {
    version: (u64, u64),
    /// Positions that hold the host cache's rows.
    valid: usize,
    capacity: usize,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    last_used: u64,
}

/// The device buffers of a step, sized for up to `rows` rows and `ctx` positions.
#[derive(Default)]
struct Buffers {
    rows: usize,
    ctx: usize,
    /// Rows of logits (a prompt's step needs one, not one per row), and rows of attention
    /// splits' partial sums (none for the tiled attention of a prompt's step).
    logit_rows: usize,
    score_rows: usize,
    /// Bytes of a key or value element the new rows come back in (the arena's last region).
    kv_bytes: usize,
    /// Reallocations of the arena so far.
    generation: u64,
    arena: Option<CudaSlice<u8>>,
    host_in: Option<PinnedHostSlice<u8>>,
    host_out: Option<PinnedHostSlice<f32>>,
    /// A layer's normed rows and routing coming back, and the host's expert sums going in (a
    /// step whose host computes its experts), with the flags of their handoff; device-mapped.
    host_xchg: Option<PinnedHostSlice<f32>>,
}

#[derive(Default)]
struct State {
    buffers: Buffers,
    mirrors: Vec<Mirror>,
    clock: u64,
    /// The launches of the last repeated step shape, replayed while steps keep that shape.
    graph: Option<StepGraph>,
    /// The previous step's shape.
    last_key: Option<GraphKey>,
}

/// What a captured step depends on besides the contents of its input: its shape and the
/// addresses its launches and copies name.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct GraphKey {
    rows: usize,
    logit_rows: usize,
    arena: u64,
    host_in: usize,
    host_out: usize,
    /// The exchange of a step whose host computes experts (its kernels name it and its flags).
    host_xchg: usize,
    /// Of a decode row's host experts, how many the device computes (a kernel argument).
    host_read: usize,
    input_len: usize,
    ctx_cap: usize,
    /// Keys and values rounded to f16 in the mirror (a kernel argument, as the cache's type).
    round_f16: bool,
    /// The arena's layout (its reallocations counted: a new one may reuse the old address
    /// with other offsets), and whether the step's attention is tiled (other kernels).
    arena_generation: u64,
    tiled: bool,
}

struct StepGraph {
    key: GraphKey,
    graph: cudarc::driver::CudaGraph,
}

// SAFETY: a CudaGraph is not thread safe (graph objects are not internally synchronized); this
// one lives in `State` and is only captured, launched and dropped with the state's mutex held.
unsafe impl Send for StepGraph {}

pub struct ResidentModel {
    dev: Arc<CudaOffload>,
    stream: Arc<CudaStream>,
    f: Kernels,
    layers: Vec<DevLayer>,
    output_norm: u64,
    output: DevMat,
    d: usize,
    nh: usize,
    nkv: usize,
    dk: usize,
    n_rot: usize,
    neox: bool,
    eps: f32,
    scale: f32,
    n_vocab: usize,
    /// The widest expert and dense FFN, the most experts of a layer.
    max_ff: usize,
    max_expert: usize,
    max_k: usize,
    /// Norm vectors, routing descriptors and expert address tables.
    _constants: Vec<CudaSlice<u8>>,
    state: Mutex<State>,
    steps: std::sync::atomic::AtomicU64,
    /// `MOESHARD_GPU_TIMING=1`: where a step's time goes, on stderr.
    timing: Option<StepTiming>,
    /// Graphs, launch overlap and weights fetched ahead, on or off (launch.rs).
    switches: launch::LaunchSwitches,
    /// Routed experts the device does not hold, copied in per step (host_experts.rs).
    host_experts: Option<host_experts::HostExperts>,
}

/// Byte offsets of one step's data in the device arena (and, for the input, in the pinned
/// input buffer at the same offsets from its start).
#[derive(Default)]
struct Arena {
    len: usize,
}

impl Arena {
    fn take(&mut self, bytes: usize) -> usize {
        let at = self.len;
        self.len = (at + bytes).next_multiple_of(256);
        at
    }
}

/// Where each buffer of a step lies (offsets into the arena).
struct Offsets {
    input: usize,
    input_len: usize,
    /// The normed rows in f32, each slot's expert and weight: what a step whose host
    /// computes experts copies out per layer.
    hn: usize,
    ids: usize,
    wts: usize,
    /// Each row's weighted sum of the host's experts (read from the host by such a step).
    host_sums: usize,
    /// `handoff_out`'s count of finished blocks (0 between its launches).
    handoff_done: usize,
    hq8k: usize,
    hq80: usize,
    q: usize,
    k: usize,
    v: usize,
    att: usize,
    att_q8k: usize,
    att_q80: usize,
    /// A row's attention splits' partial sums (`attention`, `attention_grouped`: per head
    /// and split, the scores' max, the sum of their exponentials and dk weighted values).
    scores: usize,
    /// Per row and head, the splits of the attention done so far (zero between steps).
    split_counts: usize,
    router_logits: usize,
    slot_row: usize,
    gather: usize,
    /// Per expert, its slots in the step (moe_count's, for moe_route).
    counted: usize,
    gu_table: usize,
    glu_table: usize,
    down_table: usize,
    gate_out: usize,
    up_out: usize,
    hidden: usize,
    down_out: usize,
    sum_rows: usize,
    sum_w: usize,
    logits: usize,
    fresh: usize,
}

fn quant_bytes(kind: ActKind, width: usize) -> usize {
    match kind {
        ActKind::Q8K if width.is_multiple_of(256) => kind.row_bytes(width),
        ActKind::Q8_0 if width.is_multiple_of(32) => kind.row_bytes(width),
        _ => 0,
    }
}

impl ResidentModel {
    /// The model's layers on `dev`, which must hold every weight of them but routed experts
    /// it can copy in through its streaming buffer (host_experts.rs); `Err` says why they
    /// cannot run there whole.
    pub fn new(dev: Arc<CudaOffload>, model: &Arc<Model>) -> Result<ResidentModel, String> {
        let plan = model.whole_model_plan()?;
        let err = |what: &str, e: cudarc::driver::DriverError| format!("{what}: {e}");
        dev.ctx
            .bind_to_thread()
            .map_err(|e| err("binding the context", e))?;
        // Weights were copied on the default stream; this stream must see them.
        dev.stream
            .synchronize()
            .map_err(|e| err("waiting for the weight copies", e))?;
        let stream = dev
            .ctx
            .new_stream()
            .map_err(|e| err("creating a stream", e))?;
        let load = |name: &str| {
            dev.module
                .load_function(name)
                .map_err(|e| format!("finding kernel {name}: {e}"))
        };
        let f = Kernels {
            matmul: load("matmul_grouped")?,
            matmul_one: load("matmul_one")?,
            matmul_mma: load("matmul_mma")?,
            glu: load("glu_quantize")?,
            weighted_sum: load("weighted_sum")?,
            rms_norm_quant: load("rms_norm_quant")?,
            quantize_rows: load("quantize_rows")?,
            qk_rope_store: load("qk_rope_store")?,
            attention: load("attention")?,
            attention_grouped: load("attention_grouped")?,
            attention_tile: load("attention_tile")?,
            moe_route: load("moe_route")?,
            moe_topk: load("moe_topk")?,
            moe_count: load("moe_count")?,
            handoff_out: load("handoff_out")?,
            handoff_in: load("handoff_in")?,
            handoff_signal: load("handoff_signal")?,
        };
        let WholeModelPlan {
            layers,
            output_norm,
            output,
            n_embd: d,
            n_head: nh,
            n_head_kv: nkv,
            head_dim: dk,
            n_rot,
            neox,
            rms_eps: eps,
            attn_scale: scale,
            n_vocab,
        } = plan;
        if d * 4 > 48 * 1024 || nh * dk * 4 > 48 * 1024 || dk > 512 || nkv == 0 || nh % nkv != 0 {
            return Err(format!(
                "{d} wide rows of {nh} heads of {dk} (at most 12288 values a row, 512 a head)"
            ));
        }
        let mut constants: Vec<CudaSlice<u8>> = Vec::new();
        let mut upload = |bytes: &[u8]| -> Result<u64, String> {
            let s = stream
                .clone_htod(bytes)
                .map_err(|e| format!("copying constants: {e}"))?;
            let (p, _) = s.device_ptr(&stream);
            constants.push(s);
            Ok(p)
        };
        let floats = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let mat_at = |w: &Weights, what: &str, addr: Option<u64>| -> Result<DevMat, String> {
            if !supports(w.dtype) {
                return Err(format!("{what} is {}, which has no GPU kernel", w.dtype));
            }
            let addr = addr.ok_or_else(|| format!("{what} is not in GPU memory"))?;
            let fmt = kernels::format(w.dtype).ok_or_else(|| format!("{what}: no format"))?;
            let act_bytes = act_row_bytes(w).map_err(|e| e.to_string())?;
            Ok(DevMat {
                addr,
                key: weights_key(w),
                act: fmt.act,
                act_bytes,
                rows: w.rows,
            })
        };
        let mat = |w: &Weights, what: &str| mat_at(w, what, dev.device_address(w.data));
        // Where the streaming buffer takes the experts the device does not hold, when it
        // streams them.
        let staging = dev
            .staging_buffer()
            .map_err(|e| format!("the streaming buffer: {e}"))?;
        // The buffer was allocated in the device stream's order; the copy stream must see it.
        dev.stream
            .synchronize()
            .map_err(|e| err("waiting for the streaming buffer", e))?;
        let host = host_experts::Layout::new(&dev, staging, &layers)?;
        let check_input = |m: &DevMat, width: usize, what: &str| -> Result<(), String> {
            if m.key.2 != width || (m.act != ActKind::F32 && quant_bytes(m.act, width) == 0) {
                return Err(format!("{what}: {} columns for rows of {width}", m.key.2));
            }
            Ok(())
        };
        let (mut max_ff, mut max_expert, mut max_k) = (0, 0, 0);
        let mut dev_layers = Vec::with_capacity(layers.len());
        for (il, l) in layers.iter().enumerate() {
            let name = |m: &str| format!("layer {il}'s {m}");
            let (q, k, v, o) = (
                mat(&l.q, &name("q"))?,
                mat(&l.k, &name("k"))?,
                mat(&l.v, &name("v"))?,
                mat(&l.o, &name("output projection"))?,
            );
            for (m, what) in [(&q, "q"), (&k, "k"), (&v, "v")] {
                check_input(m, d, &name(what))?;
            }
            check_input(&o, nh * dk, &name("output projection"))?;
            if q.rows != nh * dk || k.rows != nkv * dk || v.rows != nkv * dk || o.rows != d {
                return Err(name("attention shapes"));
            }
            let qk_norm = match (l.q_norm, l.k_norm) {
                (Some(qn), Some(kn)) => Some((upload(&floats(qn))?, upload(&floats(kn))?)),
                _ => None,
            };
            let ffn = match &l.ffn {
                PlanFfn::Dense { gate, up, down } => {
                    let (g, u, dn) = (
                        mat(gate, &name("gate"))?,
                        mat(up, &name("up"))?,
                        mat(down, &name("down"))?,
                    );
                    check_input(&g, d, &name("gate"))?;
                    check_input(&u, d, &name("up"))?;
                    check_input(&dn, g.rows, &name("down"))?;
                    if u.rows != g.rows || dn.rows != d || g.act != u.act {
                        return Err(name("FFN shapes"));
                    }
                    max_ff = max_ff.max(g.rows);
                    DevFfn::Dense {
                        gate: g,
                        up: u,
                        down: dn,
                    }
                }
                PlanFfn::Moe {
                    router,
                    experts,
                    k,
                    norm_topk,
                    weights_scale,
                } => {
                    let router = mat(router, &name("router"))?;
                    check_input(&router, d, &name("router"))?;
                    let n_expert = experts.len();
                    if n_expert > MAX_EXPERTS {
                        return Err(format!(
                            "{}: {n_expert} routed experts (the GPU's routing takes at most {MAX_EXPERTS})",
                            name("MoE layer")
                        ));
                    }
                    let mut tables: [Vec<u64>; 3] = Default::default();
                    let mut first: Option<[DevMat; 3]> = None;
                    for (e, x) in experts.iter().enumerate() {
                        let expert_mat = |w: &Weights, what: &str| {
                            let what = name(&format!("expert {e} {what}"));
                            let addr = dev
                                .device_address(w.data)
                                .or_else(|| host.address(il, w.data));
                            mat_at(w, &what, addr)
                        };
                        let ms = [
                            expert_mat(&x.gate, "gate")?,
                            expert_mat(&x.up, "up")?,
                            expert_mat(&x.down, "down")?,
                        ];
                        match &first {
                            None => {
                                check_input(&ms[0], d, &name("expert gate"))?;
                                check_input(&ms[2], ms[0].rows, &name("expert down"))?;
                                if ms[1].key != ms[0].key || ms[2].rows != d {
                                    return Err(name("expert shapes"));
                                }
                                first = Some(ms);
                            }
                            Some(f) if (0..3).any(|i| f[i].key != ms[i].key) => {
                                return Err(name("experts of differing formats"));
                            }
                            Some(_) => {}
                        }
                        for (t, m) in tables.iter_mut().zip(&ms) {
                            t.push(m.addr);
                        }
                    }
                    let Some([g, u, dn]) = first else {
                        return Err(name("MoE layer without experts"));
                    };
                    let n_ff = g.rows;
                    let hidden_act = dn.act;
                    let hidden_bytes = match hidden_act {
                        ActKind::F32 => 4 * n_ff,
                        a => a.row_bytes(n_ff),
                    };
                    let u64s =
                        |v: &[u64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
                    let addrs = [
                        upload(&u64s(&tables[0]))?,
                        upload(&u64s(&tables[1]))?,
                        upload(&u64s(&tables[2]))?,
                    ];
                    let desc: [u64; DESC_FIELDS] = [
                        n_expert as u64,
                        *k as u64,
                        *norm_topk as u64,
                        weights_scale.to_bits() as u64,
                        addrs[0],
                        addrs[1],
                        addrs[2],
                        g.key.0 as u64,
                        u.key.0 as u64,
                        dn.key.0 as u64,
                        n_ff as u64,
                        d as u64,
                        g.key.3,
                        u.key.3,
                        dn.key.3,
                        hidden_act.ggml_type() as u64,
                        hidden_bytes as u64,
                        g.act_bytes as u64,
                    ];
                    max_ff = max_ff.max(n_ff);
                    max_expert = max_expert.max(n_expert);
                    max_k = max_k.max(*k);
                    let (host_mask, device_experts) = match host.on_host(il) {
                        Some(on_host) => {
                            let flags: Vec<u8> = on_host
                                .iter()
                                .flat_map(|&h| u32::from(h).to_le_bytes())
                                .collect();
                            let held = on_host.iter().filter(|&&h| !h).count();
                            (upload(&flags)?, held)
                        }
                        None => (0, n_expert),
                    };
                    DevFfn::Moe {
                        router,
                        desc: upload(&u64s(&desc))?,
                        n_expert,
                        k: *k,
                        n_ff,
                        gate_act: g.act,
                        expert_types: [g.key.3, u.key.3, dn.key.3],
                        host_mask,
                        device_experts,
                    }
                }
            };
            dev_layers.push(DevLayer {
                attn_norm: upload(&floats(l.attn_norm))?,
                q,
                k,
                v,
                o,
                qk_norm,
                ffn_norm: upload(&floats(l.ffn_norm))?,
                ffn,
            });
        }
        let output = mat(&output, "the output head")?;
        check_input(&output, d, "the output head")?;
        let output_norm = upload(&floats(output_norm))?;
        let switches =
            launch::LaunchSwitches::from_env(dev.ctx.compute_capability().unwrap_or((0, 0)));
        let host_experts = host.finish(&dev.ctx, model, dev.host_read())?;
        Ok(ResidentModel {
            dev,
            stream,
            f,
            layers: dev_layers,
            output_norm,
            output,
            d,
            nh,
            nkv,
            dk,
            n_rot,
            neox,
            eps,
            scale,
            n_vocab,
            max_ff,
            max_expert,
            max_k,
            _constants: constants,
            state: Mutex::new(State::default()),
            steps: std::sync::atomic::AtomicU64::new(0),
            switches,
            timing: std::env::var("MOESHARD_GPU_TIMING")
                .is_ok_and(|v| v == "1")
                .then(StepTiming::default),
            host_experts,
        })
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> ModelError {
        ModelError::Matmul(self.dev.device_error(what, e))
    }

    /// Grows `b` (the arena, reallocated zeroed) to hold a step of `n` rows over caches of
    /// `ctx_needed` positions, `m_rows` of them with logits, `score_rows` with attention
    /// scores, and new KV rows of `kv_bytes` an element; sizes round up so that steps of
    /// similar shapes reuse one arena.
    fn fit_buffers(
        &self,
        b: &mut Buffers,
        n: usize,
        ctx_needed: usize,
        m_rows: usize,
        score_rows: usize,
        kv_bytes: usize,
    ) -> model::Result<()> {
        if b.arena.is_some()
            && b.rows >= n
            && b.ctx >= ctx_needed
            && b.logit_rows >= m_rows
            && b.score_rows >= score_rows
            && b.kv_bytes >= kv_bytes
        {
            return Ok(());
        }
        b.rows = b.rows.max(n).next_power_of_two();
        b.ctx = b.ctx.max(ctx_needed).next_multiple_of(1024);
        b.logit_rows = b.logit_rows.max(m_rows).next_power_of_two();
        b.score_rows = b.score_rows.max(score_rows).next_power_of_two();
        b.kv_bytes = b.kv_bytes.max(kv_bytes);
        b.generation += 1;
        let o = self.offsets(b.rows, b.ctx, b.logit_rows, b.score_rows);
        let kd = self.nkv * self.dk;
        b.arena = None;
        b.arena = Some(
            self.stream
                .alloc_zeros::<u8>(o.fresh + b.kv_bytes * b.rows * self.layers.len() * 2 * kd + 256)
                .map_err(|e| self.error("allocating step buffers", e))?,
        );
        Ok(())
    }

    /// The arena's layout for `n` rows over caches of up to `ctx` positions, `m` of them with
    /// logits and `scored` with attention scores.
    fn offsets(&self, n: usize, ctx: usize, m: usize, scored: usize) -> Offsets {
        let (d, nh, nkv, dk) = (self.d, self.nh, self.nkv, self.dk);
        let slots = n * self.max_k.max(1);
        let max_jobs = slots.min(self.max_expert).max(1);
        let ff = self.max_ff.max(1);
        let mut a = Arena::default();
        let input_len = self.input_layout(n).len;
        let input = a.take(input_len);
        let q8k = |w: usize| ActKind::Q8K.row_bytes(w - w % 256);
        let q80 = |w: usize| ActKind::Q8_0.row_bytes(w - w % 32);
        Offsets {
            input,
            input_len,
            hn: a.take(4 * n * d),
            ids: a.take(4 * slots),
            wts: a.take(4 * slots),
            host_sums: a.take(4 * n * d),
            handoff_done: a.take(4),
            hq8k: a.take(n * q8k(d)),
            hq80: a.take(n * q80(d)),
            q: a.take(4 * n * nh * dk),
            k: a.take(4 * n * nkv * dk),
            v: a.take(4 * n * nkv * dk),
            att: a.take(4 * n * nh * dk),
            att_q8k: a.take(n * q8k(nh * dk)),
            att_q80: a.take(n * q80(nh * dk)),
            scores: a.take(4 * scored * nh * attention_splits(ctx) * (2 + dk)),
            split_counts: a.take(4 * scored * nh),
            router_logits: a.take(4 * n * self.max_expert.max(1)),
            slot_row: a.take(4 * slots),
            gather: a.take(4 * slots),
            counted: a.take(4 * self.max_expert.max(1)),
            gu_table: a.take(2 * max_jobs * JOB_FIELDS * 8),
            glu_table: a.take(max_jobs * GLU_FIELDS * 8),
            down_table: a.take(max_jobs * JOB_FIELDS * 8),
            gate_out: a.take(4 * slots * ff),
            up_out: a.take(4 * slots * ff),
            hidden: a.take(slots * (4 * ff)),
            down_out: a.take(4 * slots * d),
            sum_rows: a.take(8 * slots),
            sum_w: a.take(4 * slots),
            logits: a.take(4 * m * self.n_vocab),
            // Last: the step's allocation sizes it by the caches' element type.
            fresh: {
                let at = a.take(0);
                debug_assert!(at > 0);
                at
            },
        }
    }

    /// Where a step's input lies (offsets from its start, each 16-byte aligned): per layer its
    /// matmul tables (q/k/v, output projection, router or dense gate/up and down, the dense
    /// activation's table) and the head's, then the rows, the RoPE table and the per-row
    /// arrays.
    fn input_layout(&self, n: usize) -> InputLayout {
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let here = at;
            at = (at + bytes).next_multiple_of(16);
            here
        };
        let half = self.n_rot / 2;
        let tables = take(self.layers.len() * (7 * JOB_FIELDS + GLU_FIELDS) * 8 + JOB_FIELDS * 8);
        InputLayout {
            _tables: tables,
            x: take(4 * n * self.d),
            cos: take(4 * n * half),
            sin: take(4 * n * half),
            pos: take(4 * n),
            row_k: take(8 * n),
            row_v: take(8 * n),
            row_stride: take(8 * n),
            head_rows: take(4 * n),
            slot_offsets: take(4 * (n + 1)),
            len: at.next_multiple_of(256),
        }
    }
}

struct InputLayout {
    _tables: usize,
    x: usize,
    cos: usize,
    sin: usize,
    pos: usize,
    row_k: usize,
    row_v: usize,
    row_stride: usize,
    head_rows: usize,
    slot_offsets: usize,
    len: usize,
}

mod exchange;
mod graph;
mod handoff;
mod host_experts;
mod host_side;
mod launch;
mod mirrors;
mod step;
mod step_input;
mod timing;

use timing::StepTiming;
