//! A framed connection over TCP: a writer shared by threads (one frame at a time) and a reader
//! owned by one thread. `TCP_NODELAY` is on: frames are latency-bound, not throughput-bound.
//!
//! After the handshake of a keyed link every frame travels as Noise transport records: the
//! 28-byte header sealed into one record, then the payload in records of at most
//! [`RECORD_PLAIN`] bytes, each with its own nonce (a counter per direction), so a record that
//! is altered, dropped, replayed or reordered fails authentication and ends the link.
//!
//! Liveness: once established, each side sends a heartbeat (a `Ping` frame) when it has sent
//! nothing for a quarter of the peer timeout, from a thread of its own (so a long computation
//! does not silence it), reads with the peer timeout as deadline, writes with it as deadline,
//! and has TCP keepalive on. A stopped, half-open or partitioned peer therefore surfaces as
//! [`WireError::Silent`] within the timeout. Heartbeats are consumed by `recv`.

use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use snow::StatelessTransportState;

use super::frame::{Frame, HEADER_LEN, Kind, MAX_PAYLOAD, parse_header, read_frame};
use super::{WireError, decode, encode};

/// Plaintext bytes of one Noise transport record (the protocol's 65535-byte message limit
/// less the 16-byte tag).
pub const RECORD_PLAIN: usize = 65535 - TAG;
const TAG: usize = 16;
/// Payload cap before the peer has authenticated: a hello, a welcome, a refusal.
pub const PRE_AUTH_MAX_PAYLOAD: u64 = 64 * 1024;
/// Sealed records are written in batches of about this many bytes.
const WRITE_BATCH: usize = 1 << 20;

type Cipher = Arc<StatelessTransportState>;

struct Writer {
    stream: TcpStream,
    cipher: Option<Cipher>,
    nonce: u64,
    buf: Vec<u8>,
    last_send: Instant,
}

/// The sending half (cheap to clone).
#[derive(Clone)]
pub struct Connection {
    writer: Arc<Mutex<Writer>>,
    closed: Arc<AtomicBool>,
    peer: SocketAddr,
    local: SocketAddr,
}

/// A stream whose reads stop at a deadline (the handshake's), else at the idle timeout set
/// on the socket.
struct Timed {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(d) = self.deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "handshake deadline",
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        self.stream.read(buf)
    }
}

/// The receiving half.
pub struct ConnectionReader {
    reader: BufReader<Timed>,
    cipher: Option<Cipher>,
    nonce: u64,
    peer: SocketAddr,
    max_payload: u64,
    /// How long the peer may stay silent (`None`: forever).
    idle: Option<Duration>,
}

impl Connection {
    /// A plaintext connection with the pre-authentication payload cap (the handshake's).
    pub fn new(stream: TcpStream) -> Result<(Connection, ConnectionReader), WireError> {
        stream.set_nodelay(true)?;
        let peer = stream.peer_addr()?;
        let local = stream.local_addr()?;
        let timed = Timed {
            stream: stream.try_clone()?,
            deadline: None,
        };
        Ok((
            Connection {
                writer: Arc::new(Mutex::new(Writer {
                    stream,
                    cipher: None,
                    nonce: 0,
                    buf: Vec::new(),
                    last_send: Instant::now(),
                })),
                closed: Arc::new(AtomicBool::new(false)),
                peer,
                local,
            },
            ConnectionReader {
                reader: BufReader::with_capacity(1 << 16, timed),
                cipher: None,
                nonce: 0,
                peer,
                max_payload: PRE_AUTH_MAX_PAYLOAD,
                idle: None,
            },
        ))
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    pub fn local(&self) -> SocketAddr {
        self.local
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Writer> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn send(&self, frame: &Frame) -> Result<(), WireError> {
        let mut w = self.lock();
        let r = w.send(frame);
        if r.is_err() {
            self.closed.store(true, Ordering::Release);
        }
        r
    }

    pub fn send_msg<T: serde::Serialize>(
        &self,
        kind: Kind,
        request_id: u64,
        msg: &T,
    ) -> Result<(), WireError> {
        self.send(&Frame::new(kind, request_id, encode(msg)))
    }

    /// Sends an error frame (best effort) naming why the peer is being dropped.
    pub fn send_error(&self, request_id: u64, message: &str) {
        let _ = self.send_msg(Kind::Error, request_id, &message.to_string());
    }

    pub fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        let _ = self.lock().stream.shutdown(Shutdown::Both);
    }

    /// Frames from now on are sealed with `cipher` (after a keyed handshake).
    pub(super) fn secure(&self, cipher: Cipher) {
        let mut w = self.lock();
        w.cipher = Some(cipher);
        w.nonce = 0;
    }

    /// Write deadline, TCP keepalive and a heartbeat thread for an established link; the
    /// heartbeats come often enough for a peer that waits at most `beat_for`.
    pub(super) fn keep_alive(
        &self,
        peer_timeout: Duration,
        beat_for: Duration,
    ) -> Result<(), WireError> {
        {
            let w = self.lock();
            w.stream.set_write_timeout(Some(peer_timeout))?;
            // The kernel counts keepalive in whole seconds (0 is invalid).
            let keepalive = socket2::TcpKeepalive::new()
                .with_time(peer_timeout.max(Duration::from_secs(1)))
                .with_interval((peer_timeout / 4).max(Duration::from_secs(1)));
            socket2::SockRef::from(&w.stream).set_tcp_keepalive(&keepalive)?;
        }
        let writer: Weak<Mutex<Writer>> = Arc::downgrade(&self.writer);
        let closed = Arc::clone(&self.closed);
        let every = (beat_for / 4).max(Duration::from_millis(50));
        let peer = self.peer;
        std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || heartbeats(writer, closed, every, peer))?;
        Ok(())
    }
}

