//! The routed experts a whole-model device leaves to the host in a step: the CPU's share of
//! a layer the device routed (`crate::layer_device`'s hybrid decode).

use kernels::Input;

use super::{ExpertFfn, run_experts_here};
use crate::blocks::Compute;
use crate::error::{ModelError, Result};

/// For a whole-model device that computes the other routed experts of layer `layer` itself:
/// the experts `on_host` marks, on this machine's CPU, for rows `x` (`n × n_embd`, the layer's
/// normed FFN input) routed as the device routed them (`ids` and `weights`, `k` slots a row).
/// `out` (`n × n_embd`) gets each row's weighted sum of its host slots' outputs, in slot order
/// (zero for a row with none). The model's experts are SwiGLU without biases (the whole-model
/// plan's).
#[allow(clippy::too_many_arguments)]
pub fn host_expert_sums(
    cx: &Compute,
    model: &crate::Model,
    layer: usize,
    x: &[f32],
    k: usize,
    ids: &[u32],
    weights: &[f32],
    on_host: &[bool],
    out: &mut [f32],
) -> Result<()> {
    let n_embd = model.hp.n_embd;
    let n = x.len() / n_embd.max(1);
    if x.len() != n * n_embd || ids.len() != n * k || weights.len() != n * k || out.len() != x.len()
    {
        return Err(ModelError::Experts(format!(
            "layer {layer}: host experts for {} values, {} slots of {k} and {} weights into {} \
             values ({n_embd} a row)",
            x.len(),
            ids.len(),
            weights.len(),
            out.len()
        )));
    }
    let mut groups = vec![Vec::new(); on_host.len()];
    for (slot, &e) in ids.iter().enumerate() {
        let e = e as usize;
        match on_host.get(e) {
            Some(true) => groups[e].push(slot),
            Some(false) => {}
            None => {
                return Err(ModelError::Experts(format!(
                    "layer {layer}: the device routed slot {slot} to expert {e} of {}",
                    on_host.len()
                )));
            }
        }
    }
    out.fill(0.0);
    let mut batch = Vec::new();
    for (e, g) in groups.iter().enumerate() {
        if !g.is_empty() {
            batch.push((e, model.expert_weights(layer, e)?));
        }
    }
    if batch.is_empty() {
        return Ok(());
    }
    let input = Input::new(x, n, n_embd)?;
    let mut slot_out = vec![0f32; n * k * n_embd];
    let kind = ExpertFfn {
        glu: model.spec.glu,
        biases: None,
    };
    run_experts_here(cx, &input, &groups, &batch, n_embd, &kind, &mut slot_out)?;
    let is_host = |s: usize| on_host[ids[s] as usize];
    for (t, o) in out.chunks_exact_mut(n_embd).enumerate() {
        for s in (t * k..(t + 1) * k).filter(|&s| is_host(s)) {
            let w = weights[s];
            for (ov, &yv) in o.iter_mut().zip(&slot_out[s * n_embd..(s + 1) * n_embd]) {
                *ov += w * yv;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::Glu;
    use crate::blocks::moe::tests::qwen3moe_f32;
    use crate::blocks::moe::{Routing, moe_ffn};

    /// The host's share of a device's routing: what the CPU path gives for the experts the
    /// mask marks, per row (the rows' other slots left out), and nothing for a row with none;
    /// the two halves of a mask add up to the whole layer.
    #[test]
    fn host_expert_sums_are_the_marked_experts_share() {
        let (model, n_embd, n_expert) = qwen3moe_f32();
        let cx = Compute::new(2);
        let n = 3;
        let x: Vec<f32> = (0..n * n_embd)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 9.0)
            .collect();
        let input = Input::new(&x, n, n_embd).expect("three rows");
        let kind = ExpertFfn {
            glu: Glu::Silu,
            biases: None,
        };
        let experts = crate::experts::ResidentExperts::new(&model);
        // Row 0 picks experts 0 and 1, row 1 experts 1 and 2, row 2 experts 2 and 3.
        let k = 2;
        let picks: Vec<usize> = vec![0, 1, 1, 2, 2, 3];
        let weights = vec![0.75f32, 0.25, 0.5, 0.5, 0.125, 0.875];
        let ids: Vec<u32> = picks.iter().map(|&e| e as u32).collect();
        // Experts 1 and 3 on the host: row 0 has slot 1, row 1 slot 0, row 2 slot 1.
        let on_host: Vec<bool> = (0..n_expert).map(|e| e == 1 || e == 3).collect();
        let mut got = vec![f32::NAN; n * n_embd];
        host_expert_sums(&cx, &model, 0, &x, k, &ids, &weights, &on_host, &mut got)
            .expect("the host's experts run");
        let cpu = |picks: &[usize], weights: &[f32]| {
            let routing = Routing {
                k: 1,
                experts: picks.to_vec(),
                weights: weights.to_vec(),
            };
            moe_ffn(&cx, 0, &input, &routing, n_expert, n_embd, &kind, &experts)
                .expect("the experts run")
        };
        let want = cpu(&[1, 1, 3], &[0.25, 0.5, 0.875]);
        let diff = got
            .iter()
            .zip(&want)
            .map(|(&g, &w)| (g as f64 - w).abs())
            .fold(0f64, f64::max);
        assert!(diff < 1e-5, "host sums differ from the CPU path by {diff}");
        assert!(
            want.iter().any(|&w| w.abs() > 1e-3),
            "a share worth comparing"
        );
        // The other half of the mask, and the whole layer.
        let rest: Vec<bool> = on_host.iter().map(|&h| !h).collect();
        let mut other = vec![f32::NAN; n * n_embd];
        host_expert_sums(&cx, &model, 0, &x, k, &ids, &weights, &rest, &mut other)
            .expect("the host's experts run");
        let whole = moe_ffn(
            &cx,
            0,
            &input,
            &Routing {
                k,
                experts: picks.clone(),
                weights: weights.clone(),
            },
            n_expert,
            n_embd,
            &kind,
            &experts,
        )
        .expect("the experts run");
        let diff = got
            .iter()
            .zip(&other)
            .zip(&whole)
            .map(|((&a, &b), &w)| (a as f64 + b as f64 - w).abs())
            .fold(0f64, f64::max);
        assert!(diff < 1e-5, "the halves differ from the whole by {diff}");
        // No host expert picked: zeros.
        let none = vec![false; n_expert];
        host_expert_sums(&cx, &model, 0, &x, k, &ids, &weights, &none, &mut other)
            .expect("nothing to run");
        assert!(other.iter().all(|&v| v == 0.0));
        // An expert the model lacks is an error naming it.
        let bad: Vec<u32> = vec![0, n_expert as u32, 1, 2, 2, 3];
        let err = host_expert_sums(&cx, &model, 0, &x, k, &bad, &weights, &on_host, &mut other)
            .expect_err("a slot past the experts");
        assert!(
            err.to_string().contains(&format!("expert {n_expert}")),
            "{err}"
        );
    }
}
