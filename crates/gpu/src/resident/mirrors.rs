//! The sequences' KV mirrors in device memory: (re)made and filled from the host caches where
//! stale before a step, and the step's new rows stored into the host caches after it (so the
//! CPU path, rewinds and snapshots see what they always did).

use model::{KvType, SeqInput};

use super::{MIRRORS, Mirror, ResidentModel, State};

/// Converts cache bytes of `t` to f32.
fn cache_floats(t: KvType, bytes: &[u8]) -> Vec<f32> {
    match t {
        KvType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        KvType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

impl ResidentModel {
    /// The caches' element type when every sequence's cache has the model's whole shape (all
    /// layers, its kv heads and head size, no sliding window, compression, index keys or
    /// hybrid layers) and they share one type; `None` otherwise (the step is declined).
    pub(super) fn mirrorable_kv_type(&self, seqs: &[SeqInput]) -> Option<KvType> {
        let (n_layers, nkv, dk) = (self.layers.len(), self.nkv, self.dk);
        let mut kv_type = None;
        for s in seqs {
            let l = s.kv.layout();
            let same_type = kv_type.is_none_or(|t| t == l.kv_type);
            if *l.layers.start() != 0
                || *l.layers.end() != n_layers - 1
                || l.n_kv_head != nkv
                || l.head_dim_k != dk
                || l.head_dim_v != dk
                || l.sliding.is_some()
                || l.compression.is_some()
                || l.index_keys.is_some()
                || l.hybrid.is_some()
                || !same_type
            {
                return None;
            }
            kv_type = Some(l.kv_type);
        }
        kv_type
    }

    /// Each sequence's mirror (its index in `state.mirrors`), made where missing or too short
    /// and refilled with the host's rows of positions `0..pos0` where stale.
    pub(super) fn sync_mirrors(
        &self,
        state: &mut State,
        seqs: &[SeqInput],
        pos0: &[usize],
        kv_type: KvType,
    ) -> model::Result<Vec<usize>> {
        let (n_layers, kd, clock) = (self.layers.len(), self.nkv * self.dk, state.clock);
        let ids: Vec<u64> = seqs.iter().map(|s| s.kv.content_version().0).collect();
        // A sequence's mirror that is too short grows in place (its rows copied on the device,
        // at least doubling): refilling it from the host at every 1024 positions made decode at
        // depth stall for the whole cache's conversion and upload (0.5 s of host time for the
        // steps at depth 4096 of qwen3-30b-a3b on an H100), each longer than the last.
        for m in state.mirrors.iter_mut() {
            let Some(seq) = ids.iter().position(|&id| id == m.version.0) else {
                continue;
            };
            let need = pos0[seq] + seqs[seq].n_tokens;
            if m.capacity < need {
                let n_ctx = seqs[seq].kv.layout().n_ctx;
                let capacity = need
                    .next_multiple_of(1024)
                    .max(2 * m.capacity)
                    .min(n_ctx)
                    .max(need);
                // Without room for both copies, the old one goes and a new one is filled
                // from the host below, as before.
                if self.grow_mirror(m, capacity, n_layers, kd).is_err() {
                    m.capacity = 0;
                }
            }
        }
        state.mirrors.retain(|m| m.capacity > 0);
        // Removals first, so that the indices handed out below stay put. When any sequence
        // needs a new mirror, the least recently used beyond the cap go. With routed experts on
        // the host, decode runs on the CPU path and leaves a mirror stale after its prompt:
        // then every mirror this step does not use goes (a finished prompt's would otherwise
        // hold device memory outside --gpu-mem until seven more came).
        let new = (0..seqs.len())
            .filter(|&seq| !state.mirrors.iter().any(|m| m.version.0 == ids[seq]))
            .count();
        if new > 0 {
            if self.host_experts.is_some() {
                state.mirrors.retain(|m| ids.contains(&m.version.0));
            }
            while state.mirrors.len() + new > MIRRORS.max(seqs.len()) {
                let Some(oldest) = (0..state.mirrors.len())
                    .filter(|&i| !ids.contains(&state.mirrors[i].version.0))
                    .min_by_key(|&i| state.mirrors[i].last_used)
                else {
                    break;
                };
                state.mirrors.remove(oldest);
            }
        }
        let mut mirror_of = Vec::with_capacity(seqs.len());
        for (seq, (s, &p0)) in seqs.iter().zip(pos0).enumerate() {
            let id = ids[seq];
            let need = p0 + s.n_tokens;
            let n_ctx = s.kv.layout().n_ctx;
            let i = match state.mirrors.iter().position(|m| m.version.0 == id) {
                Some(i) => i,
                None => {
                    let capacity = need.next_multiple_of(1024).min(n_ctx).max(need);
                    let len = n_layers * capacity * kd;
                    let alloc = || {
                        self.stream
                            .alloc_zeros::<f32>(len)
                            .map_err(|e| self.error("allocating a KV mirror", e))
                    };
                    state.mirrors.push(Mirror {
                        version: (id, u64::MAX),
                        valid: 0,
                        capacity,
                        k: alloc()?,
                        v: alloc()?,
                        last_used: clock,
                    });
                    state.mirrors.len() - 1
                }
            };
            let m = &mut state.mirrors[i];
            m.last_used = clock;
            if m.version != s.kv.content_version() || m.valid < p0 {
                // The host's rows of positions 0..p0, layer by layer.
                for il in 0..n_layers {
                    let row = kd * kv_type.bytes();
                    let keys = cache_floats(kv_type, &s.kv.keys(il)?[..p0 * row]);
                    let values = cache_floats(kv_type, &s.kv.values(il)?[..p0 * row]);
                    let at = il * m.capacity * kd;
                    for (src, dst) in [(&keys, &mut m.k), (&values, &mut m.v)] {
                        if src.is_empty() {
                            continue;
                        }
                        let mut view = dst.slice_mut(at..at + src.len());
                        self.stream
                            .memcpy_htod(src.as_slice(), &mut view)
                            .map_err(|e| self.error("copying a KV cache in", e))?;
                    }
                }
                m.valid = p0;
            }
            mirror_of.push(i);
        }
        Ok(mirror_of)
    }

    /// Reallocates `m` for `capacity` positions, its valid rows copied layer by layer on the
    /// device (a layer's rows are `capacity` positions apart).
    fn grow_mirror(
        &self,
        m: &mut Mirror,
        capacity: usize,
        n_layers: usize,
        kd: usize,
    ) -> model::Result<()> {
        let len = n_layers * capacity * kd;
        let rows = m.valid.min(m.capacity) * kd;
        for old in [&mut m.k, &mut m.v] {
            let mut grown = self
                .stream
                .alloc_zeros::<f32>(len)
                .map_err(|e| self.error("allocating a KV mirror", e))?;
            if rows > 0 {
                for il in 0..n_layers {
                    let src = old.slice(il * m.capacity * kd..il * m.capacity * kd + rows);
                    let mut dst = grown.slice_mut(il * capacity * kd..il * capacity * kd + rows);
                    self.stream
                        .memcpy_dtod(&src, &mut dst)
                        .map_err(|e| self.error("copying a KV mirror into a larger one", e))?;
                }
            }
            *old = grown;
        }
        m.capacity = capacity;
        Ok(())
    }

    /// Stores a step's new keys and values (`fresh`: per layer, the step's key rows then its
    /// value rows, in the caches' element type) into the sequences' host caches, and marks
    /// their mirrors as holding those versions.
    pub(super) fn store_new_rows(
        &self,
        state: &mut State,
        seqs: &mut [SeqInput],
        pos0: &[usize],
        mirror_of: &[usize],
        fresh: &[u8],
        kv_type: KvType,
    ) -> model::Result<()> {
        let (n_layers, kd) = (self.layers.len(), self.nkv * self.dk);
        let n: usize = seqs.iter().map(|s| s.n_tokens).sum();
        let row_bytes = kd * kv_type.bytes();
        let mut row = 0;
        for ((s, &p0), &mi) in seqs.iter_mut().zip(pos0).zip(mirror_of) {
            let rows = row * row_bytes..(row + s.n_tokens) * row_bytes;
            let layers: Vec<(usize, &[u8], &[u8])> = (0..n_layers)
                .map(|il| {
                    let layer = &fresh[il * 2 * n * row_bytes..][..2 * n * row_bytes];
                    let (keys, values) = layer.split_at(n * row_bytes);
                    (il, &keys[rows.clone()], &values[rows.clone()])
                })
                .collect();
            s.kv.store_encoded_layers(p0, &layers)?;
            row += s.n_tokens;
            let m = &mut state.mirrors[mi];
            m.version = s.kv.content_version();
            m.valid = p0 + s.n_tokens;
        }
        Ok(())
    }
}
