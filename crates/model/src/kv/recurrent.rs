//! GLM-5.3 Flash's per-layer memories in the KV cache: latent layers keep their rows (as every
//! other model), full-indexer layers also the indexer's keys and pooling scores per position
//! (f32 whatever the KV type: the top-k cut is too close for f16 keys, see
//! `tools/fixtures/models/README.md`) and the pooled key of every complete pool, and KDA layers a
//! recurrent state instead of rows: the last `conv_taps` pre-convolution q/k/v rows and the
//! per-head `head_dim × head_dim` matrix.
//!
//! A recurrent state cannot be rewound by slicing, so a KDA layer keeps its memory at a base
//! position plus the inputs of every step since, which a rewind replays: the latest
//! [`KEPT_REWINDS`] positions are reachable (the engine's re-evaluation of a last token, a
//! rejected speculative draft). It also keeps its memory where longer chunks started, up to
//! [`KEPT_CHECKPOINTS`] of them spread over the history: the rewind the forward path does on
//! error, and the prefix cache's reuse of a shared beginning (a system prompt, an earlier turn),
//! for which a linear-attention layer's entry is a state at a position, not a slice of rows. The
//! points depend only on the positions stored, not on the layers a cache holds, so every stage
//! of a pipeline answers [`KvCache::can_rewind`] the same way.

use super::pooled_keys::PooledKeys;
use super::recurrent_bytes::{put, take};
use super::{KvCache, KvLayout};
use crate::error::{ModelError, Result};

/// Positions back from the end that a rewind can reach: the speculative decoder's default
/// eight drafts with room to spare, at `6·width + heads` values per position and KDA layer.
pub const KEPT_REWINDS: usize = 16;

/// Chunk starts whose memory a KDA layer keeps (each a `head_dim²` matrix per head, 4 MiB a
/// layer at GLM-5.3 Flash's 64 heads of 128), as llama.cpp's server keeps 8 context
/// checkpoints per slot.
pub const KEPT_CHECKPOINTS: usize = 8;

/// Adds a checkpoint at `at(&item)` (later than every one in `list`); past
/// [`KEPT_CHECKPOINTS`], drops the one whose loss leaves the shortest gap between neighbours
/// (the older on a tie), so the points stay spread over the history. The latest is always
/// kept. Both the cache's list of positions and each layer's list of memories follow this one
/// rule, so they agree.
pub(super) fn add_checkpoint<T>(list: &mut Vec<T>, item: T, at: impl Fn(&T) -> usize) {
    debug_assert!(list.last().is_none_or(|l| at(l) < at(&item)));
    list.push(item);
    if list.len() <= KEPT_CHECKPOINTS {
        return;
    }
    let pos: Vec<usize> = list.iter().map(&at).collect();
    let merged_gap = |i: usize| pos[i + 1] - if i == 0 { 0 } else { pos[i - 1] };
    let drop = (0..pos.len() - 1)
        .min_by_key(|&i| (merged_gap(i), i))
        .expect("more than one checkpoint");
    list.remove(drop);
}

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

/// One step of the gated delta rule on one head's state `s` (`k.len()` key rows of `v.len()`
/// values): `S ← diag(decay)·S`, then `S ← S + k ⊗ β(v − Sᵀk)`. The forward pass and a rewind's
/// replay both run this, so a replayed state has the bits of the original.
pub fn delta_rule_step(s: &mut [f32], k: &[f32], v: &[f32], decay: &[f32], beta: f32) {
    let dv = v.len();
    for (row, &e) in s.chunks_exact_mut(dv).zip(decay) {
        row.iter_mut().for_each(|x| *x *= e);
    }
    let mut u = vec![0f32; dv];
    for (row, &ki) in s.chunks_exact(dv).zip(k) {
        for (acc, &x) in u.iter_mut().zip(row) {
            *acc += x * ki;
        }
    }
    for (ui, &vj) in u.iter_mut().zip(v) {
        *ui = beta * (vj - *ui);
    }
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (x, &uj) in row.iter_mut().zip(&u) {
            *x += ki * uj;
        }
    }
}

