//! The HTTP/1.1 server loop: accepts connections up to a cap, serves each with hyper under an
//! idle timeout, bounds each request's time with a tower timeout layer, and shuts down
//! gracefully.
//!
//! Which timeout applies where:
//! - **idle** (`--http-idle-timeout`): from the moment a connection waits for a request's head
//!   until the head is complete — a connection that sends nothing, sends its headers slowly, or
//!   sits idle between keep-alive requests is closed (hyper's `header_read_timeout`);
//! - **request** (`--http-timeout`): from the head until the response head — reading the body,
//!   parsing, tokenizing and, for a non-streamed completion, the whole generation (the request is
//!   then cancelled and answered 408). A streamed (SSE) response's head goes out as soon as the
//!   request is admitted, so tokens flowing afterwards are never cut by it; a stream ends when its
//!   generation does (bounded by `max_tokens` and the context) or when the client leaves.
//! - **connections** (`--max-connections`): open TCP connections, idle keep-alive ones
//!   included; one more is answered 503 and closed at once.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::response::IntoResponse;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::api::ApiError;
use crate::metrics::Metrics;

/// Limits on what HTTP clients may hold.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// Time from a request's head to its response's head.
    pub request_timeout: Duration,
    /// Time a connection may wait for (or take to send) a request's head.
    pub idle_timeout: Duration,
    /// Open connections at most.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            request_timeout: Duration::from_secs(600),
            idle_timeout: Duration::from_secs(30),
            max_connections: 512,
        }
    }
}

/// Connections refused at the cap that are still being answered; beyond these, more are dropped
/// without an answer.
const MAX_REFUSING: usize = 64;

/// `app` with the request timeout: a request still without a response head after `timeout` is
/// dropped (a running generation is cancelled with it) and answered 408.
pub fn with_request_timeout(app: Router, timeout: Duration) -> Router {
    app.layer(
        tower::ServiceBuilder::new()
            .layer(HandleErrorLayer::new(
                move |err: tower::BoxError| async move {
                    if err.is::<tower::timeout::error::Elapsed>() {
                        ApiError::timeout(timeout).into_response()
                    } else {
                        ApiError::internal(err.to_string()).into_response()
                    }
                },
            ))
            .layer(tower::timeout::TimeoutLayer::new(timeout)),
    )
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting and waits for the
/// open connections to finish their requests (idle ones are closed at once).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let conns = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .keep_alive(true);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    accept_error(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = Arc::clone(&conns).try_acquire_owned() else {
            metrics.connections_refused.inc();
            tracing::warn!(
                "refusing a connection from {peer}: {} connections are open (--max-connections)",
                limits.max_connections
            );
            if let Ok(p) = Arc::clone(&refusing).try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream).await;
                    drop(p);
                });
            }
            continue;
        };
        let conn =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        let metrics = Arc::clone(&metrics);
        metrics.connections.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection from {peer}: {e}");
            }
            metrics.connections.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answers a connection over the cap with a 503 and closes it; reads what the client sent
/// (briefly) so that closing does not reset the connection before the answer is read.
async fn refuse(mut stream: TcpStream) {
    let body = ApiError::unavailable("too many open connections; retry later")
        .body()
        .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        let mut buf = [0u8; 4096];
        while stream.read(&mut buf).await? > 0 {}
        Ok::<_, std::io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
}

/// Errors of `accept`: a connection that failed before it was accepted is skipped; anything
/// else (out of file descriptors) is logged and retried after a pause.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    tracing::error!("accepting a connection: {e}; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
