//! `GET /v1/responses` upgraded to a WebSocket: the Responses API's
//! WebSocket mode, Codex's default transport.
//!
//! Each `response.create` message is the body of a `POST /v1/responses`
//! without `stream`; it goes through the same driver as one
//! ([`super::proxy::handle`]: conversation match, compaction, recording,
//! retries, recall), as a streamed request carrying the upgrade's headers,
//! and the events of its answer go back one message each (the JSON of the
//! event), in order. The upstream is asked over a WebSocket of its own
//! when it takes one (`upstream.websocket`, see [`crate::upstream::Socket`]:
//! one per client socket, opened at its first response, closed with it),
//! else over HTTP with SSE; the client cannot tell.
//!
//! One response at a time: a `response.create` while one is under way is
//! refused with an `error` event, as is a binary message, a message that
//! is not JSON or an event type other than `response.create` (the socket
//! stays open). A failure of the answer itself (an error status, the
//! upstream breaking off) is an `error` event carrying the status, as
//! OpenAI's WebSocket mode reports it. Messages over `server.max_body_bytes`
//! close the socket (1009), as do text that is not UTF-8 (1007) and frames
//! that break the protocol (1002); no response and nothing from the client for
//! `server.websocket_idle_secs` closes it (1001).
//!
//! Backpressure: the next part of the answer is read only once the last
//! was written to the client, so a client that stops reading holds the
//! upstream, not memory; one that reads nothing for
//! `upstream.idle_timeout_secs` is dropped. A client that goes away
//! mid-answer drops it, which records the exchange as partial, as a
//! dropped HTTP stream does.
//!
//! A socket holds its connection's slot among `server.max_connections`
//! while it is open. At shutdown an idle socket is closed (1001) at once;
//! one with a response under way finishes it (a `response.create` sent
//! meanwhile is refused with a 503 `error` event), then is closed; one
//! still answering when `server.shutdown_grace_secs` is over drops its
//! answer (recorded as partial, the proxy having shut down) and is closed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

mod event;

use super::answer::is_sse;
use super::lease::Lease;
use crate::app::AppState;
use crate::error::{json_response, ProxyBody};
use crate::wire::sse::Framer;
use crate::wire::Api;
use event::{is_final, read_event, ClientEvent, Last, Warmed};

/// The label its upgrade and each of its answers are counted under in
/// `compactor_requests_total` (the upgrade with status 101).
pub(super) const ENDPOINT: &str = "responses_websocket";

/// Most bytes of an answer that is not a stream (an error) read to report
/// it.
const MAX_ERROR_BODY: usize = 1 << 20;

/// Longest wait for the end of a stream whose final event was sent, when
/// the client asks for the next response.
const DRAIN: Duration = Duration::from_secs(5);

/// Longest wait to send the close frame of a socket whose answer was cut
/// at the end of the shutdown grace period.
const CUT_CLOSE: Duration = Duration::from_secs(1);

type Socket = WebSocketStream<TokioIo<Upgraded>>;
type Answering = Pin<Box<dyn Future<Output = Response<ProxyBody>> + Send>>;

/// Whether the request asks to be upgraded to a WebSocket.
pub(super) fn is_upgrade(req: &Request<Incoming>) -> bool {
    has_token(req.headers(), &header::UPGRADE, "websocket")
}

