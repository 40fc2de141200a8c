//! `moeshard serve`: the OpenAI-compatible HTTP server (crates/server) in front of the engine
//! these model flags build — local, pipeline coordinator, or SSD-streaming alike.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use engine::tokenizer::Tokenizer;

use crate::cluster_args::ClusterArgs;
use crate::common::{self, ModelArgs};
use crate::speculative_args::SpeculativeArgs;

#[derive(clap::Args)]
#[command(next_help_heading = "Server")]
pub struct ServeArgs {
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
    /// Require `Authorization: Bearer KEY` on /v1/ endpoints (visible in `ps`: prefer
    /// --api-key-file or MOESHARD_API_KEY).
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// File holding the API key (surrounding whitespace ignored). Without --api-key or
    /// --api-key-file, MOESHARD_API_KEY is used when set.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
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
    /// Seconds from a request's head to its response's head: the body, tokenizing and, for a
    /// non-streamed completion, the whole generation (then cancelled, 408). A stream's head is
    /// sent once it is admitted, so streamed tokens are not cut by it.
    #[arg(long, default_value_t = 600.0)]
    pub http_timeout: f64,
    /// Seconds a connection may wait for, or take to send, a request's head (idle keep-alive
    /// connections are closed after it).
    #[arg(long, default_value_t = 30.0)]
    pub http_idle_timeout: f64,
    /// Open HTTP connections at most (idle keep-alive ones included); more are answered 503.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// A Jinja chat template to use instead of the model's.
    #[arg(long)]
    pub chat_template_file: Option<PathBuf>,
    /// Where reasoning (`<think>…</think>`, gpt-oss' analysis channel) goes: `deepseek` (or
    /// `auto`) into `reasoning_content`, `none` left in the content.
    #[arg(long, default_value = "deepseek")]
    pub reasoning_format: engine::chat_output::ReasoningFormat,
    /// An origin browsers may call the API from (repeatable), e.g. `https://app.example`.
    /// Without it any origin may (CORS `*`), as with llama-server.
    #[arg(long)]
    pub cors_origin: Vec<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    // Every request drafts, and verifies its drafts inside the batched steps.
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

/// The API key from --api-key, --api-key-file or MOESHARD_API_KEY (in that order), if any.
fn read_api_key(args: &ServeArgs) -> anyhow::Result<Option<String>> {
    let key = if let Some(k) = &args.api_key {
        k.clone()
    } else if let Some(path) = &args.api_key_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the API key from {}", path.display()))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(m) = std::fs::metadata(path)
                && m.permissions().mode() & 0o077 != 0
            {
                tracing::warn!(
                    "{} is readable by other users (mode {:o}); chmod 600 it",
                    path.display(),
                    m.permissions().mode() & 0o777
                );
            }
        }
        let key = text.trim().to_string();
        anyhow::ensure!(!key.is_empty(), "{} holds no API key", path.display());
        key
    } else {
        match std::env::var("MOESHARD_API_KEY") {
            Ok(k) if !k.trim().is_empty() => k.trim().to_string(),
            Ok(_) | Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(e) => anyhow::bail!("MOESHARD_API_KEY: {e}"),
        }
    };
    anyhow::ensure!(!key.is_empty(), "the API key is empty");
    Ok(Some(key))
}

/// A duration flag in seconds, finite and above zero.
fn seconds(flag: &str, v: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        v.is_finite() && v > 0.0,
        "{flag} must be a positive number of seconds"
    );
    Ok(Duration::from_secs_f64(v))
}

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    // Flags first: a mistake should not wait for the model to load.
    anyhow::ensure!(
        args.max_connections >= 1,
        "--max-connections must be at least 1"
    );
    let http = server::HttpLimits {
        request_timeout: seconds("--http-timeout", args.http_timeout)?,
        idle_timeout: seconds("--http-idle-timeout", args.http_idle_timeout)?,
        max_connections: args.max_connections,
    };
    let api_key = read_api_key(args)?;
    let (model, engine) = common::open(&args.model, &args.cluster)?;
    let meta = model.files().metadata();
    let tokenizer = Tokenizer::from_metadata(meta).context("building the tokenizer")?;
    let template = common::chat_template(meta, &tokenizer, args.chat_template_file.as_deref())?;
    let model_id = args.alias.clone().unwrap_or_else(|| {
        let path = args.model.source().display_path();
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "moeshard".into())
    });
    anyhow::ensure!(args.parallel >= 1, "--parallel must be at least 1");
    anyhow::ensure!(
        args.shutdown_grace >= 0.0 && args.sse_keepalive > 0.0,
        "durations must be positive"
    );
    let speculative = args
        .speculative
        .speculation(&args.model, engine.info().n_ctx, &tokenizer)?;
    tracing::info!("executor: {}", engine.executor().describe());
    let cfg = server::ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_id,
        parallel: args.parallel,
        max_queue: args.max_queue,
        prefill_chunk: args.prefill_chunk,
        api_key,
        kv_disk: args.kv_disk_dir.clone().map(|d| (d, args.kv_disk_max)),
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
        sse_keepalive: Duration::from_secs_f64(args.sse_keepalive),
        http,
        reasoning: args.reasoning_format,
        cors_origins: args.cors_origin.clone(),
        speculative,
        ..Default::default()
    };
    server::serve(cfg, engine, tokenizer, template).context("serving")
}
