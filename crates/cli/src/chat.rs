//! `moeshard chat`: an interactive multi-turn chat. The conversation is re-rendered with the
//! model's chat template each turn; the engine keeps the KV cache of the common prefix, so a
//! turn only evaluates what is new.

use std::io::{BufRead, Write};

use anyhow::Context;
use engine::Sampler;
use engine::chat_template::ChatMessage;
use engine::generate::{GenerateOptions, generate};
use engine::tokenizer::Tokenizer;

use crate::cluster_args::ClusterArgs;
use crate::common::{self, ModelArgs};
use crate::sampling::SamplingArgs;
use crate::speculative_args::{self, SpeculativeArgs};

#[derive(clap::Args)]
pub struct ChatArgs {
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(short = 'n', long, default_value_t = 512)]
    pub n_predict: usize,
    /// Stop before this text (repeatable), e.g. `--stop $'\n\n'`.
    #[arg(long)]
    pub stop: Vec<String>,
    /// A Jinja chat template to use instead of the model's.
    #[arg(long)]
    pub chat_template_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

pub fn run(args: &ChatArgs) -> anyhow::Result<()> {
    let (model, mut engine) = common::open(&args.model, &args.cluster)?;
    let meta = model.files().metadata();
    let tokenizer = Tokenizer::from_metadata(meta).context("building the tokenizer")?;
    let template = common::chat_template(meta, &tokenizer, args.chat_template_file.as_deref())?;
    let mut sampler = Sampler::new(args.sampling.config());
    let speculation = args
        .speculative
        .speculation(&args.model, engine.info().n_ctx, &tokenizer)?;
    let mut session = engine.new_session();
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::new("system", s.clone()));
    }
    eprintln!(
        "chatting with {} — empty line or Ctrl-D to quit",
        engine.info().name
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let Some(line) = lines.next() else { break };
        let line = line?;
        if line.trim().is_empty() {
            break;
        }
        messages.push(ChatMessage::new("user", line));
        let rendered = template.render(&messages, true, &Default::default())?;
        let starts_with_bos =
            !template.bos_token().is_empty() && rendered.starts_with(template.bos_token());
        let prompt = tokenizer.encode(&rendered, !starts_with_bos, true);
        let opts = GenerateOptions {
            max_tokens: args.n_predict,
            stop: args.stop.clone(),
            ignore_eos: false,
            speculative: speculation.clone(),
        };
        let mut reply = String::new();
        let mut out = std::io::stdout().lock();
        let stats = generate(
            &mut engine,
            &mut session,
            &tokenizer,
            &mut sampler,
            &prompt,
            &opts,
            &mut |text| {
                reply.push_str(text);
                write!(out, "{text}").and_then(|_| out.flush()).is_ok()
            },
        )?;
        writeln!(out)?;
        eprintln!(
            "[{} new prompt tokens ({} reused) at {:.1} t/s, {} tokens at {:.1} t/s{}]",
            stats.prompt_evaluated,
            stats.prompt_tokens - stats.prompt_evaluated,
            stats.prompt_tps(),
            stats.generated_tokens,
            stats.generation_tps(),
            speculative_args::acceptance(&stats)
        );
        messages.push(ChatMessage::new("assistant", reply));
    }
    Ok(())
}
