//! What protects a cluster's links: a shared key of at least 32 bytes (from `moeshard keygen`),
//! from which the pre-shared key of the Noise handshake is derived, and how long a silent peer
//! is tolerated. Running keyless (plaintext, no authentication) is allowed only on loopback, on
//! request.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::WireError;

/// The shortest key accepted: what `moeshard keygen` writes.
pub const MIN_KEY_LEN: usize = 32;

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
        if bytes.len() < MIN_KEY_LEN {
            return Err(WireError::Auth(format!(
                "the cluster key is {} bytes; use at least {MIN_KEY_LEN} (`moeshard keygen FILE` writes one)",
                bytes.len()
            )));
        }
        Ok(ClusterKey(bytes))
    }

    /// Reads a key file: its bytes, exactly as they are.
    pub fn from_file(path: &Path) -> Result<ClusterKey, WireError> {
        let bytes = std::fs::read(path)
            .map_err(|e| WireError::Auth(format!("reading key file {}: {e}", path.display())))?;
        ClusterKey::new(bytes).map_err(|e| WireError::Auth(format!("{}: {e}", path.display())))
    }

    /// `--cluster-key-file`, else `MOESHARD_CLUSTER_KEY` (its bytes), else none.
    pub fn from_flag_or_env(file: Option<&Path>) -> Result<Option<ClusterKey>, WireError> {
        if let Some(f) = file {
            return ClusterKey::from_file(f).map(Some);
        }
        match std::env::var_os("MOESHARD_CLUSTER_KEY") {
            Some(k) if !k.is_empty() => ClusterKey::new(k.into_encoded_bytes())
                .map(Some)
                .map_err(|e| WireError::Auth(format!("MOESHARD_CLUSTER_KEY: {e}"))),
            _ => Ok(None),
        }
    }

    /// 32 fresh random bytes (`moeshard keygen`).
    pub fn generate() -> ClusterKey {
        let mut k = vec![0u8; MIN_KEY_LEN];
        rand::fill(&mut k[..]);
        ClusterKey(k)
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// The Noise pre-shared key: a hash of the whole key (of any length ≥ 32), under a label
    /// of this protocol so the same key used elsewhere gives another value.
    pub fn psk(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"moeshard cluster psk v2");
        h.update(&self.0);
        h.finalize().into()
    }
}

/// How a node authenticates its links.
#[derive(Clone, Debug)]
pub enum AuthMode {
    /// Noise handshake with the key as pre-shared key; every frame encrypted.
    Key(ClusterKey),
    /// No authentication, no encryption: only between loopback addresses, and only when asked
    /// for.
    Insecure,
}

impl AuthMode {
    /// The mode for a node's flags: a key if one is configured; keyless only with `--insecure`.
    pub fn from_flags(key: Option<ClusterKey>, insecure: bool) -> Result<AuthMode, WireError> {
        match (key, insecure) {
            (Some(k), _) => Ok(AuthMode::Key(k)),
            (None, true) => Ok(AuthMode::Insecure),
            (None, false) => Err(WireError::Auth(
                "no cluster key: pass --cluster-key-file (make one with `moeshard keygen FILE`) or set MOESHARD_CLUSTER_KEY (or --insecure on loopback)".into(),
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

/// The default for `--peer-timeout`.
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything a link needs besides its socket: how it is protected and how long the peer may
/// stay silent before it counts as dead (heartbeats are sent at a quarter of that).
#[derive(Clone, Debug)]
pub struct LinkConfig {
    pub auth: AuthMode,
    pub peer_timeout: Duration,
}

impl LinkConfig {
    pub fn new(auth: AuthMode) -> LinkConfig {
        LinkConfig {
            auth,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
        }
    }

    pub fn with_peer_timeout(mut self, t: Duration) -> LinkConfig {
        self.peer_timeout = t.max(Duration::from_millis(200));
        self
    }

    /// How often a link sends a heartbeat when it has nothing else to send.
    pub fn heartbeat(&self) -> Duration {
        self.peer_timeout / 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_refused_and_files_are_read_as_bytes() {
        assert!(ClusterKey::new(vec![7u8; 31]).is_err());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k");
        // Trailing whitespace is part of the key: two files that differ only in it differ.
        std::fs::write(
            &p,
            [b'a'; 32].iter().chain(b"\n").copied().collect::<Vec<_>>(),
        )
        .unwrap();
        let with_newline = ClusterKey::from_file(&p).unwrap();
        assert_eq!(with_newline.bytes().len(), 33);
        assert_ne!(
            with_newline.psk(),
            ClusterKey::new(vec![b'a'; 32]).unwrap().psk()
        );
        let a = ClusterKey::generate();
        assert_eq!(a.bytes().len(), MIN_KEY_LEN);
        assert_ne!(a.bytes(), ClusterKey::generate().bytes());
    }
}
