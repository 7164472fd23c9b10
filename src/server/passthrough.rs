//! Every `/v1/*` path the proxy does not parse (models, embeddings, files…):
//! request and response stream through untouched, both directions.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::TryStreamExt;
use http::{Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Body, Frame, Incoming, SizeHint};

use super::read;
use crate::app::AppState;
use crate::error::{BodyError, ProxyBody, ProxyError};
use crate::upstream::strip_hop_by_hop;

/// Request bodies up to this declared length are read before they are sent,
/// so that the request can be sent again if a pooled connection turns out
/// closed (see `Upstream::send_bytes`); longer ones, and those of unknown
/// length, stream through.
const RESENDABLE_BODY: u64 = 1 << 20;

/// The paths the proxy parses, records and compacts; any other spelling of
/// them is refused (see [`check_path`]).
const PARSED: &[&str] = &[
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/responses/compact",
    "/v1/messages",
    "/v1/messages/count_tokens",
];

/// Refuses a path below `/v1/` that must not be forwarded as it is:
///
/// - one that could leave the upstream's base path once a URL parser reads
///   it: a dot segment (`..`, `.`, also percent-encoded, any case), a
///   backslash, or an encoded slash or backslash (`%2f`, `%5c`);
/// - one that names a parsed endpoint in another spelling
///   (`/v1/chat/completions/`, `/v1//chat/completions`,
///   `/v1/chat/%63ompletions`, `/v1/Chat/Completions`): forwarded, it would
///   reach the endpoint upstream around recording and compaction. Such a
///   request is refused rather than treated as the endpoint, so the client
///   learns its spelling is off instead of getting what another server
///   might not give it.
pub fn check_path(path: &str) -> Result<(), ProxyError> {
    let refuse = |why: &str| Err(ProxyError::InvalidPath(format!("path refused: {why}")));
    if path.contains('\\') {
        return refuse("it contains a backslash");
    }
    let mut canonical = String::with_capacity(path.len());
    for segment in path.split('/') {
        let decoded = percent_encoding::percent_decode_str(segment).decode_utf8_lossy();
        if decoded.contains(['/', '\\']) {
            return refuse("it contains an encoded slash or backslash (%2f, %5c)");
        }
        if decoded == "." || decoded == ".." {
            return refuse("it contains a dot segment (`.` or `..`, also encoded)");
        }
        // Path parameters (`;…`), which some servers ignore, and empty
        // segments do not change the endpoint a path names.
        let name = decoded.split(';').next().unwrap_or_default();
        if !name.is_empty() {
            canonical.push('/');
            canonical.push_str(&name.to_ascii_lowercase());
        }
    }
    // Gemini's parsed endpoints, in a spelling the route did not take.
    let gemini = [":generatecontent", ":streamgeneratecontent", ":counttokens"];
    if canonical.starts_with("/v1/models/") && gemini.iter().any(|m| canonical.ends_with(m)) {
        return refuse(
            "it spells a Gemini endpoint another way; send /v1beta/models/{model}:{method} exactly",
        );
    }
    if let Some(endpoint) = PARSED.iter().find(|p| **p == canonical) {
        return refuse(&format!(
            "it spells {endpoint} another way; send {endpoint} exactly"
        ));
    }
    Ok(())
}

/// The upstream URL a `/v1/*` request goes to: its path below `/v1` on the
/// upstream's base, its query kept, once [`check_path`] let it through.
pub fn upstream_url(state: &AppState, uri: &http::Uri) -> Result<reqwest::Url, ProxyError> {
    check_path(uri.path())?;
    let below = uri.path().strip_prefix("/v1").unwrap_or(uri.path());
    Ok(state.upstream.url(below, uri.query())?)
}

/// Forwards the request as is and streams the answer back.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
    let url = match upstream_url(&state, req.uri()) {
        Ok(url) => url,
        Err(e) => return e.into_response(),
    };
    let headers = state.upstream.request_headers(req.headers(), false);
    forward(state, req, url, headers).await
}

