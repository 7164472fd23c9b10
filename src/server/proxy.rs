//! `POST /v1/chat/completions` and `POST /v1/responses`: parse, identify the
//! conversation, forward, tee the answer, record.
//!
//! The client's bytes go upstream unchanged unless the proxy must change
//! something (today: asking a chat stream for usage); the answer reaches the
//! client unchanged except for the `x-compactor-conversation` header and the
//! hiding of usage the client did not ask for.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::Value;

use super::exchange::{Outcome, PendingExchange};
use crate::app::AppState;
use crate::compaction::{policy, remote, Compaction};
use crate::conversation::tenant_of;
use crate::engine;
use crate::error::{full, BodyError, ProxyBody, ProxyError};
use crate::ids::now_ms;
use crate::upstream::{describe, strip_hop_by_hop, Payload};
use crate::wire::items::{cached_hash, split_body_reusing, ItemList, Tools};
use crate::wire::sse::SseTee;
use crate::wire::{self, chat, item_hash, Api};

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

/// A parsed request, before it goes upstream.
struct Parsed {
    /// The exchange under way (items, view, compaction applied…).
    pending: Unanswered,
    /// The client's body as it goes upstream when no compaction applies.
    original_bytes: Payload,
    /// The proxy asked for stream usage the client did not ask for.
    strip_usage: bool,
    /// The input ended with Codex's in-band `compaction_trigger`.
    trigger: bool,
}