/// Sends a `Ping` whenever the link has been quiet for `every`, until the connection is shut
/// down, fails, or every handle to it is gone.
fn heartbeats(
    writer: Weak<Mutex<Writer>>,
    closed: Arc<AtomicBool>,
    every: Duration,
    peer: SocketAddr,
) {
    let ping = Frame::new(Kind::Ping, 0, Vec::new());
    loop {
        std::thread::sleep(every / 2);
        if closed.load(Ordering::Acquire) {
            return;
        }
        let Some(w) = writer.upgrade() else { return };
        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
        if w.last_send.elapsed() >= every
            && let Err(e) = w.send(&ping)
        {
            tracing::debug!("heartbeat to {peer} failed: {e}");
            closed.store(true, Ordering::Release);
            return;
        }
    }
}

impl Writer {
    fn send(&mut self, frame: &Frame) -> Result<(), WireError> {
        let r = match self.cipher.clone() {
            None => self.send_plain(frame),
            Some(c) => self.send_sealed(&c, frame),
        };
        self.last_send = Instant::now();
        r.map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => WireError::Stalled,
            _ => WireError::Io(e),
        })
    }

    fn send_plain(&mut self, frame: &Frame) -> io::Result<()> {
        // Header and payload in one write when small, to keep a frame in one segment.
        if frame.payload.len() <= 4096 {
            self.buf.clear();
            frame.write_to(&mut self.buf)?;
            self.stream.write_all(&self.buf)
        } else {
            frame.write_to(&mut self.stream)
        }
    }

    fn seal(&mut self, cipher: &Cipher, plain: &[u8]) -> io::Result<()> {
        seal_record(cipher, &mut self.nonce, plain, &mut self.buf)
    }

    fn send_sealed(&mut self, cipher: &Cipher, frame: &Frame) -> io::Result<()> {
        self.buf.clear();
        self.seal(cipher, &frame.encode_header())?;
        for chunk in frame.payload.chunks(RECORD_PLAIN) {
            self.seal(cipher, chunk)?;
            if self.buf.len() >= WRITE_BATCH {
                self.stream.write_all(&self.buf)?;
                self.buf.clear();
            }
        }
        self.stream.write_all(&self.buf)?;
        if self.buf.capacity() > 4 * WRITE_BATCH {
            self.buf = Vec::new();
        }
        Ok(())
    }
}

