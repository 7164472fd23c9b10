//! The real tier: compactor in front of a real llama.cpp server
//! (SmolLM2-135M, 2048-token context) started by `scripts/test`, which
//! exports its base URL as `COMPACTOR_LLAMA_URL`.
//!
//! Every test is `#[ignore]`d so a bare `cargo test` stays offline; the
//! project's test command runs them with `--include-ignored`. Generations are
//! kept to a few tokens so each step fits the harness' 20 s cap on 2 cores.

mod support;

use serde_json::{json, Value};
use support::{post, within, Harness};

const CONVERSATION: &str = "x-compactor-conversation";
const KEY: &str = "sk-real-upstream-test";

/// The llama-server base URL (with `/v1`), or a panic saying how to get one.
fn llama_url() -> String {
    match std::env::var("COMPACTOR_LLAMA_URL") {
        Ok(u) if !u.trim().is_empty() => u.trim().trim_end_matches('/').to_string(),
        _ => panic!(
            "COMPACTOR_LLAMA_URL is not set: these tests need a real llama-server. \
             Run `scripts/test` (it starts one and sets the variable), or start one with \
             `scripts/llama-server.sh start 18931 2048` and export \
             COMPACTOR_LLAMA_URL=http://127.0.0.1:18931/v1"
        ),
    }
}

/// A proxy whose upstream is the real llama-server.
async fn proxy() -> Harness {
    let url = llama_url();
    within(Harness::start_with(move |c| c.upstream.base_url = url)).await
}

/// One stored exchange: the columns these tests check.
#[derive(Debug)]
struct Row {
    id: i64,
    conversation: String,
    endpoint: String,
    input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    status: i64,
    streamed: bool,
    partial: bool,
    response_id: Option<String>,
}

/// All exchanges in the store, oldest first (read right after the response:
/// the record is committed before the answer is released).
fn rows(h: &Harness) -> Vec<Row> {
    let db = h.db();
    let mut stmt = db
        .prepare(
            "SELECT id, conversation_id, endpoint, input_tokens, output_tokens, status,
                    streamed, partial, response_id
             FROM exchanges ORDER BY id",
        )
        .expect("prepare");
    stmt.query_map([], |r| {
        Ok(Row {
            id: r.get(0)?,
            conversation: r.get(1)?,
            endpoint: r.get(2)?,
            input_tokens: r.get(3)?,
            output_tokens: r.get(4)?,
            status: r.get(5)?,
            streamed: r.get::<_, i64>(6)? != 0,
            partial: r.get::<_, i64>(7)? != 0,
            response_id: r.get(8)?,
        })
    })
    .expect("query")
    .collect::<Result<_, _>>()
    .expect("rows")
}

fn header(headers: &http::HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .unwrap_or_else(|| panic!("response has no {name} header: {headers:?}"))
        .to_str()
        .expect("ascii header")
        .to_string()
}

fn json_of(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(body)))
}

/// SSE events as (event name, data), in order.
fn sse(body: &[u8]) -> Vec<(Option<String>, String)> {
    let text = std::str::from_utf8(body)
        .expect("utf-8 stream")
        .replace("\r\n", "\n");
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut event = None;
        let mut data: Vec<&str> = Vec::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                event = Some(v.trim().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if event.is_some() || !data.is_empty() {
            out.push((event, data.join("\n")));
        }
    }
    out
}

fn chat_body(content: &str, max_tokens: u64) -> Value {
    json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    })
}

