//! Frames: a fixed little-endian header (magic, protocol version, kind, flags, request id,
//! payload length) and a payload. Reading checks the magic and version before trusting the
//! length, caps the length, and tells a clean end of stream (`Ok(None)`) from a torn frame.

use std::io::{self, Read, Write};

use super::WireError;

pub const MAGIC: [u8; 4] = *b"MSHD";
/// Bumped on any incompatible change to frames or messages (2: Noise handshake and sealed
/// frames, heartbeats; 3: a rank's hello names the experts its shard file holds; 4: a rank's
/// start command carries its expert share, placements planned from routing included).
pub const PROTOCOL_VERSION: u16 = 4;
pub const HEADER_LEN: usize = 28;
/// Largest payload accepted from an authenticated peer (hidden states of a long chunk,
/// all-position logits, a layer's KV).
pub const MAX_PAYLOAD: u64 = 1 << 30;
/// Flag of a `Hello` frame: the sender runs without a key (plaintext hello).
pub const FLAG_KEYLESS: u32 = 1;

/// Message kinds. Unknown kinds are an error (and close the connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Kind {
    /// The first handshake message (Noise message 1, or a plaintext hello when keyless).
    Hello = 1,
    /// The second handshake message (Noise message 2 carrying the welcome or the refusal).
    Welcome = 4,
    /// A refusal before the peer authenticated (reasons that reveal nothing of the key).
    Reject = 5,
    Error = 6,
    /// A heartbeat: proof of life on a quiet link, consumed by the reader.
    Ping = 7,
    Pong = 8,
    Route = 10,
    Work = 11,
    WorkResult = 12,
    SessionOp = 13,
    SessionOpDone = 14,
    SnapshotPart = 15,
    TpExchange = 21,
    TpOp = 22,
    TpDone = 23,
}

impl Kind {
    pub fn from_u16(v: u16) -> Option<Kind> {
        use Kind::*;
        [
            Hello,
            Welcome,
            Reject,
            Error,
            Ping,
            Pong,
            Route,
            Work,
            WorkResult,
            SessionOp,
            SessionOpDone,
            SnapshotPart,
            TpExchange,
            TpOp,
            TpDone,
        ]
        .into_iter()
        .find(|k| *k as u16 == v)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u16,
    pub kind: Kind,
    pub flags: u32,
    pub request_id: u64,
    pub len: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: Kind,
    pub flags: u32,
    pub request_id: u64,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn new(kind: Kind, request_id: u64, payload: Vec<u8>) -> Frame {
        Frame {
            kind,
            flags: 0,
            request_id,
            payload,
        }
    }

    pub fn encode_header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        h[8..12].copy_from_slice(&self.flags.to_le_bytes());
        h[12..20].copy_from_slice(&self.request_id.to_le_bytes());
        h[20..28].copy_from_slice(&(self.payload.len() as u64).to_le_bytes());
        h
    }

    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        w.write_all(&self.encode_header())?;
        w.write_all(&self.payload)
    }
}

/// Parses a header, checking magic, version, kind and the length cap `max`.
pub fn parse_header(h: &[u8; HEADER_LEN], max: u64) -> Result<Header, WireError> {
    if h[0..4] != MAGIC {
        return Err(WireError::NotOurProtocol {
            first_bytes: h[..8].to_vec(),
        });
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: version,
        });
    }
    let kind_raw = u16::from_le_bytes([h[6], h[7]]);
    let kind = Kind::from_u16(kind_raw).ok_or(WireError::UnknownKind(kind_raw))?;
    let len = u64::from_le_bytes(h[20..28].try_into().expect("8 bytes"));
    if len > max {
        return Err(WireError::TooLarge { len, max });
    }
    Ok(Header {
        version,
        kind,
        flags: u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")),
        request_id: u64::from_le_bytes(h[12..20].try_into().expect("8 bytes")),
        len,
    })
}

/// Reads one plaintext frame of at most `max` payload bytes. `Ok(None)` on a clean end of
/// stream before any byte of a header.
pub fn read_frame(r: &mut impl Read, max: u64) -> Result<Option<Frame>, WireError> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(WireError::Truncated {
                    what: "frame header",
                    got,
                    want: HEADER_LEN as u64,
                });
            }
            Ok(n) => {
                got += n;
                // Reject non-protocol bytes as soon as the magic is visible.
                if got >= 4 && h[0..4] != MAGIC {
                    return Err(WireError::NotOurProtocol {
                        first_bytes: h[..got.min(8)].to_vec(),
                    });
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    let header = parse_header(&h, max)?;
    // Grown as bytes arrive (not allocated from the declared length up front), so a header
    // alone cannot make the reader allocate a large buffer.
    let mut payload = Vec::with_capacity((header.len as usize).min(1 << 16));
    let got = r
        .by_ref()
        .take(header.len)
        .read_to_end(&mut payload)
        .map_err(WireError::Io)?;
    if (got as u64) < header.len {
        return Err(WireError::Truncated {
            what: "frame payload",
            got,
            want: header.len,
        });
    }
    Ok(Some(Frame {
        kind: header.kind,
        flags: header.flags,
        request_id: header.request_id,
        payload,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_clean_eof() {
        let f = Frame {
            kind: Kind::Work,
            flags: 3,
            request_id: 42,
            payload: vec![1, 2, 3],
        };
        let mut buf = Vec::new();
        f.write_to(&mut buf).unwrap();
        f.write_to(&mut buf).unwrap();
        let mut r = buf.as_slice();
        assert_eq!(read_frame(&mut r, MAX_PAYLOAD).unwrap(), Some(f.clone()));
        assert_eq!(read_frame(&mut r, MAX_PAYLOAD).unwrap(), Some(f));
        assert_eq!(read_frame(&mut r, MAX_PAYLOAD).unwrap(), None);
    }

    #[test]
    fn garbage_torn_frames_versions_and_huge_lengths_are_errors() {
        assert!(matches!(
            read_frame(&mut &b"GET / HTTP/1.1\r\n\r\n"[..], MAX_PAYLOAD),
            Err(WireError::NotOurProtocol { .. })
        ));
        let f = Frame::new(Kind::Ping, 1, vec![9; 10]);
        let mut buf = Vec::new();
        f.write_to(&mut buf).unwrap();
        for cut in 1..buf.len() {
            assert!(
                read_frame(&mut &buf[..cut], MAX_PAYLOAD).is_err(),
                "cut {cut}"
            );
        }
        let mut v = buf.clone();
        v[4] = 99;
        assert!(matches!(
            read_frame(&mut v.as_slice(), MAX_PAYLOAD),
            Err(WireError::VersionMismatch { theirs: 99, .. })
        ));
        let mut v = buf.clone();
        v[20..28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            read_frame(&mut v.as_slice(), MAX_PAYLOAD),
            Err(WireError::TooLarge { .. })
        ));
        let mut v = buf;
        v[6] = 0xEE;
        assert!(matches!(
            read_frame(&mut v.as_slice(), MAX_PAYLOAD),
            Err(WireError::UnknownKind(_))
        ));
    }
}