/// Runs stored steps `steps` (each [`RecurrentState::step_len`] values of a layer `width` wide)
/// on head `hh`'s state `s` (`head_dim = s.len().isqrt()`), as the forward pass ran them.
pub fn replay_head(s: &mut [f32], steps: &[f32], hh: usize, width: usize) {
    let hd = s.len().isqrt();
    let step = 6 * width + width / hd.max(1);
    let c = hh * hd..(hh + 1) * hd;
    for st in steps.chunks_exact(step) {
        let (k, v) = (&st[3 * width..4 * width], &st[4 * width..5 * width]);
        let (decay, beta) = (&st[5 * width..6 * width], &st[6 * width..]);
        delta_rule_step(s, &k[c.clone()], &v[c.clone()], &decay[c.clone()], beta[hh]);
    }
}

/// How a layer's base moves when the forward pass takes in positions `at..end`
/// ([`RecurrentState::base_move`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BaseMove {
    /// The base after the pass.
    pub new_base: usize,
    /// The position, inside the pass, whose state becomes the new base (the pass captures it).
    pub capture: Option<usize>,
    /// Stored steps (from the old base on) that bring the base to `new_base`, when the new base
    /// lies before the pass: the pass replays them on the base state in place
    /// ([`RecurrentState::heads_mut`]), head by head beside its own steps.
    pub replay: usize,
    /// Whether the pass's first position becomes a checkpoint: then its memory must be handed
    /// to [`RecurrentState::commit`].
    pub checkpoint: bool,
}

/// A KDA layer's recurrent memory after `at` positions. To rewind, it keeps the memory at
/// `base_at` and, for every position since, the inputs of its step
/// ([`RecurrentState::step_len`] values: the pre-convolution q/k/v rows, the normalized k and v,
/// the decay factors, the per-head β), which it replays up to the rewind point; and the memory
/// where stored chunks started before `base_at` ([`add_checkpoint`]).
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
    base_at: usize,
    base_conv: Vec<f32>,
    base_state: Vec<f32>,
    steps: Vec<f32>,
    checkpoints: Vec<Checkpoint>,
}

/// A layer's memory (convolution history, state) after `at` positions.
#[derive(Clone, Debug)]
struct Checkpoint {
    at: usize,
    conv: Vec<f32>,
    state: Vec<f32>,
}

/// Where a layer's replayable span starts once positions up to `end` are stored: it keeps
/// the latest [`KEPT_REWINDS`] positions replayable.
pub(super) fn base_after(base_at: usize, end: usize) -> usize {
    base_at.max(end.saturating_sub(KEPT_REWINDS))
}

/// Whether a chunk starting at `start` becomes a checkpoint once the base is `new_base`: the
/// replayable span has left it behind (the start of the sequence needs none).
fn is_checkpoint(start: usize, new_base: usize) -> bool {
    start > 0 && start < new_base
}

impl RecurrentState {
    fn new(n_head: usize, head_dim: usize, conv_taps: usize) -> RecurrentState {
        let mut s = RecurrentState {
            n_head,
            head_dim,
            conv_taps,
            ..RecurrentState::default()
        };
        s.reset(0);
        s
    }

