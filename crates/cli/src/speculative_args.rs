//! Speculative-decoding flags shared by `run`, `chat`, `serve` and `bench`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use engine::tokenizer::Tokenizer;
use engine::{DraftModel, Engine, LocalExecutor, PromptLookup, Speculation};
use model::{Compute, Model};

use crate::common::ModelArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SpeculativeMode {
    /// One token per step.
    Off,
    /// Draft the tokens that followed the latest earlier occurrence of the context's last
    /// n-gram, verify them in one batched step.
    PromptLookup,
    /// Draft with `--draft-model` (greedy, on this process), verify in one batched step.
    DraftModel,
}

#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Speculative decoding")]
pub struct SpeculativeArgs {
    /// Speculative decoding. Greedy output is the same as without it; sampled output keeps the
    /// sampler's distribution (other random draws than without it).
    #[arg(long, value_enum, default_value = "off")]
    pub speculative: SpeculativeMode,
    /// A small GGUF with the target's vocabulary to draft with (implies
    /// `--speculative draft-model`); it runs on this process at `--threads`, whatever the
    /// target's topology.
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// Most tokens drafted per step.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub draft_max: u64,
    /// Longest n-gram prompt lookup matches (down to one token).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub draft_ngram: u64,
}

impl SpeculativeArgs {
    /// Where drafts come from, for a target opened with `target` whose sessions hold `n_ctx`
    /// positions and whose tokenizer is `vocab`.
    pub fn speculation(
        &self,
        target: &ModelArgs,
        n_ctx: usize,
        vocab: &Tokenizer,
    ) -> anyhow::Result<Option<Speculation>> {
        let mode = match (&self.draft_model, self.speculative) {
            (Some(_), SpeculativeMode::Off) => SpeculativeMode::DraftModel,
            (Some(_), SpeculativeMode::PromptLookup) => {
                anyhow::bail!("--draft-model and --speculative prompt-lookup exclude each other")
            }
            (None, SpeculativeMode::DraftModel) => {
                anyhow::bail!("--speculative draft-model needs --draft-model FILE")
            }
            (_, mode) => mode,
        };
        Ok(match mode {
            SpeculativeMode::Off => None,
            SpeculativeMode::PromptLookup => Some(Speculation::PromptLookup(PromptLookup {
                max_ngram: self.draft_ngram as usize,
                min_ngram: 1,
                max_draft: self.draft_max as usize,
            })),
            SpeculativeMode::DraftModel => {
                let path = self.draft_model.as_ref().context("no draft model")?;
                let draft = open_draft_model(path, target, n_ctx, vocab)?;
                Some(Speculation::DraftModel(Arc::new(Mutex::new(
                    DraftModel::new(draft, self.draft_max as usize),
                ))))
            }
        })
    }
}

/// The draft model's engine: the whole model in this process, the target's context size and KV
/// type. Refused unless its vocabulary is the target's, token for token.
fn open_draft_model(
    path: &std::path::Path,
    target: &ModelArgs,
    n_ctx: usize,
    vocab: &Tokenizer,
) -> anyhow::Result<Engine> {
    let files = Arc::new(
        gguf::GgufModel::open(path)
            .with_context(|| format!("loading the draft model {}", path.display()))?,
    );
    let model = Model::from_gguf_rank(files, 0, 1)
        .with_context(|| format!("loading the draft model {}", path.display()))?;
    let draft_vocab = Tokenizer::from_metadata(model.files().metadata())
        .with_context(|| format!("the draft model {}'s tokenizer", path.display()))?;
    let target_name = target.source().to_string();
    anyhow::ensure!(
        draft_vocab.vocab_size() == vocab.vocab_size(),
        "the draft model {} has {} tokens, the target {} has {}: a draft model needs the \
         target's vocabulary",
        path.display(),
        draft_vocab.vocab_size(),
        target_name,
        vocab.vocab_size()
    );
    if let Some(id) = (0..vocab.vocab_size() as u32)
        .find(|&id| draft_vocab.token_to_piece(id) != vocab.token_to_piece(id))
    {
        anyhow::bail!(
            "the draft model {} and the target {} differ at token {id} ({:?} vs {:?}): a \
             draft model needs the target's vocabulary",
            path.display(),
            target_name,
            String::from_utf8_lossy(draft_vocab.token_to_piece(id)),
            String::from_utf8_lossy(vocab.token_to_piece(id)),
        );
    }
    let exec = LocalExecutor::new(
        Arc::new(model),
        Compute::new(target.threads),
        target.kv_type,
        n_ctx,
    );
    Ok(Engine::new(Box::new(exec)))
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
