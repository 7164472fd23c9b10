//! `POST /v1/chat/completions`, `POST /v1/responses` and
//! `POST /v1/responses/compact`: the phases of a request, in order.
//!
//! 1. [`super::read`]: read and parse the body, expand what the proxy
//!    stands for;
//! 2. [`super::identify`]: name the conversation, open the exchange, apply
//!    a compaction;
//! 3. [`super::send`]: send, and decide whether to send again;
//! 4. [`super::relay`]: relay the answer and tee it;
//! 5. [`super::record`]: record the exchange.
//!
//! The client's bytes go upstream unchanged unless the proxy must change
//! something (asking a chat stream for usage, a compaction); the answer
//! reaches the client unchanged except for the `x-compactor-conversation`
//! header and the hiding of usage the client did not ask for.

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response};
use hyper::body::Incoming;

use super::identify::{compact_now, identify};
use super::read::read_request;
use super::record::fail;
use super::{compact, relay, send};
use crate::app::AppState;
use crate::config::Mode;
use crate::engine;
use crate::error::{ProxyBody, ProxyError};
use crate::ids::now_ms;
use crate::wire::Api;

/// Handles one parsed-endpoint request; every failure becomes a JSON error.
pub async fn handle(state: Arc<AppState>, api: Api, req: Request<Incoming>) -> Response<ProxyBody> {
    handle_inner(state, api, req)
        .await
        .unwrap_or_else(|e| e.into_response_as(api.error_shape()))
}

async fn handle_inner(
    state: Arc<AppState>,
    api: Api,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let started = Instant::now();
    let started_ms = now_ms();
    let (parts, body) = req.into_parts();
    let read = read_request(&state, api, &parts, body).await?;
    let trigger = read.trigger;
    let asked = read.control.compact_now;
    let mut pending = identify(&state, &parts, read, started, started_ms).await?;
    if trigger {
        return compact::answer_trigger(&state, pending).await;
    }
    // A manual compaction waits for a request in auto mode.
    let auto = matches!(pending.mode, Mode::Auto | Mode::Manual);
    if auto
        && state
            .compactions
            .take_manual(&pending.tenant, &pending.ident.conversation)
    {
        compact_now(&state, &mut pending, "manual".into(), engine::Goal::Shrink).await;
    } else if asked {
        let reason = format!("requested: {}", super::control::COMPACT_HEADER);
        compact_now(&state, &mut pending, reason, engine::Goal::Shrink).await;
    }
    let url = state.upstream.url(api.endpoint(), parts.uri.query())?;
    let headers = state
        .upstream
        .request_headers_for(api, &parts.headers, true);
    let sent = match send::send(&state, &mut pending, &url, &headers).await {
        Ok(answer) => super::recall::settle(&state, &mut pending, &url, &headers, answer).await,
        Err(e) => Err(e),
    };
    match sent {
        Ok(send::Answer::Live(held)) => Ok(super::splice::relay_live(
            state, pending, url, headers, held, started,
        )),
        Ok(answer) => relay::relay(state, pending.into_inner(), answer, started).await,
        Err(e) => Err(fail(&state, pending.into_inner(), e, None).await),
    }
}

/// `POST /v1/responses/compact`, served by the proxy for any upstream:
/// compacts the given input and answers in OpenAI's shape.
pub async fn handle_compact(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
    let started = Instant::now();
    let started_ms = now_ms();
    let (parts, body) = req.into_parts();
    let result = async {
        let read = read_request(&state, Api::Responses, &parts, body).await?;
        let pending = identify(&state, &parts, read, started, started_ms).await?;
        compact::answer_compact(&state, pending.into_inner()).await
    }
    .await;
    result.unwrap_or_else(ProxyError::into_response)
}
