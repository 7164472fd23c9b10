//! `POST /v1/chat/completions`, `/v1/responses`, `/v1/messages`, Gemini's
//! `generateContent` (a WebSocket message too) and `/v1/responses/compact`: the driver of a request's phases. Each
//! phase is a file of `server/` that returns what it decided to this
//! driver, which takes the next step; no phase calls another.
//!
//! 1. [`super::read`]: read and parse the body, expand what the proxy
//!    stands for;
//! 2. [`super::identify`]: name the conversation, open the exchange, apply
//!    a stored compaction, say whether it needs one made now;
//! 3. [`super::compact_now`]: make the compaction asked for (by identify,
//!    a manual or requested compaction, an upstream "too long", a refused
//!    provider compaction);
//! 4. [`super::send`]: send once, and say whether to send again;
//! 5. [`super::recall`]: answer the calls of the proxy's tools, and say
//!    whether to send the continued request;
//! 6. [`super::relay`], or [`super::splice`] for a stream that began with
//!    reasoning: relay the answer and tee it;
//! 7. [`super::record`]: record the exchange, which the driver hands to
//!    every exchange it opens, for the relay, the splice, the compact
//!    endpoint or a failure to run when the exchange ends.
//!
//! [`super::compact`] answers in place of 4 to 6 when the client asked the
//! proxy for a compaction. The loop of sends (retries, reactive
//! compactions, recall rounds) is this driver's alone ([`settle`]).
//!
//! The client's bytes go upstream unchanged unless the proxy must change
//! something (asking a chat stream for usage, a compaction); the answer
//! reaches the client unchanged except for the `x-compactor-conversation`
//! header and the hiding of usage the client did not ask for.

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response};
use hyper::body::Incoming;

use super::answer::Answer;
use super::exchange::Unanswered;
use super::identify::{identify, Compact};
use super::read::{read_request, RequestBody};
use super::recall::Settled;
use super::request::ReadRequest;
use super::send::{Sent, Target, Tried};
use super::{compact, compact_now, recall, record, relay, send, splice};
use crate::app::AppState;
use crate::config::Mode;
use crate::engine;
use crate::error::{ProxyBody, ProxyError};
use crate::ids::now_ms;
use crate::upstream::Socket;
use crate::wire::Api;

/// Handles one parsed-endpoint request; every failure becomes a JSON error.
pub async fn handle(state: Arc<AppState>, api: Api, req: Request<Incoming>) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    handle_read(state, api, parts, RequestBody::Http(body)).await
}

/// [`handle`] for a request whose body is whole already (a WebSocket
/// message's, `super::websocket`).
pub(super) async fn handle_whole(
    state: Arc<AppState>,
    api: Api,
    parts: http::request::Parts,
    body: bytes::Bytes,
) -> Response<ProxyBody> {
    handle_read(state, api, parts, RequestBody::Whole(body)).await
}

async fn handle_read(
    state: Arc<AppState>,
    api: Api,
    parts: http::request::Parts,
    body: RequestBody,
) -> Response<ProxyBody> {
    handle_inner(state, api, parts, body)
        .await
        .unwrap_or_else(|e| e.into_response_as(api.error_shape()))
}

