//! Whole steps on the GPU ([`model::LayerDevice`]): when the device holds every weight of a
//! model whose layers it has kernels for, a step's activations never leave it. The host sends
//! the embedded rows, the RoPE table and the step's tables in one copy, the device runs every
//! layer and the head, and one copy brings back the logits and the step's new keys and values,
//! which go into the host cache (so the CPU path, snapshots and rewinds see what they always
//! did). Each sequence's keys and values are mirrored in device memory, kept while the host
//! cache holds the same rows ([`model::KvCache::content_version`]) and copied again otherwise.

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use kernels::{ActKind, Weights};
use model::{DeviceStep, KvType, Model, ModelError, PlanFfn, WholeModelPlan};

use crate::cuda::{
    CudaOffload, GLU_FIELDS, JOB_FIELDS, MatRecord, ROWS_PER_BLOCK, THREADS_PER_BLOCK,
    TOKENS_PER_TILE, act_row_bytes, ensure_pinned, weights_key, write_matmul_table,
};
use crate::supports;

/// As in resident.cu.
const DESC_FIELDS: usize = 18;
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
    glu: CudaFunction,
    weighted_sum: CudaFunction,
    rms_norm_quant: CudaFunction,
    quantize_rows: CudaFunction,
    qk_rope_store: CudaFunction,
    attention: CudaFunction,
    moe_route: CudaFunction,
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
    arena: Option<CudaSlice<u8>>,
    host_in: Option<PinnedHostSlice<u8>>,
    host_out: Option<PinnedHostSlice<f32>>,
}

