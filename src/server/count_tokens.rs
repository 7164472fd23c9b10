//! `POST /v1/messages/count_tokens`: a client that sizes its next request
//! (Claude Code does, before it decides to compact by itself) is told the
//! size of what the proxy would send for it. A body whose messages extend a
//! conversation a stored compaction covers — matched by its content, never
//! by a session header, since Claude Code also sizes single tool results
//! here under the same header — is counted with that compaction applied, by
//! the upstream's own count_tokens; any other body is forwarded untouched.
//! It records nothing and computes no compaction.

use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use serde_json::Value;

use super::read::read_client_body;
use crate::app::AppState;
use crate::compaction::recall;
use crate::error::{ErrorShape, ProxyBody, ProxyError};
use crate::wire::items::{ItemList, Tools};
use crate::wire::{messages, Api};

/// The endpoint below `/v1`.
const ENDPOINT: &str = "/messages/count_tokens";

/// The API whose requests this endpoint counts.
const API: Api = Api::Messages;

/// Answers a count_tokens request.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
    match count(&state, req).await {
        Ok(resp) => resp,
        Err(e) => e.into_response_as(ErrorShape::Anthropic),
    }
}

async fn count(
    state: &Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let (parts, body) = req.into_parts();
    let (raw, tenant) = read_client_body(state, &parts, body).await?;
    let applied = compacted(state, &tenant, &raw);
    // A provider's compaction block in what is counted needs its beta.
    let compact_beta = applied.as_ref().is_some_and(|(b, _)| {
        serde_json::from_slice::<Value>(b).is_ok_and(|v| {
            v["messages"]
                .as_array()
                .is_some_and(|m| crate::compaction::provider::carries_block(m))
        })
    });
    let (bytes, drop_block) = applied.unwrap_or((raw, false));
    let url = state.upstream.url(ENDPOINT, parts.uri.query())?;
    let mut headers = state
        .upstream
        .request_headers_for(API, &parts.headers, true);
    if drop_block {
        messages::add_binding_beta(&mut headers);
    }
    if compact_beta {
        crate::compaction::provider::add_beta(&mut headers);
    }
    let resp = state
        .upstream
        .send_bytes(http::Method::POST, &url, headers, bytes)
        .await?;
    answer(state, resp).await
}

/// A count's answer as the client gets it: the upstream's status, type,
/// request id and body (without the server's key).
pub(super) async fn answer(
    state: &AppState,
    resp: reqwest::Response,
) -> Result<Response<ProxyBody>, ProxyError> {
    let status = resp.status();
    let resp_headers = resp.headers().clone();
    let body = state.upstream.read_body(resp).await?;
    let mut out = Response::new(crate::error::full(state.upstream.hide_own_key(body)));
    *out.status_mut() = status;
    for name in [
        http::header::CONTENT_TYPE,
        http::header::HeaderName::from_static("request-id"),
    ] {
        if let Some(v) = resp_headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    Ok(out)
}

/// The body with the stored compaction that covers a prefix of its
/// messages applied, when one does (and the body is an object with a
/// message list), and whether it lets the API drop a thinking block (see
/// `wire::messages::finish_view`); `None` otherwise.
fn compacted(state: &AppState, tenant: &str, raw: &[u8]) -> Option<(bytes::Bytes, bool)> {
    let mut body: Value = serde_json::from_slice(raw).ok()?;
    let values = API.take_items(&mut body);
    if values.is_empty() {
        return None;
    }
    let items = ItemList::from(values);
    let (_, chains, _) = items.hashes_and_chains(tenant);
    let c = state.compactions.find(tenant, &chains)?;
    let tools = Tools::take(&mut body);
    let outside = tools
        .as_ref()
        .map_or(0, |t| messages::breakpoints(t.value()))
        + body.get("system").map_or(0, messages::breakpoints);
    let mut view = items
        .with_prefix_replaced(c.covered_len, &c.replacement)
        .into_values();
    let drop_block = messages::finish_view(&mut view, c.replacement.len(), outside);
    if drop_block {
        messages::with_block_binding(&mut body);
    }
    // The recall tool goes with it when the proxy would offer it.
    let offered = state.config.compaction.recall_max_rounds > 0
        && recall::may_offer(&body, tools.as_ref().map(Tools::value));
    let tools = match (offered, &tools) {
        (true, Some(t)) => {
            let mut with = serde_json::json!({"tools": recall::with_tool(API, t.value())});
            Tools::take(&mut with)
        }
        _ => tools,
    };
    let bytes = API.rebuild_body(&body, &view, tools.as_ref()).ok()?;
    Some((bytes, drop_block))
}
