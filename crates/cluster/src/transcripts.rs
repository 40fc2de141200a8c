//! What a cluster coordinator keeps per session: the token transcript (everything it has asked
//! the nodes to evaluate, replayed after a failure), whether every node holds the session, and
//! the cutting of a request into work items — long prompts into chunks, a batch of sessions
//! into one item.

use std::collections::{HashMap, HashSet};

use engine::executor::{EvalRequest, SessionId};
use engine::prefix_hash as hash;
use engine::{EngineError, Result, SeqWork};
use model::LogitsWanted;

/// A work item: its sequences and their tokens, in order.
pub type WorkItem = (Vec<SeqWork>, Vec<u32>);

#[derive(Default)]
pub struct Transcripts {
    tokens: HashMap<SessionId, Vec<u32>>,
    /// Sessions whose state every node holds (the rest are replayed before use).
    synced: HashSet<SessionId>,
}

impl Transcripts {
    pub fn get(&self, s: SessionId) -> &[u32] {
        self.tokens.get(&s).map_or(&[][..], |t| &t[..])
    }

    pub fn contains(&self, s: SessionId) -> bool {
        self.tokens.contains_key(&s)
    }

    pub fn len(&self, s: SessionId) -> usize {
        self.get(s).len()
    }

    /// Fails with `ContextFull` when a request would overflow `n_ctx`.
    pub fn check_fits(&self, batch: &[EvalRequest], n_ctx: usize) -> Result<()> {
        for r in batch {
            let needed = self.len(r.session) + r.tokens.len();
            if needed > n_ctx {
                return Err(EngineError::ContextFull { needed, n_ctx });
            }
        }
        Ok(())
    }

    /// Records a batch that every node has evaluated.
    pub fn commit(&mut self, batch: &[EvalRequest]) {
        for r in batch {
            self.tokens
                .entry(r.session)
                .or_default()
                .extend_from_slice(r.tokens);
        }
    }

    pub fn set(&mut self, s: SessionId, tokens: Vec<u32>) {
        self.tokens.insert(s, tokens);
        self.synced.insert(s);
    }

    pub fn truncate(&mut self, s: SessionId, n: usize) {
        if let Some(t) = self.tokens.get_mut(&s) {
            t.truncate(n);
        }
    }

    pub fn remove(&mut self, s: SessionId) {
        self.tokens.remove(&s);
        self.synced.remove(&s);
    }

    pub fn is_synced(&self, s: SessionId) -> bool {
        self.synced.contains(&s)
    }

    pub fn mark_synced(&mut self, s: SessionId) {
        self.synced.insert(s);
    }

    pub fn mark_stale(&mut self, s: SessionId) {
        self.synced.remove(&s);
    }

    /// After the nodes lost state (a route or group rebuilt): every session needs a replay.
    pub fn mark_all_stale(&mut self) {
        self.synced.clear();
    }

    /// The items that replay a session's whole transcript onto fresh nodes: chunks of `chunk`
    /// tokens, the first resetting the session, the last asking for its logits.
    pub fn replay_items(&self, s: SessionId, chunk: usize) -> Vec<WorkItem> {
        chunk_items(s, &[], self.get(s), chunk, LogitsWanted::Last, true)
    }

    /// The items of one evaluation: a single request in chunks (so pipeline stages overlap and
    /// memory stays bounded), several requests (decode steps) as one item.
    pub fn eval_items(&self, batch: &[EvalRequest], chunk: usize) -> Vec<WorkItem> {
        if let [r] = batch {
            return chunk_items(
                r.session,
                self.get(r.session),
                r.tokens,
                chunk,
                r.logits,
                false,
            );
        }
        let mut seqs = Vec::with_capacity(batch.len());
        let mut tokens = Vec::new();
        for r in batch {
            let prev = self.get(r.session);
            seqs.push(SeqWork {
                session: r.session,
                pos0: prev.len() as u32,
                n_tokens: r.tokens.len() as u32,
                reset: false,
                hash_before: hash::of(prev),
                logits: SeqWork::code(r.logits),
            });
            tokens.extend_from_slice(r.tokens);
        }
        vec![(seqs, tokens)]
    }
}

/// `tokens` appended after `prev`, in chunks; logits as `wanted` asks (for `Last`, only the
/// final chunk's last token).
fn chunk_items(
    session: SessionId,
    prev: &[u32],
    tokens: &[u32],
    chunk: usize,
    wanted: LogitsWanted,
    reset_first: bool,
) -> Vec<WorkItem> {
    let chunk = chunk.max(1);
    let n_chunks = tokens.len().div_ceil(chunk).max(1);
    let mut hash = hash::of(prev);
    let mut items = Vec::with_capacity(n_chunks);
    for (c, part) in tokens.chunks(chunk).enumerate() {
        let last = c + 1 == n_chunks;
        let logits = match wanted {
            LogitsWanted::All => 2,
            LogitsWanted::Last if last => 1,
            _ => 0,
        };
        items.push((
            vec![SeqWork {
                session,
                pos0: (prev.len() + c * chunk) as u32,
                n_tokens: part.len() as u32,
                reset: reset_first && c == 0,
                hash_before: hash,
                logits,
            }],
            part.to_vec(),
        ));
        hash = hash::extend(hash, part);
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_carry_positions_hashes_and_logits() {
        let mut t = Transcripts::default();
        let first = [1u32, 2, 3];
        t.commit(&[EvalRequest {
            session: 7,
            tokens: &first,
            logits: LogitsWanted::Last,
        }]);
        let more = [4u32, 5, 6, 7, 8];
        let items = t.eval_items(
            &[EvalRequest {
                session: 7,
                tokens: &more,
                logits: LogitsWanted::Last,
            }],
            2,
        );
        assert_eq!(items.len(), 3);
        assert_eq!(items[1].0[0].pos0, 5);
        assert_eq!(items[1].0[0].hash_before, hash::of(&[1, 2, 3, 4, 5]));
        assert_eq!(
            items.iter().map(|i| i.0[0].logits).collect::<Vec<_>>(),
            vec![0, 0, 1]
        );
        let replay = t.replay_items(7, 2);
        assert!(replay[0].0[0].reset && !replay[1].0[0].reset);
    }
}
