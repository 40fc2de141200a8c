//! Tensors bound to typed per-layer structs at load time. Matrices stay in the GGUF map (a
//! [`TensorRef`] into it, resolved to bytes when used); small vectors (norms, biases, the shared
//! expert gate) are dequantized to f32 once.

use gguf::{GgmlType, GgufModel, ModelTensor};
use kernels::Weights;

use crate::arch::{ArchSpec, FfnLayout, QkNorm};
use crate::error::{ModelError, Result, bad_tensor};
use crate::hparams::Hparams;
use crate::names::TensorName;

mod dsv4;
mod glm5next;

pub use dsv4::{Compressor, Dsv4Attention, HyperMix, Indexer};
pub use glm5next::{Glm5Block, Glm5NextAttention, KdaWeights, KpoolIndexer};

/// Where a tensor's bytes are: a range of one split's map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorRef {
    pub split: usize,
    /// Absolute byte offset in the split file.
    pub offset: u64,
    pub len: u64,
}

/// A `rows × cols` matrix in the map.
#[derive(Clone, Copy, Debug)]
pub struct Matrix {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: TensorRef,
}

impl Matrix {
    pub fn bytes<'m>(&self, files: &'m GgufModel) -> &'m [u8] {
        let file = &files.splits()[self.data.split];
        &file.bytes()[self.data.offset as usize..(self.data.offset + self.data.len) as usize]
    }

    pub fn weights<'m>(&self, files: &'m GgufModel) -> Weights<'m> {
        Weights::new(self.dtype, self.rows, self.cols, self.bytes(files))
            .expect("matrix shapes were validated when binding")
    }
}

/// `n_expert` matrices of `rows × cols` stacked in one tensor (`ffn_*_exps`), expert-major.
/// A tensor-parallel rank's shard file stacks only its experts: `n_held` of them, the first
/// being expert `first` (the ids stay the parent's).
#[derive(Clone, Copy, Debug)]
pub struct ExpertStack {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub n_expert: usize,
    pub first: usize,
    pub n_held: usize,
    pub data: TensorRef,
}

impl ExpertStack {
    pub fn bytes_per_expert(&self) -> u64 {
        self.data.len / self.n_held.max(1) as u64
    }

    /// Whether expert `e`'s bytes are in this file.
    pub fn holds(&self, e: usize) -> bool {
        e >= self.first && e < self.first + self.n_held
    }

    /// Expert `e` (one this stack [holds](Self::holds)) as a matrix of its own.
    pub fn expert(&self, e: usize) -> Matrix {
        debug_assert!(
            self.holds(e),
            "expert {e} outside {}+{}",
            self.first,
            self.n_held
        );
        let per = self.bytes_per_expert();
        Matrix {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: TensorRef {
                split: self.data.split,
                offset: self.data.offset + (e - self.first) as u64 * per,
                len: per,
            },
        }
    }
}

/// The routed experts of one layer: gate, up and down projections.
#[derive(Clone, Copy, Debug)]
pub struct ExpertTensors {
    /// `n_ff × n_embd` per expert; absent for architectures without a gate.
    pub gate: ExpertStack,
    pub up: ExpertStack,
    /// `n_embd × n_ff` per expert.
    pub down: ExpertStack,
    /// When gate and up are one fused tensor (`ffn_gate_up_exps`): gate rows first.
    pub fused_gate_up: bool,
}

impl ExpertTensors {
    pub fn n_ff(&self) -> usize {
        self.down.cols
    }

    /// Bytes of one expert's gate, up and down together.
    pub fn bytes_per_expert(&self) -> u64 {
        let gu = if self.fused_gate_up {
            self.gate.bytes_per_expert()
        } else {
            self.gate.bytes_per_expert() + self.up.bytes_per_expert()
        };
        gu + self.down.bytes_per_expert()
    }
}

/// One expert's three projections.
#[derive(Clone, Copy)]
pub struct ExpertMatrices<'a> {
    pub gate: Weights<'a>,
    pub up: Weights<'a>,
    pub down: Weights<'a>,
}

