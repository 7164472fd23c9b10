//! The Responses API over a WebSocket (`GET /v1/responses` upgraded), as
//! Codex speaks it, through real sockets: a tokio-tungstenite client
//! against the proxy in front of the scripted fake upstream, which takes
//! no WebSocket here, so it is asked over HTTP with SSE (an upstream that
//! takes one: `tests/websocket_upstream.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::fake_upstream::Reply;
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use support::websocket::{
    broken, connect, connect_to, create, next_event, next_response_after_a_break, response_events,
    send, sse_data, streamed, Ws,
};
use support::{client_calls, last_client_call, number, within, Harness};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;

const KEY: &str = "sk-ws-test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_create_streams_back_the_upstreams_events_and_is_recorded() {
    let h = Harness::start().await;
    let reply = streamed(&["Hello", " over", " a socket"]);
    let expected = sse_data(&reply);
    h.fake.push(reply);
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create("turn one", None)).await;
    let events = response_events(&mut ws).await;
    assert_eq!(events, expected, "each SSE event is one message, in order");
    // Upstream: a streamed POST /v1/responses, without the event's type and
    // without the socket's own headers.
    let sent = last_client_call(&h);
    assert_eq!(sent["stream"], true);
    assert!(sent.get("type").is_none(), "{sent}");
    assert_eq!(sent["input"][0]["content"], "turn one");
    let last = h.fake.last().unwrap();
    assert_eq!(last.method, http::Method::POST);
    assert_eq!(last.path, "/v1/responses");
    assert!(last.headers.get("sec-websocket-key").is_none());
    assert!(last.headers.get("upgrade").is_none());
    assert!(last.headers.get("openai-beta").is_none());
    assert_eq!(
        last.headers.get("authorization").unwrap(),
        &format!("Bearer {KEY}")
    );
    h.wait_exchanges(1).await;
    let metrics = h.scrape().await;
    assert!(
        metrics
            .contains(r#"compactor_requests_total{endpoint="responses_websocket",status="101"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics
            .contains(r#"compactor_requests_total{endpoint="responses_websocket",status="200"} 1"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_response_id_continues_on_the_socket_against_an_upstream_that_stores_nothing() {
    let h = Harness::start().await;
    h.fake.push(streamed(&["first answer"]));
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create("turn one", None)).await;
    let events = response_events(&mut ws).await;
    let done = events.last().unwrap();
    assert_eq!(done["type"], "response.completed");
    let id1 = done["response"]["id"].as_str().unwrap().to_string();
    let first_output = done["response"]["output"][0].clone();
    h.fake.push(streamed(&["second answer"]));
    send(&mut ws, &create("turn two", Some(&id1))).await;
    let events = response_events(&mut ws).await;
    assert_eq!(
        events.last().unwrap()["type"],
        "response.completed",
        "{events:?}"
    );
    let sent = last_client_call(&h);
    assert!(sent.get("previous_response_id").is_none(), "{sent}");
    let input = sent["input"].as_array().unwrap();
    assert_eq!(input.len(), 3, "{sent}");
    assert_eq!(
        input[0]["content"][0]["text"]
            .as_str()
            .or(input[0]["content"].as_str()),
        Some("turn one")
    );
    assert_eq!(input[1], first_output);
    h.wait_exchanges(2).await;
    let conversations = number(
        &*h.sql(),
        "SELECT count(DISTINCT conversation_id) FROM exchanges",
    );
    assert_eq!(conversations, 1, "both turns are one conversation");
    drop(ws);
    assert_eq!(client_calls(&h).len(), 2);
}

/// An answer that is an error status comes back as an `error` event with
/// the status and the upstream's error object, and the socket goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_is_an_error_event_and_the_socket_goes_on() {
    let h = Harness::start().await;
    h.fake.push(Reply::json(
        429,
        json!({"error": {"type": "rate_limit_exceeded", "code": "rate_limit_exceeded", "message": "slow down"}}),
    ));
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create("turn one", None)).await;
    let e = next_event(&mut ws).await;
    assert_eq!(e["type"], "error");
    assert_eq!(e["status"], 429);
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    h.fake.push(streamed(&["fine now"]));
    send(&mut ws, &create("turn two", None)).await;
    let events = response_events(&mut ws).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    let _ = within(ws.close(None)).await;
}

