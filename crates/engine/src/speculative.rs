//! Drafts for speculative decoding. Prompt lookup: where the context's last few tokens
//! occurred before, the tokens that followed them then are proposed as the continuation
//! (vLLM's `ngram` method, llama.cpp's lookup decoding); code being edited, documents being
//! revised and answers quoting their sources repeat long runs of their context. A draft model:
//! a small model with the same vocabulary, run greedily on the coordinator. Either way each run
//! of drafts the target agrees with costs it one batched step instead of one step per token.
//!
//! Both drafters are deterministic functions of the context (a point-mass draft distribution),
//! which is what [`crate::Sampler::verify`]'s acceptance rule assumes.

use std::sync::{Arc, Mutex};

use crate::error::{EngineError, Result};
use crate::sampler::argmax;
use crate::session::{Engine, Session};

/// Where drafts come from.
#[derive(Clone, Debug)]
pub enum Speculation {
    PromptLookup(PromptLookup),
    /// Shared so that options holding it stay cheap to clone; one generation uses it at a time.
    DraftModel(Arc<Mutex<DraftModel>>),
}

impl Speculation {
    /// Most tokens drafted per step.
    pub fn max_draft(&self) -> usize {
        match self {
            Speculation::PromptLookup(l) => l.max_draft,
            Speculation::DraftModel(m) => m.lock().map_or(1, |m| m.max_draft),
        }
    }

    /// Up to `limit` drafted tokens to follow `context` (possibly none).
    pub fn draft(&self, context: &[u32], limit: usize) -> Result<Vec<u32>> {
        self.draft_in(0, context, limit)
    }

    /// As [`Speculation::draft`] for one of several generations that run interleaved (the
    /// server's slots): each `lane` has its own draft-model session, so switching between
    /// generations does not make the draft model evaluate each one's context again.
    pub fn draft_in(&self, lane: usize, context: &[u32], limit: usize) -> Result<Vec<u32>> {
        match self {
            Speculation::PromptLookup(l) => Ok(l.draft(context, limit)),
            Speculation::DraftModel(m) => m
                .lock()
                .map_err(|_| EngineError::Executor("the draft model's lock is poisoned".into()))?
                .draft_in(lane, context, limit),
        }
    }
}

/// A draft model: its own engine (a local executor on the coordinator) and a session per lane
/// (one for `run`, one per slot for the server) whose history follows that generation's, so each
/// step evaluates only what changed since the last one (the tokens the target kept are already
/// in its cache from drafting them).
pub struct DraftModel {
    engine: Engine,
    sessions: Vec<Session>,
    max_draft: usize,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel")
            .field("model", &self.engine.info().name)
            .field("max_draft", &self.max_draft)
            .finish()
    }
}

impl DraftModel {
    pub fn new(mut engine: Engine, max_draft: usize) -> DraftModel {
        let session = engine.new_session();
        DraftModel {
            engine,
            sessions: vec![session],
            max_draft: max_draft.max(1),
        }
    }

    /// The draft model's greedy continuation of `context`, `limit` (at most `max_draft`)
    /// tokens; none when the context no longer fits the draft model's.
    pub fn draft(&mut self, context: &[u32], limit: usize) -> Result<Vec<u32>> {
        self.draft_in(0, context, limit)
    }

    /// [`DraftModel::draft`] in lane `lane`'s session (made on first use).
    pub fn draft_in(&mut self, lane: usize, context: &[u32], limit: usize) -> Result<Vec<u32>> {
        let limit = limit.min(self.max_draft);
        if limit == 0 || context.len() + limit > self.engine.info().n_ctx {
            return Ok(Vec::new());
        }
        while self.sessions.len() <= lane {
            let s = self.engine.new_session();
            self.sessions.push(s);
        }
        let session = &mut self.sessions[lane];
        self.engine.sync(session, context)?;
        let mut out = Vec::with_capacity(limit);
        loop {
            let tok = argmax(&session.last_logits);
            out.push(tok);
            if out.len() == limit {
                return Ok(out);
            }
            self.engine.append(session, &[tok])?;
        }
    }
}

