//! Gemini `generateContent` (`POST /v1beta/models/{model}:generateContent`,
//! `:streamGenerateContent?alt=sse`, `:countTokens`) through the proxy,
//! against the fake upstream's Gemini endpoints, which refuse what the API
//! refuses (see `compactor::fake_upstream::gemini`): forwarding below the
//! base, usage and records, the key (header or query) never stored, logged
//! or echoed, tenants, compaction that keeps function calls paired, the
//! overflow refusal retried, streams, and parts the proxy does not know.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::fake_upstream::gemini as fake;
use compactor::fake_upstream::Reply;
use compactor::wire::gemini::Collector;
use serde_json::{json, Value};
use support::*;

const KEY: &str = "AIzaSy-gemini-test-key-000111";
const MODEL: &str = "tiny-gemini";

/// POSTs `body` to the proxy's Gemini `path` (below the proxy's address)
/// with the key in `x-goog-api-key` when `header` is set; status, headers,
/// body.
async fn post_gemini(
    h: &Harness,
    path: &str,
    key: Option<&str>,
    body: &[u8],
) -> (u16, http::HeaderMap, Vec<u8>) {
    let mut req = client()
        .post(format!("http://{}{path}", h.addr))
        .header("content-type", "application/json")
        .body(body.to_vec());
    if let Some(k) = key {
        req = req.header("x-goog-api-key", k);
    }
    let resp = within(req.send()).await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = within(resp.bytes()).await.expect("body");
    (status, headers, bytes.to_vec())
}

fn generate(model: &str) -> String {
    format!("/v1beta/models/{model}:generateContent")
}

fn user(text: &str) -> Value {
    json!({"role": "user", "parts": [{"text": text}]})
}

#[tokio::test]
async fn a_generate_content_exchange_is_forwarded_below_the_base_and_recorded_with_its_usage() {
    let h = Harness::start().await;
    let body = json!({"contents": [user("hello")],
        "systemInstruction": {"parts": [{"text": "You are terse."}]},
        "generationConfig": {"temperature": 0.2}});
    h.fake.push(Reply::json(
        200,
        json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "Hi."}]},
                               "finishReason": "STOP"}],
               "usageMetadata": {"promptTokenCount": 1200, "cachedContentTokenCount": 1000,
                                 "candidatesTokenCount": 5, "thoughtsTokenCount": 40,
                                 "totalTokenCount": 1245},
               "responseId": "resp-1"}),
    ));
    let raw = serde_json::to_vec(&body).unwrap();
    let (status, headers, bytes) = post_gemini(&h, &generate(MODEL), Some(KEY), &raw).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(headers.get("x-compactor-conversation").is_some());
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        answer["candidates"][0]["content"]["parts"][0]["text"],
        "Hi."
    );
    let got = h.fake.last().unwrap();
    assert_eq!(got.path, format!("/v1/models/{MODEL}:generateContent"));
    assert_eq!(got.body, raw, "the client's bytes went as they came");
    assert_eq!(got.headers["x-goog-api-key"], KEY);
    h.wait_exchanges(1).await;
    let rows = h
        .sql()
        .rows(
            "SELECT endpoint, model, input_tokens, output_tokens, cached_tokens FROM exchanges",
            &[],
        )
        .unwrap();
    let endpoint: String = rows[0].get(0).unwrap();
    let model: String = rows[0].get(1).unwrap();
    let (input, output, cached): (i64, i64, i64) = (
        rows[0].get(2).unwrap(),
        rows[0].get(3).unwrap(),
        rows[0].get(4).unwrap(),
    );
    assert_eq!(endpoint, "/generateContent");
    assert_eq!(model, MODEL, "the model comes from the path");
    assert_eq!((input, output, cached), (1200, 45, 1000));

    // `/v1/models/…` is the same endpoint.
    let (status, _, _) = post_gemini(
        &h,
        &format!("/v1/models/{MODEL}:generateContent"),
        Some(KEY),
        &raw,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        h.fake.last().unwrap().path,
        format!("/v1/models/{MODEL}:generateContent")
    );
    h.wait_exchanges(2).await;
}