/// Forwards the request as is to `url` with `headers`, and streams the
/// answer back.
pub async fn forward(
    state: Arc<AppState>,
    req: Request<Incoming>,
    url: reqwest::Url,
    headers: http::HeaderMap,
) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let sent = if body.is_end_stream() {
        // Nothing to stream (a GET, mostly): it can be sent again if a
        // pooled connection turns out closed. A declared empty body is
        // declared upstream too.
        let mut headers = headers;
        if let Some(declared) = parts.headers.get(http::header::CONTENT_LENGTH) {
            headers.insert(http::header::CONTENT_LENGTH, declared.clone());
        }
        state
            .upstream
            .send_bodyless(parts.method.clone(), &url, headers)
            .await
    } else if read::declared_length(&parts.headers).is_some_and(|n| n <= RESENDABLE_BODY) {
        // Small (an embeddings request, say): read first, so that it too
        // can be sent again.
        let bytes = match read::read_body(
            body,
            &parts.headers,
            RESENDABLE_BODY as usize,
            state.config.body_read_timeout(),
        )
        .await
        {
            Ok(b) => b,
            Err(e) => return e.into_response(),
        };
        state
            .upstream
            .send_bytes(parts.method.clone(), &url, headers, bytes)
            .await
    } else {
        // Streamed upstream without buffering, framed as the client framed
        // it: a declared length stays declared.
        let idle = state.config.body_read_timeout();
        let watch = Watch::new(body);
        let upstream_body = reqwest::Body::wrap(Watched::new(watch.clone(), idle));
        let up = &state.upstream;
        // The upstream's time to answer starts once the upload is in; while
        // it goes on, the upstream must keep taking it.
        let give_up = async {
            tokio::select! {
                () = watch.all_sent() => {
                    tokio::time::sleep(up.response_timeout).await;
                    crate::upstream::Error::silent(up.response_timeout)
                }
                () = watch.not_taken_for(up.idle_timeout) => {
                    crate::upstream::Error::silent(up.idle_timeout)
                }
            }
        };
        let sent = up
            .send(parts.method.clone(), &url, headers, upstream_body, give_up)
            .await;
        if sent.is_err() {
            watch.abandon();
        }
        if let (true, Some(idle)) = (watch.stalled.load(Ordering::Acquire), idle) {
            return ProxyError::RequestTimeout(idle.as_secs()).into_response();
        }
        let broken = watch
            .broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let (Err(_), Some(why)) = (&sent, broken) {
            return ProxyError::BodyUnreadable(why.into()).into_response();
        }
        sent
    };
    let resp = match sent {
        Ok(r) => r,
        Err(e) => return ProxyError::from(e).into_response(),
    };
    relay(resp)
}

/// Streams an upstream response to the client unchanged (status, end-to-end
/// headers, body bytes — compressed bodies stay compressed).
pub fn relay(resp: reqwest::Response) -> Response<ProxyBody> {
    let status = resp.status();
    let headers = strip_hop_by_hop(resp.headers());
    let stream = resp
        .bytes_stream()
        .map_ok(Frame::data)
        .map_err(|e| -> BodyError { Box::new(e) });
    let mut out = Response::new(StreamBody::new(stream).boxed_unsync());
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// A client's request body the proxy streams upstream, and what it learns
/// about it on the way.
struct Watch {
    /// The body; taken away when the proxy gives up on the request, so an
    /// upstream that stopped taking it no longer holds the client's
    /// connection open.
    body: Mutex<Option<Incoming>>,
    /// The client sent nothing for the idle time, so the body failed.
    stalled: AtomicBool,
    /// The client's body itself failed (a malformed chunk, a connection
    /// cut mid-body): the client's fault, not the upstream's.
    broken: Mutex<Option<String>>,
    /// Notified once the last byte was handed on.
    all_sent: tokio::sync::Notify,
    started: std::time::Instant,
    /// When a piece was last handed on, ms after `started`.
    last_taken_ms: AtomicU64,
    /// The body waits for the client (not for the upstream to take more).
    awaiting_client: AtomicBool,
}

impl Watch {
    fn new(body: Incoming) -> Arc<Self> {
        Arc::new(Self {
            body: Mutex::new(Some(body)),
            stalled: AtomicBool::new(false),
            broken: Mutex::new(None),
            all_sent: tokio::sync::Notify::new(),
            started: std::time::Instant::now(),
            last_taken_ms: AtomicU64::new(0),
            awaiting_client: AtomicBool::new(false),
        })
    }

    fn body(&self) -> std::sync::MutexGuard<'_, Option<Incoming>> {
        self.body.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the client's body: the proxy answers without sending the rest.
    fn abandon(&self) {
        drop(self.body().take());
    }

    fn taken(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.last_taken_ms.store(ms, Ordering::Release);
        self.awaiting_client.store(false, Ordering::Release);
    }

    /// Resolves once the upstream side has taken nothing of the body for
    /// `idle` while the client had more ready (a piece was handed on and no
    /// other asked for since).
    async fn not_taken_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last_taken_ms.load(Ordering::Acquire));
            let quiet = self.started.elapsed().saturating_sub(last);
            if quiet >= idle && !self.awaiting_client.load(Ordering::Acquire) {
                return;
            }
            tokio::time::sleep(idle.saturating_sub(quiet).max(Duration::from_millis(100))).await;
        }
    }

    fn finished(&self) {
        // Stores a permit when nobody waits yet (one at most, however
        // often the end is seen).
        self.all_sent.notify_one();
    }

    /// Resolves once the whole body was handed on.
    async fn all_sent(&self) {
        self.all_sent.notified().await;
    }
}

