//! Gemini's endpoints: `POST /v1beta/models/{model}:generateContent`,
//! `:streamGenerateContent` (`alt=sse`) and `:countTokens` (also below
//! `/v1/`). The first two go through the same phases as the other parsed
//! APIs (`super::proxy`); a count counts what the proxy would send. Each goes upstream to its
//! path below the version prefix, under the configured base URL.
//!
//! A key given in the query (`?key=`) is moved to `x-goog-api-key`, which
//! the API takes too, before anything else reads the request: it then
//! names the tenant and is kept, redacted and never recorded like every
//! other credential header, and no query the proxy keeps or prints holds it.

use std::sync::Arc;

use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;

use serde_json::Value;

use super::read::read_client_body;
use super::{count_tokens, proxy};
use crate::app::AppState;
use crate::error::{ErrorShape, ProxyBody, ProxyError};
use crate::wire::gemini::{self, Method, KEY_HEADER};
use crate::wire::items::ItemList;
use crate::wire::Api;

/// Whether a request is one of Gemini's endpoints.
pub(super) fn is_gemini(method: &http::Method, path: &str) -> bool {
    method == http::Method::POST && gemini::route_below(path).is_some()
}

/// Serves a Gemini request; the metrics' endpoint label with the answer.
pub(super) async fn handle(
    state: Arc<AppState>,
    mut req: Request<Incoming>,
) -> (&'static str, Response<ProxyBody>) {
    let Some(route) = gemini::route(req.uri().path()) else {
        let e = ProxyError::InvalidPath("path refused: not a Gemini endpoint".into());
        return ("gemini", e.into_response_as(ErrorShape::Google));
    };
    if let Err(e) = key_into_header(&mut req) {
        return ("gemini", e.into_response_as(ErrorShape::Google));
    }
    match route.method {
        Method::Generate | Method::Stream => {
            ("gemini", proxy::handle(state, Api::Gemini, req).await)
        }
        Method::CountTokens => (
            "gemini_count_tokens",
            count_tokens(state, req, &route).await,
        ),
    }
}

/// `:countTokens`: a client that sizes its history (Gemini CLI does,
/// before it compresses by itself) is told the size of what the proxy
/// would send for it. Contents that extend a conversation a stored
/// compaction covers (matched by content, for the key's tenant) are counted
/// by the upstream with that compaction applied; any other body is
/// forwarded as it came. Nothing is recorded or computed.
async fn count_tokens(
    state: Arc<AppState>,
    req: Request<Incoming>,
    route: &gemini::Route,
) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let counted = async {
        let (raw, tenant) = read_client_body(&state, &parts, body).await?;
        let bytes = compacted(&state, &tenant, &raw).unwrap_or(raw);
        let url = state.upstream.url(&route.below, parts.uri.query())?;
        let headers = state
            .upstream
            .request_headers_for(Api::Gemini, &parts.headers, true);
        let resp = state
            .upstream
            .send_bytes(http::Method::POST, &url, headers, bytes)
            .await?;
        count_tokens::answer(&state, resp).await
    };
    counted
        .await
        .unwrap_or_else(|e| e.into_response_as(ErrorShape::Google))
}

/// A count's body with the stored compaction that covers a prefix of its
/// contents applied (the contents of the body, or of the
/// `generateContentRequest` it wraps), when one does.
fn compacted(state: &AppState, tenant: &str, raw: &[u8]) -> Option<bytes::Bytes> {
    let mut body: Value = serde_json::from_slice(raw).ok()?;
    let wrapped = body.get("generateContentRequest").is_some();
    let request = if wrapped {
        body.get_mut("generateContentRequest")?
    } else {
        &mut body
    };
    let values = Api::Gemini.take_items(request);
    if values.is_empty() {
        return None;
    }
    let items = ItemList::from(values);
    let (_, chains, _) = items.hashes_and_chains(tenant);
    let c = state.compactions.find(tenant, &chains)?;
    let view = items
        .with_prefix_replaced(c.covered_len, &c.replacement)
        .into_values();
    Api::Gemini.set_items(request, &view);
    serde_json::to_vec(&body).ok().map(bytes::Bytes::from)
}

/// Moves a `key` query parameter into [`KEY_HEADER`] (a key already sent
/// in a credential header wins, and the query's is dropped).
pub(super) fn key_into_header(req: &mut Request<Incoming>) -> Result<(), ProxyError> {
    let Some(query) = req.uri().query() else {
        return Ok(());
    };
    let (key, rest) = gemini::take_key(query);
    let Some(key) = key else {
        return Ok(());
    };
    let mut parts = req.uri().clone().into_parts();
    let path = req.uri().path();
    let pq = match rest {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    parts.path_and_query = Some(
        pq.parse()
            .map_err(|_| ProxyError::InvalidPath("path refused: unreadable query".into()))?,
    );
    *req.uri_mut() = http::Uri::from_parts(parts)
        .map_err(|_| ProxyError::InvalidPath("path refused: unreadable query".into()))?;
    if crate::wire::credential(req.headers()).is_none() {
        let mut v = HeaderValue::from_str(&key).map_err(|_| {
            ProxyError::InvalidRequest(crate::error::InvalidField::missing_query(
                gemini::KEY_PARAM,
                "the key must be visible ASCII",
            ))
        })?;
        v.set_sensitive(true);
        req.headers_mut().insert(KEY_HEADER, v);
    }
    Ok(())
}