/// Codex's warm-up (`generate: false`) is answered by the proxy (an upstream
/// asked over HTTP would generate), and the response that continues it
/// goes upstream with the warm-up's input in front of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_up_is_answered_by_the_proxy_and_its_input_goes_with_the_next_response() {
    let h = Harness::start().await;
    let mut ws = connect(&h, KEY).await;
    let mut warm = create("context first", None);
    warm["generate"] = json!(false);
    send(&mut ws, &warm).await;
    let events = response_events(&mut ws).await;
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0]["type"], "response.created");
    let done = &events[1];
    assert_eq!(done["type"], "response.completed");
    assert_eq!(done["response"]["output"], json!([]));
    assert!(h.fake.received().is_empty(), "nothing went upstream");
    let warm_id = done["response"]["id"].as_str().unwrap().to_string();
    h.fake.push(streamed(&["answer"]));
    send(&mut ws, &create("then this", Some(&warm_id))).await;
    let events = response_events(&mut ws).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    let sent = last_client_call(&h);
    assert!(sent.get("previous_response_id").is_none(), "{sent}");
    assert!(sent.get("generate").is_none(), "{sent}");
    let texts: Vec<&str> = sent["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["content"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["context first", "then this"]);
}

/// A stream that sends its first two events and waits for `gate`.
fn gated(gate: &std::sync::Arc<tokio::sync::Notify>) -> Reply {
    let Reply::Sse { chunks, .. } = streamed(&["held", " back", " answer"]) else {
        unreachable!()
    };
    Reply::Gated {
        chunks,
        at: 2,
        gate: gate.clone(),
    }
}

/// What is not a `response.create` is refused with an `error` event and
/// the socket goes on: binary, not JSON, another type, and a second
/// `response.create` while one is under way (one response at a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_get_error_events_and_a_second_create_waits_its_turn() {
    let h = Harness::start().await;
    let mut ws = connect(&h, KEY).await;
    within(ws.send(Message::Binary(vec![1u8, 2, 3].into())))
        .await
        .unwrap();
    let e = next_event(&mut ws).await;
    assert_eq!(
        (e["type"].as_str(), e["error"]["code"].as_str()),
        (Some("error"), Some("unsupported_message"))
    );
    within(ws.send(Message::Text("{not json".into())))
        .await
        .unwrap();
    let e = next_event(&mut ws).await;
    assert_eq!(e["error"]["code"], "invalid_json", "{e}");
    assert_eq!(e["status"], 400);
    send(&mut ws, &json!({"type": "session.update"})).await;
    let e = next_event(&mut ws).await;
    assert_eq!(e["error"]["code"], "unsupported_event", "{e}");
    assert!(h.fake.received().is_empty());

    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    h.fake.push(gated(&gate));
    send(&mut ws, &create("first", None)).await;
    assert_eq!(next_event(&mut ws).await["type"], "response.created");
    send(&mut ws, &create("second", None)).await;
    let e = next_event(&mut ws).await;
    assert_eq!(e["type"], "response.in_progress", "the first goes on: {e}");
    let e = next_event(&mut ws).await;
    assert_eq!(e["error"]["code"], "response_in_progress", "{e}");
    gate.notify_one();
    let events = response_events(&mut ws).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    h.wait_exchanges(1).await;
    assert_eq!(client_calls(&h).len(), 1, "the second never went upstream");
}

/// A message over `server.max_body_bytes` closes the socket with 1009
/// after an `error` event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_size_limit_closes_the_socket() {
    let h = Harness::start_with(|c| c.server.max_body_bytes = 70_000).await;
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create(&"x".repeat(80_000), None)).await;
    let e = next_event(&mut ws).await;
    assert_eq!(e["error"]["code"], "message_too_large", "{e}");
    assert_eq!(e["status"], 413);
    match within(ws.next()).await {
        Some(Ok(Message::Close(Some(frame)))) => assert_eq!(frame.code, CloseCode::Size),
        other => panic!("expected a close frame, got {other:?}"),
    }
    assert!(h.fake.received().is_empty());
}

