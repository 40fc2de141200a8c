//! moeshard's own wire protocol: frames, typed messages, the authenticated handshake, and a
//! connection type. Data frames carry tensors as raw little-endian bytes behind a small header;
//! control messages are serde structs in postcard.

pub mod auth;
pub mod codec;
pub mod conn;
pub mod frame;
pub mod handshake;
pub mod messages;

pub use auth::{AuthMode, ClusterKey, DEFAULT_PEER_TIMEOUT, LinkConfig};
pub use codec::{f32_bytes, f32_values, pack, unpack};
pub use conn::{Connection, ConnectionReader, dial, read_sealed_frame, seal_frame, seal_record};
pub use frame::{Frame, Kind, PROTOCOL_VERSION};
pub use handshake::{
    HandshakeSlot, PendingHandshakes, accept, connect, hello_frame, log_rejected, read_answer,
    transport_pair,
};
pub use messages::{HeldExperts, Hello, Role, Welcome};

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("peer does not speak the moeshard protocol (first bytes {first_bytes:02x?})")]
    NotOurProtocol { first_bytes: Vec<u8> },
    #[error("protocol version mismatch: we speak {ours}, the peer speaks {theirs}")]
    VersionMismatch { ours: u16, theirs: u16 },
    #[error("unknown frame kind {0}")]
    UnknownKind(u16),
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: u64, max: u64 },
    #[error("connection closed inside a {what} ({got} of {want} bytes)")]
    Truncated {
        what: &'static str,
        got: usize,
        want: u64,
    },
    #[error("malformed {what}: {detail}")]
    Decode { what: &'static str, detail: String },
    #[error("authentication: {0}")]
    Auth(String),
    #[error("rejected by {peer}: {reason}")]
    Rejected { peer: String, reason: String },
    #[error("expected a {expected:?} frame, got {got:?}")]
    Unexpected { expected: Kind, got: Kind },
    #[error("peer error: {0}")]
    Remote(String),
    #[error("connection closed by peer")]
    Closed,
    #[error("the peer sent nothing (not even a heartbeat) for {after:?}")]
    Silent { after: std::time::Duration },
    #[error("the peer stopped taking data (a write made no progress within the peer timeout)")]
    Stalled,
}

impl WireError {
    /// Whether the link itself failed (as opposed to a refusal or a protocol violation).
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            WireError::Io(_)
                | WireError::Truncated { .. }
                | WireError::Closed
                | WireError::Silent { .. }
                | WireError::Stalled
        )
    }
}

/// Serializes a control message.
pub fn encode<T: serde::Serialize>(msg: &T) -> Vec<u8> {
    postcard::to_stdvec(msg).expect("control messages serialize")
}

/// Deserializes a control message, naming it on failure.
pub fn decode<'a, T: serde::Deserialize<'a>>(
    what: &'static str,
    bytes: &'a [u8],
) -> Result<T, WireError> {
    postcard::from_bytes(bytes).map_err(|e| WireError::Decode {
        what,
        detail: e.to_string(),
    })
}
