//! Speculative-decoding flags shared by `run` and `chat`.

use engine::PromptLookup;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SpeculativeMode {
    /// One token per step.
    Off,
    /// Draft the tokens that followed the latest earlier occurrence of the context's last
    /// n-gram, verify them in one batched step.
    PromptLookup,
}

#[derive(clap::Args, Clone, Debug)]
pub struct SpeculativeArgs {
    /// Speculative decoding. Greedy output is the same as without it; sampled output keeps the
    /// sampler's distribution (other random draws than without it).
    #[arg(long, value_enum, default_value = "off")]
    pub speculative: SpeculativeMode,
    /// Most tokens drafted per step.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub draft_max: u64,
    /// Longest n-gram prompt lookup matches (down to one token).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub draft_ngram: u64,
}

impl SpeculativeArgs {
    pub fn prompt_lookup(&self) -> Option<PromptLookup> {
        match self.speculative {
            SpeculativeMode::Off => None,
            SpeculativeMode::PromptLookup => Some(PromptLookup {
                max_ngram: self.draft_ngram as usize,
                min_ngram: 1,
                max_draft: self.draft_max as usize,
            }),
        }
    }
}

/// ` | drafted D, accepted A (P %)` for the summary line, or nothing without drafts.
pub fn acceptance(stats: &engine::generate::GenerateStats) -> String {
    if stats.drafted_tokens == 0 {
        return String::new();
    }
    format!(
        " | drafted {}, accepted {} ({:.0} %)",
        stats.drafted_tokens,
        stats.accepted_tokens,
        100.0 * stats.accepted_tokens as f64 / stats.drafted_tokens as f64
    )
}
