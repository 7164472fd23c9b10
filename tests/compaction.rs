//! Compaction of Chat Completions conversations through real sockets:
//! background after the trigger, reactive on overflow, cache-stable
//! replacement, tenancy, safety valves, and replay after a restart.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use compactor::compaction::recall;
use compactor::compaction::summary::SUMMARIZER_MARKER;
use compactor::fake_upstream::Reply;
use compactor::wire::Api;
use serde_json::{json, Value};
use support::{
    client_calls, compactions, is_summary_call, last_client_call, last_client_request, post,
    post_raw, small_window, small_window_foreground, wait_compactions, within, Harness,
};

const KEY: &str = "sk-compaction-tests";
const MODEL: &str = "tiny-test";

struct Chat {
    url: String,
    key: String,
    history: Vec<Value>,
    /// Tool definitions sent with every request, if any.
    tools: Option<Value>,
    /// Bodies go pretty-printed (as no serialiser of the proxy writes them).
    pretty: bool,
}

impl Chat {
    fn new(h: &Harness, key: &str) -> Chat {
        Chat {
            url: format!("{}/chat/completions", h.url()),
            key: key.into(),
            history: vec![json!({"role": "system", "content": "You are a careful coding agent."})],
            tools: None,
            pretty: false,
        }
    }

    /// One user turn: sends the whole history, appends the answer.
    async fn turn(&mut self, text: &str) -> (u16, http::HeaderMap, Value) {
        self.history.push(json!({"role": "user", "content": text}));
        let mut request = json!({"model": MODEL, "temperature": 0.5});
        if let Some(tools) = &self.tools {
            request["tools"] = tools.clone();
        }
        request["messages"] = json!(self.history);
        let (status, headers, body) = if self.pretty {
            post_raw(
                &self.url,
                &self.key,
                serde_json::to_vec_pretty(&request).unwrap(),
            )
            .await
        } else {
            post(&self.url, &self.key, &request).await
        };
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status == 200 {
            let content = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default();
            self.history
                .push(json!({"role": "assistant", "content": content}));
        }
        (status, headers, v)
    }
}

fn filler(i: usize) -> String {
    format!(
        "Step {i}: please look at src/module_{i}.rs and explain it. {}",
        "lorem ipsum dolor ".repeat(25)
    )
}

/// About 200 tokens: ten of these turns fill two thirds of the window.
fn big_filler(i: usize) -> String {
    format!(
        "Step {i}: read src/module_{i}.rs and report. {}",
        "sit amet consectetur adipiscing elit ".repeat(22)
    )
}

