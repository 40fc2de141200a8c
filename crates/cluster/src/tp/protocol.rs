//! Messages between the tensor-parallel coordinator (rank 0) and its ranks. Commands travel on
//! each rank's control link and every rank executes them in the same order (lockstep);
//! partial sums travel on the data mesh.

use engine::SeqWork;
use serde::{Deserialize, Serialize};

use super::placement::Share;
use crate::wire::{Connection, Frame, Kind, WireError, pack, unpack};

/// Coordinator → rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum TpCommand {
    /// Form group `epoch`: `peers[r]` is rank r's data address; `share` the experts this
    /// rank computes. Ranks connect to lower ranks and accept higher ones, then answer `Ready`.
    Start {
        epoch: u64,
        n_ranks: u32,
        peers: Vec<String>,
        share: Share,
    },
    /// Evaluate a batch (every rank runs the same tokens); answer with this rank's logits slice.
    Eval {
        step: u64,
        seqs: Vec<SeqWork>,
        tokens: Vec<u32>,
    },
    Destroy {
        session: u64,
    },
    /// Drop every session (before a replay).
    Reset,
    /// Send this rank's KV (its kv heads) of every layer for the first `n` positions.
    Snapshot {
        step: u64,
        session: u64,
        n: u32,
    },
    /// Replace a session: tokens, then this rank's share of every layer.
    Restore {
        step: u64,
        session: u64,
        tokens: Vec<u32>,
        layers: Vec<(Vec<u8>, Vec<u8>)>,
    },
    Shutdown,
}

/// Rank → coordinator.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum TpReply {
    Ready {
        epoch: u64,
    },
    StartFailed {
        epoch: u64,
        detail: String,
    },
    /// `n_rows` rows of this rank's vocabulary slice follow as raw f32.
    Logits {
        step: u64,
        n_rows: u32,
        n_vocab: u32,
        vocab_offset: u32,
        exchanges: u32,
        exchange_us: u64,
    },
    Failed {
        step: u64,
        detail: String,
    },
    Snapshot {
        step: u64,
        layers: Vec<(Vec<u8>, Vec<u8>)>,
    },
    Restored {
        step: u64,
    },
}

/// Sends a command to a rank.
pub fn send_command(conn: &Connection, step: u64, cmd: &TpCommand) -> Result<(), WireError> {
    conn.send(&pack(Kind::TpOp, step, cmd, &[]))
}

/// Sends a reply (with raw bytes: logits rows) to the coordinator.
pub fn send_reply(conn: &Connection, reply: &TpReply, raw: &[u8]) -> Result<(), WireError> {
    conn.send(&pack(Kind::TpDone, 0, reply, raw))
}

/// The reply a frame from a rank carries (`None` for other frames), for `Member::wait`.
pub fn reply_of(f: Frame) -> Option<Result<(TpReply, Vec<u8>), WireError>> {
    if f.kind != Kind::TpDone {
        return Some(Err(WireError::Unexpected {
            expected: Kind::TpDone,
            got: f.kind,
        }));
    }
    Some(unpack::<TpReply>("tp reply", &f.payload).map(|(r, raw)| (r, raw.to_vec())))
}
