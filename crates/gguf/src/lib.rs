//! GGUF model files: reading (memory-mapped, validated, zero-copy tensor data), split models,
//! model fingerprints, and writing.
//!
//! - [`GgufFile`] parses and validates one file; [`GgufModel`] opens a single file or a
//!   llama.cpp split set and merges the tensor indexes.
//! - [`Metadata`] holds the key/value section with typed accessors ([`Metadata::arch_u32`] ...).
//! - [`GgufWriter`] writes files (v3 by default); [`write_split_model`] writes split sets.

mod cursor;
mod error;
mod fingerprint;
mod metadata;
mod model;
mod reader;
mod tensor;
mod types;
mod value;
mod writer;

pub use error::{GgufError, Result};
pub use fingerprint::{Fingerprint, PARENT_FINGERPRINT_KEY};
pub use metadata::{ALIGNMENT_KEY, ARCHITECTURE_KEY, DEFAULT_ALIGNMENT, Metadata};
pub use model::{
    GgufModel, ModelTensor, SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY,
    split_file_path, write_split_model,
};
pub use reader::{GGUF_MAGIC, GgufFile, TensorLocation};
pub use tensor::{MAX_DIMS, Shape, TensorInfo};
pub use types::{GgmlType, QK_K};
pub use value::{Array, MAX_ARRAY_DEPTH, StringArray, Value, ValueType};
pub use writer::{GgufVersion, GgufWriter};