#[tokio::test]
async fn a_key_in_the_query_goes_upstream_as_the_header_and_is_never_kept_logged_or_echoed() {
    let logs_before = captured_logs().len();
    let h = Harness::start().await;
    let secret = "AIzaSy-query-key-never-printed-42";
    let body = serde_json::to_vec(&json!({"contents": [user("hello")]})).unwrap();
    let path = format!("{}?key={secret}&alt=json", generate(MODEL));
    let (status, headers, bytes) = post_gemini(&h, &path, None, &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let got = h.fake.last().unwrap();
    assert_eq!(got.headers["x-goog-api-key"], secret);
    assert_eq!(
        got.query.as_deref(),
        Some("alt=json"),
        "the key left the query"
    );
    // A tenant of its own: the same key in the header is the same tenant,
    // whose conversation the next turn continues.
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let next =
        json!({"contents": [user("hello"), answer["candidates"][0]["content"], user("more")]});
    let next = serde_json::to_vec(&next).unwrap();
    let (_, again, _) = post_gemini(&h, &generate(MODEL), Some(secret), &next).await;
    assert_eq!(
        headers["x-compactor-conversation"],
        again["x-compactor-conversation"]
    );
    // Errors the proxy makes are Google's shape and never quote the key.
    let (status, _, bytes) = post_gemini(&h, &path, None, b"{not json").await;
    assert_eq!(status, 400);
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["error"]["code"], 400);
    assert_eq!(v["error"]["status"], "INVALID_ARGUMENT");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("JSON"),
        "{v}"
    );
    let bad = serde_json::to_vec(&json!({"contents": "hi"})).unwrap();
    let (status, _, bytes) = post_gemini(&h, &path, None, &bad).await;
    assert_eq!(status, 400);
    let text = String::from_utf8_lossy(&bytes);
    assert!(
        text.contains("contents") && !text.contains(secret),
        "{text}"
    );
    // An upstream failure names no URL.
    h.fake.push(Reply::Status(
        500,
        Box::new(Reply::json(
            500,
            json!({"error": {"code": 500, "message": "boom", "status": "INTERNAL"}}),
        )),
    ));
    let (status, _, bytes) = post_gemini(&h, &path, None, &body).await;
    assert_eq!(status, 500);
    assert!(!String::from_utf8_lossy(&bytes).contains(secret));
    h.wait_exchanges(3).await;
    assert!(
        !store_text(&h).contains(secret),
        "the key reached the store"
    );
    let logs = captured_logs();
    assert!(!logs[logs_before.min(logs.len())..].contains(secret));
    assert!(!logs.contains(secret), "the key reached the logs");
}

#[tokio::test]
async fn identical_gemini_histories_under_two_keys_are_two_tenants() {
    let h = Harness::start().await;
    let first = json!({"contents": [user("the same question")]});
    let body = serde_json::to_vec(&first).unwrap();
    let (one, two) = ("tenant-one-key-0123", "tenant-two-key-4567");
    let (_, a, bytes) = post_gemini(&h, &generate(MODEL), Some(one), &body).await;
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let next = json!({"contents": [user("the same question"),
        answer["candidates"][0]["content"], user("and then?")]});
    let next = serde_json::to_vec(&next).unwrap();
    // The other tenant sends the continued history byte for byte: a
    // conversation of its own; the first tenant's continues its own.
    let (_, b, _) = post_gemini(&h, &generate(MODEL), Some(two), &next).await;
    let (_, a2, _) = post_gemini(&h, &generate(MODEL), Some(one), &next).await;
    assert_ne!(a["x-compactor-conversation"], b["x-compactor-conversation"]);
    assert_eq!(
        a["x-compactor-conversation"],
        a2["x-compactor-conversation"]
    );
}

#[tokio::test]
async fn paths_that_would_leave_the_base_or_name_no_model_are_refused() {
    let h = Harness::start().await;
    let body = serde_json::to_vec(&json!({"contents": [user("x")]})).unwrap();
    for path in [
        "/v1beta/models/..%2F..%2Fadmin:generateContent",
        "/v1/models/%2e%2e:generateContent",
        "/v1/models/m:GENERATECONTENT",
    ] {
        let before = h.fake.received().len();
        let (status, _, bytes) = post_gemini(&h, path, Some(KEY), &body).await;
        assert!(
            (400..500).contains(&status),
            "{path}: {status} {}",
            String::from_utf8_lossy(&bytes)
        );
        assert_eq!(h.fake.received().len(), before, "{path} went upstream");
    }
}