    fn width(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Values of one position's step inputs: pre-convolution q, k, v, then k, v, the decay
    /// factors (`n_head · head_dim` each) and β (`n_head`).
    pub fn step_len(&self) -> usize {
        6 * self.width() + self.n_head
    }

    /// Empty memory (a fresh sequence, or one about to be restored) said to be at `at`.
    fn reset(&mut self, at: usize) {
        let width = self.width();
        self.conv = vec![0.0; 3 * self.conv_taps * width];
        self.state = vec![0.0; self.n_head * self.head_dim * self.head_dim];
        self.at = at;
        self.rebase();
        self.checkpoints.clear();
    }

    /// The current memory becomes the base, with nothing to replay.
    fn rebase(&mut self) {
        self.base_at = self.at;
        self.base_conv = self.conv.clone();
        self.base_state = self.state.clone();
        self.steps.clear();
    }

    /// Positions the state has taken in.
    pub fn at(&self) -> usize {
        self.at
    }

    /// How the base moves when the forward pass takes in positions `at..end`.
    pub fn base_move(&self, end: usize) -> BaseMove {
        let new_base = base_after(self.base_at, end);
        let moves = new_base > self.base_at;
        let capture = (moves && new_base >= self.at).then_some(new_base);
        BaseMove {
            new_base,
            capture,
            replay: if moves && capture.is_none() {
                new_base - self.base_at
            } else {
                0
            },
            checkpoint: is_checkpoint(self.at, new_base),
        }
    }

    /// What the forward pass works on in place: the state, the base state (for a
    /// [`BaseMove::replay`]) and the stored steps, each head's `head_dim²` values in turn.
    pub fn heads_mut(&mut self) -> (&mut [f32], &mut [f32], &[f32]) {
        (&mut self.state, &mut self.base_state, &self.steps)
    }

    /// Takes in positions `at..end` after the forward pass has run them on the state in place
    /// (and, for a [`BaseMove::replay`], the base's steps on the base state): their step
    /// inputs, the convolution history after them, the memory at [`BaseMove::capture`] when
    /// there is one, and the memory before them when [`BaseMove::checkpoint`] says so.
    pub fn commit(
        &mut self,
        end: usize,
        steps: &[f32],
        conv: Vec<f32>,
        captured: Option<(Vec<f32>, Vec<f32>)>,
        before: Option<(Vec<f32>, Vec<f32>)>,
    ) {
        let p0 = self.at;
        let step = self.step_len();
        debug_assert_eq!(steps.len(), (end - p0) * step);
        let mv = self.base_move(end);
        self.steps.extend_from_slice(steps);
        if mv.new_base > self.base_at {
            match captured {
                Some((b_conv, b_state)) if mv.capture.is_some() => {
                    self.base_conv = b_conv;
                    self.base_state = b_state;
                }
                // The pass advanced the base state; the history is the steps' rows.
                _ => self.base_conv = self.conv_after(mv.new_base),
            }
            self.steps.drain(..(mv.new_base - self.base_at) * step);
            self.base_at = mv.new_base;
        }
        // A chunk start the replayable span has left behind stays a rewind point.
        if mv.checkpoint {
            let (conv, state) = before.expect("the memory before a checkpointed chunk");
            let c = Checkpoint {
                at: p0,
                conv,
                state,
            };
            add_checkpoint(&mut self.checkpoints, c, |c| c.at);
        }
        self.conv = conv;
        self.at = end;
    }

    /// The convolution history after `n` positions, `base_at ≤ n ≤ at + stored steps`: per
    /// projection the last `taps` inputs, the base's history, then the steps' rows.
    fn conv_after(&self, n: usize) -> Vec<f32> {
        let (w, taps, step) = (self.width(), self.conv_taps, self.step_len());
        let steps = &self.steps[..(n - self.base_at) * step];
        let mut conv = Vec::with_capacity(self.base_conv.len());
        for j in 0..3 {
            let mut rows: Vec<&[f32]> = self.base_conv[j * taps * w..(j + 1) * taps * w]
                .chunks_exact(w)
                .collect();
            rows.extend(steps.chunks_exact(step).map(|st| &st[j * w..(j + 1) * w]));
            for r in &rows[rows.len() - taps..] {
                conv.extend_from_slice(r);
            }
        }
        conv
    }

    /// The memory after `n` positions, `base_at ≤ n ≤ at`, from the base and the steps.
    fn replay(&self, n: usize) -> (Vec<f32>, Vec<f32>) {
        let (w, hd, step) = (self.width(), self.head_dim, self.step_len());
        let mut state = self.base_state.clone();
        let steps = &self.steps[..(n - self.base_at) * step];
        for (hh, s) in state.chunks_exact_mut(hd * hd).enumerate() {
            replay_head(s, steps, hh, w);
        }
        (self.conv_after(n), state)
    }

    fn memory_at(&self, n: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        if n == self.at {
            return Some((self.conv.clone(), self.state.clone()));
        }
        if (self.base_at..self.at).contains(&n) {
            return Some(self.replay(n));
        }
        self.checkpoints
            .iter()
            .find(|c| c.at == n)
            .map(|c| (c.conv.clone(), c.state.clone()))
    }

    /// Back to the memory after `n` positions; false when it cannot be had.
    fn rewind(&mut self, n: usize) -> bool {
        if n == 0 {
            self.reset(0);
            return true;
        }
        if n == self.at {
            return true;
        }
        if (self.base_at..self.at).contains(&n) {
            let (conv, state) = self.replay(n);
            self.steps.truncate((n - self.base_at) * self.step_len());
            self.conv = conv;
            self.state = state;
            self.at = n;
            return true;
        }
        let Some(i) = self.checkpoints.iter().position(|c| c.at == n) else {
            return false;
        };
        // Later checkpoints hold positions the rewind forgets.
        let c = self.checkpoints.drain(i..).next().expect("checkpoint i");
        self.conv = c.conv;
        self.state = c.state;
        self.at = n;
        self.rebase();
        true
    }

    fn bytes(&self) -> usize {
        let checkpoints: usize = self
            .checkpoints
            .iter()
            .map(|c| c.conv.len() + c.state.len())
            .sum();
        4 * (self.conv.len()
            + self.state.len()
            + self.base_conv.len()
            + self.base_state.len()
            + self.steps.len()
            + checkpoints)
    }
}

#[derive(Clone, Debug)]
pub(super) enum HybridState {
    Rows,
    Index(PooledKeys),
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
                    HybridState::Index(PooledKeys {
                        width,
                        pool,
                        ..PooledKeys::default()
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

impl KvCache {
    fn is_hybrid(&self) -> bool {
        self.layout.hybrid.is_some()
    }

    /// Whether local layer `l` keeps per-position rows (all but KDA layers).
    pub(super) fn holds_rows(&self, l: usize) -> bool {
        !matches!(self.hybrid.get(l), Some(HybridState::Recurrent(_)))
    }

    /// The indexer memory of `layer`.
    pub fn pooled_keys(&self, layer: usize) -> Result<&PooledKeys> {
        let l = self.local(layer)?;
        match &self.hybrid[l] {
            HybridState::Index(ix) => Ok(ix),
            _ => Err(ModelError::Input(format!(
                "layer {layer} keeps no indexer keys"
            ))),
        }
    }

    pub fn pooled_keys_mut(&mut self, layer: usize) -> Result<&mut PooledKeys> {
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

    /// Whether a rewind to `n` finds the recurrent layers' memory (0 always does).
    pub(super) fn hybrid_can_rewind(&self, n: usize) -> bool {
        !self.is_hybrid()
            || n == 0
            || n >= self.rewind_from.min(self.len)
            || self.checkpoints.contains(&n)
    }

    /// The positions a rewind can reach, for messages.
    pub(super) fn rewind_points(&self) -> String {
        let points: String = self.checkpoints.iter().map(|p| format!("{p}, ")).collect();
        format!("0, {points}{}..={}", self.rewind_from, self.len)
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
        // As each recurrent layer's `rewind`: back at 0 or at a checkpoint, that is the base
        // and later checkpoints are gone.
        if n == 0 || self.checkpoints.contains(&n) {
            self.rewind_from = n;
            self.checkpoints.retain(|&p| p < n);
        }
    }

    /// Before positions `pos0..end` are stored (after the rewind to `pos0`): the rewinds the
    /// recurrent layers will answer, reckoned as each layer's [`RecurrentState::commit`] does (the
    /// latest [`KEPT_REWINDS`] positions replayable, and `pos0` itself as a checkpoint), so that
    /// a cache holding no recurrent layer answers [`KvCache::can_rewind`] as one holding them.
    pub(super) fn reserve_hybrid(&mut self, pos0: usize, end: usize) {
        if !self.is_hybrid() {
            return;
        }
        self.rewind_from = base_after(self.rewind_from, end);
        if is_checkpoint(pos0, self.rewind_from) {
            add_checkpoint(&mut self.checkpoints, pos0, |&p| p);
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
                        "KV export of {n} positions: the recurrent state reaches {} only",
                        self.rewind_points()
                    ))
                })?;
                put(&mut out, &conv);
                put(&mut out, &state);
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
                HybridState::Recurrent(r) => r.reset(n),
            }
        }
        self.rewind_from = n;
        self.checkpoints.clear();
    }

