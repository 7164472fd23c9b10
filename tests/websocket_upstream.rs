//! A client's Responses WebSocket in front of an upstream that takes one
//! (`upstream.websocket = "auto"`): each `response.create` goes over one
//! upstream socket per client socket; the reactive compaction, the record
//! and the error relay work as over HTTP; an upstream that refuses the
//! upgrade is asked over HTTP with SSE, and remembered; the client cannot
//! tell. Through real sockets: a tokio-tungstenite client, the proxy, and
//! the scripted fake upstream in its WebSocket mode.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::config::UpstreamWebSocket;
use compactor::fake_upstream::Reply;
use serde_json::Value;
use support::responses::Session;
use support::websocket::{
    broken, connect, create, failed_exchanges, next_response_after_a_break, response_events, send,
    sse_data, streamed, Ws, WEBSOCKET_BETA,
};
use support::{
    captured_logs, compactions, last_client_call, number, small_window_foreground, store_text,
    Harness,
};

const KEY: &str = "sk-ws-upstream-key-0123456789";

/// The requests the fake received on `/v1/responses` (the client's: the
/// summary calls go to `/chat/completions`), over either transport.
fn responses_requests(h: &Harness) -> usize {
    h.fake
        .received()
        .iter()
        .filter(|r| r.path == "/v1/responses")
        .count()
}

/// Sends the session's next turn on `ws`; its events.
async fn turn(ws: &mut Ws, s: &mut Session) -> Vec<Value> {
    s.step();
    send(ws, &s.event()).await;
    response_events(ws).await
}

/// The fake answers `reply`; a `response.create` of `text` sent on `ws`
/// gets the reply's events, in order, whichever way the proxy asked.
async fn relayed(h: &Harness, ws: &mut Ws, reply: Reply, text: &str) {
    let expected = sse_data(&reply);
    h.fake.push(reply);
    send(ws, &create(text, None)).await;
    assert_eq!(response_events(ws).await, expected, "{text}");
}

fn completed(events: &[Value]) {
    assert_eq!(
        events.last().unwrap()["type"],
        "response.completed",
        "{events:?}"
    );
    assert!(events.iter().all(|e| e["type"] != "error"), "{events:?}");
}

fn is_summary(item: &Value) -> bool {
    item["content"]
        .as_str()
        .is_some_and(|t| t.starts_with("[compactor summary"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_goes_over_one_upstream_socket_and_an_overflow_on_it_is_compacted_and_retried(
) {
    let h = Harness::start_with(small_window_foreground).await;
    h.fake.take_websockets(true);
    let mut ws = connect(&h, KEY).await;
    let mut s = Session::new();
    for _ in 0..8 {
        completed(&turn(&mut ws, &mut s).await);
    }
    assert_eq!(compactions(&h), 0);
    // The upstream's "too long" comes as an `error` event before any other.
    h.fake.push(Reply::context_length_exceeded());
    completed(&turn(&mut ws, &mut s).await);
    assert_eq!(compactions(&h), 1);
    let reason: String = h
        .db()
        .query_row("SELECT reason FROM compactions", [], |r| r.get(0))
        .unwrap();
    assert!(reason.starts_with("overflow"), "{reason}");
    let calls: Vec<Value> = h
        .fake
        .received()
        .iter()
        .filter(|r| r.path == "/v1/responses")
        .map(|r| r.json())
        .collect();
    let (failed, retried) = (&calls[calls.len() - 2], &calls[calls.len() - 1]);
    let len = |v: &Value| v["input"].as_array().unwrap().len();
    assert_eq!(len(failed), s.input.len());
    assert!(len(retried) < len(failed), "the retry went compacted");
    assert!(retried["input"].as_array().unwrap().iter().any(is_summary));
    // The next turn goes compacted too, on the same socket.
    completed(&turn(&mut ws, &mut s).await);
    let sent = last_client_call(&h);
    assert!(sent["input"].as_array().unwrap().iter().any(is_summary));
    assert!(len(&sent) < s.input.len());
    assert_eq!(sent["instructions"], "Be precise.");
    // One upgrade; every request of the client's, the retry included,
    // went over it (8 turns, the refused one, its retry, one more).
    let (upgrades, refusals, over_socket) = h.fake.websockets();
    assert_eq!((upgrades, refusals), (1, 0));
    assert_eq!(over_socket, 11);
    assert_eq!(responses_requests(&h), over_socket, "none over HTTP");
    h.wait_exchanges(10).await;
    let sql = h.sql();
    assert_eq!(
        number(
            &*sql,
            "SELECT count(DISTINCT conversation_id) FROM exchanges"
        ),
        1
    );
    assert_eq!(
        failed_exchanges(&h),
        0,
        "the client never saw the overflow, nor does the record"
    );
}

/// What the client reads is the same whichever way the upstream was asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_refuses_the_upgrade_is_asked_over_http_and_the_refusal_is_remembered() {
    // The only test of this binary whose upstream refuses: its log line is
    // the one.
    let _ = captured_logs();
    let h = Harness::start().await;
    for socket in 0..2 {
        let mut ws = connect(&h, KEY).await;
        for n in 0..2 {
            let reply = streamed(&["over", " HTTP"]);
            relayed(&h, &mut ws, reply, &format!("socket {socket} turn {n}")).await;
        }
    }
    // One handshake tried, by the first response of the first socket.
    assert_eq!(h.fake.websockets(), (0, 1, 0));
    assert_eq!(responses_requests(&h), 4);
    let last = h.fake.last().unwrap();
    assert_eq!(last.method, http::Method::POST);
    assert!(
        last.headers.get("openai-beta").is_none(),
        "the WebSocket mode's beta is not asked over HTTP"
    );
    let logs = captured_logs();
    let said: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("takes no WebSocket"))
        .collect();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains("INFO"), "{said:?}");
}

