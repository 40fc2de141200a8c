//! Session snapshots that do not depend on the split: tokens, every layer's KV (position-major,
//! all kv heads) and the last logits. Saved by one topology, loadable by any other. A full
//! layer holds every position; a sliding-window layer of a bounded cache only the latest
//! `window - 1` (what the next token attends to besides itself; a restored session cannot
//! rewind) — its first position is implied by its length.
//!
//! File format (version 3, magic `MSSNAP03`): the magic, length-prefixed little-endian fields,
//! then an XXH3-128 checksum of everything before it ([`crate::file`]), checked on every read.
//! Files are written atomically with mode 0600. Version 3 has the fields of version 2
//! (`MSSNAP02`), whose layers all hold every position: version-2 files are still read (their
//! sliding layers restore by keeping the latest positions), while a version-2 reader refuses a
//! version-3 file by its magic instead of misreading short layers. A version-1 file
//! (`MSSNAP01`, no checksum) is refused as an old format.

use std::io::{Read, Write};
use std::path::Path;

use model::{KvType, Model};

use crate::error::{EngineError, Result};
use crate::file::{self, ChecksumReader, ChecksumWriter};

/// Version 3: the fields of version 2, sliding-window layers holding their latest positions.
const MAGIC: &[u8; 8] = b"MSSNAP03";
/// Version 2: the fields of version 1 (every layer every position), then a checksum.
const MAGIC_V2: &[u8; 8] = b"MSSNAP02";
const OLD_MAGIC: &[u8; 8] = b"MSSNAP01";

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
    /// Keys and values for every layer, in layer order: positions `0..tokens.len()`, or the
    /// latest `min(tokens.len(), window - 1)` of them for a sliding-window layer.
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
    /// Per layer: the sliding window, for a layer that attends to one (whose snapshot may hold
    /// only the latest `window - 1` positions); `None` for a full layer.
    pub windows: Vec<Option<usize>>,
    /// Per layer: its value bytes are not value rows but the layer's own state — a
    /// compressor's (DeepSeek V4), the indexer keys (GLM-5, GLM-5.3 Flash) or a recurrent
    /// state (GLM-5.3 Flash) — which the KV cache checks when it imports them.
    pub values_own_format: Vec<bool>,
    /// Per layer: it keeps no rows, only a recurrent state (GLM-5.3 Flash's KDA layers): its
    /// key bytes are empty.
    pub recurrent: Vec<bool>,
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
            windows: (0..model.hp.n_layer)
                .map(|il| model.hp.window(il))
                .collect(),
            values_own_format: (0..model.hp.n_layer)
                .map(|il| {
                    model.hp.dsv4.as_ref().is_some_and(|p| p.ratio(il) > 0)
                        || model.hp.dsa.as_ref().is_some_and(|p| p.is_full(il))
                        || model.hp.glm5next.as_ref().is_some_and(|p| {
                            p.kind(il) != model::hparams::Glm5LayerKind::Mla { indexer: false }
                        })
                })
                .collect(),
            recurrent: (0..model.hp.n_layer)
                .map(|il| {
                    model
                        .hp
                        .glm5next
                        .as_ref()
                        .is_some_and(|p| p.kind(il) == model::hparams::Glm5LayerKind::Kda)
                })
                .collect(),
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

fn r_u64(r: &mut impl Read) -> Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b).map_err(truncated)?;
    Ok(u64::from_le_bytes(b))
}

fn truncated(e: std::io::Error) -> EngineError {
    EngineError::Snapshot(format!("truncated: {e}"))
}

