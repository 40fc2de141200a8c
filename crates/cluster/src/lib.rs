//! Running one model across machines: the wire protocol (frames, authenticated handshake),
//! the registry of peers a coordinator admits, pipeline stages with chunked prefill, replay
//! and snapshots, and tensor-parallel groups. Every node computes through `engine::Runner`.

pub mod activation;
pub mod error;
pub mod membership;
pub mod pipeline;
pub mod registry;
pub mod tp;
pub mod transcripts;
pub mod wire;

pub use error::{ClusterError, Result};
