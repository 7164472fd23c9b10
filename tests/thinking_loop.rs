//! An open tool loop with thinking on whose current tool result is itself
//! larger than the window (Claude Code reading a large file), on
//! `/v1/messages`, against the fake upstream's Messages endpoint, which
//! refuses what the API refuses: the compaction that must escalate to
//! truncating the tail keeps the loop's last assistant message opened by
//! its own thinking block, so no 400 reaches the client and the upstream is
//! asked a bounded number of times; and when truly nothing fits, the client
//! gets the upstream's "too long" once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::anthropic::{self, Answer};
use compactor::fake_upstream::{Received, Reply};
use serde_json::{json, Value};
use support::*;

const KEY: &str = "sk-ant-test-key-0002";

/// The window of `claude-tiny*` models, in the fake's tokens (4 bytes).
const WINDOW: u64 = 9000;

fn tiny_claude(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "claude-tiny*".into(),
        context_window: WINDOW,
        max_output_tokens: Some(1024),
        trigger_ratio: None,
        ..Default::default()
    });
}

/// The proxy, told the window of `claude-tiny*` and compacting only in
/// the foreground, in front of the fake enforcing that window.
async fn start_tiny() -> Harness {
    let h = Harness::start_with(|c| {
        tiny_claude(c);
        c.compaction.background = false;
    })
    .await;
    h.fake.set_messages_window(Some(WINDOW));
    h
}

/// POSTs a Messages request as Claude Code does; status and body.
async fn send(h: &Harness, body: &Value) -> (u16, Vec<u8>) {
    let resp = support::post_messages(h, KEY, "context-management-2025-06-27", body).await;
    let status = resp.status().as_u16();
    let bytes = within(resp.bytes()).await.expect("body");
    (status, bytes.to_vec())
}

fn messages_requests(h: &Harness) -> Vec<Received> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/messages")
        .collect()
}

/// A file's contents of `bytes` bytes, numbered lines, different per `tag`.
fn file_contents(tag: &str, bytes: usize) -> String {
    let mut out = String::new();
    let mut i = 0;
    while out.len() < bytes {
        out.push_str(&format!(
            "{i:>6}\tpub fn {tag}_item_{i}() -> u32 {{ {i} }} // line {i} of {tag}\n"
        ));
        i += 1;
    }
    out
}

/// Claude Code's shape: system and tools with breakpoints, thinking on,
/// the breakpoint on the newest message, its per-turn context edit.
fn body(model: &str, history: &[Value]) -> Value {
    let mut msgs = history.to_vec();
    if let Some(Value::Array(blocks)) = msgs.last_mut().and_then(|m| m.get_mut("content")) {
        if let Some(Value::Object(b)) = blocks.last_mut() {
            b.insert("cache_control".into(), json!({"type": "ephemeral"}));
        }
    }
    json!({"model": model, "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Read", "description": "Reads a file.",
            "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
            "cache_control": {"type": "ephemeral"}}],
        "messages": msgs, "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "{\"session_id\": \"big-read-1\"}"}})
}

/// An agent that reads files: each step one request, answered by a signed
/// thinking block and a `Read` call (scripted), whose result is appended.
struct Reader {
    model: &'static str,
    history: Vec<Value>,
    step: usize,
}

impl Reader {
    fn new(model: &'static str, task: &str) -> Reader {
        Reader {
            model,
            history: vec![json!({"role": "user", "content": [{"type": "text", "text": task}]})],
            step: 0,
        }
    }

    /// Sends the history; the answer (a `Read` call, thinking first) is
    /// appended with a result of `result_bytes`. Status and body.
    async fn step(&mut self, h: &Harness, result_bytes: usize) -> (u16, Vec<u8>) {
        self.step_with(h, result_bytes, None).await
    }

    /// [`Reader::step`], the result's message carrying `text` after its
    /// `tool_result` block (as Claude Code appends reminders).
    async fn step_with(
        &mut self,
        h: &Harness,
        result_bytes: usize,
        text: Option<String>,
    ) -> (u16, Vec<u8>) {
        let step = self.step;
        self.step += 1;
        h.fake.push(Reply::Messages(
            Answer::tool_use(
                &format!("toolu_{step:03}"),
                "Read",
                json!({"file_path": format!("src/part_{step}.rs")}),
            )
            .thinking(&format!("step {step}: read the next part")),
        ));
        let (status, bytes) = send(h, &body(self.model, &self.history)).await;
        if status != 200 {
            return (status, bytes);
        }
        let v: Value = serde_json::from_slice(&bytes).expect("JSON answer");
        let id = v["content"][1]["id"]
            .as_str()
            .expect("the call")
            .to_string();
        self.history
            .push(json!({"role": "assistant", "content": v["content"]}));
        let mut blocks = vec![json!({"type": "tool_result", "tool_use_id": id,
             "content": file_contents(&format!("part{step}"), result_bytes)})];
        blocks.extend(text.map(|t| json!({"type": "text", "text": t})));
        self.history
            .push(json!({"role": "user", "content": blocks}));
        (status, bytes)
    }
}

