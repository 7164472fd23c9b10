//! The upstream's Responses WebSocket: a `response.create` that came over
//! a client's WebSocket goes over one of the upstream's own when it takes
//! one. Each client socket has its [`Socket`]: the upstream socket opened
//! at its first response, kept between responses, closed with it.
//!
//! The handshake is an HTTP/1.1 `GET` of the URL the `POST` would have
//! gone to, sent by the upstream client with the request's own headers
//! ([`handshake`]): the same URL mapping, header hygiene, credentials and
//! TLS. What comes back is made into the answer the upstream would have
//! given over HTTP ([`exchange`]): a stream of SSE events (`event:` the
//! type, `data:` the message) with status 200, or, for an `error` event
//! before any other, the status it carries with an OpenAI-shaped JSON
//! error body; so the rest of the proxy (the reactive compaction, the
//! relay, the record) cannot tell.
//!
//! One response at a time on a socket: it is taken from its [`Socket`]
//! for the response and put back at the response's final event. An
//! answer dropped before its end drops (closes) the socket it was on, and
//! the next response opens another.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::{FutureExt, SinkExt, StreamExt};
use http::header::{self, HeaderMap, HeaderValue};
use serde_json::value::RawValue;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use crate::wire::RawMembers;

/// An open upstream socket.
pub type Conn = WebSocketStream<reqwest::Upgraded>;

/// Longest wait to send the close frame of a client socket's upstream
/// socket when the client socket closes.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// The read buffer of an upstream socket: a few events' worth (a larger
/// message grows it as it arrives). Tungstenite zeroes the room it reads
/// into before each read, the try that finds nothing too, as much as this
/// size, so its default of 128 KiB would cost a 128 KiB memset at every read
/// of a turn's events, and at every check that a kept socket is still open.
const READ_BUFFER: usize = 8 * 1024;

/// The events that end a response.
const FINAL: [&str; 4] = [
    "response.completed",
    "response.failed",
    "response.incomplete",
    "error",
];

/// A client socket's upstream socket, when one is open and no response is
/// under way on it.
#[derive(Default)]
pub struct Socket {
    idle: Mutex<Option<Conn>>,
    /// The client socket closed: a socket that comes back is closed.
    closed: AtomicBool,
    /// Headers only the handshake carries (the client's `OpenAI-Beta`
    /// asking for the WebSocket mode, which its HTTP requests go without).
    handshake: HeaderMap,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket").finish_non_exhaustive()
    }
}

impl Socket {
    /// A client socket's, whose handshake upstream carries `handshake`
    /// beside the request's headers.
    pub fn new(handshake: HeaderMap) -> Socket {
        Socket {
            handshake,
            ..Socket::default()
        }
    }