/// Reads, parses and validates a request of `api`; expands what the proxy
/// stands for (a recorded `previous_response_id` chain, its own `compaction`
/// items); identifies the conversation; applies a stored compaction.
async fn parse(
    state: &Arc<AppState>,
    api: Api,
    parts: &http::request::Parts,
    body: Incoming,
    started: Instant,
    started_ms: i64,
) -> Result<Parsed, ProxyError> {
    let raw = read_body(
        body,
        &parts.headers,
        state.config.server.max_body_bytes,
        state.config.body_read_timeout(),
    )
    .await?;
    let raw_len = raw.len();
    let tenant = tenant_of(&state.tenant_salt, wire::credential(&parts.headers));
    // The history stays bytes (see `wire::items`), and the part of it that
    // repeats the tenant's recent request is not even parsed again; a body
    // that is not an object with an item array is parsed whole, which
    // names what is wrong.
    let (mut body, spans, body_key, tools, reuse, shell) =
        match split_body_reusing(&raw, api.items_key(), &tenant) {
            Some(split) => {
                let tools = split
                    .tools
                    .map(|(span, key)| Tools::raw(raw.clone(), span, key));
                (
                    split.body,
                    split.spans,
                    Some(split.body_key),
                    tools,
                    split.reuse,
                    split.shell,
                )
            }
            None => {
                let mut body: Value = serde_json::from_slice(&raw).map_err(|e| {
                    ProxyError::BadRequest(format!("request body is not valid JSON: {e}"))
                })?;
                let tools = Tools::take(&mut body);
                (body, None, None, tools, None, None)
            }
        };
    api.validate(&body).map_err(ProxyError::BadRequest)?;
    let previous = body
        .get("previous_response_id")
        .and_then(Value::as_str)
        .map(String::from);
    let mut rewritten = false;
    let mut trigger = false;
    let mut items = api
        .item_list(&mut body, raw.clone(), spans)
        .with_reuse(reuse)
        .with_shell(shell);
    // A chain the proxy recorded, its own compaction items and Codex's
    // compaction trigger change the items; anything else leaves them as
    // the client's bytes.
    let history = match &previous {
        Some(prev) if api == Api::Responses => previous_history(state, &tenant, prev).await,
        _ => None,
    };
    if api == Api::Responses && (history.is_some() || items.may_contain("\"compaction")) {
        let mut values = items.into_values();
        // A chain the proxy recorded is expanded into full input, so it can
        // be compacted and works with upstreams that keep no responses.
        if let Some(mut history) = history {
            history.extend(
                values
                    .drain(..)
                    .filter(|i| !wire::responses::is_instructions_item(i)),
            );
            if let Some(obj) = body.as_object_mut() {
                obj.remove("previous_response_id");
            }
            values = history;
            rewritten = true;
        }
        rewritten |= remote::expand_items(&mut values, |id| state.compactions.get(&tenant, id));
        trigger = remote::ends_with_trigger(&values);
        if trigger {
            values.pop();
        }
        items = values.into();
    }
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let streamed = body.get("stream").and_then(Value::as_bool) == Some(true);
    let (hashes, chains, claims) = items.hashes_and_chains(&tenant);
    let explicit_key = wire::explicit_conversation_key(&parts.headers, &body);
    let ident = state.conversations.identify(
        &tenant,
        explicit_key.as_deref(),
        previous.as_deref(),
        &chains,
    );
    let span = tracing::Span::current();
    span.record("conversation", ident.conversation.as_str());
    span.record("model", model.as_str());
    state.metrics.conversation_seen(&ident.conversation);

    // The body stays the client's; only the bytes going upstream ask for
    // the usage it did not ask for.
    let had_stream_options = body.get("stream_options").is_some();
    let strip_usage = api == Api::Chat && chat::lacks_stream_usage(&body);
    let spliced = (strip_usage && !had_stream_options && !rewritten)
        .then(|| chat::splice_stream_usage(&raw))
        .flatten();
    let original_bytes = match spliced {
        Some((head, rest)) => Payload::joined(head, rest),
        None if strip_usage || rewritten => {
            let mut full = body.clone();
            if strip_usage {
                chat::ensure_stream_usage(&mut full);
            }
            api.set_items(&mut full, &items.values());
            Tools::restore(tools.as_ref(), &mut full);
            Bytes::from(serde_json::to_vec(&full).map_err(|e| ProxyError::Internal(e.to_string()))?)
                .into()
        }
        None => raw.into(),
    };
    // The parameters' hash, through their bytes unless the proxy changed
    // the body (an expanded `previous_response_id`).
    let full_hash = || {
        let mut full = body.clone();
        Tools::restore(tools.as_ref(), &mut full);
        item_hash(&full)
    };
    let params = match body_key {
        Some(key) if !rewritten => cached_hash(key, full_hash),
        _ => full_hash(),
    };
    let items: Arc<ItemList> = Arc::new(items);
    let mut pending = Unanswered::new(
        state,
        PendingExchange {
            id: state.store.next_exchange_id(),
            ident,
            explicit_key,
            tenant,
            api,
            model,
            body: Arc::new(body),
            params,
            tools,
            chain_request: chains.last().copied().unwrap_or([0; 32]),
            hashes: Arc::new(hashes),
            view: items.clone(),
            items,
            chains: Arc::new(chains),
            claims,
            compaction: None,
            mode: crate::config::Mode::Auto,
            observed: None,
            auth: engine::auth_headers(&parts.headers),
            streamed,
            started,
            started_ms,
            span,
        },
    );
    // The first request of a model asks the upstream for its window
    // (bounded in time), so that the check below already uses it.
    super::discovery::discover(state, &pending.model, &pending.auth).await;
    // A stored compaction covering a prefix of this request replaces it; a
    // request too large to go without one waits for one under way.
    if let Some(c) = state.compactions.find(&pending.tenant, &pending.chains) {
        pending.apply(c);
    }
    let bytes = pending.compaction.is_none().then_some(raw_len);
    let check = engine::FitCheck {
        tenant: &pending.tenant,
        conversation: &pending.ident.conversation,
        model: &pending.model,
        view: pending.view.clone(),
        hashes: Arc::ptr_eq(&pending.view, &pending.items).then(|| pending.hashes.clone()),
        tools: pending.tools.clone(),
        bytes,
    };
    match engine::check_fit(state, check).await {
        engine::Fit::Fits => {}
        engine::Fit::Waited => {
            if let Some(c) = state.compactions.find(&pending.tenant, &pending.chains) {
                pending.apply(c);
            }
        }
        // Too large to go out as it is, and nothing under way: compact now
        // rather than let the upstream refuse it.
        engine::Fit::Over(tokens) => {
            compact_now(
                state,
                &mut pending,
                format!("hard_limit: ~{tokens} tokens leave no room for the answer"),
                engine::Goal::HardLimit,
            )
            .await;
        }
    }
    Ok(Parsed {
        pending,
        original_bytes,
        strip_usage,
        trigger,
    })
}

/// Computes a compaction of the request's view now, to reach `goal`, and
/// applies it.
async fn compact_now(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    reason: String,
    goal: engine::Goal,
) -> bool {
    let mut input = pending.input(reason, false);
    input.goal = goal;
    match engine::compact(state, input).await {
        Ok(c) => {
            pending.apply(c);
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "no compaction could be applied");
            false
        }
    }
}

/// Most reactive compactions of one request. The first fits the limit the
/// upstream stated; a second is for an upstream whose tokenizer counts
/// well above the estimate, and aims [`policy::FIT_MARGIN`] below the size
/// refused again.
const MAX_REACTIVE_RETRIES: u32 = 2;

/// The upstream refused the request as too long: remembers the window it
/// stated, and compacts the request to fit it.
async fn compact_on_overflow(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    stated: policy::Stated,
    why: &str,
) -> bool {
    if let Some(window) = stated.limit {
        super::discovery::tell(
            state,
            &pending.model,
            window,
            crate::windows::Source::Learned,
        )
        .await;
    }
    let max_output = request_max_output(&pending.body);
    let goal = engine::Goal::Overflow { stated, max_output };
    compact_now(state, pending, format!("overflow: {why}"), goal).await
}

