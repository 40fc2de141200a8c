//! DeepSeek V4's compressed rows in the KV cache: per compressed layer the rows made so far
//! and the compressors' inputs of recent positions, with their rewinds, pruning and snapshots.

use super::{KvCache, KvLayout};
use crate::error::{ModelError, Result};

/// Which layers of a DeepSeek V4 cache pool windows of positions into compressed rows, and
/// how. Besides the rows, a compressed layer keeps its compressor's inputs (the projected
/// values and scores) of recent positions: those of the window being filled, the previous
/// window (ratio 4 windows overlap), and what a rewind by up to a sliding window needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compression {
    /// Per layer of the cache.
    pub layers: Vec<Option<CompressedLayer>>,
    /// The model's largest ratio: inputs are kept in whole windows of it, the same positions
    /// in every cache, so every stage of a pipeline answers rewinds the same way.
    pub max_ratio: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompressedLayer {
    pub ratio: usize,
    /// Values of an attention compressed row.
    pub width: usize,
    /// Values of an indexer key row (0: no indexer).
    pub index_width: usize,
    /// Two inputs per position, the first pooled into the next window (ratio 4).
    pub overlap: bool,
}

/// Which compressor of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    Attention,
    Indexer,
}

/// One compressor's state: inputs from the cache's `comp_from` on, and the rows made.
#[derive(Clone, Debug, Default)]
pub(super) struct PoolState {
    in_width: usize,
    width: usize,
    kv_in: Vec<f32>,
    score_in: Vec<f32>,
    rows: Vec<f32>,
}

impl PoolState {
    fn new(width: usize, overlap: bool) -> PoolState {
        PoolState {
            in_width: if overlap { 2 * width } else { width },
            width,
            ..PoolState::default()
        }
    }

    fn n_inputs(&self) -> usize {
        self.kv_in.len() / self.in_width
    }

    fn bytes(&self) -> usize {
        4 * (self.kv_in.len() + self.score_in.len() + self.rows.len())
    }
}

#[derive(Clone, Debug)]
pub(super) struct CompLayerState {
    spec: CompressedLayer,
    attn: PoolState,
    index: Option<PoolState>,
}

impl CompLayerState {
    fn pool(&self, p: Pool) -> Option<&PoolState> {
        match p {
            Pool::Attention => Some(&self.attn),
            Pool::Indexer => self.index.as_ref(),
        }
    }

    fn pool_mut(&mut self, p: Pool) -> Option<&mut PoolState> {
        match p {
            Pool::Attention => Some(&mut self.attn),
            Pool::Indexer => self.index.as_mut(),
        }
    }

    fn pools_mut(&mut self) -> impl Iterator<Item = &mut PoolState> {
        std::iter::once(&mut self.attn).chain(self.index.as_mut())
    }
}

/// First position whose compressor inputs a rewind to `n` needs, in windows of `m`: the
/// window `n` falls in and the one before it.
pub(super) fn comp_needed(n: usize, m: usize) -> usize {
    (n / m).saturating_sub(1) * m
}

/// Each local layer's compressor state as `layout` declares it (`n` local layers).
pub(super) fn states(layout: &KvLayout, n: usize) -> Vec<Option<CompLayerState>> {
    (0..n)
        .map(|l| {
            let spec = layout
                .compression
                .as_ref()?
                .layers
                .get(l)
                .copied()
                .flatten()?;
            Some(CompLayerState {
                spec,
                attn: PoolState::new(spec.width, spec.overlap),
                index: (spec.index_width > 0)
                    .then(|| PoolState::new(spec.index_width, spec.overlap)),
            })
        })
        .collect()
}

impl KvCache {
    /// Bytes of compressed rows and compressor inputs (DeepSeek V4; f32).
    pub fn compressed_bytes(&self) -> usize {
        self.comp
            .iter()
            .flatten()
            .map(|c| c.attn.bytes() + c.index.as_ref().map_or(0, PoolState::bytes))
            .sum()
    }

    fn comp_pool(&self, layer: usize, pool: Pool) -> Result<&PoolState> {
        let l = self.local(layer)?;
        self.comp[l]
            .as_ref()
            .and_then(|c| c.pool(pool))
            .ok_or_else(|| ModelError::Input(format!("layer {layer} has no {pool:?} compressor")))
    }

    fn comp_pool_mut(&mut self, layer: usize, pool: Pool) -> Result<&mut PoolState> {
        let l = self.local(layer)?;
        self.comp[l]
            .as_mut()
            .and_then(|c| c.pool_mut(pool))
            .ok_or_else(|| ModelError::Input(format!("layer {layer} has no {pool:?} compressor")))
    }

    /// Appends a compressor's inputs (`kv` and `score` rows, one per position from `pos0`,
    /// which must be the next position it has no input for).
    pub fn push_pool_inputs(
        &mut self,
        layer: usize,
        pool: Pool,
        pos0: usize,
        kv: &[f32],
        score: &[f32],
    ) -> Result<()> {
        let from = self.comp_from;
        let p = self.comp_pool_mut(layer, pool)?;
        if pos0 != from + p.n_inputs()
            || kv.len() != score.len()
            || !kv.len().is_multiple_of(p.in_width)
        {
            return Err(ModelError::Input(format!(
                "compressor inputs of layer {layer} at position {pos0}: it holds {}..{}",
                from,
                from + p.n_inputs()
            )));
        }
        p.kv_in.extend_from_slice(kv);
        p.score_in.extend_from_slice(score);
        Ok(())
    }

