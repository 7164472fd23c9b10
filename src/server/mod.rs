//! HTTP plumbing: the accept loop, graceful shutdown, routing.
//!
//! `run` takes a bound listener (never binds itself, so tests and the CLI
//! choose the port) and a shutdown future.

mod answer;
mod compact;
mod compact_now;
pub mod control;
mod count_tokens;
pub mod discovery;
mod exchange;
mod gather;
mod gemini;
mod health;
mod identify;
mod lease;
mod models;
mod passthrough;
mod proxy;
mod read;
mod recall;
mod record;
mod relay;
mod request;
mod send;
mod splice;
mod websocket;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tracing::Instrument;

use lease::Lease;

use crate::app::AppState;
use crate::error::{json_response, ProxyBody, ProxyError};
use crate::wire::Api;

/// `GET /metrics`: the exposition of `state`'s metrics with its gauges.
fn serve_metrics(state: &AppState) -> Response<ProxyBody> {
    let mut gauges = state.metrics.gauges(
        &state.config.store_path(),
        Some(state.compactions.len() as u64),
    );
    gauges.windows = state.models_seen();
    gauges.db_pool = state.postgres.as_ref().map(|pg| pg.pool_status());
    gauges.db_reads = state.postgres.as_ref().map(|pg| pg.reads());
    let mut resp = Response::new(crate::error::full(state.metrics.render(&gauges)));
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(crate::metrics::CONTENT_TYPE_TEXT),
    );
    resp
}

/// Tasks a runtime worker runs between two checks for I/O (tokio's default
/// is 61). See [`runtime_builder`].
const EVENT_INTERVAL: u32 = 255;

/// The runtime the proxy serves on; `compactor serve` builds its runtime
/// here, and so does the bench, to measure the same.
///
/// Its workers check for I/O every `EVENT_INTERVAL` tasks rather than
/// every 61. A request's tasks are short, and under load the checks were
/// syscalls that found little; the relay's gathering of SSE chunks that
/// arrived together (`relay::gather`) also lasts until such a check. At
/// 30 KB and c=32 this took `epoll_wait` calls per request from 0.44 to
/// 0.32 and `writev` from 4.0 to 3.3. A worker with no task left checks at
/// once, so an idle proxy answers as before.
pub fn runtime_builder() -> tokio::runtime::Builder {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder
        .enable_all()
        .event_interval(EVENT_INTERVAL)
        .thread_name("compactor");
    builder
}

/// File descriptors kept for what is not a client connection (the
/// listener, the store and its journal, the runtime, logs), in
/// [`connection_limit`].
const RESERVED_FDS: u64 = 64;

/// First pause after an accept that failed for want of resources (out of
/// file descriptors, of memory), doubled while it goes on, up to
/// [`ACCEPT_BACKOFF_MAX`].
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause between two accepts that fail for want of resources.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How many client connections may be open at once: `server.max_connections`,
/// lowered so that they, and an upstream connection for each, fit in the
/// process's open-file limit. Past it, connections wait in the listen
/// backlog: the proxy keeps the descriptors its store and upstream
/// connections need, rather than failing accepts and everything else with
/// "too many open files".
pub fn connection_limit(configured: usize) -> usize {
    match open_file_limit() {
        Some(files) => {
            let fit = (files.saturating_sub(RESERVED_FDS) / 2).max(1);
            configured.min(usize::try_from(fit).unwrap_or(usize::MAX))
        }
        None => configured,
    }
}

/// Raises the soft limit on open files towards the hard one, as far as
/// `max_connections` needs (see [`connection_limit`]): many systems start
/// processes at a soft limit of 1024 under a far higher hard one, which
/// would bound the default `server.max_connections` at half of it.
pub fn raise_open_file_limit(max_connections: usize) {
    #[cfg(unix)]
    {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let limit = getrlimit(Resource::Nofile);
        let Some(current) = limit.current else {
            return;
        };
        let wanted = (max_connections as u64)
            .saturating_mul(2)
            .saturating_add(RESERVED_FDS);
        let new = limit.maximum.map_or(wanted, |hard| wanted.min(hard));
        if new > current {
            let raised = Rlimit {
                current: Some(new),
                maximum: limit.maximum,
            };
            if let Err(e) = setrlimit(Resource::Nofile, raised) {
                tracing::debug!(error = %e, "open-file limit not raised");
            }
        }
    }
    #[cfg(not(unix))]
    let _ = max_connections;
}

