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

/// Every text the store holds, for a search.
fn store_text(h: &Harness) -> String {
    let _ = h.sql();
    let mut all = Vec::new();
    for entry in std::fs::read_dir(h.dir.path()).unwrap() {
        all.extend(std::fs::read(entry.unwrap().path()).unwrap_or_default());
    }
    String::from_utf8_lossy(&all).into_owned()
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
