//! The OpenAI-compatible HTTP server: axum handlers on a tokio runtime in front of one
//! scheduler thread that owns the engine and batches every active session into each forward
//! step. See `docs/server.md` for the API and the design.
//!
//! | module | owns |
//! |---|---|
//! | [`api`] | OpenAI request/response types and the error shape |
//! | [`http`] | the connection loop: connection cap, idle and request timeouts, graceful stop |
//! | [`auth`] | the API key, compared in constant time |
//! | [`handlers`] | HTTP: admission, validation, chat template + tokenization, submission |
//! | [`chat`] | a chat request as its template sees it; reading the reply (reasoning, tool calls) |
//! | [`tokenize`] | `/tokenize`, `/detokenize`, `/apply-template` |
//! | `respond` | events → a JSON response or an SSE stream |
//! | [`job`] | what handlers and the scheduler exchange; admission control |
//! | [`scheduler`] | the engine's owner: slots, queue, continuous batching |
//! | `slot` | one slot's session and its request's sampler, text and progress |
//! | [`prefix_cache`] | which idle slot a prompt reuses |
//! | [`disk_cache`] | sessions saved to and restored from disk |
//! | [`metrics`] | counters, gauges, histograms, Prometheus text |
//! | [`status`] | `/v1/status`: model, cluster view, gauges, executor statistics as JSON |
//! | [`web`] | the built-in page at `/` (chat and cluster view), embedded in the binary |
//! | [`text`] | UTF-8 and stop-string handling of the streamed text |

pub mod api;
pub mod auth;
pub mod chat;
pub mod disk_cache;
pub mod handlers;
pub mod http;
pub mod job;
pub mod metrics;
pub mod prefix_cache;
mod respond;
pub mod scheduler;
mod slot;
pub mod status;
pub mod structured;
pub mod tokenize;
pub mod web;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use engine::Engine;
use engine::GrammarCompiler;
use engine::chat_output::ReasoningFormat;
use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use tokio::sync::oneshot;
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

use crate::auth::ApiKey;
use crate::disk_cache::DiskCache;
use crate::handlers::{AppState, RequestContext};
use crate::job::SchedulerConfig;
use crate::metrics::Metrics;
use crate::scheduler::Scheduler;

pub use disk_cache::parse_size;
pub use http::HttpLimits;

/// Request bodies above this are refused (a long prompt is a few MiB of JSON at most).
const MAX_BODY_BYTES: usize = 32 << 20;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    /// 0: any free port (the bound address is logged and printed to stderr).
    pub port: u16,
    /// The name clients use in `model`; any other name gets a 404.
    pub model_id: String,
    /// Session slots decoded together.
    pub parallel: usize,
    pub max_queue: usize,
    /// Prompt tokens evaluated per step alongside the decoders.
    pub prefill_chunk: usize,
    pub api_key: Option<String>,
    /// Disk KV cache directory and size bound.
    pub kv_disk: Option<(PathBuf, u64)>,
    /// How long in-flight requests may run after SIGINT/SIGTERM before they are cancelled.
    pub shutdown_grace: Duration,
    /// Interval of SSE keep-alive comments while a stream waits (queue, long prefill).
    pub sse_keepalive: Duration,
    /// Worker threads of the HTTP runtime (the engine has its own pool).
    pub http_threads: usize,
    /// Request timeout, idle timeout, connection cap.
    pub http: HttpLimits,
    /// Where reasoning text goes unless a request says (`--reasoning-format`).
    pub reasoning: ReasoningFormat,
    /// Origins browsers may call the API from (`--cors-origin`); empty: any origin.
    pub cors_origins: Vec<String>,
    /// Speculative decoding for every request (`--speculative`, `--draft-model`).
    pub speculative: Option<engine::Speculation>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            model_id: "moeshard".into(),
            parallel: 4,
            max_queue: 64,
            prefill_chunk: 256,
            api_key: None,
            kv_disk: None,
            shutdown_grace: Duration::from_secs(30),
            sse_keepalive: Duration::from_secs(10),
            http_threads: 2,
            http: HttpLimits::default(),
            reasoning: ReasoningFormat::default(),
            cors_origins: Vec::new(),
            speculative: None,
        }
    }
}

/// The CORS policy: preflights answered, any method and header, the configured origins (any
/// when none are), as llama-server allows any.
fn cors(origins: &[String]) -> std::io::Result<CorsLayer> {
    let layer = CorsLayer::new().allow_methods(Any).allow_headers(Any);
    if origins.is_empty() {
        return Ok(layer.allow_origin(Any));
    }
    let list = origins
        .iter()
        .map(|o| {
            axum::http::HeaderValue::from_str(o).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("--cors-origin {o:?} is not a valid origin"),
                )
            })
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok(layer.allow_origin(AllowOrigin::list(list)))
}

/// A server running on its own threads (tests, embedding); `serve` is this plus signals.
pub struct RunningServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
}

