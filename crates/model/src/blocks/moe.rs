//! Mixture-of-experts feed-forward: a softmax or sigmoid router picks the top-k experts per token, tokens
//! are grouped by expert so each expert's weights are read once per batch, and each token's
//! expert outputs are summed in its top-k order — an order that does not depend on when an
//! expert became available, so streamed and resident runs give the same bits.

use kernels::{Input, MatmulJob};

use super::{Compute, swiglu};
use crate::arch::{Gating, Glu};
use crate::error::{ModelError, Result};
use crate::experts::{ExpertMatrices, ExpertSource};
use crate::hparams::MoeParams;
use crate::profile::{Phase, span};
use crate::weights::ExpertBiases;

mod host;
pub use host::host_expert_sums;

/// What an expert computes besides its three matrices: the activation and optional biases.
pub struct ExpertFfn<'a> {
    pub glu: Glu,
    pub biases: Option<&'a ExpertBiases>,
}

/// gpt-oss' clamped SwiGLU, in place into `gate` (as llama.cpp's `swiglu_oai` and HF).
pub fn clamped_swiglu(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    let glu = kernels::activation::ClampedGlu {
        alpha,
        limit,
        up_plus_one: true,
    };
    kernels::activation::clamped_silu_mul(gate, up, glu);
}

/// `ln(1 + e^x)`, linear above 20 as torch's `F.softplus` (threshold 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// DeepSeek V4's clamped SwiGLU, in place into `gate`: `silu(min(g, limit)) · clamp(u, ±limit)`.
pub fn clamped_silu(gate: &mut [f32], up: &[f32], limit: f32) {
    let glu = kernels::activation::ClampedGlu {
        alpha: 1.0,
        limit,
        up_plus_one: false,
    };
    kernels::activation::clamped_silu_mul(gate, up, glu);
}

/// The routing decision for a batch of tokens: `k` (expert, weight) slots per token, in
/// descending selection score.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub k: usize,
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

impl Routing {
    pub fn n_tokens(&self) -> usize {
        self.experts.len() / self.k
    }
}

/// `x ← softmax(x)` in place.
fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for p in x.iter_mut() {
        *p = (*p - max).exp();
        sum += *p;
    }
    for p in x.iter_mut() {
        *p /= sum;
    }
}

