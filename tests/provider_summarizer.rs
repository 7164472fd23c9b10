//! The summary rung delegated to the provider (`compaction.summarizer`),
//! through the real proxy in front of the fake upstream's own compaction
//! (`fake_upstream::provider_compact`, which follows each API's documented
//! rules at a far smaller scale than the real thresholds):
//!
//! - with `provider`, the summary is the provider's (Responses
//!   `/responses/compact`, Messages on-demand compaction), the facts the
//!   proxy's, in the newest user message; the kept turns go as they came,
//!   Messages thinking blocks with their signatures included;
//! - every failure of the provider's compaction is served by the local
//!   summarizer in the same request, with a metric;
//! - `auto` asks an upstream once and remembers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use compactor::config::{Config, ModelConfig, Summarizer};
use compactor::fake_upstream::provider_compact::Behaviour;
use compactor::fake_upstream::{anthropic, Received, Reply};
use serde_json::{json, Value};
use support::{client, column, is_summary_call, post, small_window_foreground, within, Harness};

const KEY: &str = "sk-provider-summarizer";

/// The task of the Responses sessions, which the facts must carry.
const TASK: &str = "Port the CSV exporter to UTC timestamps; keep the public column names.";

fn provider(c: &mut Config) {
    small_window_foreground(c);
    c.compaction.summarizer = Summarizer::Provider;
}

/// A Responses history over the tiny model's hard limit: short user
/// turns, long answers (a compacted window keeps the user's messages).
fn responses_history(task: &str) -> Vec<Value> {
    let mut items = vec![json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": task}]})];
    for i in 0..14 {
        items.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text",
            "text": format!("step {i}: {}", "the exporter still writes local offsets in three places. ".repeat(22))}]}));
        items.push(json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": format!("ok, go on with step {}", i + 1)}]}));
    }
    items
}

fn requests_to(h: &Harness, path: &str) -> Vec<Received> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path == path)
        .collect()
}

/// The text parts of an item's content.
fn texts(item: &Value) -> Vec<String> {
    match &item["content"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    }
}

async fn metric(h: &Harness, line_start: &str) -> f64 {
    let text = h.scrape().await;
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// With `summarizer = "provider"`, a Responses request over the hard
/// limit is compacted by `/responses/compact`: its window as it came (the
/// compaction item byte-identical, no second selection of user messages),
/// the proxy's facts in the newest user message, no summarizer call; the
/// next request carries the same item again, and the fake takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_the_window_is_the_providers_and_the_facts_the_proxys() {
    let h = Harness::start_with(provider).await;
    let url = format!("{}/responses", h.url());
    for stream in [false, true] {
        let task = format!("{TASK} (stream: {stream})");
        let items = responses_history(&task);
        let body = json!({"model": "tiny-x", "input": items, "stream": stream});
        let before = h.fake.received().len();
        let (status, headers, bytes) = post(&url, KEY, &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        assert!(headers.get("x-compactor-compacted").is_some());
        if stream {
            assert!(String::from_utf8_lossy(&bytes).contains("response.completed"));
        }
        let got: Vec<Received> = h.fake.received()[before..].to_vec();
        assert!(!got.iter().any(is_summary_call), "no local summarizer call");
        let compact: Vec<&Received> = got
            .iter()
            .filter(|r| r.path == "/v1/responses/compact")
            .collect();
        assert_eq!(compact.len(), 1, "one provider compaction");
        let asked = compact[0].json();
        assert_eq!(asked["model"], "tiny-x");
        assert!(asked.get("context_management").is_none());
        let sent = got.iter().rfind(|r| r.path == "/v1/responses").unwrap();
        let input = sent.json()["input"].as_array().unwrap().clone();
        // The compaction item as the fake minted it (it refuses any other).
        let item = input
            .iter()
            .find(|i| i["type"] == "compaction")
            .expect("the compaction item went upstream");
        assert!(item["encrypted_content"]
            .as_str()
            .unwrap()
            .starts_with("enc_"));
        // The facts: in the newest user message, after its own text.
        let newest = input.iter().rfind(|i| i["role"] == "user").unwrap();
        let parts = texts(newest);
        assert_eq!(parts[0], "ok, go on with step 14", "its own text first");
        assert!(
            parts[1].starts_with("[compactor summary") && parts[1].contains(&task),
            "the facts carry the task verbatim: {}",
            parts[1]
        );
        // Every other item is one the client sent, byte for byte: the
        // window's user messages and the kept turns. No user message twice.
        for i in input.iter().filter(|i| *i != item && *i != newest) {
            assert!(items.contains(i), "not the client's: {i}");
        }
        let users: Vec<&Value> = input.iter().filter(|i| i["role"] == "user").collect();
        let distinct: std::collections::HashSet<String> =
            users.iter().map(|u| u.to_string()).collect();
        assert_eq!(
            users.len(),
            distinct.len(),
            "no recent user message added twice"
        );

        // The next request: the stored compaction again, the item identical.
        let mut next = items.clone();
        next.push(json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "Done with step 14."}]}));
        next.push(json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "now the tests"}]}));
        let (status, _, bytes) = post(
            &url,
            KEY,
            &json!({"model": "tiny-x", "input": next, "stream": stream}),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let again = h.fake.last().unwrap();
        assert_eq!(again.path, "/v1/responses");
        let again_input = again.json()["input"].as_array().unwrap().clone();
        assert!(again_input.contains(item), "the same item, byte-identical");
        assert!(
            again_input.contains(newest),
            "the facts stay where they went"
        );
    }
    let reasons: Vec<String> = column(&*h.sql(), "SELECT reason FROM compactions");
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(reasons
        .iter()
        .all(|r| r.ends_with("summary by the provider")));
    let summaries: Vec<String> = column(&*h.sql(), "SELECT summary FROM compactions");
    assert!(
        summaries.iter().all(|s| s.contains(TASK)),
        "the record keeps the facts"
    );
    let replacements: Vec<String> = column(&*h.sql(), "SELECT replacement FROM compactions");
    assert!(
        replacements.iter().all(|r| r.contains("\"compaction\"")),
        "the record keeps the provider's window"
    );
}

