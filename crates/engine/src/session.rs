//! Sessions over an executor: a session's token history mirrors what the executor has cached,
//! so a new prompt that extends the history (the next chat turn) only evaluates its new tail.

use model::LogitsWanted;

use crate::error::{EngineError, Result};
use crate::executor::{EvalRequest, EvalResult, Executor, ModelInfo, SessionId};
use crate::snapshot::Snapshot;

/// Prompts are evaluated in chunks of this many tokens so one long prompt does not need
/// activations for all its tokens at once.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// One conversation's state as the engine sees it.
#[derive(Debug)]
pub struct Session {
    pub id: SessionId,
    /// Every token the executor holds for this session, in order.
    pub tokens: Vec<u32>,
    /// Logits after the last token (empty before the first evaluation).
    pub last_logits: Vec<f32>,
}

/// Owns an executor and hands out sessions.
pub struct Engine {
    exec: Box<dyn Executor>,
    next_id: SessionId,
    pub prefill_chunk: usize,
}

impl Engine {
    pub fn new(exec: Box<dyn Executor>) -> Engine {
        Engine {
            exec,
            next_id: 1,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }

    pub fn info(&self) -> &ModelInfo {
        self.exec.info()
    }

    pub fn executor(&self) -> &dyn Executor {
        self.exec.as_ref()
    }

    pub fn executor_mut(&mut self) -> &mut dyn Executor {
        self.exec.as_mut()
    }

    pub fn new_session(&mut self) -> Session {
        let id = self.next_id;
        self.next_id += 1;
        Session {
            id,
            tokens: Vec::new(),
            last_logits: Vec::new(),
        }
    }

    pub fn close(&mut self, s: Session) {
        self.exec.destroy(s.id);
    }

    /// Logits at every position of `tokens` evaluated in one pass on a fresh session, which is
    /// closed afterwards (`logits`, `perplexity`).
    pub fn all_logits(&mut self, tokens: &[u32]) -> Result<EvalResult> {
        let session = self.new_session();
        let req = EvalRequest {
            session: session.id,
            tokens,
            logits: LogitsWanted::All,
        };
        let out = self.exec.eval(std::slice::from_ref(&req));
        self.close(session);
        let out = out?
            .pop()
            .ok_or_else(|| EngineError::Executor("no result for the request".into()))?;
        if out.n_rows != tokens.len() {
            return Err(EngineError::Executor(format!(
                "expected {} rows of logits, got {}",
                tokens.len(),
                out.n_rows
            )));
        }
        Ok(out)
    }

    /// Appends `tokens` to the session (chunked) and keeps the logits after the last one.
    pub fn append(&mut self, s: &mut Session, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        let n_ctx = self.info().n_ctx;
        if s.tokens.len() + tokens.len() > n_ctx {
            return Err(EngineError::ContextFull {
                needed: s.tokens.len() + tokens.len(),
                n_ctx,
            });
        }
        let chunk_len = if self.exec.chunks_long_evals() {
            tokens.len()
        } else {
            self.prefill_chunk.max(1)
        };
        for chunk in tokens.chunks(chunk_len) {
            let req = EvalRequest {
                session: s.id,
                tokens: chunk,
                logits: LogitsWanted::Last,
            };
            let mut out = self.exec.eval(std::slice::from_ref(&req))?;
            let r = out
                .pop()
                .ok_or_else(|| EngineError::Executor("no result for the request".into()))?;
            s.tokens.extend_from_slice(chunk);
            s.last_logits = r.last().map(<[f32]>::to_vec).unwrap_or_default();
        }
        Ok(())
    }

    /// Appends `tokens` in one evaluation and returns the logits after each of them
    /// (speculative decoding verifies a drafted run this way: one step, or one pipeline round
    /// trip, for all of it). `last_logits` becomes the last row.
    pub fn append_all(&mut self, s: &mut Session, tokens: &[u32]) -> Result<EvalResult> {
        let n_ctx = self.info().n_ctx;
        if s.tokens.len() + tokens.len() > n_ctx {
            return Err(EngineError::ContextFull {
                needed: s.tokens.len() + tokens.len(),
                n_ctx,
            });
        }
        let req = EvalRequest {
            session: s.id,
            tokens,
            logits: LogitsWanted::All,
        };
        let out = self
            .exec
            .eval(std::slice::from_ref(&req))?
            .pop()
            .ok_or_else(|| EngineError::Executor("no result for the request".into()))?;
        if out.n_rows != tokens.len() {
            return Err(EngineError::Executor(format!(
                "expected {} rows of logits, got {}",
                tokens.len(),
                out.n_rows
            )));
        }
        s.tokens.extend_from_slice(tokens);
        s.last_logits = out.last().map(<[f32]>::to_vec).unwrap_or_default();
        Ok(out)
    }

    /// Keeps the session's first `n` positions (a rewind; `last_logits` is cleared). Fails with
    /// [`EngineError::CannotRewind`] where sliding-window layers no longer hold what the kept
    /// prefix needs.
    pub fn truncate(&mut self, s: &mut Session, n: usize) -> Result<()> {
        self.exec.truncate(s.id, n)?;
        s.tokens.truncate(n);
        s.last_logits.clear();
        Ok(())
    }

    /// Makes the session's history equal `tokens`, reusing the longest cached common prefix;
    /// returns how many tokens had to be evaluated. At least the last token is always
    /// re-evaluated so fresh logits exist.
    pub fn sync(&mut self, s: &mut Session, tokens: &[u32]) -> Result<usize> {
        let mut keep = s
            .tokens
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count();
        if keep == tokens.len() && keep > 0 && (keep < s.tokens.len() || s.last_logits.is_empty()) {
            keep -= 1;
        }
        if keep == tokens.len() && keep == s.tokens.len() && !s.last_logits.is_empty() {
            return Ok(0);
        }
        // A recurrent cache keeps its memory at some positions only.
        keep = self.exec.rewind_point(s.id, keep);
        match self.exec.truncate(s.id, keep) {
            Ok(()) => {}
            // The sliding-window layers dropped what the kept prefix needs: a cache miss.
            Err(EngineError::CannotRewind { .. }) => {
                self.exec.destroy(s.id);
                keep = 0;
            }
            Err(e) => return Err(e),
        }
        s.tokens.truncate(keep);
        s.last_logits.clear();
        self.append(s, &tokens[keep..])?;
        Ok(tokens.len() - keep)
    }

    /// Saves the session (tokens, KV of every layer, last logits).
    pub fn snapshot(&mut self, s: &Session) -> Result<Snapshot> {
        let mut snap = self.exec.snapshot(s.id)?;
        snap.tokens = s.tokens.clone();
        snap.last_logits = s.last_logits.clone();
        Ok(snap)
    }

    /// A session restored from a snapshot (possibly made by another topology).
    pub fn restore(&mut self, snap: &Snapshot) -> Result<Session> {
        let mut s = self.new_session();
        self.exec.restore(s.id, snap)?;
        s.tokens = snap.tokens.clone();
        s.last_logits = snap.last_logits.clone();
        Ok(s)
    }

    /// A second session with the same history, KV and last logits (`n > 1` choices sampled
    /// from one evaluated prompt). Goes through snapshot and restore, which every executor
    /// has, so it costs a copy of the session's KV.
    pub fn fork(&mut self, s: &Session) -> Result<Session> {
        let snap = self.snapshot(s)?;
        self.restore(&snap)
    }
}
