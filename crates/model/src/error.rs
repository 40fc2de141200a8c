//! Errors of loading and running a model. Every variant names what it is about: the tensor,
//! the metadata key, the layer.

use gguf::GgufError;
use kernels::MatmulError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture {arch:?} (supported: {supported})")]
    UnsupportedArch { arch: String, supported: String },
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("tensor {name}: {detail}")]
    BadTensor { name: String, detail: String },
    #[error("metadata {key}: {detail}")]
    BadMetadata { key: String, detail: String },
    #[error("layer {layer}: {source}")]
    Kernel { layer: usize, source: MatmulError },
    #[error(transparent)]
    Matmul(#[from] MatmulError),
    #[error("invalid forward input: {0}")]
    Input(String),
    #[error("expert source: {0}")]
    Experts(String),
    #[error("wrong shard file: {0}")]
    WrongShard(String),
    #[error("collective operation at layer {layer}: {detail}")]
    Collective { layer: usize, detail: String },
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

pub(crate) fn bad_tensor(name: &str, detail: impl Into<String>) -> ModelError {
    ModelError::BadTensor {
        name: name.to_string(),
        detail: detail.into(),
    }
}
