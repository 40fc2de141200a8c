//! The handshake: `Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s` with the cluster key's PSK, the
//! protocol name and version as prologue.
//!
//! - Client → server: a `Hello` frame carrying Noise message 1 (`psk, e`), whose payload is the
//!   client's [`Hello`] (role, model, context, data address, versions). Only a holder of the
//!   key can produce it or read it; the server learns the peer is authentic from its tag.
//! - Server → client: a `Welcome` frame carrying message 2 (`e, ee`), whose payload is the
//!   answer — [`Welcome`] or the reason for refusing — so the client learns the server holds
//!   the key too, and what the server decided is bound to the same transcript.
//! - Both sides then split the transcript into two transport keys, one per direction; every
//!   later frame is sealed (see `conn`).
//!
//! A peer without the key gets a plaintext `Reject` naming only that authentication failed;
//! a server that is not what the client expects gets nothing from the client but message 1,
//! which needs the 32-byte key to open. Everything happens before one deadline
//! ([`HANDSHAKE_TIMEOUT`]) with a small payload cap. Keyless links (`--insecure`, loopback
//! only) exchange plaintext hellos and stay plaintext.

use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use snow::{Builder, HandshakeState, StatelessTransportState};

use super::auth::{AuthMode, LinkConfig};
use super::conn::{Connection, ConnectionReader};
use super::frame::{FLAG_KEYLESS, Frame, Kind};
use super::messages::{Hello, Reject, Welcome, build_id};
use super::{PROTOCOL_VERSION, WireError, decode, encode};

/// How long a whole handshake may take before the peer is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress on one port at most: connections that never finish theirs cannot
/// pile up threads (each is dropped at [`HANDSHAKE_TIMEOUT`] anyway).
pub const MAX_PENDING_HANDSHAKES: usize = 16;

/// The handshakes in progress on one listening port.
#[derive(Clone, Default)]
pub struct PendingHandshakes(Arc<AtomicUsize>);

/// One handshake's place among the pending ones; dropping it (when the handshake is over)
/// frees the place, even if the thread goes on serving the link.
pub struct HandshakeSlot(Arc<AtomicUsize>);

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PendingHandshakes {
    /// Runs `serve` on a thread of its own (never on the accept thread), or drops the
    /// connection when [`MAX_PENDING_HANDSHAKES`] are already in progress on this port.
    /// `serve` drops its slot once the handshake is done.
    pub fn spawn(
        &self,
        stream: TcpStream,
        serve: impl FnOnce(TcpStream, HandshakeSlot) + Send + 'static,
    ) {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        if self.0.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_HANDSHAKES {
            self.0.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(
                "dropped a connection from {peer}: {MAX_PENDING_HANDSHAKES} handshakes already in progress"
            );
            return;
        }
        let slot = HandshakeSlot(Arc::clone(&self.0));
        let spawned = std::thread::Builder::new()
            .name("handshake".into())
            .spawn(move || serve(stream, slot));
        if let Err(e) = spawned {
            tracing::warn!("dropped a connection from {peer}: no handshake thread ({e})");
        }
    }
}

const NOISE: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";

fn prologue() -> Vec<u8> {
    format!("moeshard cluster link, protocol {PROTOCOL_VERSION}").into_bytes()
}

fn noise(psk: &[u8; 32], initiator: bool) -> Result<HandshakeState, WireError> {
    let params = NOISE
        .parse()
        .map_err(|e| WireError::Auth(format!("noise parameters: {e:?}")))?;
    let prologue = prologue();
    let b = Builder::new(params)
        .prologue(&prologue)
        .and_then(|b| b.psk(0, psk))
        .map_err(|e| WireError::Auth(format!("noise setup: {e}")))?;
    if initiator {
        b.build_initiator()
    } else {
        b.build_responder()
    }
    .map_err(|e| WireError::Auth(format!("noise setup: {e}")))
}

