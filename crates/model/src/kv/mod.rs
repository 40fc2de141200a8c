//! The KV cache of one sequence for a range of layers: keys (after RoPE) and values, stored
//! position-major (`[pos][kv_head][dim]`) so that it grows by appending and a snapshot of any
//! prefix is one contiguous copy per layer, independent of how layers are split across nodes.
//! Sliding-window layers keep only their latest positions (see [`KvCache`]).

use std::borrow::Cow;
use std::ops::RangeInclusive;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::{ModelError, Result};

mod compressed;
mod index_keys;
mod pooled_keys;
mod recurrent;
mod recurrent_bytes;

use compressed::{CompLayerState, comp_needed};
pub use compressed::{CompressedLayer, Compression, Pool};
pub use index_keys::IndexKeys;
pub use pooled_keys::PooledKeys;
use recurrent::HybridState;
pub use recurrent::{
    HybridLayers, KEPT_CHECKPOINTS, KEPT_REWINDS, LayerMemory, RecurrentState, delta_rule_step,
    replay_head,
};
pub use recurrent_bytes::{merge_recurrent_shares, split_recurrent_share};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvType {
    F32,
    F16,
}

impl KvType {
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    pub fn ggml_type(self) -> gguf::GgmlType {
        match self {
            KvType::F32 => gguf::GgmlType::F32,
            KvType::F16 => gguf::GgmlType::F16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }

    pub fn from_name(s: &str) -> Option<KvType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(KvType::F32),
            "f16" => Some(KvType::F16),
            _ => None,
        }
    }
}

/// Shape of the cache: which layers, how many kv heads of what size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub kv_type: KvType,
    pub layers: RangeInclusive<usize>,
    pub n_kv_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Maximum positions.
    pub n_ctx: usize,
    /// The model's sliding window, when sliding layers keep only their latest positions;
    /// `None`: every layer keeps every position (no sliding layers, or the full cache was
    /// asked for).
    pub sliding: Option<SlidingLayers>,
    /// DeepSeek V4's compressed rows (see [`Compression`]).
    pub compression: Option<Compression>,
    /// GLM-5's indexer keys (see [`IndexKeys`]).
    pub index_keys: Option<IndexKeys>,
    /// GLM-5.3 Flash's per-layer memories (see [`HybridLayers`]).
    pub hybrid: Option<HybridLayers>,
}

/// A layer's snapshot bytes: keys, and values (or a compressed layer's compressor state).
pub type LayerExport<'a> = (Cow<'a, [u8]>, Cow<'a, [u8]>);

/// Which of a cache's layers slide, and over how many positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlidingLayers {
    /// Positions a sliding layer's token attends to, its own included.
    pub window: usize,
    /// Per layer of the cache (`layers` in order): whether it slides. A cache may hold no
    /// sliding layer and still track where they would start (see [`KvCache::held_from`]), so
    /// that every stage of a pipeline answers rewinds the same way.
    pub layers: Vec<bool>,
}

impl KvLayout {
    /// Every layer keeps every position (llama.cpp's `--swa-full`).
    pub fn full_sliding(mut self) -> KvLayout {
        self.sliding = None;
        self
    }

    /// The most bytes a cache of this layout holds at `n` positions, stored in chunks of up to
    /// `chunk` positions: every position of a full layer, at most
    /// [`sliding_positions_held`] of a sliding one.
    pub fn bytes_at_most(&self, n: usize, chunk: usize) -> usize {
        let row = self.n_kv_head * (self.head_dim_k + self.head_dim_v) * self.kv_type.bytes();
        let n_layers = self.layers.clone().count();
        let (n_sliding, held) = match &self.sliding {
            Some(s) if s.window > 0 => (
                s.layers.iter().filter(|&&b| b).count(),
                n.min(sliding_positions_held(s.window, chunk)),
            ),
            _ => (0, 0),
        };
        ((n_layers - n_sliding) * n + n_sliding * held) * row + n * self.index_bytes_per_position()
    }
}