#[tokio::test]
async fn count_tokens_is_forwarded_with_its_key() {
    let h = Harness::start().await;
    let body = serde_json::to_vec(&json!({"contents": [user("count me")]})).unwrap();
    let path = format!("/v1beta/models/{MODEL}:countTokens?key={KEY}");
    let (status, _, bytes) = post_gemini(&h, &path, None, &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(v["totalTokens"].as_u64().unwrap() > 0, "{v}");
    let got = h.fake.last().unwrap();
    assert_eq!(got.path, format!("/v1/models/{MODEL}:countTokens"));
    assert_eq!(got.headers["x-goog-api-key"], KEY);
    assert_eq!(got.query, None);
}

/// The model content of a streamed answer.
fn collect_stream(bytes: &[u8]) -> Collector {
    let mut c = Collector::default();
    for line in String::from_utf8_lossy(bytes).lines() {
        if let Some(data) = line.trim_end_matches('\r').strip_prefix("data: ") {
            c.push(data);
        }
    }
    c
}

#[tokio::test]
async fn a_stream_is_relayed_chunk_by_chunk_and_its_usage_read_from_the_last_chunk() {
    let h = Harness::start().await;
    h.fake
        .push(fake::stream(&["one ", "two ", "three"], 900, 12));
    let body = serde_json::to_vec(&json!({"contents": [user("count")]})).unwrap();
    let path = format!("/v1beta/models/{MODEL}:streamGenerateContent?alt=sse");
    let (status, headers, bytes) = post_gemini(&h, &path, Some(KEY), &body).await;
    assert_eq!(status, 200);
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let c = collect_stream(&bytes);
    assert!(c.finished());
    assert_eq!(c.items()[0]["parts"][0]["text"], "one two three");
    assert_eq!(h.fake.last().unwrap().query.as_deref(), Some("alt=sse"));
    h.wait_exchanges(1).await;
    let rows = h
        .sql()
        .rows("SELECT input_tokens, output_tokens FROM exchanges", &[])
        .unwrap();
    let (input, output): (i64, i64) = (rows[0].get(0).unwrap(), rows[0].get(1).unwrap());
    assert_eq!((input, output), (900, 12));

    // Without `alt=sse` the answer is one JSON array, read whole.
    let path = format!("/v1beta/models/{MODEL}:streamGenerateContent");
    let (status, _, bytes) = post_gemini(&h, &path, Some(KEY), &body).await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(v.is_array(), "{v}");
    h.wait_exchanges(2).await;
}

#[tokio::test]
async fn an_error_inside_a_stream_reaches_the_client_and_is_recorded() {
    let h = Harness::start().await;
    let first =
        json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "partial"}]}}]});
    let error = json!({"error": {"code": 503, "message": "The model is overloaded.", "status": "UNAVAILABLE"}});
    h.fake.push(Reply::sse(vec![
        format!("data: {first}\r\n\r\n"),
        format!("data: {error}\r\n\r\n"),
    ]));
    let body = serde_json::to_vec(&json!({"contents": [user("go")]})).unwrap();
    let path = format!("/v1beta/models/{MODEL}:streamGenerateContent?alt=sse");
    let (status, _, bytes) = post_gemini(&h, &path, Some(KEY), &body).await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&bytes);
    assert!(
        text.contains("partial") && text.contains("overloaded"),
        "{text}"
    );
    h.wait_exchanges(1).await;
    let errors: Vec<Option<String>> = column(&*h.sql(), "SELECT error FROM exchanges");
    assert!(
        errors[0]
            .as_deref()
            .is_some_and(|e| e.contains("overloaded")),
        "{errors:?}"
    );

    // An error before any output is the client's as the upstream sent it.
    h.fake
        .push(Reply::sse(vec![format!("data: {error}\r\n\r\n")]));
    let (status, _, bytes) = post_gemini(&h, &path, Some(KEY), &body).await;
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("overloaded"), "{status} {text}");
    h.wait_exchanges(2).await;
}