/// Both ends of a link's handshake run in memory, in transport mode (initiator's, responder's):
/// what the link benchmark and the frame fuzzer seal and open records with.
pub fn transport_pair(
    psk: &[u8; 32],
) -> Result<(StatelessTransportState, StatelessTransportState), WireError> {
    let (mut client, mut server) = (noise(psk, true)?, noise(psk, false)?);
    let first = write_message(&mut client, &[])?;
    read_message(&mut server, &first).ok_or_else(|| WireError::Auth("message 1".into()))?;
    let second = write_message(&mut server, &[])?;
    read_message(&mut client, &second).ok_or_else(|| WireError::Auth("message 2".into()))?;
    let transport = |hs: HandshakeState| {
        hs.into_stateless_transport_mode()
            .map_err(|e| WireError::Auth(format!("noise: {e}")))
    };
    Ok((transport(client)?, transport(server)?))
}

/// A Noise message from `payload` (handshake payloads are small; the frame cap bounds them).
fn write_message(hs: &mut HandshakeState, payload: &[u8]) -> Result<Vec<u8>, WireError> {
    let mut out = vec![0u8; payload.len() + 128];
    let n = hs
        .write_message(payload, &mut out)
        .map_err(|e| WireError::Auth(format!("noise: {e}")))?;
    out.truncate(n);
    Ok(out)
}

