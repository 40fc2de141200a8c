//! The seam for a device that runs whole forward passes (a GPU holding every weight): what it
//! is given per step, and the description of the model it builds itself from
//! ([`Model::whole_model_plan`]). The forward path hands a step to it when one is attached
//! and the step is one it can run (every layer and the head, token input, no observing hooks,
//! one rank); it may still decline (`Ok(None)`), and the CPU path then runs the step.

use kernels::Weights;

use crate::Model;
use crate::arch::{Gating, QkNorm, RopeKind};
use crate::blocks::rope::RopeTable;
use crate::error::Result;
use crate::pass::SeqInput;
use crate::weights::{AttentionWeights, ExpertMatrices, Ffn};

/// One step for a [`LayerDevice`]: the embedded rows of every sequence of the batch (their
/// caches already reserved for the new positions), and which rows need logits.
pub struct DeviceStep<'a, 'k> {
    /// `n × n_embd`, the batch's rows in sequence order.
    pub x: &'a [f32],
    pub seqs: &'a mut [SeqInput<'k>],
    /// Each sequence's first new position.
    pub pos0: &'a [usize],
    pub rope: &'a RopeTable,
    pub logit_rows: &'a [usize],
    /// The CPU's threads, for work the device leaves to the host (routed experts it does not
    /// hold, in steps too small to copy them in).
    pub cx: &'a crate::Compute,
}

/// A device that runs every layer and the head of a step. It stores the step's keys and
/// values into the sequences' caches (so that the CPU path or a snapshot can take over at any
/// step) and returns the logits of `logit_rows` (`rows × n_vocab`), or `None` when it declines
/// the step before changing anything.
pub trait LayerDevice: Send + Sync {
    fn forward(&self, model: &Model, step: DeviceStep) -> Result<Option<Vec<f32>>>;

    /// Steps run so far (not the declined ones).
    fn steps(&self) -> u64;
}

/// A layer as a whole-model device runs it: grouped-query attention without biases or sinks
/// (its q/k norms per head, or none), and a SwiGLU FFN or softmax-routed experts.
pub struct PlanLayer<'m> {
    pub attn_norm: &'m [f32],
    pub q: Weights<'m>,
    pub k: Weights<'m>,
    pub v: Weights<'m>,
    pub o: Weights<'m>,
    pub q_norm: Option<&'m [f32]>,
    pub k_norm: Option<&'m [f32]>,
    pub ffn_norm: &'m [f32],
    pub ffn: PlanFfn<'m>,
}

pub enum PlanFfn<'m> {
    Dense {
        gate: Weights<'m>,
        up: Weights<'m>,
        down: Weights<'m>,
    },
    /// Softmax over every expert, the top `k`, renormalized when `norm_topk`, times
    /// `weights_scale`; `experts[e]` is expert `e`.
    Moe {
        router: Weights<'m>,
        experts: Vec<ExpertMatrices<'m>>,
        k: usize,
        norm_topk: bool,
        weights_scale: f32,
    },
}

/// The whole model in the terms a whole-model device runs.
pub struct WholeModelPlan<'m> {
    pub layers: Vec<PlanLayer<'m>>,
    pub output_norm: &'m [f32],
    pub output: Weights<'m>,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub neox: bool,
    pub rms_eps: f32,
    pub attn_scale: f32,
    pub n_vocab: usize,
}

