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
use crate::compaction::{engine, policy, rewrite, Compaction};
use crate::conversation::tenant_of;
use crate::error::{full, BodyError, ProxyBody, ProxyError};
use crate::upstream::{describe, strip_hop_by_hop};
use crate::wire::sse::SseTee;
use crate::wire::{self, chain_hashes, chat, item_hash, Api, ItemHash};

/// Response header naming the conversation.
pub const CONVERSATION_HEADER: &str = "x-compactor-conversation";
/// Response header naming the compaction applied to the request.
pub const COMPACTED_HEADER: &str = "x-compactor-compacted";

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
    let items = Arc::new(items);
    let chains = Arc::new(chains);
    let conversation = ident.conversation.clone();

    // A stored compaction covering a prefix of this request replaces it.
    let mut applied = match api {
        Api::Chat => state.compactions.find(&tenant, &chains),
        Api::Responses => None,
    };
    if api == Api::Chat {
        let view = view_of(&items, applied.as_deref());
        if engine::wait_if_needed(&state, &tenant, &conversation, &model, view).await {
            applied = state.compactions.find(&tenant, &chains);
        }
    }
    let original_bytes = if strip_usage {
        Bytes::from(serde_json::to_vec(&body).map_err(|e| ProxyError::Internal(e.to_string()))?)
    } else {
        raw
    };
    if api == Api::Chat && state.compactions.take_manual(&conversation) {
        let input = engine::Input {
            tenant: tenant.clone(),
            conversation: conversation.clone(),
            model: model.clone(),
            view: view_of(&items, applied.as_deref()),
            chains: chains.clone(),
            base: applied.clone(),
            auth: engine::auth_headers(&parts.headers),
            reason: "manual".into(),
            requested_ms: started_ms,
        };
        match engine::compact(&state, input).await {
            Ok(c) => applied = Some(c),
            Err(e) => tracing::warn!(error = %e, "manual compaction produced nothing"),
        }
    }
    let view = view_of(&items, applied.as_deref());
    let mut upstream_bytes = match &applied {
        Some(_) => with_items(&body, &view)?,
        None => original_bytes.clone(),
    };
    let mut pending = PendingExchange {
        id: state.store.next_exchange_id(),
        ident,
        explicit_key,
        tenant,
        api,
        model,
        body: Arc::new(body),
        chain_request: chains.last().copied().unwrap_or([0; 32]),
        hashes: Arc::new(hashes),
        items,
        chains,
        view,
        compaction: applied,
        auth: engine::auth_headers(&parts.headers),
        streamed,
        started,
        started_ms,
    };

    let url = state.upstream.url(api.endpoint(), parts.uri.query());
    let headers = state.upstream.request_headers(&parts.headers, true);
    let mut retried = false;
    let answer = loop {
        let resp = match state
            .upstream
            .send_bytes(Method::POST, &url, headers.clone(), upstream_bytes.clone())
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
        if resp.status().is_success() {
            break Answer::Upstream(resp);
        }
        // An error answer is small: read it whole to see whether it says the
        // prompt did not fit.
        let status = resp.status();
        let resp_headers = resp.headers().clone();
        let bytes = match tokio::time::timeout(state.upstream.idle_timeout, resp.bytes()).await {
            Ok(Ok(b)) => b,
            _ => Bytes::new(),
        };
        if !retried && api == Api::Chat {
            if policy::is_context_overflow(status.as_u16(), &bytes) {
                let input = engine::Input {
                    tenant: pending.tenant.clone(),
                    conversation: conversation.clone(),
                    model: pending.model.clone(),
                    view: pending.view.clone(),
                    chains: pending.chains.clone(),
                    base: pending.compaction.clone(),
                    auth: pending.auth.clone(),
                    reason: format!("overflow: upstream answered {status}"),
                    requested_ms: pending.started_ms,
                };
                match engine::compact(&state, input).await {
                    Ok(c) => {
                        pending.view = view_of(&pending.items, Some(&c));
                        upstream_bytes = with_items(&pending.body, &pending.view)?;
                        pending.compaction = Some(c);
                        retried = true;
                        tracing::info!("retrying once with the compacted request");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "overflow could not be compacted; relaying the upstream's answer")
                    }
                }
            } else if pending.compaction.is_some() && status.is_client_error() {
                // Compaction must never turn a request that would have
                // succeeded into a failure: send the client's own request.
                tracing::warn!(%status, "compacted request refused; resending it uncompacted");
                pending.compaction = None;
                pending.view = pending.items.clone();
                upstream_bytes = original_bytes.clone();
                retried = true;
                continue;
            }
        }
        break Answer::Error(status, resp_headers, bytes);
    };
    let applied = pending.compaction.clone();
    let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
    let mut response = match answer {
        Answer::Upstream(resp) => {
            let is_sse = resp
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|ct| ct.starts_with("text/event-stream"));
            if is_sse {
                stream_response(state, pending, resp, strip_usage, ttfb_ms)
            } else {
                let status = resp.status();
                let headers = resp.headers().clone();
                match tokio::time::timeout(state.upstream.idle_timeout, resp.bytes()).await {
                    Ok(Ok(b)) => {
                        buffered_response(state, pending, status, headers, b, ttfb_ms).await
                    }
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
                        let err =
                            ProxyError::UpstreamTimeout(state.upstream.idle_timeout.as_secs());
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
                }
            }
        }
        Answer::Error(status, headers, bytes) => {
            buffered_response(state, pending, status, headers, bytes, ttfb_ms).await
        }
    };
    if let Some(c) = &applied {
        if let Ok(v) = HeaderValue::from_str(&c.id) {
            response.headers_mut().insert(COMPACTED_HEADER, v);
        }
    }
    Ok(response)
}

/// What the upstream finally answered.
enum Answer {
    /// A success, body not yet read.
    Upstream(reqwest::Response),
    /// An error answer, read whole.
    Error(http::StatusCode, http::HeaderMap, Bytes),
}

/// The items as they go upstream: the compaction's replacement, then the
/// rest of the client's items; the client's items when none applies.
fn view_of(items: &Arc<Vec<Value>>, applied: Option<&Compaction>) -> Arc<Vec<Value>> {
    match applied {
        Some(c) => Arc::new(rewrite::rewrite(items, c)),
        None => items.clone(),
    }
}

/// The request body with its `messages` replaced by `view`.
fn with_items(body: &Value, view: &[Value]) -> Result<Bytes, ProxyError> {
    let mut out = body.clone();
    out["messages"] = Value::Array(view.to_vec());
    serde_json::to_vec(&out)
        .map(Bytes::from)
        .map_err(|e| ProxyError::Internal(e.to_string()))
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

/// A JSON (or error) answer, read whole: parsed for usage and output,
/// recorded, then released to the client byte for byte.
async fn buffered_response(
    state: Arc<AppState>,
    pending: PendingExchange,
    status: http::StatusCode,
    headers: http::HeaderMap,
    bytes: Bytes,
    ttfb_ms: f64,
) -> Response<ProxyBody> {
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
    response_head(status, &headers, &pending.ident.conversation, full(bytes))
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
