//! The handshake. Client: Hello (its role, model, nonce). Server: Challenge (its nonce and MAC
//! over both nonces). Client: Proof (its MAC). Server: Welcome or Reject. Version mismatches
//! are caught from the frame header before anything else is parsed; role and model checks run
//! only after both sides have proven the key, so an outsider learns nothing.

use std::net::TcpStream;
use std::time::Duration;

use super::auth::{AuthMode, new_nonce};
use super::conn::{Connection, ConnectionReader};
use super::frame::Kind;
use super::messages::{Challenge, Hello, Proof, Reject, Welcome, build_id};
use super::{WireError, decode};

/// How long a handshake may take before the peer is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Client side: introduces itself and authenticates in both directions.
pub fn connect(
    stream: TcpStream,
    auth: &AuthMode,
    mut hello: Hello,
) -> Result<(Connection, ConnectionReader, Welcome), WireError> {
    let (conn, mut reader) = Connection::new(stream)?;
    auth.check_addresses(conn.local(), conn.peer())?;
    reader.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    hello.nonce = new_nonce();
    hello.keyless = matches!(auth, AuthMode::Insecure);
    let peer = conn.peer().to_string();
    conn.send_msg(Kind::Hello, 0, &hello)?;
    let f = reader.recv().map_err(|e| rejected(e, &peer))?;
    if f.kind == Kind::Reject {
        let r: Reject = decode("reject", &f.payload)?;
        return Err(WireError::Rejected {
            peer,
            reason: r.reason,
        });
    }
    if f.kind != Kind::Challenge {
        return Err(WireError::Unexpected {
            expected: Kind::Challenge,
            got: f.kind,
        });
    }
    let ch: Challenge = decode("challenge", &f.payload)?;
    let proof = match auth {
        AuthMode::Key(key) => {
            if !key.verify(&key.server_mac(&hello.nonce, &ch.nonce), &ch.mac) {
                let reason = "server failed authentication (different cluster key)".to_string();
                conn.send_msg(
                    Kind::Reject,
                    0,
                    &Reject {
                        reason: reason.clone(),
                    },
                )?;
                return Err(WireError::Auth(format!("{peer}: {reason}")));
            }
            key.client_mac(&ch.nonce, &hello.nonce)
        }
        AuthMode::Insecure => Vec::new(),
    };
    conn.send_msg(Kind::Proof, 0, &Proof { mac: proof })?;
    let f = reader.recv().map_err(|e| rejected(e, &peer))?;
    match f.kind {
        Kind::Welcome => {
            reader.set_read_timeout(None)?;
            if ch.build != build_id() {
                tracing::warn!("{peer} runs {}, we run {}", ch.build, build_id());
            }
            Ok((conn, reader, decode("welcome", &f.payload)?))
        }
        Kind::Reject => {
            let r: Reject = decode("reject", &f.payload)?;
            Err(WireError::Rejected {
                peer,
                reason: r.reason,
            })
        }
        other => Err(WireError::Unexpected {
            expected: Kind::Welcome,
            got: other,
        }),
    }
}

fn rejected(e: WireError, peer: &str) -> WireError {
    match e {
        WireError::Remote(reason) => WireError::Rejected {
            peer: peer.to_string(),
            reason,
        },
        other => other,
    }
}

/// Logs why an inbound connection from `peer` did not become a link: something that does not
/// speak the protocol (curl, nc, random bytes, a port scan) is dropped; a peer that does but was
/// refused (key, version, model, range) is named as refused.
pub fn log_rejected(peer: impl std::fmt::Display, e: &WireError) {
    match e {
        WireError::NotOurProtocol { .. }
        | WireError::Truncated { .. }
        | WireError::Closed
        | WireError::Io(_) => {
            tracing::warn!("dropped a connection from {peer} that does not speak the protocol: {e}")
        }
        _ => tracing::warn!("refused {peer}: {e}"),
    }
}

