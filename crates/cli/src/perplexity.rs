//! `moeshard perplexity`: perplexity over a text file the way `llama-perplexity` computes it —
//! non-overlapping windows of `--ctx` tokens, each starting with BOS, scoring the second half of
//! every window — so numbers compare across quantizations and with llama.cpp.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use engine::tokenizer::Tokenizer;

use crate::cluster_args::ClusterArgs;
use crate::common::{self, ModelArgs};

#[derive(clap::Args)]
pub struct PerplexityArgs {
    /// Text file to score.
    #[arg(short = 'f', long)]
    pub file: PathBuf,
    /// Stop after this many windows (0: all).
    #[arg(long, default_value_t = 0)]
    pub chunks: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// -log softmax(logits)[target], computed stably in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    -(logits[target as usize] as f64 - max - sum.ln())
}

pub fn run(args: &PerplexityArgs) -> anyhow::Result<()> {
    let mut margs = args.model.clone();
    if margs.ctx == 0 {
        margs.ctx = 512;
    }
    let (model, mut engine) = common::open(&margs, &args.cluster)?;
    let tokenizer =
        Tokenizer::from_metadata(model.files().metadata()).context("building the tokenizer")?;
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let add_bos = tokenizer.add_bos() && tokenizer.bos().is_some();
    let tokens = tokenizer.encode(&text, add_bos, false);
    let n_ctx = engine.info().n_ctx;
    anyhow::ensure!(n_ctx >= 8, "--ctx must be at least 8");
    let mut n_chunks = tokens.len() / n_ctx;
    anyhow::ensure!(
        n_chunks > 0,
        "{} tokens is less than one window of {n_ctx}",
        tokens.len()
    );
    if args.chunks > 0 {
        n_chunks = n_chunks.min(args.chunks);
    }
    eprintln!("{} tokens, {n_chunks} windows of {n_ctx}", tokens.len());
    let first = n_ctx / 2;
    let (mut total, mut count) = (0f64, 0usize);
    let t0 = Instant::now();
    for c in 0..n_chunks {
        let mut window = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if add_bos {
            window[0] = tokenizer.bos().expect("checked above");
        }
        let out = engine.all_logits(&window)?;
        for i in first..n_ctx - 1 {
            total += nll(out.row(i), window[i + 1]);
            count += 1;
        }
        eprint!("[{}]{:.4},", c + 1, (total / count as f64).exp());
    }
    let ppl = (total / count as f64).exp();
    eprintln!();
    println!(
        "perplexity: {ppl:.4} over {count} scored tokens ({n_chunks} windows of {n_ctx}) in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