/// Router logits to top-k (expert, weight) slots by selection score, ties to the lower expert
/// id. `Softmax`: softmax over all experts; `Sigmoid`: a sigmoid per expert; `SoftmaxSelected`:
/// the raw logits select, a softmax over the chosen k weighs. The selection score is the
/// probability plus the correction `bias` when given (DeepSeek V3: the bias steers which experts
/// are picked, never how much they weigh), within the `n_group_used` best expert groups when
/// grouped. Then optional renormalization of the chosen weights (with llama.cpp's floor on the
/// sum) and scale.
pub fn route(logits: &[f32], n_expert: usize, params: &MoeParams, bias: Option<&[f32]>) -> Routing {
    let k = params.n_expert_used;
    let n = logits.len() / n_expert;
    let mut experts = Vec::with_capacity(n * k);
    let mut weights = Vec::with_capacity(n * k);
    let mut probs = vec![0f32; n_expert];
    let mut select = vec![0f32; n_expert];
    let mut order: Vec<usize> = Vec::with_capacity(n_expert);
    let n_group = params.n_group.max(1);
    let per_group = n_expert / n_group;
    let mut groups: Vec<usize> = Vec::with_capacity(n_group);
    let mut group_score = vec![0f32; n_group];
    for row in logits.chunks_exact(n_expert) {
        probs.copy_from_slice(row);
        match params.gating {
            Gating::Softmax => softmax_in_place(&mut probs),
            Gating::SoftmaxSelected => {}
            Gating::Sigmoid => {
                for (p, &l) in probs.iter_mut().zip(row) {
                    *p = 1.0 / (1.0 + (-l).exp());
                }
            }
            Gating::SqrtSoftplus => {
                for (p, &l) in probs.iter_mut().zip(row) {
                    *p = softplus(l).sqrt();
                }
            }
        }
        select.copy_from_slice(&probs);
        if let Some(b) = bias {
            for (s, &b) in select.iter_mut().zip(b) {
                *s += b;
            }
        }
        if n_group > 1 && params.n_group_used < n_group {
            // A group's score, as in DeepSeek's inference code: the sum of its two best
            // selection scores when there is a correction bias (V3's `noaux_tc`), its best
            // probability when there is none (V2's `group_limited_greedy`).
            for (g, score) in group_score.iter_mut().enumerate() {
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in &select[g * per_group..(g + 1) * per_group] {
                    if v > a {
                        b = a;
                        a = v;
                    } else if v > b {
                        b = v;
                    }
                }
                *score = if bias.is_some() { a + b } else { a };
            }
            groups.clear();
            groups.extend(0..n_group);
            groups.sort_by(|&a, &b| group_score[b].total_cmp(&group_score[a]).then(a.cmp(&b)));
            for &g in &groups[params.n_group_used..] {
                select[g * per_group..(g + 1) * per_group].fill(f32::NEG_INFINITY);
            }
        }
        order.clear();
        order.extend(0..n_expert);
        order.sort_by(|&a, &b| select[b].total_cmp(&select[a]).then(a.cmp(&b)));
        let chosen = &order[..k];
        if params.gating == Gating::SoftmaxSelected {
            let mut selected: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
            softmax_in_place(&mut selected);
            for (&e, &p) in chosen.iter().zip(&selected) {
                probs[e] = p;
            }
        }
        let mut wsum = 0f32;
        for &e in chosen {
            wsum += probs[e];
        }
        let norm = if params.norm_topk {
            1.0 / wsum.max(6.103_515_6e-5)
        } else {
            1.0
        };
        for &e in chosen {
            experts.push(e);
            let mut w = probs[e];
            if params.norm_topk {
                w *= norm;
            }
            weights.push(w * params.weights_scale);
        }
    }
    Routing {
        k,
        experts,
        weights,
    }
}

/// [`route`] with the tokens spread over the pool (each token is routed on its own, so the
/// result is the same).
pub fn route_tokens(
    cx: &Compute,
    logits: &[f32],
    n_expert: usize,
    params: &MoeParams,
    bias: Option<&[f32]>,
) -> Routing {
    let n = logits.len() / n_expert.max(1);
    let per_task = cx.rows_per_task(n).max(4);
    if n <= per_task {
        return route(logits, n_expert, params, bias);
    }
    let mut parts: Vec<Option<Routing>> = vec![None; n.div_ceil(per_task)];
    cx.pool.for_each_mut(&mut parts, |i, part| {
        let rows = i * per_task..((i + 1) * per_task).min(n);
        *part = Some(route(
            &logits[rows.start * n_expert..rows.end * n_expert],
            n_expert,
            params,
            bias,
        ));
    });
    let k = params.n_expert_used;
    let mut all = Routing {
        k,
        experts: Vec::with_capacity(n * k),
        weights: Vec::with_capacity(n * k),
    };
    for part in parts.into_iter().flatten() {
        all.experts.extend(part.experts);
        all.weights.extend(part.weights);
    }
    all
}

/// The tokens (and their slot) each expert serves.
fn group_by_expert(r: &Routing, n_expert: usize) -> Vec<Vec<usize>> {
    let mut groups = vec![Vec::new(); n_expert];
    for (slot, &e) in r.experts.iter().enumerate() {
        groups[e].push(slot);
    }
    groups
}

