//! GLM-5.3 Flash's k-pool indexer memory of one layer: the indexer key and pooling scores of
//! every position (f32 whatever the KV type) and the pooled key of every complete pool.

use crate::error::{ModelError, Result};

/// The k-pool indexer's memory of one layer: positions `0..len` and the pools complete so far.
#[derive(Clone, Debug, Default)]
pub struct PooledKeys {
    pub(super) width: usize,
    pub(super) pool: usize,
    pub(super) keys: Vec<f32>,
    pub(super) scores: Vec<f32>,
    pub(super) pooled: Vec<f32>,
}

impl PooledKeys {
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn pool(&self) -> usize {
        self.pool
    }

    pub fn len(&self) -> usize {
        self.keys.len() / self.width.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Appends the key and pooling scores of the next position.
    pub fn push(&mut self, pos: usize, key: &[f32], scores: &[f32]) -> Result<()> {
        if pos != self.len() || key.len() != self.width || scores.len() != self.width {
            return Err(ModelError::Input(format!(
                "indexer key of position {pos}: {} held, rows of {}",
                self.len(),
                self.width
            )));
        }
        self.keys.extend_from_slice(key);
        self.scores.extend_from_slice(scores);
        Ok(())
    }

    /// Keys and pooling scores of positions `range`.
    pub fn rows(&self, range: std::ops::Range<usize>) -> (&[f32], &[f32]) {
        let (a, b) = (range.start * self.width, range.end * self.width);
        (&self.keys[a..b], &self.scores[a..b])
    }

    /// Pools whose key is made.
    pub fn n_pooled(&self) -> usize {
        self.pooled.len() / self.width.max(1)
    }

    /// Pools complete in the positions held (their key made or not).
    pub fn n_complete(&self) -> usize {
        self.len() / self.pool.max(1)
    }

    pub fn push_pooled(&mut self, key: &[f32]) {
        debug_assert!(key.len() == self.width && self.n_pooled() < self.n_complete());
        self.pooled.extend_from_slice(key);
    }

    /// The pooled keys, pool `j` at row `j`.
    pub fn pooled(&self) -> &[f32] {
        &self.pooled
    }

    pub(super) fn truncate(&mut self, n: usize) {
        self.keys.truncate(n * self.width);
        self.scores.truncate(n * self.width);
        self.pooled.truncate(n / self.pool.max(1) * self.width);
    }

    pub(super) fn bytes(&self) -> usize {
        4 * (self.keys.len() + self.scores.len() + self.pooled.len())
    }
}