/// An upstream that breaks off mid-stream: an `error` event, the exchange
/// recorded once, as failed; the socket takes the next response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_breaks_off_is_an_error_event_recorded_once() {
    let h = Harness::start().await;
    h.fake.push(broken(&["cut", " short", " here"], 3));
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create("turn one", None)).await;
    let events = response_events(&mut ws).await;
    let e = events.last().unwrap();
    assert_eq!(e["type"], "error", "{events:?}");
    assert_eq!(e["status"], 502);
    next_response_after_a_break(&h, &mut ws).await;
}

/// A client that goes away mid-answer: the exchange is recorded as
/// partial, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_vanishes_mid_answer_leaves_a_partial_record() {
    let h = Harness::start().await;
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    h.fake.push(gated(&gate));
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create("turn one", None)).await;
    assert_eq!(next_event(&mut ws).await["type"], "response.created");
    drop(ws);
    h.wait_exchanges(1).await;
    gate.notify_one();
    let sql = h.sql();
    assert_eq!(number(&*sql, "SELECT count(*) FROM exchanges"), 1);
    assert_eq!(
        number(&*sql, "SELECT count(*) FROM exchanges WHERE partial = 1"),
        1
    );
}

/// A client that never reads: the proxy stops reading the upstream once
/// its writes wait, and drops the socket after the write limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_dropped_with_its_answer_partial() {
    let h = Harness::start_with(|c| c.upstream.idle_timeout_secs = 1).await;
    // ~8 MB of deltas: more than the socket buffers hold.
    let piece = "y".repeat(16_000);
    let pieces: Vec<&str> = std::iter::repeat_n(piece.as_str(), 500).collect();
    h.fake.push(streamed(&pieces));
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create("turn one", None)).await;
    // Never read; the record says the client went away.
    h.wait_exchanges(1).await;
    let sql = h.sql();
    assert_eq!(
        number(&*sql, "SELECT count(*) FROM exchanges WHERE partial = 1"),
        1
    );
    drop(ws);
}

/// Two keys over sockets, with byte-identical histories: two tenants, each
/// its own conversation; one's `previous_response_id` on the other's socket
/// (a response's, or a warm-up's) continues nothing of the other's and goes
/// upstream as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_keys_over_sockets_never_see_each_others_conversations() {
    const ALICE: &str = "sk-ws-alice-aaaaaaaaaaaa";
    const BOB: &str = "sk-ws-bob-bbbbbbbbbbbbbb";
    let h = Harness::start().await;
    let mut a = connect(&h, ALICE).await;
    let mut b = connect(&h, BOB).await;
    let mut ids = Vec::new();
    for ws in [&mut a, &mut b] {
        h.fake.push(streamed(&["the same answer"]));
        send(ws, &create("the same question", None)).await;
        let events = response_events(ws).await;
        let done = events.last().unwrap();
        assert_eq!(done["type"], "response.completed", "{events:?}");
        ids.push(done["response"]["id"].as_str().unwrap().to_string());
    }
    h.wait_exchanges(2).await;
    let sql = h.sql();
    assert_eq!(
        number(&*sql, "SELECT count(DISTINCT tenant) FROM exchanges"),
        2
    );
    assert_eq!(
        number(
            &*sql,
            "SELECT count(DISTINCT conversation_id) FROM exchanges"
        ),
        2,
        "identical histories under two keys are two conversations"
    );

    // Bob continues Alice's response: nothing of hers is put in front.
    h.fake.push(streamed(&["bob's"]));
    send(&mut b, &create("bob goes on", Some(&ids[0]))).await;
    let events = response_events(&mut b).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    let sent = last_client_call(&h);
    assert_eq!(sent["previous_response_id"], ids[0], "{sent}");
    assert_eq!(sent["input"].as_array().unwrap().len(), 1, "{sent}");
    assert!(
        !sent.to_string().contains("the same answer"),
        "nothing of another tenant's conversation: {sent}"
    );

    // Alice's warm-up id means nothing on Bob's socket.
    let mut warm = create("alice's context, private", None);
    warm["generate"] = json!(false);
    send(&mut a, &warm).await;
    let events = response_events(&mut a).await;
    let warm_id = events.last().unwrap()["response"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    h.fake.push(streamed(&["bob's again"]));
    send(&mut b, &create("bob again", Some(&warm_id))).await;
    let events = response_events(&mut b).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    let sent = last_client_call(&h);
    assert_eq!(sent["previous_response_id"], warm_id.as_str());
    assert!(!sent.to_string().contains("alice's context"), "{sent}");
    // Alice's own conversation goes on as hers alone.
    h.fake.push(streamed(&["alice's"]));
    send(&mut a, &create("alice goes on", Some(&ids[0]))).await;
    response_events(&mut a).await;
    let sent = last_client_call(&h);
    assert!(sent.get("previous_response_id").is_none(), "{sent}");
    assert_eq!(sent["input"].as_array().unwrap().len(), 3, "{sent}");
    assert!(!sent.to_string().contains("bob"), "{sent}");
    assert_eq!(
        last_client_request_key(&h),
        format!("Bearer {ALICE}"),
        "each request goes upstream with its own socket's key"
    );
}

