//! The KV cache of one sequence for a range of layers: keys (after RoPE) and values, stored
//! position-major (`[pos][kv_head][dim]`) so that it grows by appending and a snapshot of any
//! prefix is one contiguous copy per layer, independent of how layers are split across nodes.

use std::ops::RangeInclusive;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::{ModelError, Result};

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
}

/// Positions are added in chunks so a long prompt does not reallocate per token.
const GROW_POSITIONS: usize = 256;

pub struct KvCache {
    layout: KvLayout,
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
    len: usize,
}

impl KvCache {
    pub fn new(layout: KvLayout) -> KvCache {
        let n = layout.layers.clone().count();
        KvCache {
            layout,
            k: vec![Vec::new(); n],
            v: vec![Vec::new(); n],
            len: 0,
        }
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

    /// Forgets positions `n..` (rewind).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Bytes of keys plus values per position, over all layers held.
    pub fn bytes_per_position(&self) -> usize {
        let l = &self.layout;
        self.k.len() * l.n_kv_head * (l.head_dim_k + l.head_dim_v) * l.kv_type.bytes()
    }

    /// Bytes in use (filled positions).
    pub fn bytes_used(&self) -> usize {
        self.len * self.bytes_per_position()
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
    /// and marks them filled.
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
        let want = end
            .div_ceil(GROW_POSITIONS)
            .saturating_mul(GROW_POSITIONS)
            .min(self.layout.n_ctx);
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        for (k, v) in self.k.iter_mut().zip(self.v.iter_mut()) {
            if k.len() < end * kr {
                k.resize(want * kr, 0);
                v.resize(want * vr, 0);
            }
        }
        self.len = end;
        Ok(())
    }

    /// Stores the keys and values (all kv heads) of position `pos` of `layer`.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let l = self.local(layer)?;
        if pos >= self.len {
            return Err(ModelError::Input(format!(
                "position {pos} was not reserved"
            )));
        }
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        let t = self.layout.kv_type;
        write_values(t, k, &mut self.k[l][pos * kr..(pos + 1) * kr]);
        write_values(t, v, &mut self.v[l][pos * vr..(pos + 1) * vr]);
        Ok(())
    }

    /// Keys of `layer` for positions `0..len`, position-major.
    pub fn keys(&self, layer: usize) -> Result<&[u8]> {
        let l = self.local(layer)?;
        Ok(&self.k[l][..self.len * self.k_row_bytes()])
    }

    pub fn values(&self, layer: usize) -> Result<&[u8]> {
        let l = self.local(layer)?;
        Ok(&self.v[l][..self.len * self.v_row_bytes()])
    }

    /// Raw bytes of positions `0..n` of `layer` (keys, values), for snapshots.
    pub fn export(&self, layer: usize, n: usize) -> Result<(&[u8], &[u8])> {
        let l = self.local(layer)?;
        let n = n.min(self.len);
        Ok((
            &self.k[l][..n * self.k_row_bytes()],
            &self.v[l][..n * self.v_row_bytes()],
        ))
    }

    /// Restores positions `0..n` of `layer` from raw bytes made by [`KvCache::export`] with the
    /// same layout. Call [`KvCache::reserve`]`(0, n)` first.
    pub fn import(&mut self, layer: usize, n: usize, k: &[u8], v: &[u8]) -> Result<()> {
        let l = self.local(layer)?;
        let (kr, vr) = (self.k_row_bytes(), self.v_row_bytes());
        if n > self.len || k.len() != n * kr || v.len() != n * vr {
            return Err(ModelError::Input(format!(
                "KV import of {n} positions for layer {layer}: sizes do not match"
            )));
        }
        self.k[l][..n * kr].copy_from_slice(k);
        self.v[l][..n * vr].copy_from_slice(v);
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
