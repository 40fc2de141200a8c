//! `moeshard run`: complete one prompt, streaming the text, then report prompt and generation
//! speed.

use std::io::Write;

use std::path::PathBuf;

use anyhow::Context;
use engine::generate::{GenerateOptions, generate};
use engine::tokenizer::Tokenizer;
use engine::{GrammarCompiler, GrammarSpec, Sampler, TokenConstraint};

use crate::cluster_args::ClusterArgs;
use crate::common::{self, ModelArgs};
use crate::sampling::SamplingArgs;
use crate::speculative_args::{self, SpeculativeArgs};

#[derive(clap::Args)]
pub struct RunArgs {
    /// The prompt (appended to the restored conversation with --load-snapshot).
    #[arg(short = 'p', long, default_value = "")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n_predict: usize,
    /// Stop before this text (repeatable), e.g. `--stop $'\n\n'`.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print execution statistics (route, expert cache, seed) at the end.
    #[arg(long)]
    pub stats: bool,
    /// Save the session (tokens, KV of every layer, last logits) to this file at the end.
    #[arg(long)]
    pub save_snapshot: Option<std::path::PathBuf>,
    /// Start from a saved session (made by any split of the same model).
    #[arg(long)]
    pub load_snapshot: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Structured output: the text is JSON valid against the JSON schema in FILE.
    #[arg(
        long,
        value_name = "FILE",
        group = "structured",
        help_heading = "Structured output"
    )]
    pub json_schema: Option<PathBuf>,
    /// Structured output: the text matches the grammar in FILE (llguidance's Lark syntax,
    /// `start: ...`; not llama.cpp's GBNF).
    #[arg(
        long,
        value_name = "FILE",
        group = "structured",
        help_heading = "Structured output"
    )]
    pub grammar_file: Option<PathBuf>,
    /// Structured output: the text matches this regular expression.
    #[arg(long, group = "structured", help_heading = "Structured output")]
    pub regex: Option<String>,
}

/// The grammar the flags ask for, compiled against the model's vocabulary.
fn grammar(args: &RunArgs, tokenizer: &Tokenizer) -> anyhow::Result<Option<TokenConstraint>> {
    let read = |path: &PathBuf| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    let spec = if let Some(path) = &args.json_schema {
        let schema = serde_json::from_str(&read(path)?)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        GrammarSpec::JsonSchema(schema)
    } else if let Some(path) = &args.grammar_file {
        GrammarSpec::Lark(read(path)?)
    } else if let Some(regex) = &args.regex {
        GrammarSpec::Regex(regex.clone())
    } else {
        return Ok(None);
    };
    let compiler = GrammarCompiler::new(tokenizer)?;
    Ok(Some(compiler.compile(&spec)?))
}

pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    let (model, mut engine) = common::open(&args.model, &args.cluster)?;
    let tokenizer =
        Tokenizer::from_metadata(model.files().metadata()).context("building the tokenizer")?;
    let (mut session, prompt) = match &args.load_snapshot {
        Some(path) => {
            let snap = engine::Snapshot::load(path)?;
            let session = engine
                .restore(&snap)
                .with_context(|| format!("restoring {}", path.display()))?;
            let mut prompt = snap.tokens.clone();
            prompt.extend(tokenizer.encode(&args.prompt, false, true));
            (session, prompt)
        }
        None => (
            engine.new_session(),
            tokenizer.encode(&args.prompt, true, true),
        ),
    };
    anyhow::ensure!(!prompt.is_empty(), "the prompt tokenizes to nothing");
    let cfg = args.sampling.config();
    let seed = cfg.seed;
    let mut sampler = Sampler::new(cfg).with_grammar(grammar(args, &tokenizer)?);
    let speculation = args
        .speculative
        .speculation(&args.model, engine.info().n_ctx, &tokenizer)?;
    let opts = GenerateOptions {
        max_tokens: args.n_predict,
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        speculative: speculation.clone(),
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", args.prompt)?;
    out.flush()?;
    let stats = generate(
        &mut engine,
        &mut session,
        &tokenizer,
        &mut sampler,
        &prompt,
        &opts,
        &mut |text| write!(out, "{text}").and_then(|_| out.flush()).is_ok(),
    )?;
    writeln!(out)?;
    if let Some(path) = &args.save_snapshot {
        let snap = engine.snapshot(&session)?;
        snap.save(path)?;
        eprintln!(
            "saved the session ({} tokens) to {}",
            snap.tokens.len(),
            path.display()
        );
    }
    eprintln!(
        "\nprompt: {} tokens in {:.2} s ({:.1} t/s) | generation: {} tokens in {:.2} s ({:.1} t/s) | {:?}{}",
        stats.prompt_evaluated,
        stats.prompt_secs,
        stats.prompt_tps(),
        stats.generated_tokens,
        stats.generation_secs,
        stats.generation_tps(),
        stats.finish,
        speculative_args::acceptance(&stats)
    );
    if args.stats {
        eprintln!("executor: {}", engine.executor().describe());
        eprintln!("seed: {seed}");
        for (k, v) in engine.executor().stats() {
            eprintln!("{k}: {v}");
        }
    }
    Ok(())
}
