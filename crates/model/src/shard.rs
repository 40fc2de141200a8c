//! A tensor-parallel rank's share of a model: which attention heads, which slice of every
//! dense FFN and shared expert, which slice of the vocabulary. Written once here and used by the
//! shared blocks, so no architecture file knows about sharding. Parts that cannot be split
//! (head counts that do not divide, block boundaries that do not align, RMSNorm over the whole
//! q projection) are computed by rank 0 alone and contribute zero elsewhere, which keeps the
//! partial-sum semantics of every all-reduce exact.

use std::ops::Range;

use gguf::GgmlType;

use crate::hparams::Hparams;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub n_ranks: usize,
    /// Query heads computed here; all of them when attention is not split.
    pub heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// Attention is split by heads (partial output sums) rather than replicated.
    pub attention_split: bool,
    /// Rows of the output head computed here.
    pub vocab: Range<usize>,
}

/// Column chunk of the attention output projection's exact reduction: whole blocks and whole
/// split units of `heads_per_unit` heads of `head_dim_v` — the fewest heads a rank can get
/// (a GQA group: ranks split kv heads; one head for latent attention). Larger chunks are fewer
/// kernel calls per row and token (Q4_K 2048×4096 × 256 tokens, one thread: 18.9 GFLOP/s in
/// 256-column chunks, 30.6 in 1024), and any head split is still whole chunks (`Shard::new`
/// splits only at block-aligned multiples of a unit).
pub fn o_chunk(o_dtype: GgmlType, head_dim_v: usize, heads_per_unit: usize) -> usize {
    let unit = head_dim_v * heads_per_unit.max(1);
    kernels::Kernels::reduction_chunk(o_dtype, unit).unwrap_or(unit)
}

/// Column chunk of a SwiGLU down projection's exact reduction: whole blocks, at least 256
/// columns (fewer dot calls), or the whole width when it does not divide.
pub fn ffn_chunk(down_dtype: GgmlType, n_ff: usize) -> usize {
    match kernels::Kernels::reduction_chunk(down_dtype, 256) {
        Some(c) if n_ff.is_multiple_of(c) => c,
        _ => n_ff,
    }
}

/// The `i`-th of `n` contiguous parts of `0..len`, boundaries rounded down to multiples of
/// `align` (the last part ends at `len`).
pub fn split_range(len: usize, i: usize, n: usize, align: usize) -> Range<usize> {
    let cut = |k: usize| {
        if k >= n {
            len
        } else {
            (len * k / n) / align * align
        }
    };
    cut(i)..cut(i + 1)
}

/// Rank `rank`'s kv heads under a grouped-query head split, or `None` when attention stays
/// whole on every rank. Ranks get whole units — the fewest kv heads whose query heads fill
/// whole reduction chunks of the output projection (`o_chunk`), so every rank computes whole
/// chunks and the all-reduce reproduces the single node — as evenly as the units allow
/// (OLMoE's 16 heads of 128 in Q4_K blocks of 256 over 3 ranks: 6, 6 and 4 heads).
fn gqa_kv_heads(
    hp: &Hparams,
    o_dtype: GgmlType,
    rank: usize,
    n_ranks: usize,
) -> Option<Range<usize>> {
    let n_kv = hp.n_head_kv;
    if n_kv == 0 || !hp.n_head.is_multiple_of(n_kv) {
        return None;
    }
    let group_width = (hp.n_head / n_kv) * hp.head_dim_out();
    let chunk = o_chunk(o_dtype, hp.head_dim_out(), hp.n_head / n_kv);
    if group_width == 0 || !chunk.is_multiple_of(group_width) {
        return None;
    }
    let unit = chunk / group_width;
    if !n_kv.is_multiple_of(unit) || n_kv / unit < n_ranks {
        return None;
    }
    let units = split_range(n_kv / unit, rank, n_ranks, 1);
    Some(units.start * unit..units.end * unit)
}

