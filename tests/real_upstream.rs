//! The real tier: compactor in front of a real llama.cpp server
//! (SmolLM2-135M, 2048-token context) started by `scripts/test`, which
//! exports its base URL as `COMPACTOR_LLAMA_URL`.
//!
//! Every test is `#[ignore]`d so a bare `cargo test` stays offline; the
//! project's test command runs them with `--include-ignored`. Generations are
//! kept to a few tokens so each step fits the harness' 20 s cap on 2 cores.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{json, Value};
use support::{post, within, Harness};

const CONVERSATION: &str = "x-compactor-conversation";

/// llama-server runs one slot (`-np 1`): the tests take turns, so a long
/// summary call of one never eats another's step timeout.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
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

/// The real llama-server as upstream, with its window in the models table.
fn through_llama_window(c: &mut compactor::config::Config) {
    c.upstream.base_url = llama_url();
    c.models.push(compactor::config::ModelConfig {
        pattern: "smollm2".into(),
        context_window: LLAMA_WINDOW as u64,
        max_output_tokens: Some(64),
        trigger_ratio: None,
        ..Default::default()
    });
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

/// POSTs `req` with the test key and asserts a 200 (showing the body if not).
async fn post_ok(url: &str, req: &Value) -> (http::HeaderMap, bytes::Bytes) {
    let (status, headers, body) = post(url, KEY, req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    (headers, body)
}

/// The one exchange in the store, asserting it is the only one.
fn only_row(h: &Harness) -> Row {
    let mut rows = rows(h);
    assert_eq!(rows.len(), 1, "{rows:?}");
    rows.remove(0)
}

/// Asserts the exchange was recorded whole with status 200, streamed or not.
fn assert_whole_200(r: &Row, streamed: bool) {
    assert_eq!(
        (r.status, r.streamed, r.partial),
        (200, streamed, false),
        "{r:?}"
    );
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
    let _slot = ONE_AT_A_TIME.lock().await;
    let mut h = proxy().await;
    let (headers, body) = post_ok(
        &format!("{}/chat/completions", h.url()),
        &chat_body("Say hello.", 12),
    )
    .await;
    let v = json_of(&body);
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant", "no assistant message: {v}");
    assert!(
        msg["content"].as_str().is_some_and(|c| !c.is_empty()),
        "empty content: {v}"
    );
    let conv = header(&headers, CONVERSATION);

    let r = &only_row(&h);
    assert_whole_200(r, false);
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
    let _slot = ONE_AT_A_TIME.lock().await;
    let mut h = proxy().await;
    let url = format!("{}/chat/completions", h.url());

    // 1. No stream_options: the proxy asks upstream for usage and hides it.
    let mut req = chat_body("Count to three.", 8);
    req["stream"] = json!(true);
    let (headers, body) = post_ok(&url, &req).await;
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
    let r = &only_row(&h);
    assert_whole_200(r, true);
    assert!(
        r.input_tokens.is_some_and(|t| t > 0)
            && r.output_tokens.is_some_and(|t| (1..=8).contains(&t)),
        "hidden usage was not recorded: {r:?}"
    );

    // 2. The client asks for usage: it gets the usage chunk, equal to the record.
    let mut req = chat_body("Count to three.", 8);
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let (_, body) = post_ok(&url, &req).await;
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
    assert_whole_200(r, true);
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
    let _slot = ONE_AT_A_TIME.lock().await;
    let mut h = proxy().await;
    let req = json!({"model": "smollm2", "input": "Say hello.", "max_output_tokens": 12});
    let (headers, body) = post_ok(&format!("{}/responses", h.url()), &req).await;
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

    let r = &only_row(&h);
    assert_whole_200(r, false);
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
    let _slot = ONE_AT_A_TIME.lock().await;
    let mut h = proxy().await;
    let req = json!({
        "model": "smollm2",
        "input": [{"role": "user", "content": "Say hello."}],
        "max_output_tokens": 8,
        "stream": true,
    });
    let (headers, body) = post_ok(&format!("{}/responses", h.url()), &req).await;
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

    let r = &only_row(&h);
    assert_whole_200(r, true);
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
    let _slot = ONE_AT_A_TIME.lock().await;
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

    let r = &only_row(&h);
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(r.conversation, conv);
    assert_eq!((r.input_tokens, r.output_tokens), (None, None), "{r:?}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn two_turns_land_in_one_conversation() {
    let _slot = ONE_AT_A_TIME.lock().await;
    let mut h = proxy().await;
    let url = format!("{}/chat/completions", h.url());
    let user1 = json!({"role": "user", "content": "My name is Ada. Say hello."});
    let req1 = json!({"model": "smollm2", "messages": [user1], "max_tokens": 12});
    let (h1, b1) = post_ok(&url, &req1).await;
    let answer = json_of(&b1)["choices"][0]["message"].clone();
    assert!(answer.is_object(), "no message in turn 1");
    let conv1 = header(&h1, CONVERSATION);

    // Turn 2 resends turn 1 and the assistant's answer as received.
    let req2 = json!({
        "model": "smollm2",
        "messages": [user1, answer, {"role": "user", "content": "What is my name?"}],
        "max_tokens": 12,
    });
    let (h2, _) = post_ok(&url, &req2).await;
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
    let _slot = ONE_AT_A_TIME.lock().await;
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

// ---------------------------------------------------------------------------
// A long conversation: through compactor it completes, direct it overflows.
// ---------------------------------------------------------------------------

/// Per-request cap of the long-conversation test: a request may queue
/// behind background summary calls (several seconds each on 2 cores).
const LONG_STEP: std::time::Duration = std::time::Duration::from_secs(180);
const TURNS: usize = 30;
const TURN_MAX_TOKENS: u64 = 20;
const LLAMA_WINDOW: i64 = 2048;

/// Awaits `f` or fails after [`LONG_STEP`].
async fn within_long<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LONG_STEP, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {LONG_STEP:?}"))
}

/// POSTs `body` as JSON; returns status, headers and the whole body.
async fn post_long(url: &str, body: &Value) -> (u16, http::HeaderMap, bytes::Bytes) {
    within_long(url, async {
        let resp = support::client()
            .post(url)
            .header("authorization", format!("Bearer {KEY}"))
            .json(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp
            .bytes()
            .await
            .unwrap_or_else(|e| panic!("POST {url} body: {e}"));
        (status, headers, bytes)
    })
    .await
}

/// The first user message: the task, as a coding agent would get it.
const LONG_TASK: &str = "TASK: refactor the tokenizer in src/parser/lexer.rs so that it \
streams tokens from a BufRead instead of loading the whole file into a String. Keep the \
public function `parse_document(input: &str) -> Result<Document, ParseError>` working for \
existing callers, add `parse_reader<R: BufRead>(r: R)`, and make `cargo test --all` pass. \
Answer briefly: one short sentence per turn.";

/// The user message of turn `i` (1-based, after the task): 60–120 tokens
/// of varied coding-agent chatter with paths, commands and error strings.
fn long_turn_message(i: usize) -> String {
    const FILES: [&str; 10] = [
        "src/parser/lexer.rs",
        "src/parser/ast.rs",
        "src/parser/mod.rs",
        "src/io/reader.rs",
        "tests/parser_roundtrip.rs",
        "benches/lexer_throughput.rs",
        "src/cli/args.rs",
        "src/error.rs",
        "Cargo.toml",
        "docs/ARCHITECTURE.md",
    ];
    const ACTIONS: [&str; 6] = [
        "I changed the struct `Lexer` to hold a `Peekable<Chars>` over a line buffer",
        "I moved the span bookkeeping into a new type `SpanTracker`",
        "I replaced the `Vec<Token>` return value with an iterator adapter",
        "I added a ring buffer of 4096 bytes so lookahead can cross line boundaries",
        "I renamed `next_token_inner` to `scan_token` and made it return `Option<Result<Token, LexError>>`",
        "I split string-literal handling into `scan_string` with escape decoding",
    ];
    const OUTPUTS: [&str; 6] = [
        "error[E0502]: cannot borrow `self.buf` as mutable because it is also borrowed as immutable",
        "thread 'nested_lists' panicked at src/parser/ast.rs:212:9: index out of bounds: the len is 3 but the index is 7",
        "test parser_roundtrip::unicode_escapes ... FAILED (left: \"\\u{1F600}\", right: \"\\\\u{1F600}\")",
        "warning: unused variable: `line_start` --> src/parser/lexer.rs:88:13",
        "error[E0308]: mismatched types: expected `Result<Token, LexError>`, found `Option<Token>`",
        "test result: ok. 41 passed; 0 failed; 2 ignored; finished in 0.38s",
    ];
    const ASKS: [&str; 5] = [
        "What should I check next?",
        "Is that the right approach, or should the buffer live in the reader?",
        "Which file should I edit next?",
        "Summarize what is still broken.",
        "What is the smallest fix?",
    ];
    let file = FILES[i % FILES.len()];
    let other = FILES[(i * 7 + 3) % FILES.len()];
    let action = ACTIONS[i % ACTIONS.len()];
    let output = OUTPUTS[(i * 5 + 1) % OUTPUTS.len()];
    let ask = ASKS[i % ASKS.len()];
    let mut text = format!(
        "Step {i}: {action} in {file}. Then I ran `cargo test --test parser_roundtrip -- --nocapture` \
         and it printed: {output}. {ask}"
    );
    if i.is_multiple_of(3) {
        text.push_str(&format!(" Note: {other} still uses the old signature."));
    }
    text
}

/// The assistant message of a chat answer as a client keeps it: the message
/// as received, or rebuilt from the deltas of a stream.
fn assistant_message(body: &[u8], streamed: bool) -> Value {
    if !streamed {
        let v = json_of(body);
        let m = v["choices"][0]["message"].clone();
        assert!(m.is_object(), "no assistant message: {v}");
        return m;
    }
    let events = sse(body);
    assert_eq!(
        events.last().map(|e| e.1.as_str()),
        Some("[DONE]"),
        "stream does not end with [DONE]: {}",
        String::from_utf8_lossy(body)
    );
    let mut content = String::new();
    for (_, data) in &events[..events.len() - 1] {
        let chunk = json_of(data.as_bytes());
        if let Some(c) = chunk["choices"][0]["delta"]["content"].as_str() {
            content.push_str(c);
        }
    }
    json!({"role": "assistant", "content": content})
}

fn long_request(history: &[Value], streamed: bool) -> Value {
    let mut req = json!({
        "model": "smollm2",
        "messages": history,
        "max_tokens": TURN_MAX_TOKENS,
        "temperature": 0.0,
    });
    if streamed {
        req["stream"] = json!(true);
    }
    req
}

fn is_exceed_context(status: u16, body: &[u8]) -> bool {
    status == 400
        && serde_json::from_slice::<Value>(body)
            .is_ok_and(|v| v["error"]["type"] == "exceed_context_size_error")
}

/// One stored compaction: the columns this test reports.
#[derive(Debug)]
struct CompactionRow {
    id: String,
    rung: String,
    reason: String,
    tokens_before: i64,
    tokens_after: i64,
    summary_calls: i64,
    duration_ms: i64,
}

fn compaction_rows(h: &Harness) -> Vec<CompactionRow> {
    let db = h.db();
    let mut stmt = db
        .prepare(
            "SELECT id, rung, reason, tokens_before, tokens_after, summary_calls, duration_ms
             FROM compactions ORDER BY created_ms, rowid",
        )
        .expect("prepare");
    stmt.query_map([], |r| {
        Ok(CompactionRow {
            id: r.get(0)?,
            rung: r.get(1)?,
            reason: r.get(2)?,
            tokens_before: r.get(3)?,
            tokens_after: r.get(4)?,
            summary_calls: r.get(5)?,
            duration_ms: r.get(6)?,
        })
    })
    .expect("query")
    .collect::<Result<_, _>>()
    .expect("rows")
}

/// The acceptance test: a 30-turn conversation that outgrows the
/// 2048-token window completes through compactor with no error reaching the
/// client, while the same conversation sent direct is refused with
/// `exceed_context_size_error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn thirty_turns_fit_through_compactor_but_overflow_direct() {
    let _slot = ONE_AT_A_TIME.lock().await;
    let started = std::time::Instant::now();
    let system = json!({"role": "system", "content": "You are a careful coding agent. Answer in one short sentence."});
    let user = |i: usize| {
        let text = if i == 0 {
            LONG_TASK.to_string()
        } else {
            long_turn_message(i)
        };
        json!({"role": "user", "content": text})
    };
    // Turns 5, 12, 19 and 26 are streamed (SSE through the proxy).
    let streamed = |i: usize| i % 7 == 5;

    // 1. Direct: the growing conversation overflows the window.
    let direct_url = format!("{}/chat/completions", llama_url());
    let mut direct = vec![system.clone()];
    let mut overflow_at = None;
    let mut direct_prompt = Vec::new();
    for i in 0..TURNS {
        direct.push(user(i));
        let s = streamed(i);
        let (status, _, body) = post_long(&direct_url, &long_request(&direct, s)).await;
        if is_exceed_context(status, &body) {
            eprintln!(
                "direct: turn {} refused: {}",
                i + 1,
                String::from_utf8_lossy(&body)
            );
            overflow_at = Some(i + 1);
            break;
        }
        assert_eq!(
            status,
            200,
            "direct turn {}: {}",
            i + 1,
            String::from_utf8_lossy(&body)
        );
        if !s {
            direct_prompt.push(
                json_of(&body)["usage"]["prompt_tokens"]
                    .as_i64()
                    .unwrap_or(-1),
            );
        }
        direct.push(assistant_message(&body, s));
    }
    let overflow_at = overflow_at.unwrap_or_else(|| {
        panic!("the conversation sent direct never overflowed in {TURNS} turns; prompt tokens: {direct_prompt:?}")
    });
    let direct_secs = started.elapsed().as_secs_f64();

    // 2. Through compactor: every turn succeeds.
    let mut h = within_long("proxy start", Harness::start_with(through_llama_window)).await;
    let url = format!("{}/chat/completions", h.url());
    let mut history = vec![system.clone()];
    let mut failures = Vec::new();
    let mut conversations = std::collections::BTreeSet::new();
    // Turns sent while a compaction was already stored, and whether each
    // came back rewritten.
    let mut after_first: Vec<(usize, Option<String>)> = Vec::new();
    let mut last_compacted = None;
    for i in 0..TURNS {
        history.push(user(i));
        let s = streamed(i);
        let stored_before = compaction_rows(&h).len();
        let t = std::time::Instant::now();
        let (status, headers, body) = post_long(&url, &long_request(&history, s)).await;
        let compacted = headers
            .get("x-compactor-compacted")
            .map(|v| v.to_str().unwrap_or_default().to_string());
        if let Some(c) = headers.get(CONVERSATION) {
            conversations.insert(c.to_str().unwrap_or_default().to_string());
        }
        eprintln!(
            "proxy: turn {:2} {} status {status} in {:.1}s, {} messages held, compacted: {}",
            i + 1,
            if s { "stream" } else { "json  " },
            t.elapsed().as_secs_f64(),
            history.len(),
            compacted.as_deref().unwrap_or("-")
        );
        if stored_before > 0 {
            after_first.push((i + 1, compacted.clone()));
        }
        last_compacted = compacted;
        if status != 200 {
            failures.push(format!(
                "turn {}: {status} {}",
                i + 1,
                String::from_utf8_lossy(&body)
            ));
            break;
        }
        history.push(assistant_message(&body, s));
    }
    // The exact conversation the client now holds does not fit the window.
    let mut full = long_request(&history, false);
    full["max_tokens"] = json!(1);
    let (direct_status, _, direct_body) = post_long(&direct_url, &full).await;

    let rows = rows(&h);
    let compactions = compaction_rows(&h);
    h.stop().await;
    let secs = started.elapsed().as_secs_f64();

    // The figures, whatever the verdict.
    let mut by_rung = std::collections::BTreeMap::<&str, usize>::new();
    for c in &compactions {
        *by_rung.entry(c.rung.as_str()).or_default() += 1;
    }
    let max_input = rows.iter().filter_map(|r| r.input_tokens).max();
    let max_total = rows
        .iter()
        .filter_map(|r| Some(r.input_tokens? + r.output_tokens?))
        .max();
    eprintln!(
        "thirty turns: direct overflowed at turn {overflow_at} ({direct_secs:.0}s); \
         through compactor {} exchanges, {} compactions by rung {by_rung:?}; \
         max input_tokens {max_input:?} (max input+output {max_total:?}) of {LLAMA_WINDOW}; \
         final history of {} messages sent direct: {direct_status}; {secs:.0}s in all",
        rows.len(),
        compactions.len(),
        history.len(),
    );
    for c in &compactions {
        eprintln!(
            "  compaction {} {}: {} -> {} tokens, {} summary calls, {} ms ({})",
            c.id, c.rung, c.tokens_before, c.tokens_after, c.summary_calls, c.duration_ms, c.reason
        );
    }
    eprintln!(
        "  input tokens per exchange: {:?}",
        rows.iter().map(|r| r.input_tokens).collect::<Vec<_>>()
    );

    assert!(
        failures.is_empty(),
        "errors reached the client: {failures:?}"
    );
    assert!(
        overflow_at <= TURNS,
        "direct never overflowed within {TURNS} turns"
    );
    assert!(
        is_exceed_context(direct_status, &direct_body),
        "the proxied conversation, sent direct, should not fit: {direct_status} {}",
        String::from_utf8_lossy(&direct_body)
    );
    assert_eq!(rows.len(), TURNS, "one record per turn: {rows:?}");
    let bad: Vec<&Row> = rows.iter().filter(|r| r.status != 200).collect();
    assert!(
        bad.is_empty(),
        "recorded exchanges with status != 200: {bad:?}"
    );
    assert!(
        !compactions.is_empty(),
        "no compaction fired although the conversation outgrew the window"
    );
    assert!(
        compactions.iter().all(|c| c.tokens_after < c.tokens_before),
        "a stored compaction did not shrink: {compactions:?}"
    );
    assert!(
        last_compacted.is_some(),
        "the last turn was not sent compacted"
    );
    let uncompacted: Vec<usize> = after_first
        .iter()
        .filter(|(_, c)| c.is_none())
        .map(|(t, _)| *t)
        .collect();
    assert!(
        uncompacted.is_empty(),
        "turns sent while a compaction was stored went out uncompacted: {uncompacted:?}"
    );
    assert!(
        max_input.is_some_and(|m| m < LLAMA_WINDOW),
        "an exchange's input reached the window: {max_input:?}"
    );
    assert_eq!(
        conversations.len(),
        1,
        "the turns were not recognised as one conversation: {conversations:?}"
    );
}

// ---------------------------------------------------------------------------
// Responses: a previous_response_id chain llama-server cannot follow itself,
// and a multi-turn conversation that overflows direct.
// ---------------------------------------------------------------------------

/// The id and assistant message of a Responses answer (JSON, or the
/// `response.completed` event of a stream), the message as the next input item.
fn responses_output(body: &[u8], streamed: bool) -> (String, Value) {
    let response = if streamed {
        let events = sse(body);
        let (_, data) = events
            .iter()
            .find(|(e, _)| e.as_deref() == Some("response.completed"))
            .expect("response.completed");
        json_of(data.as_bytes())["response"].clone()
    } else {
        json_of(body)
    };
    let id = response["id"].as_str().expect("response id").to_string();
    // The output message as the upstream wrote it: llama-server takes an
    // assistant turn back only in this form.
    let item = response["output"][0].clone();
    assert_eq!(item["role"], "assistant", "{response}");
    (id, item)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn responses_chains_and_long_conversations_work_through_compactor() {
    let _slot = ONE_AT_A_TIME.lock().await;
    let llama = llama_url();
    let h = within(Harness::start_with(through_llama_window)).await;
    let url = format!("{}/responses", h.url());
    let ask = |input: Value, prev: Option<&str>, stream: bool| {
        let mut body = json!({"model": "smollm2", "input": input, "max_output_tokens": 12, "temperature": 0.0});
        if let Some(p) = prev {
            body["previous_response_id"] = json!(p);
        }
        if stream {
            body["stream"] = json!(true);
        }
        body
    };

    // A chain: llama-server refuses previous_response_id; through compactor
    // the proxy expands it from its own records.
    let (status, _, body) = post_long(&url, &ask(json!("Name one fruit."), None, false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (id1, _) = responses_output(&body, false);
    let next = ask(json!("Name another one."), Some(&id1), false);
    let (status, _, direct) = post_long(&format!("{llama}/responses"), &next).await;
    assert_eq!(status, 400, "llama-server itself cannot follow the chain");
    assert!(String::from_utf8_lossy(&direct).contains("previous_response_id"));
    let (status, _, body) = post_long(&url, &next).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (id2, _) = responses_output(&body, false);
    let (status, _, body) = post_long(&url, &ask(json!("And a third?"), Some(&id2), true)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    responses_output(&body, true);

    // A long conversation with full input each turn, JSON and SSE turns.
    let mut input = vec![json!({"role": "user", "content": LONG_TASK})];
    let mut compacted_turns = 0;
    for i in 1..=16 {
        input.push(json!({"role": "user", "content": long_turn_message(i)}));
        let streamed = i % 4 == 0;
        let (status, headers, body) =
            post_long(&url, &ask(Value::Array(input.clone()), None, streamed)).await;
        assert_eq!(status, 200, "turn {i}: {}", String::from_utf8_lossy(&body));
        compacted_turns += usize::from(headers.get("x-compactor-compacted").is_some());
        input.push(responses_output(&body, streamed).1);
    }
    let (status, _, body) = post_long(
        &format!("{llama}/responses"),
        &ask(Value::Array(input.clone()), None, false),
    )
    .await;
    assert!(
        is_exceed_context(status, &body),
        "direct, the same input overflows: {status} {}",
        String::from_utf8_lossy(&body)
    );
    assert!(
        compacted_turns > 0,
        "through compactor, later turns went out compacted"
    );
    let statuses: Vec<i64> = rows(&h).iter().map(|r| r.status).collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    eprintln!(
        "responses through compactor: {compacted_turns} of 16 turns compacted; compactions: {:?}",
        compaction_rows(&h)
            .iter()
            .map(|c| (c.rung.clone(), c.tokens_before, c.tokens_after))
            .collect::<Vec<_>>()
    );
}

/// The window the server really runs with, learned: SmolLM2 served at
/// `-c 2048` with no `[[models]]` entry, so the built-in table says 8192.
/// The first overflow answer states `n_ctx` 2048; from then on the proxy
/// fits every request to it, and no error reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn the_real_window_is_learned_and_thirty_turns_fit_without_a_models_entry() {
    let _slot = ONE_AT_A_TIME.lock().await;
    let url = llama_url();
    let mut h = within_long(
        "proxy start",
        Harness::start_with(move |c| {
            c.upstream.base_url = url;
            // Learned from the overflow answer, not asked for.
            c.upstream.discover_windows = false;
            // SmolLM2 cannot write the summary's sections (the 30-turn test
            // above pays for its attempts); one call per compaction keeps
            // this one short on the shared server.
            c.compaction.max_summary_calls = 1;
        }),
    )
    .await;
    assert_eq!(h.state.model_limits("smollm2").context_window, 8192);
    let chat = format!("{}/chat/completions", h.url());
    let mut history = vec![
        json!({"role": "system", "content": "You are a careful coding agent. Answer in one short sentence."}),
    ];
    let mut failures = Vec::new();
    for i in 0..TURNS {
        let text = if i == 0 {
            LONG_TASK.to_string()
        } else {
            long_turn_message(i)
        };
        history.push(json!({"role": "user", "content": text}));
        let s = i % 7 == 5;
        let (status, _, body) = post_long(&chat, &long_request(&history, s)).await;
        if status != 200 {
            failures.push((i + 1, status, String::from_utf8_lossy(&body).into_owned()));
            history.pop();
            continue;
        }
        history.push(assistant_message(&body, s));
    }
    let windows: Value = h.get_json("/admin/api/windows").await;
    let compactions = compaction_rows(&h);
    for c in &compactions {
        eprintln!(
            "compaction {} {} {} -> {} calls {} {}ms: {}",
            c.id, c.rung, c.tokens_before, c.tokens_after, c.summary_calls, c.duration_ms, c.reason
        );
    }
    assert!(
        failures.is_empty(),
        "errors reached the client: {failures:?}"
    );
    assert!(
        windows["models"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["model"] == "smollm2"
                && m["context_window"] == 2048
                && m["source"] == "learned"),
        "{windows}"
    );
    assert!(!compactions.is_empty());
    h.stop().await;
}

/// llama-server says its window when asked: the first request of a model
/// discovers it (`/v1/models` `meta.n_ctx`, else `/props`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn the_window_is_discovered_from_llama_server() {
    let _slot = ONE_AT_A_TIME.lock().await;
    let url = llama_url();
    let mut h = within(Harness::start_with(move |c| {
        c.upstream.base_url = url;
        c.upstream.discover_windows = true;
    }))
    .await;
    let (status, _, body) = post(
        &format!("{}/chat/completions", h.url()),
        KEY,
        &chat_body("Say hi.", 4),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (limits, source) = h.state.model_window("smollm2");
    assert_eq!(
        (limits.context_window, source.as_str()),
        (LLAMA_WINDOW as u64, "discovered")
    );
    h.stop().await;
}

/// `compactor doctor` against the real llama-server: the window it states
/// (its `-c 2048`) against the table's guess for SmolLM2 (8,192).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a real llama-server: run scripts/test"]
async fn doctor_reports_llamas_window_against_the_table() {
    let _turn = within(ONE_AT_A_TIME.lock()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_compactor"));
    cmd.args(["doctor", "--upstream", &llama_url(), "--db"])
        .arg(dir.path().join("c.db"))
        .env_remove("COMPACTOR_CONFIG")
        .env_remove("COMPACTOR_LISTEN")
        .env_remove("COMPACTOR_DB");
    let out = within(tokio::task::spawn_blocking(move || cmd.output()))
        .await
        .expect("join")
        .expect("run compactor doctor");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.contains("model ") && l.contains("smollm2"))
        .unwrap_or_else(|| panic!("no window line for SmolLM2:\n{stdout}"));
    assert!(
        line.starts_with('✓')
            && line.contains("window 2,048 (discovered")
            && line.contains("the models table's 8,192"),
        "{line}"
    );
}
