//! Every way reading, validating, querying or writing a GGUF file can fail. File errors name the
//! file, the byte offset and the field being read, so a corrupt download can be diagnosed from
//! the message alone; accessor errors name the metadata key.

use std::io;
use std::path::{Path, PathBuf};

use crate::types::GgmlType;

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    // ---- the file as a whole -------------------------------------------------------------
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: io::Error },

    #[error(
        "{}: not a GGUF file: magic at offset 0 is \"{}\", expected \"GGUF\"",
        path.display(), found.escape_ascii()
    )]
    BadMagic { path: PathBuf, found: Vec<u8> },

    #[error(
        "{}: unsupported GGUF version {version} at offset 4 (supported: 2 and 3; \
         a huge value means a big-endian file)",
        path.display()
    )]
    UnsupportedVersion { path: PathBuf, version: u32 },

    // ---- the header, metadata and tensor-info sections -------------------------------------
    #[error(
        "{}: truncated at offset {offset} while reading {field}: needs {needed} bytes, {available} left",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        offset: u64,
        field: String,
        needed: u64,
        available: u64,
    },

    #[error(
        "{}: string length {len} at offset {offset} ({field}) exceeds the {remaining} bytes left in the file",
        path.display()
    )]
    StringTooLong {
        path: PathBuf,
        offset: u64,
        field: String,
        len: u64,
        remaining: u64,
    },

    #[error(
        "{}: count {count} at offset {offset} ({field}) cannot fit in the {remaining} bytes left \
         (each entry takes at least {min_bytes_each} bytes)",
        path.display()
    )]
    CountTooLarge {
        path: PathBuf,
        offset: u64,
        field: String,
        count: u64,
        min_bytes_each: u64,
        remaining: u64,
    },

    #[error("{}: invalid UTF-8 in {field} at offset {offset}", path.display())]
    InvalidUtf8 {
        path: PathBuf,
        offset: u64,
        field: String,
    },

    #[error("{}: unknown metadata value type {type_id} at offset {offset} ({field})", path.display())]
    UnknownValueType {
        path: PathBuf,
        offset: u64,
        field: String,
        type_id: u32,
    },

    #[error("{}: invalid bool byte {byte} at offset {offset} ({field})", path.display())]
    InvalidBool {
        path: PathBuf,
        offset: u64,
        field: String,
        byte: u8,
    },

    #[error(
        "{}: arrays nested deeper than {max_depth} levels at offset {offset} (value of `{key}`)",
        path.display()
    )]
    NestingTooDeep {
        path: PathBuf,
        offset: u64,
        key: String,
        max_depth: usize,
    },

    #[error("{}: duplicate metadata key `{key}` at offset {offset}", path.display())]
    DuplicateKey {
        path: PathBuf,
        offset: u64,
        key: String,
    },

    #[error(
        "{}: `general.alignment` must be a nonzero power of two that fits u32, found {found}",
        path.display()
    )]
    BadAlignment { path: PathBuf, found: String },

    // ---- tensor infos ------------------------------------------------------------------------
    #[error(
        "{}: tensor `{tensor}` has {n_dims} dimensions at offset {offset} (must be 1..=4)",
        path.display()
    )]
    BadDimCount {
        path: PathBuf,
        offset: u64,
        tensor: String,
        n_dims: u32,
    },

    #[error(
        "{}: tensor `{tensor}` has unknown or removed ggml type id {type_id} at offset {offset}",
        path.display()
    )]
    UnknownTensorType {
        path: PathBuf,
        offset: u64,
        tensor: String,
        type_id: u32,
    },

    #[error(
        "{}: tensor `{tensor}` ({dtype}, shape {shape:?}, info at offset {offset}): element count or byte size overflows u64",
        path.display()
    )]
    ShapeOverflow {
        path: PathBuf,
        offset: u64,
        tensor: String,
        dtype: GgmlType,
        shape: Vec<u64>,
    },

    #[error(
        "{}: tensor `{tensor}` (info at offset {offset}): row length {row_len} is not a multiple of the {dtype} block size {block_size}",
        path.display()
    )]
    RowNotWholeBlocks {
        path: PathBuf,
        offset: u64,
        tensor: String,
        dtype: GgmlType,
        row_len: u64,
        block_size: usize,
    },

    #[error("{}: duplicate tensor name `{tensor}` at offset {offset}", path.display())]
    DuplicateTensor {
        path: PathBuf,
        offset: u64,
        tensor: String,
    },

    #[error(
        "{}: tensor `{tensor}` data offset {offset_in_data} is not a multiple of the alignment {alignment}",
        path.display()
    )]
    TensorMisaligned {
        path: PathBuf,
        tensor: String,
        offset_in_data: u64,
        alignment: u64,
    },

    #[error(
        "{}: tensor `{tensor}` data [{start}, {end}) runs past the end of the file ({file_len} bytes)",
        path.display()
    )]
    TensorOutOfBounds {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    #[error(
        "{}: tensors `{first}` [{}, {}) and `{second}` [{}, {}) overlap",
        path.display(), first_range.0, first_range.1, second_range.0, second_range.1
    )]
    TensorsOverlap {
        path: PathBuf,
        first: String,
        first_range: (u64, u64),
        second: String,
        second_range: (u64, u64),
    },

    // ---- split models -----------------------------------------------------------------------
    #[error("split {split_no} of {count} is missing: {}: {error}", path.display())]
    MissingSplit {
        path: PathBuf,
        split_no: u32,
        count: u32,
        error: io::Error,
    },

    #[error(
        "{}: file says `split.count` = {found} but the split set has {expected} files",
        path.display()
    )]
    SplitCountMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },

    #[error("{}: split file lacks `{key}`", path.display())]
    MissingSplitKey { path: PathBuf, key: &'static str },

    #[error(
        "{}: expected `split.no` = {expected} (0-based) for this file, found {found}",
        path.display()
    )]
    SplitNumberMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },

    #[error(
        "{}: architecture `{found}` differs from the first split's `{expected}`",
        path.display()
    )]
    SplitArchMismatch {
        path: PathBuf,
        expected: String,
        found: String,
    },

    #[error(
        "{}: `split.tensors.count` says {expected} tensors but the splits hold {found}",
        path.display()
    )]
    SplitTensorCountMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },

    #[error(
        "{}: `split.count` is {count} but the file name is not `<name>-NNNNN-of-NNNNN.gguf`",
        path.display()
    )]
    BadSplitName { path: PathBuf, count: u64 },

    #[error("tensor `{tensor}` appears in two splits: {} and {}", first.display(), second.display())]
    DuplicateTensorAcrossSplits {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },

    // ---- metadata accessors -------------------------------------------------------------------
    #[error("metadata key `{key}` is missing")]
    MissingKey { key: String },

    #[error("metadata key `{key}` has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    #[error("metadata key `{key}` holds {value}, which does not fit {target}")]
    ValueOutOfRange {
        key: String,
        value: String,
        target: &'static str,
    },

    // ---- writing ------------------------------------------------------------------------------
    #[error("metadata key `{key}` was already added")]
    DuplicateMetadataKey { key: String },

    #[error("tensor `{tensor}` was already added")]
    DuplicateTensorName { tensor: String },

    #[error("tensor `{tensor}`: {reason}")]
    InvalidTensor { tensor: String, reason: String },

    #[error("tensor `{tensor}`: shape and type need {expected} bytes of data, got {actual}")]
    TensorDataSize {
        tensor: String,
        expected: u64,
        actual: u64,
    },

    #[error("metadata key `{key}`: {reason}")]
    InvalidValue { key: String, reason: String },

    #[error("cannot write split set: {reason}")]
    InvalidSplitSet { reason: String },

    #[error("writing GGUF data: {0}")]
    Write(io::Error),
}

impl GgufError {
    pub(crate) fn io(path: &Path, error: io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            error,
        }
    }
}
