//! Gemini's endpoints: `POST /v1beta/models/{model}:generateContent`,
//! `:streamGenerateContent` (`alt=sse`) and `:countTokens` (also below
//! `/v1/`). The first two go through the same phases as the other parsed
//! APIs (`super::proxy`); a count is forwarded. Each goes upstream to its
//! path below the version prefix, under the configured base URL.
//!
//! A key given in the query (`?key=`) is moved to `x-goog-api-key`, which
//! the API takes too, before anything else reads the request: it then
//! names the tenant and is kept, redacted and never recorded like every
//! other credential header, and no query the proxy keeps or prints holds it.

use std::sync::Arc;

use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;

use super::{passthrough, proxy};
use crate::app::AppState;
use crate::error::{ErrorShape, ProxyBody, ProxyError};
use crate::wire::gemini::{self, Method, KEY_HEADER};
use crate::wire::Api;

/// Whether a request is one of Gemini's endpoints.
pub(super) fn is_gemini(method: &http::Method, path: &str) -> bool {
    method == http::Method::POST && gemini::route(path).is_some()
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

/// `:countTokens`, forwarded as it came.
async fn count_tokens(
    state: Arc<AppState>,
    req: Request<Incoming>,
    route: &gemini::Route,
) -> Response<ProxyBody> {
    let url = match state.upstream.url(&route.below, req.uri().query()) {
        Ok(url) => url,
        Err(e) => return ProxyError::from(e).into_response_as(ErrorShape::Google),
    };
    let headers = state
        .upstream
        .request_headers_for(Api::Gemini, req.headers(), false);
    passthrough::forward(state, req, url, headers).await
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
