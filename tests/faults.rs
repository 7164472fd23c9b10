//! Bad input and faults: each gets a clear OpenAI-style error (or the
//! upstream's own answer), nothing leaks the credential, the process keeps
//! serving, and the exchange is recorded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use compactor::fake_upstream::{chat_stream_events, Reply};
use serde_json::{json, Value};
use support::{client, post, post_raw, raw_upstream, read_request, stream_chat, within, Harness};

const KEY: &str = "sk-test-SECRET-never-echo-42";

fn error_of(body: &[u8]) -> Value {
    let v: Value = serde_json::from_slice(body).expect("error body is JSON");
    let e = v.get("error").expect("has error").clone();
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string() && e["code"].is_string(), "{v}");
    assert!(
        !String::from_utf8_lossy(body).contains(KEY),
        "credential echoed: {v}"
    );
    e
}

/// Each bad body gets the code OpenAI gives it: `invalid_json` only for a
/// body that is not JSON; a body of the wrong shape says which field
/// (`param`) and how (`missing_required_parameter`, `invalid_type`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_get_openai_codes_and_the_field_at_fault() {
    let h = Harness::start().await;
    let cases: Vec<(&str, &[u8], &str, Value)> = vec![
        (
            "chat/completions",
            b"{not json",
            "invalid_json",
            Value::Null,
        ),
        ("chat/completions", b"[1,2]", "invalid_type", Value::Null),
        (
            "chat/completions",
            br#"{"model":"m"}"#,
            "missing_required_parameter",
            json!("messages"),
        ),
        (
            "chat/completions",
            br#"{"model":"m","messages":"hi"}"#,
            "invalid_type",
            json!("messages"),
        ),
        (
            "chat/completions",
            br#"{"model":"m","messages":[{"role":"user","content":"a"},1]}"#,
            "invalid_type",
            json!("messages[1]"),
        ),
        (
            "chat/completions",
            br#"{"model":7,"messages":[]}"#,
            "invalid_type",
            json!("model"),
        ),
        (
            "chat/completions",
            br#"{"model":"m","stream":"yes","messages":[]}"#,
            "invalid_type",
            json!("stream"),
        ),
        (
            "responses",
            br#"{"input":42}"#,
            "invalid_type",
            json!("input"),
        ),
        (
            "responses",
            br#"{"input":[1]}"#,
            "invalid_type",
            json!("input[0]"),
        ),
        (
            "responses",
            br#"{"input":"q","instructions":3}"#,
            "invalid_type",
            json!("instructions"),
        ),
    ];
    for (path, body, code, param) in cases {
        let (status, _, resp) = post_raw(&format!("{}/{path}", h.url()), KEY, body.to_vec()).await;
        let shown = String::from_utf8_lossy(body);
        assert_eq!(status, 400, "{shown}");
        let e = error_of(&resp);
        assert_eq!(e["type"], "invalid_request_error", "{shown}: {e}");
        assert_eq!(e["code"], code, "{shown}: {e}");
        assert_eq!(e["param"], param, "{shown}: {e}");
    }
    assert_eq!(h.fake.count(), 0, "nothing malformed went upstream");
    still_serving(&h).await;
}