/// The largest answer the request asks for, if it sets one (Chat's
/// `max_tokens` / `max_completion_tokens`, Responses' `max_output_tokens`).
fn request_max_output(body: &Value) -> Option<u64> {
    ["max_completion_tokens", "max_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64))
}

async fn handle_inner(
    state: Arc<AppState>,
    api: Api,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let started = Instant::now();
    let started_ms = now_ms();
    let (parts, body) = req.into_parts();
    let Parsed {
        mut pending,
        original_bytes,
        strip_usage,
        trigger,
    } = parse(&state, api, &parts, body, started, started_ms).await?;
    if trigger {
        return answer_trigger(&state, pending).await;
    }
    if state.compactions.take_manual(&pending.ident.conversation) {
        compact_now(&state, &mut pending, "manual".into(), engine::Goal::Shrink).await;
    }

    let url = state.upstream.url(api.endpoint(), parts.uri.query())?;
    let headers = state.upstream.request_headers(&parts.headers, true);
    // Reactive compactions of this request: each retry is smaller than
    // the request refused before it (see `policy::fit_limit`).
    let mut reactive = 0;
    let mut retried = false;
    let answer = loop {
        // The client's bytes, or the body with the compaction applied now.
        let upstream_bytes = match pending.upstream_bytes(&original_bytes) {
            Ok(b) => b,
            Err(e) => return Err(fail(&state, pending.into_inner(), e, None).await),
        };
        let resp = match state
            .upstream
            .send_bytes(Method::POST, &url, headers.clone(), upstream_bytes)
            .await
        {
            Ok(r) => r,
            Err(e) => return Err(fail(&state, pending.into_inner(), e, None).await),
        };
        if resp.status().is_success() {
            if api != Api::Responses || !is_sse(resp.headers()) {
                break Answer::Upstream(resp);
            }
            // Hold the first events back until the upstream commits to an
            // answer, so a start that fails for lack of room can be retried.
            let held = match hold_back(resp, state.upstream.idle_timeout).await {
                Ok(h) => h,
                Err(e) => return Err(fail(&state, pending.into_inner(), e, None).await),
            };
            let overflow = held
                .failure
                .as_ref()
                .filter(|data| policy::is_context_overflow(400, data.as_bytes()))
                .map(|data| policy::stated_limits(data.as_bytes()));
            if let Some(stated) = overflow {
                if reactive < MAX_REACTIVE_RETRIES
                    && compact_on_overflow(&state, &mut pending, stated, "upstream stream failed")
                        .await
                {
                    reactive += 1;
                    retried = true;
                    state.metrics.reactive_retry();
                    continue;
                }
            }
            break Answer::Held(held);
        }
        // An error answer is small: read it whole to see whether it says the
        // prompt did not fit.
        let status = resp.status();
        let resp_headers = resp.headers().clone();
        // One the upstream broke off, or too large to read whole, is the
        // proxy's 502: relaying the status without its body would not be
        // what the upstream said.
        let bytes = match state.upstream.read_body(resp).await {
            Ok(b) => b,
            Err(e) => return Err(fail(&state, pending.into_inner(), e, None).await),
        };
        if policy::is_context_overflow(status.as_u16(), &bytes) {
            let stated = policy::stated_limits(&bytes);
            let why = format!("upstream answered {status}");
            if reactive < MAX_REACTIVE_RETRIES
                && compact_on_overflow(&state, &mut pending, stated, &why).await
            {
                reactive += 1;
                retried = true;
                state.metrics.reactive_retry();
                continue;
            }
        } else if !retried && pending.compaction.is_some() && status.is_client_error() {
            // Compaction must never turn a request that would have succeeded
            // into a failure: send the client's own request.
            tracing::warn!(%status, "compacted request refused; resending it uncompacted");
            pending.unapply();
            retried = true;
            continue;
        }
        break Answer::Error(status, resp_headers, bytes);
    };
    let applied = pending.compaction.clone();
    let mut response = match answer {
        Answer::Held(mut held) => {
            held.take_delivered().await;
            let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
            stream_response(state, pending.into_inner(), held, strip_usage, ttfb_ms)
        }
        Answer::Upstream(resp) if is_sse(resp.headers()) => {
            let mut held = Held {
                status: resp.status(),
                headers: resp.headers().clone(),
                chunks: Vec::new(),
                failure: None,
                rest: Box::pin(resp.bytes_stream()),
                end: None,
            };
            held.take_delivered().await;
            let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
            stream_response(state, pending.into_inner(), held, strip_usage, ttfb_ms)
        }
        Answer::Upstream(resp) => {
            let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
            let status = resp.status();
            let headers = resp.headers().clone();
            match state.upstream.read_body(resp).await {
                Ok(b) => {
                    let pending = pending.into_inner();
                    buffered_response(state, pending, status, headers, b, ttfb_ms).await
                }
                Err(err) => {
                    return Err(fail(&state, pending.into_inner(), err, Some(ttfb_ms)).await)
                }
            }
        }
        Answer::Error(status, headers, bytes) => {
            let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
            buffered_response(state, pending.into_inner(), status, headers, bytes, ttfb_ms).await
        }
    };
    if let Some(c) = &applied {
        if let Ok(v) = HeaderValue::from_str(&c.id) {
            response.headers_mut().insert(COMPACTED_HEADER, v);
        }
    }
    Ok(response)
}

/// Records an exchange that failed before an answer could be relayed and
/// returns the error for the client.
async fn fail(
    state: &Arc<AppState>,
    pending: PendingExchange,
    err: ProxyError,
    ttfb_ms: Option<f64>,
) -> ProxyError {
    let outcome = Outcome {
        status: err.status().as_u16(),
        error: Some(err.to_string()),
        ttfb_ms,
        ..Outcome::default()
    };
    pending.finish(state, outcome).await;
    err
}

/// Codex's in-band compaction: the input ended with `compaction_trigger`.
/// Answered by the proxy itself with exactly one `compaction` item, which
/// later requests carry and the proxy expands into its summary.
async fn answer_trigger(
    state: &Arc<AppState>,
    pending: Unanswered,
) -> Result<Response<ProxyBody>, ProxyError> {
    let mut input = pending.input("requested: compaction_trigger".into(), true);
    input.goal = engine::Goal::HardLimit;
    let compacted = engine::compact(state, input).await;
    let pending = pending.into_inner();
    let c = match compacted {
        Ok(c) => c,
        Err(e) => {
            let err = e.into_refusal();
            return Err(fail(state, pending, err, None).await);
        }
    };
    let item = remote::compaction_item(&c, remote::Form::Full);
    let response = compaction_response(&c, &pending.model, vec![item.clone()]);
    let outcome = Outcome {
        status: 200,
        usage: pending.api.usage(&response),
        response_items: vec![item],
        response_id: response.get("id").and_then(Value::as_str).map(String::from),
        ..Outcome::default()
    };
    pending.finish(state, outcome).await;
    let body = if pending.streamed {
        let events = compaction_events(&response);
        let mut resp = Response::new(full(events));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        resp
    } else {
        crate::error::json_response(http::StatusCode::OK, &response)
    };
    let mut resp = body;
    for (name, value) in [
        (CONVERSATION_HEADER, &pending.ident.conversation),
        (COMPACTED_HEADER, &c.id),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            resp.headers_mut().insert(name, v);
        }
    }
    Ok(resp)
}

