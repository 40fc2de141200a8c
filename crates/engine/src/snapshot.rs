//! Session snapshots that do not depend on the split: tokens, every layer's KV (position-major,
//! all kv heads) and the last logits. Saved by one topology, loadable by any other.

use std::io::{Read, Write};
use std::path::Path;

use model::{KvType, Model};

use crate::error::{EngineError, Result};

const MAGIC: &[u8; 8] = b"MSSNAP01";

/// Keys and values of consecutive layers, each position-major.
pub type LayersKv = Vec<(Vec<u8>, Vec<u8>)>;

#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Fingerprint of the model the state belongs to.
    pub fingerprint: String,
    pub tokens: Vec<u32>,
    pub kv_type: KvType,
    pub n_kv_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Keys and values of positions `0..tokens.len()` for every layer, in layer order.
    pub layers: LayersKv,
    pub last_logits: Vec<f32>,
}

/// What a snapshot must match to be restored by an executor: the model, and the KV layout of
/// the whole (unsplit) model. Every executor checks restores against this one description.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotLayout {
    pub fingerprint: String,
    pub kv_type: KvType,
    pub n_layer: usize,
    pub n_kv_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Positions a session may hold.
    pub n_ctx: usize,
}

impl SnapshotLayout {
    /// The layout of `model` (all layers, all kv heads, whatever this process's share is).
    pub fn of(model: &Model, kv_type: KvType, n_ctx: usize) -> SnapshotLayout {
        SnapshotLayout {
            fingerprint: model.files().fingerprint().to_string(),
            kv_type,
            n_layer: model.hp.n_layer,
            n_kv_head: model.hp.n_head_kv,
            head_dim_k: model.hp.head_dim_k,
            head_dim_v: model.hp.head_dim_v,
            n_ctx,
        }
    }

    /// Bytes per position of one layer's keys and of its values (all kv heads).
    pub fn row_bytes(&self) -> (usize, usize) {
        let e = self.kv_type.bytes();
        (
            self.n_kv_head * self.head_dim_k * e,
            self.n_kv_head * self.head_dim_v * e,
        )
    }

    /// A snapshot of `tokens` with `layers` (every layer, all kv heads, position-major).
    pub fn assemble(&self, tokens: Vec<u32>, layers: LayersKv) -> Snapshot {
        Snapshot {
            fingerprint: self.fingerprint.clone(),
            tokens,
            kv_type: self.kv_type,
            n_kv_head: self.n_kv_head,
            head_dim_k: self.head_dim_k,
            head_dim_v: self.head_dim_v,
            layers,
            last_logits: Vec::new(),
        }
    }
}

fn w_u64(w: &mut impl Write, v: u64) -> std::io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

fn r_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn r_bytes(r: &mut impl Read, limit: u64) -> Result<Vec<u8>> {
    let n = r_u64(r).map_err(|e| EngineError::Snapshot(format!("truncated: {e}")))?;
    if n > limit {
        return Err(EngineError::Snapshot(format!(
            "a field of {n} bytes exceeds the remaining {limit}"
        )));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)
        .map_err(|e| EngineError::Snapshot(format!("truncated: {e}")))?;
    Ok(v)
}

impl Snapshot {
    /// Refuses a snapshot of another model.
    pub fn check_model(&self, fingerprint: &str) -> Result<(), EngineError> {
        if self.fingerprint == fingerprint {
            Ok(())
        } else {
            Err(EngineError::Snapshot(format!(
                "snapshot is of model {}, this is {fingerprint}",
                self.fingerprint
            )))
        }
    }

