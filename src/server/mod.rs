//! HTTP plumbing: the accept loop, graceful shutdown, routing.
//!
//! `run` takes a bound listener (never binds itself, so tests and the CLI
//! choose the port) and a shutdown future.

mod exchange;
pub use exchange::now_ms;
mod passthrough;
mod proxy;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tracing::Instrument;

use crate::background::Background;
use crate::compaction::engine::Compactions;
use crate::config::{Config, ModelLimits};
use crate::conversation::ConversationIndex;
use crate::error::{json_response, ProxyBody, ProxyError};
use crate::store::{sqlite::SqliteBackend, Store};
use crate::tokens::TokenCounter;
use crate::upstream::Upstream;
use crate::wire::Api;

/// Everything a request handler needs, shared by all connections.
pub struct AppState {
    /// The effective configuration.
    pub config: Config,
    /// The upstream client.
    pub upstream: Upstream,
    /// Records.
    pub store: Arc<Store>,
    /// Prefix / key / response-id → conversation.
    pub conversations: ConversationIndex,
    /// Token estimates.
    pub tokens: Arc<TokenCounter>,
    /// Salt of tenant hashes (per store).
    pub tenant_salt: [u8; 32],
    /// Stored compactions and running compaction jobs.
    pub compactions: Compactions,
    /// Prometheus metrics (`GET /metrics`).
    pub metrics: crate::metrics::Metrics,
    /// The thread for the accounting that follows each answer.
    pub background: &'static Background,
    /// [`Config::model_limits`] of the models seen, looked up once each,
    /// and whether a `[[models]]` entry gave them.
    limits: Mutex<foldhash::HashMap<String, (ModelLimits, bool)>>,
    /// The windows the upstream told (see [`crate::windows`]).
    pub windows: crate::windows::Windows,
}

impl AppState {
    /// Opens the store and builds the upstream client.
    pub fn open(config: Config) -> anyhow::Result<Arc<Self>> {
        let path = config.store_path();
        let backend = SqliteBackend::open_writer(&path)
            .map_err(|e| anyhow::anyhow!("cannot open store {}: {e}", path.display()))?;
        let journal = crate::store::Journal::open(&path)
            .map_err(|e| anyhow::anyhow!("cannot open the journal of {}: {e}", path.display()))?;
        let (store, mut snapshot) = Store::start(Box::new(backend), Some(journal))?;
        let conversations = ConversationIndex::from_snapshot(
            &snapshot,
            crate::store::sqlite::key_reader(path.clone()),
        );
        let stored = std::mem::take(&mut snapshot.compactions);
        let windows = crate::windows::Windows::from_stored(
            &config.upstream.base_url,
            std::mem::take(&mut snapshot.windows),
        );
        let compactions =
            Compactions::from_stored(stored, crate::store::sqlite::reader(path.clone()));
        Ok(Arc::new(AppState {
            compactions,
            upstream: Upstream::new(&config.upstream)?,
            store,
            conversations,
            tokens: TokenCounter::new_warm(),
            tenant_salt: snapshot.salt,
            metrics: crate::metrics::Metrics::new(),
            background: Background::global(),
            limits: Mutex::default(),
            windows,
            config,
        }))
    }

    /// The limits of `model`: [`Config::model_limits`] (which every
    /// exchange needs and the config cannot change while the process runs)
    /// with the window the upstream told applied.
    pub fn model_limits(&self, model: &str) -> ModelLimits {
        self.model_window(model).0
    }

    /// [`AppState::model_limits`] and where its window came from.
    pub fn model_window(&self, model: &str) -> (ModelLimits, crate::windows::Source) {
        let configured = {
            let mut known = self.limits.lock().unwrap_or_else(|p| p.into_inner());
            match known.get(model) {
                Some(l) => *l,
                None => {
                    let l = self.config.model_limits_sourced(model);
                    // Model names come from clients: keep the table bounded.
                    if known.len() >= 1024 {
                        known.clear();
                    }
                    known.insert(model.to_string(), l);
                    l
                }
            }
        };
        let source = if configured.1 {
            crate::windows::Source::Config
        } else {
            crate::windows::Source::Table
        };
        crate::windows::effective(configured.0, source, self.windows.told(model).as_ref())
    }

    /// The effective window of every model seen or told, by name:
    /// (model, tokens, source).
    pub fn models_seen(&self) -> Vec<(String, u64, &'static str)> {
        let mut names: Vec<String> = self
            .limits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        names.extend(self.windows.all().into_iter().map(|t| t.model));
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|m| {
                let (l, s) = self.model_window(&m);
                (m, l.context_window, s.as_str())
            })
            .collect()
    }
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
/// arrived together (`proxy::gather`) also lasts until such a check. At
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

/// Serves connections from `listener` until `shutdown` resolves, then stops
/// accepting and gives in-flight requests `server.shutdown_grace_secs` to end.
pub async fn run(listener: TcpListener, state: Arc<AppState>, shutdown: impl Future<Output = ()>) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // A client that sends its headers slowly, or never, would hold its
    // connection (and a task) until the OS gave up on it.
    let header_read = state.config.server.header_read_timeout_secs;
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout((header_read > 0).then(|| Duration::from_secs(header_read)));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let service = service_fn(move |req| {
            let state = state.clone();
            async move { Ok::<_, Infallible>(route(state, peer, req).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let grace = Duration::from_secs(state.config.server.shutdown_grace_secs);
    tracing::info!(
        grace_secs = grace.as_secs(),
        "shutting down: draining in-flight requests"
    );
    let started = std::time::Instant::now();
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("grace period over; closing remaining connections");
    }
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
            (&Method::GET, "/healthz") => (
                "healthz",
                json_response(StatusCode::OK, &serde_json::json!({"status": "ok"})),
            ),
            (&Method::GET, "/metrics") => ("metrics", crate::metrics::serve(&state)),
            (&Method::POST, "/v1/chat/completions") => {
                ("chat", proxy::handle(state, Api::Chat, req).await)
            }
            (&Method::POST, "/v1/responses") => {
                ("responses", proxy::handle(state, Api::Responses, req).await)
            }
            (&Method::POST, "/v1/responses/compact") => {
                ("responses_compact", proxy::handle_compact(state, req).await)
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