#[derive(Clone, Debug)]
pub struct SharedExpert {
    /// `sigmoid(x · gate_inp)` scales the shared expert's output.
    pub gate_inp: Option<Vec<f32>>,
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

#[derive(Clone, Debug)]
pub struct Attention {
    pub norm: Vec<f32>,
    pub q: Matrix,
    pub k: Matrix,
    pub v: Matrix,
    pub o: Matrix,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub o_bias: Option<Vec<f32>>,
    /// One learned logit per query head that joins every softmax (gpt-oss `attn_sinks`).
    pub sinks: Option<Vec<f32>>,
}

/// Per-expert biases of the routed experts (gpt-oss), `n_expert` rows each: added to gate and
/// up before the activation and to down's output.
#[derive(Clone, Debug)]
pub struct ExpertBiases {
    /// `n_ff` values per expert.
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    /// `n_embd` values per expert.
    pub down: Vec<f32>,
    pub n_ff: usize,
    pub n_embd: usize,
}

impl ExpertBiases {
    /// Expert `e`'s (gate, up, down) bias rows.
    pub fn of(&self, e: usize) -> (&[f32], &[f32], &[f32]) {
        let (nf, nd) = (self.n_ff, self.n_embd);
        (
            &self.gate[e * nf..(e + 1) * nf],
            &self.up[e * nf..(e + 1) * nf],
            &self.down[e * nd..(e + 1) * nd],
        )
    }
}

/// Multi-head latent attention (DeepSeek V2/V3). Per-head matrices are stacks over heads.
#[derive(Clone, Debug)]
pub struct MlaAttention {
    pub norm: Vec<f32>,
    /// The query: `q_a` (n_embd → q_lora_rank), RMSNorm, `q_b` (→ heads × (nope + rope)); or
    /// one `attn_q` when the file has no query compression.
    pub q_a: Option<(Matrix, Vec<f32>)>,
    pub q: Matrix,
    /// n_embd → kv_lora_rank latent followed by the n_rot shared rope key.
    pub kv_a: Matrix,
    pub kv_a_norm: Vec<f32>,
    /// Per head `kv_lora_rank × qk_nope`: absorbs a head's no-rope query into latent space
    /// (`q_nope · W_kb`); its transpose decompresses a latent into that head's key.
    pub k_b: ExpertStack,
    /// Per head `v_head_dim × kv_lora_rank`: a head's value (or attention output) from latent.
    pub v_b: ExpertStack,
    pub o: Matrix,
    /// GLM-5's lightning indexer (full sparse-attention layers only).
    pub indexer: Option<DsaIndexer>,
}

/// The lightning indexer of a GLM-5 sparse-attention layer: per-head queries from the query
/// latent, one LayerNorm-ed key per token, per-head weights from the block input.
#[derive(Clone, Debug)]
pub struct DsaIndexer {
    /// q_lora_rank → n_head × head_dim.
    pub q_b: Matrix,
    /// n_embd → head_dim.
    pub k: Matrix,
    pub k_norm: Vec<f32>,
    pub k_norm_bias: Vec<f32>,
    /// n_embd → n_head.
    pub proj: Matrix,
}

/// A layer's attention weights.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum AttentionWeights {
    /// Grouped-query attention over a key/value cache.
    Gqa(Attention),
    /// Multi-head latent attention over a latent cache.
    Mla(MlaAttention),
    /// DeepSeek V4's windowed + compressed attention.
    Dsv4(Box<Dsv4Attention>),
    /// GLM-5.3 Flash's KDA or indexed latent attention.
    Glm5Next(Box<Glm5NextAttention>),
}

impl AttentionWeights {
    /// The output projection (every form has one of n_head · head_dim_v columns).
    pub fn o(&self) -> &Matrix {
        match self {
            AttentionWeights::Gqa(a) => &a.o,
            AttentionWeights::Mla(m) => &m.o,
            AttentionWeights::Dsv4(a) => &a.o_b,
            AttentionWeights::Glm5Next(a) => a.o(),
        }
    }
}

/// One per layer, so the size difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Ffn {
    Dense {
        gate: Matrix,
        up: Matrix,
        down: Matrix,
    },
    Moe {
        router: Matrix,
        /// Added to the expert probabilities for selection only (`exp_probs_b`).
        selection_bias: Option<Vec<f32>>,
        /// Added to the router logits (gpt-oss).
        router_bias: Option<Vec<f32>>,
        experts: ExpertTensors,
        expert_biases: Option<ExpertBiases>,
        shared: Option<SharedExpert>,
        /// DeepSeek V4's hash-routed layers: `n_expert_used` expert ids per token id.
        hash_routes: Option<Vec<u32>>,
    },
}

#[derive(Clone, Debug)]
pub struct Layer {
    pub attn: AttentionWeights,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
}