    /// Refuses a snapshot that this layout cannot hold: another model, another KV type or
    /// shape, a different layer count, more positions than the context, or any layer whose
    /// bytes do not cover exactly its positions (a corrupt or truncated file). After this
    /// check, slicing any layer by position and head cannot go out of bounds.
    pub fn check_layout(&self, want: &SnapshotLayout) -> Result<(), EngineError> {
        self.check_model(&want.fingerprint)?;
        let bad = |what: String| Err(EngineError::Snapshot(what));
        if (
            self.kv_type,
            self.n_kv_head,
            self.head_dim_k,
            self.head_dim_v,
        ) != (
            want.kv_type,
            want.n_kv_head,
            want.head_dim_k,
            want.head_dim_v,
        ) {
            return bad(format!(
                "KV layout {} × {} kv heads × {}/{} dims differs from this executor's {} × {} × {}/{}",
                self.kv_type.name(),
                self.n_kv_head,
                self.head_dim_k,
                self.head_dim_v,
                want.kv_type.name(),
                want.n_kv_head,
                want.head_dim_k,
                want.head_dim_v
            ));
        }
        if self.layers.len() != want.n_layer {
            return bad(format!(
                "{} layers of KV for a model of {}",
                self.layers.len(),
                want.n_layer
            ));
        }
        let n = self.tokens.len();
        if n > want.n_ctx {
            return Err(EngineError::ContextFull {
                needed: n,
                n_ctx: want.n_ctx,
            });
        }
        let (kr, vr) = want.row_bytes();
        for (il, (k, v)) in self.layers.iter().enumerate() {
            if k.len() != n * kr || v.len() != n * vr {
                return bad(format!(
                    "layer {il} holds {} key and {} value bytes; {n} positions need {} and {}",
                    k.len(),
                    v.len(),
                    n * kr,
                    n * vr
                ));
            }
        }
        Ok(())
    }

    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(MAGIC)?;
        let fp = self.fingerprint.as_bytes();
        w_u64(w, fp.len() as u64)?;
        w.write_all(fp)?;
        w_u64(w, self.tokens.len() as u64 * 4)?;
        for t in &self.tokens {
            w.write_all(&t.to_le_bytes())?;
        }
        w_u64(
            w,
            match self.kv_type {
                KvType::F32 => 0,
                KvType::F16 => 1,
            },
        )?;
        w_u64(w, self.n_kv_head as u64)?;
        w_u64(w, self.head_dim_k as u64)?;
        w_u64(w, self.head_dim_v as u64)?;
        w_u64(w, self.layers.len() as u64)?;
        for (k, v) in &self.layers {
            w_u64(w, k.len() as u64)?;
            w.write_all(k)?;
            w_u64(w, v.len() as u64)?;
            w.write_all(v)?;
        }
        w_u64(w, self.last_logits.len() as u64 * 4)?;
        for l in &self.last_logits {
            w.write_all(&l.to_le_bytes())?;
        }
        Ok(())
    }

    /// Reads a snapshot; `total` bounds every length field (the file size).
    pub fn read_from(r: &mut impl Read, total: u64) -> Result<Snapshot> {
        let io = |e: std::io::Error| EngineError::Snapshot(format!("truncated: {e}"));
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic).map_err(io)?;
        if &magic != MAGIC {
            return Err(EngineError::Snapshot(
                "not a moeshard snapshot (bad magic)".into(),
            ));
        }
        let fingerprint = String::from_utf8(r_bytes(r, total)?)
            .map_err(|_| EngineError::Snapshot("fingerprint is not UTF-8".into()))?;
        let tokens = r_bytes(r, total)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let kv_type = match r_u64(r).map_err(io)? {
            0 => KvType::F32,
            1 => KvType::F16,
            other => return Err(EngineError::Snapshot(format!("unknown KV type {other}"))),
        };
        let n_kv_head = r_u64(r).map_err(io)? as usize;
        let head_dim_k = r_u64(r).map_err(io)? as usize;
        let head_dim_v = r_u64(r).map_err(io)? as usize;
        let n_layers = r_u64(r).map_err(io)?;
        if n_layers > 100_000 {
            return Err(EngineError::Snapshot(format!(
                "{n_layers} layers is not plausible"
            )));
        }
        let mut layers = Vec::with_capacity(n_layers as usize);
        for _ in 0..n_layers {
            let k = r_bytes(r, total)?;
            let v = r_bytes(r, total)?;
            layers.push((k, v));
        }
        let last_logits = r_bytes(r, total)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Snapshot {
            fingerprint,
            tokens,
            kv_type,
            n_kv_head,
            head_dim_k,
            head_dim_v,
            layers,
            last_logits,
        })
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |source| EngineError::Io {
            path: path.display().to_string(),
            source,
        };
        let tmp = path.with_extension("tmp");
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(io)?);
        self.write_to(&mut f).map_err(io)?;
        f.flush().map_err(io)?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io)
    }

    pub fn load(path: &Path) -> Result<Snapshot> {
        let io = |source| EngineError::Io {
            path: path.display().to_string(),
            source,
        };
        let f = std::fs::File::open(path).map_err(io)?;
        let total = f.metadata().map_err(io)?.len();
        Snapshot::read_from(&mut std::io::BufReader::new(f), total)
    }

    /// Bytes of one layer's keys + values per position.
    pub fn bytes_per_position_per_layer(&self) -> usize {
        self.n_kv_head
            * (self.head_dim_k + self.head_dim_v)
            * match self.kv_type {
                KvType::F32 => 4,
                KvType::F16 => 2,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption_are_detected() {
        let s = Snapshot {
            fingerprint: "abc".into(),
            tokens: vec![1, 2, 3],
            kv_type: KvType::F16,
            n_kv_head: 2,
            head_dim_k: 4,
            head_dim_v: 4,
            layers: vec![(vec![1; 48], vec![2; 48]), (vec![3; 48], vec![4; 48])],
            last_logits: vec![0.5, -1.0],
        };
        let mut buf = Vec::new();
        s.write_to(&mut buf).unwrap();
        let back = Snapshot::read_from(&mut buf.as_slice(), buf.len() as u64).unwrap();
        assert_eq!(back, s);
        for cut in [0, 7, 12, buf.len() - 1] {
            assert!(
                Snapshot::read_from(&mut &buf[..cut], cut as u64).is_err(),
                "cut at {cut}"
            );
        }
        let mut bad = buf.clone();
        bad[0] = b'X';
        assert!(Snapshot::read_from(&mut bad.as_slice(), bad.len() as u64).is_err());
    }

    #[test]
    fn layout_check_refuses_what_a_restore_could_not_hold() {
        let want = SnapshotLayout {
            fingerprint: "abc".into(),
            kv_type: KvType::F16,
            n_layer: 2,
            n_kv_head: 2,
            head_dim_k: 4,
            head_dim_v: 4,
            n_ctx: 8,
        };
        // 3 positions × 2 heads × 4 dims × 2 bytes = 48 bytes per layer.
        let good = want.assemble(vec![1, 2, 3], vec![(vec![0; 48], vec![0; 48]); 2]);
        good.check_layout(&want).unwrap();
        let mut cases: Vec<(&str, Snapshot)> = Vec::new();
        let mut s = good.clone();
        s.fingerprint = "other".into();
        cases.push(("model", s));
        let mut s = good.clone();
        s.kv_type = KvType::F32;
        cases.push(("kv type", s));
        let mut s = good.clone();
        s.n_kv_head = 1;
        cases.push(("heads", s));
        let mut s = good.clone();
        s.layers.pop();
        cases.push(("layer count", s));
        let mut s = good.clone();
        s.layers[1].1.truncate(47);
        cases.push(("short values", s));
        let mut s = good.clone();
        s.tokens.push(4);
        cases.push(("tokens without KV", s));
        let mut s = want.assemble(vec![0; 9], vec![(vec![0; 144], vec![0; 144]); 2]);
        s.fingerprint = "abc".into();
        cases.push(("past the context", s));
        for (what, s) in cases {
            assert!(s.check_layout(&want).is_err(), "{what} must be refused");
        }
    }
}