impl Model {
    /// This model as a [`WholeModelPlan`], or why a whole-model device cannot run it.
    pub fn whole_model_plan(&self) -> std::result::Result<WholeModelPlan<'_>, String> {
        let hp = &self.hp;
        let arch = self.spec.name;
        if hp.dsv4.is_some() || hp.glm5next.is_some() || hp.mla.is_some() || hp.dsa.is_some() {
            return Err(format!(
                "{arch}'s attention has no whole-layer GPU form yet"
            ));
        }
        if hp.sliding_window.is_some() && hp.swa_layers.iter().any(|&s| s) {
            return Err("sliding-window layers have no whole-layer GPU form yet".into());
        }
        if self.spec.qk_norm == QkNorm::Whole {
            return Err(
                "a q/k norm over the whole projection has no whole-layer GPU form yet".into(),
            );
        }
        if self.slice.is_some() || self.shard.is_split() {
            return Err("the file or rank holds part of the model".into());
        }
        if hp.head_dim_k != hp.head_dim_v || hp.head_dim_k > 512 {
            return Err(format!(
                "heads of {} key and {} value dims (equal, at most 512, run whole on the GPU)",
                hp.head_dim_k, hp.head_dim_v
            ));
        }
        let files = self.files();
        let (Some(output_norm), Some(output)) = (&self.output_norm, &self.output) else {
            return Err("the file holds no output head".into());
        };
        let mut layers = Vec::with_capacity(hp.n_layer);
        for il in 0..hp.n_layer {
            let l = self
                .layer(il)
                .ok_or_else(|| format!("layer {il} is not held"))?;
            let AttentionWeights::Gqa(a) = &l.attn else {
                return Err(format!("layer {il}'s attention is not grouped-query"));
            };
            if a.q_bias.is_some()
                || a.k_bias.is_some()
                || a.v_bias.is_some()
                || a.o_bias.is_some()
                || a.sinks.is_some()
            {
                return Err(format!("layer {il}'s attention has biases or sinks"));
            }
            let (q_norm, k_norm) = match (&a.q_norm, &a.k_norm) {
                (Some(q), Some(k)) => (Some(q.as_slice()), Some(k.as_slice())),
                _ => (None, None),
            };
            let ffn = match &l.ffn {
                Ffn::Dense { gate, up, down } => {
                    if self.spec.glu != crate::arch::Glu::Silu {
                        return Err(format!("layer {il}'s FFN is not SwiGLU"));
                    }
                    PlanFfn::Dense {
                        gate: gate.weights(files),
                        up: up.weights(files),
                        down: down.weights(files),
                    }
                }
                Ffn::Moe {
                    router,
                    selection_bias,
                    router_bias,
                    experts,
                    expert_biases,
                    shared,
                    hash_routes,
                } => {
                    let moe = hp.moe.as_ref().ok_or("MoE layers without MoE params")?;
                    if selection_bias.is_some()
                        || router_bias.is_some()
                        || expert_biases.is_some()
                        || shared.is_some()
                        || hash_routes.is_some()
                        || moe.gating != Gating::Softmax
                        || (moe.n_group > 1 && moe.n_group_used < moe.n_group)
                        || self.spec.glu != crate::arch::Glu::Silu
                    {
                        return Err(format!(
                            "layer {il}'s routing (biases, shared experts, groups or gating \
                             other than softmax) has no whole-layer GPU form yet"
                        ));
                    }
                    let n_expert = experts.gate.n_expert;
                    if n_expert > 1024 || moe.n_expert_used > n_expert {
                        return Err(format!("layer {il}: {n_expert} experts (at most 1024)"));
                    }
                    let experts = (0..n_expert)
                        .map(|e| self.expert_weights(il, e))
                        .collect::<Result<Vec<_>>>()
                        .map_err(|e| e.to_string())?;
                    PlanFfn::Moe {
                        router: router.weights(files),
                        experts,
                        k: moe.n_expert_used,
                        norm_topk: moe.norm_topk,
                        weights_scale: moe.weights_scale,
                    }
                }
            };
            layers.push(PlanLayer {
                attn_norm: &a.norm,
                q: a.q.weights(files),
                k: a.k.weights(files),
                v: a.v.weights(files),
                o: a.o.weights(files),
                q_norm,
                k_norm,
                ffn_norm: &l.ffn_norm,
                ffn,
            });
        }
        Ok(WholeModelPlan {
            layers,
            output_norm,
            output: output.weights(files),
            n_embd: hp.n_embd,
            n_head: hp.n_head,
            n_head_kv: hp.n_head_kv,
            head_dim: hp.head_dim_k,
            n_rot: hp.rope.n_rot,
            neox: hp.rope.kind == RopeKind::Neox,
            rms_eps: hp.rms_eps,
            attn_scale: hp.attn_scale(),
            n_vocab: hp.n_vocab,
        })
    }
}
