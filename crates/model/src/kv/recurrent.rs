//! GLM-5.3 Flash's per-layer memories in the KV cache: latent layers keep their rows (as every
//! other model), full-indexer layers also the indexer's keys and pooling scores per position
//! (f32 whatever the KV type: the top-k cut is too close for f16 keys, see
//! `tools/fixtures/models/README.md`) and the pooled key of every complete pool, and KDA layers a
//! recurrent state instead of rows: the last `conv_taps` pre-convolution q/k/v rows and the
//! per-head `head_dim × head_dim` matrix.
//!
//! A recurrent state cannot be rewound by slicing, so the cache keeps checkpoints of it at a
//! few positions (its rewind points): where the last stored chunk started (the rewind the
//! forward path does on error) and the latest [`KEPT_REWINDS`] positions (the engine's
//! re-evaluation of a last token, a speculative draft's rejection). The points depend only on
//! the positions stored, not on the layers a cache holds, so every stage of a pipeline answers
//! [`KvCache::can_rewind`] the same way.

use super::{KvCache, KvLayout};
use crate::error::{ModelError, Result};

/// Positions back from the end that a rewind can reach.
pub const KEPT_REWINDS: usize = 4;

/// What each layer of a GLM-5.3 Flash cache remembers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HybridLayers {
    /// Per layer of the cache.
    pub layers: Vec<LayerMemory>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerMemory {
    /// Rows per position only.
    Rows,
    /// Rows plus, per position, an indexer key and its pooling scores (`width` each), pooled
    /// every `pool` positions.
    RowsAndIndexKeys { width: usize, pool: usize },
    /// No rows: a recurrent state of `n_head` heads of `head_dim` and the convolutions'
    /// history of `conv_taps` positions of q, k and v (`n_head · head_dim` each).
    Recurrent {
        n_head: usize,
        head_dim: usize,
        conv_taps: usize,
    },
}

/// The k-pool indexer's memory of one layer: positions `0..len` and the pools complete so far.
#[derive(Clone, Debug, Default)]
pub struct IndexKeys {
    width: usize,
    pool: usize,
    keys: Vec<f32>,
    scores: Vec<f32>,
    pooled: Vec<f32>,
}

impl IndexKeys {
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

    fn truncate(&mut self, n: usize) {
        self.keys.truncate(n * self.width);
        self.scores.truncate(n * self.width);
        self.pooled.truncate(n / self.pool.max(1) * self.width);
    }

    fn bytes(&self) -> usize {
        4 * (self.keys.len() + self.scores.len() + self.pooled.len())
    }
}

/// A KDA layer's recurrent memory after `at` positions, with checkpoints at rewind points.
#[derive(Clone, Debug, Default)]
pub struct RecurrentState {
    pub n_head: usize,
    pub head_dim: usize,
    pub conv_taps: usize,
    /// q, k, v in turn: `conv_taps` pre-convolution rows each, oldest first.
    pub conv: Vec<f32>,
    /// Per head `head_dim` key rows of `head_dim` values.
    pub state: Vec<f32>,
    at: usize,
    checkpoints: Vec<(usize, Vec<f32>, Vec<f32>)>,
}

impl RecurrentState {
    fn new(n_head: usize, head_dim: usize, conv_taps: usize) -> RecurrentState {
        let mut s = RecurrentState {
            n_head,
            head_dim,
            conv_taps,
            ..RecurrentState::default()
        };
        s.reset();
        s
    }

    fn reset(&mut self) {
        let width = self.n_head * self.head_dim;
        self.conv = vec![0.0; 3 * self.conv_taps * width];
        self.state = vec![0.0; self.n_head * self.head_dim * self.head_dim];
        self.at = 0;
        self.checkpoints.clear();
    }

    /// Positions the state has taken in.
    pub fn at(&self) -> usize {
        self.at
    }

    /// Marks the state as that after `at` positions.
    pub fn set_at(&mut self, at: usize) {
        self.at = at;
    }

    /// Keeps `(conv, state)` as the memory after `at` positions.
    pub fn checkpoint(&mut self, at: usize, conv: &[f32], state: &[f32]) {
        self.checkpoints.retain(|c| c.0 != at);
        self.checkpoints.push((at, conv.to_vec(), state.to_vec()));
    }

    fn memory_at(&self, n: usize) -> Option<(&[f32], &[f32])> {
        if n == self.at {
            return Some((&self.conv, &self.state));
        }
        self.checkpoints
            .iter()
            .find(|c| c.0 == n)
            .map(|c| (&c.1[..], &c.2[..]))
    }