/// A length-prefixed field; its length may not exceed what is left of the checksummed part.
fn r_bytes<R: Read>(r: &mut ChecksumReader<R>) -> Result<Vec<u8>> {
    let n = r_u64(r)?;
    if n > r.left() {
        return Err(EngineError::Snapshot(format!(
            "a field of {n} bytes exceeds the remaining {}",
            r.left()
        )));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v).map_err(truncated)?;
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
            let held = k.len() / kr.max(1);
            let window = want.windows.get(il).copied().flatten();
            let tail = window.map(|w| n.min(w.saturating_sub(1)));
            let rowless = want.recurrent.get(il) == Some(&true) && k.is_empty();
            let positions_ok = held == n || tail == Some(held) || rowless;
            let values_ok = v.len() == held * vr || want.values_own_format.get(il) == Some(&true);
            if !positions_ok || k.len() != held * kr || !values_ok {
                let sliding = tail.map_or(String::new(), |t| {
                    format!(
                        " (or, a sliding layer, {} and {} for its latest {t})",
                        t * kr,
                        t * vr
                    )
                });
                return bad(format!(
                    "layer {il} holds {} key and {} value bytes; {n} positions need {} and {}{sliding}",
                    k.len(),
                    v.len(),
                    n * kr,
                    n * vr
                ));
            }
        }
        Ok(())
    }

    /// Writes the snapshot: magic, fields, then the checksum of everything before it.
    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        let mut w = ChecksumWriter::new(w);
        w.write_all(MAGIC)?;
        let fp = self.fingerprint.as_bytes();
        w_u64(&mut w, fp.len() as u64)?;
        w.write_all(fp)?;
        w_u64(&mut w, self.tokens.len() as u64 * 4)?;
        let tokens: Vec<u8> = self.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        w.write_all(&tokens)?;
        w_u64(
            &mut w,
            match self.kv_type {
                KvType::F32 => 0,
                KvType::F16 => 1,
            },
        )?;
        w_u64(&mut w, self.n_kv_head as u64)?;
        w_u64(&mut w, self.head_dim_k as u64)?;
        w_u64(&mut w, self.head_dim_v as u64)?;
        w_u64(&mut w, self.layers.len() as u64)?;
        for (k, v) in &self.layers {
            w_u64(&mut w, k.len() as u64)?;
            w.write_all(k)?;
            w_u64(&mut w, v.len() as u64)?;
            w.write_all(v)?;
        }
        w_u64(&mut w, self.last_logits.len() as u64 * 4)?;
        let logits: Vec<u8> = self
            .last_logits
            .iter()
            .flat_map(|l| l.to_le_bytes())
            .collect();
        w.write_all(&logits)?;
        w.finish()?;
        Ok(())
    }

    /// Reads a snapshot of `total` bytes (the file size) and checks its checksum. A corrupt
    /// stream is an error whichever byte changed: when a damaged field makes the fields
    /// unreadable, the checksum is still compared and its mismatch reported.
    pub fn read_from(r: &mut impl Read, total: u64) -> Result<Snapshot> {
        let mut r = ChecksumReader::new(r, total).map_err(truncated)?;
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic).map_err(truncated)?;
        if &magic == OLD_MAGIC {
            return Err(EngineError::Snapshot(format!(
                "old snapshot format ({}, without a checksum); this version reads {}: save the session again",
                String::from_utf8_lossy(OLD_MAGIC),
                String::from_utf8_lossy(MAGIC)
            )));
        }
        if &magic != MAGIC && &magic != MAGIC_V2 {
            return Err(EngineError::Snapshot(
                "not a moeshard snapshot (bad magic)".into(),
            ));
        }
        let parsed = Snapshot::read_fields(&mut r).and_then(|s| match r.left() {
            0 => Ok(s),
            n => Err(EngineError::Snapshot(format!(
                "{n} bytes after the last field"
            ))),
        });
        match r.verify() {
            Ok(Ok(())) => parsed,
            Ok(Err(mismatch)) => Err(EngineError::Snapshot(mismatch.to_string())),
            Err(e) => parsed.and(Err(truncated(e))),
        }
    }

    /// The fields after the magic.
    fn read_fields<R: Read>(r: &mut ChecksumReader<R>) -> Result<Snapshot> {
        let fingerprint = String::from_utf8(r_bytes(r)?)
            .map_err(|_| EngineError::Snapshot("fingerprint is not UTF-8".into()))?;
        let tokens = r_bytes(r)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let kv_type = match r_u64(r)? {
            0 => KvType::F32,
            1 => KvType::F16,
            other => return Err(EngineError::Snapshot(format!("unknown KV type {other}"))),
        };
        let n_kv_head = r_u64(r)? as usize;
        let head_dim_k = r_u64(r)? as usize;
        let head_dim_v = r_u64(r)? as usize;
        let n_layers = r_u64(r)?;
        // Each layer has two length fields at least.
        if n_layers > 100_000 || n_layers.saturating_mul(16) > r.left() {
            return Err(EngineError::Snapshot(format!(
                "{n_layers} layers is not plausible"
            )));
        }
        let mut layers = Vec::with_capacity(n_layers as usize);
        for _ in 0..n_layers {
            let k = r_bytes(r)?;
            let v = r_bytes(r)?;
            layers.push((k, v));
        }
        let last_logits = r_bytes(r)?
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

    /// Writes the snapshot to `path` atomically (see [`file::write_atomic`]: mode 0600, a
    /// temporary file fsynced and renamed into place).
    pub fn save(&self, path: &Path) -> Result<()> {
        file::write_atomic(path, |w| self.write_to(w)).map_err(|source| EngineError::Io {
            path: path.display().to_string(),
            source,
        })
    }

    /// Reads and checks a snapshot file; errors name the file.
    pub fn load(path: &Path) -> Result<Snapshot> {
        let io = |source| EngineError::Io {
            path: path.display().to_string(),
            source,
        };
        let f = std::fs::File::open(path).map_err(io)?;
        let total = f.metadata().map_err(io)?.len();
        Snapshot::read_from(&mut std::io::BufReader::with_capacity(1 << 20, f), total).map_err(
            |e| match e {
                EngineError::Snapshot(m) => {
                    EngineError::Snapshot(format!("{}: {m}", path.display()))
                }
                other => other,
            },
        )
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

    fn sample() -> Snapshot {
        Snapshot {
            fingerprint: "abc".into(),
            tokens: vec![1, 2, 3],
            kv_type: KvType::F16,
            n_kv_head: 2,
            head_dim_k: 4,
            head_dim_v: 4,
            layers: vec![(vec![1; 48], vec![2; 48]), (vec![3; 48], vec![4; 48])],
            last_logits: vec![0.5, -1.0],
        }
    }

    #[test]
    fn round_trip_and_corruption_are_detected() {
        let s = sample();
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
        // Any other byte changed — a length, the fingerprint, the KV, the logits, the checksum
        // itself — is a checksum mismatch, never a panic or a different snapshot.
        for i in 8..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x04;
            let err = Snapshot::read_from(&mut bad.as_slice(), bad.len() as u64)
                .expect_err("a changed byte is refused");
            assert!(
                err.to_string().contains("checksum mismatch"),
                "byte {i}: {err}"
            );
        }
    }

    #[test]
    fn a_version_2_snapshot_is_still_read() {
        let mut buf = Vec::new();
        sample().write_to(&mut buf).unwrap();
        assert_eq!(&buf[..8], MAGIC);
        // Same fields, same checksum (the magic is checksummed too: recompute it).
        let mut v2 = Vec::new();
        let mut w = ChecksumWriter::new(&mut v2);
        w.write_all(MAGIC_V2).unwrap();
        w.write_all(&buf[8..buf.len() - file::CHECKSUM_LEN])
            .unwrap();
        w.finish().unwrap();
        let back = Snapshot::read_from(&mut v2.as_slice(), v2.len() as u64).unwrap();
        assert_eq!(back, sample());
    }

    #[test]
    fn an_old_snapshot_is_named_as_such() {
        let mut buf = Vec::new();
        sample().write_to(&mut buf).unwrap();
        buf[..8].copy_from_slice(OLD_MAGIC);
        let err = Snapshot::read_from(&mut buf.as_slice(), buf.len() as u64).unwrap_err();
        assert!(err.to_string().contains("old snapshot format"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn files_are_private_checked_and_named_in_errors() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.snap");
        let mut s = sample();
        s.layers = vec![(vec![9; 1 << 16], vec![8; 1 << 16]); 4];
        s.save(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
        assert_eq!(Snapshot::load(&path).unwrap(), s);
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = Snapshot::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("checksum mismatch") && err.contains(&path.display().to_string()),
            "{err}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file is left"
        );
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
            values_own_format: vec![false; 2],
            recurrent: vec![false; 2],
            windows: vec![None, Some(3)],
        };
        // 3 positions × 2 heads × 4 dims × 2 bytes = 48 bytes per layer.
        let good = want.assemble(vec![1, 2, 3], vec![(vec![0; 48], vec![0; 48]); 2]);
        good.check_layout(&want).unwrap();
        // The sliding layer (window 3) may hold its latest 2 positions only.
        let mut windowed = good.clone();
        windowed.layers[1] = (vec![0; 32], vec![0; 32]);
        windowed.check_layout(&want).unwrap();
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
        let mut s = good.clone();
        s.layers[0] = (vec![0; 32], vec![0; 32]);
        cases.push(("a full layer holding the window only", s));
        let mut s = good.clone();
        s.layers[1] = (vec![0; 16], vec![0; 16]);
        cases.push(("a sliding layer holding less than its window", s));
        let mut s = good.clone();
        s.layers[1] = (vec![0; 32], vec![0; 16]);
        cases.push(("a sliding layer's keys and values disagree", s));
        let mut s = want.assemble(vec![0; 9], vec![(vec![0; 144], vec![0; 144]); 2]);
        s.fingerprint = "abc".into();
        cases.push(("past the context", s));
        for (what, s) in cases {
            assert!(s.check_layout(&want).is_err(), "{what} must be refused");
        }
    }
}
