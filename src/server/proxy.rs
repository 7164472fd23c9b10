//! `POST /v1/chat/completions` and `POST /v1/responses`: parse, identify the
//! conversation, forward, tee the answer, record.
//!
//! The client's bytes go upstream unchanged unless the proxy must change
//! something (today: asking a chat stream for usage); the answer reaches the
//! client unchanged except for the `x-compactor-conversation` header and the
//! hiding of usage the client did not ask for.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::Value;

use super::exchange::{now_ms, Outcome, PendingExchange};
use super::AppState;
use crate::conversation::tenant_of;
use crate::error::{full, BodyError, ProxyBody, ProxyError};
use crate::upstream::{describe, strip_hop_by_hop};
use crate::wire::sse::SseTee;
use crate::wire::{self, chain_hashes, chat, item_hash, Api, ItemHash};

/// Response header naming the conversation.
pub const CONVERSATION_HEADER: &str = "x-compactor-conversation";

/// Handles one parsed-endpoint request; every failure becomes a JSON error.
pub async fn handle(state: Arc<AppState>, api: Api, req: Request<Incoming>) -> Response<ProxyBody> {
    match handle_inner(state, api, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn handle_inner(
    state: Arc<AppState>,
    api: Api,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let started = Instant::now();
    let started_ms = now_ms();
    let (parts, body) = req.into_parts();
    let raw = read_body(body, &parts.headers, state.config.server.max_body_bytes).await?;
    let mut body: Value = serde_json::from_slice(&raw)
        .map_err(|e| ProxyError::BadRequest(format!("request body is not valid JSON: {e}")))?;
    api.validate(&body).map_err(ProxyError::BadRequest)?;

    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let streamed = body.get("stream").and_then(Value::as_bool) == Some(true);
    let tenant = tenant_of(&state.tenant_salt, wire::credential(&parts.headers));
    let items = api.request_items(&body);
    let hashes: Vec<ItemHash> = items.iter().map(item_hash).collect();
    let chains = chain_hashes(&hashes);
    let explicit_key = wire::explicit_conversation_key(&parts.headers, &body);
    let previous = body.get("previous_response_id").and_then(Value::as_str);
    let ident = state
        .conversations
        .identify(&tenant, explicit_key.as_deref(), previous, &chains);
    tracing::Span::current().record("conversation", ident.conversation.as_str());

    let strip_usage = api == Api::Chat && chat::ensure_stream_usage(&mut body);
    let upstream_bytes = if strip_usage {
        Bytes::from(serde_json::to_vec(&body).map_err(|e| ProxyError::Internal(e.to_string()))?)
    } else {
        raw
    };

    let pending = PendingExchange {
        id: state.store.next_exchange_id(),
        ident,
        explicit_key,
        tenant,
        api,
        model,
        body: Arc::new(body),
        items: Arc::new(items),
        chain_request: chains.last().copied().unwrap_or([0; 32]),
        hashes: Arc::new(hashes),
        streamed,
        started,
        started_ms,
    };

    let url = state.upstream.url(api.endpoint(), parts.uri.query());
    let headers = state.upstream.request_headers(&parts.headers, true);
    let resp = match state
        .upstream
        .send_bytes(Method::POST, &url, headers, upstream_bytes)
        .await
    {
        Ok(r) => r,
        Err(e) => {
            let outcome = Outcome {
                status: e.status().as_u16(),
                error: Some(e.to_string()),
                ..Outcome::default()
            };
            pending.finish(&state, outcome).await;
            return Err(e);
        }
    };
    let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
    let is_sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    if is_sse && resp.status().is_success() {
        Ok(stream_response(state, pending, resp, strip_usage, ttfb_ms))
    } else {
        buffered_response(state, pending, resp, ttfb_ms).await
    }
}

/// Reads the whole body, refusing more than `limit` bytes with 413.
async fn read_body(
    body: Incoming,
    headers: &http::HeaderMap,
    limit: usize,
) -> Result<Bytes, ProxyError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ProxyError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ProxyError::PayloadTooLarge { limit })
        }
        Err(e) => Err(ProxyError::BadRequest(format!(
            "could not read request body: {e}"
        ))),
    }
}

/// Copies the upstream's status and end-to-end headers and adds ours.
fn response_head(
    status: http::StatusCode,
    upstream: &http::HeaderMap,
    conversation: &str,
    body: ProxyBody,
) -> Response<ProxyBody> {
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = strip_hop_by_hop(upstream);
    if let Ok(v) = HeaderValue::from_str(conversation) {
        out.headers_mut().insert(CONVERSATION_HEADER, v);
    }
    out
}

