//! The fake upstream's Responses WebSocket (`GET /v1/responses`
//! upgraded), as OpenAI serves it: each `response.create` is answered as
//! the `POST /v1/responses` it stands for (streamed) would be, the events
//! of its SSE answer one message each, an error answer an `error` event
//! carrying its status; a stream scripted to break off drops the socket
//! without a close frame.

use std::future::Future;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::error::ProxyBody;
use crate::wire::sse::Framer;

type Socket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// Whether `req` asks for a WebSocket.
pub fn is_upgrade(req: &Request<Incoming>) -> bool {
    req.headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// The 101 answering the upgrade `req` asks, and the connection it hands
/// over; `None` for a handshake without a key.
pub fn accept(req: &mut Request<Incoming>) -> Option<(Response<ProxyBody>, OnUpgrade)> {
    let key = req.headers().get(header::SEC_WEBSOCKET_KEY)?;
    let accept = HeaderValue::from_str(&derive_accept_key(key.as_bytes())).ok()?;
    let upgrade = hyper::upgrade::on(req);
    let mut resp = Response::new(crate::error::full(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    Some((resp, upgrade))
}

/// A refusal of the upgrade: `404` from an upstream that takes no
/// WebSocket there, another status for a refusal of the moment.
pub fn refusal(status: StatusCode) -> Response<ProxyBody> {
    let body = json!({"error": {"type": "invalid_request_error",
        "code": status.canonical_reason().unwrap_or("refused"),
        "message": "no WebSocket here", "param": null}});
    let mut resp = Response::new(crate::error::full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// The headers each `response.create` of a socket is received with: the
/// handshake's, without its own.
pub fn request_headers(handshake: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (name, value) in handshake {
        if name.as_str().starts_with("sec-websocket-")
            || name == header::CONNECTION
            || name == header::UPGRADE
        {
            continue;
        }
        out.append(name, value.clone());
    }
    out.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    out
}

/// The body of the `POST /v1/responses` a `response.create` stands for
/// (its members but `type`, streamed); `None` for another event.
pub fn request_body(event: &str) -> Option<Bytes> {
    let mut v: Value = serde_json::from_str(event).ok()?;
    let o = v.as_object_mut()?;
    if o.remove("type")?.as_str() != Some("response.create") {
        return None;
    }
    o.insert("stream".into(), Value::Bool(true));
    Some(Bytes::from(v.to_string()))
}

/// Serves the socket `upgrade` becomes: each `response.create` answered
/// with what `answer` gives its request body, one at a time.
pub async fn serve<F, Fut>(upgrade: OnUpgrade, answer: F)
where
    F: Fn(Bytes) -> Fut,
    Fut: Future<Output = Response<ProxyBody>>,
{
    let Ok(io) = upgrade.await else {
        return;
    };
    let mut ws = WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, None).await;
    while let Some(message) = ws.next().await {
        let text = match message {
            Ok(Message::Text(text)) => text,
            Ok(Message::Close(_)) | Err(_) => return,
            Ok(_) => continue,
        };
        let Some(body) = request_body(text.as_str()) else {
            let event = json!({"type": "error", "status": 400, "error": {
                "type": "invalid_request_error", "code": "unsupported_event",
                "message": "this socket takes `response.create`", "param": null}});
            if send(&mut ws, event.to_string()).await {
                continue;
            }
            return;
        };
        if !relay(&mut ws, answer(body).await).await {
            // Dropped without a close frame.
            return;
        }
    }
}

async fn send(ws: &mut Socket, text: String) -> bool {
    ws.send(Message::Text(text.into())).await.is_ok()
}

/// Sends an answer as events; false once the socket is to be dropped.
async fn relay(ws: &mut Socket, resp: Response<ProxyBody>) -> bool {
    let status = resp.status();
    let sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let mut body = resp.into_body();
    if !(status.is_success() && sse) {
        let Ok(bytes) = body.collect().await.map(|c| c.to_bytes()) else {
            return false;
        };
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let event = if status.is_success() {
            json!({"type": "response.completed", "response": value})
        } else {
            let error = value.get("error").cloned().unwrap_or(value);
            json!({"type": "error", "status": status.as_u16(), "error": error})
        };
        return send(ws, event.to_string()).await;
    }
    let mut framer = Framer::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return false;
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        framer.push(data);
        while let Some(block) = framer.next_block() {
            let Some(event) = block.event else { continue };
            if event.data.is_empty() || event.data == "[DONE]" {
                continue;
            }
            if !send(ws, event.data).await {
                return false;
            }
        }
    }
    true
}