/// A completed Responses answer carrying compaction output.
fn compaction_response(c: &Compaction, model: &str, output: Vec<Value>) -> Value {
    let output_tokens = c.tokens_after.saturating_sub(c.items_kept as u64);
    serde_json::json!({
        "id": format!("resp_{}", c.id),
        "object": "response",
        "created_at": c.created_ms / 1000,
        "status": "completed",
        "model": model,
        "output": output,
        "usage": {"input_tokens": c.tokens_before, "output_tokens": output_tokens,
                  "total_tokens": c.tokens_before + output_tokens},
    })
}

/// The SSE events of a completed response (created, each item added and
/// done, completed).
fn compaction_events(response: &Value) -> Bytes {
    let mut out = String::new();
    let mut seq = 0;
    let mut push = |kind: &str, mut data: Value| {
        data["type"] = Value::String(kind.into());
        data["sequence_number"] = seq.into();
        seq += 1;
        out.push_str(&format!("event: {kind}\ndata: {data}\n\n"));
    };
    let mut created = response.clone();
    created["status"] = "in_progress".into();
    created["output"] = Value::Array(Vec::new());
    push("response.created", serde_json::json!({"response": created}));
    for (i, item) in response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        push(
            "response.output_item.added",
            serde_json::json!({"output_index": i, "item": item}),
        );
        push(
            "response.output_item.done",
            serde_json::json!({"output_index": i, "item": item}),
        );
    }
    push(
        "response.completed",
        serde_json::json!({"response": response}),
    );
    Bytes::from(out)
}

