//! The messages of the handshake: what the connecting side says it is (inside Noise message 1,
//! so only a holder of the key can read or forge it), and the answer (inside message 2).

use serde::{Deserialize, Serialize};

/// What the connecting side is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Role {
    /// A pipeline stage holding layers `first..=last` (and the output head when `head`).
    Stage { first: u32, last: u32, head: bool },
    /// The upstream end of a stage-to-stage data link.
    Hop,
    /// A tensor-parallel rank (`rank` as requested; `None` lets the coordinator assign one).
    Rank {
        rank: Option<u32>,
        expert_weight: f32,
        /// The routed experts its file holds, when it is a rank's shard file (a full file
        /// holds them all).
        held: Option<HeldExperts>,
    },
}

/// The routed experts a rank's shard file holds, so the coordinator can refuse a file that
/// lacks the experts the group would give that rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeldExperts {
    /// Expert ids `first..end` of every MoE layer.
    pub first: u32,
    pub end: u32,
    /// The file and its slice, for messages (`r1.gguf, rank 1 of 3 (experts 3..5)`).
    pub file: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u16,
    /// The sender's build (crate version); a different build is logged, not refused.
    pub build: String,
    pub role: Role,
    /// Model fingerprint (hex) — peers must run the same model.
    pub fingerprint: String,
    pub n_ctx: u32,
    /// `host:port` where the sender accepts stage-to-stage links.
    pub listen: Option<String>,
    /// The sender's peer timeout (ms): the other side heartbeats often enough for it.
    pub peer_timeout_ms: u64,
}

impl Hello {
    /// A hello of this build and protocol.
    pub fn new(role: Role, fingerprint: &str, n_ctx: u32, listen: Option<String>) -> Hello {
        Hello {
            protocol: super::PROTOCOL_VERSION,
            build: build_id(),
            role,
            fingerprint: fingerprint.to_string(),
            n_ctx,
            listen,
            peer_timeout_ms: 0,
        }
    }
}

/// Accepted: what the server tells the newcomer.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Welcome {
    /// The server's build (a different build is logged, not refused).
    pub build: String,
    /// The server's peer timeout (ms): the client heartbeats often enough for it.
    pub peer_timeout_ms: u64,
    pub message: String,
    /// For tensor-parallel ranks: the assigned rank.
    pub rank: Option<u32>,
    /// For tensor-parallel ranks: the number of ranks in the group.
    pub group_size: Option<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Reject {
    pub reason: String,
}

pub fn build_id() -> String {
    concat!("moeshard ", env!("CARGO_PKG_VERSION")).to_string()
}
