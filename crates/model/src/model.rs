//! A loaded model: hyperparameters, the architecture's declaration, and every tensor bound to
//! its typed place. Loading touches only metadata and small vectors; matrices stay in the map
//! until a forward pass reads them, so a process that runs a slice of the layers only ever
//! faults in that slice.

use std::path::Path;
use std::sync::Arc;

use gguf::GgufModel;

use crate::arch::{self, ArchSpec};
use crate::error::{ModelError, Result};
use crate::file_slice::{FileSlice, Role};
use crate::hparams::Hparams;
use crate::kv::{KvLayout, KvType, SlidingLayers};
use crate::names::TensorName;
use crate::weights::{Binder, ExpertMatrices, Ffn, Layer, Matrix};

pub struct Model {
    files: Arc<GgufModel>,
    pub spec: &'static ArchSpec,
    pub hp: Hparams,
    /// Absent (like the head and the layers outside its range) only in a shard file that does
    /// not hold them; `slice` says what it holds.
    pub(crate) token_embd: Option<Matrix>,
    pub(crate) output_norm: Option<Vec<f32>>,
    pub(crate) output: Option<Matrix>,
    pub(crate) rope_freqs: Option<Vec<f32>>,
    /// DeepSeek V4's collapse of the streams before the output norm.
    pub(crate) hc_head: Option<crate::weights::HyperMix>,
    pub(crate) layers: Vec<Option<Layer>>,
    /// Layer 0's attention output type, which fixes every layer's reduction chunk.
    pub(crate) o_dtype: gguf::GgmlType,
    pub(crate) slice: Option<FileSlice>,
    pub(crate) shard: crate::shard::Shard,
    /// How multi-head latent attention is computed (absorbed unless set; both give the same
    /// attention, and every topology must use the same form to stay bit-identical).
    pub mla_form: crate::blocks::mla::MlaForm,
}

