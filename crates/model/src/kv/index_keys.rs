//! GLM-5's indexer keys in the KV cache: per full sparse-attention layer one key per position,
//! kept in f32 whatever the cache's type (the indexer's top-k cut moves with key rounding: f16
//! keys change which tokens are attended on the reference fixture, see docs/models.md). They
//! follow the layer's positions exactly (the layer is never sliding), so rewinds need nothing
//! beyond the cache's length; snapshots carry them in the layer's values slot, which latent
//! attention leaves empty.

use super::{KvCache, KvLayout};
use crate::error::{ModelError, Result};

/// Which layers of a cache keep indexer keys, and their width.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexKeys {
    pub width: usize,
    /// Per layer of the cache (`layers` in order).
    pub layers: Vec<bool>,
}

impl KvLayout {
    /// Indexer key values per position of local layer `l` (0 without).
    pub(super) fn index_width(&self, l: usize) -> usize {
        self.index_keys
            .as_ref()
            .filter(|ix| ix.layers.get(l).copied().unwrap_or(false))
            .map_or(0, |ix| ix.width)
    }

    /// Indexer key bytes per position over the cache's layers.
    pub(super) fn index_bytes_per_position(&self) -> usize {
        let n = self.layers.clone().count();
        (0..n).map(|l| 4 * self.index_width(l)).sum()
    }
}

impl KvCache {
    /// Stores the indexer key of position `pos` of `layer` (reserved like its latent row).
    pub fn store_index_key(&mut self, layer: usize, pos: usize, key: &[f32]) -> Result<()> {
        let l = self.local(layer)?;
        let w = self.layout.index_width(l);
        if w == 0 || key.len() != w {
            return Err(ModelError::Input(format!(
                "layer {layer} keeps indexer keys of {w} values, got {}",
                key.len()
            )));
        }
        if pos >= self.len {
            return Err(ModelError::Input(format!(
                "position {pos} was not reserved"
            )));
        }
        self.ix[l][pos * w..(pos + 1) * w].copy_from_slice(key);
        Ok(())
    }

    /// Indexer keys of `layer` for positions `0..len`, position-major.
    pub fn index_keys(&self, layer: usize) -> Result<&[f32]> {
        let l = self.local(layer)?;
        Ok(&self.ix[l][..self.len * self.layout.index_width(l)])
    }

    /// Grows every indexer-key layer to `positions` (called by `reserve` with its target).
    pub(super) fn grow_index_keys(&mut self, need: usize, positions: usize) {
        for l in 0..self.ix.len() {
            let w = self.layout.index_width(l);
            if self.ix[l].len() < need * w {
                self.ix[l].resize(positions * w, 0.0);
            }
        }
    }

    pub(super) fn index_key_bytes_used(&self) -> usize {
        self.len * self.layout.index_bytes_per_position()
    }

    /// Sizes the indexer keys for an import of `n` positions.
    pub(super) fn begin_import_index_keys(&mut self, n: usize) {
        for l in 0..self.ix.len() {
            let w = self.layout.index_width(l);
            self.ix[l].clear();
            self.ix[l].resize(n * w, 0.0);
        }
    }

    /// Snapshot bytes of local layer `l`'s keys for positions `0..n` (f32, little-endian).
    pub(super) fn export_index_keys(&self, l: usize, n: usize) -> Vec<u8> {
        let w = self.layout.index_width(l);
        self.ix[l][..n * w]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }

    pub(super) fn import_index_keys(&mut self, layer: usize, n: usize, bytes: &[u8]) -> Result<()> {
        let l = self.local(layer)?;
        let w = self.layout.index_width(l);
        if bytes.len() != n * w * 4 || n != self.len {
            return Err(ModelError::Input(format!(
                "KV import of {n} positions for layer {layer}: {} indexer key bytes, {} expected",
                bytes.len(),
                n * w * 4
            )));
        }
        for (d, c) in self.ix[l].iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }
}