fn claude_tiny(c: &mut Config) {
    c.compaction.background = false;
    c.compaction.summarizer = Summarizer::Provider;
    c.models.push(ModelConfig {
        pattern: "claude-tiny*".into(),
        context_window: 4000,
        max_output_tokens: Some(400),
        ..Default::default()
    });
}

const THINKING: &str = r#"{"type": "enabled", "budget_tokens": 1024}"#;

/// The Messages sessions' system prompt (their thinking is bound to it).
const SYSTEM: &str = "You are a careful refactoring agent.";

/// A Messages history with thinking, every answer the fake's own (its
/// thinking signed for the request it answered), built against the fake
/// directly: long user turns, past the tiny model's hard limit.
async fn signed_history(h: &Harness, task: &str) -> Vec<Value> {
    let thinking: Value = serde_json::from_str(THINKING).unwrap();
    let mut msgs = vec![json!({"role": "user", "content": task})];
    for i in 0..20 {
        let body = json!({"model": "claude-tiny", "max_tokens": 300, "thinking": thinking,
                          "system": SYSTEM, "messages": msgs});
        let resp = within(
            client()
                .post(format!("{}/messages", h.fake.url()))
                .header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01")
                .json(&body)
                .send(),
        )
        .await
        .expect("fake");
        assert_eq!(resp.status(), 200);
        let answer: Value = within(resp.json()).await.expect("answer");
        msgs.push(json!({"role": "assistant", "content": answer["content"]}));
        msgs.push(json!({"role": "user", "content": format!(
            "step {i}: {}",
            "please move the date parsing into its own module and keep the public API. ".repeat(12)
        )}));
    }
    msgs
}