/// The body of a [`Watch`] as the upstream request's body: fails once the
/// client has sent nothing for `idle` (as a body the proxy reads does, with
/// a 408), and tells the watch what happens.
struct Watched {
    watch: Arc<Watch>,
    idle: Option<Duration>,
    /// Armed while waiting for the client, reset after each frame.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    rearm: bool,
}

impl Watched {
    fn new(watch: Arc<Watch>, idle: Option<Duration>) -> Self {
        Self {
            watch,
            idle,
            timer: None,
            rearm: true,
        }
    }
}

impl Body for Watched {
    type Data = bytes::Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let (polled, ended) = {
            let mut body = this.watch.body();
            let Some(body) = body.as_mut() else {
                return Poll::Ready(Some(Err("the request was given up".into())));
            };
            (Pin::new(&mut *body).poll_frame(cx), body.is_end_stream())
        };
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                this.rearm = true;
                this.watch.taken();
                if ended {
                    this.watch.finished();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                let why = e.to_string();
                *this.watch.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                this.watch.finished();
                Poll::Ready(None)
            }
            Poll::Pending => {
                this.watch.awaiting_client.store(true, Ordering::Release);
                let Some(idle) = this.idle else {
                    return Poll::Pending;
                };
                let deadline = tokio::time::Instant::now() + idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if std::mem::take(&mut this.rearm) {
                    timer.as_mut().reset(deadline);
                }
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        this.watch.stalled.store(true, Ordering::Release);
                        let e = ProxyError::RequestTimeout(idle.as_secs());
                        Poll::Ready(Some(Err(e.into())))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.watch
            .body()
            .as_ref()
            .is_some_and(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.watch
            .body()
            .as_ref()
            .map_or_else(SizeHint::default, |b| b.size_hint())
    }
}

#[cfg(test)]
mod tests {
    use super::check_path;

    #[test]
    fn paths_that_could_leave_the_base_or_spell_an_endpoint_are_refused() {
        for path in [
            "/v1/../../etc/passwd",
            "/v1/%2e%2e/internal/admin",
            "/v1/%2E%2e/x",
            "/v1/.%2E/x",
            "/v1/./models",
            "/v1/%2e/models",
            "/v1/models/..",
            "/v1/models\\..\\admin",
            "/v1/models%5c..%5cadmin",
            "/v1/models%5C",
            "/v1/a%2fb",
            "/v1/a%2F..%2Fb",
            "/v1/chat/completions/",
            "/v1//chat/completions",
            "/v1/chat//completions",
            "/v1/chat/%63ompletions",
            "/v1/%43hat/Completions",
            "/v1/Chat/Completions",
            "/v1/chat/completions;x=1",
            "/v1/responses/",
            "/v1/RESPONSES",
            "/v1/responses//compact",
            "//v1/responses",
        ] {
            assert!(check_path(path).is_err(), "{path}");
        }
        for path in [
            "/v1/models",
            "/v1/models/gpt-4o",
            "/v1/files/file-abc/content",
            "/v1/embeddings",
            "/v1/chat/completions/chatcmpl-123",
            "/v1/responses/resp_123",
            "/v1/responses/resp_123/input_items",
            "/v1/files/a%20b",
            "/v1/...",
            "/v1/.well-known",
            "/v1/models/llama-3.1-8b.gguf",
        ] {
            assert!(check_path(path).is_ok(), "{path}");
        }
    }
}