impl Shard {
    /// Everything, on one node.
    pub fn full(hp: &Hparams) -> Shard {
        Shard {
            rank: 0,
            n_ranks: 1,
            heads: 0..hp.n_head,
            kv_heads: 0..hp.n_head_kv,
            attention_split: false,
            vocab: 0..hp.n_vocab,
        }
    }

    /// Rank `rank` of `n_ranks`. `o_dtype` is the attention output projection's type, whose
    /// blocks must not straddle a head boundary for a head split.
    pub fn new(hp: &Hparams, o_dtype: GgmlType, rank: usize, n_ranks: usize) -> Shard {
        let mut s = Shard::full(hp);
        s.rank = rank;
        s.n_ranks = n_ranks;
        if n_ranks <= 1 {
            return s;
        }
        let heads_per_rank = hp.n_head / n_ranks;
        let aligned = o_dtype
            .row_bytes((heads_per_rank * hp.head_dim_out()) as u64)
            .is_some();
        if let Some(p) = &hp.dsv4 {
            // DeepSeek V4: whole output groups of query heads per rank; the one shared
            // key/value head, the compressors and the indexer are computed by every rank.
            let r = p.o_lora_rank;
            if p.o_groups.is_multiple_of(n_ranks) && o_dtype.row_bytes(r as u64).is_some() {
                s.heads = rank * heads_per_rank..(rank + 1) * heads_per_rank;
                s.attention_split = true;
            }
        } else if hp.mla.is_some() {
            // Latent attention: query heads split, the one latent cache (shared by every head)
            // kept whole on every rank. GLM-5.3 Flash's KDA layers split the same heads, each
            // rank keeping its heads' recurrent state; its indexer runs whole on every rank.
            let kda_aligned = hp.glm5next.as_ref().is_none_or(|p| {
                o_dtype
                    .row_bytes((heads_per_rank * p.kda_head_dim) as u64)
                    .is_some()
            });
            if hp.n_head.is_multiple_of(n_ranks) && aligned && kda_aligned {
                s.heads = rank * heads_per_rank..(rank + 1) * heads_per_rank;
                s.attention_split = true;
            }
        } else if let Some(kv_heads) = gqa_kv_heads(hp, o_dtype, rank, n_ranks) {
            // A whole-projection q/k norm (OLMoE) splits too: the ranks all-reduce each
            // head's sum of squares before normalizing (`ReducePoint::QkNormSums`).
            let group = hp.n_head / hp.n_head_kv.max(1);
            s.heads = kv_heads.start * group..kv_heads.end * group;
            s.kv_heads = kv_heads;
            s.attention_split = true;
        }
        s.vocab = split_range(hp.n_vocab, rank, n_ranks, 1);
        s
    }

    pub fn is_split(&self) -> bool {
        self.n_ranks > 1
    }

    /// Whether ranks hold different kv heads (else each holds the whole cache, as for
    /// replicated attention or multi-head latent attention).
    pub fn kv_split(&self, n_head_kv: usize) -> bool {
        self.attention_split && self.kv_heads.len() < n_head_kv
    }

    /// This rank's columns of a SwiGLU FFN of width `n_ff` reduced in chunks of `chunk`
    /// columns; `None` when there are fewer chunks than ranks (rank 0 then computes it all).
    pub fn ffn_cols(&self, n_ff: usize, chunk: usize) -> Option<Range<usize>> {
        if self.n_ranks <= 1 {
            return Some(0..n_ff);
        }
        if !n_ff.is_multiple_of(chunk) || n_ff / chunk < self.n_ranks {
            return None;
        }
        Some(split_range(n_ff, self.rank, self.n_ranks, chunk))
    }
}