/// With `summarizer = "provider"`, a Messages request over the hard limit
/// is compacted by on-demand compaction: the block first, the kept turns
/// as they came (their thinking blocks and signatures too, which the fake
/// accepts: the block stands for what it compacted), the facts in the
/// newest user message, the beta on the compacted request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_the_block_goes_first_and_kept_thinking_stays_signed() {
    let h = Harness::start_with(claude_tiny).await;
    for stream in [false, true] {
        let task = format!("Split the date parsing out of the exporter (stream: {stream}).");
        let history = signed_history(&h, &task).await;
        let thinking: Value = serde_json::from_str(THINKING).unwrap();
        let body = json!({"model": "claude-tiny", "max_tokens": 300, "thinking": thinking,
                          "system": SYSTEM, "messages": history, "stream": stream});
        let before = h.fake.received().len();
        let resp = within(
            client()
                .post(format!("{}/messages", h.url()))
                .header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01")
                .json(&body)
                .send(),
        )
        .await
        .expect("proxy");
        let status = resp.status();
        assert!(resp.headers().get("x-compactor-compacted").is_some());
        let bytes = within(resp.bytes()).await.expect("body");
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        if stream {
            assert!(String::from_utf8_lossy(&bytes).contains("message_stop"));
        }
        let got: Vec<Received> = h.fake.received()[before..].to_vec();
        assert!(!got.iter().any(is_summary_call), "no local summarizer call");
        let (asked, sent): (Vec<&Received>, Vec<&Received>) = got
            .iter()
            .partition(|r| r.json().get("compaction").is_some());
        assert_eq!(asked.len(), 1, "one on-demand compaction");
        let ask = asked[0].json();
        assert_eq!(ask["compaction"], json!({"type": "summarize"}));
        assert!(ask.get("context_management").is_none());
        assert_eq!(ask["system"], SYSTEM, "the conversation's system prompt");
        assert!(asked[0].headers["anthropic-beta"]
            .to_str()
            .unwrap()
            .contains("compact-2026-09-04"));
        let asked_msgs = ask["messages"].as_array().unwrap();
        assert_eq!(
            asked_msgs[..],
            history[..asked_msgs.len()],
            "a prefix, as sent"
        );
        assert_eq!(sent.len(), 1, "the compacted request was taken: no resend");
        let compacted = sent[0].json();
        assert!(
            anthropic::check(&compacted, &sent[0].headers, None).is_none(),
            "valid by the documented rules, the beta included"
        );
        // The kept thinking is valid as signed, not only droppable.
        assert_eq!(
            compacted["thinking"]["block_binding"]["prefix_mismatch_behavior"],
            "drop_block"
        );
        let mut strict = compacted.clone();
        strict["thinking"]
            .as_object_mut()
            .unwrap()
            .remove("block_binding");
        assert!(
            anthropic::check(&strict, &sent[0].headers, None).is_none(),
            "every kept thinking block still matches its signature"
        );
        let msgs = compacted["messages"].as_array().unwrap();
        assert_eq!(msgs[0]["role"], "assistant");
        assert_eq!(
            msgs[0]["content"][0]["type"], "compaction",
            "the block first"
        );
        // The kept turns: the client's messages, byte for byte, thinking too.
        let last = msgs.len() - 1;
        let kept = &msgs[1..last];
        assert!(!kept.is_empty());
        assert!(
            kept.iter().any(|m| m["content"][0]["type"] == "thinking"),
            "a signed thinking block in the kept turns"
        );
        let offset = history.len() - msgs.len() + 1;
        assert_eq!(kept[..], history[offset..history.len() - 1]);
        // The newest user message: its text, then the facts.
        let parts = texts(&msgs[last]);
        assert_eq!(
            parts[0],
            history.last().unwrap()["content"].as_str().unwrap()
        );
        assert!(
            parts[1].starts_with("[compactor summary") && parts[1].contains(&task),
            "{}",
            parts[1]
        );

        // Counting the conversation's tokens counts what would go: the
        // block, under its beta.
        let resp = within(
            client()
                .post(format!("{}/messages/count_tokens", h.url()))
                .header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01")
                .json(&json!({"model": "claude-tiny", "system": SYSTEM, "messages": history}))
                .send(),
        )
        .await
        .expect("count_tokens");
        assert_eq!(resp.status(), 200);
        let counted = h.fake.last().unwrap();
        assert_eq!(counted.path, "/v1/messages/count_tokens");
        assert_eq!(counted.json()["messages"][0], msgs[0], "the block");
        assert!(counted.headers["anthropic-beta"]
            .to_str()
            .unwrap()
            .contains("compact-2026-09-04"));
    }
}