    /// Back to the memory after `n` positions (a checkpoint, or nothing at 0); false when
    /// there is none.
    fn rewind(&mut self, n: usize) -> bool {
        if n == 0 {
            self.reset();
            return true;
        }
        if n != self.at {
            let Some(i) = self.checkpoints.iter().position(|c| c.0 == n) else {
                return false;
            };
            let (_, conv, state) = self.checkpoints[i].clone();
            self.conv = conv;
            self.state = state;
            self.at = n;
        }
        self.checkpoints.retain(|c| c.0 <= n);
        true
    }

    fn bytes(&self) -> usize {
        4 * (self.conv.len()
            + self.state.len()
            + self
                .checkpoints
                .iter()
                .map(|c| c.1.len() + c.2.len())
                .sum::<usize>())
    }
}

#[derive(Clone, Debug)]
pub(super) enum HybridState {
    Rows,
    Index(IndexKeys),
    Recurrent(RecurrentState),
}

/// Each local layer's memory as `layout` declares it (`n` local layers).
pub(super) fn states(layout: &KvLayout, n: usize) -> Vec<HybridState> {
    (0..n)
        .map(|l| {
            match layout
                .hybrid
                .as_ref()
                .and_then(|h| h.layers.get(l).copied())
            {
                None | Some(LayerMemory::Rows) => HybridState::Rows,
                Some(LayerMemory::RowsAndIndexKeys { width, pool }) => {
                    HybridState::Index(IndexKeys {
                        width,
                        pool,
                        ..IndexKeys::default()
                    })
                }
                Some(LayerMemory::Recurrent {
                    n_head,
                    head_dim,
                    conv_taps,
                }) => HybridState::Recurrent(RecurrentState::new(n_head, head_dim, conv_taps)),
            }
        })
        .collect()
}