async fn handle_inner(
    state: Arc<AppState>,
    api: Api,
    parts: http::request::Parts,
    body: RequestBody,
) -> Result<Response<ProxyBody>, ProxyError> {
    let started = Instant::now();
    let started_ms = now_ms();
    let read = read_request(&state, api, &parts, body).await?;
    let mut pending = open(&state, read, started, started_ms).await?;
    if pending.request().trigger() {
        return compact::answer_trigger(&state, pending).await;
    }
    // A manual compaction waits for a request in auto mode.
    let auto = matches!(pending.request().mode(), Mode::Auto | Mode::Manual);
    let goal = engine::Goal::Shrink;
    if auto
        && state
            .compactions
            .take_manual(pending.request().tenant(), pending.conversation())
    {
        compact_now::compact_now(&state, &mut pending, "manual".into(), goal).await;
    } else if pending.request().asks_compaction_now() {
        let reason = format!("requested: {}", super::control::COMPACT_HEADER);
        compact_now::compact_now(&state, &mut pending, reason, goal).await;
    }
    let url = state
        .upstream
        .url(&api.upstream_path(parts.uri.path()), parts.uri.query())?;
    let headers = state
        .upstream
        .request_headers_for(api, &parts.headers, true);
    // A request that came over a WebSocket carries its upstream socket.
    let socket = parts.extensions.get::<Arc<Socket>>().cloned();
    let target = Target {
        url,
        headers,
        socket,
    };
    match settle(&state, &mut pending, &target, None).await {
        Ok(Answer::Live(held)) => {
            // The spliced stream's tool calls come back to this loop.
            let driver = state.clone();
            let rounds = splice::rounds(move |pending, answer| {
                let (state, target) = (driver.clone(), target.clone());
                Box::pin(async move { settle(&state, pending, &target, Some(answer)).await })
            });
            Ok(splice::relay_live(state, pending, rounds, held, started))
        }
        Ok(answer) => relay::relay(state, pending.into_inner(), answer, started).await,
        Err(e) => Err(pending.into_inner().fail(&state, e, None).await),
    }
}

/// Identifies the request read and makes the compaction identify asked for.
async fn open(
    state: &Arc<AppState>,
    read: ReadRequest,
    started: Instant,
    started_ms: i64,
) -> Result<Unanswered, ProxyError> {
    let (mut pending, compact) =
        identify(state, read, started, started_ms, record::RECORDER).await?;
    match compact {
        Compact::No => {}
        Compact::HardLimit(tokens) => compact_now::hard_limit(state, &mut pending, tokens).await,
        Compact::IfStillOver => compact_now::fit_after_waiting(state, &mut pending).await,
    }
    Ok(pending)
}

/// The loop of a request's sends: sends the exchange (after `answer`, if
/// given, an answer in hand), acts on what [`send::send`] and
/// [`recall::settle`] decide, and sends again until an answer is the
/// client's. The error is the client's; the caller records it.
async fn settle(
    state: &Arc<AppState>,
    pending: &mut Unanswered,
    target: &Target,
    mut answer: Option<Answer>,
) -> Result<Answer, ProxyError> {
    let mut tried = Tried::default();
    loop {
        let got = match answer.take() {
            Some(got) => got,
            None => match send::send(state, pending, target, &mut tried).await? {
                Sent::Answer(got) => got,
                Sent::Again => continue,
                // The provider's compaction refused: the local
                // summarizer's in its place, in this request.
                Sent::Refused(status) => {
                    if compact_now::local_instead(state, pending, status).await {
                        tried.new_body();
                    } else {
                        send::resend_uncompacted(pending, &mut tried, Some(status));
                    }
                    continue;
                }
                // The provider refused its own compaction item: rebuilt
                // from the record and sent again, once; else its answer.
                Sent::ItemRefused { how, answer } => {
                    tried.rebuilt();
                    if compact_now::rebuild_from_record(state, pending, how).await {
                        tried.new_body();
                        continue;
                    }
                    answer
                }
                Sent::Overflow {
                    stated,
                    why,
                    answer,
                } => {
                    if !compact_now::compact_on_overflow(state, pending, stated, &why).await {
                        answer
                    } else {
                        tried.compacted_again();
                        state.metrics.reactive_retry();
                        continue;
                    }
                }
            },
        };
        match recall::settle(state, pending, got).await? {
            Settled::Answer(got) => return Ok(got),
            // The continued request is a new one to send.
            Settled::Round => tried = Tried::default(),
        }
    }
}

/// `POST /v1/responses/compact`, served by the proxy for any upstream:
/// compacts the given input and answers in OpenAI's shape.
pub async fn handle_compact(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
    let started = Instant::now();
    let started_ms = now_ms();
    let (parts, body) = req.into_parts();
    let result = async {
        let read = read_request(&state, Api::Responses, &parts, RequestBody::Http(body)).await?;
        let pending = open(&state, read, started, started_ms).await?;
        compact::answer_compact(&state, pending.into_inner()).await
    }
    .await;
    result.unwrap_or_else(ProxyError::into_response)
}