/// Resolves names to tensors and checks shapes.
pub(crate) struct Binder<'m> {
    pub files: &'m GgufModel,
    /// The routed experts the file's stacks hold (all of them but in a rank's shard file).
    pub experts: std::ops::Range<usize>,
}

impl<'m> Binder<'m> {
    fn get(&self, name: &str) -> Option<ModelTensor<'m>> {
        self.files.tensor(name)
    }

    fn require(&self, name: &str) -> Result<ModelTensor<'m>> {
        self.get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    fn tref(t: &ModelTensor<'m>) -> TensorRef {
        TensorRef {
            split: t.split,
            offset: t.info.file_offset,
            len: t.info.n_bytes,
        }
    }

    fn check_computable(name: &str, dtype: GgmlType) -> Result<()> {
        if kernels::format(dtype).is_none() {
            return Err(bad_tensor(
                name,
                format!("type {dtype} has no compute kernel"),
            ));
        }
        Ok(())
    }

    /// A 2-D tensor of `rows` rows of `cols` (GGUF `ne = [cols, rows]`).
    pub fn matrix(&self, name: &str, cols: usize, rows: usize) -> Result<Matrix> {
        let t = self.require(name)?;
        self.matrix_of(name, &t, cols, rows)
    }

    pub fn matrix_opt(&self, name: &str, cols: usize, rows: usize) -> Result<Option<Matrix>> {
        self.get(name)
            .map(|t| self.matrix_of(name, &t, cols, rows))
            .transpose()
    }

    fn matrix_of(
        &self,
        name: &str,
        t: &ModelTensor<'m>,
        cols: usize,
        rows: usize,
    ) -> Result<Matrix> {
        let dims = t.info.shape.dims();
        let (c, r) = (dims[0] as usize, dims.get(1).copied().unwrap_or(1) as usize);
        if dims.len() > 2 || c != cols || r != rows {
            return Err(bad_tensor(
                name,
                format!("shape {:?}, expected [{cols}, {rows}]", dims),
            ));
        }
        Self::check_computable(name, t.info.dtype)?;
        Ok(Matrix {
            dtype: t.info.dtype,
            rows,
            cols,
            data: Self::tref(t),
        })
    }

    /// A 2-D tensor whose row count is read from the file (vocabulary size, n_ff).
    pub fn matrix_any_rows(&self, name: &str, cols: usize) -> Result<Matrix> {
        self.matrix_any_rows_opt(name, cols)?
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    pub fn matrix_any_rows_opt(&self, name: &str, cols: usize) -> Result<Option<Matrix>> {
        let Some(t) = self.get(name) else {
            return Ok(None);
        };
        let dims = t.info.shape.dims();
        if dims.len() > 2 || dims[0] as usize != cols {
            return Err(bad_tensor(
                name,
                format!("shape {:?}, expected [{cols}, *]", dims),
            ));
        }
        self.matrix_of(name, &t, cols, dims.get(1).copied().unwrap_or(1) as usize)
            .map(Some)
    }

    /// A stack of `n` matrices, all of them in the file (per-head matrices).
    pub fn stack(
        &self,
        name: &str,
        cols: usize,
        rows: Option<usize>,
        n: usize,
    ) -> Result<ExpertStack> {
        self.stack_of(name, cols, rows, n, 0..n)
    }

    /// The stack of a layer's routed experts: the experts the file holds of `n_expert`.
    fn expert_stack(
        &self,
        name: &str,
        cols: usize,
        rows: Option<usize>,
        n_expert: usize,
    ) -> Result<ExpertStack> {
        self.stack_of(name, cols, rows, n_expert, self.experts.clone())
    }

    fn stack_of(
        &self,
        name: &str,
        cols: usize,
        rows: Option<usize>,
        n_expert: usize,
        held: std::ops::Range<usize>,
    ) -> Result<ExpertStack> {
        let t = self.require(name)?;
        let dims = t.info.shape.dims();
        let ok = dims.len() == 3
            && dims[0] as usize == cols
            && rows.is_none_or(|r| dims[1] as usize == r)
            && dims[2] as usize == held.len();
        if !ok {
            let r = rows.map_or("*".to_string(), |r| r.to_string());
            return Err(bad_tensor(
                name,
                format!("shape {:?}, expected [{cols}, {r}, {}]", dims, held.len()),
            ));
        }
        Self::check_computable(name, t.info.dtype)?;
        Ok(ExpertStack {
            dtype: t.info.dtype,
            rows: dims[1] as usize,
            cols,
            n_expert,
            first: held.start,
            n_held: held.len(),
            data: Self::tref(&t),
        })
    }

    /// A 1-D tensor of `len` values, dequantized.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.require(name)?;
        self.vector_of(name, &t, len)
    }

    pub fn vector_opt(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        self.get(name)
            .map(|t| self.vector_of(name, &t, len))
            .transpose()
    }

    /// `rows` vectors of `len` values stored as one `[len, rows]` tensor, dequantized.
    pub fn vector_rows(&self, name: &str, len: usize, rows: usize) -> Result<Vec<f32>> {
        let t = self.require(name)?;
        let dims = t.info.shape.dims();
        if dims.len() != 2 || dims[0] as usize != len || dims[1] as usize != rows {
            return Err(bad_tensor(
                name,
                format!("shape {dims:?}, expected [{len}, {rows}]"),
            ));
        }
        self.values_of(name, &t, len * rows)
    }

    fn vector_of(&self, name: &str, t: &ModelTensor<'m>, len: usize) -> Result<Vec<f32>> {
        if t.info.shape.dims().iter().filter(|&&d| d != 1).count() > 1 {
            return Err(bad_tensor(
                name,
                format!("shape {:?}, expected {len} values", t.info.shape.dims()),
            ));
        }
        self.values_of(name, t, len)
    }

    fn values_of(&self, name: &str, t: &ModelTensor<'m>, len: usize) -> Result<Vec<f32>> {
        let n = t.info.n_elements() as usize;
        if n != len {
            return Err(bad_tensor(
                name,
                format!("shape {:?}, expected {len} values", t.info.shape.dims()),
            ));
        }
        let mut out = vec![0f32; len];
        kernels::formats::dequantize_row(t.info.dtype, t.data(), &mut out).ok_or_else(|| {
            bad_tensor(name, format!("type {} cannot be dequantized", t.info.dtype))
        })?;
        Ok(out)
    }

    /// Multi-head latent attention of layer `il`.
    fn mla_attention(&self, hp: &Hparams, il: usize) -> Result<MlaAttention> {
        use TensorName as T;
        let m = hp.mla.as_ref().expect("called for MLA models");
        let n_embd = hp.n_embd;
        let n_rot = hp.rope.n_rot;
        let q_rows = hp.n_head * (m.qk_nope + n_rot);
        let (q_a, q) = if m.q_lora_rank > 0 {
            let r = m.q_lora_rank;
            (
                Some((
                    self.matrix(&T::AttnQA.weight(il), n_embd, r)?,
                    self.vector(&T::AttnQANorm.weight(il), r)?,
                )),
                self.matrix(&T::AttnQB.weight(il), r, q_rows)?,
            )
        } else {
            (None, self.matrix(&T::AttnQ.weight(il), n_embd, q_rows)?)
        };
        if self.get(&T::AttnKvB.weight(il)).is_some() && self.get(&T::AttnKB.weight(il)).is_none() {
            return Err(bad_tensor(
                &T::AttnKvB.weight(il),
                "a joint attn_kv_b (files converted before llama.cpp split it into attn_k_b and \
                 attn_v_b) is not read: convert the model again",
            ));
        }
        Ok(MlaAttention {
            norm: self.vector(&T::AttnNorm.weight(il), n_embd)?,
            q_a,
            q,
            kv_a: self.matrix(&T::AttnKvAMqa.weight(il), n_embd, m.kv_lora_rank + n_rot)?,
            kv_a_norm: self.vector(&T::AttnKvANorm.weight(il), m.kv_lora_rank)?,
            k_b: self.stack(
                &T::AttnKB.weight(il),
                m.qk_nope,
                Some(m.kv_lora_rank),
                hp.n_head,
            )?,
            v_b: self.stack(
                &T::AttnVB.weight(il),
                m.kv_lora_rank,
                Some(m.v_head_dim),
                hp.n_head,
            )?,
            o: self.matrix(&T::AttnOut.weight(il), hp.n_head * m.v_head_dim, n_embd)?,
            indexer: match &hp.dsa {
                Some(p) if p.is_full(il) => Some(DsaIndexer {
                    q_b: self.matrix(
                        &T::IndexerAttnQB.weight(il),
                        m.q_lora_rank,
                        p.n_head * p.head_dim,
                    )?,
                    k: self.matrix(&T::IndexerAttnK.weight(il), n_embd, p.head_dim)?,
                    k_norm: self.vector(&T::IndexerKNorm.weight(il), p.head_dim)?,
                    k_norm_bias: self.vector(&T::IndexerKNorm.bias(il), p.head_dim)?,
                    proj: self.matrix(&T::IndexerProj.weight(il), n_embd, p.n_head)?,
                }),
                _ => None,
            },
        })
    }

    pub fn layer(&self, spec: &ArchSpec, hp: &Hparams, il: usize) -> Result<Layer> {
        use TensorName as T;
        if hp.dsv4.is_some() {
            let attn = AttentionWeights::Dsv4(Box::new(self.dsv4_attention(hp, il)?));
            return self.ffn_layer(spec, hp, il, attn, true);
        }
        if hp.glm5next.is_some() {
            return self.glm5next_layer(spec, hp, il);
        }
        let attn = if hp.mla.is_some() {
            AttentionWeights::Mla(self.mla_attention(hp, il)?)
        } else {
            AttentionWeights::Gqa(self.gqa_attention(spec, hp, il)?)
        };
        let routed = match spec.ffn {
            FfnLayout::Moe => true,
            FfnLayout::MoeWhenRouted => self.get(&T::FfnGateInp.weight(il)).is_some(),
        };
        self.ffn_layer(spec, hp, il, attn, routed)
    }

    /// Grouped-query attention of layer `il`.
    fn gqa_attention(&self, spec: &ArchSpec, hp: &Hparams, il: usize) -> Result<Attention> {
        use TensorName as T;
        let n_embd = hp.n_embd;
        let q_dim = hp.n_head * hp.head_dim_k;
        let k_dim = hp.n_head_kv * hp.head_dim_k;
        let v_dim = hp.n_head_kv * hp.head_dim_v;
        let (q_norm, k_norm) = match spec.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (
                Some(self.vector(&T::AttnQNorm.weight(il), hp.head_dim_k)?),
                Some(self.vector(&T::AttnKNorm.weight(il), hp.head_dim_k)?),
            ),
            QkNorm::Whole => (
                Some(self.vector(&T::AttnQNorm.weight(il), q_dim)?),
                Some(self.vector(&T::AttnKNorm.weight(il), k_dim)?),
            ),
            QkNorm::PerHeadIfPresent => (
                self.vector_opt(&T::AttnQNorm.weight(il), hp.head_dim_k)?,
                self.vector_opt(&T::AttnKNorm.weight(il), hp.head_dim_k)?,
            ),
        };
        let attn = Attention {
            norm: self.vector(&T::AttnNorm.weight(il), n_embd)?,
            q: self.matrix(&T::AttnQ.weight(il), n_embd, q_dim)?,
            k: self.matrix(&T::AttnK.weight(il), n_embd, k_dim)?,
            v: self.matrix(&T::AttnV.weight(il), n_embd, v_dim)?,
            o: self.matrix(&T::AttnOut.weight(il), hp.n_head * hp.head_dim_v, n_embd)?,
            q_bias: self.vector_opt(&T::AttnQ.bias(il), q_dim)?,
            k_bias: self.vector_opt(&T::AttnK.bias(il), k_dim)?,
            v_bias: self.vector_opt(&T::AttnV.bias(il), v_dim)?,
            q_norm,
            k_norm,
            o_bias: self.vector_opt(&T::AttnOut.bias(il), n_embd)?,
            sinks: self.vector_opt(&T::AttnSinks.weight(il), hp.n_head)?,
        };
        Ok(attn)
    }

    /// The feed-forward block of layer `il` (routed or dense), completing the layer.
    fn ffn_layer(
        &self,
        spec: &ArchSpec,
        hp: &Hparams,
        il: usize,
        attn: AttentionWeights,
        routed: bool,
    ) -> Result<Layer> {
        use TensorName as T;
        let n_embd = hp.n_embd;
        let ffn = if routed {
            let moe = hp.moe.as_ref().ok_or_else(|| ModelError::BadMetadata {
                key: format!("{}.expert_count", spec.name),
                detail: format!("layer {il} has experts but the file declares none"),
            })?;
            let n_expert = moe.n_expert;
            let router = self.matrix(&T::FfnGateInp.weight(il), n_embd, n_expert)?;
            // The down projection's row length is the expert FFN width; read it from there.
            let n_ff = self.require(&T::FfnDownExps.weight(il))?.info.shape.dims()[0] as usize;
            let down =
                self.expert_stack(&T::FfnDownExps.weight(il), n_ff, Some(n_embd), n_expert)?;
            let experts = if self.get(&T::FfnGateUpExps.weight(il)).is_some() {
                let gate_up = self.expert_stack(
                    &T::FfnGateUpExps.weight(il),
                    n_embd,
                    Some(2 * n_ff),
                    n_expert,
                )?;
                let half = ExpertStack {
                    rows: n_ff,
                    ..gate_up
                };
                ExpertTensors {
                    gate: half,
                    up: half,
                    down,
                    fused_gate_up: true,
                }
            } else {
                ExpertTensors {
                    gate: self.expert_stack(
                        &T::FfnGateExps.weight(il),
                        n_embd,
                        Some(n_ff),
                        n_expert,
                    )?,
                    up: self.expert_stack(
                        &T::FfnUpExps.weight(il),
                        n_embd,
                        Some(n_ff),
                        n_expert,
                    )?,
                    down,
                    fused_gate_up: false,
                }
            };
            let shared = if spec.shared_expert && self.get(&T::FfnUpShexp.weight(il)).is_some() {
                let up = self.matrix_any_rows(&T::FfnUpShexp.weight(il), n_embd)?;
                let n_ff_sh = up.rows;
                Some(SharedExpert {
                    gate_inp: self.vector_opt(&T::FfnGateInpShexp.weight(il), n_embd)?,
                    gate: self.matrix(&T::FfnGateShexp.weight(il), n_embd, n_ff_sh)?,
                    up,
                    down: self.matrix(&T::FfnDownShexp.weight(il), n_ff_sh, n_embd)?,
                })
            } else {
                None
            };
            // Biases of all three routed projections, or none (gpt-oss has all of them).
            let expert_biases = match self.get(&T::FfnGateExps.bias(il)) {
                None => None,
                Some(_) => Some(ExpertBiases {
                    gate: self.vector_rows(&T::FfnGateExps.bias(il), n_ff, n_expert)?,
                    up: self.vector_rows(&T::FfnUpExps.bias(il), n_ff, n_expert)?,
                    down: self.vector_rows(&T::FfnDownExps.bias(il), n_embd, n_expert)?,
                    n_ff,
                    n_embd,
                }),
            };
            let hash_routes = if hp.dsv4.as_ref().is_some_and(|p| il < p.n_hash_layers) {
                let routes = self.hash_routes(il, hp, moe.n_expert_used, n_expert)?;
                if routes.is_none() {
                    return Err(ModelError::MissingTensor(T::FfnGateTid2Eid.weight(il)));
                }
                routes
            } else {
                None
            };
            Ffn::Moe {
                router,
                selection_bias: self.vector_opt(&T::FfnExpProbsB.bias(il), n_expert)?,
                router_bias: self.vector_opt(&T::FfnGateInp.bias(il), n_expert)?,
                experts,
                expert_biases,
                shared,
                hash_routes,
            }
        } else {
            let up = self.matrix_any_rows(&T::FfnUp.weight(il), n_embd)?;
            let n_ff = up.rows;
            Ffn::Dense {
                gate: self.matrix(&T::FfnGate.weight(il), n_embd, n_ff)?,
                up,
                down: self.matrix(&T::FfnDown.weight(il), n_ff, n_embd)?,
            }
        };
        let ffn_norm = if spec.post_attention_norm {
            T::AttnPostNorm
        } else {
            T::FfnNorm
        };
        Ok(Layer {
            attn,
            ffn_norm: self.vector(&ffn_norm.weight(il), n_embd)?,
            ffn,
        })
    }
}

impl ExpertTensors {
    /// Gate and up of expert `e` (for a fused tensor, the two halves of its rows).
    pub fn gate_up(&self, e: usize) -> (Matrix, Matrix) {
        if self.fused_gate_up {
            let both = ExpertStack {
                rows: 2 * self.gate.rows,
                ..self.gate
            }
            .expert(e);
            let half = both.data.len / 2;
            let gate = Matrix {
                rows: self.gate.rows,
                data: TensorRef {
                    len: half,
                    ..both.data
                },
                ..both
            };
            let up = Matrix {
                rows: self.gate.rows,
                data: TensorRef {
                    offset: both.data.offset + half,
                    len: half,
                    ..both.data
                },
                ..both
            };
            (gate, up)
        } else {
            (self.gate.expert(e), self.up.expert(e))
        }
    }
}