fn tiny_gemini(c: &mut compactor::config::Config) {
    gemini_window(c, 6000);
}

/// `tiny-gemini*` models get a window of `window` tokens.
fn gemini_window(c: &mut compactor::config::Config, window: u64) {
    c.models.push(compactor::config::ModelConfig {
        pattern: "tiny-gemini*".into(),
        context_window: window,
        max_output_tokens: Some(500),
        trigger_ratio: None,
        ..Default::default()
    });
}

/// A 2.5 KB tool output, different every time, as Gemini CLI's shell
/// tool reports a command.
fn tool_output(step: usize) -> String {
    let lines: String = (0..60)
        .map(|i| format!("test module_{step}::case_{i:02} ... ok (line {i})\n"))
        .collect();
    let mut out = format!("Command: cargo test step{step}\nDirectory: (root)\nStdout: {lines}");
    out.truncate(2400);
    out.push_str("\nStderr: (empty)\nError: (none)\nExit Code: 0");
    out
}

/// A Gemini-CLI-shaped agent: a shell tool, 2.5 KB results, calls with
/// ids on odd steps and without on even ones, a thought signature on each
/// call, and a part of a kind the proxy does not know on every answer.
struct Agent {
    contents: Vec<Value>,
    step: usize,
    /// Every third request streams.
    stream: bool,
}

impl Agent {
    fn new(task: &str) -> Agent {
        Agent {
            contents: vec![user(task)],
            step: 0,
            stream: false,
        }
    }

    fn body(&self) -> Value {
        json!({"contents": self.contents,
            "systemInstruction": {"parts": [{"text": "You are a coding agent."}]},
            "tools": [{"functionDeclarations": [{"name": "run_shell_command",
                "description": "Runs a command.",
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]}],
            "generationConfig": {"temperature": 0}})
    }

    /// One request and its answer: a call, or every sixth step the end of
    /// the turn and a new user message.
    async fn step(&mut self, h: &Harness) -> http::HeaderMap {
        let step = self.step;
        self.step += 1;
        let end_of_turn = step % 6 == 5;
        let id = format!("call-{step}");
        let mut first = if end_of_turn {
            json!({ "text": format!("Step {step} done.") })
        } else {
            let mut call = json!({"name": "run_shell_command",
                "args": {"command": format!("cargo test step{step}")}});
            if step % 2 == 1 {
                call["id"] = json!(id);
            }
            json!({ "functionCall": call })
        };
        first["thoughtSignature"] = json!(format!("sig-{step}"));
        let unknown = json!({"executableCode": {"language": "PYTHON", "code": "print(1)"}});
        let streamed = self.stream && step % 3 == 1;
        let raw = serde_json::to_vec(&self.body()).unwrap();
        // The upstream counts a token per 4 bytes, as the fake does.
        let prompt = raw.len() as u64 / 4;
        if streamed {
            // Two chunks: the first part, then the rest with the end and usage.
            let one = json!({"candidates": [{"content": {"role": "model", "parts": [first]}}],
                "usageMetadata": {"promptTokenCount": prompt}});
            let two = fake::body(json!([unknown]), prompt, 5);
            h.fake.push(Reply::sse(vec![
                format!("data: {one}\r\n\r\n"),
                format!("data: {two}\r\n\r\n"),
            ]));
        } else {
            h.fake.push(Reply::json(
                200,
                fake::body(json!([first, unknown]), prompt, 5),
            ));
        }
        let path = if streamed {
            format!("/v1beta/models/{MODEL}:streamGenerateContent?alt=sse")
        } else {
            generate(MODEL)
        };
        let (status, headers, bytes) = post_gemini(h, &path, Some(KEY), &raw).await;
        assert_eq!(
            status,
            200,
            "step {step}: {}",
            String::from_utf8_lossy(&bytes)
        );
        let content = if streamed {
            let c = collect_stream(&bytes);
            assert!(
                c.finished(),
                "step {step}: {}",
                String::from_utf8_lossy(&bytes)
            );
            c.items().remove(0)
        } else {
            let answer: Value = serde_json::from_slice(&bytes).unwrap();
            answer["candidates"][0]["content"].clone()
        };
        let calls: Vec<Value> = compactor::wire::gemini::function_calls(&content)
            .cloned()
            .collect();
        self.contents.push(content);
        if calls.is_empty() {
            self.contents.push(user(&format!("Now step {}.", step + 1)));
        } else {
            let parts: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let mut r =
                        json!({"name": c["name"], "response": {"output": tool_output(step)}});
                    if let Some(id) = c.get("id") {
                        r["id"] = id.clone();
                    }
                    json!({ "functionResponse": r })
                })
                .collect();
            self.contents.push(json!({"role": "user", "parts": parts}));
        }
        headers
    }
}