async fn still_serving(h: &Harness) {
    let resp = within(client().get(format!("http://{}/healthz", h.addr)).send())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let (status, _, _) = post(
        &format!("{}/chat/completions", h.url()),
        KEY,
        &json!({"model": "m", "messages": [{"role": "user", "content": "still there?"}]}),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_mistyped_bodies_get_400_naming_the_problem() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "not valid JSON"),
        (b"[1,2]".to_vec(), "JSON object"),
        (br#"{"model":"m"}"#.to_vec(), "messages"),
        (
            br#"{"model":"m","messages":"hi"}"#.to_vec(),
            "`messages` must be an array",
        ),
        (br#"{"model":"m","messages":[1]}"#.to_vec(), "messages[0]"),
        (
            br#"{"model":7,"messages":[]}"#.to_vec(),
            "`model` must be a string",
        ),
        (
            br#"{"model":"m","stream":"yes","messages":[]}"#.to_vec(),
            "`stream`",
        ),
    ];
    for (body, needle) in cases {
        let (status, headers, resp) = post_raw(&url, KEY, body.clone()).await;
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
        assert_eq!(headers.get("content-type").unwrap(), "application/json");
        let e = error_of(&resp);
        assert_eq!(e["type"], "invalid_request_error");
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{e} should mention {needle}"
        );
    }
    let (status, _, resp) = post_raw(
        &format!("{}/responses", h.url()),
        KEY,
        br#"{"input":42}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 400);
    assert!(error_of(&resp)["message"]
        .as_str()
        .unwrap()
        .contains("input"));
    assert_eq!(h.fake.count(), 0, "nothing malformed went upstream");
    still_serving(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413() {
    let h = Harness::start_with(|c| c.server.max_body_bytes = 10_000).await;
    let big = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(20_000)}]});
    let (status, _, resp) = post(&format!("{}/chat/completions", h.url()), KEY, &big).await;
    assert_eq!(status, 413);
    assert_eq!(error_of(&resp)["code"], "request_too_large");
    // Without a content-length (chunked upload) the limit holds too.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        vec![Ok(vec![b' '; 6000]), Ok(vec![b' '; 6000])];
    let resp = within(
        client()
            .post(format!("{}/responses", h.url()))
            .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
                chunks,
            )))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 413);
    assert_eq!(h.fake.count(), 0);
    still_serving(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_endpoints_get_404() {
    let h = Harness::start().await;
    let resp = within(client().get(format!("http://{}/nope", h.addr)).send())
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body = within(resp.bytes()).await.unwrap();
    assert_eq!(error_of(&body)["code"], "unknown_url");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_errors_pass_through_verbatim_and_are_recorded() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let req = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let overflow = Reply::context_length_exceeded();
    let Reply::Full { body: expected, .. } = overflow.clone() else {
        unreachable!()
    };
    h.fake.push(overflow);
    let (status, headers, body) = post(&url, KEY, &req).await;
    assert_eq!(status, 400);
    assert_eq!(body, expected);
    assert!(headers.get("x-compactor-conversation").is_some());

    h.fake.push(Reply::Full {
        status: 503,
        headers: vec![
            ("content-type".into(), "text/plain".into()),
            ("retry-after".into(), "7".into()),
        ],
        body: "overloaded".into(),
    });
    let (status, headers, body) = post(&url, KEY, &req).await;
    assert_eq!(status, 503);
    assert_eq!(headers.get("retry-after").unwrap(), "7");
    assert_eq!(&body[..], b"overloaded");
    // A stream request answered with an error is relayed as is, too.
    h.fake.push(Reply::json(429, json!({"error": {"message": "slow down", "type": "rate_limit", "code": "rate_limit_exceeded"}})));
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let (status, _, body) = post(&url, KEY, &sreq).await;
    assert_eq!(status, 429);
    assert!(String::from_utf8_lossy(&body).contains("slow down"));

    let statuses: Vec<(i64, Option<String>)> = h
        .db()
        .prepare("SELECT status, error FROM exchanges ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        statuses.iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![400, 503, 429]
    );
    assert!(statuses[0]
        .1
        .as_deref()
        .unwrap()
        .contains("context_length_exceeded"));
    still_serving(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_upstream_gives_502() {
    // Nothing listens there.
    let (port, _dead) = support::dead_port();
    let h =
        Harness::start_with(|c| c.upstream.base_url = format!("http://127.0.0.1:{port}/v1")).await;
    chat_gets_a_recorded_502(&h).await;
    let resp = within(client().get(format!("{}/models", h.url())).send())
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
}

/// A chat request gets the proxy's 502 `upstream_unreachable`, and its
/// exchange is recorded with that status.
async fn chat_gets_a_recorded_502(h: &Harness) {
    let (status, _, body) = post(
        &format!("{}/chat/completions", h.url()),
        KEY,
        &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 502);
    assert_eq!(error_of(&body)["code"], "upstream_unreachable");
    h.wait_exchanges(1).await;
    let recorded: i64 = h
        .db()
        .query_row("SELECT status FROM exchanges", [], |r| r.get(0))
        .unwrap();
    assert_eq!(recorded, 502);
}

async fn answer_chat(s: &mut tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = compactor::fake_upstream::chat_body("answered", 3, 1).to_string();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(format!("{head}{body}").as_bytes())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_an_upstream_read_on_a_new_connection_and_dropped_is_not_sent_again() {
    // Every connection: read the request, then close without a byte of
    // answer; the first with a FIN, the next with a reset.
    let (url, requests) = raw_upstream(|n, mut s, requests| async move {
        let mut buf = Vec::new();
        if read_request(&mut s, &mut buf).await.is_some() {
            requests.fetch_add(1, Ordering::SeqCst);
            if n % 2 == 1 {
                let _ = s.set_zero_linger();
            }
        }
    })
    .await;
    let h = Harness::start_with(|c| c.upstream.base_url = url).await;
    for (i, how) in ["closed", "reset"].iter().enumerate() {
        let (status, _, body) = post(
            &format!("{}/chat/completions", h.url()),
            KEY,
            &json!({"model": "m", "messages": [{"role": "user", "content": "once"}]}),
        )
        .await;
        assert_eq!(status, 502, "{how}: {}", String::from_utf8_lossy(&body));
        assert_eq!(error_of(&body)["code"], "upstream_unreachable");
        // A second attempt would have come before the client's answer.
        assert_eq!(
            requests.load(Ordering::SeqCst),
            i + 1,
            "{how}: the upstream got the request once"
        );
    }
}

/// An upstream whose first connection answers one request, then reads the
/// next and closes (as a server does that closes idle connections: the
/// request crossed its close); later connections answer. Runs `turn` twice
/// through a proxy in front of it and checks the second request was sent
/// again on a new connection.
async fn pooled_connection_closed_under<F, Fut>(turn: F)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = (u16, bytes::Bytes)>,
{
    let (url, requests) = raw_upstream(|n, mut s, requests| async move {
        let mut buf = Vec::new();
        while read_request(&mut s, &mut buf).await.is_some() {
            let seen = requests.fetch_add(1, Ordering::SeqCst);
            if n == 0 && seen == 1 {
                return;
            }
            answer_chat(&mut s).await;
        }
    })
    .await;
    let h = Harness::start_with(|c| c.upstream.base_url = url).await;
    for which in ["first", "second"] {
        let (status, body) = turn(h.url()).await;
        assert_eq!(status, 200, "{which}: {}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "answered");
    }
    assert_eq!(
        requests.load(Ordering::SeqCst),
        3,
        "the second request, again on a new connection"
    );
}

/// [`pooled_connection_closed_under`] with a POST of `body` to `path`.
async fn post_where_a_pooled_connection_is_closed_under(path: &str, body: Value) {
    pooled_connection_closed_under(|url| {
        let (url, body) = (format!("{url}{path}"), body.clone());
        async move {
            let (status, _, answer) = post(&url, KEY, &body).await;
            (status, answer)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_a_pooled_connection_the_upstream_closed_is_sent_again() {
    post_where_a_pooled_connection_is_closed_under(
        "/chat/completions",
        json!({"model": "m", "messages": [{"role": "user", "content": "again"}]}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_passthrough_post_on_a_pooled_connection_the_upstream_closed_is_sent_again() {
    post_where_a_pooled_connection_is_closed_under(
        "/embeddings",
        json!({"model": "e", "input": "again"}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passthrough_get_on_a_pooled_connection_the_upstream_closed_is_sent_again() {
    pooled_connection_closed_under(|url| async move {
        let resp = within(
            client()
                .get(format!("{url}/models"))
                .bearer_auth(KEY)
                .send(),
        )
        .await
        .unwrap();
        let status = resp.status().as_u16();
        (status, within(resp.bytes()).await.unwrap())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_upstream_gives_504_and_the_proxy_keeps_serving() {
    let h = Harness::start_with(|c| c.upstream.response_timeout_secs = 1).await;
    h.fake.push(Reply::Delay(
        Duration::from_secs(3),
        Box::new(Reply::chat("late", 1, 1)),
    ));
    let (status, _, body) = post(
        &format!("{}/chat/completions", h.url()),
        KEY,
        &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 504);
    assert_eq!(error_of(&body)["code"], "upstream_timeout");
    still_serving(&h).await;
}

/// Checks a raw HTTP answer: its status, and an OpenAI-style error body
/// with `code`.
fn assert_raw_error(answer: &str, status: u16, code: &str) {
    assert!(
        answer.starts_with(&format!("HTTP/1.1 {status} ")),
        "{answer:.300}"
    );
    let body = &answer[answer.find("\r\n\r\n").expect("a whole head") + 4..];
    assert_eq!(error_of(body.as_bytes())["code"], code, "{body}");
}

/// Sends `head` and then `parts` of a body on a raw connection, pausing
/// `pause` before each part, and returns the whole answer and how long after
/// the last part it came.
async fn upload_in_parts(
    h: &Harness,
    head: &str,
    parts: &[&[u8]],
    pause: Duration,
) -> (String, Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = within(tokio::net::TcpStream::connect(h.addr))
        .await
        .unwrap();
    within(s.write_all(head.as_bytes())).await.unwrap();
    for part in parts {
        tokio::time::sleep(pause).await;
        within(s.write_all(part)).await.unwrap();
    }
    let sent = std::time::Instant::now();
    let mut answer = Vec::new();
    let _ = within(s.read_to_end(&mut answer)).await;
    (
        String::from_utf8_lossy(&answer).into_owned(),
        sent.elapsed(),
    )
}

/// An upload to a path the proxy streams through (a large file, say) gets
/// the same 408 as a body the proxy reads, when the client stops sending
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_sending_a_streamed_upload_gets_a_408() {
    let h = Harness::start_with(|c| c.server.body_read_timeout_secs = 1).await;
    // Over the size the proxy reads before sending, so it streams.
    let head = "POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: 3000000\r\n\r\n";
    let part = vec![b'x'; 64 * 1024];
    let (answer, waited) = upload_in_parts(&h, head, &[&part], Duration::ZERO).await;
    assert_raw_error(&answer, 408, "request_timeout");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "answered after {waited:?}"
    );
    // The upstream saw the request begin; its body never came whole.
    assert!(h.fake.received().iter().all(|r| r.body.len() < 3_000_000));
    still_serving(&h).await;
}

/// `upstream.response_timeout_secs` is the upstream's time to answer: a
/// streamed upload that takes longer than that to send still gets its
/// answer, and an upstream slow to answer once the upload is in still
/// gets a 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_timeout_of_a_streamed_upload_starts_when_it_is_sent() {
    let h = Harness::start_with(|c| {
        c.upstream.response_timeout_secs = 1;
        c.server.body_read_timeout_secs = 10;
    })
    .await;
    let size = 1536 * 1024;
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: {size}\r\nconnection: close\r\n\r\n"
    );
    let body = vec![b'y'; size];
    let thirds: Vec<&[u8]> = body.chunks(size / 3).collect();
    // Three pauses of 0.6 s: the upload lasts longer than the timeout.
    let (answer, _) = upload_in_parts(&h, &head, &thirds, Duration::from_millis(600)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:.300}");
    let got = h.fake.last().expect("the upstream got the upload");
    assert_eq!(got.path, "/v1/files");
    assert_eq!(got.body.len(), size);

    // Sent at once, answered after 3 s: 504 after the 1 s timeout.
    h.fake.push(Reply::Delay(
        Duration::from_secs(3),
        Box::new(Reply::json(200, json!({"id": "file-late"}))),
    ));
    let (answer, waited) = upload_in_parts(&h, &head, &[&body], Duration::ZERO).await;
    assert_raw_error(&answer, 504, "upstream_timeout");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(3),
        "answered after {waited:?}"
    );
    still_serving(&h).await;
}

/// An upstream that stops taking a streamed upload gets
/// `upstream.idle_timeout_secs` of it, then the client a 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_stops_taking_an_upload_gives_504() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Accepts the connection and never reads from it.
    let (url, _) = raw_upstream(|_, stream, _| async move {
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(stream);
    })
    .await;
    let h = Harness::start_with(move |c| {
        c.upstream.base_url = url.clone();
        c.upstream.idle_timeout_secs = 1;
    })
    .await;
    // More than the sockets on the way hold, so the upload stalls.
    let size: usize = 256 << 20;
    let s = within(tokio::net::TcpStream::connect(h.addr))
        .await
        .unwrap();
    let (mut rd, mut wr) = s.into_split();
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: {size}\r\n\r\n"
    );
    let writer = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await?;
        let piece = vec![b'z'; 1 << 20];
        for _ in 0..size >> 20 {
            wr.write_all(&piece).await?;
        }
        Ok::<_, std::io::Error>(())
    });
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    let _ = within(rd.read_to_end(&mut answer)).await;
    let waited = started.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert_raw_error(&answer, 504, "upstream_timeout");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "answered after {waited:?}"
    );
    assert!(
        within(writer).await.unwrap().is_err(),
        "the upload was cut off, not sent whole"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset_mid_stream_reaches_the_client_and_is_recorded_partial() {
    let h = Harness::start().await;
    let events = chat_stream_events(&["a", "b", "c", "d"], Some((9, 4)));
    // A gap lets the status line and first chunks leave before the reset,
    // after the first content chunk (a stream that breaks before any
    // output is the proxy's 502, as for the other APIs).
    h.fake.push(Reply::Sse {
        chunks: events.into_iter().map(Into::into).collect(),
        gap: Duration::from_millis(50),
        reset_after: Some(3),
    });
    let req = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
                     "messages": [{"role": "user", "content": "hi"}]});
    let resp = within(
        client()
            .post(format!("{}/chat/completions", h.url()))
            .json(&req)
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    // The body must end in an error, not look complete.
    assert!(
        within(resp.bytes()).await.is_err(),
        "a broken upstream stream must not look complete"
    );
    h.wait_exchanges(1).await;
    let (partial, error): (i64, Option<String>) = h
        .db()
        .query_row("SELECT partial, error FROM exchanges", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!(partial, 1);
    assert!(error.is_some());
    still_serving(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_broken_off_is_a_502_not_an_empty_relay() {
    let h = Harness::start().await;
    // A 500 whose body the upstream breaks off after its first chunk.
    h.fake.push(Reply::Status(
        500,
        Box::new(Reply::Sse {
            chunks: vec!["{\"error\": {\"message\": ".into(), "\"boom\"}}".into()],
            gap: Duration::ZERO,
            reset_after: Some(1),
        }),
    ));
    chat_gets_a_recorded_502(&h).await;
    still_serving(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_leaving_mid_stream_cancels_upstream_and_records_partial() {
    let h = Harness::start().await;
    let pieces: Vec<String> = (0..50).map(|i| format!("w{i} ")).collect();
    let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let events = chat_stream_events(&refs, Some((9, 50)));
    h.fake.push(Reply::Sse {
        chunks: events.into_iter().map(Into::into).collect(),
        gap: Duration::from_millis(100),
        reset_after: None,
    });
    let req = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "long answer"}]});
    let mut resp = within(
        client()
            .post(format!("{}/chat/completions", h.url()))
            .json(&req)
            .send(),
    )
    .await
    .unwrap();
    let _first = within(resp.chunk()).await.unwrap();
    let _second = within(resp.chunk()).await.unwrap();
    drop(resp);
    h.wait_exchanges(1).await;
    let (partial, error, content): (i64, String, String) = h
        .db()
        .query_row(
            "SELECT e.partial, e.error, i.body FROM exchanges e JOIN items i ON i.hash = substr(e.response_items, 1, 32)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(partial, 1);
    assert!(error.contains("client disconnected"), "{error}");
    assert!(
        content.contains("w0"),
        "what was relayed before the client left is kept: {content}"
    );
    still_serving(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_leaving_before_the_answer_cancels_upstream_and_is_recorded() {
    // An upstream that reads the request, never answers, and notes when
    // the proxy closes the connection.
    let closed = Arc::new(AtomicUsize::new(0));
    let noted = closed.clone();
    let (url, requests) = raw_upstream(move |_, mut s, requests| {
        let closed = noted.clone();
        async move {
            let mut buf = Vec::new();
            if read_request(&mut s, &mut buf).await.is_some() {
                requests.fetch_add(1, Ordering::SeqCst);
                if read_request(&mut s, &mut buf).await.is_none() {
                    closed.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    })
    .await;
    let h = Harness::start_with(|c| c.upstream.base_url = url).await;
    let req = json!({"model": "m", "messages": [{"role": "user", "content": "think it over"}]});
    let gave_up = within(
        client()
            .post(format!("{}/chat/completions", h.url()))
            .json(&req)
            .timeout(Duration::from_millis(500))
            .send(),
    )
    .await;
    assert!(gave_up.is_err(), "the client stops waiting first");
    h.wait_exchanges(1).await;
    let (status, error): (i64, String) = h
        .db()
        .query_row("SELECT status, error FROM exchanges", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!(status, 499);
    assert!(error.contains("before the answer"), "{error}");
    assert_eq!(requests.load(Ordering::SeqCst), 1);
    within(async {
        while closed.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let health = within(client().get(format!("http://{}/healthz", h.addr)).send())
        .await
        .unwrap();
    assert_eq!(health.status(), 200, "the proxy keeps serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_an_in_flight_stream() {
    let mut h = Harness::start().await;
    let events = chat_stream_events(&["x", "y", "z"], None);
    let mut resp = stream_chat(&h, events, Duration::from_millis(200), false).await;
    let first = within(resp.chunk()).await.unwrap().unwrap();
    assert!(!first.is_empty());
    let body = tokio::spawn(async move { within(resp.bytes()).await });
    h.stop().await;
    let rest = within(body)
        .await
        .unwrap()
        .expect("stream finished during shutdown");
    assert!(String::from_utf8_lossy(&rest).ends_with("data: [DONE]\n\n"));
    // After shutdown nothing accepts connections.
    assert!(
        within(client().get(format!("http://{}/healthz", h.addr)).send())
            .await
            .is_err()
    );
}

/// A client that starts a request and never finishes its headers is
/// disconnected after `server.header_read_timeout_secs`; with 0 it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let partial =
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n";

    let h = Harness::start_with(|c| c.server.header_read_timeout_secs = 1).await;
    let mut s = within(tokio::net::TcpStream::connect(h.addr))
        .await
        .unwrap();
    within(s.write_all(partial)).await.unwrap();
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    // The server closes the connection (whatever it writes first).
    let _ = within(s.read_to_end(&mut answer)).await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "closed after {waited:?}"
    );
    still_serving(&h).await;

    let h = Harness::start_with(|c| c.server.header_read_timeout_secs = 0).await;
    let mut s = within(tokio::net::TcpStream::connect(h.addr))
        .await
        .unwrap();
    within(s.write_all(partial)).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_millis(2500), s.read(&mut byte)).await;
    assert!(
        read.is_err(),
        "without a limit the connection stays open: {read:?}"
    );
    still_serving(&h).await;
}

/// A client that stops sending its body midway gets a 408 after
/// `server.body_read_timeout_secs`, and the proxy keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_sending_its_body_gets_a_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::start_with(|c| c.server.body_read_timeout_secs = 1).await;
    let mut s = within(tokio::net::TcpStream::connect(h.addr))
        .await
        .unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    within(s.write_all(head.as_bytes())).await.unwrap();
    within(s.write_all(br#"{"model": "m", "mess"#))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    let _ = within(s.read_to_end(&mut answer)).await;
    let waited = started.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let body: Value =
        serde_json::from_str(&answer[answer.find("\r\n\r\n").unwrap() + 4..]).unwrap();
    assert_eq!(body["error"]["code"], "request_timeout", "{body}");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "answered after {waited:?}"
    );
    assert_eq!(h.fake.count(), 0, "nothing went upstream");
    still_serving(&h).await;
}
