//! `GET /v1/models` and `GET /v1/models/{id}`, and Gemini's
//! `GET /v1beta/models` and `GET /v1beta/models/{model}`: the upstream's
//! listing, each model carrying the context window the proxy uses for it,
//! so that a client which sizes its context from a listing sizes it as the
//! proxy does.
//!
//! Every entry with an `id` gets `context_length` (OpenRouter's field, read
//! by many clients) and `max_model_len` (vLLM's); an Anthropic entry
//! (`"type": "model"`) gets `max_input_tokens`; a Gemini entry (`"name":
//! "models/…"`, in a `models` list or alone) gets `inputTokenLimit` and
//! `outputTokenLimit`. The window is the proxy's (a `[[models]]` entry, or
//! what the upstream told), except where the proxy only guesses from the
//! model's name and the listing states a window of its own: the upstream's
//! word stays. Anything else of the answer — a status other than 200, a
//! body that is not a JSON listing, one over the size the proxy reads
//! whole — goes to the client as it came.

use std::sync::Arc;

use http::{header, HeaderValue, Request, Response};
use hyper::body::Incoming;
use serde_json::Value;

use super::passthrough;
use crate::app::AppState;
use crate::error::{ErrorShape, ProxyBody, ProxyError};
use crate::upstream::strip_hop_by_hop;
use crate::windows::Source;
use crate::wire::Api;

/// The version prefixes of the listings: Gemini's, then everyone else's.
const VERSIONS: [&str; 2] = ["/v1beta", "/v1"];

/// A listing path below its version prefix (`/models`, `/models/{id}`).
fn below(path: &str) -> Option<&str> {
    VERSIONS
        .iter()
        .find_map(|v| path.strip_prefix(v))
        .filter(|b| *b == "/models" || b.strip_prefix("/models/").is_some_and(|id| !id.is_empty()))
}

/// True for the paths this module answers: the listing and one model.
pub fn is_listing(path: &str) -> bool {
    below(path).is_some()
}

/// Forwards the listing request and annotates the answer. Gemini's
/// (`/v1beta/`) carries a key given in the query as `x-goog-api-key`, as
/// Gemini's other endpoints do, and answers errors in Google's shape.
pub async fn handle(state: Arc<AppState>, mut req: Request<Incoming>) -> Response<ProxyBody> {
    let gemini = req.uri().path().starts_with("/v1beta/");
    let shape = if gemini {
        ErrorShape::Google
    } else {
        ErrorShape::OpenAi
    };
    if gemini {
        if let Err(e) = super::gemini::key_into_header(&mut req) {
            return e.into_response_as(shape);
        }
    }
    let (parts, _body) = req.into_parts();
    let url = passthrough::check_path(parts.uri.path()).and_then(|()| {
        let below = below(parts.uri.path()).unwrap_or_default();
        Ok(state.upstream.url(below, parts.uri.query())?)
    });
    let url = match url {
        Ok(url) => url,
        Err(e) => return e.into_response_as(shape),
    };
    // Unencoded, so the proxy can read it; a server-side key where the
    // API reads it.
    let headers = if gemini {
        state
            .upstream
            .request_headers_for(Api::Gemini, &parts.headers, true)
    } else {
        state.upstream.request_headers(&parts.headers, true)
    };
    let resp = match state
        .upstream
        .send_bodyless(parts.method.clone(), &url, headers)
        .await
    {
        Ok(r) => r,
        Err(e) => return ProxyError::from(e).into_response_as(shape),
    };
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.contains("json"));
    let encoded = resp.headers().contains_key(header::CONTENT_ENCODING);
    if resp.status() != http::StatusCode::OK || !json || encoded {
        return passthrough::relay(resp);
    }
    let status = resp.status();
    let mut headers = strip_hop_by_hop(resp.headers());
    let body = match state.upstream.read_body(resp).await {
        Ok(b) => b,
        Err(e) => return ProxyError::from(e).into_response_as(shape),
    };
    let body = annotate(&state, &body).unwrap_or(body);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    let mut out = Response::new(crate::error::full(body));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// The listing (`{"data": [...]}`, Gemini's `{"models": [...]}`) or the
/// single model (`{"id": ...}`, Gemini's `{"name": "models/..."}`) in
/// `body` with each model's window written in; `None` when `body` is none
/// of these.
fn annotate(state: &AppState, body: &[u8]) -> Option<bytes::Bytes> {
    let mut doc: Value = serde_json::from_slice(body).ok()?;
    let mut changed = false;
    if let Some(entries) = doc.get_mut("data").and_then(Value::as_array_mut) {
        for entry in entries {
            changed |= annotate_entry(state, entry);
        }
    } else if let Some(entries) = doc.get_mut("models").and_then(Value::as_array_mut) {
        for entry in entries {
            changed |= annotate_gemini_entry(state, entry);
        }
    } else {
        changed = annotate_entry(state, &mut doc) || annotate_gemini_entry(state, &mut doc);
    }
    if !changed {
        return None;
    }
    serde_json::to_vec(&doc).ok().map(bytes::Bytes::from)
}

/// Fields in which servers state a model's window, read when the proxy
/// only guesses it.
const STATED: &[&str] = &["context_length", "max_model_len", "max_input_tokens"];

/// Writes the window the proxy uses for the entry's model; false when the
/// entry names no model.
fn annotate_entry(state: &AppState, entry: &mut Value) -> bool {
    let Some(model) = entry.get("id").and_then(Value::as_str).map(str::to_string) else {
        return false;
    };
    let Some(fields) = entry.as_object_mut() else {
        return false;
    };
    let (limits, source) = state.listed_model_window(&model);
    let stated = STATED
        .iter()
        .find_map(|k| fields.get(*k).and_then(Value::as_u64))
        .filter(|&w| w > 0);
    let window = match (source, stated) {
        (Source::Table, Some(w)) => w,
        _ => limits.context_window,
    };
    fields.insert("context_length".into(), window.into());
    fields.insert("max_model_len".into(), window.into());
    if fields.get("type").and_then(Value::as_str) == Some("model") {
        fields.insert("max_input_tokens".into(), window.into());
    }
    true
}

/// Writes the window the proxy uses, and its room for an answer, in a
/// Gemini model entry (`name` is `models/{model}`); false when the entry
/// names no model. Where the proxy only guesses, the limits the entry
/// states stay.
fn annotate_gemini_entry(state: &AppState, entry: &mut Value) -> bool {
    let Some(model) = entry
        .get("name")
        .and_then(Value::as_str)
        .and_then(|n| n.strip_prefix("models/"))
        .filter(|m| !m.is_empty())
        .map(str::to_string)
    else {
        return false;
    };
    let Some(fields) = entry.as_object_mut() else {
        return false;
    };
    let (limits, source) = state.listed_model_window(&model);
    let stated = |k: &str| fields.get(k).and_then(Value::as_u64).filter(|&n| n > 0);
    let (window, output) = match source {
        Source::Table => (
            stated("inputTokenLimit").unwrap_or(limits.context_window),
            stated("outputTokenLimit").unwrap_or(limits.max_output_tokens),
        ),
        _ => (limits.context_window, limits.max_output_tokens),
    };
    fields.insert("inputTokenLimit".into(), window.into());
    fields.insert("outputTokenLimit".into(), output.into());
    true
}