impl Model {
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        Model::from_gguf(Arc::new(GgufModel::open(path)?))
    }

    /// The whole model (one node).
    pub fn from_gguf(files: Arc<GgufModel>) -> Result<Model> {
        Model::from_gguf_rank(files, 0, 1)
    }

    /// Rank `rank` of a tensor-parallel group of `n_ranks`: its share of heads, FFN columns and
    /// vocabulary is fixed here, before any KV cache is made for it. A shard file binds what it
    /// holds; [`Model::check_role`] says whether that is enough for a role.
    pub fn from_gguf_rank(files: Arc<GgufModel>, rank: usize, n_ranks: usize) -> Result<Model> {
        let meta = files.metadata();
        let arch_name = meta.arch()?;
        let spec = arch::lookup(arch_name).ok_or_else(|| ModelError::UnsupportedArch {
            arch: arch_name.to_string(),
            supported: arch::supported().join(", "),
        })?;
        let mut hp = Hparams::from_metadata(meta, spec)?;
        let n_expert = hp.moe.as_ref().map_or(0, |m| m.n_expert);
        let slice = FileSlice::from_metadata(meta, hp.n_layer, n_expert)?;
        let b = Binder {
            files: &files,
            experts: slice.as_ref().map_or(0..n_expert, |s| s.experts.clone()),
        };
        // A full file must have what a shard file may leave out.
        let required = |name: &str, present: bool| match (&slice, present) {
            (None, false) => Err(ModelError::MissingTensor(name.to_string())),
            _ => Ok(()),
        };
        let embd_name = TensorName::TokenEmbd.weight(0);
        let token_embd = b.matrix_any_rows_opt(&embd_name, hp.n_embd)?;
        required(&embd_name, token_embd.is_some())?;
        hp.n_vocab = match (&slice, &token_embd) {
            (Some(s), _) => s.n_vocab,
            (None, Some(t)) => t.rows,
            (None, None) => 0,
        };
        if let Some(t) = &token_embd
            && t.rows != hp.n_vocab
        {
            return Err(crate::error::bad_tensor(
                &embd_name,
                format!("{} rows, the shard's vocabulary is {}", t.rows, hp.n_vocab),
            ));
        }
        let norm_name = TensorName::OutputNorm.weight(0);
        let output_norm = b.vector_opt(&norm_name, hp.n_embd)?;
        required(&norm_name, output_norm.is_some())?;
        let output = b
            .matrix_opt(&TensorName::Output.weight(0), hp.n_embd, hp.n_vocab)?
            .or(token_embd);
        let rope_freqs = b.vector_opt(&TensorName::RopeFreqs.weight(0), hp.rope.n_rot / 2)?;
        let hc_head = b.hyper_head(&hp)?;
        if hp.dsv4.is_some() && output_norm.is_some() {
            required(&TensorName::HcHeadFn.weight(0), hc_head.is_some())?;
        }
        let layers = (0..hp.n_layer)
            .map(|il| match &slice {
                Some(s) if !s.layers.contains(&il) => Ok(None),
                _ => b.layer(spec, &hp, il).map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        let o_dtype = match (&slice, layers.first()) {
            (Some(s), _) => s.attn_output_type,
            (None, Some(Some(l))) => l.attn.o().dtype,
            (None, _) => gguf::GgmlType::F32,
        };
        let shard = crate::shard::Shard::new(&hp, o_dtype, rank, n_ranks);
        Ok(Model {
            files,
            spec,
            hp,
            token_embd,
            output_norm,
            output,
            rope_freqs,
            hc_head,
            layers,
            o_dtype,
            slice,
            shard,
            mla_form: crate::blocks::mla::MlaForm::Absorbed,
        })
    }

    /// What the file holds when it is a shard file (`None`: the whole model).
    pub fn slice(&self) -> Option<&FileSlice> {
        self.slice.as_ref()
    }

    /// Whether this model's file holds everything `role` runs (a full file always does); the
    /// refusal names the file's slice and the role.
    pub fn check_role(&self, role: &Role) -> Result<()> {
        match &self.slice {
            None => Ok(()),
            Some(s) => {
                let n_expert = self.hp.moe.as_ref().map_or(0, |m| m.n_expert);
                s.check(role, self.n_layer(), n_expert)
                    .map_err(ModelError::WrongShard)
            }
        }
    }

    /// The layer-0 attention output type (of the parent, for a shard file).
    pub fn attn_output_type(&self) -> gguf::GgmlType {
        self.o_dtype
    }

    /// This process's tensor-parallel share (everything unless set).
    pub fn shard(&self) -> &crate::shard::Shard {
        &self.shard
    }

    /// The share rank `rank` of a group of this model's size has (every rank computes the
    /// others' the same way).
    pub fn shard_of(&self, rank: usize) -> crate::shard::Shard {
        crate::shard::Shard::new(&self.hp, self.o_dtype, rank, self.shard.n_ranks)
    }

    pub fn files(&self) -> &GgufModel {
        &self.files
    }

    pub fn shared_files(&self) -> Arc<GgufModel> {
        Arc::clone(&self.files)
    }

    /// Layer `il`'s weights (`None` past the last layer or outside a shard file's layers).
    pub fn layer(&self, il: usize) -> Option<&Layer> {
        self.layers.get(il)?.as_ref()
    }

    /// Layer `il` for the forward path, whose range was checked against the file's slice.
    pub(crate) fn held_layer(&self, il: usize) -> Result<&Layer> {
        self.layer(il).ok_or_else(|| {
            ModelError::Input(format!(
                "layer {il} is not in this file ({})",
                self.slice
                    .as_ref()
                    .map_or("the model has fewer".into(), FileSlice::describe)
            ))
        })
    }

    pub fn n_layer(&self) -> usize {
        self.hp.n_layer
    }

    /// Whether layer `il` routes through experts.
    pub fn is_moe_layer(&self, il: usize) -> bool {
        matches!(self.layer(il).map(|l| &l.ffn), Some(Ffn::Moe { .. }))
    }

    /// Expert `e` of layer `il`, straight from the map.
    pub fn expert_weights(&self, il: usize, e: usize) -> Result<ExpertMatrices<'_>> {
        match &self.layer(il).map(|l| &l.ffn) {
            Some(Ffn::Moe { experts, .. }) if experts.gate.holds(e) => {
                let (gate, up) = experts.gate_up(e);
                Ok(ExpertMatrices {
                    gate: gate.weights(&self.files),
                    up: up.weights(&self.files),
                    down: experts.down.expert(e).weights(&self.files),
                })
            }
            Some(Ffn::Moe { experts, .. }) if e < experts.gate.n_expert => {
                Err(self.not_held(&format!("expert {e} of layer {il}")))
            }
            _ => Err(ModelError::Experts(format!("layer {il} has no expert {e}"))),
        }
    }

    /// The cache layout for `layers` of this model.
    pub fn kv_layout(
        &self,
        kv_type: KvType,
        layers: std::ops::RangeInclusive<usize>,
        n_ctx: usize,
    ) -> KvLayout {
        let sliding = self.hp.sliding_window.map(|window| SlidingLayers {
            window,
            layers: layers
                .clone()
                .map(|il| self.hp.window(il).is_some())
                .collect(),
        });
        let compression = self.hp.dsv4.as_ref().map(|p| crate::kv::Compression {
            layers: layers
                .clone()
                .map(|il| {
                    let ratio = p.ratio(il);
                    (ratio > 0).then_some(crate::kv::CompressedLayer {
                        ratio,
                        width: self.hp.head_dim_k,
                        index_width: if ratio == 4 { p.index_head_dim } else { 0 },
                        overlap: ratio == 4,
                    })
                })
                .collect(),
            max_ratio: p.compress_ratios[..self.hp.n_layer]
                .iter()
                .copied()
                .max()
                .unwrap_or(0),
        });
        let index_keys = self.hp.dsa.as_ref().map(|p| crate::kv::IndexKeys {
            width: p.head_dim,
            layers: layers.clone().map(|il| p.is_full(il)).collect(),
        });
        let hybrid = self
            .hp
            .glm5next
            .as_ref()
            .map(|p| crate::glm5next::cache_layers(p, &self.shard, layers.clone()));
        KvLayout {
            kv_type,
            layers,
            n_kv_head: self.shard.kv_heads.len(),
            head_dim_k: self.hp.head_dim_k,
            head_dim_v: self.hp.head_dim_v,
            n_ctx,
            sliding,
            compression,
            index_keys,
            hybrid,
        }
    }

    /// Embedding rows of `tokens`, dequantized into `out` (`tokens.len() × n_embd`).
    pub fn embed(&self, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        let d = self.hp.n_embd;
        let w = self
            .token_embd
            .as_ref()
            .ok_or_else(|| self.not_held("token embeddings"))?
            .weights(&self.files);
        for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(d)) {
            if t as usize >= self.hp.n_vocab {
                return Err(ModelError::Input(format!(
                    "token id {t} is outside the vocabulary of {}",
                    self.hp.n_vocab
                )));
            }
            kernels::formats::dequantize_row(w.dtype, w.row(t as usize), row).ok_or_else(|| {
                ModelError::Input(format!("embedding type {} cannot be dequantized", w.dtype))
            })?;
        }
        Ok(())
    }
}