    /// A compressor's inputs of positions `range` (kv, score), which it must hold.
    pub fn pool_inputs(
        &self,
        layer: usize,
        pool: Pool,
        range: std::ops::Range<usize>,
    ) -> Result<(&[f32], &[f32])> {
        let from = self.comp_from;
        let p = self.comp_pool(layer, pool)?;
        if range.start < from || range.end > from + p.n_inputs() {
            return Err(ModelError::Input(format!(
                "compressor inputs {range:?} of layer {layer}: it holds {}..{}",
                from,
                from + p.n_inputs()
            )));
        }
        let (a, b) = (
            (range.start - from) * p.in_width,
            (range.end - from) * p.in_width,
        );
        Ok((&p.kv_in[a..b], &p.score_in[a..b]))
    }

    /// The compressed rows a compressor has made (window `w` is row `w`).
    pub fn pool_rows(&self, layer: usize, pool: Pool) -> Result<&[f32]> {
        Ok(&self.comp_pool(layer, pool)?.rows)
    }

    /// Appends the row of the next window.
    pub fn push_pool_row(&mut self, layer: usize, pool: Pool, row: &[f32]) -> Result<()> {
        let p = self.comp_pool_mut(layer, pool)?;
        if row.len() != p.width {
            return Err(ModelError::Input(format!(
                "compressed row of {} values for layer {layer}, expected {}",
                row.len(),
                p.width
            )));
        }
        p.rows.extend_from_slice(row);
        Ok(())
    }

