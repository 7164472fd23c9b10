//! A provider compaction item the provider no longer accepts (OpenAI's
//! encrypted `compaction` item after a key rotation or its expiry: 400
//! `invalid_encrypted_content`). The proxy rebuilds the conversation from
//! its record — the input of the exchange whose answer carried the item —
//! compacts it locally, and sends it again in the same request: the client
//! never sees the 400. When the record does not hold what the item stood
//! for, the provider's 400 reaches the client as it came.
//!
//! Anthropic's `compaction` block carries its summary as plain text and no
//! refusal of one is documented: Messages requests are not rebuilt.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::provider::Settings;
use compactor::fake_upstream::{Received, Reply};
use serde_json::{json, Value};
use support::responses::{output_text, responses_call, responses_output, responses_text};
use support::*;

const KEY: &str = "sk-test-rebuild-0001";

const SUMMARY: &str = "## TASK\nbuild the modules";

/// A constraint the first turns state, for the facts to carry.
const PLANTED: &str = "Never edit vendor/zlib_planted.c by hand.";

/// A 3000-token window for `prov*` models.
fn prov_window(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "prov*".into(),
        context_window: 3000,
        max_output_tokens: Some(300),
        trigger_ratio: None,
        ..Default::default()
    });
}

fn provider() -> Option<Settings> {
    Some(Settings {
        min_threshold: 100,
        responses_window: None,
    })
}

/// The requests the fake received for the client (not the summarizer's).
fn client_requests(h: &Harness) -> Vec<Received> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/responses" && !is_summary_call(r))
        .collect()
}

/// A Responses client asking its provider to compact, holding its history.
struct Client {
    input: Vec<Value>,
    body: Value,
    /// Each provider compaction item received, serialized.
    minted: Vec<String>,
    requests: usize,
}

impl Client {
    fn new() -> Self {
        Client {
            input: Vec::new(),
            body: json!({"model": "prov-mini", "instructions": "You are a build agent.",
                         "context_management": [{"type": "compaction", "compact_threshold": 1500}],
                         "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]}),
            minted: Vec::new(),
            requests: 0,
        }
    }

    async fn post(&mut self, h: &Harness, streamed: bool) -> (u16, bytes::Bytes) {
        let mut body = self.body.clone();
        body["input"] = Value::from(self.input.clone());
        body["stream"] = json!(streamed);
        let (status, _, bytes) = post(&format!("{}/responses", h.url()), KEY, &body).await;
        self.requests += 1;
        (status, bytes)
    }

    async fn send(&mut self, h: &Harness, streamed: bool) -> Vec<Value> {
        let (status, bytes) = self.post(h, streamed).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let output = responses_output(&bytes, streamed);
        for item in &output {
            if item["type"] == "compaction" {
                self.minted.push(item.to_string());
            }
        }
        self.input.extend(output.iter().cloned());
        output
    }

    fn user(&mut self, text: &str) {
        self.input.push(json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}]}));
    }

    /// One turn: a user message, a tool call and its output, an answer.
    async fn turn(&mut self, h: &Harness, n: usize, streamed: bool) {
        let text = if n == 1 {
            format!("step {n}: build module {n}\n{PLANTED}")
        } else {
            format!("step {n}: build module {n}")
        };
        self.user(&text);
        let call_id = format!("call_{n}");
        h.fake.push(responses_call(&call_id, streamed));
        self.send(h, streamed).await;
        self.input
            .push(json!({"type": "function_call_output", "call_id": call_id,
            "output": output_text(n, 700)}));
        h.fake
            .push(responses_text(&format!("module {n} built"), streamed));
        self.send(h, streamed).await;
    }

    /// Turns until the provider compacted `times`.
    async fn until_minted(&mut self, h: &Harness, times: usize, streamed: bool) -> usize {
        let mut n = 0;
        while self.minted.len() < times {
            self.turn(h, n, streamed).await;
            n += 1;
            assert!(n < 40, "the provider never compacted {times} times");
        }
        n
    }
}

/// A counter of `/metrics`, 0 when absent.
async fn metric(h: &Harness, line_start: &str) -> f64 {
    h.scrape()
        .await
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}

const REACTIVE: &str = "compactor_compaction_triggers_total{trigger=\"reactive\"}";