/// Every way the provider's compaction fails is served in the same
/// request by the local summarizer, counted by why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_falls_back_to_the_local_summarizer() {
    let cases = [
        (
            Behaviour::Fail(500, json!({"error": {"message": "overloaded"}})),
            "status",
        ),
        (
            Behaviour::Fail(404, json!({"error": {"message": "Not found"}})),
            "unsupported",
        ),
        (
            Behaviour::Fail(
                400,
                json!({"error": {"message": "Unrecognized request argument supplied: compaction"}}),
            ),
            "unsupported",
        ),
        (Behaviour::Hang(Duration::from_secs(8)), "timeout"),
        (Behaviour::Junk, "invalid"),
    ];
    for (behaviour, reason) in cases {
        let h = Harness::start_with(|c| {
            provider(c);
            c.compaction.provider_timeout_secs = 1;
        })
        .await;
        h.fake.set_compact_endpoint(behaviour.clone());
        let items = responses_history(TASK);
        let (status, headers, bytes) = post(
            &format!("{}/responses", h.url()),
            KEY,
            &json!({"model": "tiny-x", "input": items}),
        )
        .await;
        assert_eq!(
            status,
            200,
            "{behaviour:?}: {}",
            String::from_utf8_lossy(&bytes)
        );
        assert!(
            headers.get("x-compactor-compacted").is_some(),
            "{behaviour:?}"
        );
        assert_eq!(requests_to(&h, "/v1/responses/compact").len(), 1);
        assert!(
            h.fake.received().iter().any(is_summary_call),
            "{behaviour:?}: the local summarizer wrote it"
        );
        let sent = requests_to(&h, "/v1/responses").pop().unwrap().json();
        assert!(
            !sent["input"]
                .as_array()
                .unwrap()
                .iter()
                .any(|i| i["type"] == "compaction"),
            "{behaviour:?}"
        );
        let reasons: Vec<String> = column(&*h.sql(), "SELECT reason FROM compactions");
        assert!(
            !reasons[0].ends_with("summary by the provider"),
            "{behaviour:?}: {reasons:?}"
        );
        let counted = metric(
            &h,
            &format!("compactor_provider_compaction_fallbacks_total{{reason=\"{reason}\"}}"),
        )
        .await;
        assert_eq!(counted, 1.0, "{behaviour:?}");
    }
}

/// A Messages upstream whose on-demand compaction fails: the local
/// summarizer, and a valid request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_failure_falls_back_too() {
    let h = Harness::start_with(claude_tiny).await;
    h.fake.set_compact_endpoint(Behaviour::Fail(
        529,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    ));
    let history = signed_history(&h, "Split the date parsing out.").await;
    let thinking: Value = serde_json::from_str(THINKING).unwrap();
    let body = json!({"model": "claude-tiny", "max_tokens": 300, "thinking": thinking,
                      "system": SYSTEM, "messages": history});
    let before = h.fake.received().len();
    let resp = within(
        client()
            .post(format!("{}/messages", h.url()))
            .header("x-api-key", KEY)
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send(),
    )
    .await
    .expect("proxy");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("x-compactor-compacted").is_some());
    let got: Vec<Received> = h.fake.received()[before..].to_vec();
    assert!(got
        .iter()
        .any(|r| anthropic::is_summarizer_request(&r.json())));
    let sent = got
        .iter()
        .rfind(|r| {
            !anthropic::is_summarizer_request(&r.json()) && r.json().get("compaction").is_none()
        })
        .unwrap();
    assert!(anthropic::check(&sent.json(), &sent.headers, None).is_none());
    assert_eq!(
        metric(
            &h,
            "compactor_provider_compaction_fallbacks_total{reason=\"status\"}"
        )
        .await,
        1.0
    );
}

/// `auto` asks an upstream without the endpoint once, then summarizes
/// locally without asking again; one with it is asked each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_asks_once_and_remembers() {
    let h = Harness::start_with(|c| {
        small_window_foreground(c);
        c.compaction.summarizer = Summarizer::Auto;
    })
    .await;
    h.fake.set_compact_endpoint(Behaviour::Fail(
        404,
        json!({"error": {"message": "Not found"}}),
    ));
    let url = format!("{}/responses", h.url());
    for n in 0..3 {
        let items = responses_history(&format!("{TASK} (session {n})"));
        let (status, headers, _) =
            post(&url, KEY, &json!({"model": "tiny-x", "input": items})).await;
        assert_eq!(status, 200);
        assert!(headers.get("x-compactor-compacted").is_some());
    }
    assert_eq!(
        requests_to(&h, "/v1/responses/compact").len(),
        1,
        "asked once"
    );
    let local = h
        .fake
        .received()
        .iter()
        .filter(|r| is_summary_call(r))
        .count();
    assert!(local >= 3, "every compaction summarized locally: {local}");

    // Another model of the same upstream is asked for itself.
    let h2 = Harness::start_with(|c| {
        small_window_foreground(c);
        c.compaction.summarizer = Summarizer::Auto;
    })
    .await;
    for n in 0..2 {
        let items = responses_history(&format!("{TASK} (offered {n})"));
        let (status, _, _) = post(
            &format!("{}/responses", h2.url()),
            KEY,
            &json!({"model": "tiny-x", "input": items}),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        requests_to(&h2, "/v1/responses/compact").len(),
        2,
        "an upstream that compacts is asked every time"
    );
    assert!(!h2.fake.received().iter().any(is_summary_call));
}