/// The authorization header of the last request upstream.
fn last_client_request_key(h: &Harness) -> String {
    support::last_client_request(h)
        .headers
        .get("authorization")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string()
}

/// A socket holds its connection's slot: with `server.max_connections` at
/// 1, nothing else is served while it is open, and the next connection is
/// once it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_counts_against_the_connection_limit() {
    let h = Harness::start_with(|c| c.server.max_connections = 1).await;
    let mut ws = connect(&h, KEY).await;
    h.fake.push(streamed(&["still", " served"]));
    send(&mut ws, &create("turn one", None)).await;
    assert_eq!(
        response_events(&mut ws).await.last().unwrap()["type"],
        "response.completed"
    );
    let healthz = format!("http://{}/healthz", h.addr);
    let started = std::time::Instant::now();
    let waiting = tokio::spawn(async move {
        let resp = within(support::client().get(healthz).send()).await.unwrap();
        (resp.status(), started.elapsed())
    });
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    assert!(!waiting.is_finished(), "served beside an open socket");
    within(ws.close(None)).await.unwrap();
    let (status, waited) = within(waiting).await.unwrap();
    assert_eq!(status, 200);
    assert!(
        waited >= std::time::Duration::from_millis(800),
        "{waited:?}"
    );
}

/// The close frame a socket ends with (after any events), or None if the
/// connection ended without one.
async fn close_code(ws: &mut Ws) -> Option<CloseCode> {
    loop {
        match within(ws.next()).await {
            Some(Ok(Message::Close(frame))) => return frame.map(|f| f.code),
            Some(Ok(Message::Text(t))) => panic!("an event after the last response: {t}"),
            Some(Ok(_)) => continue,
            Some(Err(_)) | None => return None,
        }
    }
}

/// At shutdown an idle socket is closed with 1001 at once; one with a
/// response under way finishes it, its events all sent and the exchange
/// recorded whole, a `response.create` sent meanwhile refused with a 503,
/// then is closed with 1001; the server then stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_a_socket_finish_its_response_then_closes_it() {
    let mut h = Harness::start().await;
    let mut idle = connect(&h, KEY).await;
    let mut busy = connect(&h, KEY).await;
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let reply = streamed(&["held", " back", " answer"]);
    let expected = sse_data(&reply);
    let Reply::Sse { chunks, .. } = reply else {
        unreachable!()
    };
    let reply = Reply::Gated {
        chunks,
        at: 2,
        gate: gate.clone(),
    };
    h.fake.push(reply);
    send(&mut busy, &create("a long one", None)).await;
    let mut events = vec![next_event(&mut busy).await];
    assert_eq!(events[0]["type"], "response.created");
    let db = h.db.clone();
    let stopped = tokio::spawn(async move {
        h.stop().await;
        h
    });
    assert_eq!(close_code(&mut idle).await, Some(CloseCode::Away));
    events.push(next_event(&mut busy).await);
    send(&mut busy, &create("one more", None)).await;
    let refused = next_event(&mut busy).await;
    assert_eq!(refused["status"], 503, "{refused}");
    assert_eq!(refused["error"]["code"], "server_shutting_down");
    gate.notify_one();
    events.extend(response_events(&mut busy).await);
    assert_eq!(events, expected, "the whole response, in order");
    assert_eq!(close_code(&mut busy).await, Some(CloseCode::Away));
    let h = within(stopped).await.unwrap();
    assert_eq!(client_calls(&h).len(), 1, "the refused one went nowhere");
    let sql = h.sql();
    assert_eq!(number(&*sql, "SELECT count(*) FROM exchanges"), 1);
    assert_eq!(
        number(
            &*sql,
            "SELECT count(*) FROM exchanges WHERE partial = 0 AND error IS NULL"
        ),
        1,
        "recorded whole ({})",
        db.display()
    );
}