/// Prompt-lookup drafting parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    /// Longest suffix n-gram matched (tried first).
    pub max_ngram: usize,
    /// Shortest suffix n-gram matched.
    pub min_ngram: usize,
    /// Most tokens drafted per step.
    pub max_draft: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        PromptLookup {
            max_ngram: 3,
            min_ngram: 1,
            max_draft: 8,
        }
    }
}

impl PromptLookup {
    /// The tokens that followed the most recent earlier occurrence of the longest suffix of
    /// `context` (between `min_ngram` and `max_ngram` tokens) that occurred before, continued
    /// periodically past the context's end, `limit` and at most `max_draft` of them; empty when
    /// no suffix recurs.
    pub fn draft(&self, context: &[u32], limit: usize) -> Vec<u32> {
        let limit = limit.min(self.max_draft);
        if limit == 0 {
            return Vec::new();
        }
        let len = context.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // The most recent occurrence that ends before the suffix itself starts to overlap
            // the end (start + n < len), so at least one token follows it.
            if let Some(start) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
                // Read on past the context's end into the draft itself: a run that repeats
                // with period `len - start - n` is drafted as that repetition.
                let from = start + n;
                let mut draft = Vec::with_capacity(limit);
                for k in 0..limit {
                    let i = from + k;
                    draft.push(if i < len { context[i] } else { draft[i - len] });
                }
                return draft;
            }
        }
        Vec::new()
    }
}

/// How many tokens to draft next, from how the last drafts did: twice as many after a draft
/// the model kept whole, one more than it kept after a rejection. Where the model rarely
/// agrees, drafts stay at one token, so a verification step costs little more than a plain
/// one; where it copies long runs, drafts grow to the maximum.
#[derive(Clone, Debug)]
pub struct DraftLength {
    current: usize,
    max: usize,
}

impl DraftLength {
    pub fn new(max: usize) -> DraftLength {
        DraftLength {
            current: max.clamp(1, 2),
            max: max.max(1),
        }
    }

    pub fn get(&self) -> usize {
        self.current
    }

    /// Records that of `drafted` tokens the model kept `accepted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.current = if accepted >= drafted {
            (2 * drafted.max(self.current)).min(self.max)
        } else {
            (accepted + 1).min(self.max)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_latest_occurrence_of_the_longest_suffix() {
        let p = PromptLookup::default();
        // "1 2 3" occurs at 0 (followed by 4 5) and at 5 (followed by 9): the latest wins.
        let ctx = [1, 2, 3, 4, 5, 1, 2, 3, 9, 7, 1, 2, 3];
        assert_eq!(p.draft(&ctx, 8), vec![9, 7, 1, 2, 3, 9, 7, 1]);
        assert_eq!(p.draft(&ctx, 2), vec![9, 7]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_drafts_nothing_without_a_match() {
        let p = PromptLookup::default();
        assert_eq!(p.draft(&[5, 6, 7, 8, 6], 4), vec![7, 8, 6, 7]);
        assert!(p.draft(&[1, 2, 3, 4], 8).is_empty());
        assert!(p.draft(&[1], 8).is_empty());
        assert!(p.draft(&[1, 2, 1, 2], 0).is_empty());
        let bigrams_only = PromptLookup {
            min_ngram: 2,
            ..PromptLookup::default()
        };
        assert!(bigrams_only.draft(&[5, 6, 7, 8, 6], 8).is_empty());
    }

    #[test]
    fn draft_length_doubles_on_whole_acceptance_and_shrinks_on_rejection() {
        let mut d = DraftLength::new(8);
        assert_eq!(d.get(), 2);
        d.record(2, 2);
        assert_eq!(d.get(), 4);
        d.record(4, 4);
        d.record(8, 8);
        assert_eq!(d.get(), 8);
        d.record(8, 3);
        assert_eq!(d.get(), 4);
        d.record(4, 0);
        assert_eq!(d.get(), 1);
        // A shorter draft than asked for (the lookup ran out) kept whole still grows it.
        d.record(1, 1);
        assert_eq!(d.get(), 2);
        assert_eq!(DraftLength::new(1).get(), 1);
    }

    #[test]
    fn a_repeating_token_drafts_its_repetition() {
        let p = PromptLookup::default();
        assert_eq!(p.draft(&[4, 4, 4, 4], 3), vec![4, 4, 4]);
        assert_eq!(p.draft(&[9, 4, 4, 4, 4, 4], 20), vec![4; 8]);
    }
}
