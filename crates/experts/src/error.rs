//! Errors of streaming experts. Each names the file, the expert and the range involved, so a
//! failed request says what to check.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("opening {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error(
        "reading expert {expert} of layer {layer} from {path} (bytes {offset}+{len}): {source}"
    )]
    Read {
        layer: usize,
        expert: usize,
        path: PathBuf,
        offset: u64,
        len: u64,
        source: io::Error,
    },
    #[error(
        "short read of expert {expert} of layer {layer} from {path} at byte {offset}: \
         {got} of {want} bytes"
    )]
    Short {
        layer: usize,
        expert: usize,
        path: PathBuf,
        offset: u64,
        want: u64,
        got: u64,
    },
    #[error("{path} changed since the model was loaded ({detail}); restart to use the new file")]
    Changed { path: PathBuf, detail: String },
    #[error("expert profile {path}: {detail}")]
    Profile { path: PathBuf, detail: String },
    #[error("streaming setup: {0}")]
    Config(String),
    #[error("{0}")]
    Model(#[from] model::ModelError),
}

pub type Result<T, E = StreamError> = std::result::Result<T, E>;