/// Whether a comma-separated header has `token` (any case).
fn has_token(headers: &HeaderMap, name: &HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Answers the upgrade (101, or a JSON error for a malformed handshake)
/// and runs the socket's session once hyper hands the connection over.
pub(super) fn handle(
    state: Arc<AppState>,
    mut req: Request<Incoming>,
    lease: Arc<Lease>,
) -> Response<ProxyBody> {
    let headers = req.headers();
    let version_ok = headers
        .get(header::SEC_WEBSOCKET_VERSION)
        .is_some_and(|v| v.as_bytes() == b"13");
    let key = headers.get(header::SEC_WEBSOCKET_KEY).cloned();
    let (Some(key), true, true) = (
        key,
        version_ok,
        has_token(headers, &header::CONNECTION, "upgrade"),
    ) else {
        let mut resp = json_response(
            StatusCode::BAD_REQUEST,
            &error_body(
                "invalid_request_error",
                "websocket_handshake_invalid",
                "a WebSocket upgrade needs `Connection: Upgrade`, `Sec-WebSocket-Version: 13` \
                 and a `Sec-WebSocket-Key`",
            ),
        );
        resp.headers_mut().insert(
            header::SEC_WEBSOCKET_VERSION,
            HeaderValue::from_static("13"),
        );
        return resp;
    };
    let accept = derive_accept_key(key.as_bytes());
    let forwarded = forwarded_headers(req.headers());
    let upstream = Arc::new(crate::upstream::Socket::new(websocket_beta(req.headers())));
    let uri = match req.uri().query() {
        Some(q) => format!("{}?{q}", Api::Responses.endpoint()),
        None => Api::Responses.endpoint().to_string(),
    };
    let upgrade = hyper::upgrade::on(&mut req);
    let span = tracing::info_span!("websocket");
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            match upgrade.await {
                Ok(io) => {
                    let ws = WebSocketStream::from_raw_socket(
                        TokioIo::new(io),
                        Role::Server,
                        Some(socket_config(&state)),
                    )
                    .await;
                    tracing::debug!("websocket opened");
                    Session::new(state, ws, forwarded, uri, lease, upstream.clone())
                        .run()
                        .await;
                    upstream.close().await;
                    tracing::debug!("websocket closed");
                }
                Err(e) => tracing::debug!(error = %e, "websocket upgrade failed"),
            }
        },
        span,
    ));
    let mut resp = Response::new(crate::error::full(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(v) = HeaderValue::from_str(&accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    resp
}

/// Frame and message limits: a message may be as large as a request body.
/// The read buffer starts small and grows with the messages: tungstenite
/// zeroes the room it reads into before each read (the try that finds
/// nothing, at every turn of the socket's loop, too), as much as the read
/// buffer's size however far a large message grew the buffer, so its 128 KiB
/// default would be a 128 KiB memset each time.
fn socket_config(state: &AppState) -> WebSocketConfig {
    let max = state.config.server.max_body_bytes.max(1 << 16);
    WebSocketConfig::default()
        .read_buffer_size(8 * 1024)
        .max_message_size(Some(max))
        .max_frame_size(Some(max))
        .max_write_buffer_size(max.saturating_mul(2))
}

/// The upgrade's headers, as each `response.create` carries them: the
/// client's credentials and ids, without the upgrade's own.
fn forwarded_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len() + 2);
    for (name, value) in headers {
        let n = name.as_str();
        if n.starts_with("sec-websocket-")
            || name == header::CONNECTION
            || name == header::UPGRADE
            || name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            // Asks OpenAI for its WebSocket mode: the upstream's
            // handshake carries it (`websocket_beta`), an HTTP request not.
            || (n == "openai-beta" && is_websocket_beta(value))
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

/// The headers asking for OpenAI's WebSocket mode, which only the
/// upstream's handshake carries.
fn websocket_beta(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for value in headers.get_all("openai-beta") {
        if is_websocket_beta(value) {
            out.append("openai-beta", value.clone());
        }
    }
    out
}

fn is_websocket_beta(value: &HeaderValue) -> bool {
    value
        .to_str()
        .is_ok_and(|v| v.contains("responses_websockets"))
}

/// An OpenAI-style error object's body (`{"error": {…}}`).
fn error_body(kind: &str, code: &str, message: &str) -> Value {
    json!({"error": {"type": kind, "code": code, "message": message, "param": null}})
}

/// The `error` event for a failure of status `status`: the error object of
/// `body` (an OpenAI-style error body), as OpenAI's WebSocket mode sends it.
fn error_event(status: u16, body: Value) -> Value {
    let error = match body {
        Value::Object(mut o) => o.remove("error").unwrap_or(Value::Object(o)),
        other => json!({"type": "server_error", "message": other}),
    };
    json!({"type": "error", "status": status, "error": error})
}

/// What the socket is doing between two messages of the client.
enum Turn {
    /// No response under way.
    Idle,
    /// A `response.create` is in the driver, its answer not begun.
    Starting(Answering),
    /// Its answer streams: the body, framed into events.
    Streaming {
        body: ProxyBody,
        framer: Framer,
        /// A final event (`response.completed`, `.failed`, `.incomplete`,
        /// `error`) went to the client.
        ended: bool,
    },
}

/// What woke the session.
enum Step {
    Client(Option<Result<Message, WsError>>),
    Idle,
    /// The server stops accepting.
    Closing,
    /// The shutdown grace period is over.
    Cut,
    Answer(Response<ProxyBody>),
    Frame(Option<Result<hyper::body::Frame<Bytes>, crate::error::BodyError>>),
}

/// One WebSocket's session.
struct Session {
    state: Arc<AppState>,
    ws: Socket,
    /// What each `response.create` is sent with.
    headers: HeaderMap,
    uri: String,
    /// How long the socket may sit without a response or a client message.
    idle: Option<Duration>,
    /// How long a write may wait for the client to read.
    write_limit: Duration,
    /// Most bytes of one event of an answer.
    max_event: usize,
    /// The last warm-up answered.
    warmed: Option<Warmed>,
    /// The last `response.create`, which the next is read against.
    last: Last,
    /// Its connection's slot and the server's shutdown.
    lease: Arc<Lease>,
    /// The server is shutting down: close once no response is under way.
    stopping: bool,
    /// The upstream's WebSocket of this socket, which each
    /// `response.create` carries to the driver.
    upstream: Arc<crate::upstream::Socket>,
}

impl Session {
    fn new(
        state: Arc<AppState>,
        ws: Socket,
        headers: HeaderMap,
        uri: String,
        lease: Arc<Lease>,
        upstream: Arc<crate::upstream::Socket>,
    ) -> Self {
        let idle_secs = state.config.server.websocket_idle_secs;
        let write_limit = state.upstream.idle_timeout;
        let max_event = state
            .config
            .server
            .max_body_bytes
            .max(crate::wire::sse::MAX_COLLECTED);
        Self {
            state,
            ws,
            headers,
            uri,
            idle: (idle_secs > 0).then(|| Duration::from_secs(idle_secs)),
            write_limit,
            max_event,
            warmed: None,
            last: Last::default(),
            lease,
            stopping: false,
            upstream,
        }
    }

    async fn run(mut self) {
        let mut turn = Turn::Idle;
        let mut quiet_since = tokio::time::Instant::now();
        // Its own receivers, polled beside the socket.
        let (mut closing, mut cut) = (self.lease.closing.clone(), self.lease.cut.clone());
        loop {
            if self.stopping && matches!(turn, Turn::Idle) {
                self.close(
                    CloseCode::Away,
                    "the server is shutting down",
                    self.write_limit,
                )
                .await;
                return;
            }
            // The shutdown first: a message that arrives once the server
            // stops accepting is answered as the server is stopping.
            let step = {
                let next = self.ws.next();
                let stopping = self.stopping;
                let shutdown = async {
                    tokio::select! {
                        _ = closing.wait_for(|c| *c), if !stopping => Step::Closing,
                        _ = cut.wait_for(|c| *c) => Step::Cut,
                    }
                };
                match &mut turn {
                    Turn::Idle => {
                        let idle = async {
                            match self.idle {
                                Some(limit) => tokio::time::sleep_until(quiet_since + limit).await,
                                None => std::future::pending().await,
                            }
                        };
                        tokio::select! {
                            biased;
                            s = shutdown => s,
                            m = next => Step::Client(m),
                            () = idle => Step::Idle,
                        }
                    }
                    Turn::Starting(answering) => tokio::select! {
                        biased;
                        s = shutdown => s,
                        m = next => Step::Client(m),
                        resp = answering => Step::Answer(resp),
                    },
                    Turn::Streaming { body, .. } => tokio::select! {
                        biased;
                        s = shutdown => s,
                        m = next => Step::Client(m),
                        f = body.frame() => Step::Frame(f),
                    },
                }
            };
            let go_on = match step {
                Step::Client(m) => {
                    quiet_since = tokio::time::Instant::now();
                    self.client_message(m, &mut turn).await
                }
                Step::Idle => {
                    let reason = "no response and nothing from the client for the idle limit";
                    self.close(CloseCode::Away, reason, self.write_limit).await;
                    false
                }
                Step::Closing => {
                    // Closed once the response under way, if any, ended.
                    self.stopping = true;
                    true
                }
                Step::Cut => {
                    // Dropped first, so that it is recorded as cut by the
                    // shutdown before the store closes.
                    turn = Turn::Idle;
                    let reason = "the server shut down before the response ended";
                    self.close(CloseCode::Away, reason, CUT_CLOSE).await;
                    false
                }
                Step::Answer(resp) => self.answer(resp, &mut turn).await,
                Step::Frame(f) => {
                    let go_on = self.frame(f, &mut turn).await;
                    if matches!(turn, Turn::Idle) {
                        quiet_since = tokio::time::Instant::now();
                    }
                    go_on
                }
            };
            if !go_on {
                // Dropping a turn under way drops its answer, which records
                // the exchange as cut short.
                return;
            }
        }
    }

    /// Acts on a message of the client; false once the socket is done.
    async fn client_message(
        &mut self,
        m: Option<Result<Message, WsError>>,
        turn: &mut Turn,
    ) -> bool {
        match m {
            None | Some(Err(WsError::ConnectionClosed | WsError::AlreadyClosed)) => false,
            Some(Err(WsError::Capacity(e))) => {
                let msg = format!("message too large: {e}; the limit is server.max_body_bytes");
                self.refuse(StatusCode::PAYLOAD_TOO_LARGE, "message_too_large", &msg)
                    .await;
                self.close(CloseCode::Size, "message too large", self.write_limit)
                    .await;
                false
            }
            Some(Err(WsError::Utf8(_))) => {
                let reason = "a text message that is not UTF-8";
                self.close(CloseCode::Invalid, reason, self.write_limit)
                    .await;
                false
            }
            Some(Err(WsError::Protocol(e))) => {
                self.close(CloseCode::Protocol, &e.to_string(), self.write_limit)
                    .await;
                false
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "websocket read failed");
                false
            }
            Some(Ok(Message::Text(text))) => self.event(text.as_str(), turn).await,
            Some(Ok(Message::Binary(_))) => {
                self.refuse(
                    StatusCode::BAD_REQUEST,
                    "unsupported_message",
                    "binary messages are not accepted: send each event as a text message of JSON",
                )
                .await
            }
            Some(Ok(Message::Close(_))) => {
                // The reply tungstenite queued.
                let _ = tokio::time::timeout(self.write_limit, self.ws.flush()).await;
                false
            }
            // Pings are answered by the socket itself.
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => true,
        }
    }

    /// A client event (the text of a message).
    async fn event(&mut self, text: &str, turn: &mut Turn) -> bool {
        let body = match read_event(text, self.warmed.as_ref(), &mut self.last) {
            Ok(ClientEvent::Create(body)) => body,
            Ok(ClientEvent::Nothing) => return true,
            Ok(ClientEvent::WarmUp { model, input }) => return self.warm_up(model, input).await,
            Err((code, msg)) => return self.refuse(StatusCode::BAD_REQUEST, code, &msg).await,
        };
        if let Turn::Streaming {
            body, ended: true, ..
        } = turn
        {
            // The client read the final event; the stream's end (recorded
            // already) is on its way.
            let _ =
                tokio::time::timeout(DRAIN, async { while body.frame().await.is_some() {} }).await;
            *turn = Turn::Idle;
        }
        if self.stopping {
            return self
                .refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_shutting_down",
                    "the server is shutting down: send it again on a new connection",
                )
                .await;
        }
        if !matches!(turn, Turn::Idle) {
            return self
                .refuse(
                    StatusCode::CONFLICT,
                    "response_in_progress",
                    "a response is already under way on this socket: send the next \
                     `response.create` once it ended (one response at a time)",
                )
                .await;
        }
        let (mut parts, ()) = Request::new(()).into_parts();
        parts.method = http::Method::POST;
        if let Ok(uri) = self.uri.parse() {
            parts.uri = uri;
        }
        parts.headers = self.headers.clone();
        parts.extensions.insert(self.upstream.clone());
        let state = self.state.clone();
        let body = Bytes::from(body);
        *turn = Turn::Starting(Box::pin(super::proxy::handle_whole(
            state,
            Api::Responses,
            parts,
            body,
        )));
        true
    }

    /// Answers a warm-up (`generate: false`) itself: an empty response,
    /// whose input the next `response.create` that continues it gets in
    /// front of its own. An upstream asked over HTTP would generate.
    async fn warm_up(&mut self, model: String, input: String) -> bool {
        let id = crate::ids::new_response_id();
        let mut response = json!({"id": id, "object": "response", "status": "in_progress",
            "model": model, "output": []});
        let created = json!({"type": "response.created", "response": response.clone()});
        response["status"] = json!("completed");
        response["usage"] = json!({"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}});
        let completed = json!({"type": "response.completed", "response": response});
        self.warmed = Some(Warmed { id, input });
        self.send_all(vec![created.to_string(), completed.to_string()])
            .await
    }

    /// The driver's answer to a `response.create`.
    async fn answer(&mut self, resp: Response<ProxyBody>, turn: &mut Turn) -> bool {
        let status = resp.status();
        self.state.metrics.request(ENDPOINT, status.as_u16());
        if status.is_success() && is_sse(resp.headers()) {
            *turn = Turn::Streaming {
                body: resp.into_body(),
                framer: Framer::new(),
                ended: false,
            };
            return true;
        }
        *turn = Turn::Idle;
        let bytes = tokio::time::timeout(self.write_limit, read_capped(resp.into_body()))
            .await
            .unwrap_or_default();
        let value = serde_json::from_slice::<Value>(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        let event = if status.is_success() {
            // An upstream that answered with the whole response.
            json!({"type": "response.completed", "response": value})
        } else {
            error_event(status.as_u16(), value)
        };
        self.send_all(vec![event.to_string()]).await
    }

    /// The next part of a streamed answer.
    async fn frame(
        &mut self,
        f: Option<Result<hyper::body::Frame<Bytes>, crate::error::BodyError>>,
        turn: &mut Turn,
    ) -> bool {
        let Turn::Streaming { framer, ended, .. } = turn else {
            return true;
        };
        match f {
            Some(Ok(frame)) => {
                let Some(data) = frame.data_ref() else {
                    return true;
                };
                framer.push(data);
                let mut events = Vec::new();
                while let Some(block) = framer.next_block() {
                    let Some(event) = block.event else { continue };
                    if event.data.is_empty() || event.data == "[DONE]" {
                        continue;
                    }
                    *ended |= is_final(&event.name, &event.data);
                    events.push(event.data);
                }
                if framer.pending() > self.max_event {
                    let msg = format!(
                        "an event of the answer exceeds {} bytes; the answer is cut",
                        self.max_event
                    );
                    *turn = Turn::Idle;
                    return self.send_all(events).await
                        && self
                            .refuse(StatusCode::BAD_GATEWAY, "event_too_large", &msg)
                            .await;
                }
                self.send_all(events).await
            }
            Some(Err(e)) => {
                // The relay recorded the exchange as partial.
                *turn = Turn::Idle;
                let msg = format!("the answer broke off: {e}");
                self.refuse(StatusCode::BAD_GATEWAY, "stream_interrupted", &msg)
                    .await
            }
            None => {
                let complete = *ended;
                *turn = Turn::Idle;
                if complete {
                    return true;
                }
                self.refuse(
                    StatusCode::BAD_GATEWAY,
                    "stream_incomplete",
                    "the upstream ended the answer before its final event",
                )
                .await
            }
        }
    }

    /// Sends an `error` event; false if the client is gone.
    async fn refuse(&mut self, status: StatusCode, code: &str, message: &str) -> bool {
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        let event = error_event(status.as_u16(), error_body(kind, code, message));
        self.send_all(vec![event.to_string()]).await
    }

    /// Writes `events`, one message each, in one flush; false if the client
    /// is gone or read nothing for the write limit.
    async fn send_all(&mut self, events: Vec<String>) -> bool {
        if events.is_empty() {
            return true;
        }
        let ws = &mut self.ws;
        let write = async {
            for e in events {
                ws.feed(Message::Text(e.into())).await?;
            }
            ws.flush().await
        };
        match tokio::time::timeout(self.write_limit, write).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "websocket write failed");
                false
            }
            Err(_) => {
                tracing::info!(
                    secs = self.write_limit.as_secs(),
                    "websocket client read nothing for the limit; closed"
                );
                false
            }
        }
    }

    /// Closes the socket with `code` and `reason`, waiting at most `limit`
    /// for the client to take the close frame.
    async fn close(&mut self, code: CloseCode, reason: &str, limit: Duration) {
        let frame = CloseFrame {
            code,
            reason: reason.to_string().into(),
        };
        let _ = tokio::time::timeout(limit, self.ws.close(Some(frame))).await;
    }
}

/// The first [`MAX_ERROR_BODY`] bytes of `body` (what arrived before a
/// failure, if it fails).
async fn read_capped(mut body: ProxyBody) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            let room = MAX_ERROR_BODY.saturating_sub(out.len());
            out.extend_from_slice(&data[..data.len().min(room)]);
            if room <= data.len() {
                break;
            }
        }
    }
    out
}