/// Server side: authenticates the peer, then asks `check` whether its hello is acceptable
/// (model, version, range, ctx). A refusal is sent to the peer and returned as `Rejected`.
pub fn accept(
    stream: TcpStream,
    auth: &AuthMode,
    check: impl FnOnce(&Hello) -> Result<Welcome, String>,
) -> Result<(Connection, ConnectionReader, Hello), WireError> {
    let (conn, mut reader) = Connection::new(stream)?;
    let peer = conn.peer().to_string();
    reader.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let refuse = |conn: &Connection, reason: String| -> WireError {
        let _ = conn.send_msg(
            Kind::Reject,
            0,
            &Reject {
                reason: reason.clone(),
            },
        );
        conn.shutdown();
        WireError::Rejected {
            peer: peer.clone(),
            reason,
        }
    };
    let f = match reader.recv() {
        Ok(f) => f,
        Err(WireError::VersionMismatch { ours, theirs }) => {
            // Tell the peer in our framing; it will see our version in the header.
            conn.send_error(
                0,
                &format!("protocol version mismatch: this node speaks {ours}, you speak {theirs}"),
            );
            conn.shutdown();
            return Err(WireError::VersionMismatch { ours, theirs });
        }
        Err(e) => {
            conn.shutdown();
            return Err(e);
        }
    };
    if f.kind != Kind::Hello {
        conn.shutdown();
        return Err(WireError::Unexpected {
            expected: Kind::Hello,
            got: f.kind,
        });
    }
    let hello: Hello = decode("hello", &f.payload).inspect_err(|_| conn.shutdown())?;
    if let Err(e) = auth.check_addresses(conn.local(), conn.peer()) {
        return Err(refuse(&conn, e.to_string()));
    }
    match (auth, hello.keyless) {
        (AuthMode::Key(_), true) => {
            return Err(refuse(
                &conn,
                "this cluster requires a key; the peer has none".into(),
            ));
        }
        (AuthMode::Insecure, false) => {
            return Err(refuse(
                &conn,
                "this node runs --insecure without a key; the peer expects one".into(),
            ));
        }
        _ => {}
    }
    let nonce = new_nonce();
    let mac = match auth {
        AuthMode::Key(key) => key.server_mac(&hello.nonce, &nonce),
        AuthMode::Insecure => Vec::new(),
    };
    conn.send_msg(
        Kind::Challenge,
        0,
        &Challenge {
            nonce,
            mac,
            build: build_id(),
        },
    )?;
    let f = match reader.recv() {
        Ok(f) => f,
        Err(e) => {
            conn.shutdown();
            return Err(rejected(e, &peer));
        }
    };
    if f.kind == Kind::Reject {
        let r: Reject = decode("reject", &f.payload)?;
        conn.shutdown();
        return Err(WireError::Auth(format!("{peer} refused us: {}", r.reason)));
    }
    if f.kind != Kind::Proof {
        conn.shutdown();
        return Err(WireError::Unexpected {
            expected: Kind::Proof,
            got: f.kind,
        });
    }
    let proof: Proof = decode("proof", &f.payload)?;
    if let AuthMode::Key(key) = auth
        && !key.verify(&key.client_mac(&nonce, &hello.nonce), &proof.mac)
    {
        return Err(refuse(
            &conn,
            "authentication failed (different cluster key)".into(),
        ));
    }
    if hello.protocol != super::PROTOCOL_VERSION {
        return Err(refuse(
            &conn,
            format!(
                "protocol version mismatch: this node speaks {}, the peer speaks {}",
                super::PROTOCOL_VERSION,
                hello.protocol
            ),
        ));
    }
    match check(&hello) {
        Ok(welcome) => {
            conn.send_msg(Kind::Welcome, 0, &welcome)?;
            reader.set_read_timeout(None)?;
            if hello.build != build_id() {
                tracing::warn!("{peer} runs {}, we run {}", hello.build, build_id());
            }
            Ok((conn, reader, hello))
        }
        Err(reason) => Err(refuse(&conn, reason)),
    }
}
