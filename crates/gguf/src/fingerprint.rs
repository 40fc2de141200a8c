//! Model identity: a SHA-256 over every split's metadata (keys, types, values) and tensor index
//! (names, types, shapes, data offsets), in split order. Two nodes holding byte-identical model
//! headers agree on it whatever their paths, so the cluster handshake can reject a peer serving
//! a different model (or a different quantization or split layout of the same one). Tensor data
//! is not hashed: reading hundreds of GiB at start-up is not affordable.
//!
//! A file written by `moeshard shard` (a pipeline stage's or a tensor-parallel rank's part of a
//! model) names its parent's fingerprint under [`PARENT_FINGERPRINT_KEY`]; a model opened from
//! it presents that identity, so shard files and full files of one model form one cluster.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::metadata::Metadata;
use crate::tensor::TensorInfo;
use crate::value::encode_string;

/// Domain separation, bumped if the hashed encoding ever changes.
const DOMAIN: &[u8] = b"moeshard.gguf.fingerprint.v1\0";
/// Flush the encoding buffer into the hasher beyond this size (a vocabulary is megabytes).
const FLUSH_BYTES: usize = 1 << 16;

/// Metadata key of a shard file's parent fingerprint (64 lower-case hex digits).
pub const PARENT_FINGERPRINT_KEY: &str = "moeshard.shard.parent_fingerprint";

/// A 256-bit model fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Parses the 64 hex digits [`Fingerprint`]'s `Display` writes.
    pub fn from_hex(hex: &str) -> Option<Fingerprint> {
        if hex.len() != 64 || !hex.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (byte, pair) in out.iter_mut().zip(hex.as_bytes().chunks_exact(2)) {
            let pair = std::str::from_utf8(pair).ok()?;
            *byte = u8::from_str_radix(pair, 16).ok()?;
        }
        Some(Fingerprint(out))
    }

    /// The first 8 bytes as a little-endian u64, for logs and compact wire fields.
    pub fn short(&self) -> u64 {
        let mut first = [0u8; 8];
        first.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(first)
    }
}

impl fmt::Display for Fingerprint {
    /// Lower-case hex, 64 characters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// Hashes the metadata and tensor index of each file (split) of `files`, in order.
pub(crate) fn fingerprint_files<'a>(
    files: impl ExactSizeIterator<Item = (&'a Metadata, &'a [TensorInfo])>,
) -> Fingerprint {
    let mut hasher = Sha256::new();
    let mut buf = Vec::with_capacity(FLUSH_BYTES * 2);
    buf.extend_from_slice(DOMAIN);
    buf.extend_from_slice(&(files.len() as u64).to_le_bytes());
    for (metadata, tensors) in files {
        buf.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata.iter() {
            encode_string(key, &mut buf);
            buf.extend_from_slice(&value.value_type().id().to_le_bytes());
            value.encode(&mut buf);
            if buf.len() >= FLUSH_BYTES {
                hasher.update(&buf);
                buf.clear();
            }
        }
        buf.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        for tensor in tensors {
            encode_string(&tensor.name, &mut buf);
            buf.extend_from_slice(&tensor.dtype.id().to_le_bytes());
            buf.extend_from_slice(&(tensor.shape.len() as u32).to_le_bytes());
            for &dim in tensor.shape.iter() {
                buf.extend_from_slice(&dim.to_le_bytes());
            }
            buf.extend_from_slice(&tensor.offset_in_data.to_le_bytes());
            if buf.len() >= FLUSH_BYTES {
                hasher.update(&buf);
                buf.clear();
            }
        }
    }
    hasher.update(&buf);
    Fingerprint(hasher.finalize().into())
}