impl Model {
    /// The error of asking a shard file for `what` it does not hold.
    pub(crate) fn not_held(&self, what: &str) -> ModelError {
        ModelError::WrongShard(format!(
            "{what}: not in this file ({})",
            self.slice
                .as_ref()
                .map_or("a full model".into(), FileSlice::describe)
        ))
    }
}

/// Which tensors a process reads: its layer range, and the embeddings / head / routed experts
/// depending on its role.
#[derive(Clone, Debug)]
pub struct WeightSelection {
    pub layers: std::ops::RangeInclusive<usize>,
    pub embeddings: bool,
    pub head: bool,
    /// Routed experts (false under SSD streaming, where they are read on demand).
    pub experts: bool,
}

impl Model {
    /// Byte ranges of the tensors in `sel`, merged where adjacent, in file order.
    pub fn weight_ranges(&self, sel: &WeightSelection) -> Vec<crate::weights::TensorRef> {
        use crate::weights::TensorRef;
        let mut refs: Vec<TensorRef> = Vec::new();
        let tied = match (&self.output, &self.token_embd) {
            (Some(o), Some(t)) => o.data == t.data,
            _ => false,
        };
        let names = self.files().tensors().filter_map(|t| {
            let name = t.info.name.as_str();
            let layer = name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok());
            let keep = match layer {
                Some(il) => {
                    let routed = name.contains("_exps.");
                    sel.layers.contains(&il) && (sel.experts || !routed)
                }
                None => {
                    (sel.embeddings && name.starts_with("token_embd"))
                        || (sel.head && name.starts_with("output"))
                        || (sel.head && tied && name.starts_with("token_embd"))
                        || name.starts_with("rope_freqs")
                }
            };
            keep.then_some(TensorRef {
                split: t.split,
                offset: t.info.file_offset,
                len: t.info.n_bytes,
            })
        });
        refs.extend(names);
        refs.sort_by_key(|r| (r.split, r.offset));
        let mut merged: Vec<TensorRef> = Vec::with_capacity(refs.len());
        for r in refs {
            match merged.last_mut() {
                Some(m) if m.split == r.split && m.offset + m.len >= r.offset => {
                    m.len = m.len.max(r.offset + r.len - m.offset);
                }
                _ => merged.push(r),
            }
        }
        merged
    }

    /// Faults in the pages of `ranges` (so the first token is not paying for disk reads),
    /// reporting bytes done through `progress`.
    pub fn warm(&self, ranges: &[crate::weights::TensorRef], mut progress: impl FnMut(u64)) {
        const PAGE: usize = 4096;
        for r in ranges {
            let bytes = &self.files().splits()[r.split].bytes()
                [r.offset as usize..(r.offset + r.len) as usize];
            let mut sum = 0u8;
            for chunk in bytes.chunks(1 << 20) {
                // One byte per page; `black_box` consumes their sum before `progress`, so the
                // reads are neither elided nor moved past it.
                for p in (0..chunk.len()).step_by(PAGE) {
                    sum = sum.wrapping_add(chunk[p]);
                }
                std::hint::black_box(sum);
                progress(chunk.len() as u64);
            }
        }
    }
}