/// `POST /v1/responses/compact`, served by the proxy for any upstream:
/// compacts the given input and answers in OpenAI's shape.
pub async fn handle_compact(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
    let started = Instant::now();
    let started_ms = now_ms();
    let (parts, body) = req.into_parts();
    let result = async {
        let Parsed { pending, .. } =
            parse(&state, Api::Responses, &parts, body, started, started_ms).await?;
        // This endpoint records the compaction it makes, not an exchange.
        let pending = pending.into_inner();
        let mut input = pending.input("requested: /v1/responses/compact".into(), true);
        input.goal = engine::Goal::HardLimit;
        let c = engine::compact(&state, input)
            .await
            .map_err(engine::CompactError::into_refusal)?;
        let mut answer = compaction_response(&c, &pending.model, remote::endpoint_output(&c));
        answer["object"] = "response.compaction".into();
        answer["id"] = Value::String(c.id.clone());
        let mut resp = crate::error::json_response(http::StatusCode::OK, &answer);
        for (name, value) in [
            (CONVERSATION_HEADER, &pending.ident.conversation),
            (COMPACTED_HEADER, &c.id),
        ] {
            if let Ok(v) = HeaderValue::from_str(value) {
                resp.headers_mut().insert(name, v);
            }
        }
        Ok::<_, ProxyError>(resp)
    }
    .await;
    result.unwrap_or_else(ProxyError::into_response)
}

/// An exchange whose answer has not been handed to the client yet. A
/// client that leaves before then (a timeout while the model thinks, say)
/// makes hyper drop the request's future, and this with it: the exchange
/// is recorded with status 499 (as nginx logs a client that closed the
/// request), and the upstream request, dropped with the future, is
/// cancelled. Every path that answers takes the exchange out first.
struct Unanswered {
    state: Arc<AppState>,
    /// Always here until [`Unanswered::into_inner`] or the drop.
    pending: Option<PendingExchange>,
}

/// The status recorded for an exchange whose client left before its answer.
pub const CLIENT_CLOSED: u16 = 499;

impl Unanswered {
    fn new(state: &Arc<AppState>, pending: PendingExchange) -> Self {
        Self {
            state: state.clone(),
            pending: Some(pending),
        }
    }

    /// The exchange, for the path that answers (and records) it.
    fn into_inner(mut self) -> PendingExchange {
        self.pending.take().expect("present until taken")
    }
}

impl std::ops::Deref for Unanswered {
    type Target = PendingExchange;
    fn deref(&self) -> &PendingExchange {
        self.pending.as_ref().expect("present until taken")
    }
}

impl std::ops::DerefMut for Unanswered {
    fn deref_mut(&mut self) -> &mut PendingExchange {
        self.pending.as_mut().expect("present until taken")
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            let outcome = Outcome {
                status: CLIENT_CLOSED,
                error: Some(format!("{} before the answer", self.state.cut_reason())),
                ..Outcome::default()
            };
            p.finish_detached(&self.state, outcome);
        }
    }
}

/// What the upstream finally answered.
enum Answer {
    /// A success, body not yet read.
    Upstream(reqwest::Response),
    /// A stream whose first events were read and held back.
    Held(Held),
    /// An error answer, read whole.
    Error(http::StatusCode, http::HeaderMap, Bytes),
}

/// A stream whose first events are held back.
struct Held {
    status: http::StatusCode,
    headers: http::HeaderMap,
    /// Bytes read so far, in order.
    chunks: Vec<Bytes>,
    /// The data of a `response.failed` / `error` event seen before any output.
    failure: Option<String>,
    /// The rest of the body.
    rest: UpstreamStream,
    /// How the body ended (or failed), if it did while being read.
    end: Option<Option<reqwest::Result<Bytes>>>,
}

impl Held {
    /// Adds to the chunks what the upstream delivered with them (see
    /// [`take_delivered`]), so that the answer's first write carries it all:
    /// with a short answer, the whole of it.
    async fn take_delivered(&mut self) {
        if self.end.is_some() {
            return;
        }
        let chunks = &mut self.chunks;
        let mut size: usize = chunks.iter().map(Bytes::len).sum();
        self.end = take_delivered(&mut self.rest, size, |chunk| {
            size += chunk.len();
            chunks.push(chunk);
            size
        })
        .await;
    }
}

/// Longest time a Responses stream's first events are held back waiting
/// for the upstream to commit (a reasoning model may think silently first).
const MAX_HOLD_BACK: Duration = Duration::from_secs(10);

/// Event types that come before a Responses stream commits to an answer.
const PRELUDE_EVENTS: &[&str] = &[
    "response.created",
    "response.in_progress",
    "response.queued",
];

