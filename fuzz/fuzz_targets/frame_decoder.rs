//! The cluster links' frame decoding: plaintext frames (`frame::read_frame`, the pre-auth and
//! the full payload cap) and sealed ones (`read_sealed_frame`, what every keyed link reads), and
//! the message decoders the receiving ends run on each kind's payload.
//!
//! The first byte picks the form: even, the rest is a raw byte stream read as plaintext frames;
//! odd, frames built by `arbitrary` are sealed by the real writer, damaged at arbitrary places
//! (flipped bits, cuts, inserted bytes, swapped spans) and read back. Properties: an undamaged
//! stream reads back frame for frame and then ends; every frame that comes out of a damaged
//! stream lies wholly before the first damaged byte and equals the frame that was sent.
#![no_main]

use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use cluster::wire::conn::PRE_AUTH_MAX_PAYLOAD;
use cluster::wire::frame::{MAX_PAYLOAD, read_frame};
use cluster::wire::{Frame, read_sealed_frame, seal_frame, transport_pair};
use libfuzzer_sys::fuzz_target;
use moeshard_fuzz::frames;
use snow::StatelessTransportState;

#[derive(Arbitrary, Debug)]
struct Sent {
    kind: u8,
    flags: u32,
    request_id: u64,
    payload: Vec<u8>,
}

#[derive(Arbitrary, Debug)]
enum Damage {
    Flip { at: u32, bit: u8 },
    Cut { at: u32 },
    Insert { at: u32, byte: u8 },
    Swap { a: u32, b: u32, len: u16 },
}

fn pair() -> &'static (StatelessTransportState, StatelessTransportState) {
    static PAIR: OnceLock<(StatelessTransportState, StatelessTransportState)> = OnceLock::new();
    PAIR.get_or_init(|| transport_pair(&[7; 32]).expect("an in-memory handshake"))
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        for max in [PRE_AUTH_MAX_PAYLOAD, MAX_PAYLOAD] {
            let mut r = rest;
            while let Ok(Some(f)) = read_frame(&mut r, max) {
                frames::decode_payload(&f);
            }
        }
        return;
    }
    let mut u = Unstructured::new(rest);
    let (Ok(sent), Ok(damage)) = (
        u.arbitrary::<Vec<Sent>>(),
        u.arbitrary::<Vec<Damage>>(),
    ) else {
        return;
    };
    let sent: Vec<Frame> = sent
        .into_iter()
        .take(16)
        .map(|s| Frame {
            kind: frames::KINDS[s.kind as usize % frames::KINDS.len()],
            flags: s.flags,
            request_id: s.request_id,
            payload: s.payload,
        })
        .collect();
    let (tx, rx) = pair();
    let mut stream = Vec::new();
    let mut ends = Vec::new();
    let mut nonce = 0;
    for f in &sent {
        seal_frame(tx, &mut nonce, f, &mut stream).expect("sealing");
        ends.push(stream.len());
    }
    let clean = stream.clone();
    for d in damage.iter().take(4) {
        match *d {
            Damage::Flip { at, bit } => {
                if !stream.is_empty() {
                    let at = at as usize % stream.len();
                    stream[at] ^= 1 << (bit % 8);
                }
            }
            Damage::Cut { at } => stream.truncate(at as usize % (stream.len() + 1)),
            Damage::Insert { at, byte } => {
                stream.insert(at as usize % (stream.len() + 1), byte);
            }
            Damage::Swap { a, b, len } => {
                let len = (len as usize).min(stream.len() / 2);
                if len == 0 {
                    continue;
                }
                let room = stream.len() - len + 1;
                let (a, b) = (a as usize % room, b as usize % room);
                let (lo, hi) = (a.min(b), a.max(b));
                if hi - lo >= len {
                    let tmp = stream[lo..lo + len].to_vec();
                    stream.copy_within(hi..hi + len, lo);
                    stream[hi..hi + len].copy_from_slice(&tmp);
                }
            }
        }
    }
    // The first byte that differs from what was sent (damage can cancel itself out); a
    // shortened stream differs where it ends.
    let first_damage = match clean.iter().zip(&stream).position(|(x, y)| x != y) {
        Some(i) => i,
        None if stream.len() == clean.len() => usize::MAX,
        None => stream.len().min(clean.len()),
    };
    let mut r = stream.as_slice();
    let mut nonce = 0;
    let mut got = 0;
    loop {
        match read_sealed_frame(&mut r, rx, &mut nonce, MAX_PAYLOAD) {
            Ok(Some(f)) => {
                assert!(got < sent.len(), "more frames came out than went in");
                assert!(
                    ends[got] <= first_damage,
                    "a frame spanning damaged bytes was accepted (frame {got}, ends at {}, damage at {first_damage})",
                    ends[got]
                );
                assert_eq!(f, sent[got], "frame {got} changed on the way");
                frames::decode_payload(&f);
                got += 1;
            }
            Ok(None) => break,
            Err(_) => {
                assert!(first_damage != usize::MAX, "an undamaged stream failed to read");
                break;
            }
        }
    }
    // Every frame wholly before the first damaged byte comes out (all of them when none is).
    let intact = ends.iter().filter(|&&e| e <= first_damage).count();
    assert_eq!(got, intact, "frames before the damage at {first_damage} were lost");
});
