//! The fake upstream's Responses WebSocket (`GET /v1/responses`
//! upgraded), as OpenAI serves it: each `response.create` is answered as
//! the `POST /v1/responses` it stands for (streamed) would be, the events
//! of its SSE answer one message each (those ready together in one write,
//! as a server streams), an error answer an `error` event carrying its
//! status; a stream scripted to break off drops the socket without a close
//! frame.

use std::future::Future;

use bytes::Bytes;
use futures_util::{FutureExt, SinkExt, StreamExt};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::error::ProxyBody;
use crate::wire::sse::Framer;

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
    serve_on(TokioIo::new(io), answer).await;
}

/// [`serve`] on the connection `io`, once upgraded.
async fn serve_on<S, F, Fut>(io: S, answer: F)
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Fn(Bytes) -> Fut,
    Fut: Future<Output = Response<ProxyBody>>,
{
    let mut ws = WebSocketStream::from_raw_socket(io, Role::Server, None).await;
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

async fn send<S: AsyncRead + AsyncWrite + Unpin>(
    ws: &mut WebSocketStream<S>,
    text: String,
) -> bool {
    ws.send(Message::Text(text.into())).await.is_ok()
}

/// Sends an answer as events; false once the socket is to be dropped.
async fn relay<S: AsyncRead + AsyncWrite + Unpin>(
    ws: &mut WebSocketStream<S>,
    resp: Response<ProxyBody>,
) -> bool {
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
    // As a server writes a stream: the events that are ready go out
    // together, flushed once the answer has to be waited for (and at its
    // end, or before a socket dropped for a break), not one write each.
    let mut framer = Framer::new();
    loop {
        let frame = match body.frame().now_or_never() {
            Some(frame) => frame,
            None => {
                if ws.flush().await.is_err() {
                    return false;
                }
                body.frame().await
            }
        };
        let data = match frame {
            None => break,
            Some(Err(_)) => {
                let _ = ws.flush().await;
                return false;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue,
            },
        };
        framer.push(&data);
        while let Some(block) = framer.next_block() {
            let Some(event) = block.event else { continue };
            if event.data.is_empty() || event.data == "[DONE]" {
                continue;
            }
            if ws.feed(Message::Text(event.data.into())).await.is_err() {
                return false;
            }
        }
    }
    ws.flush().await.is_ok()
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use futures_util::{SinkExt, StreamExt};
    use serde_json::Value;
    use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::WebSocketStream;

    use crate::fake_upstream::{render, responses_stream_events, Reply};

    const WAIT: Duration = Duration::from_secs(10);

    /// The server's end of the connection, counting the writes that reach it.
    struct Counted {
        io: DuplexStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncRead for Counted {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Counted {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let written = Pin::new(&mut self.io).poll_write(cx, buf);
            if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
                self.writes.fetch_add(1, Ordering::Relaxed);
            }
            written
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }
        fn poll_shutdown(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    /// A socket on [`serve_on`] answering each `response.create` with
    /// `reply`; the count of the server's writes.
    async fn serving(reply: Reply) -> (WebSocketStream<DuplexStream>, Arc<AtomicUsize>) {
        let (client, server) = tokio::io::duplex(1 << 20);
        let writes = Arc::new(AtomicUsize::new(0));
        let io = Counted {
            io: server,
            writes: writes.clone(),
        };
        tokio::spawn(super::serve_on(io, move |_| render(reply.clone())));
        let ws = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        (ws, writes)
    }

    async fn create(ws: &mut WebSocketStream<DuplexStream>) {
        let event = r#"{"type":"response.create","model":"m","input":[]}"#;
        ws.send(Message::Text(event.into())).await.unwrap();
    }

    /// The types of the next `n` events.
    async fn types(ws: &mut WebSocketStream<DuplexStream>, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        while out.len() < n {
            let m = tokio::time::timeout(WAIT, ws.next()).await.unwrap();
            let Some(Ok(Message::Text(text))) = m else {
                panic!("{m:?} after {out:?}");
            };
            let event: Value = serde_json::from_str(text.as_str()).unwrap();
            out.push(event["type"].as_str().unwrap_or_default().to_string());
        }
        out
    }

    /// The events of the fake's streamed answer, and their types.
    fn answer() -> (Vec<bytes::Bytes>, Vec<String>) {
        let events = responses_stream_events("resp_ws", &["a", "b", "c"], 10, 3);
        let types = events
            .iter()
            .map(|e| e.lines().next().unwrap()["event: ".len()..].to_string())
            .collect();
        (events.into_iter().map(bytes::Bytes::from).collect(), types)
    }

    /// A server writes what it has of a stream together: an answer ready
    /// at once leaves in one write, not one per event.
    #[tokio::test]
    async fn an_answer_ready_at_once_leaves_in_one_write() {
        let (chunks, expected) = answer();
        assert_eq!(expected.len(), 8);
        let (mut ws, writes) = serving(Reply::Sse {
            chunks,
            gap: Duration::ZERO,
            reset_after: None,
        })
        .await;
        for turn in 1..=2 {
            create(&mut ws).await;
            assert_eq!(types(&mut ws, expected.len()).await, expected);
            assert_eq!(writes.load(Ordering::Relaxed), turn, "one write a response");
        }
    }

    /// What is ready is flushed before the answer is waited for: the
    /// events before a wait arrive before it ends, together, and the rest
    /// after it.
    #[tokio::test]
    async fn the_events_before_a_wait_are_not_held_over_it() {
        let (chunks, expected) = answer();
        let gate = Arc::new(tokio::sync::Notify::new());
        let (mut ws, writes) = serving(Reply::Gated {
            chunks,
            at: 5,
            gate: gate.clone(),
        })
        .await;
        create(&mut ws).await;
        assert_eq!(types(&mut ws, 5).await, expected[..5]);
        assert_eq!(writes.load(Ordering::Relaxed), 1);
        gate.notify_one();
        assert_eq!(types(&mut ws, 3).await, expected[5..]);
        assert_eq!(writes.load(Ordering::Relaxed), 2);
    }
}
