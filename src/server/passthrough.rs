//! Every `/v1/*` path the proxy does not parse (models, embeddings, files…):
//! request and response stream through untouched, both directions.

use std::sync::Arc;

use futures_util::TryStreamExt;
use http::{Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Body as _;
use hyper::body::{Frame, Incoming};

use super::{proxy, AppState};
use crate::error::{BodyError, ProxyBody};
use crate::upstream::strip_hop_by_hop;

/// Request bodies up to this declared length are read before they are sent,
/// so that the request can be sent again if a pooled connection turns out
/// closed (see `Upstream::send_bytes`); longer ones, and those of unknown
/// length, stream through.
const RESENDABLE_BODY: u64 = 1 << 20;

/// Forwards the request as is and streams the answer back.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let below = parts
        .uri
        .path()
        .strip_prefix("/v1")
        .unwrap_or(parts.uri.path());
    let url = state.upstream.url(below, parts.uri.query());
    let headers = state.upstream.request_headers(&parts.headers, false);
    let sent = if body.is_end_stream() {
        // Nothing to stream (a GET, mostly): it can be sent again if a
        // pooled connection turns out closed. A declared empty body is
        // declared upstream too.
        let mut headers = headers;
        if let Some(declared) = parts.headers.get(http::header::CONTENT_LENGTH) {
            headers.insert(http::header::CONTENT_LENGTH, declared.clone());
        }
        state
            .upstream
            .send_bodyless(parts.method.clone(), &url, headers)
            .await
    } else if proxy::declared_length(&parts.headers).is_some_and(|n| n <= RESENDABLE_BODY) {
        // Small (an embeddings request, say): read first, so that it too
        // can be sent again.
        let bytes = match proxy::read_body(
            body,
            &parts.headers,
            RESENDABLE_BODY as usize,
            state.config.body_read_timeout(),
        )
        .await
        {
            Ok(b) => b,
            Err(e) => return e.into_response(),
        };
        state
            .upstream
            .send_bytes(parts.method.clone(), &url, headers, bytes)
            .await
    } else {
        // Streamed upstream without buffering, framed as the client framed
        // it: a declared length stays declared.
        let upstream_body = reqwest::Body::wrap(body);
        state
            .upstream
            .send(parts.method.clone(), &url, headers, upstream_body)
            .await
    };
    let resp = match sent {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    relay(resp)
}

/// Streams an upstream response to the client unchanged (status, end-to-end
/// headers, body bytes — compressed bodies stay compressed).
pub fn relay(resp: reqwest::Response) -> Response<ProxyBody> {
    let status = resp.status();
    let headers = strip_hop_by_hop(resp.headers());
    let stream = resp
        .bytes_stream()
        .map_ok(Frame::data)
        .map_err(|e| -> BodyError { Box::new(e) });
    let mut out = Response::new(StreamBody::new(stream).boxed_unsync());
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}