/// A socket still answering when the grace period is over: its answer is
/// dropped, recorded as partial because the proxy shut down, and the
/// socket closed with 1001, within the grace period and a little.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_answering_past_the_grace_period_is_cut_and_recorded() {
    let mut h = Harness::start_with(|c| c.server.shutdown_grace_secs = 1).await;
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    h.fake.push(gated(&gate));
    let mut ws = connect(&h, KEY).await;
    send(&mut ws, &create("never finishes", None)).await;
    assert_eq!(next_event(&mut ws).await["type"], "response.created");
    assert_eq!(next_event(&mut ws).await["type"], "response.in_progress");
    let started = std::time::Instant::now();
    h.stop().await;
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(4), "{took:?}");
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Away));
    let sql = h.sql();
    let errors: Vec<String> = support::column(
        &*sql,
        "SELECT error FROM exchanges WHERE partial = 1 AND error IS NOT NULL",
    );
    assert_eq!(errors.len(), 1, "recorded once, as partial");
    assert!(errors[0].contains("shut down"), "{errors:?}");
    gate.notify_one();
}

/// The real binary, stopped by SIGTERM while a socket's response is under
/// way: the response finishes, the socket is closed with 1001, the process
/// exits, and the store holds the exchange whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_finishes_a_sockets_response_at_shutdown() {
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .unwrap();
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    fake.push(gated(&gate));
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let config = dir.path().join("proxy.toml");
    // No window discovery: its `GET /v1/models` would take the scripted
    // stream meant for the socket's response.
    std::fs::write(
        &config,
        format!(
            "[server]\nshutdown_grace_secs = 10\n[upstream]\nbase_url = \"{}\"\n\
             discover_windows = false\n[store]\npath = \"{}\"\n",
            fake.url(),
            db.display()
        ),
    )
    .unwrap();
    let port = support::free_port();
    let args = [
        std::ffi::OsString::from("--config"),
        config.into_os_string(),
    ];
    let mut child = within(tokio::task::spawn_blocking(move || {
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        support::spawn_binary(port, &args)
    }))
    .await
    .unwrap();
    let addr = ([127, 0, 0, 1], port).into();
    let mut idle = connect_to(addr, KEY).await;
    let mut ws = connect_to(addr, KEY).await;
    send(&mut ws, &create("finish me", None)).await;
    assert_eq!(next_event(&mut ws).await["type"], "response.created");
    assert_eq!(next_event(&mut ws).await["type"], "response.in_progress");
    let term = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    // Draining (the idle socket closed at once): the busy one still
    // answers, refusing a new response.
    assert_eq!(close_code(&mut idle).await, Some(CloseCode::Away));
    send(&mut ws, &create("one more", None)).await;
    assert_eq!(next_event(&mut ws).await["status"], 503);
    gate.notify_one();
    let events = response_events(&mut ws).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Away));
    let status = within(async {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(status.success(), "{status:?}");
    let conn =
        rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    let (count, whole): (i64, i64) = conn
        .query_row(
            "SELECT count(*), sum(partial = 0 AND error IS NULL) FROM exchanges",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((count, whole), (1, 1), "recorded once, whole");
}