/// The upstream refuses (a 4xx) the request compacted with the provider's
/// window: the local summarizer compacts it again in the same request,
/// the provider's compaction no longer applies, and the conversation's
/// next compaction is local too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_provider_compaction_is_replaced_by_a_local_summary() {
    let h = Harness::start_with(provider).await;
    // The request compacted with the provider's window is the first to
    // take a scripted reply (the compaction call is answered apart).
    h.fake.push(Reply::json(
        400,
        json!({"error": {"message": "Invalid 'input[3]': unsupported item", "type": "invalid_request_error"}}),
    ));
    let url = format!("{}/responses", h.url());
    let items = responses_history(TASK);
    let (status, headers, bytes) =
        post(&url, KEY, &json!({"model": "tiny-x", "input": items})).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(headers.get("x-compactor-compacted").is_some());
    let sent = requests_to(&h, "/v1/responses");
    assert_eq!(sent.len(), 2, "the refused request, then the local one");
    let carries_item = |r: &Received| {
        r.json()["input"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["type"] == "compaction")
    };
    assert!(carries_item(&sent[0]));
    assert!(
        !carries_item(&sent[1]),
        "the local summary, not the provider's window"
    );
    assert!(
        sent[1].json()["input"]
            .to_string()
            .contains("[compactor summary"),
        "compacted, not the client's own request"
    );
    assert!(h.fake.received().iter().any(is_summary_call));
    assert_eq!(
        metric(
            &h,
            "compactor_provider_compaction_fallbacks_total{reason=\"refused\"}"
        )
        .await,
        1.0
    );
    let reasons: Vec<String> = column(
        &*h.sql(),
        "SELECT reason FROM compactions ORDER BY created_ms",
    );
    assert_eq!(reasons.len(), 2, "both recorded: {reasons:?}");
    assert!(reasons[0].ends_with("summary by the provider"));
    assert!(reasons[1].contains("refused upstream (400"), "{reasons:?}");

    // The next request of the conversation: the local compaction applies.
    let mut next = items.clone();
    next.push(json!({"type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "Done."}]}));
    next.push(json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "now the tests"}]}));
    let (status, _, _) = post(&url, KEY, &json!({"model": "tiny-x", "input": next})).await;
    assert_eq!(status, 200);
    let last = requests_to(&h, "/v1/responses").pop().unwrap();
    assert!(
        !carries_item(&last),
        "the refused window is not applied again"
    );
    assert_eq!(requests_to(&h, "/v1/responses/compact").len(), 1);
}

/// A short tool output, different every time (the user's turns carry the
/// bulk, which only the summary rung can shrink).
fn bash_output(step: usize) -> String {
    let mut out = format!("$ cargo test step{step}\n");
    for i in 0..60 {
        out.push_str(&format!(
            "test module_{step}::case_{i:02} ... ok (line {i})\n"
        ));
    }
    out.truncate(2500);
    out
}

