//! The byte form of a hybrid layer's memory in snapshots and tensor-parallel exchanges: each
//! array as a little-endian u64 count and its f32 values; a KDA layer's is its convolution
//! history then its state, and a tensor-parallel rank's share holds its consecutive heads.

use crate::error::{ModelError, Result};

pub(super) fn put(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Reads what [`put`] wrote: `want` values at `*at` of the state of `what`.
pub(super) fn take(bytes: &[u8], at: &mut usize, want: usize, what: &str) -> Result<Vec<f32>> {
    let bad = |why: String| ModelError::Input(format!("{what}: state {why}"));
    let head = bytes
        .get(*at..*at + 8)
        .ok_or_else(|| bad("is truncated".into()))?;
    let len = u64::from_le_bytes(head.try_into().expect("8 bytes")) as usize;
    if len != want {
        return Err(bad(format!("has {len} values where {want} belong")));
    }
    let body = bytes
        .get(*at + 8..*at + 8 + 4 * len)
        .ok_or_else(|| bad("is truncated".into()))?;
    *at += 8 + 4 * len;
    Ok(body
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A KDA layer's snapshot values (conv history, state) from `bytes`, as written by
/// [`super::KvCache::export`]; `heads` of `head_dim` with `conv_taps` taps.
fn parse_memory(bytes: &[u8], head_dim: usize, conv_taps: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let len_at = |at: usize| -> Result<usize> {
        let head = bytes
            .get(at..at + 8)
            .ok_or_else(|| ModelError::Input("a recurrent state is truncated".into()))?;
        Ok(u64::from_le_bytes(head.try_into().expect("8 bytes")) as usize)
    };
    let conv_len = len_at(0)?;
    let state_len = len_at(8 + 4 * conv_len)?;
    let heads = state_len / (head_dim * head_dim).max(1);
    let mut at = 0;
    let of = "a tensor-parallel share of a KDA layer";
    let conv = take(bytes, &mut at, 3 * conv_taps * heads * head_dim, of)?;
    let state = take(bytes, &mut at, heads * head_dim * head_dim, of)?;
    if at != bytes.len() || state_len != heads * head_dim * head_dim {
        return Err(ModelError::Input(format!(
            "a recurrent state of {} bytes does not hold whole heads of {head_dim}",
            bytes.len()
        )));
    }
    Ok((conv, state))
}

fn memory_bytes(conv: &[f32], state: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + 4 * (conv.len() + state.len()));
    put(&mut out, conv);
    put(&mut out, state);
    out
}

/// The whole KDA layer's snapshot values from a tensor-parallel group's, in rank order (each
/// rank holds the memory of its consecutive heads): the convolution history rows interleaved
/// back into rows of all heads, the heads' states concatenated.
pub fn merge_recurrent_shares(
    parts: &[&[u8]],
    head_dim: usize,
    conv_taps: usize,
) -> Result<Vec<u8>> {
    let shares = parts
        .iter()
        .map(|p| parse_memory(p, head_dim, conv_taps))
        .collect::<Result<Vec<_>>>()?;
    let mut conv = Vec::new();
    let mut state = Vec::new();
    for row in 0..3 * conv_taps {
        for (c, _) in &shares {
            let w = c.len() / (3 * conv_taps).max(1);
            conv.extend_from_slice(&c[row * w..(row + 1) * w]);
        }
    }
    for (_, s) in &shares {
        state.extend_from_slice(s);
    }
    Ok(memory_bytes(&conv, &state))
}

/// The share of `heads` of a whole KDA layer's snapshot values ([`merge_recurrent_shares`]
/// undone for one rank).
pub fn split_recurrent_share(
    bytes: &[u8],
    heads: std::ops::Range<usize>,
    head_dim: usize,
    conv_taps: usize,
) -> Result<Vec<u8>> {
    let (conv, state) = parse_memory(bytes, head_dim, conv_taps)?;
    let n_head = state.len() / (head_dim * head_dim).max(1);
    if heads.end > n_head {
        return Err(ModelError::Input(format!(
            "heads {heads:?} of a recurrent state of {n_head}"
        )));
    }
    let w = n_head * head_dim;
    let cols = heads.start * head_dim..heads.end * head_dim;
    let conv: Vec<f32> = conv
        .chunks_exact(w.max(1))
        .flat_map(|row| row[cols.clone()].iter().copied())
        .collect();
    let hd2 = head_dim * head_dim;
    Ok(memory_bytes(
        &conv,
        &state[heads.start * hd2..heads.end * hd2],
    ))
}