    /// The idle socket, if one is open and nothing came on it meanwhile
    /// (a close, a failure, or an event no response asked for: a new one
    /// is opened instead).
    pub fn take(&self) -> Option<Conn> {
        let mut conn = self.lock().take()?;
        loop {
            match conn.next().now_or_never() {
                None => return Some(conn),
                Some(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => continue,
                Some(_) => return None,
            }
        }
    }

    /// A socket whose response ended, kept for the next one unless the
    /// client socket closed.
    fn put(&self, conn: Conn) {
        if !self.closed.load(Ordering::Acquire) {
            *self.lock() = Some(conn);
        }
    }

    /// Closes the idle socket (the client socket closed); a socket still
    /// answering is closed with its answer.
    pub async fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let Some(mut conn) = self.lock().take() else {
            return;
        };
        let frame = CloseFrame {
            code: CloseCode::Normal,
            reason: "".into(),
        };
        let _ = tokio::time::timeout(CLOSE_WAIT, conn.close(Some(frame))).await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Conn>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Makes `headers` (a request's headers upstream) those of the handshake
/// for `socket`; the key the upgrade's answer must be derived from.
pub fn handshake(headers: &mut HeaderMap, socket: &Socket) -> String {
    headers.remove(header::CONTENT_TYPE);
    headers.remove(header::CONTENT_LENGTH);
    for (name, value) in &socket.handshake {
        headers.append(name, value.clone());
    }
    let key = generate_key();
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(
        header::SEC_WEBSOCKET_VERSION,
        HeaderValue::from_static("13"),
    );
    if let Ok(v) = HeaderValue::from_str(&key) {
        headers.insert(header::SEC_WEBSOCKET_KEY, v);
    }
    key
}

/// Whether a handshake answered `status` was refused for the moment (a key
/// refused, a rate limit, a server error), which says nothing of whether
/// the upstream takes a WebSocket, rather than for good (no such endpoint,
/// no upgrade there).
pub fn refusal_of_the_moment(status: http::StatusCode) -> bool {
    use http::StatusCode as S;
    matches!(
        status,
        S::UNAUTHORIZED | S::FORBIDDEN | S::TOO_MANY_REQUESTS
    ) || status.is_server_error()
}

/// Whether the upstream took the upgrade asked with `key`: a 101 with the
/// accept key derived from it.
pub fn accepted(resp: &reqwest::Response, key: &str) -> bool {
    resp.status() == http::StatusCode::SWITCHING_PROTOCOLS
        && resp
            .headers()
            .get(header::SEC_WEBSOCKET_ACCEPT)
            .is_some_and(|v| v.as_bytes() == derive_accept_key(key.as_bytes()).as_bytes())
}

/// The socket an accepted upgrade became; its messages at most `max`
/// bytes.
pub async fn open(resp: reqwest::Response, max: usize) -> Result<Conn, reqwest::Error> {
    let io = resp.upgrade().await?;
    let config = WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER)
        .max_message_size(Some(max))
        .max_frame_size(Some(max));
    Ok(WebSocketStream::from_raw_socket(io, Role::Client, Some(config)).await)
}

/// The `response.create` event a Responses request body stands for: its
/// members but `stream` (the socket always streams) after the event's
/// `type`; `None` if the body is not a JSON object.
///
/// The body is one the proxy built for a client socket's `response.create`
/// and read whole on its way here: that event's `type` and `stream` were
/// taken out and `"stream":true` put last, and what rebuilds a body keeps
/// one member per key. Such a body becomes its event by moving its ends,
/// without a second parse of its 30 KB or 300 KB; any other is read.
pub fn create_event(body: &[u8]) -> Option<String> {
    const STREAMED: &[u8] = br#","stream":true}"#;
    let members = body
        .strip_prefix(b"{")
        .and_then(|b| b.strip_suffix(STREAMED))
        .and_then(|m| std::str::from_utf8(m).ok());
    if let Some(members) = members {
        let mut out = String::with_capacity(body.len() + 16);
        out.push_str(r#"{"type":"response.create","#);
        out.push_str(members);
        out.push('}');
        return Some(out);
    }
    let RawMembers(members) = serde_json::from_slice(body).ok()?;
    let mut out = String::with_capacity(body.len() + 32);
    out.push_str(r#"{"type":"response.create""#);
    for (k, v) in members {
        if k == "stream" || k == "type" {
            continue;
        }
        out.push(',');
        // A key that came from JSON serializes back.
        out.push_str(&serde_json::to_string(&k).ok()?);
        out.push(':');
        out.push_str(v.get());
    }
    out.push('}');
    Some(out)
}

/// Why a response on an upstream socket got no answer.
#[derive(Debug, thiserror::Error)]
pub enum Broke {
    /// The socket closed (or ended) before the first event.
    #[error("the upstream's WebSocket closed before the answer began")]
    Closed,
    /// No first event within the bound.
    #[error("no answer in time")]
    Silent,
    /// The socket failed.
    #[error("the upstream's WebSocket failed: {0}")]
    Failed(#[source] Box<WsError>),
}

/// Sends `event` (a `response.create`) on `conn` and answers as the
/// upstream would have over HTTP: the first event within `wait`, then the
/// rest as the answer's body is read. The socket goes back to `socket` at
/// the response's final event.
pub async fn exchange(
    socket: std::sync::Arc<Socket>,
    mut conn: Conn,
    event: String,
    wait: Duration,
) -> Result<reqwest::Response, Broke> {
    let first = async {
        conn.send(Message::Text(event.into()))
            .await
            .map_err(closed_or_failed)?;
        next_event(&mut conn).await
    };
    let first = match tokio::time::timeout(wait, first).await {
        Ok(first) => first?,
        Err(_) => return Err(Broke::Silent),
    };
    let kind = event_type(&first);
    if kind == "error" {
        socket.put(conn);
        return Ok(error_answer(&first));
    }
    let head = sse(&kind, &first);
    let conn = if FINAL.contains(&kind.as_str()) {
        socket.put(conn);
        None
    } else {
        Some(conn)
    };
    let rest = futures_util::stream::unfold(
        (Some(head), conn, socket),
        |(head, conn, socket)| async move {
            if let Some(head) = head {
                return Some((Ok(head), (None, conn, socket)));
            }
            let mut conn = conn?;
            match next_event(&mut conn).await {
                Ok(text) => {
                    let kind = event_type(&text);
                    let bytes = sse(&kind, &text);
                    if FINAL.contains(&kind.as_str()) {
                        socket.put(conn);
                        return Some((Ok(bytes), (None, None, socket)));
                    }
                    Some((Ok(bytes), (None, Some(conn), socket)))
                }
                Err(broke) => {
                    let e: Box<dyn std::error::Error + Send + Sync> = match broke {
                        Broke::Closed => "the upstream closed its WebSocket mid-answer".into(),
                        other => Box::new(other),
                    };
                    Some((Err(e), (None, None, socket)))
                }
            }
        },
    );
    let resp = http::Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(reqwest::Body::wrap_stream(rest))
        .map_err(|_| Broke::Closed)?;
    Ok(reqwest::Response::from(resp))
}

/// The next event on `conn` (a text message), past pings.
async fn next_event(conn: &mut Conn) -> Result<String, Broke> {
    loop {
        match conn.next().await {
            Some(Ok(Message::Text(t))) => return Ok(t.as_str().to_owned()),
            // Events are text; pings are answered by the socket itself.
            Some(Ok(Message::Binary(_) | Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Frame(_))) => continue,
            Some(Ok(Message::Close(_))) | None => return Err(Broke::Closed),
            Some(Err(e)) => return Err(closed_or_failed(e)),
        }
    }
}

fn closed_or_failed(e: WsError) -> Broke {
    match e {
        WsError::ConnectionClosed | WsError::AlreadyClosed => Broke::Closed,
        WsError::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionAborted
            ) =>
        {
            Broke::Closed
        }
        WsError::Protocol(
            tokio_tungstenite::tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
        ) => Broke::Closed,
        other => Broke::Failed(Box::new(other)),
    }
}

#[derive(serde::Deserialize)]
struct Kind<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<std::borrow::Cow<'a, str>>,
}

/// An event's `type` (`message` without one, as SSE names an event with
/// no `event:` line).
fn event_type(text: &str) -> String {
    serde_json::from_str::<Kind>(text)
        .ok()
        .and_then(|k| k.kind)
        .map_or_else(|| "message".to_string(), |k| k.into_owned())
}

/// An event as an SSE block: `event:` its type, a `data:` line per line of
/// its JSON (a line break in JSON is whitespace).
fn sse(kind: &str, text: &str) -> Bytes {
    let mut out = BytesMut::with_capacity(text.len() + kind.len() + 16);
    out.put_slice(b"event: ");
    out.put_slice(kind.as_bytes());
    out.put_u8(b'\n');
    for line in text.split(['\n', '\r']).filter(|l| !l.is_empty()) {
        out.put_slice(b"data: ");
        out.put_slice(line.as_bytes());
        out.put_u8(b'\n');
    }
    out.put_u8(b'\n');
    out.freeze()
}

#[derive(serde::Deserialize)]
struct ErrorEvent<'a> {
    status: Option<u16>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
}

/// An `error` event before any other, as the HTTP answer it stands for:
/// the status it carries (else 400 for an invalid request, 500 for the
/// rest) and `{"error": …}`.
fn error_answer(text: &str) -> reqwest::Response {
    let parsed = serde_json::from_str::<ErrorEvent>(text).ok();
    let error = parsed.as_ref().and_then(|e| e.error).map(RawValue::get);
    let invalid = error.is_some_and(|e| e.contains("invalid_request_error"));
    let status = parsed
        .as_ref()
        .and_then(|e| e.status)
        .and_then(|s| http::StatusCode::from_u16(s).ok())
        .filter(|s| s.is_client_error() || s.is_server_error())
        .unwrap_or(if invalid {
            http::StatusCode::BAD_REQUEST
        } else {
            http::StatusCode::INTERNAL_SERVER_ERROR
        });
    let body = match error {
        Some(e) => format!(r#"{{"error":{e}}}"#),
        None => text.to_string(),
    };
    let mut resp = http::Response::new(reqwest::Body::from(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    reqwest::Response::from(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_body_becomes_a_response_create_in_its_order() {
        let body = br#"{"model":"m","stream":true,"input":[{"role":"user","content":"a\"b"}],"store":false}"#;
        assert_eq!(
            create_event(body).unwrap(),
            r#"{"type":"response.create","model":"m","input":[{"role":"user","content":"a\"b"}],"store":false}"#
        );
        // As a client socket's body ends: its members taken as they are.
        let built = br#"{"model":"m","input":[{"type":"message","role":"user","content":"a"}],"store":false,"stream":true}"#;
        let event = create_event(built).unwrap();
        assert_eq!(
            event,
            r#"{"type":"response.create","model":"m","input":[{"type":"message","role":"user","content":"a"}],"store":false}"#
        );
        // Either way, the same event.
        let read: serde_json::Value = serde_json::from_str(&event).unwrap();
        let moved = br#"{"stream":true,"model":"m","input":[{"type":"message","role":"user","content":"a"}],"store":false}"#;
        let other: serde_json::Value = serde_json::from_str(&create_event(moved).unwrap()).unwrap();
        assert_eq!(read, other);
        assert!(create_event(b"[1]").is_none());
        assert!(create_event(b"{").is_none());
    }

    #[test]
    fn events_become_sse_blocks_named_by_their_type() {
        assert_eq!(
            sse("response.created", r#"{"type":"response.created"}"#),
            "event: response.created\ndata: {\"type\":\"response.created\"}\n\n"
        );
        assert_eq!(
            sse("x", "{\n \"a\": 1\r\n}"),
            "event: x\ndata: {\ndata:  \"a\": 1\ndata: }\n\n"
        );
        assert_eq!(event_type(r#"{"a":1,"type":"error"}"#), "error");
        assert_eq!(event_type("{}"), "message");
    }

    #[tokio::test]
    async fn an_error_event_is_the_status_it_carries_with_an_openai_error_body() {
        let e = error_answer(
            r#"{"type":"error","status":400,"error":{"type":"invalid_request_error","code":"context_length_exceeded","message":"too long"}}"#,
        );
        assert_eq!(e.status(), 400);
        let body: serde_json::Value = e.json().await.unwrap();
        assert_eq!(body["error"]["code"], "context_length_exceeded");
        let no_status = error_answer(r#"{"type":"error","error":{"type":"server_error"}}"#);
        assert_eq!(no_status.status(), 500);
        let invalid = error_answer(r#"{"type":"error","error":{"type":"invalid_request_error"}}"#);
        assert_eq!(invalid.status(), 400);
    }
}