impl ConnectionReader {
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Reads stop at `deadline` (the handshake's), whatever the peer sends meanwhile.
    pub(super) fn set_deadline(&mut self, deadline: Option<Instant>) -> Result<(), WireError> {
        self.reader.get_mut().deadline = deadline;
        if deadline.is_none() {
            self.reader.get_ref().stream.set_read_timeout(self.idle)?;
        }
        Ok(())
    }

    /// An authenticated link: frames up to the full cap, read with `peer_timeout` as the
    /// longest silence, sealed with `cipher` when the link is keyed.
    pub(super) fn established(
        &mut self,
        cipher: Option<Cipher>,
        peer_timeout: Duration,
    ) -> Result<(), WireError> {
        self.cipher = cipher;
        self.nonce = 0;
        self.max_payload = MAX_PAYLOAD;
        self.idle = Some(peer_timeout);
        self.set_deadline(None)
    }

    /// The next frame other than a heartbeat; `Err(Closed)` at a clean end of stream,
    /// `Err(Silent)` when the peer sent nothing (not even a heartbeat) for the peer timeout.
    /// An `Error` frame from the peer becomes `Err(Remote)`.
    pub fn recv(&mut self) -> Result<Frame, WireError> {
        loop {
            let f = self.read_one().map_err(|e| match e {
                WireError::Io(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    match self.idle {
                        Some(after) if self.reader.get_ref().deadline.is_none() => {
                            WireError::Silent { after }
                        }
                        _ => WireError::Io(e),
                    }
                }
                e => e,
            })?;
            match f.kind {
                Kind::Ping | Kind::Pong => continue,
                Kind::Error => {
                    let msg: String = decode("error message", &f.payload)
                        .unwrap_or_else(|_| "(undecodable error)".into());
                    return Err(WireError::Remote(msg));
                }
                _ => return Ok(f),
            }
        }
    }

    fn read_one(&mut self) -> Result<Frame, WireError> {
        let Some(cipher) = self.cipher.clone() else {
            return read_frame(&mut self.reader, self.max_payload)?.ok_or(WireError::Closed);
        };
        let peer = self.peer;
        read_sealed_frame(&mut self.reader, &cipher, &mut self.nonce, self.max_payload)
            .map_err(|e| match e {
                WireError::Auth(what) => WireError::Auth(format!("{what} (from {peer})")),
                e => e,
            })?
            .ok_or(WireError::Closed)
    }

    /// The next frame, which must be of `kind`.
    pub fn expect(&mut self, kind: Kind) -> Result<Frame, WireError> {
        let f = self.recv()?;
        if f.kind == kind {
            Ok(f)
        } else {
            Err(WireError::Unexpected {
                expected: kind,
                got: f.kind,
            })
        }
    }
}

/// Seals one Noise transport record of `plain` (at most [`RECORD_PLAIN`] bytes) with the
/// next nonce and appends it to `out`.
pub fn seal_record(
    cipher: &StatelessTransportState,
    nonce: &mut u64,
    plain: &[u8],
    out: &mut Vec<u8>,
) -> io::Result<()> {
    let at = out.len();
    out.resize(at + plain.len() + TAG, 0);
    cipher
        .write_message(*nonce, plain, &mut out[at..])
        .map_err(|e| io::Error::other(format!("sealing a record: {e}")))?;
    *nonce += 1;
    Ok(())
}

/// Appends `frame` as sealed records (the header in one, the payload in records of at most
/// [`RECORD_PLAIN`] bytes): what a keyed link carries.
pub fn seal_frame(
    cipher: &StatelessTransportState,
    nonce: &mut u64,
    frame: &Frame,
    out: &mut Vec<u8>,
) -> io::Result<()> {
    seal_record(cipher, nonce, &frame.encode_header(), out)?;
    for chunk in frame.payload.chunks(RECORD_PLAIN) {
        seal_record(cipher, nonce, chunk, out)?;
    }
    Ok(())
}

/// Reads one sealed frame of at most `max` payload bytes; `Ok(None)` at a clean end of stream
/// before its first byte. The payload grows record by record as the records authenticate, so
/// a header that declares a large frame costs nothing until its bytes arrive.
pub fn read_sealed_frame(
    r: &mut impl Read,
    cipher: &StatelessTransportState,
    nonce: &mut u64,
    max: u64,
) -> Result<Option<Frame>, WireError> {
    let mut sealed = [0u8; HEADER_LEN + TAG];
    if !read_full(r, &mut sealed, "sealed frame header", true)? {
        return Ok(None);
    }
    let mut h = [0u8; HEADER_LEN];
    open_record(cipher, nonce, &sealed, &mut h)?;
    let header = parse_header(&h, max)?;
    let len = header.len as usize;
    let mut payload = Vec::new();
    let mut record = vec![0u8; RECORD_PLAIN.min(len) + TAG];
    while payload.len() < len {
        let n = RECORD_PLAIN.min(len - payload.len());
        let rec = &mut record[..n + TAG];
        read_full(r, rec, "sealed frame payload", false)?;
        let at = payload.len();
        payload.resize(at + n, 0);
        open_record(cipher, nonce, rec, &mut payload[at..])?;
    }
    Ok(Some(Frame {
        kind: header.kind,
        flags: header.flags,
        request_id: header.request_id,
        payload,
    }))
}

fn open_record(
    cipher: &StatelessTransportState,
    nonce: &mut u64,
    sealed: &[u8],
    plain: &mut [u8],
) -> Result<(), WireError> {
    let n = cipher.read_message(*nonce, sealed, plain).map_err(|_| {
        WireError::Auth("a record failed authentication (altered, replayed or out of order)".into())
    })?;
    *nonce += 1;
    if n != plain.len() {
        return Err(WireError::Auth("a record of the wrong length".into()));
    }
    Ok(())
}

/// Fills `buf`; `Ok(false)` when the stream ended cleanly before its first byte and
/// `clean_eof` allows that.
fn read_full(
    r: &mut impl Read,
    buf: &mut [u8],
    what: &'static str,
    clean_eof: bool,
) -> Result<bool, WireError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 && clean_eof => return Ok(false),
            Ok(0) => {
                return Err(WireError::Truncated {
                    what,
                    got,
                    want: buf.len() as u64,
                });
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(true)
}

/// How long dialing a peer may take before it counts as unreachable.
pub const DIAL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Resolves `addr` (`host:port`) and connects within [`DIAL_TIMEOUT`]; errors name the address.
pub fn dial(addr: &str) -> std::io::Result<TcpStream> {
    let context = |e: std::io::Error| std::io::Error::new(e.kind(), format!("{addr}: {e}"));
    let sock = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(context)?
        .next()
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{addr} resolves to no address"),
            )
        })?;
    TcpStream::connect_timeout(&sock, DIAL_TIMEOUT)
        .map_err(|e| std::io::Error::new(e.kind(), format!("connecting {addr}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_frames_round_trip_and_any_altered_byte_fails() {
        let (tx, rx) = crate::wire::transport_pair(&[7; 32]).unwrap();
        let frames = [
            Frame::new(Kind::Work, 1, vec![]),
            Frame::new(
                Kind::WorkResult,
                2,
                (0..=255).cycle().take(RECORD_PLAIN + 9).collect(),
            ),
            Frame::new(Kind::Ping, 3, vec![1, 2, 3]),
        ];
        let mut stream = Vec::new();
        let mut nonce = 0;
        for f in &frames {
            seal_frame(&tx, &mut nonce, f, &mut stream).unwrap();
        }
        let mut r = stream.as_slice();
        let mut n = 0;
        for f in &frames {
            let got = read_sealed_frame(&mut r, &rx, &mut n, MAX_PAYLOAD).unwrap();
            assert_eq!(got.as_ref(), Some(f));
        }
        assert!(
            read_sealed_frame(&mut r, &rx, &mut n, MAX_PAYLOAD)
                .unwrap()
                .is_none()
        );
        // Any flipped bit is caught before a frame is handed out.
        for at in (0..stream.len()).step_by(997) {
            let mut bad = stream.clone();
            bad[at] ^= 0x10;
            let mut r = bad.as_slice();
            let mut n = 0;
            let mut seen = 0;
            let err = loop {
                match read_sealed_frame(&mut r, &rx, &mut n, MAX_PAYLOAD) {
                    Ok(Some(f)) => {
                        assert_eq!(f, frames[seen], "an altered stream gave another frame");
                        seen += 1;
                    }
                    Ok(None) => panic!("flip at {at} went unnoticed"),
                    Err(e) => break e,
                }
            };
            assert!(matches!(err, WireError::Auth(_)), "flip at {at}: {err}");
        }
        // A header beyond the cap is refused without reading on.
        let mut big = Vec::new();
        let mut nonce = 0;
        let f = Frame::new(Kind::Work, 9, vec![0; 100]);
        seal_frame(&tx, &mut nonce, &f, &mut big).unwrap();
        let mut n = 0;
        assert!(matches!(
            read_sealed_frame(&mut big.as_slice(), &rx, &mut n, 50),
            Err(WireError::TooLarge { len: 100, max: 50 })
        ));
    }
}