/// A JSON (or error) answer: read whole, parsed for usage and output,
/// recorded, then released to the client byte for byte.
async fn buffered_response(
    state: Arc<AppState>,
    pending: PendingExchange,
    resp: reqwest::Response,
    ttfb_ms: f64,
) -> Result<Response<ProxyBody>, ProxyError> {
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = match tokio::time::timeout(state.upstream.idle_timeout, resp.bytes()).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            let err = ProxyError::UpstreamUnreachable(describe(&e));
            pending
                .finish(
                    &state,
                    Outcome {
                        status: 502,
                        error: Some(err.to_string()),
                        ttfb_ms: Some(ttfb_ms),
                        ..Outcome::default()
                    },
                )
                .await;
            return Err(err);
        }
        Err(_) => {
            let err = ProxyError::UpstreamTimeout(state.upstream.idle_timeout.as_secs());
            pending
                .finish(
                    &state,
                    Outcome {
                        status: 504,
                        error: Some(err.to_string()),
                        ttfb_ms: Some(ttfb_ms),
                        ..Outcome::default()
                    },
                )
                .await;
            return Err(err);
        }
    };
    let mut outcome = Outcome {
        status: status.as_u16(),
        ttfb_ms: Some(ttfb_ms),
        ..Outcome::default()
    };
    if status.is_success() {
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            outcome.usage = pending.api.usage(&v);
            outcome.response_items = pending.api.response_items(&v);
            outcome.response_id = v.get("id").and_then(Value::as_str).map(String::from);
        }
    } else {
        outcome.error = Some(String::from_utf8_lossy(&bytes).into_owned());
    }
    pending.finish(&state, outcome).await;
    Ok(response_head(
        status,
        &headers,
        &pending.ident.conversation,
        full(bytes),
    ))
}

type UpstreamStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// State of a streamed answer between chunks.
struct Relay {
    state: Arc<AppState>,
    upstream: UpstreamStream,
    tee: SseTee,
    /// Taken once the exchange is recorded; still here on drop = client left.
    pending: Option<PendingExchange>,
    status: u16,
    ttfb_ms: f64,
    done: bool,
}

impl Relay {
    fn outcome(&self, partial: bool, error: Option<String>) -> Outcome {
        Outcome {
            status: self.status,
            usage: self.tee.usage(),
            response_items: self.tee.items(),
            response_id: self.tee.response_id(),
            error: error.or_else(|| self.tee.error().map(|e| e.to_string())),
            partial,
            ttfb_ms: Some(self.ttfb_ms),
        }
    }

    async fn record(&mut self, partial: bool, error: Option<String>) {
        if let Some(p) = self.pending.take() {
            let outcome = self.outcome(partial, error);
            p.finish(&self.state, outcome).await;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            // The client went away mid-stream: dropping `upstream` cancels the
            // upstream request; the exchange is kept as partial.
            let outcome = self.outcome(
                true,
                Some("client disconnected before the end of the stream".into()),
            );
            p.finish_detached(&self.state, outcome);
        }
    }
}

/// An SSE answer: forwarded chunk by chunk as it arrives, teed for usage and
/// output. The exchange is committed before the chunk carrying the terminal
/// event is released, so whatever the client saw complete is on disk.
fn stream_response(
    state: Arc<AppState>,
    pending: PendingExchange,
    resp: reqwest::Response,
    strip_usage: bool,
    ttfb_ms: f64,
) -> Response<ProxyBody> {
    let status = resp.status();
    let mut headers = resp.headers().clone();
    headers.remove(header::CONTENT_LENGTH);
    let conversation = pending.ident.conversation.clone();
    let relay = Relay {
        tee: SseTee::new(pending.api, strip_usage),
        state,
        upstream: Box::pin(resp.bytes_stream()),
        pending: Some(pending),
        status: status.as_u16(),
        ttfb_ms,
        done: false,
    };
    let body = futures_util::stream::unfold(relay, next_frame);
    response_head(
        status,
        &headers,
        &conversation,
        BodyExt::boxed_unsync(StreamBody::new(body)),
    )
}

async fn next_frame(mut r: Relay) -> Option<(Result<Frame<Bytes>, BodyError>, Relay)> {
    loop {
        if r.done {
            return None;
        }
        let idle: Duration = r.state.upstream.idle_timeout;
        match tokio::time::timeout(idle, r.upstream.next()).await {
            Ok(Some(Ok(chunk))) => {
                let out = r.tee.push(chunk);
                if r.tee.finished() {
                    r.record(false, None).await;
                }
                if out.is_empty() {
                    continue;
                }
                return Some((Ok(Frame::data(out)), r));
            }
            Ok(None) => {
                let out = r.tee.finish();
                let complete = r.tee.finished();
                r.record(
                    !complete,
                    (!complete).then(|| "upstream ended the stream without a final event".into()),
                )
                .await;
                r.done = true;
                if out.is_empty() {
                    return None;
                }
                return Some((Ok(Frame::data(out)), r));
            }
            Ok(Some(Err(e))) => {
                // Upstream broke off: end the client's stream uncleanly too,
                // as a direct connection would.
                let msg = describe(&e);
                r.record(true, Some(msg.clone())).await;
                r.done = true;
                return Some((Err(msg.into()), r));
            }
            Err(_) => {
                let msg = format!("upstream stream silent for {} s", idle.as_secs());
                r.record(true, Some(msg.clone())).await;
                r.done = true;
                return Some((Err(msg.into()), r));
            }
        }
    }
}
