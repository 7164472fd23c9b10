//! The read phase: runs first, when a parsed endpoint's request
//! arrives. Reads the body within its limits, splits it into its items,
//! validates it, parses once what the later phases read of it (its model,
//! whether it streams, the client's credentials and the names it gives its
//! conversation), and expands what the proxy stands for (a recorded
//! `previous_response_id` chain, its own `compaction` items, Codex's
//! `compaction_trigger`). It must not identify the conversation, change
//! the items for any other reason, or send anything upstream.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::Value;

use super::request::{AsSent, Client, Parsed, ReadRequest};
use crate::app::AppState;
use crate::compaction::remote;
use crate::config::Mode;
use crate::conversation::tenant_of;
use crate::error::ProxyError;
use crate::upstream::Payload;
use crate::wire::items::Tools;
use crate::wire::{self, chat, Api};

/// A request's body as it reaches the driver.
pub(super) enum RequestBody {
    /// An HTTP request's, still to be read.
    Http(Incoming),
    /// Whole already: what a WebSocket message carried
    /// (`server::websocket`).
    Whole(Bytes),
}

/// Reads, parses and validates a request of `api`, and expands what the
/// proxy stands for.
pub(super) async fn read_request(
    state: &Arc<AppState>,
    api: Api,
    parts: &http::request::Parts,
    body: RequestBody,
) -> Result<ReadRequest, ProxyError> {
    let (raw, tenant) = match body {
        RequestBody::Http(body) => read_client_body(state, parts, body).await?,
        RequestBody::Whole(raw) => {
            let limit = state.config.server.max_body_bytes;
            if raw.len() > limit {
                return Err(ProxyError::PayloadTooLarge { limit });
            }
            let tenant = tenant_of(&state.tenant_salt, wire::credential(&parts.headers));
            (raw, tenant)
        }
    };
    let raw_len = raw.len();
    // The history stays bytes (see `wire::items`), and the part of it that
    // repeats the tenant's recent request is not even parsed again; a body
    // that is not an object with an item array is parsed whole, which
    // names what is wrong.
    let (mut body, spans, body_key, tools, reuse, shell) = match state
        .item_caches
        .split_body_reusing(&raw, api.items_key(), &tenant)
    {
        Some(split) => {
            let tools = split
                .tools
                .map(|(span, key)| Tools::raw(raw.clone(), span, key, &state.item_caches));
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
            let mut body: Value = serde_json::from_slice(&raw).map_err(ProxyError::InvalidJson)?;
            let tools = Tools::take(&mut body);
            (body, None, None, tools, None, None)
        }
    };
    api.validate(&body)?;
    // Parsed once, here: the request carries it (`ReadRequest::model`).
    let (model, streamed) = api.model_and_stream(&body, &parts.uri);
    let (control, metadata_taken) =
        super::control::control(&state.config, &parts.headers, &mut body, &tenant, &model)?;
    // Observe and off send the client's request as it came: no expanded
    // history, no usage asked for, no trigger answered by the proxy.
    let auto = matches!(control.mode, Mode::Auto | Mode::Manual);
    let previous = body
        .get("previous_response_id")
        .and_then(Value::as_str)
        .map(String::from);
    // The metadata key is cut out of the client's bytes, the rest going as
    // it came; the body is rebuilt only when the bytes cannot be cut.
    let spliced = metadata_taken
        .then(|| super::control::splice_metadata_mode(&raw))
        .flatten();
    let mut rewritten = metadata_taken && spliced.is_none();
    let mut trigger = false;
    let mut items = api
        .item_list(&mut body, raw.clone(), spans)
        .with_reuse(reuse)
        .with_shell(shell)
        .with_caches(state.item_caches.clone());
    // A chain the proxy recorded, its own compaction items and Codex's
    // compaction trigger change the items; anything else leaves them as
    // the client's bytes.
    let history = match &previous {
        Some(prev) if api.format().expands_items() && auto => {
            previous_history(state, &tenant, prev).await
        }
        _ => None,
    };
    if api.format().expands_items() && (history.is_some() || items.may_contain("\"compaction")) {
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
        trigger = auto && remote::ends_with_trigger(&values);
        if trigger {
            values.pop();
        }
        items = values.into();
    }
    // The body stays the client's; only the bytes going upstream ask for
    // the usage it did not ask for.
    let had_stream_options = body.get("stream_options").is_some();
    let strip_usage = auto && api.format().lacks_stream_usage(&body);
    let raw = spliced.unwrap_or(raw);
    let original = if rewritten {
        None
    } else if strip_usage {
        (!had_stream_options)
            .then(|| chat::splice_stream_usage(&raw))
            .flatten()
            .map(|(head, rest)| Payload::joined(head, rest))
    } else {
        Some(raw.into())
    };
    let client = Client::of(tenant, &parts.headers, &body);
    let body_key = body_key.filter(|_| !rewritten && !metadata_taken);
    Ok(ReadRequest::new(
        client,
        Parsed::new(api, model, streamed, body, items, tools),
        AsSent::new(original, strip_usage, body_key, raw_len),
        control,
        previous,
        trigger,
    ))
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

/// A client's request body, read within the configured limits
/// (`server.max_body_bytes`, the body read timeout), and the tenant its
/// credential names.
pub(super) async fn read_client_body(
    state: &AppState,
    parts: &http::request::Parts,
    body: Incoming,
) -> Result<(Bytes, String), ProxyError> {
    let raw = read_body(
        body,
        &parts.headers,
        state.config.server.max_body_bytes,
        state.config.body_read_timeout(),
    )
    .await?;
    let tenant = tenant_of(&state.tenant_salt, wire::credential(&parts.headers));
    Ok((raw, tenant))
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
            Err(e) => return Err(ProxyError::BodyUnreadable(e)),
        }
    }
    Ok(buf.freeze())
}
