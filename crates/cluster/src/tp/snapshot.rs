//! A tensor-parallel session's KV in the topology-free snapshot form: when attention is split
//! by heads each rank holds its kv heads, which are interleaved back into rows of all heads for
//! a snapshot and cut out again on restore; replicated attention, and latent attention (whose
//! one latent cache every rank holds whole), need only rank 0's copy. A sliding-window layer
//! holds only its latest positions; how many is read from its size. GLM-5.3 Flash's KDA layers
//! are split by heads like attention: each rank's recurrent state (its heads') is merged into the
//! whole layer's and cut out again.

use std::ops::Range;

use engine::snapshot::LayersKv;
use model::hparams::{Glm5LayerKind, Glm5NextParams};
use model::kv::{merge_recurrent_shares, split_recurrent_share};
use model::shard::{kv_heads_merge, kv_heads_slice};
use model::{KvType, Model};

use crate::error::Result;

/// GLM-5.3 Flash's parameters when its KDA heads are split across the ranks.
fn recurrent_split(model: &Model) -> Option<&Glm5NextParams> {
    model
        .hp
        .glm5next
        .as_ref()
        .filter(|_| model.shard().attention_split)
}

fn rank_heads(model: &Model) -> Vec<Range<usize>> {
    (0..model.shard().n_ranks)
        .map(|r| model.shard_of(r).kv_heads)
        .collect()
}

/// The snapshot layers (all kv heads) of `n_pos` positions from every rank's export, in rank
/// order. Sizes come from peers, so every one is checked.
pub fn merge(
    model: &Model,
    kv_type: KvType,
    n_pos: usize,
    per_rank: &[LayersKv],
) -> Result<LayersKv> {
    let hp = &model.hp;
    let Some(first) = per_rank.first() else {
        return Ok(Vec::new());
    };
    if let Some(p) = recurrent_split(model) {
        return (0..hp.n_layer)
            .map(|il| {
                if p.kind(il) != Glm5LayerKind::Kda {
                    return Ok(first.get(il).cloned().unwrap_or_default());
                }
                let shares: Vec<&[u8]> = per_rank
                    .iter()
                    .map(|layers| layers.get(il).map_or(&[][..], |(_, v)| &v[..]))
                    .collect();
                let v = merge_recurrent_shares(&shares, p.kda_head_dim, p.conv_kernel - 1)?;
                Ok((Vec::new(), v))
            })
            .collect();
    }
    if !model.shard().kv_split(hp.n_head_kv) {
        return Ok(first.clone());
    }
    let heads = rank_heads(model);
    let e = kv_type.bytes();
    (0..hp.n_layer)
        .map(|il| {
            // A rank that sent too few layers contributes an empty part, which the merge refuses.
            let (ks, vs): (Vec<&[u8]>, Vec<&[u8]>) = per_rank
                .iter()
                .map(|layers| {
                    layers
                        .get(il)
                        .map_or((&[][..], &[][..]), |(k, v)| (&k[..], &v[..]))
                })
                .unzip();
            // Rank 0's keys give the positions (the window of a sliding layer); the merge checks
            // every part against them, and the snapshot's layout check the result.
            let rank0_row = heads[0].len() * hp.head_dim_k * e;
            let n_pos = match (hp.window(il), ks[0].len().checked_div(rank0_row)) {
                (Some(_), Some(held)) => held.min(n_pos),
                _ => n_pos,
            };
            let k = kv_heads_merge(&ks, &heads, n_pos, hp.n_head_kv, hp.head_dim_k * e)?;
            let v = kv_heads_merge(&vs, &heads, n_pos, hp.n_head_kv, hp.head_dim_v * e)?;
            Ok((k, v))
        })
        .collect()
}

/// Every rank's share of snapshot `layers` (all kv heads, `n_pos` positions or a sliding
/// layer's latest ones, already checked against the model's layout).
pub fn split(
    model: &Model,
    kv_type: KvType,
    n_pos: usize,
    layers: &[(Vec<u8>, Vec<u8>)],
) -> Result<Vec<LayersKv>> {
    let n_ranks = model.shard().n_ranks;
    if let Some(p) = recurrent_split(model) {
        return (0..n_ranks)
            .map(|r| {
                let heads = model.shard_of(r).heads;
                layers
                    .iter()
                    .enumerate()
                    .map(|(il, (k, v))| {
                        if p.kind(il) != Glm5LayerKind::Kda {
                            return Ok((k.clone(), v.clone()));
                        }
                        let share = split_recurrent_share(
                            v,
                            heads.clone(),
                            p.kda_head_dim,
                            p.conv_kernel - 1,
                        )?;
                        Ok((Vec::new(), share))
                    })
                    .collect()
            })
            .collect();
    }
    if !model.shard().kv_split(model.hp.n_head_kv) {
        return Ok(vec![layers.to_vec(); n_ranks]);
    }
    let hp = &model.hp;
    let e = kv_type.bytes();
    rank_heads(model)
        .iter()
        .map(|heads| {
            layers
                .iter()
                .map(|(k, v)| {
                    let row = hp.n_head_kv * hp.head_dim_k * e;
                    let n_pos = k.len().checked_div(row).unwrap_or(n_pos);
                    Ok((
                        kv_heads_slice(k, n_pos, hp.n_head_kv, heads, hp.head_dim_k * e)?,
                        kv_heads_slice(v, n_pos, hp.n_head_kv, heads, hp.head_dim_v * e)?,
                    ))
                })
                .collect()
        })
        .collect()
}