/// Whether a request carries any of `items` (serialized) byte for byte.
fn carries_any(r: &Received, items: &[String]) -> bool {
    let text = String::from_utf8_lossy(&r.body);
    items.iter().any(|i| text.contains(i.as_str()))
}

async fn expired_items_are_rebuilt(streamed: bool) {
    let h = Harness::start_with(prov_window).await;
    h.fake.set_provider_compaction(provider());
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let mut c = Client::new();
    // Two of the provider's compactions: the newer item's history holds
    // the older item, which the rebuild expands too.
    let n = c.until_minted(&h, 2, false).await;
    h.wait_exchanges(c.requests as i64).await;
    assert_eq!(h.fake.expire_provider_items(), c.minted.len());
    let expired = c.minted.clone();
    let reactive_before = metric(&h, REACTIVE).await;
    let before = client_requests(&h).len();

    // The client sends its history back as it holds it.
    c.user(&format!("step {n}: and now the docs"));
    h.fake.push(responses_text("docs written", streamed));
    c.send(&h, streamed).await;
    let sent = client_requests(&h);
    let attempts = &sent[before..];
    assert_eq!(attempts.len(), 2, "refused once, sent again once");
    assert!(
        carries_any(&attempts[0], &expired),
        "the first attempt went as the client sent it"
    );
    let rebuilt = &attempts[1];
    assert!(
        !carries_any(rebuilt, &expired),
        "the rebuilt request holds none of the expired items"
    );
    let text = String::from_utf8_lossy(&rebuilt.body);
    assert!(
        text.contains(PLANTED),
        "the facts of what the items stood for reach the upstream: {text}"
    );
    assert!(
        text.contains(&format!("step {n}: and now the docs")),
        "the newest turn goes as sent"
    );
    assert_eq!(
        rebuilt.json()["context_management"],
        c.body["context_management"]
    );
    let sent_items = rebuilt.json()["input"].as_array().map_or(0, Vec::len);
    assert!(
        sent_items < c.input.len(),
        "compacted locally: {sent_items} items for the client's {}",
        c.input.len()
    );
    assert_eq!(metric(&h, REACTIVE).await, reactive_before + 1.0);
    let _ = h.state.store.flush().await;
    let reasons: Vec<String> = column(
        &*h.sql(),
        "SELECT reason FROM compactions ORDER BY created_ms",
    );
    assert!(
        reasons.last().is_some_and(|r| r.starts_with("rebuild:")),
        "{reasons:?}"
    );

    // Later requests carry the expired items still: the stored compaction
    // covers them, so each goes once, accepted.
    for k in 0..3 {
        let before = client_requests(&h).len();
        c.turn(&h, n + 1 + k, streamed).await;
        let sent = client_requests(&h);
        assert_eq!(sent.len() - before, 2, "no refusal on a later turn");
        assert!(sent[before..].iter().all(|r| !carries_any(r, &expired)));
    }
    assert_eq!(
        metric(&h, REACTIVE).await,
        reactive_before + 1.0,
        "rebuilt once"
    );
    // The record keeps every item the client sent, the expired ones too.
    h.wait_exchanges(c.requests as i64).await;
    let conversation: String = column(
        &*h.sql(),
        "SELECT conversation_id FROM exchanges ORDER BY id",
    )
    .pop()
    .unwrap();
    let export = h
        .get_json(&format!("/admin/api/conversations/{conversation}/export"))
        .await;
    let original = export["original_items"].as_array().cloned().unwrap();
    assert_eq!(original[1..].to_vec(), c.input, "the whole history");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_provider_item_is_rebuilt_from_the_record_json() {
    expired_items_are_rebuilt(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_provider_item_is_rebuilt_from_the_record_sse() {
    expired_items_are_rebuilt(true).await;
}

/// A client that kept only what follows the item (as OpenAI lets it):
/// what the item stood for is in the record only, and comes back from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_dropped_what_the_item_stood_for_gets_it_back() {
    let h = Harness::start_with(prov_window).await;
    h.fake.set_provider_compaction(provider());
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let mut c = Client::new();
    let n = c.until_minted(&h, 1, false).await;
    let item = c.minted[0].clone();
    let at = c
        .input
        .iter()
        .position(|i| serde_json::to_string(i).is_ok_and(|t| t == item))
        .unwrap();
    c.input.drain(..at);
    h.wait_exchanges(c.requests as i64).await;
    h.fake.expire_provider_items();
    let before = client_requests(&h).len();
    c.user(&format!("step {n}: what did I ask you never to do?"));
    h.fake
        .push(responses_text("not to edit the vendored zlib", false));
    c.send(&h, false).await;
    let sent = client_requests(&h);
    assert_eq!(sent.len() - before, 2, "refused once, sent again once");
    let text = String::from_utf8_lossy(&sent[before + 1].body);
    assert!(!text.contains(item.as_str()));
    assert!(
        text.contains(PLANTED),
        "what only the record held reached the upstream: {text}"
    );
}

/// The same refusal as a stream's failure event before any output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_failing_on_the_item_is_rebuilt_before_the_client_sees_it() {
    let h = Harness::start_with(prov_window).await;
    h.fake.set_provider_compaction(provider());
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let mut c = Client::new();
    let n = c.until_minted(&h, 1, false).await;
    h.wait_exchanges(c.requests as i64).await;
    let failed = json!({"id": "resp_failed", "object": "response", "status": "failed", "output": [],
        "error": {"code": "invalid_encrypted_content",
                  "message": "The encrypted content for item cmp_fake1 could not be verified."}});
    h.fake.push(Reply::sse(vec![
        format!("event: response.created\ndata: {}\n\n", json!({"type": "response.created",
            "sequence_number": 0, "response": {"id": "resp_failed", "status": "in_progress", "output": []}})),
        format!("event: response.failed\ndata: {}\n\n", json!({"type": "response.failed",
            "sequence_number": 1, "response": failed})),
    ]));
    h.fake.push(responses_text("docs written", true));
    c.user(&format!("step {n}: and now the docs"));
    let before = client_requests(&h).len();
    let output = c.send(&h, true).await;
    assert_eq!(output.last().unwrap()["content"][0]["text"], "docs written");
    let sent = client_requests(&h);
    assert_eq!(sent.len() - before, 2, "failed once, sent again once");
    assert!(!carries_any(&sent[before + 1], &c.minted[..1]));
    assert!(String::from_utf8_lossy(&sent[before + 1].body).contains(PLANTED));
}

/// An item the proxy never relayed: nothing to rebuild from, and the
/// client gets the provider's refusal as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_the_record_does_not_hold_is_refused_as_the_provider_said() {
    let h = Harness::start_with(prov_window).await;
    h.fake.set_provider_compaction(provider());
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    for streamed in [false, true] {
        let mut c = Client::new();
        c.user("step 0: build module 0");
        c.input
            .push(json!({"type": "compaction", "id": "cmp_elsewhere",
            "encrypted_content": "gAAAAB-minted-elsewhere-opaque"}));
        c.user("step 1: go on");
        let before = h.fake.count();
        let (status, bytes) = c.post(&h, streamed).await;
        assert_eq!(status, 400);
        let v: Value = serde_json::from_slice(&bytes).expect("the provider's JSON error");
        assert_eq!(
            v,
            json!({"error": {
                "message": "The encrypted content for item cmp_elsewhere could not be verified. Reason: Encrypted content could not be decrypted or parsed.",
                "type": "invalid_request_error", "param": null, "code": "invalid_encrypted_content"}}),
            "the provider's refusal, as it came"
        );
        assert_eq!(h.fake.count(), before + 1, "sent once: nothing to rebuild");
    }
    assert_eq!(metric(&h, REACTIVE).await, 0.0);
    let _ = h.state.store.flush().await;
    assert_eq!(compactions(&h), 0);
}

/// Outside the modes that rewrite requests the refusal is the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_relays_the_refusal() {
    let h = Harness::start_with(|c| {
        prov_window(c);
        c.compaction.mode = compactor::config::Mode::Observe;
    })
    .await;
    h.fake.set_provider_compaction(provider());
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let mut c = Client::new();
    c.until_minted(&h, 1, false).await;
    h.wait_exchanges(c.requests as i64).await;
    h.fake.expire_provider_items();
    c.user("step 99: go on");
    let before = h.fake.count();
    let (status, bytes) = c.post(&h, false).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["error"]["code"], "invalid_encrypted_content");
    assert_eq!(h.fake.count(), before + 1);
}