    /// Restores what [`KvCache::export_hybrid`] wrote for `layer` of `n` positions; false for
    /// a layer of rows only (its values are plain rows).
    pub(super) fn import_hybrid(&mut self, layer: usize, n: usize, bytes: &[u8]) -> Result<bool> {
        let l = self.local(layer)?;
        let of = format!("KV import of layer {layer}");
        let mut at = 0usize;
        match &mut self.hybrid[l] {
            HybridState::Rows => return Ok(false),
            HybridState::Index(ix) => {
                let w = ix.width;
                ix.keys = take(bytes, &mut at, n * w, &of)?;
                ix.scores = take(bytes, &mut at, n * w, &of)?;
                ix.pooled = take(bytes, &mut at, (n / ix.pool) * w, &of)?;
            }
            HybridState::Recurrent(r) => {
                r.conv = take(bytes, &mut at, r.conv.len(), &of)?;
                r.state = take(bytes, &mut at, r.state.len(), &of)?;
                r.at = n;
                r.rebase();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with_checkpoints(starts: impl IntoIterator<Item = usize>) -> Vec<usize> {
        let mut list = Vec::new();
        for p in starts {
            add_checkpoint(&mut list, p, |&p| p);
        }
        list
    }

    #[test]
    fn checkpoints_stay_spread_and_keep_the_latest() {
        // Up to the limit every chunk start stays.
        assert_eq!(
            with_checkpoints((1..=8).map(|i| 64 * i)),
            (1..=8).map(|i| 64 * i).collect::<Vec<_>>()
        );
        // Evenly spaced starts past it: each new one drops the oldest of the closest pair,
        // and the list keeps its last entry and stays within the limit.
        let list = with_checkpoints((1..=40).map(|i| 64 * i));
        assert_eq!(list.len(), KEPT_CHECKPOINTS);
        assert_eq!(list.last(), Some(&(64 * 40)));
        let gaps: Vec<usize> = std::iter::once(list[0])
            .chain(list.windows(2).map(|w| w[1] - w[0]))
            .collect();
        assert!(
            gaps.iter().all(|&g| g <= 4 * 64 * 40 / KEPT_CHECKPOINTS),
            "spread over the history: {list:?}"
        );
        // A close pair loses its older member first.
        let list = with_checkpoints([100, 200, 300, 400, 500, 600, 700, 800, 810]);
        assert_eq!(list, [100, 200, 300, 400, 500, 600, 700, 810]);
        // Nearly adjacent starts early on go before the spread ones later.
        let list = with_checkpoints([10, 12, 1000, 2000, 3000, 4000, 5000, 6000, 7000]);
        assert_eq!(list, [12, 1000, 2000, 3000, 4000, 5000, 6000, 7000]);
    }
}