/// Positions a sliding layer of `window` holds at most while chunks of up to `chunk` positions
/// are stored (see [`KvCache::reserve`]: the oldest position attended to, a window of slack,
/// rounded down to a whole window).
pub fn sliding_positions_held(window: usize, chunk: usize) -> usize {
    (3 * window).saturating_sub(2) + chunk
}

/// Positions are added in chunks so a long prompt does not reallocate per token.
const GROW_POSITIONS: usize = 256;
/// Stores and growths of this many bytes or more run on several threads
/// (`store_encoded_layers`, `reserve`).
const PARALLEL_STORE_BYTES: usize = 4 << 20;

/// Runs `work` on every item, on up to 8 threads when the items move `bytes` of at least
/// PARALLEL_STORE_BYTES between them (whole layers' rows: memory bandwidth one thread does not
/// reach), else on this one.
fn run_split<T: Send>(items: &mut [T], bytes: usize, work: impl Fn(&mut T) + Sync) {
    let threads = if bytes < PARALLEL_STORE_BYTES {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8)
    };
    if threads <= 1 || items.len() <= 1 {
        items.iter_mut().for_each(&work);
        return;
    }
    let per_thread = items.len().div_ceil(threads);
    let work = &work;
    std::thread::scope(|scope| {
        for chunk in items.chunks_mut(per_thread) {
            scope.spawn(move || chunk.iter_mut().for_each(work));
        }
    });
}

/// The KV of one sequence. Full layers hold positions `0..len`; sliding layers hold
/// `first..len` only: before a chunk is stored, positions no token of the chunk attends to
/// are dropped, in blocks of a window (one shift of the kept rows per block, so the kept rows
/// stay contiguous and in order and attention reads them exactly as from a full cache), and
/// a window more than needed is kept so a short rewind (the re-evaluated last token of a
/// repeated prompt, a reformatted end of turn) still finds its positions. A sliding layer
/// thus holds at most 3 windows plus one chunk ([`sliding_positions_held`]).
pub struct KvCache {
    layout: KvLayout,
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
    len: usize,
    /// First position sliding layers hold (0 without a bounded window).
    first: usize,
    /// Per local layer: its compressors' state (DeepSeek V4 compressed layers).
    comp: Vec<Option<CompLayerState>>,
    /// First position whose compressor inputs are kept.
    comp_from: usize,
    /// Per local layer: its indexer keys (GLM-5 full sparse-attention layers; else empty).
    ix: Vec<Vec<f32>>,
    /// Per local layer: GLM-5.3 Flash's indexer keys or recurrent state.
    hybrid: Vec<HybridState>,
    /// GLM-5.3 Flash's recurrent layers rewind to any position from here on (replaying their
    /// kept step inputs), and to the `checkpoints` (ascending; see `recurrent::add_checkpoint`).
    rewind_from: usize,
    checkpoints: Vec<usize>,
    /// Unique per cache, and bumped by every change to rows already stored (see
    /// [`KvCache::content_version`]).
    id: u64,
    generation: u64,
}