/// Routed experts' contribution for `x` (`n × n_embd`): Σ over each token's slots of
/// `weight · expert(x)`, counting only the experts `source` assigns itself (the rest are
/// another rank's).
/// The sum is accumulated in f64, so which rank adds which slots does not change the result.
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn(
    cx: &Compute,
    layer: usize,
    x: &Input,
    routing: &Routing,
    n_expert: usize,
    n_embd: usize,
    kind: &ExpertFfn,
    source: &dyn ExpertSource,
) -> Result<Vec<f64>> {
    let n = x.n();
    let groups = group_by_expert(routing, n_expert);
    let active: Vec<usize> = (0..n_expert).filter(|&e| !groups[e].is_empty()).collect();
    let tokens: Vec<usize> = active.iter().map(|&e| groups[e].len()).collect();
    let wanted = source.assign(layer, &active, &tokens);
    let mut mine = vec![false; n_expert];
    for &e in &wanted {
        if let Some(m) = mine.get_mut(e) {
            *m = true;
        }
    }
    // Per slot output (n_embd each), filled as experts arrive, summed in slot order at the end.
    let mut slot_out = cx.zeroed::<f32>(routing.experts.len() * n_embd);
    let mut done = vec![false; routing.experts.len()];
    // Experts an offload device ran come back summed per token (their slots stay zero).
    let mut device_sum: Option<Vec<f32>> = None;
    let mut summed = vec![false; routing.experts.len()];
    let mut sink = |batch: &[(usize, ExpertMatrices<'_>)]| -> Result<()> {
        let ran = run_experts(
            cx,
            x,
            &groups,
            batch,
            n_embd,
            kind,
            &routing.weights,
            &mut slot_out,
        )?;
        if let Some((sum, experts)) = ran {
            for e in experts {
                for &slot in &groups[e] {
                    summed[slot] = true;
                }
            }
            match &mut device_sum {
                Some(total) => total.iter_mut().zip(&sum).for_each(|(a, b)| *a += b),
                None => device_sum = Some(sum),
            }
        }
        for (e, _) in batch {
            for &slot in &groups[*e] {
                done[slot] = true;
            }
        }
        Ok(())
    };
    source.with_experts(layer, &wanted, &mut sink)?;
    let _combine = span(Phase::ExpertCombine);
    let is_mine = |s: usize| mine.get(routing.experts[s]).copied().unwrap_or(false);
    if let Some(s) = (0..routing.experts.len()).find(|&s| is_mine(s) && !done[s]) {
        return Err(ModelError::Experts(format!(
            "layer {layer}: expert {} was never provided",
            routing.experts[s]
        )));
    }
    let mut out = vec![0f64; n * n_embd];
    let k = routing.k;
    cx.par_rows(&mut out, n_embd, |first, rows| {
        for (j, o) in rows.chunks_exact_mut(n_embd).enumerate() {
            let t = first + j;
            for s in (t * k..(t + 1) * k).filter(|&s| is_mine(s) && !summed[s]) {
                let w = routing.weights[s] as f64;
                for (ov, &yv) in o.iter_mut().zip(&slot_out[s * n_embd..(s + 1) * n_embd]) {
                    *ov += w * yv as f64;
                }
            }
            if let Some(sum) = &device_sum {
                for (ov, &yv) in o.iter_mut().zip(&sum[t * n_embd..(t + 1) * n_embd]) {
                    *ov += yv as f64;
                }
            }
        }
    });
    Ok(out)
}

/// One ready expert's buffers through its FFN.
struct ExpertWork {
    /// The rows of the tokens it serves, in the gate/up activation form (left empty when each
    /// expert serves the one token, whose quantized input row every expert reads itself).
    rows_in: Vec<u8>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// The gated activation in the down projection's activation form.
    hidden: Vec<u8>,
    down: Vec<f32>,
}

/// Runs a batch of ready experts. Those whose three matrices an offload device (a GPU) holds,
/// or copies in for the step when the expert serves enough rows, run there as whole FFNs with
/// their weighted sum per token — when the FFN has no biases and a plain SiLU gate, the
/// device's one fused form — while the CPU runs the others at the same time into `slot_out`. Returns the device's per-token sums (`n × n_embd`) and the experts it
/// ran, if it ran any.
#[allow(clippy::too_many_arguments)]
fn run_experts(
    cx: &Compute,
    x: &Input,
    groups: &[Vec<usize>],
    batch: &[(usize, ExpertMatrices<'_>)],
    n_embd: usize,
    kind: &ExpertFfn,
    slot_weights: &[f32],
    slot_out: &mut [f32],
) -> Result<Option<(Vec<f32>, Vec<usize>)>> {
    let here_only = |batch: &[(usize, ExpertMatrices<'_>)], slot_out: &mut [f32]| {
        run_experts_here(cx, x, groups, batch, n_embd, kind, slot_out).map(|()| None)
    };
    let device = cx
        .offload()
        .filter(|_| kind.biases.is_none() && kind.glu == Glu::Silu && !batch.is_empty());
    let Some(device) = device else {
        return here_only(batch, slot_out);
    };
    // Experts the device holds run there; so do those it can copy in for the call when they
    // serve enough of the step's rows (a prompt's) for the copy to cost less than the CPU's work.
    let stream_from = device.streams_experts_from();
    let (there, here): (Vec<_>, Vec<_>) = batch.iter().copied().partition(|(e, m)| {
        let [g, u, d] = [&m.gate, &m.up, &m.down];
        (device.holds(g) && device.holds(u) && device.holds(d))
            || stream_from.is_some_and(|from| {
                groups[*e].len() >= from
                    && [g, u, d]
                        .iter()
                        .all(|w| device.holds(w) || device.can_stream(w))
            })
    });
    let act_of = |w: &kernels::Weights| kernels::format(w.dtype).map(|f| f.act);
    let gate_act = there.first().and_then(|(_, m)| act_of(&m.gate));
    let Some(gate_act) = gate_act.filter(|&a| {
        there
            .iter()
            .all(|(_, m)| act_of(&m.gate) == Some(a) && act_of(&m.up) == Some(a))
    }) else {
        return here_only(batch, slot_out);
    };
    // Quantized here, before the device's thread starts: the pool serves one caller at a time.
    let acts = x.quantized(gate_act, &cx.pool);
    let arb = gate_act.row_bytes(x.k());
    let slots_per_token = slot_out.len() / n_embd / x.n().max(1);
    let on_device = || -> Result<(bool, Vec<f32>)> {
        let rows_in: Vec<Vec<u8>> = there
            .iter()
            .map(|(e, _)| gather_rows(acts, arb, &groups[*e], slots_per_token))
            .collect();
        let tokens: Vec<Vec<u32>> = there
            .iter()
            .map(|(e, _)| {
                groups[*e]
                    .iter()
                    .map(|&s| (s / slots_per_token) as u32)
                    .collect()
            })
            .collect();
        let weights: Vec<Vec<f32>> = there
            .iter()
            .map(|(e, _)| groups[*e].iter().map(|&s| slot_weights[s]).collect())
            .collect();
        let jobs: Vec<kernels::ExpertFfnJob> = there
            .iter()
            .enumerate()
            .map(|(i, (e, m))| kernels::ExpertFfnJob {
                gate: m.gate,
                up: m.up,
                down: m.down,
                acts: &rows_in[i],
                n: groups[*e].len(),
                tokens: &tokens[i],
                weights: &weights[i],
            })
            .collect();
        let mut sum = vec![0f32; x.n() * n_embd];
        let ran = device.expert_ffn(&jobs, &mut sum)?;
        Ok((ran, sum))
    };
    let (device_result, here_result) = if here.is_empty() {
        let _wait = span(Phase::ExpertDevice);
        (on_device(), Ok(()))
    } else {
        std::thread::scope(|s| {
            let gpu = s.spawn(on_device);
            let cpu = run_experts_here(cx, x, groups, &here, n_embd, kind, slot_out);
            let _wait = span(Phase::ExpertDevice);
            let gpu = match gpu.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            (gpu, cpu)
        })
    };
    here_result?;
    let (ran, sum) = device_result?;
    if !ran {
        return here_only(&there, slot_out);
    }
    Ok(Some((sum, there.iter().map(|(e, _)| *e).collect())))
}

/// Runs a batch of ready experts on this machine's CPU: gate and up of all of them in one
/// dispatch, then all downs. The per-row work between (gathering, biases, activation,
/// quantization, scattering) runs on the pool too, one expert or one block of slots per task:
/// done serially it costs as much as the matmuls at 16 threads.
fn run_experts_here(
    cx: &Compute,
    x: &Input,
    groups: &[Vec<usize>],
    batch: &[(usize, ExpertMatrices<'_>)],
    n_embd: usize,
    kind: &ExpertFfn,
    slot_out: &mut [f32],
) -> Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    let k_slots = slot_out.len() / n_embd;
    let n_tokens = x.n();
    let slots_per_token = k_slots / n_tokens.max(1);
    // One token whose experts are all different (top-k routing always; hash routing could
    // name one twice): each expert serves exactly one slot, the token's row.
    let one_slot_each = n_tokens == 1 && batch.iter().all(|(e, _)| groups[*e].len() == 1);
    // Gather each expert's token rows from the input quantized once for the gate/up format.
    let gather_span = span(Phase::ExpertGather);
    let format_of = |m: &kernels::Weights| {
        kernels::format(m.dtype).ok_or(kernels::MatmulError::UnsupportedType(m.dtype))
    };
    let gate_act = format_of(&batch[0].1.gate)?.act;
    let mut down_acts = Vec::with_capacity(batch.len());
    for (e, m) in batch {
        if format_of(&m.gate)?.act != gate_act || format_of(&m.up)?.act != gate_act {
            return Err(ModelError::Experts(format!(
                "expert {e}: mixed gate/up formats in one layer"
            )));
        }
        down_acts.push(format_of(&m.down)?.act);
    }
    let acts = x.quantized(gate_act, &cx.pool);
    let arb = gate_act.row_bytes(x.k());
    let mut work: Vec<ExpertWork> = batch
        .iter()
        .map(|_| ExpertWork {
            rows_in: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
            hidden: Vec::new(),
            down: Vec::new(),
        })
        .collect();
    let prepare = |i: usize, w: &mut ExpertWork| {
        let (e, m) = &batch[i];
        let slots = &groups[*e];
        if !one_slot_each {
            w.rows_in = gather_rows(acts, arb, slots, slots_per_token);
        }
        w.gate = vec![0f32; slots.len() * m.gate.rows];
        w.up = vec![0f32; slots.len() * m.up.rows];
    };
    if !one_slot_each {
        cx.pool.for_each_mut(&mut work, prepare);
    } else {
        // Decode: nothing to gather, and a dispatch would cost more than these allocations.
        work.iter_mut().enumerate().for_each(|(i, w)| prepare(i, w));
    }
    drop(gather_span);
    let gate_up_span = span(Phase::ExpertGateUp);
    {
        let mut jobs = Vec::with_capacity(2 * batch.len());
        for ((e, m), w) in batch.iter().zip(work.iter_mut()) {
            let n = groups[*e].len();
            let ExpertWork {
                rows_in, gate, up, ..
            } = w;
            let rows_in: &[u8] = if one_slot_each { &acts[..arb] } else { rows_in };
            jobs.push(MatmulJob {
                w: m.gate,
                acts: rows_in,
                n,
                out: gate,
            });
            jobs.push(MatmulJob {
                w: m.up,
                acts: rows_in,
                n,
                out: up,
            });
        }
        cx.matmul_batch(&mut jobs)?;
    }
    drop(gate_up_span);
    let activation_span = span(Phase::ExpertActivation);
    cx.pool.for_each_mut(&mut work, |i, w| {
        let (e, m) = &batch[i];
        if let Some(b) = kind.biases {
            let (bg, bu, _) = b.of(*e);
            add_to_rows(&mut w.gate, bg);
            add_to_rows(&mut w.up, bu);
        }
        match kind.glu {
            Glu::Silu => swiglu(&mut w.gate, &w.up),
            Glu::ClampedSwiglu { alpha, limit } => clamped_swiglu(&mut w.gate, &w.up, alpha, limit),
            Glu::ClampedSilu { limit } => clamped_silu(&mut w.gate, &w.up, limit),
        }
        let width = m.gate.rows;
        let act = down_acts[i];
        let hrb = act.row_bytes(width);
        w.hidden = vec![0u8; groups[*e].len() * hrb];
        for (src, dst) in w
            .gate
            .chunks_exact(width)
            .zip(w.hidden.chunks_exact_mut(hrb))
        {
            act.quantize_row(src, dst);
        }
        if !one_slot_each {
            w.down = vec![0f32; groups[*e].len() * m.down.rows];
        }
    });
    drop(activation_span);
    let down_span = span(Phase::ExpertDown);
    if one_slot_each {
        // Decode: each expert's down projection writes its slot's row, nothing to scatter.
        let mut rows: Vec<Option<&mut [f32]>> =
            slot_out.chunks_exact_mut(n_embd).map(Some).collect();
        let mut jobs = Vec::with_capacity(batch.len());
        for ((e, m), w) in batch.iter().zip(work.iter()) {
            let slot = groups[*e][0];
            let out = rows.get_mut(slot).and_then(Option::take).ok_or_else(|| {
                ModelError::Experts(format!("expert {e}: slot {slot} is not free"))
            })?;
            jobs.push(MatmulJob {
                w: m.down,
                acts: &w.hidden,
                n: 1,
                out,
            });
        }
        cx.matmul_batch(&mut jobs)?;
        drop(jobs);
        drop(down_span);
        if let Some(b) = kind.biases {
            let _combine = span(Phase::ExpertCombine);
            for (e, _) in batch {
                let slot = groups[*e][0];
                add_to_rows(
                    &mut slot_out[slot * n_embd..(slot + 1) * n_embd],
                    b.of(*e).2,
                );
            }
        }
        return Ok(());
    }
    {
        let mut jobs = Vec::with_capacity(batch.len());
        for ((e, m), w) in batch.iter().zip(work.iter_mut()) {
            jobs.push(MatmulJob {
                w: m.down,
                acts: &w.hidden,
                n: groups[*e].len(),
                out: &mut w.down,
            });
        }
        cx.matmul_batch(&mut jobs)?;
    }
    drop(down_span);
    let _combine = span(Phase::ExpertCombine);
    // Which expert of the batch, and which of its rows, fills each slot.
    let mut source = vec![None; k_slots];
    for (bi, (e, _)) in batch.iter().enumerate() {
        for (row, &slot) in groups[*e].iter().enumerate() {
            source[slot] = Some((bi, row));
        }
    }
    cx.par_rows(slot_out, n_embd, |first, rows| {
        for (j, dst) in rows.chunks_exact_mut(n_embd).enumerate() {
            let Some((bi, row)) = source[first + j] else {
                continue;
            };
            let y = &work[bi].down[row * n_embd..(row + 1) * n_embd];
            match kind.biases {
                Some(b) => {
                    let bias = b.of(batch[bi].0).2;
                    for ((d, &v), &bv) in dst.iter_mut().zip(y).zip(bias) {
                        *d = v + bv;
                    }
                }
                None => dst.copy_from_slice(y),
            }
        }
    });
    Ok(())
}

/// The activation rows (`arb` bytes each) of the tokens that fill `slots`, in slot order.
fn gather_rows(acts: &[u8], arb: usize, slots: &[usize], slots_per_token: usize) -> Vec<u8> {
    let mut rows = Vec::with_capacity(slots.len() * arb);
    for &slot in slots {
        let t = slot / slots_per_token;
        rows.extend_from_slice(&acts[t * arb..(t + 1) * arb]);
    }
    rows
}

/// Adds `bias` to every row of `x` (rows of `bias.len()`).
fn add_to_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The qwen3moe F32 fixture, its embedding width and its routed experts.
    pub(super) fn qwen3moe_f32() -> (crate::Model, usize, usize) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/qwen3moe/model-f32.gguf");
        let model = crate::Model::load(&path).expect("the qwen3moe fixture loads");
        let n_embd = model.hp.n_embd;
        let n_expert = model.hp.moe.as_ref().expect("a MoE fixture").n_expert;
        (model, n_embd, n_expert)
    }

    /// One token whose two slots name the same expert (hash routing could): each slot gets the
    /// expert's whole output, and they add up in slot order, exactly as one slot of weight one
    /// gives that output alone.
    #[test]
    fn a_token_routed_twice_to_one_expert_gets_both_slots() {
        let (model, n_embd, n_expert) = qwen3moe_f32();
        let cx = Compute::new(2);
        let x: Vec<f32> = (0..n_embd)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 9.0)
            .collect();
        let input = Input::new(&x, 1, n_embd).expect("one row");
        let kind = ExpertFfn {
            glu: Glu::Silu,
            biases: None,
        };
        let experts = crate::experts::ResidentExperts::new(&model);
        let run = |picks: &[usize], weights: &[f32]| {
            let routing = Routing {
                k: picks.len(),
                experts: picks.to_vec(),
                weights: weights.to_vec(),
            };
            moe_ffn(&cx, 0, &input, &routing, n_expert, n_embd, &kind, &experts)
                .expect("the experts run")
        };
        let alone = run(&[1], &[1.0]);
        let twice = run(&[1, 1], &[0.75, 0.5]);
        let want: Vec<f64> = alone.iter().map(|&y| 0.75 * y + 0.5 * y).collect();
        assert_eq!(twice, want);
    }

    fn params(gating: Gating, k: usize, n_group: usize, n_group_used: usize) -> MoeParams {
        MoeParams {
            n_expert: 8,
            n_expert_used: k,
            norm_topk: false,
            weights_scale: 1.0,
            gating,
            n_group,
            n_group_used,
        }
    }

    fn sigmoid(x: f32) -> f32 {
        1.0 / (1.0 + (-x).exp())
    }

    #[test]
    fn the_correction_bias_picks_experts_but_does_not_weigh_them() {
        let logits = [2.0, 1.0, 0.0, -1.0, -2.0, 0.5, 0.2, 0.1];
        let p = params(Gating::Sigmoid, 2, 1, 1);
        let plain = route(&logits, 8, &p, None);
        assert_eq!(plain.experts, vec![0, 1]);
        let mut bias = [0f32; 8];
        bias[4] = 3.0;
        let biased = route(&logits, 8, &p, Some(&bias));
        assert_eq!(biased.experts, vec![4, 0]);
        assert_eq!(biased.weights, vec![sigmoid(-2.0), sigmoid(2.0)]);
    }

    #[test]
    fn only_the_best_groups_compete() {
        // Groups of two: {0,1} {2,3} {4,5} {6,7}. Expert 0 is the single best, but with a
        // correction bias (V3, here all zero) group 0's top-2 sum loses to groups 1 and 3...
        let logits = [3.0, -3.0, 1.0, 1.0, -1.0, -1.0, 1.2, 0.9];
        let zero = [0f32; 8];
        let v3 = route(&logits, 8, &params(Gating::Sigmoid, 2, 4, 2), Some(&zero));
        assert_eq!(v3.experts, vec![6, 2]);
        // ... while without one (V2) a group's score is its best expert.
        let v2 = route(&logits, 8, &params(Gating::Softmax, 2, 4, 2), None);
        assert_eq!(v2.experts, vec![0, 6]);
        let sigmoid_unbiased = route(&logits, 8, &params(Gating::Sigmoid, 2, 4, 2), None);
        assert_eq!(sigmoid_unbiased.experts, vec![0, 6]);
        // Without groups, expert 0 wins outright.
        let flat = route(&logits, 8, &params(Gating::Sigmoid, 2, 1, 1), None);
        assert_eq!(flat.experts, vec![0, 6]);
    }

    #[test]
    fn renormalization_and_scale_apply_to_the_unbiased_probabilities() {
        let logits = [0.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0];
        let mut p = params(Gating::Sigmoid, 2, 1, 1);
        p.norm_topk = true;
        p.weights_scale = 2.5;
        let mut bias = [0f32; 8];
        bias[2] = 1.0;
        let r = route(&logits, 8, &p, Some(&bias));
        // Expert 2 is picked first (its bias lifts it), but weighs by its own probability.
        assert_eq!(r.experts, vec![2, 1]);
        let (a, b) = (sigmoid(-1.0), sigmoid(1.0));
        let want = [a / (a + b) * 2.5, b / (a + b) * 2.5];
        for (w, v) in r.weights.iter().zip(want) {
            assert!((w - v).abs() < 1e-6, "{w} vs {v}");
        }
    }
}