impl RunningServer {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Graceful shutdown: stop accepting, let in-flight requests finish (within the grace),
    /// save sessions to the disk cache, stop.
    pub fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.join()
    }

    /// Waits until the server stops by itself (a signal).
    pub fn join(mut self) -> std::io::Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the server thread panicked"))),
            None => Ok(()),
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
                    _ = term.recv() => tracing::info!("SIGTERM received"),
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Binds, starts the scheduler and the HTTP runtime, and returns at once. With `signals`, SIGINT
/// and SIGTERM start the graceful shutdown too.
pub fn start(
    cfg: ServerConfig,
    engine: Engine,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    signals: bool,
) -> std::io::Result<RunningServer> {
    let info = engine.info().clone();
    let cors = cors(&cfg.cors_origins)?;
    let disk = match &cfg.kv_disk {
        Some((dir, max)) => Some(DiskCache::open(dir, &info.fingerprint, *max)?),
        None => None,
    };
    let metrics = Arc::new(Metrics::default());
    let grammars = GrammarCompiler::new(&tokenizer);
    if let Err(e) = &grammars {
        tracing::warn!("{e}: requests for structured output will be refused");
    }
    let tokenizer = Arc::new(tokenizer);
    let sched_cfg = SchedulerConfig {
        parallel: cfg.parallel.max(1),
        max_queue: cfg.max_queue,
        prefill_chunk: cfg.prefill_chunk.max(1),
    };
    let listener = std::net::TcpListener::bind((cfg.host.as_str(), cfg.port))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let (scheduler, handle) = Scheduler::new(
        engine,
        tokenizer.clone(),
        sched_cfg,
        disk,
        Arc::clone(&metrics),
    );
    let scheduler = scheduler.with_speculation(cfg.speculative.clone());
    let sched_thread = std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || scheduler.run())?;
    let state = Arc::new(AppState {
        sched: handle,
        metrics,
        model_info: info.clone(),
        requests: RequestContext {
            tokenizer,
            template,
            model_id: cfg.model_id.clone(),
            n_ctx: info.n_ctx,
            n_vocab: info.n_vocab,
            reasoning: cfg.reasoning,
            grammars,
        },
        fingerprint: format!(
            "fp_{}",
            info.fingerprint.chars().take(10).collect::<String>()
        ),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        keepalive: cfg.sse_keepalive,
        next_id: AtomicU64::new(1),
        shutting_down: AtomicBool::new(false),
    });
    let app = Router::new()
        .route("/v1/models", get(handlers::models))
        .route("/v1/models/{id}", get(handlers::model))
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/apply-template", post(tokenize::apply_template))
        .route("/health", get(handlers::health))
        .route("/metrics", get(handlers::metrics))
        .route("/v1/status", get(status::status))
        .route("/", get(web::index))
        .route("/web/app.js", get(web::script))
        .route("/web/style.css", get(web::style))
        .fallback(handlers::not_found)
        .layer(axum::middleware::from_fn_with_state(
            cfg.api_key.as_deref().map(|k| Arc::new(ApiKey::new(k))),
            auth::require_key,
        ))
        // Outside the key check: a browser's preflight carries no key.
        .layer(cors)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(Arc::clone(&state));
    let app = http::with_request_timeout(app, cfg.http.request_timeout);
    let limits = cfg.http;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.http_threads.max(1))
        .thread_name("http")
        .enable_all()
        .build()?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let grace = cfg.shutdown_grace;
    let speculative = match &cfg.speculative {
        None => String::new(),
        Some(engine::Speculation::PromptLookup(l)) => {
            format!(", speculative: prompt lookup, up to {} drafts", l.max_draft)
        }
        Some(s @ engine::Speculation::DraftModel(_)) => {
            format!(
                ", speculative: a draft model, up to {} drafts",
                s.max_draft()
            )
        }
    };
    tracing::info!(
        "listening on http://{addr} (model `{}`, {} slots, queue {}, prefill chunk {}, ctx {}{speculative}; \
         request timeout {:?}, idle timeout {:?}, at most {} connections)",
        cfg.model_id,
        sched_cfg.parallel,
        sched_cfg.max_queue,
        sched_cfg.prefill_chunk,
        info.n_ctx,
        limits.request_timeout,
        limits.idle_timeout,
        limits.max_connections
    );
    let thread = std::thread::Builder::new().name("http-main".into()).spawn(move || {
        let result = rt.block_on(async {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            let st = Arc::clone(&state);
            let shutdown = async move {
                if signals {
                    tokio::select! {
                        _ = signal() => {}
                        _ = stop_rx => {}
                    }
                } else {
                    let _ = stop_rx.await;
                }
                tracing::info!("shutting down: no new requests; in-flight requests have {grace:?} to finish");
                st.shutting_down.store(true, Ordering::Release);
                st.sched.close();
                let st2 = Arc::clone(&st);
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    tracing::info!("shutdown grace expired: cancelling what is still running");
                    st2.sched.cancel_all();
                });
            };
            http::serve(listener, app, limits, Arc::clone(&state.metrics), shutdown).await
        });
        state.sched.shutdown();
        let joined = sched_thread.join();
        rt.shutdown_timeout(Duration::from_secs(1));
        tracing::info!("server stopped");
        match joined {
            Ok(()) => result,
            Err(_) => Err(std::io::Error::other("the scheduler thread panicked")),
        }
    })?;
    Ok(RunningServer {
        addr,
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}

/// Runs until SIGINT/SIGTERM, then shuts down gracefully.
pub fn serve(
    cfg: ServerConfig,
    engine: Engine,
    tokenizer: Tokenizer,
    template: ChatTemplate,
) -> std::io::Result<()> {
    let server = start(cfg, engine, tokenizer, template, true)?;
    eprintln!("moeshard serve: listening on http://{}", server.addr());
    server.join()
}