#[derive(Default)]
struct State {
    buffers: Buffers,
    mirrors: Vec<Mirror>,
    clock: u64,
}

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
    x: usize,
    hn: usize,
    hq8k: usize,
    hq80: usize,
    q: usize,
    k: usize,
    v: usize,
    att: usize,
    att_q8k: usize,
    att_q80: usize,
    scores: usize,
    router_logits: usize,
    ids: usize,
    wts: usize,
    slot_row: usize,
    gather: usize,
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
    /// The model's layers on `dev`, which must hold every weight of them; `Err` says why they
    /// cannot run there whole.
    pub fn new(dev: Arc<CudaOffload>, model: &Model) -> Result<ResidentModel, String> {
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
            glu: load("glu_quantize")?,
            weighted_sum: load("weighted_sum")?,
            rms_norm_quant: load("rms_norm_quant")?,
            quantize_rows: load("quantize_rows")?,
            qk_rope_store: load("qk_rope_store")?,
            attention: load("attention")?,
            moe_route: load("moe_route")?,
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
        if d * 4 > 48 * 1024 || nh * dk * 4 > 48 * 1024 || dk > 1024 || nkv == 0 || nh % nkv != 0 {
            return Err(format!(
                "{d} wide rows of {nh} heads of {dk} (at most 12288 values a row, 1024 a head)"
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
        let mat = |w: &Weights, what: &str| -> Result<DevMat, String> {
            if !supports(w.dtype) {
                return Err(format!("{what} is {}, which has no GPU kernel", w.dtype));
            }
            let addr = dev
                .device_address(w.data)
                .ok_or_else(|| format!("{what} is not in GPU memory"))?;
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
                    let mut tables: [Vec<u64>; 3] = Default::default();
                    let mut first: Option<[DevMat; 3]> = None;
                    for (e, x) in experts.iter().enumerate() {
                        let ms = [
                            mat(&x.gate, &name(&format!("expert {e} gate")))?,
                            mat(&x.up, &name(&format!("expert {e} up")))?,
                            mat(&x.down, &name(&format!("expert {e} down")))?,
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
                    DevFfn::Moe {
                        router,
                        desc: upload(&u64s(&desc))?,
                        n_expert,
                        k: *k,
                        n_ff,
                        gate_act: g.act,
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
        })
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> ModelError {
        ModelError::Matmul(self.dev.device_error(what, e))
    }

    /// The arena's layout for `n` rows over caches of up to `ctx` positions.
    fn offsets(&self, n: usize, ctx: usize) -> Offsets {
        let (d, nh, nkv, dk) = (self.d, self.nh, self.nkv, self.dk);
        let n_layers = self.layers.len();
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
            x: a.take(4 * n * d),
            hn: a.take(4 * n * d),
            hq8k: a.take(n * q8k(d)),
            hq80: a.take(n * q80(d)),
            q: a.take(4 * n * nh * dk),
            k: a.take(4 * n * nkv * dk),
            v: a.take(4 * n * nkv * dk),
            att: a.take(4 * n * nh * dk),
            att_q8k: a.take(n * q8k(nh * dk)),
            att_q80: a.take(n * q80(nh * dk)),
            scores: a.take(4 * n * nh * ctx),
            router_logits: a.take(4 * n * self.max_expert.max(1)),
            ids: a.take(4 * slots),
            wts: a.take(4 * slots),
            slot_row: a.take(4 * slots),
            gather: a.take(4 * slots),
            gu_table: a.take(2 * max_jobs * JOB_FIELDS * 8),
            glu_table: a.take(max_jobs * GLU_FIELDS * 8),
            down_table: a.take(max_jobs * JOB_FIELDS * 8),
            gate_out: a.take(4 * slots * ff),
            up_out: a.take(4 * slots * ff),
            hidden: a.take(slots * (4 * ff)),
            down_out: a.take(4 * slots * d),
            sum_rows: a.take(8 * slots),
            sum_w: a.take(4 * slots),
            logits: a.take(4 * n * self.n_vocab),
            fresh: {
                let at = a.take(4 * n * n_layers * 2 * nkv * dk);
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

/// Converts cache bytes of `t` to f32.
fn cache_floats(t: KvType, bytes: &[u8]) -> Vec<f32> {
    match t {
        KvType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        KvType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

fn put<T: Copy>(buf: &mut [u8], at: usize, values: &[T]) {
    // SAFETY: T is a plain number type (u32, u64, f32); the bytes are copied as they are.
    let bytes = unsafe {
        std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values))
    };
    buf[at..at + bytes.len()].copy_from_slice(bytes);
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
        } = step;
        let (d, nkv, dk) = (self.d, self.nkv, self.dk);
        let n_layers = self.layers.len();
        let n = x.len() / d;
        if n == 0 || model.n_layer() != n_layers {
            return Ok(None);
        }
        let kd = nkv * dk;
        // Caches of the model's whole shape only.
        let mut kv_type = None;
        for s in seqs.iter() {
            let l = s.kv.layout();
            let same_type = kv_type.is_none_or(|t| t == l.kv_type);
            if *l.layers.start() != 0
                || *l.layers.end() != n_layers - 1
                || l.n_kv_head != nkv
                || l.head_dim_k != dk
                || l.head_dim_v != dk
                || l.sliding.is_some()
                || l.compression.is_some()
                || l.index_keys.is_some()
                || l.hybrid.is_some()
                || !same_type
            {
                return Ok(None);
            }
            kv_type = Some(l.kv_type);
        }
        let Some(kv_type) = kv_type else {
            return Ok(None);
        };
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(|e| self.error("binding the context to this thread", e))?;
        let mut guard = self
            .state
            .lock()
            .map_err(|_| self.error("resident state", "poisoned by an earlier panic"))?;
        let state = &mut *guard;
        state.clock += 1;
        let clock = state.clock;
        let ctx_needed = seqs
            .iter()
            .zip(pos0)
            .map(|(s, &p)| p + s.n_tokens)
            .max()
            .unwrap_or(1);

        // The sequences' mirrors, (re)made and filled where stale.
        let mut mirror_of = Vec::with_capacity(seqs.len());
        for (s, &p0) in seqs.iter().zip(pos0) {
            let (id, _) = s.kv.content_version();
            let need = p0 + s.n_tokens;
            let n_ctx = s.kv.layout().n_ctx;
            let found = state.mirrors.iter().position(|m| m.version.0 == id);
            let i = match found {
                Some(i) if state.mirrors[i].capacity >= need => i,
                _ => {
                    if let Some(i) = found {
                        state.mirrors.swap_remove(i);
                    }
                    if state.mirrors.len() >= MIRRORS {
                        let oldest = (0..state.mirrors.len())
                            .min_by_key(|&i| state.mirrors[i].last_used)
                            .expect("full");
                        state.mirrors.swap_remove(oldest);
                    }
                    let capacity = need.next_multiple_of(1024).min(n_ctx).max(need);
                    let len = n_layers * capacity * kd;
                    let alloc = || {
                        self.stream
                            .alloc_zeros::<f32>(len)
                            .map_err(|e| self.error("allocating a KV mirror", e))
                    };
                    state.mirrors.push(Mirror {
                        version: (id, u64::MAX),
                        valid: 0,
                        capacity,
                        k: alloc()?,
                        v: alloc()?,
                        last_used: clock,
                    });
                    state.mirrors.len() - 1
                }
            };
            let m = &mut state.mirrors[i];
            m.last_used = clock;
            if m.version != s.kv.content_version() || m.valid < p0 {
                // The host's rows of positions 0..p0, layer by layer.
                for il in 0..n_layers {
                    let row = kd * kv_type.bytes();
                    let keys = cache_floats(kv_type, &s.kv.keys(il)?[..p0 * row]);
                    let values = cache_floats(kv_type, &s.kv.values(il)?[..p0 * row]);
                    let at = il * m.capacity * kd;
                    for (src, dst) in [(&keys, &mut m.k), (&values, &mut m.v)] {
                        if src.is_empty() {
                            continue;
                        }
                        let mut view = dst.slice_mut(at..at + src.len());
                        self.stream
                            .memcpy_htod(src.as_slice(), &mut view)
                            .map_err(|e| self.error("copying a KV cache in", e))?;
                    }
                }
                m.valid = p0;
            }
            mirror_of.push(i);
        }

        // Buffers for n rows and ctx_needed positions.
        let b = &mut state.buffers;
        if b.arena.is_none() || b.rows < n || b.ctx < ctx_needed {
            b.rows = b.rows.max(n).next_power_of_two();
            b.ctx = b.ctx.max(ctx_needed).next_multiple_of(1024);
            let o = self.offsets(b.rows, b.ctx);
            b.arena = None;
            b.arena = Some(
                self.stream
                    .alloc_zeros::<u8>(o.fresh + 4 * b.rows * n_layers * 2 * kd + 256)
                    .map_err(|e| self.error("allocating step buffers", e))?,
            );
        }
        let o = self.offsets(b.rows, b.ctx);
        let ctx_cap = b.ctx;
        let base = b
            .arena
            .as_ref()
            .map(|a| a.device_ptr(&self.stream).0)
            .expect("allocated above");
        let at = |off: usize| base + off as u64;
        let m_rows = logit_rows.len();
        let out_floats = m_rows * self.n_vocab + n * n_layers * 2 * kd;
        let pin_in = ensure_pinned(&self.dev.ctx, &mut b.host_in, o.input_len)
            .map_err(|e| self.error("allocating page-locked memory", e))?;
        let pin_out = ensure_pinned(&self.dev.ctx, &mut b.host_out, out_floats.max(1))
            .map_err(|e| self.error("allocating page-locked memory", e))?;
        // SAFETY: both hold at least these lengths (ensured above); nothing else refers to
        // them while the state lock is held, and every step ends by synchronizing the stream.
        let (host_in, host_out) = unsafe {
            (
                std::slice::from_raw_parts_mut(pin_in, o.input_len),
                std::slice::from_raw_parts_mut(pin_out, out_floats.max(1)),
            )
        };

        // The step's input: tables first, then the data they point at.
        let il_in = self.input_layout(b.rows);
        let half = self.n_rot / 2;
        let (x_in, cos_in, sin_in, pos_in) = (il_in.x, il_in.cos, il_in.sin, il_in.pos);
        let (rk_in, rv_in, rs_in, head_in) =
            (il_in.row_k, il_in.row_v, il_in.row_stride, il_in.head_rows);
        put(host_in, x_in, x);
        let (_, cos, sin) = rope.tables();
        put(host_in, cos_in, &cos[..n * half]);
        put(host_in, sin_in, &sin[..n * half]);
        let (mut row_pos, mut row_k, mut row_v, mut row_stride) =
            (Vec::with_capacity(n), Vec::new(), Vec::new(), Vec::new());
        for ((s, &p0), &mi) in seqs.iter().zip(pos0).zip(&mirror_of) {
            let m = &state.mirrors[mi];
            let (kp, vp) = (
                m.k.device_ptr(&self.stream).0,
                m.v.device_ptr(&self.stream).0,
            );
            for i in 0..s.n_tokens {
                row_pos.push((p0 + i) as u32);
                row_k.push(kp);
                row_v.push(vp);
                row_stride.push(m.capacity as u64);
            }
        }
        put(host_in, pos_in, &row_pos);
        put(host_in, rk_in, &row_k);
        put(host_in, rv_in, &row_v);
        put(host_in, rs_in, &row_stride);
        let head_rows: Vec<u32> = logit_rows.iter().map(|&r| r as u32).collect();
        put(host_in, head_in, &head_rows);
        // The weighted sum's slot offsets: row t's k slots start at t·k.
        let offs_in = il_in.slot_offsets;
        let slot_offsets: Vec<u32> = (0..=n).map(|t| (t * self.max_k) as u32).collect();
        put(host_in, offs_in, &slot_offsets);
        let input = |off: usize| at(o.input) + off as u64;

        // The quantized forms of a normed row of width `w` a matrix reads.
        let acts_of = |m: &DevMat, f32_at: usize, q8k_at: usize, q80_at: usize| match m.act {
            ActKind::F32 => at(f32_at),
            ActKind::Q8K => at(q8k_at),
            ActKind::Q8_0 => at(q80_at),
        };
        let record = |m: &DevMat, acts: u64, out: u64, rows_n: usize, accumulate: bool| MatRecord {
            w: m.addr,
            acts,
            out,
            weights: m.key,
            act_stride: m.act_bytes,
            n: rows_n,
            accumulate,
        };
        struct Tables {
            qkv: (usize, u32),
            o: (usize, u32),
            first: (usize, u32),
            down: (usize, u32),
            glu: usize,
        }
        let mut tables = Vec::with_capacity(n_layers);
        let mut cursor = 0usize;
        let mut write =
            |host_in: &mut [u8], records: &[MatRecord]| -> model::Result<(usize, u32)> {
                let here = cursor;
                let grid = write_matmul_table(&mut host_in[here..], records)
                    .ok_or_else(|| self.error("resident step", "too many blocks for one launch"))?;
                cursor += records.len() * JOB_FIELDS * 8;
                Ok((here, grid))
            };
        for l in &self.layers {
            let hn = |m: &DevMat| acts_of(m, o.hn, o.hq8k, o.hq80);
            let qkv = write(
                host_in,
                &[
                    record(&l.q, hn(&l.q), at(o.q), n, false),
                    record(&l.k, hn(&l.k), at(o.k), n, false),
                    record(&l.v, hn(&l.v), at(o.v), n, false),
                ],
            )?;
            let oo = write(
                host_in,
                &[record(
                    &l.o,
                    acts_of(&l.o, o.att, o.att_q8k, o.att_q80),
                    at(o.x),
                    n,
                    true,
                )],
            )?;
            let (first, down) = match &l.ffn {
                DevFfn::Moe { router, .. } => (
                    write(
                        host_in,
                        &[record(router, hn(router), at(o.router_logits), n, false)],
                    )?,
                    (0, 0),
                ),
                DevFfn::Dense { gate, up, down } => (
                    write(
                        host_in,
                        &[
                            record(gate, hn(gate), at(o.gate_out), n, false),
                            record(up, hn(up), at(o.up_out), n, false),
                        ],
                    )?,
                    write(host_in, &[record(down, at(o.hidden), at(o.x), n, true)])?,
                ),
            };
            tables.push(Tables {
                qkv,
                o: oo,
                first,
                down,
                glu: 0,
            });
        }
        let head_table = write(
            host_in,
            &[record(
                &self.output,
                acts_of(&self.output, o.hn, o.hq8k, o.hq80),
                at(o.logits),
                m_rows,
                false,
            )],
        )?;
        // The dense layers' activation tables.
        let mut glu_cursor = n_layers * 7 * JOB_FIELDS * 8 + JOB_FIELDS * 8;
        debug_assert!(cursor <= glu_cursor);
        for (l, t) in self.layers.iter().zip(tables.iter_mut()) {
            if let DevFfn::Dense { gate, down, .. } = &l.ffn {
                let fields: [u64; GLU_FIELDS] = [
                    at(o.gate_out),
                    at(o.up_out),
                    at(o.hidden),
                    gate.rows as u64,
                    down.act.ggml_type() as u64,
                    0,
                    n as u64,
                ];
                put(host_in, glu_cursor, &fields);
                t.glu = glu_cursor;
                glu_cursor += GLU_FIELDS * 8;
            }
        }

        // In, every layer, the head, out.
        let cu = self.stream.cu_stream();
        // SAFETY: host_in is page-locked and untouched until the synchronize below; the arena
        // holds the input region at o.input.
        unsafe { cudarc::driver::result::memcpy_htod_async(at(o.input), &host_in[..], cu) }
            .map_err(|e| self.error("copying the step in", e))?;
        let cfg = |grid: (u32, u32), block: u32, shared: u32| LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        };
        let launch_err = |name: &str, e: cudarc::driver::DriverError| {
            self.error(&format!("launching {name}"), e)
        };
        let matmul = |table: u64, n_jobs: usize, grid: u32| -> model::Result<()> {
            if grid == 0 {
                return Ok(());
            }
            let n_jobs = n_jobs as i32;
            let mut l = self.stream.launch_builder(&self.f.matmul);
            l.arg(&table).arg(&n_jobs);
            // SAFETY: matmul_grouped reads n_jobs records of a table in the arena (copied in
            // or written by moe_route, in stream order); their weights lie in uploaded
            // regions (checked when this model was built) and activations and outputs in the
            // arena, sized by `offsets` for these rows; blocks past the jobs return.
            unsafe { l.launch(cfg((grid, 1), THREADS_PER_BLOCK, 0)) }
                .map(|_| ())
                .map_err(|e| launch_err("matmul", e))
        };
        let null = 0u64;
        let form = |act_needed: bool, off: usize| if act_needed { at(off) } else { null };
        let (eps, d_i) = (self.eps, d as i32);
        let norm = |x_at: u64,
                    rows: u64,
                    w: u64,
                    out_rows: usize,
                    out: u64,
                    q8k: u64,
                    q80: u64|
         -> model::Result<()> {
            let mut l = self.stream.launch_builder(&self.f.rms_norm_quant);
            l.arg(&x_at)
                .arg(&rows)
                .arg(&w)
                .arg(&d_i)
                .arg(&eps)
                .arg(&out)
                .arg(&q8k)
                .arg(&q80);
            // SAFETY: rms_norm_quant reads out_rows rows of d floats of x (or the rows named by
            // `rows`), d weights, and writes out_rows rows of each form asked for, all in the
            // arena or uploaded constants; shared memory holds d floats.
            unsafe { l.launch(cfg((out_rows as u32, 1), 256, 4 * d as u32)) }
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
            let qkv: [&DevMat; 3] = [&l.q, &l.k, &l.v];
            norm(
                at(o.x),
                null,
                l.attn_norm,
                n,
                form(needs(&qkv, ActKind::F32), o.hn),
                form(needs(&qkv, ActKind::Q8K), o.hq8k),
                form(needs(&qkv, ActKind::Q8_0), o.hq80),
            )?;
            matmul(input(t.qkv.0), 3, t.qkv.1)?;
            {
                let (qn, kn) = l.qk_norm.unwrap_or((0, 0));
                let (q_at, k_at, v_at, fresh) = (at(o.q), at(o.k), at(o.v), at(o.fresh));
                let (cos_at, sin_at) = (input(cos_in), input(sin_in));
                let mut b = self.stream.launch_builder(&self.f.qk_rope_store);
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
                // position (capacity checked above); `fresh` holds n × layers × 2·kd floats.
                unsafe { b.launch(cfg((n as u32, (self.nh + nkv) as u32), block, 0)) }
                    .map_err(|e| launch_err("qk_rope_store", e))?;
            }
            {
                let (q_at, att_at, sc_at) = (at(o.q), at(o.att), at(o.scores));
                let cap = ctx_cap as i64;
                let scale = self.scale;
                let mut b = self.stream.launch_builder(&self.f.attention);
                b.arg(&q_at)
                    .arg(&att_at)
                    .arg(&rows_k)
                    .arg(&rows_v)
                    .arg(&rows_s)
                    .arg(&rows_p)
                    .arg(&il_i)
                    .arg(&nh_i)
                    .arg(&nkv_i)
                    .arg(&dk_i)
                    .arg(&dk_i)
                    .arg(&scale)
                    .arg(&sc_at)
                    .arg(&cap);
                // SAFETY: one block per (head, row); each reads its row's mirror up to its
                // position (< capacity) and writes dk floats of `att` and at most ctx_cap
                // scores (every position ≤ ctx_needed ≤ ctx_cap).
                unsafe { b.launch(cfg((self.nh as u32, n as u32), 256, 0)) }
                    .map_err(|e| launch_err("attention", e))?;
            }
            if l.o.act != ActKind::F32 {
                let width = (self.nh * dk) as i32;
                let (src, q8k, q80) = (
                    at(o.att),
                    form(l.o.act == ActKind::Q8K, o.att_q8k),
                    form(l.o.act == ActKind::Q8_0, o.att_q80),
                );
                let mut b = self.stream.launch_builder(&self.f.quantize_rows);
                b.arg(&src).arg(&width).arg(&q8k).arg(&q80);
                // SAFETY: n rows of `width` floats in, the asked form out, all in the arena;
                // shared memory holds one row.
                unsafe { b.launch(cfg((n as u32, 1), 256, 4 * width as u32)) }
                    .map_err(|e| launch_err("quantize_rows", e))?;
            }
            matmul(input(t.o.0), 1, t.o.1)?;
            match &l.ffn {
                DevFfn::Dense { gate, up, .. } => {
                    let gu: [&DevMat; 2] = [gate, up];
                    norm(
                        at(o.x),
                        null,
                        l.ffn_norm,
                        n,
                        form(needs(&gu, ActKind::F32), o.hn),
                        form(needs(&gu, ActKind::Q8K), o.hq8k),
                        form(needs(&gu, ActKind::Q8_0), o.hq80),
                    )?;
                    matmul(input(t.first.0), 2, t.first.1)?;
                    let (table, one) = (input(t.glu), 1i32);
                    let mut b = self.stream.launch_builder(&self.f.glu);
                    b.arg(&table).arg(&one);
                    // SAFETY: one job of n rows of the gate/up outputs into `hidden`, all in
                    // the arena (sized for the widest FFN).
                    unsafe { b.launch(cfg((n as u32, 1), 256, 0)) }
                        .map_err(|e| launch_err("glu_quantize", e))?;
                    matmul(input(t.down.0), 1, t.down.1)?;
                }
                DevFfn::Moe {
                    router,
                    desc,
                    n_expert,
                    k,
                    n_ff,
                    gate_act,
                } => {
                    let kind_of = |a: ActKind, b: ActKind| router.act == a || *gate_act == b;
                    norm(
                        at(o.x),
                        null,
                        l.ffn_norm,
                        n,
                        form(kind_of(ActKind::F32, ActKind::F32), o.hn),
                        form(kind_of(ActKind::Q8K, ActKind::Q8K), o.hq8k),
                        form(kind_of(ActKind::Q8_0, ActKind::Q8_0), o.hq80),
                    )?;
                    matmul(input(t.first.0), 1, t.first.1)?;
                    let slots = n * k;
                    let max_jobs = slots.min(*n_expert);
                    let acts = match gate_act {
                        ActKind::F32 => at(o.hn),
                        ActKind::Q8K => at(o.hq8k),
                        ActKind::Q8_0 => at(o.hq80),
                    };
                    let (n_i, mj_i) = (n as i32, max_jobs as i32);
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
                    let mut b = self.stream.launch_builder(&self.f.moe_route);
                    b.arg(&ptrs[0]).arg(&n_i);
                    for p in &ptrs[1..] {
                        b.arg(p);
                    }
                    b.arg(&mj_i);
                    // SAFETY: moe_route reads n rows of router logits and the layer's
                    // descriptor (uploaded constants) and writes tables for max_jobs experts
                    // and n·k slots into the arena, sized for them.
                    unsafe { b.launch(cfg((1, 1), 256, 0)) }
                        .map_err(|e| launch_err("moe_route", e))?;
                    let tiles = slots.div_ceil(TOKENS_PER_TILE) + max_jobs;
                    let grid = |rows: usize| -> model::Result<u32> {
                        u32::try_from(rows.div_ceil(ROWS_PER_BLOCK) * tiles)
                            .map_err(|_| self.error("resident step", "too many blocks"))
                    };
                    matmul(at(o.gu_table), 2 * max_jobs, 2 * grid(*n_ff)?)?;
                    let (glu_at, mj) = (at(o.glu_table), max_jobs as i32);
                    let mut b = self.stream.launch_builder(&self.f.glu);
                    b.arg(&glu_at).arg(&mj);
                    // SAFETY: one block per slot row; the table (written by moe_route) names
                    // gate/up/hidden rows in the arena.
                    unsafe { b.launch(cfg((slots as u32, 1), 256, 0)) }
                        .map_err(|e| launch_err("glu_quantize", e))?;
                    matmul(at(o.down_table), max_jobs, grid(d)?)?;
                    let (offs, rows, wts, x_at, acc) =
                        (input(offs_in), at(o.sum_rows), at(o.sum_w), at(o.x), 1i32);
                    let mut b = self.stream.launch_builder(&self.f.weighted_sum);
                    b.arg(&offs)
                        .arg(&rows)
                        .arg(&wts)
                        .arg(&d_i)
                        .arg(&x_at)
                        .arg(&acc);
                    // SAFETY: n + 1 offsets over n·k slot rows (down outputs of d floats in
                    // the arena) and weights; adds n rows of d floats into x.
                    unsafe { b.launch(cfg((n as u32, 1), 256, 0)) }
                        .map_err(|e| launch_err("weighted_sum", e))?;
                }
            }
        }
        // The head on the rows that need logits.
        if m_rows > 0 {
            let out = [&self.output];
            norm(
                at(o.x),
                input(head_in),
                self.output_norm,
                m_rows,
                form(needs(&out, ActKind::F32), o.hn),
                form(needs(&out, ActKind::Q8K), o.hq8k),
                form(needs(&out, ActKind::Q8_0), o.hq80),
            )?;
            matmul(input(head_table.0), 1, head_table.1)?;
        }
        let logits_len = m_rows * self.n_vocab;
        let fresh_len = n * n_layers * 2 * kd;
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
        self.stream
            .synchronize()
            .map_err(|e| self.error("waiting for the GPU", e))?;
        let logits = host_out[..logits_len].to_vec();
        let fresh = &host_out[logits_len..logits_len + fresh_len];
        let mut row = 0;
        for ((s, &p0), &mi) in seqs.iter_mut().zip(pos0).zip(&mirror_of) {
            for i in 0..s.n_tokens {
                for il in 0..n_layers {
                    let f = &fresh[(row * n_layers + il) * 2 * kd..][..2 * kd];
                    s.kv.store(il, p0 + i, &f[..kd], &f[kd..])?;
                }
                row += 1;
            }
            let m = &mut state.mirrors[mi];
            m.version = s.kv.content_version();
            m.valid = p0 + s.n_tokens;
        }
        self.steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Some(logits))
    }
}
