//! `moeshard serve`: the OpenAI-compatible HTTP server (crates/server) in front of the engine
//! these model flags build — local, pipeline coordinator, or SSD-streaming alike.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;

use crate::common::{self, ModelArgs};

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: any free port; the bound address is printed to stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Session slots decoded together in one batched forward step.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Requests that may wait for a free slot; beyond that requests get 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Prompt tokens evaluated per step next to the decoding sessions.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Require `Authorization: Bearer KEY` on /v1/ endpoints.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model name clients send (default: the model file's stem).
    #[arg(long)]
    pub alias: Option<String>,
    /// Save evicted sessions' KV here and restore them later, also after a restart.
    #[arg(long)]
    pub kv_disk_dir: Option<PathBuf>,
    /// Size bound of --kv-disk-dir (least recently used sessions are deleted), e.g. 20G.
    #[arg(long, default_value = "10G", value_parser = server::parse_size)]
    pub kv_disk_max: u64,
    /// Seconds in-flight requests may run after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace: f64,
    /// Seconds between SSE keep-alive comments while a stream waits (queue, long prefill).
    #[arg(long, default_value_t = 10.0)]
    pub sse_keepalive: f64,
}

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    let (model, engine) = common::open(&args.model)?;
    let meta = model.files().metadata();
    let tokenizer = Tokenizer::from_metadata(meta).context("building the tokenizer")?;
    let template = match ChatTemplate::from_metadata(meta).context("reading the chat template")? {
        Some(t) => t,
        None => {
            tracing::info!("the model has no chat template; /v1/chat/completions uses ChatML");
            let text = |id: Option<u32>| {
                id.and_then(|i| tokenizer.token_text(i))
                    .unwrap_or("")
                    .to_string()
            };
            ChatTemplate::chatml(text(tokenizer.bos()), text(tokenizer.eos()))
        }
    };
    let model_id = args.alias.clone().unwrap_or_else(|| {
        let path = args.model.model_path();
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "moeshard".into())
    });
    anyhow::ensure!(args.parallel >= 1, "--parallel must be at least 1");
    anyhow::ensure!(
        args.shutdown_grace >= 0.0 && args.sse_keepalive > 0.0,
        "durations must be positive"
    );
    tracing::info!("executor: {}", engine.executor().describe());
    let cfg = server::ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_id,
        parallel: args.parallel,
        max_queue: args.max_queue,
        prefill_chunk: args.prefill_chunk,
        api_key: args.api_key.clone(),
        kv_disk: args.kv_disk_dir.clone().map(|d| (d, args.kv_disk_max)),
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
        sse_keepalive: Duration::from_secs_f64(args.sse_keepalive),
        ..Default::default()
    };
    server::serve(cfg, engine, tokenizer, template).context("serving")
}