/// A layer's keys or values as a rank holds them: position-major rows of `heads` kv heads of
/// `head_bytes` each, cut out of rows of all `n_head_kv` heads (`all`, `n_pos` rows).
pub fn kv_heads_slice(
    all: &[u8],
    n_pos: usize,
    n_head_kv: usize,
    heads: &Range<usize>,
    head_bytes: usize,
) -> crate::Result<Vec<u8>> {
    let row = n_head_kv * head_bytes;
    if all.len() != n_pos * row || heads.end > n_head_kv || heads.start > heads.end {
        return Err(crate::ModelError::Input(format!(
            "KV of {} bytes is not {n_pos} positions of {n_head_kv} heads × {head_bytes} bytes \
             (heads {heads:?} wanted)",
            all.len()
        )));
    }
    let (a, b) = (heads.start * head_bytes, heads.end * head_bytes);
    Ok(all
        .chunks_exact(row.max(1))
        .flat_map(|r| &r[a..b])
        .copied()
        .collect())
}

/// The inverse of [`kv_heads_slice`] over a whole group: `parts[r]` holds `n_pos` rows of the
/// heads `heads[r]` (in rank order, together covering `0..n_head_kv` once); the result is
/// `n_pos` rows of all heads.
pub fn kv_heads_merge(
    parts: &[&[u8]],
    heads: &[Range<usize>],
    n_pos: usize,
    n_head_kv: usize,
    head_bytes: usize,
) -> crate::Result<Vec<u8>> {
    let bad = |what: String| {
        Err(crate::ModelError::Input(format!(
            "merging KV heads: {what}"
        )))
    };
    if parts.len() != heads.len() {
        return bad(format!(
            "{} parts for {} head ranges",
            parts.len(),
            heads.len()
        ));
    }
    let mut next = 0;
    for (p, h) in parts.iter().zip(heads) {
        if h.start != next || h.end < h.start {
            return bad(format!(
                "head ranges {heads:?} do not cover 0..{n_head_kv} in order"
            ));
        }
        next = h.end;
        if p.len() != n_pos * h.len() * head_bytes {
            return bad(format!(
                "a part of {} bytes for {n_pos} positions of heads {h:?}",
                p.len()
            ));
        }
    }
    if next != n_head_kv {
        return bad(format!("head ranges {heads:?} do not cover 0..{n_head_kv}"));
    }
    let mut out = Vec::with_capacity(n_pos * n_head_kv * head_bytes);
    for pos in 0..n_pos {
        for (p, h) in parts.iter().zip(heads) {
            let w = h.len() * head_bytes;
            out.extend_from_slice(&p[pos * w..(pos + 1) * w]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_heads_split_and_merge_are_inverse_and_check_sizes() {
        let (n_pos, n_head_kv, hb) = (3, 4, 2);
        let all: Vec<u8> = (0..(n_pos * n_head_kv * hb) as u8).collect();
        let heads = [0..1, 1..3, 3..4];
        let parts: Vec<Vec<u8>> = heads
            .iter()
            .map(|h| kv_heads_slice(&all, n_pos, n_head_kv, h, hb).unwrap())
            .collect();
        assert_eq!(parts[1], vec![2, 3, 4, 5, 10, 11, 12, 13, 18, 19, 20, 21]);
        let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        assert_eq!(
            kv_heads_merge(&refs, &heads, n_pos, n_head_kv, hb).unwrap(),
            all
        );
        assert!(kv_heads_slice(&all[1..], n_pos, n_head_kv, &(0..1), hb).is_err());
        assert!(kv_heads_slice(&all, n_pos, n_head_kv, &(3..5), hb).is_err());
        assert!(kv_heads_merge(&refs[..2], &heads[..2], n_pos, n_head_kv, hb).is_err());
        let short = [&parts[0][..], &parts[1][1..], &parts[2][..]];
        assert!(kv_heads_merge(&short, &heads, n_pos, n_head_kv, hb).is_err());
    }

    #[test]
    fn split_ranges_cover_everything_once_and_align() {
        for (len, n, align) in [(1536, 2, 32), (768, 3, 256), (151_936, 3, 1), (100, 4, 1)] {
            let parts: Vec<_> = (0..n).map(|i| split_range(len, i, n, align)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[n - 1].end, len);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            for p in &parts[..n - 1] {
                assert_eq!(p.end % align, 0);
            }
        }
    }
}
