//! What a shard file holds of its parent model. `moeshard shard` writes a pipeline stage's
//! layers or a tensor-parallel rank's experts into a GGUF of their own and records, under
//! `moeshard.shard.*`, which part it is; the loader binds only those tensors, and a process is
//! refused a role its file cannot run before it computes anything (naming both). The parent's
//! hyperparameters and tokenizer are copied unchanged, so a part loads as its parent would.

use std::ops::{Range, RangeInclusive};

use gguf::{Array, Fingerprint, GgmlType, GgufWriter, Metadata, PARENT_FINGERPRINT_KEY, Value};

use crate::error::{ModelError, Result};

/// `[first, last]` (u32): the parent's layers this file holds.
pub const LAYERS_KEY: &str = "moeshard.shard.layers";
/// Whether the token embeddings are here (the first stage, a rank).
pub const EMBEDDINGS_KEY: &str = "moeshard.shard.embeddings";
/// Whether the output norm and head are here (the last stage, a rank).
pub const HEAD_KEY: &str = "moeshard.shard.head";
/// `[first, end)` (u32): the routed experts of every MoE layer held, as the parent's expert ids.
/// The stacked `*_exps.weight` tensors hold `end - first` experts, expert `first` first.
pub const EXPERTS_KEY: &str = "moeshard.shard.experts";
/// The parent's vocabulary size, for a middle stage holding neither embeddings nor head.
pub const N_VOCAB_KEY: &str = "moeshard.shard.n_vocab";
/// The GGML type id of the parent's layer-0 attention output projection: it fixes the column
/// chunk of every layer's exact reduction (`shard::o_chunk`), so a stage without layer 0 must
/// still chunk as its parent does to stay bit-identical.
pub const ATTN_OUTPUT_TYPE_KEY: &str = "moeshard.shard.attn_output_type";
/// `[rank, n_ranks]` (u32): the tensor-parallel placement a rank file was written for.
pub const TP_RANK_KEY: &str = "moeshard.shard.tp_rank";
/// The `--expert-weights` of that placement (f32 per rank).
pub const EXPERT_WEIGHTS_KEY: &str = "moeshard.shard.expert_weights";

/// The tensor-parallel layout a rank file was written for.
#[derive(Clone, Debug, PartialEq)]
pub struct RankPlacement {
    pub rank: usize,
    pub n_ranks: usize,
    pub expert_weights: Vec<f32>,
}

/// The part of the parent model a shard file holds.
#[derive(Clone, Debug, PartialEq)]
pub struct FileSlice {
    pub parent: Fingerprint,
    pub layers: RangeInclusive<usize>,
    pub embeddings: bool,
    pub head: bool,
    /// Routed experts held in every MoE layer (all of them: `0..n_expert`).
    pub experts: Range<usize>,
    pub n_vocab: usize,
    pub attn_output_type: GgmlType,
    pub placement: Option<RankPlacement>,
}

/// What a process is asked to run, to check against its file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Every layer, the embeddings, the head and every expert (one node).
    Whole,
    /// A pipeline stage (embeddings when it starts at layer 0).
    Stage {
        layers: RangeInclusive<usize>,
        head: bool,
    },
    /// A tensor-parallel rank computing these routed experts (all layers, embeddings, head).
    Rank {
        rank: usize,
        n_ranks: usize,
        experts: Range<usize>,
    },
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Role::Whole => write!(f, "the whole model"),
            Role::Stage { layers, head } => write!(f, "stage {}", show_layers(layers, *head)),
            Role::Rank {
                rank,
                n_ranks,
                experts,
            } => write!(
                f,
                "rank {rank} of {n_ranks} (experts {}..{})",
                experts.start, experts.end
            ),
        }
    }
}

fn show_layers(layers: &RangeInclusive<usize>, head: bool) -> String {
    if head {
        format!("{}:output", layers.start())
    } else {
        format!("{}:{}", layers.start(), layers.end())
    }
}

fn bad(key: &str, detail: impl Into<String>) -> ModelError {
    ModelError::BadMetadata {
        key: key.into(),
        detail: detail.into(),
    }
}

fn u32_pair(meta: &Metadata, key: &str) -> Result<(usize, usize)> {
    match meta.get(key) {
        Some(Value::Array(Array::U32(v))) if v.len() == 2 => Ok((v[0] as usize, v[1] as usize)),
        Some(other) => Err(bad(
            key,
            format!("{}, expected 2 × u32", other.type_description()),
        )),
        None => Err(bad(key, "missing from a shard file")),
    }
}

fn flag(meta: &Metadata, key: &str) -> Result<bool> {
    match meta.get(key) {
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(bad(
            key,
            format!("{}, expected bool", other.type_description()),
        )),
        None => Err(bad(key, "missing from a shard file")),
    }
}