/// Sends `filler` turns until the store holds a compaction (fewer than 40),
/// pausing between turns for the background job. Returns each turn's status
/// and headers.
async fn grow_until_compacted(h: &Harness, chat: &mut Chat) -> Vec<(u16, http::HeaderMap)> {
    let mut turns = Vec::new();
    while compactions(h) == 0 {
        let (status, headers, _) = chat.turn(&filler(turns.len())).await;
        turns.push((status, headers));
        assert!(turns.len() < 40, "never compacted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    turns
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_the_trigger_compacts_in_the_background_and_rewrites_the_next_request() {
    let h = Harness::start_with(small_window).await;
    let mut chat = Chat::new(&h, KEY);
    chat.history
        .push(json!({"role": "user", "content": "TASK: refactor the parser so that it streams."}));
    chat.history
        .push(json!({"role": "assistant", "content": "Understood."}));
    // Grow until the store holds a compaction (the trigger is ~9 KB of request).
    let turns = grow_until_compacted(&h, &mut chat).await;
    for (i, (status, headers)) in turns.iter().enumerate() {
        assert_eq!(*status, 200);
        // The last turn may already be rewritten: the compaction can be
        // stored between the look at the store and that turn.
        assert!(
            i + 1 == turns.len() || headers.get("x-compactor-compacted").is_none(),
            "nothing compacted yet"
        );
    }
    wait_compactions(&h, 1).await;
    assert!(
        h.fake.received().iter().any(is_summary_call),
        "the summary went through the same upstream"
    );
    let summary_auth = h.fake.received().into_iter().find(is_summary_call).unwrap();
    assert_eq!(
        summary_auth.headers.get("authorization").unwrap(),
        &format!("Bearer {KEY}"),
        "with the client's credentials"
    );
    assert!(summary_auth.json().get("tools").is_none() && summary_auth.json()["stream"] == false);

    let (status, headers, _) = chat.turn("What is the next step?").await;
    assert_eq!(status, 200);
    let id = headers
        .get("x-compactor-compacted")
        .expect("the next request was rewritten")
        .to_str()
        .unwrap()
        .to_string();
    let sent = client_calls(&h).pop().unwrap();
    let msgs = sent["messages"].as_array().unwrap();
    assert_eq!(msgs[0], chat.history[0], "system prompt verbatim");
    let summary = msgs[1]["content"].as_str().unwrap();
    assert!(summary.starts_with("[compactor summary"), "{summary}");
    assert!(
        summary.contains("TASK: refactor the parser so that it streams."),
        "TASK verbatim: {summary}"
    );
    assert!(
        msgs.len() < chat.history.len() - 1,
        "fewer items sent than the client holds"
    );
    assert_eq!(
        msgs.last().unwrap()["content"],
        "What is the next step?",
        "latest user message verbatim"
    );
    // The record says what happened.
    let (rung, before, after, applied): (String, i64, i64, String) = h
        .db()
        .query_row(
            "SELECT c.rung, c.tokens_before, c.tokens_after, e.compaction_id FROM compactions c
             JOIN exchanges e ON e.compaction_id = c.id ORDER BY e.id DESC LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!(applied, id);
    assert_eq!(rung, "summary");
    assert!(after < before, "{before} -> {after}");
}

/// The client's one tool, `read_file`.
fn read_file_tools() -> Value {
    json!([{"type": "function", "function": {"name": "read_file",
        "description": "Reads a file of the workspace.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}])
}

/// A 200k window with a 32k answer (Claude's shape) for `big-*` models.
fn big_window(c: &mut compactor::config::Config) {
    c.models.push(compactor::config::ModelConfig {
        pattern: "big-*".into(),
        context_window: 200_000,
        max_output_tokens: Some(32_000),
        ..Default::default()
    });
}

/// Appends `n` turns of about 500 tokens each (as the fake counts them)
/// to `history`, numbered from `from`.
fn long_turns(history: &mut Vec<Value>, from: usize, n: usize) {
    for i in from..from + n {
        history.push(json!({"role": "user", "content": format!("Step {i}: {}",
            "carry on with the next part of the port and report what changed ".repeat(30))}));
        history.push(
            json!({"role": "assistant", "content": format!("Step {i} done; {}",
            "the tests pass and nothing else changed ".repeat(6))}),
        );
    }
}

/// Compact deep: a long conversation on a 200k window (Claude's shape, a
/// 32k answer) that crosses the trigger restarts small — its system prompt,
/// the summary with the proxy's facts, a few recent user messages and the
/// newest turn: under 25k tokens, the range a client's own compaction
/// restarts at, not the 44–107k the old budgets (40% of the window, 20k of
/// user messages, a 16k tail, a 12k summary) kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_conversation_restarts_small_with_its_task() {
    let h = Harness::start_with(big_window).await;
    let url = format!("{}/chat/completions", h.url());
    let task = "TASK: port the scheduler to async; never touch src/legacy.rs.";
    let mut history = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": task}),
    ];
    // About 140k tokens as the fake counts them (a token per 4 bytes).
    long_turns(&mut history, 0, 270);
    let body = json!({"model": "big-test", "messages": history});
    let size = serde_json::to_vec(&body).unwrap().len() / 4;
    assert!((130_000..160_000).contains(&size), "{size}");
    assert_eq!(post(&url, KEY, &body).await.0, 200);
    wait_compactions(&h, 1).await;
    history.push(json!({"role": "assistant", "content": "Noted."}));
    history.push(json!({"role": "user", "content": "What is the next step?"}));
    let body = json!({"model": "big-test", "messages": history});
    let (status, headers, _) = post(&url, KEY, &body).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let sent = last_client_request(&h);
    let tokens = sent.body.len() / 4;
    assert!(tokens < 25_000, "restarts at {tokens} tokens");
    let text = String::from_utf8_lossy(&sent.body);
    assert!(text.contains(task), "the task kept");
    let msgs = sent.json()["messages"].as_array().unwrap().clone();
    assert_eq!(msgs.last().unwrap()["content"], "What is the next step?");
}

/// The summary call repeats the request the upstream last saw — its
/// messages, tools (the proxy's recall tool among them), sampling
/// parameters and credentials — with one user message appended carrying
/// the summarizer's instructions, so that all it repeats is a prompt-cache
/// read upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_summary_call_repeats_the_request_the_upstream_last_saw() {
    let h = Harness::start_with(big_window).await;
    let url = format!("{}/chat/completions", h.url());
    let tools = read_file_tools();
    let mut history = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": "TASK: port the scheduler to async."}),
    ];
    // Twice past the trigger: the first compaction's request had none
    // applied; the second's went with the first and the recall tool.
    for round in 0..2 {
        long_turns(&mut history, round * 1000, 270);
        let body = json!({"model": "big-test", "temperature": 0.5, "tools": tools,
            "messages": history});
        assert_eq!(post(&url, KEY, &body).await.0, 200);
        wait_compactions(&h, round as i64 + 1).await;
        history.push(json!({"role": "assistant", "content": "Noted."}));
    }
    let received = h.fake.received();
    for (n, i) in received
        .iter()
        .enumerate()
        .filter(|(_, r)| is_summary_call(r))
        .map(|(i, _)| i)
        .enumerate()
    {
        let call = received[i].json();
        // The request before it is the one whose answer triggered it.
        let seen = received[..i]
            .iter()
            .rev()
            .find(|r| !is_summary_call(r))
            .unwrap()
            .json();
        let messages = call["messages"].as_array().unwrap();
        let (last, repeated) = messages.split_last().unwrap();
        assert_eq!(
            repeated,
            seen["messages"].as_array().unwrap().as_slice(),
            "call {n}: the history as sent"
        );
        assert_eq!(last["role"], "user");
        assert!(last["content"]
            .as_str()
            .unwrap()
            .contains(SUMMARIZER_MARKER));
        assert_eq!(call["tools"], seen["tools"], "call {n}: the tools as sent");
        assert_eq!(call["temperature"], seen["temperature"]);
        assert_eq!(call["model"], seen["model"]);
        assert_eq!(call["stream"], false);
        assert_eq!(
            received[i].headers.get("authorization").unwrap(),
            &format!("Bearer {KEY}")
        );
    }
    let reasons: Vec<String> = support::column(&*h.sql(), "SELECT reason FROM compactions");
    assert_eq!(reasons.len(), 2);
    for r in &reasons {
        assert!(r.contains("summary from the cached request"), "{r}");
        assert!(!r.contains("missed"), "{r}");
    }
}

/// On Messages the repeated request keeps what decides the cache and what
/// the body means: the system with its breakpoint, thinking, the client's
/// breakpoints in its messages, `anthropic-beta`; its answer's room is the
/// summary's budget above the thinking budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_summary_call_repeats_system_thinking_breakpoints_and_betas() {
    let h = Harness::start_with(big_window).await;
    let system = json!([{"type": "text", "text": "You are a careful coding agent.",
        "cache_control": {"type": "ephemeral"}}]);
    let mut history = vec![json!({"role": "user", "content": "TASK: port the scheduler."})];
    long_turns(&mut history, 0, 270);
    history.push(
        json!({"role": "user", "content": [{"type": "text", "text": "Go on.",
        "cache_control": {"type": "ephemeral"}}]}),
    );
    let body = json!({"model": "big-test", "max_tokens": 32000, "system": system,
        "thinking": {"type": "enabled", "budget_tokens": 2048}, "messages": history});
    let resp = support::post_messages(&h, KEY, "context-management-2025-06-27", &body).await;
    assert_eq!(resp.status(), 200);
    wait_compactions(&h, 1).await;
    let received = h.fake.received();
    let call = received
        .iter()
        .find(|r| is_summary_call(r))
        .expect("a summary call");
    let seen = received
        .iter()
        .find(|r| !is_summary_call(r))
        .unwrap()
        .json();
    let v = call.json();
    assert_eq!(v["system"], seen["system"], "the system and its breakpoint");
    assert_eq!(v["thinking"], seen["thinking"]);
    let messages = v["messages"].as_array().unwrap();
    let (last, repeated) = messages.split_last().unwrap();
    assert_eq!(repeated, seen["messages"].as_array().unwrap().as_slice());
    assert!(last["content"][0]["text"]
        .as_str()
        .unwrap()
        .contains(SUMMARIZER_MARKER));
    assert!(
        last["content"][0].get("cache_control").is_none(),
        "no breakpoint of its own"
    );
    let max = v["max_tokens"].as_u64().unwrap();
    assert!(max > 2048 && max < 32000, "{max}");
    assert_eq!(
        call.headers["anthropic-beta"],
        "context-management-2025-06-27"
    );
    assert_eq!(call.headers["x-api-key"], KEY);
    let reason: String = support::column(&*h.sql(), "SELECT reason FROM compactions")
        .pop()
        .unwrap();
    assert!(
        reason.ends_with("summary from the cached request"),
        "{reason}"
    );
}

/// A summary asked of the repeated request that answers with a tool call
/// is not used: the summarizer's own call writes it, and the compaction's
/// reason says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_for_a_summary_falls_back_to_the_summarizers_own_call() {
    let h = Harness::start_with(big_window).await;
    let url = format!("{}/chat/completions", h.url());
    let tools = read_file_tools();
    let mut history = vec![json!({"role": "user", "content": "TASK: port the scheduler."})];
    long_turns(&mut history, 0, 270);
    // The client's answer, then the repeated request's: a tool call.
    h.fake.push(Reply::chat("Done.", 140_000, 5));
    h.fake.push(Reply::chat_tool_calls(
        &[("call_s", "read_file", "{\"path\":\"a\"}")],
        140_000,
        9,
    ));
    let body = json!({"model": "big-test", "tools": tools, "messages": history});
    assert_eq!(post(&url, KEY, &body).await.0, 200);
    wait_compactions(&h, 1).await;
    let calls = support::summary_calls(&h);
    assert_eq!(
        calls.len(),
        2,
        "the repeated request, then the summarizer's own call"
    );
    assert!(calls[1]["messages"][0]["content"]
        .as_str()
        .unwrap()
        .contains(SUMMARIZER_MARKER));
    assert!(calls[1].get("tools").is_none());
    let (rung, reason): (String, String) = h
        .db()
        .query_row("SELECT rung, reason FROM compactions", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!(rung, "summary");
    assert!(
        reason.ends_with("summary from the cached request missed: tool_call"),
        "{reason}"
    );
    assert!(h
        .scrape()
        .await
        .contains("compactor_summary_failures_total 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replacement_is_byte_identical_on_every_later_request() {
    let h = Harness::start_with(small_window).await;
    let mut chat = Chat::new(&h, KEY);
    grow_until_compacted(&h, &mut chat).await;
    let mut bodies = Vec::new();
    for q in ["short question one", "short question two", "three"] {
        let (status, headers, _) = chat.turn(q).await;
        assert_eq!(status, 200);
        assert!(headers.get("x-compactor-compacted").is_some());
        bodies.push(last_client_request(&h).body);
    }
    // The bytes up to the end of the replacement are the same every time, so
    // the upstream's prompt cache keeps hitting.
    let first = String::from_utf8(bodies[0].to_vec()).unwrap();
    let cut = first.find("short question one").unwrap();
    for b in &bodies[1..] {
        assert_eq!(&b[..cut], &bodies[0][..cut]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflow_answer_is_compacted_and_retried_transparently() {
    let h = Harness::start_with(small_window_foreground).await;
    let mut chat = Chat::new(&h, KEY);
    for i in 0..10 {
        assert_eq!(chat.turn(&big_filler(i)).await.0, 200);
    }
    h.fake.push(Reply::context_length_exceeded());
    let (status, headers, body) = chat.turn("and now?").await;
    assert_eq!(status, 200, "the client never sees the overflow: {body}");
    assert!(headers.get("x-compactor-compacted").is_some());
    let calls = client_calls(&h);
    let (failed, retried) = (&calls[calls.len() - 2], &calls[calls.len() - 1]);
    assert!(
        retried["messages"].as_array().unwrap().len()
            < failed["messages"].as_array().unwrap().len()
    );
    assert_eq!(
        retried["messages"].as_array().unwrap().last().unwrap()["content"],
        "and now?"
    );
    let reason: String = h
        .db()
        .query_row("SELECT reason FROM compactions", [], |r| r.get(0))
        .unwrap();
    assert!(reason.starts_with("overflow"), "{reason}");

    // Streamed requests too (another conversation, llama.cpp's wording):
    // the overflow comes as an HTTP error before any event.
    let mut other = Chat::new(&h, "sk-other");
    for i in 0..10 {
        other.turn(&big_filler(i)).await;
    }
    h.fake.push(Reply::json(
        400,
        json!({"error": {"code": 400, "message": "request (4601 tokens) exceeds the available context size (2048 tokens), try increasing it", "type": "exceed_context_size_error"}}),
    ));
    other
        .history
        .push(json!({"role": "user", "content": "stream it"}));
    let (status, headers, body) = post(
        &other.url,
        "sk-other",
        &json!({"model": MODEL, "stream": true, "messages": other.history}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    // The compacted retry asks for usage, and the client never sees it.
    let retried = last_client_call(&h);
    assert_eq!(retried["stream_options"]["include_usage"], true);
    assert!(!String::from_utf8_lossy(&body).contains("\"usage\""));
}

/// A summarizer answer with every mandatory section.
fn valid_narrative() -> Reply {
    let text = compactor::compaction::summary::NARRATIVE_SECTIONS
        .iter()
        .map(|s| format!("## {s}\n- noted\n"))
        .collect::<String>();
    Reply::chat(&text, 100, 60)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_retry_still_overflows_the_client_gets_the_upstreams_error() {
    let h = Harness::start_with(small_window_foreground).await;
    let mut chat = Chat::new(&h, KEY);
    for i in 0..10 {
        chat.turn(&big_filler(i)).await;
    }
    let overflow = Reply::context_length_exceeded();
    // First attempt overflows, the summary call succeeds, the retry
    // overflows; compacted again (each retry aims below the size refused
    // before it), the second retry overflows too.
    h.fake.push(overflow.clone());
    h.fake.push(valid_narrative());
    h.fake.push(overflow.clone());
    h.fake.push(valid_narrative());
    h.fake.push(overflow.clone());
    chat.history
        .push(json!({"role": "user", "content": "again"}));
    let (status, _, resp) = post(
        &chat.url,
        KEY,
        &json!({"model": MODEL, "messages": chat.history}),
    )
    .await;
    let Reply::Full { body: expected, .. } = overflow else {
        unreachable!()
    };
    assert_eq!(status, 400);
    assert_eq!(resp, expected, "the upstream's own error, verbatim");
    assert_eq!(client_calls(&h).len(), 10 + 3, "two retries, no more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_never_applies_to_another_tenant() {
    let h = Harness::start_with(small_window).await;
    let mut alice = Chat::new(&h, "sk-alice");
    grow_until_compacted(&h, &mut alice).await;
    // A new user message: a turn boundary, where a waiting compaction applies.
    alice
        .history
        .push(json!({"role": "user", "content": "and now?"}));
    // Bob sends Alice's history byte for byte.
    let (status, headers, _) = post(
        &alice.url,
        "sk-bob",
        &json!({"model": MODEL, "messages": alice.history}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_none());
    let sent = client_calls(&h).pop().unwrap();
    assert_eq!(
        sent["messages"].as_array().unwrap().len(),
        alice.history.len(),
        "sent uncompacted"
    );
    // Alice sending the same gets her compaction.
    let (_, headers, _) = post(
        &alice.url,
        "sk-alice",
        &json!({"model": MODEL, "messages": alice.history}),
    )
    .await;
    assert!(headers.get("x-compactor-compacted").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_request_the_upstream_refuses_is_resent_uncompacted() {
    let h = Harness::start_with(small_window).await;
    let mut chat = Chat::new(&h, KEY);
    grow_until_compacted(&h, &mut chat).await;
    h.fake.push(Reply::json(400, json!({"error": {"message": "Invalid 'messages[1]'", "type": "invalid_request_error", "code": null}})));
    let (status, headers, _) = chat.turn("next").await;
    assert_eq!(
        status, 200,
        "compaction must not turn a success into a failure"
    );
    assert!(headers.get("x-compactor-compacted").is_none());
    let sent = client_calls(&h).pop().unwrap();
    assert_eq!(
        sent["messages"].as_array().unwrap().len(),
        chat.history.len() - 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_summarizer_falls_back_to_extracted_facts() {
    let h = Harness::start_with(small_window_foreground).await;
    let mut chat = Chat::new(&h, KEY);
    chat.history
        .push(json!({"role": "user", "content": "TASK: make the tests pass"}));
    chat.history.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": "{\"path\":\"src/auth.py\",\"content\":\"def login():\\n    return True\\n\"}"}}]}));
    chat.history
        .push(json!({"role": "tool", "tool_call_id": "c1", "content": "ok"}));
    for i in 0..10 {
        chat.turn(&big_filler(i)).await;
    }
    h.fake.push(Reply::context_length_exceeded());
    // Both summary attempts fail: one error, one answer without the sections.
    h.fake
        .push(Reply::json(500, json!({"error": {"message": "boom"}})));
    h.fake.push(Reply::chat("I cannot summarize.", 10, 3));
    let (status, headers, _) = chat.turn("continue").await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let (rung, summary): (String, String) = h
        .db()
        .query_row("SELECT rung, summary FROM compactions", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!(rung, "fallback");
    assert!(summary.contains("TASK: make the tests pass"), "{summary}");
    assert!(
        summary.contains("src/auth.py") && summary.contains("return True"),
        "file state kept: {summary}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_rewrites_its_history_is_backed_off() {
    let h = Harness::start_with(small_window).await;
    let url = format!("{}/chat/completions", h.url());
    // Like aider: every turn re-wraps earlier messages, so no compaction ever matches.
    for turn in 0..16 {
        let msgs: Vec<Value> = std::iter::once(json!({"role": "system", "content": format!("system, reminder {turn}")}))
            .chain((0..12).map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("{} (v{turn})", big_filler(i))})))
            .collect();
        let (status, headers, _) =
            post(&url, KEY, &json!({"model": MODEL, "messages": msgs})).await;
        assert_eq!(status, 200);
        assert!(headers.get("x-compactor-compacted").is_none());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let compactions = compactions(&h);
    assert!(compactions >= 2, "it did try: {compactions}");
    assert!(
        compactions <= 8,
        "but backed off instead of compacting every turn: {compactions}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_after_a_restart_rewrites_exactly_as_before() {
    let mut h = Harness::start_with(small_window).await;
    let mut chat = Chat::new(&h, KEY);
    grow_until_compacted(&h, &mut chat).await;
    let (_, headers, _) = chat.turn("before restart").await;
    let id = headers.get("x-compactor-compacted").unwrap().clone();
    let before = last_client_request(&h);
    // Same history again after a restart on the same store.
    chat.history.truncate(chat.history.len() - 2);
    h.stop().await;
    let config = h.state.config.clone();
    let (fake, db) = (h.fake.clone(), h.db.clone());
    let dir = std::mem::replace(&mut h.dir, tempfile::tempdir().unwrap());
    drop(h);
    let h2 = Harness::start_on(fake, dir, db, config).await;
    chat.url = format!("{}/chat/completions", h2.url());
    let (status, headers, _) = chat.turn("before restart").await;
    assert_eq!(status, 200);
    assert_eq!(headers.get("x-compactor-compacted"), Some(&id));
    let after = last_client_request(&h2);
    assert_eq!(
        after.body, before.body,
        "byte-identical request after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_compaction_applies_to_the_next_request() {
    let h = Harness::start_with(small_window_foreground).await;
    let mut chat = Chat::new(&h, KEY);
    let mut conv = String::new();
    for i in 0..10 {
        let (_, headers, _) = chat.turn(&big_filler(i)).await;
        conv = headers
            .get("x-compactor-conversation")
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
    }
    assert!(h.state.compactions.request_manual(&conv).expect("kept"));
    let (status, headers, _) = chat.turn("compact now please").await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let reason: String = h
        .db()
        .query_row("SELECT reason FROM compactions", [], |r| r.get(0))
        .unwrap();
    assert_eq!(reason, "manual");
    // Kept by conversation in this process: the tenant is not looked at.
    assert!(!h.state.compactions.take_manual("any", &conv), "used up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_hard_limit_waits_for_the_compaction_under_way() {
    let h = Harness::start_with(small_window).await;
    let mut chat = Chat::new(&h, KEY);
    // Grow to just past the trigger, with a slow summarizer scripted for the
    // background job that the crossing answer starts.
    let mut i = 0;
    loop {
        let (_, _, v) = chat.turn(&big_filler(i)).await;
        i += 1;
        if v["usage"]["prompt_tokens"].as_u64().unwrap() >= 2025 {
            break;
        }
        assert!(i < 30);
    }
    let slow = Duration::from_millis(1500);
    h.fake.push(Reply::Delay(slow, Box::new(valid_narrative())));
    // The next request is far over the hard limit (3000 - 300 tokens).
    let huge = format!(
        "Here is the whole log: {}",
        "trace line with details ".repeat(600)
    );
    let started = std::time::Instant::now();
    let (status, headers, _) = chat.turn(&huge).await;
    let waited = started.elapsed();
    assert_eq!(status, 200);
    assert!(
        headers.get("x-compactor-compacted").is_some(),
        "it went out compacted"
    );
    assert!(
        waited >= slow / 2,
        "it waited for the compaction ({waited:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_hard_limit_with_nothing_under_way_is_compacted_before_it_goes_out() {
    let h = Harness::start_with(small_window).await;
    // A client arriving with a long history the proxy has never seen
    // (another proxy's restart, a resumed session): no usage to go by.
    let mut history = vec![json!({"role": "system", "content": "You are a careful coding agent."})];
    for i in 0..24 {
        history.push(json!({"role": "user", "content": big_filler(i)}));
        history.push(json!({"role": "assistant", "content": format!("Done with step {i}.")}));
    }
    history.push(json!({"role": "user", "content": "What next?"}));
    let url = format!("{}/chat/completions", h.url());
    let (status, headers, _) = post(&url, KEY, &json!({"model": MODEL, "messages": history})).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let calls = client_calls(&h);
    assert_eq!(calls.len(), 1, "one request upstream, already compacted");
    assert!(calls[0]["messages"].as_array().unwrap().len() < history.len());
    let reason: String = h
        .db()
        .query_row("SELECT reason FROM compactions", [], |r| r.get(0))
        .unwrap();
    assert!(reason.starts_with("hard_limit"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hard_limit_is_checked_in_the_upstreams_tokens() {
    use compactor::engine::{check_fit, Fit, FitCheck};
    use std::sync::Arc;
    let h = Harness::start_with(small_window).await;
    let view: Arc<compactor::wire::items::ItemList> = Arc::new(
        (0..14)
            .map(|i| json!({"role": "user", "content": big_filler(i)}))
            .collect::<Vec<Value>>()
            .into(),
    );
    let estimate = compactor::engine::estimate_view(&h.state, view.clone(), None).await;
    assert!(
        estimate < 2700 && estimate * 2 > 2700,
        "test premise: {estimate}"
    );
    let fit = |conv: &'static str| {
        let check = FitCheck {
            tenant: "t",
            conversation: conv,
            model: MODEL,
            view: view.clone(),
            hashes: None,
            tools: None,
            bytes: None,
        };
        check_fit(&h.state, check)
    };
    assert_eq!(
        within(fit("c")).await,
        Fit::Fits,
        "by the proxy's own tokenizer it fits"
    );
    // This upstream counted twice as many tokens as the proxy estimated.
    h.state
        .compactions
        .calibrate("t", "c", 2 * estimate, estimate);
    match within(fit("c")).await {
        Fit::Over(tokens) => assert_eq!(tokens, 2 * estimate),
        other => panic!("expected Over, got {other:?}"),
    }
    assert_eq!(
        within(fit("other")).await,
        Fit::Fits,
        "calibration is per conversation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_binary_rewrites_exactly_as_before_after_kill_9_and_a_restart() {
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("replay.db");
    let config = dir.path().join("proxy.toml");
    std::fs::write(
        &config,
        format!(
            "[upstream]\nbase_url = \"{}\"\n[store]\npath = \"{}\"\n\
             [[models]]\nmatch = \"tiny*\"\ncontext_window = 3000\nmax_output_tokens = 300\n",
            fake.url(),
            db.display()
        ),
    )
    .unwrap();
    let start = || {
        let port = support::free_port();
        (
            support::spawn_binary(port, &["--config".as_ref(), config.as_os_str()]),
            port,
        )
    };
    let compactions = || {
        rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| {
                c.query_row("SELECT count(*) FROM compactions", [], |r| {
                    r.get::<_, i64>(0)
                })
            })
            .unwrap_or(0)
    };
    let last_upstream_body = || {
        fake.received()
            .into_iter()
            .rev()
            .find(|r| !support::is_summary_call(r))
            .expect("a client call")
            .body
    };
    let (mut child, port) = start();
    let mut history = vec![json!({"role": "system", "content": "You are a careful coding agent."})];
    let mut turns = 0;
    while compactions() == 0 {
        history.push(json!({"role": "user", "content": big_filler(turns)}));
        let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
        let (status, _, body) =
            post(&url, KEY, &json!({"model": MODEL, "messages": history})).await;
        assert_eq!(status, 200);
        let answer: Value = serde_json::from_slice(&body).unwrap();
        history.push(
            json!({"role": "assistant", "content": answer["choices"][0]["message"]["content"]}),
        );
        turns += 1;
        assert!(turns < 40, "never compacted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    history.push(json!({"role": "user", "content": "before and after the restart"}));
    let request = json!({"model": MODEL, "messages": history});
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let (status, headers, _) = post(&url, KEY, &request).await;
    assert_eq!(status, 200);
    let id = headers
        .get("x-compactor-compacted")
        .expect("rewritten before the restart")
        .clone();
    let before = last_upstream_body();
    // SIGKILL: nothing flushed, nothing handed over; only the store remains.
    child.kill().unwrap();
    child.wait().unwrap();
    let (mut child, port) = start();
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let (status, headers, _) = post(&url, KEY, &request).await;
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        headers.get("x-compactor-compacted"),
        Some(&id),
        "the same compaction, replayed"
    );
    assert_eq!(
        last_upstream_body(),
        before,
        "byte-identical request after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_request_keeps_the_clients_parameters_and_tools_in_place() {
    let h = Harness::start_with(small_window).await;
    let mut chat = Chat::new(&h, KEY);
    let tools = read_file_tools();
    chat.tools = Some(tools.clone());
    grow_until_compacted(&h, &mut chat).await;
    wait_compactions(&h, 1).await;
    let (status, headers, _) = chat.turn("one more step").await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let sent = last_client_call(&h);
    // The client's definitions unchanged and first, the proxy's recall
    // tool after them.
    let mut with_recall = tools.as_array().unwrap().clone();
    with_recall.push(recall::definition(Api::Chat));
    assert_eq!(
        sent["tools"],
        json!(with_recall),
        "the client's tools, then recall"
    );
    assert_eq!(sent["temperature"], 0.5);
    assert_eq!(
        support::keys(&sent),
        ["model", "temperature", "tools", "messages"],
        "in the client's order"
    );
}

/// The proxy's own tool never comes and goes within a conversation: a
/// text-only history (summaries, nothing archived) is offered
/// `compactor_recall` from its first compacted request on, and every later
/// compacted request, past a second compaction too, sends the tool
/// definitions as the same bytes, so what a prompt cache keyed on them
/// holds stays valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_definitions_keep_their_bytes_across_compactions() {
    let h = Harness::start_with(small_window).await;
    let mut chat = Chat::new(&h, KEY);
    chat.tools = Some(read_file_tools());
    grow_until_compacted(&h, &mut chat).await;
    let tools_sent = |h: &Harness| {
        let sent = last_client_request(h).json();
        serde_json::to_vec(&sent["tools"]).unwrap()
    };
    let (status, headers, _) = chat.turn("one more step").await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let first = tools_sent(&h);
    let names: Vec<String> = serde_json::from_slice::<Value>(&first)
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        ["read_file", recall::TOOL],
        "offered though nothing is archived"
    );
    let mut turns = 0;
    while compactions(&h) < 2 {
        let (status, headers, _) = chat.turn(&filler(100 + turns)).await;
        assert_eq!(status, 200);
        assert!(headers.get("x-compactor-compacted").is_some());
        assert_eq!(tools_sent(&h), first, "turn {turns}: the same bytes");
        turns += 1;
        assert!(turns < 40, "never compacted again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, headers, _) = chat.turn("and the next step").await;
    assert_eq!(status, 200);
    let applied = headers
        .get("x-compactor-compacted")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let second: String = support::column(
        &*h.sql(),
        "SELECT id FROM compactions ORDER BY created_ms DESC LIMIT 1",
    )
    .pop()
    .unwrap();
    assert!(
        applied.contains(&second),
        "the second compaction applies: {applied}"
    );
    assert_eq!(
        tools_sent(&h),
        first,
        "after the second compaction: the same bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_request_goes_as_the_clients_bytes_with_the_replacement_in_place() {
    let h = Harness::start_with(small_window).await;
    let mut chat = Chat::new(&h, KEY);
    chat.pretty = true;
    grow_until_compacted(&h, &mut chat).await;
    wait_compactions(&h, 1).await;
    let (status, headers, _) = chat.turn("one more step").await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let sent = last_client_request(&h).body;
    // What the client sent, pretty-printed as the proxy never writes JSON.
    let mut request = json!({"model": MODEL, "temperature": 0.5});
    request["messages"] = json!(chat.history[..chat.history.len() - 1]);
    let client = serde_json::to_vec_pretty(&request).unwrap();
    let text = String::from_utf8(client.clone()).unwrap();
    // The bytes before the first item and from the last user message on
    // are the client's, byte for byte: nothing was rebuilt.
    let first_item = text.find("\"messages\": [").unwrap() + "\"messages\": [".len();
    let first_item = first_item + text[first_item..].find('{').unwrap();
    let last = text.rfind("{\n      \"role\": \"user\"").unwrap();
    assert!(
        sent.starts_with(&client[..first_item]),
        "the client's bytes up to its items"
    );
    assert!(
        sent.ends_with(&client[last..]),
        "the client's bytes of what is kept"
    );
    assert!(
        sent.len() < client.len(),
        "the history it covers is replaced"
    );
    let sent: Value = serde_json::from_slice(&sent).expect("JSON");
    let messages = sent["messages"].as_array().unwrap();
    assert_eq!(messages[0], chat.history[0], "the system prompt leads");
    assert_eq!(messages.last().unwrap()["content"], "one more step");
    assert!(
        messages.len() < chat.history.len() - 1,
        "fewer messages than the client's {}",
        chat.history.len() - 1
    );
}

/// llama.cpp's answer when a request does not fit its `-c`.
fn llama_overflow(requested: u64, n_ctx: u64) -> Reply {
    Reply::json(
        400,
        json!({"error": {"code": 400, "message": format!("request ({requested} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"),
                         "type": "exceed_context_size_error", "n_prompt_tokens": requested, "n_ctx": n_ctx}}),
    )
}

/// The admin API's windows, as (model, window, source).
async fn admin_windows(h: &Harness) -> Vec<(String, u64, String)> {
    let v: Value = h.get_json("/admin/api/windows").await;
    v["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["model"].as_str().unwrap().to_string(),
                m["context_window"].as_u64().unwrap(),
                m["source"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_the_upstream_states_is_learned_used_and_remembered() {
    // The table knows nothing of this model's real window (128k by default).
    let mut h = Harness::start_with(|c| c.compaction.background = false).await;
    let mut chat = Chat::new(&h, KEY);
    for i in 0..6 {
        chat.turn(&big_filler(i)).await;
    }
    h.fake.push(llama_overflow(2052, 2048));
    let (status, headers, _) = chat.turn("and now?").await;
    assert_eq!(status, 200, "the client never sees the overflow");
    assert!(headers.get("x-compactor-compacted").is_some());
    let windows = admin_windows(&h).await;
    assert!(
        windows.contains(&(MODEL.to_string(), 2048, "learned".to_string())),
        "{windows:?}"
    );
    let metrics = h.scrape().await;
    assert!(
        metrics.contains(&format!(
            "compactor_model_context_window{{model=\"{MODEL}\",source=\"learned\"}} 2048"
        )),
        "{metrics}"
    );
    // The next requests are checked against it before they go out.
    let reason: String = h
        .db()
        .query_row(
            "SELECT reason FROM compactions ORDER BY created_ms DESC LIMIT 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(reason.starts_with("overflow"), "{reason}");
    // Remembered across a restart.
    h.stop().await;
    let config = h.state.config.clone();
    let h2 = Harness::start_on(h.fake.clone(), h.dir, h.db.clone(), config).await;
    let windows = admin_windows(&h2).await;
    assert!(
        windows.contains(&(MODEL.to_string(), 2048, "learned".to_string())),
        "{windows:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflow_while_the_tail_holds_most_of_the_request_is_compacted_anyway() {
    // No [[models]] entry: the table's 128k window gives the ladder a
    // verbatim tail of 16k tokens, which holds the whole current turn.
    let h = Harness::start_with(|c| c.compaction.background = false).await;
    let mut chat = Chat::new(&h, KEY);
    chat.turn("Fix the failing build, please.").await;
    // One turn of tool calls whose outputs fill the window: everything
    // compactable sits inside the ladder's verbatim tail.
    chat.history
        .push(json!({"role": "user", "content": "Run the tests and fix them."}));
    for k in 0..4 {
        let id = format!("call_{k}");
        chat.history.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "shell", "arguments": "{\"cmd\":\"cargo test\"}"}}]}));
        chat.history.push(json!({"role": "tool", "tool_call_id": id,
            "content": format!("test output {k}: {}", "error[E0308]: mismatched types at src/lib.rs ".repeat(50))}));
    }
    // Refused with no figures at all (OpenAI's Responses wording).
    h.fake.push(Reply::json(400, json!({"error": {"message": "Your input exceeds the context window of this model. Please adjust your input and try again.",
        "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}})));
    let before = h.fake.received().len();
    let (status, headers, _) = post(
        &chat.url,
        KEY,
        &json!({"model": MODEL, "messages": chat.history}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let summary_calls = h.fake.received()[before..]
        .iter()
        .filter(|r| is_summary_call(r))
        .count();
    assert!(summary_calls <= 2, "{summary_calls}");
    let (reason, after): (String, i64) = h
        .db()
        .query_row("SELECT reason, tokens_after FROM compactions", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert!(reason.contains("escalated"), "{reason} (after {after})");
    // The retry went with the pending tool batch and the newest user message.
    let sent = last_client_call(&h);
    let messages = sent["messages"].as_array().unwrap();
    assert_eq!(messages.last().unwrap()["tool_call_id"], "call_3");
    assert!(messages
        .iter()
        .any(|m| m["content"] == "Run the tests and fix them."));
    assert!(after > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_core_cannot_fit_gets_the_error_at_once_without_a_summary_call() {
    let h = Harness::start_with(small_window_foreground).await;
    let mut chat = Chat::new(&h, KEY);
    chat.turn("hello").await;
    // The newest user message alone is over the window.
    let huge = "every token matters ".repeat(900);
    chat.history.push(json!({"role": "user", "content": huge}));
    h.fake.push(llama_overflow(3700, 2800));
    let before = h.fake.received().len();
    let (status, _, body) = post(
        &chat.url,
        KEY,
        &json!({"model": MODEL, "messages": chat.history}),
    )
    .await;
    assert_eq!(status, 400, "the upstream's error, relayed");
    assert!(String::from_utf8_lossy(&body).contains("exceeds the available context size"));
    let after: Vec<_> = h.fake.received()[before..].to_vec();
    assert!(
        after.iter().all(|r| !is_summary_call(r)),
        "no summarizer call"
    );
    assert_eq!(compactions(&h), 0);
    let metrics = h.scrape().await;
    assert!(
        metrics.contains("compactor_unfittable_total{goal=\"overflow\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_history_costs_a_bounded_number_of_summarizer_calls() {
    let h = Harness::start_with(small_window_foreground).await;
    // A 0.88 MB history the proxy has never seen, far over the window.
    let mut history = vec![json!({"role": "system", "content": "You are a careful coding agent."})];
    let mut i = 0;
    while serde_json::to_string(&history).unwrap().len() < 880_000 {
        history.push(json!({"role": "user", "content": big_filler(i)}));
        history.push(json!({"role": "assistant", "content": format!("Done with step {i}: {}", "the module parses its input ".repeat(40))}));
        i += 1;
    }
    history.push(json!({"role": "user", "content": "What next?"}));
    let url = format!("{}/chat/completions", h.url());
    let before = h.fake.received().len();
    let (status, headers, _) = post(&url, KEY, &json!({"model": MODEL, "messages": history})).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let calls = h.fake.received()[before..]
        .iter()
        .filter(|r| is_summary_call(r))
        .count();
    eprintln!("summarizer calls for one 0.88 MB request: {calls}");
    assert!(
        (1..=8).contains(&calls),
        "compaction.max_summary_calls defaults to 8: {calls}"
    );
    let (stored_calls, tokens): (i64, i64) = h
        .db()
        .query_row(
            "SELECT summary_calls, summary_tokens FROM compactions",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(stored_calls as usize, calls);
    assert!(tokens > 0);
    let metrics = h.scrape().await;
    assert!(
        metrics.contains(&format!("compactor_summary_calls_total {calls}\n")),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("compactor_summary_tokens_total {tokens}\n")),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_codex_first_request_over_a_small_window_is_relayed_with_no_summarizer_call() {
    let h = Harness::start_with(|c| c.compaction.background = false).await;
    // Codex's first request: long instructions, many tools, a developer
    // message, the environment context and the prompt.
    let tools: Vec<Value> = (0..30)
        .map(|k| json!({"type": "function", "name": format!("tool_{k}"),
            "description": "Runs a command in the workspace and returns what it printed. ".repeat(6),
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}))
        .collect();
    let body = json!({
        "model": MODEL,
        "instructions": "You are Codex, a coding agent. Follow the repository's conventions. ".repeat(220),
        "tools": tools,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>read-only sandbox</permissions> ".repeat(40)}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": format!("<environment_context>{}</environment_context>", "cwd=/work shell=bash ".repeat(30))}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the failing test"}]},
        ],
    });
    h.fake.push(llama_overflow(4571, 4096));
    let before = h.fake.received().len();
    let started = std::time::Instant::now();
    let (status, _, resp) = post(&format!("{}/responses", h.url()), KEY, &body).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&resp));
    let received = h.fake.received()[before..].to_vec();
    let summary_calls = received.iter().filter(|r| is_summary_call(r)).count();
    eprintln!(
        "codex first request over 4096: {summary_calls} summarizer calls, {} upstream requests, {:?}",
        received.len(),
        started.elapsed()
    );
    assert_eq!(summary_calls, 0);
    assert_eq!(received.len(), 1, "relayed at once, no retry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_window_is_discovered_at_its_first_request_and_a_silent_upstream_delays_nothing_long(
) {
    let h = Harness::start_with(|c| c.upstream.discover_windows = true).await;
    // vLLM's `/v1/models` names the window it serves.
    h.fake.push(Reply::json(
        200,
        json!({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}),
    ));
    let mut chat = Chat::new(&h, KEY);
    let (status, _, _) = chat.turn("hello").await;
    assert_eq!(status, 200);
    let received = h.fake.received();
    assert_eq!(
        (received[0].method.as_str(), received[0].path.as_str()),
        ("GET", "/v1/models")
    );
    assert!(
        admin_windows(&h)
            .await
            .contains(&(MODEL.to_string(), 4096, "discovered".to_string())),
        "{:?}",
        admin_windows(&h).await
    );
    // Asked once per model.
    chat.turn("again").await;
    let gets = h
        .fake
        .received()
        .iter()
        .filter(|r| r.method == http::Method::GET)
        .count();
    assert_eq!(gets, 1);

    // Another model, and an upstream that does not answer: the request goes
    // on after the time box.
    h.fake.push(Reply::Delay(
        Duration::from_secs(8),
        Box::new(Reply::json(200, json!({"data": []}))),
    ));
    let started = std::time::Instant::now();
    let (status, _, _) = post(
        &chat.url,
        KEY,
        &json!({"model": "other-model", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(6),
        "discovery is time-boxed ({waited:?})"
    );
}

/// The estimate after an answer is made where something reads it: the
/// calibration it feeds matters from half the trigger on, and the next
/// request's fit check needs token counts once its bytes do not clear the
/// hard limit alone. A conversation far from both, whose usage was
/// reported, is not tokenized after each answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_estimate_after_an_answer_is_made_only_where_it_is_read() {
    // 100 000 tokens: the trigger at 75 000, half of it 37 500; the hard
    // limit at 99 000, half of it 49 500 bytes.
    let h = Harness::start_with(|c| {
        c.models.push(compactor::config::ModelConfig {
            pattern: "roomy*".into(),
            context_window: 100_000,
            max_output_tokens: Some(1_000),
            ..Default::default()
        });
    })
    .await;
    let url = format!("{}/chat/completions", h.url());
    // Three conversations, each one exchange: usage far below half the
    // trigger; usage past it; a body past half the hard limit in bytes.
    let bodies = [
        ("far", "Summarise the build log.".to_string(), 1_200),
        ("near", "Summarise the test log.".to_string(), 40_000),
        (
            "large",
            format!("Read this file: {}", "fn main() {} ".repeat(4_000)),
            1_200,
        ),
    ];
    for (_, text, prompt) in &bodies {
        h.fake.push(Reply::chat("Done.", *prompt, 10));
        let request = json!({"model": "roomy-1", "messages": [
            {"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": text},
        ]});
        let (status, _, _) = post(&url, KEY, &request).await;
        assert_eq!(status, 200);
    }
    h.wait_exchanges(3).await;
    assert!(
        within(h.state.background.drained(Duration::from_secs(10))).await,
        "the accounting thread ran every exchange's line"
    );
    let conversations: Vec<String> = support::column(
        &*h.sql(),
        "SELECT conversation_id FROM exchanges ORDER BY id",
    );
    assert_eq!(conversations.len(), 3);
    let tenants: Vec<String> =
        support::column(&*h.sql(), "SELECT tenant FROM exchanges ORDER BY id");
    let calibration = |i: usize| {
        h.state
            .compactions
            .calibration(&tenants[i], &conversations[i])
    };
    assert_eq!(calibration(0), 1.0, "{}: nothing estimated", bodies[0].0);
    assert_ne!(
        calibration(1),
        1.0,
        "{}: estimated and calibrated",
        bodies[1].0
    );
    assert_ne!(
        calibration(2),
        1.0,
        "{}: estimated and calibrated",
        bodies[2].0
    );
}
