//! GGUF model files: reading (memory-mapped, validated, zero-copy tensor data) and writing.

mod types;

pub use types::{GgmlType, QK_K};
