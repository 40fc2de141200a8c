//! Shared fixtures: a small valid file exercising every section, byte-patching helpers to
//! corrupt it field by field, and a raw little-endian builder for files the writer refuses to
//! produce (nesting too deep, v1 headers).

use gguf::{Array, GgmlType, GgufError, GgufFile, GgufWriter, Value};

/// The label used as the "path" of in-memory files; every error message must name it.
pub const LABEL: &str = "fixture.gguf";

/// A long first string so that metadata and tensor-info truncations land past the count checks.
pub const DESCRIPTION: &str =
    "a small GGUF fixture used by the gguf crate's corrupt-file and round-trip test suites";

/// The data of tensor `i` (deterministic, distinct per tensor).
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A writer with every value kind and three tensors:
/// `tensor.a` f32 [8, 2] (64 B), `tensor.b` q8_0 [32, 2] (68 B, padded to 96), `tensor.c` f16
/// [16] (32 B, so the file ends exactly at the last tensor byte and every truncation fails).
pub fn sample_writer() -> GgufWriter<'static> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "test").unwrap();
    w.add_metadata("general.description", DESCRIPTION).unwrap();
    w.add_metadata("tokens", vec!["a", "bb", "ccc"]).unwrap();
    w.add_metadata("scores", vec![0.5f32, -1.0, 2.25]).unwrap();
    w.add_metadata(
        "nested",
        vec![Array::from(vec![1u8, 2]), Array::from(vec!["x"])],
    )
    .unwrap();
    w.add_metadata("test.dup_a", 1u8).unwrap();
    w.add_metadata("test.dup_b", 2u8).unwrap();
    w.add_metadata("test.flag", true).unwrap();
    w.add_metadata("general.alignment", 32u32).unwrap();
    w.add_metadata("test.block_count", 2u32).unwrap();
    w.add_tensor("tensor.a", GgmlType::F32, &[8, 2], pattern(64, 1))
        .unwrap();
    w.add_tensor("tensor.b", GgmlType::Q8_0, &[32, 2], pattern(68, 2))
        .unwrap();
    w.add_tensor("tensor.c", GgmlType::F16, &[16], pattern(32, 3))
        .unwrap();
    w
}

pub fn sample_bytes() -> Vec<u8> {
    let mut out = Vec::new();
    sample_writer().write_to(&mut out).unwrap();
    out
}

pub fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(LABEL, bytes)
}

/// Offset of the first occurrence of `needle`.
pub fn find(bytes: &[u8], needle: &[u8]) -> usize {
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{:?} not in fixture", String::from_utf8_lossy(needle)))
}

/// Offset just past the GGUF string `s` (its u64 length prefix + bytes) where it occurs.
pub fn after_string(bytes: &[u8], s: &str) -> usize {
    let mut encoded = (s.len() as u64).to_le_bytes().to_vec();
    encoded.extend_from_slice(s.as_bytes());
    find(bytes, &encoded) + encoded.len()
}

/// Offset of the u64 length prefix of the GGUF string `s`.
pub fn string_start(bytes: &[u8], s: &str) -> usize {
    after_string(bytes, s) - 8 - s.len()
}

pub fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Field offsets of a tensor info, found by its name.
pub struct TensorInfoAt {
    pub name: usize,
    pub n_dims: usize,
    pub dims: usize,
    pub dtype: usize,
    pub offset: usize,
}

pub fn tensor_info_at(bytes: &[u8], name: &str, n_dims: usize) -> TensorInfoAt {
    let n_dims_at = after_string(bytes, name);
    let dims = n_dims_at + 4;
    let dtype = dims + 8 * n_dims;
    TensorInfoAt {
        name: string_start(bytes, name),
        n_dims: n_dims_at,
        dims,
        dtype,
        offset: dtype + 4,
    }
}

/// Asserts that `err`'s message mentions every one of `parts`.
#[track_caller]
pub fn assert_mentions(err: &GgufError, parts: &[&str]) {
    let message = err.to_string();
    for part in parts {
        assert!(
            message.contains(part),
            "message {message:?} should mention {part:?}"
        );
    }
}

/// A little-endian byte builder for hand-made (possibly invalid) files.
#[derive(Default)]
pub struct Raw(pub Vec<u8>);

impl Raw {
    pub fn header(version: u32, tensors: u64, kvs: u64) -> Self {
        let mut raw = Raw::default();
        raw.0.extend_from_slice(b"GGUF");
        raw.u32(version).u64(tensors).u64(kvs);
        raw
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn string(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    pub fn value(&mut self, v: &Value) -> &mut Self {
        v.encode(&mut self.0);
        self
    }
}
