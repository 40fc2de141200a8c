//! Running one model across machines: the wire protocol (frames, authenticated handshake),
//! pipeline stages with chunked prefill, replay and snapshots, and tensor-parallel groups.

pub mod activation;
pub mod hash;
pub mod pipeline;
pub mod stage;
pub mod tp;
pub mod transcripts;
pub mod wire;