/// A rate limit or a server error at the handshake is of the moment: that
/// response goes over HTTP, and the next asks for a WebSocket again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_refused_for_the_moment_is_not_remembered() {
    let h = Harness::start().await;
    h.fake.take_websockets(true);
    h.fake
        .refuse_next_websocket(http::StatusCode::TOO_MANY_REQUESTS);
    h.fake
        .refuse_next_websocket(http::StatusCode::SERVICE_UNAVAILABLE);
    let mut ws = connect(&h, KEY).await;
    for n in 0..3 {
        let reply = streamed(&["turn", &format!(" {n}")]);
        relayed(&h, &mut ws, reply, &format!("turn {n}")).await;
    }
    // Two refusals, each followed by the response over HTTP; the third
    // response went over the upstream's WebSocket.
    assert_eq!(h.fake.websockets(), (1, 2, 1));
    assert_eq!(responses_requests(&h), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_upstream_websocket_off_no_upgrade_is_tried() {
    let h = Harness::start_with(|c| c.upstream.websocket = UpstreamWebSocket::Off).await;
    h.fake.take_websockets(true);
    let mut ws = connect(&h, KEY).await;
    for n in 0..2 {
        send(&mut ws, &create(&format!("turn {n}"), None)).await;
        completed(&response_events(&mut ws).await);
    }
    assert_eq!(h.fake.websockets(), (0, 0, 0));
    assert_eq!(responses_requests(&h), 2);
}

/// The upstream socket closing mid-answer ends the answer as an HTTP
/// stream that broke off does: an `error` event, a record of the failure,
/// once; the next `response.create` goes on a new upstream socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_socket_closing_mid_answer_is_an_error_event_and_the_next_response_opens_another(
) {
    let h = Harness::start().await;
    h.fake.take_websockets(true);
    // Past the first output: the answer committed, and the client has
    // some of it.
    h.fake.push(broken(&["cut", " short", " here", " now"], 5));
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create("turn one", None)).await;
    let events = response_events(&mut ws).await;
    let e = events.last().unwrap();
    assert_eq!(e["type"], "error", "{events:?}");
    assert_eq!(e["status"], 502);
    assert!(
        events.len() > 1,
        "part of the answer came first: {events:?}"
    );
    next_response_after_a_break(&h, &mut ws).await;
    assert_eq!(h.fake.websockets(), (2, 0, 2), "a second upstream socket");
}

/// The client's key goes in the upstream socket's handshake, with the
/// WebSocket mode's beta; it reaches neither the record nor the logs, and
/// the socket closes with the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_key_reaches_the_upstream_handshake_and_never_the_record_or_logs() {
    let _ = captured_logs();
    let h = Harness::start().await;
    h.fake.take_websockets(true);
    let mut ws = connect(&h, KEY).await;
    for n in 0..2 {
        send(&mut ws, &create(&format!("turn {n}"), None)).await;
        completed(&response_events(&mut ws).await);
    }
    assert_eq!(h.fake.websockets(), (1, 0, 2));
    // The fake receives each request with its socket's handshake headers.
    let got = h.fake.last().unwrap();
    assert_eq!(got.headers["authorization"], format!("Bearer {KEY}"));
    assert_eq!(got.headers["openai-beta"], WEBSOCKET_BETA);
    assert!(got.headers.get("x-compactor-hop").is_some());
    assert_eq!(got.json()["input"][0]["content"], "turn 1");
    h.wait_exchanges(2).await;
    assert!(!store_text(&h).contains(KEY), "the key reached the store");
    assert!(!captured_logs().contains(KEY), "the key reached the logs");
    drop(ws);
}

/// Events larger than the upstream socket's read buffer, and answers far
/// larger together, arrive whole and in order, turn after turn on the one
/// socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_larger_than_the_upstream_sockets_read_buffer_arrive_whole() {
    let h = Harness::start().await;
    h.fake.take_websockets(true);
    let mut ws = connect(&h, KEY).await;
    for (n, size) in [100, 40_000, 100_000, 100].into_iter().enumerate() {
        let piece = "x".repeat(size);
        let reply = streamed(&[&piece, " and ", &piece]);
        relayed(&h, &mut ws, reply, &format!("turn {n}")).await;
    }
    assert_eq!(h.fake.websockets(), (1, 0, 4), "one upstream socket");
}
