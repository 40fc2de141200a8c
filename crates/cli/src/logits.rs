//! `moeshard logits`: the f32 logits of every position as a NumPy array, plus the token ids —
//! the tool reference comparisons and bug reports start from.

use std::path::PathBuf;

use anyhow::{Context, bail};
use engine::tokenizer::Tokenizer;

use crate::cluster_args::ClusterArgs;
use crate::common::{self, ModelArgs};
use crate::npy;

/// Reference numbers are the point of this command, so its KV cache is f32 unless asked
/// otherwise (every other command defaults to f16).
#[derive(clap::Args)]
#[command(mut_arg("kv_type", |a| a.default_value("f32")))]
pub struct LogitsArgs {
    /// Text to tokenize (BOS added per the model's metadata).
    #[arg(short = 'p', long, conflicts_with = "tokens")]
    pub prompt: Option<String>,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
    /// Output `.npy` (`[n_tokens, n_vocab]` f32); the ids go to `<out>.tokens.npy`.
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

pub fn run(args: &LogitsArgs) -> anyhow::Result<()> {
    let (model, mut engine) = common::open(&args.model, &args.cluster)?;
    let tokens = match (&args.prompt, &args.tokens) {
        (Some(p), _) => Tokenizer::from_metadata(model.files().metadata())
            .context("building the tokenizer")?
            .encode(p, true, true),
        (None, Some(t)) => t.clone(),
        (None, None) => bail!("give --prompt or --tokens"),
    };
    anyhow::ensure!(!tokens.is_empty(), "no tokens to evaluate");
    let out = engine.all_logits(&tokens)?;
    npy::write_f32(&args.out, &[out.n_rows, out.n_vocab], &out.logits)?;
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let ids_path = args.out.with_extension("tokens.npy");
    npy::write_i32(&ids_path, &[ids.len()], &ids)?;
    eprintln!(
        "wrote {} ({} × {}) and {}",
        args.out.display(),
        out.n_rows,
        out.n_vocab,
        ids_path.display()
    );
    Ok(())
}