fn client_requests(h: &Harness) -> Vec<Value> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path.ends_with(":generateContent"))
        .map(|r| r.json())
        .filter(|v| !compactor::fake_upstream::is_summarizer_request(v))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_tool_loop_streamed_or_not_is_compacted_with_its_calls_paired_and_unknown_parts_kept(
) {
    let h = Harness::start_with(tiny_gemini).await;
    // The fake refuses, as the API does, a response that does not answer
    // the calls right before it, and a prompt over the window.
    h.fake.set_messages_window(Some(6000));
    let mut agent = Agent::new("TASK: make every test in the workspace pass");
    agent.stream = true;
    let mut compactions = std::collections::HashSet::new();
    for _ in 0..30 {
        let headers = agent.step(&h).await;
        if let Some(id) = headers.get("x-compactor-compacted") {
            compactions.insert(id.clone());
        }
    }
    assert!(
        !compactions.is_empty(),
        "the conversation was never compacted"
    );
    let sent = client_requests(&h);
    let last = sent.last().unwrap();
    let contents = last["contents"].as_array().unwrap();
    assert!(
        contents.len() < agent.contents.len(),
        "{} items sent for {}",
        contents.len(),
        agent.contents.len()
    );
    let summary = contents.iter().find_map(|c| {
        c["parts"][0]["text"]
            .as_str()
            .filter(|t| t.contains("[compactor summary"))
    });
    assert!(
        summary.is_some_and(|s| s.contains("make every test")),
        "{last}"
    );
    assert_eq!(last["systemInstruction"], agent.body()["systemInstruction"]);
    // The tail went as the client sent it: thought signatures and unknown
    // parts included.
    // (The last request went before its answer and the next message.)
    let n = agent.contents.len();
    let tail = &agent.contents[n - 4..n - 2];
    assert_eq!(&contents[contents.len() - 2..], tail);
    let kept = |key: &str| {
        tail.iter().any(|c| {
            c["parts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p.get(key).is_some())
        })
    };
    assert!(
        kept("thoughtSignature") && kept("executableCode"),
        "{tail:?}"
    );
    // Every function response in what went up answers the call right before
    // it (the fake would have refused otherwise): some were summarized away
    // with their calls, by summary calls to the same model's endpoint.
    let summary = h
        .fake
        .received()
        .into_iter()
        .find(|r| compactor::fake_upstream::is_summarizer_request(&r.json()))
        .expect("a summary call");
    assert_eq!(summary.path, format!("/v1/models/{MODEL}:generateContent"));
    assert_eq!(summary.headers["x-goog-api-key"], KEY);
    // Another tenant sending the same contents gets none of it: over the
    // window, its request is compacted anew, with its own key.
    let raw = serde_json::to_vec(&agent.body()).unwrap();
    let other = "AIza-other-tenant-99";
    let before = h.fake.received().len();
    let (status, headers, _) = post_gemini(&h, &generate(MODEL), Some(other), &raw).await;
    assert_eq!(status, 200);
    let id = headers
        .get("x-compactor-compacted")
        .expect("over the window");
    assert!(
        !compactions.contains(id),
        "another tenant's compaction applied"
    );
    let received = h.fake.received();
    assert!(received[before..]
        .iter()
        .all(|r| r.headers["x-goog-api-key"] == other));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_input_token_count_refusal_is_compacted_and_retried_unseen() {
    let h = Harness::start_with(|c| {
        tiny_gemini(c);
        c.compaction.background = false;
    })
    .await;
    let mut agent = Agent::new("TASK: fix the build");
    agent.stream = true;
    for _ in 0..7 {
        agent.step(&h).await;
    }
    // The upstream's window turns out smaller than configured (and the
    // refused request is a stream's).
    let before = h.fake.received().len();
    h.fake.set_messages_window(Some(2500));
    let headers = agent.step(&h).await;
    assert!(headers.get("x-compactor-compacted").is_some());
    let received = h.fake.received();
    let refused = received[before..]
        .iter()
        .filter(|r| !compactor::fake_upstream::is_summarizer_request(&r.json()))
        .count();
    assert!(
        refused >= 2,
        "the refused request and its compacted retry: {refused}"
    );
    let exchanges = number(
        &*h.sql(),
        "SELECT count(*) FROM exchanges WHERE status = 200",
    );
    assert_eq!(exchanges, 8);
}

#[tokio::test]
async fn a_function_call_without_its_response_goes_through_and_is_recorded() {
    let h = Harness::start().await;
    let body = json!({"contents": [user("list"),
        {"role": "model", "parts": [{"functionCall": {"name": "ls", "args": {}}}]},
        user("never mind, just say hi")]});
    let raw = serde_json::to_vec(&body).unwrap();
    let (status, _, bytes) = post_gemini(&h, &generate(MODEL), Some(KEY), &raw).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(h.fake.last().unwrap().body, raw);
    h.wait_exchanges(1).await;
}

/// An image in a content the summary replaces is not dropped silently:
/// the summary says what it was, at what Gemini charges for it (258 a
/// 768-px tile), and where.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_image_the_summary_replaces_leaves_a_marker() {
    let h = Harness::start_with(tiny_gemini).await;
    let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    png.extend(800u32.to_be_bytes());
    png.extend(600u32.to_be_bytes());
    png.extend([8, 6, 0, 0, 0, 0, 0, 0, 0]);
    let png = compactor::tokens::media::encode_base64(&png);
    let mut contents = vec![json!({"role": "user", "parts": [
        {"text": "This dialog renders its buttons off screen. Fix the layout."},
        {"inlineData": {"mimeType": "image/png", "data": png}}]})];
    for i in 0..6 {
        contents.push(json!({"role": "model", "parts": [{"text": format!("Step {i}: looked at the dialog code.")}]}));
        contents.push(user(&format!(
            "Turn {i}: {}",
            "the dialog's buttons sit in a flex row whose width comes from the parent. ".repeat(12)
        )));
    }
    let raw = serde_json::to_vec(&json!({ "contents": contents })).unwrap();
    let resp = client()
        .post(format!("http://{}{}", h.addr, generate(MODEL)))
        .header("x-goog-api-key", KEY)
        .header("x-compactor-compact", "now")
        .body(raw);
    let resp = within(resp.send()).await.expect("request");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("x-compactor-compacted").is_some());
    let sent = client_requests(&h).pop().unwrap().to_string();
    assert!(!sent.contains(&png), "the image went as it came");
    assert!(
        sent.contains("[image omitted by compactor: 800×600 PNG, ~516 tokens] (in a user message)"),
        "{sent}"
    );
}

