//! Frames whose payload is a postcard header followed by raw bytes (tensors, logits):
//! `[u32 header length][postcard header][raw bytes]`. Used by the pipeline's data path and the
//! tensor-parallel control links alike.

use serde::{Deserialize, Serialize};

use super::{Frame, Kind, WireError, decode, encode};

/// A frame of `kind` carrying `header` then `raw`.
pub fn pack<T: Serialize>(kind: Kind, request_id: u64, header: &T, raw: &[u8]) -> Frame {
    let h = encode(header);
    let mut payload = Vec::with_capacity(4 + h.len() + raw.len());
    payload.extend_from_slice(&(h.len() as u32).to_le_bytes());
    payload.extend_from_slice(&h);
    payload.extend_from_slice(raw);
    Frame::new(kind, request_id, payload)
}

/// The header and the raw bytes of a [`pack`]ed payload, naming `what` on error.
pub fn unpack<'a, T: Deserialize<'a>>(
    what: &'static str,
    payload: &'a [u8],
) -> Result<(T, &'a [u8]), WireError> {
    let Some((len, rest)) = payload.split_first_chunk::<4>() else {
        return Err(WireError::Decode {
            what,
            detail: "payload shorter than its header length".into(),
        });
    };
    let n = u32::from_le_bytes(*len) as usize;
    if n > rest.len() {
        return Err(WireError::Decode {
            what,
            detail: format!("header of {n} bytes in a payload of {}", payload.len()),
        });
    }
    let (header, raw) = rest.split_at(n);
    Ok((decode(what, header)?, raw))
}

/// Raw little-endian f32 values (logits rows).
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The f32 values of raw little-endian bytes (a trailing partial value is ignored).
pub fn f32_values(raw: &[u8]) -> Vec<f32> {
    raw.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_round_trips_and_short_payloads_are_errors() {
        let f = pack(Kind::Work, 9, &(7u32, "x".to_string()), &[1, 2, 3]);
        let ((a, b), raw): ((u32, String), &[u8]) = unpack("t", &f.payload).unwrap();
        assert_eq!((a, b.as_str(), raw), (7, "x", &[1u8, 2, 3][..]));
        assert!(unpack::<u32>("t", &[1, 0]).is_err());
        assert!(unpack::<u32>("t", &[200, 0, 0, 0, 1]).is_err());
        assert_eq!(f32_values(&f32_bytes(&[1.5, -2.0])), vec![1.5, -2.0]);
    }
}