fn number(meta: &Metadata, key: &str) -> Result<usize> {
    match meta.get(key) {
        Some(Value::U32(n)) => Ok(*n as usize),
        Some(other) => Err(bad(
            key,
            format!("{}, expected u32", other.type_description()),
        )),
        None => Err(bad(key, "missing from a shard file")),
    }
}

impl FileSlice {
    /// The slice recorded in `meta`, checked against the parent's `n_layer` layers and
    /// `n_expert` routed experts; `None` for a full model file.
    pub fn from_metadata(
        meta: &Metadata,
        n_layer: usize,
        n_expert: usize,
    ) -> Result<Option<FileSlice>> {
        let Some(hex) = meta.get_str(PARENT_FINGERPRINT_KEY)? else {
            return Ok(None);
        };
        let parent = Fingerprint::from_hex(hex).ok_or_else(|| {
            bad(
                PARENT_FINGERPRINT_KEY,
                format!("{hex:?} is not 64 hex digits"),
            )
        })?;
        let (first, last) = u32_pair(meta, LAYERS_KEY)?;
        if first > last || last >= n_layer {
            return Err(bad(
                LAYERS_KEY,
                format!("[{first}, {last}] is not a range of the model's {n_layer} layers"),
            ));
        }
        let (e0, e1) = u32_pair(meta, EXPERTS_KEY)?;
        if e0 > e1 || e1 > n_expert {
            return Err(bad(
                EXPERTS_KEY,
                format!("[{e0}, {e1}) is not a range of the model's {n_expert} experts"),
            ));
        }
        let type_id = number(meta, ATTN_OUTPUT_TYPE_KEY)?;
        let attn_output_type = u32::try_from(type_id)
            .ok()
            .and_then(GgmlType::from_id)
            .ok_or_else(|| bad(ATTN_OUTPUT_TYPE_KEY, format!("unknown type id {type_id}")))?;
        let placement = match meta.get(TP_RANK_KEY) {
            None => None,
            Some(_) => {
                let (rank, n_ranks) = u32_pair(meta, TP_RANK_KEY)?;
                if rank >= n_ranks {
                    return Err(bad(TP_RANK_KEY, format!("rank {rank} of {n_ranks}")));
                }
                let expert_weights = match meta.get(EXPERT_WEIGHTS_KEY) {
                    Some(Value::Array(Array::F32(w))) => w.clone(),
                    None => Vec::new(),
                    Some(other) => {
                        return Err(bad(
                            EXPERT_WEIGHTS_KEY,
                            format!("{}, expected f32 array", other.type_description()),
                        ));
                    }
                };
                Some(RankPlacement {
                    rank,
                    n_ranks,
                    expert_weights,
                })
            }
        };
        Ok(Some(FileSlice {
            parent,
            layers: first..=last,
            embeddings: flag(meta, EMBEDDINGS_KEY)?,
            head: flag(meta, HEAD_KEY)?,
            experts: e0..e1,
            n_vocab: number(meta, N_VOCAB_KEY)?,
            attn_output_type,
            placement,
        }))
    }

    /// Records this slice (and the parent's identity) in a shard file's metadata.
    pub fn write_metadata(&self, w: &mut GgufWriter) -> gguf::Result<()> {
        let pair = |a: usize, b: usize| Value::Array(Array::U32(vec![a as u32, b as u32]));
        w.set_metadata(PARENT_FINGERPRINT_KEY, self.parent.to_string())?;
        w.set_metadata(LAYERS_KEY, pair(*self.layers.start(), *self.layers.end()))?;
        w.set_metadata(EMBEDDINGS_KEY, Value::Bool(self.embeddings))?;
        w.set_metadata(HEAD_KEY, Value::Bool(self.head))?;
        w.set_metadata(EXPERTS_KEY, pair(self.experts.start, self.experts.end))?;
        w.set_metadata(N_VOCAB_KEY, Value::U32(self.n_vocab as u32))?;
        w.set_metadata(ATTN_OUTPUT_TYPE_KEY, Value::U32(self.attn_output_type.id()))?;
        if let Some(p) = &self.placement {
            w.set_metadata(TP_RANK_KEY, pair(p.rank, p.n_ranks))?;
            w.set_metadata(
                EXPERT_WEIGHTS_KEY,
                Value::Array(Array::F32(p.expert_weights.clone())),
            )?;
        }
        Ok(())
    }

    /// `layers 10:19`, `layers 20:output`, `rank 1 of 3 (experts 43..64)`.
    pub fn describe(&self) -> String {
        match &self.placement {
            Some(p) => format!(
                "rank {} of {} (experts {}..{})",
                p.rank, p.n_ranks, self.experts.start, self.experts.end
            ),
            None => format!("layers {}", show_layers(&self.layers, self.head)),
        }
    }