    /// A compressed layer's state for a snapshot of `n` positions: per compressor the rows of
    /// the windows complete at `n`, then the inputs of positions `comp_needed(n)..n` (what the
    /// windows to come read), little-endian f32 behind u64 counts.
    pub(super) fn export_compressed(&self, l: usize, n: usize) -> Result<Vec<u8>> {
        let c = self.comp[l].as_ref().expect("a compressed layer");
        let m = self.max_ratio().unwrap_or(1);
        let from = comp_needed(n, m);
        if from < self.comp_from {
            return Err(ModelError::Input(format!(
                "KV export of {n} positions: the compressors hold inputs from {} only",
                self.comp_from
            )));
        }
        let mut out = Vec::new();
        let put = |out: &mut Vec<u8>, v: &[f32]| {
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
        for p in std::iter::once(&c.attn).chain(c.index.as_ref()) {
            put(&mut out, &p.rows[..(n / c.spec.ratio) * p.width]);
            let (a, b) = (
                (from - self.comp_from) * p.in_width,
                (n - self.comp_from) * p.in_width,
            );
            put(&mut out, &p.kv_in[a..b]);
            put(&mut out, &p.score_in[a..b]);
        }
        Ok(out)
    }

    /// Restores what [`KvCache::export_compressed`] wrote for local layer `l` of `n` positions.
    pub(super) fn import_compressed(&mut self, layer: usize, n: usize, bytes: &[u8]) -> Result<()> {
        let l = self.local(layer)?;
        let from = self.comp_from;
        let bad = |why: String| {
            ModelError::Input(format!(
                "KV import of layer {layer}: compressor state {why}"
            ))
        };
        let mut at = 0usize;
        let mut take = |want: usize| -> Result<Vec<f32>> {
            let head = bytes
                .get(at..at + 8)
                .ok_or_else(|| bad("is truncated".into()))?;
            let len = u64::from_le_bytes(head.try_into().expect("8 bytes")) as usize;
            if len != want {
                return Err(bad(format!("has {len} values where {want} belong")));
            }
            let body = bytes
                .get(at + 8..at + 8 + 4 * len)
                .ok_or_else(|| bad("is truncated".into()))?;
            at += 8 + 4 * len;
            Ok(body
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let c = self.comp[l]
            .as_mut()
            .ok_or_else(|| bad("for a layer that has none".into()))?;
        let ratio = c.spec.ratio;
        for p in c.pools_mut() {
            p.rows = take((n / ratio) * p.width)?;
            p.kv_in = take((n - from) * p.in_width)?;
            p.score_in = take((n - from) * p.in_width)?;
        }
        if at != bytes.len() {
            return Err(bad(format!("has {} bytes too many", bytes.len() - at)));
        }
        Ok(())
    }

    /// After a rewind to `self.len`: rows of windows no longer complete and inputs past it go.
    pub(super) fn truncate_compressed(&mut self) {
        let (len, from) = (self.len, self.comp_from);
        for c in self.comp.iter_mut().flatten() {
            let ratio = c.spec.ratio;
            for p in c.pools_mut() {
                let keep = len.saturating_sub(from).min(p.n_inputs());
                p.kv_in.truncate(keep * p.in_width);
                p.score_in.truncate(keep * p.in_width);
                p.rows.truncate((len / ratio) * p.width);
            }
        }
    }

    /// Before positions from `pos0` are stored: drops the inputs no rewind the sliding layers
    /// still answer for needs.
    pub(super) fn prune_compressed(&mut self, pos0: usize) {
        let Some(m) = self.max_ratio() else { return };
        let slack = self.window().unwrap_or(0) + m;
        let new_from = comp_needed(pos0.saturating_sub(slack), m).max(self.comp_from);
        if new_from > self.comp_from {
            let drop = new_from - self.comp_from;
            for c in self.comp.iter_mut().flatten() {
                for p in c.pools_mut() {
                    let d = drop.min(p.n_inputs()) * p.in_width;
                    p.kv_in.drain(..d);
                    p.score_in.drain(..d);
                }
            }
            self.comp_from = new_from;
        }
    }

    /// Empties the compressors for a restore of `n` positions.
    pub(super) fn begin_import_compressed(&mut self, n: usize) {
        self.comp_from = self.max_ratio().map_or(0, |m| comp_needed(n, m));
        for c in self.comp.iter_mut().flatten() {
            for p in c.pools_mut() {
                p.rows.clear();
                p.kv_in.clear();
                p.score_in.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvType, SlidingLayers};

    /// DeepSeek-V4-Flash's cache shape: 43 layers, one 512-dim key row per position (values are
    /// the keys) in a 128-position window on every layer, ratio 4 on even layers from 2 on
    /// (attention rows of 512 and indexer rows of 128) and ratio 128 on the odd ones.
    fn dsv4_flash(n_ctx: usize) -> KvLayout {
        let n_layer = 43;
        KvLayout {
            kv_type: KvType::F16,
            layers: 0..=n_layer - 1,
            n_kv_head: 1,
            head_dim_k: 512,
            head_dim_v: 0,
            n_ctx,
            sliding: Some(SlidingLayers {
                window: 128,
                layers: vec![true; n_layer],
            }),
            compression: Some(Compression {
                layers: (0..n_layer)
                    .map(|il| match il {
                        0 | 1 => None,
                        il if il % 2 == 0 => Some(CompressedLayer {
                            ratio: 4,
                            width: 512,
                            index_width: 128,
                            overlap: true,
                        }),
                        _ => Some(CompressedLayer {
                            ratio: 128,
                            width: 512,
                            index_width: 0,
                            overlap: false,
                        }),
                    })
                    .collect(),
                max_ratio: 128,
            }),
            index_keys: None,
            hybrid: None,
        }
    }

    /// Fills the compressors as the forward path does: inputs per position, a row per window.
    fn fill_compressed(kv: &mut KvCache, pos0: usize, n: usize) {
        kv.reserve(pos0, n).unwrap();
        let layers: Vec<(usize, CompressedLayer)> = kv
            .layout
            .compression
            .clone()
            .unwrap()
            .layers
            .iter()
            .enumerate()
            .filter_map(|(l, c)| c.map(|c| (l, c)))
            .collect();
        for (l, c) in layers {
            for (pool, width) in [(Pool::Attention, c.width), (Pool::Indexer, c.index_width)] {
                if width == 0 {
                    continue;
                }
                let w_in = if c.overlap { 2 * width } else { width };
                let inputs = vec![0.5f32; n * w_in];
                kv.push_pool_inputs(l, pool, pos0, &inputs, &inputs)
                    .unwrap();
                let made = kv.pool_rows(l, pool).unwrap().len() / width;
                for _ in made..(pos0 + n) / c.ratio {
                    kv.push_pool_row(l, pool, &vec![1.0; width]).unwrap();
                }
            }
        }
    }

    #[test]
    fn a_deepseek_v4_flash_shaped_cache_grows_by_its_compressed_rows_only() {
        let mut kv = KvCache::new(dsv4_flash(1 << 16));
        fill_compressed(&mut kv, 0, 512);
        for pos in 512..4096 {
            fill_compressed(&mut kv, pos, 1);
        }
        let at_4k = kv.bytes_used();
        for pos in 4096..8192 {
            fill_compressed(&mut kv, pos, 1);
        }
        let at_8k = kv.bytes_used();
        let per_position = (at_8k - at_4k) as f64 / 4096.0;
        // 21 ratio-4 layers × (512 + 128) f32 / 4 + 20 ratio-128 layers × 512 f32 / 128.
        let want = 21.0 * 640.0 + 20.0 * 16.0;
        eprintln!(
            "DeepSeek-V4-Flash shape, f16 window rows, f32 compressed rows: {at_4k} bytes at 4096 positions, {at_8k} at 8192, {per_position:.1} per position (the window and the compressors' pending inputs are fixed)"
        );
        assert!(
            (per_position - want).abs() < 1.0,
            "{per_position} vs {want}"
        );
        // Rewinds within the window work and keep every compressor consistent.
        assert!(kv.can_rewind(8192 - 100));
        kv.truncate(8192 - 100).unwrap();
        fill_compressed(&mut kv, 8192 - 100, 100);
        assert_eq!(kv.bytes_used(), at_8k);
    }
}