/// Every request the upstream received for the client keeps the API's
/// rules (the window aside: a "too long" is the proxy's to handle).
fn assert_all_valid(h: &Harness) {
    for r in messages_requests(h) {
        if anthropic::is_summarizer_request(&r.json()) {
            continue;
        }
        if let Some(refusal) = anthropic::check(&r.json(), &r.headers, None) {
            let Reply::Full { body, .. } = refusal else {
                panic!("a refusal is a full answer")
            };
            panic!(
                "a request the API refuses went upstream: {}",
                String::from_utf8_lossy(&body)
            );
        }
    }
}

const TASK: &str = "Task: review src/ for dead code; change nothing.";

/// The proxy knows the window: the request over the hard limit is
/// compacted before it goes, the summary escalates to truncating the tail
/// (the open loop's result is over the window alone), and the request sent
/// keeps the loop's thinking and lets the API drop it. One summarizer call
/// and one request upstream for the step.
#[tokio::test]
async fn a_result_over_the_window_in_an_open_thinking_loop_is_compacted_and_accepted() {
    let h = start_tiny().await;
    let mut agent = Reader::new("claude-tiny-1", TASK);
    for _ in 0..3 {
        let (status, bytes) = agent.step(&h, 2_000).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    }
    // The next result: a file of ~12,500 tokens, over the 9,000 window.
    let (status, bytes) = agent.step(&h, 50_000).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let before = messages_requests(&h).len();
    let (status, bytes) = agent.step(&h, 2_000).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let (sends, summaries) = counted(&h, before);
    assert_eq!(
        (sends, summaries),
        (1, 1),
        "one summary and one request for the step"
    );
    assert_all_valid(&h);
    let sent = h.fake.last().unwrap().json();
    assert!(anthropic::prompt_tokens(&sent) <= WINDOW, "it fits");
    let msgs = sent["messages"].as_array().unwrap();
    let last_assistant = msgs
        .iter()
        .rev()
        .find(|m| m["role"] == "assistant")
        .unwrap();
    assert_eq!(last_assistant["content"][0]["type"], "thinking");
    assert_eq!(
        sent["thinking"]["block_binding"]["prefix_mismatch_behavior"],
        "drop_block"
    );
    // And the conversation goes on.
    let (status, bytes) = agent.step(&h, 2_000).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert_all_valid(&h);
}

/// Requests and summarizer calls the upstream received from `before` on.
fn counted(h: &Harness, before: usize) -> (usize, usize) {
    let step = messages_requests(h).split_off(before);
    let summaries = step
        .iter()
        .filter(|r| anthropic::is_summarizer_request(&r.json()))
        .count();
    (step.len() - summaries, summaries)
}

/// The proxy does not know the window: the upstream's "prompt is too
/// long" is compacted at once (escalating to the tail) and sent again,
/// valid. At most two sends and one summarizer call for the step.
#[tokio::test]
async fn a_result_over_an_unknown_window_is_compacted_on_overflow_and_accepted() {
    let h = Harness::start_with(|c| c.compaction.background = false).await;
    h.fake.set_messages_window(Some(WINDOW));
    let mut agent = Reader::new("claude-wide-1", TASK);
    for _ in 0..3 {
        let (status, bytes) = agent.step(&h, 2_000).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    }
    let (status, _) = agent.step(&h, 50_000).await;
    assert_eq!(status, 200);
    let before = messages_requests(&h).len();
    let (status, bytes) = agent.step(&h, 2_000).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let (sends, summaries) = counted(&h, before);
    assert_eq!(sends, 2, "the refused one and the compacted one");
    assert!(summaries <= 1, "{summaries} summarizer calls");
    assert_all_valid(&h);
    let (status, bytes) = agent.step(&h, 2_000).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert_all_valid(&h);
}

/// Truly nothing fits: the open loop's result message also carries text
/// over the window, which no rung may cut. No summarizer call is paid for,
/// and the client gets the upstream's "too long" once: one request
/// upstream for the step (the proxy knows the window; its compaction
/// cannot fit, so the request goes as sent), not a loop.
#[tokio::test]
async fn when_nothing_fits_the_client_gets_the_upstreams_error_once() {
    let h = start_tiny().await;
    let mut agent = Reader::new("claude-tiny-1", TASK);
    let (status, _) = agent.step(&h, 2_000).await;
    assert_eq!(status, 200);
    let (status, _) = agent
        .step_with(&h, 2_000, Some(file_contents("pasted", 50_000)))
        .await;
    assert_eq!(status, 200);
    let before = messages_requests(&h).len();
    let (status, bytes) = agent.step(&h, 2_000).await;
    let text = String::from_utf8_lossy(&bytes);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("prompt is too long"), "{text}");
    let (sends, summaries) = counted(&h, before);
    assert_eq!((sends, summaries), (1, 0), "one send, no summary");
    assert_all_valid(&h);
    // The proxy keeps serving the conversation.
    let mut other = Reader::new("claude-tiny-1", TASK);
    let (status, _) = other.step(&h, 2_000).await;
    assert_eq!(status, 200);
}