fn put(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Reads what [`put`] wrote: `want` values at `*at`.
fn take(bytes: &[u8], at: &mut usize, want: usize, layer: usize) -> Result<Vec<f32>> {
    let bad = |why: String| ModelError::Input(format!("KV import of layer {layer}: state {why}"));
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

impl KvCache {
    fn is_hybrid(&self) -> bool {
        self.layout.hybrid.is_some()
    }

    /// Whether local layer `l` keeps per-position rows (all but KDA layers).
    pub(super) fn holds_rows(&self, l: usize) -> bool {
        !matches!(self.hybrid.get(l), Some(HybridState::Recurrent(_)))
    }

    /// The indexer memory of `layer`.
    pub fn index_keys(&self, layer: usize) -> Result<&IndexKeys> {
        let l = self.local(layer)?;
        match &self.hybrid[l] {
            HybridState::Index(ix) => Ok(ix),
            _ => Err(ModelError::Input(format!(
                "layer {layer} keeps no indexer keys"
            ))),
        }
    }

    pub fn index_keys_mut(&mut self, layer: usize) -> Result<&mut IndexKeys> {
        let l = self.local(layer)?;
        match &mut self.hybrid[l] {
            HybridState::Index(ix) => Ok(ix),
            _ => Err(ModelError::Input(format!(
                "layer {layer} keeps no indexer keys"
            ))),
        }
    }

    /// The recurrent memory of KDA layer `layer`.
    pub fn recurrent_mut(&mut self, layer: usize) -> Result<&mut RecurrentState> {
        let l = self.local(layer)?;
        match &mut self.hybrid[l] {
            HybridState::Recurrent(r) => Ok(r),
            _ => Err(ModelError::Input(format!(
                "layer {layer} keeps no recurrent state"
            ))),
        }
    }

    /// Rewind points (positions after which recurrent layers keep a checkpoint) in `range`.
    pub fn rewind_points_in(&self, range: std::ops::RangeInclusive<usize>) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .rewind_points
            .iter()
            .copied()
            .filter(|m| range.contains(m))
            .collect();
        v.sort_unstable();
        v
    }

    /// Whether a rewind to `n` finds the recurrent layers' memory (0 always does).
    pub(super) fn hybrid_can_rewind(&self, n: usize) -> bool {
        !self.is_hybrid() || n == 0 || n >= self.len || self.rewind_points.contains(&n)
    }

    /// After a rewind to `self.len`.
    pub(super) fn truncate_hybrid(&mut self) {
        let n = self.len;
        for h in &mut self.hybrid {
            match h {
                HybridState::Rows => {}
                HybridState::Index(ix) => ix.truncate(n),
                HybridState::Recurrent(r) => {
                    let found = r.rewind(n);
                    debug_assert!(found, "rewind to {n} without a checkpoint");
                }
            }
        }
        self.rewind_points.retain(|&m| m <= n);
    }

    /// Before positions `pos0..end` are stored (after the rewind to `pos0`): the rewind points
    /// become `pos0` and the latest [`KEPT_REWINDS`] positions up to `end`; recurrent layers
    /// keep their memory at `pos0` and drop checkpoints of points no longer kept.
    pub(super) fn reserve_hybrid(&mut self, pos0: usize, end: usize) {
        if !self.is_hybrid() {
            return;
        }
        let oldest = end.saturating_sub(KEPT_REWINDS);
        self.rewind_points.retain(|&m| m >= oldest && m <= pos0);
        self.rewind_points.push(pos0);
        self.rewind_points.extend((pos0 + 1).max(oldest)..=end);
        self.rewind_points.sort_unstable();
        self.rewind_points.dedup();
        let points = self.rewind_points.clone();
        for h in &mut self.hybrid {
            if let HybridState::Recurrent(r) = h {
                r.checkpoints.retain(|c| points.contains(&c.0));
                if r.at == pos0 && !r.checkpoints.iter().any(|c| c.0 == pos0) {
                    let (conv, state) = (r.conv.clone(), r.state.clone());
                    r.checkpoints.push((pos0, conv, state));
                }
            }
        }
    }

    pub(super) fn hybrid_bytes(&self) -> usize {
        self.hybrid
            .iter()
            .map(|h| match h {
                HybridState::Rows => 0,
                HybridState::Index(ix) => ix.bytes(),
                HybridState::Recurrent(r) => r.bytes(),
            })
            .sum()
    }

    /// The snapshot bytes of local layer `l` at `n` positions that go where values would:
    /// the indexer keys, scores and pooled keys, or the recurrent memory after `n` positions;
    /// `None` for a layer of rows only.
    pub(super) fn export_hybrid(&self, l: usize, n: usize) -> Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        match &self.hybrid[l] {
            HybridState::Rows => return Ok(None),
            HybridState::Index(ix) => {
                let w = ix.width;
                put(&mut out, &ix.keys[..n * w]);
                put(&mut out, &ix.scores[..n * w]);
                put(&mut out, &ix.pooled[..(n / ix.pool) * w]);
            }
            HybridState::Recurrent(r) => {
                let (conv, state) = r.memory_at(n).ok_or_else(|| {
                    ModelError::Input(format!(
                        "KV export of {n} positions: the recurrent state is at {} and has no checkpoint there",
                        r.at
                    ))
                })?;
                put(&mut out, conv);
                put(&mut out, state);
            }
        }
        Ok(Some(out))
    }

    /// Empties the memories for a restore of `n` positions.
    pub(super) fn begin_import_hybrid(&mut self, n: usize) {
        for h in &mut self.hybrid {
            match h {
                HybridState::Rows => {}
                HybridState::Index(ix) => ix.truncate(0),
                HybridState::Recurrent(r) => {
                    r.reset();
                    r.at = n;
                }
            }
        }
        self.rewind_points = if self.is_hybrid() {
            vec![n]
        } else {
            Vec::new()
        };
    }

    /// Restores what [`KvCache::export_hybrid`] wrote for `layer` of `n` positions; false for
    /// a layer of rows only (its values are plain rows).
    pub(super) fn import_hybrid(&mut self, layer: usize, n: usize, bytes: &[u8]) -> Result<bool> {
        let l = self.local(layer)?;
        let mut at = 0usize;
        match &mut self.hybrid[l] {
            HybridState::Rows => return Ok(false),
            HybridState::Index(ix) => {
                let w = ix.width;
                ix.keys = take(bytes, &mut at, n * w, layer)?;
                ix.scores = take(bytes, &mut at, n * w, layer)?;
                ix.pooled = take(bytes, &mut at, (n / ix.pool) * w, layer)?;
            }
            HybridState::Recurrent(r) => {
                r.conv = take(bytes, &mut at, r.conv.len(), layer)?;
                r.state = take(bytes, &mut at, r.state.len(), layer)?;
                r.at = n;
            }
        }
        if at != bytes.len() {
            return Err(ModelError::Input(format!(
                "KV import of layer {layer}: state has {} bytes too many",
                bytes.len() - at
            )));
        }
        Ok(true)
    }
}