/// The soft limit on open files, if there is one.
fn open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        rustix::process::getrlimit(rustix::process::Resource::Nofile).current
    }
    #[cfg(not(unix))]
    None
}

/// Whether an accept failed for want of resources (then the next one fails
/// too until some are freed), not because of the one connection.
fn out_of_resources(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    {
        use rustix::io::Errno;
        [Errno::MFILE, Errno::NFILE, Errno::NOBUFS, Errno::NOMEM]
            .iter()
            .any(|no| e.raw_os_error() == Some(no.raw_os_error()))
    }
    #[cfg(not(unix))]
    {
        e.kind() == std::io::ErrorKind::OutOfMemory
    }
}

/// What a client connection is doing, for its idle timeout: requests in
/// flight, and since when it has had none.
struct Activity {
    started: std::time::Instant,
    in_flight: AtomicUsize,
    /// When the last request in flight ended, ms after `started`.
    idle_since_ms: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            started: std::time::Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
        })
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// Resolves once the connection has had no request in flight for
    /// `limit`, and not before `not_before`.
    async fn idle_for(&self, limit: Duration, not_before: tokio::time::Instant) {
        tokio::time::sleep_until(not_before).await;
        loop {
            let quiet = if self.in_flight.load(Ordering::Acquire) == 0 {
                let since = Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
                self.started.elapsed().saturating_sub(since)
            } else {
                Duration::ZERO
            };
            if quiet >= limit {
                return;
            }
            tokio::time::sleep(limit - quiet).await;
        }
    }
}

/// A request in flight, from its headers until its response body is
/// dropped (sent, or cut short).
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let ms = self.0.started.elapsed().as_millis() as u64;
        self.0.idle_since_ms.store(ms, Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request [`Busy`] until it is dropped.
struct Tracked {
    body: ProxyBody,
    _busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = crate::error::BodyError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Runs the tasks hyper spawns for a connection (one per HTTP/2 stream) as
/// tokio tasks that end when `cut` is set, each holding a clone of `live`:
/// at the end of the shutdown grace period the streams they answer are
/// dropped, and so recorded, before the store closes, like those of
/// HTTP/1 connections.
#[derive(Clone)]
struct StreamTasks {
    cut: tokio::sync::watch::Receiver<bool>,
    live: tokio::sync::mpsc::Sender<()>,
}

impl<F> hyper::rt::Executor<F> for StreamTasks
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, task: F) {
        let mut cut = self.cut.clone();
        let live = self.live.clone();
        tokio::spawn(async move {
            let _live = live;
            tokio::select! {
                _ = task => {}
                _ = cut.wait_for(|c| *c) => {}
            }
        });
    }
}