/// A truncated tool output names its archived original; the model's call
/// of `compactor_recall` for it is answered by the proxy, in Gemini's
/// shape, and the client gets only the answer that follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recall_call_is_answered_by_the_proxy_in_geminis_shape() {
    let h = Harness::start_with(|c| {
        tiny_gemini(c);
        c.compaction.tool_output_max_bytes = 600;
        c.compaction.tool_output_keep_bytes = 200;
    })
    .await;
    let mut agent = Agent::new("TASK: make every test in the workspace pass");
    let mut reference = None;
    for _ in 0..30 {
        agent.step(&h).await;
        let sent = client_requests(&h).pop().unwrap().to_string();
        let offered = sent.contains("compactor_recall");
        if let (true, Some(at)) = (offered, sent.find("archived as item:")) {
            let start = at + "archived as ".len();
            reference = Some(sent[start..start + "item:".len() + 16].to_string());
            break;
        }
    }
    let reference = reference.expect("a truncated output, the recall tool offered");
    h.fake.push(fake::calls(
        &[("compactor_recall", json!({ "ref": reference }), Some("r-1"))],
        100,
        5,
    ));
    h.fake.push(fake::text("Recalled it.", 100, 5));
    let raw = serde_json::to_vec(&agent.body()).unwrap();
    let (status, _, bytes) = post_gemini(&h, &generate(MODEL), Some(KEY), &raw).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        answer["candidates"][0]["content"]["parts"][0]["text"],
        "Recalled it."
    );
    assert!(!String::from_utf8_lossy(&bytes).contains("compactor_recall"));
    let continued = client_requests(&h).pop().unwrap();
    let contents = continued["contents"].as_array().unwrap();
    let response = &contents[contents.len() - 1]["parts"][0]["functionResponse"];
    assert_eq!(response["name"], "compactor_recall");
    assert_eq!(response["id"], "r-1");
    let text = response["response"]["output"].as_str().unwrap();
    assert!(text.contains("Exit Code: 0"), "the original, whole: {text}");
    assert_eq!(
        contents[contents.len() - 2]["parts"][0]["functionCall"]["name"],
        "compactor_recall"
    );
}