/// Reads a Responses stream until its first event past the prelude: an
/// output event (committed) or a failure.
async fn hold_back(resp: reqwest::Response, idle: Duration) -> Result<Held, ProxyError> {
    let status = resp.status();
    let headers = resp.headers().clone();
    let mut rest: UpstreamStream = Box::pin(resp.bytes_stream());
    let mut chunks = Vec::new();
    let mut buf = Vec::new();
    let mut scanned = 0;
    let release_at = tokio::time::Instant::now() + MAX_HOLD_BACK;
    let mut end = None;
    loop {
        // What the upstream has delivered already is taken without arming a
        // timer: a timer due before every other one wakes the runtime's
        // driver (a syscall), and the first events of an answer usually
        // come together.
        let mut size = buf.len();
        let delivered = take_delivered(&mut rest, size, |chunk| {
            size += chunk.len();
            buf.extend_from_slice(&chunk);
            chunks.push(chunk);
            size
        })
        .await;
        let (events, used) = wire::sse::complete_events(&buf[scanned..]);
        scanned += used;
        for (name, data) in events {
            let kind = wire::responses::event_type(&data).unwrap_or(name);
            if PRELUDE_EVENTS.contains(&kind.as_str()) {
                continue;
            }
            let failure = (kind == "response.failed" || kind == "error").then_some(data);
            return Ok(Held {
                status,
                headers,
                chunks,
                failure,
                rest,
                end: delivered,
            });
        }
        match delivered {
            Some(Some(Err(e))) => return Err(ProxyError::UpstreamUnreachable(describe(&e))),
            Some(_) => {
                end = Some(None);
                break;
            }
            None => {}
        }
        // Past the hold-back limit the stream is released as it is (a later
        // failure is relayed); the client must not wait on a silent start.
        let wait = release_at.saturating_duration_since(tokio::time::Instant::now());
        if wait.is_zero() {
            break;
        }
        let next = match tokio::time::timeout(wait.min(idle), rest.next()).await {
            Ok(next) => next,
            Err(_) if wait <= idle => break,
            Err(_) => return Err(ProxyError::UpstreamTimeout(idle.as_secs())),
        };
        let Some(chunk) = next else {
            end = Some(None);
            break;
        };
        let chunk = chunk.map_err(|e| ProxyError::UpstreamUnreachable(describe(&e)))?;
        buf.extend_from_slice(&chunk);
        chunks.push(chunk);
    }
    Ok(Held {
        status,
        headers,
        chunks,
        failure: None,
        rest,
        end,
    })
}

fn is_sse(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"))
}

/// The recorded history a `previous_response_id` continues, if the proxy
/// relayed that response for this tenant.
async fn previous_history(state: &Arc<AppState>, tenant: &str, id: &str) -> Option<Vec<Value>> {
    // The response may be the one just relayed, still on its way from the
    // journal into the database.
    if let Err(e) = state.store.flush().await {
        tracing::warn!(error = %e, "store flush failed before a previous_response_id lookup");
    }
    let reads = state.reads.clone();
    let (tenant, id) = (tenant.to_string(), id.to_string());
    tokio::task::spawn_blocking(move || reads.response_history(&tenant, &id))
        .await
        .ok()
        .flatten()
}

/// Most bytes allocated for a request body before they arrive.
const PRESIZE_LIMIT: usize = 1 << 20;

/// The body length a request declares (`content-length`), if any.
pub(super) fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Reads the whole body, refusing more than `limit` bytes with 413, and a
/// client that sends nothing of it for `idle` (if set) with 408.
pub(super) async fn read_body(
    body: Incoming,
    headers: &http::HeaderMap,
    limit: usize,
    idle: Option<Duration>,
) -> Result<Bytes, ProxyError> {
    let declared = declared_length(headers);
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ProxyError::PayloadTooLarge { limit });
    }
    // Into a buffer of its own, sized as declared (up to a point: a client
    // may declare more than it sends): the body outlives the request
    // (recent requests are kept to recognise the next one's history), so it
    // must not hold on to a larger connection buffer.
    let presize = declared.unwrap_or(0).min(PRESIZE_LIMIT as u64) as usize;
    let mut buf = bytes::BytesMut::with_capacity(presize);
    let mut body = Limited::new(body, limit);
    loop {
        // A frame already received is taken without arming the timer.
        let frame = match idle {
            Some(idle) => tokio::time::timeout(idle, body.frame())
                .await
                .map_err(|_| ProxyError::RequestTimeout(idle.as_secs()))?,
            None => body.frame().await,
        };
        let Some(frame) = frame else { break };
        match frame {
            Ok(frame) => {
                if let Some(data) = frame.data_ref() {
                    buf.extend_from_slice(data);
                }
            }
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(ProxyError::PayloadTooLarge { limit });
            }
            Err(e) => {
                return Err(ProxyError::BadRequest(format!(
                    "could not read request body: {e}"
                )))
            }
        }
    }
    Ok(buf.freeze())
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
    let mut headers = headers;
    let bytes = if status.is_success() {
        bytes
    } else {
        let shown = state.upstream.hide_own_key(bytes);
        // The length the upstream announced is the unredacted body's.
        headers.remove(http::header::CONTENT_LENGTH);
        shown
    };
    response_head(status, &headers, &pending.ident.conversation, full(bytes))
}

type UpstreamStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// State of a streamed answer between chunks.
struct Relay {
    state: Arc<AppState>,
    /// What was read before the answer began (held back, or delivered with
    /// the first chunks), released first, as one frame.
    held: Option<Bytes>,
    upstream: UpstreamStream,
    tee: SseTee,
    /// Taken once the exchange is recorded; still here on drop = client left.
    pending: Option<PendingExchange>,
    status: u16,
    ttfb_ms: f64,
    done: bool,
    /// What the upstream delivered after the chunks gathered into the last
    /// frame (its end or a failure), handled next.
    peeked: Option<Option<reqwest::Result<Bytes>>>,
    /// Bytes went to the client already; the first go out at once.
    started: bool,
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
                Some(format!(
                    "{} before the end of the stream",
                    self.state.cut_reason()
                )),
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
    held: Held,
    strip_usage: bool,
    ttfb_ms: f64,
) -> Response<ProxyBody> {
    let Held {
        status,
        mut headers,
        chunks,
        rest,
        end,
        ..
    } = held;
    headers.remove(header::CONTENT_LENGTH);
    let conversation = pending.ident.conversation.clone();
    let relay = Relay {
        tee: SseTee::new(pending.api, strip_usage),
        state,
        held: concat(chunks),
        upstream: rest,
        pending: Some(pending),
        status: status.as_u16(),
        ttfb_ms,
        done: false,
        peeked: end,
        started: false,
    };
    let body = futures_util::stream::unfold(relay, next_frame);
    response_head(
        status,
        &headers,
        &conversation,
        BodyExt::boxed_unsync(StreamBody::new(body)),
    )
}

/// Most a frame gathers from chunks the upstream delivered together.
const GATHER_BYTES: usize = 64 * 1024;

/// Longest a frame waits for more chunks the upstream delivered together.
const GATHER_HOLD: Duration = Duration::from_millis(1);

/// `out` followed by the chunks the upstream has already delivered (see
/// [`take_delivered`]), so that events that arrived together leave in one
/// write, not one each. The end of the upstream body ends the gathering, so
/// that the last events and the end of the answer leave together.
async fn gather(r: &mut Relay, out: Bytes) -> Bytes {
    let mut joined: Option<bytes::BytesMut> = None;
    let (tee, upstream) = (&mut r.tee, &mut r.upstream);
    r.peeked = take_delivered(upstream, out.len(), |chunk| {
        let more = tee.push(chunk);
        let joined = joined.get_or_insert_with(|| bytes::BytesMut::from(&out[..]));
        joined.extend_from_slice(&more);
        joined.len()
    })
    .await;
    joined.map_or(out, bytes::BytesMut::freeze)
}

/// Passes `take` the chunks the upstream has already delivered, up to
/// [`GATHER_BYTES`] (`take` returns the size so far, starting at `size`),
/// and returns how the body ended if it did meanwhile.
///
/// The upstream connection hands a body over one chunk at a time, and the
/// server writes out what it has whenever the body is not ready: relayed
/// as they come, a burst of events (a Responses stream's first and last
/// ones, a short answer) costs a write per event. So while the upstream's
/// next chunk is not ready, this waits until the runtime has given the
/// other tasks (the upstream connection among them) their turn, and takes
/// what they delivered meanwhile. A turn that brought a chunk is followed
/// by another, for up to [`GATHER_HOLD`]; the first turn that brings
/// nothing ends it. It never waits on the network.
async fn take_delivered(
    upstream: &mut UpstreamStream,
    mut size: usize,
    mut take: impl FnMut(Bytes) -> usize,
) -> Option<Option<reqwest::Result<Bytes>>> {
    let mut turn: Option<Arc<Turn>> = None;
    // When the first turn began, and whether the turn under way brought a chunk.
    let mut began: Option<Instant> = None;
    let mut brought = false;
    std::future::poll_fn(|cx| loop {
        if size >= GATHER_BYTES {
            return Poll::Ready(None);
        }
        match upstream.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                size = take(chunk);
                brought = true;
            }
            Poll::Ready(end_or_error) => return Poll::Ready(Some(end_or_error)),
            Poll::Pending => {
                if turn.as_ref().is_some_and(|t| !t.over()) {
                    return Poll::Pending;
                }
                let began = *began.get_or_insert_with(Instant::now);
                if turn.is_some() && !(brought && began.elapsed() < GATHER_HOLD) {
                    return Poll::Ready(None);
                }
                brought = false;
                turn = Some(Turn::after_others(cx));
                return Poll::Pending;
            }
        }
    })
    .await
}

/// The chunks as one, if any (copied only when there are several).
fn concat(mut chunks: Vec<Bytes>) -> Option<Bytes> {
    match chunks.len() {
        0 => None,
        1 => chunks.pop(),
        _ => {
            let mut out = bytes::BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for c in &chunks {
                out.extend_from_slice(c);
            }
            Some(out.freeze())
        }
    }
}

/// The other tasks' turn: over once the runtime has run the tasks that
/// were ready when it began. Tokio wakes a task that yielded only after its
/// worker ran the others (or at its next periodic check); outside a tokio
/// worker, at once.
struct Turn {
    over: AtomicBool,
    task: Waker,
}

