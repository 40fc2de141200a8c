//! What can go wrong in a cluster, with the peer and the operation it happened in. The binary
//! adds its own context with `anyhow`; executors hand these to the engine as
//! [`EngineError::Cluster`], keeping the source chain.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use engine::{EngineError, RunError};

use crate::wire::WireError;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("binding {what} {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error("{peer}: {source}")]
    Link { peer: String, source: WireError },
    /// A peer answered, but with a failure or out of step.
    #[error("{peer}: {detail}")]
    Peer { peer: String, detail: String },
    #[error("{peer} did not answer {what} within {timeout:?}")]
    Timeout {
        peer: String,
        what: &'static str,
        timeout: Duration,
    },
    #[error("{peer} left")]
    Left { peer: String },
    /// The coordinator refused this process (wrong key, model, version, range or rank):
    /// retrying cannot help.
    #[error("refused by the coordinator: {0}")]
    Refused(WireError),
    #[error("the group or route could not be formed: {0}")]
    Formation(String),
    #[error("expert source: {0}")]
    Experts(BoxError),
    #[error(transparent)]
    Run(#[from] RunError),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl ClusterError {
    /// A wire error on the link to `peer`; refusals by the other side stay recognizable.
    pub fn link(peer: impl ToString, source: WireError) -> ClusterError {
        ClusterError::Link {
            peer: peer.to_string(),
            source,
        }
    }

    pub fn peer(peer: impl ToString, detail: impl Into<String>) -> ClusterError {
        ClusterError::Peer {
            peer: peer.to_string(),
            detail: detail.into(),
        }
    }

    /// Whether the other side refused us for good (key, version, model, range): a worker
    /// stops retrying.
    pub fn is_refusal(&self) -> bool {
        match self {
            ClusterError::Refused(_) => true,
            ClusterError::Link { source, .. } => matches!(
                source,
                WireError::Rejected { .. } | WireError::Auth(_) | WireError::VersionMismatch { .. }
            ),
            _ => false,
        }
    }
}

/// Binds `addr` (the flag or port named `what`), with the bound address.
pub fn bind(what: &'static str, addr: &str) -> Result<(TcpListener, SocketAddr)> {
    let err = |source| ClusterError::Bind {
        what,
        addr: addr.to_string(),
        source,
    };
    let listener = TcpListener::bind(addr).map_err(err)?;
    let bound = listener.local_addr().map_err(err)?;
    Ok((listener, bound))
}

impl From<ClusterError> for EngineError {
    fn from(e: ClusterError) -> EngineError {
        match e {
            ClusterError::Engine(e) => e,
            e => EngineError::Cluster(Box::new(e)),
        }
    }
}

pub type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// An error from outside the cluster crate (an expert source built by the binary).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