/// Serves connections from `listener` until `shutdown` resolves, then stops
/// accepting and gives in-flight requests `server.shutdown_grace_secs` to
/// end; streams still going then are cut, and recorded as partial.
/// WebSockets finish the response under way, if any, and are closed
/// (1001), or are cut with it at the end of the grace period.
///
/// A connection has `server.header_read_timeout_secs` from its accept to
/// send a request's headers, and as long again after each request ends:
/// one that sends nothing, part of a request head, part of an HTTP/2
/// preface, or sits idle (HTTP/1 keep-alive or HTTP/2) is closed then.
/// At most [`connection_limit`] are open at once.
pub async fn run(listener: TcpListener, state: Arc<AppState>, shutdown: impl Future<Output = ()>) {
    let (cut, cut_rx) = tokio::sync::watch::channel(false);
    let (live, mut all_ended) = tokio::sync::mpsc::channel::<()>(1);
    let mut builder = auto::Builder::new(StreamTasks {
        cut: cut_rx.clone(),
        live,
    });
    let header_read = state.config.server.header_read_timeout_secs;
    let idle = (header_read > 0).then(|| Duration::from_secs(header_read));
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(idle);
    let limit = connection_limit(state.config.server.max_connections);
    if limit < state.config.server.max_connections {
        tracing::warn!(
            max_connections = limit,
            configured = state.config.server.max_connections,
            "client connections bounded by the open-file limit"
        );
    }
    tracing::info!(max_connections = limit, "accepting connections");
    let permits = Arc::new(tokio::sync::Semaphore::new(limit));
    let (closing, closing_rx) = tokio::sync::watch::channel(false);
    // Every lease holds a sender: the receiver ends once all are gone.
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    let mut open = Some(open);
    let mut conns = tokio::task::JoinSet::new();
    let mut backoff: Option<Duration> = None;
    let mut failed_accepts = 0u64;
    tokio::pin!(shutdown);
    loop {
        let accept = async {
            // Waits for a free slot before taking the next connection.
            let permit = permits.clone().acquire_owned().await;
            (permit, listener.accept().await)
        };
        let (permit, accepted) = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            got = accept => got,
        };
        let Ok(permit) = permit else { break };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) if out_of_resources(&e) => {
                // Out of file descriptors and the like: every accept fails
                // until some are freed, so pause (longer each time) rather
                // than spin, and say so once.
                let pause = backoff.map_or(ACCEPT_BACKOFF_MIN, |b| (b * 2).min(ACCEPT_BACKOFF_MAX));
                if backoff.is_none() {
                    tracing::warn!(error = %e, "accept failed; pausing accepts until it succeeds");
                }
                backoff = Some(pause);
                failed_accepts += 1;
                drop(permit);
                tokio::select! {
                    _ = &mut shutdown => break,
                    () = tokio::time::sleep(pause) => continue,
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "accept failed");
                continue;
            }
        };
        if backoff.take().is_some() {
            tracing::info!(failed_accepts, "accepting connections again");
            failed_accepts = 0;
        }
        let _ = stream.set_nodelay(true);
        let Some(open) = open.clone() else { break };
        let lease = Arc::new(Lease::new(permit, closing_rx.clone(), cut_rx.clone(), open));
        let state = state.clone();
        let activity = Activity::new();
        let busy = activity.clone();
        let service = service_fn(move |req| {
            let state = state.clone();
            let busy = busy.begin();
            let lease = lease.clone();
            async move {
                let resp = route(state, peer, req, lease).await;
                Ok::<_, Infallible>(resp.map(|body| Tracked { body, _busy: busy }))
            }
        });
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let mut closing = closing_rx.clone();
        conns.spawn(async move {
            tokio::pin!(conn);
            let mut stopping = false;
            let mut not_before = tokio::time::Instant::now();
            let quiet = async |limit: Option<Duration>, not_before| match limit {
                Some(limit) => activity.idle_for(limit, not_before).await,
                None => std::future::pending().await,
            };
            loop {
                tokio::select! {
                    done = conn.as_mut() => {
                        if let Err(e) = done {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                        return;
                    }
                    _ = closing.wait_for(|c| *c), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    () = quiet(idle, not_before) => {
                        // Idle for the limit: ask it to close (HTTP/2 says
                        // GOAWAY); idle as long again, it is dropped.
                        if stopping {
                            return;
                        }
                        stopping = true;
                        not_before = tokio::time::Instant::now() + idle.unwrap_or_default();
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
        });
    }
    drop(listener);
    let _ = closing.send(true);
    let grace = Duration::from_secs(state.config.server.shutdown_grace_secs);
    tracing::info!(
        grace_secs = grace.as_secs(),
        "shutting down: draining in-flight requests"
    );
    let started = std::time::Instant::now();
    let drained = tokio::time::timeout(grace, async {
        while conns.join_next().await.is_some() {}
        // The connections are gone; the WebSockets they became finish
        // their responses.
        open = None;
        let _ = all_closed.recv().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            connections = conns.len(),
            "grace period over; closing remaining connections"
        );
        // Dropping a connection drops the answers it was streaming, which
        // record themselves as cut short (journaled before the store is
        // closed below).
        state.cut_at_shutdown.store(true, Ordering::Release);
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
    // With their connections gone, stream tasks still running have no one
    // to answer: end them, and wait until the last one (each holds a
    // sender) is dropped; WebSockets drop their responses and close.
    let _ = cut.send(true);
    drop(open);
    drop(builder);
    let _ = all_ended.recv().await;
    let _ = all_closed.recv().await;
    // The accounting lines (and estimate-based decisions) of the last
    // exchanges.
    let left = grace
        .saturating_sub(started.elapsed())
        .max(Duration::from_secs(1));
    if !state.background.drained(left).await {
        tracing::warn!(
            pending = state.background.pending(),
            "accounting not finished at shutdown"
        );
    }
    // Journaled exchanges into the database, so the journal is empty when
    // the process ends, and the store free for another server.
    if let Err(e) = state.store.close().await {
        tracing::warn!(error = %e, "store not flushed at shutdown; the journal keeps its records");
    }
}

async fn route(
    state: Arc<AppState>,
    peer: SocketAddr,
    req: Request<Incoming>,
    lease: Arc<Lease>,
) -> Response<ProxyBody> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let span = tracing::info_span!(
        "request",
        %method,
        %path,
        %peer,
        conversation = tracing::field::Empty,
        model = tracing::field::Empty,
        input_tokens = tracing::field::Empty,
        output_tokens = tracing::field::Empty,
        compaction = tracing::field::Empty,
    );
    async move {
        let metrics_state = state.clone();
        let (endpoint, response) = match (&method, path.as_str()) {
            // Counted under `other`: the metrics' endpoint labels are fixed.
            (_, p)
                if (p.starts_with("/v1/") || p.starts_with("/v1beta/"))
                    && state.upstream.looped(req.headers()) =>
            {
                ("other", ProxyError::LoopDetected.into_response())
            }
            // Someone who opens the proxy's address finds where to go; JSON,
            // as everything else here answers, which a browser shows too.
            (&Method::GET, "/") => (
                "other",
                json_response(
                    StatusCode::OK,
                    &serde_json::json!({
                        "name": "compactor",
                        "version": env!("CARGO_PKG_VERSION"),
                        "api": "/v1/",
                        "admin": "/admin/",
                        "health": "/healthz",
                        "ready": "/readyz",
                        "metrics": "/metrics",
                        "docs": "the README of compactor's source, and `compactor --help`",
                    }),
                ),
            ),
            (&Method::GET, "/healthz") => ("healthz", health::healthz()),
            (&Method::GET, "/readyz") => ("readyz", health::readyz(&state).await),
            (&Method::GET, "/metrics") => ("metrics", serve_metrics(&state)),
            (&Method::POST, "/v1/chat/completions") => {
                ("chat", proxy::handle(state, Api::Chat, req).await)
            }
            (&Method::GET, "/v1/responses") if websocket::is_upgrade(&req) => {
                (websocket::ENDPOINT, websocket::handle(state, req, lease))
            }
            (&Method::POST, "/v1/responses") => {
                ("responses", proxy::handle(state, Api::Responses, req).await)
            }
            (&Method::POST, "/v1/messages/count_tokens") => (
                "messages_count_tokens",
                count_tokens::handle(state, req).await,
            ),
            (&Method::POST, "/v1/messages") => {
                ("messages", proxy::handle(state, Api::Messages, req).await)
            }
            (&Method::POST, "/v1/responses/compact") => {
                ("responses_compact", proxy::handle_compact(state, req).await)
            }
            (m, p) if gemini::is_gemini(m, p) => gemini::handle(state, req).await,
            // The listing, each model with the window the proxy uses for it
            // (counted as passthrough: the endpoint labels are fixed).
            (&Method::GET, p) if models::is_listing(p) => {
                ("passthrough", models::handle(state, req).await)
            }
            (_, p) if p.starts_with("/v1/") => {
                ("passthrough", passthrough::handle(state, req).await)
            }
            (_, p) if p == "/admin" || p.starts_with("/admin/") => {
                ("admin", crate::admin::handle(state, peer, req).await)
            }
            _ => (
                "other",
                ProxyError::NotFound {
                    method: method.to_string(),
                    path: path.clone(),
                }
                .into_response(),
            ),
        };
        metrics_state
            .metrics
            .request(endpoint, response.status().as_u16());
        response
    }
    .instrument(span)
    .await
}