    /// Whether this file holds everything `role` runs in a model of `n_layer` layers and
    /// `n_expert` routed experts; the refusal names what the file holds and what was asked.
    pub fn check(&self, role: &Role, n_layer: usize, n_expert: usize) -> Result<(), String> {
        let all_layers = 0..=n_layer.saturating_sub(1);
        let (layers, embeddings, head, experts) = match role {
            Role::Whole => (all_layers, true, true, 0..n_expert),
            Role::Stage { layers, head } => {
                (layers.clone(), *layers.start() == 0, *head, 0..n_expert)
            }
            Role::Rank { experts, .. } => (all_layers, true, true, experts.clone()),
        };
        let missing = if layers.start() < self.layers.start() || layers.end() > self.layers.end() {
            Some(format!(
                "layers {}:{}",
                self.layers.start(),
                self.layers.end()
            ))
        } else if embeddings && !self.embeddings {
            Some("no token embeddings".into())
        } else if head && !self.head {
            Some("no output head".into())
        } else if !experts.is_empty()
            && (experts.start < self.experts.start || experts.end > self.experts.end)
        {
            Some(format!(
                "experts {}..{} of each layer",
                self.experts.start, self.experts.end
            ))
        } else {
            None
        };
        match missing {
            None => Ok(()),
            Some(holds) => Err(format!(
                "the file is the shard {} of model {} and holds {holds}; {role} needs more",
                self.describe(),
                short(&self.parent)
            )),
        }
    }
}

/// The first 16 hex digits of a fingerprint, for messages.
fn short(f: &Fingerprint) -> String {
    f.to_string()[..16].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(layers: RangeInclusive<usize>, head: bool) -> FileSlice {
        FileSlice {
            parent: Fingerprint([7; 32]),
            embeddings: *layers.start() == 0,
            layers,
            head,
            experts: 0..8,
            n_vocab: 100,
            attn_output_type: GgmlType::F32,
            placement: None,
        }
    }

    #[test]
    fn a_slice_round_trips_through_metadata() {
        let mut s = stage(0..=3, false);
        s.experts = 3..6;
        s.placement = Some(RankPlacement {
            rank: 1,
            n_ranks: 3,
            expert_weights: vec![2.0, 1.0, 1.0],
        });
        let mut w = GgufWriter::new();
        s.write_metadata(&mut w).unwrap();
        let back = FileSlice::from_metadata(w.metadata(), 8, 8).unwrap();
        assert_eq!(back, Some(s));
        assert_eq!(
            FileSlice::from_metadata(&Metadata::new(), 8, 8).unwrap(),
            None
        );
        // A slice outside the model it claims to be part of is refused by key.
        let err = FileSlice::from_metadata(w.metadata(), 3, 8).unwrap_err();
        assert!(err.to_string().contains(LAYERS_KEY), "{err}");
        let err = FileSlice::from_metadata(w.metadata(), 8, 5).unwrap_err();
        assert!(err.to_string().contains(EXPERTS_KEY), "{err}");
    }

    #[test]
    fn roles_outside_the_slice_are_refused_naming_both() {
        let s = stage(4..=7, true);
        let stage_role = |a, b, head| Role::Stage {
            layers: a..=b,
            head,
        };
        assert!(s.check(&stage_role(4, 7, true), 8, 8).is_ok());
        assert!(s.check(&stage_role(5, 6, false), 8, 8).is_ok());
        let err = s.check(&stage_role(2, 7, true), 8, 8).unwrap_err();
        assert!(
            err.contains("layers 4:output") && err.contains("stage 2:output"),
            "{err}"
        );
        assert!(s.check(&Role::Whole, 8, 8).is_err());
        let first = stage(0..=3, false);
        assert!(first.check(&stage_role(0, 3, false), 8, 8).is_ok());
        assert!(first.check(&stage_role(0, 3, true), 8, 8).is_err());
        let mut rank = stage(0..=7, true);
        rank.experts = 3..6;
        let role = |a, b| Role::Rank {
            rank: 1,
            n_ranks: 3,
            experts: a..b,
        };
        assert!(rank.check(&role(3, 6), 8, 8).is_ok());
        assert!(rank.check(&role(4, 5), 8, 8).is_ok());
        let err = rank.check(&role(2, 5), 8, 8).unwrap_err();
        assert!(
            err.contains("experts 3..6") && err.contains("experts 2..5"),
            "{err}"
        );
        assert!(rank.check(&stage_role(0, 7, true), 8, 8).is_err());
    }
}