/// A Claude-Code-shaped loop (thinking on, a Bash tool, a breakpoint on the
/// newest message, the `context_management` edit it sends every turn) with
/// background compaction by the provider, past a small window several
/// times: every answer a 200, every request the upstream received valid by
/// the documented rules (the block with its beta, kept thinking signed),
/// compacted by the provider, the task still carried by the facts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thinking_tool_loop_compacted_by_the_provider_keeps_every_request_valid() {
    const LOOP_TASK: &str = "Task: make every test in crates/ledger pass; keep the public API.";
    let h = Harness::start_with(|c| {
        c.compaction.summarizer = Summarizer::Provider;
        c.models.push(ModelConfig {
            pattern: "claude-tiny*".into(),
            context_window: 9000,
            max_output_tokens: Some(1024),
            ..Default::default()
        });
    })
    .await;
    h.fake.set_messages_window(Some(9000));
    let tools = json!([{"name": "Bash", "description": "Runs a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]);
    let mut history =
        vec![json!({"role": "user", "content": [{"type": "text", "text": LOOP_TASK}]})];
    for step in 0..40 {
        let end_of_turn = step % 4 == 3;
        let answer = if end_of_turn {
            anthropic::Answer::text(&format!("Step {step} done.")).thinking("wrap up")
        } else {
            anthropic::Answer::tool_use(
                &format!("toolu_{step:03}"),
                "Bash",
                json!({"command": format!("cargo test step{step}")}),
            )
            .thinking(&format!("step {step}: run the tests"))
        };
        h.fake.push(Reply::Messages(answer));
        let mut msgs = history.clone();
        if let Some(Value::Array(blocks)) = msgs.last_mut().and_then(|m| m.get_mut("content")) {
            if let Some(Value::Object(b)) = blocks.last_mut() {
                b.insert("cache_control".into(), json!({"type": "ephemeral"}));
            }
        }
        let streamed = step % 2 == 1;
        let body = json!({"model": "claude-tiny-1", "max_tokens": 1024, "system": SYSTEM,
            "tools": tools, "messages": msgs, "stream": streamed, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}});
        let resp = within(
            client()
                .post(format!("{}/messages", h.url()))
                .header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01")
                .header("anthropic-beta", "context-management-2025-06-27")
                .json(&body)
                .send(),
        )
        .await
        .expect("proxy");
        let status = resp.status();
        let bytes = within(resp.bytes()).await.expect("body");
        assert_eq!(
            status,
            200,
            "step {step}: {}",
            String::from_utf8_lossy(&bytes)
        );
        let assistant = if streamed {
            let mut acc = compactor::wire::messages::MessagesCollector::default();
            let text = String::from_utf8_lossy(&bytes).into_owned();
            for event in text.split("\n\n") {
                let name = event.lines().find_map(|l| l.strip_prefix("event: "));
                let data = event.lines().find_map(|l| l.strip_prefix("data: "));
                if let (Some(name), Some(data)) = (name, data) {
                    acc.push(name, data);
                }
            }
            acc.items().remove(0)
        } else {
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            json!({"role": "assistant", "content": v["content"]})
        };
        history.push(assistant.clone());
        if end_of_turn {
            history.push(json!({"role": "user", "content": [{"type": "text",
                "text": format!("Now the next part, after step {step}: {}",
                    "the ledger's CSV import must reject rows whose dates lack an offset. ".repeat(40))}]}));
        } else {
            let id = assistant["content"][1]["id"]
                .as_str()
                .expect("the call")
                .to_string();
            history.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": bash_output(step)}]}));
        }
    }
    let sent: Vec<Received> = requests_to(&h, "/v1/messages");
    let (asked, client_requests): (Vec<&Received>, Vec<&Received>) = sent
        .iter()
        .partition(|r| r.json().get("compaction").is_some());
    for r in &client_requests {
        assert!(
            anthropic::check(&r.json(), &r.headers, None).is_none(),
            "a request the API would refuse went upstream: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
    assert!(!asked.is_empty(), "the provider was asked");
    // Truncate and prune stay local; every summary is the provider's, but
    // for those the provider refused (a compaction request over its own
    // window, as this small one gets), each counted as a fallback.
    let summaries: Vec<String> = column(
        &*h.sql(),
        "SELECT reason FROM compactions WHERE rung IN ('summary', 'fallback')",
    );
    let by_provider = summaries
        .iter()
        .filter(|r| r.ends_with("summary by the provider"))
        .count();
    assert!(by_provider > 0, "{summaries:?}");
    let metrics = h.scrape().await;
    let fell_back: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("compactor_provider_compaction_fallbacks_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(
        (summaries.len() - by_provider) as f64,
        fell_back,
        "{summaries:?}"
    );
    // A refusal is the provider's window's, in either of its wordings (the
    // prompt alone, or with the answer's room): the summary rung runs more
    // often than the cheap rungs at the default target, and a request the
    // hard limit compacts can be over the window as the client sent it.
    for r in &asked {
        let refused = anthropic::check(&r.json(), &r.headers, Some(9000));
        let said = format!("{refused:?}");
        assert!(
            refused.is_none()
                || said.contains("exceed context limit")
                || said.contains("prompt is too long"),
            "{refused:?}"
        );
    }
    let last = client_requests.last().unwrap().json();
    let first = &last["messages"][0];
    let compacted = first["content"][0]["type"] == "compaction"
        || compactor::compaction::items::is_summary(first);
    assert!(compacted, "{first}");
    assert!(
        last.to_string().contains(LOOP_TASK),
        "the facts carry the task"
    );
    assert!(
        anthropic::prompt_tokens(&last) <= 9000,
        "the last request fits"
    );
}