/// The payload of a Noise message, or `None` when it does not authenticate.
fn read_message(hs: &mut HandshakeState, message: &[u8]) -> Option<Vec<u8>> {
    let mut out = vec![0u8; message.len()];
    let n = hs.read_message(message, &mut out).ok()?;
    out.truncate(n);
    Some(out)
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

/// Client side: introduces itself, authenticates in both directions, and returns the
/// established link and the server's welcome.
pub fn connect(
    stream: TcpStream,
    link: &LinkConfig,
    mut hello: Hello,
) -> Result<(Connection, ConnectionReader, Welcome), WireError> {
    hello.peer_timeout_ms = link.peer_timeout.as_millis() as u64;
    let (conn, mut reader) = Connection::new(stream)?;
    link.auth.check_addresses(conn.local(), conn.peer())?;
    reader.set_deadline(Some(Instant::now() + HANDSHAKE_TIMEOUT))?;
    let peer = conn.peer().to_string();
    let (first, mut noise_state) = hello_frame(&link.auth, &hello)?;
    conn.send(&first)?;
    let f = reader.recv().map_err(|e| rejected(e, &peer))?;
    let answer = read_answer(&f, noise_state.as_mut(), &peer)?;
    let welcome = answer.map_err(|reason| WireError::Rejected {
        peer: peer.clone(),
        reason,
    })?;
    if welcome.build != build_id() {
        tracing::warn!("{peer} runs {}, we run {}", welcome.build, build_id());
    }
    establish(
        &conn,
        &mut reader,
        noise_state,
        link,
        welcome.peer_timeout_ms,
    )?;
    Ok((conn, reader, welcome))
}

/// The client's first handshake frame carrying `hello` (Noise message 1 when keyed, a
/// plaintext hello flagged keyless otherwise) and the state that opens the server's answer.
pub fn hello_frame(
    auth: &AuthMode,
    hello: &Hello,
) -> Result<(Frame, Option<HandshakeState>), WireError> {
    Ok(match auth {
        AuthMode::Key(key) => {
            let mut hs = noise(&key.psk(), true)?;
            let frame = Frame::new(Kind::Hello, 0, write_message(&mut hs, &encode(hello))?);
            (frame, Some(hs))
        }
        AuthMode::Insecure => {
            let mut frame = Frame::new(Kind::Hello, 0, encode(hello));
            frame.flags = FLAG_KEYLESS;
            (frame, None)
        }
    })
}

/// What the server answered to our hello (`f`): its welcome, or the reason it refused; an
/// error when the answer is malformed or does not authenticate as coming from a key holder.
pub fn read_answer(
    f: &Frame,
    noise_state: Option<&mut HandshakeState>,
    peer: &str,
) -> Result<Result<Welcome, String>, WireError> {
    match (f.kind, noise_state) {
        (Kind::Reject, _) => Ok(Err(decode::<Reject>("reject", &f.payload)?.reason)),
        (Kind::Welcome, Some(hs)) => {
            let payload = read_message(hs, &f.payload).ok_or_else(|| {
                WireError::Auth(format!(
                    "{peer} failed authentication (different cluster key)"
                ))
            })?;
            decode("welcome", &payload)
        }
        (Kind::Welcome, None) => decode("welcome", &f.payload),
        (other, _) => Err(WireError::Unexpected {
            expected: Kind::Welcome,
            got: other,
        }),
    }
}

/// Turns a finished handshake into an established link: transport keys (keyed links),
/// the full payload cap, the idle deadline, write deadline, keepalive and heartbeats — sent
/// often enough for the shorter of the two sides' peer timeouts (`remote_ms`, 0 if unknown).
fn establish(
    conn: &Connection,
    reader: &mut ConnectionReader,
    noise_state: Option<HandshakeState>,
    link: &LinkConfig,
    remote_ms: u64,
) -> Result<(), WireError> {
    let cipher = match noise_state {
        Some(hs) => {
            let t = hs
                .into_stateless_transport_mode()
                .map_err(|e| WireError::Auth(format!("noise: {e}")))?;
            Some(std::sync::Arc::new(t))
        }
        None => None,
    };
    if let Some(c) = &cipher {
        conn.secure(std::sync::Arc::clone(c));
    }
    reader.established(cipher, link.peer_timeout)?;
    let remote = Duration::from_millis(remote_ms);
    let beat_for = if remote.is_zero() {
        link.peer_timeout
    } else {
        link.peer_timeout.min(remote)
    };
    conn.keep_alive(link.peer_timeout, beat_for)
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
    link: &LinkConfig,
    check: impl FnOnce(&Hello) -> Result<Welcome, String>,
) -> Result<(Connection, ConnectionReader, Hello), WireError> {
    let (conn, mut reader) = Connection::new(stream)?;
    let peer = conn.peer().to_string();
    reader.set_deadline(Some(Instant::now() + HANDSHAKE_TIMEOUT))?;
    // A refusal before the peer proved the key: plaintext, and saying nothing of the key.
    let refuse = |reason: String| -> WireError {
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
    if let Err(e) = link.auth.check_addresses(conn.local(), conn.peer()) {
        return Err(refuse(e.to_string()));
    }
    let keyless = f.flags & FLAG_KEYLESS != 0;
    let (hello_bytes, mut noise_state) = match (&link.auth, keyless) {
        (AuthMode::Key(_), true) => {
            return Err(refuse(
                "this cluster requires a key; the peer has none".into(),
            ));
        }
        (AuthMode::Insecure, false) => {
            return Err(refuse(
                "this node runs --insecure without a key; the peer expects one".into(),
            ));
        }
        (AuthMode::Insecure, true) => (f.payload, None),
        (AuthMode::Key(key), false) => {
            let mut hs = noise(&key.psk(), false)?;
            let Some(payload) = read_message(&mut hs, &f.payload) else {
                return Err(refuse(
                    "authentication failed (different cluster key)".into(),
                ));
            };
            (payload, Some(hs))
        }
    };
    // From here on the peer is authentic (or keyless on loopback by agreement).
    let hello: Hello = match decode("hello", &hello_bytes) {
        Ok(h) => h,
        Err(e) => return Err(refuse(e.to_string())),
    };
    let mut answer = if hello.protocol != PROTOCOL_VERSION {
        Err(format!(
            "protocol version mismatch: this node speaks {PROTOCOL_VERSION}, the peer speaks {}",
            hello.protocol
        ))
    } else {
        check(&hello)
    };
    if let Ok(w) = answer.as_mut() {
        w.build = build_id();
        w.peer_timeout_ms = link.peer_timeout.as_millis() as u64;
    }
    let payload = encode(&answer);
    let second = match noise_state.as_mut() {
        Some(hs) => write_message(hs, &payload)?,
        None => payload,
    };
    conn.send(&Frame::new(Kind::Welcome, 0, second))?;
    if let Err(reason) = answer {
        conn.shutdown();
        return Err(WireError::Rejected { peer, reason });
    }
    if hello.build != build_id() {
        tracing::warn!("{peer} runs {}, we run {}", hello.build, build_id());
    }
    establish(&conn, &mut reader, noise_state, link, hello.peer_timeout_ms)?;
    Ok((conn, reader, hello))
}
