//! The in-memory prefix cache: idle slots keep their sessions (tokens and KV), and a new
//! request goes to the idle slot whose history shares the longest token prefix with its prompt,
//! so the next turn of a chat only evaluates what is new. A request that extends no slot's
//! history well enough takes the least recently used slot instead (empty slots first), so one
//! short shared header (BOS, a system prompt) does not evict a long conversation.

/// A session long enough to matter is reused when the prompt keeps at least half of it, or at
/// least this many tokens (a long shared system prompt).
pub const REUSE_MIN_TOKENS: usize = 256;

/// An idle slot as the chooser sees it.
pub struct IdleSlot<'a> {
    pub index: usize,
    pub tokens: &'a [u32],
    /// Larger is more recent; empty slots use 0.
    pub last_used: u64,
}

pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The slot for `prompt` among `idle` (not empty) and the number of its tokens to keep.
/// With `reuse` false the least recently used slot is chosen and nothing is kept.
pub fn choose(idle: &[IdleSlot], prompt: &[u32], reuse: bool) -> (usize, usize) {
    assert!(!idle.is_empty(), "choose needs an idle slot");
    let lru = idle.iter().min_by_key(|s| s.last_used).expect("not empty");
    if !reuse {
        return (lru.index, 0);
    }
    let best = idle
        .iter()
        .map(|s| (s, common_prefix(s.tokens, prompt)))
        .max_by_key(|(s, n)| (*n, s.last_used))
        .expect("not empty");
    let (slot, n) = best;
    if n > 0 && (2 * n >= slot.tokens.len() || n >= REUSE_MIN_TOKENS) {
        return (slot.index, n);
    }
    (lru.index, common_prefix(lru.tokens, prompt))
}

/// How much of a session with `cached` tokens (`have_logits`: its last logits are known) to
/// keep for `prompt`, given their common prefix `common`: all of it when the prompt is exactly
/// the cached history, else at most `prompt.len() - 1` so the last prompt token is evaluated and
/// fresh logits exist.
pub fn keep_len(cached: usize, have_logits: bool, prompt_len: usize, common: usize) -> usize {
    if common == prompt_len && cached == prompt_len && have_logits {
        return common;
    }
    common.min(prompt_len.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_turn_goes_to_its_conversation() {
        let conv_a = [1, 2, 3, 4, 5, 6];
        let conv_b = [1, 2, 9, 9, 9];
        let idle = [
            IdleSlot {
                index: 0,
                tokens: &conv_a,
                last_used: 1,
            },
            IdleSlot {
                index: 1,
                tokens: &conv_b,
                last_used: 2,
            },
            IdleSlot {
                index: 2,
                tokens: &[],
                last_used: 0,
            },
        ];
        assert_eq!(choose(&idle, &[1, 2, 3, 4, 5, 6, 7, 8], true), (0, 6));
        assert_eq!(choose(&idle, &[1, 2, 9, 9, 1], true), (1, 4));
        // Only the short header in common: the empty slot, not a conversation.
        assert_eq!(choose(&idle, &[1, 2, 7], true), (2, 0));
        assert_eq!(choose(&idle, &[1, 2, 3, 4, 5, 6, 7], false), (2, 0));
    }

    #[test]
    fn lru_when_all_slots_hold_other_conversations() {
        let a = [5, 5, 5];
        let b = [6, 6, 6];
        let idle = [
            IdleSlot {
                index: 3,
                tokens: &a,
                last_used: 9,
            },
            IdleSlot {
                index: 4,
                tokens: &b,
                last_used: 4,
            },
        ];
        assert_eq!(choose(&idle, &[7], true), (4, 0));
    }

    #[test]
    fn keeps_one_token_to_evaluate_unless_logits_are_cached() {
        assert_eq!(keep_len(4, true, 4, 4), 4);
        assert_eq!(keep_len(4, false, 4, 4), 3);
        assert_eq!(keep_len(6, true, 4, 4), 3);
        assert_eq!(keep_len(6, true, 8, 6), 6);
        assert_eq!(keep_len(0, false, 3, 0), 0);
    }
}
