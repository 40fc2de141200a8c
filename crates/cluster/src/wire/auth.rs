//! Cluster authentication: a shared key, HMAC-SHA256 challenge-response in both directions.
//! Each side proves it holds the key over both nonces, so neither a replayed transcript nor a
//! peer without the key gets in. Running keyless is allowed only on loopback, on request.

use std::net::SocketAddr;
use std::path::Path;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use super::WireError;

type HmacSha256 = Hmac<Sha256>;

pub const NONCE_LEN: usize = 32;

/// The shared secret of a cluster.
#[derive(Clone)]
pub struct ClusterKey(Vec<u8>);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<ClusterKey, WireError> {
        let bytes = bytes.into();
        if bytes.len() < 16 {
            return Err(WireError::Auth(format!(
                "cluster key is {} bytes; use at least 16",
                bytes.len()
            )));
        }
        Ok(ClusterKey(bytes))
    }

    /// Reads a key file (surrounding whitespace ignored).
    pub fn from_file(path: &Path) -> Result<ClusterKey, WireError> {
        let text = std::fs::read(path)
            .map_err(|e| WireError::Auth(format!("reading key file {}: {e}", path.display())))?;
        let trimmed = String::from_utf8_lossy(&text).trim().as_bytes().to_vec();
        ClusterKey::new(trimmed).map_err(|e| WireError::Auth(format!("{}: {e}", path.display())))
    }

    /// `--cluster-key-file`, else `MOESHARD_CLUSTER_KEY`, else none.
    pub fn from_flag_or_env(file: Option<&Path>) -> Result<Option<ClusterKey>, WireError> {
        if let Some(f) = file {
            return ClusterKey::from_file(f).map(Some);
        }
        match std::env::var("MOESHARD_CLUSTER_KEY") {
            Ok(k) if !k.trim().is_empty() => {
                ClusterKey::new(k.trim().as_bytes().to_vec()).map(Some)
            }
            _ => Ok(None),
        }
    }

    fn mac(&self, label: &[u8], a: &[u8], b: &[u8]) -> Vec<u8> {
        let mut m =
            <HmacSha256 as KeyInit>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        m.update(a);
        m.update(b);
        m.finalize().into_bytes().to_vec()
    }

    /// The server's proof: over the client's nonce, then its own.
    pub fn server_mac(&self, client_nonce: &[u8], server_nonce: &[u8]) -> Vec<u8> {
        self.mac(b"moeshard-server-v1", client_nonce, server_nonce)
    }

    /// The client's proof: over the server's nonce, then its own.
    pub fn client_mac(&self, server_nonce: &[u8], client_nonce: &[u8]) -> Vec<u8> {
        self.mac(b"moeshard-client-v1", server_nonce, client_nonce)
    }

    /// Constant-time comparison of a received MAC.
    pub fn verify(&self, expected: &[u8], got: &[u8]) -> bool {
        expected.len() == got.len()
            && expected
                .iter()
                .zip(got)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

pub fn new_nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::fill(&mut n);
    n
}

/// How a node authenticates its links.
#[derive(Clone, Debug)]
pub enum AuthMode {
    Key(ClusterKey),
    /// No authentication: only between loopback addresses, and only when asked for.
    Insecure,
}

impl AuthMode {
    /// The mode for a node's flags: a key if one is configured; keyless only with `--insecure`.
    pub fn from_flags(key: Option<ClusterKey>, insecure: bool) -> Result<AuthMode, WireError> {
        match (key, insecure) {
            (Some(k), _) => Ok(AuthMode::Key(k)),
            (None, true) => Ok(AuthMode::Insecure),
            (None, false) => Err(WireError::Auth(
                "no cluster key: pass --cluster-key-file or set MOESHARD_CLUSTER_KEY (or --insecure on loopback)".into(),
            )),
        }
    }

    /// Keyless links are refused unless both ends are loopback.
    pub fn check_addresses(&self, local: SocketAddr, peer: SocketAddr) -> Result<(), WireError> {
        if matches!(self, AuthMode::Insecure)
            && !(local.ip().is_loopback() && peer.ip().is_loopback())
        {
            return Err(WireError::Auth(format!(
                "--insecure is only allowed on loopback, but this link is {local} ↔ {peer}"
            )));
        }
        Ok(())
    }
}