/// Once a conversation is compacted, `countTokens` of its contents counts
/// what the proxy sends for it, not the whole history; another tenant's
/// count of the same contents is forwarded as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_of_a_compacted_conversation_counts_what_the_proxy_sends() {
    let h = Harness::start_with(tiny_gemini).await;
    let mut agent = Agent::new("TASK: make every test in the workspace pass");
    let mut compacted = false;
    for _ in 0..30 {
        compacted |= agent.step(&h).await.get("x-compactor-compacted").is_some();
    }
    assert!(compacted);
    let count = |key: &'static str, body: Value| {
        let h = &h;
        async move {
            let raw = serde_json::to_vec(&body).unwrap();
            let path = format!("/v1beta/models/{MODEL}:countTokens");
            let (status, _, bytes) = post_gemini(h, &path, Some(key), &raw).await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            let sent = h.fake.last().unwrap().json();
            (v["totalTokens"].as_u64().unwrap(), sent)
        }
    };
    let whole = serde_json::to_vec(&json!({"contents": agent.contents}))
        .unwrap()
        .len() as u64
        / 4;
    let (tokens, sent) = count(KEY, json!({"contents": agent.contents})).await;
    assert!(tokens < whole / 2, "{tokens} of {whole}");
    assert!(sent.to_string().contains("[compactor summary"));
    // The wrapped form counts the same way.
    let wrapped = json!({"generateContentRequest": {"model": format!("models/{MODEL}"),
        "contents": agent.contents}});
    let (wrapped_tokens, _) = count(KEY, wrapped).await;
    assert!(wrapped_tokens < whole / 2);
    let (other, sent) = count("AIza-other-tenant-99", json!({"contents": agent.contents})).await;
    assert_eq!(other, whole.max(1));
    assert_eq!(sent["contents"], json!(agent.contents));
}

/// Gemini CLI's own compression (its history, then the ask for a
/// `<state_snapshot>`) is the client's: forwarded as it came while it
/// fits, the proxy's waiting compaction not applied to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_clis_own_compression_goes_as_it_came_while_it_fits() {
    let h = Harness::start_with(|c| gemini_window(c, 15_000)).await;
    let mut agent = Agent::new("TASK: make every test in the workspace pass");
    for _ in 0..20 {
        agent.step(&h).await;
    }
    // Past the trigger: the proxy's compaction waits for the next turn.
    wait_compactions(&h, 1).await;
    let mut ask = agent.contents.clone();
    ask.push(user(
        "First, reason in your scratchpad. Then, generate the <state_snapshot>.",
    ));
    let body = json!({ "contents": ask });
    let raw = serde_json::to_vec(&body).unwrap();
    h.fake
        .push(fake::text("<state_snapshot/>", raw.len() as u64 / 4, 50));
    let (status, headers, _) = post_gemini(&h, &generate(MODEL), Some(KEY), &raw).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_none());
    assert_eq!(h.fake.last().unwrap().body, raw, "forwarded as it came");
    // The same history with a user's turn instead takes the compaction.
    let mut turn = agent.contents.clone();
    turn.push(user("Go on."));
    let raw = serde_json::to_vec(&json!({ "contents": turn })).unwrap();
    let (status, headers, _) = post_gemini(&h, &generate(MODEL), Some(KEY), &raw).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
}
