//! Session snapshots that do not depend on the split: tokens, every layer's KV (position-major,
//! all kv heads) and the last logits. Saved by one topology, loadable by any other.

use std::io::{Read, Write};
use std::path::Path;

use model::KvType;

use crate::error::{EngineError, Result};

const MAGIC: &[u8; 8] = b"MSSNAP01";

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
    pub layers: Vec<(Vec<u8>, Vec<u8>)>,
    pub last_logits: Vec<f32>,
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
}
