//! A framed connection over TCP: a writer shared by threads (one frame at a time) and a reader
//! owned by one thread. `TCP_NODELAY` is on: frames are latency-bound, not throughput-bound.

use std::io::{BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::frame::{Frame, Kind, read_frame};
use super::{WireError, decode, encode};

/// The sending half (cheap to clone).
#[derive(Clone)]
pub struct Connection {
    writer: Arc<Mutex<TcpStream>>,
    peer: SocketAddr,
    local: SocketAddr,
}

/// The receiving half.
pub struct ConnectionReader {
    reader: BufReader<TcpStream>,
    peer: SocketAddr,
}

impl Connection {
    pub fn new(stream: TcpStream) -> Result<(Connection, ConnectionReader), WireError> {
        stream.set_nodelay(true)?;
        let peer = stream.peer_addr()?;
        let local = stream.local_addr()?;
        let reader = BufReader::with_capacity(1 << 16, stream.try_clone()?);
        Ok((
            Connection {
                writer: Arc::new(Mutex::new(stream)),
                peer,
                local,
            },
            ConnectionReader { reader, peer },
        ))
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    pub fn local(&self) -> SocketAddr {
        self.local
    }

    pub fn send(&self, frame: &Frame) -> Result<(), WireError> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        // Header and payload in one write when small, to keep a frame in one segment.
        if frame.payload.len() <= 4096 {
            let mut buf = Vec::with_capacity(super::frame::HEADER_LEN + frame.payload.len());
            frame.write_to(&mut buf)?;
            w.write_all(&buf)?;
        } else {
            frame.write_to(&mut *w)?;
        }
        Ok(())
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
        let w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let _ = w.shutdown(Shutdown::Both);
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> Result<(), WireError> {
        Ok(self
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_write_timeout(t)?)
    }
}

impl ConnectionReader {
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The next frame; `Err(Closed)` at a clean end of stream. An `Error` frame from the peer
    /// becomes `Err(Remote)`.
    pub fn recv(&mut self) -> Result<Frame, WireError> {
        match read_frame(&mut self.reader)? {
            None => Err(WireError::Closed),
            Some(f) if f.kind == Kind::Error => {
                let msg: String = decode("error message", &f.payload)
                    .unwrap_or_else(|_| "(undecodable error)".into());
                Err(WireError::Remote(msg))
            }
            Some(f) => Ok(f),
        }
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

    pub fn set_read_timeout(&self, t: Option<Duration>) -> Result<(), WireError> {
        Ok(self.reader.get_ref().set_read_timeout(t)?)
    }
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