/// Ids of caches made so far.
static NEXT_CACHE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl KvCache {
    pub fn new(layout: KvLayout) -> KvCache {
        let n = layout.layers.clone().count();
        let comp = compressed::states(&layout, n);
        let hybrid = recurrent::states(&layout, n);
        KvCache {
            layout,
            k: vec![Vec::new(); n],
            v: vec![Vec::new(); n],
            len: 0,
            first: 0,
            comp,
            comp_from: 0,
            ix: vec![Vec::new(); n],
            hybrid,
            rewind_from: 0,
            checkpoints: Vec::new(),
            id: NEXT_CACHE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            generation: 0,
        }
    }

    /// (this cache's id, its generation): a copy of the rows made at one version holds the
    /// same bytes for every position below the cache's length at any later point of the same
    /// version. Storing, importing or dropping rows starts a new generation; a rewind does
    /// not (the positions it keeps are unchanged), nor does reserving room.
    pub fn content_version(&self) -> (u64, u64) {
        (self.id, self.generation)
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bounded window (a window of 0 would attend to nothing: treated as none).
    fn window(&self) -> Option<usize> {
        self.layout
            .sliding
            .as_ref()
            .map(|s| s.window)
            .filter(|&w| w > 0)
    }

    fn slides(&self, local: usize) -> bool {
        self.layout
            .sliding
            .as_ref()
            .is_some_and(|s| s.layers.get(local).copied().unwrap_or(false))
    }

    /// First position a token at `pos` attends to in a sliding layer.
    fn oldest_attended(&self, pos: usize) -> usize {
        self.window()
            .map_or(0, |w| pos.saturating_sub(w.saturating_sub(1)))
    }

    /// Whether [`KvCache::truncate`]`(n)` keeps what the next token (at position `n`) needs:
    /// false when sliding layers already dropped positions it attends to, or recurrent layers
    /// (GLM-5.3 Flash's KDA) no longer reach their memory after `n`. Depends only on the
    /// positions stored and rewound, not on which layers this cache holds, so every stage of a
    /// pipeline gives the same answer.
    pub fn can_rewind(&self, n: usize) -> bool {
        n == 0
            || n >= self.len
            || (self.oldest_attended(n) >= self.first
                && self
                    .max_ratio()
                    .is_none_or(|m| comp_needed(n, m) >= self.comp_from)
                && self.hybrid_can_rewind(n))
    }

    /// The latest position at most `n` that [`KvCache::truncate`] can rewind to (0 at worst):
    /// where a prefix shared with a new prompt ends between a recurrent cache's rewind points,
    /// the kept prefix stops at the checkpoint before it.
    pub fn rewind_point(&self, n: usize) -> usize {
        std::iter::once(n)
            .chain(self.checkpoints.iter().rev().copied().filter(|&p| p < n))
            .find(|&m| self.can_rewind(m))
            .unwrap_or(0)
    }

    fn max_ratio(&self) -> Option<usize> {
        self.layout
            .compression
            .as_ref()
            .map(|c| c.max_ratio)
            .filter(|&m| m > 0)
    }

    /// Forgets positions `n..` (rewind). Fails, changing nothing, when sliding layers no
    /// longer hold the positions that position `n` attends to or recurrent layers cannot
    /// rebuild their memory at `n` ([`KvCache::can_rewind`]): the caller evaluates the sequence
    /// afresh instead.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if !self.hybrid_can_rewind(n) {
            return Err(ModelError::Input(format!(
                "cannot rewind to {n} positions: the recurrent layers reach {} only",
                self.rewind_points()
            )));
        }
        if !self.can_rewind(n) {
            return Err(ModelError::Input(format!(
                "cannot rewind to {n} positions: the sliding-window layers hold positions {}..{} only (position {n} attends from {})",
                self.first,
                self.len,
                self.oldest_attended(n)
            )));
        }
        self.len = self.len.min(n);
        if self.len == 0 {
            self.first = 0;
            self.comp_from = 0;
        }
        self.truncate_compressed();
        self.truncate_hybrid();
        Ok(())
    }

    /// First position `layer` holds: 0 for a full layer.
    pub fn held_from(&self, layer: usize) -> Result<usize> {
        let l = self.local(layer)?;
        Ok(if self.slides(l) { self.first } else { 0 })
    }

    /// Bytes of keys plus values per position, over all layers held, as a full cache would
    /// store them.
    pub fn bytes_per_position(&self) -> usize {
        let l = &self.layout;
        self.k.len() * l.n_kv_head * (l.head_dim_k + l.head_dim_v) * l.kv_type.bytes()
            + l.index_bytes_per_position()
    }

    fn layer_row_bytes(&self) -> usize {
        self.k_row_bytes() + self.v_row_bytes()
    }

    /// Bytes of the positions held (full layers every filled position, sliding layers the
    /// latest ones).
    pub fn bytes_used(&self) -> usize {
        let n_sliding = (0..self.k.len()).filter(|&l| self.slides(l)).count();
        let n_full = self.k.len() - n_sliding;
        let n_rowless = (0..self.k.len()).filter(|&l| !self.holds_rows(l)).count();
        (n_full * self.len + n_sliding * (self.len - self.first) - n_rowless * self.len)
            * self.layer_row_bytes()
            + self.compressed_bytes()
            + self.index_key_bytes_used()
            + self.hybrid_bytes()
    }

    /// Bytes allocated for keys and values (what [`KvCache::bytes_used`] grows into).
    pub fn bytes_allocated(&self) -> usize {
        self.k.iter().chain(&self.v).map(Vec::len).sum()
    }

    fn k_row_bytes(&self) -> usize {
        self.layout.n_kv_head * self.layout.head_dim_k * self.layout.kv_type.bytes()
    }

    fn v_row_bytes(&self) -> usize {
        self.layout.n_kv_head * self.layout.head_dim_v * self.layout.kv_type.bytes()
    }

    fn local(&self, layer: usize) -> Result<usize> {
        if !self.layout.layers.contains(&layer) {
            return Err(ModelError::Input(format!(
                "layer {layer} is not in this KV cache ({:?})",
                self.layout.layers
            )));
        }
        Ok(layer - self.layout.layers.start())
    }

    /// Makes room for positions `pos0..pos0+n` (which must continue or rewrite the filled prefix)
    /// and marks them filled. Sliding layers first drop the positions no token from `pos0` on
    /// attends to (beyond the kept slack, in whole windows).
    pub fn reserve(&mut self, pos0: usize, n: usize) -> Result<()> {
        if pos0 > self.len {
            return Err(ModelError::Input(format!(
                "position {pos0} leaves a gap after {} cached positions",
                self.len
            )));
        }
        let end = pos0 + n;
        if end > self.layout.n_ctx {
            return Err(ModelError::Input(format!(
                "{end} positions exceed the context size {}",
                self.layout.n_ctx
            )));
        }
        if pos0 < self.len {
            self.truncate(pos0)?;
        }
        if let Some(w) = self.window() {
            // Keep a window of slack before the oldest position attended to, and drop whole
            // windows, so the shift below runs once per window of new positions.
            let keep_from = pos0.saturating_sub(w.saturating_sub(1) + w);
            let new_first = keep_from / w * w;
            if new_first > self.first {
                self.drop_sliding_before(new_first, pos0);
            }
        }
        self.prune_compressed(pos0);
        self.reserve_hybrid(pos0, end);
        let want = end
            .div_ceil(GROW_POSITIONS)
            .saturating_mul(GROW_POSITIONS)
            .min(self.layout.n_ctx);
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        let first = self.first;
        // The layers that keep rows (sliding ones from `first`) and are too short, with the
        // positions each grows to: none in most steps, and then nothing is allocated.
        let growing: Vec<(usize, usize)> = (0..self.k.len())
            .filter_map(|l| {
                let from = if self.slides(l) { first } else { 0 };
                (self.holds_rows(l) && self.k[l].len() < (end - from) * kr)
                    .then_some((l, want - from))
            })
            .collect();
        if !growing.is_empty() {
            // Their two buffers each, borrowed apart so they grow side by side: a fresh
            // session's 512-row prompt zero-fills 48 MB on qwen3-30b-a3b, most of the 7.3 ms
            // such a prompt spent outside its GPU step on the GPU host (1.4 ms on several
            // threads).
            let mut buffers: Vec<Option<(&mut Vec<u8>, &mut Vec<u8>)>> =
                self.k.iter_mut().zip(self.v.iter_mut()).map(Some).collect();
            let mut grow = Vec::with_capacity(2 * growing.len());
            for &(l, rows) in &growing {
                let (k, v) = buffers[l].take().expect("each layer once");
                grow.push((k, rows * kr));
                grow.push((v, rows * vr));
            }
            let bytes: usize = grow
                .iter()
                .map(|(b, len)| len.saturating_sub(b.len()))
                .sum();
            run_split(&mut grow, bytes, |(buffer, len)| buffer.resize(*len, 0));
        }
        self.grow_index_keys(end, want);
        self.len = end;
        Ok(())
    }

    /// Moves the sliding layers' positions `new_first..filled` to the front of their buffers.
    fn drop_sliding_before(&mut self, new_first: usize, filled: usize) {
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        self.generation += 1;
        let (skip, keep) = (new_first - self.first, filled.saturating_sub(new_first));
        for l in 0..self.k.len() {
            if self.slides(l) {
                self.k[l].copy_within(skip * kr..(skip + keep) * kr, 0);
                self.v[l].copy_within(skip * vr..(skip + keep) * vr, 0);
            }
        }
        self.first = new_first;
    }

    /// Index of `pos` in local layer `l`'s rows.
    fn row_index(&self, l: usize, pos: usize) -> usize {
        if self.slides(l) {
            pos - self.first
        } else {
            pos
        }
    }

    /// The local index of `layer`, which must keep rows (not a recurrent state) to be written.
    fn local_with_rows(&self, layer: usize) -> Result<usize> {
        let l = self.local(layer)?;
        if !self.holds_rows(l) {
            return Err(ModelError::Input(format!(
                "layer {layer} keeps a recurrent state, no rows"
            )));
        }
        Ok(l)
    }

    /// Stores the keys and values (all kv heads) of position `pos` of `layer`.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let l = self.local_with_rows(layer)?;
        if pos >= self.len || pos < self.held_from(layer)? {
            return Err(ModelError::Input(format!(
                "position {pos} was not reserved"
            )));
        }
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        let t = self.layout.kv_type;
        let i = self.row_index(l, pos);
        self.generation += 1;
        write_values(t, k, &mut self.k[l][i * kr..(i + 1) * kr]);
        write_values(t, v, &mut self.v[l][i * vr..(i + 1) * vr]);
        Ok(())
    }

    /// Stores the keys and values of positions `pos0..pos0 + n` of `layer` already in the
    /// cache's element type (little-endian, position-major, all kv heads): what a device that
    /// rounds to that type hands back, copied as it is instead of converted row by row.
    pub fn store_encoded_rows(
        &mut self,
        layer: usize,
        pos0: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<()> {
        self.store_encoded_layers(pos0, &[(layer, k, v)])
    }

    /// [`KvCache::store_encoded_rows`] for several distinct layers at once, `(layer, keys,
    /// values)` each: every layer is checked before any is written, and large stores are copied
    /// on several threads (a 512-row step of qwen3-30b-a3b hands back 50 MB of f16 rows, which
    /// one thread copied in 8.6-9.7 ms on the GPU host).
    pub fn store_encoded_layers(
        &mut self,
        pos0: usize,
        layers: &[(usize, &[u8], &[u8])],
    ) -> Result<()> {
        let mut targets = Vec::with_capacity(layers.len());
        for &(layer, k, v) in layers {
            let (l, i) = self.encoded_rows_target(layer, pos0, k, v)?;
            if targets.iter().any(|&(t, _)| t == l) {
                return Err(ModelError::Input(format!("layer {layer} given twice")));
            }
            targets.push((l, i));
        }
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        // Each layer's two destinations, borrowed apart so the copies can run side by side.
        let mut dest: Vec<Option<(&mut Vec<u8>, &mut Vec<u8>)>> =
            self.k.iter_mut().zip(self.v.iter_mut()).map(Some).collect();
        let mut copies = Vec::with_capacity(2 * layers.len());
        for (&(_, k, v), &(l, i)) in layers.iter().zip(&targets) {
            let (dk, dv) = dest[l].take().expect("distinct layers, checked above");
            copies.push((&mut dk[i * kr..i * kr + k.len()], k));
            copies.push((&mut dv[i * vr..i * vr + v.len()], v));
        }
        let bytes: usize = copies.iter().map(|(_, src)| src.len()).sum();
        if bytes == 0 {
            return Ok(());
        }
        self.generation += 1;
        run_split(&mut copies, bytes, |(dst, src)| dst.copy_from_slice(src));
        Ok(())
    }

    /// Where encoded rows `k`, `v` of `layer` from `pos0` go: the local layer and row index,
    /// after checking they are whole rows of reserved positions.
    fn encoded_rows_target(
        &self,
        layer: usize,
        pos0: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(usize, usize)> {
        let l = self.local_with_rows(layer)?;
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        let n = k.len() / kr.max(1);
        if k.len() != n * kr || v.len() != n * vr {
            return Err(ModelError::Input(format!(
                "layer {layer}: {} key and {} value bytes are not whole rows of {kr} and {vr}",
                k.len(),
                v.len()
            )));
        }
        if n == 0 {
            return Ok((l, 0));
        }
        if pos0 + n > self.len || pos0 < self.held_from(layer)? {
            return Err(ModelError::Input(format!(
                "positions {pos0}..{} were not reserved",
                pos0 + n
            )));
        }
        Ok((l, self.row_index(l, pos0)))
    }

    /// Keys of `layer` for the positions it holds (`held_from(layer)..len`), position-major.
    pub fn keys(&self, layer: usize) -> Result<&[u8]> {
        let l = self.local(layer)?;
        if !self.holds_rows(l) {
            return Ok(&[]);
        }
        let n = self.len - self.held_from(layer)?;
        Ok(&self.k[l][..n * self.k_row_bytes()])
    }

    /// Values of `layer` for the positions it holds, as [`KvCache::keys`].
    pub fn values(&self, layer: usize) -> Result<&[u8]> {
        let l = self.local(layer)?;
        if !self.holds_rows(l) {
            return Ok(&[]);
        }
        let n = self.len - self.held_from(layer)?;
        Ok(&self.v[l][..n * self.v_row_bytes()])
    }

    /// Positions a snapshot of `n` positions keeps of local layer `l`: all of them for a full
    /// layer; for a sliding one the latest `window - 1`, what the next token (at `n`) attends
    /// to besides itself. That is exactly what [`KvCache::can_rewind`] keeps for a rewind
    /// point, so a session can be exported after any rewind it accepted; a restored session
    /// in turn cannot rewind (but to 0).
    fn snapshot_positions(&self, l: usize, n: usize) -> usize {
        match self.window() {
            Some(w) if self.slides(l) => n.min(w.saturating_sub(1)),
            _ => n,
        }
    }

    /// Raw bytes (keys, values) of `layer` for a snapshot of positions `0..n`: every position
    /// of a full layer, the latest `window - 1` positions of a sliding one.
    /// A compressed layer's values slot carries its compressor state instead (see
    /// [`KvCache::export_compressed`]), a layer with indexer keys those keys.
    pub fn export(&self, layer: usize, n: usize) -> Result<LayerExport<'_>> {
        let l = self.local(layer)?;
        if let Some(state) = self.export_hybrid(l, n.min(self.len))? {
            let k = if self.holds_rows(l) {
                self.export_rows(layer, n)?.0
            } else {
                &[]
            };
            return Ok((Cow::Borrowed(k), Cow::Owned(state)));
        }
        let (k, v) = self.export_rows(layer, n)?;
        if self.comp[l].is_some() {
            return Ok((
                Cow::Borrowed(k),
                Cow::Owned(self.export_compressed(l, n.min(self.len))?),
            ));
        }
        if self.layout.index_width(l) > 0 {
            return Ok((
                Cow::Borrowed(k),
                Cow::Owned(self.export_index_keys(l, n.min(self.len))),
            ));
        }
        Ok((Cow::Borrowed(k), Cow::Borrowed(v)))
    }

    fn export_rows(&self, layer: usize, n: usize) -> Result<(&[u8], &[u8])> {
        let l = self.local(layer)?;
        let n = n.min(self.len);
        let from = n - self.snapshot_positions(l, n);
        let held = self.held_from(layer)?;
        if from < held {
            return Err(ModelError::Input(format!(
                "KV export of {n} positions for layer {layer}: the sliding window holds positions {held}.. only"
            )));
        }
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        let (i, j) = (from - held, n - held);
        Ok((&self.k[l][i * kr..j * kr], &self.v[l][i * vr..j * vr]))
    }

    /// Makes the cache hold `n` positions to be filled by [`KvCache::import`], one layer at a
    /// time: sliding layers then hold the latest `window - 1` of them.
    pub fn begin_import(&mut self, n: usize) -> Result<()> {
        if n > self.layout.n_ctx {
            return Err(ModelError::Input(format!(
                "{n} restored positions exceed the context size {}",
                self.layout.n_ctx
            )));
        }
        self.generation += 1;
        self.first = self
            .window()
            .map_or(0, |w| n.saturating_sub(w.saturating_sub(1)));
        self.begin_import_compressed(n);
        self.begin_import_index_keys(n);
        self.begin_import_hybrid(n);
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        for l in 0..self.k.len() {
            let rows = match self.holds_rows(l) {
                false => 0,
                true => n - if self.slides(l) { self.first } else { 0 },
            };
            self.k[l].clear();
            self.k[l].resize(rows * kr, 0);
            self.v[l].clear();
            self.v[l].resize(rows * vr, 0);
        }
        self.len = n;
        Ok(())
    }

    /// Restores `layer` of a snapshot of `n` positions (after [`KvCache::begin_import`]`(n)`)
    /// from bytes made by [`KvCache::export`] with the same row shape: the latest positions of
    /// the `n`, all of them or (a sliding layer of a bounded cache) at least `window - 1`.
    pub fn import(&mut self, layer: usize, n: usize, k: &[u8], v: &[u8]) -> Result<()> {
        let l = self.local(layer)?;
        self.generation += 1;
        if self.comp[l].is_some() {
            self.import_rows(layer, n, k, &[])?;
            return self.import_compressed(layer, n, v);
        }
        if self.layout.index_width(l) > 0 {
            self.import_rows(layer, n, k, &[])?;
            return self.import_index_keys(layer, n, v);
        }
        if self.import_hybrid(layer, n, v)? {
            if !self.holds_rows(l) {
                return match k.is_empty() {
                    true => Ok(()),
                    false => Err(ModelError::Input(format!(
                        "KV import of layer {layer}: {} key bytes for a recurrent layer",
                        k.len()
                    ))),
                };
            }
            return self.import_rows(layer, n, k, &[]);
        }
        self.import_rows(layer, n, k, v)
    }

    fn import_rows(&mut self, layer: usize, n: usize, k: &[u8], v: &[u8]) -> Result<()> {
        let l = self.local(layer)?;
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        let given = k.len() / kr.max(1);
        let mismatch = |why: &str| {
            Err(ModelError::Input(format!(
                "KV import of {n} positions for layer {layer}: {} key and {} value bytes {why}",
                k.len(),
                v.len()
            )))
        };
        if n != self.len || !k.len().is_multiple_of(kr.max(1)) || v.len() != given * vr || given > n
        {
            return mismatch("do not match the row size and positions");
        }
        let need = n - self.held_from(layer)?;
        if given < need {
            return mismatch(&format!(
                "hold only the latest {given} positions and this cache keeps {need} of the layer (a snapshot of a bounded sliding-window cache restored into a full one?)"
            ));
        }
        let skip = given - need;
        self.k[l][..need * kr].copy_from_slice(&k[skip * kr..]);
        self.v[l][..need * vr].copy_from_slice(&v[skip * vr..]);
        Ok(())
    }
}

fn write_values(t: KvType, src: &[f32], dst: &mut [u8]) {
    match t {
        KvType::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&s.to_le_bytes());
            }
        }
        KvType::F16 => {
            let mut tmp = vec![f16::ZERO; src.len()];
            tmp.convert_from_f32_slice(src);
            for (d, s) in dst.chunks_exact_mut(2).zip(&tmp) {
                d.copy_from_slice(&s.to_bits().to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests;
