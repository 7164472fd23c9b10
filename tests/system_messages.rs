//! System messages inside `messages` (Claude Code's 9 KB `role: "system"`
//! message at `messages[1]`: environment, deferred tools, agent types,
//! skills; a harness's reminders in a chat history) through compaction, on
//! real sockets: every request the upstream gets after a compaction holds
//! each of them as the client sent it (its cache breakpoint aside), in the
//! client's order, and the summary never lists their lines as the user's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::compaction::items::{is_summary, text_of};
use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::anthropic::{self, Answer};
use compactor::fake_upstream::{Received, Reply};
use serde_json::{json, Value};
use support::*;

const KEY: &str = "sk-ant-test-key-0003";

/// A request as Claude Code 2.1.332 sent it (trimmed: two tools' worth of
/// system prompt, no tools): a user message of reminders and the prompt,
/// then a 9 KB system message.
fn recorded() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/claude-code-mid-conversation-system.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A message without its `cache_control` members.
fn bare(m: &Value) -> Value {
    let mut m = m.clone();
    anthropic::strip_cache_control(&mut m);
    m
}

/// The system messages of a list, breakpoints aside, in order.
fn systems(msgs: &[Value]) -> Vec<Value> {
    msgs.iter()
        .filter(|m| m["role"] == "system")
        .map(bare)
        .collect()
}

async fn post(h: &Harness, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut req = client()
        .post(format!("{}{path}", h.url()))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body).unwrap());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = within(req.send()).await.expect("request");
    let status = resp.status().as_u16();
    let bytes = within(resp.bytes()).await.expect("body");
    let v =
        serde_json::from_slice(&bytes).unwrap_or_else(|_| json!(String::from_utf8_lossy(&bytes)));
    (status, v)
}

fn tiny(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "claude-tiny*".into(),
        context_window: 9000,
        max_output_tokens: Some(1024),
        trigger_ratio: None,
        ..Default::default()
    });
    c.compaction.background = false;
}

/// A 2.5 KB result of reading part `step` of a file.
fn read_result(step: usize) -> String {
    let mut out = String::new();
    for i in 0..60 {
        out.push_str(&format!("{:>5}\tdef part_{step}_fn_{i}(): return {i}\n", i));
    }
    out.truncate(2500);
    out
}

/// The upstream's client requests (the proxy's summary calls left out).
fn client_requests(h: &Harness) -> Vec<Received> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| !is_summary_call(r))
        .collect()
}

/// Claude Code's session with its mid-conversation system message, thinking
/// on, a `Read` loop past the window: once compacted, every request holds
/// the system message as sent, after the summary, and the summary's facts
/// do not list its lines as constraints the user stated.
#[tokio::test]
async fn claude_codes_mid_conversation_system_message_is_kept_verbatim_through_compaction() {
    let h = Harness::start_with(tiny).await;
    h.fake.set_messages_window(Some(9000));
    let start = recorded();
    let mut history: Vec<Value> = start["messages"].as_array().unwrap().clone();
    let want = systems(&history);
    assert_eq!(want.len(), 1);
    assert!(want[0].to_string().len() > 9_000);
    let headers = [
        ("x-api-key", KEY),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "mid-conversation-system-2026-04-07"),
    ];
    for step in 0..20 {
        h.fake.push(Reply::Messages(
            Answer::tool_use(
                &format!("toolu_{step:02}"),
                "Read",
                json!({"file_path": format!("big{}.py", step % 8 + 1)}),
            )
            .thinking(&format!("Read part {step}.")),
        ));
        let mut body = start.clone();
        body["messages"] = json!(history);
        let (status, answer) = post(&h, "/messages", &body, &headers).await;
        assert_eq!(status, 200, "step {step}: {answer}");
        history.push(json!({"role": "assistant", "content": answer["content"]}));
        history.push(json!({"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": format!("toolu_{step:02}"), "content": read_result(step)}]}));
    }
    assert!(compactions(&h) >= 1, "the session was compacted");
    let mut compacted = 0;
    for r in client_requests(&h) {
        let v = r.json();
        assert!(anthropic::check(&v, &r.headers, None).is_none(), "{v}");
        let msgs = v["messages"].as_array().unwrap();
        if !is_summary(&msgs[0]) {
            continue;
        }
        compacted += 1;
        assert_eq!(systems(msgs), want, "the system message went as sent");
        let summary = text_of(&msgs[0]);
        for line in [
            "Primary working directory",
            "Available agent types",
            "ToolSearch",
        ] {
            assert!(
                !summary.contains(line),
                "the summary reads the system message as the user's: {summary}"
            );
        }
    }
    assert!(compacted >= 2, "{compacted} compacted requests");
}

/// A chat history with a harness's reminder as a system message after the
/// task: compacted on the summary rung, the reminder goes as sent, in its
/// place among what is kept, and is not a constraint in the summary.
#[tokio::test]
async fn a_chat_historys_mid_conversation_system_message_is_kept_verbatim() {
    let h = Harness::start_with(small_window_foreground).await;
    let reminder = json!({"role": "system", "content": "Reminder from the harness: the repository is read-only.\nNever run git push."});
    let mut items = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Task: list the dead code in src/."}),
        reminder.clone(),
    ];
    for step in 0..12 {
        let id = format!("call_{step}");
        let body = json!({"model": "tiny-1", "messages": items});
        // The usage an upstream would report for the history as sent (about
        // four bytes a token): the proxy takes a reported size at its word,
        // so a fixed small figure would keep it from ever compacting.
        let prompt_tokens = serde_json::to_vec(&body).unwrap().len() as u64 / 4;
        h.fake.push(Reply::chat_tool_calls(
            &[(&id, "read", r#"{"path": "src/a.py"}"#)],
            prompt_tokens,
            10,
        ));
        let (status, answer) = post(
            &h,
            "/chat/completions",
            &body,
            &[("authorization", "Bearer sk-test-0003")],
        )
        .await;
        assert_eq!(status, 200, "step {step}: {answer}");
        items.push(answer["choices"][0]["message"].clone());
        items.push(json!({"role": "tool", "tool_call_id": id, "content": read_result(step)}));
    }
    assert!(compactions(&h) >= 1, "the history was compacted");
    let mut compacted = 0;
    for v in client_calls(&h) {
        let msgs = v["messages"].as_array().unwrap();
        let Some(s) = msgs.iter().position(is_summary) else {
            continue;
        };
        compacted += 1;
        assert_eq!(msgs[0], items[0], "the leading system message first");
        let kept: Vec<&Value> = msgs.iter().filter(|m| m["role"] == "system").collect();
        assert_eq!(kept, vec![&items[0], &reminder], "in the client's order");
        let at = msgs.iter().position(|m| *m == reminder).unwrap();
        assert!(at > s, "after the summary that stands for what came before");
        let summary = text_of(&msgs[s]);
        assert!(
            !summary.contains("Never run git push"),
            "the reminder is not the user's: {summary}"
        );
    }
    assert!(compacted >= 1, "{compacted} compacted requests");
}
