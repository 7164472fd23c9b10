//! A Responses WebSocket client (tokio-tungstenite) for the tests of
//! `GET /v1/responses` upgraded: connect as Codex does, send events, read
//! a response's events.

use compactor::fake_upstream::Reply;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::{number, within, Harness};

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// The beta header Codex asks OpenAI's WebSocket mode with.
pub const WEBSOCKET_BETA: &str = "responses_websockets=2026-02-06";

/// Opens a WebSocket on the proxy's `/v1/responses` with `key`.
pub async fn connect(h: &Harness, key: &str) -> Ws {
    connect_to(h.addr, key).await
}

/// Opens a WebSocket on `/v1/responses` of the proxy at `addr`.
pub async fn connect_to(addr: std::net::SocketAddr, key: &str) -> Ws {
    let mut req = format!("ws://{addr}/v1/responses")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", format!("Bearer {key}").parse().unwrap());
    req.headers_mut()
        .insert("openai-beta", WEBSOCKET_BETA.parse().unwrap());
    let (ws, resp) = within(tokio_tungstenite::connect_async(req))
        .await
        .expect("upgrade");
    assert_eq!(resp.status(), 101);
    ws
}

/// Sends `event` as a text message.
pub async fn send(ws: &mut Ws, event: &Value) {
    within(ws.send(Message::Text(event.to_string().into())))
        .await
        .unwrap();
}

/// The next text message, as JSON.
pub async fn next_event(ws: &mut Ws) -> Value {
    loop {
        match within(ws.next()).await {
            Some(Ok(Message::Text(t))) => return serde_json::from_str(&t).expect("a JSON event"),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            other => panic!("expected an event, got {other:?}"),
        }
    }
}

/// The events of one response, up to its final one (or an `error`).
pub async fn response_events(ws: &mut Ws) -> Vec<Value> {
    let mut events = Vec::new();
    loop {
        let e = next_event(ws).await;
        let end = matches!(
            e["type"].as_str(),
            Some("response.completed" | "response.failed" | "response.incomplete" | "error")
        );
        events.push(e);
        if end {
            return events;
        }
    }
}

/// A `response.create` of one user message, continuing `previous`.
pub fn create(input: &str, previous: Option<&str>) -> Value {
    let mut e = json!({"type": "response.create", "model": "gpt-5", "instructions": "be brief",
        "input": [{"role": "user", "content": input}], "store": false});
    if let Some(p) = previous {
        e["previous_response_id"] = json!(p);
    }
    e
}

/// A streamed Responses answer of `pieces`.
pub fn streamed(pieces: &[&str]) -> Reply {
    Reply::responses_stream(pieces, 40, 5)
}

/// A streamed Responses answer of `pieces` whose connection breaks after
/// `after` of its events.
pub fn broken(pieces: &[&str], after: usize) -> Reply {
    let Reply::Sse { chunks, gap, .. } = streamed(pieces) else {
        unreachable!("a stream")
    };
    Reply::Sse {
        chunks,
        gap,
        reset_after: Some(after),
    }
}

/// The SSE events of a scripted stream, each's JSON.
pub fn sse_data(reply: &Reply) -> Vec<Value> {
    let Reply::Sse { chunks, .. } = reply else {
        panic!("an SSE reply")
    };
    chunks
        .iter()
        .flat_map(|c| {
            String::from_utf8_lossy(c)
                .lines()
                .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
                .collect::<Vec<_>>()
        })
        .map(|d| serde_json::from_str(&d).unwrap())
        .collect()
}

/// The exchanges recorded as failed or partial.
pub fn failed_exchanges(h: &Harness) -> i64 {
    let sql = "SELECT count(*) FROM exchanges WHERE error IS NOT NULL OR partial = 1";
    number(&*h.sql(), sql)
}

/// After an answer that broke off (its `error` event read): the socket
/// takes the next response, and the broken one is recorded as failed,
/// once.
pub async fn next_response_after_a_break(h: &Harness, ws: &mut Ws) {
    h.wait_exchanges(1).await;
    h.fake.push(streamed(&["fine"]));
    send(ws, &create("turn two", None)).await;
    let events = response_events(ws).await;
    assert_eq!(
        events.last().unwrap()["type"],
        "response.completed",
        "{events:?}"
    );
    h.wait_exchanges(2).await;
    assert_eq!(number(&*h.sql(), "SELECT count(*) FROM exchanges"), 2);
    assert_eq!(
        failed_exchanges(h),
        1,
        "the broken answer is recorded as failed, once"
    );
}
