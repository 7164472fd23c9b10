//! The answers the proxy makes itself, from a compaction, in OpenAI's
//! shape: Codex's in-band `compaction_trigger` and `/v1/responses/compact`.
//! The driver runs them once the request is identified, in place of the
//! send and the relay; they must not send the client's request upstream.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::Response;
use serde_json::Value;

use super::answer::{COMPACTED_HEADER, CONVERSATION_HEADER};
use super::exchange::{Outcome, PendingExchange, Unanswered};
use crate::app::AppState;
use crate::compaction::{remote, Compaction};
use crate::engine;
use crate::error::{full, json_response, ProxyBody, ProxyError};

/// Codex's in-band compaction: the input ended with `compaction_trigger`.
/// Answered by the proxy itself with exactly one `compaction` item, which
/// later requests carry and the proxy expands into its summary.
pub(super) async fn answer_trigger(
    state: &Arc<AppState>,
    pending: Unanswered,
) -> Result<Response<ProxyBody>, ProxyError> {
    let compacted = compact_whole(state, &pending, "requested: compaction_trigger").await;
    let pending = pending.into_inner();
    let c = match compacted {
        Ok(c) => c,
        Err(e) => {
            let err = e.into_refusal();
            return Err(pending.fail(state, err, None).await);
        }
    };
    let item = remote::compaction_item(&c, remote::Form::Full);
    let response = compaction_response(&c, pending.request().model(), vec![item.clone()]);
    let outcome = Outcome {
        status: 200,
        usage: pending.request().api().usage(&response),
        response_items: vec![item],
        response_id: response.get("id").and_then(Value::as_str).map(String::from),
        ..Outcome::default()
    };
    pending.finish(state, outcome).await;
    let body = if pending.request().streamed() {
        let events = compaction_events(&response);
        let mut resp = Response::new(full(events));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        resp
    } else {
        json_response(http::StatusCode::OK, &response)
    };
    let mut resp = body;
    name_conversation_and_compaction(&mut resp, &pending, &c);
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
    let mut out = bytes::BytesMut::new();
    let mut seq = 0;
    let mut push = |kind: &str, mut data: Value| {
        data["type"] = Value::String(kind.into());
        data["sequence_number"] = seq.into();
        seq += 1;
        crate::wire::sse::write_event(&mut out, kind, data.to_string().as_bytes());
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
    out.freeze()
}

/// `POST /v1/responses/compact`: compacts the given input and answers with
/// the compaction. This endpoint records the compaction it makes, not an
/// exchange.
pub(super) async fn answer_compact(
    state: &Arc<AppState>,
    pending: PendingExchange,
) -> Result<Response<ProxyBody>, ProxyError> {
    let c = compact_whole(state, &pending, "requested: /v1/responses/compact")
        .await
        .map_err(engine::CompactError::into_refusal)?;
    let mut answer =
        compaction_response(&c, pending.request().model(), remote::endpoint_output(&c));
    answer["object"] = "response.compaction".into();
    answer["id"] = Value::String(c.id.clone());
    let mut resp = json_response(http::StatusCode::OK, &answer);
    name_conversation_and_compaction(&mut resp, &pending, &c);
    Ok(resp)
}

/// Compacts the whole of the request's history, as the client asked.
async fn compact_whole(
    state: &Arc<AppState>,
    pending: &PendingExchange,
    reason: &str,
) -> Result<Arc<Compaction>, engine::CompactError> {
    let mut input = pending.input(reason.into(), true);
    input.ask.goal = engine::Goal::HardLimit;
    engine::compact(state, input).await
}

/// Adds the headers naming the conversation and the compaction.
fn name_conversation_and_compaction(
    resp: &mut Response<ProxyBody>,
    pending: &PendingExchange,
    c: &Compaction,
) {
    for (name, value) in [
        (CONVERSATION_HEADER, pending.conversation()),
        (COMPACTED_HEADER, c.id.as_str()),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            resp.headers_mut().insert(name, v);
        }
    }
}