/// Asserts the stored usage equals `(input, output)` reported to the client.
fn assert_usage(row: &Row, input: &Value, output: &Value) {
    let (i, o) = (input.as_i64(), output.as_i64());
    assert!(
        i.is_some_and(|i| i > 0),
        "client usage has no input tokens: {input}"
    );
    assert!(
        o.is_some_and(|o| o > 0),
        "client usage has no output tokens: {output}"
    );
    assert_eq!(
        (row.input_tokens, row.output_tokens),
        (i, o),
        "recorded usage differs from the usage the client received: {row:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn chat_json_usage_matches_the_record() {
    let mut h = proxy().await;
    let (status, headers, body) = post(
        &format!("{}/chat/completions", h.url()),
        KEY,
        &chat_body("Say hello.", 12),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v = json_of(&body);
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant", "no assistant message: {v}");
    assert!(
        msg["content"].as_str().is_some_and(|c| !c.is_empty()),
        "empty content: {v}"
    );
    let conv = header(&headers, CONVERSATION);

    let rows = rows(&h);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(
        (r.status, r.streamed, r.partial),
        (200, false, false),
        "{r:?}"
    );
    assert!(r.endpoint.ends_with("chat/completions"), "{r:?}");
    assert_eq!(r.conversation, conv);
    assert_usage(
        r,
        &v["usage"]["prompt_tokens"],
        &v["usage"]["completion_tokens"],
    );
    assert!(
        r.output_tokens.unwrap() <= 12,
        "max_tokens not honoured: {r:?}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn chat_stream_hides_usage_the_client_did_not_ask_for() {
    let mut h = proxy().await;
    let url = format!("{}/chat/completions", h.url());

    // 1. No stream_options: the proxy asks upstream for usage and hides it.
    let mut req = chat_body("Count to three.", 8);
    req["stream"] = json!(true);
    let (status, headers, body) = post(&url, KEY, &req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let ct = header(&headers, "content-type");
    assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
    header(&headers, CONVERSATION);
    let events = sse(&body);
    assert!(
        events.len() >= 3,
        "too few events: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(
        events.last().unwrap().1,
        "[DONE]",
        "stream does not end with [DONE]"
    );
    let mut content = String::new();
    for (_, data) in &events[..events.len() - 1] {
        let chunk = json_of(data.as_bytes());
        assert!(
            chunk.get("usage").is_none(),
            "client did not ask for usage but a chunk carries a usage key: {data}"
        );
        let choices = chunk["choices"]
            .as_array()
            .unwrap_or_else(|| panic!("no choices: {data}"));
        assert!(
            !choices.is_empty(),
            "usage-only chunk (empty choices) reached the client: {data}"
        );
        if let Some(c) = choices[0]["delta"]["content"].as_str() {
            content.push_str(c);
        }
    }
    assert!(!content.is_empty(), "no content streamed");
    assert!(
        !String::from_utf8_lossy(&body).contains("\"usage\""),
        "usage leaked"
    );
    let rows1 = rows(&h);
    assert_eq!(rows1.len(), 1, "{rows1:?}");
    let r = &rows1[0];
    assert_eq!(
        (r.status, r.streamed, r.partial),
        (200, true, false),
        "{r:?}"
    );
    assert!(
        r.input_tokens.is_some_and(|t| t > 0)
            && r.output_tokens.is_some_and(|t| (1..=8).contains(&t)),
        "hidden usage was not recorded: {r:?}"
    );

    // 2. The client asks for usage: it gets the usage chunk, equal to the record.
    let mut req = chat_body("Count to three.", 8);
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let (status, _, body) = post(&url, KEY, &req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let events = sse(&body);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let usage_chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| json_of(d.as_bytes()))
        .filter(|c| c.get("usage").is_some_and(|u| u.is_object()))
        .collect();
    assert_eq!(
        usage_chunks.len(),
        1,
        "expected one usage chunk: {}",
        String::from_utf8_lossy(&body)
    );
    let u = &usage_chunks[0];
    assert_eq!(
        u["choices"],
        json!([]),
        "usage chunk should have empty choices: {u}"
    );
    let rows2 = rows(&h);
    assert_eq!(rows2.len(), 2, "{rows2:?}");
    let r = &rows2[1];
    assert_eq!(
        (r.status, r.streamed, r.partial),
        (200, true, false),
        "{r:?}"
    );
    assert_usage(
        r,
        &u["usage"]["prompt_tokens"],
        &u["usage"]["completion_tokens"],
    );
    // Same prompt both times: the hidden usage counted the same input.
    assert_eq!(rows2[0].input_tokens, r.input_tokens, "{rows2:?}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn responses_json_usage_matches_the_record() {
    let mut h = proxy().await;
    let req = json!({"model": "smollm2", "input": "Say hello.", "max_output_tokens": 12});
    let (status, headers, body) = post(&format!("{}/responses", h.url()), KEY, &req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v = json_of(&body);
    assert_eq!(v["object"], "response", "{v}");
    let out = v["output"]
        .as_array()
        .unwrap_or_else(|| panic!("no output: {v}"));
    assert!(
        out.iter()
            .any(|i| i["type"] == "message" && i["role"] == "assistant"),
        "no assistant message in output: {v}"
    );
    let conv = header(&headers, CONVERSATION);

    let rows = rows(&h);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(
        (r.status, r.streamed, r.partial),
        (200, false, false),
        "{r:?}"
    );
    assert_eq!(r.conversation, conv);
    assert!(r.endpoint.ends_with("responses"), "{r:?}");
    assert_eq!(
        r.response_id.as_deref(),
        v["id"].as_str(),
        "response id not recorded: {r:?}"
    );
    assert_usage(r, &v["usage"]["input_tokens"], &v["usage"]["output_tokens"]);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn responses_stream_usage_matches_the_completed_event() {
    let mut h = proxy().await;
    let req = json!({
        "model": "smollm2",
        "input": [{"role": "user", "content": "Say hello."}],
        "max_output_tokens": 8,
        "stream": true,
    });
    let (status, headers, body) = post(&format!("{}/responses", h.url()), KEY, &req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let ct = header(&headers, "content-type");
    assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
    let conv = header(&headers, CONVERSATION);
    let events = sse(&body);
    assert!(
        events
            .iter()
            .any(|(e, _)| e.as_deref() == Some("response.output_text.delta")),
        "no text deltas: {}",
        String::from_utf8_lossy(&body)
    );
    let (name, data) = events.last().expect("events");
    assert_eq!(
        name.as_deref(),
        Some("response.completed"),
        "last event: {name:?} {data}"
    );
    let completed = json_of(data.as_bytes());
    let resp = &completed["response"];
    assert_eq!(resp["status"], "completed", "{completed}");

    let rows = rows(&h);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(
        (r.status, r.streamed, r.partial),
        (200, true, false),
        "{r:?}"
    );
    assert_eq!(r.conversation, conv);
    assert_eq!(
        r.response_id.as_deref(),
        resp["id"].as_str(),
        "response id not recorded: {r:?}"
    );
    assert_usage(
        r,
        &resp["usage"]["input_tokens"],
        &resp["usage"]["output_tokens"],
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn over_long_prompt_gets_the_upstream_400_verbatim() {
    let mut h = proxy().await;
    // One user message of 3000 words (far over the 2048-token window). It is
    // the latest user message, so no compaction may shorten it: the upstream's
    // refusal must reach the client as is.
    let words: Vec<String> = (0..3000).map(|i| format!("word{i}")).collect();
    let req = chat_body(&words.join(" "), 8);

    // What the client would get going direct.
    let direct = within(
        support::client()
            .post(format!("{}/chat/completions", llama_url()))
            .header("authorization", format!("Bearer {KEY}"))
            .json(&req)
            .send(),
    )
    .await
    .expect("direct request");
    let direct_status = direct.status().as_u16();
    let direct_body = within(direct.bytes()).await.expect("direct body");
    assert_eq!(direct_status, 400, "upstream accepted an over-long prompt?");

    let (status, headers, body) = post(&format!("{}/chat/completions", h.url()), KEY, &req).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    let v = json_of(&body);
    assert_eq!(v["error"]["type"], "exceed_context_size_error", "{v}");
    assert_eq!(
        String::from_utf8_lossy(&body),
        String::from_utf8_lossy(&direct_body),
        "the upstream's error body was not passed through verbatim"
    );
    let conv = header(&headers, CONVERSATION);

    let rows = rows(&h);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(r.conversation, conv);
    assert_eq!((r.input_tokens, r.output_tokens), (None, None), "{r:?}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn two_turns_land_in_one_conversation() {
    let mut h = proxy().await;
    let url = format!("{}/chat/completions", h.url());
    let user1 = json!({"role": "user", "content": "My name is Ada. Say hello."});
    let req1 = json!({"model": "smollm2", "messages": [user1], "max_tokens": 12});
    let (s1, h1, b1) = post(&url, KEY, &req1).await;
    assert_eq!(s1, 200, "{}", String::from_utf8_lossy(&b1));
    let answer = json_of(&b1)["choices"][0]["message"].clone();
    assert!(answer.is_object(), "no message in turn 1");
    let conv1 = header(&h1, CONVERSATION);

    // Turn 2 resends turn 1 and the assistant's answer as received.
    let req2 = json!({
        "model": "smollm2",
        "messages": [user1, answer, {"role": "user", "content": "What is my name?"}],
        "max_tokens": 12,
    });
    let (s2, h2, b2) = post(&url, KEY, &req2).await;
    assert_eq!(s2, 200, "{}", String::from_utf8_lossy(&b2));
    let conv2 = header(&h2, CONVERSATION);
    assert_eq!(
        conv1, conv2,
        "turn 2 was not recognised as continuing turn 1"
    );

    // A different conversation gets a different id (the header is not constant).
    let other = json!({"model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4});
    let (s3, h3, _) = post(&url, KEY, &other).await;
    assert_eq!(s3, 200);
    let conv3 = header(&h3, CONVERSATION);
    assert_ne!(conv3, conv1, "an unrelated request joined the conversation");

    let rows = rows(&h);
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(rows[0].conversation, conv1, "{rows:?}");
    assert_eq!(rows[1].conversation, conv1, "{rows:?}");
    assert_eq!(rows[2].conversation, conv3, "{rows:?}");
    assert!(
        rows.iter()
            .all(|r| r.status == 200 && r.input_tokens.is_some()),
        "{rows:?}"
    );
    // Turn 2 carries turn 1's history: more input tokens.
    assert!(rows[1].input_tokens > rows[0].input_tokens, "{rows:?}");
    assert!(rows[0].id < rows[1].id);
    h.stop().await;
}

/// llama-server closes the connection after every streamed answer although
/// it advertises keep-alive. A client going direct just reconnects; through
/// the proxy, a request must not fail because the proxy reused that dead
/// pooled connection ("connection closed before message completed" → 502).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn back_to_back_streams_all_succeed() {
    let mut h = proxy().await;
    let url = format!("{}/chat/completions", h.url());
    let mut failures = Vec::new();
    const N: usize = 20;
    for i in 0..N {
        let mut req = chat_body(&format!("Say the number {i}."), 2);
        req["stream"] = json!(true);
        let (status, _, body) = post(&url, KEY, &req).await;
        if status != 200 {
            failures.push(format!(
                "request {i}: {status} {}",
                String::from_utf8_lossy(&body)
            ));
        } else {
            assert_eq!(
                sse(&body).last().map(|e| e.1.as_str()),
                Some("[DONE]"),
                "request {i}"
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {N} sequential streams failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    h.stop().await;
}