impl Turn {
    fn after_others(cx: &Context<'_>) -> Arc<Turn> {
        let turn = Arc::new(Turn {
            over: AtomicBool::new(false),
            task: cx.waker().clone(),
        });
        let waker = Waker::from(turn.clone());
        let mut yielded = std::pin::pin!(tokio::task::yield_now());
        // The first poll hands `waker` to the runtime, to wake when the
        // others have run.
        let _ = yielded.as_mut().poll(&mut Context::from_waker(&waker));
        turn
    }

    fn over(&self) -> bool {
        self.over.load(Ordering::Acquire)
    }
}

impl std::task::Wake for Turn {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.over.store(true, Ordering::Release);
        self.task.wake_by_ref();
    }
}

async fn next_frame(mut r: Relay) -> Option<(Result<Frame<Bytes>, BodyError>, Relay)> {
    loop {
        if r.done {
            return None;
        }
        let idle: Duration = r.state.upstream.idle_timeout;
        let held = r.held.take();
        let gathered = held.is_some();
        let next = if let Some(chunk) = held {
            Ok(Some(Ok(chunk)))
        } else if let Some(peeked) = r.peeked.take() {
            Ok(peeked)
        } else {
            tokio::time::timeout(idle, r.upstream.next()).await
        };
        match next {
            Ok(Some(Ok(chunk))) => {
                let mut out = r.tee.push(chunk);
                if r.started && !gathered {
                    out = gather(&mut r, out).await;
                }
                r.started |= !out.is_empty();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream body: each chunk after `pause` (None: the chunk is
    /// handed over at the next turn, as a connection task would).
    fn upstream(chunks: Vec<(&'static str, Option<Duration>)>) -> UpstreamStream {
        Box::pin(futures_util::stream::unfold(
            chunks.into_iter(),
            |mut it| async move {
                let (text, pause) = it.next()?;
                match pause {
                    Some(d) => tokio::time::sleep(d).await,
                    None => tokio::task::yield_now().await,
                }
                Some((Ok(Bytes::from_static(text.as_bytes())), it))
            },
        ))
    }

    async fn take_all(s: &mut UpstreamStream) -> (Vec<Bytes>, Option<bool>) {
        let mut taken = Vec::new();
        let end = take_delivered(s, 0, |c| {
            taken.push(c);
            taken.iter().map(Bytes::len).sum()
        })
        .await;
        (taken, end.map(|e| e.is_none()))
    }

    #[tokio::test]
    async fn chunks_delivered_turn_after_turn_are_taken_with_the_end() {
        let mut s = upstream(vec![("a", None), ("b", None), ("c", None)]);
        let (taken, end) = tokio::time::timeout(Duration::from_secs(5), take_all(&mut s))
            .await
            .unwrap();
        assert_eq!(taken, ["a", "b", "c"]);
        assert_eq!(end, Some(true), "the end of the body is reported");
    }

    #[tokio::test]
    async fn a_chunk_still_on_the_network_is_not_waited_for() {
        let pause = Duration::from_millis(300);
        let mut s = upstream(vec![("a", None), ("b", Some(pause)), ("c", None)]);
        let t = Instant::now();
        let (taken, end) = tokio::time::timeout(Duration::from_secs(5), take_all(&mut s))
            .await
            .unwrap();
        assert!(t.elapsed() < pause, "{:?}", t.elapsed());
        assert_eq!(taken, ["a"]);
        assert_eq!(end, None);
        // The rest comes with the next gathering.
        let (taken, end) = tokio::time::timeout(Duration::from_secs(5), async {
            let first = s.next().await.unwrap().unwrap();
            let (mut rest, end) = take_all(&mut s).await;
            rest.insert(0, first);
            (rest, end)
        })
        .await
        .unwrap();
        assert_eq!(taken, ["b", "c"]);
        assert_eq!(end, Some(true));
    }

    #[tokio::test]
    async fn gathering_stops_at_its_size_limit() {
        let big: &'static str = Box::leak("x".repeat(GATHER_BYTES / 2 + 1).into_boxed_str());
        let mut s = upstream(vec![(big, None), (big, None), (big, None)]);
        let (taken, end) = tokio::time::timeout(Duration::from_secs(5), take_all(&mut s))
            .await
            .unwrap();
        assert_eq!(taken.len(), 2);
        assert_eq!(end, None);
    }

    #[test]
    fn concat_joins_chunks_in_order() {
        assert_eq!(concat(Vec::new()), None);
        let one = Bytes::from_static(b"one");
        assert_eq!(concat(vec![one.clone()]), Some(one));
        let joined = concat(vec![Bytes::from_static(b"a"), Bytes::from_static(b"bc")]);
        assert_eq!(joined.as_deref(), Some(&b"abc"[..]));
    }
}
